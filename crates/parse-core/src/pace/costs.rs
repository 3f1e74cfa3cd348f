//! What the pool's figures say: the rates of the target alone and of each kind of speculation by load level,
//! what a token-level round should draft, whether a guess or a copy round pays, and when the next probe is due.

use super::*;

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
    pub(super) const MIN_LENGTHS: usize = 4;

    pub(super) fn with<T>(&self, level: u32, f: impl FnOnce(&mut Level) -> T) -> T {
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
    pub(super) fn near(
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
    pub(super) fn record_paused(&self, kind: &str, level: u32, ms: f64, tokens: usize) {
        self.with(level, |l| {
            l.spec
                .entry(pause_kind(kind))
                .or_default()
                .rate
                .add(ms, tokens)
        })
    }

    /// [`Costs::spec_ms`] and how many rounds were reported to it.
    pub(super) fn spec_figure(&self, kind: &str, level: u32) -> (Option<f64>, usize) {
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
    pub(super) fn add_alone(
        &self,
        kind: Option<&str>,
        level: u32,
        ms: f64,
        tokens: usize,
        beside: bool,
    ) {
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
    pub(super) fn add_rested(&self, kind: &str, level: u32, tokens: usize) {
        self.with(level, |l| {
            l.spec.entry(kind.to_string()).or_default().since += tokens
        })
    }

    pub(super) fn activity<T>(&self, f: impl FnOnce(&mut Activity) -> T) -> T {
        f(&mut self.activity.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(super) fn round_begins(&self) {
        self.activity(|a| a.running += 1)
    }

    pub(super) fn round_ends(&self) -> std::time::Instant {
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
    pub(super) fn until_probe(&self, kind: &str, level: u32) -> usize {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.gap.saturating_sub(s.since)
        })
    }

    /// Whether a request may make the first round of `kind` at `level`, which has no figure: only if no other
    /// request is making one (it then counts as making it, until [`Costs::measured`]).
    pub(super) fn take_measuring(&self, kind: &str, level: u32) -> bool {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            let free = !s.measuring;
            s.measuring = true;
            free
        })
    }

    /// The first round taken with [`Costs::take_measuring`] reported, or its request ended.
    pub(super) fn measured(&self, kind: &str, level: u32) {
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
    /// Both bound what probes cost where they lose by far. Without the first, every few tokens written alone at a
    /// loaded level would make another probe due while the ones taken have not reported yet (each a whole PARSE
    /// round, seconds at that load). Without the second, a probe would go to whichever request asked first, late in
    /// a burst a request hundreds of tokens in whose draft has its whole context to prefill first, which the burst's
    /// last requests wait for.
    pub(super) fn take_probe(&self, kind: &str, level: u32, catch_up: usize) -> bool {
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
    pub(super) fn probe_back(&self, kind: &str, level: u32) {
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
    pub(super) fn since(&self, kind: &str, level: u32) -> usize {
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
    pub(super) fn best_round(
        &self,
        kind: &str,
        level: u32,
        max: usize,
    ) -> Result<BestRound, usize> {
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
    pub(super) fn passes(&self, kind: &str, level: u32) -> Passes {
        self.with(level, |l| l.spec.get(kind).map(|s| s.passes))
            .unwrap_or_default()
    }

    /// A verification's time at `level` as a line in its rows, (fixed ms, ms per row), from a kind's `passes`
    /// ([`Passes::line`], where the drafts' lengths spread; otherwise a row is the verifications' mean time less the
    /// target's one-token step, over their mean rows less one); `None` where neither can be read yet.
    pub(super) fn row_line(&self, passes: &Passes, level: u32) -> Option<(f64, f64)> {
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
    /// of one token ([`DraftHints::guess_lookup`]: the token after the latest earlier occurrence of the context's last
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
    /// [`DraftHints::guess_lookup`]: crate::driver::DraftHints::guess_lookup
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
