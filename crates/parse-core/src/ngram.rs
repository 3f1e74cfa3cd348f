//! A drafter without a model: prompt lookup. The draft continues the text after the latest earlier place where the
//! context's last `n` tokens (`max_n` down to `min_n`) occurred, token by token, so a reply that quotes its prompt,
//! edits code it was given or repeats itself gets whole runs of tokens drafted for free. Where nothing matches it
//! drafts nothing, and the loop lets the target write (token-level modes: one plain step; `parse`: an extension).
//!
//! Where nothing of `min_n` tokens or more matches, a token-level round may still have the target verify a guess of
//! one token, the one after the latest earlier occurrence of the context's last token ([`DraftHints::guess_lookup`]),
//! where the share of such guesses the target keeps pays for the row they cost ([`crate::pace::Costs::guess_pays`]).
//!
//! It costs a scan of the context per drafted token (no forward pass), so whatever the target accepts is gain. Its
//! drafts are deterministic: in sampled token-level speculation each drafted token had probability 1, which keeps
//! speculative sampling lossless (the target's residual is its own distribution without that token).

use std::collections::HashMap;
use std::sync::Arc;

use crate::driver::{DraftChunk, DraftHints, Drafter, SamplingParams};
use crate::error::{Error, ErrorKind, Result};

/// Turns token ids into their texts (the target's tokenizer).
pub type PieceFn = Arc<dyn Fn(&[u32]) -> Result<Vec<String>> + Send + Sync>;

pub use crate::lookup::{DrafterKind, NgramConfig, lookup, lookup_match};

#[derive(Debug, Default)]
struct Lookup {
    context: Vec<u32>,
    /// Tokens drafted since `begin`.
    drafted: Vec<u32>,
    sampled: bool,
    done: bool,
}

/// Prompt-lookup drafts for any number of sessions.
pub struct NgramDrafter {
    cfg: NgramConfig,
    pieces: PieceFn,
    end_tokens: Vec<u32>,
    sessions: HashMap<String, Lookup>,
}

impl std::fmt::Debug for NgramDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NgramDrafter")
            .field("cfg", &self.cfg)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl NgramDrafter {
    /// A drafter that looks up `cfg`'s suffixes, writes texts with `pieces` and ends a draft after any of
    /// `end_tokens`.
    pub fn new(cfg: NgramConfig, pieces: PieceFn, end_tokens: Vec<u32>) -> Result<Self> {
        cfg.validate()?;
        Ok(NgramDrafter {
            cfg,
            pieces,
            end_tokens,
            sessions: HashMap::new(),
        })
    }
}

/// A drafter's state for `session`, or NOT_FOUND.
pub(crate) fn draft_session<'a, S>(
    sessions: &'a mut HashMap<String, S>,
    session: &str,
) -> Result<&'a mut S> {
    sessions
        .get_mut(session)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no draft session `{session}`")))
}

impl Drafter for NgramDrafter {
    fn begin(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<()> {
        let s = self.sessions.entry(session.to_string()).or_default();
        s.context.clear();
        s.context.extend_from_slice(context);
        s.drafted.clear();
        s.sampled = !sampling.is_greedy();
        s.done = false;
        Ok(())
    }

    fn next(&mut self, session: &str, max: usize) -> Result<DraftChunk> {
        let (cfg, end) = (self.cfg, &self.end_tokens);
        let s = draft_session(&mut self.sessions, session)?;
        let mut tokens = Vec::new();
        while !s.done && tokens.len() < max {
            let Some(t) = lookup(&s.context, &cfg) else {
                // Nothing matches now, and nothing drafted changes that.
                s.done = true;
                break;
            };
            s.context.push(t);
            s.drafted.push(t);
            tokens.push(t);
            s.done = end.contains(&t);
        }
        let probs = if s.sampled {
            vec![1.0; tokens.len()]
        } else {
            Vec::new()
        };
        let done = s.done;
        let pieces = (self.pieces)(&tokens)?;
        Ok(DraftChunk {
            tokens,
            pieces,
            probs,
            done,
        })
    }

    fn distribution(&mut self, session: &str, index: usize) -> Result<Vec<(u32, f32)>> {
        let s = draft_session(&mut self.sessions, session)?;
        let t = s.drafted.get(index).ok_or_else(|| {
            Error::invalid(format!(
                "draft token {index} asked for, {} drafted",
                s.drafted.len()
            ))
        })?;
        Ok(vec![(*t, 1.0)])
    }

    fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>> {
        (self.pieces)(tokens)
    }

    fn release(&mut self, session: &str) -> Result<()> {
        self.sessions.remove(session);
        Ok(())
    }
}

impl DraftHints for NgramDrafter {
    /// Guesses from a one-token match, where the drafter's own sizes start above one.
    fn guess_lookup(&self) -> Option<NgramConfig> {
        (self.cfg.min_n > 1).then_some(NgramConfig { min_n: 1, max_n: 1 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(cfg: NgramConfig) -> NgramDrafter {
        let pieces: PieceFn =
            Arc::new(|t: &[u32]| Ok(t.iter().map(|x| format!("<{x}>")).collect()));
        NgramDrafter::new(cfg, pieces, vec![99]).unwrap()
    }

    #[test]
    fn lookup_takes_the_longest_suffix_at_its_latest_occurrence() {
        let cfg = NgramConfig::default();
        // "5 6" occurs twice; the latest is followed by 8. "4 5 6" once, followed by 7: the longer match wins.
        assert_eq!(lookup(&[4, 5, 6, 7, 1, 5, 6, 8, 2, 4, 5, 6], &cfg), Some(7));
        assert_eq!(
            lookup_match(&[4, 5, 6, 7, 1, 5, 6, 8, 2, 4, 5, 6], &cfg),
            Some((7, 3))
        );
        assert_eq!(lookup(&[1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6], &cfg), Some(8));
        // Single tokens are below min_n; an empty or short context has nothing.
        assert_eq!(lookup(&[1, 2, 3, 1], &cfg), None);
        assert_eq!(lookup(&[], &cfg), None);
        assert_eq!(lookup(&[1, 1], &cfg), None);
        // Overlapping occurrences count: 1 1 1 -> 1.
        assert_eq!(lookup(&[1, 1, 1], &cfg), Some(1));
        assert_eq!(
            lookup(&[1, 2, 3, 1], &NgramConfig { min_n: 1, max_n: 2 }),
            Some(2)
        );
    }

    #[test]
    fn drafts_copy_runs_stop_at_an_end_token_and_when_nothing_matches() {
        let mut d = drafter(NgramConfig::default());
        let greedy = SamplingParams::default();
        // The prompt quotes "10 11 12 13 14 99 7"; the output so far ends with "10 11".
        d.begin("s", &[3, 10, 11, 12, 13, 14, 99, 7, 5, 10, 11], &greedy)
            .unwrap();
        let c = d.next("s", 2).unwrap();
        assert_eq!((c.tokens.as_slice(), c.done), (&[12, 13][..], false));
        assert_eq!(c.pieces, ["<12>", "<13>"]);
        assert!(c.probs.is_empty(), "greedy drafts carry no probabilities");
        let c = d.next("s", 10).unwrap();
        assert_eq!((c.tokens.as_slice(), c.done), (&[14, 99][..], true));
        assert!(d.next("s", 10).unwrap().tokens.is_empty());
        // A new begin starts over; a context with no repeat drafts nothing and says so.
        d.begin("s", &[1, 2, 3, 4], &greedy).unwrap();
        let c = d.next("s", 5).unwrap();
        assert!(c.tokens.is_empty() && c.done);
        d.release("s").unwrap();
        assert_eq!(d.next("s", 1).unwrap_err().kind, ErrorKind::NotFound);
    }

    #[test]
    fn sampled_drafts_are_point_masses() {
        let mut d = drafter(NgramConfig::default());
        let sampled = SamplingParams {
            temperature: 0.8,
            ..Default::default()
        };
        d.begin("s", &[7, 8, 9, 7, 8], &sampled).unwrap();
        let c = d.next("s", 3).unwrap();
        assert_eq!(c.tokens, [9, 7, 8]);
        assert_eq!(c.probs, [1.0, 1.0, 1.0]);
        assert_eq!(d.distribution("s", 1).unwrap(), [(7, 1.0)]);
        assert!(d.distribution("s", 3).is_err());
    }

    #[test]
    fn drafter_kinds_parse_and_print() {
        for k in [
            DrafterKind::Model,
            DrafterKind::Ngram,
            DrafterKind::ModelNgram,
        ] {
            assert_eq!(k.as_str().parse::<DrafterKind>().unwrap(), k);
        }
        assert_eq!(
            "eagle".parse::<DrafterKind>().unwrap_err().kind,
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn bad_sizes_are_refused() {
        let pieces: PieceFn = Arc::new(|_: &[u32]| Ok(Vec::new()));
        for (min_n, max_n) in [(0, 3), (4, 2), (2, 17)] {
            assert!(
                NgramDrafter::new(NgramConfig { min_n, max_n }, pieces.clone(), vec![]).is_err()
            );
        }
    }
}
