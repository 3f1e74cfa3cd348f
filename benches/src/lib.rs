//! Shared pieces of the benchmark binaries.

use std::path::PathBuf;

pub mod plot;

/// The model cache directory: `$PARSE_MODEL_DIR`, else `~/.cache/parse/models`.
pub fn model_dir() -> PathBuf {
    match std::env::var_os("PARSE_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/parse/models")
        }
    }
}

/// The prompts of the first `n` HumanEval development records (`shared/eval/humaneval-dev.jsonl`).
pub fn humaneval_prompts(n: usize) -> anyhow::Result<Vec<String>> {
    use anyhow::Context;
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/eval/humaneval-dev.jsonl");
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
