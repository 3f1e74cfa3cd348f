//! Verdicts and acceptance: from one verification pass to the number of draft tokens kept.
//!
//! Every verdict scores each segment from the same single pass; a segment's score is the lowest score of its rows
//! (a row predicts one draft token), so one bad token rejects its segment. Per row, with `p` the target's
//! distribution there, `d` the draft's token and `a` the target's greedy token:
//!
//! - `likelihood`: `p(d)`. An absolute floor: it lets the draft's *plausible* mistakes through (measured on the
//!   default pair: at `tau = 1e-3` it returned the draft's answer on unseen problems).
//! - `relative`: `p(d) / p(a)`, the draft token's probability relative to the target's first choice. `tau` is the
//!   ratio a token needs: a confident target that disagrees rejects, an uncertain one lets a near-tie through.
//! - `entropy` (the FLy idea): `1` where `d = a`; at a mismatch, the target's flatness `1 - exp(-H(p))` (`exp(H)`
//!   is the number of choices the target hesitates between: `tau = 0.5` asks for at least 2, `0.75` for 4) if the
//!   draft agrees with the target's greedy choice on the next `lookahead` rows (the alternative did not derail
//!   it), else `0`.
//! - `judge`: segment `i` scores `p(yes) / (p(yes) + p(no))` at the end of its suffix copy (for strong targets; a
//!   1.5B target says yes to nearly everything).
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
    /// The target's probability of its greedy token.
    pub top_prob: f32,
    /// Entropy of the target's distribution at this row, in nats.
    pub entropy: f32,
}

impl RowScore {
    /// A row known only by its greedy token and the draft token's probability (tests, and verifiers that report
    /// no more): the greedy token's probability is taken as `prob` where they agree, and the entropy as zero.
    pub fn new(argmax: u32, prob: f32) -> Self {
        RowScore {
            argmax,
            prob,
            top_prob: prob,
            entropy: 0.0,
        }
    }
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
    /// Lowest ratio of a draft token's target probability to the target's top probability.
    Relative,
    /// Mismatches kept only where the target is flat and agrees again within the look-ahead window.
    Entropy,
    /// The target's yes/no answer to a verification suffix.
    Judge,
}

impl Verdict {
    /// The `tau` a request gets with this verdict when it names none.
    pub fn default_tau(&self) -> f32 {
        match self {
            Verdict::Likelihood => 1e-3,
            Verdict::Relative => 0.9,
            Verdict::Entropy => 0.9,
            Verdict::Judge => 0.5,
        }
    }

    pub const ALL: [Verdict; 4] = [
        Verdict::Likelihood,
        Verdict::Relative,
        Verdict::Entropy,
        Verdict::Judge,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Likelihood => "likelihood",
            Verdict::Relative => "relative",
            Verdict::Entropy => "entropy",
            Verdict::Judge => "judge",
        }
    }
}

impl std::str::FromStr for Verdict {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Verdict::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown verdict `{s}` (likelihood, relative, entropy or judge)"
                ))
            })
    }
}

/// The acceptance policy of a request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AcceptPolicy {
    pub verdict: Verdict,
    pub tau: f32,
    /// Accept at least the exact-match length.
    pub exact_floor: bool,
    /// Rows after a mismatch that must agree with the target (`entropy` verdict).
    pub lookahead: usize,
}

/// The `entropy` verdict's look-ahead window (FLy uses a few tokens).
pub const DEFAULT_LOOKAHEAD: usize = 3;

/// The default: `relative` at `tau = 0.9` (a draft token passes where the target gives it at least 0.9 of its
/// own first choice's probability): the loosest setting that kept `target`'s pass@1 on the HumanEval development
/// problems, where looser thresholds and the other verdicts lost problems (docs/decisions/default-mode.md).
impl Default for AcceptPolicy {
    fn default() -> Self {
        AcceptPolicy {
            verdict: Verdict::Relative,
            tau: 0.9,
            exact_floor: true,
            lookahead: DEFAULT_LOOKAHEAD,
        }
    }
}

impl AcceptPolicy {
    /// The policy for `verdict` (default: the default policy's) at `tau` (default: the verdict's own default).
    pub fn for_verdict(verdict: Option<Verdict>, tau: Option<f32>) -> Self {
        let d = Self::default();
        let verdict = verdict.unwrap_or(d.verdict);
        AcceptPolicy {
            verdict,
            tau: tau.unwrap_or_else(|| verdict.default_tau()),
            ..d
        }
    }

    pub fn with_exact_floor(self, exact_floor: bool) -> Self {
        AcceptPolicy {
            exact_floor,
            ..self
        }
    }

    pub fn with_lookahead(self, lookahead: usize) -> Self {
        AcceptPolicy { lookahead, ..self }
    }

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
    // The score of the row that predicts draft token `t` (token verdicts).
    let row_score = |t: usize| -> f32 {
        let (r, d) = (&out.rows[t], plan.draft[t]);
        match policy.verdict {
            Verdict::Relative if r.argmax == d => 1.0,
            Verdict::Relative if r.top_prob > 0.0 => (r.prob / r.top_prob).clamp(0.0, 1.0),
            Verdict::Entropy if r.argmax == d => 1.0,
            Verdict::Entropy => {
                let agrees = (t + 1..=t + policy.lookahead)
                    .all(|u| u < l && out.rows[u].argmax == plan.draft[u]);
                if agrees {
                    (1.0 - (-r.entropy.max(0.0)).exp()).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            }
            Verdict::Likelihood => r.prob,
            _ => 0.0,
        }
    };
    let mut start = 0;
    for (i, &b) in plan.boundaries.iter().enumerate() {
        let probs = &out.rows[start..b];
        mean_probs.push(probs.iter().map(|r| r.prob).sum::<f32>() / probs.len() as f32);
        let score = match policy.verdict {
            // A segment's score is its lowest row's; a row left unscored (NaN, `Scoring`) makes it NaN, which
            // passes no verdict (`f32::min` would drop it and pass the segment on its other rows).
            Verdict::Likelihood | Verdict::Relative | Verdict::Entropy => {
                (start..b).map(row_score).fold(f32::INFINITY, |lowest, s| {
                    if lowest.is_nan() || s.is_nan() {
                        f32::NAN
                    } else {
                        lowest.min(s)
                    }
                })
            }
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
                .map(|(a, p)| RowScore::new(*a, *p))
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
            verdict: Verdict::Likelihood,
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
            ..Default::default()
        };
        let a = decide(&plan, &o, &p).unwrap();
        assert_eq!((a.accepted, a.segments_accepted), (1, 1));
        assert!((a.scores[0] - 0.75).abs() < 1e-6);
        assert!(AcceptPolicy { tau: f32::NAN, ..p }.validate().is_err());
        assert!(AcceptPolicy { tau: -1.0, ..p }.validate().is_err());
        assert!("judge".parse::<Verdict>().is_ok() && "vibes".parse::<Verdict>().is_err());
        for v in Verdict::ALL {
            assert_eq!(v.as_str().parse::<Verdict>().unwrap(), v);
        }
    }

    /// A row from the target's distribution at it: greedy token, its probability, the draft token's, entropy.
    fn row(argmax: u32, top_prob: f32, prob: f32, entropy: f32) -> RowScore {
        RowScore {
            argmax,
            prob,
            top_prob,
            entropy,
        }
    }

    fn outcome(rows: Vec<RowScore>) -> VerifyOutput {
        VerifyOutput {
            rows,
            judge: vec![],
            sampled: None,
        }
    }

    fn policy(verdict: Verdict, tau: f32) -> AcceptPolicy {
        AcceptPolicy {
            verdict,
            tau,
            exact_floor: true,
            lookahead: 2,
        }
    }

    #[test]
    fn relative_likelihood_rejects_a_confident_target_and_passes_a_near_tie() {
        // Draft [10, 11 | 12, 13]; the draft's second token differs from the target's choice (90).
        let plan = VerifyPlan::build(0, 0, &[10, 11, 12, 13], &[2, 4], None).unwrap();
        let confident = outcome(vec![
            row(10, 0.9, 0.9, 0.4),
            row(90, 0.95, 0.01, 0.3),
            row(12, 0.9, 0.9, 0.4),
            row(13, 0.9, 0.9, 0.4),
            row(5, 0.9, f32::NAN, 0.4),
        ]);
        let a = decide(&plan, &confident, &policy(Verdict::Relative, 0.3)).unwrap();
        // 0.01 / 0.95 is far below 0.3: only the exact prefix survives.
        assert_eq!((a.accepted, a.segments_accepted, a.exact_match), (1, 0, 1));
        // Under a flat target the same token is a near-tie (0.30 against 0.32): both segments pass.
        let mut flat = confident.clone();
        flat.rows[1] = row(90, 0.32, 0.30, 2.5);
        let a = decide(&plan, &flat, &policy(Verdict::Relative, 0.3)).unwrap();
        assert_eq!((a.accepted, a.segments_accepted), (4, 2));
        assert!((a.scores[0] - 0.30 / 0.32).abs() < 1e-6);
        assert_eq!(a.scores[1], 1.0);
        // The limits: tau > 1 keeps the exact prefix only, tau = 0 the whole draft.
        assert_eq!(
            decide(&plan, &flat, &policy(Verdict::Relative, 1.5))
                .unwrap()
                .accepted,
            1
        );
        assert_eq!(
            decide(&plan, &confident, &policy(Verdict::Relative, 0.0))
                .unwrap()
                .accepted,
            4
        );
    }

    #[test]
    fn entropy_gate_keeps_a_flat_mismatch_only_when_the_draft_agrees_again() {
        // Draft [10, 11, 12, 13, 14] in one segment; row 1 is a mismatch (the target prefers 90).
        let plan = VerifyPlan::build(0, 0, &[10, 11, 12, 13, 14], &[5], None).unwrap();
        let rows: Vec<RowScore> = [10, 11, 12, 13, 14]
            .iter()
            .map(|d| row(*d, 0.8, 0.8, 0.5))
            .chain([row(7, 0.8, f32::NAN, 0.5)])
            .collect();
        // A flat target at the mismatch (exp(H) = 4 choices) and agreement on the next two rows: kept.
        let mut flat = outcome(rows.clone());
        flat.rows[1] = row(90, 0.3, 0.25, 4f32.ln());
        let a = decide(&plan, &flat, &policy(Verdict::Entropy, 0.5)).unwrap();
        assert_eq!(a.accepted, 5);
        assert!((a.scores[0] - 0.75).abs() < 1e-5, "{:?}", a.scores);
        // A confident target at the mismatch (exp(H) = 1.2): rejected, whatever follows.
        let mut confident = flat.clone();
        confident.rows[1] = row(90, 0.9, 0.05, 1.2f32.ln());
        let a = decide(&plan, &confident, &policy(Verdict::Entropy, 0.5)).unwrap();
        assert_eq!((a.accepted, a.exact_match), (1, 1));
        // Flat, but the draft diverges again two rows later: rejected.
        let mut diverges = flat.clone();
        diverges.rows[3] = row(91, 0.8, 0.1, 0.5);
        let a = decide(&plan, &diverges, &policy(Verdict::Entropy, 0.5)).unwrap();
        assert_eq!(a.accepted, 1);
        assert_eq!(a.scores[0], 0.0);
        // A mismatch too close to the draft's end for the window: rejected (nothing to agree with).
        let mut late = outcome(rows);
        late.rows[4] = row(92, 0.3, 0.25, 4f32.ln());
        let a = decide(&plan, &late, &policy(Verdict::Entropy, 0.5)).unwrap();
        assert_eq!((a.accepted, a.exact_match), (4, 4));
        // Limits.
        assert_eq!(
            decide(&plan, &flat, &policy(Verdict::Entropy, 1.5))
                .unwrap()
                .accepted,
            1
        );
        assert_eq!(
            decide(&plan, &diverges, &policy(Verdict::Entropy, 0.0))
                .unwrap()
                .accepted,
            5
        );
    }

    #[test]
    fn rows_left_unscored_decide_as_scored_rows_do_and_pass_no_verdict_that_reads_them() {
        use crate::plan::Scoring;
        // Draft 10..16 in segments [2, 4, 6]; the target agrees on rows 0, 2, 3 and 5 and differs on 1 and 4
        // (a near tie on 1, a confident target on 4); row 6 predicts the token after the draft.
        let draft = [10, 11, 12, 13, 14, 15];
        let plan = VerifyPlan::build(5, 0, &draft, &[2, 4, 6], None).unwrap();
        let full = vec![
            row(10, 0.9, 0.9, 0.4),
            row(99, 0.45, 0.4, 1.2),
            row(12, 0.8, 0.8, 0.7),
            row(13, 0.95, 0.95, 0.2),
            row(98, 0.9, 0.02, 0.5),
            row(15, 0.6, 0.6, 1.0),
            row(7, 0.7, f32::NAN, 0.9),
        ];
        // What a verifier returns for `scoring`: rows it does not score carry NaN.
        let reduced = |scoring: Scoring| {
            outcome(
                full.iter()
                    .enumerate()
                    .map(|(t, r)| {
                        if scoring.scores(t, &draft, r.argmax) {
                            *r
                        } else {
                            row(r.argmax, f32::NAN, f32::NAN, f32::NAN)
                        }
                    })
                    .collect(),
            )
        };
        let exact = AcceptPolicy {
            verdict: Verdict::Likelihood,
            tau: f32::INFINITY,
            exact_floor: true,
            ..Default::default()
        };
        let cases = [
            (Scoring::Greedy, exact),
            (Scoring::Mismatches, policy(Verdict::Relative, 0.9)),
            (Scoring::Mismatches, policy(Verdict::Relative, 0.5)),
            (Scoring::Mismatches, policy(Verdict::Relative, 0.01)),
            (Scoring::Mismatches, policy(Verdict::Entropy, 0.3)),
            (Scoring::Mismatches, policy(Verdict::Entropy, 0.6)),
        ];
        let mut accepted = Vec::new();
        for (scoring, p) in cases {
            let a = decide(&plan, &outcome(full.clone()), &p).unwrap();
            let b = decide(&plan, &reduced(scoring), &p).unwrap();
            assert_eq!(
                (a.accepted, a.segments_accepted, a.exact_match),
                (b.accepted, b.segments_accepted, b.exact_match),
                "{scoring:?} {p:?}"
            );
            accepted.push(a.accepted);
        }
        // The cases differ (the comparison above is not between rejections only): exact agreement keeps 1, the
        // near tie passes `relative` at 0.5 and everything passes at 0.01.
        assert_eq!(&accepted[..4], &[1, 1, 4, 6]);
        // Which rows are scored.
        assert!(Scoring::All.scores(6, &draft, 7));
        assert!(
            !Scoring::Mismatches.scores(0, &draft, 10) && Scoring::Mismatches.scores(1, &draft, 99)
        );
        assert!(
            !Scoring::Mismatches.scores(6, &draft, 7) && !Scoring::Greedy.scores(1, &draft, 99)
        );
        // A segment with an unscored row passes no verdict that reads it (`f32::min` alone would drop the NaN and
        // pass all six): only the exact-match floor keeps anything.
        let unscored = reduced(Scoring::Greedy);
        let a = decide(&plan, &unscored, &policy(Verdict::Likelihood, 1e-3)).unwrap();
        assert_eq!((a.accepted, a.segments_accepted), (1, 0));
        assert!(a.scores.iter().all(|s| s.is_nan()));
    }
}
