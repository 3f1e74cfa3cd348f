//! The target worker: one target model behind `parse.v1.Verifier`, alone or as rank 0 (the leader) of a
//! tensor-parallel group whose followers run `Engine::follow` (see `parse_engine::tp`).
//!
//! Every call runs in a blocking task under the engine lock. At most `max_queue` calls may wait or run at once;
//! beyond that the worker answers RESOURCE_EXHAUSTED instead of queueing without limit. Sessions idle for longer
//! than the TTL are released.
//!
//! A leader sends its followers a heartbeat every `heartbeat` when idle. Once a collective fails (a follower died
//! or hung) the group is broken: in-flight and later calls fail with UNAVAILABLE, and health turns NOT_SERVING so
//! that routers stop sending work here; the group has to be restarted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use parse_core::{Error as CoreError, SegmenterConfig, Verifier as _};
use parse_engine::Engine;
use parse_engine::backend::EngineVerifier;
use parse_proto::v1::verifier_server::{Verifier, VerifierServer};
use parse_proto::v1::{
    DrainRequest, DrainResponse, ExtendRequest, ExtendResponse, GetModelInfoRequest,
    GetModelInfoResponse, OpenSessionRequest, OpenSessionResponse, ReleaseRequest, ReleaseResponse,
    TruncateRequest, TruncateResponse, VerifyRequest, VerifyResponse,
};
use parse_proto::{check_session, plan_from, sampling_from, segmenter_from, status_from_core};
use tokio::sync::{Semaphore, watch};
use tonic::{Request, Response, Status};

/// Limits of a target worker.
#[derive(Debug, Clone)]
pub struct TargetWorkerConfig {
    /// Calls running or waiting at once.
    pub max_queue: usize,
    /// Idle sessions are released after this long.
    pub session_ttl: Duration,
    /// Tokens one `Extend` may decode.
    pub max_extend: u32,
    /// How often a tensor-parallel leader checks its followers.
    pub heartbeat: Duration,
}

impl Default for TargetWorkerConfig {
    fn default() -> Self {
        TargetWorkerConfig {
            max_queue: 256,
            session_ttl: Duration::from_secs(300),
            max_extend: 4096,
            heartbeat: Duration::from_secs(1),
        }
    }
}

struct Inner {
    verifier: EngineVerifier<Engine>,
    last_used: HashMap<String, Instant>,
}

/// The `Verifier` service.
#[derive(Clone)]
pub struct TargetWorker {
    inner: Arc<Mutex<Inner>>,
    queue: Arc<Semaphore>,
    cfg: TargetWorkerConfig,
    info: GetModelInfoResponse,
    /// Health: false once the tensor-parallel group broke, or while the discovery registration is lost.
    ready: Arc<watch::Sender<bool>>,
    group_ok: Arc<AtomicBool>,
    registered: Arc<AtomicBool>,
    /// Started by `Drain`: no new sessions.
    pub drain: parse_discovery::Drain,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TargetWorker {
    pub fn new(engine: Engine, cfg: TargetWorkerConfig) -> Result<Self, CoreError> {
        let info = parse_draft_worker::model_info(&engine)?;
        Ok(TargetWorker {
            inner: Arc::new(Mutex::new(Inner {
                verifier: EngineVerifier::new(engine),
                last_used: HashMap::new(),
            })),
            queue: Arc::new(Semaphore::new(cfg.max_queue)),
            cfg,
            info,
            ready: Arc::new(watch::channel(true).0),
            group_ok: Arc::new(AtomicBool::new(true)),
            registered: Arc::new(AtomicBool::new(true)),
            drain: parse_discovery::Drain::default(),
        })
    }

    fn publish(&self) {
        let r = self.group_ok.load(Ordering::Relaxed) && self.registered.load(Ordering::Relaxed);
        self.ready
            .send_if_modified(|v| std::mem::replace(v, r) != r);
    }

    /// Follows a discovery registration: the worker reports ready only while it is registered.
    pub fn follow_registration(&self, mut registered: watch::Receiver<bool>) {
        let w = self.clone();
        tokio::spawn(async move {
            loop {
                let r = *registered.borrow_and_update();
                w.registered.store(r, Ordering::Relaxed);
                w.publish();
                if registered.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    /// Whether the worker can serve (false once its tensor-parallel group broke).
    pub fn ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Marks the worker unhealthy when the engine's group broke.
    fn check_group(&self, g: &Inner) {
        if !g.verifier.engine().group_healthy() && self.group_ok.swap(false, Ordering::Relaxed) {
            tracing::error!("tensor-parallel group broken: reporting NOT_SERVING");
            self.publish();
        }
    }

    /// One heartbeat through the group (no-op without one); returns whether the group is whole.
    pub fn heartbeat(&self) -> bool {
        let mut g = lock(&self.inner);
        if g.verifier.engine().tensor_parallel().1 > 1
            && g.verifier.engine().group_healthy()
            && let Err(e) = g.verifier.engine_mut().ping()
        {
            tracing::error!("tensor-parallel heartbeat failed: {e}");
        }
        self.check_group(&g);
        self.group_ok.load(Ordering::Relaxed)
    }

    /// Checks the followers every `heartbeat` (only on a tensor-parallel leader).
    pub fn spawn_heartbeat(&self) -> Option<tokio::task::JoinHandle<()>> {
        let tp = lock(&self.inner).verifier.engine().tensor_parallel().1 > 1;
        if !tp {
            return None;
        }
        let w = self.clone();
        Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(w.cfg.heartbeat).await;
                let w2 = w.clone();
                match tokio::task::spawn_blocking(move || w2.heartbeat()).await {
                    Ok(true) => {}
                    _ => return,
                }
            }
        }))
    }

    pub fn into_server(self) -> VerifierServer<Self> {
        VerifierServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    /// Sessions with a KV cache (tests and admin).
    pub fn open_sessions(&self) -> usize {
        lock(&self.inner).verifier.engine().sessions().count()
    }

    /// Releases sessions idle for longer than the TTL; returns how many.
    pub fn expire_idle(&self) -> usize {
        let mut g = lock(&self.inner);
        let ttl = self.cfg.session_ttl;
        let old: Vec<String> = g
            .last_used
            .iter()
            .filter(|(_, t)| t.elapsed() > ttl)
            .map(|(s, _)| s.clone())
            .collect();
        for s in &old {
            g.last_used.remove(s);
            if let Err(e) = g.verifier.release(s) {
                tracing::warn!(session = %s, "releasing an idle session: {}", e.message);
            }
        }
        if !old.is_empty() {
            tracing::info!(count = old.len(), "released idle target sessions");
        }
        old.len()
    }

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

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), Status> {
        let vocab = self.info.vocab_size;
        if tokens.iter().any(|t| *t >= vocab) {
            return Err(Status::invalid_argument(format!(
                "token ids must be below the vocabulary size {vocab}"
            )));
        }
        Ok(())
    }

    /// Runs `f` on the verifier in a blocking task, within the queue bound, marking `session` used.
    async fn call<T: Send + 'static>(
        &self,
        session: String,
        f: impl FnOnce(&mut EngineVerifier<Engine>) -> Result<T, CoreError> + Send + 'static,
    ) -> Result<T, Status> {
        check_session(&session)?;
        let permit = self.queue.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "target worker busy: {} calls queued",
                self.cfg.max_queue
            ))
        })?;
        let inner = self.inner.clone();
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut g = lock(&inner);
            let out = f(&mut g.verifier);
            me.check_group(&g);
            if g.verifier.engine().sessions().len(&session).is_ok() {
                g.last_used.insert(session, Instant::now());
            } else {
                g.last_used.remove(&session);
            }
            out
        })
        .await
        .map_err(|e| parse_proto::status_from_join("target task", e))?
        .map_err(|e| {
            if e.kind == parse_core::ErrorKind::Internal {
                tracing::error!("{}", e.message);
            }
            status_from_core(e)
        })
    }
}

#[tonic::async_trait]
impl Verifier for TargetWorker {
    async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<Response<OpenSessionResponse>, Status> {
        let r = request.into_inner();
        if self.drain.is_draining() {
            return Err(Status::unavailable("the target worker is draining"));
        }
        self.check_tokens(&r.prompt)?;
        let max = self.info.max_context as usize;
        if r.prompt.len() >= max {
            return Err(Status::invalid_argument(format!(
                "prompt of {} tokens does not fit the model's context of {max}",
                r.prompt.len()
            )));
        }
        let sampling = sampling_from(r.sampling.as_ref()).map_err(status_from_core)?;
        let session = r.session.clone();
        self.call(session.clone(), move |v| {
            v.open(&session, &r.prompt, &sampling)
        })
        .await?;
        Ok(Response::new(OpenSessionResponse {}))
    }

    async fn verify(
        &self,
        request: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let r = request.into_inner();
        self.check_tokens(&r.tokens)?;
        let plan = plan_from(&r).map_err(status_from_core)?;
        let session = r.session;
        let out = self
            .call(session.clone(), move |v| v.verify(&session, &plan))
            .await?;
        Ok(Response::new(VerifyResponse::from(&out)))
    }

    async fn extend(
        &self,
        request: Request<ExtendRequest>,
    ) -> Result<Response<ExtendResponse>, Status> {
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
                segmenter_from(Some(s), &SegmenterConfig::default()).map_err(status_from_core)?,
            ),
        };
        let session = r.session;
        let out = self
            .call(session.clone(), move |v| {
                v.extend(&session, r.pending, r.max_tokens as usize, segment.as_ref())
            })
            .await?;
        Ok(Response::new(ExtendResponse {
            tokens: out.tokens,
            pieces: out.pieces,
        }))
    }

    async fn truncate(
        &self,
        request: Request<TruncateRequest>,
    ) -> Result<Response<TruncateResponse>, Status> {
        let r = request.into_inner();
        let session = r.session;
        self.call(session.clone(), move |v| {
            v.truncate(&session, r.len as usize)
        })
        .await?;
        Ok(Response::new(TruncateResponse {}))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let session = request.into_inner().session;
        self.call(session.clone(), move |v| v.release(&session))
            .await?;
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

/// Serves a target worker on `listener` until `shutdown` resolves.
pub async fn serve(
    worker: TargetWorker,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let reaper = worker.spawn_reaper();
    let heartbeat = worker.spawn_heartbeat();
    let ready = worker.ready.subscribe();
    let result =
        parse_proto::serve::run_reporting(worker.clone().into_server(), listener, shutdown, ready)
            .await;
    reaper.abort();
    if let Some(h) = heartbeat {
        h.abort();
    }
    // Followers leave their loop when the leader stops; a broken group has nothing to tell them.
    let mut g = lock(&worker.inner);
    if g.verifier.engine().tensor_parallel().1 > 1
        && g.verifier.engine().group_healthy()
        && let Err(e) = g.verifier.engine_mut().stop_followers()
    {
        tracing::warn!("stopping the followers: {e}");
    }
    drop(g);
    result.map_err(|e| anyhow::anyhow!(e))
}
