//! The engine behind the PARSE loop's traits: [`EngineVerifier`] runs the target, [`EngineDrafter`] the draft, both
//! in process. The gRPC workers wrap the same types.

use std::collections::HashMap;

use parse_core::driver::{DraftChunk, DraftHints, Drafter, ExtendOutput, SamplingParams, Verifier};
use parse_core::policy::{JudgeScore, RowScore, VerifyOutput};
use parse_core::segmenter::{self, SegmenterConfig};
use parse_core::speculative::{self, SampledRow};
use parse_core::{Error as CoreError, Result as CoreResult, VerifyPlan};
use rayon::prelude::*;

use crate::engine::{Block, Engine, EngineOps};
use crate::generate::PREFILL_CHUNK;
use crate::model::Logits;
use crate::sampling::{Sampler, argmax, distribution};
use crate::steps::{Forward, Next, Steps, run_alone};

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

/// The fewest rows a prefill chunk takes when the scheduler offers less room: smaller chunks would waste passes.
const MIN_PREFILL_CHUNK: usize = 16;

/// Cached tokens at which a prefill chunk's rows cost about twice what they cost at the prompt's start: a row's
/// attention reads every key before it, and on a 2-core Zen 4 EPYC (Qwen2.5 1.5B, Q4_K) a prompt took about
/// 4.45 ms a token plus 1.9 us a token for every key it attends to (4,000 tokens in 33 s, 8,000 in 96 s). Past it a
/// chunk takes fewer rows ([`context_chunk`]).
const CHUNK_CONTEXT: usize = 2048;

/// The fewest rows a chunk takes however long its context: the pass's fixed part (its weights read once) stays small
/// beside that many rows attending to that many keys.
const MIN_CONTEXT_CHUNK: usize = 8;

/// The most rows a prefill chunk of at most `rows` takes after `base` cached tokens: all of them at the prompt's
/// start, fewer as the keys each row reads add up, so that a pass holding a chunk of a long prompt costs about what
/// it does at the start and the other sessions' steps packed with it are not held for seconds. Fixed-size chunks
/// would let a long prompt's late passes (each row reading thousands of keys) stall every request that shares them;
/// the prompt itself takes a little longer this way.
fn context_chunk(base: usize, rows: usize) -> usize {
    (rows * CHUNK_CONTEXT / (base + CHUNK_CONTEXT)).max(MIN_CONTEXT_CHUNK.min(rows))
}

/// Tokens fed to a session in chunks of at most [`PREFILL_CHUNK`] rows (fewer when a batching scheduler offers
/// less room, so that a long prompt does not stall the other sessions' steps). Chunking does not change the
/// result: every row attends to the same keys in the same order whatever the cut.
struct Prefill {
    tokens: Vec<u32>,
    fed: usize,
    /// Logits at the last token (read out of the last chunk).
    readout_last: bool,
}

impl Prefill {
    fn new(tokens: &[u32], readout_last: bool) -> Self {
        Prefill {
            tokens: tokens.to_vec(),
            fed: 0,
            readout_last,
        }
    }

    fn finished(&self) -> bool {
        self.fed == self.tokens.len()
    }

    /// The next chunk, after the `base` tokens the session holds; `None` once every token is fed.
    fn next(&mut self, session: &str, base: usize, room: usize) -> Option<Block> {
        if self.finished() {
            return None;
        }
        let rows = room.clamp(MIN_PREFILL_CHUNK, PREFILL_CHUNK);
        let n = (self.tokens.len() - self.fed).min(context_chunk(base, rows));
        let chunk = &self.tokens[self.fed..self.fed + n];
        self.fed += n;
        let readout = if self.finished() && self.readout_last {
            vec![n - 1]
        } else {
            Vec::new()
        };
        Some(Block::causal(session, base, chunk, readout))
    }
}

/// The target model as a [`Verifier`], over a borrowed (`&mut Engine`, in process) or owned engine (a worker).
pub struct EngineVerifier<E: EngineOps> {
    engine: E,
    samplers: HashMap<String, Sampler>,
    yes_no: Option<(u32, u32)>,
}

impl<E: EngineOps> EngineVerifier<E> {
    /// Whether `session` holds a cache but its open never finished (it failed, or was stopped mid-prefill): a
    /// session no caller can use.
    pub fn half_open(&self, session: &str) -> bool {
        !self.samplers.contains_key(session) && self.engine.engine().session_len(session).is_ok()
    }

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

impl<E: EngineOps> Forward for EngineVerifier<E> {
    fn forward_blocks(&mut self, blocks: &[Block]) -> Vec<crate::Result<Logits>> {
        self.engine.forward_batch(blocks)
    }
}

impl<E: EngineOps> EngineVerifier<E> {
    /// What a verification block's logits say: the rows' scores, the sampled check, the judge's answers.
    fn verify_output(
        &self,
        session: &str,
        plan: &VerifyPlan,
        logits: &Logits,
    ) -> CoreResult<VerifyOutput> {
        let l = plan.draft.len();
        // Rows scored only where the plan asks (`parse_core::Scoring`), each on its own thread: a score is a pass
        // over the whole vocabulary, and the rows are independent (a row's arithmetic is the same on any thread).
        let rows = (0..=l)
            .into_par_iter()
            .map(|t| {
                let row = logits.row(t);
                let argmax = argmax(row);
                if !plan.scoring.scores(t, &plan.draft, argmax) {
                    return RowScore {
                        argmax,
                        prob: f32::NAN,
                        top_prob: f32::NAN,
                        entropy: f32::NAN,
                    };
                }
                let (prob, top_prob, entropy) = row_view(row, plan.draft.get(t).copied());
                RowScore {
                    argmax,
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
}

/// [`Verifier::open`] as steps: the session opens, the prompt but its last token is prefilled in chunks.
pub struct OpenSteps {
    session: String,
    empty: bool,
    sampling: SamplingParams,
    prefill: Prefill,
    sampler: Option<Sampler>,
    reused: usize,
}

impl OpenSteps {
    pub fn new(session: &str, prompt: &[u32], sampling: &SamplingParams) -> Self {
        let cached = &prompt[..prompt.len().saturating_sub(1)];
        OpenSteps {
            session: session.to_string(),
            empty: prompt.is_empty(),
            sampling: sampling.clone(),
            prefill: Prefill::new(cached, false),
            sampler: None,
            reused: 0,
        }
    }
}

/// Opening a session takes the keys and values of the prompt's first tokens from a prompt kept earlier where one
/// shares them (`EngineOps::reuse_prefix`, in the request's `cache_salt` namespace), computes the rest, and keeps the
/// prompt for later requests (`EngineOps::keep_prefix`). Its output: how many of the prompt's tokens were reused.
impl<E: EngineOps> Steps<EngineVerifier<E>> for OpenSteps {
    type Output = usize;
    fn step(
        &mut self,
        v: &mut EngineVerifier<E>,
        input: Option<crate::Result<Logits>>,
        room: usize,
    ) -> CoreResult<Next<usize>> {
        match input {
            None => {
                if self.empty {
                    return Err(CoreError::invalid("empty prompt"));
                }
                if self.sampler.is_some() {
                    return Err(CoreError::internal(
                        "an open step without its block's logits",
                    ));
                }
                self.sampler = Some(Sampler::new(self.sampling.clone())?);
                v.engine.open_session(&self.session)?;
                let salt = self.sampling.cache_salt;
                self.reused = v
                    .engine
                    .reuse_prefix(&self.session, salt, &self.prefill.tokens)?;
                self.prefill.fed = self.reused;
            }
            Some(Err(e)) => {
                let _ = v.engine.release(&self.session);
                return Err(e.into());
            }
            Some(Ok(_)) => {}
        }
        let base = v.engine.engine().session_len(&self.session)?;
        if let Some(block) = self.prefill.next(&self.session, base, room) {
            return Ok(Next::Forward(block));
        }
        let sampler = self
            .sampler
            .take()
            .ok_or_else(|| CoreError::internal("open finished twice"))?;
        v.samplers.insert(self.session.clone(), sampler);
        let salt = self.sampling.cache_salt;
        v.engine
            .keep_prefix(&self.session, salt, &self.prefill.tokens)?;
        Ok(Next::Done(self.reused))
    }
}

/// [`Verifier::verify`] as steps: one block, then its verdict data.
pub struct VerifySteps {
    session: String,
    plan: VerifyPlan,
}

impl VerifySteps {
    pub fn new(session: &str, plan: VerifyPlan) -> Self {
        VerifySteps {
            session: session.to_string(),
            plan,
        }
    }
}

impl<E: EngineOps> Steps<EngineVerifier<E>> for VerifySteps {
    type Output = VerifyOutput;
    fn step(
        &mut self,
        v: &mut EngineVerifier<E>,
        input: Option<crate::Result<Logits>>,
        _room: usize,
    ) -> CoreResult<Next<VerifyOutput>> {
        match input {
            None => Ok(Next::Forward(Block {
                session: self.session.clone(),
                tokens: self.plan.tokens.clone(),
                positions: self.plan.positions.clone(),
                mask: self.plan.mask.clone(),
                readout: self.plan.readout(),
            })),
            Some(r) => Ok(Next::Done(v.verify_output(
                &self.session,
                &self.plan,
                &r?,
            )?)),
        }
    }
}

/// [`Verifier::extend`] as steps: one token per step until `max`, the end of sequence, a segment's end or the
/// context's end.
pub struct ExtendSteps {
    session: String,
    last: u32,
    max: usize,
    segment: Option<SegmenterConfig>,
    out: ExtendOutput,
    all_pieces: Vec<String>,
}

impl ExtendSteps {
    pub fn new(session: &str, pending: u32, max: usize, segment: Option<&SegmenterConfig>) -> Self {
        ExtendSteps {
            session: session.to_string(),
            last: pending,
            max: max.max(1),
            segment: segment.cloned(),
            out: ExtendOutput::default(),
            all_pieces: Vec::new(),
        }
    }

    fn finish(&mut self) -> CoreResult<Next<ExtendOutput>> {
        if self.out.tokens.is_empty() {
            return Err(CoreError::invalid(
                "the session has reached the model's context length",
            ));
        }
        Ok(Next::Done(std::mem::take(&mut self.out)))
    }
}

impl<E: EngineOps> Steps<EngineVerifier<E>> for ExtendSteps {
    type Output = ExtendOutput;
    fn step(
        &mut self,
        v: &mut EngineVerifier<E>,
        input: Option<crate::Result<Logits>>,
        _room: usize,
    ) -> CoreResult<Next<ExtendOutput>> {
        match input {
            None => {
                if self.segment.is_some() {
                    self.all_pieces = pieces_of(v.engine.engine(), &[self.last])?;
                }
            }
            Some(r) => {
                let logits = r?;
                let sampler = v.samplers.get_mut(&self.session).ok_or_else(|| {
                    CoreError::invalid(format!("unknown session `{}`", self.session))
                })?;
                let t = sampler.sample(logits.row(0));
                self.out.tokens.push(t);
                self.last = t;
                if v.engine.engine().tokenizer().is_eos(t) {
                    return self.finish();
                }
                if let Some(cfg) = &self.segment {
                    let p = pieces_of(v.engine.engine(), &[t])?;
                    self.all_pieces.extend(p.iter().cloned());
                    self.out.pieces.extend(p);
                    if segmenter::first_segment_end(&self.all_pieces, cfg).is_some() {
                        return self.finish();
                    }
                }
            }
        }
        let limit = v.engine.engine().model().config().max_context;
        let base = v.engine.engine().session_len(&self.session)?;
        if self.out.tokens.len() >= self.max || base + 1 >= limit {
            return self.finish();
        }
        Ok(Next::Forward(Block::causal(
            &self.session,
            base,
            &[self.last],
            vec![0],
        )))
    }
}

impl<E: EngineOps> Verifier for EngineVerifier<E> {
    fn open(
        &mut self,
        session: &str,
        prompt: &[u32],
        sampling: &SamplingParams,
    ) -> CoreResult<usize> {
        run_alone(self, OpenSteps::new(session, prompt, sampling))
    }

    fn verify(&mut self, session: &str, plan: &VerifyPlan) -> CoreResult<VerifyOutput> {
        run_alone(self, VerifySteps::new(session, plan.clone()))
    }

    fn extend(
        &mut self,
        session: &str,
        pending: u32,
        max: usize,
        segment: Option<&SegmenterConfig>,
    ) -> CoreResult<ExtendOutput> {
        run_alone(self, ExtendSteps::new(session, pending, max, segment))
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

impl<E: EngineOps> Forward for EngineDrafter<E> {
    fn forward_blocks(&mut self, blocks: &[Block]) -> Vec<crate::Result<Logits>> {
        self.engine.forward_batch(blocks)
    }
}

/// [`Drafter::begin`] as steps: the draft's cache follows `context` (the longest common prefix kept, the rest
/// prefilled in chunks) and ends with the logits after its last token.
pub struct BeginSteps {
    session: String,
    context: Vec<u32>,
    sampling: SamplingParams,
    prefill: Option<Prefill>,
    keep: usize,
    /// This begin opened the session: its context is kept for later requests once computed.
    opened: bool,
}

impl BeginSteps {
    pub fn new(session: &str, context: &[u32], sampling: &SamplingParams) -> Self {
        BeginSteps {
            session: session.to_string(),
            context: context.to_vec(),
            sampling: sampling.clone(),
            prefill: None,
            keep: 0,
            opened: false,
        }
    }

    /// Everything before the first block: the state, and what of the cache is kept. `None`: nothing to compute.
    fn start<E: EngineOps>(&mut self, d: &mut EngineDrafter<E>) -> CoreResult<Option<Prefill>> {
        let (session, context) = (self.session.as_str(), self.context.as_slice());
        if context.is_empty() {
            return Err(CoreError::invalid("empty context"));
        }
        if !d.states.contains_key(session) {
            d.engine.open_session(session)?;
            self.opened = true;
            // The keys and values of the context's first tokens from a context kept earlier, where one shares them
            // (at least the last token is computed, for its logits).
            let salt = self.sampling.cache_salt;
            let cut = context.len() - 1;
            let reused = d.engine.reuse_prefix(session, salt, &context[..cut])?;
            let sampler = Sampler::new(self.sampling.clone())?;
            d.states.insert(
                session.to_string(),
                DraftState {
                    kv: context[..reused].to_vec(),
                    next: Vec::new(),
                    cursor: 0,
                    sampler,
                    done: false,
                    dists: Vec::new(),
                },
            );
        }
        let st = d
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
            return Ok(None);
        }
        // Recompute from the common prefix, keeping at least the last context token to get its logits.
        let keep = common.min(context.len() - 1);
        d.engine.truncate(session, keep)?;
        st.kv.truncate(keep);
        self.keep = keep;
        Ok(Some(Prefill::new(&context[keep..], true)))
    }
}

impl<E: EngineOps> Steps<EngineDrafter<E>> for BeginSteps {
    type Output = ();
    fn step(
        &mut self,
        d: &mut EngineDrafter<E>,
        input: Option<crate::Result<Logits>>,
        room: usize,
    ) -> CoreResult<Next<()>> {
        let logits = match input {
            None => match self.start(d)? {
                None => return Ok(Next::Done(())),
                Some(p) => {
                    self.prefill = Some(p);
                    None
                }
            },
            Some(r) => Some(r?),
        };
        let prefill = self
            .prefill
            .as_mut()
            .ok_or_else(|| CoreError::internal("a begin step without its prefill"))?;
        if !prefill.finished() {
            let base = d.engine.engine().session_len(&self.session)?;
            if let Some(block) = prefill.next(&self.session, base, room) {
                return Ok(Next::Forward(block));
            }
        }
        let logits = logits.ok_or_else(|| CoreError::internal("prefill returned no logits"))?;
        let st = d
            .states
            .get_mut(&self.session)
            .ok_or_else(|| CoreError::internal("draft state lost"))?;
        st.kv.extend_from_slice(&self.context[self.keep..]);
        st.next = logits.row(0).to_vec();
        st.cursor = self.context.len();
        if self.opened {
            let salt = self.sampling.cache_salt;
            d.engine.keep_prefix(&self.session, salt, &self.context)?;
        }
        Ok(Next::Done(()))
    }
}

/// [`Drafter::next`] as steps: tokens drafted earlier are replayed, new ones cost a one-token block each.
pub struct DraftSteps {
    session: String,
    max: usize,
    chunk: DraftChunk,
    /// The token whose block is running.
    pending: Option<u32>,
}

impl DraftSteps {
    pub fn new(session: &str, max: usize) -> Self {
        DraftSteps {
            session: session.to_string(),
            max,
            chunk: DraftChunk::default(),
            pending: None,
        }
    }
}

impl<E: EngineOps> Steps<EngineDrafter<E>> for DraftSteps {
    type Output = DraftChunk;
    fn step(
        &mut self,
        d: &mut EngineDrafter<E>,
        input: Option<crate::Result<Logits>>,
        _room: usize,
    ) -> CoreResult<Next<DraftChunk>> {
        let limit = d.engine.engine().model().config().max_context;
        let session = self.session.as_str();
        let st = d
            .states
            .get_mut(session)
            .ok_or_else(|| CoreError::invalid(format!("unknown draft session `{session}`")))?;
        if let Some(r) = input {
            let logits = r?;
            let t = self
                .pending
                .take()
                .ok_or_else(|| CoreError::internal("a draft step without its token"))?;
            st.next = logits.row(0).to_vec();
            st.kv.push(t);
            st.cursor = st.kv.len();
        }
        let chunk = &mut self.chunk;
        let stochastic = !st.sampler.params().is_greedy();
        while chunk.tokens.len() < self.max && !st.done {
            if st.cursor < st.kv.len() {
                let t = st.kv[st.cursor];
                st.cursor += 1;
                chunk.tokens.push(t);
                st.done = d.engine.engine().tokenizer().is_eos(t);
                continue;
            }
            // A sampled token is written at position `kv.len()`, the context's last at `limit - 1`.
            if st.kv.len() >= limit {
                st.done = true;
                break;
            }
            let t = if stochastic {
                let (t, dist) = st.sampler.sample_with_distribution(&st.next);
                let dist: Vec<(u32, f32)> = dist
                    .into_iter()
                    .map(|(t, p)| (t, p as f32))
                    .filter(|x| x.1 > 0.0)
                    .collect();
                chunk
                    .probs
                    .push(dist.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1));
                st.dists.push(dist);
                t
            } else {
                st.sampler.sample(&st.next)
            };
            chunk.tokens.push(t);
            if d.engine.engine().tokenizer().is_eos(t) {
                st.done = true;
                break;
            }
            self.pending = Some(t);
            let base = d.engine.engine().session_len(session)?;
            return Ok(Next::Forward(Block::causal(session, base, &[t], vec![0])));
        }
        chunk.done = st.done;
        chunk.pieces = pieces_of(d.engine.engine(), &chunk.tokens)?;
        Ok(Next::Done(std::mem::take(chunk)))
    }
}

impl<E: EngineOps> Drafter for EngineDrafter<E> {
    fn begin(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
    ) -> CoreResult<()> {
        run_alone(self, BeginSteps::new(session, context, sampling))
    }

    fn next(&mut self, session: &str, max: usize) -> CoreResult<DraftChunk> {
        run_alone(self, DraftSteps::new(session, max))
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

impl<E: EngineOps> DraftHints for EngineDrafter<E> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long prompt's chunks: every token fed once and in order, the readout at the last; chunks shrink as the
    /// cached context grows, never below the floor, and the scheduler's room still caps them.
    #[test]
    fn a_long_prompts_chunks_shrink_with_the_context_they_attend_to() {
        let tokens: Vec<u32> = (0..40_000).collect();
        let mut p = Prefill::new(&tokens, true);
        let (mut base, mut fed, mut sizes) = (0, Vec::<u32>::new(), Vec::new());
        while let Some(b) = p.next("s", base, 128) {
            assert_eq!(b.positions.first().copied(), Some(base as u32));
            sizes.push((base, b.rows()));
            fed.extend(&b.tokens);
            base += b.rows();
            if base < tokens.len() {
                assert!(b.readout.is_empty());
            } else {
                assert_eq!(b.readout, vec![b.rows() - 1]);
            }
        }
        assert_eq!(fed, tokens);
        assert!(sizes.windows(2).all(|w| w[1].1 <= w[0].1), "chunks grow");
        let at = |from: usize| sizes.iter().find(|(b, _)| *b >= from).unwrap().1;
        assert_eq!(at(0), 128, "the room caps a chunk at the start");
        assert!(
            at(16_000) < 16 && at(16_000) > MIN_CONTEXT_CHUNK,
            "{}",
            at(16_000)
        );
        assert!(at(30_000) < at(16_000));
        assert_eq!(context_chunk(1 << 20, 128), MIN_CONTEXT_CHUNK);
        // In process, with no scheduler (room without bound): the engine's own chunk at the start.
        let mut p = Prefill::new(&tokens, false);
        assert_eq!(p.next("s", 0, usize::MAX).unwrap().rows(), PREFILL_CHUNK);
        // Less room than the floor of a chunk: the floor (a pass for a few rows would waste its fixed part).
        let mut p = Prefill::new(&tokens, false);
        assert_eq!(p.next("s", 0, 1).unwrap().rows(), MIN_PREFILL_CHUNK);
    }
}
