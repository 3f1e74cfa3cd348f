//! The draft worker: one draft model behind `parse.v1.Drafter`, in the shared worker shell (`parse-worker`): a
//! scheduler task owns the engine and packs the steps of every running draft into one forward pass per step
//! (continuous batching).
//!
//! `Draft` streams tokens one message per token (`max_tokens` 0 only prepares the session: prefill); each token is
//! one task, so the drafts of several sessions share passes and a stream whose caller is busy (verifying) blocks
//! nobody. A new `Draft` for a session supersedes the previous one (its producer stops before its next step), and a
//! dropped stream stops its producer at the next send. Sessions idle for longer than the TTL are released. At most
//! `max_streams` drafts run at once; beyond that the worker answers RESOURCE_EXHAUSTED.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tracing::Instrument;

use parse_core::{Drafter as _, Error as CoreError};
use parse_engine::Engine;
use parse_engine::drafter_verifier::{BeginSteps, DraftSteps, EngineDrafter};
use parse_proto::v1::drafter_server::{Drafter, DrafterServer};
use parse_proto::v1::{
    DistributionRequest, DistributionResponse, DraftRequest, DraftResponse, DrainRequest,
    DrainResponse, GetModelInfoRequest, GetModelInfoResponse, ReleaseRequest, ReleaseResponse,
};
use parse_proto::{check_session, sampling_from, status_from_core};
use parse_worker::{Shell, ShellConfig};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// The accessors both workers share (sessions, drain, metrics): in scope where they are called.
pub use parse_worker::Worker;

/// Limits of a draft worker.
#[derive(Debug, Clone)]
pub struct DraftWorkerConfig {
    /// Drafts streaming at once.
    pub max_streams: usize,
    /// Idle sessions are released after this long.
    pub session_ttl: Duration,
    /// Tokens one `Draft` call may ask for.
    pub max_tokens_per_draft: u32,
    /// Mutual TLS and the cluster token its callers must present.
    pub security: parse_proto::security::Security,
    /// Sessions open at once; a new one beyond it is RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
    /// Rows one packed forward pass holds at most (a prefill is cut to the room the drafts' steps leave).
    pub step_rows: usize,
    /// How a pass's time is split among the requests in it (`--charge`).
    pub charge: parse_worker::scheduler::Charge,
}

impl Default for DraftWorkerConfig {
    fn default() -> Self {
        DraftWorkerConfig {
            max_streams: 64,
            session_ttl: Duration::from_secs(300),
            max_tokens_per_draft: 1024,
            security: Default::default(),
            max_sessions: 256,
            step_rows: parse_worker::args::DEFAULT_STEP_ROWS,
            charge: Default::default(),
        }
    }
}

/// The `Drafter` service.
#[derive(Clone)]
pub struct DraftWorker {
    shell: Shell<EngineDrafter<Engine>>,
    streams: Arc<Semaphore>,
    cfg: DraftWorkerConfig,
}

impl DraftWorker {
    /// A worker that stops with `cancel` (the process's root token, or a test's).
    pub fn new(
        engine: Engine,
        cfg: DraftWorkerConfig,
        cancel: CancellationToken,
    ) -> Result<Self, CoreError> {
        let info = parse_worker::model_info(&engine, 1)?;
        let shell = Shell::new(
            EngineDrafter::new(engine),
            info,
            ShellConfig {
                // Every stream's next step, plus the unary calls of as many sessions.
                queue: 2 * cfg.max_streams.max(1),
                session_ttl: cfg.session_ttl,
                name: "draft worker",
                step_rows: cfg.step_rows,
                charge: cfg.charge,
            },
            cancel,
        );
        Ok(DraftWorker {
            shell,
            streams: Arc::new(Semaphore::new(cfg.max_streams)),
            cfg,
        })
    }

    pub fn into_server(self) -> DrafterServer<Self> {
        DrafterServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }
}

impl parse_worker::Worker for DraftWorker {
    type Backend = EngineDrafter<Engine>;

    fn shell(&self) -> &Shell<Self::Backend> {
        &self.shell
    }
}

type DraftStream = Pin<Box<dyn Stream<Item = Result<DraftResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Drafter for DraftWorker {
    type DraftStream = DraftStream;

    async fn draft(
        &self,
        request: Request<DraftRequest>,
    ) -> Result<Response<Self::DraftStream>, Status> {
        // The span covers the begin (prefill) and the stream's steps; `tokens` counts what was sent.
        let span = parse_proto::telemetry::call_span("draft", "draft", &request);
        let r = request.into_inner();
        check_session(&r.session)?;
        if r.context.is_empty() {
            return Err(Status::invalid_argument("empty context"));
        }
        if r.max_tokens > self.cfg.max_tokens_per_draft {
            return Err(Status::invalid_argument(format!(
                "max_tokens must be 0..={} (0: prepare the session for the context, stream nothing)",
                self.cfg.max_tokens_per_draft
            )));
        }
        let vocab = self.shell.info().vocab_size;
        if r.context.iter().any(|t| *t >= vocab) {
            return Err(Status::invalid_argument(format!(
                "token ids must be below the vocabulary size {vocab}"
            )));
        }
        let sampling = sampling_from(r.sampling.as_ref()).map_err(status_from_core)?;
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "draft worker busy: {} drafts streaming",
                self.cfg.max_streams
            ))
        })?;
        let draining = self.shell.drain.is_draining();
        let max_sessions = self.cfg.max_sessions;
        let session = r.session.clone();
        // Begin (prefill may take a while): a new epoch supersedes the session's running draft.
        let epoch = Arc::new(AtomicU64::new(0));
        let gate = {
            let (epoch, session) = (epoch.clone(), session.clone());
            move |st: &mut parse_worker::State<EngineDrafter<Engine>>| {
                if draining && !st.book.contains(&session) {
                    return Err(CoreError::new(
                        parse_core::ErrorKind::Unavailable,
                        "the draft worker is draining",
                    ));
                }
                if st.book.was_released(&session) {
                    return Err(parse_worker::released_error(&session));
                }
                parse_worker::admit(&st.backend, &session, max_sessions)?;
                epoch.store(st.book.next_epoch(&session), Ordering::Relaxed);
                Ok(true)
            }
        };
        let begin = BeginSteps::new(&session, &r.context, &sampling);
        let charged_to = session.clone();
        let charged_ms = self
            .shell
            .steps(
                "begin",
                &session,
                gate,
                begin,
                move |st, out| out.map(|_| st.book.charged(&charged_to)),
                false,
            )
            .instrument(span.clone())
            .await?;
        let epoch = epoch.load(Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<Result<DraftResponse, Status>>(4);
        if r.max_tokens == 0 {
            // Prefill only: one message with no tokens, which carries what the prefill was charged.
            let m = DraftResponse {
                charged_ms,
                ..DraftResponse::default()
            };
            tx.try_send(Ok(m)).map_err(|_| {
                Status::internal("the draft stream closed before its first message")
            })?;
            return Ok(Response::new(Box::pin(ReceiverStream::new(rx))));
        }
        let session = r.session;
        let max = r.max_tokens as usize;
        let shell = self.shell.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                let mut sent = 0usize;
                while sent < max && !tx.is_closed() {
                    let s = session.clone();
                    let gate = {
                        let s = s.clone();
                        move |st: &mut parse_worker::State<EngineDrafter<Engine>>| {
                            // Superseded by a newer draft, or released: nothing more to send.
                            if st.book.epoch(&s) != Some(epoch) {
                                return Ok(false);
                            }
                            st.book.touch(&s);
                            Ok(true)
                        }
                    };
                    let charged_to = s.clone();
                    let step = shell
                        .steps(
                            "draft",
                            &s,
                            gate,
                            DraftSteps::new(&s, 1),
                            move |st, out| {
                                let charged = st.book.charged(&charged_to);
                                Ok(out?.map(|c| (c, charged)))
                            },
                            true,
                        )
                        .await;
                    match step {
                        Ok(Some((c, charged_ms))) => {
                            sent += c.tokens.len();
                            tracing::Span::current().record("tokens", sent);
                            shell.metrics().rows("draft", c.tokens.len());
                            let done = c.done || c.tokens.is_empty();
                            let m = DraftResponse {
                                tokens: c.tokens,
                                pieces: c.pieces,
                                probs: c.probs,
                                done,
                                charged_ms,
                            };
                            if tx.send(Ok(m)).await.is_err() || done {
                                return;
                            }
                        }
                        Ok(None) => return,
                        Err(status) => {
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn distribution(
        &self,
        request: Request<DistributionRequest>,
    ) -> Result<Response<DistributionResponse>, Status> {
        let span = parse_proto::telemetry::call_span("draft", "distribution", &request);
        async move {
            let r = request.into_inner();
            check_session(&r.session)?;
            let d = self
                .shell
                .call("distribution", move |st| {
                    st.backend.distribution(&r.session, r.index as usize)
                })
                .await?;
            Ok(Response::new(DistributionResponse {
                tokens: d.iter().map(|x| x.0).collect(),
                probs: d.iter().map(|x| x.1).collect(),
            }))
        }
        .instrument(span)
        .await
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let span = parse_proto::telemetry::call_span("draft", "release", &request);
        async move {
            let r = request.into_inner();
            check_session(&r.session)?;
            self.shell
                .call_waiting("release", move |st| {
                    // Remembered even when this worker does not hold it: a draft its caller gave up on may still
                    // be on its way here.
                    st.book.mark_released(&r.session);
                    st.backend.release(&r.session)
                })
                .await?;
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

/// Serves a draft worker on `listener` until `shutdown` resolves.
pub async fn serve(
    worker: DraftWorker,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (_ready, rx) = tokio::sync::watch::channel(true);
    serve_reporting(worker, listener, shutdown, rx).await
}

/// Like [`serve`], reporting healthy only while `ready` holds true (e.g. while registered in discovery).
pub async fn serve_reporting(
    worker: DraftWorker,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ready: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let (shell, security) = (worker.shell.clone(), worker.cfg.security.clone());
    parse_worker::serve(
        &shell,
        worker.into_server(),
        listener,
        shutdown,
        ready,
        &security,
    )
    .await
}
