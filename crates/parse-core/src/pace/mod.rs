//! Whether speculation pays, judged on measured times: by each request, with what the requests sharing its workers
//! have measured at the same load.
//!
//! A speculative round costs its drafting and its verification and writes the tokens it keeps; the target writing
//! alone costs one step per token. Which is cheaper depends on the request (how much of its drafts the target keeps)
//! and on the load (a step shared by 8 requests costs more than a step alone, and a verification block more again,
//! so speculation that pays at one request can lose at eight). [`Costs`] keeps, per load level, the target's
//! milliseconds per token when it writes alone and each kind of speculation's milliseconds per output token, as
//! moving averages weighted by tokens over the requests that report to it: the router keeps one for its worker
//! pools, an in-process request one of its own. [`Pace`] is one request's use of it: before each round it asks
//! whether to speculate or to let the target write alone for a while, and reports what the round cost.
//!
//! By job: `rates` holds the estimators, `costs` the pool's figures, `probes` when a losing speculation is measured
//! again, `length` how far a token-level round drafts and whether a guess pays, `advise` the decision before a round
//! ([`Why`] a pause began), `report` what a round or pause cost. The tunables are one [`PaceConfig`]; the time is
//! read from the pool's [`Clock`]. Why the pacing measures rather than follows a fixed schedule by batch size:
//! `docs/decisions/pacing.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use config::PaceConfig;
use rates::{BestRound, Guesses, Passes, Rate, Reach};

/// The kind under which the copy rounds of a request of `kind` are judged ([`Pace::copied`], [`Pace::copies_only`]):
/// `<kind> copies`.
fn copy_kind(kind: &str) -> String {
    format!("{kind} copies")
}

/// The figure of everything the pauses of a request of `kind` wrote ([`Pace::wrote_alone`], [`Pace::copied`],
/// [`Pace::copied_nothing`]): `<kind> pauses`.
fn pause_kind(kind: &str) -> String {
    format!("{kind} pauses")
}

/// The rounds a `parse+token-spec` request speculates with, chosen round by round by what each writes per millisecond
/// at the current load ([`Pace::choose_rounds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounds {
    /// PARSE rounds: a window of whole segments verified in one pass, and after a cut, token-level rounds to the
    /// segment's end.
    Segments,
    /// A token-level round of the length [`Costs::draft_length`] chooses, as `token-spec` makes them.
    Tokens,
}

impl Rounds {
    /// The figure under which a request of `kind` reports its rounds of this sort: `<kind> segments`, `<kind>
    /// tokens`.
    fn figure(self, kind: &str) -> String {
        match self {
            Rounds::Segments => format!("{kind} segments"),
            Rounds::Tokens => format!("{kind} tokens"),
        }
    }

    fn other(self) -> Self {
        match self {
            Rounds::Segments => Rounds::Tokens,
            Rounds::Tokens => Rounds::Segments,
        }
    }
}

/// What speculation of a kind must beat: the target writing alone (`alone`), or where the kind's drafter copies as
/// well and its copy rounds (`copies`) write faster than that, those. A draft model that is cheaper than the target
/// alone and dearer than copying rests, and its requests copy (where a draft-model token costs a large share of a
/// target step, the model's rounds can lose to the target while copy rounds win). Rounds of copies alone are judged
/// as copies ([`Pace::copies_only`]). Where the kind's pauses have a figure of their own, that stands for the copies
/// ([`Costs::pauses_ms`]).
fn rival(alone: Option<f64>, copies: Option<f64>) -> Option<f64> {
    match (alone, copies) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, _) => a,
    }
}

/// The load level a figure belongs to: requests at once per target worker, in powers of two (level 0: 1 request,
/// 1: 2, 2: 3-4, 3: 5-8, ...).
pub fn load_level(requests: usize) -> u32 {
    usize::BITS - requests.max(1).saturating_sub(1).leading_zeros()
}

/// The requests a load level stands for, as text (`1`, `2`, `3-4`, `5-8`, ...).
pub fn level_label(level: u32) -> String {
    match level {
        0 => "1".into(),
        1 => "2".into(),
        l => format!("{}-{}", (1usize << (l - 1)) + 1, 1usize << l),
    }
}

/// One kind of speculation at one load level.
#[derive(Debug, Clone, Default)]
struct SpecFigure {
    rate: Rate,
    /// Tokens written alone by requests of this kind since its last speculative round here.
    since: usize,
    /// Tokens written alone between two probe rounds while speculation loses: doubled after each probe that still
    /// loses, back to the least after one that wins (0 stands for [`PaceConfig::min_gap`]).
    gap: usize,
    /// Rounds reported here, by all requests.
    reports: usize,
    /// A request is making a first round here with no figure to judge it by (see [`Pace::advise`]).
    measuring: bool,
    /// A request took a probe here and has not asked for advice since ([`Costs::take_probe`]).
    probe_out: bool,
    /// What token-level rounds' verifications and drafts cost here ([`Costs::draft_length`]).
    passes: Passes,
    /// What the drafter's prefill costs here per context token (its first prefill of a request's context): the price
    /// of the tokens a request's draft has to catch up on before speculating again ([`Pace::position`]).
    entry: Rate,
}

#[derive(Debug, Clone, Default)]
struct Level {
    alone: Rate,
    spec: HashMap<String, SpecFigure>,
}

impl Level {
    /// What speculation of `kind` is set against besides the target alone ([`rival`]), where the kind's drafter
    /// copies in its pauses: what those pauses wrote per token as a whole (the copy rounds, those that found nothing
    /// to copy, and the target's calls alone), once a pause has measured it. Not the copy rounds' own figure, which
    /// counts only rounds that found a copy (and speculative rounds that drew their whole draft from copies): set
    /// against that, a model would rest for pauses that write more slowly than its own rounds.
    fn pauses_ms(&self, kind: &str) -> Option<f64> {
        let rate = |k: String| self.spec.get(&k).and_then(|s| s.rate.get());
        rate(copy_kind(kind)).and(rate(pause_kind(kind)))
    }
}

/// One figure of [`Costs::snapshot`].
#[derive(Debug, Clone, PartialEq)]
pub struct CostFigure {
    pub level: u32,
    /// `alone` (the target writing alone) or a kind of speculation.
    pub path: String,
    pub ms_per_token: f64,
}

/// Milliseconds per output token, per load level: the target writing alone and each kind of speculation (a mode and
/// its drafter, say `parse+token-spec/model`). Shared by the requests of one pool of workers.
#[derive(Debug, Default)]
pub struct Costs {
    cfg: PaceConfig,
    clock: Clock,
    levels: Mutex<HashMap<u32, Level>>,
    activity: Mutex<Activity>,
    reach: Mutex<HashMap<String, Reach>>,
    /// Per kind, its one-token guesses ([`Costs::guess_pays`]).
    guesses: Mutex<HashMap<String, Guesses>>,
    /// Output lengths of the pool's last [`PaceConfig::lengths`] finished requests, newest last.
    lengths: Mutex<std::collections::VecDeque<usize>>,
}

/// Where the pacing reads the time: the monotonic clock, or a test's.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> std::time::Instant + Send + Sync>);

impl Clock {
    pub fn new(now: impl Fn() -> std::time::Instant + Send + Sync + 'static) -> Self {
        Clock(Arc::new(now))
    }

    pub fn now(&self) -> std::time::Instant {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new(std::time::Instant::now)
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// The speculative rounds of a pool's requests: how many run now, and when the last ended.
#[derive(Debug, Default)]
struct Activity {
    running: usize,
    last_end: Option<std::time::Instant>,
}

/// Where a request's pace reports: the shared figures, the request's kind of speculation, how to read the
/// current load (requests at once per target worker), and the load from which the operator turned speculation off.
#[derive(Clone)]
pub struct Pacing {
    pub costs: Arc<Costs>,
    pub kind: String,
    pub load: Arc<dyn Fn() -> usize + Send + Sync>,
    /// Where the load is at least this, the target writes alone, as in `target` mode: no draft, no copies, no
    /// guesses, whatever the figures say (the router's `--speculation-off-at`; vLLM's
    /// `speculative_disable_by_batch_size` is the same setting). `None`: the figures alone decide.
    pub off_at: Option<usize>,
}

impl Pacing {
    /// Figures of one request's own, at a load of one.
    pub fn alone(kind: &str) -> Self {
        Pacing {
            costs: Arc::new(Costs::default()),
            kind: kind.to_string(),
            load: Arc::new(|| 1),
            off_at: None,
        }
    }

    /// Whether the operator turned speculation off at the current load ([`Pacing::off_at`]).
    pub fn off(&self) -> bool {
        self.off_at.is_some_and(|n| (self.load)() >= n)
    }
}

impl std::fmt::Debug for Pacing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pacing")
            .field("kind", &self.kind)
            .field("load", &(self.load)())
            .field("off_at", &self.off_at)
            .finish()
    }
}

/// What a round or a run of steps cost: its wall time and, where the workers measure it, the worker time charged to
/// it ([`crate::Verifier::charged_ms`]: each pass's time split among the requests in it by rows).
///
/// With one request per worker the wall time is the cost: it is the request's latency, round trips included, and
/// nobody else could have used the gaps. With more, it is not: a step that shares its pass with other requests'
/// verification blocks and prefills takes as long as the whole pass, so the target writing alone looks dearer the
/// more the others speculate, while what a request takes from the pool is its rows' share of the passes. Figures at
/// those levels are charged times where the workers report them: summed over the requests they are the pool's busy
/// time, and a request that takes the cheaper path per token raises the pool's throughput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spent {
    pub wall_ms: f64,
    pub charged_ms: Option<f64>,
}

impl Spent {
    /// Wall time alone (no worker reports a charge: in process).
    pub fn wall(ms: f64) -> Self {
        Spent {
            wall_ms: ms,
            charged_ms: None,
        }
    }

    /// The figure that counts at `level`.
    pub fn at(&self, level: u32) -> f64 {
        match self.charged_ms {
            Some(c) if level > 0 => c,
            _ => self.wall_ms,
        }
    }
}

/// Why the target writes alone for a while ([`Pace::advise`]): logged at debug level with the figures it was judged
/// by (`RUST_LOG=parse_core::pace=debug`), and the last one kept ([`Pace::why`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The operator turned speculation off at this load (the router's `--speculation-off-at`).
    Off,
    /// Speculation beats only the cheapest verification seen, an upper bound of the target's step: a short pause
    /// measures the target.
    TargetUnmeasured,
    /// The first rounds of its kind at this load lose by far, or the target's step here is not known.
    FirstRoundsLose,
    /// No figure of its kind at this load yet, and its drafter has more to catch up on than a first round is worth.
    CatchUpBeforeFirstRound,
    /// Its drafter's catching up is not priced yet and is many times the tokens left to write.
    CatchUpUnpriced,
    /// Speculation pays per token, but not for its drafter's catching up.
    CatchUpDoesNotPay,
    /// Speculation loses to the target alone (or to its copy rounds).
    Loses,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Why::Off => "speculation is off at this load (the router's --speculation-off-at)",
            Why::TargetUnmeasured => {
                "speculation beats only the cheapest verification seen: a short pause measures the target"
            }
            Why::FirstRoundsLose => "the first rounds here lose by far, or the target's step is not known",
            Why::CatchUpBeforeFirstRound => {
                "no figure here yet, and its drafter has more to catch up on than a first round is worth"
            }
            Why::CatchUpUnpriced => {
                "its drafter's catching up is not priced yet and is many times the tokens left to write"
            }
            Why::CatchUpDoesNotPay => "speculation does not pay for catching up",
            Why::Loses => "speculation loses to the target alone",
        })
    }
}

/// What a request does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Advice {
    Speculate,
    /// Let the target write up to this many tokens alone.
    Alone(usize),
}

/// One request's pace. Speculation goes on while it writes tokens at least as fast as the target alone, judged on
/// an estimate of its milliseconds per token: the request's own recent rounds, leaning on the shared figure of its
/// kind at the current load until it has made [`PaceConfig::probe_rounds`] rounds of its own (with no shared figure, it leans on
/// the first that other requests report while its rounds go on, and with none, those rounds are made before it is
/// judged). While it loses, the target writes alone, and every so many tokens written
/// alone at that load (16, doubling while probes keep losing and at least [`PaceConfig::probe_share`] times what the last
/// probe lost, up to [`PaceConfig::max_gap`]; counted over all requests of the kind) one request makes a probe round,
/// which measures it again. Before the target's own speed at a load is known, a one-row pass by the line fitted to
/// token-level verifications of its kind ([`Costs::one_row_ms`]) stands in for it, or where there is none, the
/// cheapest verification the request has seen (a one-token step costs no more), and the first pause is short, which
/// measures it. Where no request has reported a round of its kind at its load yet, one request at a time makes the
/// first, and the others write alone in short pauses until its figure is in.
/// Greedy only: a pause in a sampled request would change which random draws it uses.
#[derive(Debug)]
pub struct Pace {
    pacing: Pacing,
    /// This request's ms per token since its last pause, and its rounds there.
    own: Rate,
    rounds: usize,
    /// The shared figure when those rounds began (before they were reported to it), or where there was none, the
    /// first that others reported to while they went on.
    prior: Option<f64>,
    /// Rounds this request reported since it last paused.
    reported: usize,
    /// The last advice was to write alone.
    alone_last: bool,
    cheapest_verify_ms: Option<f64>,
    /// Tokens still to write alone in the current pause.
    paused: usize,
    /// The level of the last advice, which the next report belongs to.
    level: u32,
    probing: bool,
    /// A speculative round of this request is running (counted in the pool's [`Activity`]).
    in_round: bool,
    /// When this request's last round ended (a round that ends at the next advice ends after that advice's mark).
    round_ended: Option<std::time::Instant>,
    /// The level where this request makes the first round of its kind, with no figure there yet.
    measuring: Option<u32>,
    /// Where the request is ([`Pace::position`]): tokens written, tokens it may still write, and context tokens its
    /// drafter has not processed yet.
    written: usize,
    left: usize,
    lag: usize,
    /// Why the last pause began.
    why: Option<Why>,
    /// Pauses (runs of tokens written alone between speculative rounds) and the tokens written in them.
    pub pauses: usize,
    pub paused_tokens: usize,
    /// Times speculation would have paid per token but not for what its drafter had to catch up on first, and times
    /// a first round at a load with no figure yet was left to a request whose drafter had less to catch up on.
    pub entries_declined: usize,
    /// The copy round about to be made is a probe of copies that lose ([`Pace::copies_pay`]).
    probing_copies: bool,
    /// Probes this request took and has not given back yet ([`Costs::probe_back`]: at its next advice, or its end).
    held: Vec<(String, u32)>,
    /// The sort of the speculative round in progress, where it was chosen ([`Pace::choose_rounds`]).
    rounds_of: Option<Rounds>,
    /// The sort of this request's rounds since its last choice, the tokens they wrote, and whether the first of them
    /// is still to report (it pays for the switch, and goes to no sort's figure).
    streak: Option<(Rounds, usize, bool)>,
}

impl Drop for Pace {
    fn drop(&mut self) {
        self.end_round();
        self.give_back_probes();
        if let Some(level) = self.measuring.take() {
            self.pacing.costs.measured(&self.pacing.kind, level);
        }
    }
}

mod advise;
mod config;
mod costs;
mod length;
mod probes;
mod rates;
mod report;
#[cfg(test)]
mod tests;
