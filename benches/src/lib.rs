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
