//! PARSE rounds: draft segments, verify every prefix in one pass, extend from the cut; copy rounds in the
//! draft model's pauses.

use super::*;

impl<D: Drafter + ?Sized, V: Verifier + ?Sized> Run<'_, D, V> {
    pub(super) fn run_parse(&mut self) -> Result<()> {
        self.warm_draft()?;
        self.open_target()?;
        let adaptive = self.req.window.adaptive;
        if adaptive {
            // Paced, where the target may write any token alone. Unpaced, the verdict decides every token, the
            // first too (at `tau = 0` the output is the draft's: DESIGN.md's limits).
            self.first_token()?;
        } else {
            self.open_draft(&SamplingParams::default())?;
        }
        self.window = self.req.window.initial_segments;
        let mut round = 0usize;
        while self.finished.is_none() {
            // One span per round (draft, verification, extension): the workers' spans of its calls are its
            // children (the trace context travels with each call).
            let span = round_span(round);
            let _round = span.enter();
            round += 1;
            let (mark, before) = (self.mark(), self.out.len());
            if adaptive && let Advice::Alone(n) = self.advise() {
                // The target writes alone, 16 tokens per call, and in the pause's last call to the end of the
                // current segment at most, so that the next PARSE round drafts from a segment's start. (Stopping at
                // every segment's end would cost a call per line of code, each call a chance to miss a batched pass.)
                // Once the last call stops at a segment's end, the pause is over, whatever of its length is left:
                // going on to the end of the next segment, and the next, took a call per line of code again.
                // While the model rests, copy rounds (`copy_round`: prompt lookup, the draft's and its extension's,
                // as the `ngram` drafter drafts) take the pause's place, unless they lose to the target here.
                let copies = self
                    .d
                    .rest_lookup()
                    .filter(|_| self.copy_may_start() && self.pace.copies_pay());
                if let Some(lookup) = copies {
                    let (drafted, accepted) = self.copy_round(&lookup)?;
                    span.record("drafted", drafted);
                    span.record("accepted", accepted);
                    continue;
                }
                let cfg = self.req.segmenter.clone();
                let last = n <= 16;
                let want = n.min(16).min(self.remaining());
                self.extend(want, last.then_some(&cfg))?;
                let wrote = self.out.len() - before;
                self.pace.wrote_alone(self.spent(mark), wrote);
                if last && wrote < want {
                    self.pace.end_pause();
                }
                span.record("drafted", 0);
                continue;
            }
            // In `parse+token-spec`, a PARSE round or a token-level one, whichever writes faster here by what
            // each measured (`Pace::choose_rounds`). (PARSE modes decode greedily: `GenerationRequest::validate`.)
            if adaptive
                && self.req.mode == Mode::ParseTokenSpec
                && self.pace.choose_rounds() == Rounds::Tokens
            {
                let drafted = self.speculative_token_round(mark, before, true)?;
                self.stats.token_rounds += 1;
                span.record("drafted", drafted);
                continue;
            }
            let modelled = self.d.model_tokens_drafted();
            // With `adaptive`, no further than the length that writes the most per unit of measured cost,
            // as a token-level round's (`Costs::draft_length`: the chance of each position being accepted and the
            // price of a verification's rows, from this kind's rounds of either sort).
            let max = self.req.window.max_tokens;
            let cap = if adaptive {
                self.pace.draft_length(max)
            } else {
                max
            };
            let (dt, dc) = (Instant::now(), self.d.charged_ms());
            let (draft, bs, _) = self.draft(Some(self.window), cap)?;
            let drafting = Spent {
                wall_ms: ms(dt),
                charged_ms: dc.zip(self.d.charged_ms()).map(|(a, b)| (b - a).max(0.0)),
            };
            span.record("drafted", draft.len());
            span.record("segments", bs.len());
            if draft.is_empty() {
                // The draft had nothing to say: the target writes a segment.
                self.extend_segment()?;
                continue;
            }
            // While the target verifies this draft, the drafter may already write the next one on the guess that
            // this one is accepted whole (the likely case once the window has grown): PARSE verifies finished
            // segments while the draft streams on. Not when the draft ends the output.
            // Nor after a probe of a speculation that was losing: a pause most likely follows, and the draft read
            // ahead would be thrown away after taking its share of the workers.
            let after = self.remaining().saturating_sub(draft.len());
            let probe = adaptive && self.pace.probing();
            if after > 0 && !probe && !draft.iter().any(|t| self.req.eos.contains(t)) {
                let mut context = self.context();
                context.extend(&draft);
                let ahead = (2 * draft.len())
                    .clamp(8, self.req.window.max_tokens)
                    .min(after);
                self.d.prefetch(
                    &self.req.session,
                    &context,
                    &SamplingParams::default(),
                    ahead,
                )?;
            }
            let m = self.mark();
            let (accepted, full) = self.verify(&draft, &bs, false, false)?;
            let this_verify = self.spent(m);
            span.record("accepted", accepted);
            if adaptive {
                self.pace
                    .token_round(draft.len(), accepted, this_verify, drafting);
            }
            if full {
                self.window = (self.window * 2).min(self.req.window.max_segments);
            } else {
                self.window = (self.window / 2).max(1);
                if self.finished.is_none() {
                    self.extend_segment()?;
                }
            }
            if adaptive {
                let spent = self.spent_round(mark);
                if modelled.is_some() && self.d.model_tokens_drafted() == modelled {
                    // All copies: the copies' figure, not the model's.
                    self.pace.copies_only(spent, self.out.len() - before);
                } else {
                    let setup = self.setup(mark);
                    self.pace
                        .speculated(spent, self.out.len() - before, &[this_verify], setup);
                }
            }
        }
        Ok(())
    }

    /// Whether a copy round may start here, in a pause of the draft model: at one request, wherever the lookup
    /// matches (the copy round's own lookup decides); under load, only where the context's last
    /// [`LOADED_COPY_MATCH`] tokens or more occurred earlier, a long quote going on rather than a phrase met again.
    pub(super) fn copy_may_start(&self) -> bool {
        self.pace.level() == 0
            || crate::lookup::lookup_match(
                &self.context(),
                &crate::lookup::NgramConfig {
                    min_n: LOADED_COPY_MATCH,
                    max_n: LOADED_COPY_MATCH,
                },
            )
            .is_some()
    }

    /// A PARSE round of copies while the draft model rests ([`DraftHints::rest_lookup`]): the draft is what followed
    /// the latest earlier occurrence of the context's end, token after token, up to the round's window of segments;
    /// the target verifies it by the request's verdict. Where it cuts the copy short, and where nothing matches,
    /// the target writes on to the end of the segment as a request drafting by prompt lookup alone does
    /// ([`Run::extend_segment_copying`]), so that a request whose model rests drafts as the `ngram` drafter would.
    /// Returns (tokens drafted, accepted) of the round's copy. Its tokens count towards the pause as the target's
    /// alone would; the cost of a round that copied goes to the copies' own figure ([`Pace::copied`]), by which the
    /// next copy round is judged ([`Pace::copies_pay`]), that of one that found nothing to copy to the target's
    /// ([`Pace::copied_nothing`]).
    pub(super) fn copy_round(
        &mut self,
        lookup: &crate::lookup::NgramConfig,
    ) -> Result<(usize, usize)> {
        let (mark, before) = (self.mark(), self.out.len());
        let cfg = self.req.segmenter.clone();
        let cap = self.remaining().min(self.req.window.max_tokens);
        let t = Instant::now();
        let mut context = self.context();
        // Each chunk: up to `want` tokens, each the one after the latest earlier occurrence of the context's end.
        let copy = |run: &mut Self, want: usize| {
            let (tokens, done) = copy_tokens(&mut context, lookup, want, &run.req.eos);
            let pieces = run.d.pieces(&tokens)?;
            Ok(DraftChunk {
                tokens,
                pieces,
                probs: Vec::new(),
                done,
            })
        };
        let (draft, pieces, _) = self.pull(Some(self.copy_window), cap, copy)?;
        self.stats.draft_ms += ms(t);
        if draft.is_empty() {
            // Nothing to copy: the target's steps to the segment's end go to its own figure, not the copies' (as
            // where the `ngram` drafter has nothing to draft), and so do the token-level copies on the way.
            self.extend_segment_copying(lookup)?;
            self.pace
                .copied_nothing(self.spent(mark), self.out.len() - before);
            return Ok((0, 0));
        }
        let bs = segmenter::boundaries(&pieces, &cfg);
        let (accepted, full) = self.verify(&draft, &bs, false, false)?;
        self.stats.copy_rounds += 1;
        if full {
            self.copy_window = (self.copy_window * 2).min(self.req.window.max_segments);
        } else {
            self.copy_window = (self.copy_window / 2).max(1);
            if self.finished.is_none() {
                self.extend_segment_copying(lookup)?;
            }
        }
        self.pace.copied(self.spent(mark), self.out.len() - before);
        Ok((draft.len(), accepted))
    }

    /// The target writes on to the end of the current segment, in `parse+token-spec` by token-level rounds whose
    /// drafts are copies (`lookup`), as [`Run::extend_segment`] does for a request drafting by prompt lookup alone;
    /// where nothing matches, the target writes one token. In `parse`, alone to the segment's end.
    pub(super) fn extend_segment_copying(
        &mut self,
        lookup: &crate::lookup::NgramConfig,
    ) -> Result<()> {
        self.write_to_segment_end(|run| {
            let (start, want) = (run.out.len(), run.req.window.token_spec_tokens);
            let t = Instant::now();
            let want = want.min(run.remaining());
            let (draft, _) = copy_tokens(&mut run.context(), lookup, want, &run.req.eos);
            run.stats.draft_ms += ms(t);
            if draft.is_empty() {
                // The target alone: its figure, as in any token-level round with nothing drafted (in a pause that
                // is all copy rounds, the only place it is measured).
                let m = run.mark();
                run.extend(1, None)?;
                run.pace.target_wrote(run.spent(m), run.out.len() - start);
            } else {
                run.verify(&draft, &[draft.len()], true, true)?;
            }
            Ok(())
        })
    }

    /// The target writes on to the end of the current segment (the one starting at the pending token).
    pub(super) fn extend_segment(&mut self) -> Result<()> {
        // Never paused: a token-level round may run past the segment's end, a paused target would stop at it, and
        // the next PARSE round would start elsewhere (outputs would follow measured times).
        self.write_to_segment_end(|run| run.token_round(false).map(drop))
    }

    /// The target writes on to the end of the current segment: in `parse+token-spec` by token-level rounds (`round`,
    /// called until a segment ends), in `parse` alone.
    pub(super) fn write_to_segment_end(
        &mut self,
        mut round: impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let cfg = self.req.segmenter.clone();
        if self.req.mode != Mode::ParseTokenSpec {
            return self.extend(self.remaining(), Some(&cfg));
        }
        let mut pieces = self.d.pieces(&[self.pending])?;
        while self.finished.is_none() && segmenter::first_segment_end(&pieces, &cfg).is_none() {
            let start = self.out.len();
            round(self)?;
            let new: Vec<u32> = self.out[start..].to_vec();
            pieces.extend(self.d.pieces(&new)?);
        }
        Ok(())
    }
}
