//! Plain autoregressive generation on one engine: prefill in chunks, then one token per step, streamed as text
//! deltas, stopping on an end token, a stop string or the token budget.
//!
//! Conventions: the end token itself is not part of the output (`token_ids`, `text`); on a stop string the text is
//! cut before it while `token_ids` keep every token generated; text is released to the stream only once no stop
//! string can still begin inside it.

use std::time::Instant;

use serde::Serialize;

use parse_core::FinishReason;
use parse_text::{StopFilter, StreamDecoder};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams};

/// Prompt tokens processed per forward block during prefill.
pub const PREFILL_CHUNK: usize = 256;

/// What to generate without speculation.
#[derive(Debug, Clone)]
pub struct PlainRequest {
    pub prompt_tokens: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

/// Figures of one generation.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct PlainStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub forward_passes: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub total_ms: f64,
    /// Output tokens per second of decoding (prefill excluded).
    pub decode_tokens_per_s: f64,
}

/// A finished plain generation.
#[derive(Debug, Clone, Serialize)]
pub struct PlainOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: PlainStats,
}

/// Validates a request against the engine's limits.
pub fn validate(engine: &Engine, req: &PlainRequest) -> Result<()> {
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
pub fn generate_plain(
    engine: &mut Engine,
    session: &str,
    req: &PlainRequest,
    mut on_delta: impl FnMut(&str, &[u32]),
) -> Result<PlainOutput> {
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
    req: &PlainRequest,
    on_delta: &mut dyn FnMut(&str, &[u32]),
) -> Result<PlainOutput> {
    let start = Instant::now();
    let tokenizer = engine.tokenizer().clone();
    let limit = engine.model().config().max_context;
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let mut stats = PlainStats {
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
    Ok(PlainOutput {
        text: filter.into_text(),
        token_ids,
        finish_reason: finish,
        stats,
    })
}
