//! Stochastic token-spec is lossless: its output follows the target's sampling distribution exactly.
//!
//! Fake models over a five-token vocabulary whose next-token distributions depend on the last two tokens; the draft's
//! distribution differs from the target's so that rejections are frequent. Thousands of seeded runs (deterministic:
//! seeds 0..N) are compared with the exact distribution of the first three output tokens under the target alone,
//! by a chi-square statistic on every position's marginal and on the first pair.

use std::collections::HashMap;

use rand::{Rng, SeedableRng, rngs::StdRng};

use parse_core::driver::{DraftChunk, DraftHints, Drafter, ExtendOutput, Verifier};
use parse_core::speculative::{self, SampledRow};
use parse_core::{
    AcceptPolicy, DraftWindow, GenerationRequest, Mode, RowScore, SamplingParams, SegmenterConfig,
    VerifyOutput, VerifyPlan, generate,
};

const V: u32 = 5;

fn normalise(w: Vec<f64>) -> Vec<(u32, f32)> {
    let total: f64 = w.iter().sum();
    w.iter()
        .enumerate()
        .map(|(i, x)| (i as u32 + 1, (x / total) as f32))
        .collect()
}

/// Tokens are 1..=5.
fn target_dist(ctx: &[u32]) -> Vec<(u32, f32)> {
    let a = *ctx.last().unwrap() as u64;
    let b = if ctx.len() > 1 {
        ctx[ctx.len() - 2] as u64
    } else {
        2
    };
    normalise(
        (1..=V as u64)
            .map(|j| 0.2 + ((a * 7 + b * 3 + j * 5) % 9) as f64)
            .collect(),
    )
}

fn draft_dist(ctx: &[u32]) -> Vec<(u32, f32)> {
    let a = *ctx.last().unwrap() as u64;
    normalise(
        (1..=V as u64)
            .map(|j| 0.5 + ((a * 5 + j * 3) % 7) as f64)
            .collect(),
    )
}

fn prob(d: &[(u32, f32)], t: u32) -> f32 {
    d.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1)
}

fn draw(d: &[(u32, f32)], rng: &mut StdRng) -> u32 {
    speculative::sample_from(d, rng.random::<f64>()).unwrap()
}

#[derive(Default)]
struct Target {
    caches: HashMap<String, (Vec<u32>, StdRng)>,
}

impl Verifier for Target {
    fn open(&mut self, s: &str, prompt: &[u32], p: &SamplingParams) -> parse_core::Result<usize> {
        let cache = prompt[..prompt.len() - 1].to_vec();
        self.caches
            .insert(s.into(), (cache, StdRng::seed_from_u64(p.seed)));
        Ok(0)
    }
    fn verify(&mut self, s: &str, plan: &VerifyPlan) -> parse_core::Result<VerifyOutput> {
        let (cache, _) = self.caches.get_mut(s).unwrap();
        assert_eq!(plan.positions[0] as usize, cache.len());
        let mut ctx = cache.clone();
        ctx.push(plan.tokens[0]);
        let mut dists = Vec::new();
        let mut rows = Vec::new();
        for t in 0..=plan.draft.len() {
            let d = target_dist(&ctx);
            rows.push(RowScore::new(
                1,
                plan.draft.get(t).map_or(f32::NAN, |x| prob(&d, *x)),
            ));
            dists.push(d);
            if let Some(x) = plan.draft.get(t) {
                ctx.push(*x);
            }
        }
        let check = plan
            .sample
            .as_ref()
            .expect("stochastic rounds carry a check");
        let accepted = speculative::first_rejection(check, |i| Ok(prob(&dists[i], plan.draft[i])))?;
        cache.extend(&plan.tokens);
        Ok(VerifyOutput {
            rows,
            judge: vec![],
            sampled: Some(SampledRow {
                accepted,
                dist: dists.swap_remove(accepted),
            }),
        })
    }
    fn extend(
        &mut self,
        s: &str,
        pending: u32,
        max: usize,
        _: Option<&SegmenterConfig>,
    ) -> parse_core::Result<ExtendOutput> {
        let (cache, rng) = self.caches.get_mut(s).unwrap();
        let mut out = ExtendOutput::default();
        let mut last = pending;
        while out.tokens.len() < max.max(1) {
            cache.push(last);
            last = draw(&target_dist(cache), rng);
            out.tokens.push(last);
            out.pieces.push(format!(" t{last}"));
        }
        Ok(out)
    }
    fn truncate(&mut self, s: &str, len: usize) -> parse_core::Result<()> {
        self.caches.get_mut(s).unwrap().0.truncate(len);
        Ok(())
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.caches.remove(s).unwrap();
        Ok(())
    }
}

/// Per session: the context, the sampler's stream, and the distributions of the current draft's tokens.
type DraftState = (Vec<u32>, StdRng, Vec<Vec<(u32, f32)>>);

#[derive(Default)]
struct Draft {
    state: HashMap<String, DraftState>,
}

impl Drafter for Draft {
    fn begin(&mut self, s: &str, context: &[u32], p: &SamplingParams) -> parse_core::Result<()> {
        let e = self
            .state
            .entry(s.into())
            .or_insert_with(|| (vec![], StdRng::seed_from_u64(p.seed), vec![]));
        e.0 = context.to_vec();
        e.2.clear();
        Ok(())
    }
    fn next(&mut self, s: &str, max: usize) -> parse_core::Result<DraftChunk> {
        let (ctx, rng, dists) = self.state.get_mut(s).unwrap();
        let mut c = DraftChunk::default();
        while c.tokens.len() < max {
            let d = draft_dist(ctx);
            let t = draw(&d, rng);
            c.probs.push(prob(&d, t));
            dists.push(d);
            ctx.push(t);
            c.tokens.push(t);
            c.pieces.push(format!(" t{t}"));
        }
        Ok(c)
    }
    fn distribution(&mut self, s: &str, index: usize) -> parse_core::Result<Vec<(u32, f32)>> {
        Ok(self.state[s].2[index].clone())
    }
    fn pieces(&mut self, tokens: &[u32]) -> parse_core::Result<Vec<String>> {
        Ok(tokens.iter().map(|t| format!(" t{t}")).collect())
    }
    fn release(&mut self, s: &str) -> parse_core::Result<()> {
        self.state.remove(s);
        Ok(())
    }
}

impl DraftHints for Draft {}

const PROMPT: [u32; 2] = [3, 1];
const N: u64 = 4000;

fn request(mode: Mode, seed: u64) -> GenerationRequest {
    GenerationRequest {
        session: "s".into(),
        prompt: PROMPT.to_vec(),
        max_new_tokens: 3,
        mode,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed,
            cache_salt: 0,
        },
        policy: AcceptPolicy::default(),
        segmenter: SegmenterConfig::default(),
        window: DraftWindow {
            token_spec_tokens: 2,
            ..Default::default()
        },
        eos: vec![],
        judge_suffix: vec![],
    }
}

/// Chi-square statistic of observed counts against expected probabilities.
fn chi2(counts: &HashMap<Vec<u32>, u64>, exact: &HashMap<Vec<u32>, f64>, n: u64) -> f64 {
    exact
        .iter()
        .map(|(k, p)| {
            let e = p * n as f64;
            let o = *counts.get(k).unwrap_or(&0) as f64;
            (o - e) * (o - e) / e
        })
        .sum()
}

fn exact_marginals() -> Vec<HashMap<Vec<u32>, f64>> {
    // Position 0, 1, 2 marginals and the (0, 1) pair, enumerating all 125 sequences.
    let mut m = vec![HashMap::new(); 4];
    for a in 1..=V {
        for b in 1..=V {
            for c in 1..=V {
                let mut ctx = PROMPT.to_vec();
                let mut p = 1.0f64;
                for t in [a, b, c] {
                    p *= prob(&target_dist(&ctx), t) as f64;
                    ctx.push(t);
                }
                for (i, key) in [vec![a], vec![b], vec![c], vec![a, b]]
                    .into_iter()
                    .enumerate()
                {
                    *m[i].entry(key).or_insert(0.0) += p;
                }
            }
        }
    }
    m
}

fn observed(mode: Mode) -> (Vec<HashMap<Vec<u32>, u64>>, f64) {
    let mut m = vec![HashMap::new(); 4];
    let (mut t, mut d) = (Target::default(), Draft::default());
    let (mut proposed, mut accepted) = (0, 0);
    for seed in 0..N {
        let out = generate(&mut d, &mut t, &request(mode, seed), &mut |_, _| true).unwrap();
        let o = &out.tokens;
        assert_eq!(o.len(), 3);
        for (i, key) in [vec![o[0]], vec![o[1]], vec![o[2]], vec![o[0], o[1]]]
            .into_iter()
            .enumerate()
        {
            *m[i].entry(key).or_insert(0) += 1;
        }
        proposed += out.stats.draft_tokens_proposed;
        accepted += out.stats.draft_tokens_accepted;
        assert!(
            t.caches.is_empty() && d.state.is_empty(),
            "sessions released"
        );
    }
    let rate = if proposed > 0 {
        accepted as f64 / proposed as f64
    } else {
        0.0
    };
    (m, rate)
}

#[test]
fn token_spec_sampling_follows_the_target_distribution() {
    let exact = exact_marginals();
    // 99.9% quantiles of chi-square with 4 and 24 degrees of freedom.
    let limits = [18.47, 18.47, 18.47, 51.18];
    let (target, _) = observed(Mode::Target);
    let (spec, rate) = observed(Mode::TokenSpec);
    assert!(
        (0.3..0.9).contains(&rate),
        "the fakes must disagree often enough to exercise rejections: acceptance {rate}"
    );
    for i in 0..4 {
        let c_target = chi2(&target[i], &exact[i], N);
        let c_spec = chi2(&spec[i], &exact[i], N);
        assert!(
            c_target < limits[i],
            "target mode itself off the exact distribution at {i}: chi2 {c_target}"
        );
        assert!(
            c_spec < limits[i],
            "token-spec sampling off the target distribution at {i}: chi2 {c_spec}"
        );
    }
    // The draft's own distribution is far from the target's: the same statistic must reject it, or the test could
    // not tell a lossy implementation from a lossless one.
    let (draft, _) = observed(Mode::Draft);
    assert!(chi2(&draft[3], &exact[3], N) > 10.0 * limits[3]);
}
