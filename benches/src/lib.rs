//! Shared pieces of the benchmark binaries.

use std::path::PathBuf;

pub mod plot;

/// The model cache directory: `$PARSE_MODEL_DIR`, else `~/.cache/parse/models`.
pub fn model_dir() -> PathBuf {
    match std::env::var_os(parse_core::env::MODEL_DIR) {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/parse/models")
        }
    }
}

/// The development prompts' cache (`deploy/eval/fetch.py` fills it): `$PARSE_EVAL_DIR`, else `~/.cache/parse/eval`.
pub fn eval_dir() -> PathBuf {
    match std::env::var_os(parse_core::env::EVAL_DIR) {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/parse/eval")
        }
    }
}

/// A suite's development prompts (`<suite>-dev.jsonl` in [`eval_dir`]); the error says how to fetch them.
pub fn eval_file(suite: &str) -> anyhow::Result<PathBuf> {
    let path = eval_dir().join(format!("{suite}-dev.jsonl"));
    if !path.exists() {
        anyhow::bail!(
            "{} is missing: run deploy/eval/fetch.py (or set PARSE_EVAL_DIR)",
            path.display()
        );
    }
    Ok(path)
}

/// The reference Qwen2.5 tokenizer kept in the repository (`assets/tokenizer`).
pub fn reference_tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/tokenizer/qwen2.5-tokenizer.json")
}

/// The prompts of the first `n` HumanEval development records.
pub fn humaneval_prompts(n: usize) -> anyhow::Result<Vec<String>> {
    use anyhow::Context;
    let path = eval_file("humaneval")?;
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    text.lines()
        .take(n)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            Ok(v["prompt"]
                .as_str()
                .context("record without a prompt")?
                .to_string())
        })
        .collect()
}

/// One `GET /metrics` over plain HTTP/1.0 to `addr` (`host:port`); the body, or an error that names the address.
pub fn scrape_metrics(addr: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    use std::io::{Read, Write};
    let timeout = std::time::Duration::from_secs(10);
    let sock: std::net::SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .with_context(|| format!("metrics address {addr}"))?
        .next()
        .with_context(|| format!("metrics address {addr} resolves to nothing"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, timeout)
        .with_context(|| format!("GET http://{addr}/metrics"))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)
        .with_context(|| format!("GET http://{addr}/metrics"))?;
    let (head, body) = buf
        .split_once("\r\n\r\n")
        .with_context(|| format!("http://{addr}/metrics: no HTTP reply"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        anyhow::bail!(
            "http://{addr}/metrics answered {}",
            head.lines().next().unwrap_or_default()
        );
    }
    Ok(body.to_string())
}

/// The value of the unlabelled series `name` in a Prometheus text exposition.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Median of a non-empty sample.
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_is_read_by_its_exact_name() {
        let text = "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n\
                    # TYPE process_cpu_seconds_total counter\n\
                    process_cpu_seconds_total_other 9\n\
                    process_cpu_seconds_total 12.34\n";
        assert_eq!(metric_value(text, "process_cpu_seconds_total"), Some(12.34));
        assert_eq!(metric_value(text, "process_cpu_seconds"), None);
        assert_eq!(metric_value("", "process_cpu_seconds_total"), None);
    }

    #[test]
    fn a_scrape_reads_the_body_and_refuses_other_answers() {
        let serve = |reply: &'static str| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap().to_string();
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let (mut s, _) = l.accept().unwrap();
                let mut req = [0u8; 256];
                let _ = s.read(&mut req).unwrap();
                s.write_all(reply.as_bytes()).unwrap();
            });
            addr
        };
        let ok = serve(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nprocess_cpu_seconds_total 3.5\n",
        );
        let body = scrape_metrics(&ok).unwrap();
        assert_eq!(metric_value(&body, "process_cpu_seconds_total"), Some(3.5));
        let missing = serve("HTTP/1.1 404 Not Found\r\n\r\n");
        let e = scrape_metrics(&missing).unwrap_err().to_string();
        assert!(e.contains("404"), "{e}");
    }
}
