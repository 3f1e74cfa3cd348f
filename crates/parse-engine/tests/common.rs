//! Shared helpers of the engine's integration tests: where the default models and the shared data are.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use parse_engine::ops::RopeStyle;
use parse_engine::{Arch, Engine, EngineConfig, ModelConfig};

pub const TARGET_FILE: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const DRAFT_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

pub fn model_dir() -> PathBuf {
    match std::env::var_os(parse_core::env::MODEL_DIR) {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
            .join(".cache/parse/models"),
    }
}

/// Path of a default model; fails the test with instructions when it has not been fetched.
pub fn model_path(file: &str) -> PathBuf {
    let p = model_dir().join(file);
    assert!(
        p.exists(),
        "{} is missing: run deploy/models/fetch.py (or set PARSE_MODEL_DIR) before the tests",
        p.display()
    );
    p
}

/// The reference Qwen2.5 tokenizer kept in the repository (`assets/tokenizer`).
pub fn tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/qwen2.5-tokenizer.json")
}

/// The development prompts fetched by `deploy/eval/fetch.py`: `$PARSE_EVAL_DIR`, else `~/.cache/parse/eval`.
pub fn eval_path(file: &str) -> PathBuf {
    let dir = match std::env::var_os(parse_core::env::EVAL_DIR) {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/parse/eval")
        }
    };
    let p = dir.join(file);
    assert!(
        p.exists(),
        "{} is missing: run deploy/eval/fetch.py (or set PARSE_EVAL_DIR) before the tests",
        p.display()
    );
    p
}

fn load(file: &str) -> Mutex<Engine> {
    Mutex::new(Engine::load(&EngineConfig::new(model_path(file))).expect("default model loads"))
}

/// The default target, loaded once per test binary.
pub fn target() -> &'static Mutex<Engine> {
    static E: OnceLock<Mutex<Engine>> = OnceLock::new();
    E.get_or_init(|| load(TARGET_FILE))
}

/// The default draft, loaded once per test binary.
pub fn draft() -> &'static Mutex<Engine> {
    static E: OnceLock<Mutex<Engine>> = OnceLock::new();
    E.get_or_init(|| load(DRAFT_FILE))
}

/// Prompts used by the real-model tests.
pub const PROMPTS: [&str; 5] = [
    "Write a Python function that checks whether a string is a palindrome.",
    "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep does he have?",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning, my friend' into French and Spanish.",
];

/// A tiny configuration whose matrices divide into 256-wide K-quant blocks (every weight format fits), with the
/// rotary pairing each architecture's GGUF files use.
pub fn tiny_k(arch: Arch, max_context: usize) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 512,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_style: match arch {
            Arch::Qwen2 => RopeStyle::Neox,
            Arch::Llama => RopeStyle::Interleaved,
        },
        max_context,
    }
}
