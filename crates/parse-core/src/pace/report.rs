//! What a request reports after each round and pause: its cost goes to the shared figures of its kind and load, and
//! to the request's own estimate.

use super::*;

impl Pace {
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

    /// The request finished with `tokens` of output ([`Costs::record_length`]).
    pub fn finished(&self, tokens: usize) {
        self.pacing.costs.record_length(tokens);
    }

    /// Gives back the probes this request took ([`Costs::probe_back`]): their rounds are over.
    pub(super) fn give_back_probes(&mut self) {
        for (kind, level) in std::mem::take(&mut self.held) {
            self.pacing.costs.probe_back(&kind, level);
        }
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
    /// [`PaceConfig::max_pause`] tokens, and where requests end meanwhile its last calls share passes with fewer rows, each
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
    pub(super) fn copy_kind(&self) -> String {
        copy_kind(&self.pacing.kind)
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

    /// A round advised as speculation drew its whole draft from copies ([`DraftHints::model_tokens_drafted`]): it wrote
    /// `tokens` for `spent`, which goes to the copies' figure, not the model's. (Judged as the model's, rounds of long
    /// copies, a verification for dozens of tokens, made a model that lost to them look cheap, and each request began
    /// with a model round that paid for the draft's prefill of its prompt.)
    ///
    /// [`DraftHints::model_tokens_drafted`]: crate::driver::DraftHints::model_tokens_drafted
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
    pub(super) fn report_rounds(&mut self, ms: f64, tokens: usize) {
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

    pub(super) fn end_round(&mut self) {
        if std::mem::take(&mut self.in_round) {
            self.round_ended = Some(self.pacing.costs.round_ends());
        }
    }

    /// Whether another request's speculative round ran while the target wrote for `spent` (the last to end being
    /// this request's own, the others' are taken to have ended before it).
    pub(super) fn beside_speculation(&self, spent: Spent) -> bool {
        let costs = &self.pacing.costs;
        costs.activity(|a| {
            a.running > usize::from(self.in_round)
                || a.last_end.is_some_and(|t| {
                    Some(t) != self.round_ended
                        && costs.clock.now().saturating_duration_since(t).as_secs_f64() * 1e3
                            < spent.wall_ms
                })
        })
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
