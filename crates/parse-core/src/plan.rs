//! The verification plan: one packed block that lets the target judge every prefix of a draft in one pass.
//!
//! The session's KV cache holds everything before the **pending** token (the last accepted token, not yet
//! processed), so `C = cached + 1` tokens precede the draft. The block is
//! `[pending] [d_0 .. d_{L-1}] [S for b_1] .. [S for b_k]`:
//!
//! | row | token | position | sees |
//! |---|---|---|---|
//! | 0 | pending | `C - 1` | the cache and itself |
//! | `1 + t` | `d_t` | `C + t` | the cache, pending and `d_0..=d_t` |
//! | suffix copy `i`, token `u` | `S[u]` | `C + b_i + u` | the cache, pending, `d_0..d_{b_i - 1}`, `S_i[0..=u]` |
//!
//! Row `t` (0 <= t < L) predicts `d_t`; row `L` predicts the token after the whole draft; the last row of suffix
//! copy `i` carries the judge's verdict on the prefix `d_0..d_{b_i - 1}`. The draft rows come first, so truncating
//! the cache to `cached + 1 + a` keeps exactly pending and the `a` accepted draft tokens and drops every suffix entry.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::mask::{BlockMask, MaskRow};
use crate::speculative::SampleCheck;

/// A packed verification block.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyPlan {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub mask: BlockMask,
    /// Rows `0..=L`: row `t < L` predicts `draft[t]`, row `L` the token after the draft.
    pub draft_rows: Range<usize>,
    /// The draft tokens (what rows `0..L` are expected to predict).
    pub draft: Vec<u32>,
    /// Segment boundaries `b_1 < .. < b_k = L`.
    pub boundaries: Vec<usize>,
    /// Last row of each suffix copy, one per boundary (empty when no suffix is used).
    pub suffix_rows: Vec<usize>,
    /// Stochastic acceptance (token-level speculation at temperature > 0); `None` for greedy and PARSE verdicts.
    pub sample: Option<SampleCheck>,
    /// Which draft rows the verifier scores beyond their greedy token ([`Scoring`]).
    pub scoring: Scoring,
}

/// Which rows of a verification the verifier scores (probabilities and entropy, [`RowScore`]) beyond their greedy
/// token. A score is a pass over the row's whole vocabulary (a softmax in `f64`: about 0.7 ms for the default
/// pair's 152k logits on one core), which a verdict reads only where it needs it: token-level rounds read none
/// (exact agreement), `relative` and `entropy` only the rows whose greedy token differs from the draft's, so a
/// short verification does not pay a vocabulary pass per row. Rows left unscored carry NaN. What is scored never changes a score, so the verdicts are the same bits whatever is asked.
///
/// [`RowScore`]: crate::policy::RowScore
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scoring {
    /// Every row (`likelihood` reads each draft token's probability; the default, and what older callers get).
    #[default]
    All,
    /// Only the draft rows whose greedy token is not the draft token (`relative` and `entropy` read no others).
    Mismatches,
    /// None: greedy tokens only (exact agreement).
    Greedy,
}

impl Scoring {
    /// Whether row `t` of a plan with draft `draft` is scored, given its greedy token `argmax`. The row after the
    /// draft (`t == draft.len()`) predicts no draft token: only [`Scoring::All`] scores it.
    pub fn scores(&self, t: usize, draft: &[u32], argmax: u32) -> bool {
        match self {
            Scoring::All => true,
            Scoring::Mismatches => draft.get(t).is_some_and(|&d| d != argmax),
            Scoring::Greedy => false,
        }
    }
}

impl VerifyPlan {
    /// Builds the block for a session with `cached` tokens in its KV cache, the `pending` token, a draft, its
    /// segment boundaries and an optional judge suffix.
    pub fn build(
        cached: usize,
        pending: u32,
        draft: &[u32],
        boundaries: &[usize],
        suffix: Option<&[u32]>,
    ) -> Result<Self> {
        let l = draft.len();
        if l == 0 {
            return Err(Error::invalid("empty draft"));
        }
        check_boundaries(boundaries, l)?;
        let suffix = suffix.filter(|s| !s.is_empty());
        let c = cached + 1;
        let mut tokens =
            Vec::with_capacity(1 + l + suffix.map_or(0, |s| s.len() * boundaries.len()));
        let mut positions = Vec::with_capacity(tokens.capacity());
        let mut rows = Vec::with_capacity(tokens.capacity());
        tokens.push(pending);
        positions.push(cached as u32);
        rows.push(MaskRow {
            cached,
            spans: vec![0..1],
        });
        for (t, &d) in draft.iter().enumerate() {
            tokens.push(d);
            positions.push((c + t) as u32);
            rows.push(MaskRow {
                cached,
                spans: vec![0..t + 2],
            });
        }
        let mut suffix_rows = Vec::new();
        if let Some(s) = suffix {
            for &b in boundaries {
                let start = tokens.len();
                for (u, &tok) in s.iter().enumerate() {
                    tokens.push(tok);
                    positions.push((c + b + u) as u32);
                    rows.push(MaskRow {
                        cached,
                        spans: vec![0..b + 1, start..start + u + 1],
                    });
                }
                suffix_rows.push(tokens.len() - 1);
            }
        }
        Ok(VerifyPlan {
            tokens,
            positions,
            mask: BlockMask::from_rows(rows),
            draft_rows: 0..l + 1,
            draft: draft.to_vec(),
            boundaries: boundaries.to_vec(),
            suffix_rows,
            sample: None,
            scoring: Scoring::All,
        })
    }

    /// Asks the verifier to score only the rows `scoring` names ([`Scoring`]).
    pub fn with_scoring(mut self, scoring: Scoring) -> Self {
        self.scoring = scoring;
        self
    }

    /// Asks the verifier for stochastic acceptance (see `speculative`); one entry per draft token.
    pub fn with_sample_check(mut self, check: SampleCheck) -> Result<Self> {
        let l = self.draft.len();
        if check.draft_probs.len() != l || check.uniforms.len() != l {
            return Err(Error::invalid(format!(
                "sample check needs {l} draft probabilities and uniforms"
            )));
        }
        self.sample = Some(check);
        Ok(self)
    }

    /// Rows whose logits the verdicts need: the draft rows, then the suffix ends.
    pub fn readout(&self) -> Vec<usize> {
        self.draft_rows
            .clone()
            .chain(self.suffix_rows.iter().copied())
            .collect()
    }
}

/// Boundaries must be strictly ascending, positive, and end at the draft's length.
pub fn check_boundaries(boundaries: &[usize], len: usize) -> Result<()> {
    if boundaries.last() != Some(&len) {
        return Err(Error::invalid(format!(
            "the last boundary must be the draft length {len}"
        )));
    }
    let mut prev = 0;
    for &b in boundaries {
        if b <= prev {
            return Err(Error::invalid(format!(
                "boundaries must be ascending and positive: {boundaries:?}"
            )));
        }
        prev = b;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_checked_layout() {
        // Cache of 5, pending 9, draft [20, 21, 22] with boundaries [2, 3], suffix [7, 8].
        let p = VerifyPlan::build(5, 9, &[20, 21, 22], &[2, 3], Some(&[7, 8])).unwrap();
        assert_eq!(p.tokens, vec![9, 20, 21, 22, 7, 8, 7, 8]);
        assert_eq!(p.positions, vec![5, 6, 7, 8, 8, 9, 9, 10]);
        let r = p.mask.rows();
        assert_eq!(
            r[0],
            MaskRow {
                cached: 5,
                spans: vec![0..1]
            }
        );
        assert_eq!(
            r[3],
            MaskRow {
                cached: 5,
                spans: vec![0..4]
            }
        );
        // Copy for b_1 = 2 sees pending, d_0, d_1 and itself.
        assert_eq!(
            r[4],
            MaskRow {
                cached: 5,
                spans: vec![0..3, 4..5]
            }
        );
        assert_eq!(
            r[5],
            MaskRow {
                cached: 5,
                spans: vec![0..3, 4..6]
            }
        );
        // Copy for b_2 = 3 sees the whole draft.
        assert_eq!(
            r[7],
            MaskRow {
                cached: 5,
                spans: vec![0..4, 6..8]
            }
        );
        assert_eq!(p.suffix_rows, vec![5, 7]);
        assert_eq!(p.readout(), vec![0, 1, 2, 3, 5, 7]);
        p.mask.validate(5, 8).unwrap();
    }

    #[test]
    fn without_suffix_and_bad_boundaries() {
        let p = VerifyPlan::build(0, 1, &[2, 3], &[2], None).unwrap();
        assert_eq!(p.tokens, vec![1, 2, 3]);
        assert_eq!(p.positions, vec![0, 1, 2]);
        assert!(p.suffix_rows.is_empty());
        assert!(VerifyPlan::build(0, 1, &[2, 3], &[1], None).is_err());
        assert!(VerifyPlan::build(0, 1, &[2, 3], &[2, 1, 2], None).is_err());
        assert!(VerifyPlan::build(0, 1, &[], &[], None).is_err());
    }
}
