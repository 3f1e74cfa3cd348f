//! Row-wise CPU kernels of the transformer block: RMSNorm, RoPE from explicit positions, SwiGLU and masked
//! attention over a KV cache.
//!
//! Invariant: every kernel computes a row from that row's inputs alone, in a fixed order of operations, so the
//! result for a token never depends on which other tokens share the block (see `quant` for the matmul side).

use rayon::prelude::*;

use crate::mask::MaskRow;

/// Dot product with 8 independent accumulators combined in a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        let (x, y) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail = a[i].mul_add(b[i], tail);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[r] = x[r] / rms(x[r]) * w` for each row of width `w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ss = dot(xr, xr);
        let scale = 1.0 / ((ss / d as f32) + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension `i` pairs with `i + d/2` (Qwen2, and Hugging Face checkpoints of Llama).
    Neox,
    /// Dimension `2i` pairs with `2i + 1` (llama-architecture GGUF files, whose q/k rows are permuted).
    Interleaved,
}

/// Rotary embedding tables: inverse frequencies per pair.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, style: RopeStyle) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64) as f32)
            .collect();
        Rope { inv_freq, style }
    }

    /// Rotates every head of every row of `x` (rows x n_heads x head_dim) by the row's position.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], n_heads: usize) {
        let half = self.inv_freq.len();
        let hd = 2 * half;
        let mut cs = vec![(0f32, 0f32); half];
        for (row, &pos) in x.chunks_mut(n_heads * hd).zip(positions) {
            for (c, f) in cs.iter_mut().zip(&self.inv_freq) {
                let angle = pos as f32 * f;
                *c = (angle.cos(), angle.sin());
            }
            for head in row.chunks_mut(hd) {
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (a, b) = match self.style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
    }
}

/// `gate = silu(gate) * up`, element-wise, in place.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = (*g / (1.0 + (-*g).exp())) * u;
    }
}

/// Shapes of one attention call.
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Cache index of the block's first token (the block's keys are already written after the cached ones).
    pub block_start: usize,
}

/// Masked softmax attention. `q`: rows x n_heads x head_dim; `k_cache`/`v_cache`: tokens x n_kv_heads x head_dim,
/// holding the cached tokens followed by the block's own; `out`: like `q`.
///
/// The visible keys of a row are visited in cache order (the cached prefix, then the visible block spans), scores
/// are reduced in that order, and the softmax and weighted sum follow it too: the result for a row depends only on
/// the keys it sees.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    mask: &[MaskRow],
    s: &AttnShape,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let kv_stride = s.n_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (row, h) = (idx / s.n_heads, idx % s.n_heads);
        let kvh = h / group;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let m = &mask[row];
        let keys = (0..m.cached).chain(
            m.spans
                .iter()
                .flat_map(|sp| sp.clone().map(|j| s.block_start + j)),
        );
        let mut scores: Vec<(usize, f32)> = keys
            .map(|t| {
                let kv = &k_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd];
                (t, dot(qv, kv) * scale)
            })
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |a, (_, v)| a.max(*v));
        let mut sum = 0f32;
        for (_, v) in scores.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        o.fill(0.0);
        for (t, p) in &scores {
            let vv = &v_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd];
            for (a, b) in o.iter_mut().zip(vv) {
                *a = p.mul_add(*b, *a);
            }
        }
        let inv = 1.0 / sum;
        for a in o.iter_mut() {
            *a *= inv;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let rope = Rope::new(4, 10000.0, RopeStyle::Neox);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope.apply(&mut x, &[0], 1);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
        rope.apply(&mut x, &[3], 1);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4);
        // Pair (0, 2) rotated by 3 rad at frequency 1.
        assert!((x[0] - (1.0 * 3f32.cos() - 3.0 * 3f32.sin())).abs() < 1e-5);
    }

    #[test]
    fn attention_over_one_key_returns_its_value() {
        let s = AttnShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            block_start: 1,
        };
        let k = vec![1.0, 0.0, 0.0, 1.0];
        let v = vec![5.0, 6.0, 7.0, 8.0];
        let mask = vec![MaskRow {
            cached: 0,
            spans: vec![0..1],
        }];
        let mut out = vec![0.0; 4];
        attention(&[1.0, 1.0, 2.0, 2.0], &k, &v, &mask, &s, &mut out);
        assert_eq!(out, vec![7.0, 8.0, 7.0, 8.0]);
    }
}
