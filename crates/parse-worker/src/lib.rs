//! The shell both workers share. A worker is a model backend ([`Backend`]: the target's `EngineVerifier`, the
//! draft's `EngineDrafter`) owned by one [`Scheduler`] task, plus what surrounds it: the book of its sessions (last
//! use, and the epoch of a session's current draft), the reaper that releases idle sessions, the drain, the model
//! information it publishes, and a bound on queued work.
//!
//! Nothing locks the engine: every operation is a command sent to the scheduler over a bounded channel, answered
//! over a `oneshot`. Commands run one at a time, in arrival order (batches of one; the batching scheduler packs
//! them). A command whose caller has gone (a cancelled request: the oneshot receiver dropped) is skipped, so a
//! cancelled request stops its work on the worker at the next command.

pub mod info;
pub mod metrics;
pub mod scheduler;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parse_core::Error as CoreError;
use parse_engine::EngineOps;
use parse_engine::backend::{EngineDrafter, EngineVerifier};
use parse_proto::v1::GetModelInfoResponse;
use tokio_util::sync::CancellationToken;
use tonic::Status;

pub use info::model_info;
pub use metrics::{WorkerMetrics, serve_metrics, spawn_metrics};
pub use scheduler::{Scheduler, SchedulerError};

/// A model backend the shell can own: it releases sessions and counts them.
pub trait Backend: Send + 'static {
    /// Releases a session's state (its KV cache); unknown sessions are an error.
    fn release(&mut self, session: &str) -> Result<(), CoreError>;
    /// Sessions holding state.
    fn open_sessions(&self) -> usize;
    /// Whether `session` holds state.
    fn has_session(&self, session: &str) -> bool;
    /// KV cache bytes held by sessions, and the capacity.
    fn kv_bytes(&self) -> (usize, usize);
}

impl<E: EngineOps + Send + 'static> Backend for EngineVerifier<E> {
    fn release(&mut self, session: &str) -> Result<(), CoreError> {
        parse_core::Verifier::release(self, session)
    }
    fn open_sessions(&self) -> usize {
        self.engine().sessions().count()
    }
    fn has_session(&self, session: &str) -> bool {
        self.engine().sessions().len(session).is_ok()
    }
    fn kv_bytes(&self) -> (usize, usize) {
        let s = self.engine().sessions();
        (s.used(), s.capacity())
    }
}

impl<E: EngineOps + Send + 'static> Backend for EngineDrafter<E> {
    fn release(&mut self, session: &str) -> Result<(), CoreError> {
        parse_core::Drafter::release(self, session)
    }
    fn open_sessions(&self) -> usize {
        self.sessions().count()
    }
    fn has_session(&self, session: &str) -> bool {
        self.sessions().any(|s| s == session)
    }
    fn kv_bytes(&self) -> (usize, usize) {
        let s = self.engine().sessions();
        (s.used(), s.capacity())
    }
}

/// Admits `session` to `backend`: a session it already holds always, a new one while fewer than `max` are open;
/// beyond that RESOURCE_EXHAUSTED (the router takes the request to another worker). Run inside the scheduler, so
/// that concurrent opens cannot pass the cap together.
pub fn admit<B: Backend>(backend: &B, session: &str, max: usize) -> Result<(), CoreError> {
    if backend.has_session(session) || backend.open_sessions() < max {
        return Ok(());
    }
    Err(CoreError::new(
        parse_core::ErrorKind::ResourceExhausted,
        format!("{max} sessions open, the most this worker holds"),
    ))
}

/// Per session: the epoch of its current draft (a newer draft supersedes older producers) and its last use.
#[derive(Debug, Default)]
pub struct SessionBook {
    entries: HashMap<String, (u64, Instant)>,
}

impl SessionBook {
    /// Marks `session` used now; returns its epoch.
    pub fn touch(&mut self, session: &str) -> u64 {
        let e = self
            .entries
            .entry(session.to_string())
            .or_insert((0, Instant::now()));
        e.1 = Instant::now();
        e.0
    }

    /// Starts a new epoch for `session` (a new draft that supersedes the running one); returns it.
    pub fn next_epoch(&mut self, session: &str) -> u64 {
        let e = self
            .entries
            .entry(session.to_string())
            .or_insert((0, Instant::now()));
        e.0 += 1;
        e.1 = Instant::now();
        e.0
    }

    /// The current epoch of `session`, if it is in the book.
    pub fn epoch(&self, session: &str) -> Option<u64> {
        self.entries.get(session).map(|e| e.0)
    }

    pub fn contains(&self, session: &str) -> bool {
        self.entries.contains_key(session)
    }

    pub fn remove(&mut self, session: &str) {
        self.entries.remove(session);
    }

    /// Sessions unused for longer than `ttl`.
    pub fn idle(&self, ttl: Duration) -> Vec<String> {
        self.entries
            .iter()
            .filter(|(_, (_, t))| t.elapsed() > ttl)
            .map(|(s, _)| s.clone())
            .collect()
    }
}

/// What the scheduler owns: the backend and the book of its sessions.
pub struct State<B> {
    pub backend: B,
    pub book: SessionBook,
}

/// The shell's settings.
#[derive(Debug, Clone)]
pub struct ShellConfig {
    /// Commands queued at once; beyond that a call answers RESOURCE_EXHAUSTED.
    pub queue: usize,
    /// Idle sessions are released after this long.
    pub session_ttl: Duration,
    /// Names the worker in logs and errors ("draft worker", "target worker").
    pub name: &'static str,
}

/// A worker's shell around backend `B`. Cheap to clone.
pub struct Shell<B: Backend> {
    scheduler: Scheduler<State<B>>,
    cfg: ShellConfig,
    info: Arc<GetModelInfoResponse>,
    open: Arc<AtomicUsize>,
    metrics: Arc<WorkerMetrics>,
    /// Started by `Drain`: no new sessions.
    pub drain: parse_discovery::Drain,
    cancel: CancellationToken,
}

impl<B: Backend> Clone for Shell<B> {
    fn clone(&self) -> Self {
        Shell {
            scheduler: self.scheduler.clone(),
            cfg: self.cfg.clone(),
            info: self.info.clone(),
            open: self.open.clone(),
            metrics: self.metrics.clone(),
            drain: self.drain.clone(),
            cancel: self.cancel.clone(),
        }
    }
}

impl<B: Backend> Shell<B> {
    /// Starts the scheduler task that owns `backend`. It stops when `cancel` is cancelled or every handle is gone.
    pub fn new(
        backend: B,
        info: GetModelInfoResponse,
        cfg: ShellConfig,
        cancel: CancellationToken,
    ) -> Self {
        let state = State {
            backend,
            book: SessionBook::default(),
        };
        Shell {
            scheduler: Scheduler::spawn(cfg.name, state, cfg.queue.max(1), cancel.clone()),
            cfg,
            info: Arc::new(info),
            open: Arc::new(AtomicUsize::new(0)),
            metrics: Arc::new(WorkerMetrics::new()),
            drain: parse_discovery::Drain::default(),
            cancel,
        }
    }

    /// What the worker says about its model.
    pub fn info(&self) -> &GetModelInfoResponse {
        &self.info
    }

    /// The process's (or the test's) cancellation token this worker stops with.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// The worker's Prometheus metrics.
    pub fn metrics(&self) -> &Arc<WorkerMetrics> {
        &self.metrics
    }

    /// Sessions holding state, as of the last command.
    pub fn open_sessions(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn job<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State<B>) -> Result<T, CoreError> + Send + 'static,
    ) -> impl FnOnce(&mut State<B>) -> Result<T, CoreError> + Send + 'static {
        let open = self.open.clone();
        let metrics = self.metrics.clone();
        // Made as the call is queued; dropped when it starts, or with the call if it never runs.
        let waiting = metrics.queued();
        move |st: &mut State<B>| {
            drop(waiting);
            let t = Instant::now();
            let out = f(st);
            metrics.step(op, t.elapsed().as_secs_f64());
            let n = st.backend.open_sessions();
            open.store(n, Ordering::Relaxed);
            let (used, capacity) = st.backend.kv_bytes();
            metrics.state(n, used, capacity);
            out
        }
    }

    /// Runs `f` (operation `op`, the metrics' label) on the backend, or answers RESOURCE_EXHAUSTED at once when the
    /// queue is full.
    pub async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State<B>) -> Result<T, CoreError> + Send + 'static,
    ) -> Result<T, Status> {
        let r = self.scheduler.try_call(self.job(op, f)).await;
        self.answer(r)
    }

    /// Runs `f` on the backend, waiting for room in the queue (a running stream's next step).
    pub async fn call_waiting<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State<B>) -> Result<T, CoreError> + Send + 'static,
    ) -> Result<T, Status> {
        let r = self.scheduler.call(self.job(op, f)).await;
        self.answer(r)
    }

    fn answer<T>(&self, r: Result<Result<T, CoreError>, SchedulerError>) -> Result<T, Status> {
        if matches!(r, Err(SchedulerError::Full)) {
            self.metrics.refused();
        }
        match r {
            Ok(out) => out.map_err(parse_proto::status_from_core),
            Err(SchedulerError::Full) => Err(Status::resource_exhausted(format!(
                "{} busy: {} calls queued",
                self.cfg.name, self.cfg.queue
            ))),
            Err(SchedulerError::Stopped) => Err(Status::unavailable(format!(
                "{}: the server is shutting down",
                self.cfg.name
            ))),
        }
    }

    /// Releases sessions idle for longer than the TTL; returns how many.
    pub async fn expire_idle(&self) -> usize {
        let ttl = self.cfg.session_ttl;
        let name = self.cfg.name;
        self.call_waiting("expire", move |st| {
            let old = st.book.idle(ttl);
            for s in &old {
                st.book.remove(s);
                if st.backend.has_session(s)
                    && let Err(e) = st.backend.release(s)
                {
                    tracing::warn!(session = %s, "releasing an idle session: {}", e.message);
                }
            }
            if !old.is_empty() {
                tracing::info!(count = old.len(), "{name}: released idle sessions");
            }
            Ok(old.len())
        })
        .await
        .unwrap_or(0)
    }

    /// Runs [`Shell::expire_idle`] every quarter TTL until the worker is cancelled.
    pub fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let w = self.clone();
        tokio::spawn(async move {
            let every = (w.cfg.session_ttl / 4).max(Duration::from_millis(50));
            loop {
                tokio::select! {
                    _ = w.cancel.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                w.expire_idle().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_book_keeps_epochs_and_finds_idle_sessions() {
        let mut b = SessionBook::default();
        assert_eq!(b.touch("a"), 0);
        assert_eq!(b.next_epoch("a"), 1);
        assert_eq!(b.next_epoch("a"), 2);
        assert_eq!(b.epoch("a"), Some(2));
        assert_eq!(b.epoch("b"), None);
        assert!(b.idle(Duration::from_secs(60)).is_empty());
        std::thread::sleep(Duration::from_millis(20));
        b.touch("b");
        assert_eq!(b.idle(Duration::from_millis(10)), vec!["a".to_string()]);
        b.remove("a");
        assert!(!b.contains("a"));
    }
}
