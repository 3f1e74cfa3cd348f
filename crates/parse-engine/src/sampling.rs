//! Token sampling: greedy, temperature, top-k and top-p, seeded and reproducible.
//!
//! Greedy picks the highest logit, the lowest id on ties. Stochastic sampling works in f64 over a fixed candidate
//! order (descending probability with ascending id on ties under a top-k/top-p cut, token order otherwise) and draws
//! from a ChaCha-based `StdRng` seeded per request, so the same seed gives the same tokens on every machine.

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::error::Result;

pub use parse_core::SamplingParams;

/// Index of the largest logit (lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Probability distribution after temperature, top-k and top-p as `(token, probability)`: in descending
/// probability (ascending id on ties) when a top-k or top-p cut applies, in token order otherwise (no sort on the
/// common temperature-only path: sorting a 150k vocabulary costs more than a draft step's sampling should).
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let t = p.temperature.max(1e-6) as f64;
    let n = logits.len();
    if n == 0 {
        return Vec::new();
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v)) as f64;
    let weight = |i: u32| ((logits[i as usize] as f64 - max) / t).exp();
    let desc = |a: &u32, b: &u32| {
        logits[*b as usize]
            .partial_cmp(&logits[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    let top_k = if p.top_k > 0 && p.top_k < n {
        p.top_k
    } else {
        n
    };
    let cut_p = p.top_p < 1.0;
    if top_k == n && !cut_p {
        let mut probs: Vec<(u32, f64)> = (0..n as u32).map(|i| (i, weight(i))).collect();
        let total: f64 = probs.iter().map(|x| x.1).sum();
        for x in probs.iter_mut() {
            x.1 /= total;
        }
        return probs;
    }
    let mut idx: Vec<u32> = (0..n as u32).collect();
    // Normaliser over the top-k set (all tokens without a top-k cut).
    let mut sorted_upto = top_k;
    if top_k < n {
        idx.select_nth_unstable_by(top_k - 1, desc);
        idx.truncate(top_k);
    }
    let total: f64 = idx.iter().map(|i| weight(*i)).sum();
    if cut_p && idx.len() > 256 {
        // The nucleus usually lies in the first few hundred tokens: sort those, fall back to a full sort otherwise.
        let head = 256;
        idx.select_nth_unstable_by(head - 1, desc);
        idx[..head].sort_by(desc);
        let mass: f64 = idx[..head].iter().map(|i| weight(*i)).sum();
        sorted_upto = head;
        if mass / total < p.top_p as f64 {
            idx.sort_by(desc);
            sorted_upto = idx.len();
        }
    } else {
        idx.sort_by(desc);
    }
    let mut probs: Vec<(u32, f64)> = idx[..sorted_upto.min(idx.len())]
        .iter()
        .map(|i| (*i, weight(*i) / total))
        .collect();
    if cut_p {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x.1;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let kept: f64 = probs.iter().map(|x| x.1).sum();
        for x in probs.iter_mut() {
            x.1 /= kept;
        }
    }
    probs
}

/// A per-request sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// A uniform draw in [0, 1) from the request's stream (also used for speculative acceptance tests).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Picks the next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        self.sample_with_distribution(logits).0
    }

    /// Picks the next token by sampling (whatever the temperature) and returns the distribution it was drawn from.
    pub fn sample_with_distribution(&mut self, logits: &[f32]) -> (u32, Vec<(u32, f64)>) {
        let dist = distribution(logits, &self.params);
        let u = self.uniform();
        let mut acc = 0.0;
        for (id, p) in &dist {
            acc += p;
            if u < acc {
                return (*id, dist);
            }
        }
        (dist.last().map_or(0, |x| x.0), dist)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = [0.1, 2.0, 2.0, -1.0];
        assert_eq!(argmax(&logits), 1);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
            cache_salt: 0,
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert!(
            draw(&p).contains(&0),
            "a temperature of 1 must sometimes pick a low logit"
        );
        let k1 = SamplingParams {
            top_k: 1,
            ..p.clone()
        };
        assert!(draw(&k1).iter().all(|t| *t == 1));
        let nucleus = SamplingParams {
            top_p: 0.5,
            ..p.clone()
        };
        assert!(draw(&nucleus).iter().all(|t| *t == 1 || *t == 2));
        assert!(
            Sampler::new(SamplingParams {
                temperature: f32::NAN,
                ..p.clone()
            })
            .is_err()
        );
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..p }).is_err());
    }

    /// The fast paths (no sort without a cut, a partial sort for the nucleus) equal a full sort's definition.
    #[test]
    fn fast_paths_equal_the_sorted_definition() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(3);
        let reference = |logits: &[f32], p: &SamplingParams| -> Vec<(u32, f64)> {
            let t = p.temperature as f64;
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            idx.sort_by(|a, b| {
                logits[*b as usize]
                    .partial_cmp(&logits[*a as usize])
                    .unwrap()
                    .then(a.cmp(b))
            });
            if p.top_k > 0 {
                idx.truncate(p.top_k);
            }
            let max = logits[idx[0] as usize] as f64;
            let w: Vec<f64> = idx
                .iter()
                .map(|i| ((logits[*i as usize] as f64 - max) / t).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut out: Vec<(u32, f64)> =
                idx.into_iter().zip(w.iter().map(|x| x / total)).collect();
            let mut acc = 0.0;
            let keep = out
                .iter()
                .position(|x| {
                    acc += x.1;
                    acc >= p.top_p as f64
                })
                .map_or(out.len(), |i| i + 1);
            out.truncate(keep);
            let kept: f64 = out.iter().map(|x| x.1).sum();
            out.iter().map(|(i, x)| (*i, x / kept)).collect()
        };
        for (scale, top_k, top_p) in [(4.0, 0, 0.9), (0.2, 0, 0.95), (3.0, 50, 0.8), (1.0, 0, 1.0)]
        {
            let logits: Vec<f32> = (0..5000).map(|_| rng.random::<f32>() * scale).collect();
            let p = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                seed: 0,
                cache_salt: 0,
            };
            let mut got = distribution(&logits, &p);
            let mut want = reference(&logits, &p);
            got.sort_by_key(|x| x.0);
            want.sort_by_key(|x| x.0);
            assert_eq!(got.len(), want.len(), "{scale} {top_k} {top_p}");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.0, w.0);
                assert!((g.1 - w.1).abs() < 1e-12);
            }
        }
    }
}
