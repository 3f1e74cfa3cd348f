//! What a request reports: where each token came from, why it finished, and its figures.

use serde::{Deserialize, Serialize};

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
    /// PARSE rounds of copies (prompt lookup) made while the draft model rested ([`DraftHints::rest_lookup`]).
    pub copy_rounds: usize,
    /// Token-level rounds a `parse+token-spec` request made in place of PARSE rounds, where those measured faster at
    /// the load of the moment ([`crate::pace::Pace::choose_rounds`]).
    #[serde(default)]
    pub token_rounds: usize,
    /// One-token guesses verified where the drafter proposed nothing ([`DraftHints::guess_lookup`]), and those the
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
    pub(super) fn set_output(&mut self, tokens: usize) {
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
