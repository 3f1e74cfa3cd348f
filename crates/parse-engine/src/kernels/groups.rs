//! AVX-512 VNNI block kernels for Q4_K and Q6_K weights: 16 weight rows at once, one weight row per 32-bit lane,
//! against every activation row of the block.
//!
//! The panels of the `vnni` variant compute one weight row against up to 8 activation rows: per 64 products and row
//! they spend a multiply of pairs and a scaled accumulate, then reduce the lanes of every row, so a block of rows costs
//! about a third of a one-token step per row on a CPU without AMX. Here the 16 lanes of a vector are 16 weight rows:
//! four consecutive weights of each row go to one 32-bit lane (16-byte runs of the 16 rows loaded and transposed 4 x 4
//! words at a time), so one `vpdpbusd` with four activation bytes broadcast to every lane accumulates 4 products for
//! each of the 16 rows, and a sub-block's scale is one `vpmulld` by the 16 rows' scales. The weights of a super-block
//! are transposed and unpacked once and serve every activation row; nothing is reduced across lanes.
//!
//! Q4_K matrices loaded for this variant are stored in the lanes layout (`quant::to_lanes`), where one 64-byte
//! load is already a word of 16 rows: [`q4k_lanes`] runs the same arithmetic without the gathering and transposing,
//! for every block size including the one-token step; so are Q6_K matrices where no AMX tiles take them
//! ([`q6k_lanes`]). Q5_0 matrices take a lanes layout of their own (`quant::Q5_0Tiles::Masks16`: scales, fifth bits as
//! masks, nibbles as vectors), read by [`q5_0_lanes`].
//!
//! They compute the arithmetic of [`q4k_dot_scalar`] and [`q6k_dot_scalar`] bit for bit: the super-block integers
//! (`S`, and for Q4_K the min term `M`) are exact however their products are grouped, and the float chains are the
//! definitions' (`fma(d_x * d_w, S, acc)` per super-block, one row per lane).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::*;

mod q32;
pub use q32::{q5_0_groups, q5_0_lanes, q8_0_groups};

mod q6k;
pub use q6k::{q6k_groups, q6k_lanes};

// Which blocks come here is timed per matrix and block size ([`super::choose`]): transposing and unpacking 16
// weight rows costs about what a panel spends on a few activation rows, and how many depends on the CPU. Each kernel
// prefetches the next group's weights (contiguous) a share at a time while it computes this group
// ([`prefetch_share`]); prefetching only the 16 rows' next super-blocks, all at once, changed nothing.

/// Byte offset of the nibbles in a Q4_K super-block (ggml's `block_q4_K`: `d`, `dmin`, 12 scale bytes, then them).
pub(super) const Q4K_QS: usize = 16;

/// Words `off / 4 .. off / 4 + 4` of 16 weight rows `row_bytes` apart from `base`, one vector per word with row `n`
/// in lane `n`: the rows' 16-byte runs are loaded four to a vector (rows `a`, `a + 4`, `a + 8`, `a + 12` in its
/// 128-bit lanes) and each lane's 4 x 4 words transposed.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn words4(base: *const u8, row_bytes: usize, off: usize) -> [__m512i; 4] {
    // SAFETY: the caller guarantees 16 readable bytes at `off` in each of the 16 rows.
    let load = |n: usize| unsafe { _mm_loadu_si128(base.add(n * row_bytes + off).cast()) };
    let z: [__m512i; 4] = std::array::from_fn(|a| {
        let v = _mm512_castsi128_si512(load(a));
        let v = _mm512_inserti32x4::<1>(v, load(a + 4));
        let v = _mm512_inserti32x4::<2>(v, load(a + 8));
        _mm512_inserti32x4::<3>(v, load(a + 12))
    });
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// Prefetches share `b` of `kb` of the `bytes` bytes at `next` (the next group's weight rows, contiguous) into L2
/// (into every level on AMD CPUs: [`super::prefetch_l1`]), so that they arrive while this group computes. The
/// hardware prefetchers do not follow 16 short rows at once, so without this memory time and compute add up; the
/// shares are spread over the group's work because requesting all of a group's lines at its start leaves most of
/// them arriving late.
#[inline]
pub(super) fn prefetch_share(next: *const u8, bytes: usize, b: usize, kb: usize) {
    let (from, to) = (bytes * b / kb, bytes * (b + 1) / kb);
    let mut off = from & !63;
    let l1 = super::prefetch_l1();
    while off < to {
        let p = next.wrapping_add(off).cast();
        // SAFETY: a prefetch reads nothing and cannot fault; `wrapping_add` keeps the address arithmetic defined.
        unsafe {
            if l1 {
                _mm_prefetch::<_MM_HINT_T0>(p)
            } else {
                _mm_prefetch::<_MM_HINT_T1>(p)
            }
        };
        off += 64;
    }
}

/// Where the weights of group `g + 1` start (from the first group's at `w`, rows `row_bytes` long), and their size.
#[inline]
pub(super) fn next_group(w: *const u8, row_bytes: usize, g: usize) -> (*const u8, usize) {
    (w.wrapping_add((g + 1) * 16 * row_bytes), 16 * row_bytes)
}

/// The groups whose successors are prefetched: all but the last.
pub(super) fn prefetched(groups: usize) -> usize {
    groups.saturating_sub(1)
}

/// Per activation row and super-block, the sums of its sub-blocks' Q8_K sums (`bsums[2s] + bsums[2s + 1]`, at most
/// 2 x 16 x 128 in magnitude) packed in pairs of i16: word `i` holds sub-blocks `2i` (low half) and `2i + 1`.
pub(super) fn bsum_pairs(xs: &[&[RawQ8K]], kb: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(xs.len() * kb * 4);
    for x in xs {
        for xb in &x[..kb] {
            let s = |g: usize| (xb.bsums[2 * g] as i32 + xb.bsums[2 * g + 1] as i32) as i16 as u16;
            for i in 0..4 {
                out.push((s(2 * i) as u32 | ((s(2 * i + 1) as u32) << 16)) as i32);
            }
        }
    }
    out
}

/// Four activation bytes at `p`, in every lane.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bcast(p: *const i8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes at p.
    _mm512_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// Byte `k` (0..4) of every lane, as an i32.
#[target_feature(enable = "avx512f")]
#[inline]
fn byte_of(v: __m512i, k: u32) -> __m512i {
    _mm512_and_si512(
        _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * k as i32)),
        _mm512_set1_epi32(0xFF),
    )
}

/// The f16 in the low (`high = false`) or high half of every lane, as f32 (exact).
#[target_feature(enable = "avx512f")]
#[inline]
fn half_to_f32(v: __m512i, high: bool) -> __m512 {
    let v = if high { _mm512_srli_epi32::<16>(v) } else { v };
    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
}

/// What a Q4_K super-block's first four words give, one weight row per lane (`words`: its d and dmin, then its 12
/// scale bytes, as [`tile_words4`] or [`words4`] give them at offset 0): the 6-bit scales of sub-blocks 0..8 as i32
/// (those of `scales_mins`), the mins of sub-blocks `2i` and `2i + 1` as a pair of i16 for `vpdpwssd` with
/// [`bsum_pairs`], and d and dmin as f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
pub(super) fn q4k_scales(words: [__m512i; 4]) -> ([__m512i; 8], [__m512i; 4], __m512, __m512) {
    let [dd, u0, u1, u2] = words;
    let (mask6, mask4, mask2) = (
        _mm512_set1_epi32(0x3f3f_3f3f),
        _mm512_set1_epi32(0x0f0f_0f0f),
        _mm512_set1_epi32(0x0303_0303),
    );
    // Bytes 0..4 of sc_lo are sub-blocks 0..4, of sc_hi 4..8 (and the same for the mins).
    let sc_lo = _mm512_and_si512(u0, mask6);
    let sc_hi = _mm512_or_si512(
        _mm512_and_si512(u2, mask4),
        _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), mask2)),
    );
    let m_lo = _mm512_and_si512(u1, mask6);
    let m_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32::<4>(u2), mask4),
        _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), mask2)),
    );
    let scale: [__m512i; 8] =
        std::array::from_fn(|t| byte_of(if t < 4 { sc_lo } else { sc_hi }, t as u32 % 4));
    let mins: [__m512i; 4] = std::array::from_fn(|i| {
        let src = if i < 2 { m_lo } else { m_hi };
        let k = 2 * (i as u32 % 2);
        _mm512_or_si512(
            byte_of(src, k),
            _mm512_slli_epi32::<16>(byte_of(src, k + 1)),
        )
    });
    (scale, mins, half_to_f32(dd, false), half_to_f32(dd, true))
}

/// `out[r * stride + c] = q4k_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` (a multiple of 16 rows of `kb`
/// super-blocks) and every activation row `r`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL, VNNI and F16C; `w` must be whole rows of `kb` blocks, a multiple of 16 rows
/// (the loads of each super-block stay inside it); `xs` rows must hold at least `kb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q4k_groups(
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q4k_16::<false>(w, kb, xs, out, stride) }
}

/// [`q4k_groups`] over weights in the lanes layout (`quant::to_lanes`): the 16 rows' words come from plain
/// vector loads instead of being gathered and transposed from 16 rows at every step.
///
/// # Safety
/// As [`q4k_groups`], with `w` in the lanes layout (a multiple of 16 rows of `kb` super-blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q4k_lanes(
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q4k_16::<true>(w, kb, xs, out, stride) }
}

/// The end of a Q4_K super-block for one activation row, 16 weight rows in the lanes: its integer `s` and its min
/// term (the sub-block sum pairs `pairs` of [`bsum_pairs`] against `mins`) go into the float chains of the
/// definition, `acc += (d_x * d) * S` and `acc_m += (d_x * dmin) * M`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
pub(super) fn q4k_super_block(
    s: __m512i,
    pairs: &[i32],
    mins: &[__m512i; 4],
    dx: f32,
    (wd, wdm): (__m512, __m512),
    (acc, acc_m): (&mut __m512, &mut __m512),
) {
    let mut mn = _mm512_setzero_si512();
    for (i, &pair) in pairs.iter().enumerate() {
        mn = _mm512_dpwssd_epi32(mn, mins[i], _mm512_set1_epi32(pair));
    }
    let dx = _mm512_set1_ps(dx);
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(dx, wd), _mm512_cvtepi32_ps(s), *acc);
    *acc_m = _mm512_fmadd_ps(_mm512_mul_ps(dx, wdm), _mm512_cvtepi32_ps(mn), *acc_m);
}

/// Byte offset of the values in a Q8_K activation block (after its f32 `d`).
const Q8K_QS: usize = std::mem::offset_of!(RawQ8K, qs);

/// Bytes of a tile of 16 rows' super-block `b` in the lanes layout.
pub(super) const Q4K_TILE: usize = 16 * std::mem::size_of::<RawQ4K>();

/// Words `off / 4 .. off / 4 + 4` of the 16 rows of a lanes-layout tile at `tile`, as [`words4`] gives them.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn tile_words4(tile: *const u8, off: usize) -> [__m512i; 4] {
    // SAFETY: the caller guarantees a whole tile at `tile` (`off + 16` at most the block's bytes).
    std::array::from_fn(|k| unsafe { _mm512_loadu_si512(tile.add(16 * off + 64 * k).cast()) })
}

/// The Q4_K row-group kernel over either layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_16<const LANES: bool>(
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    let w = raw_q4k(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let m = xs.len();
    let xs: Vec<&[RawQ8K]> = xs.iter().map(|x| raw_q8k(x)).collect();
    let bsp = bsum_pairs(&xs, kb);
    let xp: Vec<*const i8> = xs.iter().map(|x| x.as_ptr().cast::<i8>()).collect();
    let row_bytes = kb * std::mem::size_of::<RawQ4K>();
    let groups = cols / 16;
    let ahead = prefetched(groups);
    let wp = w.as_ptr().cast::<u8>();
    let nib = _mm512_set1_epi8(0xF);
    let stream = LANES && super::streamed_q4k(m);
    let mut acc = vec![_mm512_setzero_ps(); m];
    let mut acc_m = vec![_mm512_setzero_ps(); m];
    let mut s = vec![_mm512_setzero_si512(); m];
    for g in 0..groups {
        acc.fill(_mm512_setzero_ps());
        acc_m.fill(_mm512_setzero_ps());
        for b in 0..kb {
            let base = if LANES {
                wp.wrapping_add((g * kb + b) * Q4K_TILE)
            } else {
                (&w[g * 16 * kb + b] as *const RawQ4K).cast::<u8>()
            };
            // Words `off / 4..+4` of the 16 rows' super-block b, in either layout.
            // SAFETY: lane n reads row g * 16 + n's super-block b, inside `w` by the caller's bounds (whole 16-row
            // groups of kb blocks; in the lanes layout tile (g, b) is those same 16 blocks' bytes).
            let words = |off: usize| unsafe {
                if LANES {
                    tile_words4(base, off)
                } else {
                    words4(base, row_bytes, off)
                }
            };
            // d and dmin, then the 12 scale bytes.
            let (scale, mins, wd, wdm) = q4k_scales(words(0));
            for j in 0..4 {
                if g < ahead {
                    let (next, bytes) = next_group(wp, row_bytes, g);
                    prefetch_share(next, bytes, 4 * b + j, 4 * kb);
                }
                let sc = (scale[2 * j], scale[2 * j + 1]);
                let off = b * std::mem::size_of::<RawQ8K>() + Q8K_QS + 64 * j;
                if stream {
                    let wq = base.wrapping_add(16 * (Q4K_QS + 32 * j));
                    let mut r0 = 0;
                    while r0 < m {
                        let n = (m - r0).min(8);
                        // SAFETY: row r0 + r holds kb blocks, so block b's chunk j (64 bytes at `off`) is inside
                        // it.
                        let at = |r: usize| unsafe { xp[r0 + r].add(off) };
                        let s = &mut s[r0..r0 + n];
                        // SAFETY: the chunk's 8 words of the tile are its 512 bytes from `wq` (tile (g, b) is
                        // inside `w`); each activation pointer is 64 bytes of a row's qs.
                        unsafe {
                            match n {
                                1 => q4k_chunk_streamed::<1, true>(wq, nib, [at(0)], sc, j == 0, s),
                                2 => q4k_chunk_streamed::<2, true>(
                                    wq,
                                    nib,
                                    [at(0), at(1)],
                                    sc,
                                    j == 0,
                                    s,
                                ),
                                3 => q4k_chunk_streamed::<3, true>(
                                    wq,
                                    nib,
                                    [at(0), at(1), at(2)],
                                    sc,
                                    j == 0,
                                    s,
                                ),
                                4 => q4k_chunk_streamed::<4, false>(
                                    wq,
                                    nib,
                                    [at(0), at(1), at(2), at(3)],
                                    sc,
                                    j == 0,
                                    s,
                                ),
                                5 => {
                                    let rows = [at(0), at(1), at(2), at(3), at(4)];
                                    q4k_chunk_streamed::<5, false>(wq, nib, rows, sc, j == 0, s)
                                }
                                6 => {
                                    let rows = [at(0), at(1), at(2), at(3), at(4), at(5)];
                                    q4k_chunk_streamed::<6, false>(wq, nib, rows, sc, j == 0, s)
                                }
                                7 => {
                                    let rows = [at(0), at(1), at(2), at(3), at(4), at(5), at(6)];
                                    q4k_chunk_streamed::<7, false>(wq, nib, rows, sc, j == 0, s)
                                }
                                _ => {
                                    let rows =
                                        [at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)];
                                    q4k_chunk_streamed::<8, false>(wq, nib, rows, sc, j == 0, s)
                                }
                            }
                        }
                        r0 += n;
                    }
                    continue;
                }
                // Word t of chunk j: its low nibbles are values 64j + 4t..+4 (sub-block 2j), its high nibbles
                // values 64j + 32 + 4t..+4 (sub-block 2j + 1).
                let mut lo = [_mm512_setzero_si512(); 8];
                let mut hi = [_mm512_setzero_si512(); 8];
                for h in 0..2 {
                    // Words 8j + 4h..+4 of qs.
                    let q = words(Q4K_QS + 32 * j + 16 * h);
                    for (k, qk) in q.into_iter().enumerate() {
                        lo[4 * h + k] = _mm512_and_si512(qk, nib);
                        hi[4 * h + k] = _mm512_and_si512(_mm512_srli_epi32::<4>(qk), nib);
                    }
                }
                // Up to four activation rows at once, their chains interleaved ([`q4k_chunk`]).
                let full = m / 4 * 4;
                for r0 in (0..full).step_by(4) {
                    // SAFETY: row r0 + r holds kb blocks, so block b's chunk j (64 bytes at `off`) is inside it.
                    let at = |r: usize| unsafe { xp[r0 + r].add(off) };
                    // SAFETY: each pointer is 64 bytes of an activation row's qs.
                    unsafe {
                        q4k_chunk::<4, false>(
                            &lo,
                            &hi,
                            [at(0), at(1), at(2), at(3)],
                            sc,
                            j == 0,
                            &mut s[r0..r0 + 4],
                        )
                    }
                }
                for r0 in (full..m).step_by(4) {
                    let at = |r: usize| xs[r0 + r][b].qs[64 * j..].as_ptr();
                    let s = &mut s[r0..m.min(r0 + 4)];
                    // SAFETY: each pointer is 64 bytes of an activation row's qs (64j + 64 <= 256).
                    unsafe {
                        match s.len() {
                            1 => q4k_chunk::<1, true>(&lo, &hi, [at(0)], sc, j == 0, s),
                            2 => q4k_chunk::<2, true>(&lo, &hi, [at(0), at(1)], sc, j == 0, s),
                            3 => q4k_chunk::<3, false>(
                                &lo,
                                &hi,
                                [at(0), at(1), at(2)],
                                sc,
                                j == 0,
                                s,
                            ),
                            _ => q4k_chunk::<4, false>(
                                &lo,
                                &hi,
                                [at(0), at(1), at(2), at(3)],
                                sc,
                                j == 0,
                                s,
                            ),
                        }
                    }
                }
            }
            for (r, x) in xs.iter().enumerate() {
                let p = &bsp[(r * kb + b) * 4..(r * kb + b) * 4 + 4];
                q4k_super_block(
                    s[r],
                    p,
                    &mins,
                    x[b].d,
                    (wd, wdm),
                    (&mut acc[r], &mut acc_m[r]),
                );
            }
        }
        for r in 0..m {
            let v = _mm512_sub_ps(acc[r], acc_m[r]);
            // SAFETY: out holds row r's 16 values at r * stride + 16g (the caller's layout).
            unsafe { _mm512_storeu_ps(out[r * stride + 16 * g..][..16].as_mut_ptr(), v) };
        }
    }
}

/// Chunk `j` of a Q4_K super-block for `R` activation rows (`q8[r]`: the row's 64 activation bytes of the chunk),
/// 16 weight rows in the lanes (`lo`, `hi`: the unpacked nibbles of sub-blocks `2j` and `2j + 1`): each sub-block's
/// sum times its scale (`sc`), added into `s[r]` (or stored where `first`). The rows' chains are interleaved, and
/// where `SPLIT` (one or two rows) each sub-block's sum runs in two chains (even and odd words), so that
/// `vpdpbusd`'s latency does not set the pace (one chain of eight per sub-block and row, row after row, leaves the
/// kernel well under the core's `vpdpbusd` rate). The sums are exact integers, so their grouping leaves the bits as
/// they are.
///
/// # Safety
/// Each `q8[r]` points at 64 readable bytes; `s` has `R` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q4k_chunk<const R: usize, const SPLIT: bool>(
    lo: &[__m512i; 8],
    hi: &[__m512i; 8],
    q8: [*const i8; R],
    sc: (__m512i, __m512i),
    first: bool,
    s: &mut [__m512i],
) {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q4k_chunk_by::<R, SPLIT>(|t| (lo[t], hi[t]), q8, sc, first, s) }
}

/// [`q4k_chunk`] with the 16 rows' words of chunk `j` loaded and unpacked as they are used (`words`: the lanes
/// layout's 8 words of the chunk, 64 bytes apart) instead of held in 16 registers, for blocks of a few rows, where
/// the words serve only those rows: the registers go to more chains (four per row at one to three rows, two per row
/// at four to eight). At most [`super::STREAMED_Q4K_MAX_ROWS`] rows take this.
///
/// # Safety
/// `words` points at 512 readable bytes; each `q8[r]` at 64; `s` has `R` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q4k_chunk_streamed<const R: usize, const SPLIT: bool>(
    words: *const u8,
    nib: __m512i,
    q8: [*const i8; R],
    sc: (__m512i, __m512i),
    first: bool,
    s: &mut [__m512i],
) {
    let word = |t: usize| {
        // SAFETY: word t is 64 bytes at 64t < 512.
        let z = unsafe { _mm512_loadu_si512(words.add(64 * t).cast()) };
        (
            _mm512_and_si512(z, nib),
            _mm512_and_si512(_mm512_srli_epi32::<4>(z), nib),
        )
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { q4k_chunk_by::<R, SPLIT>(word, q8, sc, first, s) }
}

/// The body of [`q4k_chunk`] and [`q4k_chunk_streamed`]: `word(t)` gives word `t`'s low and high nibbles.
///
/// # Safety
/// As [`q4k_chunk`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q4k_chunk_by<const R: usize, const SPLIT: bool>(
    word: impl Fn(usize) -> (__m512i, __m512i),
    q8: [*const i8; R],
    sc: (__m512i, __m512i),
    first: bool,
    s: &mut [__m512i],
) {
    // Accumulators per row: low nibbles' even and odd words, high nibbles' even and odd words (the odd ones only
    // where split: at three or four rows the rows themselves give enough chains, and the registers run out).
    let split = SPLIT;
    let mut a = [[_mm512_setzero_si512(); 4]; R];
    for t in 0..8 {
        let c = if split { t & 1 } else { 0 };
        let (lo_t, hi_t) = word(t);
        for r in 0..R {
            // SAFETY: 4t + 32 + 4 <= 64 bytes of the chunk.
            unsafe {
                a[r][c] = _mm512_dpbusd_epi32(a[r][c], lo_t, bcast(q8[r].add(4 * t)));
                a[r][2 + c] = _mm512_dpbusd_epi32(a[r][2 + c], hi_t, bcast(q8[r].add(32 + 4 * t)));
            }
        }
    }
    for (r, [l0, l1, h0, h1]) in a.into_iter().enumerate() {
        let (l, h) = if split {
            (_mm512_add_epi32(l0, l1), _mm512_add_epi32(h0, h1))
        } else {
            (l0, h0)
        };
        let v = _mm512_add_epi32(_mm512_mullo_epi32(l, sc.0), _mm512_mullo_epi32(h, sc.1));
        s[r] = if first { v } else { _mm512_add_epi32(s[r], v) };
    }
}
