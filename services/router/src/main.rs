//! `parse-router (--target ADDR... [--draft ADDR...] | --etcd ENDPOINTS) [--listen ADDR]`: the Generation API in
//! front of the workers, named by flags or discovered through etcd.

use std::net::SocketAddr;

use clap::Parser;
use parse_core::{AcceptPolicy, Mode, Verdict};
use parse_router::{Router, RouterConfig, serve};

#[derive(Parser)]
#[command(
    version,
    about = "PARSE router: parse.v1.Generation in front of draft and target workers"
)]
struct Args {
    #[arg(long, env = parse_core::env::ROUTER_LISTEN, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Draft worker addresses (host:port), repeatable or comma-separated.
    #[arg(long = "draft", env = parse_core::env::DRAFT_WORKERS, value_delimiter = ',')]
    drafts: Vec<String>,
    /// Target worker addresses (host:port), repeatable or comma-separated.
    #[arg(
        long = "target",
        env = parse_core::env::TARGET_WORKERS,
        value_delimiter = ',',
        required_unless_present = "etcd"
    )]
    targets: Vec<String>,
    /// etcd endpoints (comma-separated): follow the workers registered under /parse/v1/workers/ instead of flags.
    #[arg(long, env = parse_core::env::ETCD, value_delimiter = ',', conflicts_with_all = ["drafts", "targets"])]
    etcd: Vec<String>,
    /// Requests running at once before RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 64)]
    max_in_flight: usize,
    #[arg(long, default_value_t = 4096)]
    max_new_tokens_limit: usize,
    /// Mode of requests that name none.
    #[arg(long, value_enum, default_value_t = Mode::ParseTokenSpec)]
    default_mode: Mode,
    /// Acceptance threshold of requests that name none [default: the verdict's default, see docs/parse.md].
    #[arg(long)]
    default_tau: Option<f32>,
    /// Verdict of requests that name none [default: the project's default, see docs/parse.md].
    #[arg(long, value_enum)]
    default_verdict: Option<Verdict>,
    /// Address of the admin API (parse.v1.Admin).
    #[arg(long, env = parse_core::env::ADMIN_LISTEN, default_value = "127.0.0.1:50052")]
    admin_listen: SocketAddr,
    /// Bearer token of the admin API; without one the admin API is off.
    #[arg(long, env = parse_core::env::ADMIN_TOKEN, hide_env_values = true)]
    admin_token: Option<String>,
    /// Address of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health).
    #[arg(long, env = parse_core::env::OPENAI_LISTEN, default_value = "127.0.0.1:8000")]
    openai_listen: SocketAddr,
    /// The key OpenAI API clients must send as `Authorization: Bearer <key>` (or a file holding it:
    /// --openai-api-key-file); without one the API is open to whoever reaches its port.
    #[arg(long, env = parse_core::env::OPENAI_API_KEY, hide_env_values = true)]
    openai_api_key: Option<String>,
    #[arg(
        long,
        env = parse_core::env::OPENAI_API_KEY_FILE,
        conflicts_with = "openai_api_key"
    )]
    openai_api_key_file: Option<std::path::PathBuf>,
    /// HTTPS on the OpenAI API with the router's certificate (--tls-cert/--tls-key); clients need none of their
    /// own. Off: plain HTTP (loopback, or TLS ended at an ingress).
    #[arg(long, env = parse_core::env::OPENAI_TLS)]
    openai_tls: bool,
    /// Serve no OpenAI-compatible HTTP API.
    #[arg(long)]
    no_openai: bool,
    /// Model id of the OpenAI API [default: the target worker's model name].
    #[arg(long, env = parse_core::env::SERVED_MODEL_NAME)]
    served_model_name: Option<String>,
    /// Do not let draft workers write the next draft while the target verifies (for a draft and a target that
    /// share one device).
    #[arg(long)]
    no_draft_ahead: bool,
    /// When a request's draft worker processes the prompt: beside the target's prefill (alongside), after it
    /// (after), or beside it where the draft worker's host (by address) is no target worker's (auto: two prefills
    /// on one host's cores take turns and both end later). Where it is beside, the draft worker also drafts the
    /// next token-level round while the target verifies this one, guessing the target's next token.
    #[arg(long, env = parse_core::env::DRAFT_PREFILL, value_enum, default_value = "auto")]
    draft_prefill: parse_router::DraftPrefill,
    /// Drafter of requests that name none: model (the draft workers), ngram (prompt lookup in the router; with it
    /// no draft worker is needed) or model+ngram (copies of long prompt-lookup matches, the draft workers for the
    /// rest; the default: faster than `model` on code that repeats its prompt, level with it elsewhere). `draft` mode
    /// always writes with the draft model alone.
    #[arg(long, env = parse_core::env::DEFAULT_DRAFTER, default_value = "model+ngram")]
    default_drafter: parse_core::DrafterKind,
    /// Keep speculating even where it writes more slowly than the target alone at the current load (by default the
    /// target then writes alone for a while: greedy token-spec gives the same tokens either way; in the PARSE modes
    /// those stretches are the target's own tokens, so outputs follow the load). Requests may say otherwise.
    #[arg(long)]
    no_adaptive: bool,
    /// Requests running at once per target worker from which the target writes alone, as in `target` mode, in
    /// requests that adapt (no draft, no copies), whatever the measured figures say [default: none, the figures
    /// decide]. For fleets where speculation is known to stop paying at some batch size; requests that turn
    /// adaptation off still speculate.
    #[arg(long, env = parse_core::env::SPECULATION_OFF_AT, value_parser = clap::value_parser!(u64).range(1..))]
    speculation_off_at: Option<u64>,
    /// The most bytes of prompt text (prompt, system and messages together) a request may carry.
    #[arg(long, default_value_t = 1 << 20)]
    max_prompt_bytes: usize,
    /// Seconds a streaming client may leave its stream unread before its request is cancelled.
    #[arg(long, default_value_t = 30)]
    stalled_reader_timeout_s: u64,
    /// The longest one worker call may take (within the client's deadline, if any), its wait behind other requests'
    /// work on the worker included. A call past it counts its worker as lost (wedged) and moves the request, so set
    /// it well above the longest call at peak load: a stopped or unreachable worker is found by HTTP/2 keep-alive
    /// (about 10 s) whatever this is. A call that prefills more than 8,192 context tokens (a long prompt) gets this
    /// times the square of its tokens over 8,192.
    #[arg(long, default_value_t = 300)]
    worker_call_timeout_s: u64,
    #[command(flatten)]
    security: parse_proto::security::SecurityArgs,
    #[command(flatten)]
    etcd_auth: parse_discovery::EtcdAuthArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when this guard drops).
    let _telemetry = parse_proto::telemetry::init("parse-router")
        .map_err(|e| anyhow::anyhow!("telemetry: {e}"))?;
    let args = Args::parse();
    let security = args.security.load()?;
    if args.openai_tls && !security.tls() {
        anyhow::bail!("--openai-tls needs the router's --tls-cert, --tls-key and --tls-ca");
    }
    let router_tls = args.openai_tls;
    args.etcd_auth.install()?;
    let openai_api_key = match (&args.openai_api_key, &args.openai_api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(p)) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    }
    .filter(|k| !k.is_empty());
    if args.worker_call_timeout_s == 0 {
        anyhow::bail!("--worker-call-timeout-s must be at least 1");
    }
    let err = |e: parse_core::Error| anyhow::anyhow!(e.message);
    let default_mode = args.default_mode;
    let policy = AcceptPolicy::for_verdict(args.default_verdict, args.default_tau);
    policy.validate().map_err(err)?;
    let router = Router::new(RouterConfig {
        drafts: args.drafts.clone(),
        targets: args.targets.clone(),
        max_in_flight: args.max_in_flight,
        max_new_tokens_limit: args.max_new_tokens_limit,
        default_mode,
        default_policy: policy,
        draft_ahead: !args.no_draft_ahead,
        draft_prefill: args.draft_prefill,
        etcd: args.etcd.clone(),
        served_model_name: args.served_model_name.clone(),
        default_drafter: args.default_drafter,
        adaptive: !args.no_adaptive,
        speculation_off_at: args.speculation_off_at.map(|n| n as usize),
        security,
        worker_call_timeout: std::time::Duration::from_secs(args.worker_call_timeout_s),
        max_prompt_bytes: args.max_prompt_bytes,
        openai_api_key,
        openai_tls: args.openai_tls,
        stalled_reader_timeout: std::time::Duration::from_secs(
            args.stalled_reader_timeout_s.max(1),
        ),
        ..Default::default()
    })?;
    let (listener, addr) = parse_proto::serve::bind(args.listen).await?;
    tracing::info!(%addr, drafts = ?args.drafts, targets = ?args.targets, etcd = ?args.etcd, "router serving");
    let admin = match args.admin_token.filter(|t| !t.is_empty()) {
        Some(token) => {
            let (l, a) = parse_proto::serve::bind(args.admin_listen).await?;
            tracing::info!(addr = %a, "admin API serving");
            Some(tokio::spawn(parse_router::serve_admin(
                router.clone(),
                l,
                token,
                parse_proto::serve::shutdown_signal(),
            )))
        }
        None => {
            tracing::info!("no --admin-token: the admin API is off");
            None
        }
    };
    let openai = if args.no_openai {
        None
    } else {
        let (l, a) = parse_proto::serve::bind(args.openai_listen).await?;
        let scheme = if router_tls { "https" } else { "http" };
        tracing::info!(addr = %a, "OpenAI API serving ({scheme}://{a}/v1)");
        Some(tokio::spawn(parse_router::serve_openai(
            router.clone(),
            l,
            parse_proto::serve::shutdown_signal(),
        )))
    };
    let served = serve(router, listener, parse_proto::serve::shutdown_signal()).await;
    if let Some(a) = admin {
        a.abort();
    }
    if let Some(o) = openai {
        o.abort();
    }
    served
}
