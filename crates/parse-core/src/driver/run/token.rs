//! Token-level speculation: `token-spec` rounds, greedy or sampled, with their guesses.

use super::*;

impl<D: Drafter + ?Sized, V: Verifier + ?Sized> Run<'_, D, V> {
    pub(super) fn run_token_spec(&mut self) -> Result<()> {
        self.warm_draft()?;
        self.open_target()?;
        self.first_token()?;
        let sampling = self.draft_sampling();
        if !self.req.window.adaptive {
            self.open_draft(&sampling)?;
        }
        let mut round = 0usize;
        while self.finished.is_none() {
            let span = round_span(round);
            let _round = span.enter();
            round += 1;
            let before = self.stats.draft_tokens_accepted;
            if sampling.is_greedy() {
                let drafted = self.token_round(self.req.window.adaptive)?;
                span.record("drafted", drafted);
            } else {
                let (draft, _, probs) = self.draft(None, self.req.window.token_spec_tokens)?;
                span.record("drafted", draft.len());
                if draft.is_empty() {
                    self.extend(1, None)?;
                    continue;
                }
                self.verify_sampled(&draft, &probs)?;
            }
            span.record("accepted", self.stats.draft_tokens_accepted - before);
        }
        Ok(())
    }

    /// One round of greedy token-level speculation or, with `adaptive` and while it does not pay ([`Pace`]), the
    /// target writing alone for the pause's length. Both give the target's greedy tokens. Returns the tokens drafted.
    pub(super) fn token_round(&mut self, adaptive: bool) -> Result<usize> {
        let (round, before) = (self.mark(), self.out.len());
        let max = self.req.window.token_spec_tokens;
        if adaptive && let Advice::Alone(n) = self.advise_token_round(max) {
            // At most 16 per call, as in `target` mode, so that text streams out as it is written.
            self.extend(n.min(16).min(self.remaining()), None)?;
            self.pace
                .wrote_alone(self.spent(round), self.out.len() - before);
            return Ok(0);
        }
        self.speculative_token_round(round, before, adaptive)
    }

    /// The token of a one-token guess ([`DraftHints::guess_lookup`]), where the drafter makes them, the request may
    /// write two tokens more, the lookup finds one and guesses pay here ([`Pace::guess_pays`], asked last: while
    /// guesses lose, it lets one place in a few guess, and a place with nothing to guess should not use that turn).
    pub(super) fn guess(&self) -> Option<u32> {
        let cfg = self.d.guess_lookup()?;
        if self.remaining() < 2 {
            return None;
        }
        crate::lookup::lookup(&self.context(), &cfg).filter(|_| self.pace.guess_pays())
    }

    /// The speculative part of [`Run::token_round`], from `round` (its mark) with `before` tokens written.
    pub(super) fn speculative_token_round(
        &mut self,
        round: Mark,
        before: usize,
        adaptive: bool,
    ) -> Result<usize> {
        let max = self.req.window.token_spec_tokens;
        // How far to draft: with `adaptive`, the length that writes the most per unit of measured cost (the chance
        // of each position being accepted, the price of a verification's rows: `Costs::draft_length`); the
        // request's own `token_spec_tokens` is the most it drafts. Greedy, so the output is the target's whatever
        // the length.
        let want = if adaptive {
            self.pace.draft_length(max)
        } else {
            max
        };
        let (draft, bs, _) = self.draft(None, want)?;
        if draft.is_empty()
            && adaptive
            && let Some(t) = self.guess()
        {
            // The drafter had nothing; a guess of one token costs the target one more row.
            let m = self.mark();
            let (accepted, _) = self.verify(&[t], &[1], true, true)?;
            let this_verify = self.spent(m);
            self.stats.guesses += 1;
            self.stats.guesses_right += accepted;
            self.pace.guessed(this_verify, accepted > 0);
            let (spent, setup) = (self.spent_round(round), self.setup(round));
            self.pace
                .speculated(spent, self.out.len() - before, &[this_verify], setup);
            return Ok(1);
        }
        if draft.is_empty() {
            let m = self.mark();
            self.extend(1, None)?;
            self.pace
                .target_wrote(self.spent(m), self.out.len() - before);
            return Ok(0);
        }
        // While the target verifies, a drafter with compute of its own may draft the next round already, guessing
        // the target's token after this draft as its own (as `run_parse` drafts ahead, where a full acceptance
        // needs no guess). Not where this draft ends the output, nor after a probe of a speculation that was
        // losing (a pause most likely follows).
        let after = self.remaining().saturating_sub(draft.len() + 1);
        let probe = adaptive && self.pace.probing();
        if after > 0 && !probe && !draft.iter().any(|t| self.req.eos.contains(t)) {
            let mut context = self.context();
            context.extend(&draft);
            self.d.prefetch_guessing(
                &self.req.session,
                &context,
                &self.draft_sampling(),
                want.min(after),
            )?;
        }
        let m = self.mark();
        let (accepted, _) = self.verify(&draft, &bs, true, true)?;
        if adaptive {
            let this_verify = self.spent(m);
            let spent = self.spent_round(round);
            let setup = self.setup(round);
            let drafting = Spent {
                wall_ms: (spent.wall_ms - this_verify.wall_ms).max(0.0),
                charged_ms: spent
                    .charged_ms
                    .zip(this_verify.charged_ms)
                    .map(|(a, b)| (a - b).max(0.0)),
            };
            self.pace
                .token_round(draft.len(), accepted, this_verify, drafting);
            self.pace
                .speculated(spent, self.out.len() - before, &[this_verify], setup);
        }
        Ok(draft.len())
    }
}
