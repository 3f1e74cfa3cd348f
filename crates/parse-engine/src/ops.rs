//! Row-wise CPU kernels of the transformer block: RMSNorm, RoPE from explicit positions, SwiGLU and masked
//! attention over a KV cache.
//!
//! Invariant: every kernel computes a row from that row's inputs alone, in a fixed order of operations, so the
//! result for a token never depends on which other tokens share the block (see `quant` for the matmul side).

use rayon::prelude::*;

use parse_core::mask::MaskRow;

/// Dot product with a fixed arithmetic: lane `l` (0..8) of two accumulators takes elements `16i + l` (first) and
/// `16i + 8 + l` (second) by fused multiply-add, the accumulators are added lane-wise and the lanes summed in a
/// fixed tree; a tail shorter than 16 is added by a scalar fma chain. The AVX2 path and the portable path
/// compute exactly this, so results do not depend on which one runs.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            #[allow(unsafe_code)]
            // SAFETY: AVX2 and FMA are available (checked just above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

#[inline]
fn lane_sum(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

fn dot_tail(a: &[f32], b: &[f32], from: usize) -> f32 {
    let mut t = 0f32;
    for i in from..a.len().min(b.len()) {
        t = a[i].mul_add(b[i], t);
    }
    t
}

/// The portable definition of [`dot`].
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n16 = a.len().min(b.len()) / 16 * 16;
    let mut acc0 = [0f32; 8];
    let mut acc1 = [0f32; 8];
    for i in (0..n16).step_by(16) {
        for l in 0..8 {
            acc0[l] = a[i + l].mul_add(b[i + l], acc0[l]);
            acc1[l] = a[i + 8 + l].mul_add(b[i + 8 + l], acc1[l]);
        }
    }
    let lanes: [f32; 8] = std::array::from_fn(|l| acc0[l] + acc1[l]);
    lane_sum(lanes) + dot_tail(a, b, n16)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n16 = a.len().min(b.len()) / 16 * 16;
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= n16 <= both lengths.
        unsafe {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: lanes holds 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc0, acc1)) };
    lane_sum(lanes) + dot_tail(a, b, n16)
}

/// `out[h] = dot(qs[h * k.len()..], k)` for the `out.len()` query heads that share key `k`, bitwise as [`dot`]
/// computes each: the heads' accumulator chains run side by side, so the multiply-adds are not waiting on one
/// another (a single 128-wide dot is two chains of 8 dependent steps).
pub fn dot_heads(qs: &[f32], k: &[f32], out: &mut [f32]) {
    let hd = k.len();
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            let mut h = 0;
            while h < out.len() {
                let g = (out.len() - h).min(4);
                #[allow(unsafe_code)]
                // SAFETY: AVX2 and FMA are available (checked just above).
                unsafe {
                    match g {
                        4 => dot_heads_avx2::<4>(&qs[h * hd..], k, &mut out[h..]),
                        3 => dot_heads_avx2::<3>(&qs[h * hd..], k, &mut out[h..]),
                        2 => dot_heads_avx2::<2>(&qs[h * hd..], k, &mut out[h..]),
                        _ => dot_heads_avx2::<1>(&qs[h * hd..], k, &mut out[h..]),
                    }
                }
                h += g;
            }
            return;
        }
    }
    for (h, o) in out.iter_mut().enumerate() {
        *o = dot(&qs[h * hd..(h + 1) * hd], k);
    }
}

/// The two accumulator chains of [`dot`] over the first `n16` values (a multiple of 16) for each of `G` heads (`qs`:
/// G heads of `k.len()` values) against one key `k`, added lane-wise: what [`lane_sum`] then sums.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `qs` must hold `G * k.len()` values and `n16 <= k.len()`.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn heads_lanes_avx2<const G: usize>(
    qs: &[f32],
    k: &[f32],
    n16: usize,
) -> [std::arch::x86_64::__m256; G] {
    use std::arch::x86_64::*;
    let hd = k.len();
    let mut acc0 = [_mm256_setzero_ps(); G];
    let mut acc1 = [_mm256_setzero_ps(); G];
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= n16 <= hd, and every head's slice has hd values (the caller's bounds).
        unsafe {
            let k0 = _mm256_loadu_ps(k.as_ptr().add(i));
            let k1 = _mm256_loadu_ps(k.as_ptr().add(i + 8));
            for h in 0..G {
                let q = qs.as_ptr().add(h * hd + i);
                acc0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q), k0, acc0[h]);
                acc1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8)), k1, acc1[h]);
            }
        }
    }
    for h in 0..G {
        acc0[h] = _mm256_add_ps(acc0[h], acc1[h]);
    }
    acc0
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_heads_avx2<const G: usize>(qs: &[f32], k: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = k.len();
    assert!(qs.len() >= G * hd && out.len() >= G);
    let n16 = hd / 16 * 16;
    // SAFETY: the caller's CPU has AVX2 and FMA; the lengths are checked above.
    let acc = unsafe { heads_lanes_avx2::<G>(qs, k, n16) };
    for h in 0..G {
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[h]) };
        let a = &qs[h * hd..(h + 1) * hd];
        out[h] = lane_sum(lanes) + dot_tail(a, k, n16);
    }
}

/// `o += p[i] * v[i]` over the keys in order, for one head: `o = fma(p, v, o)` element by element as a plain loop
/// would, with the head's accumulator in registers when the width is 64 or 128.
fn weighted_sum(p: impl Iterator<Item = (f32, usize)>, v_cache: &[f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            #[allow(unsafe_code)]
            // SAFETY: AVX2 and FMA are available (checked just above).
            unsafe {
                match o.len() {
                    128 => return weighted_sum_avx2::<16>(p, v_cache, o),
                    64 => return weighted_sum_avx2::<8>(p, v_cache, o),
                    _ => {}
                }
            }
        }
    }
    let w = o.len();
    for (pi, off) in p {
        for (a, b) in o.iter_mut().zip(&v_cache[off..off + w]) {
            *a = pi.mul_add(*b, *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum_avx2<const V: usize>(
    p: impl Iterator<Item = (f32, usize)>,
    v_cache: &[f32],
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert_eq!(o.len(), 8 * V);
    // SAFETY: o has 8V values.
    let mut acc: [__m256; V] =
        std::array::from_fn(|j| unsafe { _mm256_loadu_ps(o.as_ptr().add(8 * j)) });
    for (pi, off) in p {
        let v = &v_cache[off..off + 8 * V];
        let pv = _mm256_set1_ps(pi);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: v has 8V values.
            *a = _mm256_fmadd_ps(pv, unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * j)) }, *a);
        }
    }
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: o has 8V values.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), *a) };
    }
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

/// `gate = silu(gate) * up`, element-wise, in place ([`crate::vexp::swiglu`]: the engine's own `exp`, the same bits
/// on every path).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    crate::vexp::swiglu(gate, up)
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
/// Work is split by (row, KV head) on the AVX-512 path, by (run of rows, KV head) without it
/// ([`attention_narrow`]): the query heads sharing a KV head read each key and value once, and without AVX-512 the
/// rows of a run read each key once. For every (row, head) the visible keys are visited in cache order (the cached
/// prefix, then the visible block spans), and the scores, softmax and weighted sum follow that order: the result
/// depends only on the keys the row sees.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    mask: &[MaskRow],
    s: &AttnShape,
    out: &mut [f32],
) {
    attention_with(wide_attention(), q, k_cache, v_cache, mask, s, out)
}

/// How far ahead, in visible keys, [`attention`]'s AVX-512 path asks for a key's or a value's row: 32 rows of 128
/// f32, 16 KB.
const KEYS_AHEAD: usize = 32;

/// Asks for every cache line of `row` into L1 (a hint: no fault, no effect on results).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_row(row: &[f32]) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    for line in row.chunks(16) {
        // SAFETY: a prefetch of an address inside `row` (SSE, part of x86_64).
        #[allow(unsafe_code)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast())
        };
    }
}

/// Whether [`attention`] takes its AVX-512 path ([`dot_heads_wide`], [`weighted_sums_wide`]): on a CPU with AVX-512
/// F, checked once. The path computes the same bits as the AVX2 and portable ones, in fewer instructions per key.
fn wide_attention() -> bool {
    wide_attention_runs()
}

/// Whether this CPU can run [`attention`]'s AVX-512 path (AVX-512 F, AVX2, FMA), checked once.
fn wide_attention_runs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`attention`], with its AVX-512 path (`wide`, taken only where the CPU has it and the head width is a multiple of
/// 16, at most 128) or without; the two give the same bits.
fn attention_with(
    wide: bool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    mask: &[MaskRow],
    s: &AttnShape,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let wide = wide && wide_attention_runs() && hd.is_multiple_of(16) && hd <= 128;
    if !wide {
        let rb = rows_per_task(mask.len(), s);
        return attention_narrow(q, k_cache, v_cache, mask, s, out, rb);
    }
    #[cfg(target_arch = "x86_64")]
    attention_wide(q, k_cache, v_cache, mask, s, out);
}

/// [`attention`]'s AVX-512 path, its work split by (row, KV head): whole runs of 16 keys scored at once
/// ([`scores16_wide`]), the rest key by key ([`dot_heads_wide`]), every head of the group over each value row at once
/// ([`weighted_sums_wide`]). Only where [`wide_attention_runs`] and the head width is a multiple of 16, at most 128.
#[cfg(target_arch = "x86_64")]
fn attention_wide(
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
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(idx, o)| {
            let (row, kvh) = (idx / s.n_kv_heads, idx % s.n_kv_heads);
            let qs = &q[idx * group * hd..(idx + 1) * group * hd];
            let m = &mask[row];
            let keys: Vec<usize> = (0..m.cached)
                .chain(
                    m.spans
                        .iter()
                        .flat_map(|sp| sp.clone().map(|j| s.block_start + j)),
                )
                .collect();
            let n = keys.len();
            // scores[h * n + i]: head h of the group, i-th visible key.
            let mut scores = vec![0f32; group * n];
            let mut row = vec![0f32; group];
            let by16 = n / 16 * 16;
            for i0 in (0..by16).step_by(16) {
                for &t in keys.iter().skip(i0 + KEYS_AHEAD).take(16) {
                    prefetch_row(
                        &k_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd],
                    );
                }
                let ks: [&[f32]; 16] = std::array::from_fn(|j| {
                    let t = keys[i0 + j];
                    &k_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd]
                });
                #[allow(unsafe_code)]
                // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (the caller's check); hd is a multiple of 16, at most
                // 128; `scores` holds group x n values and i0 + 16 <= n.
                unsafe {
                    scores16_wide(qs, &ks, &mut scores, n, i0, scale)
                };
            }
            for (i, &t) in keys.iter().enumerate().skip(by16) {
                let kv = &k_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd];
                #[allow(unsafe_code)]
                // SAFETY: as above.
                unsafe {
                    dot_heads_wide(qs, kv, &mut row)
                };
                for h in 0..group {
                    scores[h * n + i] = row[h] * scale;
                }
            }
            let mut sums = vec![0f32; group];
            for h in 0..group {
                let sc = &mut scores[h * n..(h + 1) * n];
                sums[h] = crate::vexp::exp_sum(sc, crate::vexp::max_of(sc));
            }
            o.fill(0.0);
            let offsets: Vec<usize> = keys.iter().map(|&t| t * kv_stride + kvh * hd).collect();
            #[allow(unsafe_code)]
            // SAFETY: as above; every offset starts a value row of hd values in v_cache.
            unsafe {
                weighted_sums_wide(&scores, &offsets, v_cache, o, hd)
            };
            for h in 0..group {
                let inv = 1.0 / sums[h];
                for a in o[h * hd..(h + 1) * hd].iter_mut() {
                    *a *= inv;
                }
            }
        });
}

/// Rows of a block that one task of [`attention_narrow`] takes together for a KV head: as many as leave a task for
/// each of the pool's threads (one row each where the threads outnumber the rows' KV heads, as before), at most 8.
fn rows_per_task(rows: usize, s: &AttnShape) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (rows * s.n_kv_heads / threads).clamp(1, 8)
}

/// Keys visited per step of [`attention_narrow`]'s scoring: every row of a task scores them before the next run, so
/// their keys are read from memory once for all rows (32 keys of 128 f32 are 16 KB).
const KEY_RUN: usize = 32;

/// [`attention`] without the AVX-512 path, its work split by (KV head, run of `rb` rows): the rows of a task score
/// each run of [`KEY_RUN`] keys in turn, so a key comes from memory once for all of them, and score 8 keys at a time
/// with their sums reduced side by side ([`scores8`], bitwise [`dot_heads`] of each key). The weighted sums go by the
/// same runs: every (row, head) of the task sums a run's values before the next run, so that a run's values are read
/// from memory once for all of them, each output element's chain carried over from run to run in key order. Per
/// (row, head) the scores, softmax and weighted sum ([`weighted_sum`]) are the same operations in the same order as
/// the row alone runs them (`rb` 1): the same bits whatever `rb`.
fn attention_narrow(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    mask: &[MaskRow],
    s: &AttnShape,
    out: &mut [f32],
    rb: usize,
) {
    let (hd, n_kv) = (s.head_dim, s.n_kv_heads);
    let group = s.n_heads / n_kv;
    let kv_stride = n_kv * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = mask.len();
    let tasks: Vec<(usize, usize)> = (0..rows)
        .step_by(rb.max(1))
        .flat_map(|r0| (0..n_kv).map(move |kvh| (kvh, r0)))
        .collect();
    let done: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(kvh, r0)| {
            let r1 = (r0 + rb.max(1)).min(rows);
            let keys: Vec<Vec<usize>> = mask[r0..r1]
                .iter()
                .map(|m| {
                    (0..m.cached)
                        .chain(
                            m.spans
                                .iter()
                                .flat_map(|sp| sp.clone().map(|j| s.block_start + j)),
                        )
                        .collect()
                })
                .collect();
            let qs = |j: usize| {
                let idx = (r0 + j) * n_kv + kvh;
                &q[idx * group * hd..(idx + 1) * group * hd]
            };
            // scores[j][h * n + i]: row r0 + j, head h of the group, i-th visible key of the row.
            let mut scores: Vec<Vec<f32>> =
                keys.iter().map(|k| vec![0f32; group * k.len()]).collect();
            let mut row = vec![0f32; group];
            let mut by8 = vec![0f32; group * 8];
            let most = keys.iter().map(Vec::len).max().unwrap_or(0);
            let key = |t: usize| &k_cache[t * kv_stride + kvh * hd..t * kv_stride + (kvh + 1) * hd];
            for i0 in (0..most).step_by(KEY_RUN) {
                for (j, ks) in keys.iter().enumerate() {
                    let n = ks.len();
                    let end = (i0 + KEY_RUN).min(n);
                    let mut i = i0;
                    // Runs of 8 keys, their sums reduced side by side (`scores8`); the rest key by key.
                    while i + 8 <= end
                        && scores8(qs(j), std::array::from_fn(|e| key(ks[i + e])), &mut by8)
                    {
                        for h in 0..group {
                            for e in 0..8 {
                                scores[j][h * n + i + e] = by8[h * 8 + e] * scale;
                            }
                        }
                        i += 8;
                    }
                    for (i, &t) in ks.iter().enumerate().take(end).skip(i) {
                        dot_heads(qs(j), key(t), &mut row);
                        for h in 0..group {
                            scores[j][h * n + i] = row[h] * scale;
                        }
                    }
                }
            }
            let mut o = vec![0f32; (r1 - r0) * group * hd];
            let mut sums = vec![0f32; (r1 - r0) * group];
            for (j, sc) in scores.iter_mut().enumerate() {
                let n = keys[j].len();
                for h in 0..group {
                    let sh = &mut sc[h * n..(h + 1) * n];
                    sums[j * group + h] = crate::vexp::exp_sum(sh, crate::vexp::max_of(sh));
                }
            }
            // By runs of keys, every (row, head) of the task over a run before the next.
            let run = KEY_RUN;
            for i0 in (0..most).step_by(run) {
                for (j, ks) in keys.iter().enumerate() {
                    let n = ks.len();
                    if i0 >= n {
                        // This row's keys ended in an earlier run.
                        continue;
                    }
                    let end = (i0 + run).min(n);
                    for h in 0..group {
                        let p = ks[i0..end]
                            .iter()
                            .zip(&scores[j][h * n + i0..h * n + end])
                            .map(|(&t, &pi)| (pi, t * kv_stride + kvh * hd));
                        let at = (j * group + h) * hd;
                        weighted_sum(p, v_cache, &mut o[at..at + hd]);
                    }
                }
            }
            for (a, inv) in o.chunks_mut(hd).zip(sums.iter().map(|s| 1.0 / s)) {
                for x in a.iter_mut() {
                    *x *= inv;
                }
            }
            o
        })
        .collect();
    for (&(kvh, r0), o) in tasks.iter().zip(&done) {
        for (j, oj) in o.chunks(group * hd).enumerate() {
            let idx = (r0 + j) * n_kv + kvh;
            out[idx * group * hd..(idx + 1) * group * hd].copy_from_slice(oj);
        }
    }
}

/// [`dot_heads`] of 8 keys: `out[h * 8 + e] = dot(qs[h], ks[e])`, bitwise, where AVX2 and FMA are available and
/// the head width is a multiple of 16 (returns whether it ran). Each key's accumulator chains are those of
/// [`dot_heads`]; the 8 keys' lane sums are then taken side by side in vectors with [`lane_sum`]'s additions (lanes
/// `l` and `l + 4`, then `(0 + 2) + (1 + 3)`) and the empty tail's `+ 0`, instead of one store and seven scalar
/// additions per key and head.
fn scores8(qs: &[f32], ks: [&[f32]; 8], out: &mut [f32]) -> bool {
    let hd = ks[0].len();
    #[cfg(target_arch = "x86_64")]
    {
        if hd.is_multiple_of(16)
            && hd > 0
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            let group = qs.len() / hd;
            let mut h = 0;
            while h < group {
                let g = (group - h).min(4);
                let (q, o) = (&qs[h * hd..], &mut out[h * 8..]);
                #[allow(unsafe_code)]
                // SAFETY: AVX2 and FMA are available (checked just above); every key has hd values, a multiple of
                // 16; q holds g heads of hd values and o g x 8 values.
                unsafe {
                    match g {
                        4 => scores8_avx2::<4>(q, &ks, o),
                        3 => scores8_avx2::<3>(q, &ks, o),
                        2 => scores8_avx2::<2>(q, &ks, o),
                        _ => scores8_avx2::<1>(q, &ks, o),
                    }
                }
                h += g;
            }
            return true;
        }
    }
    let _ = (qs, out, hd);
    false
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores8_avx2<const G: usize>(qs: &[f32], ks: &[&[f32]; 8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = ks[0].len();
    assert!(hd.is_multiple_of(16) && qs.len() >= G * hd && out.len() >= G * 8);
    assert!(ks.iter().all(|k| k.len() == hd));
    let mut lanes = [[_mm256_setzero_ps(); 8]; G];
    for (e, k) in ks.iter().enumerate() {
        // SAFETY: the caller's CPU has AVX2 and FMA; the lengths are checked above.
        let acc = unsafe { heads_lanes_avx2::<G>(qs, k, hd) };
        for h in 0..G {
            lanes[h][e] = acc[h];
        }
    }
    for (h, v) in lanes.iter().enumerate() {
        // s = lanes l + l + 4 of each key, two keys a vector: keys (0, 1), (2, 3), (4, 5), (6, 7).
        let s: [__m256; 4] = std::array::from_fn(|p| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(v[2 * p], v[2 * p + 1]),
                _mm256_permute2f128_ps::<0x31>(v[2 * p], v[2 * p + 1]),
            )
        });
        // Per 128-bit half: (s0 + s2, s1 + s3) of two keys.
        let g: [__m256; 2] = std::array::from_fn(|p| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(s[2 * p], s[2 * p + 1]),
                _mm256_shuffle_ps::<0b11_10_11_10>(s[2 * p], s[2 * p + 1]),
            )
        });
        // (s0 + s2) + (s1 + s3), then the empty tail's + 0: keys 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high.
        let r = _mm256_add_ps(
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b10_00_10_00>(g[0], g[1]),
                _mm256_shuffle_ps::<0b11_01_11_01>(g[0], g[1]),
            ),
            _mm256_setzero_ps(),
        );
        let mut t = [0f32; 8];
        // SAFETY: t holds 8 f32.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), r) };
        for (e, x) in [0, 2, 4, 6, 1, 3, 5, 7].into_iter().zip(t) {
            out[h * 8 + e] = x;
        }
    }
}

/// [`dot_heads`] with one 16-lane accumulator per head in place of two of 8 (lanes 0..8 are the first 8-lane
/// accumulator's, 8..16 the second's), up to 8 heads side by side: the same multiply-adds in the same chains, the
/// same sum at the end, so the same bits. `k.len()` is a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_heads_wide(qs: &[f32], k: &[f32], out: &mut [f32]) {
    let mut h = 0;
    while h < out.len() {
        let g = (out.len() - h).min(8);
        // SAFETY: the caller's CPU features; each call reads g heads of qs from head h.
        unsafe {
            match g {
                8 => dot_heads_zmm::<8>(&qs[h * k.len()..], k, &mut out[h..]),
                7 => dot_heads_zmm::<7>(&qs[h * k.len()..], k, &mut out[h..]),
                6 => dot_heads_zmm::<6>(&qs[h * k.len()..], k, &mut out[h..]),
                5 => dot_heads_zmm::<5>(&qs[h * k.len()..], k, &mut out[h..]),
                4 => dot_heads_zmm::<4>(&qs[h * k.len()..], k, &mut out[h..]),
                3 => dot_heads_zmm::<3>(&qs[h * k.len()..], k, &mut out[h..]),
                2 => dot_heads_zmm::<2>(&qs[h * k.len()..], k, &mut out[h..]),
                _ => dot_heads_zmm::<1>(&qs[h * k.len()..], k, &mut out[h..]),
            }
        }
        h += g;
    }
}

/// The 16-lane accumulators of [`dot_heads_zmm`] for `G` heads against key `k`, before their lanes are summed.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn acc_heads_zmm<const G: usize>(qs: &[f32], k: &[f32]) -> [std::arch::x86_64::__m512; G] {
    use std::arch::x86_64::*;
    let hd = k.len();
    assert!(hd.is_multiple_of(16) && qs.len() >= G * hd);
    let mut acc = [_mm512_setzero_ps(); G];
    for i in (0..hd).step_by(16) {
        // SAFETY: i + 16 <= hd, and every head's slice has hd values.
        unsafe {
            let kv = _mm512_loadu_ps(k.as_ptr().add(i));
            for (h, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(qs.as_ptr().add(h * hd + i)), kv, *a);
            }
        }
    }
    acc
}

/// The scores of 16 keys `ks` for every head of a group (`qs`: its heads' queries, one after the other), written to
/// `scores[h * n + i0 + j]` for key `j`: each head's 16 accumulators of [`acc_heads_zmm`] are summed lane by lane
/// with the additions of [`dot_heads_zmm`] (lanes `i` and `i + 8`, then [`lane_sum`]'s pairs, then the tail's zero)
/// done for the 16 keys side by side, then multiplied by `scale`: the same bits as scoring the keys one by one.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores16_wide(
    qs: &[f32],
    ks: &[&[f32]; 16],
    scores: &mut [f32],
    n: usize,
    i0: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let hd = ks[0].len();
    let group = qs.len() / hd;
    assert!(i0 + 16 <= n && scores.len() >= group * n);
    // Written for heads 0..g before they are read; left uninitialized, not zeroed (8 KB per run of 16 keys).
    let mut raw = [[std::mem::MaybeUninit::<__m512>::uninit(); 16]; 8];
    let mut h0 = 0;
    while h0 < group {
        let g = (group - h0).min(8);
        let q = &qs[h0 * hd..];
        for (j, k) in ks.iter().enumerate() {
            // SAFETY (every call): the caller's CPU features; q holds g heads of hd values from h0.
            unsafe {
                macro_rules! heads {
                    ($g:literal) => {{
                        let acc = acc_heads_zmm::<$g>(q, k);
                        for h in 0..$g {
                            raw[h][j] = std::mem::MaybeUninit::new(acc[h]);
                        }
                    }};
                }
                match g {
                    8 => heads!(8),
                    7 => heads!(7),
                    6 => heads!(6),
                    5 => heads!(5),
                    4 => heads!(4),
                    3 => heads!(3),
                    2 => heads!(2),
                    _ => heads!(1),
                }
            }
        }
        for (h, x) in raw.iter().enumerate().take(g) {
            // SAFETY: the loop above wrote all 16 accumulators of every head below g.
            let x: &[__m512; 16] = unsafe { &*x.as_ptr().cast::<[__m512; 16]>() };
            let v = _mm512_mul_ps(sum_lanes16(x), _mm512_set1_ps(scale));
            let at = (h0 + h) * n + i0;
            // SAFETY: scores holds 16 values from `at` (checked above).
            unsafe { _mm512_storeu_ps(scores[at..at + 16].as_mut_ptr(), v) };
        }
        h0 += g;
    }
}

/// Lane `j` of the result: the lanes of `x[j]` summed as [`dot_heads_zmm`] sums one accumulator (`lo + hi` of its
/// 8-lane halves, then `(s0 + s2) + (s1 + s3)` of `s_i = l_i + l_(i+4)`, then `+ 0.0` for the empty tail), the 16
/// accumulators' additions done side by side.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
fn sum_lanes16(x: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // y[m]: keys 2m and 2m + 1, 8 lanes each (l_i = a_i + a_(i+8)).
    let y: [__m512; 8] = std::array::from_fn(|m| {
        let (a, b) = (x[2 * m], x[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // z[q]: keys 4q..4q + 4, one per 128-bit block holding s_0..s_3 (s_i = l_i + l_(i+4)).
    let z: [__m512; 4] = std::array::from_fn(|q| {
        let (a, b) = (y[2 * q], y[2 * q + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // w[r], block k: keys 8r + k and 8r + 4 + k, each as (s0 + s2, s1 + s3).
    let w: [__m512; 2] = std::array::from_fn(|r| {
        let (a, b) = (_mm512_castps_pd(z[2 * r]), _mm512_castps_pd(z[2 * r + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    });
    // Lane 4k + j of f: key k + 4j.
    let f = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(w[0], w[1]),
        _mm512_shuffle_ps::<0xDD>(w[0], w[1]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_add_ps(_mm512_permutexvar_ps(order, f), _mm512_setzero_ps())
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn dot_heads_zmm<const G: usize>(qs: &[f32], k: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = k.len();
    assert!(hd.is_multiple_of(16) && qs.len() >= G * hd && out.len() >= G);
    // SAFETY: the caller's CPU features; checked just above.
    let acc = unsafe { acc_heads_zmm::<G>(qs, k) };
    for (h, a) in acc.iter().enumerate() {
        let lo = _mm512_castps512_ps256(*a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(lo, hi)) };
        out[h] = lane_sum(lanes) + dot_tail(&qs[h * hd..(h + 1) * hd], k, hd);
    }
}

/// [`weighted_sum`] for every head of a group at once (`scores[h * n + i]`, `n = offsets.len()`; head h's sum goes
/// to `o[h * hd..]`): each value row is read once for up to 24 / (hd / 16) heads, whose accumulators stay in
/// registers. Each output element is the same chain of fused multiply-adds in key order as in [`weighted_sum`],
/// so the same bits. `hd` is a multiple of 16, at most 128; `o` starts at zero.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn weighted_sums_wide(
    scores: &[f32],
    offsets: &[usize],
    v_cache: &[f32],
    o: &mut [f32],
    hd: usize,
) {
    let n = offsets.len();
    let group = o.len() / hd;
    let mut h = 0;
    while h < group {
        let sc = &scores[h * n..];
        let oh = &mut o[h * hd..];
        // SAFETY: the caller's CPU features and value rows; each call takes g heads from h.
        let g = unsafe {
            match hd {
                128 => wsum_zmm::<8>(sc, offsets, v_cache, oh, group - h),
                112 => wsum_zmm::<7>(sc, offsets, v_cache, oh, group - h),
                96 => wsum_zmm::<6>(sc, offsets, v_cache, oh, group - h),
                80 => wsum_zmm::<5>(sc, offsets, v_cache, oh, group - h),
                64 => wsum_zmm::<4>(sc, offsets, v_cache, oh, group - h),
                48 => wsum_zmm::<3>(sc, offsets, v_cache, oh, group - h),
                32 => wsum_zmm::<2>(sc, offsets, v_cache, oh, group - h),
                _ => wsum_zmm::<1>(sc, offsets, v_cache, oh, group - h),
            }
        };
        h += g;
    }
}

/// Up to `24 / V` heads (at most `left`) of [`weighted_sums_wide`], `V` vectors of 16 per head; returns the heads
/// done.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn wsum_zmm<const V: usize>(
    scores: &[f32],
    offsets: &[usize],
    v_cache: &[f32],
    o: &mut [f32],
    left: usize,
) -> usize {
    // SAFETY (all calls below): the caller's CPU features.
    unsafe {
        match (24 / V).min(left) {
            g if g >= 6 => wsum_heads::<V, 6>(scores, offsets, v_cache, o),
            5 => wsum_heads::<V, 5>(scores, offsets, v_cache, o),
            4 => wsum_heads::<V, 4>(scores, offsets, v_cache, o),
            3 => wsum_heads::<V, 3>(scores, offsets, v_cache, o),
            2 => wsum_heads::<V, 2>(scores, offsets, v_cache, o),
            _ => wsum_heads::<V, 1>(scores, offsets, v_cache, o),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn wsum_heads<const V: usize, const H: usize>(
    scores: &[f32],
    offsets: &[usize],
    v_cache: &[f32],
    o: &mut [f32],
) -> usize {
    use std::arch::x86_64::*;
    let (n, hd) = (offsets.len(), 16 * V);
    assert!(scores.len() >= (H - 1) * n + n && o.len() >= H * hd);
    let mut acc = [[_mm512_setzero_ps(); V]; H];
    for (i, &off) in offsets.iter().enumerate() {
        let v = &v_cache[off..off + hd];
        if let Some(&ahead) = offsets.get(i + KEYS_AHEAD) {
            prefetch_row(&v_cache[ahead..ahead + hd]);
        }
        let p: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(scores[h * n + i]));
        for j in 0..V {
            // SAFETY: v has hd = 16V values.
            let vj = unsafe { _mm512_loadu_ps(v.as_ptr().add(16 * j)) };
            for (a, ph) in acc.iter_mut().zip(&p) {
                a[j] = _mm512_fmadd_ps(*ph, vj, a[j]);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (j, aj) in a.iter().enumerate() {
            // SAFETY: o has H * hd values.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(h * hd + 16 * j), *aj) };
        }
    }
    H
}

#[cfg(test)]
mod tests;
