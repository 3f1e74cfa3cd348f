//! Verdicts and acceptance: from one verification pass to the number of draft tokens kept.
//!
//! - `likelihood`: segment `i` scores the lowest probability the target gives any of its tokens (the mean is kept as
//!   a second figure).
//! - `judge`: segment `i` scores `p(yes) / (p(yes) + p(no))` at the end of its suffix copy.
//!
//! The accepted prefix is `b_j` for the largest `j` with `s_1 .. s_j >= tau` (a segment passes at any score when
//! `tau <= 0`); with the exact-match floor it is at least the number of leading draft tokens equal to the target's
//! greedy choice. `tau > 1` therefore accepts exactly the greedy agreement and `tau = 0` the whole draft.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::plan::VerifyPlan;
use crate::speculative::SampledRow;

/// The target's view of one draft row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowScore {
    /// The target's greedy token at this row.
    pub argmax: u32,
    /// The target's probability (temperature 1) of the draft token this row predicts; NaN for the row after the
    /// draft.
    pub prob: f32,
}

/// The judge's answer at the end of one suffix copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JudgeScore {
    pub yes: f32,
    pub no: f32,
}

/// What a verifier returns for a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyOutput {
    /// One per draft row (`L + 1`).
    pub rows: Vec<RowScore>,
    /// One per suffix copy (empty without a suffix).
    pub judge: Vec<JudgeScore>,
    /// The answer to the plan's sample check (`None` when the plan had none).
    pub sampled: Option<SampledRow>,
}

/// How segments are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Verdict {
    /// Lowest target probability of a segment's tokens.
    Likelihood,
    /// The target's yes/no answer to a verification suffix.
    Judge,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Likelihood => "likelihood",
            Verdict::Judge => "judge",
        }
    }
}

impl std::str::FromStr for Verdict {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "likelihood" => Ok(Verdict::Likelihood),
            "judge" => Ok(Verdict::Judge),
            other => Err(Error::invalid(format!(
                "unknown verdict `{other}` (likelihood or judge)"
            ))),
        }
    }
}

/// The acceptance policy of a request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AcceptPolicy {
    pub verdict: Verdict,
    pub tau: f32,
    /// Accept at least the exact-match length.
    pub exact_floor: bool,
}

impl Default for AcceptPolicy {
    fn default() -> Self {
        AcceptPolicy {
            verdict: Verdict::Likelihood,
            tau: 1e-3,
            exact_floor: true,
        }
    }
}

impl AcceptPolicy {
    pub fn validate(&self) -> Result<()> {
        if !self.tau.is_finite() || self.tau < 0.0 {
            return Err(Error::invalid(format!(
                "tau must be a finite number >= 0, got {}",
                self.tau
            )));
        }
        Ok(())
    }

    fn passes(&self, score: f32) -> bool {
        self.tau <= 0.0 || score >= self.tau
    }
}

/// The outcome of one verification.
#[derive(Debug, Clone, PartialEq)]
pub struct Acceptance {
    /// Draft tokens kept.
    pub accepted: usize,
    /// Segments passed before the first rejection.
    pub segments_accepted: usize,
    /// Leading draft tokens equal to the target's greedy choice.
    pub exact_match: usize,
    /// Score of each segment.
    pub scores: Vec<f32>,
    /// Mean token probability of each segment (likelihood's second figure).
    pub mean_probs: Vec<f32>,
}

/// Applies a policy to a verification pass.
pub fn decide(plan: &VerifyPlan, out: &VerifyOutput, policy: &AcceptPolicy) -> Result<Acceptance> {
    let l = plan.draft.len();
    if out.rows.len() != l + 1 {
        return Err(Error::internal(format!(
            "verifier returned {} rows for a draft of {l}",
            out.rows.len()
        )));
    }
    let exact_match = plan
        .draft
        .iter()
        .zip(&out.rows)
        .take_while(|(d, r)| r.argmax == **d)
        .count();
    let mut scores = Vec::with_capacity(plan.boundaries.len());
    let mut mean_probs = Vec::with_capacity(plan.boundaries.len());
    let mut start = 0;
    for (i, &b) in plan.boundaries.iter().enumerate() {
        let probs = &out.rows[start..b];
        let min = probs.iter().map(|r| r.prob).fold(f32::INFINITY, f32::min);
        mean_probs.push(probs.iter().map(|r| r.prob).sum::<f32>() / probs.len() as f32);
        let score = match policy.verdict {
            Verdict::Likelihood => min,
            Verdict::Judge => {
                let j = out.judge.get(i).ok_or_else(|| {
                    Error::internal("verifier returned no judge score for a segment")
                })?;
                let total = j.yes + j.no;
                if total > 0.0 { j.yes / total } else { 0.0 }
            }
        };
        scores.push(score);
        start = b;
    }
    let segments_accepted = scores.iter().take_while(|s| policy.passes(**s)).count();
    let by_verdict = if segments_accepted == 0 {
        0
    } else {
        plan.boundaries[segments_accepted - 1]
    };
    let accepted = if policy.exact_floor {
        by_verdict.max(exact_match)
    } else {
        by_verdict
    };
    Ok(Acceptance {
        accepted,
        segments_accepted,
        exact_match,
        scores,
        mean_probs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(argmax: &[u32], probs: &[f32]) -> VerifyOutput {
        VerifyOutput {
            rows: argmax
                .iter()
                .zip(probs)
                .map(|(a, p)| RowScore {
                    argmax: *a,
                    prob: *p,
                })
                .collect(),
            judge: vec![],
            sampled: None,
        }
    }

    #[test]
    fn first_rejected_segment_ends_acceptance() {
        let plan = VerifyPlan::build(3, 0, &[10, 11, 12, 13, 14], &[2, 4, 5], None).unwrap();
        let o = out(
            &[10, 99, 12, 13, 14, 15],
            &[0.9, 0.5, 1e-5, 0.8, 0.9, f32::NAN],
        );
        let p = AcceptPolicy {
            tau: 1e-3,
            ..Default::default()
        };
        let a = decide(&plan, &o, &p).unwrap();
        assert_eq!((a.accepted, a.segments_accepted, a.exact_match), (2, 1, 1));
        assert_eq!(a.scores, vec![0.5, 1e-5, 0.9]);
        // tau > 1: only the exact-match floor.
        let a = decide(&plan, &o, &AcceptPolicy { tau: 2.0, ..p }).unwrap();
        assert_eq!(a.accepted, 1);
        let a = decide(
            &plan,
            &o,
            &AcceptPolicy {
                tau: 2.0,
                exact_floor: false,
                ..p
            },
        )
        .unwrap();
        assert_eq!(a.accepted, 0);
        // tau = 0: everything.
        let a = decide(&plan, &o, &AcceptPolicy { tau: 0.0, ..p }).unwrap();
        assert_eq!((a.accepted, a.segments_accepted), (5, 3));
    }

    #[test]
    fn judge_scores_and_bad_policies() {
        let plan = VerifyPlan::build(0, 0, &[1, 2, 3], &[1, 3], Some(&[7])).unwrap();
        let mut o = out(&[5, 5, 5, 5], &[0.1; 4]);
        o.judge = vec![
            JudgeScore { yes: 0.6, no: 0.2 },
            JudgeScore { yes: 0.1, no: 0.3 },
        ];
        let p = AcceptPolicy {
            verdict: Verdict::Judge,
            tau: 0.5,
            exact_floor: true,
        };
        let a = decide(&plan, &o, &p).unwrap();
        assert_eq!((a.accepted, a.segments_accepted), (1, 1));
        assert!((a.scores[0] - 0.75).abs() < 1e-6);
        assert!(AcceptPolicy { tau: f32::NAN, ..p }.validate().is_err());
        assert!(AcceptPolicy { tau: -1.0, ..p }.validate().is_err());
        assert!("judge".parse::<Verdict>().is_ok() && "vibes".parse::<Verdict>().is_err());
    }
}
