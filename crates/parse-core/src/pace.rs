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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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

/// Milliseconds per token over recent samples, each weighted by its tokens: a sample of [`Rate::SPAN`] tokens moves
/// the figure as far as one step of a moving average with weight 0.4 would, a one-token sample about a sixteenth as far
/// (so that one slow step, say the first after a wave of prefills, does not stand for the whole rate).
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    ms: f64,
    tokens: f64,
}

impl Rate {
    const SPAN: f64 = 16.0;
    const KEEP: f64 = 0.6;

    fn add(&mut self, ms: f64, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let keep = Self::KEEP.powf(tokens as f64 / Self::SPAN);
        self.ms = self.ms * keep + ms;
        self.tokens = self.tokens * keep + tokens as f64;
    }

    fn get(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.ms / self.tokens)
    }
}

/// One kind of speculation at one load level.
#[derive(Debug, Clone)]
struct SpecFigure {
    rate: Rate,
    /// Tokens written alone by requests of this kind since its last speculative round here.
    since: usize,
    /// Tokens written alone between two probe rounds while speculation loses: doubled after each probe that still
    /// loses, back to the least after one that wins.
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

/// Token-level rounds at one load: their verification passes (milliseconds against rows, rows being the pending token
/// and the drafted ones) and their drafting (milliseconds and tokens drafted), as sums that fade by [`Passes::KEEP`]
/// per round.
#[derive(Debug, Clone, Copy, Default)]
struct Passes {
    weight: f64,
    rows: f64,
    rows2: f64,
    verify_ms: f64,
    rows_ms: f64,
    draft_ms: f64,
    drafted: f64,
    /// Rounds reported (unfaded): every [`Passes::SPREAD_EVERY`]th drafts half as far while the rows have no spread.
    rounds: usize,
}

impl Passes {
    const KEEP: f64 = 0.9;
    const SPREAD_EVERY: usize = 4;

    fn add(&mut self, verify_ms: f64, rows: usize, draft_ms: f64, drafted: usize) {
        let (k, r) = (Self::KEEP, rows as f64);
        self.weight = self.weight * k + 1.0;
        self.rows = self.rows * k + r;
        self.rows2 = self.rows2 * k + r * r;
        self.verify_ms = self.verify_ms * k + verify_ms;
        self.rows_ms = self.rows_ms * k + r * verify_ms;
        self.draft_ms = self.draft_ms * k + draft_ms;
        self.drafted = self.drafted * k + drafted as f64;
        self.rounds += 1;
    }

    /// A verification's time as a line in its rows, fitted by least squares: (fixed ms, ms per row). `None` while
    /// the rows spread less than half a row either way (a line through one point).
    fn line(&self) -> Option<(f64, f64)> {
        let w = self.weight;
        let spread = w * self.rows2 - self.rows * self.rows;
        if w <= 0.0 || spread < 0.25 * w * w {
            return None;
        }
        let per_row = ((w * self.rows_ms - self.rows * self.verify_ms) / spread).max(0.0);
        Some((
            ((self.verify_ms - per_row * self.rows) / w).max(0.0),
            per_row,
        ))
    }

    /// Milliseconds per drafted token.
    fn ms_per_drafted(&self) -> f64 {
        if self.drafted > 0.0 {
            (self.draft_ms / self.drafted).max(0.0)
        } else {
            0.0
        }
    }
}

/// How often each position of a kind's token-level drafts is accepted, given the ones before it were: per position,
/// the drafts that reached it with every earlier token accepted, and those of them whose token was accepted, as sums
/// that fade by [`Reach::KEEP`] per round (at every position, so that a position the drafts no longer reach drifts
/// back to the prior and gets tried again).
#[derive(Debug, Clone, Default)]
struct Reach {
    offered: Vec<f64>,
    accepted: Vec<f64>,
}

impl Reach {
    const KEEP: f64 = 0.97;
    /// Weight of the prior of a position's rate: the rate of the position before it (the first position's, 1: a
    /// kind with no rounds yet drafts as far as it may, which measures it).
    const PRIOR: f64 = 2.0;

    fn add(&mut self, drafted: usize, accepted: usize) {
        if self.offered.len() < drafted {
            self.offered.resize(drafted, 0.0);
            self.accepted.resize(drafted, 0.0);
        }
        for j in 0..self.offered.len() {
            self.offered[j] *= Self::KEEP;
            self.accepted[j] *= Self::KEEP;
            if j < drafted && j <= accepted {
                self.offered[j] += 1.0;
                if j < accepted {
                    self.accepted[j] += 1.0;
                }
            }
        }
    }

    /// The chance that a draft's token at each position up to `max` is accepted with every one before it.
    fn reach(&self, max: usize) -> Vec<f64> {
        let (mut prior, mut all) = (1.0, 1.0);
        (0..max)
            .map(|j| {
                let (o, a) = (
                    self.offered.get(j).copied().unwrap_or(0.0),
                    self.accepted.get(j).copied().unwrap_or(0.0),
                );
                let p = (a + Self::PRIOR * prior) / (o + Self::PRIOR);
                prior = p;
                all *= p;
                all
            })
            .collect()
    }
}

/// A kind's one-token guesses ([`Costs::guess_pays`]): how many were made and how many the target kept (both decayed
/// by [`Guesses::KEEP`] per guess), and the guesses left out since the last one made while they lose.
#[derive(Debug, Default)]
struct Guesses {
    made: f64,
    right: f64,
    skipped: usize,
}

impl Guesses {
    /// About the last hundred guesses count.
    const KEEP: f64 = 0.99;

    /// The share of guesses the target keeps, with one kept and one not as the prior (a kind with no guesses yet
    /// guesses, which measures it).
    fn rate(&self) -> f64 {
        (self.right + 1.0) / (self.made + 2.0)
    }
}

/// The token-level round [`Costs::draft_length`] chooses: its draft length and the ms per output token it expects,
/// with the row and drafted-token prices it was judged by.
#[derive(Debug, Clone, Copy)]
struct BestRound {
    tokens: usize,
    ms_per_token: f64,
    per_row: f64,
    draft_ms: f64,
}

impl Default for SpecFigure {
    fn default() -> Self {
        SpecFigure {
            rate: Rate::default(),
            since: 0,
            gap: Costs::MIN_GAP,
            reports: 0,
            measuring: false,
            probe_out: false,
            passes: Passes::default(),
            entry: Rate::default(),
        }
    }
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
    levels: Mutex<HashMap<u32, Level>>,
    activity: Mutex<Activity>,
    reach: Mutex<HashMap<String, Reach>>,
    /// Per kind, its one-token guesses ([`Costs::guess_pays`]).
    guesses: Mutex<HashMap<String, Guesses>>,
    /// Output lengths of the pool's last [`Costs::LENGTHS`] finished requests, newest last.
    lengths: Mutex<std::collections::VecDeque<usize>>,
}

/// The speculative rounds of a pool's requests: how many run now, and when the last ended.
#[derive(Debug, Default)]
struct Activity {
    running: usize,
    last_end: Option<std::time::Instant>,
}

impl Costs {
    /// Tokens written alone before the first probe of a losing speculation, and at most between two.
    pub const MIN_GAP: usize = 16;
    pub const MAX_GAP: usize = 4096;
    /// After a losing probe, the next waits at least this many times the tokens the target alone would have written
    /// in the time the probe lost, its setup included (the draft's prefill of a request that had not drafted yet): a
    /// probe of a speculation that loses by far then costs at most a 33rd of the time between probes (gaps that only
    /// double let losing probes write a large share of a loaded pool's output). The price is a slower return to
    /// speculating where it starts to pay at that load: up to 4096 tokens written alone at that load by the requests
    /// of that kind.
    pub const PROBE_SHARE: f64 = 32.0;
    /// A drafted token that costs less than this share of a verification row counts as free
    /// ([`Costs::free_rounds_pay`]).
    pub const FREE_DRAFT: f64 = 0.01;
    /// Tokens the sort of rounds that writes faster at a load writes there before a request makes a round of the other
    /// sort ([`Costs::choose_rounds`]). Such a round costs what the other sort loses for one round: at most a few
    /// percent of the time of 128 tokens where they differ by a fifth.
    pub const TRY_OTHER_EVERY: usize = 128;
    /// While one-token guesses lose, one in this many places where they could be made still makes one
    /// ([`Costs::guess_pays`]).
    pub const GUESS_PROBE: usize = 8;
    /// Finished requests' lengths kept for [`Costs::expected_left`].
    pub const LENGTHS: usize = 256;
    /// Fewer past requests than this that wrote as far as a request has: its tokens so far stand for what is left.
    const MIN_LENGTHS: usize = 4;

    fn with<T>(&self, level: u32, f: impl FnOnce(&mut Level) -> T) -> T {
        let mut levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        f(levels.entry(level).or_default())
    }

    pub fn alone_ms(&self, level: u32) -> Option<f64> {
        self.with(level, |l| l.alone.get())
    }

    /// The target's figure at `level`, or where it has none yet, at the nearest level that has one (the lower of two
    /// as near) among those measured the same way (level 0 by wall time, the others by charged time, [`Spent::at`]).
    /// Loads just above a power of two (9 requests at 8 clients, while one request ends as the next begins) are
    /// otherwise judged against a verification's cost until a pause there measures the target.
    pub fn alone_near(&self, level: u32) -> Option<f64> {
        self.near(level, false, |l| l.alone.get())
    }

    /// `figure` at `level`, or at the nearest level that has it (the lower of two as near): among those measured the
    /// same way (see [`Costs::alone_near`]), or with `any_level`, among all.
    fn near(
        &self,
        level: u32,
        any_level: bool,
        figure: impl Fn(&Level) -> Option<f64>,
    ) -> Option<f64> {
        let levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        let figure = |l: u32| levels.get(&l).and_then(&figure);
        if level == 0 && !any_level {
            return figure(0);
        }
        let highest = levels.keys().copied().max().unwrap_or(0);
        (0..=highest.max(level)).find_map(|d| {
            [level.checked_sub(d), level.checked_add(d)]
                .into_iter()
                .flatten()
                .filter(|&l| any_level || l >= 1)
                .find_map(figure)
        })
    }

    /// A request of `kind` opened its drafter at `level`: the prefill of `rows` context tokens cost `ms`.
    pub fn record_entry(&self, kind: &str, level: u32, ms: f64, rows: usize) {
        self.with(level, |l| {
            l.spec
                .entry(kind.to_string())
                .or_default()
                .entry
                .add(ms, rows)
        })
    }

    /// What `kind`'s drafter costs per context token it catches up on, at `level` or where it has not been measured
    /// there, at the nearest level that has it, one request's wall time (level 0) and charged time alike: it is the
    /// drafter's prefill, whose price does not follow the target's load the way the target's figures do. Without a
    /// price from other levels, the last request of a loaded run, alone at last and hundreds of tokens in, could make
    /// the first round at one request with its whole context to prefill on the draft worker, with nothing to judge
    /// the catching up by.
    pub fn entry_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.near(level, true, |l| {
            l.spec.get(kind).and_then(|s| s.entry.get())
        })
    }

    /// A request of the pool finished with `tokens` of output.
    pub fn record_length(&self, tokens: usize) {
        let mut l = self.lengths.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() == Self::LENGTHS {
            l.pop_front();
        }
        l.push_back(tokens);
    }

    /// How many more tokens a request that has written `written` and may write `left` more is expected to write:
    /// the mean of what the pool's past requests that wrote more than `written` wrote beyond it (each at most
    /// `left`). Where fewer than [`Costs::MIN_LENGTHS`] got that far, `written` itself (the median of what is left
    /// when nothing is known of where in its length a request is), and while the pool has finished fewer than
    /// [`Costs::MIN_LENGTHS`] requests, `left` (no history: judged over the whole budget, as a fresh request always
    /// was).
    pub fn expected_left(&self, written: usize, left: usize) -> usize {
        let l = self.lengths.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() < Self::MIN_LENGTHS {
            return left;
        }
        let beyond: Vec<usize> = l
            .iter()
            .filter(|&&n| n > written)
            .map(|&n| (n - written).min(left))
            .collect();
        if beyond.len() < Self::MIN_LENGTHS {
            return written.min(left);
        }
        beyond.iter().sum::<usize>() / beyond.len()
    }

    pub fn spec_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| l.spec.get(kind).and_then(|s| s.rate.get()))
    }

    /// What `kind`'s speculation writes per token at `level` by its better sort of rounds, where it makes either and
    /// both have a figure there ([`Costs::choose_rounds`]: a request makes the better one), otherwise by all its
    /// rounds ([`Costs::spec_ms`]).
    pub fn best_spec_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| {
            let rate = |k: String| l.spec.get(&k).and_then(|s| s.rate.get());
            let all = rate(kind.to_string());
            match (
                rate(Rounds::Segments.figure(kind)),
                rate(Rounds::Tokens.figure(kind)),
            ) {
                (Some(s), Some(t)) if all.is_some() => Some(s.min(t)),
                _ => all,
            }
        })
    }

    /// What `kind`'s speculation is set against besides the target alone at `level` ([`Level::pauses_ms`]).
    pub fn pauses_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| l.pauses_ms(kind))
    }

    /// A pause of a request of `kind` at `level` wrote `tokens` in `ms` (any way: [`Level::pauses_ms`]).
    fn record_paused(&self, kind: &str, level: u32, ms: f64, tokens: usize) {
        self.with(level, |l| {
            l.spec
                .entry(pause_kind(kind))
                .or_default()
                .rate
                .add(ms, tokens)
        })
    }

    /// [`Costs::spec_ms`] and how many rounds were reported to it.
    fn spec_figure(&self, kind: &str, level: u32) -> (Option<f64>, usize) {
        self.with(level, |l| {
            l.spec
                .get(kind)
                .map_or((None, 0), |s| (s.rate.get(), s.reports))
        })
    }

    /// The target wrote `tokens` alone in `ms`: for a paused request of `kind`, or (`None`) in `target` mode.
    pub fn record_alone(&self, kind: Option<&str>, level: u32, ms: f64, tokens: usize) {
        self.add_alone(kind, level, ms, tokens, false);
    }

    /// [`Costs::record_alone`] for tokens written while another request's speculative round ran (`beside`): they
    /// count towards the next probe, but not towards the target's figure at that level, once it has one.
    ///
    /// Where workers share their cores (a draft worker beside the target worker on one host), a step written beside
    /// others' drafting takes longer, in wall time and in the time charged to it, and the longer the more requests
    /// draft: a figure of the target taken then makes speculation look cheaper by comparison, more requests
    /// speculate, and the target looks dearer still: a feedback loop that keeps requests speculating where it loses.
    fn add_alone(&self, kind: Option<&str>, level: u32, ms: f64, tokens: usize, beside: bool) {
        if tokens == 0 {
            return;
        }
        self.with(level, |l| {
            if !beside || l.alone.get().is_none() {
                l.alone.add(ms, tokens);
            }
            if let Some(k) = kind {
                l.spec.entry(k.to_string()).or_default().since += tokens;
            }
        })
    }

    /// A paused request of `kind` wrote `tokens` by other means than the target alone (copy rounds while the model
    /// rests): they count towards the next probe, as tokens written alone do, and not towards any figure.
    fn add_rested(&self, kind: &str, level: u32, tokens: usize) {
        self.with(level, |l| {
            l.spec.entry(kind.to_string()).or_default().since += tokens
        })
    }

    fn activity<T>(&self, f: impl FnOnce(&mut Activity) -> T) -> T {
        f(&mut self.activity.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn round_begins(&self) {
        self.activity(|a| a.running += 1)
    }

    fn round_ends(&self) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.activity(|a| {
            a.running = a.running.saturating_sub(1);
            a.last_end = Some(now);
        });
        now
    }

    /// A round of `kind` wrote `tokens` in `ms`. `probe`: it was a probe of a speculation that was losing, with what
    /// its setup cost besides `ms` (the draft's first prefill, which a request that goes on speculating pays once and
    /// which is not part of the rate, but which a probe pays for a single round).
    pub fn record_spec(&self, kind: &str, level: u32, ms: f64, tokens: usize, probe: Option<f64>) {
        self.with(level, |l| {
            let alone = rival(l.alone.get(), l.pauses_ms(kind));
            let s = l.spec.entry(kind.to_string()).or_default();
            s.since = 0;
            s.reports += 1;
            s.rate.add(ms, tokens);
            match (s.rate.get(), alone) {
                (Some(x), Some(a)) if x > a => {
                    if let Some(setup) = probe {
                        let lost = ((ms + setup) / a - tokens as f64).max(0.0);
                        let pay = (Self::PROBE_SHARE * lost).ceil() as usize;
                        s.gap = (s.gap * 2).max(pay).min(Self::MAX_GAP);
                    }
                }
                _ => s.gap = Self::MIN_GAP,
            }
        })
    }

    /// Tokens still to be written alone before the next probe of `kind` (0: a probe is due).
    fn until_probe(&self, kind: &str, level: u32) -> usize {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.gap.saturating_sub(s.since)
        })
    }

    /// Whether a request may make the first round of `kind` at `level`, which has no figure: only if no other
    /// request is making one (it then counts as making it, until [`Costs::measured`]).
    fn take_measuring(&self, kind: &str, level: u32) -> bool {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            let free = !s.measuring;
            s.measuring = true;
            free
        })
    }

    /// The first round taken with [`Costs::take_measuring`] reported, or its request ended.
    fn measured(&self, kind: &str, level: u32) {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.measuring = false;
        })
    }

    /// Takes the due probe of `kind`, so that one request makes it, not every request at once: due once the tokens
    /// written alone since the last one reach the gap and, for a request whose drafter must catch up first, also
    /// [`Costs::PROBE_SHARE`] times the tokens the target alone writes in the time that takes (`catch_up`, see
    /// [`Pace::catch_up_tokens`]), and not while another request's probe here is out ([`Costs::probe_back`]).
    ///
    /// Both bound what probes cost where they lose by far. On a router at 8 clients whose first round at a load
    /// lost 4x to the target, every 16 tokens written alone made another probe due while the ones taken had not
    /// reported yet (each a whole PARSE round, 2-3 s at that load): 11 probes at 5-8 requests in 6 s. And a probe
    /// went to whichever request asked first, at the end of a run a request hundreds of tokens in whose draft had
    /// its whole context to prefill first (2-3.5 s at 2 requests, which the run's last requests wait for).
    fn take_probe(&self, kind: &str, level: u32, catch_up: usize) -> bool {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            let setup = (Self::PROBE_SHARE * catch_up as f64).ceil() as usize;
            let due = !s.probe_out && s.since >= s.gap.saturating_add(setup);
            if due {
                s.since = 0;
                s.probe_out = true;
            }
            due
        })
    }

    /// The probe a request took ([`Costs::take_probe`]) is over: reported, or the request has moved on.
    fn probe_back(&self, kind: &str, level: u32) {
        self.with(level, |l| {
            if let Some(s) = l.spec.get_mut(kind) {
                s.probe_out = false;
            }
        })
    }

    /// Which rounds a request of `kind` at `level` should speculate with ([`Rounds`]): PARSE rounds until they have a
    /// figure there, then token-level rounds until those have one, then the sort that writes at fewer ms per token,
    /// except that every [`Costs::TRY_OTHER_EVERY`] tokens the winner wrote there, one request makes a round of the
    /// other sort, which measures it again (the load, the task and the drafter's hits move both).
    pub fn choose_rounds(&self, kind: &str, level: u32) -> Rounds {
        let (segments, tokens) = (Rounds::Segments.figure(kind), Rounds::Tokens.figure(kind));
        self.with(level, |l| {
            let rate = |name: &str| l.spec.get(name).and_then(|f| f.rate.get());
            let winner = match (rate(&segments), rate(&tokens)) {
                (None, _) => return Rounds::Segments,
                (Some(_), None) => return Rounds::Tokens,
                (Some(s), Some(t)) if t < s => Rounds::Tokens,
                _ => Rounds::Segments,
            };
            let other = l.spec.entry(winner.other().figure(kind)).or_default();
            if other.since >= Self::TRY_OTHER_EVERY {
                other.since = 0;
                winner.other()
            } else {
                winner
            }
        })
    }

    /// A speculative round of `rounds` made by a request of `kind` at `level` wrote `tokens` in `ms` (`None`: the
    /// first round of a switch, which is no figure of the sort): that sort's figure, and towards the next round of
    /// the other sort there.
    pub fn record_rounds(
        &self,
        kind: &str,
        rounds: Rounds,
        level: u32,
        ms: Option<f64>,
        tokens: usize,
    ) {
        self.with(level, |l| {
            if let Some(ms) = ms {
                l.spec
                    .entry(rounds.figure(kind))
                    .or_default()
                    .rate
                    .add(ms, tokens);
            }
            l.spec.entry(rounds.other().figure(kind)).or_default().since += tokens;
        })
    }

    /// Tokens written alone at `level` by requests of `kind` since its last round there.
    fn since(&self, kind: &str, level: u32) -> usize {
        self.with(level, |l| l.spec.get(kind).map_or(0, |s| s.since))
    }

    /// A token-level round of `kind` at `level` drafted `drafted` tokens in `draft_ms` and the target kept `accepted`
    /// of them, verifying in `verify_ms`.
    pub fn record_token_round(
        &self,
        kind: &str,
        level: u32,
        drafted: usize,
        accepted: usize,
        verify_ms: f64,
        draft_ms: f64,
    ) {
        if drafted == 0 {
            return;
        }
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.passes.add(verify_ms, drafted + 1, draft_ms, drafted);
        });
        let mut reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
        reach
            .entry(kind.to_string())
            .or_default()
            .add(drafted, accepted.min(drafted));
    }

    /// How many tokens (1 to `max`) a token-level round of `kind` at `level` should draft: the length that writes
    /// the most tokens per millisecond, by the measured chance of each position being accepted and the measured
    /// costs here: a verification's time as a line in its rows ([`Passes::line`], where the drafts' lengths spread;
    /// otherwise a row is the verifications' mean time less the target's one-token step, over their mean rows less
    /// one), and a drafted token's time. A round of `k` tokens is taken to write `1 + P1 + ... + Pk` tokens (`Pj`:
    /// its first `j` accepted; the 1 is the target's own token after them) in the time of a verification of `k + 1`
    /// rows and `k` drafted tokens.
    ///
    /// A row's cost is the multi-row kernels' price and differs several-fold by machine and load (AVX2 kernels
    /// against AMX tiles), and how far a drafter is right differs by task (prompt lookup copying a quote, then nothing), so neither is a constant here.
    /// `max` where nothing is measured yet; while the rows have no spread and the target's step is not known, every
    /// [`Passes::SPREAD_EVERY`]th round drafts half as far, which gives the line its second point.
    pub fn draft_length(&self, kind: &str, level: u32, max: usize) -> usize {
        match self.best_round(kind, level, max) {
            Ok(best) => best.tokens,
            Err(length) => length,
        }
    }

    /// The token-level round [`Costs::draft_length`] chooses, with what it expects of it; where the figures cannot
    /// say yet, `Err` with the length to draft (`max`, or half of it on a spreading round).
    fn best_round(&self, kind: &str, level: u32, max: usize) -> Result<BestRound, usize> {
        let passes = self.passes(kind, level);
        if passes.weight <= 0.0 {
            return Err(max);
        }
        let Some((fixed, per_row)) = self.row_line(&passes, level) else {
            let spread_round = passes.rounds % Passes::SPREAD_EVERY == Passes::SPREAD_EVERY - 1;
            return Err(if spread_round { max.div_ceil(2) } else { max });
        };
        let draft = passes.ms_per_drafted();
        let reach = {
            let r = self.reach.lock().unwrap_or_else(|e| e.into_inner());
            r.get(kind).cloned().unwrap_or_default().reach(max)
        };
        let (mut best, mut best_ms, mut tokens) = (max, f64::MAX, 1.0);
        for (j, pj) in reach.iter().enumerate() {
            let k = (j + 1) as f64;
            tokens += pj;
            let ms = (fixed + per_row * (k + 1.0) + k * draft).max(1e-9) / tokens;
            if ms < best_ms {
                (best, best_ms) = (j + 1, ms);
            }
        }
        Ok(BestRound {
            tokens: best,
            ms_per_token: best_ms,
            per_row,
            draft_ms: draft,
        })
    }

    /// `kind`'s verification passes at `level` (none yet: empty).
    fn passes(&self, kind: &str, level: u32) -> Passes {
        self.with(level, |l| l.spec.get(kind).map(|s| s.passes))
            .unwrap_or_default()
    }

    /// A verification's time at `level` as a line in its rows, (fixed ms, ms per row), from a kind's `passes`
    /// ([`Passes::line`], where the drafts' lengths spread; otherwise a row is the verifications' mean time less the
    /// target's one-token step, over their mean rows less one); `None` where neither can be read yet.
    fn row_line(&self, passes: &Passes, level: u32) -> Option<(f64, f64)> {
        if passes.weight <= 0.0 {
            return None;
        }
        let step = self.alone_ms(level).or_else(|| self.alone_near(level));
        match (passes.line(), step) {
            (Some(line), _) => Some(line),
            (None, Some(step)) if passes.rows > passes.weight => {
                let per_row = ((passes.verify_ms - step * passes.weight)
                    / (passes.rows - passes.weight))
                    .max(0.0);
                Some((step - per_row, per_row))
            }
            _ => None,
        }
    }

    /// Whether a request of `kind` at `level` whose drafter proposes nothing should have the target verify a guess
    /// of one token ([`Drafter::guess_lookup`]: the token after the latest earlier occurrence of the context's last
    /// token) rather than write alone: where a guess round (a verification of two rows) is expected to write faster
    /// than the target's step, by the share of guesses the target kept and the measured price of rows. A guess
    /// that misses costs one row; one kept writes two tokens for a verification. Where the figures cannot say yet,
    /// it guesses (which measures them); while guesses lose, one in [`Costs::GUESS_PROBE`] is still made, so that
    /// a task where they start to pay is seen.
    ///
    /// Prompt lookup drafts from matches of two tokens or more: what a one-token match proposes is kept about half
    /// as often, and the tokens after it, each kept only with all before it, do not pay. One token alone does,
    /// wherever more of them are kept than a row costs in steps.
    ///
    /// [`Drafter::guess_lookup`]: crate::driver::Drafter::guess_lookup
    pub fn guess_pays(&self, kind: &str, level: u32) -> bool {
        let passes = self.passes(kind, level);
        let step = self.alone_ms(level).or_else(|| self.alone_near(level));
        let mut guesses = self.guesses.lock().unwrap_or_else(|e| e.into_inner());
        let g = guesses.entry(kind.to_string()).or_default();
        let pays = match (self.row_line(&passes, level), step) {
            (Some((fixed, per_row)), Some(step)) => {
                (fixed + 2.0 * per_row) / (1.0 + g.rate()) < step
            }
            _ => true,
        };
        if pays {
            g.skipped = 0;
            return true;
        }
        g.skipped += 1;
        if g.skipped >= Self::GUESS_PROBE {
            g.skipped = 0;
            return true;
        }
        false
    }

    /// A one-token guess of `kind` at `level` was verified in `verify_ms` (a pass of two rows, which goes to the
    /// kind's price of rows as any token-level round's does, not to its chance of each position being accepted:
    /// that is its drafts' own): the target kept it (`right`) or not.
    pub fn record_guess(&self, kind: &str, level: u32, verify_ms: f64, right: bool) {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.passes.add(verify_ms, 2, 0.0, 1);
        });
        let mut guesses = self.guesses.lock().unwrap_or_else(|e| e.into_inner());
        let g = guesses.entry(kind.to_string()).or_default();
        g.made = g.made * Guesses::KEEP + 1.0;
        g.right = g.right * Guesses::KEEP + f64::from(u8::from(right));
    }

    /// Whether `kind`'s token-level rounds at `level` draft for nothing and are expected to write faster than the
    /// target alone: its drafts cost less than [`Costs::FREE_DRAFT`] of a verification row (prompt lookup: a few
    /// microseconds a token against milliseconds a row), and the round [`Costs::draft_length`] chooses, by the
    /// measured chance of each position being accepted and the measured price of rows, writes at fewer ms per token
    /// than the target's step there. Such a round can lose only its rows, and only where the lookup proposed
    /// something, so its request need not pause when its own last rounds lost ([`Pace::advise`]).
    pub fn free_rounds_pay(&self, kind: &str, level: u32, max: usize) -> bool {
        let Some(step) = self.alone_ms(level) else {
            return false;
        };
        match self.best_round(kind, level, max) {
            Ok(b) => {
                b.per_row > 0.0
                    && b.draft_ms <= Self::FREE_DRAFT * b.per_row
                    && b.ms_per_token < step
            }
            Err(_) => false,
        }
    }

    /// What a one-row pass of the target costs at `level` by the line of [`Costs::draft_length`] (token-level rounds
    /// of `kind` whose drafts' lengths spread): a stand-in for the target's step where it has not written alone at
    /// that load yet.
    pub fn one_row_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| l.spec.get(kind).and_then(|s| s.passes.line()))
            .map(|(fixed, per_row)| fixed + per_row)
    }

    /// Every figure measured so far, by level then path.
    pub fn snapshot(&self) -> Vec<CostFigure> {
        let levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (&level, l) in levels.iter() {
            if let Some(ms) = l.alone.get() {
                out.push(CostFigure {
                    level,
                    path: "alone".into(),
                    ms_per_token: ms,
                });
            }
            for (k, s) in &l.spec {
                if let Some(ms) = s.rate.get() {
                    out.push(CostFigure {
                        level,
                        path: k.clone(),
                        ms_per_token: ms,
                    });
                }
            }
        }
        out.sort_by(|a, b| (a.level, &a.path).cmp(&(b.level, &b.path)));
        out
    }
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

/// What a request does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Advice {
    Speculate,
    /// Let the target write up to this many tokens alone.
    Alone(usize),
}

/// One request's pace. Speculation goes on while it writes tokens at least as fast as the target alone, judged on
/// an estimate of its milliseconds per token: the request's own recent rounds, leaning on the shared figure of its
/// kind at the current load until it has made [`Pace::PROBE`] rounds of its own (with no shared figure, it leans on
/// the first that other requests report while its rounds go on, and with none, those rounds are made before it is
/// judged). While it loses, the target writes alone, and every so many tokens written
/// alone at that load (16, doubling while probes keep losing and at least [`Costs::PROBE_SHARE`] times what the last
/// probe lost, up to [`Costs::MAX_GAP`]; counted over all requests of the kind) one request makes a probe round,
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

impl Pace {
    /// Rounds of its own after which a request is judged on them alone.
    pub const PROBE: usize = 3;
    /// Context tokens a drafter may catch up on per token left to write, where no drafter's prefill is priced yet
    /// ([`Pace::entry_unpriced_and_far`]).
    pub const UNPRICED_ENTRY: usize = 32;
    /// The first pause where the target's speed at this load is not known yet.
    pub const FIRST_PAUSE: usize = 4;
    /// Tokens a request writes by the sort of rounds it chose before it chooses again ([`Pace::choose_rounds`]).
    pub const STREAK: usize = 32;
    /// The longest pause before the figures are read again (the load may have moved).
    const MAX_PAUSE: usize = 64;
    /// A request measuring the first rounds of its kind at a load stops before [`Pace::PROBE`] rounds where its
    /// rounds so far cost more than this many times the target's step per token: two more rounds do not turn such a
    /// loss (the default's rounds on HumanEval wrote at about 0.7 of a step on average, 1.43-1.46x `target`; its
    /// first rounds on MT-Bench at about 3 steps).
    const FAR_BEHIND: f64 = 2.0;

    pub fn new(pacing: Pacing) -> Self {
        Pace {
            pacing,
            own: Rate::default(),
            rounds: 0,
            prior: None,
            reported: 0,
            alone_last: false,
            cheapest_verify_ms: None,
            paused: 0,
            level: 0,
            probing: false,
            in_round: false,
            round_ended: None,
            measuring: None,
            written: 0,
            left: 0,
            lag: 0,
            pauses: 0,
            paused_tokens: 0,
            entries_declined: 0,
            probing_copies: false,
            held: Vec::new(),
            rounds_of: None,
            streak: None,
        }
    }

    /// Where the request stands before the next advice: it has written `written` tokens, may write `left` more, and
    /// its drafter has `lag` context tokens to process before it can draft (its whole context, where it never drafted;
    /// what the target wrote alone since its last round).
    pub fn position(&mut self, written: usize, left: usize, lag: usize) {
        (self.written, self.left, self.lag) = (written, left, lag);
    }

    /// Whether starting to speculate, where it pays `alone - spec` ms per token, pays for the drafter's catching up
    /// first. A request that writes alone leaves its drafter behind, and its first round makes the drafter process
    /// every token since (a whole context where it never drafted), at the drafter's prefill price per token
    /// ([`Costs::entry_ms`]); the gain comes only over the tokens still to be written ([`Costs::expected_left`]).
    /// Under load this is most of what speculation costs once it has paused: as a run's requests end the load falls
    /// until speculation pays per token, and the last requests, hundreds of tokens in, would have the draft worker
    /// prefill their whole context (at about the target's price per token) for a few dozen tokens left. Only checked
    /// where the request is not speculating already.
    fn entry_pays(&self, spec: f64, alone: f64) -> bool {
        if self.lag == 0 || !(self.alone_last || self.rounds == 0) {
            return true;
        }
        let costs = &self.pacing.costs;
        let Some(row) = costs.entry_ms(&self.pacing.kind, self.level) else {
            return true;
        };
        let horizon = costs.expected_left(self.written, self.left);
        (alone - spec) * horizon as f64 >= row * self.lag as f64
    }

    /// Whether the drafter has more to catch up on than [`Pace::UNPRICED_ENTRY`] tokens for each token the request is
    /// expected to write still ([`Costs::expected_left`]), where no drafter's prefill has been priced in the pool
    /// yet ([`Costs::entry_ms`]: [`Pace::entry_pays`] has nothing to judge by). Speculation saves less than the
    /// target's step per token written, and a drafter's prefill is taken to cost at least a 32nd of that step per
    /// token it catches up on (the default draft's costs about a third of the target's step), so such an entry loses
    /// whatever it accepts: without this rule the first request of a fresh router with a long prompt and a few
    /// tokens to write would have the draft worker prefill the whole prompt after the target had.
    fn entry_unpriced_and_far(&self) -> bool {
        let costs = &self.pacing.costs;
        self.lag > 0
            && (self.alone_last || self.rounds == 0)
            && costs.entry_ms(&self.pacing.kind, self.level).is_none()
            && self.lag > Self::UNPRICED_ENTRY * costs.expected_left(self.written, self.left).max(1)
    }

    /// The drafter's first prefill, of `rows` context tokens, cost `spent` ([`Costs::record_entry`]).
    pub fn draft_opened(&self, spent: Spent, rows: usize) {
        if rows > 0 {
            self.pacing.costs.record_entry(
                &self.pacing.kind,
                self.level,
                spent.at(self.level),
                rows,
            );
        }
    }

    /// Whether the shared figures at the current load say this request's speculation pays (its kind's ms per token
    /// at most the target's alone, or its copy rounds' where those are faster), or have no figure of its kind there
    /// yet (a first round would measure it). No side effect: the advice itself comes from [`Pace::advise`]. Read
    /// before the target's prefill, to let the drafter process the prompt beside it ([`Drafter::warm`]).
    ///
    /// [`Drafter::warm`]: crate::driver::Drafter::warm
    pub fn leans_to_speculate(&self) -> bool {
        if self.pacing.off() {
            return false;
        }
        let costs = &self.pacing.costs;
        let level = load_level((self.pacing.load)());
        let Some(spec) = costs.best_spec_ms(&self.pacing.kind, level) else {
            return true;
        };
        let alone = costs.alone_ms(level).or_else(|| costs.alone_near(level));
        let copies = costs.pauses_ms(&self.pacing.kind, level);
        rival(alone, copies).is_none_or(|a| spec <= a)
    }

    /// The request finished with `tokens` of output ([`Costs::record_length`]).
    pub fn finished(&self, tokens: usize) {
        self.pacing.costs.record_length(tokens);
    }

    fn estimate(&self) -> Option<f64> {
        match (self.own.get(), self.prior) {
            (Some(o), _) if self.rounds >= Self::PROBE => Some(o),
            (Some(o), Some(s)) => {
                let w = self.rounds as f64 / Self::PROBE as f64;
                Some(w * o + (1.0 - w) * s)
            }
            (None, Some(s)) => Some(s),
            (_, None) => None,
        }
    }

    /// Speculate or write alone, now.
    pub fn advise(&mut self) -> Advice {
        self.end_round();
        self.give_back_probes();
        self.rounds_of = None;
        if self.paused > 0 {
            return Advice::Alone(self.paused);
        }
        let (costs, kind) = (&self.pacing.costs, self.pacing.kind.as_str());
        self.level = load_level((self.pacing.load)());
        self.probing = false;
        if self.pacing.off() {
            // The operator's setting, whatever the figures say: the longest pause, after which the load is read again.
            return self.pause(
                Self::MAX_PAUSE,
                "speculation is off at this load (the router's --speculation-off-at)",
            );
        }
        if self.rounds == 0 {
            self.prior = costs.best_spec_ms(kind, self.level);
        } else if self.prior.is_none() {
            // Rounds made with no figure to lean on. Where others reported rounds at this load meanwhile (requests
            // that began together on a router that had not measured this load), their figure counts as if it had
            // been there: each request is then judged after its first round, not its first PROBE rounds (on a
            // fresh router at 8 clients those rounds wrote a third of the output, as whole PARSE rounds, at a loss).
            // The figure holds this request's own rounds too, weighed once more: a small bias towards them.
            let (figure, reports) = costs.spec_figure(kind, self.level);
            if reports > self.reported {
                self.prior = figure.and(costs.best_spec_ms(kind, self.level));
            }
        }
        let known_alone = costs.alone_ms(self.level);
        let step = known_alone
            .or_else(|| costs.alone_near(self.level))
            .or_else(|| costs.one_row_ms(kind, self.level));
        let alone = step.or(self.cheapest_verify_ms);
        let estimate = self.estimate();
        let copies = costs.pauses_ms(kind, self.level);
        if step.is_none()
            && let (Some(spec), Some(alone)) = (estimate, alone)
            && spec <= alone
        {
            // Speculation beats the cheapest verification the request has seen, which is only an upper bound of
            // the target's step: a PARSE round's verification is a block of up to 128 rows, which costs several
            // steps where rows are dear. A short pause measures the target itself before the request goes on;
            // judged against its blocks alone, a request would never pause where speculation loses.
            return self.pause(Self::FIRST_PAUSE, "speculation beats only the cheapest verification seen: a short pause measures the target");
        }
        if estimate.is_none()
            && self.rounds > 0
            && step.is_none_or(|s| self.own.get().is_some_and(|own| own > Self::FAR_BEHIND * s))
        {
            // This request measures the first rounds of its kind here (no figure before them), and either the
            // target's own step at this load was never measured (nothing to judge the round by but the cheapest
            // verification, only an upper bound of a step) or its rounds so far lose to that step by far. A short
            // pause measures the target; the rounds' figure, reported to the shared costs, is the prior after it.
            // Without it the request would go on for [`Pace::PROBE`] rounds before it was judged, however far its
            // rounds lose.
            return self.pause(
                Self::FIRST_PAUSE,
                "the first rounds here lose by far, or the target's step is not known",
            );
        }
        let catch_up = self.catch_up_tokens(alone);
        if estimate.is_none()
            && self.rounds == 0
            && self.measuring.is_none()
            && costs.since(kind, self.level) < (Costs::PROBE_SHARE * catch_up as f64) as usize
        {
            // No figure here yet, and this request's drafter has more to catch up on than the tokens written alone
            // here so far pay for, as a probe's would ([`Costs::take_probe`]): the first round is left to another
            // request, or to this one later. At the end of a run on a router at 8 clients, each load the falling
            // count of requests reached was first measured by a request hundreds of tokens in.
            self.entries_declined += 1;
            return self.pause(Self::MAX_PAUSE, "no figure here yet, and its drafter has more to catch up on than a first round is worth");
        }
        if self.entry_unpriced_and_far() {
            self.entries_declined += 1;
            return self.pause(
                Self::MAX_PAUSE,
                "its drafter's catching up is not priced yet and is many times the tokens left to write",
            );
        }
        // From here on speculation is judged against the cheaper of the target alone and the request's copy rounds.
        let alone = rival(alone, copies);
        if let (Some(spec), Some(alone)) = (estimate, alone)
            && spec <= alone
            && !self.entry_pays(spec, alone)
        {
            // Speculation pays per token, not for its entry: a full pause, after which the figures are read again
            // (the lag will be longer and the tokens left fewer, unless the load has fallen).
            self.entries_declined += 1;
            return self.pause(Self::MAX_PAUSE, "speculation does not pay for catching up");
        }
        let speculate = match (estimate, alone) {
            (Some(spec), Some(alone)) => spec <= alone,
            // Nothing to judge by: a round measures. One request at a time makes the first round of a kind at a
            // level with no figure; the others write alone (the short first pause) until its figure is in, so that a
            // fresh loaded router does not open a draft session for every request to measure the same thing.
            (None, _) if self.rounds == 0 && self.measuring.is_none() => {
                let mine = costs.take_measuring(kind, self.level);
                if mine {
                    self.measuring = Some(self.level);
                }
                mine
            }
            _ => true,
        };
        // A probe measures a speculation that loses, never one with no figure yet (one request is measuring it).
        let probe = || estimate.is_some() && costs.take_probe(kind, self.level, catch_up);
        if speculate || (self.rounds == 0 && probe()) {
            if !speculate {
                self.held.push((kind.to_string(), self.level));
            }
            return self.begin_round(!speculate);
        }
        let pause = if known_alone.is_none() || estimate.is_none() {
            Self::FIRST_PAUSE
        } else {
            costs
                .until_probe(kind, self.level)
                .clamp(Self::FIRST_PAUSE, Self::MAX_PAUSE)
        };
        self.pause(pause, "speculation loses to the target alone")
    }

    /// [`Pace::advise`] before a token-level round that may draft up to `max` tokens. At one request, where the
    /// kind's drafts cost nothing and the round they would make is expected to write faster than the target alone
    /// ([`Costs::free_rounds_pay`]), it speculates without judging the request's own last rounds, and ends a pause:
    /// such a round loses at most its rows, and only where the lookup found something to copy, while a pause loses
    /// every copy it would have made.
    /// Not at higher loads, where pauses are what keeps speculation from losing to a batched target.
    pub fn advise_token_round(&mut self, max: usize) -> Advice {
        let costs = &self.pacing.costs;
        if load_level((self.pacing.load)()) == 0
            && !self.pacing.off()
            && costs.free_rounds_pay(&self.pacing.kind, 0, max)
        {
            self.end_round();
            self.give_back_probes();
            self.level = 0;
            self.paused = 0;
            return self.begin_round(false);
        }
        self.advise()
    }

    /// Advice to speculate, with the bookkeeping of a round that begins (`probing`: a probe of a speculation that
    /// was losing).
    fn begin_round(&mut self, probing: bool) -> Advice {
        self.probing = probing;
        self.alone_last = false;
        self.in_round = true;
        self.pacing.costs.round_begins();
        Advice::Speculate
    }

    /// What the drafter's catching up before a round would cost (its lag at its measured prefill price per context
    /// token, [`Costs::entry_ms`]) in tokens the target writes alone meanwhile (`alone`: its ms per token); 0 where
    /// either is not known.
    fn catch_up_tokens(&self, alone: Option<f64>) -> usize {
        match (
            self.pacing.costs.entry_ms(&self.pacing.kind, self.level),
            alone,
        ) {
            (Some(row), Some(a)) if a > 0.0 => (row * self.lag as f64 / a).ceil() as usize,
            _ => 0,
        }
    }

    /// Gives back the probes this request took ([`Costs::probe_back`]): their rounds are over.
    fn give_back_probes(&mut self) {
        for (kind, level) in std::mem::take(&mut self.held) {
            self.pacing.costs.probe_back(&kind, level);
        }
    }

    /// Advice to write `tokens` alone, with the bookkeeping of a pause; `why` and the figures it was judged by go to
    /// the log at debug level (`RUST_LOG=parse_core::pace=debug`), for an operator asking why a request stopped
    /// speculating.
    fn pause(&mut self, tokens: usize, why: &'static str) -> Advice {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let costs = &self.pacing.costs;
            tracing::debug!(
                kind = %self.pacing.kind,
                level = self.level,
                tokens,
                written = self.written,
                rounds = self.rounds,
                own_ms_per_token = ?self.own.get(),
                estimate_ms_per_token = ?self.estimate(),
                shared_ms_per_token = ?costs.spec_ms(&self.pacing.kind, self.level),
                alone_ms_per_token = ?costs.alone_ms(self.level).or_else(|| costs.alone_near(self.level)),
                "pace: the target writes alone: {why}"
            );
        }
        self.paused = tokens;
        self.streak = None;
        if !self.alone_last {
            self.pauses += 1;
        }
        self.alone_last = true;
        self.own = Rate::default();
        self.rounds = 0;
        self.reported = 0;
        Advice::Alone(self.paused)
    }

    /// After advice to speculate, in a mode that may make either: whether the round should be a PARSE round or a
    /// token-level one, by what each wrote per millisecond at this load ([`Costs::choose_rounds`]); the round's cost
    /// then goes to that sort's figure as well as the kind's. Where a verification row is dear and the draft has a
    /// core of its own, token-level rounds write faster; where rows are cheap, PARSE rounds do.
    ///
    /// A request keeps the sort it chose for [`Pace::STREAK`] tokens, and the first round after a switch (or after a
    /// pause) goes to no sort's figure: it pays for the switch (a draft read ahead for the other sort thrown away, the
    /// draft catching up), and judged by such rounds alone, the sort that was not running looked 2-3 times dearer
    /// than it wrote once it ran.
    pub fn choose_rounds(&mut self) -> Rounds {
        let rounds = match self.streak {
            Some((sort, tokens, _)) if tokens < Self::STREAK => sort,
            last => {
                let sort = self
                    .pacing
                    .costs
                    .choose_rounds(&self.pacing.kind, self.level);
                let switch = last.is_none_or(|(s, _, first)| s != sort || first);
                self.streak = Some((sort, 0, switch));
                sort
            }
        };
        self.rounds_of = Some(rounds);
        rounds
    }

    /// The load level of the last advice.
    pub fn level(&self) -> u32 {
        self.level
    }

    /// Whether the last advice to speculate was a probe of a speculation that was losing (the round will most
    /// likely be followed by a pause, so nothing should be drafted ahead for the round after it).
    pub fn probing(&self) -> bool {
        self.probing
    }

    /// A speculative round wrote `tokens` for `spent`, with its verification passes' costs and what it spent on
    /// setting up (the draft's first prefill, left out of `spent`; it counts only towards a probe's loss).
    pub fn speculated(&mut self, spent: Spent, tokens: usize, verify: &[Spent], setup: Spent) {
        self.end_round();
        let ms = spent.at(self.level);
        for v in verify {
            let v = v.at(self.level);
            self.cheapest_verify_ms = Some(self.cheapest_verify_ms.map_or(v, |c| c.min(v)));
        }
        if tokens > 0 {
            self.own.add(ms, tokens);
            self.rounds += 1;
        }
        self.report_rounds(ms, tokens);
        self.reported += 1;
        let measured = self.measuring.take();
        // A first round at a load is judged as a probe is: where it loses, the next waits by what it lost.
        let probe = std::mem::take(&mut self.probing) || measured.is_some();
        self.pacing.costs.record_spec(
            &self.pacing.kind,
            self.level,
            ms,
            tokens,
            probe.then(|| setup.at(self.level)),
        );
        if let Some(level) = measured {
            self.pacing.costs.measured(&self.pacing.kind, level);
        }
        self.give_back_probes();
    }

    /// The target wrote `tokens` alone for `spent` (in a pause). Its figures go to the load when the call ended, as
    /// [`Pace::target_wrote`]'s do, not to the load of the advice that began the pause: a pause runs for up to
    /// [`Pace::MAX_PAUSE`] tokens, and where requests end meanwhile its last calls share passes with fewer rows, each
    /// charged more. Charged to the advice's load, the pauses at the end of a run would raise the figure of the target
    /// alone at the higher load, and speculation would be set against a target dearer than it is. The tokens count
    /// towards the next probe at the advice's load, where the probe will be made.
    pub fn wrote_alone(&mut self, spent: Spent, tokens: usize) {
        let now = load_level((self.pacing.load)());
        let ms = spent.at(now);
        let beside = self.beside_speculation(spent);
        let costs = &self.pacing.costs;
        costs.add_alone(None, now, ms, tokens, beside);
        costs.add_rested(&self.pacing.kind, self.level, tokens);
        costs.record_paused(&self.pacing.kind, now, ms, tokens);
        self.paused = self.paused.saturating_sub(tokens.max(1));
        self.paused_tokens += tokens;
        // Towards the next probe of copy rounds too, where they lose.
        self.pacing
            .costs
            .add_rested(&self.copy_kind(), self.level, tokens);
    }

    /// The kind under which copy rounds made while the model rests are judged: `<kind> copies`.
    fn copy_kind(&self) -> String {
        copy_kind(&self.pacing.kind)
    }

    /// Whether a copy round may be made now, in a pause ([`Pace::copied`]): copy rounds are judged as a kind of
    /// speculation of their own, against the target alone at the same load. While they lose, only a due probe is
    /// made (the same gaps as the model's probes, [`Costs::record_spec`]). Copies that lose cost a verification for
    /// little: they pay on replies that quote their prompt (code edits) and lose on replies that only share short
    /// phrases with it (worked answers).
    pub fn copies_pay(&mut self) -> bool {
        if self.pacing.off() {
            return false;
        }
        let (costs, kind) = (&self.pacing.costs, self.copy_kind());
        let alone = costs
            .alone_ms(self.level)
            .or_else(|| costs.alone_near(self.level));
        self.probing_copies = matches!(
            (costs.spec_ms(&kind, self.level), alone),
            (Some(c), Some(a)) if c > a
        );
        if !self.probing_copies {
            return true;
        }
        let taken = costs.take_probe(&kind, self.level, 0);
        if taken {
            self.held.push((kind, self.level));
        }
        taken
    }

    /// In a pause, a copy round found nothing to copy and the target wrote `tokens` to its segment's end for `spent`
    /// (its steps measured as the target's, [`Pace::target_wrote`]): they use up the pause, count towards the model's
    /// next probe and go to the pauses' figure.
    pub fn copied_nothing(&mut self, spent: Spent, tokens: usize) {
        self.paused = self.paused.saturating_sub(tokens.max(1));
        self.paused_tokens += tokens;
        self.probing_copies = false;
        let costs = &self.pacing.costs;
        costs.add_rested(&self.pacing.kind, self.level, tokens);
        costs.record_paused(&self.pacing.kind, self.level, spent.at(self.level), tokens);
        self.give_back_probes();
    }

    /// In a pause, a copy round wrote `tokens` for `spent`: they use up the pause as the target's would, count
    /// towards the model's next probe, and go to the copies' own figure, not the target's.
    pub fn copied(&mut self, spent: Spent, tokens: usize) {
        self.paused = self.paused.saturating_sub(tokens.max(1));
        let costs = &self.pacing.costs;
        costs.add_rested(&self.pacing.kind, self.level, tokens);
        let probe = std::mem::take(&mut self.probing_copies).then_some(0.0);
        let ms = spent.at(self.level);
        costs.record_spec(&self.copy_kind(), self.level, ms, tokens, probe);
        costs.record_paused(&self.pacing.kind, self.level, ms, tokens);
        self.give_back_probes();
    }

    /// A round advised as speculation drew its whole draft from copies ([`Drafter::model_tokens_drafted`]): it wrote
    /// `tokens` for `spent`, which goes to the copies' figure, not the model's. (Judged as the model's, rounds of long
    /// copies, a verification for dozens of tokens, made a model that lost to them look cheap, and each request began
    /// with a model round that paid for the draft's prefill of its prompt.)
    ///
    /// [`Drafter::model_tokens_drafted`]: crate::driver::Drafter::model_tokens_drafted
    pub fn copies_only(&mut self, spent: Spent, tokens: usize) {
        self.end_round();
        self.probing = false;
        let ms = spent.at(self.level);
        self.pacing
            .costs
            .record_spec(&self.copy_kind(), self.level, ms, tokens, None);
        self.report_rounds(ms, tokens);
        self.give_back_probes();
    }

    /// The round chosen by [`Pace::choose_rounds`] wrote `tokens` in `ms` ([`Costs::record_rounds`]).
    fn report_rounds(&mut self, ms: f64, tokens: usize) {
        let Some(rounds) = self.rounds_of.take() else {
            return;
        };
        let measured = match self.streak.as_mut() {
            Some((_, written, first)) => {
                *written += tokens;
                !std::mem::take(first)
            }
            None => true,
        };
        self.pacing.costs.record_rounds(
            &self.pacing.kind,
            rounds,
            self.level,
            measured.then_some(ms),
            tokens,
        );
    }

    fn end_round(&mut self) {
        if std::mem::take(&mut self.in_round) {
            self.round_ended = Some(self.pacing.costs.round_ends());
        }
    }

    /// Whether another request's speculative round ran while the target wrote for `spent` (the last to end being
    /// this request's own, the others' are taken to have ended before it).
    fn beside_speculation(&self, spent: Spent) -> bool {
        let costs = &self.pacing.costs;
        costs.activity(|a| {
            a.running > usize::from(self.in_round)
                || a.last_end.is_some_and(|t| {
                    Some(t) != self.round_ended && t.elapsed().as_secs_f64() * 1e3 < spent.wall_ms
                })
        })
    }

    /// Ends the current pause before its length is used up: the target stopped at a segment's end, where the pause
    /// was to end anyway, and what was left of it would go on one segment per call. The next advice reads the figures
    /// again (most likely a pause of whole 16-token calls).
    pub fn end_pause(&mut self) {
        self.paused = 0;
    }

    /// How many tokens this request's next token-level round should draft, at most `max` ([`Costs::draft_length`],
    /// at the load of the last advice).
    pub fn draft_length(&self, max: usize) -> usize {
        self.pacing
            .costs
            .draft_length(&self.pacing.kind, self.level, max)
    }

    /// A token-level round drafted `drafted` tokens for `draft` and the target kept `accepted` of them, verifying
    /// for `verify` ([`Costs::record_token_round`]).
    pub fn token_round(&self, drafted: usize, accepted: usize, verify: Spent, draft: Spent) {
        self.pacing.costs.record_token_round(
            &self.pacing.kind,
            self.level,
            drafted,
            accepted,
            verify.at(self.level),
            draft.at(self.level),
        );
    }

    /// Whether a one-token guess pays at the load of the last advice ([`Costs::guess_pays`]).
    pub fn guess_pays(&self) -> bool {
        !self.pacing.off() && self.pacing.costs.guess_pays(&self.pacing.kind, self.level)
    }

    /// A one-token guess was verified for `verify`; the target kept it (`right`) or not ([`Costs::record_guess`]).
    pub fn guessed(&self, verify: Spent, right: bool) {
        let level = self.level;
        self.pacing
            .costs
            .record_guess(&self.pacing.kind, level, verify.at(level), right);
    }

    /// The target wrote `tokens` for `spent` outside a pause (in `target` mode, or where the drafter had nothing to
    /// propose): its speed at the current load, for the others.
    pub fn target_wrote(&self, spent: Spent, tokens: usize) {
        let level = load_level((self.pacing.load)());
        let beside = self.beside_speculation(spent);
        self.pacing
            .costs
            .add_alone(None, level, spent.at(level), tokens, beside);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A pool's shared figures and the pacing of its requests of `kind`, at a load of `load` requests.
    fn pool(kind: &str, load: usize) -> (Arc<Costs>, Pacing) {
        let costs = Arc::new(Costs::default());
        let pacing = Pacing {
            costs: costs.clone(),
            kind: kind.into(),
            load: Arc::new(move || load),
            off_at: None,
        };
        (costs, pacing)
    }

    /// As [`pool`], at a load the test moves, with speculation off from `off_at` requests.
    fn moving_pool(
        kind: &str,
        load: usize,
        off_at: Option<usize>,
    ) -> (Arc<Costs>, Pacing, Arc<AtomicUsize>) {
        let load = Arc::new(AtomicUsize::new(load));
        let costs = Arc::new(Costs::default());
        let l = load.clone();
        let pacing = Pacing {
            costs: costs.clone(),
            kind: kind.into(),
            load: Arc::new(move || l.load(Ordering::Relaxed)),
            off_at,
        };
        (costs, pacing, load)
    }

    #[test]
    fn speculation_that_pays_per_token_starts_only_where_it_pays_for_the_drafters_catching_up() {
        let (costs, pacing) = pool("parse/model", 1);
        // At one request: the target alone 80 ms per token, speculation 50; the drafter prefills at 10 ms per token.
        costs.record_alone(None, 0, 800.0, 10);
        costs.record_spec("parse/model", 0, 500.0, 10, None);
        costs.record_entry("parse/model", 0, 1000.0, 100);
        let mut p = Pace::new(pacing.clone());
        // Fewer than 4 finished requests: judged over its whole budget (300 tokens left pay 9,000 ms for 400 to
        // catch up).
        costs.record_length(190);
        p.position(200, 300, 400);
        assert_eq!(p.advise(), Advice::Speculate);
        // The pool's requests ended at 220-260 tokens: 40 left on average, 1,200 ms of gain for 4,000 of prefill.
        for n in [220, 240, 260, 240] {
            costs.record_length(n);
        }
        // (The one that ended at 190 did not get that far.)
        assert_eq!(costs.expected_left(200, 300), 40);
        let mut p = Pace::new(pacing.clone());
        p.position(200, 300, 400);
        assert_eq!(p.advise(), Advice::Alone(Pace::MAX_PAUSE));
        assert_eq!(p.entries_declined, 1);
        // A drafter 30 tokens behind pays (900 ms against 1,200).
        let mut p = Pace::new(pacing.clone());
        p.position(200, 300, 30);
        assert_eq!(p.advise(), Advice::Speculate);
        // Past every finished request's length: its own length stands for what is left (300 of the 500, 9,000 ms).
        assert_eq!(costs.expected_left(300, 100), 100);
        let mut p = Pace::new(pacing);
        p.position(300, 500, 400);
        assert_eq!(p.advise(), Advice::Speculate);
        // A request already speculating is not judged on its drafter's lag.
        p.speculated(
            Spent::wall(100.0),
            2,
            &[Spent::wall(60.0)],
            Spent::wall(0.0),
        );
        p.position(302, 498, 5000);
        assert_eq!(p.advise(), Advice::Speculate);
    }

    #[test]
    fn a_pause_reports_at_the_load_where_its_call_ended() {
        let kind = "parse+token-spec/model";
        let (costs, pacing, load) = moving_pool(kind, 8, None);
        // At 8 requests (level 3) speculation loses: a pause.
        costs.record_alone(None, 3, 200.0, 10);
        costs.record_spec(kind, 3, 600.0, 10, None);
        let mut p = Pace::new(pacing);
        assert!(matches!(p.advise(), Advice::Alone(_)));
        assert_eq!(p.level(), 3);
        // Requests ended meanwhile: the call ended at 2 (level 1), where its passes held fewer rows and charged it
        // 60 ms a token. The figures of 2 requests take it; those of 5-8 keep their 20 ms.
        load.store(2, Ordering::Relaxed);
        let spent = Spent {
            wall_ms: 1000.0,
            charged_ms: Some(16.0 * 60.0),
        };
        p.wrote_alone(spent, 16);
        assert_eq!(costs.alone_ms(1), Some(60.0));
        assert_eq!(costs.spec_ms(&pause_kind(kind), 1), Some(60.0));
        assert_eq!(costs.alone_ms(3), Some(20.0));
        assert_eq!(costs.spec_ms(&pause_kind(kind), 3), None);
        // Its tokens count towards the next probe where it paused.
        assert_eq!(costs.since(kind, 3), 16);
        assert_eq!(costs.since(kind, 1), 0);
    }

    #[test]
    fn speculation_turned_off_at_a_load_is_off_there_whatever_the_figures_say() {
        let kind = "parse+token-spec/model+ngram";
        let (costs, pacing, load) = moving_pool(kind, 8, Some(5));
        // At 8 requests (level 3) speculation writes at 20 ms a token against the target's 60, copies at 10, and
        // lookups cost nothing and are kept whole: every figure says speculate.
        costs.record_alone(None, 3, 600.0, 10);
        costs.record_spec(kind, 3, 200.0, 10, None);
        costs.record_spec(&copy_kind(kind), 3, 100.0, 10, None);
        token_rounds(&costs, kind, 3, 0.01, |d| d);
        let free = Pacing {
            off_at: None,
            ..pacing.clone()
        };
        let mut on = Pace::new(free);
        assert!(on.leans_to_speculate());
        assert_eq!(on.advise(), Advice::Speculate);
        assert!(on.copies_pay());

        let mut p = Pace::new(pacing.clone());
        assert!(!p.leans_to_speculate());
        assert_eq!(p.advise(), Advice::Alone(Pace::MAX_PAUSE));
        assert_eq!(p.pauses, 1);
        assert!(!p.copies_pay());
        assert!(!p.guess_pays());
        // A token-level round's advice too, at one request where free rounds would go on without judging.
        load.store(1, Ordering::Relaxed);
        let one = Pacing {
            off_at: Some(1),
            ..pacing.clone()
        };
        costs.record_alone(None, 0, 600.0, 10);
        token_rounds(&costs, kind, 0, 0.01, |d| d);
        assert!(costs.free_rounds_pay(kind, 0, 6));
        assert_eq!(
            Pace::new(one).advise_token_round(6),
            Advice::Alone(Pace::MAX_PAUSE)
        );
        // Below the setting the figures decide again: at 4 requests a fresh request speculates where they say so.
        load.store(4, Ordering::Relaxed);
        costs.record_alone(None, 2, 600.0, 10);
        costs.record_spec(kind, 2, 200.0, 10, None);
        let mut p = Pace::new(pacing);
        assert!(p.leans_to_speculate());
        assert_eq!(p.advise(), Advice::Speculate);
    }

    /// Token-level rounds of `kind` at `level`: drafts of 1 and 3 tokens in turn (so that the line of rows has two
    /// points), each verified for 48 ms plus 12 per row and drafted for `draft_ms` a token, the target keeping
    /// `keep` of each draft's tokens.
    fn token_rounds(
        costs: &Costs,
        kind: &str,
        level: u32,
        draft_ms: f64,
        keep: impl Fn(usize) -> usize,
    ) {
        for r in 0..40 {
            let drafted = if r % 2 == 0 { 3 } else { 1 };
            let verify = 48.0 + 12.0 * (drafted + 1) as f64;
            costs.record_token_round(
                kind,
                level,
                drafted,
                keep(drafted),
                verify,
                draft_ms * drafted as f64,
            );
        }
    }

    #[test]
    fn one_token_guesses_are_made_where_the_target_keeps_more_of_them_than_a_row_costs() {
        let kind = "token-spec/ngram";
        let guesses_made =
            |costs: &Costs, n: usize| (0..n).filter(|_| costs.guess_pays(kind, 0)).count();
        // Nothing measured: guesses measure.
        let (costs, _) = pool(kind, 1);
        assert_eq!(guesses_made(&costs, 5), 5);
        // The target alone 60 ms a token; a verification 48 ms plus 12 a row (a row 0.2 of a step): a guess round
        // (72 ms) pays where more than a fifth of the guesses are kept.
        costs.record_alone(None, 0, 600.0, 10);
        token_rounds(&costs, kind, 0, 0.01, |d| d);
        for i in 0..100 {
            costs.record_guess(kind, 0, 72.0, i % 10 < 3);
        }
        assert_eq!(guesses_made(&costs, 16), 16, "3 in 10 kept: they pay");
        for i in 0..400 {
            costs.record_guess(kind, 0, 72.0, i % 10 == 0);
        }
        // 1 in 10 kept: they lose, and only one place in GUESS_PROBE still guesses, to see the task change.
        assert_eq!(guesses_made(&costs, 4 * Costs::GUESS_PROBE), 4);
        // The same guesses where a row costs nothing to speak of (a verification 60 ms and 0.5 a row): they pay.
        let (costs, _) = pool(kind, 1);
        costs.record_alone(None, 0, 600.0, 10);
        for r in 0..40 {
            let drafted = if r % 2 == 0 { 3 } else { 1 };
            costs.record_token_round(kind, 0, drafted, drafted, 60.0 + 0.5 * drafted as f64, 0.0);
        }
        for i in 0..400 {
            costs.record_guess(kind, 0, 61.0, i % 10 == 0);
        }
        assert_eq!(guesses_made(&costs, 16), 16);
        // Guesses do not move the chance of the drafts' own positions: the draft length stays.
        let (with, without) = (Costs::default(), Costs::default());
        for c in [&with, &without] {
            c.record_alone(None, 0, 600.0, 10);
            token_rounds(c, kind, 0, 0.01, |d| d.min(2));
        }
        for _ in 0..100 {
            with.record_guess(kind, 0, 72.0, false);
        }
        assert_eq!(
            with.draft_length(kind, 0, 6),
            without.draft_length(kind, 0, 6)
        );
    }

    #[test]
    fn free_rounds_that_pay_go_on_at_one_request_whatever_the_last_rounds_did() {
        let kind = "token-spec/ngram";
        // One request: the target alone 60 ms a token; the kind's recent rounds lost (200 ms a token), so the
        // request's own judgement pauses.
        let lost = |costs: &Costs, level: u32| {
            costs.record_alone(None, level, 600.0, 10);
            costs.record_spec(kind, level, 1000.0, 5, None);
        };
        let (costs, pacing) = pool(kind, 1);
        lost(&costs, 0);
        assert!(matches!(
            Pace::new(pacing.clone()).advise(),
            Advice::Alone(_)
        ));
        // Drafts that cost 0.01 ms a token (a lookup) and are kept whole: a round of 6 writes 7 tokens for 132 ms.
        token_rounds(&costs, kind, 0, 0.01, |d| d);
        assert!(costs.free_rounds_pay(kind, 0, 6));
        let mut p = Pace::new(pacing.clone());
        assert!(
            matches!(p.advise(), Advice::Alone(_)),
            "the judgement of its own rounds is unchanged"
        );
        // ... and a pause in progress ends.
        assert_eq!(p.advise_token_round(6), Advice::Speculate);
        p.speculated(
            Spent::wall(132.0),
            7,
            &[Spent::wall(132.0)],
            Spent::wall(0.0),
        );
        assert_eq!(Pace::new(pacing).advise_token_round(6), Advice::Speculate);

        // Drafts that are never kept (the best round, 1 token drafted, 72 ms for about 1 token, loses to the
        // target's 60), and drafts from a model (20 ms a token, more than a hundredth of a row): judged as before.
        let never_kept: fn(usize) -> usize = |_| 0;
        let kept: fn(usize) -> usize = |d| d;
        for (draft_ms, keep) in [(0.01, never_kept), (20.0, kept)] {
            let (costs, pacing) = pool(kind, 1);
            lost(&costs, 0);
            token_rounds(&costs, kind, 0, draft_ms, keep);
            assert!(!costs.free_rounds_pay(kind, 0, 6));
            assert!(matches!(
                Pace::new(pacing).advise_token_round(6),
                Advice::Alone(_)
            ));
        }

        // At 8 requests the pauses stay: there they keep speculation from losing to a batched target.
        let (costs, pacing) = pool(kind, 8);
        lost(&costs, 3);
        token_rounds(&costs, kind, 3, 0.01, |d| d);
        assert!(
            costs.free_rounds_pay(kind, 3, 6),
            "free rounds that would pay there"
        );
        assert!(matches!(
            Pace::new(pacing).advise_token_round(6),
            Advice::Alone(_)
        ));
    }

    #[test]
    fn load_levels_are_powers_of_two() {
        let levels: Vec<u32> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17].map(load_level).to_vec();
        assert_eq!(levels, [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]);
        let labels: Vec<String> = (0..5).map(level_label).collect();
        assert_eq!(labels, ["1", "2", "3-4", "5-8", "9-16"]);
    }

    /// Runs `pace` for `n` decisions: speculative rounds at `spec` ms/token writing 2 tokens each, pauses at
    /// `alone` ms/token. Returns the advice, in order.
    fn drive(pace: &mut Pace, n: usize, spec: f64, alone: f64, verify: f64) -> Vec<Advice> {
        let mut seen = Vec::new();
        for _ in 0..n {
            let a = pace.advise();
            match a {
                Advice::Speculate => pace.speculated(
                    Spent::wall(2.0 * spec),
                    2,
                    &[Spent::wall(verify)],
                    Spent::wall(0.0),
                ),
                Advice::Alone(k) => pace.wrote_alone(Spent::wall(k as f64 * alone), k),
            }
            seen.push(a);
        }
        seen
    }

    /// Tokens written alone between speculative rounds.
    fn gaps(seen: &[Advice]) -> Vec<usize> {
        seen.split(|a| *a == Advice::Speculate)
            .map(|run| {
                run.iter()
                    .map(|a| match a {
                        Advice::Alone(k) => *k,
                        Advice::Speculate => 0,
                    })
                    .sum::<usize>()
            })
            .filter(|&n| n > 0)
            .collect()
    }

    #[test]
    fn a_losing_speculation_pauses_longer_each_time_and_a_winning_one_is_left_alone() {
        // Speculation at 50 ms/token with verifications of 100 ms: it beats what a target step can cost, an upper
        // bound only. After its first round one short pause measures the target (90 ms/token), and speculation,
        // winning against that, is left alone from then on.
        let mut p = Pace::new(Pacing::alone("token-spec/model"));
        let seen = drive(&mut p, 40, 50.0, 90.0, 100.0);
        assert_eq!(gaps(&seen), [Pace::FIRST_PAUSE], "{seen:?}");
        assert_eq!(seen[1], Advice::Alone(Pace::FIRST_PAUSE), "{seen:?}");
        assert!((p.pacing.costs.alone_ms(0).unwrap() - 90.0).abs() < 1e-9);
        // Rounds at 150 ms/token, with nothing to judge them by but the cheapest verification (100 ms): the first
        // round is followed by a short pause, which measures the target alone, not by PROBE - 1 more rounds.
        let mut p = Pace::new(Pacing::alone("token-spec/model"));
        assert_eq!(p.advise(), Advice::Speculate);
        p.speculated(
            Spent::wall(300.0),
            2,
            &[Spent::wall(100.0)],
            Spent::wall(0.0),
        );
        assert_eq!(p.advise(), Advice::Alone(Pace::FIRST_PAUSE));
        p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
        // Still losing against the target's measured 90 ms/token: a probe round once 16 tokens in all were written
        // alone; a probe of 2 tokens loses 120 ms, 1.33 tokens of the target's, so the next waits 43 tokens (32 times
        // that) and the gaps double from there (in pauses of at most 64 tokens), up to MAX_GAP.
        let seen = drive(&mut p, 200, 150.0, 90.0, 100.0);
        assert_eq!(
            &gaps(&seen)[..7],
            [12, 43, 86, 172, 344, 688, 1376],
            "{seen:?}"
        );
        assert_eq!(gaps(&seen)[8], Costs::MAX_GAP, "{seen:?}");
        assert!(seen.iter().all(|a| *a <= Advice::Alone(64)));
        // The first pause's 4 tokens and the 12 after them are one pause.
        assert_eq!(p.pauses, gaps(&seen).len());
        // Once a probe wins (30 ms/token), it goes on speculating.
        let seen = drive(&mut p, 600, 30.0, 90.0, 100.0);
        assert!(
            seen[550..].iter().all(|a| *a == Advice::Speculate),
            "{seen:?}"
        );
    }

    #[test]
    fn a_model_that_beats_the_target_but_loses_to_its_copies_rests() {
        let kind = "parse+token-spec/model+ngram";
        let (costs, pacing) = pool(kind, 1);
        costs.record_alone(None, 0, 16.0 * 100.0, 16);
        costs.record_spec(kind, 0, 16.0 * 80.0, 16, None);
        // The model (80 ms/token) beats the target alone (100): it speculates.
        assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
        // A round advised as speculation that was all copies goes to the copies' figure, not the model's.
        let mut p = Pace::new(pacing.clone());
        assert_eq!(p.advise(), Advice::Speculate);
        p.copies_only(Spent::wall(16.0 * 40.0), 16);
        assert_eq!(costs.spec_ms(kind, 0), Some(80.0));
        assert_eq!(costs.spec_ms(&copy_kind(kind), 0), Some(40.0));
        // Copies alone are no rival until a pause has measured what pauses write as a whole: the model goes on.
        assert_eq!(costs.pauses_ms(kind, 0), None);
        assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
        // A pause of copy rounds wrote at 40 ms/token: the model rests, and copy rounds fill its pauses.
        costs.record_paused(kind, 0, 16.0 * 40.0, 16);
        let mut p = Pace::new(pacing.clone());
        assert!(matches!(p.advise(), Advice::Alone(_)));
        assert!(p.copies_pay());
        // A probe of the model is judged against the copies: it lost 16 of their tokens, so the next waits 512.
        costs.record_spec(kind, 0, 16.0 * 80.0, 16, Some(0.0));
        assert_eq!(costs.until_probe(kind, 0), 512);
        // A speculation with no copies (the plain model) is judged against the target alone, as before.
        costs.record_spec("parse+token-spec/model", 0, 16.0 * 80.0, 16, None);
        let mut plain = Pace::new(Pacing {
            kind: "parse+token-spec/model".into(),
            ..pacing
        });
        assert_eq!(plain.advise(), Advice::Speculate);
    }

    #[test]
    fn copy_rounds_that_lose_to_the_target_are_made_only_as_probes() {
        let (costs, pacing) = pool("parse+token-spec/model+ngram", 1);
        costs.record_alone(None, 0, 16.0 * 100.0, 16);
        let mut p = Pace::new(pacing.clone());
        // No figure of copies yet: a copy round measures them. It writes 16 tokens at 300 ms each: they lose.
        assert!(p.copies_pay());
        p.copied(Spent::wall(16.0 * 300.0), 16);
        assert_eq!(
            costs.spec_ms("parse+token-spec/model+ngram copies", 0),
            Some(300.0)
        );
        // Not the target's figure, nor the model's kind's.
        assert_eq!(costs.alone_ms(0), Some(100.0));
        assert_eq!(costs.spec_ms("parse+token-spec/model+ngram", 0), None);
        assert!(!p.copies_pay());
        // 16 tokens written alone make a probe due; it loses 32 tokens of the target's time, so the next waits 1024.
        p.wrote_alone(Spent::wall(16.0 * 100.0), 16);
        assert!(p.copies_pay());
        p.copied(Spent::wall(16.0 * 300.0), 16);
        assert!(!p.copies_pay());
        p.wrote_alone(Spent::wall(1000.0 * 100.0), 1000);
        assert!(!p.copies_pay());
        p.wrote_alone(Spent::wall(24.0 * 100.0), 24);
        assert!(p.copies_pay());
        // Copies that win are made whenever something matches.
        let costs = Arc::new(Costs::default());
        costs.record_alone(None, 0, 16.0 * 100.0, 16);
        let mut p = Pace::new(Pacing {
            costs: costs.clone(),
            ..pacing
        });
        p.copied(Spent::wall(16.0 * 20.0), 16);
        assert!((0..10).all(|_| p.copies_pay()));
    }

    #[test]
    fn a_probe_is_out_one_at_a_time_and_goes_to_a_request_with_little_to_catch_up() {
        let kind = "parse+token-spec/model";
        let (costs, pacing) = pool(kind, 8);
        // At 5-8 requests: the target alone 10 ms per token, speculation 40; the drafter prefills at 5 ms per token.
        costs.record_alone(None, 3, 16.0 * 10.0, 16);
        costs.record_spec(kind, 3, 20.0 * 40.0, 20, None);
        costs.record_entry(kind, 3, 500.0, 100);
        // 64 tokens written alone since: past the least gap (16).
        costs.record_alone(Some(kind), 3, 64.0 * 10.0, 64);
        // 300 tokens behind, a request would spend 1,500 ms (150 of the target's tokens) catching up first: its
        // probe waits for 32 times that more.
        let mut far = Pace::new(pacing.clone());
        far.position(300, 84, 300);
        assert!(matches!(far.advise(), Advice::Alone(_)));
        assert!(!far.probing());
        // One token behind (half a target token to catch up, 32 more written alone): it probes.
        let mut near = Pace::new(pacing.clone());
        near.position(40, 300, 1);
        assert_eq!(near.advise(), Advice::Speculate);
        assert!(near.probing());
        // While its probe is out, no other is taken, however much is written alone meanwhile.
        costs.record_alone(Some(kind), 3, 64.0 * 10.0, 64);
        let mut other = Pace::new(pacing.clone());
        other.position(40, 300, 1);
        assert!(matches!(other.advise(), Advice::Alone(_)));
        // Its request ended before the round reported: the probe is given back, and the next request takes it.
        drop(near);
        let mut other = Pace::new(pacing);
        other.position(40, 300, 1);
        assert_eq!(other.advise(), Advice::Speculate);
        assert!(other.probing());
    }

    #[test]
    fn a_first_round_at_a_load_goes_to_a_request_with_little_to_catch_up_and_is_judged_as_a_probe()
    {
        let kind = "parse+token-spec/model";
        let (costs, pacing) = pool(kind, 4);
        // At 3-4 requests the target alone writes at 10 ms per token; the drafter's prefill (measured at 2
        // requests) costs 5 ms per token; no round of speculation was made at 3-4 yet.
        costs.record_alone(None, 2, 16.0 * 10.0, 16);
        costs.record_entry(kind, 1, 500.0, 100);
        // 300 tokens behind: 150 target tokens to catch up, more than the 0 written alone here so far pay for.
        let mut far = Pace::new(pacing.clone());
        far.position(300, 84, 300);
        assert_eq!(far.advise(), Advice::Alone(Pace::MAX_PAUSE));
        assert_eq!(far.entries_declined, 1);
        far.wrote_alone(Spent::wall(64.0 * 10.0), 64);
        // 20 behind (10 target tokens to catch up, 320 written alone needed): once that much was, it measures.
        let mut near = Pace::new(pacing.clone());
        near.position(0, 384, 20);
        assert!(matches!(near.advise(), Advice::Alone(_)));
        costs.record_alone(Some(kind), 2, 256.0 * 10.0, 256);
        let mut near = Pace::new(pacing);
        near.position(0, 384, 20);
        assert_eq!(near.advise(), Advice::Speculate);
        // Its round keeps 20 tokens for 800 ms, after 100 ms of catching up: it lost 70 of the target's tokens,
        // so no probe before 32 times as many are written alone here.
        near.speculated(
            Spent::wall(800.0),
            20,
            &[Spent::wall(300.0)],
            Spent::wall(100.0),
        );
        assert_eq!(costs.until_probe(kind, 2), 2240);
    }

    #[test]
    fn a_drafter_with_far_more_to_catch_up_on_than_tokens_left_does_not_start_on_a_fresh_router() {
        let kind = "parse+token-spec/model";
        let (costs, pacing) = pool(kind, 1);
        // Nothing measured: a long prompt with a few tokens to write writes them alone.
        let mut far = Pace::new(pacing.clone());
        far.position(0, 4, 16_000);
        assert_eq!(far.advise(), Advice::Alone(Pace::MAX_PAUSE));
        assert_eq!(far.entries_declined, 1);
        // The same prompt with a budget that could pay for it, and a short prompt, make the first round.
        let mut long = Pace::new(pacing.clone());
        long.position(0, 1024, 16_000);
        assert_eq!(long.advise(), Advice::Speculate);
        drop(long);
        let mut short = Pace::new(pacing.clone());
        short.position(0, 4, 100);
        assert_eq!(short.advise(), Advice::Speculate);
        drop(short);
        // Once a drafter's prefill is priced, this rule steps aside (the price judges the entry where a figure of
        // speculation is there to weigh it against).
        costs.record_entry(kind, 0, 160.0, 16_000);
        let mut priced = Pace::new(pacing);
        priced.position(0, 4, 16_000);
        assert_eq!(priced.advise(), Advice::Speculate);
    }

    #[test]
    fn at_one_request_the_drafters_catching_up_is_priced_by_what_other_loads_measured() {
        let kind = "parse+token-spec/model";
        let (costs, pacing) = pool(kind, 1);
        // The drafter's prefill was measured at 5-8 requests only (5 ms per token); at one request the target alone
        // writes at 60 ms per token and no round was made there yet.
        costs.record_entry(kind, 3, 500.0, 100);
        costs.record_alone(None, 0, 16.0 * 60.0, 16);
        assert_eq!(costs.entry_ms(kind, 0), Some(5.0));
        // 400 tokens behind: 2,000 ms of catching up, 34 of the target's tokens, more than the 0 written alone at one
        // request so far pay for: no first round, a full pause.
        let mut far = Pace::new(pacing.clone());
        far.position(250, 40, 400);
        assert_eq!(far.advise(), Advice::Alone(Pace::MAX_PAUSE));
        assert_eq!(far.entries_declined, 1);
        // Nothing to catch up on: it makes the first round.
        let mut near = Pace::new(pacing);
        near.position(0, 300, 0);
        assert_eq!(near.advise(), Advice::Speculate);
        // A price measured at one request stands in at the other loads as well.
        let c = Costs::default();
        c.record_entry(kind, 0, 300.0, 100);
        assert_eq!(c.entry_ms(kind, 2), Some(3.0));
    }

    #[test]
    fn a_probe_that_loses_by_far_waits_32_times_what_it_lost_setup_included() {
        let c = Costs::default();
        let kind = "parse+token-spec/model";
        c.record_alone(None, 3, 16.0 * 100.0, 16);
        // A round keeping 60 tokens at 270 ms/token against the target's 100: speculation loses at this level.
        c.record_spec(kind, 3, 60.0 * 270.0, 60, None);
        assert_eq!(c.until_probe(kind, 3), Costs::MIN_GAP);
        c.record_alone(Some(kind), 3, 16.0 * 100.0, 16);
        assert!(c.take_probe(kind, 3, 0));
        // The probe loses the same: 102 tokens of the target's time lost, so 3264 tokens alone before the next.
        c.record_spec(kind, 3, 60.0 * 270.0, 60, Some(0.0));
        c.probe_back(kind, 3);
        assert_eq!(c.until_probe(kind, 3), 3264);
        // Losing by more, it waits at most MAX_GAP; a probe that wins brings the least gap back.
        c.record_alone(Some(kind), 3, 3264.0 * 100.0, 3264);
        assert!(c.take_probe(kind, 3, 0));
        c.record_spec(kind, 3, 60.0 * 600.0, 60, Some(0.0));
        assert_eq!(c.until_probe(kind, 3), Costs::MAX_GAP);
        for _ in 0..20 {
            c.record_spec(kind, 3, 60.0 * 50.0, 60, Some(0.0));
        }
        assert_eq!(c.until_probe(kind, 3), Costs::MIN_GAP);
        // A probe that loses a little (60 tokens at 110 ms/token: 6 tokens of the target's) but had to prefill the
        // draft first (3 s, 30 tokens of the target's) lost 36: the next waits 1152 tokens, not 192. The prefill is
        // not part of the rate.
        let c = Costs::default();
        c.record_alone(None, 3, 16.0 * 100.0, 16);
        c.record_spec(kind, 3, 60.0 * 110.0, 60, Some(3000.0));
        assert_eq!(c.until_probe(kind, 3), 1152);
        assert!((c.spec_ms(kind, 3).unwrap() - 110.0).abs() < 1e-9);
        let c = Costs::default();
        c.record_alone(None, 3, 16.0 * 100.0, 16);
        c.record_spec(kind, 3, 60.0 * 110.0, 60, Some(0.0));
        assert_eq!(c.until_probe(kind, 3), 192);
    }

    #[test]
    fn a_load_with_no_figure_of_the_target_borrows_the_nearest_measured_the_same_way() {
        let c = Costs::default();
        assert_eq!(c.alone_near(3), None);
        c.record_alone(None, 0, 16.0 * 900.0, 16);
        // Level 0's figure is wall time: not a stand-in for charged time above it, nor the reverse.
        assert_eq!(c.alone_near(4), None);
        c.record_alone(None, 3, 16.0 * 50.0, 16);
        c.record_alone(None, 1, 16.0 * 70.0, 16);
        assert_eq!(c.alone_near(4), Some(50.0));
        assert_eq!(c.alone_near(2), Some(70.0), "the lower of two as near");
        assert_eq!(c.alone_near(1), Some(70.0));
        assert_eq!(c.alone_near(0), Some(900.0));
        c.record_alone(None, 4, 16.0 * 40.0, 16);
        assert_eq!(c.alone_near(4), Some(40.0));
        // A request at 9-16 requests whose speculation loses to the target at 5-8 pauses at once, for the short
        // first pause that measures the target at its own load.
        let costs = Arc::new(Costs::default());
        costs.record_alone(None, 3, 16.0 * 50.0, 16);
        let kind = "parse+token-spec/model";
        costs.record_spec(kind, 4, 60.0 * 130.0, 60, None);
        let mut p = Pace::new(Pacing {
            costs: costs.clone(),
            kind: kind.into(),
            load: Arc::new(|| 9),
            off_at: None,
        });
        assert_eq!(p.advise(), Advice::Alone(Pace::FIRST_PAUSE));
    }

    #[test]
    fn figures_weigh_samples_by_their_tokens() {
        let c = Costs::default();
        for _ in 0..10 {
            c.record_alone(None, 0, 16.0 * 100.0, 16);
        }
        assert!((c.alone_ms(0).unwrap() - 100.0).abs() < 1e-9);
        // One slow step (5 s for one token) moves the rate by about a fortieth of the gap, not by 0.4 of it.
        c.record_alone(None, 0, 5000.0, 1);
        let a = c.alone_ms(0).unwrap();
        assert!(a > 200.0 && a < 240.0, "{a}");
        // A stretch of 16 tokens at 300 ms moves it by about 0.4 of the way.
        let c = Costs::default();
        for _ in 0..10 {
            c.record_alone(None, 0, 16.0 * 100.0, 16);
        }
        c.record_alone(None, 0, 16.0 * 300.0, 16);
        let a = c.alone_ms(0).unwrap();
        assert!((a - 180.0).abs() < 2.0, "{a}");
    }

    #[test]
    fn requests_at_the_same_load_share_what_others_measured_and_one_probe() {
        let (_, pacing, load) = moving_pool("parse+token-spec/model", 8, None);
        // One request learns that at 8 requests speculation (150 ms/token) loses to the target (90 ms/token): its 3
        // rounds, pauses of 4 and 12 tokens, a probe, 43 tokens alone, a probe, 64 of the next 86 tokens alone.
        let mut first = Pace::new(pacing.clone());
        drive(&mut first, 9, 150.0, 90.0, 100.0);
        assert!(first.paused_tokens > 0);
        let seen = pacing.costs.snapshot();
        assert!(seen.iter().all(|f| f.level == 3), "{seen:?}");
        // A new request at that load starts writing alone, with no probe rounds of its own.
        let mut second = Pace::new(pacing.clone());
        assert!(matches!(second.advise(), Advice::Alone(_)));
        // When a probe is due, only one of two waiting requests makes it.
        let mut a = Pace::new(pacing.clone());
        let mut b = Pace::new(pacing.clone());
        pacing
            .costs
            .record_alone(Some(&pacing.kind), 3, 512.0 * 90.0, 512);
        let advice = [a.advise(), b.advise()];
        assert_eq!(
            advice.iter().filter(|x| **x == Advice::Speculate).count(),
            1,
            "{advice:?}"
        );
        // At one request the same kind has no figure yet: a request there speculates, and learns.
        load.store(1, Ordering::Relaxed);
        let mut alone = Pace::new(pacing.clone());
        assert_eq!(alone.advise(), Advice::Speculate);
        // Target-mode requests tell the others what the target costs at their load.
        Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 70.0), 16);
        assert_eq!(pacing.costs.alone_ms(0), Some(70.0));
    }

    /// A router's shared figures, empty, with 8 requests per target worker.
    fn fresh_pool_at_eight() -> Pacing {
        Pacing {
            costs: Arc::new(Costs::default()),
            kind: "parse+token-spec/model".into(),
            load: Arc::new(|| 8),
            off_at: None,
        }
    }

    #[test]
    fn on_a_fresh_router_one_request_measures_and_the_others_are_judged_on_its_rounds() {
        let pacing = fresh_pool_at_eight();
        // A round that loses: 40 tokens at 150 ms/token against the target's 90.
        let losing_round = |p: &mut Pace| {
            p.speculated(
                Spent::wall(40.0 * 150.0),
                40,
                &[Spent::wall(200.0)],
                Spent::wall(0.0),
            )
        };
        // The target's figure at this load is known (from `target`-mode requests), speculation's is not.
        Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
        let mut all: Vec<Pace> = (0..8).map(|_| Pace::new(pacing.clone())).collect();
        let advice: Vec<Advice> = all.iter_mut().map(|p| p.advise()).collect();
        assert_eq!(
            advice[0],
            Advice::Speculate,
            "no figure: one request measures"
        );
        assert!(
            advice[1..]
                .iter()
                .all(|a| *a == Advice::Alone(Pace::FIRST_PAUSE)),
            "the others wait for its figure, in short pauses: {advice:?}"
        );
        // While its round runs, the others go on waiting, and take no probe (there is nothing losing to probe).
        for p in all[1..].iter_mut() {
            p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
            assert_eq!(p.advise(), Advice::Alone(Pace::FIRST_PAUSE));
            p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
        }
        // Its round loses: the others are judged on the pool's figure and write alone from here; it goes on to
        // PROBE rounds of its own (they refine the figure the others read), then writes alone too.
        losing_round(&mut all[0]);
        for (i, p) in all[1..].iter_mut().enumerate() {
            assert!(matches!(p.advise(), Advice::Alone(_)), "request {}", i + 1);
        }
        for _ in 1..Pace::PROBE {
            assert_eq!(all[0].advise(), Advice::Speculate);
            losing_round(&mut all[0]);
        }
        assert!(matches!(all[0].advise(), Advice::Alone(_)));
        // A request whose rounds are the only ones reported at its load is still judged after PROBE rounds.
        let pacing = Pacing {
            costs: Arc::new(Costs::default()),
            ..pacing
        };
        Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
        let mut p = Pace::new(pacing.clone());
        for _ in 0..Pace::PROBE {
            assert_eq!(p.advise(), Advice::Speculate);
            losing_round(&mut p);
        }
        assert!(matches!(p.advise(), Advice::Alone(_)));
    }

    #[test]
    fn a_first_round_that_wins_lets_the_others_speculate_and_one_that_never_reports_frees_its_place()
     {
        let pacing = fresh_pool_at_eight();
        Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
        let mut a = Pace::new(pacing.clone());
        let mut b = Pace::new(pacing.clone());
        assert_eq!(a.advise(), Advice::Speculate);
        assert_eq!(b.advise(), Advice::Alone(Pace::FIRST_PAUSE));
        b.wrote_alone(Spent::wall(4.0 * 90.0), 4);
        // A round at 30 ms/token against the target's 90: the waiting request speculates too.
        a.speculated(
            Spent::wall(40.0 * 30.0),
            40,
            &[Spent::wall(200.0)],
            Spent::wall(0.0),
        );
        assert_eq!(b.advise(), Advice::Speculate);
        // At another load with no figure, a measuring request that ends before it reports lets the next one measure.
        let fresh = fresh_pool_at_eight();
        let mut gone = Pace::new(fresh.clone());
        let mut next = Pace::new(fresh.clone());
        assert_eq!(gone.advise(), Advice::Speculate);
        assert_eq!(next.advise(), Advice::Alone(Pace::FIRST_PAUSE));
        next.wrote_alone(Spent::wall(4.0 * 90.0), 4);
        drop(gone);
        assert_eq!(next.advise(), Advice::Speculate);
    }

    #[test]
    fn the_target_measured_beside_others_speculation_leaves_its_figure_alone() {
        let pacing = fresh_pool_at_eight();
        let step = |ms: f64| Spent {
            wall_ms: 0.0,
            charged_ms: Some(16.0 * ms),
        };
        // With no figure yet, a stretch written beside a speculative round is taken: it is all there is.
        let mut drafting = Pace::new(pacing.clone());
        let paused = Pace::new(pacing.clone());
        assert_eq!(drafting.advise(), Advice::Speculate);
        paused.target_wrote(step(90.0), 16);
        assert_eq!(pacing.costs.alone_ms(3), Some(90.0));
        drafting.speculated(step(50.0), 16, &[step(50.0)], Spent::wall(0.0));
        // Once the round is over, the target's stretches count (a stretch of 0 ms began after it ended).
        for _ in 0..20 {
            paused.target_wrote(step(30.0), 16);
        }
        let quiet = pacing.costs.alone_ms(3).unwrap();
        assert!((quiet - 30.0).abs() < 0.1, "{quiet}");
        // Beside a round that runs, or one that ended within the stretch, they count towards probes only.
        assert_eq!(drafting.advise(), Advice::Speculate);
        paused.target_wrote(step(120.0), 16);
        let mut mine = Pace::new(pacing.clone());
        mine.wrote_alone(step(120.0), 16);
        assert_eq!(pacing.costs.alone_ms(3), Some(quiet));
        drafting.speculated(step(50.0), 16, &[step(50.0)], Spent::wall(0.0));
        paused.target_wrote(
            Spent {
                wall_ms: 60_000.0,
                charged_ms: Some(16.0 * 120.0),
            },
            16,
        );
        assert_eq!(pacing.costs.alone_ms(3), Some(quiet));
        // A request's own round is not beside itself: a target step in it (the draft had nothing) counts, and a
        // request that ends in the middle of a round leaves no round running.
        assert_eq!(drafting.advise(), Advice::Speculate);
        drafting.target_wrote(step(30.0), 16);
        // Nor is a round of its own that ends at its next advice, after the stretch that follows began.
        let long = Spent {
            wall_ms: 60_000.0,
            charged_ms: Some(16.0 * 10.0),
        };
        assert_eq!(drafting.advise(), Advice::Speculate);
        drafting.wrote_alone(long, 16);
        let before_drop = pacing.costs.alone_ms(3).unwrap();
        assert!(before_drop < quiet - 5.0, "{before_drop} {quiet}");
        drop(drafting);
        paused.target_wrote(step(60.0), 16);
        assert!(pacing.costs.alone_ms(3).unwrap() > quiet + 1.0);
    }

    #[test]
    fn under_load_charged_worker_time_decides_and_alone_wall_time_at_one_request() {
        let (_, pacing, load) = moving_pool("parse+token-spec/model", 8, None);
        // At 8 requests a target step waits for a pass full of the others' verification blocks (800 ms of wall
        // time per token) but is charged one row's share of it (40 ms); a speculative round writes 2 tokens in
        // 600 ms of wall time, charged 200 ms. By wall time speculation would win; by charge it loses.
        let spec = Spent {
            wall_ms: 600.0,
            charged_ms: Some(200.0),
        };
        let step = Spent {
            wall_ms: 16.0 * 800.0,
            charged_ms: Some(16.0 * 40.0),
        };
        Pace::new(pacing.clone()).target_wrote(step, 16);
        assert_eq!(pacing.costs.alone_ms(3), Some(40.0));
        let mut p = Pace::new(pacing.clone());
        assert_eq!(p.advise(), Advice::Speculate);
        p.speculated(spec, 2, &[spec], Spent::wall(0.0));
        let at_eight = pacing.costs.spec_ms(&pacing.kind, 3).unwrap();
        assert!((at_eight - 100.0).abs() < 1e-9, "{at_eight}");
        // 2.5 times the target's step: judged after this first round, not after PROBE rounds (a loss of less
        // than FAR_BEHIND times waits for them: `on_a_fresh_router_one_request_measures...`).
        assert!(matches!(p.advise(), Advice::Alone(_)));
        // At one request the same costs are read by wall time: speculation (300 ms/token) beats the target (800).
        load.store(1, Ordering::Relaxed);
        Pace::new(pacing.clone()).target_wrote(step, 16);
        assert_eq!(pacing.costs.alone_ms(0), Some(800.0));
        let mut p = Pace::new(pacing.clone());
        for _ in 0..2 * Pace::PROBE {
            assert_eq!(p.advise(), Advice::Speculate);
            p.speculated(spec, 2, &[spec], Spent::wall(0.0));
        }
        let at_one = pacing.costs.spec_ms(&pacing.kind, 0).unwrap();
        assert!((at_one - 300.0).abs() < 1e-9, "{at_one}");
    }

    /// Token-level rounds of `kind` at level 0, each drafting `drafted` with `accepted` kept, verification costing a
    /// 10 ms step and `row` ms per drafted row, drafting `draft` ms per token.
    fn rounds(costs: &Costs, n: usize, drafted: usize, accepted: usize, row: f64, draft: f64) {
        for _ in 0..n {
            let verify = 10.0 + row * drafted as f64;
            costs.record_token_round("k", 0, drafted, accepted, verify, draft * drafted as f64);
        }
    }

    #[test]
    fn a_round_drafts_as_far_as_pays_by_measured_acceptance_and_row_costs() {
        let costs = Costs::default();
        // No figure yet: as far as the request allows (which measures the positions).
        assert_eq!(costs.draft_length("k", 0, 6), 6);
        costs.record_alone(None, 0, 10.0, 1);
        assert_eq!(costs.draft_length("k", 0, 6), 6, "no verification measured");
        // Drafts whose first two tokens are kept and never the third, rows at half a step: two pays, more does not.
        rounds(&costs, 40, 6, 2, 5.0, 0.0);
        assert_eq!(costs.draft_length("k", 0, 6), 2);
        // Every draft kept whole, rows at a twentieth of a step: as far as the request allows.
        let cheap = Costs::default();
        cheap.record_alone(None, 0, 10.0, 1);
        rounds(&cheap, 40, 6, 6, 0.5, 0.0);
        assert_eq!(cheap.draft_length("k", 0, 6), 6);
        assert_eq!(
            cheap.draft_length("k", 0, 3),
            3,
            "never past the request's own most"
        );
        // The same acceptance with a dear drafter (a model at 8 ms a token against a 10 ms step): shorter.
        let dear = Costs::default();
        dear.record_alone(None, 0, 10.0, 1);
        for _ in 0..40 {
            for kept in [6, 1, 3, 0] {
                dear.record_token_round("k", 0, 6, kept, 10.0 + 0.5 * 6.0, 8.0 * 6.0);
            }
        }
        let long = dear.draft_length("k", 0, 6);
        let free = Costs::default();
        free.record_alone(None, 0, 10.0, 1);
        for _ in 0..40 {
            for kept in [6, 1, 3, 0] {
                free.record_token_round("k", 0, 6, kept, 10.0 + 0.5 * 6.0, 0.0);
            }
        }
        assert!(long < free.draft_length("k", 0, 6), "{long}");
        // Another kind, or another load's costs, are not this one's.
        assert_eq!(costs.draft_length("other", 0, 6), 6);
    }

    #[test]
    fn a_position_no_longer_reached_drifts_back_and_is_tried_again() {
        let costs = Costs::default();
        costs.record_alone(None, 0, 10.0, 1);
        // Only the first token kept for a while: one token per round.
        rounds(&costs, 40, 4, 1, 5.0, 0.0);
        assert_eq!(costs.draft_length("k", 0, 4), 1);
        // Then one-token drafts, all kept: position 2's figure fades towards position 1's, and longer drafts return.
        rounds(&costs, 200, 1, 1, 5.0, 0.0);
        assert!(costs.draft_length("k", 0, 4) > 1);
    }

    #[test]
    fn with_no_step_measured_some_rounds_draft_half_as_far_and_the_line_through_them_prices_a_step()
    {
        let costs = Costs::default();
        // Verifications at 10 ms plus 5 per drafted row, every draft kept; nothing written alone.
        let mut lengths = Vec::new();
        for _ in 0..8 {
            let k = costs.draft_length("k", 0, 6);
            lengths.push(k);
            costs.record_token_round("k", 0, k, k, 10.0 + 5.0 * k as f64, 0.0);
        }
        assert_eq!(&lengths[..4], [6, 6, 6, 3], "{lengths:?}");
        // With two lengths seen, the line prices a one-row pass: 5 ms fixed and 5 per row (the pending token's
        // included), 10.
        let one = costs.one_row_ms("k", 0).unwrap();
        assert!((one - 10.0).abs() < 1e-6, "{one}");
        // A pace with no figure of the target alone judges speculation against that pass: rounds writing a token
        // per 20 ms lose to it and the request pauses.
        let pacing = Pacing {
            costs: Arc::new(costs),
            kind: "k".into(),
            load: Arc::new(|| 1),
            off_at: None,
        };
        let mut p = Pace::new(pacing);
        for _ in 0..Pace::PROBE {
            assert_eq!(p.advise(), Advice::Speculate);
            p.speculated(Spent::wall(40.0), 2, &[Spent::wall(40.0)], Spent::wall(0.0));
        }
        assert!(matches!(p.advise(), Advice::Alone(_)));
    }

    #[test]
    fn a_model_is_set_against_what_its_pauses_wrote_as_a_whole_not_its_copies_alone() {
        let kind = "parse+token-spec/model+ngram";
        let (costs, pacing) = pool(kind, 1);
        costs.record_alone(None, 0, 16.0 * 70.0, 16);
        costs.record_spec(kind, 0, 16.0 * 45.0, 16, None);
        costs.record_spec(&copy_kind(kind), 0, 16.0 * 30.0, 16, None);
        // A pause of a copy round (30 ms a token) and one that found nothing to copy (the target's steps to the
        // segment's end, 90): 67.5 ms a token as a whole, the later weighing more.
        let mut p = Pace::new(pacing.clone());
        p.copied(Spent::wall(16.0 * 30.0), 16);
        p.copied_nothing(Spent::wall(16.0 * 90.0), 16);
        assert_eq!(costs.pauses_ms(kind, 0), Some(67.5));
        // The model (45) beats that and the target alone (70), though not the copy rounds' own 30: it speculates.
        assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
        // Once its pauses write faster than the model, it rests (but for one probe, which the first request takes).
        costs.record_paused(kind, 0, 64.0 * 20.0, 64);
        assert!(costs.pauses_ms(kind, 0).unwrap() < 45.0);
        let mut first = Pace::new(pacing.clone());
        assert_eq!(first.advise(), Advice::Speculate);
        assert!(first.probing());
        assert!(matches!(Pace::new(pacing).advise(), Advice::Alone(_)));
    }

    #[test]
    fn rounds_of_the_sort_that_writes_faster_and_now_and_then_of_the_other() {
        let kind = "parse+token-spec/model+ngram";
        let (costs, pacing) = pool(kind, 1);
        let round = |p: &mut Pace, ms: f64, tokens: usize| {
            assert_eq!(p.advise(), Advice::Speculate);
            let sort = p.choose_rounds();
            p.speculated(
                Spent::wall(ms * tokens as f64),
                tokens,
                &[],
                Spent::wall(0.0),
            );
            sort
        };
        costs.record_alone(None, 0, 16.0 * 100.0, 16);
        costs.record_spec(kind, 0, 16.0 * 60.0, 16, None);
        let mut p = Pace::new(pacing.clone());
        // No figure of either sort: PARSE rounds first. The first round of a choice pays for the switch and goes to
        // no sort's figure; the request keeps its sort for STREAK tokens.
        assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
        assert_eq!(costs.spec_ms(&Rounds::Segments.figure(kind), 0), None);
        assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
        assert_eq!(costs.spec_ms(&Rounds::Segments.figure(kind), 0), Some(60.0));
        assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
        assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
        // PARSE rounds measured, token-level ones not: a request tries those (its first round a switch again).
        assert_eq!(round(&mut p, 90.0, 8), Rounds::Tokens);
        assert_eq!(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), None);
        for _ in 0..4 {
            assert_eq!(round(&mut p, 30.0, 8), Rounds::Tokens);
        }
        let near = |x: Option<f64>, y: f64| x.is_some_and(|x| (x - y).abs() < 1e-9);
        assert!(near(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), 30.0));
        // Token-level rounds write faster: the pace judges speculation by them, and a request makes them...
        assert!(near(costs.best_spec_ms(kind, 0), 30.0));
        let sorts: Vec<Rounds> = (0..40).map(|_| round(&mut p, 30.0, 8)).collect();
        // ... except a streak of PARSE rounds (STREAK tokens) each time the token-level ones wrote TRY_OTHER_EVERY
        // tokens (counted from the PARSE rounds' last report, before the five token-level rounds above).
        let streaks: Vec<(Rounds, usize)> = sorts
            .chunk_by(|a, b| a == b)
            .map(|c| (c[0], c.len()))
            .collect();
        let (per_streak, between) = (Pace::STREAK / 8, Costs::TRY_OTHER_EVERY / 8);
        assert_eq!(
            streaks,
            vec![
                (Rounds::Tokens, between - 5),
                (Rounds::Segments, per_streak),
                (Rounds::Tokens, between),
                (Rounds::Segments, per_streak),
                (Rounds::Tokens, 40 - 2 * (between + per_streak) + 5),
            ]
        );
        // A pause ends a streak: the round after it is a switch, whatever its sort.
        p.pause(4, "test");
        p.wrote_alone(Spent::wall(400.0), 4);
        let before = costs.spec_ms(&Rounds::Tokens.figure(kind), 0);
        assert_eq!(round(&mut p, 500.0, 8), Rounds::Tokens);
        assert_eq!(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), before);
    }
}
