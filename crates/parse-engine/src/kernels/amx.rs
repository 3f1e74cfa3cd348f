//! AMX-INT8 block kernels for Q4_K and Q6_K weights: 16 weight rows x 16 activation rows per tile multiply.
//!
//! They compute the arithmetic of [`q4k_dot_scalar`] and [`q6k_dot_scalar`] bit for bit: as the weights of a
//! super-block are unpacked, each is multiplied by its sub-block's scale and the product split into two signed
//! bytes (`lo + 2^s hi`); two `tdpbssd` chains over the whole super-block give the exact integers `L` and `H` of 16
//! weight rows with 16 activation rows, and `S = L + 2^s H` is the super-block's integer of the definition (for Q4_K
//! the min term `M` is an exact integer too, through `vpdpwssd`); the float chains are those of the definitions.
//! Only blocks of at least [`MIN_ROWS`] rows come here; one-token steps use the VNNI panels, which give the same
//! bits. The weights are walked 16 rows at a time, one super-block per step, with the blocks of a later step
//! prefetched. Q4_K matrices stored in the lanes layout (`quant::to_lanes`) take [`q4k_lanes`] instead, with
//! the weights as the B operand, for the blocks where it is faster than the row groups (`super::amx_lanes`).
//!
//! Tiles are programmed with inline assembly (the AMX intrinsics are not stable in Rust): `ldtilecfg` on entry,
//! `tilerelease` on exit, so no tile state outlives a call. The process asks the kernel for the AMX tile data
//! state once (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); if that fails the variant is unsupported.

#![allow(unsafe_code)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::*;

/// Blocks with fewer activation rows use the row groups of [`super::groups`] or the panels, whichever is faster
/// there ([`super::choose`]): unpacking the weights for the tiles costs about as much as a one-row pass whatever the
/// rows, and a 16-row tile of fewer rows is mostly padding.
pub const MIN_ROWS: usize = 14;

const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
const XFEATURE_XTILEDATA: libc::c_ulong = 18;

/// Whether this CPU has AMX-TILE and AMX-INT8 and this process may use them (asked of the kernel once).
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[allow(unused_unsafe)]
        // SAFETY: CPUID is available on every x86_64 CPU; leaf 7 is checked against the maximum leaf first.
        let (max, leaf7) = unsafe { (__get_cpuid_max(0).0, __cpuid_count(7, 0)) };
        if max < 7 || (leaf7.edx >> 24) & 1 == 0 || (leaf7.edx >> 25) & 1 == 0 {
            return false;
        }
        // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes which XSAVE features this process may use.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    })
}

/// Activations of a Q4_K or Q6_K matmul in the layouts the tiles read: per 16-row tile `t` and super-block `b`, for each
/// sub-block `s` an 8 x 64-byte B operand (`[k / 4][row][k % 4]`), the 16 rows' scales, and their sub-block sums
/// packed in pairs of i16 for the min term. Rows past `m` are zero.
pub struct Acts {
    kb: usize,
    m: usize,
    tiles: usize,
    xb: Vec<i8>,
    dx: Vec<f32>,
    bsp: Vec<i32>,
}

impl Acts {
    pub fn new(xq: &[BlockQ8K], kb: usize, m: usize) -> Self {
        let x = raw_q8k(xq);
        let tiles = m.div_ceil(16);
        let mut a = Acts {
            kb,
            m,
            tiles,
            xb: vec![0; tiles * kb * 8 * 512],
            dx: vec![0.0; tiles * kb * 16],
            bsp: vec![0; tiles * kb * 4 * 16],
        };
        for row in 0..m {
            let (t, r) = (row / 16, row % 16);
            for b in 0..kb {
                let blk = &x[row * kb + b];
                let tb = t * kb + b;
                a.dx[tb * 16 + r] = blk.d;
                for s in 0..8 {
                    for i in 0..8 {
                        let src = &blk.qs[32 * s + 4 * i..32 * s + 4 * i + 4];
                        let dst = (tb * 8 + s) * 512 + i * 64 + r * 4;
                        a.xb[dst..dst + 4].copy_from_slice(src);
                    }
                }
                let bs = |s: usize| blk.bsums[2 * s] as i32 + blk.bsums[2 * s + 1] as i32;
                for tt in 0..4 {
                    let (lo, hi) = (bs(2 * tt) as u16 as u32, bs(2 * tt + 1) as u16 as u32);
                    a.bsp[(tb * 4 + tt) * 16 + r] = (lo | (hi << 16)) as i32;
                }
            }
        }
        a
    }
}

#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    /// Palette 1 with tile `t` shaped `tiles[t]` = (bytes per row, rows).
    fn new(tiles: &[(u16, u8)]) -> Self {
        let mut cfg = TileConfig([0; 64]);
        cfg.0[0] = 1;
        for (t, &(colsb, rows)) in tiles.iter().enumerate() {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            cfg.0[48 + t] = rows;
        }
        cfg
    }
}

#[repr(C, align(64))]
struct Unpacked([[i8; 256]; 16]);

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct CTile([i32; 256]);

/// `q * v` for `q` in 0..16, for each `v` in 0..8: the scaled weights of a Q4_K sub-block, by table look-up.
static TIMES: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut v = 0;
    while v < 8 {
        let mut q = 0;
        while q < 16 {
            t[v][q] = (q * v) as u8;
            q += 1;
        }
        v += 1;
    }
    t
};

/// The two tile products of one super-block: `L = sum lo x` into `c_lo` and `H = sum hi x` into `c_hi`, for the 16
/// weight rows unpacked into `u_lo`/`u_hi` (256 values each, in activation order) and the 16 activation rows of
/// tile-block `tb` of `acts`.
///
/// # Safety
/// AMX must be usable and the tiles configured as five 16 x 64-byte tiles (`TileConfig::new(&[(64, 16); 5])`);
/// `tb` must be a tile-block of `acts`.
#[inline(always)]
unsafe fn lo_hi_products(
    acts: &Acts,
    tb: usize,
    u_lo: &Unpacked,
    u_hi: &Unpacked,
    c_lo: &mut CTile,
    c_hi: &mut CTile,
) {
    // tmm0, tmm3: L and H, 16 rows x 16 i32; tmm1, tmm4: A (lo, hi), 16 weight rows x 64 bytes; tmm2: B, 16 x 64
    // bytes (64 activation values of 16 rows: sub-blocks 2j and 2j + 1 are adjacent in `acts.xb`).
    // SAFETY: A operands span 16 rows of 64 bytes at stride 256 inside `u_lo`/`u_hi`; B spans 16 rows of 64 bytes
    // inside `acts.xb`; L and H are stored into `c_lo`/`c_hi` (16 rows of 64 bytes); the caller configured the tiles.
    unsafe {
        asm!("tilezero tmm0", "tilezero tmm3", options(nostack, nomem));
        for j in 0..4 {
            asm!(
                "tileloadd tmm2, [{b} + {s64}*1]",
                "tileloadd tmm1, [{lo} + {s256}*1]",
                "tileloadd tmm4, [{hi} + {s256}*1]",
                "tdpbssd tmm0, tmm1, tmm2",
                "tdpbssd tmm3, tmm4, tmm2",
                b = in(reg) acts.xb[(tb * 8 + 2 * j) * 512..].as_ptr(),
                lo = in(reg) u_lo.0[0][64 * j..].as_ptr(),
                hi = in(reg) u_hi.0[0][64 * j..].as_ptr(),
                s64 = in(reg) 64usize,
                s256 = in(reg) 256usize,
                options(nostack),
            );
        }
        asm!(
            "tilestored [{lo} + {s64}*1], tmm0",
            "tilestored [{hi} + {s64}*1], tmm3",
            lo = in(reg) c_lo.0.as_mut_ptr(),
            hi = in(reg) c_hi.0.as_mut_ptr(),
            s64 = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Super-block steps ahead that a group kernel prefetches its weights: the kernels walk 16 weight rows one
/// super-block at a time (16 streams, which the hardware prefetcher does not follow as well as decode's one), so the
/// blocks of the step `AHEAD` steps on are asked for while this one is computed.
const AHEAD: usize = 2;

/// Prefetches the 16 weight blocks (one per row of a group) of step `step` of the walk over `groups` groups of 16
/// rows with `kb` blocks each; past the end, nothing.
#[inline(always)]
fn prefetch_step<T>(w: &[T], kb: usize, step: usize) {
    let (g, b) = (step / kb, step % kb);
    if (g + 1) * 16 * kb > w.len() {
        return;
    }
    let size = std::mem::size_of::<T>();
    for n in 0..16 {
        let p = (&w[(g * 16 + n) * kb + b] as *const T).cast::<i8>();
        for off in (0..size).step_by(64).chain(std::iter::once(size - 1)) {
            // SAFETY: the block has `size` bytes from `p`; prefetching never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
        }
    }
}

/// `out[r * stride + c] = dot(W[c], x[r])` for every weight row `c` of `w` (a multiple of 16 rows of `kb` blocks)
/// and every activation row `r < acts.m`.
///
/// The sub-block scales (6 bits) are split as `sc = 8 * hi + lo` with `hi, lo < 8`, so `q * lo` and `q * hi` fit
/// in a signed byte: two tile products over the whole super-block, `L = sum (q * lo) x` and `H = sum (q * hi) x`,
/// give `S = L + 8 H` exactly, with one tile store each per super-block instead of one per sub-block.
///
/// # Safety
/// The CPU must support the VNNI variant and [`available`] must have returned true.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
#[allow(clippy::needless_range_loop)] // sub-block and weight-row indices address several arrays at once
pub unsafe fn q4k_groups(w: &[BlockQ4K], kb: usize, acts: &Acts, out: &mut [f32], stride: usize) {
    debug_assert_eq!(kb, acts.kb);
    let w = raw_q4k(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let tiles = acts.tiles;
    // A operands `q * lo` and `q * hi` (see `lo_hi_products`).
    let cfg = TileConfig::new(&[(64, 16); 5]);
    let mut u_lo = Box::new(Unpacked([[0; 256]; 16]));
    let mut u_hi = Box::new(Unpacked([[0; 256]; 16]));
    let mut c_lo = Box::new(CTile([0; 256]));
    let mut c_hi = Box::new(CTile([0; 256]));
    let mut acc = vec![0f32; tiles * 256];
    let mut acc_m = vec![0f32; tiles * 256];
    let m4 = _mm512_set1_epi8(0xF);
    // SAFETY: TIMES holds 8 rows of 16 bytes.
    let table = |v: u8| unsafe {
        _mm256_broadcastsi128_si256(_mm_loadu_si128(TIMES[v as usize].as_ptr().cast()))
    };
    // SAFETY: the configuration is a valid palette-1 layout; the caller guarantees AMX is usable.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
    for g in 0..cols / 16 {
        acc.fill(0.0);
        acc_m.fill(0.0);
        for b in 0..kb {
            prefetch_step(w, kb, g * kb + b + AHEAD);
            let mut mp = [[0i32; 4]; 16];
            let mut wd = [0f32; 16];
            let mut wdm = [0f32; 16];
            for n in 0..16 {
                let blk = &w[(g * 16 + n) * kb + b];
                let (sc, m8) = scales_mins(&blk.scales);
                mp[n] =
                    std::array::from_fn(|tt| m8[2 * tt] as i32 | ((m8[2 * tt + 1] as i32) << 16));
                wd[n] = f16::from_bits(blk.d).to_f32();
                wdm[n] = f16::from_bits(blk.dmin).to_f32();
                // Chunk j of qs holds sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles), which are values
                // 64j..64j+64 in activation order: one 64-byte vector per chunk.
                for j in 0..4 {
                    // SAFETY: qs has 128 bytes; the load spans 32j..32j+32; u_lo/u_hi rows have 256 bytes.
                    unsafe {
                        let z = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                            blk.qs.as_ptr().add(32 * j).cast(),
                        ));
                        let q = _mm512_and_si512(
                            _mm512_mask_blend_epi64(0xF0, z, _mm512_srli_epi16(z, 4)),
                            m4,
                        );
                        let (a, b2) = (sc[2 * j], sc[2 * j + 1]);
                        let t_lo = _mm512_inserti64x4(
                            _mm512_castsi256_si512(table(a & 7)),
                            table(b2 & 7),
                            1,
                        );
                        let t_hi = _mm512_inserti64x4(
                            _mm512_castsi256_si512(table(a >> 3)),
                            table(b2 >> 3),
                            1,
                        );
                        let off = 64 * j;
                        _mm512_store_si512(
                            u_lo.0[n].as_mut_ptr().add(off).cast(),
                            _mm512_shuffle_epi8(t_lo, q),
                        );
                        _mm512_store_si512(
                            u_hi.0[n].as_mut_ptr().add(off).cast(),
                            _mm512_shuffle_epi8(t_hi, q),
                        );
                    }
                }
            }
            for t in 0..tiles {
                let tb = t * kb + b;
                // SAFETY: the tiles were configured above with the layout `lo_hi_products` expects.
                unsafe { lo_hi_products(acts, tb, &u_lo, &u_hi, &mut c_lo, &mut c_hi) };
                // SAFETY: 16 scales and 4 x 16 packed sums of tile t, super-block b.
                let (dx, bsp) = unsafe {
                    let bsp: [__m512i; 4] = std::array::from_fn(|tt| {
                        _mm512_loadu_si512(acts.bsp[(tb * 4 + tt) * 16..].as_ptr().cast())
                    });
                    (_mm512_loadu_ps(acts.dx[tb * 16..].as_ptr()), bsp)
                };
                for n in 0..16 {
                    // SAFETY: row n of L and H is 16 i32 inside `c_lo`/`c_hi`.
                    let s_n = unsafe {
                        let l = _mm512_load_si512(c_lo.0[16 * n..].as_ptr().cast());
                        let h = _mm512_load_si512(c_hi.0[16 * n..].as_ptr().cast());
                        _mm512_add_epi32(l, _mm512_slli_epi32(h, 3))
                    };
                    let mut mn = _mm512_setzero_si512();
                    for (tt, v) in bsp.iter().enumerate() {
                        mn = _mm512_dpwssd_epi32(mn, *v, _mm512_set1_epi32(mp[n][tt]));
                    }
                    let at = (t * 16 + n) * 16;
                    // SAFETY: acc and acc_m hold 16 f32 at `at`.
                    unsafe {
                        let a = _mm512_loadu_ps(acc[at..].as_ptr());
                        let d = _mm512_mul_ps(dx, _mm512_set1_ps(wd[n]));
                        _mm512_storeu_ps(
                            acc[at..].as_mut_ptr(),
                            _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s_n), a),
                        );
                        let am = _mm512_loadu_ps(acc_m[at..].as_ptr());
                        let dm = _mm512_mul_ps(dx, _mm512_set1_ps(wdm[n]));
                        _mm512_storeu_ps(
                            acc_m[at..].as_mut_ptr(),
                            _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(mn), am),
                        );
                    }
                }
            }
        }
        for row in 0..acts.m {
            let (t, r) = (row / 16, row % 16);
            for n in 0..16 {
                let at = (t * 16 + n) * 16 + r;
                out[row * stride + g * 16 + n] = acc[at] - acc_m[at];
            }
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `i16` lane indices that spread a Q6_K super-block's 16 group scales over the 64 values of chunk `c` (0..4, in
/// activation order): half `h` (values `32h..32h + 32` of the chunk) takes groups `4c + 2h` (lanes 0..16) and
/// `4c + 2h + 1` (lanes 16..32). Entry `2c + h`.
static Q6K_SCALE_LANES: [[i16; 32]; 8] = {
    let mut t = [[0i16; 32]; 8];
    let mut e = 0;
    while e < 8 {
        let mut l = 0;
        while l < 32 {
            t[e][l] = (2 * e + l / 16) as i16;
            l += 1;
        }
        e += 1;
    }
    t
};

/// `out[r * stride + c] = dot(W[c], x[r])` for every Q6_K weight row `c` of `w` (a multiple of 16 rows of `kb`
/// blocks) and every activation row `r < acts.m`.
///
/// Each weight is multiplied by its group's scale as it is unpacked (`p = sc * q`, `q` in -32..32 and `sc` a signed
/// byte, so `p` in -4064..=4096) and split as `p = 64 * hi + lo` with `lo = p & 63` and `hi = p >> 6` (in -64..=64),
/// both signed bytes: two tile products over the whole super-block, `L = sum lo x` and `H = sum hi x`, give
/// `S = L + 64 H` exactly, the integer of the definition, with one tile store each per super-block (one per
/// 16-value group before, with a multiply per group and weight row).
///
/// # Safety
/// The CPU must support the VNNI variant and [`available`] must have returned true.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
#[allow(clippy::needless_range_loop)] // weight-row indices address several arrays at once
pub unsafe fn q6k_groups(w: &[BlockQ6K], kb: usize, acts: &Acts, out: &mut [f32], stride: usize) {
    debug_assert_eq!(kb, acts.kb);
    let w = raw_q6k(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let tiles = acts.tiles;
    let cfg = TileConfig::new(&[(64, 16); 5]);
    let mut u_lo = Box::new(Unpacked([[0; 256]; 16]));
    let mut u_hi = Box::new(Unpacked([[0; 256]; 16]));
    let mut c_lo = Box::new(CTile([0; 256]));
    let mut c_hi = Box::new(CTile([0; 256]));
    let mut acc = vec![0f32; tiles * 256];
    let m4 = _mm512_set1_epi8(0xF);
    let m2 = _mm512_set1_epi8(3);
    let k32 = _mm512_set1_epi8(32);
    let low6 = _mm512_set1_epi16(63);
    let shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    let shift23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    // SAFETY: the table holds 8 rows of 32 i16.
    let lanes: [__m512i; 8] =
        std::array::from_fn(|e| unsafe { _mm512_loadu_si512(Q6K_SCALE_LANES[e].as_ptr().cast()) });
    // SAFETY: the configuration is a valid palette-1 layout; the caller guarantees AMX is usable.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
    for g in 0..cols / 16 {
        acc.fill(0.0);
        for b in 0..kb {
            prefetch_step(w, kb, g * kb + b + AHEAD);
            let mut wd = [0f32; 16];
            for n in 0..16 {
                let blk = &w[(g * 16 + n) * kb + b];
                wd[n] = f16::from_bits(blk.d).to_f32();
                // SAFETY: scales has 16 bytes.
                let sc16 = unsafe {
                    _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(
                        blk.scales.as_ptr().cast(),
                    )))
                };
                // Chunk `c` (values 64c..64c+64 in activation order) of `q - 32`, scaled and split.
                let mut split = |c: usize, q: __m512i| {
                    let half = |h: usize, v: __m256i| {
                        let p = _mm512_mullo_epi16(
                            _mm512_cvtepi8_epi16(v),
                            _mm512_permutexvar_epi16(lanes[2 * c + h], sc16),
                        );
                        (
                            _mm512_cvtepi16_epi8(_mm512_and_si512(p, low6)),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(p, 6)),
                        )
                    };
                    let (l0, h0) = half(0, _mm512_castsi512_si256(q));
                    let (l1, h1) = half(1, _mm512_extracti64x4_epi64(q, 1));
                    // SAFETY: u_lo/u_hi rows have 256 bytes; the stores span 64c..64c+64.
                    unsafe {
                        _mm512_store_si512(
                            u_lo.0[n].as_mut_ptr().add(64 * c).cast(),
                            _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1),
                        );
                        _mm512_store_si512(
                            u_hi.0[n].as_mut_ptr().add(64 * c).cast(),
                            _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1),
                        );
                    }
                };
                // Values in activation order, as the VNNI kernel builds them.
                for h in 0..2 {
                    // SAFETY: ql has 128 bytes and qh 64; the loads span 64h..64h+64 and 32h..32h+32.
                    let (ql, qh) = unsafe {
                        (
                            _mm512_loadu_si512(blk.ql.as_ptr().add(64 * h).cast()),
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                blk.qh.as_ptr().add(32 * h).cast(),
                            )),
                        )
                    };
                    let high = |shift: __m512i| {
                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), m2), 4)
                    };
                    let q01 = _mm512_or_si512(_mm512_and_si512(ql, m4), high(shift01));
                    let q23 = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                        high(shift23),
                    );
                    split(2 * h, _mm512_sub_epi8(q01, k32));
                    split(2 * h + 1, _mm512_sub_epi8(q23, k32));
                }
            }
            for t in 0..tiles {
                let tb = t * kb + b;
                // SAFETY: the tiles were configured above with the layout `lo_hi_products` expects.
                unsafe { lo_hi_products(acts, tb, &u_lo, &u_hi, &mut c_lo, &mut c_hi) };
                // SAFETY: 16 scales of tile t, super-block b.
                let dx = unsafe { _mm512_loadu_ps(acts.dx[tb * 16..].as_ptr()) };
                for n in 0..16 {
                    let at = (t * 16 + n) * 16;
                    // SAFETY: row n of L and H is 16 i32 inside `c_lo`/`c_hi`; acc holds 16 f32 at `at`.
                    unsafe {
                        let l = _mm512_load_si512(c_lo.0[16 * n..].as_ptr().cast());
                        let h = _mm512_load_si512(c_hi.0[16 * n..].as_ptr().cast());
                        let s_n = _mm512_add_epi32(l, _mm512_slli_epi32(h, 6));
                        let a = _mm512_loadu_ps(acc[at..].as_ptr());
                        let d = _mm512_mul_ps(dx, _mm512_set1_ps(wd[n]));
                        _mm512_storeu_ps(
                            acc[at..].as_mut_ptr(),
                            _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s_n), a),
                        );
                    }
                }
            }
        }
        for row in 0..acts.m {
            let (t, r) = (row / 16, row % 16);
            for n in 0..16 {
                out[row * stride + g * 16 + n] = acc[(t * 16 + n) * 16 + r];
            }
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The B operands of one Q4_K super-block of 16 weight rows: per chunk `j` (values `64j..64j + 64`: sub-blocks `2j`
/// and `2j + 1`), the weights times the low and the high 3 bits of their sub-block's scale, 16 rows of 64 bytes each.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BTiles([[[[u8; 64]; 16]; 2]; 4]);

/// `out[r * stride + c] = q4k_dot_scalar(W[c], xs[r])` for Q4_K weights `w` in the lanes layout
/// (`quant::to_lanes`: a multiple of 16 rows of `kb` super-blocks) and every activation row `r`.
///
/// Here the weights are the tiles' B operand and the activations A, the other way round from [`q4k_groups`]: a word
/// of the lanes layout is 16 weight rows of 4 bytes, which masked to its low or high nibbles is a row of a B operand
/// as `tdpbsud` reads it (unsigned bytes, 4 consecutive values of each of 16 columns). As in [`q4k_groups`] each
/// weight is multiplied by the low and the high 3 bits of its sub-block's scale (`sc = 8 hi + lo`; here two
/// `vpmullw` per 64 weights, the product of a nibble and 3 bits never carrying into the next byte), so that two
/// chains of 64-value products over the super-block give `S = L + 8 H` exactly, with one tile store each per
/// super-block. The activation rows are read where they lie, one tile row per row, up to 16 rows a tile. A
/// super-block's B operands are made once and serve every tile of activation rows; a tile's products are read back
/// while the next tile's are multiplied. The float chains are those of [`super::groups::q4k_lanes`]
/// ([`super::groups::q4k_super_block`]).
///
/// # Safety
/// The CPU must support the VNNI variant and [`available`] must have returned true; `w` must be whole 16-row
/// groups of `kb` blocks in the lanes layout; `xs` rows must hold at least `kb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub unsafe fn q4k_lanes(
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    use super::groups::{
        Q4K_QS, Q4K_TILE, bsum_pairs, next_group, prefetch_share, prefetched, q4k_scales,
        q4k_super_block, tile_words4,
    };
    let w = raw_q4k(w);
    let cols = w.len() / kb;
    debug_assert_eq!(cols % 16, 0);
    let m = xs.len();
    let xs: Vec<&[RawQ8K]> = xs.iter().map(|x| raw_q8k(x)).collect();
    let bsp = bsum_pairs(&xs, kb);
    let row_bytes = kb * std::mem::size_of::<RawQ4K>();
    let x_bytes = kb * std::mem::size_of::<RawQ8K>();
    let groups = cols / 16;
    let ahead = prefetched(groups);
    let wp = w.as_ptr().cast::<u8>();
    // The A operands: tiles of `rows` activation rows, `x_bytes` apart. Where the rows lie that way already (the
    // quantized rows of a block are one vector), whole tiles are read in place; the rest (a last tile of fewer
    // rows, or rows that lie apart) from a copy padded with zero rows.
    let rows = m.min(16);
    let tiles = m.div_ceil(rows);
    let x0 = xs[0].as_ptr().cast::<u8>();
    let contiguous = xs
        .iter()
        .enumerate()
        .all(|(r, x)| x.as_ptr().cast::<u8>() == x0.wrapping_add(r * x_bytes));
    let in_place = if contiguous { m / rows } else { 0 };
    let zero = RawQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
    let mut pad = vec![zero; (tiles - in_place) * rows * kb];
    for (i, x) in xs[in_place * rows..].iter().enumerate() {
        pad[i * kb..(i + 1) * kb].copy_from_slice(&x[..kb]);
    }
    let tile_x = |t: usize| {
        if t < in_place {
            x0.wrapping_add(t * rows * x_bytes)
        } else {
            pad.as_ptr()
                .cast::<u8>()
                .wrapping_add((t - in_place) * rows * x_bytes)
        }
    };
    let qs_at = std::mem::offset_of!(RawQ8K, qs);
    // tmm0, tmm1: L and H (rows x 16 i32); tmm2, tmm3: the activations of even and odd chunks (rows x 64 bytes);
    // tmm4, tmm5 and tmm6, tmm7: their weights times lo and hi (16 x 64 bytes).
    let r8 = rows as u8;
    let cfg = TileConfig::new(&[
        (64, r8),
        (64, r8),
        (64, r8),
        (64, r8),
        (64, 16),
        (64, 16),
        (64, 16),
        (64, 16),
    ]);
    // The B operands of super-block b: `bt[b % 2]`.
    let mut bt = vec![BTiles([[[[0; 64]; 16]; 2]; 4]); 2];
    // L and H of activation tile t: `c[t % 2]`, 16 rows of 16 i32 each.
    let mut c = [[CTile([0; 256]); 2]; 2];
    let (nib, low3, one16) = (
        _mm512_set1_epi8(0xF),
        _mm512_set1_epi32(7),
        _mm512_set1_epi32(0x0001_0001),
    );
    let zf = _mm512_setzero_ps();
    let mut acc = vec![zf; m];
    let mut acc_m = vec![zf; m];
    // SAFETY: the configuration is a valid palette-1 layout; the caller guarantees AMX is usable.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
    for g in 0..groups {
        acc.fill(zf);
        acc_m.fill(zf);
        for b in 0..kb {
            if g < ahead {
                let (next, bytes) = next_group(wp, row_bytes, g);
                prefetch_share(next, bytes, b, kb);
            }
            let tile = wp.wrapping_add((g * kb + b) * Q4K_TILE);
            // SAFETY: tile (g, b) is 16 whole blocks inside `w` (the caller's bounds).
            let (scale, mins, wd, wdm) = q4k_scales(unsafe { tile_words4(tile, 0) });
            // The low and high 3 bits of each sub-block's scale, in both i16 halves of the row's lane.
            let lo: [__m512i; 8] = std::array::from_fn(|s| {
                _mm512_mullo_epi32(_mm512_and_si512(scale[s], low3), one16)
            });
            let hi: [__m512i; 8] = std::array::from_fn(|s| {
                _mm512_mullo_epi32(_mm512_srli_epi32::<3>(scale[s]), one16)
            });
            let bb = &mut bt[b % 2];
            for j in 0..4 {
                // Word t of chunk j: low nibbles values 64j + 4t..+4 (sub-block 2j), high nibbles values
                // 64j + 32 + 4t..+4 (sub-block 2j + 1), of the 16 weight rows: rows t and 8 + t of the B operands.
                let [bl, bh] = &mut bb.0[j];
                for h in 0..2 {
                    // SAFETY: words 8j + 4h..+4 of qs lie inside the tile; the stores fill rows of the
                    // 64-byte-aligned B operands.
                    unsafe {
                        let q = tile_words4(tile, Q4K_QS + 32 * j + 16 * h);
                        for (k, qk) in q.into_iter().enumerate() {
                            let t = 4 * h + k;
                            let (q0, q1) = (
                                _mm512_and_si512(qk, nib),
                                _mm512_and_si512(_mm512_srli_epi32::<4>(qk), nib),
                            );
                            let st = |dst: &mut [u8; 64], v: __m512i| {
                                _mm512_store_si512(dst.as_mut_ptr().cast(), v)
                            };
                            st(&mut bl[t], _mm512_mullo_epi16(q0, lo[2 * j]));
                            st(&mut bl[8 + t], _mm512_mullo_epi16(q1, lo[2 * j + 1]));
                            st(&mut bh[t], _mm512_mullo_epi16(q0, hi[2 * j]));
                            st(&mut bh[8 + t], _mm512_mullo_epi16(q1, hi[2 * j + 1]));
                        }
                    }
                }
            }
            // Tile t's products are read back after tile t + 1's are under way.
            let mut finish = |t: usize, [l, h]: &[CTile; 2]| {
                let (r0, n) = (t * rows, rows.min(m - t * rows));
                for rr in 0..n {
                    // SAFETY: row rr of L and H is 16 i32 inside its CTile.
                    let s = unsafe {
                        let l = _mm512_load_si512(l.0[16 * rr..].as_ptr().cast());
                        let h = _mm512_load_si512(h.0[16 * rr..].as_ptr().cast());
                        _mm512_add_epi32(l, _mm512_slli_epi32::<3>(h))
                    };
                    let r = r0 + rr;
                    let p = &bsp[(r * kb + b) * 4..(r * kb + b) * 4 + 4];
                    q4k_super_block(
                        s,
                        p,
                        &mins,
                        xs[r][b].d,
                        (wd, wdm),
                        (&mut acc[r], &mut acc_m[r]),
                    );
                }
            };
            let bb = &bt[b % 2];
            for t in 0..tiles {
                let a = tile_x(t).wrapping_add(b * std::mem::size_of::<RawQ8K>() + qs_at);
                let [cl, ch] = &mut c[t % 2];
                // Chunk j's weights times lo at byte 2048 j of the super-block's B operands, times hi 1024 after.
                const _: () = assert!(std::mem::size_of::<BTiles>() == 8192);
                // SAFETY: the A operands are `rows` rows of 64 bytes, `x_bytes` apart, inside the activation rows
                // (read in place) or `pad`; the B operands 16 rows of 64 bytes; L and H are stored as `rows` rows of
                // 64 bytes into 16-row CTiles; the tiles were configured above.
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tileloadd tmm2, [{a} + {xs}*1]",
                        "tileloadd tmm4, [{b} + {s64}*1]",
                        "tileloadd tmm5, [{b} + {s64}*1 + 1024]",
                        "tileloadd tmm3, [{a} + {xs}*1 + 64]",
                        "tileloadd tmm6, [{b} + {s64}*1 + 2048]",
                        "tileloadd tmm7, [{b} + {s64}*1 + 3072]",
                        "tdpbsud tmm0, tmm2, tmm4",
                        "tdpbsud tmm1, tmm2, tmm5",
                        "tileloadd tmm2, [{a} + {xs}*1 + 128]",
                        "tileloadd tmm4, [{b} + {s64}*1 + 4096]",
                        "tileloadd tmm5, [{b} + {s64}*1 + 5120]",
                        "tdpbsud tmm0, tmm3, tmm6",
                        "tdpbsud tmm1, tmm3, tmm7",
                        "tileloadd tmm3, [{a} + {xs}*1 + 192]",
                        "tileloadd tmm6, [{b} + {s64}*1 + 6144]",
                        "tileloadd tmm7, [{b} + {s64}*1 + 7168]",
                        "tdpbsud tmm0, tmm2, tmm4",
                        "tdpbsud tmm1, tmm2, tmm5",
                        "tdpbsud tmm0, tmm3, tmm6",
                        "tdpbsud tmm1, tmm3, tmm7",
                        "tilestored [{cl} + {s64}*1], tmm0",
                        "tilestored [{ch} + {s64}*1], tmm1",
                        a = in(reg) a,
                        b = in(reg) (bb as *const BTiles).cast::<u8>(),
                        xs = in(reg) x_bytes,
                        cl = in(reg) cl.0.as_mut_ptr(),
                        ch = in(reg) ch.0.as_mut_ptr(),
                        s64 = in(reg) 64usize,
                        options(nostack),
                    );
                }
                if t > 0 {
                    finish(t - 1, &c[(t - 1) % 2]);
                }
            }
            finish(tiles - 1, &c[(tiles - 1) % 2]);
        }
        for r in 0..m {
            let v = _mm512_sub_ps(acc[r], acc_m[r]);
            // SAFETY: out holds row r's 16 values at r * stride + 16g (the caller's layout).
            unsafe { _mm512_storeu_ps(out[r * stride + 16 * g..][..16].as_mut_ptr(), v) };
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
