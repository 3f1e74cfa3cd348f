//! Lossless speculative sampling (temperature > 0) for token-level speculation.
//!
//! The draft samples `x_i ~ q_i` (the request's sampling distribution over the draft's logits: temperature, top-k,
//! top-p). The target accepts `x_i` with probability `min(1, p_i(x_i) / q_i(x_i))`, where `p_i` is the same
//! transformation of the target's logits; at the first rejection it samples from the residual
//! `max(0, p_i - q_i) / Z`, and after a fully accepted draft from `p_L`. Each output token is then distributed
//! exactly as the target alone would sample it (Leviathan et al. 2023, Chen et al. 2023).
//!
//! Division of work, so that no vocabulary-sized vector crosses the network per token: the loop draws the uniforms
//! and sends them with the draft probabilities `q_i(x_i)` in the plan ([`SampleCheck`]); the verifier finds the first
//! rejection with [`first_rejection`] and returns the target's distribution at that one row ([`SampledRow`]); the
//! loop then asks the drafter for `q` at that index (only when a token was rejected) and draws the replacement.

use crate::error::{Error, Result};

/// What a verifier needs for stochastic acceptance, one entry per draft token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleCheck {
    /// `q_i(x_i)`: the draft's probability of its own token under the request's sampling distribution.
    pub draft_probs: Vec<f32>,
    /// Uniform draws in `[0, 1)`.
    pub uniforms: Vec<f32>,
}

/// The verifier's answer to a [`SampleCheck`].
#[derive(Debug, Clone, PartialEq)]
pub struct SampledRow {
    /// Draft tokens accepted (the first rejected index, or the draft length).
    pub accepted: usize,
    /// The target's sampling distribution at row `accepted` as `(token, probability)`, probabilities > 0.
    pub dist: Vec<(u32, f32)>,
}

/// A sparse probability distribution `(token, probability)`.
pub type Dist = [(u32, f32)];

/// The index of the first rejected draft token (the draft length when all pass), given `p_i(x_i)` for each row as
/// the verifier computes them. `target_prob(i)` is only called up to the first rejection.
pub fn first_rejection(
    check: &SampleCheck,
    mut target_prob: impl FnMut(usize) -> Result<f32>,
) -> Result<usize> {
    if check.draft_probs.len() != check.uniforms.len() {
        return Err(Error::invalid(
            "sample check: one draft probability and one uniform per draft token",
        ));
    }
    for (i, (&q, &u)) in check.draft_probs.iter().zip(&check.uniforms).enumerate() {
        if !(0.0..=1.0).contains(&q) || !(0.0..1.0).contains(&u) {
            return Err(Error::invalid(format!(
                "sample check: probability {q} or uniform {u} out of range"
            )));
        }
        let p = target_prob(i)?;
        // Accept with probability min(1, p / q): u < p / q, written without dividing by a zero q.
        if (u as f64) * (q as f64) >= p as f64 {
            return Ok(i);
        }
    }
    Ok(check.draft_probs.len())
}

/// Draws from `dist` with the uniform `u` (entries in the order given; the last one takes rounding leftovers).
pub fn sample_from(dist: &Dist, u: f64) -> Result<u32> {
    let total: f64 = dist.iter().map(|x| x.1 as f64).sum();
    if dist.is_empty() || total.is_nan() || total <= 0.0 {
        return Err(Error::internal("empty sampling distribution"));
    }
    let target = u * total;
    let mut acc = 0.0;
    for (t, p) in dist {
        acc += *p as f64;
        if target < acc {
            return Ok(*t);
        }
    }
    Ok(dist[dist.len() - 1].0)
}

/// Draws from the residual `max(0, p - q)` (normalised) with the uniform `u`. When `p` and `q` coincide (a residual
/// of zero mass, which a rejection makes impossible in exact arithmetic) it draws from `p`.
pub fn sample_residual(p: &Dist, q: &Dist, u: f64) -> Result<u32> {
    // Dense lookup of q: distributions over a whole vocabulary make a hash map the slow part of a round.
    let size = q.iter().map(|x| x.0 as usize + 1).max().unwrap_or(0);
    let mut dense = vec![0.0f32; size];
    for (t, pr) in q {
        dense[*t as usize] = *pr;
    }
    let residual: Vec<(u32, f32)> = p
        .iter()
        .map(|(t, pp)| {
            (
                *t,
                (pp - dense.get(*t as usize).copied().unwrap_or(0.0)).max(0.0),
            )
        })
        .filter(|x| x.1 > 0.0)
        .collect();
    if residual.is_empty() {
        return sample_from(p, u);
    }
    sample_from(&residual, u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_rule_and_draws() {
        let check = SampleCheck {
            draft_probs: vec![0.5, 0.5, 0.5],
            uniforms: vec![0.9, 0.1, 0.7],
        };
        // p >= q accepts whatever the draw; p = 0.3 < 0.5 * 0.7 rejects the third.
        let probs = [0.6, 0.3, 0.3];
        assert_eq!(first_rejection(&check, |i| Ok(probs[i])).unwrap(), 2);
        assert_eq!(first_rejection(&check, |_| Ok(0.0)).unwrap(), 0);
        assert_eq!(first_rejection(&check, |_| Ok(1.0)).unwrap(), 3);
        let bad = SampleCheck {
            draft_probs: vec![0.5],
            uniforms: vec![],
        };
        assert!(first_rejection(&bad, |_| Ok(1.0)).is_err());
        let p = [(3, 0.5), (1, 0.3), (2, 0.2)];
        assert_eq!(sample_from(&p, 0.0).unwrap(), 3);
        assert_eq!(sample_from(&p, 0.79).unwrap(), 1);
        assert_eq!(sample_from(&p, 0.99).unwrap(), 2);
        // Residual of p - q: only token 1 has more target than draft mass.
        let q = [(3, 0.7), (2, 0.3)];
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample_residual(&p, &q, u).unwrap(), 1);
        }
        assert!(sample_from(&[], 0.5).is_err());
    }
}
