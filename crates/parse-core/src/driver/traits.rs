//! The two sides the loop drives: [`Drafter`] and [`Verifier`], and the stand-ins for modes that need only one.

use crate::error::{Error, Result};
use crate::plan::VerifyPlan;
use crate::policy::VerifyOutput;
use crate::segmenter::SegmenterConfig;

use super::*;

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

/// Writes drafts. The hints the loop gives and reads besides are [`DraftHints`].
pub trait Drafter: DraftHints {
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
}

/// What a drafter may tell the loop or be told by it beyond drafting: hints of work it may start early (on its own
/// machine, while the target works), the worker time it was charged, and the lookups of a drafter that copies. None
/// changes what [`Drafter::begin`] and [`Drafter::next`] return, and every one has a default that does nothing, so a
/// drafter that needs none implements this trait empty.
pub trait DraftHints {
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
    /// Unlike [`prefetch`](DraftHints::prefetch) the guess misses whenever the draft and the target disagree on that
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
    fn rest_lookup(&self) -> Option<crate::lookup::NgramConfig> {
        None
    }
    /// The lookup of one-token guesses ([`crate::pace::Costs::guess_pays`]) for a drafter that drafts by prompt
    /// lookup from longer matches only: where its draft is empty, a token-level round may have the target verify the
    /// token this lookup finds instead of writing alone. `None`: no guesses.
    fn guess_lookup(&self) -> Option<crate::lookup::NgramConfig> {
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
}

impl<D: Drafter + ?Sized> DraftHints for &mut D {
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
    fn rest_lookup(&self) -> Option<crate::lookup::NgramConfig> {
        (**self).rest_lookup()
    }
    fn guess_lookup(&self) -> Option<crate::lookup::NgramConfig> {
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

impl DraftHints for NoDrafter {}

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
