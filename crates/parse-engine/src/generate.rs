//! Plain autoregressive generation on one engine: prefill in chunks, then one token per step, streamed as text
//! deltas, stopping on an end token, a stop string or the token budget.
//!
//! Conventions: the end token itself is not part of the output (`token_ids`, `text`); on a stop string the text is
//! cut before it while `token_ids` keep every token generated; text is released to the stream only once no stop
//! string can still begin inside it.

use std::time::Instant;

use serde::Serialize;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::StreamDecoder;

/// Prompt tokens processed per forward block during prefill.
pub const PREFILL_CHUNK: usize = 256;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end token.
    Eos,
    /// A stop string appeared.
    Stop,
    /// The token budget ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

/// Figures of one generation.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub forward_passes: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub total_ms: f64,
    /// Output tokens per second of decoding (prefill excluded).
    pub decode_tokens_per_s: f64,
}

/// A finished generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Releases text to a stream, holding back any tail that could still turn into a stop string.
#[derive(Debug, Clone)]
pub struct StopFilter {
    stop: Vec<String>,
    text: String,
    sent: usize,
}

impl StopFilter {
    pub fn new(stop: Vec<String>) -> Self {
        StopFilter {
            stop,
            text: String::new(),
            sent: 0,
        }
    }

    /// All text so far (cut before a stop string once one was found).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Adds text; returns (releasable delta, whether a stop string was found).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        self.text.push_str(delta);
        let search_from = self
            .sent
            .saturating_sub(self.stop.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = (0..=search_from)
            .rev()
            .find(|i| self.text.is_char_boundary(*i))
            .unwrap_or(0);
        let hit = self
            .stop
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| i + search_from)
            })
            .min();
        if let Some(cut) = hit {
            self.text.truncate(cut);
            let out = self.text[self.sent.min(cut)..].to_string();
            self.sent = cut;
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stop {
            for l in (1..s.len()).rev() {
                if s.is_char_boundary(l) && self.text.ends_with(&s[..l]) {
                    hold = hold.max(l);
                    break;
                }
            }
        }
        let upto = self.text.len() - hold;
        let out = if upto > self.sent {
            self.text[self.sent..upto].to_string()
        } else {
            String::new()
        };
        self.sent = self.sent.max(upto);
        (out, false)
    }

    /// Releases whatever was held back.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

/// Validates a request against the engine's limits.
pub fn validate(engine: &Engine, req: &GenerateRequest) -> Result<()> {
    if req.prompt_tokens.is_empty() {
        return Err(Error::invalid("empty prompt"));
    }
    if req.max_new_tokens == 0 {
        return Err(Error::invalid("max_new_tokens must be at least 1"));
    }
    req.sampling.validate()?;
    if req.stop.iter().any(|s| s.is_empty()) {
        return Err(Error::invalid("stop strings must not be empty"));
    }
    let limit = engine.model().config().max_context;
    if req.prompt_tokens.len() >= limit {
        return Err(Error::ContextExceeded {
            needed: req.prompt_tokens.len() + 1,
            limit,
        });
    }
    Ok(())
}

/// Generates on a fresh session named `session`, which is released before returning (also on error).
/// `on_delta(text, token_ids)` receives each piece of output as it is released.
pub fn generate(
    engine: &mut Engine,
    session: &str,
    req: &GenerateRequest,
    mut on_delta: impl FnMut(&str, &[u32]),
) -> Result<Generation> {
    validate(engine, req)?;
    engine.open_session(session)?;
    let result = run(engine, session, req, &mut on_delta);
    let released = engine.release(session);
    let generation = result?;
    released?;
    Ok(generation)
}

fn run(
    engine: &mut Engine,
    session: &str,
    req: &GenerateRequest,
    on_delta: &mut dyn FnMut(&str, &[u32]),
) -> Result<Generation> {
    let start = Instant::now();
    let tokenizer = engine.tokenizer().clone();
    let limit = engine.model().config().max_context;
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let mut stats = GenerationStats {
        prompt_tokens: req.prompt_tokens.len(),
        ..Default::default()
    };
    let mut logits = None;
    for chunk in req.prompt_tokens.chunks(PREFILL_CHUNK) {
        logits = Some(engine.forward_causal(session, chunk, &[chunk.len() - 1])?);
        stats.forward_passes += 1;
    }
    stats.prefill_ms = start.elapsed().as_secs_f64() * 1e3;
    let decode_start = Instant::now();
    let mut logits = logits.ok_or_else(|| Error::invalid("empty prompt"))?;
    let mut decoder = StreamDecoder::new();
    let mut filter = StopFilter::new(req.stop.clone());
    let mut token_ids = Vec::new();
    let mut pending_ids: Vec<u32> = Vec::new();
    let finish = loop {
        let next = sampler.sample(logits.row(0));
        if tokenizer.is_eos(next) {
            break FinishReason::Eos;
        }
        token_ids.push(next);
        pending_ids.push(next);
        if let Some(delta) = decoder.push(&tokenizer, next)? {
            let (out, stopped) = filter.push(&delta);
            if !out.is_empty() || stopped {
                on_delta(&out, &pending_ids);
                pending_ids.clear();
            }
            if stopped {
                break FinishReason::Stop;
            }
        }
        if token_ids.len() >= req.max_new_tokens || engine.session_len(session)? + 1 >= limit {
            break FinishReason::Length;
        }
        logits = engine.forward_causal(session, &[next], &[0])?;
        stats.forward_passes += 1;
    };
    if finish != FinishReason::Stop {
        let rest = filter.flush();
        if !rest.is_empty() || !pending_ids.is_empty() {
            on_delta(&rest, &pending_ids);
        }
    }
    stats.output_tokens = token_ids.len();
    stats.decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    stats.total_ms = start.elapsed().as_secs_f64() * 1e3;
    stats.decode_tokens_per_s = if stats.decode_ms > 0.0 {
        stats.output_tokens as f64 / (stats.decode_ms / 1e3)
    } else {
        0.0
    };
    Ok(Generation {
        text: filter.text,
        token_ids,
        finish_reason: finish,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_partial_matches_and_cuts() {
        let mut f = StopFilter {
            stop: vec!["END".into()],
            text: String::new(),
            sent: 0,
        };
        assert_eq!(f.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("Dxyz"), (String::new(), true));
        assert_eq!(f.text, "abc ");
        let mut g = StopFilter {
            stop: vec!["END".into()],
            text: String::new(),
            sent: 0,
        };
        assert_eq!(g.push("E"), (String::new(), false));
        assert_eq!(g.push("x"), ("Ex".to_string(), false));
        assert_eq!(g.flush(), "");
    }
}
