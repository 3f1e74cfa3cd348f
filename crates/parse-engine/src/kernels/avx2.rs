//! AVX2 + FMA variants (`maddubs` + `madd` per 32 products; Q6_K one `madd` per two `maddubs`, [`q6k_sums`]), and
//! for Q5_0 in its 8-row lanes layout and Q4_K in the lanes layout kernels of 8 weight rows per vector
//! ([`q5_0_lanes8`], [`q4k_lanes8`]). Each computes the arithmetic of the matching `*_dot_scalar` definition in
//! `super`, bit for bit.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::*;

mod lanes8;
pub(super) use lanes8::quantize_q8k_avx2;
pub use lanes8::{q4k_lanes8, q5_0_lanes8};

/// Lane `r` of the result is the sum of the 8 lanes of `v[r]` (wrapping, so exact wherever the true sums fit in
/// i32, as every sum here does): the rows of a tile are reduced together instead of one horizontal sum each.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn sum_rows8(v: [__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    // Each 128-bit half of g0 holds partial sums of rows 0..4, of g1 rows 4..8.
    let g0 = _mm256_hadd_epi32(h01, h23);
    let g1 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(g0, g1),
        _mm256_permute2x128_si256::<0x31>(g0, g1),
    )
}

/// The activations' scales of block `b` of each row, lane `r` for row `r` (0 past the tile's rows).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn row_scales<const R: usize>(xs: &[&[RawQ8K]; R], b: usize) -> __m256 {
    let d: [f32; 8] = std::array::from_fn(|r| if r < R { xs[r][b].d } else { 0.0 });
    // SAFETY: d holds 8 f32.
    unsafe { _mm256_loadu_ps(d.as_ptr()) }
}

/// A Q4_K super-block's sub-block mins as 16 x i16, each twice, so `madd` with the activations' 16 bsums gives
/// `min_j * (bsum_2j + bsum_2j+1)` in lane `j`; the lanes sum to the min term `M`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn q4k_mins_paired(m: &[u8; 8]) -> __m256i {
    let m = _mm_set_epi64x(0, i64::from_le_bytes(*m));
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m))
}

/// The tiles' float step for `R` > 1 rows at once: `acc + (d_x * d_w) * s`, one row per lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn fma_rows(acc: __m256, dx: __m256, dw: f32, s: __m256i) -> __m256 {
    _mm256_fmadd_ps(
        _mm256_mul_ps(dx, _mm256_set1_ps(dw)),
        _mm256_cvtepi32_ps(s),
        acc,
    )
}

/// The first `R` lanes of `v`.
#[target_feature(enable = "avx")]
#[inline]
pub(super) fn first_lanes<const R: usize>(v: __m256) -> [f32; R] {
    let mut out = [0f32; 8];
    // SAFETY: out holds 8 f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    std::array::from_fn(|r| out[r])
}

/// Each row's 8 lanes of scaled products with one Q4_K super-block (block `b` of the rows, `sc` its sub-block scales;
/// the min term not yet taken off), in the first `R` of `N` (>= `R`) vectors: `maddubs` pairs bytes, `madd`
/// multiplies the pairs by the sub-block scale; lane sums are exact integers.
#[target_feature(enable = "avx2")]
#[inline]
fn q4k_sums<const R: usize, const N: usize>(
    wb: &RawQ4K,
    sc: &[u8; 8],
    xs: &[&[RawQ8K]; R],
    b: usize,
) -> [__m256i; N] {
    let m4 = _mm256_set1_epi8(0xF);
    let mut sumi = [_mm256_setzero_si256(); N];
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
    sumi
}

/// `R` activation rows against one Q4_K weight row: the products of [`q4k_sums`]; each row's 8 lanes are summed into
/// the super-block's exact integer `S` of [`q4k_dot_scalar`], and the min term `M` likewise.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4k_tile<const R: usize>(w: &[BlockQ4K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q4k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let mut acc = [0f32; R];
    let mut acc_m = [0f32; R];
    for (b, wb) in w.iter().enumerate() {
        let (sc, m) = scales_mins(&wb.scales);
        let mins = _mm_cvtepu8_epi16(_mm_set_epi64x(0, i64::from_le_bytes(m)));
        let wd = f16::from_bits(wb.d).to_f32();
        let wdmin = f16::from_bits(wb.dmin).to_f32();
        let sumi: [__m256i; R] = q4k_sums(wb, &sc, &xs, b);
        for r in 0..R {
            let xb = &xs[r][b];
            let s = hsum_i32(sumi[r]);
            acc[r] = (xb.d * wd).mul_add(s as f32, acc[r]);
            acc_m[r] = (xb.d * wdmin).mul_add(q4k_min_term(mins, &xb.bsums) as f32, acc_m[r]);
        }
    }
    std::array::from_fn(|r| acc[r] - acc_m[r])
}

/// `R` (2..=8) activation rows against one Q4_K weight row: the products as in [`q4k_tile`], then the rows' integer
/// sums `S` and min terms `M` reduced together ([`sum_rows8`]) and the two float chains run with one row per lane.
/// Every lane computes `fma(d_x * d_w, S, acc)` and `fma(d_x * dmin_w, M, acc_m)` as the definition does, so the bits
/// are those of [`q4k_dot_scalar`]; what it saves is the per-row horizontal sums of every super-block.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4k_tile_rows<const R: usize>(w: &[BlockQ4K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q4k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    for (b, wb) in w.iter().enumerate() {
        let (sc, m) = scales_mins(&wb.scales);
        let mins = q4k_mins_paired(&m);
        let sumi: [__m256i; 8] = q4k_sums(wb, &sc, &xs, b);
        let mt = sum_rows8(std::array::from_fn(|r| {
            if r >= R {
                return _mm256_setzero_si256();
            }
            // SAFETY: bsums has 16 i16 (32 bytes).
            let bs = unsafe { _mm256_loadu_si256(xs[r][b].bsums.as_ptr().cast()) };
            _mm256_madd_epi16(bs, mins)
        }));
        let dx = row_scales(&xs, b);
        acc = fma_rows(acc, dx, f16::from_bits(wb.d).to_f32(), sum_rows8(sumi));
        acc_m = fma_rows(acc_m, dx, f16::from_bits(wb.dmin).to_f32(), mt);
    }
    first_lanes(_mm256_sub_ps(acc, acc_m))
}

/// The exact integer min term `M` of a Q4_K super-block: sub-block mins (`mins`, 8 x i16) times the activations'
/// sub-block sums (pairs of `bsums`).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn q4k_min_term(mins: __m128i, bsums: &[i16; 16]) -> i32 {
    // SAFETY: bsums has 16 i16 (32 bytes).
    let bs = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast()) };
    let bp = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    let prod = _mm_madd_epi16(mins, bp);
    let p2 = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0b01_00_11_10));
    _mm_cvtsi128_si32(_mm_add_epi32(p2, _mm_shuffle_epi32(p2, 0b10_11_00_01)))
}

/// The sum of the 8 lanes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Each row's 8 lanes of scaled products with one Q6_K super-block (block `b` of the rows, in the paired layout of
/// [`q6k_paired`]; the offset of 32 is not yet taken off), in the first `R` of `N` (>= `R`) vectors: lane sums are
/// exact integers.
///
/// Two `maddubs` add as i16 before one `madd` by the sub-blocks' scales: the weights of two 32-value vectors are
/// unpacked by 64-bit halves (`unpacklo`/`unpackhi_epi64`) so that each i16 lane of both holds values of the same
/// sub-block (lanes 0..4 of sub-block `s`, 4..8 of `s + 2`, 8..12 of `s + 1`, 12..16 of `s + 3`), and the
/// activations were laid out the same way once per panel. Each `maddubs` lane is at most 2 x 63 x 128 in magnitude,
/// so the two add without saturating (32,256 < 32,768); the integers are the definition's.
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_sums<const R: usize, const N: usize>(
    wb: &RawQ6K,
    xs: &[&[RawQ8K]; R],
    b: usize,
) -> [__m256i; N] {
    let m4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(3);
    // The scales' i16 words each lane of a pair holds: (0, 0, 0, 0, 2, 2, 2, 2) in the low half and (1, 1, 1, 1, 3,
    // 3, 3, 3) in the high half (the first pair), and the same plus 4 (the second).
    let pick = |w: i8| {
        let (a, b, c, d) = (2 * w, 2 * w + 4, 2 * w + 2, 2 * w + 6);
        _mm256_setr_epi8(
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            c,
            c + 1,
            c,
            c + 1,
            c,
            c + 1,
            c,
            c + 1,
            d,
            d + 1,
            d,
            d + 1,
            d,
            d + 1,
            d,
            d + 1,
        )
    };
    let picks = [pick(0), pick(4)];
    let mut sumi = [_mm256_setzero_si256(); N];
    for n in 0..2 {
        // SAFETY: ql has 128 bytes, qh 64 and scales 16; the loads span 64n..64n+64, 32n..32n+32 and 8n..8n+8.
        let (ql0, ql1, qh, sc8) = unsafe {
            (
                _mm256_loadu_si256(wb.ql.as_ptr().add(64 * n).cast()),
                _mm256_loadu_si256(wb.ql.as_ptr().add(64 * n + 32).cast()),
                _mm256_loadu_si256(wb.qh.as_ptr().add(32 * n).cast()),
                _mm_loadl_epi64(wb.scales.as_ptr().add(8 * n).cast()),
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
        // Sub-blocks 8n..8n+8 as i16 in both halves, then each pair's lanes.
        let sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8));
        let pairs: [(__m256i, __m256i, __m256i); 2] = std::array::from_fn(|p| {
            (
                _mm256_unpacklo_epi64(q[2 * p], q[2 * p + 1]),
                _mm256_unpackhi_epi64(q[2 * p], q[2 * p + 1]),
                _mm256_shuffle_epi8(sc, picks[p]),
            )
        });
        for r in 0..R {
            let q8 = xs[r][b].qs.as_ptr();
            for (p, &(lo, hi, scale)) in pairs.iter().enumerate() {
                // SAFETY: qs has 256 bytes; the loads span 128n + 64p .. +64.
                let (a_lo, a_hi) = unsafe {
                    (
                        _mm256_loadu_si256(q8.add(128 * n + 64 * p).cast()),
                        _mm256_loadu_si256(q8.add(128 * n + 64 * p + 32).cast()),
                    )
                };
                let s = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, a_lo),
                    _mm256_maddubs_epi16(hi, a_hi),
                );
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s, scale));
            }
        }
    }
    sumi
}

/// Activation rows laid out for [`q6k_sums`]: in each 64 values of a super-block, the two 32-value halves `a0`, `a1`
/// become `unpacklo_epi64(a0, a1)`, `unpackhi_epi64(a0, a1)` (the scale `d` and the sub-block sums `bsums` stay,
/// since they are sums over the same values). Into `buf`, one row after another.
#[target_feature(enable = "avx2")]
fn q6k_paired(xs: &[&[BlockQ8K]], buf: &mut Vec<RawQ8K>) {
    buf.clear();
    for x in xs {
        for xb in raw_q8k(x) {
            let mut pb = *xb;
            for g in 0..QK_K / 64 {
                // SAFETY: qs has 256 bytes; the loads and stores span 64g..64g + 64.
                unsafe {
                    let src = xb.qs.as_ptr().add(64 * g);
                    let (a0, a1) = (
                        _mm256_loadu_si256(src.cast()),
                        _mm256_loadu_si256(src.add(32).cast()),
                    );
                    let dst = pb.qs.as_mut_ptr().add(64 * g);
                    _mm256_storeu_si256(dst.cast(), _mm256_unpacklo_epi64(a0, a1));
                    _mm256_storeu_si256(dst.add(32).cast(), _mm256_unpackhi_epi64(a0, a1));
                }
            }
            buf.push(pb);
        }
    }
}

/// The offset term of a Q6_K super-block in 8 lanes: `32 * scale * bsum` over the 16 sub-blocks.
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_offset(sc16: __m256i, bsums: &[i16; 16]) -> __m256i {
    // SAFETY: bsums has 16 i16 (32 bytes).
    let bs = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast()) };
    _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5)
}

/// `R` activation rows against one Q6_K weight row; each super-block's integer sum is exact.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q6k_tile<const R: usize>(w: &[BlockQ6K], xs: &[&[RawQ8K]; R]) -> [f32; R] {
    let w = raw_q6k(w);
    let mut acc = [0f32; R];
    for (b, wb) in w.iter().enumerate() {
        // SAFETY: scales has 16 bytes.
        let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(wb.scales.as_ptr().cast()) });
        let sumi: [__m256i; R] = q6k_sums::<R, R>(wb, xs, b);
        let wd = f16::from_bits(wb.d).to_f32();
        for r in 0..R {
            let xb = &xs[r][b];
            let s = hsum_i32(_mm256_sub_epi32(sumi[r], q6k_offset(sc16, &xb.bsums)));
            acc[r] = (xb.d * wd).mul_add(s as f32, acc[r]);
        }
    }
    acc
}

/// `R` (2..=8) activation rows against one Q6_K weight row: the products as in [`q6k_tile`], the rows' integer sums
/// reduced together ([`sum_rows8`]) and the float chain run with one row per lane, bit for bit [`q6k_dot_scalar`].
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q6k_tile_rows<const R: usize>(w: &[BlockQ6K], xs: &[&[RawQ8K]; R]) -> [f32; R] {
    let w = raw_q6k(w);
    let mut acc = _mm256_setzero_ps();
    for (b, wb) in w.iter().enumerate() {
        // SAFETY: scales has 16 bytes.
        let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(wb.scales.as_ptr().cast()) });
        let mut sumi: [__m256i; 8] = q6k_sums::<R, 8>(wb, xs, b);
        for r in 0..R {
            sumi[r] = _mm256_sub_epi32(sumi[r], q6k_offset(sc16, &xs[r][b].bsums));
        }
        acc = fma_rows(
            acc,
            row_scales(xs, b),
            f16::from_bits(wb.d).to_f32(),
            sum_rows8(sumi),
        );
    }
    first_lanes(acc)
}

tile_any_fn!(q4k_tile_any, q4k_tile, q4k_tile_rows, "avx2,fma", BlockQ4K);

/// [`q6k_tile`] or [`q6k_tile_rows`] by `R`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q6k_tile_any<const R: usize>(w: &[BlockQ6K], xs: &[&[RawQ8K]; R]) -> [f32; R] {
    // SAFETY: the caller's CPU has this function's features, which both tiles need.
    unsafe {
        if R == 1 {
            q6k_tile::<R>(w, xs)
        } else {
            q6k_tile_rows::<R>(w, xs)
        }
    }
}

/// The tiles on activation rows in [`q6k_paired`]'s layout.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q6k_tile_paired<const R: usize>(w: &[BlockQ6K], xs: &[&[RawQ8K]; R]) -> [f32; R] {
    // SAFETY: the caller's CPU has this function's features.
    unsafe { q6k_tile_any::<R>(w, xs) }
}

/// `R` activation rows against one weight row of a 32-wide format, 8 blocks per step: `unpack` a block's weights once
/// for every row, `product(q, x)` its 8 lane sums (`maddubs` then `madd` with ones), [`sum_rows8`] the 8 blocks'
/// integers, plus the activations' `off5` where `q5` (Q5_0's weights are unsigned, `weight + 16`), one lane per
/// block. Past the row's last block the lanes hold `fma(0, 0, acc)`, which leaves `acc` as it is (it never holds -0:
/// it starts at +0, and a sum that comes to zero rounds to +0).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile8<B: Scaled, const R: usize>(
    w: &[B],
    xs: &[Act32Row<'_>; R],
    unpack: impl Fn(&B) -> __m256i,
    product: impl Fn(__m256i, __m256i) -> __m256i,
    q5: bool,
) -> [f32; R] {
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); R];
    for b0 in (0..w.len()).step_by(8) {
        let n = (w.len() - b0).min(8);
        // Loops, not `array::from_fn`: a closure is a function of its own, called where it cannot be inlined into
        // `from_fn`, which lacks this function's target features.
        let mut q = [zero; 8];
        for (j, qj) in q.iter_mut().enumerate().take(n) {
            *qj = unpack(&w[b0 + j]);
        }
        let wd = scales8(w, b0, n);
        let first = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        for r in 0..R {
            let x = &xs[r];
            let mut p = [zero; 8];
            for (j, (pj, qj)) in p.iter_mut().zip(&q).enumerate().take(n) {
                // SAFETY: block b0 + j of the row has 32 values at 32 (b0 + j).
                let a = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * (b0 + j)).cast()) };
                *pj = product(*qj, a);
            }
            let mut s = sum_rows8(p);
            // SAFETY: blocks b0..b0 + n of the row exist; the masked loads read no lane past them.
            unsafe {
                if q5 {
                    s = _mm256_add_epi32(s, _mm256_maskload_epi32(x.off5[b0..].as_ptr(), first));
                }
                let xd = _mm256_maskload_ps(x.d[b0..].as_ptr(), first);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(wd, xd), _mm256_cvtepi32_ps(s), acc[r]);
            }
        }
    }
    lanes_out(acc)
}

/// [`tile8`] of Q8_0: `maddubs(|w|, sign(x, w))` (activations never hold -128, so the sign trick cannot overflow)
/// gives the exact block integers of [`q8_0_dot_scalar`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_0_tile<const R: usize>(w: &[BlockQ8_0], xs: &[Act32Row<'_>; R]) -> [f32; R] {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: qs has 32 bytes.
    let unpack = |b: &RawQ8_0| unsafe { _mm256_loadu_si256(b.qs.as_ptr().cast()) };
    let product = |q: __m256i, a: __m256i| {
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)),
            ones,
        )
    };
    // SAFETY: the caller's CPU has this function's features, which tile8 needs.
    unsafe { tile8(raw_q8_0(w), xs, unpack, product, false) }
}

/// The 32 unsigned 5-bit values (`weight + 16`) of a Q5_0 block.
#[target_feature(enable = "avx2")]
#[inline]
fn q5_0_unsigned(b: &RawQ5_0) -> __m256i {
    // SAFETY: qs has 16 bytes.
    let qs = unsafe { _mm_loadu_si128(b.qs.as_ptr().cast()) };
    let m4 = _mm_set1_epi8(0xF);
    let lo = _mm_and_si128(qs, m4);
    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
    // Byte i of `bits` is 0x10 where bit i of qh is set: spread each qh byte over 8 bytes, test one bit per byte.
    let qh = u32::from_le_bytes(b.qh) as i32;
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_or_si256(
        _mm256_set_m128i(hi, lo),
        _mm256_and_si256(set, _mm256_set1_epi8(0x10)),
    )
}

/// [`tile8`] of Q5_0: `maddubs(q + 16, x)` plus the activations' `off5` (`-16 * sum of x`) gives the exact block
/// integers of [`q5_0_dot_scalar`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_0_tile<const R: usize>(w: &[BlockQ5_0], xs: &[Act32Row<'_>; R]) -> [f32; R] {
    let ones = _mm256_set1_epi16(1);
    let product = |q: __m256i, a: __m256i| _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), ones);
    // SAFETY: the caller's CPU has this function's features, which tile8 needs.
    unsafe {
        tile8(
            raw_q5_0(w),
            xs,
            |b: &RawQ5_0| q5_0_unsigned(b),
            product,
            true,
        )
    }
}

panel_fn!(q4k_panel, q4k_tile_any, "avx2,fma", BlockQ4K, &[BlockQ8K]);
panel_fn!(
    q6k_panel_paired,
    q6k_tile_paired,
    "avx2,fma",
    BlockQ6K,
    &[RawQ8K]
);

thread_local! {
    /// The activation rows of the panel running on this thread, in [`q6k_paired`]'s layout.
    static Q6K_PAIRED: std::cell::RefCell<Vec<RawQ8K>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The Q6_K panel: the activation rows laid out once for the call ([`q6k_paired`]), then the tiles over them.
///
/// # Safety
/// As the panels of [`panel_fn`]: the CPU has AVX2 and FMA, `w` holds whole rows of `kb` blocks, every row of `xs`
/// holds `kb` blocks, and `out` holds `w.len() / kb` values at every `r * stride`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn q6k_panel(
    w: &[BlockQ6K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    Q6K_PAIRED.with(|buf| {
        let mut buf = buf.borrow_mut();
        q6k_paired(xs, &mut buf);
        let mut rows: [&[RawQ8K]; TILE_ROWS] = [&[]; TILE_ROWS];
        let mut at = 0;
        for (row, x) in rows.iter_mut().zip(xs) {
            *row = &buf[at..at + x.len()];
            at += x.len();
        }
        // SAFETY: the caller's bounds, with the rows laid out anew (as many blocks each).
        unsafe { q6k_panel_paired(w, kb, &rows[..xs.len()], out, stride) }
    })
}
panel_fn!(
    q8_0_panel,
    q8_0_tile,
    "avx2,fma,f16c",
    BlockQ8_0,
    Act32Row<'_>
);
panel_fn!(
    q5_0_panel,
    q5_0_tile,
    "avx2,fma,f16c",
    BlockQ5_0,
    Act32Row<'_>
);
