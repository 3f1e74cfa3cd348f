//! How a reply is scored: HumanEval by running its tests, ASDiv by its first number.

use super::*;

/// The first ```python block of a reply, or the whole reply.
pub(super) fn code_of(reply: &str) -> String {
    if let Some(start) = reply.find("```") {
        let rest = &reply[start + 3..];
        let rest = rest.strip_prefix("python").unwrap_or(rest);
        let end = rest.find("```").unwrap_or(rest.len());
        return rest[..end].to_string();
    }
    reply.to_string()
}

pub(super) fn humaneval_pass(rec: &Value, reply: &str, timeout: u64) -> Result<bool> {
    let program = format!(
        "{}\n{}\n\n{}\ncheck({})\n",
        rec["prompt"].as_str().unwrap_or_default(),
        code_of(reply),
        rec["test"].as_str().unwrap_or_default(),
        rec["entry_point"].as_str().unwrap_or_default()
    );
    let mut child = Command::new("timeout")
        .arg(timeout.to_string())
        .args(["python3", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("running python3")?;
    child
        .stdin
        .take()
        .context("python3 stdin")?
        .write_all(program.as_bytes())?;
    Ok(child.wait()?.success())
}

pub(super) fn numbers(text: &str) -> Vec<f64> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() || (c == '.' && !cur.is_empty()) || (c == '-' && cur.is_empty()) {
            cur.push(c);
        } else if c == ',' && !cur.is_empty() {
            continue;
        } else {
            if let Ok(v) = cur.trim_end_matches('.').parse::<f64>() {
                out.push(v);
            }
            cur.clear();
        }
    }
    out
}

pub(super) fn asdiv_correct(rec: &Value, reply: &str) -> bool {
    let Some(want) = numbers(rec["answer"].as_str().unwrap_or_default())
        .first()
        .copied()
    else {
        return false;
    };
    let tail = reply.rsplit_once("Answer:").map_or(reply, |(_, t)| t);
    let got = numbers(tail);
    let pick = if reply.contains("Answer:") {
        got.first()
    } else {
        got.last()
    };
    pick.is_some_and(|g| (g - want).abs() < 1e-6 * want.abs().max(1.0))
}
