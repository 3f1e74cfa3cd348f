//! The PARSE engine: qwen2- and llama-family decoder models on the CPU with a packed-block forward (explicit
//! positions, compact attention mask, logits only at readout rows), per-request KV sessions that can be truncated,
//! a tokenizer built from GGUF metadata, sampling and streaming generation.
//!
//! Invariant: a token's logits are bitwise identical whether it is computed alone or inside any block (see
//! `quant` and `ops`); the exact limits of PARSE and lossless token-level speculation rest on it.

pub mod alloc;
pub mod any_model;
mod block;
pub mod candle;
pub mod drafter_verifier;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kernels;
mod layout;
pub mod load;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod quant;
pub mod sampling;
pub mod session;
pub mod steps;
pub use parse_text::tokenizer;
pub mod tp;
pub mod vexp;

pub use any_model::{Net, SessionCache};
#[cfg(feature = "clap")]
pub use candle::ComputeArgs;
pub use candle::{Backend, CandleModel, Compute, DeviceSpec};
pub use engine::{Block, Engine, EngineConfig, EngineOps};
pub use error::{Error, Result};
pub use generate::{PlainOutput, PlainRequest, PlainStats, generate_plain};
pub use load::LoadOptions;
pub use model::{Arch, KvCache, Logits, Model, ModelConfig};
pub use parse_core::FinishReason;
pub use parse_core::mask::{self, BlockMask, MaskRow};
pub use parse_text::{ChatRole, ChatTemplate, Message, Tokenizer};
pub use sampling::{Sampler, SamplingParams};
