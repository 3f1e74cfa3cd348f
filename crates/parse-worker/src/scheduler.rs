//! A scheduler task: one thread owns a state (an engine and what goes with it) and runs what it receives over a
//! bounded channel, answering each caller over a `oneshot`. It replaces a lock: async handlers never block on the
//! engine, and nothing else can reach it.
//!
//! Two kinds of work arrive. A *command* (a closure: release, truncate, a heartbeat) runs as soon as the thread
//! takes it. A *task* (an operation that needs forward passes: a prefill, a verification, a run of decode steps)
//! joins the running tasks, and the thread runs them together, step by step (continuous batching): at each step
//! every running task says what block it needs next, the blocks of up to `step_rows` rows are packed into one
//! forward pass ([`Forward::forward_blocks`]), and each task gets its block's logits back at its next step. A task
//! that joins does not wait for the others to finish; a prefill is cut to the room a step has left, so a long
//! prompt does not stall the decode steps beside it. The short blocks (decode steps, verifications) are planned
//! first, a prompt that starts among them leaving a row for each, and prefills under way take what is left, oldest
//! first ([`plan_order`]). Short tasks that did not get into a step go first at the next one.
//! A step whose planning answered callers waits a moment (`Packing::linger`, at most an eighth of the last pass)
//! for their next calls before its pass starts: a caller that calls again at once (the router's next `Extend` of a
//! request) otherwise sits out a whole pass.
//!
//! Work whose caller has gone (its reply receiver dropped: a cancelled request) is skipped, or stopped at its next
//! step. The thread ends when every handle is dropped or the cancellation token fires; later calls answer
//! [`SchedulerError::Stopped`].

use std::collections::VecDeque;

use parse_engine::steps::Forward;
use parse_engine::{Block, Logits};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

type Closure<S> = Box<dyn FnOnce(&mut S) + Send>;

/// An operation run step by step among others (see the module's comment).
pub trait Task<S>: Send {
    /// Advances the task with the result of the block it asked for last (`None` at its first step), with room for
    /// `room` rows in this step. Returns its next block, or `None` once it has finished (and answered its caller).
    fn advance(
        &mut self,
        state: &mut S,
        input: Option<parse_engine::Result<Logits>>,
        room: usize,
    ) -> Option<Block>;
    /// The session it works on. Tasks of one session run one after another: a task does not start while another
    /// on its session is running (a block planned against a cache that another task then changes would be stale).
    fn session(&self) -> &str;
    /// Whether its caller has gone.
    fn abandoned(&self) -> bool;
    /// Its caller has gone after it started: leave the state tidy (no reply is sent).
    fn cancel(&mut self, state: &mut S);
    /// Its share of a pass it was in, in ms: the pass's time split among its blocks as [`Packing::charge`] says.
    fn charge(&mut self, _ms: f64) {}
}

enum Work<S> {
    Command(Closure<S>),
    Task(Box<dyn Task<S>>),
}

/// Why work did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerError {
    /// The queue is full.
    Full,
    /// The scheduler has stopped (shutdown).
    Stopped,
}

/// What a step packed, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepShape {
    /// Blocks (one per task) in the pass.
    pub blocks: usize,
    /// Rows of all blocks.
    pub rows: usize,
    /// The pass's time on the engine.
    pub pass: std::time::Duration,
    /// The step's time before its pass: the tasks' planning (their sampling and bookkeeping between passes) and
    /// any linger for callers' next calls.
    pub planning: std::time::Duration,
    /// The passes' time as a line in their rows, (fixed ms, ms per row), as read after this pass ([`PassLine`]).
    pub line: Option<(f64, f64)>,
}

/// How the scheduler packs steps.
#[derive(Clone)]
pub struct Packing {
    /// Rows one packed pass holds at most (a block larger than this runs in a step of its own).
    pub step_rows: usize,
    /// Tasks running at once; more wait in the queue (and beyond the queue are refused).
    pub max_tasks: usize,
    /// Called after every packed pass.
    pub on_step: Option<std::sync::Arc<dyn Fn(StepShape) + Send + Sync>>,
    /// How long a step may wait, once tasks have finished (and answered) in its planning, for their callers' next
    /// calls before its pass starts; at most [`LINGER_SHARE`] of the last pass's time. Zero: never wait.
    pub linger: std::time::Duration,
    /// How a pass's time is split among the tasks in it ([`Task::charge`]).
    pub charge: Charge,
}

/// How a pass's time is split among the blocks in it: what each request is charged, which the router's pacing
/// weighs (speculate, or let the target write alone) at loads above one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Charge {
    /// Each block its rows' share. A speculative round's `1 + k` rows that write `1 + a` tokens then never cost
    /// less a token than one-row steps in the same passes, whatever the pass's rows cost beyond its fixed part.
    Rows,
    /// What each block adds: the pass's fixed part (a pass's time at no rows, by a line fitted to recent passes'
    /// times in their rows, [`PassLine`]) in equal shares among its blocks, the rest by rows. A block's extra rows
    /// are charged what they add to the pass, so a round pays at a load where the tokens it keeps cost less than
    /// the rows it adds, as the pool's throughput has it. By rows until the line can be read.
    ///
    /// The default: where a pass's fixed part is large next to a row, charging rows alone makes a speculative
    /// round look dearer than what it adds to the pool's time. Where rows are dear the two splits decide alike.
    #[default]
    Marginal,
}

impl std::str::FromStr for Charge {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rows" => Ok(Charge::Rows),
            "marginal" => Ok(Charge::Marginal),
            _ => Err(format!("unknown charge {s:?}: expected rows or marginal")),
        }
    }
}

/// A pass's time as a line in its rows, (fixed ms, ms per row), fitted by least squares over recent passes (sums
/// that fade by [`PassLine::KEEP`] per pass, about the last hundred).
#[derive(Debug, Clone, Copy, Default)]
pub struct PassLine {
    weight: f64,
    rows: f64,
    rows2: f64,
    ms: f64,
    rows_ms: f64,
}

impl PassLine {
    const KEEP: f64 = 0.99;

    pub fn add(&mut self, rows: usize, ms: f64) {
        let (k, r) = (Self::KEEP, rows as f64);
        self.weight = self.weight * k + 1.0;
        self.rows = self.rows * k + r;
        self.rows2 = self.rows2 * k + r * r;
        self.ms = self.ms * k + ms;
        self.rows_ms = self.rows_ms * k + r * ms;
    }

    /// (fixed ms, ms per row); `None` while the passes' rows spread less than a row either way, or where the fit
    /// has no positive price for a row or a negative fixed part.
    pub fn line(&self) -> Option<(f64, f64)> {
        let w = self.weight;
        let spread = w * self.rows2 - self.rows * self.rows;
        if w <= 0.0 || spread < w * w {
            return None;
        }
        let per_row = (w * self.rows_ms - self.rows * self.ms) / spread;
        let fixed = (self.ms - per_row * self.rows) / w;
        (per_row > 0.0 && fixed >= 0.0).then_some((fixed, per_row))
    }
}

/// Each block's share of a pass (they sum to 1) by `charge`, for blocks of `rows` rows, with `line` the passes'
/// fitted line where it can be read ([`Charge::Marginal`]; by rows without it).
pub fn shares(charge: Charge, line: Option<(f64, f64)>, rows: &[usize]) -> Vec<f64> {
    let weights: Vec<f64> = match (charge, line) {
        (Charge::Marginal, Some((fixed, per_row))) if !rows.is_empty() => {
            let each = fixed / rows.len() as f64;
            rows.iter().map(|&r| each + per_row * r as f64).collect()
        }
        _ => rows.iter().map(|&r| r as f64).collect(),
    };
    let sum: f64 = weights.iter().sum();
    if sum > 0.0 {
        weights.iter().map(|w| w / sum).collect()
    } else {
        vec![1.0 / rows.len().max(1) as f64; rows.len()]
    }
}

/// The longest a step lingers, as a share of the last pass's time: what a caller whose next call never comes costs
/// the others is bounded by it.
pub const LINGER_SHARE: f64 = 0.125;

impl Default for Packing {
    fn default() -> Self {
        Packing {
            step_rows: 128,
            max_tasks: 256,
            on_step: None,
            linger: std::time::Duration::from_millis(5),
            charge: Charge::default(),
        }
    }
}

/// A handle to a scheduler task. Cheap to clone.
pub struct Scheduler<S> {
    tx: mpsc::Sender<Work<S>>,
}

impl<S> Clone for Scheduler<S> {
    fn clone(&self) -> Self {
        Scheduler {
            tx: self.tx.clone(),
        }
    }
}

struct Running<S> {
    task: Box<dyn Task<S>>,
    started: bool,
    /// Its place in arrival order: tasks that fill the room left (prefills) take it oldest first.
    seq: u64,
    /// Its last block took all the room it was offered (more than one row): a prefill under way, whose next
    /// chunk takes what the short blocks leave (see [`plan_order`]).
    filling: bool,
    /// It was left out of the last pass.
    sat_out: bool,
    /// The result of its last block, not yet handed to it.
    input: Option<parse_engine::Result<Logits>>,
    /// Its next block, waiting for a step with room.
    block: Option<Block>,
}

/// The scheduler thread's loop.
fn run<S: Forward>(
    state: &mut S,
    rx: &mut mpsc::Receiver<Work<S>>,
    packing: &Packing,
    cancel: &CancellationToken,
) {
    let mut running: VecDeque<Running<S>> = VecDeque::new();
    let mut seq = 0u64;
    let step_rows = packing.step_rows.max(1);
    let mut last_pass = std::time::Duration::ZERO;
    let mut line = PassLine::default();
    loop {
        // Wait only when nothing runs; otherwise take what has arrived and step. Once the token has fired, no
        // work runs (what was queued is dropped: its callers get Stopped).
        if running.is_empty() {
            match rx.blocking_recv() {
                Some(w) if !cancel.is_cancelled() => take(state, &mut running, &mut seq, w),
                _ => return,
            }
        }
        while running.len() < packing.max_tasks.max(1) {
            if cancel.is_cancelled() {
                return;
            }
            match rx.try_recv() {
                Ok(w) => take(state, &mut running, &mut seq, w),
                Err(_) => break,
            }
        }
        if cancel.is_cancelled() {
            return;
        }
        // Plan a step: blocks in the order of the queue of tasks, within the row budget.
        let step_start = std::time::Instant::now();
        let mut blocks: Vec<Block> = Vec::new();
        let mut owners: Vec<usize> = Vec::new();
        let mut finished: Vec<usize> = Vec::new();
        let mut planned = 0;
        // Sessions with a task under way: another task on one of them waits.
        let mut busy: Vec<String> = running
            .iter()
            .filter(|r| r.started && !r.task.abandoned())
            .map(|r| r.task.session().to_string())
            .collect();
        // Tasks that finished in this planning: each answered a caller whose next call is likely on its way.
        let mut answered = 0;
        let mut from = 0;
        loop {
            let order = plan_order(&running, from);
            for &(i, reserve) in &order {
                let r = &mut running[i];
                if r.task.abandoned() {
                    if r.started {
                        r.task.cancel(state);
                    }
                    finished.push(i);
                    continue;
                }
                if !r.started && busy.iter().any(|b| b == r.task.session()) {
                    continue;
                }
                // Room for this task: what the step has left, less a row for each short block after it.
                let room = step_rows.saturating_sub(planned + reserve);
                if r.block.is_none() {
                    if room == 0 && planned > 0 {
                        continue;
                    }
                    if !r.started {
                        busy.push(r.task.session().to_string());
                    }
                    r.started = true;
                    let room = room.max(1);
                    match r.task.advance(state, r.input.take(), room) {
                        Some(b) => {
                            r.filling = b.rows() > 1 && b.rows() >= room;
                            r.block = Some(b);
                        }
                        None => {
                            // Done and answered: its session is free for the next task.
                            busy.retain(|b| b != r.task.session());
                            answered += 1;
                            finished.push(i);
                            continue;
                        }
                    }
                }
                let Some(b) = r.block.as_ref() else { continue };
                let fits = planned == 0 || b.rows() <= room;
                if fits && !blocks.iter().any(|x| x.session == b.session) {
                    planned += b.rows();
                    owners.push(i);
                    blocks.extend(r.block.take());
                }
            }
            // A caller just answered usually calls again at once (a worker's reply, then the router's next call):
            // without a short wait, the pass that starts now would leave its session out, and it would wait a whole
            // pass. The wait ends when as many tasks have arrived as finished, or after the linger.
            if answered == 0 || blocks.is_empty() || packing.linger.is_zero() || from > 0 {
                break;
            }
            from = running.len();
            let wait = packing.linger.min(last_pass.mul_f64(LINGER_SHARE));
            let deadline = std::time::Instant::now() + wait;
            let mut arrived = 0;
            while arrived < answered && running.len() < packing.max_tasks.max(1) {
                match rx.try_recv() {
                    Ok(w) => {
                        arrived += usize::from(matches!(w, Work::Task(_)));
                        take(state, &mut running, &mut seq, w);
                    }
                    Err(mpsc::error::TryRecvError::Empty)
                        if std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                    Err(_) => break,
                }
            }
            if running.len() == from {
                break;
            }
        }
        if !blocks.is_empty() {
            let t = std::time::Instant::now();
            let planning = t - step_start;
            let results = state.forward_blocks(&blocks);
            last_pass = t.elapsed();
            let pass_ms = last_pass.as_secs_f64() * 1e3;
            let rows: Vec<usize> = blocks.iter().map(Block::rows).collect();
            for (share, &i) in shares(packing.charge, line.line(), &rows)
                .iter()
                .zip(&owners)
            {
                running[i].task.charge(pass_ms * share);
            }
            line.add(planned, pass_ms);
            if let Some(f) = &packing.on_step {
                f(StepShape {
                    blocks: blocks.len(),
                    rows: planned,
                    pass: last_pass,
                    planning,
                    line: line.line(),
                });
            }
            let mut results = results.into_iter();
            for &i in &owners {
                running[i].input = Some(results.next().unwrap_or_else(|| {
                    Err(parse_engine::Error::InvalidInput(
                        "a block got no result".into(),
                    ))
                }));
            }
        }
        // Tasks that ran go to the back; those that waited lead the next step.
        let mut waited = VecDeque::with_capacity(running.len());
        let mut ran = Vec::with_capacity(owners.len());
        for (i, r) in running.drain(..).enumerate() {
            if finished.contains(&i) {
                continue;
            }
            if owners.contains(&i) {
                ran.push(Running {
                    sat_out: false,
                    ..r
                });
            } else {
                waited.push_back(Running { sat_out: true, ..r });
            }
        }
        waited.extend(ran);
        running = waited;
    }
}

/// The order in which a step plans the tasks from `from` on, each with the rows it leaves for the tasks after it:
/// first the tasks whose blocks are short (decode steps, verifications, extends; tasks not yet started) in the
/// queue's order, each leaving a row for every other such task after it, so that a prompt that starts among them
/// does not shut them out of the pass; then the prefills under way oldest first, each taking what is left. A
/// prefill cut into passes beside the decode steps of the others costs them a few rows of their pass instead of
/// whole passes, and prompts that arrive together are served one after another (the first answer comes after
/// one prompt's passes, not after all of theirs) instead of by turns. So that short blocks that fill whole steps
/// (many sessions' verifications) cannot hold a prompt back for ever, the oldest prefill that sat out the last pass
/// is planned first, leaving a row for each short task (a prefill chunk takes at least its engine's minimum, 16 rows,
/// where a step is otherwise full).
fn plan_order<S>(running: &VecDeque<Running<S>>, from: usize) -> Vec<(usize, usize)> {
    let short: Vec<usize> = (from..running.len())
        .filter(|&i| !running[i].filling)
        .collect();
    let mut filling: Vec<usize> = (from..running.len())
        .filter(|&i| running[i].filling)
        .collect();
    filling.sort_by_key(|&i| running[i].seq);
    let n = short.len();
    let mut order = Vec::with_capacity(n + filling.len());
    if let Some(&first) = filling.first()
        && running[first].sat_out
    {
        order.push((first, n));
        filling.remove(0);
    }
    order.extend(short.into_iter().enumerate().map(|(k, i)| (i, n - 1 - k)));
    order.extend(filling.into_iter().map(|i| (i, 0)));
    order
}

fn take<S>(state: &mut S, running: &mut VecDeque<Running<S>>, seq: &mut u64, w: Work<S>) {
    match w {
        Work::Command(f) => f(state),
        Work::Task(task) => running.push_back(Running {
            task,
            started: false,
            seq: {
                *seq += 1;
                *seq
            },
            filling: false,
            sat_out: false,
            input: None,
            block: None,
        }),
    }
}

impl<S: Forward + Send + 'static> Scheduler<S> {
    /// Starts the task on a thread of its own (engine work blocks), holding at most `queue` waiting calls.
    pub fn spawn(
        name: &str,
        mut state: S,
        queue: usize,
        packing: Packing,
        cancel: CancellationToken,
    ) -> Self {
        let (tx, mut rx) = mpsc::channel::<Work<S>>(queue.max(1));
        let thread = format!("{name} scheduler");
        let spawned = std::thread::Builder::new().name(thread).spawn(move || {
            run(&mut state, &mut rx, &packing, &cancel);
            rx.close();
        });
        if let Err(e) = spawned {
            // Without its thread the scheduler answers Stopped to every call.
            tracing::error!("{name}: cannot start the scheduler thread: {e}");
        }
        Scheduler { tx }
    }

    fn command<T: Send + 'static>(
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> (Work<S>, oneshot::Receiver<T>) {
        let (reply, rx) = oneshot::channel();
        let cmd: Closure<S> = Box::new(move |s: &mut S| {
            // The caller is gone: skip the work.
            if reply.is_closed() {
                return;
            }
            let _ = reply.send(f(s));
        });
        (Work::Command(cmd), rx)
    }

    async fn send(&self, w: Work<S>, wait: bool) -> Result<(), SchedulerError> {
        if wait {
            return self.tx.send(w).await.map_err(|_| SchedulerError::Stopped);
        }
        self.tx.try_send(w).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SchedulerError::Full,
            mpsc::error::TrySendError::Closed(_) => SchedulerError::Stopped,
        })
    }

    /// Runs `f` on the state, waiting for room in the queue.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Result<T, SchedulerError> {
        let (cmd, rx) = Self::command(f);
        self.send(cmd, true).await?;
        rx.await.map_err(|_| SchedulerError::Stopped)
    }

    /// Runs `f` on the state, or fails at once with [`SchedulerError::Full`] when the queue is full.
    pub async fn try_call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Result<T, SchedulerError> {
        let (cmd, rx) = Self::command(f);
        self.send(cmd, false).await?;
        rx.await.map_err(|_| SchedulerError::Stopped)
    }

    /// Runs a task among the others; it answers over `rx` (which the caller made with the task). With `wait`, waits
    /// for room in the queue; without, fails at once with [`SchedulerError::Full`].
    pub async fn run_task<T: Send + 'static>(
        &self,
        task: Box<dyn Task<S>>,
        rx: oneshot::Receiver<T>,
        wait: bool,
    ) -> Result<T, SchedulerError> {
        self.send(Work::Task(task), wait).await?;
        rx.await.map_err(|_| SchedulerError::Stopped)
    }
}

#[cfg(test)]
mod tests;
