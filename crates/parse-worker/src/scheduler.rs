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
mod tests {
    use super::*;
    use std::time::Duration;

    /// A state that records what each packed pass held and answers each block's readout rows with its first token.
    /// Each pass takes `pass_time` (so that work can arrive while tasks run).
    #[derive(Default)]
    struct Ledger {
        v: Vec<u32>,
        passes: Vec<Vec<(String, usize)>>,
        cancelled: Vec<String>,
        pass_time: Duration,
        /// Added to `pass_time` per row of the pass.
        row_time: Duration,
        /// `name:step` of every block the counters asked for, in order.
        asks: Vec<String>,
    }

    impl Forward for Ledger {
        fn forward_blocks(&mut self, blocks: &[Block]) -> Vec<parse_engine::Result<Logits>> {
            let rows: usize = blocks.iter().map(Block::rows).sum();
            std::thread::sleep(self.pass_time + self.row_time * rows as u32);
            self.passes.push(
                blocks
                    .iter()
                    .map(|b| (b.session.clone(), b.rows()))
                    .collect(),
            );
            blocks
                .iter()
                .map(|b| Logits::from_rows(1, vec![b.tokens[0] as f32; b.readout.len()]))
                .collect()
        }
    }

    /// Charges as tasks received them: (name, ms).
    type Charges = std::sync::Arc<std::sync::Mutex<Vec<(String, f64)>>>;

    /// Asks for `steps` blocks of `rows` rows (tokens 1, 2, ...) and answers the values it got back.
    struct Counter {
        name: String,
        session: String,
        steps: u32,
        rows: usize,
        asked: u32,
        got: Vec<f32>,
        reply: Option<oneshot::Sender<Vec<f32>>>,
        /// Where its charges go, by name.
        charges: Option<Charges>,
    }

    impl Task<Ledger> for Counter {
        fn session(&self) -> &str {
            &self.session
        }
        fn advance(
            &mut self,
            st: &mut Ledger,
            input: Option<parse_engine::Result<Logits>>,
            _room: usize,
        ) -> Option<Block> {
            if let Some(l) = input {
                self.got.push(l.unwrap().row(0)[0]);
            }
            if self.asked == self.steps {
                let _ = self.reply.take()?.send(std::mem::take(&mut self.got));
                return None;
            }
            self.asked += 1;
            st.asks.push(format!("{}:{}", self.name, self.asked));
            let tokens = vec![self.asked; self.rows];
            Some(Block::causal(&self.session, 0, &tokens, vec![0]))
        }
        fn abandoned(&self) -> bool {
            self.reply.as_ref().is_none_or(|r| r.is_closed())
        }
        fn cancel(&mut self, st: &mut Ledger) {
            st.cancelled.push(self.session.clone());
        }
        fn charge(&mut self, ms: f64) {
            if let Some(c) = &self.charges {
                c.lock().unwrap().push((self.name.clone(), ms));
            }
        }
    }

    /// A counter task and its caller's answer.
    type Counted = (Box<dyn Task<Ledger>>, oneshot::Receiver<Vec<f32>>);

    fn counter(session: &str, steps: u32, rows: usize) -> Counted {
        named(session, session, steps, rows)
    }

    fn named(name: &str, session: &str, steps: u32, rows: usize) -> Counted {
        let (reply, rx) = oneshot::channel();
        let t = Counter {
            name: name.to_string(),
            session: session.to_string(),
            steps,
            rows,
            asked: 0,
            got: Vec::new(),
            reply: Some(reply),
            charges: None,
        };
        (Box::new(t), rx)
    }

    /// Holds the scheduler thread in a command until the returned sender is used, so that work queued meanwhile
    /// is taken together.
    fn hold(s: &Scheduler<Ledger>) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let s = s.clone();
        let h = tokio::spawn(async move {
            s.call(move |_| {
                let _ = wait.recv();
            })
            .await
            .unwrap();
        });
        (go, h)
    }

    /// Queues `tasks` in order while the scheduler thread is held, then lets it go, so that it takes them together;
    /// returns the callers' answers.
    async fn queued_together(
        s: &Scheduler<Ledger>,
        tasks: Vec<Counted>,
    ) -> Vec<tokio::task::JoinHandle<Result<Vec<f32>, SchedulerError>>> {
        let (go, held) = hold(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut answers = Vec::new();
        for (task, rx) in tasks {
            let s = s.clone();
            answers.push(tokio::spawn(
                async move { s.run_task(task, rx, true).await },
            ));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        go.send(()).unwrap();
        held.await.unwrap();
        answers
    }

    /// A scheduler over an empty ledger: a queue of `queue` calls, passes of `step_rows` rows, never cancelled.
    fn ledger_scheduler(queue: usize, step_rows: usize) -> Scheduler<Ledger> {
        Scheduler::spawn(
            "test",
            Ledger::default(),
            queue,
            packing(step_rows),
            CancellationToken::new(),
        )
    }

    fn packing(step_rows: usize) -> Packing {
        Packing {
            step_rows,
            ..Packing::default()
        }
    }

    #[tokio::test]
    async fn commands_run_in_order_a_full_queue_refuses_and_cancel_stops() {
        let cancel = CancellationToken::new();
        let s = Scheduler::spawn("test", Ledger::default(), 1, packing(8), cancel.clone());
        for i in 0..5 {
            s.call(move |l| l.v.push(i)).await.unwrap();
        }
        assert_eq!(s.call(|l| l.v.clone()).await.unwrap(), [0, 1, 2, 3, 4]);
        // One slow command running, one queued: the next is refused.
        let (go, slow) = hold(&s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queued = {
            let s = s.clone();
            tokio::spawn(async move { s.call(|l| l.v.len()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(s.try_call(|l| l.v.len()).await, Err(SchedulerError::Full));
        let (task, rx) = counter("a", 1, 1);
        assert_eq!(s.run_task(task, rx, false).await, Err(SchedulerError::Full));
        go.send(()).unwrap();
        slow.await.unwrap();
        assert_eq!(queued.await.unwrap(), Ok(5));
        cancel.cancel();
        // The thread sees the token when it next wakes and stops without running the work that woke it.
        assert_eq!(s.call(|l| l.v.len()).await, Err(SchedulerError::Stopped));
        assert_eq!(s.call(|l| l.v.len()).await, Err(SchedulerError::Stopped));
    }

    #[tokio::test]
    async fn a_command_whose_caller_left_is_skipped() {
        let s = ledger_scheduler(4, 8);
        let (go, blocker) = hold(&s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let abandoned = {
            let s = s.clone();
            tokio::spawn(async move { s.call(|l| l.v.push(1)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        abandoned.abort();
        let _ = abandoned.await;
        go.send(()).unwrap();
        blocker.await.unwrap();
        assert!(
            s.call(|l| l.v.is_empty()).await.unwrap(),
            "the abandoned command ran"
        );
    }

    #[tokio::test]
    async fn running_tasks_share_passes_and_each_gets_its_own_results() {
        let s = ledger_scheduler(16, 64);
        let tasks = [("a", 4), ("b", 4), ("c", 2)]
            .into_iter()
            .map(|(name, steps)| counter(name, steps, 1))
            .collect();
        let answers = queued_together(&s, tasks).await;
        let want = [
            vec![1.0, 2.0, 3.0, 4.0],
            vec![1.0, 2.0, 3.0, 4.0],
            vec![1.0, 2.0],
        ];
        for (a, w) in answers.into_iter().zip(want) {
            assert_eq!(a.await.unwrap().unwrap(), w);
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        let sizes: Vec<usize> = passes.iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 2, 2], "{passes:?}");
        // A task that joins while others run is packed with them from its first step.
        s.call(|l| l.pass_time = Duration::from_millis(5))
            .await
            .unwrap();
        let (long, rx_long) = counter("long", 40, 1);
        let first = {
            let s = s.clone();
            tokio::spawn(async move { s.run_task(long, rx_long, true).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (late, rx_late) = counter("late", 2, 1);
        s.run_task(late, rx_late, true).await.unwrap();
        first.await.unwrap().unwrap();
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        assert!(
            passes[4..].iter().any(|p| p.len() == 2),
            "the late task never shared a pass: {passes:?}"
        );
    }

    /// Counter tasks (name, steps, rows) whose charges go to `charges`.
    fn charged(tasks: &[(&str, u32, usize)], charges: &Charges) -> Vec<Counted> {
        tasks
            .iter()
            .map(|&(name, steps, rows)| {
                let (reply, rx) = oneshot::channel();
                let t = Counter {
                    name: name.to_string(),
                    session: name.to_string(),
                    steps,
                    rows,
                    asked: 0,
                    got: Vec::new(),
                    reply: Some(reply),
                    charges: Some(charges.clone()),
                };
                (Box::new(t) as Box<dyn Task<Ledger>>, rx)
            })
            .collect()
    }

    /// What the tasks named `name` were charged in all.
    fn total(charges: &Charges, name: &str) -> f64 {
        charges
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, ms)| ms)
            .sum()
    }

    /// A scheduler over an empty ledger (a queue of 16 calls, passes of 64 rows) that splits passes by `charge`.
    fn charging_scheduler(charge: Charge) -> Scheduler<Ledger> {
        let packing = Packing {
            charge,
            ..packing(64)
        };
        Scheduler::spawn(
            "test",
            Ledger::default(),
            16,
            packing,
            CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn each_task_is_charged_its_rows_share_of_the_passes_it_was_in() {
        let s = charging_scheduler(Charge::Rows);
        s.call(|l| l.pass_time = Duration::from_millis(40))
            .await
            .unwrap();
        let charges = Charges::default();
        let tasks = charged(&[("one", 2, 1), ("three", 2, 3)], &charges);
        for a in queued_together(&s, tasks).await {
            a.await.unwrap().unwrap();
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        assert_eq!(passes.len(), 2, "{passes:?}");
        let (one, three) = (total(&charges, "one"), total(&charges, "three"));
        // Two passes of at least 40 ms each, split 1:3 by rows.
        assert!(one + three >= 80.0, "{charges:?}");
        assert!((three / one - 3.0).abs() < 1e-9, "{charges:?}");
    }

    #[tokio::test]
    async fn charged_marginally_a_task_pays_the_passes_fixed_part_in_equal_shares_and_its_rows_at_their_price()
     {
        // Passes of 30 ms and 4 ms a row (at least: sleeps overrun).
        let s = charging_scheduler(Charge::Marginal);
        s.call(|l| {
            l.pass_time = Duration::from_millis(30);
            l.row_time = Duration::from_millis(4);
        })
        .await
        .unwrap();
        // Passes of 1 and 8 rows alone, so that the line can be read; then a 1-row and a 3-row task together.
        let charges = Charges::default();
        for task in charged(&[("lone1", 3, 1), ("lone8", 3, 8)], &charges) {
            for a in queued_together(&s, vec![task]).await {
                a.await.unwrap().unwrap();
            }
        }
        let tasks = charged(&[("one", 2, 1), ("three", 2, 3)], &charges);
        for a in queued_together(&s, tasks).await {
            a.await.unwrap().unwrap();
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        assert_eq!(passes.len(), 8, "{passes:?}");
        let (one, three) = (total(&charges, "one"), total(&charges, "three"));
        // Each of the two shared passes: 15 ms of the fixed part to each task, 4 ms a row: 19 against 27 (by rows
        // it would be 1:3: the bounds leave room for sleeps that overrun). A task alone is charged its whole pass.
        let ratio = three / one;
        assert!((1.1..2.2).contains(&ratio), "{ratio} {charges:?}");
        assert!(one + three >= 2.0 * 46.0, "{charges:?}");
        assert!(total(&charges, "lone8") >= 3.0 * 62.0, "{charges:?}");
    }

    #[test]
    fn a_pass_line_is_read_once_the_rows_spread_and_shares_sum_to_the_pass() {
        let mut line = PassLine::default();
        for _ in 0..20 {
            line.add(4, 50.0);
        }
        assert_eq!(line.line(), None, "no spread in the rows: no line");
        for rows in [1, 8, 16, 4, 128] {
            line.add(rows, 30.0 + 5.0 * rows as f64);
        }
        let (fixed, per_row) = line.line().unwrap();
        assert!(
            (fixed - 30.0).abs() < 1e-6 && (per_row - 5.0).abs() < 1e-6,
            "{fixed} {per_row}"
        );
        // A fit with rows that cost nothing (or a negative fixed part) is no line.
        let mut flat = PassLine::default();
        for rows in [1, 8, 1, 8] {
            flat.add(rows, 40.0);
        }
        assert_eq!(flat.line(), None);
        let mut steep = PassLine::default();
        for rows in [1, 8, 1, 8] {
            steep.add(rows, 10.0 * rows as f64 - 5.0);
        }
        assert_eq!(steep.line(), None);

        let rows = [1, 4, 1];
        let marginal = shares(Charge::Marginal, Some((30.0, 5.0)), &rows);
        let want = [15.0 / 60.0, 30.0 / 60.0, 15.0 / 60.0];
        for (got, want) in marginal.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{marginal:?}");
        }
        assert_eq!(
            shares(Charge::Rows, Some((30.0, 5.0)), &rows),
            vec![1.0 / 6.0, 4.0 / 6.0, 1.0 / 6.0]
        );
        assert_eq!(
            shares(Charge::Marginal, None, &rows),
            vec![1.0 / 6.0, 4.0 / 6.0, 1.0 / 6.0]
        );
        assert_eq!(shares(Charge::Marginal, Some((30.0, 5.0)), &[7]), vec![1.0]);
        assert!(shares(Charge::Marginal, None, &[]).is_empty());
        assert_eq!(shares(Charge::Rows, None, &[0, 0]), vec![0.5, 0.5]);
        assert_eq!(Charge::default(), Charge::Marginal);
        assert_eq!("rows".parse::<Charge>(), Ok(Charge::Rows));
        assert_eq!("marginal".parse::<Charge>(), Ok(Charge::Marginal));
        assert!(
            "fair"
                .parse::<Charge>()
                .unwrap_err()
                .contains("rows or marginal")
        );
    }

    #[tokio::test]
    async fn a_pass_keeps_to_its_row_budget_and_a_left_caller_stops_its_task() {
        let s = ledger_scheduler(16, 4);
        let tasks = [("a", 3), ("b", 3), ("big", 9), ("d", 1)]
            .into_iter()
            .map(|(name, rows)| counter(name, 2, rows))
            .collect();
        let answers = queued_together(&s, tasks).await;
        for a in answers {
            assert_eq!(a.await.unwrap().unwrap(), vec![1.0, 2.0]);
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        for p in &passes {
            let rows: usize = p.iter().map(|x| x.1).sum();
            assert!(p.len() == 1 || rows <= 4, "{passes:?}");
        }
        // Every task's two blocks ran (the one larger than the budget in passes of its own).
        assert_eq!(passes.iter().map(Vec::len).sum::<usize>(), 8, "{passes:?}");
        // A caller that leaves: its task stops at its next step and tidies up.
        s.call(|l| l.pass_time = Duration::from_millis(2))
            .await
            .unwrap();
        let (go, held) = hold(&s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (task, rx) = counter("gone", 1000, 1);
        let gone = {
            let s = s.clone();
            tokio::spawn(async move { s.run_task(task, rx, true).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        go.send(()).unwrap();
        held.await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (cancelled, n) = s
            .call(|l| (l.cancelled.clone(), l.passes.len()))
            .await
            .unwrap();
        assert_eq!(cancelled, ["gone"]);
        assert!(n < 8 + 1000, "the abandoned task ran to its end");
    }

    /// Runs a long task and, beside it, a one-step task whose caller calls again on the same session as soon as it
    /// is answered; returns the sessions of the second pass after the first task's.
    async fn second_call_pass(linger: Duration) -> Vec<String> {
        let s = Scheduler::spawn(
            "test",
            Ledger::default(),
            16,
            Packing {
                linger,
                ..packing(64)
            },
            CancellationToken::new(),
        );
        s.call(|l| l.pass_time = Duration::from_millis(160))
            .await
            .unwrap();
        let (long, rx_long) = counter("long", 6, 1);
        let (first, rx_first) = named("first", "s", 1, 1);
        let answers = queued_together(&s, vec![(long, rx_long), (first, rx_first)]).await;
        let mut answers = answers.into_iter();
        let long = answers.next().unwrap();
        answers.next().unwrap().await.unwrap().unwrap();
        let (second, rx_second) = named("second", "s", 1, 1);
        s.run_task(second, rx_second, true).await.unwrap();
        long.await.unwrap().unwrap();
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        // Pass 0 ran `first`; it was answered while pass 1 was planned.
        passes[1]
            .iter()
            .map(|(session, _)| session.clone())
            .collect()
    }

    #[tokio::test]
    async fn a_step_lingers_for_the_next_call_of_a_caller_it_just_answered() {
        let mut with = second_call_pass(Duration::from_millis(20)).await;
        with.sort();
        assert_eq!(with, ["long", "s"]);
        // Without the linger the pass starts at once and the second call waits for the one after.
        assert_eq!(second_call_pass(Duration::ZERO).await, ["long"]);
    }

    /// Feeds `total` rows in chunks that take the room offered, at least `min` rows (as the engine's prefill cuts a
    /// prompt), then answers one value per chunk fed (its index).
    struct Prompt {
        session: String,
        total: usize,
        min: usize,
        fed: usize,
        chunks: Vec<f32>,
        reply: Option<oneshot::Sender<Vec<f32>>>,
    }

    impl Task<Ledger> for Prompt {
        fn session(&self) -> &str {
            &self.session
        }
        fn advance(
            &mut self,
            _st: &mut Ledger,
            input: Option<parse_engine::Result<Logits>>,
            room: usize,
        ) -> Option<Block> {
            if input.is_some() {
                self.chunks.push(self.chunks.len() as f32);
            }
            if self.fed == self.total {
                let _ = self.reply.take()?.send(std::mem::take(&mut self.chunks));
                return None;
            }
            let n = (self.total - self.fed).min(room.max(self.min));
            self.fed += n;
            Some(Block::causal(&self.session, 0, &vec![1; n], vec![0]))
        }
        fn abandoned(&self) -> bool {
            self.reply.as_ref().is_none_or(|r| r.is_closed())
        }
        fn cancel(&mut self, _st: &mut Ledger) {}
    }

    fn prompt(session: &str, total: usize) -> Counted {
        let (reply, rx) = oneshot::channel();
        let t = Prompt {
            session: session.to_string(),
            total,
            min: 4,
            fed: 0,
            chunks: Vec::new(),
            reply: Some(reply),
        };
        (Box::new(t), rx)
    }

    #[tokio::test]
    async fn prompts_leave_room_for_decode_steps_and_are_fed_oldest_first() {
        let s = ledger_scheduler(16, 16);
        let mut tasks = vec![prompt("p1", 40), prompt("p2", 40)];
        tasks.extend(["d1", "d2", "d3"].map(|d| counter(d, 12, 1)));
        for a in queued_together(&s, tasks).await {
            a.await.unwrap().unwrap();
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        let has = |p: &Vec<(String, usize)>, name: &str| p.iter().any(|(s, _)| s == name);
        for p in &passes {
            let rows: usize = p.iter().map(|x| x.1).sum();
            assert!(rows <= 16, "{passes:?}");
        }
        // While the decode steps run, every pass holds all three, prompt chunks or not.
        let decoding = passes.iter().filter(|p| has(p, "d1")).count();
        assert_eq!(decoding, 12, "{passes:?}");
        for p in &passes[..12] {
            assert!(["d1", "d2", "d3"].iter().all(|d| has(p, d)), "{passes:?}");
        }
        assert!(has(&passes[0], "p1"), "{passes:?}");
        // The first prompt is fed to its end before the second takes more than the chunk it was cut at first.
        let last_p1 = passes.iter().rposition(|p| has(p, "p1")).unwrap();
        let p2_before: usize = passes[..last_p1]
            .iter()
            .flatten()
            .filter(|(s, _)| s == "p2")
            .count();
        assert!(p2_before <= 1, "{passes:?}");
    }

    #[tokio::test]
    async fn a_prompt_is_fed_while_short_blocks_fill_every_step() {
        let s = ledger_scheduler(16, 4);
        let mut tasks: Vec<Counted> = ["d1", "d2", "d3", "d4"]
            .into_iter()
            .map(|d| counter(d, 30, 1))
            .collect();
        tasks.insert(0, prompt("p", 20));
        for a in queued_together(&s, tasks).await {
            a.await.unwrap().unwrap();
        }
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        // The four decode tasks fill every step's 4 rows; the prompt still gets passes (of its minimum chunk,
        // alone or over the budget) long before they end.
        let last_p = passes
            .iter()
            .rposition(|p| p.iter().any(|(s, _)| s == "p"))
            .unwrap();
        assert!(
            last_p < 25,
            "the prompt waited for the decode tasks: {passes:?}"
        );
    }

    #[tokio::test]
    async fn tasks_of_one_session_run_one_after_another() {
        let s = ledger_scheduler(16, 64);
        let tasks = [("x", "s"), ("y", "s"), ("z", "t")]
            .into_iter()
            .map(|(name, session)| named(name, session, 3, 1))
            .collect();
        let answers = queued_together(&s, tasks).await;
        for a in answers {
            assert_eq!(a.await.unwrap().unwrap(), vec![1.0, 2.0, 3.0]);
        }
        let asks = s.call(|l| l.asks.clone()).await.unwrap();
        let on_s: Vec<&str> = asks
            .iter()
            .map(String::as_str)
            .filter(|a| !a.starts_with('z'))
            .collect();
        // y starts only once x has finished; z (another session) runs beside x.
        assert_eq!(on_s, ["x:1", "x:2", "x:3", "y:1", "y:2", "y:3"], "{asks:?}");
        let passes = s.call(|l| l.passes.clone()).await.unwrap();
        assert!(passes.iter().any(|p| p.len() == 2), "{passes:?}");
    }
}
