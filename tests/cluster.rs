//! The cluster on 127.0.0.1:0 with tiny random models: the remote loop equals the in-process loop in every mode,
//! streams are complete and ordered, sessions are freed on cancellation, lost workers are survived, bad input gets
//! INVALID_ARGUMENT and overload RESOURCE_EXHAUSTED.

use std::time::Duration;

use parse_client::{Client, ClientError, Event, GenerateRequest, Sampling, Stats};
use parse_core::{
    AcceptPolicy, CopyConfig, CopyFirst, DraftWindow, GenerationRequest, Mode, SamplingParams,
    SegmenterConfig,
};
use parse_discovery::Role;
use parse_draft_worker::DraftWorkerConfig;
use parse_engine::Message;
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_router::RouterConfig;
use parse_target_worker::TargetWorkerConfig;
use parse_target_worker::Worker as _;
use parse_tests::*;
use tokio_stream::StreamExt;

const PROMPT: &str = "Write a function that adds two numbers.";

struct Cluster {
    router: Server<parse_router::Router>,
    drafts: Vec<Server<parse_draft_worker::DraftWorker>>,
    targets: Vec<Server<parse_target_worker::TargetWorker>>,
}

/// Asserts that the first target and draft workers hold no session within 20 s (`what` heads the failure).
fn sessions_end(c: &Cluster, what: &str) {
    let open = || {
        (
            c.targets[0].worker.open_sessions(),
            c.drafts[0].worker.open_sessions(),
        )
    };
    assert!(
        eventually(Duration::from_secs(20), || open() == (0, 0)),
        "{what}: target {}, draft {}",
        open().0,
        open().1
    );
}

fn cluster(n_drafts: usize, n_targets: usize, max_in_flight: usize) -> Cluster {
    cluster_with(DRAFT_SEED, n_drafts, n_targets, max_in_flight)
}

fn cluster_with(
    draft_seed: u64,
    n_drafts: usize,
    n_targets: usize,
    max_in_flight: usize,
) -> Cluster {
    cluster_routed(
        draft_seed,
        n_drafts,
        n_targets,
        max_in_flight,
        RouterConfig::default(),
    )
}

/// As [`cluster_with`], the router's other settings taken from `base`.
fn cluster_routed(
    draft_seed: u64,
    n_drafts: usize,
    n_targets: usize,
    max_in_flight: usize,
    base: RouterConfig,
) -> Cluster {
    let drafts: Vec<_> = (0..n_drafts)
        .map(|_| draft_server(tiny_engine(draft_seed), DraftWorkerConfig::default()))
        .collect();
    let targets: Vec<_> = (0..n_targets)
        .map(|_| target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default()))
        .collect();
    let router = router_server(RouterConfig {
        drafts: drafts.iter().map(|s| s.endpoint()).collect(),
        targets: targets.iter().map(|s| s.endpoint()).collect(),
        max_in_flight,
        ..base
    });
    Cluster {
        router,
        drafts,
        targets,
    }
}

/// A request whose work is reproducible (pausing speculation, on by default, follows measured times), drafted by the
/// draft workers alone (`drafter: "model"`, as `in_process` drafts; the router's default drafter also copies, which
/// the tests of `model+ngram` below cover).
fn req(mode: &str, max: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: PROMPT.into(),
        max_new_tokens: max,
        mode: mode.into(),
        drafter: "model".into(),
        adaptive: Some(false),
        ..Default::default()
    }
}

/// The sampled settings the mode tests use.
fn sampled() -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
        cache_salt: 0,
    }
}

/// [`req`] with `sampling`.
fn req_sampled(mode: &str, max: u32, sampling: &SamplingParams) -> GenerateRequest {
    GenerateRequest {
        sampling: Some(Sampling {
            temperature: sampling.temperature,
            top_k: sampling.top_k as u32,
            top_p: Some(sampling.top_p),
            seed: sampling.seed,
            cache_salt: sampling.cache_salt,
        }),
        ..req(mode, max)
    }
}

fn in_process(mode: Mode, max: usize, sampling: SamplingParams) -> Vec<u32> {
    in_process_drafts(mode, max, sampling, false).0
}

/// The output in process, and how many tokens were copied: with `copy_first` the draft model is wrapped in
/// [`CopyFirst`] as the router wraps its draft workers for `drafter: "model+ngram"`.
fn in_process_drafts(
    mode: Mode,
    max: usize,
    sampling: SamplingParams,
    copy_first: bool,
) -> (Vec<u32>, usize) {
    let (mut target, mut draft) = (tiny_engine(TARGET_SEED), tiny_engine(DRAFT_SEED));
    let tok = target.tokenizer().clone();
    let r = GenerationRequest {
        session: "local".into(),
        prompt: tok.encode_chat(&[Message::user(PROMPT)]).unwrap(),
        max_new_tokens: max,
        mode,
        sampling,
        policy: AcceptPolicy::default(),
        segmenter: SegmenterConfig::default(),
        window: DraftWindow::default(),
        eos: tok.eos_ids().to_vec(),
        judge_suffix: tok.judge_suffix().unwrap(),
    };
    let mut v = EngineVerifier::new(&mut target);
    let mut d = EngineDrafter::new(&mut draft);
    if copy_first {
        let mut d = CopyFirst::new(d, CopyConfig::default(), tok.eos_ids().to_vec()).unwrap();
        let out = parse_core::generate(&mut d, &mut v, &r, &mut |_, _| true).unwrap();
        return (out.tokens, d.copied);
    }
    let out = parse_core::generate(&mut d, &mut v, &r, &mut |_, _| true).unwrap();
    (out.tokens, 0)
}

/// The counters of two runs' stats (timings differ run to run).
fn counters(s: &Stats) -> [u32; 9] {
    [
        s.prompt_tokens,
        s.output_tokens,
        s.draft_tokens_proposed,
        s.draft_tokens_accepted,
        s.segments_proposed,
        s.segments_accepted,
        s.verify_passes,
        s.extend_passes,
        s.target_positions,
    ]
}

#[test]
fn remote_equals_in_process_in_every_mode_and_streams_match_unary() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let sampled = sampled();
    let cases = [
        ("target", SamplingParams::default()),
        ("draft", SamplingParams::default()),
        ("token-spec", SamplingParams::default()),
        ("parse", SamplingParams::default()),
        ("parse+token-spec", SamplingParams::default()),
        ("token-spec", sampled.clone()),
        ("target", sampled),
    ];
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        for (mode, sampling) in cases {
            let want = in_process(mode.parse().unwrap(), 40, sampling.clone());
            let r = req_sampled(mode, 40, &sampling);
            let unary = client.generate(r.clone()).await.unwrap();
            assert_eq!(
                unary.token_ids, want,
                "{mode} {sampling:?}: remote differs from in-process"
            );
            let mut stream = client.generate_stream(r).await.unwrap();
            let (mut tokens, mut text, mut fin) = (Vec::new(), String::new(), None);
            while let Some(ev) = stream.next().await {
                match ev.unwrap() {
                    Event::Delta(d) => {
                        assert!(fin.is_none(), "delta after the final message");
                        tokens.extend(d.token_ids);
                        text.push_str(&d.text);
                    }
                    Event::Finished(f) => fin = Some(f),
                }
            }
            let fin = fin.expect("a final message");
            assert_eq!(tokens, unary.token_ids, "{mode}: stream tokens");
            assert_eq!(text, unary.text, "{mode}: stream text");
            assert_eq!(fin.finish_reason, unary.finish_reason);
            assert_eq!(
                counters(fin.stats.as_ref().unwrap()),
                counters(unary.stats.as_ref().unwrap()),
                "{mode}: stream stats equal the unary call's"
            );
        }
    });
    assert_eq!(c.drafts[0].worker.open_sessions(), 0);
    assert_eq!(c.targets[0].worker.open_sessions(), 0);
}

/// A stop string ends a reply at the token that completed it: the text is cut before the stop string, and the token
/// ids, their count in the stats (OpenAI's `completion_tokens`) and the streamed ids are the output's tokens up to
/// that one, never the tokens the loop accepted past it in the same round; where the budget ends at that token too,
/// the reply still finishes by the stop string.
#[test]
fn a_stop_string_ends_the_reply_and_its_token_count_at_the_token_that_completed_it() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let tok = tokenizer();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let mut cut_short = 0;
        for mode in ["target", "parse+token-spec", "token-spec"] {
            let full = client.generate(req(mode, 48)).await.unwrap();
            let chars: Vec<(usize, char)> = full.text.char_indices().collect();
            assert!(
                chars.len() > 12,
                "{mode}: too little text to cut: {:?}",
                full.text
            );
            // Stop strings of two characters taken from several places in the text; each cuts at its first
            // occurrence.
            let mut stops: Vec<String> = Vec::new();
            for at in [
                1,
                chars.len() / 5,
                chars.len() / 3,
                chars.len() / 2,
                3 * chars.len() / 4,
            ] {
                let to = chars.get(at + 2).map_or(full.text.len(), |c| c.0);
                let stop = full.text[chars[at].0..to].to_string();
                if !stops.contains(&stop) {
                    stops.push(stop);
                }
            }
            for stop in stops {
                let from = full.text.find(&stop).unwrap();
                let k = (1..=full.token_ids.len())
                    .find(|&k| {
                        tok.decode(&full.token_ids[..k], true)
                            .unwrap()
                            .contains(&stop)
                    })
                    .unwrap();
                let r = GenerateRequest {
                    stop: vec![stop.clone()],
                    ..req(mode, 48)
                };
                let reply = client.generate(r.clone()).await.unwrap();
                let what = format!("{mode}, stop {stop:?} in {:?}", full.text);
                assert_eq!(reply.text, full.text[..from], "{what}: text");
                assert_eq!(reply.finish_reason, "stop", "{what}");
                assert_eq!(reply.token_ids, full.token_ids[..k], "{what}: token ids");
                let stats = reply.stats.as_ref().unwrap();
                assert_eq!(stats.output_tokens as usize, k, "{what}: output tokens");
                let mut stream = client.generate_stream(r).await.unwrap();
                let mut ids = Vec::new();
                while let Some(ev) = stream.next().await {
                    if let Event::Delta(d) = ev.unwrap() {
                        ids.extend(d.token_ids);
                    }
                }
                assert_eq!(ids, reply.token_ids, "{what}: streamed ids");
                cut_short += usize::from(k < full.token_ids.len());
                // A budget that ends at the same token: the stop string came first.
                let r = GenerateRequest {
                    stop: vec![stop.clone()],
                    ..req(mode, k as u32)
                };
                let at_budget = client.generate(r).await.unwrap();
                assert_eq!(
                    at_budget.token_ids, reply.token_ids,
                    "{what}: at the budget"
                );
                assert_eq!(at_budget.finish_reason, "stop", "{what}: at the budget");
            }
        }
        assert!(
            cut_short >= 6,
            "only {cut_short} replies ended before the full output"
        );
    });
    sessions_end(&c, "after the stopped replies");
}

/// `drafter: "model+ngram"`: the router copies from long prompt-lookup matches and asks the draft worker for the
/// rest; its output is the in-process drafter's, and greedy token-level speculation keeps the target's tokens.
#[test]
fn copies_first_through_the_router_as_in_process() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let want = client.generate(req("target", 60)).await.unwrap();
        let mut copied = 0;
        for (mode, m) in [
            ("token-spec", Mode::TokenSpec),
            ("parse+token-spec", Mode::ParseTokenSpec),
        ] {
            let got = client
                .generate(GenerateRequest {
                    drafter: "model+ngram".into(),
                    ..req(mode, 60)
                })
                .await
                .unwrap();
            let (local, n) = in_process_drafts(m, 60, SamplingParams::default(), true);
            copied += n;
            assert_eq!(got.token_ids, local, "{mode}: router and in process");
            if m == Mode::TokenSpec {
                assert_eq!(got.token_ids, want.token_ids, "{mode}: lossless");
            }
        }
        // The tiny models repeat themselves: some of the drafts were copies.
        assert!(copied > 0);
    });
    assert_eq!(c.drafts[0].worker.open_sessions(), 0);
    assert_eq!(c.targets[0].worker.open_sessions(), 0);
}

#[test]
fn without_draft_workers_prompt_lookup_drafts_and_greedy_output_equals_target() {
    let c = cluster(0, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let want = client.generate(req("target", 60)).await.unwrap();
        for mode in ["token-spec", "parse+token-spec"] {
            let r = GenerateRequest {
                drafter: "ngram".into(),
                ..req(mode, 60)
            };
            let got = client.generate(r).await.unwrap();
            let s = got.stats.unwrap();
            if mode == "token-spec" {
                // Greedy token-level speculation keeps only the target's own tokens: lossless.
                assert_eq!(got.token_ids, want.token_ids, "{mode} with ngram drafts");
            }
            assert_eq!(s.output_tokens as usize, got.token_ids.len());
            assert!(
                s.draft_tokens_accepted <= s.draft_tokens_proposed,
                "{mode}: {s:?}"
            );
        }
        // Pausing speculation where it does not pay changes the work, not the tokens.
        let adaptive = client
            .generate(GenerateRequest {
                drafter: "ngram".into(),
                adaptive: Some(true),
                ..req("token-spec", 60)
            })
            .await
            .unwrap();
        assert_eq!(
            adaptive.token_ids, want.token_ids,
            "adaptive ngram token-spec"
        );
        // The tiny target repeats itself, so lookup finds drafts and some are kept.
        let s = client
            .generate(GenerateRequest {
                drafter: "ngram".into(),
                ..req("token-spec", 60)
            })
            .await
            .unwrap()
            .stats
            .unwrap();
        assert!(s.draft_tokens_accepted > 0, "{s:?}");
        // The draft model is not there; a request that needs it, or the draft alone, is refused with a reason.
        for r in [
            req("parse", 8),
            GenerateRequest {
                drafter: "ngram".into(),
                ..req("draft", 8)
            },
            GenerateRequest {
                drafter: "eagle".into(),
                ..req("token-spec", 8)
            },
            GenerateRequest {
                drafter: "model+ngram".into(),
                ..req("token-spec", 8)
            },
        ] {
            match client.generate(r).await {
                Err(ClientError::InvalidArgument(m)) => assert!(!m.is_empty()),
                other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
            }
        }
    });
    assert_eq!(c.targets[0].worker.open_sessions(), 0);
}

/// A drafter that takes its time: every chunk costs 30 ms more than the draft model's.
struct Slow<D>(D);

impl<D: parse_core::Drafter> parse_core::Drafter for Slow<D> {
    fn begin(&mut self, s: &str, c: &[u32], p: &SamplingParams) -> parse_core::Result<()> {
        self.0.begin(s, c, p)
    }
    fn next(&mut self, s: &str, max: usize) -> parse_core::Result<parse_core::DraftChunk> {
        std::thread::sleep(Duration::from_millis(30));
        self.0.next(s, max)
    }
    fn distribution(&mut self, s: &str, i: usize) -> parse_core::Result<Vec<(u32, f32)>> {
        self.0.distribution(s, i)
    }
    fn pieces(&mut self, t: &[u32]) -> parse_core::Result<Vec<String>> {
        self.0.pieces(t)
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.0.release(s)
    }
}

impl<D: parse_core::Drafter> parse_core::DraftHints for Slow<D> {}

#[test]
fn speculation_that_does_not_pay_pauses_and_the_output_stays_the_targets() {
    let want = in_process(Mode::Target, 120, SamplingParams::default());
    for mode in [Mode::TokenSpec, Mode::ParseTokenSpec] {
        let (mut target, mut draft) = (tiny_engine(TARGET_SEED), tiny_engine(DRAFT_SEED));
        let tok = target.tokenizer().clone();
        let r = GenerationRequest {
            session: "slow".into(),
            prompt: tok.encode_chat(&[Message::user(PROMPT)]).unwrap(),
            max_new_tokens: 120,
            mode,
            sampling: SamplingParams::default(),
            // tau above 1: exact matches only, so parse+token-spec also writes the target's tokens.
            policy: AcceptPolicy {
                tau: 2.0,
                ..Default::default()
            },
            segmenter: SegmenterConfig::default(),
            window: DraftWindow {
                adaptive: true,
                ..Default::default()
            },
            eos: tok.eos_ids().to_vec(),
            judge_suffix: tok.judge_suffix().unwrap(),
        };
        let mut v = EngineVerifier::new(&mut target);
        // Every draft chunk costs 30 ms: a tiny target step takes far less, so token-level speculation loses on
        // time and pauses; the pauses measure the target alone.
        let mut d = Slow(EngineDrafter::new(&mut draft));
        let o = parse_core::generate(&mut d, &mut v, &r, &mut |_, _| true).unwrap();
        assert_eq!(o.tokens, want, "{mode:?}: the target's tokens");
        let s = &o.stats;
        // Both pause: the PARSE rounds are paced as the token-level ones are (after its first round, with the
        // target's step not measured yet, a PARSE request pauses to measure it, and its rounds lose by far).
        assert!(s.pauses > 0 && s.paused_tokens > 0, "{mode:?}: {s:?}");
        assert!(
            s.paused_tokens < s.output_tokens,
            "{mode:?}: it speculated too: {s:?}"
        );
    }
}

#[test]
fn speculation_turned_off_at_a_load_writes_as_target_mode_does() {
    // The draft worker serves the target's own weights: every draft would be kept, so only the setting keeps a
    // request that adapts from speculating.
    let off = cluster_routed(
        TARGET_SEED,
        1,
        1,
        8,
        RouterConfig {
            speculation_off_at: Some(1),
            ..Default::default()
        },
    );
    let free = cluster_with(TARGET_SEED, 1, 1, 8);
    let rt = runtime();
    rt.block_on(async {
        let mut off_client = Client::connect(&off.router.endpoint()).await.unwrap();
        let mut free_client = Client::connect(&free.router.endpoint()).await.unwrap();
        let want = off_client.generate(req("target", 60)).await.unwrap();
        let adapting = |mode: &str| GenerateRequest {
            drafter: "model+ngram".into(),
            adaptive: Some(true),
            ..req(mode, 60)
        };
        for mode in ["token-spec", "parse+token-spec"] {
            let got = off_client.generate(adapting(mode)).await.unwrap();
            assert_eq!(got.token_ids, want.token_ids, "{mode}: the target's tokens");
            let s = got.stats.unwrap();
            assert_eq!(s.draft_tokens_proposed, 0, "{mode}: nothing drafted: {s:?}");
            assert_eq!(s.copy_rounds, 0, "{mode}: no copies: {s:?}");
            assert!(s.pauses > 0 && s.paused_tokens > 0, "{mode}: {s:?}");
            // Without the setting the same request speculates, and a request that turns adaptation off speculates
            // whatever the setting.
            let s = free_client
                .generate(adapting(mode))
                .await
                .unwrap()
                .stats
                .unwrap();
            assert!(
                s.draft_tokens_proposed > 0,
                "{mode} without the setting: {s:?}"
            );
            let s = off_client
                .generate(GenerateRequest {
                    adaptive: Some(false),
                    ..adapting(mode)
                })
                .await
                .unwrap()
                .stats
                .unwrap();
            assert!(s.draft_tokens_proposed > 0, "{mode} not adapting: {s:?}");
        }
    });
}

#[test]
fn the_next_draft_is_written_while_the_target_verifies() {
    // The draft worker serves the target's own weights: every draft is accepted whole, so each one after the first
    // was begun during the previous verification, and the output is the target's greedy output.
    let c = cluster_with(TARGET_SEED, 1, 1, 8);
    let rt = runtime();
    let want = in_process(Mode::Target, 300, SamplingParams::default());
    let r = rt.block_on(async {
        let mut client = Client::connect(&c.router.endpoint()).await.unwrap();
        client.generate(req("parse", 300)).await.unwrap()
    });
    let stats = r.stats.unwrap();
    assert_eq!(r.token_ids, want);
    assert_eq!(stats.draft_tokens_accepted, stats.draft_tokens_proposed);
    assert!(
        stats.verify_passes >= 3 && stats.draft_prefetch_hits + 1 >= stats.verify_passes,
        "drafts taken from a stream begun during verification: {stats:?}"
    );
    assert_eq!(stats.draft_prefetch_misses, 0, "{stats:?}");
}

#[test]
fn a_draft_worker_beside_the_target_writes_the_next_token_round_while_the_target_verifies() {
    // The draft worker serves the target's own weights, so each round's draft is accepted whole and the draft's
    // guess of the target's next token is right: beside the target (`Alongside`), every round after the first takes
    // the draft begun during the previous verification. On the target's host (`auto` here), none is begun.
    let want = in_process(Mode::Target, 200, SamplingParams::default());
    for (prefill, beside) in [
        (parse_router::DraftPrefill::Alongside, true),
        (parse_router::DraftPrefill::Auto, false),
    ] {
        let c = cluster_routed(
            TARGET_SEED,
            1,
            1,
            8,
            RouterConfig {
                draft_prefill: prefill,
                ..Default::default()
            },
        );
        let r = runtime().block_on(async {
            let mut client = Client::connect(&c.router.endpoint()).await.unwrap();
            client.generate(req("token-spec", 200)).await.unwrap()
        });
        let stats = r.stats.unwrap();
        assert_eq!(r.token_ids, want, "{prefill:?}");
        assert_eq!(stats.draft_tokens_accepted, stats.draft_tokens_proposed);
        assert_eq!(stats.draft_prefetch_misses, 0, "{prefill:?}: {stats:?}");
        if beside {
            assert!(
                stats.verify_passes >= 3 && stats.draft_prefetch_hits + 1 >= stats.verify_passes,
                "drafts taken from a stream begun during verification: {stats:?}"
            );
        } else {
            assert_eq!(stats.draft_prefetch_hits, 0, "{stats:?}");
        }
    }
}

/// With the draft's prefill beside the target's (`DraftPrefill::Alongside`, what `auto` picks for a draft worker on
/// a host of its own), each speculative mode's output is the in-process loop's, and no session is left; so is a
/// request cancelled right after it started, while that prefill may still run.
#[test]
fn the_drafts_prefill_beside_the_targets_changes_no_output() {
    let c = cluster_routed(
        DRAFT_SEED,
        1,
        1,
        8,
        RouterConfig {
            draft_prefill: parse_router::DraftPrefill::Alongside,
            ..Default::default()
        },
    );
    let rt = runtime();
    let cases = [
        ("token-spec", SamplingParams::default()),
        ("parse", SamplingParams::default()),
        ("parse+token-spec", SamplingParams::default()),
        ("token-spec", sampled()),
    ];
    rt.block_on(async {
        let mut client = Client::connect(&c.router.endpoint()).await.unwrap();
        for (mode, sampling) in cases {
            let want = in_process(mode.parse().unwrap(), 40, sampling.clone());
            let got = client
                .generate(req_sampled(mode, 40, &sampling))
                .await
                .unwrap();
            assert_eq!(got.token_ids, want, "{mode} {sampling:?}");
        }
        let stream = client.generate_stream(req("parse", 400)).await.unwrap();
        drop(stream);
    });
    sessions_end(&c, "sessions left");
}

#[test]
fn cancelling_a_stream_frees_sessions_on_both_workers() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let mut stream = client.generate_stream(req("parse", 400)).await.unwrap();
        let first = stream.next().await.unwrap().unwrap();
        assert!(matches!(first, Event::Delta(_)));
        assert!(c.targets[0].worker.open_sessions() == 1);
        drop(stream);
    });
    sessions_end(&c, "sessions left after the client went away");
    // It has left the load the others' pace reads.
    let gauge = || {
        c.router.worker.metrics.render().lines().find_map(|l| {
            l.strip_prefix("parse_requests_in_flight ")?
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || gauge() == Some(0.0)),
        "{:?}",
        gauge()
    );
    // Counted as a request its client left, not as the cluster's error.
    let count = |outcome: &str| {
        let series = format!("parse_requests_total{{mode=\"parse\",outcome=\"{outcome}\"}} ");
        let text = c.router.worker.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        eventually(Duration::from_secs(10), || count("cancelled") == 1.0),
        "{}",
        c.router.worker.metrics.render()
    );
    assert_eq!(count("error"), 0.0);
    assert_eq!(count("ok"), 0.0);
}

/// The value of the series `series` (its name and labels) in `worker`'s metrics; 0 where absent.
fn metric(worker: &parse_target_worker::TargetWorker, series: &str) -> f64 {
    let text = worker.metrics().render();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0))
}

/// Packed forward passes `worker` has run.
fn passes(worker: &parse_target_worker::TargetWorker) -> f64 {
    metric(worker, "parse_worker_batch_rows_count")
}

#[test]
fn a_call_that_reaches_a_worker_after_its_sessions_release_creates_no_session() {
    // The router leaves a wedged worker mid-call and sends it a release; when the worker runs again, the release
    // can be served before the call it gave up on. That call must not open a session nobody will release.
    use parse_proto::v1::drafter_client::DrafterClient;
    use parse_proto::v1::verifier_client::VerifierClient;
    use parse_proto::v1::{DraftRequest, ReleaseRequest};
    use tonic::Code;
    let target = target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default());
    let draft = draft_server(tiny_engine(DRAFT_SEED), DraftWorkerConfig::default());
    let rt = runtime();
    rt.block_on(async {
        let mut t = VerifierClient::new(worker_channel(&target.endpoint()).await);
        let open = open_request;
        let release = |s: &str| ReleaseRequest { session: s.into() };
        // Released before its open arrived: NOT_FOUND as before, and the late open is refused.
        let e = t.release(release("late")).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e}");
        let e = t.open_session(open("late")).await.unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
        assert!(e.message().contains("released"), "{e}");
        assert_eq!(target.worker.open_sessions(), 0);
        // Released after it was used: a late open of the same id is refused too; other ids open as before.
        t.open_session(open("used")).await.unwrap();
        assert_eq!(target.worker.open_sessions(), 1);
        t.release(release("used")).await.unwrap();
        let e = t.open_session(open("used")).await.unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
        t.open_session(open("fresh")).await.unwrap();
        t.release(release("fresh")).await.unwrap();
        assert_eq!(target.worker.open_sessions(), 0);

        // The draft worker: a draft that arrives after its session's release is refused.
        let mut d = DrafterClient::new(worker_channel(&draft.endpoint()).await);
        let req = |s: &str| DraftRequest {
            session: s.into(),
            context: vec![1, 2, 3],
            sampling: None,
            max_tokens: 2,
        };
        d.release(release("late")).await.unwrap();
        let e = d.draft(req("late")).await.unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
        let mut s = d.draft(req("fresh")).await.unwrap().into_inner();
        while s.message().await.unwrap().is_some() {}
        assert_eq!(draft.worker.open_sessions(), 1);
        d.release(release("fresh")).await.unwrap();
        assert_eq!(draft.worker.open_sessions(), 0);
    });
}

#[test]
fn an_open_whose_caller_goes_away_mid_prefill_frees_its_cache() {
    // One row per pass: a long prompt's prefill takes hundreds of passes, so the caller can leave in the middle.
    let target = target_server(
        tiny_engine(TARGET_SEED),
        TargetWorkerConfig {
            step_rows: 1,
            ..Default::default()
        },
    );
    let rt = runtime();
    let prompt: Vec<u32> = (0..TINY_CONTEXT as u32 - 8).map(|i| 100 + i).collect();
    let before = passes(&target.worker);
    let addr = target.endpoint();
    let call = rt.spawn(async move {
        let mut t =
            parse_proto::v1::verifier_client::VerifierClient::new(worker_channel(&addr).await);
        t.open_session(parse_proto::v1::OpenSessionRequest {
            prompt,
            ..open_request("left")
        })
        .await
    });
    // Polled every millisecond, not at `eventually`'s 20 ms: on a fast CPU (a 2-core AMD EPYC with AVX-512, where
    // this failed in most runs) the abort could come after the prefill's last pass, and the open then completes and
    // keeps its session, which is not what this test is about.
    assert!(
        eventually_every(
            Duration::from_secs(20),
            Duration::from_millis(1),
            || passes(&target.worker) >= before + 2.0
        ),
        "the open never started"
    );
    call.abort();
    let r = rt.block_on(call);

    assert!(
        r.as_ref().is_err_and(|e| e.is_cancelled()),
        "the open ended before its caller left: {r:?}"
    );
    assert!(
        eventually(Duration::from_secs(20), || target.worker.open_sessions()
            == 0),
        "the half-prefilled session is still held: {} open",
        target.worker.open_sessions()
    );
    let kv = target
        .worker
        .metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("parse_worker_kv_bytes ").map(str::to_string));
    assert_eq!(kv.as_deref(), Some("0"), "KV bytes still held");
}

/// A target worker's front that passes every call to the worker, but with `miss_first_release` answers the first
/// `Release` with UNAVAILABLE (as a worker stopped just as a request finished: the release never reached it), and
/// with `slow_first_open` holds the first `OpenSession` that long first (a long prefill). It serves
/// `grpc.health.v1` as serving.
#[derive(Clone)]
struct Front {
    worker: parse_proto::v1::verifier_client::VerifierClient<tonic::transport::Channel>,
    releases: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    miss_first_release: bool,
    opens: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    slow_first_open: Option<Duration>,
}

impl Front {
    fn new(rt: &tokio::runtime::Runtime, target: &str) -> Front {
        Front {
            worker: parse_proto::v1::verifier_client::VerifierClient::new(
                rt.block_on(worker_channel(target)),
            )
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20),
            releases: Default::default(),
            miss_first_release: false,
            opens: Default::default(),
            slow_first_open: None,
        }
    }

    /// Serves the front on a free port of its own: its address.
    fn serve(self, rt: &tokio::runtime::Runtime) -> String {
        let port = free_port();
        rt.spawn(async move {
            let (_reporter, health) = tonic_health::server::health_reporter();
            tonic::transport::Server::builder()
                .add_service(health)
                .add_service(
                    parse_proto::v1::verifier_server::VerifierServer::new(self)
                        .max_decoding_message_size(64 << 20)
                        .max_encoding_message_size(64 << 20),
                )
                .serve(([127, 0, 0, 1], port).into())
                .await
        });
        assert!(eventually(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }));
        format!("127.0.0.1:{port}")
    }
}

#[tonic::async_trait]
impl parse_proto::v1::verifier_server::Verifier for Front {
    async fn open_session(
        &self,
        r: tonic::Request<parse_proto::v1::OpenSessionRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::OpenSessionResponse>, tonic::Status> {
        let first = self.opens.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        if let (true, Some(hold)) = (first, self.slow_first_open) {
            tokio::time::sleep(hold).await;
        }
        self.worker.clone().open_session(r.into_inner()).await
    }
    async fn verify(
        &self,
        r: tonic::Request<parse_proto::v1::VerifyRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::VerifyResponse>, tonic::Status> {
        self.worker.clone().verify(r.into_inner()).await
    }
    async fn extend(
        &self,
        r: tonic::Request<parse_proto::v1::ExtendRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::ExtendResponse>, tonic::Status> {
        self.worker.clone().extend(r.into_inner()).await
    }
    async fn truncate(
        &self,
        r: tonic::Request<parse_proto::v1::TruncateRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::TruncateResponse>, tonic::Status> {
        self.worker.clone().truncate(r.into_inner()).await
    }
    async fn release(
        &self,
        r: tonic::Request<parse_proto::v1::ReleaseRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::ReleaseResponse>, tonic::Status> {
        if self
            .releases
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            == 0
            && self.miss_first_release
        {
            return Err(tonic::Status::unavailable("the worker did not answer"));
        }
        self.worker.clone().release(r.into_inner()).await
    }
    async fn get_model_info(
        &self,
        r: tonic::Request<parse_proto::v1::GetModelInfoRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::GetModelInfoResponse>, tonic::Status> {
        self.worker.clone().get_model_info(r.into_inner()).await
    }
    async fn drain(
        &self,
        r: tonic::Request<parse_proto::v1::DrainRequest>,
    ) -> Result<tonic::Response<parse_proto::v1::DrainResponse>, tonic::Status> {
        self.worker.clone().drain(r.into_inner()).await
    }
}

#[test]
fn a_release_the_worker_did_not_answer_at_a_requests_end_is_sent_again() {
    let target = target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default());
    let rt = runtime();
    let front = Front {
        miss_first_release: true,
        ..Front::new(&rt, &target.endpoint())
    };
    let releases = front.releases.clone();
    let router = router_server(RouterConfig {
        targets: vec![front.serve(&rt)],
        ..Default::default()
    });
    rt.block_on(async {
        let mut client = Client::connect(&router.endpoint()).await.unwrap();
        let out = client.generate(req("target", 6)).await.unwrap();
        assert_eq!(out.token_ids.len(), 6);
    });
    assert!(releases.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    assert!(
        eventually(Duration::from_secs(20), || target.worker.open_sessions()
            == 0),
        "the session is still held ({} releases sent)",
        releases.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert_eq!(releases.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[test]
fn a_call_past_its_limit_on_a_worker_that_still_serves_fails_that_request_alone() {
    // A slow prefill (the front holds the first open past the router's per-call limit) on a worker that answers its
    // health check: that request ends with DEADLINE_EXCEEDED naming the limit, and the worker is not taken for lost:
    // the next request, right after, is served (marked failed, it was refused with "no target worker available"
    // until the prober's next round).
    let target = target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default());
    let rt = runtime();
    let front = Front {
        slow_first_open: Some(Duration::from_secs(3)),
        ..Front::new(&rt, &target.endpoint())
    };
    let router = router_server(RouterConfig {
        targets: vec![front.serve(&rt)],
        worker_call_timeout: Duration::from_secs(1),
        // Far apart: the next request must not find the worker brought back by a probe.
        probe_every: Duration::from_secs(3600),
        ..Default::default()
    });
    rt.block_on(async {
        let mut client = Client::connect(&router.endpoint()).await.unwrap();
        match client.generate(req("target", 6)).await.unwrap_err() {
            parse_client::ClientError::DeadlineExceeded(m) => {
                assert!(m.contains("--worker-call-timeout-s"), "{m}")
            }
            other => panic!("not DEADLINE_EXCEEDED: {other:?}"),
        }
        let out = client.generate(req("target", 6)).await.unwrap();
        assert_eq!(out.token_ids.len(), 6);
    });
    assert!(
        eventually(Duration::from_secs(20), || target.worker.open_sessions()
            == 0),
        "{} sessions still open",
        target.worker.open_sessions()
    );
}

#[test]
fn a_killed_draft_worker_still_yields_a_complete_answer() {
    let mut c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let (tokens, stats) = rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let mut stream = client.generate_stream(req("parse", 300)).await.unwrap();
        let mut tokens = Vec::new();
        let mut stats = None;
        let mut killed = false;
        while let Some(ev) = stream.next().await {
            match ev.expect("the request survives the draft worker") {
                Event::Delta(d) => {
                    tokens.extend(d.token_ids);
                    if !killed {
                        c.drafts[0].kill();
                        killed = true;
                    }
                }
                Event::Finished(f) => stats = f.stats,
            }
        }
        (tokens, stats.expect("final stats"))
    });
    assert_eq!(tokens.len(), 300, "complete answer");
    assert_eq!(stats.output_tokens, 300);
    assert!(
        stats.fell_back_to_target && stats.draft_failovers >= 1,
        "{stats:?}"
    );
}

#[test]
fn a_killed_target_worker_is_replaced_by_another() {
    let mut c = cluster(1, 2, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let want = in_process(Mode::Parse, 300, SamplingParams::default());
    let (tokens, stats) = rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let mut stream = client.generate_stream(req("parse", 300)).await.unwrap();
        let mut tokens = Vec::new();
        let mut stats = None;
        let mut killed = false;
        while let Some(ev) = stream.next().await {
            match ev.expect("the request survives the target worker") {
                Event::Delta(d) => {
                    tokens.extend(d.token_ids);
                    if !killed {
                        let busy = c
                            .targets
                            .iter()
                            .position(|t| t.worker.open_sessions() > 0)
                            .expect("one target holds the session");
                        c.targets[busy].kill();
                        killed = true;
                    }
                }
                Event::Finished(f) => stats = f.stats,
            }
        }
        (tokens, stats.expect("final stats"))
    });
    assert!(stats.target_failovers >= 1, "{stats:?}");
    // Greedy and batch-invariant: the re-prefilled session continues exactly as the in-process run.
    assert_eq!(tokens, want);
}

/// A prompt and a budget that together pass the model's context are refused before any work is done, with a message
/// that says how much fits; a budget that fills the context exactly runs to its end in every mode; and a request
/// that asks for the budget to fit (`fit_context`, as the OpenAI API does where `max_tokens` is left out) gets what
/// fits.
#[test]
fn a_budget_past_the_context_is_refused_before_any_work_and_one_that_fills_it_runs() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let long = GenerateRequest {
        prompt: "word ".repeat(TINY_CONTEXT - 40),
        ..req("target", 1)
    };
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let one = client.generate(long.clone()).await.unwrap();
        let prompt_tokens = one.stats.as_ref().unwrap().prompt_tokens as usize;
        let room = TINY_CONTEXT - prompt_tokens;
        assert!((8..40).contains(&room), "{prompt_tokens} prompt tokens");
        for mode in ["target", "draft", "token-spec", "parse", "parse+token-spec"] {
            // The long prompt in this mode, with a budget of `max` (lowered to what fits where `fit`).
            let asking = |max: usize, fit: bool| GenerateRequest {
                mode: mode.into(),
                max_new_tokens: max as u32,
                fit_context: fit,
                ..long.clone()
            };
            let before = passes(&c.targets[0].worker);
            match client.generate(asking(room + 1, false)).await {
                Err(ClientError::InvalidArgument(m)) => assert!(
                    m.contains(&format!("at most {room} new tokens")),
                    "{mode}: {m}"
                ),
                other => panic!("{mode}: expected INVALID_ARGUMENT, got {other:?}"),
            }
            assert_eq!(passes(&c.targets[0].worker), before, "{mode}: work done");
            let reply = client
                .generate(asking(room, false))
                .await
                .unwrap_or_else(|e| panic!("{mode}: {e:?}"));
            assert!(
                reply.token_ids.len() == room && reply.finish_reason == "length"
                    || reply.token_ids.len() < room && reply.finish_reason == "eos",
                "{mode}: {} tokens of {room}, {}",
                reply.token_ids.len(),
                reply.finish_reason
            );
            let fitted = client
                .generate(asking(1000, true))
                .await
                .unwrap_or_else(|e| panic!("{mode}: {e:?}"));
            assert_eq!(
                fitted.token_ids, reply.token_ids,
                "{mode}: fitted to the context"
            );
        }
    });
    sessions_end(&c, "after the long prompts");
}

#[test]
fn bad_input_gets_invalid_argument_and_the_cluster_stays_healthy() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let long_prompt = "word ".repeat(TINY_CONTEXT + 50);
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let bad = [
            GenerateRequest {
                prompt: String::new(),
                ..req("parse", 8)
            },
            req("parse", 0),
            req("parse", 1_000_000),
            GenerateRequest {
                tau: Some(f32::NAN),
                ..req("parse", 8)
            },
            GenerateRequest {
                tau: Some(-0.5),
                ..req("parse", 8)
            },
            req("warp-speed", 8),
            GenerateRequest {
                prompt: long_prompt,
                ..req("parse", 8)
            },
            GenerateRequest {
                verdict: "vibes".into(),
                ..req("parse", 8)
            },
            GenerateRequest {
                request_id: "x".repeat(200),
                ..req("parse", 8)
            },
            GenerateRequest {
                sampling: Some(Sampling {
                    temperature: 0.7,
                    ..Default::default()
                }),
                ..req("parse", 8)
            },
        ];
        for r in bad {
            let what = format!(
                "{:?} {:?} {} {:?}",
                r.mode,
                r.tau,
                r.max_new_tokens,
                r.prompt.len()
            );
            match client.generate(r.clone()).await {
                Err(ClientError::InvalidArgument(m)) => assert!(!m.is_empty()),
                other => panic!("{what}: expected INVALID_ARGUMENT, got {other:?}"),
            }
            let mut s = client.generate_stream(r).await.unwrap();
            match s.next().await {
                Some(Err(ClientError::InvalidArgument(_))) => {}
                other => panic!("{what}: stream: expected INVALID_ARGUMENT, got {other:?}"),
            }
        }
        let ok = client.generate(req("parse", 8)).await.unwrap();
        assert_eq!(ok.token_ids.len(), 8);
    });
}

#[test]
fn a_prompt_of_token_ids_answers_as_the_raw_text_they_encode() {
    let c = cluster(1, 1, 8);
    let rt = runtime();
    let addr = c.router.endpoint();
    let ids = tokenizer().encode_prompt(PROMPT).unwrap();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        for mode in ["target", "parse+token-spec"] {
            let text = client
                .generate(GenerateRequest {
                    raw_prompt: true,
                    ..req(mode, 8)
                })
                .await
                .unwrap();
            let by_ids = client
                .generate(GenerateRequest {
                    prompt: String::new(),
                    prompt_tokens: ids.clone(),
                    ..req(mode, 8)
                })
                .await
                .unwrap();
            assert_eq!(by_ids.token_ids, text.token_ids, "{mode}");
            assert_eq!(by_ids.text, text.text, "{mode}");
            let prompt_tokens =
                |r: &parse_client::GenerateResponse| r.stats.as_ref().unwrap().prompt_tokens;
            assert_eq!(prompt_tokens(&by_ids), ids.len() as u32, "{mode}");
            assert_eq!(prompt_tokens(&text), ids.len() as u32, "{mode}");
        }
        for (r, expected) in [
            (
                GenerateRequest {
                    prompt_tokens: vec![ids[0], u32::MAX],
                    prompt: String::new(),
                    ..req("target", 8)
                },
                "token id 4294967295 is outside the model's vocabulary",
            ),
            (
                GenerateRequest {
                    prompt_tokens: ids.clone(),
                    ..req("target", 8)
                },
                "give no `prompt`, `messages` or `system` with it",
            ),
        ] {
            match client.generate(r).await {
                Err(ClientError::InvalidArgument(m)) => assert!(m.contains(expected), "{m}"),
                other => panic!("expected INVALID_ARGUMENT ({expected}), got {other:?}"),
            }
        }
    });
    sessions_end(&c, "after the token-id prompts");
}

#[test]
fn an_overloaded_router_answers_resource_exhausted() {
    let c = cluster(1, 1, 1);
    let rt = runtime();
    let addr = c.router.endpoint();
    rt.block_on(async {
        let mut client = Client::connect(&addr).await.unwrap();
        let mut first = client.generate_stream(req("parse", 400)).await.unwrap();
        assert!(matches!(first.next().await, Some(Ok(Event::Delta(_)))));
        match client.generate(req("parse", 8)).await {
            Err(e @ ClientError::ResourceExhausted(_)) => assert!(e.is_retryable()),
            other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
        }
        drop(first);
    });
}

/// `grpc.health.v1` status of the whole server at `addr`.
async fn health(addr: &str) -> i32 {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = tonic_health::pb::health_client::HealthClient::new(channel);
    c.check(tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
}

/// A TP-2 group of the tiny target over loopback TCP (exact layout): the leader, the follower's thread (its
/// `follow` result) and the follower's communicator (to kill it).
fn tp_pair() -> (
    parse_engine::tp::Leader,
    std::thread::JoinHandle<parse_engine::Result<()>>,
    std::sync::Arc<parse_comm::TcpComm>,
) {
    use parse_engine::tp::Layout;
    use std::sync::Arc;
    let mut comms = parse_comm::loopback_group(2, Duration::from_secs(5))
        .unwrap()
        .into_iter()
        .map(Arc::new);
    let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let follower_comm = c1.clone();
    let follower = std::thread::spawn(move || {
        parse_engine::tp::join(tiny_engine(TARGET_SEED), c1, Layout::Exact)
            .unwrap()
            .follower()
            .unwrap()
            .follow()
    });
    let leader = parse_engine::tp::join(tiny_engine(TARGET_SEED), c0, Layout::Exact)
        .unwrap()
        .leader()
        .unwrap();
    (leader, follower, follower_comm)
}

#[test]
fn a_tensor_parallel_group_serves_and_a_dead_follower_sends_work_to_another_group() {
    let (leader, follower, follower_comm) = tp_pair();
    let tp = target_server(
        leader,
        TargetWorkerConfig {
            heartbeat: Duration::from_millis(200),
            ..Default::default()
        },
    );
    let plain = target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default());
    let draft = draft_server(tiny_engine(DRAFT_SEED), DraftWorkerConfig::default());
    // Idle workers tie on outstanding requests and the first listed wins: the group gets the requests.
    let router = router_server(RouterConfig {
        drafts: vec![draft.endpoint()],
        targets: vec![tp.endpoint(), plain.endpoint()],
        max_in_flight: 8,
        ..Default::default()
    });
    let want = in_process(Mode::Parse, 300, SamplingParams::default());
    let rt = runtime();
    rt.block_on(async {
        let mut client = Client::connect(&router.endpoint()).await.unwrap();
        // Through the group (exact layout): the in-process output.
        let mut stream = client.generate_stream(req("parse", 300)).await.unwrap();
        let (mut tokens, mut stats, mut checked) = (Vec::new(), None, false);
        while let Some(ev) = stream.next().await {
            match ev.unwrap() {
                Event::Delta(d) => {
                    tokens.extend(d.token_ids);
                    if !checked {
                        assert_eq!(tp.worker.open_sessions(), 1, "the group holds the session");
                        checked = true;
                    }
                }
                Event::Finished(f) => stats = f.stats,
            }
        }
        assert_eq!(tokens, want, "TP = 2 through the router");
        assert_eq!(stats.unwrap().target_failovers, 0);
        assert_eq!(health(&tp.endpoint()).await, 1, "SERVING");

        // The follower dies mid-request: the leader fails the call with UNAVAILABLE, the router re-prefills the
        // session on the other target, and the answer is still the in-process one.
        let mut stream = client.generate_stream(req("parse", 300)).await.unwrap();
        let (mut tokens, mut stats, mut killed) = (Vec::new(), None, false);
        while let Some(ev) = stream.next().await {
            match ev.expect("the request survives the group") {
                Event::Delta(d) => {
                    tokens.extend(d.token_ids);
                    if !killed {
                        follower_comm.kill();
                        killed = true;
                    }
                }
                Event::Finished(f) => stats = f.stats,
            }
        }
        let stats = stats.unwrap();
        assert_eq!(tokens, want);
        assert!(stats.target_failovers >= 1, "{stats:?}");
        assert!(plain.worker.open_sessions() == 0);
    });
    assert!(
        follower.join().unwrap().is_err(),
        "the follower left with an error"
    );
    assert!(
        eventually(Duration::from_secs(5), || !tp.worker.ready()),
        "the broken group reports unready"
    );
    rt.block_on(async {
        assert_eq!(health(&tp.endpoint()).await, 2, "NOT_SERVING");
    });
}

#[test]
fn the_router_follows_membership_as_workers_come_and_go() {
    use parse_discovery::{MemoryDiscovery, WorkerInfo};
    let members = MemoryDiscovery::new();
    let info = |role: Role, id: &str, address: String| WorkerInfo {
        id: id.into(),
        role,
        address,
        model: "tiny".into(),
        tp: 1,
        capacity: 8,
        version: String::new(),
    };
    let draft = draft_server(tiny_engine(DRAFT_SEED), DraftWorkerConfig::default());
    let targets: Vec<_> = (0..2)
        .map(|_| target_server(tiny_engine(TARGET_SEED), TargetWorkerConfig::default()))
        .collect();
    members.insert(info(Role::Draft, "d", draft.endpoint()));
    let router = router_server_with(
        RouterConfig {
            max_in_flight: 8,
            ..Default::default()
        },
        &members,
    );
    let want = in_process(Mode::Parse, 40, SamplingParams::default());
    let rt = runtime();
    rt.block_on(async {
        let mut client = Client::connect(&router.endpoint()).await.unwrap();
        // No target yet: nothing to serve with.
        let err = client.generate(req("parse", 40)).await.unwrap_err();
        assert!(matches!(err, ClientError::Unavailable(_)), "{err:?}");
        // A target joins: served, with the in-process output.
        members.insert(info(Role::Target, "t0", targets[0].endpoint()));
        assert!(eventually(Duration::from_secs(2), || router
            .worker
            .members(Role::Target)
            .len()
            == 1));
        let out = client.generate(req("parse", 40)).await.unwrap();
        assert_eq!(out.token_ids, want);
        assert_eq!(targets[0].worker.open_sessions(), 0);
        // It leaves and another joins: the next request goes to the newcomer.
        members.remove(Role::Target, "t0");
        members.insert(info(Role::Target, "t1", targets[1].endpoint()));
        assert!(eventually(Duration::from_secs(2), || {
            router.worker.members(Role::Target) == [("t1".to_string(), targets[1].endpoint())]
        }));
        let out = client.generate(req("parse", 40)).await.unwrap();
        assert_eq!(out.token_ids, want);
        // The draft leaves: parse is refused as needing one, the target alone still serves.
        members.remove(Role::Draft, "d");
        assert!(eventually(Duration::from_secs(2), || router
            .worker
            .members(Role::Draft)
            .is_empty()));
        let err = client.generate(req("parse", 40)).await.unwrap_err();
        assert!(matches!(err, ClientError::InvalidArgument(_)), "{err:?}");
        let out = client.generate(req("target", 40)).await.unwrap();
        assert_eq!(
            out.token_ids,
            in_process(Mode::Target, 40, SamplingParams::default())
        );
    });
}

/// `name_sum / name_count` of a histogram in a worker's exposition.
fn histogram_mean(exposition: &str, name: &str) -> f64 {
    let value = |suffix: &str| -> f64 {
        let key = format!("{name}_{suffix} ");
        exposition
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} not in the exposition"))
    };
    value("sum") / value("count").max(1.0)
}

#[test]
fn a_request_gets_the_same_output_alone_and_among_seven_others() {
    // Both workers pack the steps of concurrent requests into shared forward passes; a request's tokens and counters
    // must not depend on what shares its passes.
    let c = cluster(1, 1, 16);
    let rt = runtime();
    let addr = c.router.endpoint();
    let others = [
        "Explain what a hash map is.",
        "Write a haiku about autumn.",
        "What is 17 times 23?",
        "List three prime numbers greater than 50.",
        "Translate 'good morning' into French.",
        "Write a SQL query that counts the rows of a table named users.",
        "Why is the sky blue? Answer in one sentence.",
    ];
    for mode in ["target", "parse+token-spec", "token-spec"] {
        let alone = rt.block_on(async {
            let mut client = Client::connect(&addr).await.unwrap();
            client.generate(req(mode, 40)).await.unwrap()
        });
        let together = rt.block_on(async {
            let mut calls = Vec::new();
            for prompt in std::iter::once(PROMPT).chain(others) {
                let addr = addr.clone();
                let mut r = req(mode, 40);
                r.prompt = prompt.into();
                calls.push(tokio::spawn(async move {
                    let mut client = Client::connect(&addr).await.unwrap();
                    client.generate(r).await.unwrap()
                }));
            }
            let mut out = Vec::new();
            for call in calls {
                out.push(call.await.unwrap());
            }
            out
        });
        assert_eq!(
            together[0].token_ids, alone.token_ids,
            "{mode}: the request's tokens changed among others"
        );
        assert_eq!(
            counters(together[0].stats.as_ref().unwrap()),
            counters(alone.stats.as_ref().unwrap()),
            "{mode}: the request's counters changed among others"
        );
        for r in &together[1..] {
            assert!(!r.token_ids.is_empty(), "{mode}: an empty answer");
        }
    }
    // The passes were shared: on average more than one session's block per pass on both workers.
    let target = histogram_mean(
        &c.targets[0].worker.metrics().render(),
        "parse_worker_batch_blocks",
    );
    let draft = histogram_mean(
        &c.drafts[0].worker.metrics().render(),
        "parse_worker_batch_blocks",
    );
    assert!(target > 1.2, "target worker: {target} blocks per pass");
    assert!(draft > 1.2, "draft worker: {draft} blocks per pass");
    assert_eq!(c.drafts[0].worker.open_sessions(), 0);
    assert_eq!(c.targets[0].worker.open_sessions(), 0);
}

#[test]
fn a_tensor_parallel_group_packs_concurrent_requests_into_shared_passes() {
    // The leader checks each step's blocks, sends them to its follower in one message and both ranks run one packed
    // pass (the engine's tensor_parallel tests hold that pass against TP = 1): requests sent together get the tokens
    // they get alone, and the scheduler's steps held several blocks.
    let (leader, follower, _) = tp_pair();
    let tp = target_server(leader, TargetWorkerConfig::default());
    let draft = draft_server(tiny_engine(DRAFT_SEED), DraftWorkerConfig::default());
    let router = router_server(RouterConfig {
        drafts: vec![draft.endpoint()],
        targets: vec![tp.endpoint()],
        max_in_flight: 16,
        ..Default::default()
    });
    let prompts = [
        PROMPT,
        "Explain what a hash map is.",
        "Write a haiku about autumn.",
        "What is 17 times 23?",
        "List three prime numbers greater than 50.",
        "Translate 'good morning' into French.",
    ];
    let rt = runtime();
    let addr = router.endpoint();
    for mode in ["target", "parse+token-spec"] {
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                rt.block_on(async {
                    let mut client = Client::connect(&addr).await.unwrap();
                    let mut r = req(mode, 40);
                    r.prompt = (*p).into();
                    client.generate(r).await.unwrap().token_ids
                })
            })
            .collect();
        let together = rt.block_on(async {
            let calls: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let addr = addr.clone();
                    let mut r = req(mode, 40);
                    r.prompt = (*p).into();
                    tokio::spawn(async move {
                        let mut client = Client::connect(&addr).await.unwrap();
                        client.generate(r).await.unwrap().token_ids
                    })
                })
                .collect();
            let mut out = Vec::new();
            for call in calls {
                out.push(call.await.unwrap());
            }
            out
        });
        assert_eq!(
            together, alone,
            "{mode}: tokens changed among others in the group"
        );
    }
    let blocks = histogram_mean(&tp.worker.metrics().render(), "parse_worker_batch_blocks");
    assert!(
        blocks > 1.2,
        "the group's passes held {blocks} blocks on average"
    );
    drop(router);
    drop(tp);
    // The leader's shutdown tells the follower to stop.
    let _ = follower.join();
}

/// The reused prompt rows a target worker reports.
fn prefix_rows(worker: &parse_target_worker::TargetWorker) -> f64 {
    metric(worker, "parse_worker_prefix_rows_total{op=\"open\"}")
}

#[test]
fn a_prompt_sent_again_reuses_its_rows_only_in_its_cache_salt_namespace_and_answers_the_same() {
    let c = cluster(1, 1, 16);
    let rt = runtime();
    let addr = c.router.endpoint();
    let send = |mode: &str, salt: u64| {
        let mut r = req(mode, 24);
        r.sampling = Some(Sampling {
            cache_salt: salt,
            ..Default::default()
        });
        rt.block_on(async {
            let mut client = Client::connect(&addr).await.unwrap();
            client.generate(r).await.unwrap()
        })
    };
    let worker = &c.targets[0].worker;
    let first = send("target", 11);
    assert_eq!(prefix_rows(worker), 0.0, "nothing kept before the first");
    let other = send("target", 22);
    assert_eq!(
        prefix_rows(worker),
        0.0,
        "another namespace takes nothing of the first's prompt"
    );
    let again = send("target", 11);
    let reused = prefix_rows(worker);
    assert!(
        reused >= 8.0,
        "the same namespace reuses the prompt's rows ({reused})"
    );
    // PARSE through both workers in the same namespace: its prompt's rows come from the kept one on the target
    // (and on the draft worker from the draft's own), and the answer stays `target`'s.
    let parse = send("parse+token-spec", 11);
    assert!(prefix_rows(worker) >= 2.0 * reused);
    // Each reply's stats (the OpenAI API's usage.prompt_tokens_details.cached_tokens) count the rows its own open
    // took, as the worker did.
    let cached = |r: &parse_proto::v1::GenerateResponse| {
        r.stats.as_ref().unwrap().cached_prompt_tokens as f64
    };
    assert_eq!(
        [
            cached(&first),
            cached(&other),
            cached(&again),
            cached(&parse)
        ],
        [0.0, 0.0, reused, prefix_rows(worker) - reused]
    );
    for (r, what) in [
        (&other, "another namespace"),
        (&again, "reused"),
        (&parse, "parse+token-spec, reused"),
    ] {
        assert_eq!(r.token_ids, first.token_ids, "{what}: the answer changed");
    }
}
