use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A pool's shared figures and the pacing of its requests of `kind`, at a load of `load` requests.
fn pool(kind: &str, load: usize) -> (Arc<Costs>, Pacing) {
    let costs = Arc::new(Costs::default());
    let pacing = Pacing {
        costs: costs.clone(),
        kind: kind.into(),
        load: Arc::new(move || load),
        off_at: None,
    };
    (costs, pacing)
}

/// As [`pool`], at a load the test moves, with speculation off from `off_at` requests.
fn moving_pool(
    kind: &str,
    load: usize,
    off_at: Option<usize>,
) -> (Arc<Costs>, Pacing, Arc<AtomicUsize>) {
    let load = Arc::new(AtomicUsize::new(load));
    let costs = Arc::new(Costs::default());
    let l = load.clone();
    let pacing = Pacing {
        costs: costs.clone(),
        kind: kind.into(),
        load: Arc::new(move || l.load(Ordering::Relaxed)),
        off_at,
    };
    (costs, pacing, load)
}

#[test]
fn speculation_that_pays_per_token_starts_only_where_it_pays_for_the_drafters_catching_up() {
    let (costs, pacing) = pool("parse/model", 1);
    // At one request: the target alone 80 ms per token, speculation 50; the drafter prefills at 10 ms per token.
    costs.record_alone(None, 0, 800.0, 10);
    costs.record_spec("parse/model", 0, 500.0, 10, None);
    costs.record_entry("parse/model", 0, 1000.0, 100);
    let mut p = Pace::new(pacing.clone());
    // Fewer than 4 finished requests: judged over its whole budget (300 tokens left pay 9,000 ms for 400 to
    // catch up).
    costs.record_length(190);
    p.position(200, 300, 400);
    assert_eq!(p.advise(), Advice::Speculate);
    // The pool's requests ended at 220-260 tokens: 40 left on average, 1,200 ms of gain for 4,000 of prefill.
    for n in [220, 240, 260, 240] {
        costs.record_length(n);
    }
    // (The one that ended at 190 did not get that far.)
    assert_eq!(costs.expected_left(200, 300), 40);
    let mut p = Pace::new(pacing.clone());
    p.position(200, 300, 400);
    assert_eq!(p.advise(), Advice::Alone(PaceConfig::DEFAULT.max_pause));
    assert_eq!(p.entries_declined, 1);
    // A drafter 30 tokens behind pays (900 ms against 1,200).
    let mut p = Pace::new(pacing.clone());
    p.position(200, 300, 30);
    assert_eq!(p.advise(), Advice::Speculate);
    // Past every finished request's length: its own length stands for what is left (300 of the 500, 9,000 ms).
    assert_eq!(costs.expected_left(300, 100), 100);
    let mut p = Pace::new(pacing);
    p.position(300, 500, 400);
    assert_eq!(p.advise(), Advice::Speculate);
    // A request already speculating is not judged on its drafter's lag.
    p.speculated(
        Spent::wall(100.0),
        2,
        &[Spent::wall(60.0)],
        Spent::wall(0.0),
    );
    p.position(302, 498, 5000);
    assert_eq!(p.advise(), Advice::Speculate);
}

#[test]
fn a_pause_reports_at_the_load_where_its_call_ended() {
    let kind = "parse+token-spec/model";
    let (costs, pacing, load) = moving_pool(kind, 8, None);
    // At 8 requests (level 3) speculation loses: a pause.
    costs.record_alone(None, 3, 200.0, 10);
    costs.record_spec(kind, 3, 600.0, 10, None);
    let mut p = Pace::new(pacing);
    assert!(matches!(p.advise(), Advice::Alone(_)));
    assert_eq!(p.level(), 3);
    // Requests ended meanwhile: the call ended at 2 (level 1), where its passes held fewer rows and charged it
    // 60 ms a token. The figures of 2 requests take it; those of 5-8 keep their 20 ms.
    load.store(2, Ordering::Relaxed);
    let spent = Spent {
        wall_ms: 1000.0,
        charged_ms: Some(16.0 * 60.0),
    };
    p.wrote_alone(spent, 16);
    assert_eq!(costs.alone_ms(1), Some(60.0));
    assert_eq!(costs.spec_ms(&pause_kind(kind), 1), Some(60.0));
    assert_eq!(costs.alone_ms(3), Some(20.0));
    assert_eq!(costs.spec_ms(&pause_kind(kind), 3), None);
    // Its tokens count towards the next probe where it paused.
    assert_eq!(costs.since(kind, 3), 16);
    assert_eq!(costs.since(kind, 1), 0);
}

#[test]
fn speculation_turned_off_at_a_load_is_off_there_whatever_the_figures_say() {
    let kind = "parse+token-spec/model+ngram";
    let (costs, pacing, load) = moving_pool(kind, 8, Some(5));
    // At 8 requests (level 3) speculation writes at 20 ms a token against the target's 60, copies at 10, and
    // lookups cost nothing and are kept whole: every figure says speculate.
    costs.record_alone(None, 3, 600.0, 10);
    costs.record_spec(kind, 3, 200.0, 10, None);
    costs.record_spec(&copy_kind(kind), 3, 100.0, 10, None);
    token_rounds(&costs, kind, 3, 0.01, |d| d);
    let free = Pacing {
        off_at: None,
        ..pacing.clone()
    };
    let mut on = Pace::new(free);
    assert!(on.leans_to_speculate());
    assert_eq!(on.advise(), Advice::Speculate);
    assert!(on.copies_pay());

    let mut p = Pace::new(pacing.clone());
    assert!(!p.leans_to_speculate());
    assert_eq!(p.advise(), Advice::Alone(PaceConfig::DEFAULT.max_pause));
    assert_eq!(p.pauses, 1);
    assert!(!p.copies_pay());
    assert!(!p.guess_pays());
    // A token-level round's advice too, at one request where free rounds would go on without judging.
    load.store(1, Ordering::Relaxed);
    let one = Pacing {
        off_at: Some(1),
        ..pacing.clone()
    };
    costs.record_alone(None, 0, 600.0, 10);
    token_rounds(&costs, kind, 0, 0.01, |d| d);
    assert!(costs.free_rounds_pay(kind, 0, 6));
    assert_eq!(
        Pace::new(one).advise_token_round(6),
        Advice::Alone(PaceConfig::DEFAULT.max_pause)
    );
    // Below the setting the figures decide again: at 4 requests a fresh request speculates where they say so.
    load.store(4, Ordering::Relaxed);
    costs.record_alone(None, 2, 600.0, 10);
    costs.record_spec(kind, 2, 200.0, 10, None);
    let mut p = Pace::new(pacing);
    assert!(p.leans_to_speculate());
    assert_eq!(p.advise(), Advice::Speculate);
}

/// Token-level rounds of `kind` at `level`: drafts of 1 and 3 tokens in turn (so that the line of rows has two
/// points), each verified for 48 ms plus 12 per row and drafted for `draft_ms` a token, the target keeping
/// `keep` of each draft's tokens.
fn token_rounds(
    costs: &Costs,
    kind: &str,
    level: u32,
    draft_ms: f64,
    keep: impl Fn(usize) -> usize,
) {
    for r in 0..40 {
        let drafted = if r % 2 == 0 { 3 } else { 1 };
        let verify = 48.0 + 12.0 * (drafted + 1) as f64;
        costs.record_token_round(
            kind,
            level,
            drafted,
            keep(drafted),
            verify,
            draft_ms * drafted as f64,
        );
    }
}

#[test]
fn one_token_guesses_are_made_where_the_target_keeps_more_of_them_than_a_row_costs() {
    let kind = "token-spec/ngram";
    let guesses_made =
        |costs: &Costs, n: usize| (0..n).filter(|_| costs.guess_pays(kind, 0)).count();
    // Nothing measured: guesses measure.
    let (costs, _) = pool(kind, 1);
    assert_eq!(guesses_made(&costs, 5), 5);
    // The target alone 60 ms a token; a verification 48 ms plus 12 a row (a row 0.2 of a step): a guess round
    // (72 ms) pays where more than a fifth of the guesses are kept.
    costs.record_alone(None, 0, 600.0, 10);
    token_rounds(&costs, kind, 0, 0.01, |d| d);
    for i in 0..100 {
        costs.record_guess(kind, 0, 72.0, i % 10 < 3);
    }
    assert_eq!(guesses_made(&costs, 16), 16, "3 in 10 kept: they pay");
    for i in 0..400 {
        costs.record_guess(kind, 0, 72.0, i % 10 == 0);
    }
    // 1 in 10 kept: they lose, and only one place in GUESS_PROBE still guesses, to see the task change.
    assert_eq!(guesses_made(&costs, 4 * PaceConfig::DEFAULT.guess_probe), 4);
    // The same guesses where a row costs nothing to speak of (a verification 60 ms and 0.5 a row): they pay.
    let (costs, _) = pool(kind, 1);
    costs.record_alone(None, 0, 600.0, 10);
    for r in 0..40 {
        let drafted = if r % 2 == 0 { 3 } else { 1 };
        costs.record_token_round(kind, 0, drafted, drafted, 60.0 + 0.5 * drafted as f64, 0.0);
    }
    for i in 0..400 {
        costs.record_guess(kind, 0, 61.0, i % 10 == 0);
    }
    assert_eq!(guesses_made(&costs, 16), 16);
    // Guesses do not move the chance of the drafts' own positions: the draft length stays.
    let (with, without) = (Costs::default(), Costs::default());
    for c in [&with, &without] {
        c.record_alone(None, 0, 600.0, 10);
        token_rounds(c, kind, 0, 0.01, |d| d.min(2));
    }
    for _ in 0..100 {
        with.record_guess(kind, 0, 72.0, false);
    }
    assert_eq!(
        with.draft_length(kind, 0, 6),
        without.draft_length(kind, 0, 6)
    );
}

#[test]
fn free_rounds_that_pay_go_on_at_one_request_whatever_the_last_rounds_did() {
    let kind = "token-spec/ngram";
    // One request: the target alone 60 ms a token; the kind's recent rounds lost (200 ms a token), so the
    // request's own judgement pauses.
    let lost = |costs: &Costs, level: u32| {
        costs.record_alone(None, level, 600.0, 10);
        costs.record_spec(kind, level, 1000.0, 5, None);
    };
    let (costs, pacing) = pool(kind, 1);
    lost(&costs, 0);
    assert!(matches!(
        Pace::new(pacing.clone()).advise(),
        Advice::Alone(_)
    ));
    // Drafts that cost 0.01 ms a token (a lookup) and are kept whole: a round of 6 writes 7 tokens for 132 ms.
    token_rounds(&costs, kind, 0, 0.01, |d| d);
    assert!(costs.free_rounds_pay(kind, 0, 6));
    let mut p = Pace::new(pacing.clone());
    assert!(
        matches!(p.advise(), Advice::Alone(_)),
        "the judgement of its own rounds is unchanged"
    );
    // ... and a pause in progress ends.
    assert_eq!(p.advise_token_round(6), Advice::Speculate);
    p.speculated(
        Spent::wall(132.0),
        7,
        &[Spent::wall(132.0)],
        Spent::wall(0.0),
    );
    assert_eq!(Pace::new(pacing).advise_token_round(6), Advice::Speculate);

    // Drafts that are never kept (the best round, 1 token drafted, 72 ms for about 1 token, loses to the
    // target's 60), and drafts from a model (20 ms a token, more than a hundredth of a row): judged as before.
    let never_kept: fn(usize) -> usize = |_| 0;
    let kept: fn(usize) -> usize = |d| d;
    for (draft_ms, keep) in [(0.01, never_kept), (20.0, kept)] {
        let (costs, pacing) = pool(kind, 1);
        lost(&costs, 0);
        token_rounds(&costs, kind, 0, draft_ms, keep);
        assert!(!costs.free_rounds_pay(kind, 0, 6));
        assert!(matches!(
            Pace::new(pacing).advise_token_round(6),
            Advice::Alone(_)
        ));
    }

    // At 8 requests the pauses stay: there they keep speculation from losing to a batched target.
    let (costs, pacing) = pool(kind, 8);
    lost(&costs, 3);
    token_rounds(&costs, kind, 3, 0.01, |d| d);
    assert!(
        costs.free_rounds_pay(kind, 3, 6),
        "free rounds that would pay there"
    );
    assert!(matches!(
        Pace::new(pacing).advise_token_round(6),
        Advice::Alone(_)
    ));
}

#[test]
fn load_levels_are_powers_of_two() {
    let levels: Vec<u32> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17].map(load_level).to_vec();
    assert_eq!(levels, [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]);
    let labels: Vec<String> = (0..5).map(level_label).collect();
    assert_eq!(labels, ["1", "2", "3-4", "5-8", "9-16"]);
}

/// Runs `pace` for `n` decisions: speculative rounds at `spec` ms/token writing 2 tokens each, pauses at
/// `alone` ms/token. Returns the advice, in order.
fn drive(pace: &mut Pace, n: usize, spec: f64, alone: f64, verify: f64) -> Vec<Advice> {
    let mut seen = Vec::new();
    for _ in 0..n {
        let a = pace.advise();
        match a {
            Advice::Speculate => pace.speculated(
                Spent::wall(2.0 * spec),
                2,
                &[Spent::wall(verify)],
                Spent::wall(0.0),
            ),
            Advice::Alone(k) => pace.wrote_alone(Spent::wall(k as f64 * alone), k),
        }
        seen.push(a);
    }
    seen
}

/// Tokens written alone between speculative rounds.
fn gaps(seen: &[Advice]) -> Vec<usize> {
    seen.split(|a| *a == Advice::Speculate)
        .map(|run| {
            run.iter()
                .map(|a| match a {
                    Advice::Alone(k) => *k,
                    Advice::Speculate => 0,
                })
                .sum::<usize>()
        })
        .filter(|&n| n > 0)
        .collect()
}

#[test]
fn a_losing_speculation_pauses_longer_each_time_and_a_winning_one_is_left_alone() {
    // Speculation at 50 ms/token with verifications of 100 ms: it beats what a target step can cost, an upper
    // bound only. After its first round one short pause measures the target (90 ms/token), and speculation,
    // winning against that, is left alone from then on.
    let mut p = Pace::new(Pacing::alone("token-spec/model"));
    let seen = drive(&mut p, 40, 50.0, 90.0, 100.0);
    assert_eq!(gaps(&seen), [PaceConfig::DEFAULT.first_pause], "{seen:?}");
    assert_eq!(
        seen[1],
        Advice::Alone(PaceConfig::DEFAULT.first_pause),
        "{seen:?}"
    );
    assert!((p.pacing.costs.alone_ms(0).unwrap() - 90.0).abs() < 1e-9);
    // Rounds at 150 ms/token, with nothing to judge them by but the cheapest verification (100 ms): the first
    // round is followed by a short pause, which measures the target alone, not by PROBE - 1 more rounds.
    let mut p = Pace::new(Pacing::alone("token-spec/model"));
    assert_eq!(p.advise(), Advice::Speculate);
    p.speculated(
        Spent::wall(300.0),
        2,
        &[Spent::wall(100.0)],
        Spent::wall(0.0),
    );
    assert_eq!(p.advise(), Advice::Alone(PaceConfig::DEFAULT.first_pause));
    p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
    // Still losing against the target's measured 90 ms/token: a probe round once 16 tokens in all were written
    // alone; a probe of 2 tokens loses 120 ms, 1.33 tokens of the target's, so the next waits 43 tokens (32 times
    // that) and the gaps double from there (in pauses of at most 64 tokens), up to MAX_GAP.
    let seen = drive(&mut p, 200, 150.0, 90.0, 100.0);
    assert_eq!(
        &gaps(&seen)[..7],
        [12, 43, 86, 172, 344, 688, 1376],
        "{seen:?}"
    );
    assert_eq!(gaps(&seen)[8], PaceConfig::DEFAULT.max_gap, "{seen:?}");
    assert!(seen.iter().all(|a| *a <= Advice::Alone(64)));
    // The first pause's 4 tokens and the 12 after them are one pause.
    assert_eq!(p.pauses, gaps(&seen).len());
    // Once a probe wins (30 ms/token), it goes on speculating.
    let seen = drive(&mut p, 600, 30.0, 90.0, 100.0);
    assert!(
        seen[550..].iter().all(|a| *a == Advice::Speculate),
        "{seen:?}"
    );
}

#[test]
fn a_model_that_beats_the_target_but_loses_to_its_copies_rests() {
    let kind = "parse+token-spec/model+ngram";
    let (costs, pacing) = pool(kind, 1);
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    costs.record_spec(kind, 0, 16.0 * 80.0, 16, None);
    // The model (80 ms/token) beats the target alone (100): it speculates.
    assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
    // A round advised as speculation that was all copies goes to the copies' figure, not the model's.
    let mut p = Pace::new(pacing.clone());
    assert_eq!(p.advise(), Advice::Speculate);
    p.copies_only(Spent::wall(16.0 * 40.0), 16);
    assert_eq!(costs.spec_ms(kind, 0), Some(80.0));
    assert_eq!(costs.spec_ms(&copy_kind(kind), 0), Some(40.0));
    // Copies alone are no rival until a pause has measured what pauses write as a whole: the model goes on.
    assert_eq!(costs.pauses_ms(kind, 0), None);
    assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
    // A pause of copy rounds wrote at 40 ms/token: the model rests, and copy rounds fill its pauses.
    costs.record_paused(kind, 0, 16.0 * 40.0, 16);
    let mut p = Pace::new(pacing.clone());
    assert!(matches!(p.advise(), Advice::Alone(_)));
    assert!(p.copies_pay());
    // A probe of the model is judged against the copies: it lost 16 of their tokens, so the next waits 512.
    costs.record_spec(kind, 0, 16.0 * 80.0, 16, Some(0.0));
    assert_eq!(costs.until_probe(kind, 0), 512);
    // A speculation with no copies (the plain model) is judged against the target alone, as before.
    costs.record_spec("parse+token-spec/model", 0, 16.0 * 80.0, 16, None);
    let mut plain = Pace::new(Pacing {
        kind: "parse+token-spec/model".into(),
        ..pacing
    });
    assert_eq!(plain.advise(), Advice::Speculate);
}

#[test]
fn copy_rounds_that_lose_to_the_target_are_made_only_as_probes() {
    let (costs, pacing) = pool("parse+token-spec/model+ngram", 1);
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    let mut p = Pace::new(pacing.clone());
    // No figure of copies yet: a copy round measures them. It writes 16 tokens at 300 ms each: they lose.
    assert!(p.copies_pay());
    p.copied(Spent::wall(16.0 * 300.0), 16);
    assert_eq!(
        costs.spec_ms("parse+token-spec/model+ngram copies", 0),
        Some(300.0)
    );
    // Not the target's figure, nor the model's kind's.
    assert_eq!(costs.alone_ms(0), Some(100.0));
    assert_eq!(costs.spec_ms("parse+token-spec/model+ngram", 0), None);
    assert!(!p.copies_pay());
    // 16 tokens written alone make a probe due; it loses 32 tokens of the target's time, so the next waits 1024.
    p.wrote_alone(Spent::wall(16.0 * 100.0), 16);
    assert!(p.copies_pay());
    p.copied(Spent::wall(16.0 * 300.0), 16);
    assert!(!p.copies_pay());
    p.wrote_alone(Spent::wall(1000.0 * 100.0), 1000);
    assert!(!p.copies_pay());
    p.wrote_alone(Spent::wall(24.0 * 100.0), 24);
    assert!(p.copies_pay());
    // Copies that win are made whenever something matches.
    let costs = Arc::new(Costs::default());
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    let mut p = Pace::new(Pacing {
        costs: costs.clone(),
        ..pacing
    });
    p.copied(Spent::wall(16.0 * 20.0), 16);
    assert!((0..10).all(|_| p.copies_pay()));
}

#[test]
fn a_probe_is_out_one_at_a_time_and_goes_to_a_request_with_little_to_catch_up() {
    let kind = "parse+token-spec/model";
    let (costs, pacing) = pool(kind, 8);
    // At 5-8 requests: the target alone 10 ms per token, speculation 40; the drafter prefills at 5 ms per token.
    costs.record_alone(None, 3, 16.0 * 10.0, 16);
    costs.record_spec(kind, 3, 20.0 * 40.0, 20, None);
    costs.record_entry(kind, 3, 500.0, 100);
    // 64 tokens written alone since: past the least gap (16).
    costs.record_alone(Some(kind), 3, 64.0 * 10.0, 64);
    // 300 tokens behind, a request would spend 1,500 ms (150 of the target's tokens) catching up first: its
    // probe waits for 32 times that more.
    let mut far = Pace::new(pacing.clone());
    far.position(300, 84, 300);
    assert!(matches!(far.advise(), Advice::Alone(_)));
    assert!(!far.probing());
    // One token behind (half a target token to catch up, 32 more written alone): it probes.
    let mut near = Pace::new(pacing.clone());
    near.position(40, 300, 1);
    assert_eq!(near.advise(), Advice::Speculate);
    assert!(near.probing());
    // While its probe is out, no other is taken, however much is written alone meanwhile.
    costs.record_alone(Some(kind), 3, 64.0 * 10.0, 64);
    let mut other = Pace::new(pacing.clone());
    other.position(40, 300, 1);
    assert!(matches!(other.advise(), Advice::Alone(_)));
    // Its request ended before the round reported: the probe is given back, and the next request takes it.
    drop(near);
    let mut other = Pace::new(pacing);
    other.position(40, 300, 1);
    assert_eq!(other.advise(), Advice::Speculate);
    assert!(other.probing());
}

#[test]
fn a_first_round_at_a_load_goes_to_a_request_with_little_to_catch_up_and_is_judged_as_a_probe() {
    let kind = "parse+token-spec/model";
    let (costs, pacing) = pool(kind, 4);
    // At 3-4 requests the target alone writes at 10 ms per token; the drafter's prefill (measured at 2
    // requests) costs 5 ms per token; no round of speculation was made at 3-4 yet.
    costs.record_alone(None, 2, 16.0 * 10.0, 16);
    costs.record_entry(kind, 1, 500.0, 100);
    // 300 tokens behind: 150 target tokens to catch up, more than the 0 written alone here so far pay for.
    let mut far = Pace::new(pacing.clone());
    far.position(300, 84, 300);
    assert_eq!(far.advise(), Advice::Alone(PaceConfig::DEFAULT.max_pause));
    assert_eq!(far.entries_declined, 1);
    far.wrote_alone(Spent::wall(64.0 * 10.0), 64);
    // 20 behind (10 target tokens to catch up, 320 written alone needed): once that much was, it measures.
    let mut near = Pace::new(pacing.clone());
    near.position(0, 384, 20);
    assert!(matches!(near.advise(), Advice::Alone(_)));
    costs.record_alone(Some(kind), 2, 256.0 * 10.0, 256);
    let mut near = Pace::new(pacing);
    near.position(0, 384, 20);
    assert_eq!(near.advise(), Advice::Speculate);
    // Its round keeps 20 tokens for 800 ms, after 100 ms of catching up: it lost 70 of the target's tokens,
    // so no probe before 32 times as many are written alone here.
    near.speculated(
        Spent::wall(800.0),
        20,
        &[Spent::wall(300.0)],
        Spent::wall(100.0),
    );
    assert_eq!(costs.until_probe(kind, 2), 2240);
}

#[test]
fn a_drafter_with_far_more_to_catch_up_on_than_tokens_left_does_not_start_on_a_fresh_router() {
    let kind = "parse+token-spec/model";
    let (costs, pacing) = pool(kind, 1);
    // Nothing measured: a long prompt with a few tokens to write writes them alone.
    let mut far = Pace::new(pacing.clone());
    far.position(0, 4, 16_000);
    assert_eq!(far.advise(), Advice::Alone(PaceConfig::DEFAULT.max_pause));
    assert_eq!(far.entries_declined, 1);
    // The same prompt with a budget that could pay for it, and a short prompt, make the first round.
    let mut long = Pace::new(pacing.clone());
    long.position(0, 1024, 16_000);
    assert_eq!(long.advise(), Advice::Speculate);
    drop(long);
    let mut short = Pace::new(pacing.clone());
    short.position(0, 4, 100);
    assert_eq!(short.advise(), Advice::Speculate);
    drop(short);
    // Once a drafter's prefill is priced, this rule steps aside (the price judges the entry where a figure of
    // speculation is there to weigh it against).
    costs.record_entry(kind, 0, 160.0, 16_000);
    let mut priced = Pace::new(pacing);
    priced.position(0, 4, 16_000);
    assert_eq!(priced.advise(), Advice::Speculate);
}

#[test]
fn at_one_request_the_drafters_catching_up_is_priced_by_what_other_loads_measured() {
    let kind = "parse+token-spec/model";
    let (costs, pacing) = pool(kind, 1);
    // The drafter's prefill was measured at 5-8 requests only (5 ms per token); at one request the target alone
    // writes at 60 ms per token and no round was made there yet.
    costs.record_entry(kind, 3, 500.0, 100);
    costs.record_alone(None, 0, 16.0 * 60.0, 16);
    assert_eq!(costs.entry_ms(kind, 0), Some(5.0));
    // 400 tokens behind: 2,000 ms of catching up, 34 of the target's tokens, more than the 0 written alone at one
    // request so far pay for: no first round, a full pause.
    let mut far = Pace::new(pacing.clone());
    far.position(250, 40, 400);
    assert_eq!(far.advise(), Advice::Alone(PaceConfig::DEFAULT.max_pause));
    assert_eq!(far.entries_declined, 1);
    // Nothing to catch up on: it makes the first round.
    let mut near = Pace::new(pacing);
    near.position(0, 300, 0);
    assert_eq!(near.advise(), Advice::Speculate);
    // A price measured at one request stands in at the other loads as well.
    let c = Costs::default();
    c.record_entry(kind, 0, 300.0, 100);
    assert_eq!(c.entry_ms(kind, 2), Some(3.0));
}

#[test]
fn a_probe_that_loses_by_far_waits_32_times_what_it_lost_setup_included() {
    let c = Costs::default();
    let kind = "parse+token-spec/model";
    c.record_alone(None, 3, 16.0 * 100.0, 16);
    // A round keeping 60 tokens at 270 ms/token against the target's 100: speculation loses at this level.
    c.record_spec(kind, 3, 60.0 * 270.0, 60, None);
    assert_eq!(c.until_probe(kind, 3), PaceConfig::DEFAULT.min_gap);
    c.record_alone(Some(kind), 3, 16.0 * 100.0, 16);
    assert!(c.take_probe(kind, 3, 0));
    // The probe loses the same: 102 tokens of the target's time lost, so 3264 tokens alone before the next.
    c.record_spec(kind, 3, 60.0 * 270.0, 60, Some(0.0));
    c.probe_back(kind, 3);
    assert_eq!(c.until_probe(kind, 3), 3264);
    // Losing by more, it waits at most MAX_GAP; a probe that wins brings the least gap back.
    c.record_alone(Some(kind), 3, 3264.0 * 100.0, 3264);
    assert!(c.take_probe(kind, 3, 0));
    c.record_spec(kind, 3, 60.0 * 600.0, 60, Some(0.0));
    assert_eq!(c.until_probe(kind, 3), PaceConfig::DEFAULT.max_gap);
    for _ in 0..20 {
        c.record_spec(kind, 3, 60.0 * 50.0, 60, Some(0.0));
    }
    assert_eq!(c.until_probe(kind, 3), PaceConfig::DEFAULT.min_gap);
    // A probe that loses a little (60 tokens at 110 ms/token: 6 tokens of the target's) but had to prefill the
    // draft first (3 s, 30 tokens of the target's) lost 36: the next waits 1152 tokens, not 192. The prefill is
    // not part of the rate.
    let c = Costs::default();
    c.record_alone(None, 3, 16.0 * 100.0, 16);
    c.record_spec(kind, 3, 60.0 * 110.0, 60, Some(3000.0));
    assert_eq!(c.until_probe(kind, 3), 1152);
    assert!((c.spec_ms(kind, 3).unwrap() - 110.0).abs() < 1e-9);
    let c = Costs::default();
    c.record_alone(None, 3, 16.0 * 100.0, 16);
    c.record_spec(kind, 3, 60.0 * 110.0, 60, Some(0.0));
    assert_eq!(c.until_probe(kind, 3), 192);
}

#[test]
fn a_load_with_no_figure_of_the_target_borrows_the_nearest_measured_the_same_way() {
    let c = Costs::default();
    assert_eq!(c.alone_near(3), None);
    c.record_alone(None, 0, 16.0 * 900.0, 16);
    // Level 0's figure is wall time: not a stand-in for charged time above it, nor the reverse.
    assert_eq!(c.alone_near(4), None);
    c.record_alone(None, 3, 16.0 * 50.0, 16);
    c.record_alone(None, 1, 16.0 * 70.0, 16);
    assert_eq!(c.alone_near(4), Some(50.0));
    assert_eq!(c.alone_near(2), Some(70.0), "the lower of two as near");
    assert_eq!(c.alone_near(1), Some(70.0));
    assert_eq!(c.alone_near(0), Some(900.0));
    c.record_alone(None, 4, 16.0 * 40.0, 16);
    assert_eq!(c.alone_near(4), Some(40.0));
    // A request at 9-16 requests whose speculation loses to the target at 5-8 pauses at once, for the short
    // first pause that measures the target at its own load.
    let costs = Arc::new(Costs::default());
    costs.record_alone(None, 3, 16.0 * 50.0, 16);
    let kind = "parse+token-spec/model";
    costs.record_spec(kind, 4, 60.0 * 130.0, 60, None);
    let mut p = Pace::new(Pacing {
        costs: costs.clone(),
        kind: kind.into(),
        load: Arc::new(|| 9),
        off_at: None,
    });
    assert_eq!(p.advise(), Advice::Alone(PaceConfig::DEFAULT.first_pause));
}

#[test]
fn figures_weigh_samples_by_their_tokens() {
    let c = Costs::default();
    for _ in 0..10 {
        c.record_alone(None, 0, 16.0 * 100.0, 16);
    }
    assert!((c.alone_ms(0).unwrap() - 100.0).abs() < 1e-9);
    // One slow step (5 s for one token) moves the rate by about a fortieth of the gap, not by 0.4 of it.
    c.record_alone(None, 0, 5000.0, 1);
    let a = c.alone_ms(0).unwrap();
    assert!(a > 200.0 && a < 240.0, "{a}");
    // A stretch of 16 tokens at 300 ms moves it by about 0.4 of the way.
    let c = Costs::default();
    for _ in 0..10 {
        c.record_alone(None, 0, 16.0 * 100.0, 16);
    }
    c.record_alone(None, 0, 16.0 * 300.0, 16);
    let a = c.alone_ms(0).unwrap();
    assert!((a - 180.0).abs() < 2.0, "{a}");
}

#[test]
fn requests_at_the_same_load_share_what_others_measured_and_one_probe() {
    let (_, pacing, load) = moving_pool("parse+token-spec/model", 8, None);
    // One request learns that at 8 requests speculation (150 ms/token) loses to the target (90 ms/token): its 3
    // rounds, pauses of 4 and 12 tokens, a probe, 43 tokens alone, a probe, 64 of the next 86 tokens alone.
    let mut first = Pace::new(pacing.clone());
    drive(&mut first, 9, 150.0, 90.0, 100.0);
    assert!(first.paused_tokens > 0);
    let seen = pacing.costs.snapshot();
    assert!(seen.iter().all(|f| f.level == 3), "{seen:?}");
    // A new request at that load starts writing alone, with no probe rounds of its own.
    let mut second = Pace::new(pacing.clone());
    assert!(matches!(second.advise(), Advice::Alone(_)));
    // When a probe is due, only one of two waiting requests makes it.
    let mut a = Pace::new(pacing.clone());
    let mut b = Pace::new(pacing.clone());
    pacing
        .costs
        .record_alone(Some(&pacing.kind), 3, 512.0 * 90.0, 512);
    let advice = [a.advise(), b.advise()];
    assert_eq!(
        advice.iter().filter(|x| **x == Advice::Speculate).count(),
        1,
        "{advice:?}"
    );
    // At one request the same kind has no figure yet: a request there speculates, and learns.
    load.store(1, Ordering::Relaxed);
    let mut alone = Pace::new(pacing.clone());
    assert_eq!(alone.advise(), Advice::Speculate);
    // Target-mode requests tell the others what the target costs at their load.
    Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 70.0), 16);
    assert_eq!(pacing.costs.alone_ms(0), Some(70.0));
}

/// A router's shared figures, empty, with 8 requests per target worker.
fn fresh_pool_at_eight() -> Pacing {
    Pacing {
        costs: Arc::new(Costs::default()),
        kind: "parse+token-spec/model".into(),
        load: Arc::new(|| 8),
        off_at: None,
    }
}

#[test]
fn on_a_fresh_router_one_request_measures_and_the_others_are_judged_on_its_rounds() {
    let pacing = fresh_pool_at_eight();
    // A round that loses: 40 tokens at 150 ms/token against the target's 90.
    let losing_round = |p: &mut Pace| {
        p.speculated(
            Spent::wall(40.0 * 150.0),
            40,
            &[Spent::wall(200.0)],
            Spent::wall(0.0),
        )
    };
    // The target's figure at this load is known (from `target`-mode requests), speculation's is not.
    Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
    let mut all: Vec<Pace> = (0..8).map(|_| Pace::new(pacing.clone())).collect();
    let advice: Vec<Advice> = all.iter_mut().map(|p| p.advise()).collect();
    assert_eq!(
        advice[0],
        Advice::Speculate,
        "no figure: one request measures"
    );
    assert!(
        advice[1..]
            .iter()
            .all(|a| *a == Advice::Alone(PaceConfig::DEFAULT.first_pause)),
        "the others wait for its figure, in short pauses: {advice:?}"
    );
    // While its round runs, the others go on waiting, and take no probe (there is nothing losing to probe).
    for p in all[1..].iter_mut() {
        p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
        assert_eq!(p.advise(), Advice::Alone(PaceConfig::DEFAULT.first_pause));
        p.wrote_alone(Spent::wall(4.0 * 90.0), 4);
    }
    // Its round loses: the others are judged on the pool's figure and write alone from here; it goes on to
    // PROBE rounds of its own (they refine the figure the others read), then writes alone too.
    losing_round(&mut all[0]);
    for (i, p) in all[1..].iter_mut().enumerate() {
        assert!(matches!(p.advise(), Advice::Alone(_)), "request {}", i + 1);
    }
    for _ in 1..PaceConfig::DEFAULT.probe_rounds {
        assert_eq!(all[0].advise(), Advice::Speculate);
        losing_round(&mut all[0]);
    }
    assert!(matches!(all[0].advise(), Advice::Alone(_)));
    // A request whose rounds are the only ones reported at its load is still judged after PROBE rounds.
    let pacing = Pacing {
        costs: Arc::new(Costs::default()),
        ..pacing
    };
    Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
    let mut p = Pace::new(pacing.clone());
    for _ in 0..PaceConfig::DEFAULT.probe_rounds {
        assert_eq!(p.advise(), Advice::Speculate);
        losing_round(&mut p);
    }
    assert!(matches!(p.advise(), Advice::Alone(_)));
}

#[test]
fn a_first_round_that_wins_lets_the_others_speculate_and_one_that_never_reports_frees_its_place() {
    let pacing = fresh_pool_at_eight();
    Pace::new(pacing.clone()).target_wrote(Spent::wall(16.0 * 90.0), 16);
    let mut a = Pace::new(pacing.clone());
    let mut b = Pace::new(pacing.clone());
    assert_eq!(a.advise(), Advice::Speculate);
    assert_eq!(b.advise(), Advice::Alone(PaceConfig::DEFAULT.first_pause));
    b.wrote_alone(Spent::wall(4.0 * 90.0), 4);
    // A round at 30 ms/token against the target's 90: the waiting request speculates too.
    a.speculated(
        Spent::wall(40.0 * 30.0),
        40,
        &[Spent::wall(200.0)],
        Spent::wall(0.0),
    );
    assert_eq!(b.advise(), Advice::Speculate);
    // At another load with no figure, a measuring request that ends before it reports lets the next one measure.
    let fresh = fresh_pool_at_eight();
    let mut gone = Pace::new(fresh.clone());
    let mut next = Pace::new(fresh.clone());
    assert_eq!(gone.advise(), Advice::Speculate);
    assert_eq!(
        next.advise(),
        Advice::Alone(PaceConfig::DEFAULT.first_pause)
    );
    next.wrote_alone(Spent::wall(4.0 * 90.0), 4);
    drop(gone);
    assert_eq!(next.advise(), Advice::Speculate);
}

#[test]
fn the_target_measured_beside_others_speculation_leaves_its_figure_alone() {
    let pacing = fresh_pool_at_eight();
    let step = |ms: f64| Spent {
        wall_ms: 0.0,
        charged_ms: Some(16.0 * ms),
    };
    // With no figure yet, a stretch written beside a speculative round is taken: it is all there is.
    let mut drafting = Pace::new(pacing.clone());
    let paused = Pace::new(pacing.clone());
    assert_eq!(drafting.advise(), Advice::Speculate);
    paused.target_wrote(step(90.0), 16);
    assert_eq!(pacing.costs.alone_ms(3), Some(90.0));
    drafting.speculated(step(50.0), 16, &[step(50.0)], Spent::wall(0.0));
    // Once the round is over, the target's stretches count (a stretch of 0 ms began after it ended).
    for _ in 0..20 {
        paused.target_wrote(step(30.0), 16);
    }
    let quiet = pacing.costs.alone_ms(3).unwrap();
    assert!((quiet - 30.0).abs() < 0.1, "{quiet}");
    // Beside a round that runs, or one that ended within the stretch, they count towards probes only.
    assert_eq!(drafting.advise(), Advice::Speculate);
    paused.target_wrote(step(120.0), 16);
    let mut mine = Pace::new(pacing.clone());
    mine.wrote_alone(step(120.0), 16);
    assert_eq!(pacing.costs.alone_ms(3), Some(quiet));
    drafting.speculated(step(50.0), 16, &[step(50.0)], Spent::wall(0.0));
    paused.target_wrote(
        Spent {
            wall_ms: 60_000.0,
            charged_ms: Some(16.0 * 120.0),
        },
        16,
    );
    assert_eq!(pacing.costs.alone_ms(3), Some(quiet));
    // A request's own round is not beside itself: a target step in it (the draft had nothing) counts, and a
    // request that ends in the middle of a round leaves no round running.
    assert_eq!(drafting.advise(), Advice::Speculate);
    drafting.target_wrote(step(30.0), 16);
    // Nor is a round of its own that ends at its next advice, after the stretch that follows began.
    let long = Spent {
        wall_ms: 60_000.0,
        charged_ms: Some(16.0 * 10.0),
    };
    assert_eq!(drafting.advise(), Advice::Speculate);
    drafting.wrote_alone(long, 16);
    let before_drop = pacing.costs.alone_ms(3).unwrap();
    assert!(before_drop < quiet - 5.0, "{before_drop} {quiet}");
    drop(drafting);
    paused.target_wrote(step(60.0), 16);
    assert!(pacing.costs.alone_ms(3).unwrap() > quiet + 1.0);
}

#[test]
fn under_load_charged_worker_time_decides_and_alone_wall_time_at_one_request() {
    let (_, pacing, load) = moving_pool("parse+token-spec/model", 8, None);
    // At 8 requests a target step waits for a pass full of the others' verification blocks (800 ms of wall
    // time per token) but is charged one row's share of it (40 ms); a speculative round writes 2 tokens in
    // 600 ms of wall time, charged 200 ms. By wall time speculation would win; by charge it loses.
    let spec = Spent {
        wall_ms: 600.0,
        charged_ms: Some(200.0),
    };
    let step = Spent {
        wall_ms: 16.0 * 800.0,
        charged_ms: Some(16.0 * 40.0),
    };
    Pace::new(pacing.clone()).target_wrote(step, 16);
    assert_eq!(pacing.costs.alone_ms(3), Some(40.0));
    let mut p = Pace::new(pacing.clone());
    assert_eq!(p.advise(), Advice::Speculate);
    p.speculated(spec, 2, &[spec], Spent::wall(0.0));
    let at_eight = pacing.costs.spec_ms(&pacing.kind, 3).unwrap();
    assert!((at_eight - 100.0).abs() < 1e-9, "{at_eight}");
    // 2.5 times the target's step: judged after this first round, not after PROBE rounds (a loss of less
    // than FAR_BEHIND times waits for them: `on_a_fresh_router_one_request_measures...`).
    assert!(matches!(p.advise(), Advice::Alone(_)));
    // At one request the same costs are read by wall time: speculation (300 ms/token) beats the target (800).
    load.store(1, Ordering::Relaxed);
    Pace::new(pacing.clone()).target_wrote(step, 16);
    assert_eq!(pacing.costs.alone_ms(0), Some(800.0));
    let mut p = Pace::new(pacing.clone());
    for _ in 0..2 * PaceConfig::DEFAULT.probe_rounds {
        assert_eq!(p.advise(), Advice::Speculate);
        p.speculated(spec, 2, &[spec], Spent::wall(0.0));
    }
    let at_one = pacing.costs.spec_ms(&pacing.kind, 0).unwrap();
    assert!((at_one - 300.0).abs() < 1e-9, "{at_one}");
}

/// Token-level rounds of `kind` at level 0, each drafting `drafted` with `accepted` kept, verification costing a
/// 10 ms step and `row` ms per drafted row, drafting `draft` ms per token.
fn rounds(costs: &Costs, n: usize, drafted: usize, accepted: usize, row: f64, draft: f64) {
    for _ in 0..n {
        let verify = 10.0 + row * drafted as f64;
        costs.record_token_round("k", 0, drafted, accepted, verify, draft * drafted as f64);
    }
}

#[test]
fn a_round_drafts_as_far_as_pays_by_measured_acceptance_and_row_costs() {
    let costs = Costs::default();
    // No figure yet: as far as the request allows (which measures the positions).
    assert_eq!(costs.draft_length("k", 0, 6), 6);
    costs.record_alone(None, 0, 10.0, 1);
    assert_eq!(costs.draft_length("k", 0, 6), 6, "no verification measured");
    // Drafts whose first two tokens are kept and never the third, rows at half a step: two pays, more does not.
    rounds(&costs, 40, 6, 2, 5.0, 0.0);
    assert_eq!(costs.draft_length("k", 0, 6), 2);
    // Every draft kept whole, rows at a twentieth of a step: as far as the request allows.
    let cheap = Costs::default();
    cheap.record_alone(None, 0, 10.0, 1);
    rounds(&cheap, 40, 6, 6, 0.5, 0.0);
    assert_eq!(cheap.draft_length("k", 0, 6), 6);
    assert_eq!(
        cheap.draft_length("k", 0, 3),
        3,
        "never past the request's own most"
    );
    // The same acceptance with a dear drafter (a model at 8 ms a token against a 10 ms step): shorter.
    let dear = Costs::default();
    dear.record_alone(None, 0, 10.0, 1);
    for _ in 0..40 {
        for kept in [6, 1, 3, 0] {
            dear.record_token_round("k", 0, 6, kept, 10.0 + 0.5 * 6.0, 8.0 * 6.0);
        }
    }
    let long = dear.draft_length("k", 0, 6);
    let free = Costs::default();
    free.record_alone(None, 0, 10.0, 1);
    for _ in 0..40 {
        for kept in [6, 1, 3, 0] {
            free.record_token_round("k", 0, 6, kept, 10.0 + 0.5 * 6.0, 0.0);
        }
    }
    assert!(long < free.draft_length("k", 0, 6), "{long}");
    // Another kind, or another load's costs, are not this one's.
    assert_eq!(costs.draft_length("other", 0, 6), 6);
}

#[test]
fn a_position_no_longer_reached_drifts_back_and_is_tried_again() {
    let costs = Costs::default();
    costs.record_alone(None, 0, 10.0, 1);
    // Only the first token kept for a while: one token per round.
    rounds(&costs, 40, 4, 1, 5.0, 0.0);
    assert_eq!(costs.draft_length("k", 0, 4), 1);
    // Then one-token drafts, all kept: position 2's figure fades towards position 1's, and longer drafts return.
    rounds(&costs, 200, 1, 1, 5.0, 0.0);
    assert!(costs.draft_length("k", 0, 4) > 1);
}

#[test]
fn with_no_step_measured_some_rounds_draft_half_as_far_and_the_line_through_them_prices_a_step() {
    let costs = Costs::default();
    // Verifications at 10 ms plus 5 per drafted row, every draft kept; nothing written alone.
    let mut lengths = Vec::new();
    for _ in 0..8 {
        let k = costs.draft_length("k", 0, 6);
        lengths.push(k);
        costs.record_token_round("k", 0, k, k, 10.0 + 5.0 * k as f64, 0.0);
    }
    assert_eq!(&lengths[..4], [6, 6, 6, 3], "{lengths:?}");
    // With two lengths seen, the line prices a one-row pass: 5 ms fixed and 5 per row (the pending token's
    // included), 10.
    let one = costs.one_row_ms("k", 0).unwrap();
    assert!((one - 10.0).abs() < 1e-6, "{one}");
    // A pace with no figure of the target alone judges speculation against that pass: rounds writing a token
    // per 20 ms lose to it and the request pauses.
    let pacing = Pacing {
        costs: Arc::new(costs),
        kind: "k".into(),
        load: Arc::new(|| 1),
        off_at: None,
    };
    let mut p = Pace::new(pacing);
    for _ in 0..PaceConfig::DEFAULT.probe_rounds {
        assert_eq!(p.advise(), Advice::Speculate);
        p.speculated(Spent::wall(40.0), 2, &[Spent::wall(40.0)], Spent::wall(0.0));
    }
    assert!(matches!(p.advise(), Advice::Alone(_)));
}

#[test]
fn a_model_is_set_against_what_its_pauses_wrote_as_a_whole_not_its_copies_alone() {
    let kind = "parse+token-spec/model+ngram";
    let (costs, pacing) = pool(kind, 1);
    costs.record_alone(None, 0, 16.0 * 70.0, 16);
    costs.record_spec(kind, 0, 16.0 * 45.0, 16, None);
    costs.record_spec(&copy_kind(kind), 0, 16.0 * 30.0, 16, None);
    // A pause of a copy round (30 ms a token) and one that found nothing to copy (the target's steps to the
    // segment's end, 90): 67.5 ms a token as a whole, the later weighing more.
    let mut p = Pace::new(pacing.clone());
    p.copied(Spent::wall(16.0 * 30.0), 16);
    p.copied_nothing(Spent::wall(16.0 * 90.0), 16);
    assert_eq!(costs.pauses_ms(kind, 0), Some(67.5));
    // The model (45) beats that and the target alone (70), though not the copy rounds' own 30: it speculates.
    assert_eq!(Pace::new(pacing.clone()).advise(), Advice::Speculate);
    // Once its pauses write faster than the model, it rests (but for one probe, which the first request takes).
    costs.record_paused(kind, 0, 64.0 * 20.0, 64);
    assert!(costs.pauses_ms(kind, 0).unwrap() < 45.0);
    let mut first = Pace::new(pacing.clone());
    assert_eq!(first.advise(), Advice::Speculate);
    assert!(first.probing());
    assert!(matches!(Pace::new(pacing).advise(), Advice::Alone(_)));
}

#[test]
fn rounds_of_the_sort_that_writes_faster_and_now_and_then_of_the_other() {
    let kind = "parse+token-spec/model+ngram";
    let (costs, pacing) = pool(kind, 1);
    let round = |p: &mut Pace, ms: f64, tokens: usize| {
        assert_eq!(p.advise(), Advice::Speculate);
        let sort = p.choose_rounds();
        p.speculated(
            Spent::wall(ms * tokens as f64),
            tokens,
            &[],
            Spent::wall(0.0),
        );
        sort
    };
    costs.record_alone(None, 0, 16.0 * 100.0, 16);
    costs.record_spec(kind, 0, 16.0 * 60.0, 16, None);
    let mut p = Pace::new(pacing.clone());
    // No figure of either sort: PARSE rounds first. The first round of a choice pays for the switch and goes to
    // no sort's figure; the request keeps its sort for STREAK tokens.
    assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
    assert_eq!(costs.spec_ms(&Rounds::Segments.figure(kind), 0), None);
    assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
    assert_eq!(costs.spec_ms(&Rounds::Segments.figure(kind), 0), Some(60.0));
    assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
    assert_eq!(round(&mut p, 60.0, 8), Rounds::Segments);
    // PARSE rounds measured, token-level ones not: a request tries those (its first round a switch again).
    assert_eq!(round(&mut p, 90.0, 8), Rounds::Tokens);
    assert_eq!(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), None);
    for _ in 0..4 {
        assert_eq!(round(&mut p, 30.0, 8), Rounds::Tokens);
    }
    let near = |x: Option<f64>, y: f64| x.is_some_and(|x| (x - y).abs() < 1e-9);
    assert!(near(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), 30.0));
    // Token-level rounds write faster: the pace judges speculation by them, and a request makes them...
    assert!(near(costs.best_spec_ms(kind, 0), 30.0));
    let sorts: Vec<Rounds> = (0..40).map(|_| round(&mut p, 30.0, 8)).collect();
    // ... except a streak of PARSE rounds (STREAK tokens) each time the token-level ones wrote TRY_OTHER_EVERY
    // tokens (counted from the PARSE rounds' last report, before the five token-level rounds above).
    let streaks: Vec<(Rounds, usize)> = sorts
        .chunk_by(|a, b| a == b)
        .map(|c| (c[0], c.len()))
        .collect();
    let (per_streak, between) = (
        PaceConfig::DEFAULT.streak / 8,
        PaceConfig::DEFAULT.try_other_every / 8,
    );
    assert_eq!(
        streaks,
        vec![
            (Rounds::Tokens, between - 5),
            (Rounds::Segments, per_streak),
            (Rounds::Tokens, between),
            (Rounds::Segments, per_streak),
            (Rounds::Tokens, 40 - 2 * (between + per_streak) + 5),
        ]
    );
    // A pause ends a streak: the round after it is a switch, whatever its sort.
    p.pause(4, Why::Loses);
    p.wrote_alone(Spent::wall(400.0), 4);
    let before = costs.spec_ms(&Rounds::Tokens.figure(kind), 0);
    assert_eq!(round(&mut p, 500.0, 8), Rounds::Tokens);
    assert_eq!(costs.spec_ms(&Rounds::Tokens.figure(kind), 0), before);
}

/// A clock the test moves, and the instant it reads.
fn test_clock() -> (Clock, Arc<Mutex<std::time::Instant>>) {
    let now = Arc::new(Mutex::new(std::time::Instant::now()));
    let read = now.clone();
    (Clock::new(move || *read.lock().unwrap()), now)
}

#[test]
fn a_pause_says_why_and_its_length_comes_from_the_pools_tunables() {
    // Speculation off at this load: the longest pause of the pool's tunables.
    let cfg = PaceConfig {
        max_pause: 16,
        ..PaceConfig::DEFAULT
    };
    let pacing = Pacing {
        costs: Arc::new(Costs::with_config(cfg, Clock::default())),
        kind: "parse/model".into(),
        load: Arc::new(|| 8),
        off_at: Some(4),
    };
    let mut p = Pace::new(pacing);
    assert_eq!(p.why(), None);
    assert_eq!(p.advise(), Advice::Alone(16));
    assert_eq!(p.why(), Some(Why::Off));
    // Speculation that loses to the target alone, with no probe due.
    let (costs, pacing) = pool("parse/model", 1);
    costs.record_alone(None, 0, 500.0, 10);
    costs.record_spec("parse/model", 0, 800.0, 10, None);
    let mut p = Pace::new(pacing);
    assert!(matches!(p.advise(), Advice::Alone(_)));
    assert_eq!(p.why(), Some(Why::Loses));
}

#[test]
fn a_stretch_of_the_target_that_ran_beside_a_round_by_the_pools_clock_leaves_the_targets_figure_alone()
 {
    let (clock, now) = test_clock();
    let costs = Arc::new(Costs::with_config(PaceConfig::DEFAULT, clock));
    let pacing = Pacing {
        costs: costs.clone(),
        kind: "token-spec/model".into(),
        load: Arc::new(|| 8),
        off_at: None,
    };
    let stretch = |ms_per_token: f64| Spent {
        wall_ms: 100.0,
        charged_ms: Some(16.0 * ms_per_token),
    };
    let alone = Pace::new(pacing.clone());
    alone.target_wrote(stretch(30.0), 16);
    assert_eq!(costs.alone_ms(3), Some(30.0));
    // Another request's round ends; 50 ms later a stretch of 100 ms of the target ends: the round ran within it.
    let mut other = Pace::new(pacing.clone());
    assert_eq!(other.advise(), Advice::Speculate);
    other.speculated(stretch(20.0), 16, &[stretch(20.0)], Spent::wall(0.0));
    *now.lock().unwrap() += std::time::Duration::from_millis(50);
    alone.target_wrote(stretch(90.0), 16);
    assert_eq!(costs.alone_ms(3), Some(30.0));
    // 200 ms after the round ended, a stretch of 100 ms began after it: it counts.
    *now.lock().unwrap() += std::time::Duration::from_millis(150);
    alone.target_wrote(stretch(90.0), 16);
    assert!(costs.alone_ms(3).unwrap() > 30.0, "{:?}", costs.alone_ms(3));
}
