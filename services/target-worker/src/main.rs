//! `parse-target-worker --model FILE [--listen ADDR] [--tp N --rank R --tp-addrs A0,A1,...]`: serves a target
//! model, alone or as one rank of a tensor-parallel group over TCP.
//!
//! Rank 0 (the leader) serves `parse.v1.Verifier` on `--listen`; the other ranks (followers) take their work from
//! the leader and serve only `grpc.health.v1` there. Every rank loads the whole model file and keeps its shard.
//! `--tp-addrs` lists each rank's group address in rank order (the ring of persistent TCP connections); every rank
//! gets the same list.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use parse_comm::{Comm, TcpComm, TcpConfig};
use parse_discovery::{Role, model_name};
use parse_engine::Engine;
use parse_engine::tp::{Layout, Member};
use parse_target_worker::Worker as _;
use parse_target_worker::{TargetEngine, TargetWorker, TargetWorkerConfig, serve};
use parse_worker::args::WorkerArgs;

#[derive(Parser)]
#[command(
    version,
    about = "PARSE target worker: a target model behind parse.v1.Verifier"
)]
struct Args {
    /// The target model (GGUF, or a directory with safetensors and config.json).
    #[arg(long, env = parse_core::env::TARGET_MODEL)]
    model: PathBuf,
    #[arg(long, env = parse_core::env::TARGET_LISTEN, default_value = "127.0.0.1:50071")]
    listen: SocketAddr,
    /// Address of the Prometheus metrics endpoint (GET /metrics); none: no metrics listener.
    #[arg(long, env = parse_core::env::TARGET_METRICS_LISTEN)]
    metrics_listen: Option<SocketAddr>,
    /// Calls running or waiting at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    #[command(flatten)]
    worker: WorkerArgs,
    /// Ranks of the tensor-parallel group.
    #[arg(long, env = parse_core::env::TP, default_value_t = 1)]
    tp: usize,
    /// This process's rank (0 serves gRPC).
    #[arg(long, env = parse_core::env::TP_RANK, default_value_t = 0)]
    rank: usize,
    /// Every rank's group address (host:port), in rank order, comma-separated (static rendezvous).
    #[arg(long, env = parse_core::env::TP_ADDRS, value_delimiter = ',')]
    tp_addrs: Vec<String>,
    /// Rendezvous through etcd instead (with --etcd): the group's name, shared by its ranks.
    #[arg(long, env = parse_core::env::TP_GROUP)]
    tp_group: Option<String>,
    /// With --tp-group: this rank's group address (host:port, reachable by the other ranks), published in etcd.
    #[arg(long, env = parse_core::env::TP_LISTEN)]
    tp_listen: Option<String>,
    /// Seconds one collective may wait for a peer before the group counts as broken.
    #[arg(long, default_value_t = 10)]
    tp_timeout_s: u64,
    /// How o and down are split: `exact` (outputs bitwise equal to one process) or `megatron` (row-parallel with
    /// an all-reduce: fewer collectives, results within rounding; see parse_engine::tp).
    #[arg(long, env = parse_core::env::TP_LAYOUT, default_value = "exact")]
    tp_layout: String,
    /// Collectives over `tcp` (any host, CPU) or `nccl` (GPUs; a build with the `nccl` feature). With NCCL the
    /// TCP group still forms first, to hand rank 0's NCCL unique id to the others.
    #[arg(long, env = parse_core::env::TP_BACKEND, default_value = "tcp")]
    tp_backend: String,
    /// CUDA device of this rank for NCCL (default: the rank).
    #[arg(long)]
    cuda_device: Option<usize>,
    /// Seconds to wait for the other ranks to come up.
    #[arg(long, default_value_t = 300)]
    tp_rendezvous_s: u64,
}

fn check(args: &Args) -> anyhow::Result<()> {
    if args.tp == 0 {
        anyhow::bail!("--tp must be at least 1");
    }
    if args.rank >= args.tp {
        anyhow::bail!(
            "--rank {} is outside a group of --tp {}",
            args.rank,
            args.tp
        );
    }
    if !matches!(args.tp_backend.as_str(), "tcp" | "nccl") {
        anyhow::bail!(
            "--tp-backend must be tcp or nccl, got `{}`",
            args.tp_backend
        );
    }
    if args.tp > 1 && !args.worker.compute.compute()?.is_kernels() {
        anyhow::bail!(
            "--tp {} runs on the kernels backend (the candle backend runs a whole model on one device): drop \
             --backend candle / --device cuda:N, or use --tp 1",
            args.tp
        );
    }
    if args.tp_backend == "nccl" && !cfg!(feature = "nccl") {
        anyhow::bail!(
            "--tp-backend nccl needs a build with the `nccl` feature (cargo build --features nccl)"
        );
    }
    let via_etcd = args.tp_group.is_some();
    if via_etcd
        && (args.worker.discovery.etcd.is_empty()
            || args.tp_listen.is_none()
            || !args.tp_addrs.is_empty())
    {
        anyhow::bail!("--tp-group needs --etcd and --tp-listen, and no --tp-addrs");
    }
    if args.tp > 1 && !via_etcd && args.tp_addrs.len() != args.tp {
        anyhow::bail!(
            "--tp {} needs --tp-addrs with {} addresses (one per rank, in rank order), got {}, or --tp-group \
             with --etcd",
            args.tp,
            args.tp,
            args.tp_addrs.len()
        );
    }
    Ok(())
}

/// Forms the NCCL communicator: rank 0 makes the unique id and sends it over the TCP group.
#[cfg(feature = "nccl")]
fn nccl_group(tcp: TcpComm, device: usize, timeout: Duration) -> anyhow::Result<Arc<dyn Comm>> {
    let mut id = if tcp.rank() == 0 {
        parse_comm::nccl_unique_id()?.to_vec()
    } else {
        Vec::new()
    };
    tcp.broadcast(&mut id, 0)?;
    let id: [u8; 128] = id
        .try_into()
        .map_err(|_| anyhow::anyhow!("rank 0 sent an NCCL id of the wrong size"))?;
    let comm = parse_comm::NcclComm::new(tcp.rank(), tcp.world_size(), device, id, timeout)?;
    tracing::info!(rank = tcp.rank(), device, "NCCL communicator formed");
    Ok(Arc::new(comm))
}

#[cfg(not(feature = "nccl"))]
fn nccl_group(_: TcpComm, _: usize, _: Duration) -> anyhow::Result<Arc<dyn Comm>> {
    anyhow::bail!("this build has no NCCL backend (feature `nccl`)")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when this guard drops).
    let _telemetry = parse_proto::telemetry::init("parse-target-worker")
        .map_err(|e| anyhow::anyhow!("telemetry: {e}"))?;
    let args = Args::parse();
    check(&args)?;
    let security = args.worker.security.load()?;
    args.worker.discovery.etcd_auth.install()?;
    let layout: Layout = args.tp_layout.parse()?;
    let cfg = args.worker.engine_config(&args.model)?;
    tracing::info!(compute = %cfg.compute, "loading the model");
    let engine = tokio::task::spawn_blocking(move || Engine::load(&cfg)).await??;
    let member = if args.tp > 1 {
        let addrs = match (&args.tp_group, &args.tp_listen) {
            (Some(group), Some(listen)) => {
                tracing::info!(
                    group,
                    rank = args.rank,
                    "tensor-parallel rendezvous through etcd"
                );
                parse_discovery::rendezvous(
                    &args.worker.discovery.etcd,
                    group,
                    args.rank,
                    args.tp,
                    listen,
                    Duration::from_secs(30),
                    Duration::from_secs(args.tp_rendezvous_s),
                )
                .await?
            }
            _ => args.tp_addrs.clone(),
        };
        let mut tcp = TcpConfig::new(args.rank, addrs);
        tcp.secret = security.token().map(|t| t.as_bytes().to_vec());
        tcp.op_timeout = Duration::from_secs(args.tp_timeout_s.max(1));
        tcp.rendezvous_timeout = Duration::from_secs(args.tp_rendezvous_s);
        tracing::info!(
            rank = args.rank,
            tp = args.tp,
            "joining the tensor-parallel group"
        );
        let tcp = tokio::task::spawn_blocking(move || TcpComm::connect(&tcp)).await??;
        let comm: Arc<dyn Comm> = if args.tp_backend == "nccl" {
            let device = args.cuda_device.unwrap_or(args.rank);
            let timeout = Duration::from_secs(args.tp_timeout_s.max(1));
            tokio::task::spawn_blocking(move || nccl_group(tcp, device, timeout)).await??
        } else {
            Arc::new(tcp)
        };
        tokio::task::spawn_blocking(move || parse_engine::tp::join(engine, comm, layout)).await??
    } else {
        Member::Alone(engine)
    };
    let (listener, addr) = parse_proto::serve::bind(args.listen).await?;
    let engine: TargetEngine = match member {
        Member::Alone(e) => Box::new(e),
        Member::Leader(l) => Box::new(l),
        Member::Follower(follower) => {
            tracing::info!(%addr, rank = args.rank, "tensor-parallel follower (health only on this address)");
            // A follower's work shows in its leader's metrics; it answers scrapes (of its own only its process's
            // CPU time, `process_cpu_seconds_total`) so that a Pod template shared by every rank does not leave down
            // targets.
            let metrics = parse_worker::spawn_metrics(
                Arc::new(parse_worker::WorkerMetrics::new()),
                args.metrics_listen,
            )
            .await?;
            let (ready, watch) = tokio::sync::watch::channel(true);
            let health = tokio::spawn(parse_proto::serve::run_health_only(
                listener,
                parse_proto::serve::shutdown_signal(),
                watch,
                parse_proto::serve::Access::worker(&security),
            ));
            let followed = tokio::task::spawn_blocking(move || follower.follow()).await?;
            ready.send_replace(false);
            health.abort();
            if let Some(m) = metrics {
                m.abort();
            }
            return match followed {
                Ok(()) => {
                    tracing::info!("the leader stopped the group");
                    Ok(())
                }
                Err(e) => Err(anyhow::anyhow!("leaving the tensor-parallel group: {e}")),
            };
        }
    };
    // The engine's scheduler outlives the server: after the last call, the leader still tells its followers to stop.
    let engine_stop = tokio_util::sync::CancellationToken::new();
    let worker = TargetWorker::new(
        engine,
        TargetWorkerConfig {
            max_queue: args.max_queue,
            session_ttl: Duration::from_secs(args.worker.session_ttl_s),
            max_sessions: args.worker.max_sessions.max(1),
            step_rows: args.worker.step_rows as usize,
            charge: args.worker.charge,
            security: security.clone(),
            ..Default::default()
        },
        engine_stop.clone(),
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    tracing::info!(%addr, model = %args.model.display(), tp = args.tp, "target worker serving");
    let metrics = parse_worker::spawn_metrics(worker.metrics(), args.metrics_listen).await?;
    // Only the leader of a group registers: it is the group's one address.
    let registration = args.worker.discovery.announce().register(
        Role::Target,
        addr,
        &model_name(&args.model),
        args.tp as u32,
        args.max_queue as u32,
    )?;
    if let Some(r) = &registration {
        worker.follow_registration(r.ready());
    }
    let until = worker.until_drained(registration);
    let served = serve(worker, listener, until).await;
    engine_stop.cancel();
    if let Some(m) = metrics {
        m.abort();
    }
    served
}
