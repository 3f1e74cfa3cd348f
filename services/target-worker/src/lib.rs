//! The target worker: one target model behind `parse.v1.Verifier`, alone or as rank 0 (the leader) of a
//! tensor-parallel group whose followers run `tp::Follower::follow` (see `parse_engine::tp`), in the shared worker
//! shell (`parse-worker`): a scheduler task owns the engine and runs every call as a command.
//!
//! At most `max_queue` calls may wait or run at once; beyond that the worker answers RESOURCE_EXHAUSTED instead of
//! queueing without limit. Sessions idle for longer than the TTL are released.
//!
//! A leader sends its followers a heartbeat every `heartbeat`. Once a collective fails (a follower died or hung)
//! the group is broken: in-flight and later calls fail with UNAVAILABLE, and health turns NOT_SERVING so that
//! routers stop sending work here; the group has to be restarted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::Instrument;

use parse_core::{Error as CoreError, SegmenterConfig, Verifier as _, VerifyPlan};
use parse_engine::EngineOps;
use parse_engine::drafter_verifier::{EngineVerifier, ExtendSteps, OpenSteps, VerifySteps};
use parse_engine::steps::Steps;
use parse_proto::v1::verifier_server::{Verifier, VerifierServer};
use parse_proto::v1::{
    DrainRequest, DrainResponse, ExtendRequest, ExtendResponse, GetModelInfoRequest,
    GetModelInfoResponse, OpenSessionRequest, OpenSessionResponse, ReleaseRequest, ReleaseResponse,
    TruncateRequest, TruncateResponse, VerifyRequest, VerifyResponse,
};
use parse_proto::{check_session, sampling_from, segmenter_from, status_from_core};
use parse_worker::{Shell, ShellConfig, State};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// The accessors both workers share (sessions, drain, metrics): in scope where they are called.
pub use parse_worker::Worker;

/// Limits of a target worker.
#[derive(Debug, Clone)]
pub struct TargetWorkerConfig {
    /// Calls running or waiting at once.
    pub max_queue: usize,
    /// Idle sessions are released after this long.
    pub session_ttl: Duration,
    /// Tokens one `Extend` may decode.
    pub max_extend: u32,
    /// Rows one packed forward pass holds at most (continuous batching: the steps of every running request share
    /// a pass; a prefill is cut to the room left).
    pub step_rows: usize,
    /// How a pass's time is split among the requests in it (`--charge`).
    pub charge: parse_worker::scheduler::Charge,
    /// How often a tensor-parallel leader checks its followers.
    pub heartbeat: Duration,
    /// Mutual TLS and the cluster token its callers must present.
    pub security: parse_proto::security::Security,
    /// Sessions open at once; a new one beyond it is RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
}

impl Default for TargetWorkerConfig {
    fn default() -> Self {
        TargetWorkerConfig {
            max_queue: 256,
            session_ttl: Duration::from_secs(300),
            max_extend: 4096,
            step_rows: DEFAULT_STEP_ROWS,
            charge: Default::default(),
            heartbeat: Duration::from_secs(1),
            security: Default::default(),
            max_sessions: 256,
        }
    }
}

pub use parse_worker::args::DEFAULT_STEP_ROWS;

/// What the target worker's scheduler drives: an engine, or a tensor-parallel leader.
pub type TargetEngine = Box<dyn EngineOps + Send>;
type Backend = EngineVerifier<TargetEngine>;

/// The `Verifier` service.
#[derive(Clone)]
pub struct TargetWorker {
    shell: Shell<Backend>,
    cfg: TargetWorkerConfig,
    tp: usize,
    /// Health: false once the tensor-parallel group broke, or while the discovery registration is lost.
    ready: Arc<watch::Sender<bool>>,
    group_ok: Arc<AtomicBool>,
    registered: Arc<AtomicBool>,
}

impl TargetWorker {
    /// A worker over `engine` (an `Engine`, or a `tp::Leader`) that stops with `cancel`.
    pub fn new(
        engine: impl EngineOps + Send + 'static,
        cfg: TargetWorkerConfig,
        cancel: CancellationToken,
    ) -> Result<Self, CoreError> {
        let tp = engine.world_size();
        let info = parse_worker::model_info(engine.engine(), tp)?;
        let engine: TargetEngine = Box::new(engine);
        let shell = Shell::new(
            EngineVerifier::new(engine),
            info,
            ShellConfig {
                queue: cfg.max_queue,
                session_ttl: cfg.session_ttl,
                name: "target worker",
                step_rows: cfg.step_rows,
                charge: cfg.charge,
            },
            cancel,
        );
        Ok(TargetWorker {
            shell,
            cfg,
            tp,
            ready: Arc::new(watch::channel(true).0),
            group_ok: Arc::new(AtomicBool::new(true)),
            registered: Arc::new(AtomicBool::new(true)),
        })
    }

    fn publish(&self) {
        let r = self.group_ok.load(Ordering::Relaxed) && self.registered.load(Ordering::Relaxed);
        self.ready
            .send_if_modified(|v| std::mem::replace(v, r) != r);
    }

    /// Follows a discovery registration: the worker reports ready only while it is registered.
    /// The current state is taken at once, so a worker whose registration has not landed yet never reports ready.
    pub fn follow_registration(&self, mut registered: watch::Receiver<bool>) {
        let r = *registered.borrow_and_update();
        self.registered.store(r, Ordering::Relaxed);
        self.publish();
        let w = self.clone();
        tokio::spawn(async move {
            while registered.changed().await.is_ok() {
                let r = *registered.borrow_and_update();
                w.registered.store(r, Ordering::Relaxed);
                w.publish();
            }
        });
    }

    /// Whether the worker can serve (false once its tensor-parallel group broke).
    pub fn ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Marks the worker unhealthy when the group reported broken.
    fn note_group(&self, healthy: bool) {
        if !healthy && self.group_ok.swap(false, Ordering::Relaxed) {
            tracing::error!("tensor-parallel group broken: reporting NOT_SERVING");
            self.publish();
        }
    }

    /// One heartbeat through the group (no-op without one); returns whether the group is whole.
    pub async fn heartbeat(&self) -> bool {
        let healthy = self
            .shell
            .call_waiting("heartbeat", |st| {
                let e = st.backend.engine_mut();
                if e.healthy()
                    && let Err(err) = e.heartbeat()
                {
                    tracing::error!("tensor-parallel heartbeat failed: {err}");
                }
                Ok(e.healthy())
            })
            .await
            .unwrap_or(false);
        self.note_group(healthy);
        self.group_ok.load(Ordering::Relaxed)
    }

    /// Checks the followers every `heartbeat` (only on a tensor-parallel leader).
    pub fn spawn_heartbeat(&self) -> Option<tokio::task::JoinHandle<()>> {
        if self.tp <= 1 {
            return None;
        }
        let w = self.clone();
        Some(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = w.shell.cancel_token().cancelled() => return,
                    _ = tokio::time::sleep(w.cfg.heartbeat) => {}
                }
                if !w.heartbeat().await {
                    return;
                }
            }
        }))
    }

    pub fn into_server(self) -> VerifierServer<Self> {
        VerifierServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), Status> {
        let vocab = self.shell.info().vocab_size;
        if tokens.iter().any(|t| *t >= vocab) {
            return Err(Status::invalid_argument(format!(
                "token ids must be below the vocabulary size {vocab}"
            )));
        }
        Ok(())
    }

    /// Runs an operation that needs forward passes as a task packed with the other sessions' steps, within the
    /// queue bound, after `gate` (admission); keeps `session`'s entry in the book like [`TargetWorker::call`].
    async fn steps<S, G>(
        &self,
        op: &'static str,
        session: String,
        gate: G,
        steps: S,
    ) -> Result<(S::Output, f64), Status>
    where
        S: Steps<Backend> + 'static,
        S::Output: Send + 'static,
        G: FnOnce(&mut State<Backend>) -> Result<bool, CoreError> + Send + 'static,
    {
        check_session(&session)?;
        let name = session.clone();
        let (out, charged, healthy) = self
            .shell
            .steps(
                op,
                &name,
                gate,
                steps,
                move |st: &mut State<Backend>, out| {
                    let charged = st.book.charged(&session);
                    if !matches!(out, Ok(Some(_))) && st.backend.half_open(&session) {
                        // An open that failed or whose caller went away mid-prefill: nobody will use its cache.
                        let _ = st.backend.release(&session);
                    }
                    if st.backend.engine().sessions().len(&session).is_ok() {
                        st.book.touch(&session);
                    } else {
                        st.book.remove(&session);
                    }
                    Ok((out, charged, st.backend.ops().healthy()))
                },
                false,
            )
            .await?;
        self.note_group(healthy);
        let out = out
            .map_err(status_from_core)?
            .ok_or_else(|| Status::internal(format!("{op} was skipped")))?;
        Ok((out, charged))
    }

    /// Runs `f` on the verifier through the scheduler, within the queue bound, keeping `session`'s entry in the
    /// book (used now, or gone with its cache).
    async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        session: String,
        f: impl FnOnce(&mut Backend) -> Result<T, CoreError> + Send + 'static,
    ) -> Result<T, Status> {
        check_session(&session)?;
        let (out, healthy) = self
            .shell
            .call(op, move |st: &mut State<Backend>| {
                let out = f(&mut st.backend);
                if st.backend.engine().sessions().len(&session).is_ok() {
                    st.book.touch(&session);
                } else {
                    st.book.remove(&session);
                }
                Ok((out, st.backend.ops().healthy()))
            })
            .await?;
        self.note_group(healthy);
        out.map_err(status_from_core)
    }
}

#[tonic::async_trait]
impl Verifier for TargetWorker {
    async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<Response<OpenSessionResponse>, Status> {
        let span = parse_proto::telemetry::call_span("target", "open", &request);
        async move {
            let r = request.into_inner();
            if self.shell.drain.is_draining() {
                return Err(Status::unavailable("the target worker is draining"));
            }
            self.check_tokens(&r.prompt)?;
            let max = self.shell.info().max_context as usize;
            if r.prompt.len() >= max {
                return Err(Status::invalid_argument(format!(
                    "prompt of {} tokens does not fit the model's context of {max}",
                    r.prompt.len()
                )));
            }
            let sampling = sampling_from(r.sampling.as_ref()).map_err(status_from_core)?;
            let session = r.session.clone();
            // The cache takes all but the last token (the pending one).
            let rows = r.prompt.len().saturating_sub(1);
            let max_sessions = self.cfg.max_sessions;
            let steps = OpenSteps::new(&session, &r.prompt, &sampling);
            let admitted = session.clone();
            let (reused, charged_ms) = self
                .steps(
                    "open",
                    session,
                    move |st| {
                        if st.book.was_released(&admitted) {
                            return Err(parse_worker::released_error(&admitted));
                        }
                        parse_worker::admit(&st.backend, &admitted, max_sessions).map(|()| true)
                    },
                    steps,
                )
                .await?;
            let rows = rows.saturating_sub(reused);
            self.shell.metrics().rows("open", rows);
            self.shell.metrics().prefix_rows("open", reused);
            tracing::Span::current().record("rows", rows);
            Ok(Response::new(OpenSessionResponse {
                charged_ms,
                cached_tokens: reused as u32,
            }))
        }
        .instrument(span)
        .await
    }

    async fn verify(
        &self,
        request: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let span = parse_proto::telemetry::call_span("target", "verify", &request);
        async move {
            let r = request.into_inner();
            self.check_tokens(&r.tokens)?;
            let plan = VerifyPlan::try_from(&r).map_err(status_from_core)?;
            let session = r.session;
            let rows = plan.tokens.len();
            let steps = VerifySteps::new(&session, plan);
            let (out, charged_ms) = self.steps("verify", session, |_| Ok(true), steps).await?;
            self.shell.metrics().rows("verify", rows);
            tracing::Span::current().record("rows", rows);
            Ok(Response::new(VerifyResponse {
                charged_ms,
                ..VerifyResponse::from(&out)
            }))
        }
        .instrument(span)
        .await
    }

    async fn extend(
        &self,
        request: Request<ExtendRequest>,
    ) -> Result<Response<ExtendResponse>, Status> {
        let span = parse_proto::telemetry::call_span("target", "extend", &request);
        async move {
            let r = request.into_inner();
            self.check_tokens(&[r.pending])?;
            if r.max_tokens == 0 || r.max_tokens > self.cfg.max_extend {
                return Err(Status::invalid_argument(format!(
                    "max_tokens must be 1..={}",
                    self.cfg.max_extend
                )));
            }
            let segment: Option<SegmenterConfig> = match &r.segment {
                None => None,
                Some(s) => Some(
                    segmenter_from(Some(s), &SegmenterConfig::default())
                        .map_err(status_from_core)?,
                ),
            };
            let session = r.session;
            let steps =
                ExtendSteps::new(&session, r.pending, r.max_tokens as usize, segment.as_ref());
            let (out, charged_ms) = self.steps("extend", session, |_| Ok(true), steps).await?;
            self.shell.metrics().rows("extend", out.tokens.len());
            tracing::Span::current().record("tokens", out.tokens.len());
            Ok(Response::new(ExtendResponse {
                tokens: out.tokens,
                pieces: out.pieces,
                charged_ms,
            }))
        }
        .instrument(span)
        .await
    }

    async fn truncate(
        &self,
        request: Request<TruncateRequest>,
    ) -> Result<Response<TruncateResponse>, Status> {
        let span = parse_proto::telemetry::call_span("target", "truncate", &request);
        async move {
            let r = request.into_inner();
            let session = r.session;
            self.call("truncate", session.clone(), move |v| {
                v.truncate(&session, r.len as usize)
            })
            .await?;
            Ok(Response::new(TruncateResponse {}))
        }
        .instrument(span)
        .await
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let span = parse_proto::telemetry::call_span("target", "release", &request);
        async move {
            let session = request.into_inner().session;
            check_session(&session)?;
            let (out, healthy) = self
                .shell
                .call("release", move |st: &mut State<Backend>| {
                    // Remembered even when this worker does not hold it: an open the caller gave up on may still
                    // be on its way here.
                    st.book.mark_released(&session);
                    let out = st.backend.release(&session);
                    Ok((out, st.backend.ops().healthy()))
                })
                .await?;
            self.note_group(healthy);
            out.map_err(status_from_core)?;
            Ok(Response::new(ReleaseResponse {}))
        }
        .instrument(span)
        .await
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        Ok(Response::new(self.model_info()))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        Ok(Response::new(self.start_drain()))
    }
}

impl parse_worker::Worker for TargetWorker {
    type Backend = Backend;

    fn shell(&self) -> &Shell<Backend> {
        &self.shell
    }
}

/// Serves a target worker on `listener` until `shutdown` resolves.
pub async fn serve(
    worker: TargetWorker,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let heartbeat = worker.spawn_heartbeat();
    let ready = worker.ready.subscribe();
    let result = parse_worker::serve(
        &worker.shell,
        worker.clone().into_server(),
        listener,
        shutdown,
        ready,
        &worker.cfg.security,
    )
    .await;
    if let Some(h) = heartbeat {
        h.abort();
    }
    // Followers leave their loop when the leader stops; a broken group has nothing to tell them.
    if let Err(e) = worker
        .shell
        .call_waiting("shutdown", |st| {
            st.backend.engine_mut().shutdown().map_err(CoreError::from)
        })
        .await
    {
        tracing::warn!("stopping the followers: {}", e.message());
    }
    result
}
