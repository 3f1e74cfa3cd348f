//! The command-line flags both workers share: one flattened group, so the draft and target workers take the same
//! names, defaults and environment variables for what they have in common.

use std::path::{Path, PathBuf};

use parse_discovery::AnnounceArgs;
use parse_engine::EngineConfig;

use crate::scheduler::Charge;

/// Rows per packed pass by default: eight sessions' verification blocks of up to 16 rows, or a 128-token prefill
/// chunk; a token costs about the same in a 64- or a 128-row block, and a larger step would hold decode steps of
/// the other sessions longer behind a long prompt.
pub const DEFAULT_STEP_ROWS: usize = 128;

#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// A tokenizer.json to use instead of the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Sessions open at once; a new one beyond it is RESOURCE_EXHAUSTED (the router moves the request to another
    /// worker).
    #[arg(long, default_value_t = 256)]
    pub max_sessions: usize,
    /// Rows one packed forward pass holds at most: the steps of every running request share one pass (continuous
    /// batching), and a prompt's prefill is cut to the room they leave. 0 is refused.
    #[arg(long, default_value_t = DEFAULT_STEP_ROWS as u64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub step_rows: u64,
    /// How a packed pass's time is split among the requests in it, which the router's pacing weighs at loads
    /// above one request: `marginal` (the default: the pass's fixed part in equal shares, each row at what a row
    /// adds, by a line fitted to recent passes) or `rows` (each request its rows' share).
    #[arg(long, env = parse_core::env::CHARGE, default_value = "marginal")]
    pub charge: Charge,
    /// Seconds before an idle session is released.
    #[arg(long, default_value_t = 300)]
    pub session_ttl_s: u64,
    /// The most of the KV cache budget one session (request) may hold, as a share of it (0 < share <= 1); beyond it
    /// the request gets RESOURCE_EXHAUSTED rather than starving the others.
    #[arg(long, default_value_t = 0.5)]
    pub kv_session_share: f64,
    /// KV cache budget in MiB (per rank in a tensor-parallel target group: each holds its share of the KV heads).
    #[arg(long, default_value_t = 4096)]
    pub kv_mib: usize,
    /// MiB of prompts' keys and values kept for later requests that begin the same way (a system prompt, an
    /// instruction, a document asked about again): those requests take them instead of computing them, the same
    /// bits, in their `cache_salt` namespace (in a tensor-parallel target group on rank 0 alone: the group reuses
    /// none, its ranks' caches are not copied). 0 keeps none.
    #[arg(long, env = parse_core::env::PREFIX_CACHE_MIB, default_value_t = 256)]
    pub prefix_cache_mib: usize,
    #[command(flatten)]
    pub compute: parse_engine::ComputeArgs,
    #[command(flatten)]
    pub discovery: AnnounceArgs,
    #[command(flatten)]
    pub security: parse_proto::security::SecurityArgs,
}

impl WorkerArgs {
    /// The engine configuration for `model` with these flags (KV budget and share, prefix cache, tokenizer, where
    /// it computes).
    pub fn engine_config(&self, model: &Path) -> parse_engine::Result<EngineConfig> {
        let mut cfg = EngineConfig::new(model);
        cfg.tokenizer = self.tokenizer.clone();
        cfg.kv_capacity_bytes = self.kv_mib << 20;
        cfg.kv_session_share = self.kv_session_share;
        cfg.prefix_cache_bytes = self.prefix_cache_mib.saturating_mul(1 << 20);
        cfg.compute = self.compute.compute()?;
        Ok(cfg)
    }
}
