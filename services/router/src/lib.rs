//! The router: the public `parse.v1.Generation` API. It tokenizes (with the tokenizer the target worker ships),
//! runs the one PARSE loop from `parse-core` against gRPC-backed drafter and verifier ([`remote`]), streams text as
//! output is accepted, and stops the loop when the client goes away or the deadline passes; sessions on both
//! workers are released on every path. At most `max_in_flight` requests run at once; beyond that it answers
//! RESOURCE_EXHAUSTED.

pub mod admin;
pub mod metrics;
pub mod openai;
pub mod pool;
pub mod remote;
mod validate;

pub use admin::serve_admin;
pub use openai::serve_openai;

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parse_core::pace::{Costs, Pacing};
use parse_core::{
    AcceptPolicy, CopyConfig, CopyFirst, DrafterKind, Error as CoreError, ErrorKind,
    GenerationRequest, Mode, NgramConfig, NgramDrafter, Source, Verdict, generate_paced,
};
use parse_discovery::{Discovery, EtcdDiscovery, Role, StaticDiscovery};
use parse_proto::v1::generation_server::{Generation, GenerationServer};
use parse_proto::v1::verifier_client::VerifierClient;
use parse_proto::v1::{
    Finished, GenerateRequest, GenerateResponse, GenerateStreamResponse, GetModelInfoRequest,
    TextDelta, TokenSource, generate_stream_response::Event,
};
use parse_proto::{sampling_from, segmenter_from, status_from_core};
use parse_text::{TextSink, Tokenizer};
use tokio::sync::{OnceCell, Semaphore, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::pool::Pool;
use crate::remote::{CallCtx, PrefillBeside, RemoteDrafter, RemoteVerifier, host_of};
use crate::validate::{PromptIn, check_limits};

/// When a request's draft worker processes the prompt ([`parse_core::driver::DraftHints::warm`]), and whether it drafts
/// the next token-level round while the target verifies this one, guessing the target's token after the draft
/// ([`parse_core::driver::DraftHints::prefetch_guessing`]): both where it works beside the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftPrefill {
    /// Beside the target's prefill where the draft worker's host is not a target worker's host (by address), after
    /// it where it is: two prefills at once on one host's cores take turns and both end later, while on hosts of
    /// their own they overlap.
    Auto,
    /// Always beside the target's prefill (a draft worker on its own device or cores under the same address).
    Alongside,
    /// Always after it.
    After,
}

/// Router settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub drafts: Vec<String>,
    pub targets: Vec<String>,
    /// Requests running at once.
    pub max_in_flight: usize,
    /// Largest `max_new_tokens` a request may ask for.
    pub max_new_tokens_limit: usize,
    pub default_mode: Mode,
    pub default_policy: AcceptPolicy,
    pub connect_timeout: Duration,
    /// How often lost workers are probed.
    pub probe_every: Duration,
    /// Let a draft worker write the next draft while the target verifies the current one (off where the two
    /// share a device and would only take turns).
    pub draft_ahead: bool,
    /// Where a request's draft processes its prompt: beside the target's prefill or after it ([`DraftPrefill`]).
    pub draft_prefill: DraftPrefill,
    /// etcd endpoints: when set, the pools follow the workers registered there (`drafts`/`targets` stay empty).
    pub etcd: Vec<String>,
    /// The model id of the OpenAI API [default: the target worker's model name].
    pub served_model_name: Option<String>,
    /// Drafter of requests that name none: `model+ngram` unless set (copies of long prompt-lookup matches, the draft
    /// workers for the rest, copy rounds of shorter matches while the draft model rests), except in `draft` mode,
    /// which is the draft model's own answer. Copies pay on replies that quote their prompt and cost little
    /// elsewhere, since their rounds are judged by what they write (`Pace`).
    pub default_drafter: DrafterKind,
    /// Let the target write alone where speculation does not pay at the current load, for requests that do not say
    /// (`DraftWindow::adaptive`; judged on the figures in `Router::costs`).
    pub adaptive: bool,
    /// Requests running at once per target worker from which adaptive requests do not speculate at all: the target
    /// writes alone, as in `target` mode (no draft, no copies), whatever the measured figures say. `None`: the
    /// figures decide (`Pace`). For an operator who knows where speculation stops paying on the fleet's hardware
    /// (vLLM's `speculative_disable_by_batch_size`); requests that turn adaptation off still speculate.
    pub speculation_off_at: Option<usize>,
    /// Mutual TLS on the router's own APIs and its worker calls, and the cluster token it sends to workers.
    pub security: parse_proto::security::Security,
    /// The longest a worker call may take when the client set no deadline (a wedged worker must not hold a
    /// request forever).
    pub worker_call_timeout: Duration,
    /// The most bytes of prompt text (prompt, system and messages together) a request may carry.
    pub max_prompt_bytes: usize,
    /// How long a streaming client may leave its stream unread before the request is cancelled (its permit and
    /// sessions freed).
    pub stalled_reader_timeout: Duration,
    /// The key OpenAI API clients must send (`Authorization: Bearer <key>`); none: the API is open.
    pub openai_api_key: Option<String>,
    /// HTTPS on the OpenAI API with the router's certificate (off: plain HTTP, for loopback or an ingress that
    /// ends TLS).
    pub openai_tls: bool,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            drafts: Vec::new(),
            targets: Vec::new(),
            max_in_flight: 64,
            max_new_tokens_limit: 4096,
            default_mode: Mode::DEFAULT,
            default_policy: AcceptPolicy::default(),
            connect_timeout: Duration::from_secs(2),
            probe_every: Duration::from_secs(1),
            draft_ahead: true,
            draft_prefill: DraftPrefill::Auto,
            etcd: Vec::new(),
            served_model_name: None,
            default_drafter: DrafterKind::ModelNgram,
            adaptive: true,
            speculation_off_at: None,
            security: Default::default(),
            worker_call_timeout: Duration::from_secs(300),
            max_prompt_bytes: 1 << 20,
            stalled_reader_timeout: Duration::from_secs(30),
            openai_api_key: None,
            openai_tls: false,
        }
    }
}

/// What the router knows of the model pair.
struct ModelCtx {
    /// The model id clients name (OpenAI API).
    name: String,
    tokenizer: Arc<Tokenizer>,
    max_context: usize,
    /// The target's vocabulary size: token-id prompts must stay below it.
    vocab_size: usize,
    judge_suffix: Vec<u32>,
}

/// The `Generation` service.
#[derive(Clone)]
pub struct Router {
    cfg: Arc<RouterConfig>,
    pub(crate) drafts: Arc<Pool>,
    pub(crate) targets: Arc<Pool>,
    pub(crate) admin: Arc<admin::AdminState>,
    model: Arc<OnceCell<Arc<ModelCtx>>>,
    in_flight: Arc<Semaphore>,
    /// Prometheus metrics (`GET /metrics` on the OpenAI HTTP port).
    pub metrics: Arc<metrics::Metrics>,
    /// What speculation and the target alone cost per output token at each load, measured by every request of
    /// these pools ([`parse_core::pace`]).
    pub costs: Arc<Costs>,
    /// The router's root token: cancelled at shutdown, it cancels every request (each holds a child).
    cancel: CancellationToken,
}

type Sender = mpsc::Sender<Result<GenerateStreamResponse, Status>>;

/// Sends one message to a client's stream from the generation's thread. A client that leaves its stream unread for
/// `stall` counts as gone: the request stops and frees its permit and its worker sessions rather than holding them
/// for as long as the client holds the connection. False when the message was not delivered.
fn send_within(
    handle: &tokio::runtime::Handle,
    tx: &Sender,
    msg: Result<GenerateStreamResponse, Status>,
    stall: Duration,
) -> bool {
    match tx.try_send(msg) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Closed(_)) => false,
        Err(mpsc::error::TrySendError::Full(msg)) => {
            let sent = handle.block_on(async {
                matches!(tokio::time::timeout(stall, tx.send(msg)).await, Ok(Ok(())))
            });
            if !sent && !tx.is_closed() {
                tracing::warn!(
                    stall_s = stall.as_secs_f64(),
                    "the client stopped reading its stream: request cancelled"
                );
            }
            sent
        }
    }
}

/// Attaches a request's span to the trace its client sent (gRPC metadata or HTTP headers), if any.
pub(crate) type TraceParent = Box<dyn FnOnce(&tracing::Span) + Send>;

fn grpc_parent<T>(req: &Request<T>) -> TraceParent {
    let md = req.metadata().clone();
    Box::new(move |span| parse_proto::telemetry::set_parent(span, &md))
}

/// Reads the `grpc-timeout` header (the client's deadline). The value is the client's: at most 8 digits as gRPC
/// says, and no arithmetic on it may overflow (a malformed one counts as none; every worker call still has the
/// router's own limit).
fn deadline_of<T>(req: &Request<T>) -> Option<Instant> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    if num.is_empty() || num.len() > 8 {
        return None;
    }
    let n: u64 = num.parse().ok()?;
    let d = match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    Instant::now().checked_add(d)
}

/// Most messages one request may carry.
pub const MAX_MESSAGES: usize = 1024;
/// Most stop strings, and the longest one in bytes.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Most segments a request may ask its first draft to hold.
pub const MAX_DRAFT_SEGMENTS: u32 = 64;

fn source_of(s: Source) -> TokenSource {
    match s {
        Source::Draft => TokenSource::Draft,
        Source::Target => TokenSource::Target,
    }
}

impl Router {
    /// A router over the workers the configuration names: `--draft`/`--target` addresses (static discovery), or
    /// the workers registered in etcd. Call it inside a tokio runtime: the discovery watches run on it.
    pub fn new(cfg: RouterConfig) -> anyhow::Result<Self> {
        if cfg.etcd.is_empty() && cfg.targets.is_empty() {
            anyhow::bail!("the router needs at least one target worker (--target ADDR) or --etcd");
        }
        let has_static = !cfg.targets.is_empty() || !cfg.drafts.is_empty();
        if !cfg.etcd.is_empty() && has_static {
            anyhow::bail!("--etcd discovers the workers: give no --draft/--target with it");
        }
        let discovery: Arc<dyn Discovery> = if cfg.etcd.is_empty() {
            for a in cfg.drafts.iter().chain(&cfg.targets) {
                pool::check_address(a, &cfg.security)?;
            }
            Arc::new(StaticDiscovery::new(&cfg.drafts, &cfg.targets))
        } else {
            Arc::new(EtcdDiscovery::new(
                cfg.etcd.clone(),
                Duration::from_secs(5),
            )?)
        };
        Ok(Self::with_discovery(cfg, discovery.as_ref()))
    }

    /// A router whose pools follow `discovery` (static, etcd, or in memory for tests); `cfg`'s worker lists only
    /// order the members they name. Call it inside a tokio runtime.
    pub fn with_discovery(cfg: RouterConfig, discovery: &dyn Discovery) -> Self {
        let drafts = Arc::new(Pool::new(
            Role::Draft,
            cfg.connect_timeout,
            cfg.security.clone(),
        ));
        let targets = Arc::new(Pool::new(
            Role::Target,
            cfg.connect_timeout,
            cfg.security.clone(),
        ));
        let cancel = CancellationToken::new();
        for (role, pool, listed) in [
            (Role::Draft, drafts.clone(), cfg.drafts.clone()),
            (Role::Target, targets.clone(), cfg.targets.clone()),
        ] {
            let mut rx = discovery.watch(role);
            // Workers named by flags keep the flags' order (the first listed wins ties between idle workers).
            let members = move |m: &parse_discovery::Members| -> Vec<(String, String)> {
                let mut v: Vec<(String, String)> = m
                    .values()
                    .map(|w| (w.id.clone(), w.address.clone()))
                    .collect();
                v.sort_by_key(|(_, a)| listed.iter().position(|l| l == a).unwrap_or(usize::MAX));
                v
            };
            // The members known now, before the first request; later changes as they come.
            pool.sync(&members(&rx.borrow_and_update()));
            let cancel = cancel.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        changed = rx.changed() => if changed.is_err() { return },
                    }
                    pool.sync(&members(&rx.borrow_and_update()));
                }
            });
        }
        Router {
            admin: admin::initial_state(cfg.default_mode, cfg.default_policy),
            in_flight: Arc::new(Semaphore::new(cfg.max_in_flight)),
            metrics: Arc::new(metrics::Metrics::new()),
            costs: Arc::new(Costs::default()),
            cfg: Arc::new(cfg),
            drafts,
            targets,
            model: Arc::new(OnceCell::new()),
            cancel,
        }
    }

    /// Cancels every request in flight and stops following discovery (shutdown).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    pub fn into_server(self) -> GenerationServer<Self> {
        GenerationServer::new(self)
    }

    /// `(id, address)` of the current members of a role's pool.
    pub fn members(&self, role: Role) -> Vec<(String, String)> {
        let pool = match role {
            Role::Draft => &self.drafts,
            Role::Target => &self.targets,
        };
        pool.workers()
            .iter()
            .map(|w| (w.id.clone(), w.addr.clone()))
            .collect()
    }

    /// Starts the probes that bring lost workers back.
    pub fn spawn_probers(&self) -> Vec<tokio::task::JoinHandle<()>> {
        vec![
            self.drafts.spawn_prober(self.cfg.probe_every),
            self.targets.spawn_prober(self.cfg.probe_every),
        ]
    }

    /// The model pair's tokenizer and limits, asked of the target workers once.
    async fn model(&self) -> Result<Arc<ModelCtx>, Status> {
        self.model
            .get_or_try_init(|| async {
                let mut last = Status::unavailable("no target worker");
                for w in self.targets.workers() {
                    let mut c =
                        VerifierClient::new(w.channel.clone()).max_decoding_message_size(256 << 20);
                    let mut req = Request::new(GetModelInfoRequest {});
                    req.set_timeout(Duration::from_secs(10));
                    match c.get_model_info(req).await {
                        Ok(r) => {
                            let info = r.into_inner();
                            let tok =
                                Tokenizer::from_portable(&info.tokenizer_json).map_err(|e| {
                                    Status::internal(format!("tokenizer from {}: {e}", w.addr))
                                })?;
                            let judge_suffix = tok.judge_suffix().unwrap_or_default();
                            let name = self.cfg.served_model_name.clone().unwrap_or(info.model);
                            return Ok(Arc::new(ModelCtx {
                                name,
                                tokenizer: Arc::new(tok),
                                max_context: info.max_context as usize,
                                vocab_size: info.vocab_size as usize,
                                judge_suffix,
                            }));
                        }
                        Err(s) => {
                            last = Status::unavailable(format!("{}: {}", w.addr, s.message()))
                        }
                    }
                }
                Err(last)
            })
            .await
            .cloned()
    }

    /// Checks a request and turns it into the loop's request, its stop strings and its drafter.
    fn build(
        &self,
        m: &ModelCtx,
        r: &GenerateRequest,
        session: &str,
    ) -> Result<(GenerationRequest, Vec<String>, DrafterKind), CoreError> {
        check_limits(r, &self.cfg)?;
        let prompt_in = PromptIn::try_from(r)?;
        if let PromptIn::Tokens(tokens) = &prompt_in
            && let Some(t) = tokens.iter().find(|&&t| t as usize >= m.vocab_size)
        {
            return Err(CoreError::invalid(format!(
                "prompt_tokens: token id {t} is outside the model's vocabulary of {}",
                m.vocab_size
            )));
        }
        let max_new = r.max_new_tokens as usize;
        if max_new == 0 || max_new > self.cfg.max_new_tokens_limit {
            return Err(CoreError::invalid(format!(
                "max_new_tokens must be 1..={}, got {}",
                self.cfg.max_new_tokens_limit, r.max_new_tokens
            )));
        }
        let prompt = match prompt_in {
            PromptIn::Tokens(t) => Ok(t.to_vec()),
            PromptIn::Raw(text) => m.tokenizer.encode_prompt(text),
            PromptIn::Chat(messages) => m.tokenizer.encode_chat(&messages),
        }
        .map_err(CoreError::from)?;
        if prompt.len() >= m.max_context {
            return Err(CoreError::invalid(format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                m.max_context
            )));
        }
        // Every output token but the last is written into the target's cache after the prompt, and a budget that
        // would run past the context fails only once the work is done: refuse it now (as OpenAI and vLLM do), or
        // lower it where the request asks for what fits.
        let room = m.max_context - prompt.len();
        let max_new = if r.fit_context {
            max_new.min(room)
        } else if max_new > room {
            return Err(CoreError::invalid(format!(
                "the prompt has {} tokens and max_new_tokens is {max_new}: together past the model's context of {}; \
                 ask for at most {room} new tokens",
                prompt.len(),
                m.max_context
            )));
        } else {
            max_new
        };
        let live = *self.admin.policy.read().unwrap_or_else(|e| e.into_inner());
        let sampling = sampling_from(r.sampling.as_ref())?;
        let mode = if !r.mode.is_empty() {
            r.mode.parse()?
        } else if !sampling.is_greedy() && matches!(live.mode, Mode::Parse | Mode::ParseTokenSpec) {
            // PARSE decodes greedily; a request that samples and leaves the mode to the router gets lossless
            // token-level speculation (the target's own distribution) rather than an error.
            Mode::TokenSpec
        } else {
            live.mode
        };
        let mut policy = live.accept;
        if !r.verdict.is_empty() {
            // Another verdict than the router's comes with its own default tau (tau means something else).
            let verdict = r.verdict.parse::<Verdict>()?;
            if verdict != policy.verdict {
                policy.verdict = verdict;
                policy.tau = verdict.default_tau();
            }
        }
        if let Some(t) = r.tau {
            policy.tau = t;
        }
        if let Some(f) = r.exact_floor {
            policy.exact_floor = f;
        }
        let mut window = live.window();
        window.adaptive = r.adaptive.unwrap_or(self.cfg.adaptive);
        if r.draft_segments > 0 {
            window.initial_segments = r.draft_segments as usize;
            window.max_segments = window.max_segments.max(window.initial_segments);
        }
        for s in &r.stop {
            if s.is_empty() {
                return Err(CoreError::invalid("empty stop string"));
            }
        }
        let req = GenerationRequest {
            session: session.to_string(),
            prompt,
            max_new_tokens: max_new,
            mode,
            sampling,
            policy,
            segmenter: segmenter_from(r.segmenter.as_ref(), &Default::default())?,
            window,
            eos: m.tokenizer.eos_ids().to_vec(),
            judge_suffix: m.judge_suffix.clone(),
        };
        req.validate()?;
        let drafter = drafter_of(&r.drafter, mode, self.cfg.default_drafter)?;
        let model_drafts = match mode {
            Mode::Target => false,
            Mode::Draft if drafter == DrafterKind::Ngram => {
                return Err(CoreError::invalid(
                    "mode draft writes with the draft model; the ngram drafter only proposes tokens for the target \
                     to check",
                ));
            }
            Mode::Draft => true,
            _ => drafter.uses_model(),
        };
        if model_drafts && self.drafts.is_empty() {
            return Err(CoreError::invalid(format!(
                "mode {} needs a draft worker and the router has none (drafter \"ngram\" needs none)",
                mode.as_str()
            )));
        }
        Ok((req, r.stop.clone(), drafter))
    }

    /// Where a request's pace reads and reports: the pools' shared figures, under its mode and drafter, at the load
    /// of the moment (requests running per healthy target worker).
    fn pacing(&self, req: &GenerationRequest, drafter: DrafterKind) -> Pacing {
        let (metrics, targets) = (self.metrics.clone(), self.targets.clone());
        Pacing {
            costs: self.costs.clone(),
            kind: format!("{}/{}", req.mode.as_str(), drafter.as_str()),
            load: Arc::new(move || {
                let workers = targets.workers().iter().filter(|w| w.healthy()).count();
                metrics.in_flight().div_ceil(workers.max(1))
            }),
            off_at: self.cfg.speculation_off_at,
        }
    }

    /// Runs one request, sending deltas and the final message to `tx`. Returns when the loop has finished and
    /// released its sessions.
    async fn run(
        &self,
        r: GenerateRequest,
        deadline: Option<Instant>,
        tx: Sender,
        parent: TraceParent,
    ) -> Result<(), Status> {
        let permit = self.in_flight.clone().try_acquire_owned().map_err(|_| {
            self.metrics.rejected("busy");
            Status::resource_exhausted(format!(
                "router busy: {} requests in flight",
                self.cfg.max_in_flight
            ))
        })?;
        if r.request_id.len() > 128 {
            self.metrics.rejected("invalid");
            return Err(Status::invalid_argument(
                "request_id is longer than 128 bytes",
            ));
        }
        let m = self
            .model()
            .await
            .inspect_err(|_| self.metrics.rejected("unavailable"))?;
        let request_id = if r.request_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            r.request_id.clone()
        };
        let session = format!("{request_id}/{}", uuid::Uuid::new_v4().simple());
        let (req, stop, drafter_kind) = self.build(&m, &r, &session).map_err(|e| {
            self.metrics.rejected(if e.kind == ErrorKind::InvalidInput {
                "invalid"
            } else {
                "unavailable"
            });
            status_from_core(e)
        })?;
        // The request's token: cancelled when the client goes away (below), when the router shuts down (a child
        // of its root), or once the request is over (the guard).
        let cancel = self.cancel.child_token();
        let ctx = CallCtx {
            handle: tokio::runtime::Handle::current(),
            cancel: cancel.clone(),
            deadline,
            call_timeout: self.cfg.worker_call_timeout,
        };
        // The request in the load that the pace reads (and the gauge), until its loop is over or its client goes.
        let running = Arc::new(std::sync::Mutex::new(Some(self.metrics.running())));
        // A client gone mid-call cancels the call at once (the worker sees its RPC cancelled), not at the next output,
        // and the request leaves the load at once: a client that stops reading when its answer is over sends its next
        // request straight away, and until the old loop saw it was cancelled, the new one's pace read a load above
        // the clients' count (figures of 9-16 requests after every run at 8 clients).
        let closed = tx.clone();
        let watch_cancel = cancel.clone();
        let leaves = running.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = closed.closed() => {
                    leaves.lock().unwrap_or_else(|e| e.into_inner()).take();
                    watch_cancel.cancel();
                }
                _ = watch_cancel.cancelled() => {}
            }
        });
        let _done = cancel.clone().drop_guard();
        let drafts = self.drafts.clone();
        let targets = self.targets.clone();
        let draft_ahead = self.cfg.draft_ahead;
        let draft_prefill = self.cfg.draft_prefill;
        let pacing = self.pacing(&req, drafter_kind);
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let span = tracing::info_span!(
            "generate",
            request_id = %request_id,
            mode = req.mode.as_str(),
            prompt_tokens = req.prompt.len(),
            output_tokens = tracing::field::Empty,
            target_passes = tracing::field::Empty,
        );
        parent(&span);
        let stall = self.cfg.stalled_reader_timeout;
        let task = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _enter = span.enter();
            let mut first_text: Option<f64> = None;
            let tok = m.tokenizer.clone();
            let mut drafter = RemoteDrafter::new(drafts, ctx.clone(), tok.clone(), 256);
            drafter.draft_ahead = draft_ahead;
            drafter.prefill_beside = match draft_prefill {
                DraftPrefill::Alongside => PrefillBeside::Always,
                DraftPrefill::After => PrefillBeside::Never,
                DraftPrefill::Auto => PrefillBeside::OffHosts(
                    targets
                        .workers()
                        .iter()
                        .map(|w| host_of(&w.addr).to_string())
                        .collect(),
                ),
            };
            // Prompt lookup runs here, in the router; the remote drafter then stays unused (it leases no worker
            // until asked to draft).
            let mut lookup = match drafter_kind {
                DrafterKind::Ngram => Some(NgramDrafter::new(
                    NgramConfig::default(),
                    tok.piece_fn(),
                    tok.eos_ids().to_vec(),
                )),
                DrafterKind::Model | DrafterKind::ModelNgram => None,
            }
            .transpose();
            let eos = tok.eos_ids().to_vec();
            let mut verifier = RemoteVerifier::new(targets, ctx.clone());
            let mut text_sink = TextSink::new(tok, stop);
            let mut failure: Option<CoreError> = None;
            // Tokens the client was sent: a request that ends early (its client left) counts these.
            let mut sent = 0u64;
            let mut sink = |tokens: &[u32], source: Source| -> bool {
                let before = text_sink.kept();
                let text = match text_sink.push(tokens) {
                    Ok(t) => t,
                    Err(e) => {
                        failure = Some(e.into());
                        return false;
                    }
                };
                if first_text.is_none() && !text.is_empty() {
                    first_text = Some(started.elapsed().as_secs_f64());
                }
                let stopped = text_sink.stopped();
                // Past a stop string the round's tokens are not the answer's.
                let tokens = &tokens[..text_sink.kept() - before];
                let delta = GenerateStreamResponse {
                    event: Some(Event::Delta(TextDelta {
                        text,
                        token_ids: tokens.to_vec(),
                        source: source_of(source) as i32,
                    })),
                };
                if !send_within(&ctx.handle, &tx, Ok(delta), stall) {
                    // The client went away or stopped reading: stop the loop (it releases the sessions).
                    return false;
                }
                sent += tokens.len() as u64;
                !stopped && ctx.deadline.is_none_or(|d| Instant::now() < d)
            };
            // Both stand ready; the loop uses the ones the request's mode needs.
            let result = match lookup.as_mut() {
                Ok(Some(n)) => generate_paced(n, &mut verifier, &req, &mut sink, pacing.clone()),
                Ok(None) if drafter_kind == DrafterKind::ModelNgram => {
                    // Copies are made here; the remote drafter writes the rest (its counters read below).
                    CopyFirst::new(&mut drafter, CopyConfig::remote(), eos).and_then(|mut d| {
                        generate_paced(&mut d, &mut verifier, &req, &mut sink, pacing.clone())
                    })
                }
                Ok(None) => {
                    generate_paced(&mut drafter, &mut verifier, &req, &mut sink, pacing.clone())
                }
                Err(e) => Err(e.clone()),
            };
            let mut result = match (result, failure) {
                (Ok(o), None) => Ok(o),
                (Ok(_), Some(e)) | (Err(e), _) => Err(e),
            };
            // A stop string ends the answer at the token that completed it; the loop may have accepted more in
            // the same round, or reached the budget in it. The reply's tokens, its count (OpenAI's
            // `completion_tokens`) and the output metric are the answer's, and it finished by the stop string.
            if let Ok(o) = result.as_mut()
                && text_sink.stopped()
            {
                o.stop_at(text_sink.kept());
            }
            // The loop is over: the request adds no more rows to the workers' passes, so it leaves the load that the
            // other requests' pace reads (and the gauge) now, not once its sessions are released and its reply sent.
            // A client that stops reading when its answer is over (a stop rule of its own) sends its next request at
            // once, while the old one's sessions are still being released, and the other requests would read a load
            // above the clients' count. The time the loop takes to see its client went away is left out too (the
            // watcher above).
            running.lock().unwrap_or_else(|e| e.into_inner()).take();
            metrics.pace_costs(&pacing.costs.snapshot());
            let mut used: Vec<(&str, String)> = Vec::new();
            used.extend(drafter.used.iter().map(|id| ("draft", id.clone())));
            used.extend(verifier.used.iter().map(|id| ("target", id.clone())));
            let latency_ms = started.elapsed().as_secs_f64() * 1e3;
            let s = result.as_ref().map(|o| &o.stats).ok();
            let n = |f: fn(&parse_core::Stats) -> usize| s.map_or(0, |s| f(s) as u64);
            metrics.record(&metrics::RequestRecord {
                mode: req.mode.as_str(),
                ok: result.is_ok(),
                // A client that stops reading once it has its answer (a stop rule of its own) ends the request
                // this way too: not the cluster's failure.
                cancelled: result.is_err() && tx.is_closed(),
                latency_s: latency_ms / 1e3,
                ttft_s: first_text,
                output_tokens: s.map_or(sent, |s| s.output_tokens as u64),
                draft_tokens_proposed: n(|s| s.draft_tokens_proposed),
                draft_tokens_accepted: n(|s| s.draft_tokens_accepted),
                segments_proposed: n(|s| s.segments_proposed),
                segments_accepted: n(|s| s.segments_accepted),
                target_passes: n(|s| s.target_passes),
                paused_tokens: n(|s| s.paused_tokens),
                entries_declined: n(|s| s.entries_declined),
                copy_rounds: n(|s| s.copy_rounds),
                token_rounds: n(|s| s.token_rounds),
                guesses: n(|s| s.guesses),
                guesses_right: n(|s| s.guesses_right),
                draft_ahead_hits: drafter.prefetch_hits as u64,
                draft_ahead_misses: drafter.prefetch_misses as u64,
                draft_failovers: drafter.failovers as u64,
                target_failovers: verifier.failovers as u64,
                fell_back: drafter.fell_back,
                proposed_by_position: s.map_or(&[], |s| &s.proposed_by_position),
                accepted_by_position: s.map_or(&[], |s| &s.accepted_by_position),
                workers: &used,
            });
            let outcome = match result {
                Ok(o) => o,
                Err(e) => {
                    if e.kind == ErrorKind::Internal {
                        tracing::error!("{}", e.message);
                    }
                    send_within(&ctx.handle, &tx, Err(status_from_core(e)), stall);
                    return;
                }
            };
            if ctx.deadline.is_some_and(|d| Instant::now() >= d)
                && outcome.finish_reason == parse_core::FinishReason::Stop
            {
                send_within(
                    &ctx.handle,
                    &tx,
                    Err(Status::deadline_exceeded("deadline exceeded")),
                    stall,
                );
                return;
            }
            let tail = text_sink.flush();
            if !tail.is_empty() {
                send_within(
                    &ctx.handle,
                    &tx,
                    Ok(GenerateStreamResponse {
                        event: Some(Event::Delta(TextDelta {
                            text: tail,
                            token_ids: vec![],
                            source: TokenSource::Unspecified as i32,
                        })),
                    }),
                    stall,
                );
            }
            let mut stats = parse_proto::v1::Stats::from(&outcome.stats);
            stats.draft_failovers = drafter.failovers as u32;
            stats.target_failovers = verifier.failovers as u32;
            stats.fell_back_to_target = drafter.fell_back;
            stats.draft_prefetch_hits = drafter.prefetch_hits as u32;
            stats.draft_prefetch_misses = drafter.prefetch_misses as u32;
            tracing::Span::current().record("output_tokens", outcome.stats.output_tokens);
            tracing::Span::current().record("target_passes", outcome.stats.target_passes);
            tracing::info!(
                output_tokens = outcome.stats.output_tokens,
                finish = outcome.finish_reason.as_str(),
                target_passes_per_token = outcome.stats.target_passes_per_token,
                "done"
            );
            send_within(
                &ctx.handle,
                &tx,
                Ok(GenerateStreamResponse {
                    event: Some(Event::Finished(Finished {
                        request_id,
                        finish_reason: outcome.finish_reason.as_str().to_string(),
                        stats: Some(stats),
                    })),
                }),
                stall,
            );
        });
        task.await
            .map_err(|e| Status::internal(format!("generation task: {e}")))
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for Router {
    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<GenerateResponse>, Status> {
        let deadline = deadline_of(&request);
        let parent = grpc_parent(&request);
        let r = request.into_inner();
        let (tx, mut rx) = mpsc::channel(64);
        let router = self.clone();
        // The loop runs in its own task; if this handler is dropped (client gone), `rx` goes with it and the loop
        // stops at its next output.
        let run = tokio::spawn(async move { router.run(r, deadline, tx, parent).await });
        let mut text = String::new();
        let mut token_ids = Vec::new();
        let mut finished = None;
        while let Some(msg) = rx.recv().await {
            match msg?.event {
                Some(Event::Delta(d)) => {
                    text.push_str(&d.text);
                    token_ids.extend(d.token_ids);
                }
                Some(Event::Finished(f)) => finished = Some(f),
                None => {}
            }
        }
        run.await
            .map_err(|e| Status::internal(format!("generation task: {e}")))??;
        let f = finished.ok_or_else(|| Status::internal("generation ended without a result"))?;
        Ok(Response::new(GenerateResponse {
            request_id: f.request_id,
            text,
            token_ids,
            finish_reason: f.finish_reason,
            stats: f.stats,
        }))
    }

    type GenerateStreamStream = GenStream;

    async fn generate_stream(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let deadline = deadline_of(&request);
        let parent = grpc_parent(&request);
        let r = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let router = self.clone();
        let err_tx = tx.clone();
        tokio::spawn(async move {
            if let Err(s) = router.run(r, deadline, tx, parent).await {
                let _ = err_tx.send(Err(s)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the router on `listener` until `shutdown` resolves.
pub async fn serve(
    router: Router,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let probers = router.spawn_probers();
    let root = router.cancel.clone();
    let access = parse_proto::serve::Access::public(&router.cfg.security);
    let result = parse_proto::serve::run(router.into_server(), listener, shutdown, access).await;
    root.cancel();
    for p in probers {
        p.abort();
    }
    result.map_err(|e| anyhow::anyhow!(e))
}

/// The drafter a request asked for (`requested`), or where it named none, the router's `default`, except in `draft`
/// mode: that is the draft model's own answer, and the default drafter, which may copy, is for the modes the target
/// checks.
fn drafter_of(requested: &str, mode: Mode, default: DrafterKind) -> Result<DrafterKind, CoreError> {
    if !requested.is_empty() {
        return requested.parse();
    }
    Ok(match mode {
        Mode::Draft => DrafterKind::Model,
        _ => default,
    })
}

#[cfg(test)]
mod tests;
