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
