//! The generation loop, written once against the [`Drafter`] and [`Verifier`] traits (in-process engines or gRPC
//! clients), for every mode.
//!
//! Target session convention (see `plan`): the cache holds the context except its last token, the **pending** one.
//!
//! One PARSE round: draft a few segments continuing the accepted context (the window adapts: doubled after a fully
//! accepted draft, halved after a rejection, so the draft never runs far past a likely rejection); verify them in one
//! pass; keep the accepted prefix; if the draft was cut short, take the target's own token at the cut (free from the
//! pass) and let the target extend to the end of that segment (in `parse+token-spec` by token-level speculation);
//! then draft again.

use std::time::Instant;

use rand::{Rng, SeedableRng, rngs::StdRng};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::pace::{Advice, Pace, Pacing, Rounds, Spent};
use crate::plan::{Scoring, VerifyPlan};
use crate::policy::{AcceptPolicy, Verdict, VerifyOutput, decide};
use crate::segmenter::{self, SegmenterConfig};
use crate::speculative::{self, SampleCheck};

/// Under load (more than one request), a copy round in a pause of the draft model starts only where the context's
/// last this many tokens occurred earlier: the draft's own copies' minimum ([`crate::copy_first::CopyConfig`]).
/// There every verification row is paid for in a batched pass, so copies of a phrase met again, cut short after a few
/// tokens, cost more rows than they save. At one request rows are cheap next to a step, and the short matches stay.
pub const LOADED_COPY_MATCH: usize = 5;

/// Sampling settings of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
    /// The namespace of the workers' prefix caches for this request: a request reuses the keys and values of
    /// earlier prompts only where they were kept under the same value (0 unless set), as vLLM's `cache_salt`, so
    /// tenants that must not learn of each other's prompts from their timing, or benchmark cells that must not
    /// inherit each other's prompts, each set their own. It never changes the output.
    #[serde(default)]
    pub cache_salt: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            cache_salt: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::invalid(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(Error::invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Generation mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Mode {
    /// The target alone.
    #[serde(rename = "target")]
    Target,
    /// The draft alone.
    #[serde(rename = "draft")]
    Draft,
    /// Classic draft-model speculative decoding: greedy verification, or lossless speculative sampling at
    /// temperature > 0.
    #[serde(rename = "token-spec")]
    TokenSpec,
    /// Parallel prefix verification of whole segments.
    #[serde(rename = "parse")]
    Parse,
    /// PARSE whose extend steps use token-level speculation.
    #[serde(rename = "parse+token-spec")]
    #[cfg_attr(feature = "clap", value(name = "parse+token-spec"))]
    ParseTokenSpec,
}

impl Mode {
    /// The project's default mode, wherever a request leaves the mode out (the router, the OpenAI API, `parsectl
    /// generate`): PARSE with token-level speculation in its extend steps, which keeps the target's quality on the
    /// development sets and writes faster than the target alone on code (docs/decisions/default-mode.md).
    pub const DEFAULT: Mode = Mode::ParseTokenSpec;

    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Target => "target",
            Mode::Draft => "draft",
            Mode::TokenSpec => "token-spec",
            Mode::Parse => "parse",
            Mode::ParseTokenSpec => "parse+token-spec",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "target" => Ok(Mode::Target),
            "draft" => Ok(Mode::Draft),
            "token-spec" => Ok(Mode::TokenSpec),
            "parse" => Ok(Mode::Parse),
            "parse+token-spec" => Ok(Mode::ParseTokenSpec),
            other => Err(Error::invalid(format!(
                "unknown mode `{other}` (target, draft, token-spec, parse, parse+token-spec)"
            ))),
        }
    }
}

/// How much to draft before verifying.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftWindow {
    /// Segments per verification at the start of a request.
    pub initial_segments: usize,
    /// Upper bound of the adaptive window.
    pub max_segments: usize,
    /// Tokens per verification at most.
    pub max_tokens: usize,
    /// Draft tokens per round of token-level speculation (with `adaptive`, in greedy `token-spec` rounds, the most:
    /// a round drafts as far as pays by the acceptance and costs measured, [`crate::pace::Costs::draft_length`]).
    pub token_spec_tokens: usize,
    /// Let the target write alone while speculation writes tokens more slowly than the target would at the current
    /// load ([`Pace`]): greedy `token-spec` rounds and whole PARSE rounds; and draft only as far as pays in greedy
    /// `token-spec` rounds (above). In `token-spec` it changes how the
    /// target's tokens are found, never which (greedy token-level speculation is lossless). In the PARSE modes the
    /// tokens written in a pause are the target's own greedy tokens where a PARSE round might have kept draft
    /// segments the verdict judged good: the output then depends on measured times, so it can differ run to run and
    /// with the load, never falling below what the target writes. The token-level rounds inside a PARSE round's
    /// extension are not paused (see `extend_segment`). Off by default in the library, so that its figures are
    /// reproducible; the router turns it on.
    #[serde(default)]
    pub adaptive: bool,
}

impl Default for DraftWindow {
    fn default() -> Self {
        DraftWindow {
            initial_segments: 2,
            max_segments: 8,
            max_tokens: 128,
            token_spec_tokens: 6,
            adaptive: false,
        }
    }
}

/// One request to the loop.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Session id on the workers.
    pub session: String,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub mode: Mode,
    pub sampling: SamplingParams,
    pub policy: AcceptPolicy,
    pub segmenter: SegmenterConfig,
    pub window: DraftWindow,
    /// Tokens that end generation.
    pub eos: Vec<u32>,
    /// The judge's verification suffix (needed by the judge verdict).
    pub judge_suffix: Vec<u32>,
}

impl GenerationRequest {
    pub fn validate(&self) -> Result<()> {
        if self.prompt.is_empty() {
            return Err(Error::invalid("empty prompt"));
        }
        if self.max_new_tokens == 0 {
            return Err(Error::invalid("max_new_tokens must be at least 1"));
        }
        self.sampling.validate()?;
        self.policy.validate()?;
        self.segmenter.validate()?;
        let w = &self.window;
        if w.initial_segments == 0
            || w.max_segments < w.initial_segments
            || w.max_tokens == 0
            || w.token_spec_tokens == 0
        {
            return Err(Error::invalid(
                "draft window sizes must be positive, initial <= max",
            ));
        }
        let speculative = matches!(
            self.mode,
            Mode::TokenSpec | Mode::Parse | Mode::ParseTokenSpec
        );
        // PARSE accepts by a quality verdict, not by a distribution-preserving test: sampling there would have no
        // defined output distribution, so those modes decode greedily. token-spec samples losslessly.
        if speculative && self.mode != Mode::TokenSpec && !self.sampling.is_greedy() {
            return Err(Error::invalid(format!(
                "mode {} decodes greedily (temperature 0); use token-spec or target to sample",
                self.mode.as_str()
            )));
        }
        if matches!(self.mode, Mode::Parse | Mode::ParseTokenSpec)
            && self.policy.verdict == crate::policy::Verdict::Judge
            && self.judge_suffix.is_empty()
        {
            return Err(Error::invalid(
                "the judge verdict needs a verification suffix",
            ));
        }
        Ok(())
    }
}

/// A chunk of draft tokens with their texts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftChunk {
    pub tokens: Vec<u32>,
    pub pieces: Vec<String>,
    /// Each token's probability under the sampling distribution it was drawn from (empty when greedy).
    pub probs: Vec<f32>,
    /// The draft ended (end token produced, or no room left in the draft model's context).
    pub done: bool,
}

/// Writes drafts.
pub trait Drafter {
    /// Starts a draft continuing `context` (the prompt and every output token so far).
    fn begin(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<()>;
    /// Up to `max` further draft tokens; stops after an end token. Empty with `done` when the draft has ended.
    fn next(&mut self, session: &str, max: usize) -> Result<DraftChunk>;
    /// The sampling distribution (`(token, probability)`, probabilities > 0) that the `index`-th token since the
    /// last `begin` was drawn from; only asked for in stochastic token-level speculation.
    fn distribution(&mut self, session: &str, index: usize) -> Result<Vec<(u32, f32)>>;
    /// Texts of tokens (the draft and target share a tokenizer in token-level modes).
    fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>>;
    fn release(&mut self, session: &str) -> Result<()>;
    /// A hint, given before a verification: the next `begin` is likely to continue `context` (the draft just
    /// written, if it is accepted whole), with `sampling`, for about `tokens` tokens. A drafter on its own machine
    /// may start writing it now, while the target verifies; a later `begin` with another context must discard that
    /// work. It must not change what `begin`/`next` return. In process it does nothing.
    fn prefetch(
        &mut self,
        _session: &str,
        _context: &[u32],
        _sampling: &SamplingParams,
        _tokens: usize,
    ) -> Result<()> {
        Ok(())
    }
    /// A hint, given before a token-level verification of a greedy draft that ends `context`: the next `begin` is
    /// likely to continue `context` and one token more, the target's own after the draft, for about `tokens`
    /// tokens after that one. A drafter with compute of its own (a draft worker on another machine or core) may
    /// draft on from `context` now, while the target verifies; its first token is its guess of the target's, and
    /// a `begin` whose context is `context` and that token may take the rest. Any other `begin` discards the work.
    /// Unlike [`prefetch`](Drafter::prefetch) the guess misses whenever the draft and the target disagree on that
    /// token, so a drafter that shares its compute with the target should ignore it. It must not change what
    /// `begin`/`next` return. In process it does nothing.
    fn prefetch_guessing(
        &mut self,
        _session: &str,
        _context: &[u32],
        _sampling: &SamplingParams,
        _tokens: usize,
    ) -> Result<()> {
        Ok(())
    }
    /// A hint, given before the target processes the prompt: the first `begin` will most likely continue
    /// `context` (the prompt) with `sampling`. A drafter on its own machine may process it now, beside the target,
    /// so that the first `begin` finds it done instead of making the request wait for it. Returns whether it
    /// started that work. It must not change what `begin`/`next` return. In process it does nothing.
    fn warm(
        &mut self,
        _session: &str,
        _context: &[u32],
        _sampling: &SamplingParams,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Worker time charged to this drafter's work so far, in ms (see [`Verifier::charged_ms`]); `None` where it is
    /// not measured.
    fn charged_ms(&self) -> Option<f64> {
        None
    }
    /// The prompt lookup a drafter that copies as well as runs a model ([`CopyFirst`](crate::CopyFirst)) lets the
    /// loop use on its own while the model rests (a pause of [`DraftWindow::adaptive`] speculation): copy rounds,
    /// which cost the target's verification and no model step. `None`: the drafter copies nothing, or copies only
    /// (then its own rounds are the copies).
    fn rest_lookup(&self) -> Option<crate::ngram::NgramConfig> {
        None
    }
    /// The lookup of one-token guesses ([`crate::pace::Costs::guess_pays`]) for a drafter that drafts by prompt
    /// lookup from longer matches only: where its draft is empty, a token-level round may have the target verify the
    /// token this lookup finds instead of writing alone. `None`: no guesses.
    fn guess_lookup(&self) -> Option<crate::ngram::NgramConfig> {
        None
    }
    /// For a drafter that copies as well as runs a model ([`CopyFirst`](crate::CopyFirst)): how many tokens of its
    /// drafts the model has written so far; a round in which this does not grow was all copies. `None` for any other
    /// drafter (its tokens are all its model's, or none is).
    fn model_tokens_drafted(&self) -> Option<usize> {
        None
    }
}

/// A borrowed drafter drafts as the one it points to, so a wrapper ([`CopyFirst`](crate::CopyFirst)) can borrow a
/// drafter whose own counters are read afterwards.
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn begin(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<()> {
        (**self).begin(session, context, sampling)
    }
    fn next(&mut self, session: &str, max: usize) -> Result<DraftChunk> {
        (**self).next(session, max)
    }
    fn distribution(&mut self, session: &str, index: usize) -> Result<Vec<(u32, f32)>> {
        (**self).distribution(session, index)
    }
    fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>> {
        (**self).pieces(tokens)
    }
    fn release(&mut self, session: &str) -> Result<()> {
        (**self).release(session)
    }
    fn prefetch(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        (**self).prefetch(session, context, sampling, tokens)
    }
    fn prefetch_guessing(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        (**self).prefetch_guessing(session, context, sampling, tokens)
    }
    fn warm(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<bool> {
        (**self).warm(session, context, sampling)
    }
    fn charged_ms(&self) -> Option<f64> {
        (**self).charged_ms()
    }
    fn rest_lookup(&self) -> Option<crate::ngram::NgramConfig> {
        (**self).rest_lookup()
    }
    fn guess_lookup(&self) -> Option<crate::ngram::NgramConfig> {
        (**self).guess_lookup()
    }
    fn model_tokens_drafted(&self) -> Option<usize> {
        (**self).model_tokens_drafted()
    }
}

/// Tokens a verifier decoded on its own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExtendOutput {
    pub tokens: Vec<u32>,
    pub pieces: Vec<String>,
}

/// Runs the target.
pub trait Verifier {
    /// Opens a session on `prompt`: the cache takes all but its last token, which becomes pending. Returns how many
    /// of those tokens' rows were taken from a prompt kept earlier that begins the same way (prefix caching) rather
    /// than computed: 0 where nothing is kept.
    fn open(&mut self, session: &str, prompt: &[u32], sampling: &SamplingParams) -> Result<usize>;
    /// Runs a plan; the cache then holds its former tokens plus the plan's (truncate afterwards).
    fn verify(&mut self, session: &str, plan: &VerifyPlan) -> Result<VerifyOutput>;
    /// Appends `pending` and decodes up to `max` tokens (at least one), stopping after an end token or, with
    /// `segment`, once the text from `pending` on closes a segment. The last returned token is not in the cache.
    fn extend(
        &mut self,
        session: &str,
        pending: u32,
        max: usize,
        segment: Option<&SegmenterConfig>,
    ) -> Result<ExtendOutput>;
    /// Keeps the first `len` cached tokens.
    fn truncate(&mut self, session: &str, len: usize) -> Result<()>;
    fn release(&mut self, session: &str) -> Result<()>;
    /// Worker time charged to this verifier's work so far, in ms: a worker that runs many requests' blocks in one
    /// pass charges each its share of the pass's time, by rows, so that a request's figure is what it takes from
    /// the pool rather than how long it waited. `None` where it is not measured (in process): wall time stands in.
    fn charged_ms(&self) -> Option<f64> {
        None
    }
}

/// Who wrote a piece of output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Draft,
    Target,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Eos,
    Length,
    /// The caller's sink asked to stop (a stop string, a cancelled client).
    Stop,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// Per-request figures (fields missing from a saved record read as zero).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub mode: String,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub draft_tokens_proposed: usize,
    pub draft_tokens_accepted: usize,
    pub segments_proposed: usize,
    pub segments_accepted: usize,
    /// Target forward passes (prefill excluded): verify + extend.
    pub target_passes: usize,
    pub verify_passes: usize,
    pub extend_passes: usize,
    /// Token positions the target computed (prefill excluded).
    pub target_positions: usize,
    pub target_passes_per_token: f64,
    pub target_positions_per_token: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub extend_ms: f64,
    /// Prompt processing on both models.
    pub prefill_ms: f64,
    pub total_ms: f64,
    /// Output tokens per second of generation after prefill (prefill is the same work in every mode).
    pub tokens_per_s: f64,
    /// Tokens the target wrote alone because speculation was not paying at the load of the moment, and the pauses
    /// that wrote them ([`DraftWindow::adaptive`]).
    pub paused_tokens: usize,
    pub pauses: usize,
    /// Times speculation paid per token at the moment but not for the drafter's catching up first, so the target
    /// went on alone ([`crate::pace::Pace::position`]).
    pub entries_declined: usize,
    /// PARSE rounds of copies (prompt lookup) made while the draft model rested ([`Drafter::rest_lookup`]).
    pub copy_rounds: usize,
    /// Token-level rounds a `parse+token-spec` request made in place of PARSE rounds, where those measured faster at
    /// the load of the moment ([`crate::pace::Pace::choose_rounds`]).
    #[serde(default)]
    pub token_rounds: usize,
    /// One-token guesses verified where the drafter proposed nothing ([`Drafter::guess_lookup`]), and those the
    /// target kept.
    pub guesses: usize,
    pub guesses_right: usize,
    /// Prompt tokens the target took from a prompt kept earlier that begins the same way (prefix caching, in the
    /// request's `cache_salt` namespace) instead of computing them ([`Verifier::open`]).
    pub cached_prompt_tokens: usize,
    /// Per position of a verified draft (0-based): verifications whose draft reached it, and those that kept its
    /// token. Left out of serialized figures.
    #[serde(skip)]
    pub proposed_by_position: Vec<usize>,
    #[serde(skip)]
    pub accepted_by_position: Vec<usize>,
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Output tokens (the end token excluded).
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: Stats,
}

impl Outcome {
    /// The answer ends at a stop string the caller found in it, completed by token `kept - 1`: the loop hands tokens
    /// over by rounds and may have accepted some past it in the same round, or reached its budget or an end token in
    /// that round. The output is cut to its first `kept` tokens, the count and the figures per output token follow,
    /// and the finish reason is `Stop` (the stop string came first); the counts of work (passes, drafted and accepted
    /// tokens) stay, as that work was done.
    pub fn stop_at(&mut self, kept: usize) {
        self.finish_reason = FinishReason::Stop;
        if kept < self.tokens.len() {
            self.tokens.truncate(kept);
            self.stats.set_output(kept);
        }
    }
}

impl Stats {
    /// Sets the output count and the figures per output token (`total_ms` and `prefill_ms` already set).
    fn set_output(&mut self, tokens: usize) {
        self.output_tokens = tokens;
        let per = |n: usize| {
            if tokens > 0 {
                n as f64 / tokens as f64
            } else {
                0.0
            }
        };
        self.target_passes_per_token = per(self.target_passes);
        self.target_positions_per_token = per(self.target_positions);
        let gen_ms = self.total_ms - self.prefill_ms;
        self.tokens_per_s = if gen_ms > 0.0 {
            tokens as f64 / (gen_ms / 1e3)
        } else {
            0.0
        };
    }
}

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
    /// Prompt tokens the drafter was given to process beside the target's prefill ([`Drafter::warm`]; 0: none).
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
    /// ([`Drafter::warm`]: a draft worker on its own machine), so that the first round does not wait for the
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

    fn run_token_spec(&mut self) -> Result<()> {
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
    fn token_round(&mut self, adaptive: bool) -> Result<usize> {
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

    /// The token of a one-token guess ([`Drafter::guess_lookup`]), where the drafter makes them, the request may
    /// write two tokens more, the lookup finds one and guesses pay here ([`Pace::guess_pays`], asked last: while
    /// guesses lose, it lets one place in a few guess, and a place with nothing to guess should not use that turn).
    fn guess(&self) -> Option<u32> {
        let cfg = self.d.guess_lookup()?;
        if self.remaining() < 2 {
            return None;
        }
        crate::ngram::lookup(&self.context(), &cfg).filter(|_| self.pace.guess_pays())
    }

    /// The speculative part of [`Run::token_round`], from `round` (its mark) with `before` tokens written.
    fn speculative_token_round(
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

    fn run_parse(&mut self) -> Result<()> {
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
    fn copy_may_start(&self) -> bool {
        self.pace.level() == 0
            || crate::ngram::lookup_match(
                &self.context(),
                &crate::ngram::NgramConfig {
                    min_n: LOADED_COPY_MATCH,
                    max_n: LOADED_COPY_MATCH,
                },
            )
            .is_some()
    }

    /// A PARSE round of copies while the draft model rests ([`Drafter::rest_lookup`]): the draft is what followed
    /// the latest earlier occurrence of the context's end, token after token, up to the round's window of segments;
    /// the target verifies it by the request's verdict. Where it cuts the copy short, and where nothing matches,
    /// the target writes on to the end of the segment as a request drafting by prompt lookup alone does
    /// ([`Run::extend_segment_copying`]), so that a request whose model rests drafts as the `ngram` drafter would.
    /// Returns (tokens drafted, accepted) of the round's copy. Its tokens count towards the pause as the target's
    /// alone would; the cost of a round that copied goes to the copies' own figure ([`Pace::copied`]), by which the
    /// next copy round is judged ([`Pace::copies_pay`]), that of one that found nothing to copy to the target's
    /// ([`Pace::copied_nothing`]).
    fn copy_round(&mut self, lookup: &crate::ngram::NgramConfig) -> Result<(usize, usize)> {
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
    fn extend_segment_copying(&mut self, lookup: &crate::ngram::NgramConfig) -> Result<()> {
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
    fn extend_segment(&mut self) -> Result<()> {
        // Never paused: a token-level round may run past the segment's end, a paused target would stop at it, and
        // the next PARSE round would start elsewhere (outputs would follow measured times).
        self.write_to_segment_end(|run| run.token_round(false).map(drop))
    }

    /// The target writes on to the end of the current segment: in `parse+token-spec` by token-level rounds (`round`,
    /// called until a segment ends), in `parse` alone.
    fn write_to_segment_end(
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

/// Up to `max` tokens by prompt lookup, each the one after the latest earlier occurrence of `context`'s end (which
/// grows by each), stopping where nothing matches and after an end token: (tokens, the copy can go no further).
fn copy_tokens(
    context: &mut Vec<u32>,
    lookup: &crate::ngram::NgramConfig,
    max: usize,
    eos: &[u32],
) -> (Vec<u32>, bool) {
    let mut tokens = Vec::new();
    while tokens.len() < max {
        let Some(token) = crate::ngram::lookup(context, lookup) else {
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

/// Stands in for the drafter where none is loaded (target mode: never called).
pub struct NoDrafter;

impl Drafter for NoDrafter {
    fn begin(&mut self, _: &str, _: &[u32], _: &SamplingParams) -> Result<()> {
        Err(Error::internal("no draft model loaded"))
    }
    fn next(&mut self, _: &str, _: usize) -> Result<DraftChunk> {
        Err(Error::internal("no draft model loaded"))
    }
    fn distribution(&mut self, _: &str, _: usize) -> Result<Vec<(u32, f32)>> {
        Err(Error::internal("no draft model loaded"))
    }
    fn pieces(&mut self, _: &[u32]) -> Result<Vec<String>> {
        Err(Error::internal("no draft model loaded"))
    }
    fn release(&mut self, _: &str) -> Result<()> {
        Ok(())
    }
}

/// Stands in for the verifier where none is loaded (draft mode: never called).
pub struct NoVerifier;

impl Verifier for NoVerifier {
    fn open(&mut self, _: &str, _: &[u32], _: &SamplingParams) -> Result<usize> {
        Err(Error::internal("no target model loaded"))
    }
    fn verify(&mut self, _: &str, _: &VerifyPlan) -> Result<VerifyOutput> {
        Err(Error::internal("no target model loaded"))
    }
    fn extend(
        &mut self,
        _: &str,
        _: u32,
        _: usize,
        _: Option<&SegmenterConfig>,
    ) -> Result<ExtendOutput> {
        Err(Error::internal("no target model loaded"))
    }
    fn truncate(&mut self, _: &str, _: usize) -> Result<()> {
        Err(Error::internal("no target model loaded"))
    }
    fn release(&mut self, _: &str) -> Result<()> {
        Ok(())
    }
}
