//! The row groups of the 32-wide formats, Q5_0 (in rows or in its lanes layout) and Q8_0.

use std::arch::x86_64::*;

use super::*;

/// Byte offset of the nibbles in a Q5_0 block (ggml's `block_q5_0`: `d`, the 32 fifth bits `qh`, then them).
pub(super) const Q5_0_QS: usize = 6;

/// The exact integer of one 32-value block of [`q5_0_dot_scalar`] or [`q8_0_dot_scalar`] for 16 weight rows and one
/// activation row: `dpbusd` of the unsigned weights (`weight + 16` or `+ 128`, `wq[k]` for values `4k..4k + 4`) and
/// the activation bytes, in two chains (integers: the grouping changes nothing), from `off` (the activations' `off5`
/// or `off8`, `-16` or `-128 * sum of x`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn block32(wq: &[__m512i], off: i32, qs: *const i8) -> __m512i {
    let (mut a, mut b) = (_mm512_set1_epi32(off), _mm512_setzero_si512());
    for k in 0..4 {
        // SAFETY: the caller guarantees 32 readable activation bytes at qs.
        unsafe {
            a = _mm512_dpbusd_epi32(a, wq[k], bcast(qs.add(4 * k)));
            b = _mm512_dpbusd_epi32(b, wq[k + 4], bcast(qs.add(16 + 4 * k)));
        }
    }
    _mm512_add_epi32(a, b)
}

/// One 16-row group of a 32-wide format against every activation row: `wq`/`wd` its unpacked blocks and scales, the
/// integers started from the activations' `off8` (`q8`) or `off5`, and row `r`'s 16 results at `out[r * stride..]`
/// (the 8 lanes of the definition summed in `lane_tree`'s order).
///
/// # Safety
/// `out` must hold 16 values at every `r * stride`; every row must hold `wd.len()` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
pub(super) unsafe fn group_rows(
    wq: &[__m512i],
    wd: &[__m512],
    xs: &[Act32Row<'_>],
    q8: bool,
    next: Option<(*const u8, usize)>,
    out: &mut [f32],
    stride: usize,
) {
    let kb = wd.len();
    for (r, x) in xs.iter().enumerate() {
        if let Some((p, bytes)) = next {
            prefetch_share(p, bytes, r, xs.len());
        }
        let off = if q8 { x.off8 } else { x.off5 };
        let mut acc = [_mm512_setzero_ps(); 8];
        let x_qs = x.qs.as_ptr();
        for b0 in (0..kb).step_by(8) {
            for (j, a) in acc.iter_mut().enumerate().take(kb - b0) {
                let b = b0 + j;
                // SAFETY: block b of the row has 32 activation bytes at 32b.
                let s = unsafe { block32(&wq[8 * b..8 * b + 8], off[b], x_qs.add(32 * b)) };
                let d = _mm512_mul_ps(wd[b], _mm512_set1_ps(x.d[b]));
                *a = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), *a);
            }
        }
        // SAFETY: the caller's bound: 16 values at r * stride.
        unsafe { _mm512_storeu_ps(out[r * stride..][..16].as_mut_ptr(), lane_tree8(&acc)) };
    }
}

/// The 8 lanes of the 32-wide formats' definition (block `b` in lane `b % 8`), 16 weight rows each, summed in its
/// tree: `(l0 + l4) + (l2 + l6)` and `(l1 + l5) + (l3 + l7)`, then the two.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn lane_tree8(acc: &[__m512; 8]) -> __m512 {
    let t = [
        _mm512_add_ps(acc[0], acc[4]),
        _mm512_add_ps(acc[1], acc[5]),
        _mm512_add_ps(acc[2], acc[6]),
        _mm512_add_ps(acc[3], acc[7]),
    ];
    _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]))
}

/// `out[r * stride + c] = q5_0_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` (a multiple of 16 rows of `kb`
/// blocks) and every activation row `r`. The 16 rows' blocks are unpacked once (the fifth bit of value `4k + j` is
/// bit `4k + j` of `qh`: byte `k / 2` of each lane spread to its 4 bytes by a shuffle, then tested against one bit
/// per byte) into a scratch of `8 kb` vectors that every activation row reads; per activation row the 8 lanes of the
/// definition are 8 vectors, summed in its tree at the end.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL, VNNI and F16C; `w` must be whole rows of `kb` blocks, a multiple of 16 rows;
/// `xs` rows must hold at least `kb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q5_0_groups(
    w: &[BlockQ5_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    let w = raw_q5_0(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let row_bytes = kb * std::mem::size_of::<RawQ5_0>();
    let groups = cols / 16;
    let ahead = prefetched(groups);
    let wp = w.as_ptr().cast::<u8>();
    let nib = _mm512_set1_epi8(0xF);
    let fifth = _mm512_set1_epi8(0x10);
    // Word k's shuffle takes byte k / 2 of each lane's qh into all four of its bytes; byte j of a lane then holds
    // value 4k + j's fifth bit at bit 4 (k % 2) + j.
    let spread: [__m512i; 4] = std::array::from_fn(|h| {
        let idx: [u8; 64] = std::array::from_fn(|p| ((p % 16) / 4 * 4 + h) as u8);
        // SAFETY: 64 bytes make the 512 bits loaded.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    });
    let bits: [__m512i; 2] = std::array::from_fn(|h| {
        _mm512_set1_epi32(i32::from_le_bytes(std::array::from_fn(|j| {
            1u8 << (4 * h + j)
        })))
    });
    let mut wq = vec![_mm512_setzero_si512(); 8 * kb];
    let mut wd = vec![_mm512_setzero_ps(); kb];
    for g in 0..groups {
        for b in 0..kb {
            let base = (&w[g * 16 * kb + b] as *const RawQ5_0).cast::<u8>();
            // SAFETY: lane n reads row g * 16 + n's block b (the caller's bounds): bytes 0..16 (d, qh, the first 10
            // nibble bytes) and 6..22 (the 16 nibble bytes).
            let ([h0, h1, _, _], q) =
                unsafe { (words4(base, row_bytes, 0), words4(base, row_bytes, Q5_0_QS)) };
            wd[b] = half_to_f32(h0, false);
            let qh = _mm512_or_si512(_mm512_srli_epi32::<16>(h0), _mm512_slli_epi32::<16>(h1));
            for k in 0..8 {
                let v = if k < 4 {
                    _mm512_and_si512(q[k], nib)
                } else {
                    _mm512_and_si512(_mm512_srli_epi32::<4>(q[k - 4]), nib)
                };
                let byte = _mm512_shuffle_epi8(qh, spread[k / 2]);
                let set = _mm512_test_epi8_mask(byte, bits[k % 2]);
                wq[8 * b + k] = _mm512_mask_add_epi8(v, set, v, fifth);
            }
        }
        let next = (g < ahead).then(|| next_group(wp, row_bytes, g));
        // SAFETY: out holds every row's 16 values of group g (the caller's layout).
        unsafe { group_rows(&wq, &wd, xs, false, next, &mut out[16 * g..], stride) };
    }
}

/// Bytes of one tile of Q5_0's lanes layout (`quant::Q5_0Tiles::Masks16`): one block of 16 rows.
pub(super) const Q5_0_TILE: usize = 16 * std::mem::size_of::<RawQ5_0>();

/// One tile of Q5_0's lanes layout (`quant::Q5_0Tiles::Masks16`) unpacked: its 16 rows' scales, and in `wq[k]` values
/// `4k..4k + 4` of every row as unsigned bytes (`weight + 16`), one row per lane, as [`q5_0_groups`] makes them from
/// the rows: the nibbles of one vector load (low for `k < 4`, high after), the fifth bits a mask load each.
///
/// # Safety
/// `t` must point at a whole tile (352 readable bytes).
#[target_feature(enable = "avx512f,avx512bw,f16c")]
#[inline]
pub(super) unsafe fn q5_0_tile_unpack(t: *const u8, wq: &mut [__m512i]) -> __m512 {
    let nib = _mm512_set1_epi8(0xF);
    let fifth = _mm512_set1_epi8(0x10);
    // SAFETY: the caller's bound: the scales at 0..32, the masks at 32..96, the nibbles at 96..352.
    unsafe {
        let wd = _mm512_cvtph_ps(_mm256_loadu_si256(t.cast()));
        for i in 0..4 {
            let q = _mm512_loadu_si512(t.add(96 + 64 * i).cast());
            let lo = _mm512_and_si512(q, nib);
            let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(q), nib);
            let m_lo = t.add(32 + 8 * i).cast::<u64>().read_unaligned();
            let m_hi = t.add(32 + 8 * (i + 4)).cast::<u64>().read_unaligned();
            wq[i] = _mm512_mask_add_epi8(lo, m_lo, lo, fifth);
            wq[i + 4] = _mm512_mask_add_epi8(hi, m_hi, hi, fifth);
        }
        wd
    }
}

/// [`q5_0_lanes`] for `R` (1 or 2) activation rows from registers: each row's 8 lanes of 16 weight rows are held
/// across a group's blocks and every tile is unpacked into registers once for the `R` rows, nothing goes through
/// memory: at one or two rows the row groups' spills would cost more than the products (`matmul-bench --formats
/// q5_0` times it).
///
/// # Safety
/// As [`q5_0_lanes`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q5_0_lanes_regs<const R: usize>(
    w: &[BlockQ5_0],
    kb: usize,
    xs: [&Act32Row<'_>; R],
    out: &mut [f32],
    stride: usize,
) {
    let groups = w.len() / kb / 16;
    let wp = w.as_ptr().cast::<u8>();
    let mut wq = [_mm512_setzero_si512(); 8];
    for g in 0..groups {
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        for b in 0..kb {
            // SAFETY: tile (g, b) lies in `w` (the caller's bounds).
            let wd = unsafe { q5_0_tile_unpack(wp.add((g * kb + b) * Q5_0_TILE), &mut wq) };
            for (x, a) in xs.iter().zip(acc.iter_mut()) {
                // SAFETY: the row holds kb blocks, 32 activation bytes each.
                let s = unsafe { block32(&wq, x.off5[b], x.qs.as_ptr().add(32 * b)) };
                let d = _mm512_mul_ps(wd, _mm512_set1_ps(x.d[b]));
                a[b % 8] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), a[b % 8]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: out holds row r's 16 values of group g at r * stride + 16g (the caller's layout).
            unsafe {
                _mm512_storeu_ps(out[r * stride + 16 * g..][..16].as_mut_ptr(), lane_tree8(a))
            };
        }
    }
}

/// [`q5_0_groups`] over weights in Q5_0's lanes layout (`quant::Q5_0Tiles::Masks16`): a tile's 16 rows come from plain
/// vector and mask loads instead of being gathered, transposed and spread by shuffles. One or two activation rows
/// (the one-token step) run from registers ([`q5_0_lanes_regs`]); more rows unpack the group once, as
/// [`q5_0_groups`] does, and share it. The same integers and float chains as [`q5_0_groups`] either
/// way: the same bits.
///
/// # Safety
/// As [`q5_0_groups`], with `w` in Q5_0's lanes layout (a multiple of 16 rows of `kb` blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q5_0_lanes(
    w: &[BlockQ5_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    match xs {
        // SAFETY (both): the caller's bounds are q5_0_lanes_regs's.
        [x] => return unsafe { q5_0_lanes_regs(w, kb, [x], out, stride) },
        [x, y] => return unsafe { q5_0_lanes_regs(w, kb, [x, y], out, stride) },
        _ => {}
    }
    let groups = cols / 16;
    let wp = w.as_ptr().cast::<u8>();
    let tile = |g: usize, b: usize| wp.wrapping_add((g * kb + b) * Q5_0_TILE);
    let row_bytes = kb * std::mem::size_of::<RawQ5_0>();
    let ahead = prefetched(groups);
    let mut wq = vec![_mm512_setzero_si512(); 8 * kb];
    let mut wd = vec![_mm512_setzero_ps(); kb];
    for g in 0..groups {
        for b in 0..kb {
            // SAFETY: tile (g, b) lies in `w` (the caller's bounds).
            wd[b] = unsafe { q5_0_tile_unpack(tile(g, b), &mut wq[8 * b..8 * b + 8]) };
        }
        // The group's tiles are contiguous, 16 rows' worth of bytes, as the rows of the other layout are.
        let next = (g < ahead).then(|| next_group(wp, row_bytes, g));
        // SAFETY: out holds every row's 16 values of group g (the caller's layout).
        unsafe { group_rows(&wq, &wd, xs, false, next, &mut out[16 * g..], stride) };
    }
}

/// Byte offset of the weights in a Q8_0 block (ggml's `block_q8_0`: `d`, then 32 signed bytes).
pub(super) const Q8_0_QS: usize = 2;

/// `out[r * stride + c] = q8_0_dot_scalar(W[c], xs[r])` for the weight rows `c` of `w` (a multiple of 16 rows of `kb`
/// blocks) and every activation row `r`: as [`q5_0_groups`], with the weights made unsigned by `+ 128` (a flipped
/// top bit) and the block's integer started from the activations' `off8` (`-128 * sum of x`).
///
/// # Safety
/// As [`q5_0_groups`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q8_0_groups(
    w: &[BlockQ8_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    let w = raw_q8_0(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let row_bytes = kb * std::mem::size_of::<RawQ8_0>();
    let groups = cols / 16;
    let ahead = prefetched(groups);
    let wp = w.as_ptr().cast::<u8>();
    let top = _mm512_set1_epi8(-128);
    let mut wq = vec![_mm512_setzero_si512(); 8 * kb];
    let mut wd = vec![_mm512_setzero_ps(); kb];
    for g in 0..groups {
        for b in 0..kb {
            let base = (&w[g * 16 * kb + b] as *const RawQ8_0).cast::<u8>();
            // SAFETY: lane n reads row g * 16 + n's block b (the caller's bounds): bytes 0..16, 2..18 and 18..34 of
            // its 34.
            let ([h0, _, _, _], lo, hi) = unsafe {
                (
                    words4(base, row_bytes, 0),
                    words4(base, row_bytes, Q8_0_QS),
                    words4(base, row_bytes, Q8_0_QS + 16),
                )
            };
            wd[b] = half_to_f32(h0, false);
            for k in 0..4 {
                wq[8 * b + k] = _mm512_xor_si512(lo[k], top);
                wq[8 * b + 4 + k] = _mm512_xor_si512(hi[k], top);
            }
        }
        let next = (g < ahead).then(|| next_group(wp, row_bytes, g));
        // SAFETY: out holds every row's 16 values of group g (the caller's layout).
        unsafe { group_rows(&wq, &wd, xs, true, next, &mut out[16 * g..], stride) };
    }
}
