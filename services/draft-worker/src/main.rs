//! `parse-draft-worker --model FILE [--listen ADDR]`: serves a draft model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use parse_discovery::{Role, model_name};
use parse_draft_worker::Worker as _;
use parse_draft_worker::{DraftWorker, DraftWorkerConfig, serve_reporting};
use parse_engine::Engine;
use parse_worker::args::WorkerArgs;

#[derive(Parser)]
#[command(
    version,
    about = "PARSE draft worker: a draft model behind parse.v1.Drafter"
)]
struct Args {
    /// The draft model (GGUF, or a directory with safetensors and config.json).
    #[arg(long, env = parse_core::env::DRAFT_MODEL)]
    model: PathBuf,
    #[arg(long, env = parse_core::env::DRAFT_LISTEN, default_value = "127.0.0.1:50061")]
    listen: SocketAddr,
    /// Address of the Prometheus metrics endpoint (GET /metrics); none: no metrics listener.
    #[arg(long, env = parse_core::env::DRAFT_METRICS_LISTEN)]
    metrics_listen: Option<SocketAddr>,
    /// Drafts streaming at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 64)]
    max_streams: usize,
    /// Read the model's output head as stored (by default a head stored in more bits than Q5_0 is re-quantized
    /// to Q5_0 at load, `LoadOptions::draft`: faster steps and less memory at the same greedy agreement with the
    /// target). The `draft` mode's output (the draft's own answer) follows the head this worker loads.
    #[arg(long)]
    stored_head: bool,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when this guard drops).
    let _telemetry = parse_proto::telemetry::init("parse-draft-worker")
        .map_err(|e| anyhow::anyhow!("telemetry: {e}"))?;
    let args = Args::parse();
    let w = &args.worker;
    let security = w.security.load()?;
    w.discovery.etcd_auth.install()?;
    let mut cfg = w.engine_config(&args.model)?;
    if !args.stored_head {
        cfg.load = parse_engine::LoadOptions::draft();
    }
    tracing::info!(compute = %cfg.compute, "loading the model");
    let engine = tokio::task::spawn_blocking(move || Engine::load(&cfg)).await??;
    let engine_stop = tokio_util::sync::CancellationToken::new();
    let worker = DraftWorker::new(
        engine,
        DraftWorkerConfig {
            max_streams: args.max_streams,
            session_ttl: Duration::from_secs(w.session_ttl_s),
            max_sessions: w.max_sessions.max(1),
            step_rows: w.step_rows as usize,
            charge: w.charge,
            security,
            ..Default::default()
        },
        engine_stop.clone(),
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    let (listener, addr) = parse_proto::serve::bind(args.listen).await?;
    tracing::info!(%addr, model = %args.model.display(), "draft worker serving");
    let metrics = parse_worker::spawn_metrics(worker.metrics(), args.metrics_listen).await?;
    let registration = w.discovery.announce().register(
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
    let until = worker.until_drained(registration);
    let served = serve_reporting(worker, listener, until, ready).await;
    engine_stop.cancel();
    if let Some(m) = metrics {
        m.abort();
    }
    served
}
