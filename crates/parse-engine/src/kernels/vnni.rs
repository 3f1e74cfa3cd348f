//! AVX-512 VNNI variants: `vpdpbusd` sums 64 byte products into 16 lanes per instruction. Each computes the
//! arithmetic of the matching `*_dot_scalar` definition in `super`, bit for bit: the integer lane sums are exact
//! however they are grouped, and the float steps are those of the AVX2 variants.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx2::{
    first_lanes, fma_rows, hsum_i32, q4k_min_term, q4k_mins_paired, row_scales, sum_rows8,
};
use super::*;

/// Sub-block pairs whose scales the 16 lanes of the Q4_K products carry (lanes 0..8, lanes 8..16).
const SCALE_PAIRS: [(i32, i32); 4] = [(0, 2), (1, 3), (4, 6), (5, 7)];

/// `R` activation rows against one Q4_K weight row. 64 bytes of weights (two chunks) give a vector of low nibbles
/// and one of high nibbles; the activations are regrouped by lane shuffles to line up with them; `dpbusd` gives the
/// 4-byte sums and `dpwssd` multiplies them by their sub-block's scale (low 16 bits) and accumulates. The 16 lanes
/// are summed into the super-block's exact integer `S` of [`q4k_dot_scalar`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q4k_tile<const R: usize>(w: &[BlockQ4K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q4k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let m4 = _mm512_set1_epi8(0xF);
    let zero = _mm512_setzero_si512();
    let mut acc = [0f32; R];
    let mut acc_m = [0f32; R];
    for (b, wb) in w.iter().enumerate() {
        let (sc, m) = scales_mins(&wb.scales);
        let mins = _mm_cvtepu8_epi16(_mm_set_epi64x(0, i64::from_le_bytes(m)));
        let wd = f16::from_bits(wb.d).to_f32();
        let wdmin = f16::from_bits(wb.dmin).to_f32();
        // Scales as i32 lanes, arranged like the products below: (h, low nibbles) covers sub-blocks 4h and
        // 4h + 2, (h, high nibbles) 4h + 1 and 4h + 3, 8 lanes each.
        let base = _mm512_cvtepu8_epi32(_mm_set_epi64x(0, i64::from_le_bytes(sc)));
        let sv: [__m512i; 4] = std::array::from_fn(|i| {
            let (lo, hi) = (SCALE_PAIRS[i].0, SCALE_PAIRS[i].1);
            _mm512_permutexvar_epi32(
                _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1),
                base,
            )
        });
        let mut sumi = [zero; R];
        for h in 0..2 {
            // Chunks 2h and 2h + 1 at once: their low nibbles pair with values 128h..+32 and 128h+64..+96, their
            // high nibbles with 128h+32..+64 and 128h+96..+128.
            // SAFETY: qs has 128 bytes; the load spans 64h..64h+64.
            let z = unsafe { _mm512_loadu_si512(wb.qs.as_ptr().add(64 * h).cast()) };
            let lo = _mm512_and_si512(z, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            for r in 0..R {
                let q8 = xs[r][b].qs.as_ptr();
                // SAFETY: qs has 256 bytes; the loads span 128h..128h+128.
                let (x0, x1) = unsafe {
                    (
                        _mm512_loadu_si512(q8.add(128 * h).cast()),
                        _mm512_loadu_si512(q8.add(128 * h + 64).cast()),
                    )
                };
                let xa = _mm512_shuffle_i64x2::<0x44>(x0, x1);
                let xb = _mm512_shuffle_i64x2::<0xEE>(x0, x1);
                sumi[r] =
                    _mm512_dpwssd_epi32(sumi[r], _mm512_dpbusd_epi32(zero, lo, xa), sv[2 * h]);
                sumi[r] =
                    _mm512_dpwssd_epi32(sumi[r], _mm512_dpbusd_epi32(zero, hi, xb), sv[2 * h + 1]);
            }
        }
        for r in 0..R {
            let xb = &xs[r][b];
            let s = _mm512_reduce_add_epi32(sumi[r]);
            acc[r] = (xb.d * wd).mul_add(s as f32, acc[r]);
            acc_m[r] = (xb.d * wdmin).mul_add(q4k_min_term(mins, &xb.bsums) as f32, acc_m[r]);
        }
    }
    std::array::from_fn(|r| acc[r] - acc_m[r])
}

/// The 16 lanes of `v` folded into 8 (exact integer adds).
#[target_feature(enable = "avx512f")]
#[inline]
fn fold512(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// `R` (2..=8) activation rows against one Q4_K weight row. The weights are unpacked once per super-block into
/// the activations' own order (chunk `j`'s low nibbles in the lower 256 bits, its high nibbles in the upper, which
/// is values `64j..64j + 64`), so each row's activations are read as stored, with no shuffle; `maddubs` gives exact
/// pair sums (at most 2 x 15 x 128 in magnitude, so no saturation) and `dpwssd` multiplies them by their
/// sub-block's scale and accumulates. The rows' integer sums `S` and min terms `M` are reduced together
/// ([`sum_rows8`]) and the two float chains run with one row per lane: every lane computes
/// `fma(d_x * d_w, S, acc)` and `fma(d_x * dmin_w, M, acc_m)` as the definition does, so the bits are those of
/// [`q4k_dot_scalar`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q4k_tile_rows<const R: usize>(w: &[BlockQ4K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q4k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let m4 = _mm512_set1_epi8(0xF);
    // 16-bit shifts: 0 in the lower 256 bits (low nibbles), 4 in the upper (high nibbles).
    let nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    for (b, wb) in w.iter().enumerate() {
        let (sc, m) = scales_mins(&wb.scales);
        let mins = q4k_mins_paired(&m);
        let q: [__m512i; 4] = std::array::from_fn(|j| {
            // SAFETY: qs has 128 bytes; chunk j spans 32j..32j+32.
            let bytes = unsafe { _mm256_loadu_si256(wb.qs.as_ptr().add(32 * j).cast()) };
            _mm512_and_si512(
                _mm512_srlv_epi16(_mm512_broadcast_i64x4(bytes), nibble_shift),
                m4,
            )
        });
        let scale: [__m512i; 4] = std::array::from_fn(|j| {
            _mm512_inserti64x4(
                _mm512_set1_epi16(sc[2 * j] as i16),
                _mm256_set1_epi16(sc[2 * j + 1] as i16),
                1,
            )
        });
        let s = sum_rows8(std::array::from_fn(|r| {
            if r >= R {
                return _mm256_setzero_si256();
            }
            let q8 = xs[r][b].qs.as_ptr();
            let mut sumi = _mm512_setzero_si512();
            for j in 0..4 {
                // SAFETY: qs has 256 bytes; the load spans 64j..64j+64.
                let a = unsafe { _mm512_loadu_si512(q8.add(64 * j).cast()) };
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[j], a), scale[j]);
            }
            fold512(sumi)
        }));
        let mt = sum_rows8(std::array::from_fn(|r| {
            if r >= R {
                return _mm256_setzero_si256();
            }
            // SAFETY: bsums has 16 i16 (32 bytes).
            let bs = unsafe { _mm256_loadu_si256(xs[r][b].bsums.as_ptr().cast()) };
            _mm256_madd_epi16(bs, mins)
        }));
        let dx = row_scales(&xs, b);
        acc = fma_rows(acc, dx, f16::from_bits(wb.d).to_f32(), s);
        acc_m = fma_rows(acc_m, dx, f16::from_bits(wb.dmin).to_f32(), mt);
    }
    first_lanes(_mm256_sub_ps(acc, acc_m))
}

/// The unsigned 6-bit values of half `n` of a Q6_K super-block as two vectors of 64 (values 128n..+64 and
/// 128n+64..+128), and the sub-block scale of every 4-value lane of each (low 16 bits of the lane).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
fn q6k_unpack(
    wb: &RawQ6K,
    n: usize,
    sc_bytes: __m128i,
    (m4, m2, lo16): (__m512i, __m512i, __m512i),
    (shift01, shift23): (__m512i, __m512i),
) -> ([__m512i; 2], [__m512i; 2]) {
    // SAFETY: ql has 128 bytes and qh 64; the loads span 64n..64n+64 and 32n..32n+32.
    let (ql, qh) = unsafe {
        (
            _mm512_loadu_si512(wb.ql.as_ptr().add(64 * n).cast()),
            _mm512_broadcast_i64x4(_mm256_loadu_si256(wb.qh.as_ptr().add(32 * n).cast())),
        )
    };
    let high =
        |shift: __m512i| _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), m2), 4);
    let q = [
        _mm512_or_si512(_mm512_and_si512(ql, m4), high(shift01)),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
            high(shift23),
        ),
    ];
    // Lane i of part p covers 4 values of group 8n + 4p + i/4: its scale, in the low 16 bits.
    let scale: [__m512i; 2] = std::array::from_fn(|p| {
        let g = (8 * n + 4 * p) as i8;
        let idx = _mm_set_epi8(
            g + 3,
            g + 3,
            g + 3,
            g + 3,
            g + 2,
            g + 2,
            g + 2,
            g + 2,
            g + 1,
            g + 1,
            g + 1,
            g + 1,
            g,
            g,
            g,
            g,
        );
        _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(sc_bytes, idx)), lo16)
    });
    (q, scale)
}

/// Each row's 16 lanes of scaled products with one Q6_K super-block (block `b` of the rows; the offset of 32 is
/// not yet taken off): lane sums are exact integers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
fn q6k_sums<const R: usize>(
    wb: &RawQ6K,
    xs: &[&[RawQ8K]; R],
    b: usize,
    sc_bytes: __m128i,
) -> [__m512i; R] {
    let m4 = _mm512_set1_epi8(0xF);
    let m2 = _mm512_set1_epi8(3);
    let zero = _mm512_setzero_si512();
    let lo16 = _mm512_set1_epi32(0xFFFF);
    // Per-half shifts of the high-bit bytes: (0, 2) for values 0..64 of a 128-value segment, (4, 6) for 64..128.
    let shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    let shift23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    let mut sumi = [zero; R];
    for n in 0..2 {
        let (q, scale) = q6k_unpack(wb, n, sc_bytes, (m4, m2, lo16), (shift01, shift23));
        for r in 0..R {
            let q8 = xs[r][b].qs.as_ptr();
            for p in 0..2 {
                // SAFETY: qs has 256 bytes; the load spans 128n + 64p .. +64.
                let a = unsafe { _mm512_loadu_si512(q8.add(128 * n + 64 * p).cast()) };
                sumi[r] =
                    _mm512_dpwssd_epi32(sumi[r], _mm512_dpbusd_epi32(zero, q[p], a), scale[p]);
            }
        }
    }
    sumi
}

/// `R` activation rows against one Q6_K weight row; each super-block's integer sum is exact.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q6k_tile<const R: usize>(w: &[BlockQ6K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q6k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let mut acc = [0f32; R];
    for (b, wb) in w.iter().enumerate() {
        // SAFETY: scales has 16 bytes.
        let sc_bytes = unsafe { _mm_loadu_si128(wb.scales.as_ptr().cast()) };
        let sc16 = _mm256_cvtepi8_epi16(sc_bytes);
        let sumi = q6k_sums(wb, &xs, b, sc_bytes);
        let wd = f16::from_bits(wb.d).to_f32();
        for r in 0..R {
            let xb = &xs[r][b];
            // SAFETY: bsums has 16 i16 (32 bytes).
            let bs = unsafe { _mm256_loadu_si256(xb.bsums.as_ptr().cast()) };
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            let s = _mm512_reduce_add_epi32(sumi[r]).wrapping_sub(hsum_i32(offset));
            acc[r] = (xb.d * wd).mul_add(s as f32, acc[r]);
        }
    }
    acc
}

/// `R` (2..=8) activation rows against one Q6_K weight row: the products as in [`q6k_tile`], the rows' integer sums
/// reduced together ([`sum_rows8`]) and the float chain run with one row per lane, bit for bit
/// [`q6k_dot_scalar`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q6k_tile_rows<const R: usize>(w: &[BlockQ6K], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
    let w = raw_q6k(w);
    let xs: [&[RawQ8K]; R] = std::array::from_fn(|r| raw_q8k(xs[r]));
    let mut acc = _mm256_setzero_ps();
    for (b, wb) in w.iter().enumerate() {
        // SAFETY: scales has 16 bytes.
        let sc_bytes = unsafe { _mm_loadu_si128(wb.scales.as_ptr().cast()) };
        let sc16 = _mm256_cvtepi8_epi16(sc_bytes);
        let sumi = q6k_sums(wb, &xs, b, sc_bytes);
        let s = sum_rows8(std::array::from_fn(|r| {
            if r < R {
                // SAFETY: bsums has 16 i16 (32 bytes).
                let bs = unsafe { _mm256_loadu_si256(xs[r][b].bsums.as_ptr().cast()) };
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
                _mm256_sub_epi32(fold512(sumi[r]), offset)
            } else {
                _mm256_setzero_si256()
            }
        }));
        acc = fma_rows(acc, row_scales(&xs, b), f16::from_bits(wb.d).to_f32(), s);
    }
    first_lanes(acc)
}

/// The 64 activations of blocks `b` and `b + 1` of a row (only block `b`'s 32, zero-padded, when `pair` is false).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn act64(x: &Act32Row<'_>, b: usize, pair: bool) -> __m512i {
    let p = x.qs[32 * b..].as_ptr();
    if pair {
        // SAFETY: blocks b and b + 1 exist: 64 values from 32b.
        unsafe { _mm512_loadu_si512(p.cast()) }
    } else {
        // SAFETY: block b exists: 32 values from 32b.
        _mm512_castsi256_si512(unsafe { _mm256_loadu_si256(p.cast()) })
    }
}

/// The unsigned 5-bit values (`weight + 16`) of Q5_0 blocks `b` and `b + 1` (block `b` alone when `pair` is false).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
fn q5_0_unsigned(w: &[RawQ5_0], b: usize, pair: bool) -> __m512i {
    let m4 = _mm_set1_epi8(0xF);
    let nibbles = |blk: &RawQ5_0| {
        // SAFETY: qs has 16 bytes.
        let qs = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(qs, 4), m4),
            _mm_and_si128(qs, m4),
        )
    };
    let lo = _mm512_castsi256_si512(nibbles(&w[b]));
    let mut bits = u32::from_le_bytes(w[b].qh) as u64;
    let v = if pair {
        bits |= (u32::from_le_bytes(w[b + 1].qh) as u64) << 32;
        _mm512_inserti64x4(lo, nibbles(&w[b + 1]), 1)
    } else {
        lo
    };
    _mm512_or_si512(v, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)))
}

/// The 8 block sums of four vectors of lane sums (`v[i]`: block `2i` in lanes 0..8, block `2i + 1` in 8..16), block
/// `j` in lane `j`: pairs of 128-bit lanes transposed and added (integers, so the grouping changes nothing).
#[target_feature(enable = "avx512f,avx512vl")]
#[inline]
fn block_sums8(v: [__m512i; 4]) -> __m256i {
    let t0 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let t1 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // 128-bit lane L of u: the sums of lane L of v[0], v[1], v[2], v[3].
    let u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    // Lanes 0 and 1 of each v are its even block, 2 and 3 its odd one: [b0 b2 b4 b6 b1 b3 b5 b7].
    let w = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b00_00_10_00>(u, u),
        _mm512_shuffle_i64x2::<0b00_00_11_01>(u, u),
    );
    _mm256_permutevar8x32_epi32(
        _mm512_castsi512_si256(w),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    )
}

/// The 64 weights of Q8_0 blocks `b` and `b + 1` (block `b` alone, zeros above, when `pair` is false).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
fn q8_0_pair(w: &[RawQ8_0], b: usize, pair: bool) -> __m512i {
    // SAFETY: qs has 32 bytes.
    let w0 = _mm512_castsi256_si512(unsafe { _mm256_loadu_si256(w[b].qs.as_ptr().cast()) });
    if pair {
        // SAFETY: as above, for block b + 1.
        _mm512_inserti64x4(
            w0,
            unsafe { _mm256_loadu_si256(w[b + 1].qs.as_ptr().cast()) },
            1,
        )
    } else {
        w0
    }
}

/// `R` activation rows against one Q8_0 weight row, 8 blocks per step: `dpbusd(x + 128, w)` starting from
/// `-128 * lane sum of w` gives two blocks' 16 exact lane sums, [`block_sums8`] the 8 blocks' integers of
/// [`q8_0_dot_scalar`], one lane per block. Past the row's last block the lanes hold `fma(0, 0, acc)` (see the Q5_0
/// tile).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn q8_0_tile<const R: usize>(w: &[BlockQ8_0], xs: &[Act32Row<'_>; R]) -> [f32; R] {
    let w = raw_q8_0(w);
    let x80 = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm256_setzero_ps(); R];
    for b0 in (0..w.len()).step_by(8) {
        let n = (w.len() - b0).min(8);
        let (mut q, mut neg) = ([zero; 4], [zero; 4]);
        for p in 0..4 {
            if 2 * p < n {
                q[p] = q8_0_pair(w, b0 + 2 * p, 2 * p + 1 < n);
                neg[p] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, x80, q[p]));
            }
        }
        let wd = scales8(w, b0, n);
        let first = u8::MAX >> (8 - n);
        for r in 0..R {
            let x = &xs[r];
            let mut v = [zero; 4];
            for i in 0..4 {
                if 2 * i < n {
                    let a = _mm512_xor_si512(act64(x, b0 + 2 * i, 2 * i + 1 < n), x80);
                    v[i] = _mm512_dpbusd_epi32(neg[i], a, q[i]);
                }
            }
            // SAFETY: blocks b0..b0 + n of the row exist; the masked load reads no lane past them.
            let xd = unsafe { _mm256_maskz_loadu_ps(first, x.d[b0..].as_ptr()) };
            acc[r] = _mm256_fmadd_ps(
                _mm256_mul_ps(wd, xd),
                _mm256_cvtepi32_ps(block_sums8(v)),
                acc[r],
            );
        }
    }
    lanes_out(acc)
}

/// `R` activation rows against one Q5_0 weight row, 8 blocks per step: `dpbusd(q + 16, x)` of two blocks gives
/// their 16 lane sums, [`block_sums8`] the 8 blocks' sums, and the activations' `off5`
/// (`-16 * sum of x`) the exact block integers of [`q5_0_dot_scalar`], one lane per block. Past the row's last block
/// the lanes hold `fma(0, 0, acc)`, which leaves `acc` as it is (it never holds -0: it starts at +0, and a sum that
/// comes to zero rounds to +0).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
#[inline]
unsafe fn q5_0_tile<const R: usize>(w: &[BlockQ5_0], xs: &[Act32Row<'_>; R]) -> [f32; R] {
    let w = raw_q5_0(w);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm256_setzero_ps(); R];
    for b0 in (0..w.len()).step_by(8) {
        let n = (w.len() - b0).min(8);
        // Loops, not `array::from_fn`: a closure is a function of its own, called where it cannot be inlined into
        // `from_fn`, which lacks this function's target features.
        let mut q = [zero; 4];
        for (p, qp) in q.iter_mut().enumerate() {
            if 2 * p < n {
                *qp = q5_0_unsigned(w, b0 + 2 * p, 2 * p + 1 < n);
            }
        }
        let wd = scales8(w, b0, n);
        let first = u8::MAX >> (8 - n);
        for r in 0..R {
            let x = &xs[r];
            let mut v = [zero; 4];
            for (i, (vi, qi)) in v.iter_mut().zip(&q).enumerate() {
                if 2 * i < n {
                    *vi = _mm512_dpbusd_epi32(zero, *qi, act64(x, b0 + 2 * i, 2 * i + 1 < n));
                }
            }
            // SAFETY: blocks b0..b0 + n of the row exist; the masked loads read no lane past them.
            let (off, xd) = unsafe {
                (
                    _mm256_maskz_loadu_epi32(first, x.off5[b0..].as_ptr().cast()),
                    _mm256_maskz_loadu_ps(first, x.d[b0..].as_ptr()),
                )
            };
            let s = _mm256_add_epi32(block_sums8(v), off);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(wd, xd), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    lanes_out(acc)
}

/// Quantizes rows of 256-value blocks to Q8_K exactly as candle's `BlockQ8K::from_float` does (the value of largest
/// magnitude, first one on ties, maps to -127; `round` half away from zero; clamp to -128..=127; 16-value sums;
/// `d = 1 / iscale`), 16 values per instruction.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(super) fn quantize_q8k_avx512(xs: &[f32], ys: &mut [BlockQ8K]) {
    // SAFETY: RawQ8K has BlockQ8K's layout (asserted in super); the slice covers the same blocks.
    let ys = unsafe { std::slice::from_raw_parts_mut(ys.as_mut_ptr().cast::<RawQ8K>(), ys.len()) };
    let sign = _mm512_set1_ps(-0.0);
    let one = _mm512_set1_ps(1.0);
    let half = _mm512_set1_ps(0.5);
    for (x, y) in xs.chunks_exact(QK_K).zip(ys.iter_mut()) {
        // SAFETY: x has 256 values: 16 loads of 16.
        let v: [__m512; 16] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(x.as_ptr().add(16 * i)) });
        let mut m = _mm512_setzero_ps();
        for vi in &v {
            m = _mm512_max_ps(m, _mm512_andnot_ps(sign, *vi));
        }
        let amax = _mm512_reduce_max_ps(m);
        if amax == 0.0 {
            y.d = 0.0;
            y.qs.fill(0);
            y.bsums.fill(0);
            continue;
        }
        // The first value whose magnitude is amax.
        let at = v
            .iter()
            .enumerate()
            .find_map(|(i, vi)| {
                let k = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(
                    _mm512_andnot_ps(sign, *vi),
                    _mm512_set1_ps(amax),
                );
                (k != 0).then(|| 16 * i + k.trailing_zeros() as usize)
            })
            .unwrap_or(0);
        let iscale = -127f32 / x[at];
        let sc = _mm512_set1_ps(iscale);
        for (i, vi) in v.iter().enumerate() {
            let p = _mm512_mul_ps(sc, *vi);
            // Round half away from zero: truncate, then step away from zero where the dropped part is >= 0.5.
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
            let frac = _mm512_andnot_ps(sign, _mm512_sub_ps(p, t));
            let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
            let step = _mm512_or_ps(_mm512_and_ps(p, sign), one);
            let r = _mm512_mask_add_ps(t, away, t, step);
            let r = _mm512_min_ps(
                _mm512_max_ps(r, _mm512_set1_ps(-128.0)),
                _mm512_set1_ps(127.0),
            );
            let q = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r));
            // SAFETY: qs has 256 bytes; the store spans 16i..16i+16.
            unsafe { _mm_storeu_si128(y.qs.as_mut_ptr().add(16 * i).cast(), q) };
            y.bsums[i] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q)) as i16;
        }
        y.d = 1.0 / iscale;
    }
}

tile_any_fn!(
    q4k_tile_any,
    q4k_tile,
    q4k_tile_rows,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
    BlockQ4K
);
tile_any_fn!(
    q6k_tile_any,
    q6k_tile,
    q6k_tile_rows,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
    BlockQ6K
);

panel_fn!(
    q4k_panel,
    q4k_tile_any,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma",
    BlockQ4K,
    &[BlockQ8K]
);
panel_fn!(
    q6k_panel,
    q6k_tile_any,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma",
    BlockQ6K,
    &[BlockQ8K]
);
panel_fn!(
    q8_0_panel,
    q8_0_tile,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma",
    BlockQ8_0,
    Act32Row<'_>
);
panel_fn!(
    q5_0_panel,
    q5_0_tile,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma",
    BlockQ5_0,
    Act32Row<'_>
);
