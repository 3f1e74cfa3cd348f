//! How long a token-level round drafts, and whether a one-token guess pays: from the chance of each draft position
//! being accepted ([`Reach`]) and the prices of a verification's rows and a drafted token ([`Passes`]).

use super::*;

impl Costs {
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
    /// it guesses (which measures them); while guesses lose, one in [`PaceConfig::guess_probe`] is still made, so that
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
        if g.skipped >= self.cfg.guess_probe {
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
    /// target alone: its drafts cost less than [`PaceConfig::free_draft`] of a verification row (prompt lookup: a few
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
                    && b.draft_ms <= self.cfg.free_draft * b.per_row
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
}
