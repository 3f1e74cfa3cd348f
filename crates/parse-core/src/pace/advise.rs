//! The decision before each round: speculate, probe, or let the target write alone for a while, and of which sort
//! and length the round is.

use super::*;

impl Pace {
    /// The tunables this request is paced by (its pool's).
    fn cfg(&self) -> &PaceConfig {
        self.pacing.costs.config()
    }

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
            why: None,
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
    pub(super) fn entry_pays(&self, spec: f64, alone: f64) -> bool {
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

    /// Whether the drafter has more to catch up on than [`PaceConfig::unpriced_entry`] tokens for each token the request is
    /// expected to write still ([`Costs::expected_left`]), where no drafter's prefill has been priced in the pool
    /// yet ([`Costs::entry_ms`]: [`Pace::entry_pays`] has nothing to judge by). Speculation saves less than the
    /// target's step per token written, and a drafter's prefill is taken to cost at least a 32nd of that step per
    /// token it catches up on (the default draft's costs about a third of the target's step), so such an entry loses
    /// whatever it accepts: without this rule the first request of a fresh router with a long prompt and a few
    /// tokens to write would have the draft worker prefill the whole prompt after the target had.
    pub(super) fn entry_unpriced_and_far(&self) -> bool {
        let costs = &self.pacing.costs;
        self.lag > 0
            && (self.alone_last || self.rounds == 0)
            && costs.entry_ms(&self.pacing.kind, self.level).is_none()
            && self.lag
                > self.cfg().unpriced_entry * costs.expected_left(self.written, self.left).max(1)
    }

    /// Whether the shared figures at the current load say this request's speculation pays (its kind's ms per token
    /// at most the target's alone, or its copy rounds' where those are faster), or have no figure of its kind there
    /// yet (a first round would measure it). No side effect: the advice itself comes from [`Pace::advise`]. Read
    /// before the target's prefill, to let the drafter process the prompt beside it ([`DraftHints::warm`]).
    ///
    /// [`DraftHints::warm`]: crate::driver::DraftHints::warm
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

    pub(super) fn estimate(&self) -> Option<f64> {
        match (self.own.get(), self.prior) {
            (Some(o), _) if self.rounds >= self.cfg().probe_rounds => Some(o),
            (Some(o), Some(s)) => {
                let w = self.rounds as f64 / self.cfg().probe_rounds as f64;
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
            return self.pause(self.cfg().max_pause, Why::Off);
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
            return self.pause(self.cfg().first_pause, Why::TargetUnmeasured);
        }
        if estimate.is_none()
            && self.rounds > 0
            && step.is_none_or(|s| {
                self.own
                    .get()
                    .is_some_and(|own| own > self.cfg().far_behind * s)
            })
        {
            // This request measures the first rounds of its kind here (no figure before them), and either the
            // target's own step at this load was never measured (nothing to judge the round by but the cheapest
            // verification, only an upper bound of a step) or its rounds so far lose to that step by far. A short
            // pause measures the target; the rounds' figure, reported to the shared costs, is the prior after it.
            // Without it the request would go on for [`PaceConfig::probe_rounds`] rounds before it was judged, however far its
            // rounds lose.
            return self.pause(self.cfg().first_pause, Why::FirstRoundsLose);
        }
        let catch_up = self.catch_up_tokens(alone);
        if estimate.is_none()
            && self.rounds == 0
            && self.measuring.is_none()
            && costs.since(kind, self.level) < (self.cfg().probe_share * catch_up as f64) as usize
        {
            // No figure here yet, and this request's drafter has more to catch up on than the tokens written alone
            // here so far pay for, as a probe's would ([`Costs::take_probe`]): the first round is left to another
            // request, or to this one later (as a burst of requests ends, each lower load would otherwise be measured
            // first by a request hundreds of tokens in).
            self.entries_declined += 1;
            return self.pause(self.cfg().max_pause, Why::CatchUpBeforeFirstRound);
        }
        if self.entry_unpriced_and_far() {
            self.entries_declined += 1;
            return self.pause(self.cfg().max_pause, Why::CatchUpUnpriced);
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
            return self.pause(self.cfg().max_pause, Why::CatchUpDoesNotPay);
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
            self.cfg().first_pause
        } else {
            costs
                .until_probe(kind, self.level)
                .clamp(self.cfg().first_pause, self.cfg().max_pause)
        };
        self.pause(pause, Why::Loses)
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
    pub(super) fn begin_round(&mut self, probing: bool) -> Advice {
        self.probing = probing;
        self.alone_last = false;
        self.in_round = true;
        self.pacing.costs.round_begins();
        Advice::Speculate
    }

    /// What the drafter's catching up before a round would cost (its lag at its measured prefill price per context
    /// token, [`Costs::entry_ms`]) in tokens the target writes alone meanwhile (`alone`: its ms per token); 0 where
    /// either is not known.
    pub(super) fn catch_up_tokens(&self, alone: Option<f64>) -> usize {
        match (
            self.pacing.costs.entry_ms(&self.pacing.kind, self.level),
            alone,
        ) {
            (Some(row), Some(a)) if a > 0.0 => (row * self.lag as f64 / a).ceil() as usize,
            _ => 0,
        }
    }

    /// Advice to write `tokens` alone, with the bookkeeping of a pause; `why` and the figures it was judged by go to
    /// the log at debug level (`RUST_LOG=parse_core::pace=debug`), for an operator asking why a request stopped
    /// speculating.
    pub(super) fn pause(&mut self, tokens: usize, why: Why) -> Advice {
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
        self.why = Some(why);
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
    /// A request keeps the sort it chose for [`PaceConfig::streak`] tokens, and the first round after a switch (or after a
    /// pause) goes to no sort's figure: it pays for the switch (a draft read ahead for the other sort thrown away, the
    /// draft catching up), and judged by such rounds alone, the sort that was not running looked 2-3 times dearer
    /// than it wrote once it ran.
    pub fn choose_rounds(&mut self) -> Rounds {
        let rounds = match self.streak {
            Some((sort, tokens, _)) if tokens < self.cfg().streak => sort,
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

    /// Why the last pause began (`None` before any).
    pub fn why(&self) -> Option<Why> {
        self.why
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

    /// Whether a one-token guess pays at the load of the last advice ([`Costs::guess_pays`]).
    pub fn guess_pays(&self) -> bool {
        !self.pacing.off() && self.pacing.costs.guess_pays(&self.pacing.kind, self.level)
    }
}
