//! Copies first, the draft model where nothing is copied: a drafter that writes a token by prompt lookup wherever the
//! context's last tokens occurred earlier, at least `CopyConfig::lookup.min_n` of them (a reply that repeats the
//! function it was given, quotes its article or its own earlier lines), and asks the wrapped drafter (the draft
//! model) for the rest. A copied
//! token costs a scan of the context; a model token costs a draft step. Where the model takes over after copied
//! tokens, its `begin` is given the context with them, so it prefills them as one block (the draft's cache keeps the
//! common prefix) instead of writing them a step each.
//!
//! The match must be long because a copy replaces a model token that is usually right: a short match predicts the
//! next token less often than the draft model does, a match of 5 tokens or more about as often or more. So the
//! default copies from a 5-token match up, looking for 8 first. `benches/scripts/ngram-replay.py` replays a
//! `parse-bench` run's replies to measure how often each match length predicts the next token.
//!
//! A copy, once started, runs to the end of the draft: the suffix after a copied token is the one after its source,
//! which occurs one place later in the text it copies. So a draft is the model's tokens (none, where the context
//! already ends in a match) and then copied ones, and the verification decides where the copy stops; the model is
//! begun at most once per draft. Sampled requests: a copied token was drafted with probability 1 (a point mass, as
//! [`NgramDrafter`] does), a model token with the model's distribution.
//!
//! [`NgramDrafter`]: crate::ngram::NgramDrafter

use std::collections::HashMap;

use crate::driver::{DraftChunk, DraftHints, Drafter, SamplingParams};
use crate::error::{Error, Result};
use crate::ngram::{NgramConfig, draft_session, lookup_match};

/// Which matches are copied, and how the model is asked for the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyConfig {
    /// Suffix sizes looked up (longest first); a match shorter than `lookup.min_n` is not copied.
    pub lookup: NgramConfig,
    /// Tokens asked of the model per call: 1 in process; a drafter behind a network call wants more per call
    /// (tokens past the start of a copy are then dropped).
    pub model_chunk: usize,
    /// The lookup of copy rounds while the model rests ([`DraftHints::rest_lookup`]): shorter matches than `lookup`'s,
    /// because there a copy stands in for the target writing alone, not for a model token that is usually right
    /// (the prompt-lookup drafter's own sizes, [`NgramConfig::default`]).
    pub rest: NgramConfig,
}

impl Default for CopyConfig {
    fn default() -> Self {
        CopyConfig {
            lookup: NgramConfig { min_n: 5, max_n: 8 },
            model_chunk: 1,
            rest: NgramConfig::default(),
        }
    }
}

impl CopyConfig {
    /// For a drafter behind a network call (the router's draft-worker client): 8 model tokens per call, as a plain
    /// model draft asks for.
    pub fn remote() -> Self {
        CopyConfig {
            model_chunk: 8,
            ..Default::default()
        }
    }
}

/// Where a drafted token came from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Origin {
    Copied,
    /// The wrapped drafter's `index`-th token since its `begin` number `begun`.
    Model {
        begun: usize,
        index: usize,
    },
}

#[derive(Debug, Default)]
struct CopyState {
    /// The context of the last `begin` and every token drafted since.
    context: Vec<u32>,
    /// The tokens since `begin`, by origin.
    origins: Vec<Origin>,
    /// How much of `context` the wrapped drafter follows (its last `begin`'s context plus its tokens since), if it
    /// was begun in this draft.
    model_at: Option<usize>,
    /// Tokens the wrapped drafter wrote since its last `begin`, and how many times it was begun in this draft.
    model_tokens: usize,
    model_begins: usize,
    sampling: SamplingParams,
    done: bool,
}

/// Prompt lookup first, `D` for the rest (see the module's documentation).
pub struct CopyFirst<D> {
    inner: D,
    cfg: CopyConfig,
    end_tokens: Vec<u32>,
    sessions: HashMap<String, CopyState>,
    /// Tokens copied, and the wrapped drafter's tokens kept in drafts, over every session (stats, tests).
    pub copied: usize,
    pub modelled: usize,
}

impl<D> std::fmt::Debug for CopyFirst<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyFirst")
            .field("cfg", &self.cfg)
            .field("sessions", &self.sessions.len())
            .field("copied", &self.copied)
            .field("modelled", &self.modelled)
            .finish()
    }
}

impl<D: Drafter> CopyFirst<D> {
    /// Wraps `inner`; a copied draft ends after any of `end_tokens` (the wrapped drafter ends its own).
    pub fn new(inner: D, cfg: CopyConfig, end_tokens: Vec<u32>) -> Result<Self> {
        cfg.lookup.validate()?;
        cfg.rest.validate()?;
        Ok(CopyFirst {
            inner,
            cfg,
            end_tokens,
            sessions: HashMap::new(),
            copied: 0,
            modelled: 0,
        })
    }

    /// The wrapped drafter.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Whether a draft from `context` starts by copying (its end occurred earlier): such a draft asks nothing of
    /// the model yet, so the model's work read ahead for it would be dropped.
    fn starts_by_copying(&self, context: &[u32]) -> bool {
        lookup_match(context, &self.cfg.lookup).is_some()
    }
}

impl<D: Drafter> Drafter for CopyFirst<D> {
    fn begin(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<()> {
        if context.is_empty() {
            return Err(Error::invalid("empty context"));
        }
        // The wrapped drafter is begun when it is first asked for a token (it may never be), except at a session's
        // first begin: that is the request's draft prefill (the loop counts it as such, and judges by it what
        // catching the draft up costs), so the model processes the context now, as its own first begin would.
        let first = !self.sessions.contains_key(session);
        let s = self.sessions.entry(session.to_string()).or_default();
        // Begun again where the model already is, with nothing drafted since: it stays there.
        let model_here =
            s.model_at == Some(context.len()) && s.model_tokens == 0 && s.context == context;
        s.context.clear();
        s.context.extend_from_slice(context);
        s.origins.clear();
        s.model_at = model_here.then_some(context.len());
        s.model_tokens = 0;
        s.model_begins = 0;
        s.sampling = sampling.clone();
        s.done = false;
        if first {
            self.inner.begin(session, context, sampling)?;
            s.model_at = Some(context.len());
        }
        Ok(())
    }

    fn next(&mut self, session: &str, max: usize) -> Result<DraftChunk> {
        let s = draft_session(&mut self.sessions, session)?;
        let sampled = !s.sampling.is_greedy();
        let mut chunk = DraftChunk::default();
        let mut copied = Vec::new();
        while !s.done && chunk.tokens.len() < max {
            if let Some((t, _)) = lookup_match(&s.context, &self.cfg.lookup) {
                s.context.push(t);
                s.origins.push(Origin::Copied);
                chunk.tokens.push(t);
                copied.push(chunk.tokens.len() - 1);
                if sampled {
                    chunk.probs.push(1.0);
                }
                self.copied += 1;
                s.done = self.end_tokens.contains(&t);
                continue;
            }
            if s.model_at != Some(s.context.len()) {
                // The model's cache keeps what it shares with the context (earlier rounds' copied tokens are
                // prefilled as a block). Within a draft this is its first token: copies do not run out.
                self.inner.begin(session, &s.context, &s.sampling)?;
                s.model_at = Some(s.context.len());
                s.model_tokens = 0;
                s.model_begins += 1;
            }
            // `model_chunk` tokens per call (in process one: a token the model writes past the start of a copy is a
            // step thrown away; through the router more, each call being a round trip to the draft worker). The
            // model's tokens are taken up to the first that completes a match; the copy goes on from there.
            let want = self.cfg.model_chunk.max(1).min(max - chunk.tokens.len());
            let c = self.inner.next(session, want)?;
            if c.tokens.is_empty() {
                s.done = true;
                break;
            }
            if sampled && c.probs.len() < c.tokens.len() {
                return Err(Error::internal(
                    "the draft model returned no probability for a sampled token",
                ));
            }
            let n = c.tokens.len();
            let mut pieces = c.pieces.into_iter();
            for (i, &t) in c.tokens.iter().enumerate() {
                if sampled {
                    chunk.probs.push(c.probs[i]);
                }
                s.context.push(t);
                s.origins.push(Origin::Model {
                    begun: s.model_begins,
                    index: s.model_tokens,
                });
                s.model_tokens += 1;
                chunk.tokens.push(t);
                chunk.pieces.push(pieces.next().ok_or_else(|| {
                    Error::internal("a drafter returned fewer texts than tokens")
                })?);
                self.modelled += 1;
                s.done = (c.done && i + 1 == n) || self.end_tokens.contains(&t);
                if s.done || (i + 1 < n && lookup_match(&s.context, &self.cfg.lookup).is_some()) {
                    // The model's tokens after this one are dropped: it is no longer where the context is.
                    s.model_at = (i + 1 == n).then_some(s.context.len());
                    break;
                }
                s.model_at = Some(s.context.len());
            }
        }
        chunk.done = s.done;
        if !copied.is_empty() {
            // Pieces of the copied tokens, put in their places among the model's.
            let texts = self
                .inner
                .pieces(&copied.iter().map(|&i| chunk.tokens[i]).collect::<Vec<_>>())?;
            let mut model = std::mem::take(&mut chunk.pieces).into_iter();
            let mut texts = texts.into_iter();
            let mut next_copied = copied.iter().peekable();
            for i in 0..chunk.tokens.len() {
                let piece = if next_copied.next_if(|&&c| c == i).is_some() {
                    texts.next()
                } else {
                    model.next()
                };
                chunk.pieces.push(piece.ok_or_else(|| {
                    Error::internal("a drafter returned fewer texts than tokens")
                })?);
            }
        }
        Ok(chunk)
    }

    fn distribution(&mut self, session: &str, index: usize) -> Result<Vec<(u32, f32)>> {
        let s = draft_session(&mut self.sessions, session)?;
        let n = s.origins.len();
        let origin = *s
            .origins
            .get(index)
            .ok_or_else(|| Error::invalid(format!("draft token {index} asked for, {n} drafted")))?;
        match origin {
            Origin::Copied => {
                let t = s.context[s.context.len() - n + index];
                Ok(vec![(t, 1.0)])
            }
            Origin::Model { begun, index } if begun == s.model_begins => {
                self.inner.distribution(session, index)
            }
            Origin::Model { .. } => Err(Error::internal(format!(
                "draft token {index}'s distribution was dropped when the draft model began again"
            ))),
        }
    }

    fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>> {
        self.inner.pieces(tokens)
    }

    fn release(&mut self, session: &str) -> Result<()> {
        self.sessions.remove(session);
        self.inner.release(session)
    }
}

impl<D: Drafter> DraftHints for CopyFirst<D> {
    fn prefetch(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        if self.starts_by_copying(context) {
            return Ok(());
        }
        self.inner.prefetch(session, context, sampling, tokens)
    }
    fn prefetch_guessing(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        if self.starts_by_copying(context) {
            return Ok(());
        }
        self.inner
            .prefetch_guessing(session, context, sampling, tokens)
    }
    fn warm(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<bool> {
        // The model is begun at a session's first `begin` whatever it copies (see `begin`).
        self.inner.warm(session, context, sampling)
    }
    fn charged_ms(&self) -> Option<f64> {
        self.inner.charged_ms()
    }
    fn rest_lookup(&self) -> Option<NgramConfig> {
        Some(self.cfg.rest)
    }
    fn model_tokens_drafted(&self) -> Option<usize> {
        Some(self.modelled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::ngram::lookup;

    /// A draft model that writes the tokens of a script, one per step, and records its calls.
    #[derive(Default)]
    struct Model {
        script: Vec<u32>,
        at: usize,
        since_begin: Vec<u32>,
        begins: Vec<Vec<u32>>,
        prefetched: Vec<Vec<u32>>,
        released: bool,
    }

    impl Drafter for Model {
        fn begin(&mut self, _: &str, context: &[u32], _: &SamplingParams) -> Result<()> {
            self.begins.push(context.to_vec());
            self.since_begin.clear();
            Ok(())
        }

        fn next(&mut self, _: &str, max: usize) -> Result<DraftChunk> {
            let mut c = DraftChunk::default();
            while c.tokens.len() < max {
                let Some(&t) = self.script.get(self.at) else {
                    c.done = true;
                    break;
                };
                self.at += 1;
                self.since_begin.push(t);
                c.tokens.push(t);
                c.pieces.push(format!("m{t}"));
                c.probs.push(0.5);
            }
            Ok(c)
        }

        fn distribution(&mut self, _: &str, index: usize) -> Result<Vec<(u32, f32)>> {
            Ok(vec![(self.since_begin[index], 0.5)])
        }

        fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>> {
            Ok(tokens.iter().map(|t| format!("c{t}")).collect())
        }

        fn release(&mut self, _: &str) -> Result<()> {
            self.released = true;
            Ok(())
        }
    }

    impl DraftHints for Model {
        fn prefetch(
            &mut self,
            _: &str,
            context: &[u32],
            _: &SamplingParams,
            _: usize,
        ) -> Result<()> {
            self.prefetched.push(context.to_vec());
            Ok(())
        }
    }

    fn copy_first(min_n: usize, script: &[u32]) -> CopyFirst<Model> {
        let model = Model {
            script: script.to_vec(),
            ..Default::default()
        };
        let lookup = NgramConfig { min_n, max_n: 4 };
        let cfg = CopyConfig {
            lookup,
            model_chunk: 1,
            ..Default::default()
        };
        CopyFirst::new(model, cfg, vec![99]).unwrap()
    }

    #[test]
    fn the_model_writes_until_its_tokens_complete_a_long_match_and_the_copy_runs_to_the_drafts_end()
    {
        let mut d = copy_first(3, &[3, 77, 78]);
        let greedy = SamplingParams::default();
        // "9 1 2" has not occurred before: the model writes 3, which makes "1 2 3", quoted at the start: copied
        // from there on ("4 5 9 1", then on into the copy itself).
        d.begin("s", &[1, 2, 3, 4, 5, 9, 1, 2], &greedy).unwrap();
        let c = d.next("s", 5).unwrap();
        assert_eq!(c.tokens, [3, 4, 5, 9, 1]);
        assert_eq!(c.pieces, ["m3", "c4", "c5", "c9", "c1"]);
        assert!(c.probs.is_empty(), "greedy drafts carry no probabilities");
        assert!(!c.done);
        assert_eq!(d.next("s", 2).unwrap().tokens, [2, 3]);
        assert_eq!(d.inner().begins, [vec![1, 2, 3, 4, 5, 9, 1, 2]]);
        assert_eq!((d.copied, d.modelled), (6, 1));

        // A context that already ends in a long match is copied without asking the model.
        d.begin("s", &[1, 2, 3, 4, 1, 2, 3], &greedy).unwrap();
        assert_eq!(d.next("s", 3).unwrap().tokens, [4, 1, 2]);
        assert_eq!(d.inner().begins.len(), 1);
    }

    #[test]
    fn asked_for_several_tokens_the_model_is_cut_where_its_token_completes_a_match() {
        let model = Model {
            script: vec![3, 77, 78],
            ..Default::default()
        };
        let cfg = CopyConfig {
            lookup: NgramConfig { min_n: 3, max_n: 4 },
            model_chunk: 3,
            ..Default::default()
        };
        let mut d = CopyFirst::new(model, cfg, vec![99]).unwrap();
        d.begin("s", &[1, 2, 3, 4, 5, 9, 1, 2], &SamplingParams::default())
            .unwrap();
        // The same draft as one token per call: 77 and 78 are dropped, the copy starts after 3.
        let c = d.next("s", 5).unwrap();
        assert_eq!(c.tokens, [3, 4, 5, 9, 1]);
        assert_eq!(c.pieces, ["m3", "c4", "c5", "c9", "c1"]);
        assert_eq!((d.copied, d.modelled), (4, 1));
        assert_eq!(d.inner().at, 3, "one call wrote all three");
        // A chunk is never more than the call wants.
        let model = Model {
            script: vec![5, 6, 7, 8],
            ..Default::default()
        };
        let mut d = CopyFirst::new(model, cfg, vec![99]).unwrap();
        d.begin("t", &[10, 11], &SamplingParams::default()).unwrap();
        assert_eq!(d.next("t", 2).unwrap().tokens, [5, 6]);
        assert_eq!(d.inner().at, 2);
    }

    #[test]
    fn a_match_shorter_than_the_minimum_is_left_to_the_model() {
        let mut d = copy_first(3, &[5, 6]);
        let greedy = SamplingParams::default();
        let context = [7, 8, 1, 7, 8];
        // Prompt lookup from 2 tokens would copy 1 here.
        assert_eq!(lookup(&context, &NgramConfig::default()), Some(1));
        d.begin("s", &context, &greedy).unwrap();
        let c = d.next("s", 3).unwrap();
        assert_eq!(c.tokens, [5, 6]);
        assert_eq!(c.pieces, ["m5", "m6"]);
        assert!(c.done, "the model's draft ended");
        assert_eq!(d.inner().begins, [context.to_vec()]);
        assert_eq!((d.copied, d.modelled), (0, 2));
    }

    #[test]
    fn a_sessions_first_begin_is_the_models_prefill_and_is_not_repeated_where_the_model_already_is()
    {
        let mut d = copy_first(3, &[5, 6, 7]);
        let greedy = SamplingParams::default();
        // The request's draft prefill: the model processes the context now, even if the draft turns out copied.
        d.begin("s", &[1, 2, 3, 4], &greedy).unwrap();
        assert_eq!(d.inner().begins, [vec![1, 2, 3, 4]]);
        // The round's own begin, at the same context: the model is already there.
        d.begin("s", &[1, 2, 3, 4], &greedy).unwrap();
        assert_eq!(d.next("s", 2).unwrap().tokens, [5, 6]);
        assert_eq!(d.inner().begins.len(), 1);
        // Elsewhere, it is begun again where it is first asked for a token.
        d.begin("s", &[1, 2, 3, 4, 5, 9], &greedy).unwrap();
        assert_eq!(d.inner().begins.len(), 1);
        assert_eq!(d.next("s", 1).unwrap().tokens, [7]);
        assert_eq!(d.inner().begins, [vec![1, 2, 3, 4], vec![1, 2, 3, 4, 5, 9]]);
    }

    #[test]
    fn a_copy_stops_after_an_end_token() {
        let mut d = copy_first(3, &[]);
        d.begin("s", &[5, 6, 7, 99, 5, 6, 7], &SamplingParams::default())
            .unwrap();
        let c = d.next("s", 4).unwrap();
        assert_eq!((c.tokens.as_slice(), c.done), (&[99][..], true));
        let c = d.next("s", 4).unwrap();
        assert!(c.tokens.is_empty() && c.done);
    }

    #[test]
    fn sampled_copies_are_point_masses_and_model_tokens_keep_the_models_distribution() {
        let mut d = copy_first(3, &[3]);
        let sampled = SamplingParams {
            temperature: 0.8,
            ..Default::default()
        };
        d.begin("s", &[1, 2, 3, 4, 9, 1, 2], &sampled).unwrap();
        let c = d.next("s", 3).unwrap();
        assert_eq!(c.tokens, [3, 4, 9]);
        assert_eq!(c.probs, [0.5, 1.0, 1.0]);
        assert_eq!(d.distribution("s", 0).unwrap(), [(3, 0.5)]);
        assert_eq!(d.distribution("s", 2).unwrap(), [(9, 1.0)]);
        assert_eq!(
            d.distribution("s", 3).unwrap_err().kind,
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn the_model_reads_ahead_only_where_the_next_draft_would_not_copy() {
        let mut d = copy_first(3, &[]);
        let greedy = SamplingParams::default();
        d.begin("s", &[1, 2, 3], &greedy).unwrap();
        d.prefetch("s", &[1, 2, 3, 1, 2, 3], &greedy, 8).unwrap();
        assert!(d.inner().prefetched.is_empty());
        d.prefetch("s", &[1, 2, 3, 4], &greedy, 8).unwrap();
        assert_eq!(d.inner().prefetched, [vec![1, 2, 3, 4]]);
    }

    #[test]
    fn release_reaches_the_model_and_bad_calls_are_errors() {
        let mut d = copy_first(3, &[]);
        assert_eq!(d.next("x", 1).unwrap_err().kind, ErrorKind::NotFound);
        d.begin("s", &[1, 2], &SamplingParams::default()).unwrap();
        d.release("s").unwrap();
        assert!(d.inner().released);
        assert_eq!(d.next("s", 1).unwrap_err().kind, ErrorKind::NotFound);
        assert!(d.begin("s", &[], &SamplingParams::default()).is_err());
        let lookup = NgramConfig { min_n: 0, max_n: 4 };
        let bad = CopyConfig {
            lookup,
            ..Default::default()
        };
        assert!(CopyFirst::new(Model::default(), bad, vec![]).is_err());
    }
}
