//! The loop itself: one [`Run`] per request, its shared steps (target calls, drafting, verification and
//! acceptance, cost marks) here, the rounds of each mode in the submodules.

use std::time::Instant;

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::error::{Error, Result};
use crate::pace::{Advice, Pace, Pacing, Rounds, Spent};
use crate::plan::{Scoring, VerifyPlan};
use crate::policy::{AcceptPolicy, Verdict, decide};
use crate::segmenter::{self, SegmenterConfig};
use crate::speculative::{self, SampleCheck};

use super::*;

mod parse;
mod token;

/// Adds one to each of the first `n` positions' counts.
fn count_positions(counts: &mut Vec<usize>, n: usize) {
    if counts.len() < n {
        counts.resize(n, 0);
    }
    counts[..n].iter_mut().for_each(|c| *c += 1);
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

struct Run<'a, D: ?Sized, V: ?Sized> {
    d: &'a mut D,
    v: &'a mut V,
    req: &'a GenerationRequest,
    sink: &'a mut dyn FnMut(&[u32], Source) -> bool,
    out: Vec<u32>,
    stats: Stats,
    finished: Option<FinishReason>,
    /// Target cache length and pending token.
    cached: usize,
    pending: u32,
    window: usize,
    /// The window of copy rounds while the model rests (see `copy_round`), adapted as `window` is.
    copy_window: usize,
    /// The loop's own random stream (acceptance draws, replacement tokens), seeded from the request.
    rng: StdRng,
    pace: Pace,
    /// The draft model has the prompt (opened up front, or with `adaptive` at the first draft: a request that writes
    /// alone from the start never pays the draft's prefill).
    draft_open: bool,
    /// Worker time charged to the draft's prefill (left out of the rounds' costs, like its wall time).
    draft_prefill_charged: f64,
    /// The draft's charge (less its prefill) already counted in a speculative round's cost.
    draft_booked: f64,
    /// Context tokens the drafter has processed, as of its last draft (0 before it is opened).
    draft_synced: usize,
    /// Prompt tokens the drafter was given to process beside the target's prefill ([`DraftHints::warm`]; 0: none).
    draft_warmed: usize,
}

/// Where a measurement of cost starts (see [`Run::spent`]).
#[derive(Clone, Copy)]
struct Mark {
    at: Instant,
    prefill_ms: f64,
    charged: Option<f64>,
    draft_prefill_charged: f64,
}

impl<D: Drafter + ?Sized, V: Verifier + ?Sized> Run<'_, D, V> {
    fn remaining(&self) -> usize {
        self.req.max_new_tokens - self.out.len()
    }

    fn mark(&self) -> Mark {
        Mark {
            at: Instant::now(),
            prefill_ms: self.stats.prefill_ms,
            charged: self.v.charged_ms(),
            draft_prefill_charged: self.draft_prefill_charged,
        }
    }

    /// What the prefills left out of [`Run::spent`] since `m` cost (the draft's first prefill, where a round opened
    /// the draft): no part of a round's rate, but part of what a probe round lost.
    fn setup(&self, m: Mark) -> Spent {
        Spent {
            wall_ms: self.stats.prefill_ms - m.prefill_ms,
            charged_ms: m
                .charged
                .map(|_| self.draft_prefill_charged - m.draft_prefill_charged),
        }
    }

    /// What was spent since `m`: wall time less prefills (a draft's first prefill is not a cost of the round that
    /// happens to open it), and the verifier's worker time charged (`None` where it charges nothing: in process).
    /// The cost of the target writing alone, or of a verification.
    fn spent(&self, m: Mark) -> Spent {
        Spent {
            wall_ms: ms(m.at) - (self.stats.prefill_ms - m.prefill_ms),
            charged_ms: match (m.charged, self.v.charged_ms()) {
                (Some(a), Some(b)) => Some((b - a).max(0.0)),
                _ => None,
            },
        }
    }

    /// What a speculative round since `m` spent: [`Run::spent`] and all the drafter charged (less its prefill) that
    /// no round counted yet. A draft worker's charges can come in while the target writes alone (a draft read
    /// ahead, then dropped by a pause): they are speculation's cost, and counted as the target's they made writing
    /// alone look dearer than it is. A drafter that charges nothing (n-grams in the router) counts as free.
    fn spent_round(&mut self, m: Mark) -> Spent {
        let mut spent = self.spent(m);
        let drafted = self.d.charged_ms().unwrap_or(0.0) - self.draft_prefill_charged;
        if let Some(c) = spent.charged_ms.as_mut() {
            *c += (drafted - self.draft_booked).max(0.0);
        }
        self.draft_booked = self.draft_booked.max(drafted);
        spent
    }

    /// Appends output up to an end token or the budget; returns how many tokens were taken.
    fn emit(&mut self, tokens: &[u32], source: Source) -> usize {
        let mut taken = 0;
        for &t in tokens {
            if self.finished.is_some() {
                break;
            }
            if self.req.eos.contains(&t) {
                self.finished = Some(FinishReason::Eos);
                break;
            }
            self.out.push(t);
            taken += 1;
            if self.out.len() >= self.req.max_new_tokens {
                self.finished = Some(FinishReason::Length);
            }
        }
        if taken > 0
            && !(self.sink)(&self.out[self.out.len() - taken..], source)
            && self.finished.is_none()
        {
            self.finished = Some(FinishReason::Stop);
        }
        taken
    }

    fn context(&self) -> Vec<u32> {
        let mut c = self.req.prompt.clone();
        c.extend(&self.out);
        c
    }

    fn open_target(&mut self) -> Result<()> {
        let t = Instant::now();
        self.stats.cached_prompt_tokens =
            self.v
                .open(&self.req.session, &self.req.prompt, &self.req.sampling)?;
        self.stats.prefill_ms += ms(t);
        self.cached = self.req.prompt.len() - 1;
        self.pending = *self
            .req
            .prompt
            .last()
            .ok_or_else(|| Error::invalid("empty prompt"))?;
        Ok(())
    }

    fn extend(&mut self, max: usize, segment: Option<&SegmenterConfig>) -> Result<()> {
        let t = Instant::now();
        let ext = self
            .v
            .extend(&self.req.session, self.pending, max, segment)?;
        self.stats.extend_ms += ms(t);
        let n = ext.tokens.len();
        if n == 0 {
            return Err(Error::internal("verifier extended by no token"));
        }
        self.stats.extend_passes += n;
        self.stats.target_positions += n;
        self.cached += n;
        self.pending = ext.tokens[n - 1];
        self.emit(&ext.tokens, Source::Target);
        Ok(())
    }

    /// The request's first token, by the target alone right after its prefill (its own choice, greedy or sampled,
    /// as in `target` mode), in `token-spec` and paced PARSE modes too: there a first round would hold the first
    /// text back until a draft was written and verified (and, in process, until the draft's prefill), where
    /// `target` mode sends it after one step. The drafter then begins from the context that ends with it. Its time
    /// is no figure of the pace, as in `target` mode (the first step runs with the prefills of the requests that
    /// arrived with this one). So the first token comes as soon as it would in `target` mode.
    fn first_token(&mut self) -> Result<()> {
        if self.finished.is_none() && self.out.is_empty() {
            self.extend(1, None)?;
        }
        Ok(())
    }

    fn run_target(&mut self) -> Result<()> {
        self.open_target()?;
        while self.finished.is_none() {
            // The first token on its own, so that its text goes out after one step (time to first token); then
            // up to 16 per call.
            let first = self.out.is_empty();
            let n = if first { 1 } else { 16 };
            let (m, before) = (self.mark(), self.out.len());
            self.extend(self.remaining().min(n), None)?;
            // The target's speed for the others' pace; not the first step, which runs with the prefills of the
            // requests that arrived with this one and says little about writing on.
            if !first {
                self.pace
                    .target_wrote(self.spent(m), self.out.len() - before);
            }
        }
        Ok(())
    }

    /// Prompt processing on the draft side counts as prefill, like the target's: later drafts extend it. A request
    /// that wrote alone before its first draft has the draft process its whole context here (prompt and output so
    /// far), so that all of the catching up is measured as the draft's prefill: no part of the round's rate, part of
    /// what a probe costs, and the price per token by which later catch-ups are judged ([`Pace::position`]).
    fn open_draft(&mut self, sampling: &SamplingParams) -> Result<()> {
        let (t, charged) = (Instant::now(), self.d.charged_ms());
        let context = self.context();
        self.d.begin(&self.req.session, &context, sampling)?;
        let wall_ms = ms(t);
        self.stats.prefill_ms += wall_ms;
        let charged_ms = charged.zip(self.d.charged_ms()).map(|(a, b)| b - a);
        if let Some(c) = charged_ms {
            self.draft_prefill_charged += c;
        }
        self.draft_open = true;
        self.draft_synced = context.len();
        // A prefill made beside the target's was waited for only in part: its wall time is no price of catching up.
        if self.draft_warmed == 0 {
            self.pace.draft_opened(
                Spent {
                    wall_ms,
                    charged_ms,
                },
                context.len(),
            );
        }
        Ok(())
    }

    /// The pace's advice, given where the request stands ([`Pace::position`]).
    fn advise(&mut self) -> Advice {
        self.position();
        self.pace.advise()
    }

    /// [`Pace::advise_token_round`] for a token-level round of up to `max` tokens.
    fn advise_token_round(&mut self, max: usize) -> Advice {
        self.position();
        self.pace.advise_token_round(max)
    }

    fn position(&mut self) {
        let synced = self.draft_synced.max(self.draft_warmed);
        let lag = (self.req.prompt.len() + self.out.len()).saturating_sub(synced);
        self.pace.position(self.out.len(), self.remaining(), lag);
    }

    /// Before the target's prefill: where the request will most likely draft from its start (always without
    /// `adaptive`; with it, where the shared figures at the current load say its speculation pays or have nothing
    /// to say yet, [`Pace::leans_to_speculate`]), the drafter may process the prompt beside the target
    /// ([`DraftHints::warm`]: a draft worker on its own machine), so that the first round does not wait for the
    /// draft's prefill after the target's. The pace's advice itself is taken where it was, after the target's
    /// prefill.
    fn warm_draft(&mut self) -> Result<()> {
        // Sampled token-level speculation is never paced (a pause would change the random draws it uses).
        let paced = self.req.window.adaptive
            && (self.req.mode != Mode::TokenSpec || self.req.sampling.is_greedy());
        if paced && !self.pace.leans_to_speculate() {
            return Ok(());
        }
        let sampling = self.draft_sampling();
        if self
            .d
            .warm(&self.req.session, &self.req.prompt, &sampling)?
        {
            self.draft_warmed = self.req.prompt.len();
        }
        Ok(())
    }

    /// How the draft samples in speculative modes: like the request in stochastic token-spec, greedily otherwise.
    /// Sampled, the draft draws from a stream of its own: seeded as the target's, its draws would repeat the
    /// target's uniforms one for one (the target's first token and the draft's first draw after it from one
    /// uniform), so its proposals would depend on the target's tokens, where exact speculative sampling needs them
    /// drawn from the draft's distribution alone (`tests/speculative_sampling.rs` saw the second token off by a
    /// chi-square of 1,312 against a limit of 18.5).
    fn draft_sampling(&self) -> SamplingParams {
        if self.req.mode == Mode::TokenSpec {
            SamplingParams {
                seed: self.req.sampling.seed ^ DRAFT_SEED,
                ..self.req.sampling.clone()
            }
        } else {
            // Greedy, in the request's prefix-cache namespace.
            SamplingParams {
                cache_salt: self.req.sampling.cache_salt,
                ..SamplingParams::default()
            }
        }
    }

    fn run_draft(&mut self) -> Result<()> {
        let sampling = self.req.sampling.clone();
        self.open_draft(&sampling)?;
        while self.finished.is_none() {
            let t = Instant::now();
            let chunk = self.d.next(&self.req.session, self.remaining().min(16))?;
            self.stats.draft_ms += ms(t);
            self.stats.draft_tokens_proposed += chunk.tokens.len();
            let taken = self.emit(&chunk.tokens, Source::Draft);
            self.stats.draft_tokens_accepted += taken;
            if self.finished.is_none() && (chunk.done || chunk.tokens.is_empty()) {
                self.finished = Some(FinishReason::Length);
            }
        }
        Ok(())
    }

    /// Drafts for one verification: `(tokens, boundaries)`. In segment mode it pulls until `window` segments are
    /// closed, the draft ends, or a length cap is hit (the window's `max_tokens`, and `tokens`); otherwise it takes
    /// `tokens` tokens.
    fn draft(
        &mut self,
        segments: Option<usize>,
        tokens: usize,
    ) -> Result<(Vec<u32>, Vec<usize>, Vec<f32>)> {
        let cap = self.remaining().min(match segments {
            Some(_) => self.req.window.max_tokens.min(tokens),
            None => tokens,
        });
        let sampling = self.draft_sampling();
        if !self.draft_open {
            self.open_draft(&sampling)?;
        }
        let t = Instant::now();
        let context = self.context();
        self.d.begin(&self.req.session, &context, &sampling)?;
        self.draft_synced = context.len();
        let (draft, pieces, mut probs) = self.pull(segments, cap, |run, want| {
            run.d.next(&run.req.session, want)
        })?;
        self.stats.draft_ms += ms(t);
        if !sampling.is_greedy() && probs.len() < draft.len() {
            return Err(Error::internal(
                "the drafter returned no probabilities for sampled tokens",
            ));
        }
        probs.truncate(draft.len());
        let bs = match segments {
            Some(_) => segmenter::boundaries(&pieces, &self.req.segmenter),
            None => vec![draft.len()],
        };
        Ok((draft, bs, probs))
    }

    /// Pulls draft chunks from `next` (asked for at most the tokens wanted) until `segments` segments are closed
    /// (8 tokens per call then), the chunks end (`done` or empty), or `cap` tokens are drafted; cut at the last
    /// closed segment's end and at `cap`: (tokens, their texts, their probabilities as given).
    fn pull(
        &mut self,
        segments: Option<usize>,
        cap: usize,
        mut next: impl FnMut(&mut Self, usize) -> Result<DraftChunk>,
    ) -> Result<(Vec<u32>, Vec<String>, Vec<f32>)> {
        let mut draft = Vec::new();
        let mut pieces: Vec<String> = Vec::new();
        let mut probs: Vec<f32> = Vec::new();
        let mut done = false;
        let mut cut = None;
        while cut.is_none() && !done && draft.len() < cap {
            let want = match segments {
                Some(_) => (cap - draft.len()).min(8),
                None => cap - draft.len(),
            };
            let chunk = next(self, want)?;
            done = chunk.done || chunk.tokens.is_empty();
            draft.extend(chunk.tokens);
            pieces.extend(chunk.pieces);
            probs.extend(chunk.probs);
            if let Some(w) = segments {
                let closed = segmenter::closed_boundaries(&pieces, &self.req.segmenter);
                if closed.len() >= w {
                    cut = Some(closed[w - 1]);
                }
            }
        }
        if let Some(c) = cut {
            draft.truncate(c);
            pieces.truncate(c);
        }
        draft.truncate(cap);
        pieces.truncate(cap);
        Ok((draft, pieces, probs))
    }

    /// One verification of `draft`; applies the result. Returns (accepted, fully accepted).
    fn verify(
        &mut self,
        draft: &[u32],
        boundaries: &[usize],
        exact_only: bool,
        bonus: bool,
    ) -> Result<(usize, bool)> {
        let l = draft.len();
        let judge = !exact_only && self.req.policy.verdict == crate::policy::Verdict::Judge;
        let suffix = judge.then_some(self.req.judge_suffix.as_slice());
        // Scores only where the verdict reads them: token-level rounds agree exactly or not, `relative` and
        // `entropy` read only the rows whose greedy token is not the draft's.
        let scoring = match self.req.policy.verdict {
            _ if exact_only => Scoring::Greedy,
            Verdict::Relative | Verdict::Entropy => Scoring::Mismatches,
            Verdict::Likelihood | Verdict::Judge => Scoring::All,
        };
        let plan = VerifyPlan::build(self.cached, self.pending, draft, boundaries, suffix)?
            .with_scoring(scoring);
        let t = Instant::now();
        let out = self.v.verify(&self.req.session, &plan)?;
        self.stats.verify_ms += ms(t);
        self.stats.verify_passes += 1;
        self.stats.target_positions += plan.tokens.len();
        self.stats.draft_tokens_proposed += l;
        self.stats.segments_proposed += boundaries.len();
        let policy = if exact_only {
            // Token-level rounds carry no suffix: exact agreement only, whatever the request's verdict.
            AcceptPolicy {
                verdict: crate::policy::Verdict::Likelihood,
                tau: f32::INFINITY,
                exact_floor: true,
                ..Default::default()
            }
        } else {
            self.req.policy
        };
        let acc = decide(&plan, &out, &policy)?;
        let a = acc.accepted;
        let next = out.rows[a].argmax;
        self.accept(draft, boundaries, a, (bonus || a < l).then_some(next))
    }

    /// Applies a verification: keeps `a` draft tokens and, with `next`, the target's token after them.
    fn accept(
        &mut self,
        draft: &[u32],
        boundaries: &[usize],
        a: usize,
        next: Option<u32>,
    ) -> Result<(usize, bool)> {
        let l = draft.len();
        self.stats.draft_tokens_accepted += a;
        self.stats.segments_accepted += boundaries.iter().take_while(|b| **b <= a).count();
        count_positions(&mut self.stats.proposed_by_position, l);
        count_positions(&mut self.stats.accepted_by_position, a);
        let full = a == l;
        let Some(next) = next else {
            // Keep pending and d_0..d_{L-2}; d_{L-1} becomes pending.
            self.v.truncate(&self.req.session, self.cached + l)?;
            self.cached += l;
            self.pending = draft[l - 1];
            self.emit(draft, Source::Draft);
            return Ok((a, full));
        };
        // The target's own token at the cut (a correction, or the bonus after a full acceptance).
        self.v.truncate(&self.req.session, self.cached + 1 + a)?;
        self.cached += 1 + a;
        self.pending = next;
        self.emit(&draft[..a], Source::Draft);
        self.emit(&[next], Source::Target);
        Ok((a, full))
    }

    /// One round of lossless speculative sampling over `draft` (see `speculative`).
    fn verify_sampled(&mut self, draft: &[u32], probs: &[f32]) -> Result<()> {
        let l = draft.len();
        let uniforms = (0..l).map(|_| self.rng.random::<f32>()).collect();
        let plan = VerifyPlan::build(self.cached, self.pending, draft, &[l], None)?
            // Acceptance comes from the sample check alone.
            .with_scoring(Scoring::Greedy)
            .with_sample_check(SampleCheck {
                draft_probs: probs.to_vec(),
                uniforms,
            })?;
        let t = Instant::now();
        let out = self.v.verify(&self.req.session, &plan)?;
        self.stats.verify_ms += ms(t);
        self.stats.verify_passes += 1;
        self.stats.target_positions += plan.tokens.len();
        self.stats.draft_tokens_proposed += l;
        self.stats.segments_proposed += 1;
        let s = out
            .sampled
            .ok_or_else(|| Error::internal("the verifier ignored the sample check"))?;
        if s.accepted > l {
            return Err(Error::internal(format!(
                "the verifier accepted {} of {l} draft tokens",
                s.accepted
            )));
        }
        let u = self.rng.random::<f64>();
        let next = if s.accepted < l {
            let t = Instant::now();
            let q = self.d.distribution(&self.req.session, s.accepted)?;
            self.stats.draft_ms += ms(t);
            speculative::sample_residual(&s.dist, &q, u)?
        } else {
            speculative::sample_from(&s.dist, u)?
        };
        self.accept(draft, &[l], s.accepted, Some(next))?;
        Ok(())
    }
}

/// Up to `max` tokens by prompt lookup, each the one after the latest earlier occurrence of `context`'s end (which
/// grows by each), stopping where nothing matches and after an end token: (tokens, the copy can go no further).
fn copy_tokens(
    context: &mut Vec<u32>,
    lookup: &crate::lookup::NgramConfig,
    max: usize,
    eos: &[u32],
) -> (Vec<u32>, bool) {
    let mut tokens = Vec::new();
    while tokens.len() < max {
        let Some(token) = crate::lookup::lookup(context, lookup) else {
            return (tokens, true);
        };
        context.push(token);
        tokens.push(token);
        if eos.contains(&token) {
            return (tokens, true);
        }
    }
    (tokens, false)
}

/// The span of one speculation round; `drafted`, `segments` and `accepted` are recorded as they are known.
fn round_span(round: usize) -> tracing::Span {
    tracing::info_span!(
        "round",
        round,
        drafted = tracing::field::Empty,
        segments = tracing::field::Empty,
        accepted = tracing::field::Empty,
    )
}

/// What the loop's own uniforms (acceptance tests, residual draws) and the draft's draws are seeded with, each the
/// request's seed xor its constant, so that neither stream repeats the target's (seeded with the request's seed).
const LOOP_SEED: u64 = 0x5041_5253_455f_5350;
const DRAFT_SEED: u64 = 0x5041_5253_455f_4452;

/// Generates one request. `sink` receives output as it is accepted and returns `false` to stop generation. Every
/// session the loop opened is released before it returns, also on error.
pub fn generate<D: Drafter + ?Sized, V: Verifier + ?Sized>(
    drafter: &mut D,
    verifier: &mut V,
    req: &GenerationRequest,
    sink: &mut dyn FnMut(&[u32], Source) -> bool,
) -> Result<Outcome> {
    generate_paced(
        drafter,
        verifier,
        req,
        sink,
        Pacing::alone(req.mode.as_str()),
    )
}

/// [`generate`], judging whether speculation pays ([`DraftWindow::adaptive`]) with the figures of `pacing` (shared
/// by the requests of one pool of workers), and reporting its own to them.
pub fn generate_paced<D: Drafter + ?Sized, V: Verifier + ?Sized>(
    drafter: &mut D,
    verifier: &mut V,
    req: &GenerationRequest,
    sink: &mut dyn FnMut(&[u32], Source) -> bool,
    pacing: Pacing,
) -> Result<Outcome> {
    req.validate()?;
    let start = Instant::now();
    let mut run = Run {
        d: drafter,
        v: verifier,
        req,
        sink,
        out: Vec::new(),
        stats: Stats {
            mode: req.mode.as_str().to_string(),
            prompt_tokens: req.prompt.len(),
            ..Default::default()
        },
        finished: None,
        cached: 0,
        pending: 0,
        window: req.window.initial_segments,
        copy_window: req.window.initial_segments,
        // A stream of its own, apart from the target's sampler (the request's seed) and a sampled draft's
        // (`DRAFT_SEED`).
        rng: StdRng::seed_from_u64(req.sampling.seed ^ LOOP_SEED),
        pace: Pace::new(pacing),
        draft_open: false,
        draft_prefill_charged: 0.0,
        draft_booked: 0.0,
        draft_synced: 0,
        draft_warmed: 0,
    };
    let result = match req.mode {
        Mode::Target => run.run_target(),
        Mode::Draft => run.run_draft(),
        Mode::TokenSpec => run.run_token_spec(),
        Mode::Parse | Mode::ParseTokenSpec => run.run_parse(),
    };
    let uses_target = req.mode != Mode::Draft;
    let uses_draft = req.mode != Mode::Target;
    let released_v = if uses_target {
        run.v.release(&req.session)
    } else {
        Ok(())
    };
    let released_d = if uses_draft {
        run.d.release(&req.session)
    } else {
        Ok(())
    };
    result?;
    released_v?;
    released_d?;
    run.pace.finished(run.out.len());
    let mut stats = run.stats;
    stats.paused_tokens = run.pace.paused_tokens;
    stats.entries_declined = run.pace.entries_declined;
    stats.pauses = run.pace.pauses;
    stats.target_passes = stats.verify_passes + stats.extend_passes;
    stats.total_ms = ms(start);
    stats.set_output(run.out.len());
    Ok(Outcome {
        tokens: run.out,
        finish_reason: run.finished.unwrap_or(FinishReason::Length),
        stats,
    })
}

/// Runs `req` with the models its mode uses (`target` needs no drafter, `draft` no verifier): the one place that
/// stands in for a model a mode does not need, and refuses a mode whose model is missing.
pub fn generate_with(
    drafter: Option<&mut dyn Drafter>,
    verifier: Option<&mut dyn Verifier>,
    req: &GenerationRequest,
    sink: &mut dyn FnMut(&[u32], Source) -> bool,
) -> Result<Outcome> {
    let missing = |what: &str| {
        Error::invalid(format!(
            "mode {} needs a {what} model and none is loaded",
            req.mode.as_str()
        ))
    };
    match (drafter, verifier) {
        (Some(d), Some(v)) => generate(d, v, req, sink),
        (None, Some(v)) if req.mode == Mode::Target => generate(&mut NoDrafter, v, req, sink),
        (Some(d), None) if req.mode == Mode::Draft => generate(d, &mut NoVerifier, req, sink),
        (None, _) => Err(missing("draft")),
        (_, None) => Err(missing("target")),
    }
}
