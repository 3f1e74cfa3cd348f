//! The engine's second model implementation: the same decoder on candle tensors, on the CPU or on a CUDA device.
//!
//! It keeps the kernel model's contract (`forward(session, tokens, positions, mask, readout)` with a compact mask
//! over `[cache | block]`, logits only at readout rows, caches unchanged on error) and its sessions, so every
//! backend and worker drives either. Where the kernel model is bitwise batch-invariant by construction, this one is
//! as exact as candle's kernels are: on the CPU its logits agree with the kernel model's within a tolerance the
//! tests state (`tests/candle_model.rs`), and greedy outputs of the shipped pair are the same.
//!
//! Layout follows candle-transformers: [`config`] (where and how to compute), [`cache`] (the KV cache of
//! pooled tensors of all sessions), [`layer`] (one transformer block), [`model`] (embedding, layers, readout).

pub mod cache;
pub mod config;
pub mod layer;
pub mod model;

pub use cache::{KvPool, TensorCache};
#[cfg(feature = "clap")]
pub use config::ComputeArgs;
pub use config::{Backend, Compute, DeviceSpec};
pub use model::CandleModel;
