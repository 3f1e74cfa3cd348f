//! AVX2 + FMA variants (`maddubs` + `madd` per 32 products; Q6_K one `madd` per two `maddubs`, [`q6k_sums`]), and
//! for Q5_0 in its 8-row lanes layout and Q4_K in the lanes layout kernels of 8 weight rows per vector
//! ([`q5_0_lanes8`], [`q4k_lanes8`]). Each computes the arithmetic of the matching `*_dot_scalar` definition in
//! `super`, bit for bit.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::*;

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

/// Bytes of one tile of Q5_0's 8-row lanes layout (`quant::Q5_0Tiles::Words8`): one block of 8 rows.
const Q5_0_TILE8: usize = 8 * std::mem::size_of::<RawQ5_0>();

/// How far ahead of the tile being computed [`q5_0_lanes8`] prefetches, in bytes (about 23 tiles). The tiles are
/// one stream, yet on a 2-core AVX2-only EPYC (12 GB/s read by one core) the hardware prefetchers left the draft's
/// 93.6 MB head at 10.9-12.0 ms for one activation row; with this 7.4-8.0 ms, and the draft's one-token step
/// 41-45 -> 35-36 ms (`matmul-bench --formats q5_0`, `engine-bench --models draft`, one thread; 2 KB came between).
const Q5_0_PREFETCH: usize = 4096;

/// The fifth bits of values `4k..4k + 4` of the 8 rows at bit 4 of their bytes (0x10 or 0), from the tile's words
/// (`h`: row `n`'s word in lane `n`, whose byte `t` holds them at bit `k`).
#[target_feature(enable = "avx2")]
#[inline]
fn fifth_bits(h: __m256i, k: usize) -> __m256i {
    let at4 = match k {
        0 => _mm256_slli_epi32::<4>(h),
        1 => _mm256_slli_epi32::<3>(h),
        2 => _mm256_slli_epi32::<2>(h),
        3 => _mm256_slli_epi32::<1>(h),
        4 => h,
        5 => _mm256_srli_epi32::<1>(h),
        6 => _mm256_srli_epi32::<2>(h),
        _ => _mm256_srli_epi32::<3>(h),
    };
    _mm256_and_si256(at4, _mm256_set1_epi8(0x10))
}

/// One tile of Q5_0's 8-row lanes layout unpacked: its rows' scales, and in `wq[k]` values `4k..4k + 4` of every
/// row as unsigned bytes (`weight + 16`), one row per 32-bit lane: nibbles from one load per pair of `k`, the fifth
/// bits a shift and an `and` of the rows' words ([`fifth_bits`]).
///
/// # Safety
/// `t` must point at a whole tile (176 readable bytes).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q5_0_tile8(t: *const u8) -> ([__m256i; 8], __m256) {
    let nib = _mm256_set1_epi8(0xF);
    let mut wq = [_mm256_setzero_si256(); 8];
    // SAFETY: the caller's bound: the scales at 0..16, the words at 16..48, the nibbles at 48..176.
    unsafe {
        let wd = _mm256_cvtph_ps(_mm_loadu_si128(t.cast()));
        let h = _mm256_loadu_si256(t.add(16).cast());
        for i in 0..4 {
            let q = _mm256_loadu_si256(t.add(48 + 32 * i).cast());
            let lo = _mm256_and_si256(q, nib);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
            wq[i] = _mm256_or_si256(lo, fifth_bits(h, i));
            wq[i + 4] = _mm256_or_si256(hi, fifth_bits(h, i + 4));
        }
        (wq, wd)
    }
}

/// The exact integer of one block of [`q5_0_dot_scalar`] for the 8 rows of a tile ([`q5_0_tile8`]) and one
/// activation row (its 32 bytes at `qs`, `off` its `off5`): per 4 values one `maddubs` of the 8 rows' unsigned
/// weights by the activations' 4 bytes broadcast, four of them added as i16 (at most 8 x 31 x 127 = 31,496, no
/// overflow) and widened by one `madd` with ones; the sum of `(weight + 16) * x` plus `off5` is `sum weight * x`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q5_0_block8(wq: &[__m256i; 8], qs: *const i8, off: i32) -> __m256i {
    // SAFETY: the caller guarantees 32 readable activation bytes at qs.
    let x = |k: usize| unsafe { _mm256_set1_epi32(qs.add(4 * k).cast::<i32>().read_unaligned()) };
    let half = |k: usize| {
        let p = |j: usize| _mm256_maddubs_epi16(wq[k + j], x(k + j));
        _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)))
    };
    let ones = _mm256_set1_epi16(1);
    _mm256_add_epi32(
        _mm256_add_epi32(
            _mm256_madd_epi16(half(0), ones),
            _mm256_madd_epi16(half(4), ones),
        ),
        _mm256_set1_epi32(off),
    )
}

/// The 8 lanes of the 32-wide formats' definition (block `b` in `acc[b % 8]`), 8 weight rows each, summed in
/// `lane_tree`'s order.
#[target_feature(enable = "avx")]
#[inline]
fn lane_tree8(acc: &[__m256; 8]) -> __m256 {
    let t: [__m256; 4] = std::array::from_fn(|j| _mm256_add_ps(acc[j], acc[j + 4]));
    _mm256_add_ps(_mm256_add_ps(t[0], t[2]), _mm256_add_ps(t[1], t[3]))
}

/// `out[r * stride + c] = q5_0_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` in Q5_0's 8-row lanes layout
/// (`quant::Q5_0Tiles::Words8`, whole groups of 8 rows of `kb` blocks) and every activation row `r`. One weight row
/// per 32-bit lane: each tile is unpacked once ([`q5_0_tile8`]) for every activation row, whose 8 lanes of the
/// definition (block `b` in lane `b % 8`) run as 8 vectors of 8 weight rows, `fma(d_w * d_x, s, acc)` per block and
/// lane as the definition does, and are summed in its tree at the end of the group: the same bits. Against the rows'
/// tiles ([`q5_0_tile`]) it spends no shuffles on the fifth bits, and one `madd` per 4 `maddubs` where they spend
/// one per `maddubs` and a reduction across lanes.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must be whole groups of 8 rows of `kb` blocks in that layout; `xs` rows
/// must hold at least `kb` blocks; `out` must hold `w.len() / kb` values at every `r * stride`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_0_lanes8(
    w: &[BlockQ5_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    let groups = w.len() / kb / 8;
    debug_assert_eq!(groups * 8 * kb, w.len());
    let wp = w.as_ptr().cast::<u8>();
    let mut acc = vec![[_mm256_setzero_ps(); 8]; xs.len()];
    for g in 0..groups {
        acc.fill([_mm256_setzero_ps(); 8]);
        for b in 0..kb {
            let at = (g * kb + b) * Q5_0_TILE8;
            for line in 0..Q5_0_TILE8.div_ceil(64) {
                // A prefetch reads nothing and cannot fault; `wrapping_add` keeps the address arithmetic defined
                // past the matrix's end.
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(at + Q5_0_PREFETCH + 64 * line).cast());
            }
            // SAFETY: tile (g, b) lies in `w` (the caller's bounds).
            let (wq, wd) = unsafe { q5_0_tile8(wp.add(at)) };
            for (x, a) in xs.iter().zip(acc.iter_mut()) {
                // SAFETY: the row holds kb blocks, 32 activation bytes each.
                let s = unsafe { q5_0_block8(&wq, x.qs.as_ptr().add(32 * b), x.off5[b]) };
                let d = _mm256_mul_ps(wd, _mm256_set1_ps(x.d[b]));
                a[b % 8] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), a[b % 8]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: out holds row r's 8 values of group g at r * stride + 8g (the caller's bounds).
            unsafe { _mm256_storeu_ps(out[r * stride + 8 * g..][..8].as_mut_ptr(), lane_tree8(a)) };
        }
    }
}

/// Bytes of a tile of the K-quants' lanes layout for Q4_K (`quant::to_lanes`): super-block `b` of 16 rows, word `i`
/// of row `n` at byte `64i + 4n`, so that rows 0..8 of a word are its first 32 bytes and rows 8..16 the next.
const Q4K_TILE16: usize = 16 * std::mem::size_of::<RawQ4K>();

/// The largest of the 8 lanes of `m`.
#[target_feature(enable = "avx2")]
#[inline]
fn max8(m: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// `round(sc * v)` clamped to -128..=127, 8 values as i32, rounding half away from zero as `f32::round` does, a NaN
/// product giving 0 as `NaN as i8` does ([`quantize_q8k_avx2`]).
#[target_feature(enable = "avx2")]
#[inline]
fn q8_8(sc: __m256, v: __m256) -> __m256i {
    let sign = _mm256_set1_ps(-0.0);
    let p = _mm256_mul_ps(sc, v);
    // Truncate, then step away from zero where the dropped part is >= 0.5.
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
    let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(p, t));
    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let step = _mm256_and_ps(
        away,
        _mm256_or_ps(_mm256_and_ps(p, sign), _mm256_set1_ps(1.0)),
    );
    let r = _mm256_add_ps(t, step);
    let r = _mm256_min_ps(
        _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
        _mm256_set1_ps(127.0),
    );
    // A NaN product (a NaN value, or an infinite one times a zero `iscale`) gives 0.
    _mm256_cvttps_epi32(_mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p)))
}

/// Quantizes rows of 256-value blocks to Q8_K exactly as candle's `BlockQ8K::from_float` does (the value of largest
/// magnitude, the first one on ties, maps to -127; a NaN never counts as the largest; `round` half away from zero;
/// clamp to -128..=127; 16-value sums; `d = 1 / iscale`), 8 values per instruction, where candle's loop takes one
/// at a time ([`super::quantize_q8k`] says what that was worth).
///
/// # Safety
/// The CPU must have AVX2; `xs` must hold `256 * ys.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_q8k_avx2(xs: &[f32], ys: &mut [BlockQ8K]) {
    // SAFETY: RawQ8K has BlockQ8K's layout (asserted in super); the slice covers the same blocks.
    let ys = unsafe { std::slice::from_raw_parts_mut(ys.as_mut_ptr().cast::<RawQ8K>(), ys.len()) };
    let sign = _mm256_set1_ps(-0.0);
    for (x, y) in xs.chunks_exact(QK_K).zip(ys.iter_mut()) {
        let xp = x.as_ptr();
        // `max(|v|, m)` keeps `m` where `|v|` is a NaN, as candle's `amax < |v|` never takes one.
        let mut m = _mm256_setzero_ps();
        for i in 0..QK_K / 8 {
            // SAFETY: x has 256 values; the load spans 8i..8i + 8.
            let v = unsafe { _mm256_loadu_ps(xp.add(8 * i)) };
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        }
        let amax = max8(m);
        if amax == 0.0 {
            y.d = 0.0;
            y.qs.fill(0);
            y.bsums.fill(0);
            continue;
        }
        // The first value whose magnitude is amax (8 at a time; a NaN compares unequal).
        let want = _mm256_set1_ps(amax);
        let first = (0..QK_K / 8)
            .find_map(|i| {
                // SAFETY: x has 256 values; the load spans 8i..8i + 8.
                let v = unsafe { _mm256_loadu_ps(xp.add(8 * i)) };
                let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), want);
                let bits = _mm256_movemask_ps(eq) as u32;
                (bits != 0).then(|| 8 * i + bits.trailing_zeros() as usize)
            })
            .unwrap_or(0);
        let iscale = -127f32 / x[first];
        let sc = _mm256_set1_ps(iscale);
        for g in 0..QK_K / 16 {
            // SAFETY: x has 256 values; the loads span 16g..16g + 16.
            let (a, b) = unsafe {
                (
                    q8_8(sc, _mm256_loadu_ps(xp.add(16 * g))),
                    q8_8(sc, _mm256_loadu_ps(xp.add(16 * g + 8))),
                )
            };
            // i32 to i16 (lanes a0..4, b0..4, a4..8, b4..8, put back in order), then to i8: exact, as every value
            // lies in -128..=127.
            let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            let q = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
            // SAFETY: qs has 256 bytes; the store spans 16g..16g + 16.
            unsafe { _mm_storeu_si128(y.qs.as_mut_ptr().add(16 * g).cast(), q) };
            let s = _mm256_add_epi32(a, b);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_hadd_epi32(s, s);
            y.bsums[g] = _mm_cvtsi128_si32(_mm_hadd_epi32(s, s)) as i16;
        }
        y.d = 1.0 / iscale;
    }
}

/// The 32-bit words `i` of 8 rows of a Q4_K lanes tile (`base`: the tile, plus 32 for rows 8..16), one row per lane.
///
/// # Safety
/// `base + 64i` must have 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn word8(base: *const u8, i: usize) -> __m256i {
    // SAFETY: the caller's bound.
    unsafe { _mm256_loadu_si256(base.add(64 * i).cast()) }
}

/// A `shuffle_epi8` pattern that takes byte `k` of every 32-bit lane to bytes 0 and 2 of the lane (`pair`: bytes
/// `k` and `k + 1` there), zeros in bytes 1 and 3: a byte of each row as an i16 in both halves of its lane, for `madd`.
#[target_feature(enable = "avx2")]
#[inline]
fn bytes_to_i16(k: usize, pair: bool) -> __m256i {
    let idx: [u8; 32] = std::array::from_fn(|p| {
        let lane = (p % 16) / 4 * 4;
        match p % 4 {
            0 => (lane + k) as u8,
            2 => (lane + k + usize::from(pair)) as u8,
            _ => 0x80,
        }
    });
    // SAFETY: 32 bytes make the 256 bits loaded.
    unsafe { _mm256_loadu_si256(idx.as_ptr().cast()) }
}

/// What the first four words of 8 rows of a Q4_K lanes tile give, one row per lane: the 6-bit scales of sub-blocks
/// 0..8, each as an i16 in both halves of its lane (`madd` with a sub-block's i16 pair sums is `scale * sum`), the
/// mins of sub-blocks `2i` and `2i + 1` as a pair of i16 (`madd` with [`groups::bsum_pairs`]' word `i`), and `d`,
/// `dmin` as f32 (those of `scales_mins` and the block's header).
///
/// # Safety
/// As [`word8`] for words 0..4.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q4k_header8(base: *const u8) -> ([__m256i; 8], [__m256i; 4], __m256, __m256) {
    // SAFETY: the caller's bound.
    let [dd, u0, u1, u2] = std::array::from_fn(|i| unsafe { word8(base, i) });
    let (mask6, mask4, mask2) = (
        _mm256_set1_epi32(0x3f3f_3f3f),
        _mm256_set1_epi32(0x0f0f_0f0f),
        _mm256_set1_epi32(0x0303_0303),
    );
    // Bytes 0..4 of sc_lo are sub-blocks 0..4, of sc_hi 4..8 (and the same for the mins).
    let sc_lo = _mm256_and_si256(u0, mask6);
    let sc_hi = _mm256_or_si256(
        _mm256_and_si256(u2, mask4),
        _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u0), mask2)),
    );
    let m_lo = _mm256_and_si256(u1, mask6);
    let m_hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32::<4>(u2), mask4),
        _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u1), mask2)),
    );
    let scale: [__m256i; 8] = std::array::from_fn(|s| {
        let src = if s < 4 { sc_lo } else { sc_hi };
        _mm256_shuffle_epi8(src, bytes_to_i16(s % 4, false))
    });
    let mins: [__m256i; 4] = std::array::from_fn(|i| {
        let src = if i < 2 { m_lo } else { m_hi };
        _mm256_shuffle_epi8(src, bytes_to_i16(2 * (i % 2), true))
    });
    // d in the low half of each lane, dmin in the high half: packed to 8 x u16 each, then widened exactly.
    let halves = _mm256_packus_epi32(
        _mm256_and_si256(dd, _mm256_set1_epi32(0xFFFF)),
        _mm256_srli_epi32::<16>(dd),
    );
    let halves = _mm256_permute4x64_epi64::<0b11_01_10_00>(halves);
    let d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    let dmin = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves));
    (scale, mins, d, dmin)
}

/// One super-block of 8 weight rows of a Q4_K lanes tile (`tile`: the tile, plus 32 for its rows 8..16) against `R`
/// (1..=4) activation rows (`xs`, with their [`groups::bsum_pairs`], 4 words per super-block), super-block `b` of
/// theirs: per sub-block and activation row, 8 `maddubs` of 4 nibbles of the 8 rows by 4 activation bytes broadcast,
/// added as i16 (at most 8 x 2 x 15 x 127 = 30,480) and scaled by one `madd`; the super-block's `S` and `M` then go
/// into each row's float chains `acc` and `acc_m` as [`q4k_dot_scalar`]'s do.
///
/// # Safety
/// The tile's 36 words must be readable at `tile`; every row of `xs` must hold more than `b` super-blocks.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_super_block8<const R: usize, const IN_ORDER: bool>(
    tile: *const u8,
    b: usize,
    xs: &[(&[RawQ8K], &[i32]); R],
    acc: &mut [__m256; R],
    acc_m: &mut [__m256; R],
) {
    let m4 = _mm256_set1_epi8(0xF);
    // SAFETY: the tile's words are readable (the caller's bound).
    let (scale, mins, wd, wdmin) = unsafe { q4k_header8(tile) };
    let mut s = [_mm256_setzero_si256(); R];
    for j in 0..4 {
        let mut lo = [_mm256_setzero_si256(); R];
        let mut hi = [_mm256_setzero_si256(); R];
        for t in 0..8 {
            if IN_ORDER {
                // SAFETY: an empty block that touches nothing; as far as the compiler knows it may read and write
                // memory, so the loads of word t stay after those of word t - 1 (see `q4k_lanes8`).
                unsafe { std::arch::asm!("", options(nostack, preserves_flags)) };
            }
            // SAFETY: word 4 + 8j + t of the tile (36 words).
            let q = unsafe { word8(tile, 4 + 8 * j + t) };
            let (ql, qh) = (
                _mm256_and_si256(q, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
            );
            for r in 0..R {
                let a = xs[r].0[b].qs.as_ptr();
                // SAFETY: qs has 256 bytes; the words span 64j..64j + 64.
                let (al, ah) = unsafe {
                    (
                        _mm256_set1_epi32(a.add(64 * j + 4 * t).cast::<i32>().read_unaligned()),
                        _mm256_set1_epi32(
                            a.add(64 * j + 32 + 4 * t).cast::<i32>().read_unaligned(),
                        ),
                    )
                };
                lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ql, al));
                hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qh, ah));
            }
        }
        for r in 0..R {
            let p = _mm256_add_epi32(
                _mm256_madd_epi16(lo[r], scale[2 * j]),
                _mm256_madd_epi16(hi[r], scale[2 * j + 1]),
            );
            s[r] = _mm256_add_epi32(s[r], p);
        }
    }
    for r in 0..R {
        let (x, pairs) = (&xs[r].0[b], &xs[r].1[4 * b..4 * b + 4]);
        let mut mn = _mm256_setzero_si256();
        for (i, &pair) in pairs.iter().enumerate() {
            mn = _mm256_add_epi32(mn, _mm256_madd_epi16(mins[i], _mm256_set1_epi32(pair)));
        }
        let dx = _mm256_set1_ps(x.d);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, wd), _mm256_cvtepi32_ps(s[r]), acc[r]);
        acc_m[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, wdmin), _mm256_cvtepi32_ps(mn), acc_m[r]);
    }
}

/// [`q4k_lanes8`] for `R` (1..=4) activation rows (`xs`, with their [`groups::bsum_pairs`] in `pairs`, 4 words per
/// super-block) against 8 weight rows of a group (`base`: tile 0 of the group, plus 32 for its rows 8..16), one
/// [`q4k_super_block8`] after another; row `r`'s 8 results go to `out[r * stride..]`. With `IN_ORDER` each sub-block's
/// words are read first to last, whatever schedule the compiler would choose (see [`q4k_lanes8`]).
///
/// # Safety
/// The group's `kb` tiles must lie at `base - 32 * half` on; every row of `xs` must hold `kb` super-blocks; `out`
/// must hold 8 values at every `r * stride`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_rows8<const R: usize, const IN_ORDER: bool>(
    base: *const u8,
    kb: usize,
    xs: [(&[RawQ8K], &[i32]); R],
    next: Option<(*const u8, usize)>,
    out: &mut [f32],
    stride: usize,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm256_setzero_ps(); R];
    for b in 0..kb {
        let tile = base.wrapping_add(b * Q4K_TILE16);
        if let Some((next, first)) = next {
            let tile = next.wrapping_add(b * Q4K_TILE16);
            for line in first..first + Q4K_TILE16 / 128 {
                // A prefetch reads nothing and cannot fault; `wrapping_add` keeps the arithmetic defined.
                _mm_prefetch::<_MM_HINT_T0>(tile.wrapping_add(64 * line).cast());
            }
        }
        // SAFETY: the tile lies in the group (the caller's bounds).
        unsafe { q4k_super_block8::<R, IN_ORDER>(tile, b, &xs, &mut acc, &mut acc_m) };
    }
    for r in 0..R {
        // SAFETY: the caller's bound: 8 values at r * stride.
        unsafe {
            _mm256_storeu_ps(
                out[r * stride..][..8].as_mut_ptr(),
                _mm256_sub_ps(acc[r], acc_m[r]),
            )
        };
    }
}

/// `out[r * stride + c] = q4k_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` in the K-quants' lanes layout
/// (`quant::to_lanes`, whole groups of 16 rows of `kb` super-blocks) and every activation row `r`. One weight row per
/// 32-bit lane, 8 rows a vector (the first or second 32 bytes of each of the layout's 64-byte words): a sub-block's
/// 8 words take 8 `maddubs` added as i16 and one `madd` by the rows' scales, where the rows' tiles ([`q4k_tile`])
/// spend a `madd` per `maddubs` and reduce across lanes. The super-block integers `S` and `M` are exact and the float
/// chains are the definition's, one row per lane: the same bits. Activation rows go four at a time, the sums in
/// registers, over weights the first four brought into cache.
///
/// Chunks of two rows read each sub-block's words in order (an empty `asm!` block per word, which the compiler must
/// take for a memory access). Left to itself the compiler schedules the two-row instance unlike the others (each
/// sub-block's words loaded last to first, their unpacked nibbles spilled to the stack), which makes two activation
/// rows cost more than three; the other instances keep the compiler's schedule, which is as fast as the order.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must be whole groups of 16 rows of `kb` super-blocks in the lanes
/// layout; `xs` rows must hold at least `kb` super-blocks; `out` must hold `w.len() / kb` values at every
/// `r * stride`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4k_lanes8(
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    let groups = w.len() / kb / 16;
    debug_assert_eq!(groups * 16 * kb, w.len());
    let xs: Vec<&[RawQ8K]> = xs.iter().map(|x| raw_q8k(x)).collect();
    let pairs = groups::bsum_pairs(&xs, kb);
    let rows: Vec<(&[RawQ8K], &[i32])> = xs
        .iter()
        .enumerate()
        .map(|(r, x)| (*x, &pairs[r * kb * 4..(r + 1) * kb * 4]))
        .collect();
    let wp = w.as_ptr().cast::<u8>();
    for g in 0..groups {
        let next = wp.wrapping_add((g + 1) * kb * Q4K_TILE16);
        for half in 0..2 {
            let base = wp.wrapping_add(g * kb * Q4K_TILE16 + 32 * half);
            for (c, chunk) in rows.chunks(4).enumerate() {
                // The first chunk of rows prefetches the next group's tiles, half of each tile's lines per half of
                // the group, so that memory streams while both halves compute (the second reads the group's tiles
                // from cache).
                let prefetch = (c == 0).then_some((next, half * Q4K_TILE16 / 128));
                let dst = &mut out[4 * c * stride + 16 * g + 8 * half..];
                // SAFETY (all): the group's tiles lie in `w` and the rows hold kb super-blocks (the caller's bounds);
                // `dst` holds 8 values at every r * stride of the chunk.
                unsafe {
                    match *chunk {
                        [r0] => q4k_rows8::<1, false>(base, kb, [r0], prefetch, dst, stride),
                        [r0, r1] => q4k_rows8::<2, true>(base, kb, [r0, r1], prefetch, dst, stride),
                        [r0, r1, r2] => {
                            q4k_rows8::<3, false>(base, kb, [r0, r1, r2], prefetch, dst, stride)
                        }
                        [r0, r1, r2, r3] => {
                            q4k_rows8::<4, false>(base, kb, [r0, r1, r2, r3], prefetch, dst, stride)
                        }
                        _ => unreachable!("chunks of 1..=4 rows"),
                    }
                }
            }
        }
    }
}
