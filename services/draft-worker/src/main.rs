//! `parse-draft-worker --model FILE [--listen ADDR]`: serves a draft model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use parse_discovery::{AnnounceArgs, Role, model_name};
use parse_draft_worker::{DraftWorker, DraftWorkerConfig, serve_reporting};
use parse_engine::{Engine, EngineConfig};

#[derive(Parser)]
#[command(
    version,
    about = "PARSE draft worker: a draft model behind parse.v1.Drafter"
)]
struct Args {
    /// The draft model (GGUF, or a directory with safetensors and config.json).
    #[arg(long, env = "PARSE_DRAFT_MODEL")]
    model: PathBuf,
    /// A tokenizer.json to use instead of the model's own.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, env = "PARSE_DRAFT_LISTEN", default_value = "127.0.0.1:50061")]
    listen: SocketAddr,
    /// Address of the Prometheus metrics endpoint (GET /metrics); none: no metrics listener.
    #[arg(long, env = "PARSE_DRAFT_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Drafts streaming at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 64)]
    max_streams: usize,
    /// Sessions open at once; a new one beyond it is RESOURCE_EXHAUSTED (the router moves the request to another
    /// worker).
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Rows one packed forward pass holds at most: the steps of every running request share one pass (continuous
    /// batching), and a prompt's prefill is cut to the room they leave. 0 is refused.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=65536))]
    step_rows: u64,
    /// How a packed pass's time is split among the requests in it, which the router's pacing weighs at loads
    /// above one request: `marginal` (the default: the pass's fixed part in equal shares, each row at what a row
    /// adds, by a line fitted to recent passes) or `rows` (each request its rows' share).
    #[arg(long, env = "PARSE_CHARGE", default_value = "marginal")]
    charge: parse_worker::scheduler::Charge,
    /// Seconds before an idle session is released.
    #[arg(long, default_value_t = 300)]
    session_ttl_s: u64,
    /// The most of the KV cache budget one session (request) may hold, as a share of it (0 < share <= 1); beyond it
    /// the request gets RESOURCE_EXHAUSTED rather than starving the others.
    #[arg(long, default_value_t = 0.5)]
    kv_session_share: f64,
    /// KV cache budget in MiB.
    #[arg(long, default_value_t = 4096)]
    kv_mib: usize,
    /// MiB of prompts' keys and values kept for later requests that begin the same way (a system prompt, an
    /// instruction, a document asked about again): those requests take them instead of computing them, the same
    /// bits, in their `cache_salt` namespace. 0 keeps none.
    #[arg(long, env = "PARSE_PREFIX_CACHE_MIB", default_value_t = 256)]
    prefix_cache_mib: usize,
    /// Read the model's output head as stored (by default a head stored in more bits than Q5_0 is re-quantized
    /// to Q5_0 at load, `LoadOptions::draft`: the default draft's steps about 3% faster, 49 MiB less memory, the
    /// same greedy agreement with the target; docs/figures.md, "A draft head in Q5_0; one request measures a fresh
    /// load"). The `draft` mode's output (the draft's own answer) follows the head this worker loads.
    #[arg(long)]
    stored_head: bool,
    #[command(flatten)]
    compute: parse_engine::ComputeArgs,
    #[command(flatten)]
    discovery: AnnounceArgs,
    #[command(flatten)]
    security: parse_proto::security::SecurityArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when this guard drops).
    let _telemetry = parse_proto::telemetry::init("parse-draft-worker")
        .map_err(|e| anyhow::anyhow!("telemetry: {e}"))?;
    let args = Args::parse();
    let security = args.security.load()?;
    args.discovery.etcd_auth.install()?;
    let mut cfg = EngineConfig::new(&args.model);
    if !args.stored_head {
        cfg.load = parse_engine::LoadOptions::draft();
    }
    cfg.tokenizer = args.tokenizer.clone();
    cfg.kv_capacity_bytes = args.kv_mib << 20;
    cfg.kv_session_share = args.kv_session_share;
    cfg.prefix_cache_bytes = args.prefix_cache_mib.saturating_mul(1 << 20);
    cfg.compute = args.compute.compute()?;
    tracing::info!(compute = %cfg.compute, "loading the model");
    let engine = tokio::task::spawn_blocking(move || Engine::load(&cfg)).await??;
    let engine_stop = tokio_util::sync::CancellationToken::new();
    let worker = DraftWorker::new(
        engine,
        DraftWorkerConfig {
            max_streams: args.max_streams,
            session_ttl: Duration::from_secs(args.session_ttl_s),
            max_sessions: args.max_sessions.max(1),
            step_rows: args.step_rows as usize,
            charge: args.charge,
            security,
            ..Default::default()
        },
        engine_stop.clone(),
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    let (listener, addr) = parse_proto::serve::bind(args.listen).await?;
    tracing::info!(%addr, model = %args.model.display(), "draft worker serving");
    let metrics = parse_worker::spawn_metrics(worker.metrics(), args.metrics_listen).await?;
    let registration = args.discovery.announce().register(
        Role::Draft,
        addr,
        &model_name(&args.model),
        1,
        args.max_streams as u32,
    )?;
    let ready = match &registration {
        Some(r) => r.ready(),
        None => tokio::sync::watch::channel(true).1,
    };
    // Until a signal, or a drain that has finished its sessions; deregistered either way.
    let w = worker.clone();
    let until = async move {
        w.drain()
            .serve_until(
                registration,
                || w.open_sessions() == 0,
                parse_proto::serve::shutdown_signal(),
            )
            .await
    };
    let served = serve_reporting(worker, listener, until, ready).await;
    engine_stop.cancel();
    if let Some(m) = metrics {
        m.abort();
    }
    served
}
