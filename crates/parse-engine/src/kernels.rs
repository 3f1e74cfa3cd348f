//! Register-tiled CPU dot kernels for Q4_K and Q6_K weights against Q8_K activations.
//!
//! One call computes the dot products of one weight row with up to [`TILE_ROWS`] activation rows, unpacking each
//! weight super-block once for all of them. The arithmetic of each (weight row, activation row) pair is fixed and
//! independent of how many rows share the call:
//! - per super-block, the products `scale * q4 * q8` are summed as exact integers into 8 lanes (lane `k` takes bytes
//!   `4k..4k+4` of every 32-byte chunk), so the SIMD arrangement cannot change them;
//! - each lane accumulates `fma(d_x * d_w, lane as f32, acc)` over super-blocks; the min term goes the same way
//!   through 4 lanes (lane `t` takes sub-blocks `2t` and `2t + 1`), and both lane sets are summed in a fixed tree
//!   at the end.
//!
//! Q6_K is simpler: a super-block's whole integer sum `S` is exact, and `acc = fma(d_x * d_w, S as f32, acc)` runs
//! in one scalar chain.
//!
//! [`q4k_dot_scalar`] and [`q6k_dot_scalar`] implement the definitions without SIMD; the AVX2 kernels must agree
//! with them bitwise.

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ6K, BlockQ8K};
use half::f16;

/// Activation rows processed per call (8 measured fastest on the 2-core development machine: 4 and 6 were 10-20%
/// slower on 64-token blocks; the kernels are instantiated for 1..=8).
pub const TILE_ROWS: usize = 8;

const QK_K: usize = 256;

/// Byte layout of a Q4_K super-block (ggml's `block_q4_K`).
#[repr(C)]
struct RawQ4K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qs: [u8; QK_K / 2],
}

/// Byte layout of a Q6_K super-block (ggml's `block_q6_K`).
#[repr(C)]
struct RawQ6K {
    ql: [u8; QK_K / 2],
    qh: [u8; QK_K / 4],
    scales: [i8; QK_K / 16],
    d: u16,
}

/// Byte layout of a Q8_K super-block (ggml's `block_q8_K`).
#[repr(C)]
struct RawQ8K {
    d: f32,
    qs: [i8; QK_K],
    bsums: [i16; QK_K / 16],
}

const _: () = assert!(std::mem::size_of::<RawQ4K>() == std::mem::size_of::<BlockQ4K>());
const _: () = assert!(std::mem::align_of::<RawQ4K>() == std::mem::align_of::<BlockQ4K>());
const _: () = assert!(std::mem::size_of::<RawQ8K>() == std::mem::size_of::<BlockQ8K>());
const _: () = assert!(std::mem::align_of::<RawQ8K>() == std::mem::align_of::<BlockQ8K>());

#[allow(unsafe_code)]
fn raw_q4k(xs: &[BlockQ4K]) -> &[RawQ4K] {
    // SAFETY: candle's BlockQ4K is `#[repr(C)] { d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128] }`, the same
    // fields in the same order as RawQ4K (f16 and u16 share size, alignment and every bit pattern); size and
    // alignment equality is asserted at compile time above.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<RawQ4K>(), xs.len()) }
}

const _: () = assert!(std::mem::size_of::<RawQ6K>() == std::mem::size_of::<BlockQ6K>());
const _: () = assert!(std::mem::align_of::<RawQ6K>() == std::mem::align_of::<BlockQ6K>());

#[allow(unsafe_code)]
fn raw_q6k(xs: &[BlockQ6K]) -> &[RawQ6K] {
    // SAFETY: candle's BlockQ6K is `#[repr(C)] { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`, the same
    // fields in the same order as RawQ6K; size and alignment equality is asserted at compile time above.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<RawQ6K>(), xs.len()) }
}

#[allow(unsafe_code)]
fn raw_q8k(xs: &[BlockQ8K]) -> &[RawQ8K] {
    // SAFETY: candle's BlockQ8K is `#[repr(C)] { d: f32, qs: [i8; 256], bsums: [i16; 16] }`, identical to RawQ8K;
    // size and alignment equality is asserted at compile time above.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<RawQ8K>(), xs.len()) }
}

/// The 6-bit sub-block scales and mins of a Q4_K super-block, as (scales, mins), 8 bytes each.
#[inline]
fn scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let sc_lo = u0 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let join = |a: u32, b: u32| (a as u64 | ((b as u64) << 32)).to_le_bytes();
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// Lane `t` of the min term: sub-blocks `2t` and `2t + 1`.
#[inline]
fn min_lanes(m: &[u8; 8], bsums: &[i16; 16]) -> [i32; 4] {
    let bp = |j: usize| bsums[2 * j] as i32 + bsums[2 * j + 1] as i32;
    std::array::from_fn(|t| m[2 * t] as i32 * bp(2 * t) + m[2 * t + 1] as i32 * bp(2 * t + 1))
}

#[inline]
fn lane_tree4(l: [f32; 4]) -> f32 {
    (l[0] + l[2]) + (l[1] + l[3])
}

#[inline]
fn lane_tree(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Reference definition of the dot product of one Q4_K row with one Q8_K row (no SIMD).
#[allow(clippy::needless_range_loop)] // the byte index addresses weights and activations alike
pub fn q4k_dot_scalar(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    let (w, x) = (raw_q4k(w), raw_q8k(x));
    let mut acc = [0f32; 8];
    let mut acc_m = [0f32; 4];
    for (wb, xb) in w.iter().zip(x) {
        let (sc, m) = scales_mins(&wb.scales);
        let mut lanes = [0i32; 8];
        for j in 0..4 {
            let q = &wb.qs[32 * j..32 * j + 32];
            for (k, lane) in lanes.iter_mut().enumerate() {
                let mut lo = 0i32;
                let mut hi = 0i32;
                for b in 4 * k..4 * k + 4 {
                    lo += (q[b] & 0xF) as i32 * xb.qs[64 * j + b] as i32;
                    hi += (q[b] >> 4) as i32 * xb.qs[64 * j + 32 + b] as i32;
                }
                *lane += sc[2 * j] as i32 * lo + sc[2 * j + 1] as i32 * hi;
            }
        }
        let d = xb.d * f16::from_bits(wb.d).to_f32();
        let dmin = xb.d * f16::from_bits(wb.dmin).to_f32();
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = d.mul_add(l as f32, *a);
        }
        for (a, l) in acc_m.iter_mut().zip(min_lanes(&m, &xb.bsums)) {
            *a = dmin.mul_add(l as f32, *a);
        }
    }
    lane_tree(acc) - lane_tree4(acc_m)
}

/// Dispatches a tile of `xs.len()` rows (1..=[`TILE_ROWS`]) to the AVX2 kernel instantiated for that size, or to
/// the scalar definition on CPUs without AVX2/FMA.
macro_rules! tile_dispatch {
    ($kernel:path, $scalar:path, $w:expr, $xs:expr, $out:expr) => {{
        let (w, xs, out) = ($w, $xs, $out);
        debug_assert!(xs.len() <= TILE_ROWS && out.len() == xs.len());
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                #[allow(unsafe_code)]
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                unsafe {
                    use $kernel as k;
                    match xs.len() {
                        1 => k::<1>(w, xs, out),
                        2 => k::<2>(w, xs, out),
                        3 => k::<3>(w, xs, out),
                        4 => k::<4>(w, xs, out),
                        5 => k::<5>(w, xs, out),
                        6 => k::<6>(w, xs, out),
                        7 => k::<7>(w, xs, out),
                        _ => k::<8>(w, xs, out),
                    }
                }
                return;
            }
        }
        for (o, x) in out.iter_mut().zip(xs) {
            *o = $scalar(w, x);
        }
    }};
}

/// Dot products of one Q4_K weight row with up to [`TILE_ROWS`] Q8_K activation rows: `out[r] = w . xs[r]`.
pub fn q4k_dot_tile(w: &[BlockQ4K], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    tile_dispatch!(avx2::q4k_tile, q4k_dot_scalar, w, xs, out)
}

/// The unsigned 6-bit value (0..64) of element `v` of a Q6_K super-block; the weight is `value - 32`.
#[inline]
fn q6k_value(b: &RawQ6K, v: usize) -> i32 {
    let (n, rest) = (v / 128, v % 128);
    let (part, l) = (rest / 32, rest % 32);
    let ql = &b.ql[64 * n..64 * n + 64];
    let qh = b.qh[32 * n + l];
    let low = match part {
        0 => ql[l] & 0xF,
        1 => ql[l + 32] & 0xF,
        2 => ql[l] >> 4,
        _ => ql[l + 32] >> 4,
    };
    (low | (((qh >> (2 * part)) & 3) << 4)) as i32
}

/// Reference definition of the dot product of one Q6_K row with one Q8_K row (no SIMD).
pub fn q6k_dot_scalar(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let (w, x) = (raw_q6k(w), raw_q8k(x));
    let mut acc = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let mut s = 0i32;
        for g in 0..16 {
            let group: i32 = (16 * g..16 * g + 16)
                .map(|v| (q6k_value(wb, v) - 32) * xb.qs[v] as i32)
                .sum();
            s += wb.scales[g] as i32 * group;
        }
        let d = xb.d * f16::from_bits(wb.d).to_f32();
        acc = d.mul_add(s as f32, acc);
    }
    acc
}

/// Dot products of one Q6_K weight row with up to [`TILE_ROWS`] Q8_K activation rows: `out[r] = w . xs[r]`.
pub fn q6k_dot_tile(w: &[BlockQ6K], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    tile_dispatch!(avx2_q6k::q6k_tile, q6k_dot_scalar, w, xs, out)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// `R` activation rows against one weight row. Lane `k` of each 32-bit accumulator collects bytes `4k..4k+4`
    /// of every 32-byte chunk (`maddubs` pairs bytes, `madd` pairs the pairs), matching [`q4k_dot_scalar`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q4k_tile<const R: usize>(
        w: &[BlockQ4K],
        xs: &[&[BlockQ8K]],
        out: &mut [f32],
    ) {
        let w = raw_q4k(w);
        let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut acc_m = [_mm_setzero_ps(); R];
        for (b, wb) in w.iter().enumerate() {
            let (sc, m) = scales_mins(&wb.scales);
            let mins = _mm_cvtepu8_epi16(_mm_set_epi64x(0, i64::from_le_bytes(m)));
            let wd = f16::from_bits(wb.d).to_f32();
            let wdmin = f16::from_bits(wb.dmin).to_f32();
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..4 {
                // SAFETY: qs has 128 bytes; chunk j spans bytes 32j..32j+32.
                let bits = unsafe { _mm256_loadu_si256(wb.qs.as_ptr().add(32 * j).cast()) };
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                let sl = _mm256_set1_epi16(sc[2 * j] as i16);
                let sh = _mm256_set1_epi16(sc[2 * j + 1] as i16);
                for r in 0..R {
                    let q8 = xs[r][b].qs.as_ptr();
                    // SAFETY: qs has 256 bytes; the loads span 64j..64j+64.
                    let (al, ah) = unsafe {
                        (
                            _mm256_loadu_si256(q8.add(64 * j).cast()),
                            _mm256_loadu_si256(q8.add(64 * j + 32).cast()),
                        )
                    };
                    let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, al), sl);
                    let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ah), sh);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                }
            }
            for r in 0..R {
                let xb = &xs[r][b];
                let d = xb.d * wd;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
                let dmin = xb.d * wdmin;
                // SAFETY: bsums has 16 i16 (32 bytes).
                let bs = unsafe { _mm256_loadu_si256(xb.bsums.as_ptr().cast()) };
                let bp =
                    _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                let prod = _mm_madd_epi16(mins, bp);
                acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
            }
        }
        for r in 0..R {
            let mut lanes = [0f32; 8];
            // SAFETY: lanes holds 8 f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
            let mut mlanes = [0f32; 4];
            // SAFETY: mlanes holds 4 f32.
            unsafe { _mm_storeu_ps(mlanes.as_mut_ptr(), acc_m[r]) };
            out[r] = lane_tree(lanes) - lane_tree4(mlanes);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2_q6k {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// `R` activation rows against one Q6_K weight row; each super-block's integer sum is exact.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q6k_tile<const R: usize>(
        w: &[BlockQ6K],
        xs: &[&[BlockQ8K]],
        out: &mut [f32],
    ) {
        let w = raw_q6k(w);
        let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let mut acc = [0f32; R];
        for (b, wb) in w.iter().enumerate() {
            // SAFETY: scales has 16 bytes.
            let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(wb.scales.as_ptr().cast()) });
            let mut sumi = [_mm256_setzero_si256(); R];
            for n in 0..2 {
                // SAFETY: ql has 128 bytes and qh 64; the loads span 64n..64n+64 and 32n..32n+32.
                let (ql0, ql1, qh) = unsafe {
                    (
                        _mm256_loadu_si256(wb.ql.as_ptr().add(64 * n).cast()),
                        _mm256_loadu_si256(wb.ql.as_ptr().add(64 * n + 32).cast()),
                        _mm256_loadu_si256(wb.qh.as_ptr().add(32 * n).cast()),
                    )
                };
                let high = |shift: i32| -> __m256i {
                    let h = match shift {
                        0 => qh,
                        2 => _mm256_srli_epi16(qh, 2),
                        4 => _mm256_srli_epi16(qh, 4),
                        _ => _mm256_srli_epi16(qh, 6),
                    };
                    _mm256_slli_epi16(_mm256_and_si256(h, m2), 4)
                };
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
                ];
                let scale: [__m256i; 4] = std::array::from_fn(|j| {
                    let g = 8 * n + 2 * j;
                    _mm256_set_m128i(
                        _mm_set1_epi16(wb.scales[g + 1] as i16),
                        _mm_set1_epi16(wb.scales[g] as i16),
                    )
                });
                for r in 0..R {
                    let q8 = xs[r][b].qs.as_ptr();
                    for j in 0..4 {
                        // SAFETY: qs has 256 bytes; the load spans 128n + 32j .. +32.
                        let a = unsafe { _mm256_loadu_si256(q8.add(128 * n + 32 * j).cast()) };
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], a), scale[j]);
                        sumi[r] = _mm256_add_epi32(sumi[r], p);
                    }
                }
            }
            let wd = f16::from_bits(wb.d).to_f32();
            for r in 0..R {
                let xb = &xs[r][b];
                // SAFETY: bsums has 16 i16 (32 bytes).
                let bs = unsafe { _mm256_loadu_si256(xb.bsums.as_ptr().cast()) };
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
                let s = hsum_i32(_mm256_sub_epi32(sumi[r], offset));
                acc[r] = (xb.d * wd).mul_add(s as f32, acc[r]);
            }
        }
        out[..R].copy_from_slice(&acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::GgmlType;
    use rand::{Rng, SeedableRng};

    fn blocks<T: GgmlType>(data: &[f32]) -> Vec<T> {
        let mut b = vec![T::zeros(); data.len() / QK_K];
        T::from_float(data, &mut b);
        b
    }

    #[test]
    fn simd_tile_equals_the_scalar_definition_and_candles_dot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let k = 6 * QK_K;
        let w: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let wq = blocks::<BlockQ4K>(&w);
        let rows: Vec<Vec<BlockQ8K>> = (0..TILE_ROWS)
            .map(|_| {
                let x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                blocks::<BlockQ8K>(&x)
            })
            .collect();
        let refs: Vec<&[BlockQ8K]> = rows.iter().map(|r| r.as_slice()).collect();
        for n in 1..=TILE_ROWS {
            let mut out = vec![0f32; n];
            q4k_dot_tile(&wq, &refs[..n], &mut out);
            for r in 0..n {
                let want = q4k_dot_scalar(&wq, refs[r]);
                assert_eq!(out[r].to_bits(), want.to_bits(), "tile of {n}, row {r}");
                let candle = BlockQ4K::vec_dot(k, &wq, refs[r]);
                assert!(
                    (candle - want).abs() <= 1e-4 * candle.abs().max(1.0),
                    "{candle} vs {want}"
                );
            }
        }
        let w6 = blocks::<BlockQ6K>(&w);
        for n in 1..=TILE_ROWS {
            let mut out = vec![0f32; n];
            q6k_dot_tile(&w6, &refs[..n], &mut out);
            for r in 0..n {
                let want = q6k_dot_scalar(&w6, refs[r]);
                assert_eq!(out[r].to_bits(), want.to_bits(), "q6k tile of {n}, row {r}");
                let candle = BlockQ6K::vec_dot(k, &w6, refs[r]);
                assert!(
                    (candle - want).abs() <= 1e-4 * candle.abs().max(1.0),
                    "q6k: {candle} vs {want}"
                );
            }
        }
    }
}
