//! The PARSE engine: qwen2- and llama-family decoder models on the CPU with a packed-block forward (explicit
//! positions, compact attention mask, logits only at readout rows), per-request KV sessions that can be truncated,
//! a tokenizer built from GGUF metadata, sampling and streaming generation.
//!
//! Invariant: a token's logits are bitwise identical whether it is computed alone or inside any block (see
//! `quant` and `ops`); the exact limits of PARSE and lossless token-level speculation rest on it.

pub mod backend;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kernels;
pub mod load;
pub mod model;
pub mod ops;
pub mod quant;
pub mod sampling;
pub mod session;
pub mod tokenizer;
pub mod tp;

pub use engine::{Engine, EngineConfig};
pub use error::{Error, Result};
pub use generate::{FinishReason, GenerateRequest, Generation, GenerationStats, generate};
pub use load::LoadOptions;
pub use model::{Arch, KvCache, Logits, Model, ModelConfig};
pub use parse_core::mask::{self, BlockMask, MaskRow};
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::{ChatTemplate, Message, Tokenizer};
