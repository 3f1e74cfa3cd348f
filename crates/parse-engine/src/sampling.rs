//! Token sampling: greedy, temperature, top-k and top-p, seeded and reproducible.
//!
//! Greedy picks the highest logit, the lowest id on ties. Stochastic sampling works in f64 over a fixed candidate
//! order (descending probability, ascending id on ties) and draws from a ChaCha-based `StdRng` seeded per request,
//! so the same seed gives the same tokens on every machine.

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

/// Probability distribution after temperature, top-k and top-p: (token, probability) in descending probability.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let t = p.temperature.max(1e-6) as f64;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|a, b| {
        logits[*b as usize]
            .partial_cmp(&logits[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    });
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0] as usize] as f64;
    let mut probs: Vec<(u32, f64)> = idx
        .into_iter()
        .map(|i| (i, ((logits[i as usize] as f64 - max) / t).exp()))
        .collect();
    let total: f64 = probs.iter().map(|x| x.1).sum();
    for x in probs.iter_mut() {
        x.1 /= total;
    }
    if p.top_p < 1.0 {
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
        let total: f64 = probs.iter().map(|x| x.1).sum();
        for x in probs.iter_mut() {
            x.1 /= total;
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
        let dist = distribution(logits, &self.params);
        let u = self.uniform();
        let mut acc = 0.0;
        for (id, p) in &dist {
            acc += p;
            if u < acc {
                return *id;
            }
        }
        dist.last().map_or(0, |x| x.0)
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
}
