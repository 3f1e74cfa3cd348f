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
use parse_discovery::{AnnounceArgs, Role, model_name};
use parse_engine::tp::{Layout, Member};
use parse_engine::{Engine, EngineConfig};
use parse_target_worker::{TargetEngine, TargetWorker, TargetWorkerConfig, serve};

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
    /// Address of the Prometheus metrics endpoint (GET /metrics); none: no metrics listener.
    #[arg(long, env = "PARSE_TARGET_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Calls running or waiting at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Sessions open at once; a new one beyond it is RESOURCE_EXHAUSTED (the router moves the request to another
    /// worker).
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Rows one packed forward pass holds at most: the steps of every running request share one pass (continuous
    /// batching), and a prompt's prefill is cut to the room they leave. 0 is refused.
    #[arg(long, default_value_t = parse_target_worker::DEFAULT_STEP_ROWS as u64, value_parser = clap::value_parser!(u64).range(1..=65536))]
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
    /// KV cache budget in MiB (per rank in a tensor-parallel group: each holds its share of the KV heads).
    #[arg(long, default_value_t = 4096)]
    kv_mib: usize,
    /// MiB of prompts' keys and values kept for later requests that begin the same way (a system prompt, an
    /// instruction, a document asked about again): those requests take them instead of computing them, the same
    /// bits, in their `cache_salt` namespace (on rank 0 alone: a tensor-parallel group reuses none, its ranks' caches are not copied). 0 keeps none.
    #[arg(long, env = "PARSE_PREFIX_CACHE_MIB", default_value_t = 256)]
    prefix_cache_mib: usize,
    #[command(flatten)]
    compute: parse_engine::ComputeArgs,
    #[command(flatten)]
    discovery: AnnounceArgs,
    #[command(flatten)]
    security: parse_proto::security::SecurityArgs,
    /// Ranks of the tensor-parallel group.
    #[arg(long, env = "PARSE_TP", default_value_t = 1)]
    tp: usize,
    /// This process's rank (0 serves gRPC).
    #[arg(long, env = "PARSE_TP_RANK", default_value_t = 0)]
    rank: usize,
    /// Every rank's group address (host:port), in rank order, comma-separated (static rendezvous).
    #[arg(long, env = "PARSE_TP_ADDRS", value_delimiter = ',')]
    tp_addrs: Vec<String>,
    /// Rendezvous through etcd instead (with --etcd): the group's name, shared by its ranks.
    #[arg(long, env = "PARSE_TP_GROUP")]
    tp_group: Option<String>,
    /// With --tp-group: this rank's group address (host:port, reachable by the other ranks), published in etcd.
    #[arg(long, env = "PARSE_TP_LISTEN")]
    tp_listen: Option<String>,
    /// Seconds one collective may wait for a peer before the group counts as broken.
    #[arg(long, default_value_t = 10)]
    tp_timeout_s: u64,
    /// How o and down are split: `exact` (outputs bitwise equal to one process) or `megatron` (row-parallel with
    /// an all-reduce: fewer collectives, results within rounding; see parse_engine::tp).
    #[arg(long, env = "PARSE_TP_LAYOUT", default_value = "exact")]
    tp_layout: String,
    /// Collectives over `tcp` (any host, CPU) or `nccl` (GPUs; a build with the `nccl` feature). With NCCL the
    /// TCP group still forms first, to hand rank 0's NCCL unique id to the others.
    #[arg(long, env = "PARSE_TP_BACKEND", default_value = "tcp")]
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
    if args.tp > 1 && !args.compute.compute()?.is_kernels() {
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
        && (args.discovery.etcd.is_empty() || args.tp_listen.is_none() || !args.tp_addrs.is_empty())
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
    let security = args.security.load()?;
    args.discovery.etcd_auth.install()?;
    let layout: Layout = args.tp_layout.parse()?;
    let mut cfg = EngineConfig::new(&args.model);
    cfg.tokenizer = args.tokenizer.clone();
    cfg.kv_capacity_bytes = args.kv_mib << 20;
    cfg.kv_session_share = args.kv_session_share;
    cfg.prefix_cache_bytes = args.prefix_cache_mib.saturating_mul(1 << 20);
    cfg.compute = args.compute.compute()?;
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
                    &args.discovery.etcd,
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
            session_ttl: Duration::from_secs(args.session_ttl_s),
            max_sessions: args.max_sessions.max(1),
            step_rows: args.step_rows as usize,
            charge: args.charge,
            security: security.clone(),
            ..Default::default()
        },
        engine_stop.clone(),
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    tracing::info!(%addr, model = %args.model.display(), tp = args.tp, "target worker serving");
    let metrics = parse_worker::spawn_metrics(worker.metrics(), args.metrics_listen).await?;
    // Only the leader of a group registers: it is the group's one address.
    let registration = args.discovery.announce().register(
        Role::Target,
        addr,
        &model_name(&args.model),
        args.tp as u32,
        args.max_queue as u32,
    )?;
    if let Some(r) = &registration {
        worker.follow_registration(r.ready());
    }
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
    let served = serve(worker, listener, until).await;
    engine_stop.cancel();
    if let Some(m) = metrics {
        m.abort();
    }
    served
}
