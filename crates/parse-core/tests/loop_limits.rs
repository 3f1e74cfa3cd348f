//! The loop against deterministic fake models: the exact limits of every mode, session hygiene and the sink's stop.
//!
//! The "target" continues a context with a fixed function of its last tokens; the "draft" agrees with it except at
//! about one position in five. Token 0 ends generation; a token divisible by 7 reads as a newline.

use std::collections::HashMap;

use parse_core::driver::{DraftChunk, DraftHints, Drafter, ExtendOutput, Verifier};
use parse_core::segmenter::{self, SegmenterConfig};
use parse_core::{
    AcceptPolicy, DraftWindow, GenerationRequest, JudgeScore, Mode, RowScore, SamplingParams,
    Source, Verdict, VerifyOutput, VerifyPlan, generate,
};

const EOS: u32 = 0;

fn target_next(ctx: &[u32]) -> u32 {
    if ctx.len() >= 70 {
        return EOS;
    }
    let n = ctx.len();
    let a = ctx[n - 1] as usize;
    let b = if n > 1 { ctx[n - 2] as usize } else { 3 };
    ((a * 31 + b * 17 + n * 7) % 49 + 1) as u32
}

fn draft_next(ctx: &[u32]) -> u32 {
    let t = target_next(ctx);
    if t != EOS && (ctx.iter().map(|x| *x as usize).sum::<usize>() + ctx.len()).is_multiple_of(5) {
        t % 49 + 1
    } else {
        t
    }
}

fn piece(t: u32) -> String {
    if t.is_multiple_of(7) {
        "\n".into()
    } else {
        format!(" w{t}")
    }
}

fn greedy(prompt: &[u32], next: fn(&[u32]) -> u32, max: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max {
        let t = next(&ctx);
        if t == EOS {
            break;
        }
        out.push(t);
        ctx.push(t);
    }
    out
}

#[derive(Default)]
struct FakeVerifier {
    caches: HashMap<String, Vec<u32>>,
    /// Every extension: tokens asked for, whether it was to stop at a segment's end, tokens written.
    extends: Vec<(usize, bool, usize)>,
    /// Shared with a drafter: the order of the two sides' first calls.
    events: Events,
}

type Events = std::rc::Rc<std::cell::RefCell<Vec<&'static str>>>;

impl Verifier for FakeVerifier {
    fn open(&mut self, s: &str, prompt: &[u32], _: &SamplingParams) -> parse_core::Result<usize> {
        self.events.borrow_mut().push("open");
        assert!(
            self.caches
                .insert(s.into(), prompt[..prompt.len() - 1].to_vec())
                .is_none()
        );
        Ok(0)
    }
    fn verify(&mut self, s: &str, plan: &VerifyPlan) -> parse_core::Result<VerifyOutput> {
        let cache = self.caches.get_mut(s).unwrap();
        assert_eq!(
            plan.positions[0] as usize,
            cache.len(),
            "plan built for another cache length"
        );
        plan.mask.validate(cache.len(), plan.tokens.len()).unwrap();
        let mut ctx = cache.clone();
        ctx.push(plan.tokens[0]);
        let mut rows = Vec::new();
        for t in 0..=plan.draft.len() {
            let argmax = target_next(&ctx);
            let prob = match plan.draft.get(t) {
                Some(d) if *d == argmax => 0.9,
                Some(_) => 1e-4,
                None => f32::NAN,
            };
            rows.push(RowScore {
                argmax,
                prob,
                top_prob: 0.9,
                entropy: if plan.draft.get(t) == Some(&argmax) {
                    0.4
                } else {
                    1.5
                },
            });
            if let Some(d) = plan.draft.get(t) {
                ctx.push(*d);
            }
        }
        // The judge says yes when the segment's tokens all agree with the target.
        let judge = plan
            .boundaries
            .iter()
            .take(plan.suffix_rows.len())
            .map(|&b| {
                let ok = rows[..b].iter().all(|r| r.prob > 0.5);
                JudgeScore {
                    yes: if ok { 0.8 } else { 0.2 },
                    no: if ok { 0.2 } else { 0.8 },
                }
            })
            .collect();
        cache.extend(&plan.tokens);
        Ok(VerifyOutput {
            rows,
            judge,
            sampled: None,
        })
    }
    fn extend(
        &mut self,
        s: &str,
        pending: u32,
        max: usize,
        seg: Option<&SegmenterConfig>,
    ) -> parse_core::Result<ExtendOutput> {
        let cache = self.caches.get_mut(s).unwrap();
        let mut out = ExtendOutput::default();
        let mut pieces = vec![piece(pending)];
        let mut last = pending;
        while out.tokens.len() < max.max(1) {
            cache.push(last);
            let t = target_next(cache);
            out.tokens.push(t);
            out.pieces.push(piece(t));
            pieces.push(piece(t));
            last = t;
            if t == EOS || seg.is_some_and(|c| segmenter::first_segment_end(&pieces, c).is_some()) {
                break;
            }
        }
        self.extends.push((max, seg.is_some(), out.tokens.len()));
        Ok(out)
    }
    fn truncate(&mut self, s: &str, len: usize) -> parse_core::Result<()> {
        let c = self.caches.get_mut(s).unwrap();
        assert!(len <= c.len());
        c.truncate(len);
        Ok(())
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.caches.remove(s).unwrap();
        Ok(())
    }
}

#[derive(Default)]
struct FakeDrafter {
    ctx: HashMap<String, Vec<u32>>,
    /// Hints to draft ahead ([`DraftHints::prefetch`]) received.
    prefetches: usize,
    /// Hints to draft ahead guessing the target's next token ([`DraftHints::prefetch_guessing`]): (context, tokens).
    guesses: Vec<(Vec<u32>, usize)>,
    /// Contexts of every `begin`.
    begun: Vec<Vec<u32>>,
    /// Contexts it was given to process beside the target ([`DraftHints::warm`]).
    warms: Vec<Vec<u32>>,
    events: Events,
}

impl Drafter for FakeDrafter {
    fn begin(&mut self, s: &str, context: &[u32], _: &SamplingParams) -> parse_core::Result<()> {
        self.events.borrow_mut().push("begin");
        self.begun.push(context.to_vec());
        self.ctx.insert(s.into(), context.to_vec());
        Ok(())
    }
    fn next(&mut self, s: &str, max: usize) -> parse_core::Result<DraftChunk> {
        let ctx = self.ctx.get_mut(s).unwrap();
        let mut c = DraftChunk::default();
        while c.tokens.len() < max {
            if ctx.last() == Some(&EOS) {
                c.done = true;
                break;
            }
            let t = draft_next(ctx);
            ctx.push(t);
            c.tokens.push(t);
            c.pieces.push(piece(t));
        }
        c.done |= ctx.last() == Some(&EOS);
        Ok(c)
    }
    fn distribution(&mut self, _: &str, _: usize) -> parse_core::Result<Vec<(u32, f32)>> {
        Err(parse_core::Error::invalid(
            "greedy fake keeps no distributions",
        ))
    }
    fn pieces(&mut self, tokens: &[u32]) -> parse_core::Result<Vec<String>> {
        Ok(tokens.iter().map(|t| piece(*t)).collect())
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.ctx.remove(s);
        Ok(())
    }
}

impl DraftHints for FakeDrafter {
    fn warm(&mut self, _: &str, context: &[u32], _: &SamplingParams) -> parse_core::Result<bool> {
        self.events.borrow_mut().push("warm");
        self.warms.push(context.to_vec());
        Ok(true)
    }
    fn prefetch(
        &mut self,
        _: &str,
        _: &[u32],
        _: &SamplingParams,
        _: usize,
    ) -> parse_core::Result<()> {
        self.prefetches += 1;
        Ok(())
    }
    fn prefetch_guessing(
        &mut self,
        _: &str,
        context: &[u32],
        _: &SamplingParams,
        tokens: usize,
    ) -> parse_core::Result<()> {
        self.guesses.push((context.to_vec(), tokens));
        Ok(())
    }
}

fn request(
    mode: Mode,
    tau: f32,
    verdict: Verdict,
    prompt: &[u32],
    max: usize,
) -> GenerationRequest {
    GenerationRequest {
        session: "s".into(),
        prompt: prompt.to_vec(),
        max_new_tokens: max,
        mode,
        sampling: SamplingParams::default(),
        policy: AcceptPolicy {
            verdict,
            tau,
            exact_floor: true,
            ..Default::default()
        },
        segmenter: SegmenterConfig {
            min_tokens: 2,
            max_tokens: 12,
            ..Default::default()
        },
        window: DraftWindow::default(),
        eos: vec![EOS],
        judge_suffix: vec![40, 41, 42],
    }
}

fn run(
    mode: Mode,
    tau: f32,
    verdict: Verdict,
    prompt: &[u32],
    max: usize,
) -> (parse_core::Outcome, Vec<(usize, Source)>) {
    let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
    let mut chunks = Vec::new();
    let out = generate(
        &mut d,
        &mut v,
        &request(mode, tau, verdict, prompt, max),
        &mut |t, s| {
            chunks.push((t.len(), s));
            true
        },
    )
    .unwrap();
    assert!(
        v.caches.is_empty() && d.ctx.is_empty(),
        "sessions left open"
    );
    (out, chunks)
}

const PROMPTS: [&[u32]; 3] = [&[5, 9, 13], &[2], &[44, 3, 8, 21, 30]];

#[test]
fn limits_hold_exactly_in_every_mode() {
    for prompt in PROMPTS {
        for max in [1, 7, 200] {
            let target = greedy(prompt, target_next, max);
            let draft = greedy(prompt, draft_next, max);
            if max == 200 {
                assert_ne!(target, draft, "the fake draft must disagree somewhere");
            }
            for verdict in Verdict::ALL {
                assert_eq!(
                    run(Mode::Target, 0.5, verdict, prompt, max).0.tokens,
                    target
                );
                assert_eq!(run(Mode::Draft, 0.5, verdict, prompt, max).0.tokens, draft);
                assert_eq!(
                    run(Mode::TokenSpec, 0.5, verdict, prompt, max).0.tokens,
                    target
                );
                for mode in [Mode::Parse, Mode::ParseTokenSpec] {
                    assert_eq!(
                        run(mode, 1.5, verdict, prompt, max).0.tokens,
                        target,
                        "{mode:?} tau > 1"
                    );
                    assert_eq!(
                        run(mode, 0.0, verdict, prompt, max).0.tokens,
                        draft,
                        "{mode:?} tau = 0"
                    );
                }
            }
        }
    }
}

#[test]
fn parse_accepts_clean_segments_and_cuts_at_the_first_bad_one() {
    let prompt = PROMPTS[0];
    let (out, chunks) = run(Mode::Parse, 1e-3, Verdict::Likelihood, prompt, 200);
    let s = &out.stats;
    // A bad draft token scores 1e-4 < tau, so every kept draft token agrees with the target: output = target.
    assert_eq!(out.tokens, greedy(prompt, target_next, 200));
    assert_eq!(out.finish_reason, parse_core::FinishReason::Eos);
    assert!(
        s.segments_accepted > 0 && s.segments_accepted < s.segments_proposed,
        "{s:?}"
    );
    assert!(s.draft_tokens_accepted > 0 && s.draft_tokens_accepted <= s.draft_tokens_proposed);
    assert!(s.verify_passes > 0 && s.extend_passes > 0);
    assert_eq!(s.target_passes, s.verify_passes + s.extend_passes);
    assert_eq!(s.output_tokens, out.tokens.len());
    assert!(s.target_passes_per_token < 1.0, "{s:?}");
    assert_eq!(chunks.iter().map(|c| c.0).sum::<usize>(), out.tokens.len());
    assert!(
        chunks.iter().any(|c| c.1 == Source::Draft) && chunks.iter().any(|c| c.1 == Source::Target)
    );
}

#[test]
fn the_sink_can_stop_generation_and_bad_requests_are_refused() {
    let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
    let mut seen = 0;
    let out = generate(
        &mut d,
        &mut v,
        &request(Mode::Parse, 1e-3, Verdict::Likelihood, PROMPTS[0], 200),
        &mut |t, _| {
            seen += t.len();
            seen < 10
        },
    )
    .unwrap();
    assert_eq!(out.finish_reason, parse_core::FinishReason::Stop);
    assert!(out.tokens.len() >= 10 && out.tokens.len() < 40);
    assert!(v.caches.is_empty() && d.ctx.is_empty());
    // The caller keeps the answer's first 10 tokens (a stop string it found there): the count and the figures per
    // token follow, the work done stays.
    let mut kept = out.clone();
    kept.stop_at(10);
    assert_eq!(kept.tokens, out.tokens[..10]);
    assert_eq!(kept.stats.output_tokens, 10);
    assert_eq!(kept.stats.target_passes, out.stats.target_passes);
    assert_eq!(
        kept.stats.draft_tokens_accepted,
        out.stats.draft_tokens_accepted
    );
    assert_eq!(
        kept.stats.target_passes_per_token,
        out.stats.target_passes as f64 / 10.0
    );
    let rate = out.stats.tokens_per_s / out.tokens.len() as f64 * 10.0;
    assert!(
        (kept.stats.tokens_per_s - rate).abs() <= 1e-9 * rate.max(1.0),
        "{kept:?}"
    );
    let mut all = out.clone();
    all.stop_at(out.tokens.len() + 5);
    assert_eq!(all, out);
    // A stop string found in the round that reached the budget: the stop string came first.
    let mut budget = out.clone();
    budget.finish_reason = parse_core::FinishReason::Length;
    budget.stop_at(out.tokens.len());
    assert_eq!(budget.finish_reason, parse_core::FinishReason::Stop);
    for bad in [
        GenerationRequest {
            prompt: vec![],
            ..request(Mode::Parse, 0.1, Verdict::Likelihood, &[1], 5)
        },
        GenerationRequest {
            max_new_tokens: 0,
            ..request(Mode::Parse, 0.1, Verdict::Likelihood, &[1], 5)
        },
        request(Mode::Parse, f32::NAN, Verdict::Likelihood, &[1], 5),
        request(Mode::Parse, -0.5, Verdict::Likelihood, &[1], 5),
        GenerationRequest {
            judge_suffix: vec![],
            ..request(Mode::Parse, 0.1, Verdict::Judge, &[1], 5)
        },
        GenerationRequest {
            sampling: SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
            ..request(Mode::Parse, 0.1, Verdict::Likelihood, &[1], 5)
        },
    ] {
        let err = generate(&mut d, &mut v, &bad, &mut |_, _| true).unwrap_err();
        assert_eq!(err.kind, parse_core::ErrorKind::InvalidInput, "{bad:?}");
    }
}

/// Each token-level round hints that the next one may be drafted during its verification from the context and its
/// draft, the target's next token guessed ([`DraftHints::prefetch_guessing`]); where the draft was accepted whole, the
/// next round begins at that context and the target's token. No hint asks for tokens past the output's end, none
/// follows a draft that ends the output, and the output is the target's.
#[test]
fn token_level_rounds_hint_the_next_draft_with_the_targets_token_guessed() {
    let mut taken = 0;
    for (prompt, max) in [(PROMPTS[0], 200), (PROMPTS[2], 23)] {
        for mode in [Mode::TokenSpec, Mode::ParseTokenSpec] {
            let mut r = request(mode, 1.5, Verdict::Likelihood, prompt, max);
            r.window.adaptive = false;
            let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
            let out = generate(&mut d, &mut v, &r, &mut |_, _| true).unwrap();
            assert_eq!(out.tokens, greedy(prompt, target_next, max), "{mode:?}");
            assert!(!d.guesses.is_empty(), "{mode:?}");
            for (context, tokens) in &d.guesses {
                assert!(context.starts_with(prompt) && *tokens > 0, "{mode:?}");
                let written = context.len() - prompt.len();
                assert!(written + 1 + tokens <= max, "{mode:?}: past the end");
                assert!(!context.contains(&EOS), "{mode:?}: after the end");
                let next = d
                    .begun
                    .iter()
                    .any(|b| b.len() == context.len() + 1 && b.starts_with(context));
                taken += usize::from(next);
            }
        }
    }
    assert!(taken > 0, "no round began where a hint guessed");
}

/// A probe round (speculation measured again while it loses) drafts nothing ahead: a pause most likely follows, and
/// the draft read ahead would be thrown away. Speculation that pays drafts ahead as before.
#[test]
fn a_probe_round_does_not_draft_ahead() {
    use parse_core::pace::{Costs, Pacing};
    use std::sync::Arc;
    let kind = "parse/model";
    let mut r = request(Mode::Parse, 0.5, Verdict::Likelihood, PROMPTS[0], 40);
    r.window.adaptive = true;
    let paced = |spec_ms: f64, alone_ms: f64| {
        let costs = Arc::new(Costs::default());
        costs.record_spec(kind, 0, 16.0 * spec_ms, 16, None);
        costs.record_alone(Some(kind), 0, 16.0 * alone_ms, 16);
        Pacing {
            costs,
            kind: kind.into(),
            load: Arc::new(|| 1),
            off_at: None,
        }
    };
    let go = |pacing: Pacing| {
        let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
        let out = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();
        assert_eq!(out.tokens, greedy(PROMPTS[0], target_next, 40));
        (out.stats, d.prefetches)
    };
    // Speculation at 10 ms/token against the target's 100: every round speculates and drafts ahead.
    let (stats, prefetches) = go(paced(10.0, 100.0));
    assert_eq!(stats.paused_tokens, 0, "{stats:?}");
    assert!(prefetches > 0, "{stats:?}");
    // At 1e6 ms/token against 100, with 16 tokens already written alone: a probe is due at once. The request
    // makes that probe (its first round), then pauses, and never drafts ahead.
    let (stats, prefetches) = go(paced(1e6, 100.0));
    assert!(
        stats.draft_tokens_proposed > 0,
        "the probe drafted: {stats:?}"
    );
    assert!(stats.paused_tokens > 0, "{stats:?}");
    assert_eq!(prefetches, 0, "{stats:?}");
}

/// Where a request drafts from its start, its drafter is given the prompt before the target's prefill (to process
/// it beside the target, on a draft worker of its own), once; where it writes alone first, or never drafts, it is
/// not. The output is the target's either way.
#[test]
fn the_draft_gets_the_prompt_before_the_targets_prefill_where_the_request_drafts_from_its_start() {
    use parse_core::pace::{Costs, Pacing};
    use std::sync::Arc;
    let go = |mode: Mode, pacing: Option<Pacing>| {
        let events = Events::default();
        let mut d = FakeDrafter {
            events: events.clone(),
            ..Default::default()
        };
        let mut v = FakeVerifier {
            events: events.clone(),
            ..Default::default()
        };
        let mut r = request(mode, 0.5, Verdict::Likelihood, PROMPTS[0], 40);
        r.window.adaptive = pacing.is_some();
        let pacing = pacing.unwrap_or_else(|| Pacing::alone("fixed"));
        let out = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();
        let want = if mode == Mode::Draft {
            greedy(PROMPTS[0], draft_next, 40)
        } else {
            greedy(PROMPTS[0], target_next, 40)
        };
        assert_eq!(out.tokens, want, "{mode:?}");
        let events = events.borrow().clone();
        (d.warms, events)
    };
    for mode in [Mode::TokenSpec, Mode::Parse, Mode::ParseTokenSpec] {
        let (warms, events) = go(mode, None);
        assert_eq!(warms, vec![PROMPTS[0].to_vec()], "{mode:?}");
        assert_eq!(events[..2], ["warm", "open"], "{mode:?}: {events:?}");
    }
    for mode in [Mode::Target, Mode::Draft] {
        let (warms, _) = go(mode, None);
        assert!(warms.is_empty(), "{mode:?}");
    }
    // Paced: speculation at 10 ms/token against the target's 100 drafts from the start; at 1e6 against 100, with
    // its last probe just made, the request writes alone first, and its drafter catches up when (if) it drafts.
    let kind = "parse/model";
    let paced = |spec_ms: f64| {
        let costs = Arc::new(Costs::default());
        costs.record_spec(kind, 0, 16.0 * spec_ms, 16, None);
        costs.record_alone(Some(kind), 0, 16.0 * 100.0, 16);
        Pacing {
            costs,
            kind: kind.into(),
            load: Arc::new(|| 1),
            off_at: None,
        }
    };
    let (warms, events) = go(Mode::Parse, Some(paced(10.0)));
    assert_eq!(warms, vec![PROMPTS[0].to_vec()]);
    assert_eq!(events[..2], ["warm", "open"], "{events:?}");
    let (warms, _) = go(Mode::Parse, Some(losing_by_far(kind)));
    assert!(warms.is_empty());
}

/// A pool where speculation of `kind` loses to the target (100 ms/token) by far and its last probe was just made: a
/// request of that kind pauses for the longest and makes no probe for thousands of tokens.
fn losing_by_far(kind: &str) -> parse_core::pace::Pacing {
    use parse_core::pace::{Costs, Pacing};
    use std::sync::Arc;
    let costs = Arc::new(Costs::default());
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    costs.record_spec(kind, 0, 16.0 * 1e6, 16, Some(0.0));
    Pacing {
        costs,
        kind: kind.into(),
        load: Arc::new(|| 1),
        off_at: None,
    }
}

/// A pause ends where its last call stops at a segment's end; what is left of it is not written one segment per
/// call.
#[test]
fn a_pause_ends_at_the_first_segment_end_of_its_last_call() {
    let kind = "parse/model";
    let mut r = request(Mode::Parse, 0.5, Verdict::Likelihood, PROMPTS[0], 60);
    r.window.adaptive = true;
    // Speculation loses by far and its last probe was just made: every pause is of the longest length.
    let pacing = losing_by_far(kind);
    let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
    let out = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();
    assert_eq!(out.tokens, greedy(PROMPTS[0], target_next, 60));
    // Every token but the first, which the target writes before any advice.
    assert_eq!(
        out.stats.paused_tokens,
        out.tokens.len() - 1,
        "{:?}",
        out.stats
    );
    // Some last call stopped at a segment's end before its length (else this checks nothing)...
    assert!(
        v.extends.iter().any(|&(max, seg, n)| seg && n < max),
        "{:?}",
        v.extends
    );
    // ...and after each, a new pause began with a call that does not stop at a segment's end.
    for w in v.extends.windows(2) {
        if w[0].1 && w[0].2 < w[0].0 {
            assert!(!w[1].1, "{:?}", v.extends);
        }
    }
}

/// A paced request writes its first token on its own, by the target, as `target` mode does, so that its text goes
/// out after one step of the target, whether the request then pauses (the pause goes on in calls of 16) or
/// speculates (a first round would hold it until a draft was written and verified). The output is the target's.
#[test]
fn a_paced_request_streams_its_first_token_after_one_step_of_the_target() {
    for mode in [Mode::Parse, Mode::ParseTokenSpec, Mode::TokenSpec] {
        for pausing in [true, false] {
            // Above 1, PARSE rounds keep only what the target would write (DESIGN.md's limits).
            let mut r = request(mode, 1.5, Verdict::Likelihood, PROMPTS[0], 60);
            r.window.adaptive = true;
            let (mut d, mut v) = (FakeDrafter::default(), FakeVerifier::default());
            let mut chunks = Vec::new();
            let sink = &mut |t: &[u32], s| {
                chunks.push((t.len(), s));
                true
            };
            let kind = format!("{}/model", mode.as_str());
            // Speculation that loses by far pauses at once; a fresh pool speculates from the start.
            let pacing = if pausing {
                losing_by_far(&kind)
            } else {
                parse_core::pace::Pacing::alone(mode.as_str())
            };
            let out = parse_core::generate_paced(&mut d, &mut v, &r, sink, pacing).unwrap();
            let case = format!("{mode:?}, pausing {pausing}");
            assert_eq!(out.tokens, greedy(PROMPTS[0], target_next, 60), "{case}");
            assert_eq!(
                chunks.first(),
                Some(&(1, Source::Target)),
                "{case}: {chunks:?}"
            );
            assert_eq!(
                v.extends.first().map(|e| e.0),
                Some(1),
                "{case}: {:?}",
                v.extends
            );
            assert!(
                chunks[1..].iter().any(|&(n, _)| n > 1),
                "{case}: {chunks:?}"
            );
            if pausing {
                assert_eq!(
                    out.stats.paused_tokens + 1,
                    out.tokens.len(),
                    "{case}: {:?}",
                    out.stats
                );
            } else {
                // It went on speculating: the drafter's tokens made up part of the output.
                assert!(
                    out.stats.draft_tokens_accepted > 0,
                    "{case}: {:?}",
                    out.stats
                );
                assert!(
                    chunks[1..].iter().any(|&(_, s)| s == Source::Draft),
                    "{case}: {chunks:?}"
                );
            }
        }
    }
}

/// A drafter that copies as well as drafts ([`DraftHints::rest_lookup`]): the fake draft model, and prompt lookup of
/// 1-2 tokens while it rests.
struct Copying(FakeDrafter);

impl Drafter for Copying {
    fn begin(&mut self, s: &str, context: &[u32], p: &SamplingParams) -> parse_core::Result<()> {
        self.0.begin(s, context, p)
    }
    fn next(&mut self, s: &str, max: usize) -> parse_core::Result<DraftChunk> {
        self.0.next(s, max)
    }
    fn distribution(&mut self, s: &str, i: usize) -> parse_core::Result<Vec<(u32, f32)>> {
        self.0.distribution(s, i)
    }
    fn pieces(&mut self, tokens: &[u32]) -> parse_core::Result<Vec<String>> {
        self.0.pieces(tokens)
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.0.release(s)
    }
}

impl DraftHints for Copying {
    fn rest_lookup(&self) -> Option<parse_core::NgramConfig> {
        Some(parse_core::NgramConfig { min_n: 1, max_n: 2 })
    }
}

/// While the draft model rests, a drafter that copies gets PARSE rounds of copies, verified as any draft (here by
/// exact agreement, so the output is the target's), unless copies lose to the target: then none is made until a
/// probe is due. Under load, only where the context's end repeats at least `LOADED_COPY_MATCH` tokens (this
/// output never does: its tokens follow their positions).
#[test]
fn copy_rounds_fill_the_models_pauses_unless_they_lose() {
    use parse_core::pace::{Costs, Pacing, load_level};
    use std::sync::Arc;
    let kind = "parse/model";
    let mut r = request(Mode::Parse, 1e9, Verdict::Likelihood, PROMPTS[2], 60);
    r.window.adaptive = true;
    let run = |copies_lose: bool, load: usize| {
        // The model loses by far and its last probe was just made: the whole output is one long pause.
        let level = load_level(load);
        let costs = Arc::new(Costs::default());
        costs.record_alone(None, level, 16.0 * 100.0, 16);
        costs.record_spec(kind, level, 16.0 * 1e6, 16, Some(0.0));
        if copies_lose {
            costs.record_spec(&format!("{kind} copies"), level, 16.0 * 1e6, 16, Some(0.0));
        }
        let pacing = Pacing {
            costs,
            kind: kind.into(),
            load: Arc::new(move || load),
            off_at: None,
        };
        let (mut d, mut v) = (Copying(FakeDrafter::default()), FakeVerifier::default());
        let out = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();
        assert_eq!(out.tokens, greedy(PROMPTS[2], target_next, 60));
        out.stats
    };
    let stats = run(false, 1);
    assert!(stats.copy_rounds > 0, "{stats:?}");
    assert_eq!(stats.verify_passes, stats.copy_rounds, "{stats:?}");
    assert!(
        stats.draft_tokens_proposed >= stats.copy_rounds,
        "{stats:?}"
    );
    let stats = run(true, 1);
    assert_eq!(stats.copy_rounds, 0, "{stats:?}");
    assert_eq!(stats.verify_passes, 0, "{stats:?}");
    // At 8 requests copies that do not lose are not made either where no long quote goes on.
    let stats = run(false, 8);
    assert_eq!(stats.copy_rounds, 0, "{stats:?}");
    assert_eq!(stats.verify_passes, 0, "{stats:?}");
}

/// In `parse+token-spec`, a request whose model rests drafts as one with the prompt-lookup drafter does: the same
/// copies, verified in the same passes (a PARSE round of copies, then token-level rounds of copies to the segment's
/// end where the copy was cut short or nothing matched), and the target's output.
#[test]
fn a_request_whose_model_rests_drafts_as_the_lookup_drafter() {
    use parse_core::{NgramConfig, NgramDrafter, PieceFn};
    use std::sync::Arc;
    let kind = "parse+token-spec/model";
    let prompt = PROMPTS[2];
    let mut r = request(Mode::ParseTokenSpec, 0.9, Verdict::Relative, prompt, 60);
    // The model loses by far and its last probe was just made: the whole output is one long pause of copy rounds.
    let pacing = losing_by_far(kind);
    r.window.adaptive = true;
    let (mut d, mut v) = (Copying(FakeDrafter::default()), FakeVerifier::default());
    let rested = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();

    r.window.adaptive = false;
    let pieces: PieceFn = Arc::new(|t: &[u32]| Ok(t.iter().map(|&t| piece(t)).collect()));
    let mut lookup =
        NgramDrafter::new(NgramConfig { min_n: 1, max_n: 2 }, pieces, vec![EOS]).unwrap();
    let mut v = FakeVerifier::default();
    let copied = generate(&mut lookup, &mut v, &r, &mut |_, _| true).unwrap();

    let target = greedy(prompt, target_next, 60);
    assert_eq!(rested.tokens, target);
    assert_eq!(copied.tokens, target);
    let (a, b) = (&rested.stats, &copied.stats);
    assert!(
        a.copy_rounds > 0 && a.verify_passes > a.copy_rounds,
        "{a:?}"
    );
    // One pause; the tokens of stretches with nothing to copy are the target's, the rest the copy rounds'.
    assert_eq!(a.pauses, 1, "{a:?}");
    assert!(a.paused_tokens < a.output_tokens, "{a:?}");
    assert_eq!(
        (a.draft_tokens_proposed, a.draft_tokens_accepted),
        (b.draft_tokens_proposed, b.draft_tokens_accepted),
        "{a:?}\n{b:?}"
    );
    assert_eq!(
        (a.verify_passes, a.extend_passes, a.target_positions),
        (b.verify_passes, b.extend_passes, b.target_positions),
        "{a:?}\n{b:?}"
    );
}

/// Where prompt lookup has nothing of its sizes to draft, a paced token-level round has the target verify a guess of
/// one token (the one after the latest earlier occurrence of the context's last token) in place of a plain step,
/// where guesses pay: the output stays the target's, each guess is a verification of one drafted token, and an unpaced
/// request makes none.
#[test]
fn prompt_lookup_guesses_one_token_where_nothing_longer_matches() {
    use parse_core::pace::{Costs, Pacing};
    use parse_core::{NgramConfig, NgramDrafter, PieceFn};
    use std::sync::Arc;
    let (kind, prompt) = ("token-spec/ngram", PROMPTS[2]);
    let pieces: PieceFn = Arc::new(|t: &[u32]| Ok(t.iter().map(|&t| piece(t)).collect()));
    let lookup = || NgramDrafter::new(NgramConfig::default(), pieces.clone(), vec![EOS]).unwrap();
    let mut r = request(Mode::TokenSpec, 0.0, Verdict::Relative, prompt, 60);
    r.window.adaptive = true;
    // The target alone 100 ms a token; speculation of this kind 1 ms a token: the request speculates throughout.
    let costs = Arc::new(Costs::default());
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    costs.record_spec(kind, 0, 16.0, 16, None);
    let pacing = Pacing {
        costs,
        kind: kind.into(),
        load: Arc::new(|| 1),
        off_at: None,
    };
    let (mut d, mut v) = (lookup(), FakeVerifier::default());
    let paced = parse_core::generate_paced(&mut d, &mut v, &r, &mut |_, _| true, pacing).unwrap();
    let target = greedy(prompt, target_next, 60);
    assert_eq!(paced.tokens, target);
    let s = &paced.stats;
    assert!(s.guesses > 0 && s.guesses_right <= s.guesses, "{s:?}");
    assert!(
        s.verify_passes >= s.guesses && s.draft_tokens_proposed >= s.guesses,
        "{s:?}"
    );
    r.window.adaptive = false;
    let (mut d, mut v) = (lookup(), FakeVerifier::default());
    let plain = generate(&mut d, &mut v, &r, &mut |_, _| true).unwrap();
    assert_eq!(plain.tokens, target);
    assert_eq!(plain.stats.guesses, 0, "{:?}", plain.stats);
}
