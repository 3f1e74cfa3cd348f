//! The engine behind the PARSE loop's traits: [`EngineVerifier`] runs the target, [`EngineDrafter`] the draft, both
//! in process. The gRPC workers wrap the same types.

use std::collections::HashMap;

use parse_core::driver::{DraftChunk, Drafter, ExtendOutput, SamplingParams, Verifier};
use parse_core::policy::{JudgeScore, RowScore, VerifyOutput};
use parse_core::segmenter::{self, SegmenterConfig};
use parse_core::speculative::{self, SampledRow};
use parse_core::{Error as CoreError, Result as CoreResult, VerifyPlan};

use crate::engine::{Engine, EngineOps};
use crate::generate::PREFILL_CHUNK;
use crate::sampling::{Sampler, argmax, distribution};

/// Probability of `token` under softmax(`logits`) at temperature 1.
pub fn token_prob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    let sum: f64 = logits.iter().map(|v| ((*v - max) as f64).exp()).sum();
    match logits.get(token as usize) {
        Some(v) => (((*v - max) as f64).exp() / sum) as f32,
        None => 0.0,
    }
}

/// The target's view of one row at temperature 1: the probability of `token` (NaN without one), the probability
/// of the greedy token, and the entropy in nats. One pass over the row.
pub fn row_view(logits: &[f32], token: Option<u32>) -> (f32, f32, f32) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    let (mut sum, mut weighted) = (0f64, 0f64);
    for v in logits {
        let z = (*v - max) as f64;
        let e = z.exp();
        sum += e;
        weighted += z * e;
    }
    let prob = token
        .and_then(|t| logits.get(t as usize))
        .map_or(f32::NAN, |v| (((*v - max) as f64).exp() / sum) as f32);
    let entropy = sum.ln() - weighted / sum;
    (prob, (1.0 / sum) as f32, entropy.max(0.0) as f32)
}

/// The request's sampling distribution over `logits` as `(token, probability)`, zero entries dropped.
fn sparse_distribution(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f32)> {
    distribution(logits, params)
        .into_iter()
        .map(|(t, p)| (t, p as f32))
        .filter(|x| x.1 > 0.0)
        .collect()
}

fn pieces_of(engine: &Engine, tokens: &[u32]) -> CoreResult<Vec<String>> {
    Ok(engine.tokenizer().pieces(tokens)?)
}

fn prefill<E: EngineOps + ?Sized>(
    engine: &mut E,
    session: &str,
    tokens: &[u32],
    readout_last: bool,
) -> crate::Result<Option<Vec<f32>>> {
    let mut last = None;
    let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let is_last = i + 1 == chunks.len();
        let readout: &[usize] = if is_last && readout_last {
            &[chunk.len() - 1]
        } else {
            &[]
        };
        let l = engine.forward_causal(session, chunk, readout)?;
        if is_last && readout_last {
            last = Some(l.row(0).to_vec());
        }
    }
    Ok(last)
}

/// The target model as a [`Verifier`], over a borrowed (`&mut Engine`, in process) or owned engine (a worker).
pub struct EngineVerifier<E: EngineOps> {
    engine: E,
    samplers: HashMap<String, Sampler>,
    yes_no: Option<(u32, u32)>,
}

impl<E: EngineOps> EngineVerifier<E> {
    pub fn new(engine: E) -> Self {
        let tok = engine.engine().tokenizer();
        let yes_no = tok.token_to_id("Yes").zip(tok.token_to_id("No"));
        EngineVerifier {
            engine,
            samplers: HashMap::new(),
            yes_no,
        }
    }
}

impl<E: EngineOps> EngineVerifier<E> {
    pub fn engine(&self) -> &Engine {
        self.engine.engine()
    }

    /// What the verifier drives: an engine, or a tensor-parallel leader.
    pub fn ops(&self) -> &E {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut E {
        &mut self.engine
    }
}

impl<E: EngineOps> Verifier for EngineVerifier<E> {
    fn open(&mut self, session: &str, prompt: &[u32], sampling: &SamplingParams) -> CoreResult<()> {
        if prompt.is_empty() {
            return Err(CoreError::invalid("empty prompt"));
        }
        let sampler = Sampler::new(sampling.clone())?;
        self.engine.open_session(session)?;
        if prompt.len() > 1
            && let Err(e) = prefill(
                &mut self.engine,
                session,
                &prompt[..prompt.len() - 1],
                false,
            )
        {
            let _ = self.engine.release(session);
            return Err(e.into());
        }
        self.samplers.insert(session.to_string(), sampler);
        Ok(())
    }

    fn verify(&mut self, session: &str, plan: &VerifyPlan) -> CoreResult<VerifyOutput> {
        let readout = plan.readout();
        let logits =
            self.engine
                .forward(session, &plan.tokens, &plan.positions, &plan.mask, &readout)?;
        let l = plan.draft.len();
        let rows = (0..=l)
            .map(|t| {
                let row = logits.row(t);
                let (prob, top_prob, entropy) = row_view(row, plan.draft.get(t).copied());
                RowScore {
                    argmax: argmax(row),
                    prob,
                    top_prob,
                    entropy,
                }
            })
            .collect();
        let sampled = match &plan.sample {
            None => None,
            Some(check) => {
                let params = self
                    .samplers
                    .get(session)
                    .ok_or_else(|| CoreError::invalid(format!("unknown session `{session}`")))?
                    .params()
                    .clone();
                let mut dists: Vec<Vec<(u32, f32)>> = Vec::new();
                let accepted = speculative::first_rejection(check, |i| {
                    let d = sparse_distribution(logits.row(i), &params);
                    let p = d.iter().find(|x| x.0 == plan.draft[i]).map_or(0.0, |x| x.1);
                    dists.push(d);
                    Ok(p)
                })?;
                let dist = if accepted < dists.len() {
                    dists.swap_remove(accepted)
                } else {
                    sparse_distribution(logits.row(accepted), &params)
                };
                Some(SampledRow { accepted, dist })
            }
        };
        let mut judge = Vec::new();
        if !plan.suffix_rows.is_empty() {
            let (yes, no) = self.yes_no.ok_or_else(|| {
                CoreError::invalid("the tokenizer has no single `Yes`/`No` tokens for the judge")
            })?;
            for i in 0..plan.suffix_rows.len() {
                let row = logits.row(l + 1 + i);
                judge.push(JudgeScore {
                    yes: token_prob(row, yes),
                    no: token_prob(row, no),
                });
            }
        }
        Ok(VerifyOutput {
            rows,
            judge,
            sampled,
        })
    }

    fn extend(
        &mut self,
        session: &str,
        pending: u32,
        max: usize,
        segment: Option<&SegmenterConfig>,
    ) -> CoreResult<ExtendOutput> {
        let mut out = ExtendOutput::default();
        let mut all_pieces = match segment {
            Some(_) => pieces_of(self.engine.engine(), &[pending])?,
            None => Vec::new(),
        };
        let mut last = pending;
        let limit = self.engine.engine().model().config().max_context;
        while out.tokens.len() < max.max(1) {
            if self.engine.engine().session_len(session)? + 1 >= limit {
                break;
            }
            let logits = self.engine.forward_causal(session, &[last], &[0])?;
            let sampler = self
                .samplers
                .get_mut(session)
                .ok_or_else(|| CoreError::invalid(format!("unknown session `{session}`")))?;
            let t = sampler.sample(logits.row(0));
            out.tokens.push(t);
            last = t;
            if self.engine.engine().tokenizer().is_eos(t) {
                break;
            }
            if let Some(cfg) = segment {
                let p = pieces_of(self.engine.engine(), &[t])?;
                all_pieces.extend(p.iter().cloned());
                out.pieces.extend(p);
                if segmenter::first_segment_end(&all_pieces, cfg).is_some() {
                    break;
                }
            }
        }
        if out.tokens.is_empty() {
            return Err(CoreError::invalid(
                "the session has reached the model's context length",
            ));
        }
        Ok(out)
    }

    fn truncate(&mut self, session: &str, len: usize) -> CoreResult<()> {
        Ok(self.engine.truncate(session, len)?)
    }

    fn release(&mut self, session: &str) -> CoreResult<()> {
        self.samplers.remove(session);
        self.engine.release(session)?;
        Ok(())
    }
}

struct DraftState {
    /// Tokens in the draft model's cache, in order.
    kv: Vec<u32>,
    /// Logits after the last cached token.
    next: Vec<f32>,
    /// Where the current draft starts yielding in `kv` (tokens past it were drafted earlier and are reused).
    cursor: usize,
    sampler: Sampler,
    done: bool,
    /// The distributions the current draft's tokens were drawn from (stochastic sampling only).
    dists: Vec<Vec<(u32, f32)>>,
}

/// The draft model as a [`Drafter`], over a borrowed or owned engine. Its cache follows the accepted context: a new
/// draft keeps the longest common prefix, and draft tokens computed past an accepted cut are reused instead of
/// recomputed.
pub struct EngineDrafter<E: EngineOps> {
    engine: E,
    states: HashMap<String, DraftState>,
}

impl<E: EngineOps> EngineDrafter<E> {
    pub fn new(engine: E) -> Self {
        EngineDrafter {
            engine,
            states: HashMap::new(),
        }
    }
}

impl<E: EngineOps> EngineDrafter<E> {
    pub fn engine(&self) -> &Engine {
        self.engine.engine()
    }

    /// Sessions with draft state.
    pub fn sessions(&self) -> impl Iterator<Item = &str> {
        self.states.keys().map(|s| s.as_str())
    }
}

impl<E: EngineOps> Drafter for EngineDrafter<E> {
    fn begin(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
    ) -> CoreResult<()> {
        if context.is_empty() {
            return Err(CoreError::invalid("empty context"));
        }
        if !self.states.contains_key(session) {
            self.engine.open_session(session)?;
            let sampler = Sampler::new(sampling.clone())?;
            self.states.insert(
                session.to_string(),
                DraftState {
                    kv: Vec::new(),
                    next: Vec::new(),
                    cursor: 0,
                    sampler,
                    done: false,
                    dists: Vec::new(),
                },
            );
        }
        let st = self
            .states
            .get_mut(session)
            .ok_or_else(|| CoreError::internal("draft state lost"))?;
        let common = st
            .kv
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        st.done = false;
        st.dists.clear();
        let stochastic = !st.sampler.params().is_greedy();
        // Replaying tokens drafted earlier is only done greedily: a sampled replay would need their distributions.
        if common == context.len() && !st.next.is_empty() && !stochastic {
            // The context is a prefix of what the draft already computed: replay the rest.
            st.cursor = context.len();
            return Ok(());
        }
        // Recompute from the common prefix, keeping at least the last context token to get its logits.
        let keep = common.min(context.len() - 1);
        self.engine.truncate(session, keep)?;
        st.kv.truncate(keep);
        let logits = prefill(&mut self.engine, session, &context[keep..], true)?;
        st.kv.extend_from_slice(&context[keep..]);
        st.next = logits.ok_or_else(|| CoreError::internal("prefill returned no logits"))?;
        st.cursor = context.len();
        Ok(())
    }

    fn next(&mut self, session: &str, max: usize) -> CoreResult<DraftChunk> {
        let limit = self.engine.engine().model().config().max_context;
        let st = self
            .states
            .get_mut(session)
            .ok_or_else(|| CoreError::invalid(format!("unknown draft session `{session}`")))?;
        let mut chunk = DraftChunk::default();
        let stochastic = !st.sampler.params().is_greedy();
        while chunk.tokens.len() < max && !st.done {
            if st.cursor < st.kv.len() {
                let t = st.kv[st.cursor];
                st.cursor += 1;
                chunk.tokens.push(t);
                st.done = self.engine.engine().tokenizer().is_eos(t);
                continue;
            }
            if st.kv.len() + 1 >= limit {
                st.done = true;
                break;
            }
            let t = if stochastic {
                let (t, d) = st.sampler.sample_with_distribution(&st.next);
                let d: Vec<(u32, f32)> = d
                    .into_iter()
                    .map(|(t, p)| (t, p as f32))
                    .filter(|x| x.1 > 0.0)
                    .collect();
                chunk
                    .probs
                    .push(d.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1));
                st.dists.push(d);
                t
            } else {
                st.sampler.sample(&st.next)
            };
            chunk.tokens.push(t);
            if self.engine.engine().tokenizer().is_eos(t) {
                st.done = true;
                break;
            }
            let logits = self.engine.forward_causal(session, &[t], &[0])?;
            st.next = logits.row(0).to_vec();
            st.kv.push(t);
            st.cursor = st.kv.len();
        }
        chunk.done = st.done;
        chunk.pieces = pieces_of(self.engine.engine(), &chunk.tokens)?;
        Ok(chunk)
    }

    fn distribution(&mut self, session: &str, index: usize) -> CoreResult<Vec<(u32, f32)>> {
        let st = self
            .states
            .get(session)
            .ok_or_else(|| CoreError::invalid(format!("unknown draft session `{session}`")))?;
        st.dists.get(index).cloned().ok_or_else(|| {
            CoreError::invalid(format!(
                "no sampled draft token {index} in session `{session}` (greedy drafts keep none)"
            ))
        })
    }

    fn pieces(&mut self, tokens: &[u32]) -> CoreResult<Vec<String>> {
        pieces_of(self.engine.engine(), tokens)
    }

    fn release(&mut self, session: &str) -> CoreResult<()> {
        if self.states.remove(session).is_some() {
            self.engine.release(session)?;
        }
        Ok(())
    }
}
