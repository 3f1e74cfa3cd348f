//! The shell both workers share. A worker is a model backend ([`Backend`]: the target's `EngineVerifier`, the
//! draft's `EngineDrafter`) owned by one [`Scheduler`] task, plus what surrounds it: the book of its sessions (last
//! use, and the epoch of a session's current draft), the reaper that releases idle sessions, the drain, the model
//! information it publishes, and a bound on queued work.
//!
//! Nothing locks the engine: every operation is sent to the scheduler over a bounded channel and answered over a
//! `oneshot`. Operations that need forward passes run as tasks ([`Shell::steps`]), packed with the other sessions'
//! steps into one pass per step (continuous batching, see [`scheduler`]); the rest run as commands
//! ([`Shell::call`]). Work whose caller has gone (a cancelled request: the oneshot receiver dropped) is skipped or
//! stopped at its next step.

pub mod args;
pub mod info;
pub mod metrics;
pub mod scheduler;
pub mod worker;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parse_core::Error as CoreError;
use parse_engine::EngineOps;
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_engine::steps::{Forward, Next, Steps};
use parse_engine::{Block, Logits};
use parse_proto::v1::GetModelInfoResponse;
use tokio_util::sync::CancellationToken;
use tonic::Status;

pub use info::model_info;
pub use metrics::{WorkerMetrics, serve_metrics, spawn_metrics};
pub use scheduler::{Packing, Scheduler, SchedulerError, StepShape, Task};
pub use worker::{Worker, serve};

/// A model backend the shell can own: it runs blocks (one step of many sessions at once), releases sessions and
/// counts them.
pub trait Backend: Forward + Send + 'static {
    /// Releases a session's state (its KV cache); unknown sessions are an error.
    fn release(&mut self, session: &str) -> Result<(), CoreError>;
    /// Sessions holding state.
    fn open_sessions(&self) -> usize;
    /// Whether `session` holds state.
    fn has_session(&self, session: &str) -> bool;
    /// KV cache bytes held by sessions, and the capacity.
    fn kv_bytes(&self) -> (usize, usize);
    /// Device bytes the KV cache takes as allocated, where that differs from the bytes held (the candle backend's
    /// KV pool); `None` where it does not.
    fn kv_device_bytes(&self) -> Option<usize> {
        None
    }
    /// Bytes of the prompts kept for prefix caching, beside the sessions' (`SessionStore::prefix_bytes`).
    fn prefix_bytes(&self) -> usize {
        0
    }
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
    fn kv_device_bytes(&self) -> Option<usize> {
        self.engine().kv_device_bytes()
    }
    fn prefix_bytes(&self) -> usize {
        self.engine().sessions().prefix_bytes().0
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
    fn kv_device_bytes(&self) -> Option<usize> {
        self.engine().kv_device_bytes()
    }
    fn prefix_bytes(&self) -> usize {
        self.engine().sessions().prefix_bytes().0
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

/// Released session ids a worker remembers at most (see [`SessionBook::mark_released`]); past it the oldest go first.
pub const RELEASED_KEPT: usize = 16_384;

/// The answer to a call that would create a session released here (see [`SessionBook::was_released`]):
/// ALREADY_EXISTS, as the id is spent.
pub fn released_error(session: &str) -> CoreError {
    CoreError::new(
        parse_core::ErrorKind::AlreadyExists,
        format!(
            "session `{session}` was released on this worker before this call reached it (a call its caller gave \
             up on); a new session needs a new id"
        ),
    )
}

/// Per session: the epoch of its current draft (a newer draft supersedes older producers), its last use, and the
/// worker time charged to it; and the ids of sessions released here.
#[derive(Debug, Default)]
pub struct SessionBook {
    entries: HashMap<String, (u64, Instant)>,
    charged: HashMap<String, f64>,
    /// Ids released by a `Release` call, oldest first, with when. The router never uses a session id on a worker
    /// again after releasing it there (ids are unique per request, and a request does not go back to a worker it
    /// left), so a call that would create one of these sessions is a stale one: a call the router gave up on (its
    /// worker was stopped, or the connection dropped) that arrives after the release the router sent on leaving.
    /// Refusing it keeps a session nobody will use from holding KV until its TTL.
    released: VecDeque<(Instant, String)>,
    released_ids: HashSet<String>,
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
        self.charged.remove(session);
    }

    /// Removes `session` and remembers that it was released (whether or not this worker held it): see
    /// [`SessionBook::was_released`]. Sessions the reaper expires are only removed: a router that comes back to one
    /// opens it again under the same id.
    pub fn mark_released(&mut self, session: &str) {
        self.remove(session);
        if self.released_ids.insert(session.to_string()) {
            self.released
                .push_back((Instant::now(), session.to_string()));
        }
        while self.released.len() > RELEASED_KEPT {
            if let Some((_, s)) = self.released.pop_front() {
                self.released_ids.remove(&s);
            }
        }
    }

    /// Whether `session` was released here (within the TTL the reaper prunes with): a call that would create it
    /// again is refused with [`released_error`].
    pub fn was_released(&self, session: &str) -> bool {
        self.released_ids.contains(session)
    }

    /// Adds `ms` of forward-pass time to what `session` was charged (see [`Task::charge`]).
    pub fn charge(&mut self, session: &str, ms: f64) {
        *self.charged.entry(session.to_string()).or_default() += ms;
    }

    /// The forward-pass time charged to `session` since it was opened here, in ms: its share of every pass it
    /// was in. Replies carry it, so that a request can tell what it takes from the worker.
    pub fn charged(&self, session: &str) -> f64 {
        self.charged.get(session).copied().unwrap_or(0.0)
    }

    /// Forgets the charges of sessions that are not in the book (a task that ended after its session was
    /// released), and released ids older than `ttl`; the reaper runs it.
    pub fn prune(&mut self, ttl: Duration) {
        let entries = &self.entries;
        self.charged.retain(|s, _| entries.contains_key(s));
        while let Some((t, _)) = self.released.front()
            && t.elapsed() > ttl
        {
            if let Some((_, s)) = self.released.pop_front() {
                self.released_ids.remove(&s);
            }
        }
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

impl<B: Forward> Forward for State<B> {
    fn forward_blocks(&mut self, blocks: &[Block]) -> Vec<parse_engine::Result<Logits>> {
        self.backend.forward_blocks(blocks)
    }
}

/// An operation on the backend behind a gate that sees the whole state (the book: epochs, draining) and runs at
/// its first step, in the same scheduler turn as the operation's start: `Ok(true)` runs the operation, `Ok(false)`
/// skips it (its output is `None`), an error fails it. Admission checks go here, so that concurrent opens cannot
/// pass a cap together.
pub struct Gated<F, S> {
    gate: Option<F>,
    steps: S,
}

impl<F, S> Gated<F, S> {
    pub fn new(gate: F, steps: S) -> Self {
        Gated {
            gate: Some(gate),
            steps,
        }
    }
}

impl<B, F, S> Steps<State<B>> for Gated<F, S>
where
    F: FnOnce(&mut State<B>) -> Result<bool, CoreError> + Send,
    S: Steps<B>,
{
    type Output = Option<S::Output>;
    fn step(
        &mut self,
        st: &mut State<B>,
        input: Option<parse_engine::Result<Logits>>,
        room: usize,
    ) -> Result<Next<Self::Output>, CoreError> {
        if let Some(gate) = self.gate.take()
            && !gate(st)?
        {
            return Ok(Next::Done(None));
        }
        Ok(match self.steps.step(&mut st.backend, input, room)? {
            Next::Forward(block) => Next::Forward(block),
            Next::Done(out) => Next::Done(Some(out)),
        })
    }
}

/// An operation of the shell's backend as a scheduler task: it records its metrics, hands its result to `finish`
/// (which sees the whole state: the book) and answers the caller.
struct ShellTask<B: Backend, S: Steps<State<B>>, F, T> {
    op: &'static str,
    session: String,
    steps: S,
    finish: Option<F>,
    reply: Option<tokio::sync::oneshot::Sender<Result<T, CoreError>>>,
    waiting: Option<metrics::Queued>,
    started: Option<Instant>,
    /// Its share of the passes it was in so far (booked to its session when it ends).
    charged: f64,
    open: Arc<AtomicUsize>,
    metrics: Arc<WorkerMetrics>,
    _backend: std::marker::PhantomData<fn(B)>,
}

impl<B, S, F, T> ShellTask<B, S, F, T>
where
    B: Backend,
    S: Steps<State<B>>,
    F: FnOnce(&mut State<B>, Result<S::Output, CoreError>) -> Result<T, CoreError>,
{
    fn complete(&mut self, st: &mut State<B>, out: Result<S::Output, CoreError>) -> Option<T> {
        let finish = self.finish.take()?;
        st.book
            .charge(&self.session, std::mem::take(&mut self.charged));
        let out = finish(st, out);
        if let Some(t) = self.started {
            self.metrics.step(self.op, t.elapsed().as_secs_f64());
        }
        let n = st.backend.open_sessions();
        self.open.store(n, Ordering::Relaxed);
        let (used, capacity) = st.backend.kv_bytes();
        self.metrics.state(n, used, capacity);
        self.metrics.kv_device_bytes(st.backend.kv_device_bytes());
        self.metrics.prefix_bytes(st.backend.prefix_bytes());
        match (out, self.reply.take()) {
            (out, Some(reply)) => {
                let _ = reply.send(out);
                None
            }
            (Ok(t), None) => Some(t),
            (Err(_), None) => None,
        }
    }
}

impl<B, S, F, T> Task<State<B>> for ShellTask<B, S, F, T>
where
    B: Backend,
    S: Steps<State<B>> + 'static,
    F: FnOnce(&mut State<B>, Result<S::Output, CoreError>) -> Result<T, CoreError> + Send + 'static,
    T: Send + 'static,
{
    fn advance(
        &mut self,
        st: &mut State<B>,
        input: Option<parse_engine::Result<Logits>>,
        room: usize,
    ) -> Option<Block> {
        self.waiting = None;
        self.started.get_or_insert_with(Instant::now);
        match self.steps.step(st, input, room) {
            Ok(Next::Forward(block)) => Some(block),
            Ok(Next::Done(out)) => {
                self.complete(st, Ok(out));
                None
            }
            Err(e) => {
                self.complete(st, Err(e));
                None
            }
        }
    }

    fn session(&self) -> &str {
        &self.session
    }

    fn abandoned(&self) -> bool {
        self.reply.as_ref().is_none_or(|r| r.is_closed())
    }

    fn charge(&mut self, ms: f64) {
        self.charged += ms;
    }

    fn cancel(&mut self, st: &mut State<B>) {
        self.reply = None;
        self.complete(
            st,
            Err(CoreError::new(
                parse_core::ErrorKind::Cancelled,
                "the caller has gone",
            )),
        );
    }
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
    /// Rows one packed forward pass holds at most (see [`scheduler`]).
    pub step_rows: usize,
    /// How a pass's time is split among the requests in it ([`scheduler::Charge`]).
    pub charge: scheduler::Charge,
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
        let metrics = Arc::new(WorkerMetrics::new());
        let on_step = {
            let metrics = metrics.clone();
            Arc::new(move |s: StepShape| metrics.packed(&s))
        };
        let packing = Packing {
            step_rows: cfg.step_rows.max(1),
            max_tasks: cfg.queue.max(1),
            on_step: Some(on_step),
            charge: cfg.charge,
            ..Packing::default()
        };
        Shell {
            scheduler: Scheduler::spawn(cfg.name, state, cfg.queue.max(1), packing, cancel.clone()),
            cfg,
            info: Arc::new(info),
            open: Arc::new(AtomicUsize::new(0)),
            metrics,
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
            metrics.kv_device_bytes(st.backend.kv_device_bytes());
            metrics.prefix_bytes(st.backend.prefix_bytes());
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

    /// Runs the operation `steps` on `session` (operation `op`, the metrics' label) as a task packed with the
    /// other sessions' steps (it starts once no other task of its session is under way), after `gate` (see
    /// [`Gated`]); `finish` gets its result (`None`: the gate skipped
    /// it) with the whole state (the book) and makes the answer. With `wait`, waits for room in the queue (a
    /// running stream's next step); without, answers RESOURCE_EXHAUSTED at once when it is full.
    pub async fn steps<S, G, T, F>(
        &self,
        op: &'static str,
        session: &str,
        gate: G,
        steps: S,
        finish: F,
        wait: bool,
    ) -> Result<T, Status>
    where
        S: Steps<B> + 'static,
        G: FnOnce(&mut State<B>) -> Result<bool, CoreError> + Send + 'static,
        F: FnOnce(&mut State<B>, Result<Option<S::Output>, CoreError>) -> Result<T, CoreError>
            + Send
            + 'static,
        T: Send + 'static,
    {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let task = ShellTask {
            op,
            session: session.to_string(),
            steps: Gated::new(gate, steps),
            finish: Some(finish),
            reply: Some(reply),
            waiting: Some(self.metrics.queued()),
            started: None,
            charged: 0.0,
            open: self.open.clone(),
            metrics: self.metrics.clone(),
            _backend: std::marker::PhantomData,
        };
        let r = self.scheduler.run_task(Box::new(task), rx, wait).await;
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
            st.book.prune(ttl);
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
        b.charge("b", 2.5);
        b.charge("b", 1.0);
        assert_eq!(b.charged("b"), 3.5);
        assert_eq!(b.charged("a"), 0.0);
        b.remove("a");
        assert!(!b.contains("a"));
        b.remove("b");
        assert_eq!(b.charged("b"), 0.0);
        // A charge that comes after its session left the book is pruned.
        b.touch("kept");
        b.charge("kept", 1.0);
        b.charge("gone", 1.0);
        b.prune(Duration::from_secs(60));
        assert_eq!(b.charged("gone"), 0.0);
        assert_eq!(b.charged("kept"), 1.0);
    }

    #[test]
    fn the_book_remembers_released_ids_for_the_ttl_and_a_bounded_number() {
        let mut b = SessionBook::default();
        b.touch("a");
        b.charge("a", 1.0);
        b.mark_released("a");
        b.mark_released("never-held");
        assert!(!b.contains("a"));
        assert_eq!(b.charged("a"), 0.0);
        assert!(b.was_released("a") && b.was_released("never-held"));
        assert!(!b.was_released("b"));
        // Expired sessions are not remembered as released.
        b.touch("b");
        b.remove("b");
        assert!(!b.was_released("b"));
        b.prune(Duration::from_secs(60));
        assert!(b.was_released("a"));
        std::thread::sleep(Duration::from_millis(20));
        b.mark_released("late");
        b.prune(Duration::from_millis(10));
        assert!(!b.was_released("a") && !b.was_released("never-held"));
        assert!(b.was_released("late"));
        // Bounded: the oldest go first.
        for i in 0..RELEASED_KEPT + 10 {
            b.mark_released(&format!("s{i}"));
        }
        assert_eq!(b.released.len(), RELEASED_KEPT);
        assert_eq!(b.released_ids.len(), RELEASED_KEPT);
        assert!(!b.was_released("late") && !b.was_released("s9"));
        assert!(b.was_released("s10") && b.was_released(&format!("s{}", RELEASED_KEPT + 9)));
    }
}
