//! The AVX2 kernels of the lanes layouts, 8 weight rows a vector: Q5_0 (Words8) and Q4_K, and the AVX2 Q8_K
//! quantizer.

use std::arch::x86_64::*;

use super::*;

/// Bytes of one tile of Q5_0's 8-row lanes layout (`quant::Q5_0Tiles::Words8`): one block of 8 rows.
pub(super) const Q5_0_TILE8: usize = 8 * std::mem::size_of::<RawQ5_0>();

/// How far ahead of the tile being computed [`q5_0_lanes8`] prefetches, in bytes (about 23 tiles). The tiles are
/// one stream, yet the hardware prefetchers alone leave a one-row pass well below the core's read bandwidth; 4 KB
/// ahead covers the memory latency at that bandwidth (`matmul-bench --formats q5_0` times it).
pub(super) const Q5_0_PREFETCH: usize = 4096;

/// The fifth bits of values `4k..4k + 4` of the 8 rows at bit 4 of their bytes (0x10 or 0), from the tile's words
/// (`h`: row `n`'s word in lane `n`, whose byte `t` holds them at bit `k`).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fifth_bits(h: __m256i, k: usize) -> __m256i {
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
pub(super) unsafe fn q5_0_tile8(t: *const u8) -> ([__m256i; 8], __m256) {
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
pub(super) unsafe fn q5_0_block8(wq: &[__m256i; 8], qs: *const i8, off: i32) -> __m256i {
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
pub(super) fn lane_tree8(acc: &[__m256; 8]) -> __m256 {
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
pub(super) const Q4K_TILE16: usize = 16 * std::mem::size_of::<RawQ4K>();

/// The largest of the 8 lanes of `m`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn max8(m: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// `round(sc * v)` clamped to -128..=127, 8 values as i32, rounding half away from zero as `f32::round` does, a NaN
/// product giving 0 as `NaN as i8` does ([`quantize_q8k_avx2`]).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn q8_8(sc: __m256, v: __m256) -> __m256i {
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
pub(in crate::kernels) unsafe fn quantize_q8k_avx2(xs: &[f32], ys: &mut [BlockQ8K]) {
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
pub(super) unsafe fn word8(base: *const u8, i: usize) -> __m256i {
    // SAFETY: the caller's bound.
    unsafe { _mm256_loadu_si256(base.add(64 * i).cast()) }
}

/// A `shuffle_epi8` pattern that takes byte `k` of every 32-bit lane to bytes 0 and 2 of the lane (`pair`: bytes
/// `k` and `k + 1` there), zeros in bytes 1 and 3: a byte of each row as an i16 in both halves of its lane, for `madd`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn bytes_to_i16(k: usize, pair: bool) -> __m256i {
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
pub(super) unsafe fn q4k_header8(base: *const u8) -> ([__m256i; 8], [__m256i; 4], __m256, __m256) {
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
pub(super) unsafe fn q4k_super_block8<const R: usize, const IN_ORDER: bool>(
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
pub(super) unsafe fn q4k_rows8<const R: usize, const IN_ORDER: bool>(
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
