//! What a request asks for: its mode, sampling, draft window and limits.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::policy::AcceptPolicy;
use crate::segmenter::SegmenterConfig;

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
