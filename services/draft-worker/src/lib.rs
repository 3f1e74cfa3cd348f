//! The draft worker: one draft model behind `parse.v1.Drafter`.
//!
//! `Draft` streams tokens one message per token (`max_tokens` 0 only prepares the session: prefill); the engine lock is taken per token, so a stream whose caller is busy
//! (verifying) blocks nobody. A new `Draft` for a session supersedes the previous one (its producer stops before its
//! next step), and a dropped stream stops its producer at the next send. Sessions idle for longer than the TTL are
//! released. At most `max_streams` drafts run at once; beyond that the worker answers RESOURCE_EXHAUSTED.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use parse_core::{Drafter as _, Error as CoreError};
use parse_engine::Engine;
use parse_engine::backend::EngineDrafter;
use parse_proto::v1::drafter_server::{Drafter, DrafterServer};
use parse_proto::v1::{
    DistributionRequest, DistributionResponse, DraftRequest, DraftResponse, DrainRequest,
    DrainResponse, GetModelInfoRequest, GetModelInfoResponse, ReleaseRequest, ReleaseResponse,
};
use parse_proto::{check_session, sampling_from, status_from_core};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Limits of a draft worker.
#[derive(Debug, Clone)]
pub struct DraftWorkerConfig {
    /// Drafts streaming at once.
    pub max_streams: usize,
    /// Idle sessions are released after this long.
    pub session_ttl: Duration,
    /// Tokens one `Draft` call may ask for.
    pub max_tokens_per_draft: u32,
}

impl Default for DraftWorkerConfig {
    fn default() -> Self {
        DraftWorkerConfig {
            max_streams: 64,
            session_ttl: Duration::from_secs(300),
            max_tokens_per_draft: 1024,
        }
    }
}

struct Inner {
    drafter: EngineDrafter<Engine>,
    /// Per session: the epoch of its current draft (a newer `Draft` call stops older producers) and last use.
    sessions: HashMap<String, (u64, Instant)>,
}

/// The `Drafter` service.
#[derive(Clone)]
pub struct DraftWorker {
    inner: Arc<Mutex<Inner>>,
    streams: Arc<Semaphore>,
    cfg: DraftWorkerConfig,
    info: GetModelInfoResponse,
    /// Started by `Drain`: no new sessions.
    pub drain: parse_discovery::Drain,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic while holding the lock is a bug, but the data (sessions, caches) stays usable: keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the workers say about their model.
pub fn model_info(engine: &Engine) -> Result<GetModelInfoResponse, CoreError> {
    let tok = engine.tokenizer();
    let (layout, default_system) = match tok.template() {
        parse_engine::ChatTemplate::ChatMl { default_system } => {
            ("chatml", default_system.clone().unwrap_or_default())
        }
        parse_engine::ChatTemplate::Llama3 => ("llama3", String::new()),
        parse_engine::ChatTemplate::Mistral => ("mistral", String::new()),
        parse_engine::ChatTemplate::Plain => ("plain", String::new()),
    };
    let cfg = engine.model().config();
    Ok(GetModelInfoResponse {
        model: engine
            .path()
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        vocab_size: cfg.vocab_size as u32,
        max_context: cfg.max_context as u32,
        tokenizer_json: tok.to_portable().map_err(CoreError::from)?,
        chat_layout: layout.to_string(),
        default_system,
        eos_ids: tok.eos_ids().to_vec(),
        tp_size: engine.tensor_parallel().1 as u32,
    })
}

impl DraftWorker {
    pub fn new(engine: Engine, cfg: DraftWorkerConfig) -> Result<Self, CoreError> {
        let info = model_info(&engine)?;
        Ok(DraftWorker {
            inner: Arc::new(Mutex::new(Inner {
                drafter: EngineDrafter::new(engine),
                sessions: HashMap::new(),
            })),
            streams: Arc::new(Semaphore::new(cfg.max_streams)),
            cfg,
            info,
            drain: parse_discovery::Drain::default(),
        })
    }

    pub fn into_server(self) -> DrafterServer<Self> {
        DrafterServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    /// Sessions holding draft state (tests and admin).
    pub fn open_sessions(&self) -> usize {
        lock(&self.inner).drafter.sessions().count()
    }

    /// Releases sessions idle for longer than the TTL; returns how many.
    pub fn expire_idle(&self) -> usize {
        let mut g = lock(&self.inner);
        let ttl = self.cfg.session_ttl;
        let old: Vec<String> = g
            .sessions
            .iter()
            .filter(|(_, (_, t))| t.elapsed() > ttl)
            .map(|(s, _)| s.clone())
            .collect();
        for s in &old {
            g.sessions.remove(s);
            if let Err(e) = g.drafter.release(s) {
                tracing::warn!(session = %s, "releasing an idle session: {}", e.message);
            }
        }
        if !old.is_empty() {
            tracing::info!(count = old.len(), "released idle draft sessions");
        }
        old.len()
    }

    /// Runs [`DraftWorker::expire_idle`] every quarter TTL until the process ends.
    pub fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let w = self.clone();
        tokio::spawn(async move {
            let every = (w.cfg.session_ttl / 4).max(Duration::from_millis(50));
            loop {
                tokio::time::sleep(every).await;
                let w2 = w.clone();
                let _ = tokio::task::spawn_blocking(move || w2.expire_idle()).await;
            }
        })
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
        let r = request.into_inner();
        check_session(&r.session)?;
        if self.drain.is_draining() && !lock(&self.inner).sessions.contains_key(&r.session) {
            return Err(Status::unavailable("the draft worker is draining"));
        }
        if r.context.is_empty() {
            return Err(Status::invalid_argument("empty context"));
        }
        if r.max_tokens > self.cfg.max_tokens_per_draft {
            return Err(Status::invalid_argument(format!(
                "max_tokens must be 0..={} (0: prepare the session for the context, stream nothing)",
                self.cfg.max_tokens_per_draft
            )));
        }
        let vocab = self.info.vocab_size;
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
        let inner = self.inner.clone();
        // Begin under the lock, in a blocking task (prefill may take a while).
        let session = r.session.clone();
        let epoch = tokio::task::spawn_blocking({
            let inner = inner.clone();
            move || -> Result<u64, Status> {
                let mut g = lock(&inner);
                let e = g
                    .sessions
                    .entry(session.clone())
                    .or_insert((0, Instant::now()));
                e.0 += 1;
                e.1 = Instant::now();
                let epoch = e.0;
                g.drafter
                    .begin(&session, &r.context, &sampling)
                    .map_err(status_from_core)?;
                Ok(epoch)
            }
        })
        .await
        .map_err(|e| parse_proto::status_from_join("draft task", e))??;
        let (tx, rx) = mpsc::channel::<Result<DraftResponse, Status>>(4);
        if r.max_tokens == 0 {
            // Prefill only: the stream ends at once.
            return Ok(Response::new(Box::pin(ReceiverStream::new(rx))));
        }
        let session = r.session;
        let max = r.max_tokens as usize;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut sent = 0usize;
            while sent < max {
                let chunk = {
                    let mut g = lock(&inner);
                    match g.sessions.get_mut(&session) {
                        Some(e) if e.0 == epoch => e.1 = Instant::now(),
                        // Superseded by a newer draft, or released.
                        _ => return,
                    }
                    g.drafter.next(&session, 1)
                };
                let msg = match chunk {
                    Ok(c) => {
                        sent += c.tokens.len();
                        let done = c.done || c.tokens.is_empty();
                        let m = DraftResponse {
                            tokens: c.tokens,
                            pieces: c.pieces,
                            probs: c.probs,
                            done,
                        };
                        if tx.blocking_send(Ok(m)).is_err() || done {
                            return;
                        }
                        continue;
                    }
                    Err(e) => Err(status_from_core(e)),
                };
                let _ = tx.blocking_send(msg);
                return;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn distribution(
        &self,
        request: Request<DistributionRequest>,
    ) -> Result<Response<DistributionResponse>, Status> {
        let r = request.into_inner();
        check_session(&r.session)?;
        let inner = self.inner.clone();
        let d = tokio::task::spawn_blocking(move || {
            lock(&inner)
                .drafter
                .distribution(&r.session, r.index as usize)
        })
        .await
        .map_err(|e| parse_proto::status_from_join("draft task", e))?
        .map_err(status_from_core)?;
        Ok(Response::new(DistributionResponse {
            tokens: d.iter().map(|x| x.0).collect(),
            probs: d.iter().map(|x| x.1).collect(),
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let r = request.into_inner();
        check_session(&r.session)?;
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let mut g = lock(&inner);
            g.sessions.remove(&r.session);
            g.drafter.release(&r.session)
        })
        .await
        .map_err(|e| parse_proto::status_from_join("draft task", e))?
        .map_err(status_from_core)?;
        Ok(Response::new(ReleaseResponse {}))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        if self.drain.start() {
            tracing::info!("drain requested");
        }
        Ok(Response::new(DrainResponse {
            open_sessions: self.open_sessions() as u32,
        }))
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
    let reaper = worker.spawn_reaper();
    let result =
        parse_proto::serve::run_reporting(worker.into_server(), listener, shutdown, ready).await;
    reaper.abort();
    result.map_err(|e| anyhow::anyhow!(e))
}
