//! The PARSE loop on real engines: single-pass equivalence of the packed verification block, and the exact limits
//! of every mode, on tiny random models and on the shipped pair. The reference outputs come from
//! `parse_engine::generate_plain`, a plain decode loop independent of the PARSE loop.

mod common;

use std::path::Path;

use parse_core::{
    AcceptPolicy, DraftWindow, GenerationRequest, Mode, SegmenterConfig, Verdict, VerifyPlan,
};
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_engine::model::{Arch, ModelConfig};
use parse_engine::ops::RopeStyle;
use parse_engine::{Engine, Message, Model, PlainRequest, Tokenizer};
use rand::{Rng, SeedableRng};

fn reference_tokenizer() -> Tokenizer {
    Tokenizer::from_file(&common::tokenizer_path()).unwrap()
}

/// A tiny random qwen2-shaped model with the real vocabulary (so the real tokenizer and chat layout apply).
fn tiny_engine(seed: u64) -> Engine {
    let cfg = ModelConfig {
        arch: Arch::Qwen2,
        vocab_size: 151_936,
        hidden_size: 64,
        intermediate_size: 128,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        rms_eps: 1e-6,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        max_context: 512,
    };
    Engine::from_parts(
        Model::random(cfg, seed).unwrap(),
        reference_tokenizer(),
        1 << 30,
        Path::new("tiny"),
    )
}

#[test]
fn every_suffix_copy_equals_a_separate_pass() {
    let mut e = tiny_engine(21);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for trial in 0..6 {
        let cached = rng.random_range(1..40usize);
        let context: Vec<u32> = (0..cached).map(|_| rng.random_range(0..151_000)).collect();
        let pending: u32 = rng.random_range(0..151_000);
        let l = rng.random_range(1..20usize);
        let draft: Vec<u32> = (0..l).map(|_| rng.random_range(0..151_000)).collect();
        let mut boundaries: Vec<usize> = (1..l).filter(|_| rng.random_bool(0.3)).collect();
        boundaries.push(l);
        let suffix: Vec<u32> = (0..rng.random_range(1..6))
            .map(|_| rng.random_range(0..151_000))
            .collect();
        let plan = VerifyPlan::build(cached, pending, &draft, &boundaries, Some(&suffix)).unwrap();
        e.open_session("packed").unwrap();
        e.forward_causal("packed", &context, &[]).unwrap();
        let all: Vec<usize> = (0..plan.tokens.len()).collect();
        let packed = e
            .forward("packed", &plan.tokens, &plan.positions, &plan.mask, &all)
            .unwrap();
        e.release("packed").unwrap();
        let mut copy_start = 1 + l;
        for &b in &boundaries {
            let mut seq = vec![pending];
            seq.extend(&draft[..b]);
            seq.extend(&suffix);
            e.open_session("alone").unwrap();
            e.forward_causal("alone", &context, &[]).unwrap();
            let rows: Vec<usize> = (0..seq.len()).collect();
            let alone = e.forward_causal("alone", &seq, &rows).unwrap();
            e.release("alone").unwrap();
            // Draft rows up to the boundary and every row of the suffix copy: bitwise equal.
            for r in 0..=b {
                assert!(
                    packed.row(r) == alone.row(r),
                    "trial {trial}: draft row {r}"
                );
            }
            for u in 0..suffix.len() {
                assert!(
                    packed.row(copy_start + u) == alone.row(1 + b + u),
                    "trial {trial}: copy for b = {b}, row {u}"
                );
            }
            copy_start += suffix.len();
        }
    }
}

fn request(
    e: &Engine,
    prompt: &str,
    mode: Mode,
    tau: f32,
    verdict: Verdict,
    max: usize,
) -> GenerationRequest {
    let tok = e.tokenizer();
    GenerationRequest {
        session: "req".into(),
        prompt: tok.encode_chat(&[Message::user(prompt)]).unwrap(),
        max_new_tokens: max,
        mode,
        sampling: Default::default(),
        policy: AcceptPolicy {
            verdict,
            tau,
            exact_floor: true,
            ..Default::default()
        },
        segmenter: SegmenterConfig::default(),
        window: DraftWindow::default(),
        eos: tok.eos_ids().to_vec(),
        judge_suffix: tok.judge_suffix().unwrap(),
    }
}

fn plain_greedy(e: &mut Engine, prompt: &[u32], max: usize) -> Vec<u32> {
    let req = PlainRequest {
        prompt_tokens: prompt.to_vec(),
        max_new_tokens: max,
        sampling: Default::default(),
        stop: vec![],
    };
    parse_engine::generate_plain(e, "plain", &req, |_, _| {})
        .unwrap()
        .token_ids
}

fn run(target: &mut Engine, draft: &mut Engine, req: &GenerationRequest) -> parse_core::Outcome {
    let out = {
        let mut v = EngineVerifier::new(&mut *target);
        let mut d = EngineDrafter::new(&mut *draft);
        parse_core::generate(&mut d, &mut v, req, &mut |_, _| true).unwrap()
    };
    assert_eq!(target.sessions().count(), 0, "target session left open");
    assert_eq!(draft.sessions().count(), 0, "draft session left open");
    out
}

fn check_limits(
    target: &mut Engine,
    draft: &mut Engine,
    prompts: &[&str],
    max: usize,
    verdicts: &[Verdict],
) {
    for prompt in prompts {
        let base = request(target, prompt, Mode::Parse, 0.0, Verdict::Likelihood, max);
        let want_target = plain_greedy(target, &base.prompt, max);
        let want_draft = plain_greedy(draft, &base.prompt, max);
        let ts = run(
            target,
            draft,
            &GenerationRequest {
                mode: Mode::TokenSpec,
                ..base.clone()
            },
        );
        assert_eq!(ts.tokens, want_target, "token-spec, {prompt:?}");
        // Stochastic token-spec with top-k 1: every distribution is a point mass, so lossless speculative sampling
        // must reproduce greedy decoding exactly (this runs the sampled verification path end to end).
        let sampled = run(
            target,
            draft,
            &GenerationRequest {
                mode: Mode::TokenSpec,
                sampling: parse_core::SamplingParams {
                    temperature: 0.8,
                    top_k: 1,
                    top_p: 1.0,
                    seed: 7,
                    cache_salt: 0,
                },
                ..base.clone()
            },
        );
        assert_eq!(
            sampled.tokens, want_target,
            "sampled token-spec, {prompt:?}"
        );
        assert!(sampled.stats.verify_passes > 0);
        for &verdict in verdicts {
            for mode in [Mode::Parse, Mode::ParseTokenSpec] {
                let r = request(target, prompt, mode, 1.5, verdict, max);
                assert_eq!(
                    run(target, draft, &r).tokens,
                    want_target,
                    "{mode:?} {verdict:?} tau > 1, {prompt:?}"
                );
                let r = request(target, prompt, mode, 0.0, verdict, max);
                assert_eq!(
                    run(target, draft, &r).tokens,
                    want_draft,
                    "{mode:?} {verdict:?} tau = 0, {prompt:?}"
                );
            }
        }
    }
}

#[test]
fn limits_on_tiny_random_models() {
    let (mut target, mut draft) = (tiny_engine(1), tiny_engine(2));
    check_limits(
        &mut target,
        &mut draft,
        &common::PROMPTS[..3],
        24,
        &Verdict::ALL,
    );
}

#[test]
fn limits_on_the_real_pair() {
    let mut target = common::target().lock().unwrap_or_else(|e| e.into_inner());
    let mut draft = common::draft().lock().unwrap_or_else(|e| e.into_inner());
    check_limits(
        &mut target,
        &mut draft,
        &common::PROMPTS[..3],
        40,
        &[Verdict::Likelihood, Verdict::Relative, Verdict::Entropy],
    );
}

#[test]
fn a_paced_parse_request_lets_the_target_write_while_speculation_loses() {
    use parse_core::pace::{Costs, Pacing};
    use std::sync::Arc;
    let (mut target, mut draft) = (tiny_engine(1), tiny_engine(2));
    // tau = 0 keeps every draft: unpaced, the output is the draft model's.
    let mut r = request(
        &target,
        common::PROMPTS[0],
        Mode::ParseTokenSpec,
        0.0,
        Verdict::Relative,
        12,
    );
    r.window.adaptive = true;
    let want_target = plain_greedy(&mut target, &r.prompt, 12);
    assert_ne!(want_target, plain_greedy(&mut draft, &r.prompt, 12));
    // The pool's figures at this load say speculation costs far more per token than the target alone, and its
    // next probe is 15 tokens away: the request writes its 12 tokens alone, the target's own.
    let kind = "parse+token-spec/model";
    let costs = Arc::new(Costs::default());
    costs.record_spec(kind, 0, 1e6, 1, None);
    costs.record_alone(Some(kind), 0, 1.0, 1);
    let pacing = Pacing {
        costs: costs.clone(),
        kind: kind.into(),
        load: Arc::new(|| 1),
        off_at: None,
    };
    let out = {
        let mut v = EngineVerifier::new(&mut target);
        let mut d = EngineDrafter::new(&mut draft);
        parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap()
    };
    assert_eq!(out.tokens, want_target);
    // All but the first, which the target writes before any advice.
    assert_eq!(out.stats.paused_tokens, 11);
    assert_eq!(out.stats.draft_tokens_proposed, 0);
    assert!(out.stats.pauses >= 1);
    assert_eq!(target.sessions().count() + draft.sessions().count(), 0);
    // What it measured went back to the pool.
    assert!(costs.alone_ms(0).unwrap() > 1.0);
    // The same request with nothing known speculates (and, at tau = 0, keeps the draft's first tokens).
    let fresh = run(&mut target, &mut draft, &r);
    assert!(fresh.stats.draft_tokens_proposed > 0, "{:?}", fresh.stats);
}

/// One verification of `draft` after `prompt` (opened as a session), scored as `scoring` asks; the cache is cut
/// back afterwards.
fn verify_scored(
    v: &mut EngineVerifier<&mut Engine>,
    prompt: &[u32],
    draft: &[u32],
    scoring: parse_core::Scoring,
) -> parse_core::VerifyOutput {
    use parse_core::driver::Verifier;
    let cached = prompt.len() - 1;
    let plan = VerifyPlan::build(cached, prompt[cached], draft, &[draft.len()], None)
        .unwrap()
        .with_scoring(scoring);
    let out = v.verify("s", &plan).unwrap();
    v.truncate("s", cached).unwrap();
    out
}

#[test]
fn a_verification_scores_only_the_rows_asked_for_and_those_with_the_same_bits() {
    use parse_core::Scoring;
    use parse_core::driver::Verifier;
    let mut e = tiny_engine(33);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let prompt: Vec<u32> = (0..30).map(|_| rng.random_range(0..151_000)).collect();
    let mut v = EngineVerifier::new(&mut e);
    v.open("s", &prompt, &Default::default()).unwrap();
    let mut draft: Vec<u32> = (0..6).map(|_| rng.random_range(0..151_000)).collect();
    // Row 0 sees only the cache and the pending token: making the draft's first token its greedy one gives a row
    // that agrees, beside the random draft's rows that do not.
    draft[0] = verify_scored(&mut v, &prompt, &draft, Scoring::All).rows[0].argmax;
    let all = verify_scored(&mut v, &prompt, &draft, Scoring::All);
    assert!(
        all.rows
            .iter()
            .all(|r| r.top_prob > 0.0 && r.entropy >= 0.0)
    );
    let mismatches: Vec<usize> = (0..=draft.len())
        .filter(|&t| Scoring::Mismatches.scores(t, &draft, all.rows[t].argmax))
        .collect();
    assert!(
        !mismatches.is_empty() && !mismatches.contains(&0),
        "{mismatches:?}"
    );
    for scoring in [Scoring::Mismatches, Scoring::Greedy] {
        let out = verify_scored(&mut v, &prompt, &draft, scoring);
        assert_eq!(out.rows.len(), all.rows.len());
        for (t, (a, b)) in all.rows.iter().zip(&out.rows).enumerate() {
            assert_eq!(a.argmax, b.argmax, "{scoring:?} row {t}");
            if scoring.scores(t, &draft, a.argmax) {
                let bits = |r: &parse_core::RowScore| {
                    (r.prob.to_bits(), r.top_prob.to_bits(), r.entropy.to_bits())
                };
                assert_eq!(bits(a), bits(b), "{scoring:?} row {t}");
            } else {
                assert!(
                    b.prob.is_nan() && b.top_prob.is_nan() && b.entropy.is_nan(),
                    "{scoring:?} row {t}: {b:?}"
                );
            }
        }
    }
    v.release("s").unwrap();
}

/// Automatic prefix caching: a prompt that begins as a kept one takes those rows' keys and values instead of
/// computing them, and what follows has the same bits as without the cache (the target's session and the draft's);
/// prompts are kept and reused only within their `cache_salt` namespace, and within the byte budget.
#[test]
fn a_prompt_that_begins_as_a_kept_one_reuses_its_rows_with_the_same_bits() {
    use parse_core::SamplingParams;
    use parse_core::driver::Drafter;
    use parse_engine::drafter_verifier::OpenSteps;
    use parse_engine::steps::run_alone;
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..151_000)).collect() };
    let shared = tokens(37);
    let prompt = |tail: &[u32]| -> Vec<u32> { shared.iter().chain(tail).copied().collect() };
    let (first, second, third) = (prompt(&tokens(9)), prompt(&tokens(14)), prompt(&[]));
    let salted = SamplingParams {
        cache_salt: 7,
        ..Default::default()
    };
    // The next row's logits after opening `p` on `session`, and how many prompt rows the open reused.
    let open =
        |e: &mut Engine, session: &str, p: &[u32], s: &SamplingParams| -> (usize, Vec<u32>) {
            let mut v = EngineVerifier::new(&mut *e);
            let reused = run_alone(&mut v, OpenSteps::new(session, p, s)).unwrap();
            let logits = e.forward_causal(session, &p[p.len() - 1..], &[0]).unwrap();
            (reused, logits.row(0).iter().map(|x| x.to_bits()).collect())
        };
    let mut cold = tiny_engine(41);
    cold.set_prefix_budget(0);
    let mut warm = tiny_engine(41);
    assert_eq!(open(&mut warm, "a", &first, &Default::default()).0, 0);
    let (n, got) = open(&mut warm, "b", &second, &Default::default());
    assert_eq!(n, shared.len(), "the shared first tokens are reused");
    let (none, want) = open(&mut cold, "b", &second, &Default::default());
    assert_eq!(none, 0, "no budget, nothing kept");
    assert!(
        got == want,
        "the rows after a reused prefix have the bits of a full prefill"
    );
    // A prompt that is all prefix of a kept one: every cached row reused.
    let (n, got) = open(&mut warm, "c", &third, &Default::default());
    assert_eq!(n, third.len() - 1);
    assert!(got == open(&mut cold, "c", &third, &Default::default()).1);
    // Another namespace reuses nothing of the first, then its own.
    assert_eq!(open(&mut warm, "d", &second, &salted).0, 0);
    assert_eq!(open(&mut warm, "e", &first, &salted).0, shared.len());
    // The budget: room for one prompt of this length keeps the latest alone.
    let per_token = warm.config().kv_bytes_per_token();
    warm.set_prefix_budget(per_token * first.len());
    assert!(warm.sessions().prefix_bytes().1 <= 1);
    // The draft: a context that begins as a kept one drafts the same tokens as without the cache.
    let mut drafted = Vec::new();
    for e in [&mut tiny_engine(43), &mut {
        let mut c = tiny_engine(43);
        c.set_prefix_budget(0);
        c
    }] {
        let mut d = EngineDrafter::new(&mut *e);
        d.begin("x", &first, &Default::default()).unwrap();
        d.begin("y", &second, &Default::default()).unwrap();
        drafted.push(d.next("y", 6).unwrap().tokens);
        drafted.push(vec![e.sessions().prefix_bytes().1 as u32]);
    }
    assert_eq!(drafted[0], drafted[2]);
    assert_eq!(
        (drafted[1][0], drafted[3][0]),
        (2, 0),
        "the warm draft kept both contexts"
    );
}
