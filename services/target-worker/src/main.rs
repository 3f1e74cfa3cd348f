//! `parse-target-worker --model FILE [--listen ADDR]`: serves a target model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use parse_engine::{Engine, EngineConfig};
use parse_target_worker::{TargetWorker, TargetWorkerConfig, serve};

#[derive(Parser)]
#[command(
    version,
    about = "PARSE target worker: a target model behind parse.v1.Verifier"
)]
struct Args {
    /// The target model (GGUF, or a directory with safetensors and config.json).
    #[arg(long, env = "PARSE_TARGET_MODEL")]
    model: PathBuf,
    /// A tokenizer.json to use instead of the model's own.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, env = "PARSE_TARGET_LISTEN", default_value = "127.0.0.1:50071")]
    listen: SocketAddr,
    /// Calls running or waiting at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Seconds before an idle session is released.
    #[arg(long, default_value_t = 300)]
    session_ttl_s: u64,
    /// KV cache budget in MiB.
    #[arg(long, default_value_t = 4096)]
    kv_mib: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let mut cfg = EngineConfig::new(&args.model);
    cfg.tokenizer = args.tokenizer.clone();
    cfg.kv_capacity_bytes = args.kv_mib << 20;
    let engine = tokio::task::spawn_blocking(move || Engine::load(&cfg)).await??;
    let worker = TargetWorker::new(
        engine,
        TargetWorkerConfig {
            max_queue: args.max_queue,
            session_ttl: Duration::from_secs(args.session_ttl_s),
            ..Default::default()
        },
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    let (listener, addr) = parse_proto::serve::bind(args.listen).await?;
    tracing::info!(%addr, model = %args.model.display(), "target worker serving");
    serve(worker, listener, parse_proto::serve::shutdown_signal()).await
}
