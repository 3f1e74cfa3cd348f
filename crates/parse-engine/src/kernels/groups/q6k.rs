//! The Q6_K row groups: 16 weight rows of Q6_K in the lanes of a vector, in rows or in the lanes layout.

use std::arch::x86_64::*;

use super::*;

/// Byte offsets inside a Q6_K super-block (ggml's `block_q6_K`): low nibbles, high bits, group scales, `d`.
pub(super) const Q6K_QH: usize = 128;
pub(super) const Q6K_SCALES: usize = 192;
pub(super) const Q6K_D: usize = 208;

/// Bytes of a tile of 16 rows' super-block `b` in the lanes layout (`quant::to_lanes`: 52 words of the 16 rows,
/// then their 16 `d`s one after the other, at `16 * Q6K_D`).
pub(super) const Q6K_TILE: usize = 16 * std::mem::size_of::<RawQ6K>();

/// `out[r * stride + c] = q6k_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` (a multiple of 16 rows of `kb`
/// super-blocks) and every activation row `r`. Per 16-value group `g` the unsigned 6-bit values `u` (the weight is
/// `u - 32`) give `P_g = sum u x` through `vpdpbusd`; `S = sum_g sc_g P_g - 32 sum_g sc_g bsums_g`, the second sum by
/// `vpdpwssd` over pairs of groups (the activations' Q8_K group sums are stored as pairs of i16 already).
///
/// # Safety
/// As [`q4k_groups`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q6k_groups(
    w: &[BlockQ6K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q6k_16::<false>(w, kb, xs, out, stride) }
}

/// [`q6k_groups`] over weights in the lanes layout (`quant::to_lanes`): the 16 rows' words and `d`s come from plain
/// vector loads instead of being gathered and transposed from 16 rows at every step.
///
/// # Safety
/// As [`q4k_groups`], with `w` in the lanes layout (a multiple of 16 rows of `kb` super-blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q6k_lanes(
    w: &[BlockQ6K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q6k_16::<true>(w, kb, xs, out, stride) }
}

/// Words `off / 4..off / 4 + 4` of the 16 rows' super-block at `base` (`off` a multiple of 16), in the lanes layout
/// (a tile, its runs of four words in the order this kernel reads them: `quant::Q6K_RUN_SLOTS`) or in rows.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn q6k_words<const LANES: bool>(
    base: *const u8,
    row_bytes: usize,
    off: usize,
) -> [__m512i; 4] {
    debug_assert!(off.is_multiple_of(16));
    // SAFETY: the caller guarantees a whole tile at `base` (lanes) or 16 rows' super-blocks from it.
    unsafe {
        if LANES {
            tile_words4(base, 16 * crate::layout::Q6K_RUN_SLOTS[off / 16])
        } else {
            words4(base, row_bytes, off)
        }
    }
}

/// The unsigned 6-bit values of part `P` (0..4) of words `a` (ql at 64n + 4t), `bq` (ql at 64n + 32 + 4t) and `hb`
/// (qh at 32n + 4t): the low 4 bits from `a` (parts 0, 2: its low and high nibbles) or `bq` (parts 1, 3), bits 4
/// and 5 from bits `2P, 2P + 1` of each `hb` byte. Shifts cross bytes only into bits the masks clear.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn q6k_part<const P: usize>(a: __m512i, bq: __m512i, hb: __m512i) -> __m512i {
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let (src, high) = match P {
        0 => (a, _mm512_slli_epi32::<4>(hb)),
        1 => (bq, _mm512_slli_epi32::<2>(hb)),
        2 => (_mm512_srli_epi32::<4>(a), hb),
        _ => (_mm512_srli_epi32::<4>(bq), _mm512_srli_epi32::<2>(hb)),
    };
    // (src & 0x0F) | (high & 0x30), byte by byte.
    _mm512_ternarylogic_epi32::<0xEA>(src, m4, _mm512_and_si512(high, m30))
}

/// The Q6_K row-group kernel over either layout: each 16-row group against the activation rows 8 at a time
/// ([`q6k_group`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k_16<const LANES: bool>(
    w: &[BlockQ6K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    let w = raw_q6k(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let xs: Vec<&[RawQ8K]> = xs.iter().map(|x| raw_q8k(x)).collect();
    let groups = cols / 16;
    let ahead = prefetched(groups);
    for g in 0..groups {
        for r0 in (0..xs.len()).step_by(8) {
            let rows = &xs[r0..xs.len().min(r0 + 8)];
            // The next group's weights are prefetched once, while the first rows take this one's.
            let fetch = g < ahead && r0 == 0;
            let dst = &mut out[r0 * stride + 16 * g..];
            // SAFETY: the caller's guarantees; `rows` has 1..=8 rows of at least kb blocks, and `dst` holds 16
            // values at every r * stride of them.
            unsafe {
                match rows.len() {
                    1 => q6k_group::<LANES, 1>(w, kb, g, rows, fetch, dst, stride),
                    2 => q6k_group::<LANES, 2>(w, kb, g, rows, fetch, dst, stride),
                    3 => q6k_group::<LANES, 3>(w, kb, g, rows, fetch, dst, stride),
                    4 => q6k_group::<LANES, 4>(w, kb, g, rows, fetch, dst, stride),
                    5 => q6k_group::<LANES, 5>(w, kb, g, rows, fetch, dst, stride),
                    6 => q6k_group::<LANES, 6>(w, kb, g, rows, fetch, dst, stride),
                    7 => q6k_group::<LANES, 7>(w, kb, g, rows, fetch, dst, stride),
                    _ => q6k_group::<LANES, 8>(w, kb, g, rows, fetch, dst, stride),
                }
            }
        }
    }
}

/// Group `g` (weight rows `16g..16g + 16`) of [`q6k_16`] against `R` activation rows, their sums in registers. Per
/// word run (half `n`, words `4h..4h + 4`) each part's weights are unpacked once and taken by every row at once, so
/// few vectors are live at a time. The integer sums are exact, so their grouping leaves the bits as they are.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
// `b` numbers the weights' super-blocks and every activation row's alike.
#[allow(clippy::needless_range_loop)]
pub(super) unsafe fn q6k_group<const LANES: bool, const R: usize>(
    w: &[RawQ6K],
    kb: usize,
    g: usize,
    xs: &[&[RawQ8K]],
    fetch: bool,
    out: &mut [f32],
    stride: usize,
) {
    let row_bytes = kb * std::mem::size_of::<RawQ6K>();
    let wp = w.as_ptr().cast::<u8>();
    let lo16 = _mm512_set1_epi32(0xFFFF);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..kb {
        let first = g * 16 * kb + b;
        let base = if LANES {
            wp.wrapping_add((g * kb + b) * Q6K_TILE)
        } else {
            (&w[first] as *const RawQ6K).cast::<u8>()
        };
        let wd = if LANES {
            // SAFETY: the tile's last 32 bytes are the 16 rows' d.
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(base.add(16 * Q6K_D).cast()) })
        } else {
            let d: [u16; 16] = std::array::from_fn(|n| w[first + n * kb].d);
            // SAFETY: 16 u16 make the 256 bits loaded.
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(d.as_ptr().cast()) })
        };
        let q8: [*const i8; R] = std::array::from_fn(|r| xs[r][b].qs.as_ptr());
        // SAFETY (every `q6k_words` below): lane n reads row g * 16 + n's super-block b, inside `w` by the caller's
        // bounds (whole 16-row groups of kb blocks; in the lanes layout tile (g, b) is those same 16 blocks'
        // bytes), at offsets inside the block.
        let sc_words = unsafe { q6k_words::<LANES>(base, row_bytes, Q6K_SCALES) };
        // Group scale `i` (i8, sign-extended) of every row.
        let sc = |i: usize| {
            _mm512_srai_epi32::<24>(_mm512_sllv_epi32(
                sc_words[i / 4],
                _mm512_set1_epi32(24 - 8 * (i % 4) as i32),
            ))
        };
        let mut s = [_mm512_setzero_si512(); R];
        for n in 0..2 {
            for h in 0..2 {
                if fetch {
                    let (next, bytes) = next_group(wp, row_bytes, g);
                    prefetch_share(next, bytes, 4 * b + 2 * n + h, 4 * kb);
                }
                // Words t = 4h..4h + 4 of half n: `ql` at 64n + 4t (A, parts 0 and 2) and 64n + 32 + 4t (B, parts
                // 1 and 3), `qh` at 32n + 4t (2 bits per part); part p of word t holds values 128n + 32p + 4t..+4,
                // of group 8n + 2p + h.
                let (a, bq, hb) = unsafe {
                    (
                        q6k_words::<LANES>(base, row_bytes, 64 * n + 16 * h),
                        q6k_words::<LANES>(base, row_bytes, 64 * n + 32 + 16 * h),
                        q6k_words::<LANES>(base, row_bytes, Q6K_QH + 32 * n + 16 * h),
                    )
                };
                for p in 0..4 {
                    let u: [__m512i; 4] = std::array::from_fn(|k| match p {
                        0 => q6k_part::<0>(a[k], bq[k], hb[k]),
                        1 => q6k_part::<1>(a[k], bq[k], hb[k]),
                        2 => q6k_part::<2>(a[k], bq[k], hb[k]),
                        _ => q6k_part::<3>(a[k], bq[k], hb[k]),
                    });
                    let scale = sc(8 * n + 2 * p + h);
                    let at = 128 * n + 32 * p + 16 * h;
                    for r in 0..R {
                        let mut pg = _mm512_setzero_si512();
                        for (k, uk) in u.iter().enumerate() {
                            // SAFETY: qs has 256 bytes; the word spans at + 4k..+4 < 256.
                            pg = _mm512_dpbusd_epi32(pg, *uk, unsafe {
                                bcast(q8[r].add(at + 4 * k))
                            });
                        }
                        s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(pg, scale));
                    }
                }
            }
        }
        // Scales of groups 2i and 2i + 1 as a pair of i16, for `vpdpwssd` with the group sums.
        let pairs: [__m512i; 8] = std::array::from_fn(|i| {
            _mm512_or_si512(
                _mm512_and_si512(sc(2 * i), lo16),
                _mm512_slli_epi32::<16>(sc(2 * i + 1)),
            )
        });
        for r in 0..R {
            let xb = &xs[r][b];
            let bs = xb.bsums.as_ptr();
            let mut o = _mm512_setzero_si512();
            for (i, pair) in pairs.iter().enumerate() {
                // SAFETY: bsums has 16 i16; the pair spans 2i..2i + 2.
                let sums = unsafe { bs.add(2 * i).cast::<i32>().read_unaligned() };
                o = _mm512_dpwssd_epi32(o, *pair, _mm512_set1_epi32(sums));
            }
            let si = _mm512_sub_epi32(s[r], _mm512_slli_epi32::<5>(o));
            let d = _mm512_mul_ps(_mm512_set1_ps(xb.d), wd);
            acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(si), acc[r]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: out holds row r's 16 values at r * stride (the caller's layout).
        unsafe { _mm512_storeu_ps(out[r * stride..][..16].as_mut_ptr(), *a) };
    }
}
