//! The `parse.v1` gRPC API and its conversions to and from `parse-core` types, shared by the router, the workers and
//! the client SDK.
//!
//! Conversions from the wire validate what they read (lengths, ranges) and answer with `parse_core::Error`s of kind
//! `InvalidInput`, which servers return as INVALID_ARGUMENT.

use parse_core::plan::{Scoring, check_boundaries};
use parse_core::policy::{JudgeScore, RowScore, VerifyOutput};
use parse_core::speculative::{SampleCheck, SampledRow};
use parse_core::{
    BlockMask, Error as CoreError, ErrorKind, MaskRow, SamplingParams, SegmenterConfig, Stats,
    VerifyPlan,
};
use tonic::{Code, Status};

pub mod security;
pub mod serve;
pub mod telemetry;

#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("parse.v1");
}

/// The encoded descriptors of `parse.v1`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("parse_v1_descriptor");

/// A core error as a gRPC status, by meaning: the one mapping every service uses. INTERNAL details are logged here
/// (inside the caller's span, which names the request) and never returned: the client reads "internal error".
pub fn status_from_core(e: CoreError) -> Status {
    let code = match e.kind {
        ErrorKind::InvalidInput => Code::InvalidArgument,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorKind::Internal => {
            tracing::error!(error = %e.message, "internal error");
            return Status::internal("internal error");
        }
    };
    Status::new(code, e.message)
}

/// A gRPC status as a core error. Transport failures (UNAVAILABLE, UNKNOWN from a dropped connection) become
/// `Unavailable`, which the router treats as a lost worker.
pub fn core_from_status(s: &Status) -> CoreError {
    let kind = match s.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            ErrorKind::InvalidInput
        }
        Code::NotFound => ErrorKind::NotFound,
        Code::AlreadyExists => ErrorKind::AlreadyExists,
        Code::ResourceExhausted => ErrorKind::ResourceExhausted,
        Code::Unavailable | Code::Unknown | Code::Aborted => ErrorKind::Unavailable,
        // A worker that refuses this router's credentials (wrong cluster token or certificate) is of no use to
        // it: treated as lost, so the request goes to another worker, and the message says why.
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::Unavailable,
        Code::Cancelled => ErrorKind::Cancelled,
        Code::DeadlineExceeded => ErrorKind::DeadlineExceeded,
        _ => ErrorKind::Internal,
    };
    CoreError::new(kind, s.message().to_string())
}

/// A session id as the workers accept it.
pub fn check_session(s: &str) -> Result<(), Status> {
    if s.is_empty() || s.len() > 256 {
        return Err(Status::invalid_argument(
            "session id must be 1 to 256 bytes",
        ));
    }
    Ok(())
}

fn usize_of(v: u32) -> usize {
    v as usize
}

impl From<&SamplingParams> for v1::Sampling {
    fn from(p: &SamplingParams) -> Self {
        v1::Sampling {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: Some(p.top_p),
            seed: p.seed,
            cache_salt: p.cache_salt,
        }
    }
}

/// Sampling from the wire (absent: greedy).
pub fn sampling_from(s: Option<&v1::Sampling>) -> Result<SamplingParams, CoreError> {
    let p = match s {
        None => SamplingParams::default(),
        Some(s) => SamplingParams {
            temperature: s.temperature,
            top_k: usize_of(s.top_k),
            top_p: s.top_p.unwrap_or(1.0),
            seed: s.seed,
            cache_salt: s.cache_salt,
        },
    };
    p.validate()?;
    Ok(p)
}

impl From<&SegmenterConfig> for v1::Segmenter {
    fn from(c: &SegmenterConfig) -> Self {
        v1::Segmenter {
            min_tokens: Some(c.min_tokens as u32),
            max_tokens: Some(c.max_tokens as u32),
            lines: Some(c.lines),
            sentences: Some(c.sentences),
            statements: Some(c.statements),
        }
    }
}

/// Segmenter settings from the wire: unset fields keep `base`'s values.
pub fn segmenter_from(
    s: Option<&v1::Segmenter>,
    base: &SegmenterConfig,
) -> Result<SegmenterConfig, CoreError> {
    let mut c = base.clone();
    if let Some(s) = s {
        if let Some(v) = s.min_tokens {
            c.min_tokens = usize_of(v);
        }
        if let Some(v) = s.max_tokens {
            c.max_tokens = usize_of(v);
        }
        if let Some(v) = s.lines {
            c.lines = v;
        }
        if let Some(v) = s.sentences {
            c.sentences = v;
        }
        if let Some(v) = s.statements {
            c.statements = v;
        }
    }
    c.validate()?;
    Ok(c)
}

/// A plan on the wire.
pub fn verify_request(session: &str, plan: &VerifyPlan) -> v1::VerifyRequest {
    v1::VerifyRequest {
        session: session.to_string(),
        tokens: plan.tokens.clone(),
        positions: plan.positions.clone(),
        mask: plan
            .mask
            .rows()
            .iter()
            .map(|r| v1::MaskRow {
                cached: r.cached as u32,
                spans: r
                    .spans
                    .iter()
                    .flat_map(|s| [s.start as u32, s.end as u32])
                    .collect(),
            })
            .collect(),
        draft: plan.draft.clone(),
        boundaries: plan.boundaries.iter().map(|b| *b as u32).collect(),
        suffix_rows: plan.suffix_rows.iter().map(|b| *b as u32).collect(),
        sample: plan.sample.as_ref().map(|c| v1::SampleCheck {
            draft_probs: c.draft_probs.clone(),
            uniforms: c.uniforms.clone(),
        }),
        scoring: match plan.scoring {
            Scoring::All => v1::RowScoring::All,
            Scoring::Mismatches => v1::RowScoring::Mismatches,
            Scoring::Greedy => v1::RowScoring::Greedy,
        } as i32,
    }
}

/// A plan from the wire, checked for internal consistency (the engine checks the mask against its cache).
impl TryFrom<&v1::VerifyRequest> for VerifyPlan {
    type Error = CoreError;
    fn try_from(r: &v1::VerifyRequest) -> Result<Self, CoreError> {
        plan_from(r)
    }
}

/// The most rows one Verify block may hold (draft, pending token and judge suffixes); checked before anything is
/// allocated for the plan. A PARSE block is a few hundred rows at most.
pub const MAX_VERIFY_ROWS: usize = 4096;

fn plan_from(r: &v1::VerifyRequest) -> Result<VerifyPlan, CoreError> {
    let n = r.tokens.len();
    let l = r.draft.len();
    if n > MAX_VERIFY_ROWS {
        return Err(CoreError::invalid(format!(
            "a verify block holds at most {MAX_VERIFY_ROWS} rows, got {n}"
        )));
    }
    // A row attends to at most every block position: more ranges than that are not a mask.
    if let Some(m) = r.mask.iter().find(|m| m.spans.len() > 2 * (n + 1)) {
        return Err(CoreError::invalid(format!(
            "a mask row has {} span bounds for a block of {n}",
            m.spans.len()
        )));
    }
    if n == 0 || l == 0 || r.positions.len() != n || r.mask.len() != n || n < l + 1 {
        return Err(CoreError::invalid(format!(
            "inconsistent plan: {n} tokens, {} positions, {} mask rows, draft of {l}",
            r.positions.len(),
            r.mask.len()
        )));
    }
    let mut rows = Vec::with_capacity(n);
    for m in &r.mask {
        if m.spans.len() % 2 != 0 {
            return Err(CoreError::invalid("mask spans come in start/end pairs"));
        }
        rows.push(MaskRow {
            cached: usize_of(m.cached),
            spans: m
                .spans
                .chunks(2)
                .map(|p| usize_of(p[0])..usize_of(p[1]))
                .collect(),
        });
    }
    let boundaries: Vec<usize> = r.boundaries.iter().map(|b| usize_of(*b)).collect();
    check_boundaries(&boundaries, l)?;
    let suffix_rows: Vec<usize> = r.suffix_rows.iter().map(|b| usize_of(*b)).collect();
    if suffix_rows.iter().any(|s| *s >= n || *s <= l) {
        return Err(CoreError::invalid("suffix rows outside the block"));
    }
    if r.tokens[1..=l] != r.draft[..] {
        return Err(CoreError::invalid(
            "the draft must follow the pending token in the block",
        ));
    }
    let plan = VerifyPlan {
        tokens: r.tokens.clone(),
        positions: r.positions.clone(),
        mask: BlockMask::from_rows(rows),
        draft_rows: 0..l + 1,
        draft: r.draft.clone(),
        boundaries,
        suffix_rows,
        sample: None,
        scoring: match v1::RowScoring::try_from(r.scoring) {
            Ok(v1::RowScoring::All) => Scoring::All,
            Ok(v1::RowScoring::Mismatches) => Scoring::Mismatches,
            Ok(v1::RowScoring::Greedy) => Scoring::Greedy,
            Err(_) => {
                return Err(CoreError::invalid(format!(
                    "unknown row scoring {}",
                    r.scoring
                )));
            }
        },
    };
    match &r.sample {
        None => Ok(plan),
        Some(c) => plan.with_sample_check(SampleCheck {
            draft_probs: c.draft_probs.clone(),
            uniforms: c.uniforms.clone(),
        }),
    }
}

impl From<&VerifyOutput> for v1::VerifyResponse {
    fn from(o: &VerifyOutput) -> Self {
        v1::VerifyResponse {
            rows: o
                .rows
                .iter()
                .map(|r| v1::RowScore {
                    argmax: r.argmax,
                    prob: r.prob,
                    top_prob: r.top_prob,
                    entropy: r.entropy,
                })
                .collect(),
            judge: o
                .judge
                .iter()
                .map(|j| v1::JudgeScore {
                    yes: j.yes,
                    no: j.no,
                })
                .collect(),
            sampled: o.sampled.as_ref().map(|s| v1::SampledRow {
                accepted: s.accepted as u32,
                tokens: s.dist.iter().map(|x| x.0).collect(),
                probs: s.dist.iter().map(|x| x.1).collect(),
            }),
            // The worker adds its charge.
            charged_ms: 0.0,
        }
    }
}

/// A verifier's answer from the wire.
pub fn verify_output_from(r: v1::VerifyResponse) -> Result<VerifyOutput, CoreError> {
    let sampled = match r.sampled {
        None => None,
        Some(s) => Some(SampledRow {
            accepted: usize_of(s.accepted),
            dist: dist_from(s.tokens, s.probs)?,
        }),
    };
    Ok(VerifyOutput {
        rows: r
            .rows
            .into_iter()
            .map(|x| RowScore {
                argmax: x.argmax,
                prob: x.prob,
                top_prob: x.top_prob,
                entropy: x.entropy,
            })
            .collect(),
        judge: r
            .judge
            .into_iter()
            .map(|j| JudgeScore {
                yes: j.yes,
                no: j.no,
            })
            .collect(),
        sampled,
    })
}

/// A sparse distribution from parallel token/probability lists.
pub fn dist_from(tokens: Vec<u32>, probs: Vec<f32>) -> Result<Vec<(u32, f32)>, CoreError> {
    if tokens.len() != probs.len() {
        return Err(CoreError::internal(
            "distribution with unequal token and probability lists",
        ));
    }
    Ok(tokens.into_iter().zip(probs).collect())
}

impl From<&Stats> for v1::Stats {
    fn from(s: &Stats) -> Self {
        let u = |x: usize| x as u32;
        v1::Stats {
            mode: s.mode.clone(),
            prompt_tokens: u(s.prompt_tokens),
            output_tokens: u(s.output_tokens),
            draft_tokens_proposed: u(s.draft_tokens_proposed),
            draft_tokens_accepted: u(s.draft_tokens_accepted),
            segments_proposed: u(s.segments_proposed),
            segments_accepted: u(s.segments_accepted),
            target_passes: u(s.target_passes),
            verify_passes: u(s.verify_passes),
            extend_passes: u(s.extend_passes),
            target_positions: u(s.target_positions),
            target_passes_per_token: s.target_passes_per_token,
            target_positions_per_token: s.target_positions_per_token,
            draft_ms: s.draft_ms,
            verify_ms: s.verify_ms,
            extend_ms: s.extend_ms,
            prefill_ms: s.prefill_ms,
            total_ms: s.total_ms,
            tokens_per_s: s.tokens_per_s,
            draft_failovers: 0,
            target_failovers: 0,
            fell_back_to_target: false,
            draft_prefetch_hits: 0,
            draft_prefetch_misses: 0,
            paused_tokens: u(s.paused_tokens),
            pauses: u(s.pauses),
            copy_rounds: u(s.copy_rounds),
            token_rounds: u(s.token_rounds),
            guesses: u(s.guesses),
            guesses_right: u(s.guesses_right),
            cached_prompt_tokens: u(s.cached_prompt_tokens),
        }
    }
}

/// The status for a server task that did not finish: cancelled means the server is shutting down (UNAVAILABLE, so
/// that a client goes elsewhere); a panic is INTERNAL.
pub fn status_from_join(what: &str, e: tokio::task::JoinError) -> tonic::Status {
    if e.is_cancelled() {
        tonic::Status::unavailable(format!("{what}: the server is shutting down"))
    } else {
        status_from_core(CoreError::internal(format!("{what}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_stats_carry_the_pace_counters_and_the_cached_prompt_tokens() {
        let s = Stats {
            output_tokens: 100,
            paused_tokens: 40,
            pauses: 3,
            copy_rounds: 5,
            token_rounds: 7,
            guesses: 11,
            guesses_right: 4,
            cached_prompt_tokens: 6,
            ..Default::default()
        };
        let p = v1::Stats::from(&s);
        assert_eq!(
            (
                p.output_tokens,
                p.paused_tokens,
                p.pauses,
                p.copy_rounds,
                p.token_rounds,
                p.guesses,
                p.guesses_right,
                p.cached_prompt_tokens
            ),
            (100, 40, 3, 5, 7, 11, 4, 6)
        );
    }

    #[test]
    fn plans_round_trip_and_bad_plans_are_refused() {
        let plan = VerifyPlan::build(5, 9, &[20, 21, 22], &[2, 3], Some(&[7, 8]))
            .unwrap()
            .with_sample_check(SampleCheck {
                draft_probs: vec![0.5; 3],
                uniforms: vec![0.1; 3],
            })
            .unwrap();
        let wire = verify_request("s", &plan);
        assert_eq!(VerifyPlan::try_from(&wire).unwrap(), plan);
        // Which rows are scored travels too; a value this build does not know is refused.
        for scoring in [Scoring::Mismatches, Scoring::Greedy, Scoring::All] {
            let plan = plan.clone().with_scoring(scoring);
            assert_eq!(
                VerifyPlan::try_from(&verify_request("s", &plan)).unwrap(),
                plan
            );
        }
        let mut bad = wire.clone();
        bad.scoring = 7;
        let e = VerifyPlan::try_from(&bad).unwrap_err();
        assert!(e.message.contains("row scoring"), "{}", e.message);
        let mut bad = wire.clone();
        bad.positions.pop();
        assert_eq!(
            VerifyPlan::try_from(&bad).unwrap_err().kind,
            ErrorKind::InvalidInput
        );
        let mut bad = wire.clone();
        bad.boundaries = vec![1];
        assert!(VerifyPlan::try_from(&bad).is_err());
        let mut bad = wire.clone();
        bad.mask[0].spans.push(1);
        assert!(VerifyPlan::try_from(&bad).is_err());
        let mut bad = wire.clone();
        bad.draft[0] = 99;
        assert!(VerifyPlan::try_from(&bad).is_err());
        // Oversized blocks and masks are refused before anything is built from them.
        let mut big = wire.clone();
        big.tokens = vec![20; MAX_VERIFY_ROWS + 1];
        let e = VerifyPlan::try_from(&big).unwrap_err();
        assert!(e.message.contains("at most"), "{}", e.message);
        let mut bad = wire;
        bad.mask[1].spans = [0, 1].repeat(20);
        let e = VerifyPlan::try_from(&bad).unwrap_err();
        assert!(e.message.contains("span bounds"), "{}", e.message);
    }

    #[test]
    fn status_codes_by_meaning() {
        let s = status_from_core(CoreError::invalid("no"));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(core_from_status(&s).kind, ErrorKind::InvalidInput);
        assert_eq!(
            core_from_status(&Status::unavailable("gone")).kind,
            ErrorKind::Unavailable
        );
        let s = status_from_core(CoreError::new(ErrorKind::NotFound, "unknown session `x`"));
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(core_from_status(&s).kind, ErrorKind::NotFound);
        let s = status_from_core(CoreError::new(
            ErrorKind::AlreadyExists,
            "session `x` exists",
        ));
        assert_eq!(s.code(), Code::AlreadyExists);
        // INTERNAL details stay in the log.
        let s = status_from_core(CoreError::internal("cache index 7 out of range"));
        assert_eq!((s.code(), s.message()), (Code::Internal, "internal error"));
        let seg = segmenter_from(
            Some(&v1::Segmenter {
                min_tokens: Some(2),
                ..Default::default()
            }),
            &SegmenterConfig::default(),
        )
        .unwrap();
        assert_eq!((seg.min_tokens, seg.max_tokens), (2, 48));
        assert!(
            sampling_from(Some(&v1::Sampling {
                temperature: -1.0,
                ..Default::default()
            }))
            .is_err()
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn mask_row() -> impl Strategy<Value = v1::MaskRow> {
            (0u32..64, proptest::collection::vec(0u32..80, 0..12))
                .prop_map(|(cached, spans)| v1::MaskRow { cached, spans })
        }

        fn floats() -> impl Strategy<Value = f32> {
            prop_oneof![
                any::<f32>(),
                Just(f32::NAN),
                Just(f32::INFINITY),
                -1.0f32..2.0,
            ]
        }

        prop_compose! {
            fn wire_plan()(
                tokens in proptest::collection::vec(0u32..50, 0..40),
                positions in proptest::collection::vec(0u32..100, 0..40),
                mask in proptest::collection::vec(mask_row(), 0..40),
                draft in proptest::collection::vec(0u32..50, 0..40),
                boundaries in proptest::collection::vec(0u32..50, 0..8),
                suffix_rows in proptest::collection::vec(0u32..50, 0..8),
                sample in proptest::option::of((
                    proptest::collection::vec(floats(), 0..40),
                    proptest::collection::vec(floats(), 0..40),
                )),
                scoring in -1i32..4,
            ) -> v1::VerifyRequest {
                v1::VerifyRequest {
                    session: "s".into(),
                    tokens,
                    positions,
                    mask,
                    draft,
                    boundaries,
                    suffix_rows,
                    sample: sample.map(|(draft_probs, uniforms)| v1::SampleCheck { draft_probs, uniforms }),
                    scoring,
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Whatever a peer sends as a Verify plan: a plan that survives the checks, or INVALID_ARGUMENT; never
            /// a panic.
            #[test]
            fn any_wire_plan_is_a_plan_or_invalid_input(r in wire_plan()) {
                match VerifyPlan::try_from(&r) {
                    Ok(plan) => {
                        prop_assert_eq!(plan.tokens.len(), r.tokens.len());
                        // What it builds goes back on the wire as it came.
                        let again = verify_request("s", &plan);
                        prop_assert_eq!(again.tokens, r.tokens);
                    }
                    Err(e) => prop_assert_eq!(e.kind, ErrorKind::InvalidInput),
                }
            }

            #[test]
            fn any_wire_sampling_and_segmenter_are_checked(
                temperature in floats(), top_p in proptest::option::of(floats()), top_k in any::<u32>(),
                seed in any::<u64>(), cache_salt in any::<u64>(),
                min in proptest::option::of(any::<u32>()), max in proptest::option::of(any::<u32>()),
            ) {
                let s = v1::Sampling { temperature, top_k, top_p, seed, cache_salt };
                if let Ok(p) = sampling_from(Some(&s)) {
                    prop_assert!(p.temperature.is_finite() && p.temperature >= 0.0);
                    prop_assert!(p.top_p > 0.0 && p.top_p <= 1.0);
                    prop_assert_eq!(p.cache_salt, cache_salt);
                }
                let seg = v1::Segmenter { min_tokens: min, max_tokens: max, ..Default::default() };
                let _ = segmenter_from(Some(&seg), &Default::default());
            }
        }
    }
}
