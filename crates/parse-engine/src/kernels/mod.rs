//! CPU dot kernels for the engine's weight formats, chosen at run time by CPU feature.
//!
//! Each format has one arithmetic definition, written out without SIMD in a `*_dot_scalar` function; every SIMD
//! variant (AVX2, AVX-512 VNNI, AMX tiles) computes exactly that arithmetic, so all variants give bitwise the same
//! results and a token's logits do not depend on the machine's kernel choice, nor on the rows that share a call:
//! - the integer products of a block are summed exactly (into the whole block's integer, or into fixed lanes where
//!   the definition keeps lanes), so how the instructions group them cannot change the sums;
//! - floats accumulate in a fixed order (`fma(d_x * d_w, integer as f32, acc)` over blocks), and lanes, where there
//!   are any, are summed in a fixed tree at the end.
//!
//! Per format:
//! - Q4_K x Q8_K: a super-block's scaled products and its min term are exact integers `S` and `M`;
//!   `acc = fma(d_x * d_w, S as f32, acc)` and `acc_m = fma(d_x * dmin_w, M as f32, acc_m)` in two chains, and the
//!   dot product is `acc - acc_m` (a whole-super-block integer is what AMX tiles produce, so they can share it).
//! - Q6_K x Q8_K: a super-block's whole integer sum `S` is exact; `acc = fma(d_x * d_w, S as f32, acc)` in one chain.
//! - Q8_0 and Q5_0 x Q8_0: a block's 32 products sum exactly to an integer `S`; block `b` accumulates into lane `b % 8` as
//!   `fma(d_x * d_w, S as f32, acc)`, and the 8 lanes are summed in the tree. One float step per block rather than
//!   per 4 products: the row groups spend a `vpdpbusd` chain per block and one `fma`, the panels reduce 8 blocks'
//!   lane sums together.
//!
//! A call computes one weight row against up to [`TILE_ROWS`] activation rows (each weight block is unpacked once
//! for all of them); a *panel* runs that over a run of weight rows, so the kernel choice is made once per panel.
//! Blocks of many rows take other paths with the same arithmetic: the AMX tiles ([`amx`]), and without AMX on
//! AVX-512 VNNI the row groups ([`groups`]: 16 weight rows in the lanes of a vector, every row of the block), and
//! on AVX2 Q5_0 in its 8-row lanes layout and Q4_K in the lanes layout ([`q5_0_lanes8`], [`q4k_lanes8`]: 8 weight
//! rows in the lanes of a vector, every block size).
//! `PARSE_CPU_KERNELS=scalar|avx2|vnni|amx` forces a variant (tests, benchmarks); by default the best one the CPU
//! supports is used, and the engine logs it.

use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, BlockQ8K};
use half::f16;

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub use avx2::{q4k_lanes8, q5_0_lanes8};
pub mod choose;
#[cfg(target_arch = "x86_64")]
pub mod groups;
#[cfg(target_arch = "x86_64")]
mod vnni;

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
#[derive(Clone, Copy)]
struct RawQ8K {
    d: f32,
    qs: [i8; QK_K],
    bsums: [i16; QK_K / 16],
}

/// Blocks of at most this many rows take the VNNI Q4_K lanes kernel's words as they use them ([`streamed_q4k`]);
/// larger blocks hold a chunk's 16 words in registers for every row, which pays once enough rows share them.
#[cfg(target_arch = "x86_64")]
const STREAMED_Q4K_MAX_ROWS: usize = 16;

/// Whether a block of `m` rows takes the streamed words.
#[cfg(target_arch = "x86_64")]
fn streamed_q4k(m: usize) -> bool {
    m <= STREAMED_Q4K_MAX_ROWS
}

/// Whether the row-group kernels prefetch the next group's weights into every cache level (`prefetcht0`) rather
/// than into L2 (`prefetcht1`): on AMD CPUs only. Zen 4 and later take `prefetcht1` into L2 alone, and such
/// prefetches are at times dropped there (the data left in memory); Intel CPUs keep `prefetcht1`. The AVX2 kernels
/// prefetch with `prefetcht0` everywhere. The hint changes timing only, never a result.
#[cfg(target_arch = "x86_64")]
fn prefetch_l1() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(amd_cpu)
}

/// Whether the CPU's vendor string is AMD's.
#[cfg(target_arch = "x86_64")]
pub(crate) fn amd_cpu() -> bool {
    let r = std::arch::x86_64::__cpuid(0);
    let mut vendor = [0u8; 12];
    vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
    vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
    vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
    &vendor == b"AuthenticAMD"
}

/// The CPU's family as its vendors number them (CPUID leaf 1: the base family, plus the extended family where the base
/// reads 15): on AMD 23 for Zen, Zen+ and Zen 2, 25 for Zen 3 and Zen 4, 26 for Zen 5; on Intel's cores 6.
#[cfg(target_arch = "x86_64")]
pub(crate) fn cpu_family() -> u32 {
    let eax = std::arch::x86_64::__cpuid(1).eax;
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
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
fn lane_tree(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Reference definition of the dot product of one Q4_K row with one Q8_K row (no SIMD). Per super-block, the
/// scaled products and the min term are exact integers `S` and `M`; `acc = fma(d_x * d_w, S, acc)` and
/// `acc_m = fma(d_x * dmin_w, M, acc_m)` run in two chains, and the result is `acc - acc_m`.
#[allow(clippy::needless_range_loop)] // the byte index addresses weights and activations alike
pub fn q4k_dot_scalar(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    let (w, x) = (raw_q4k(w), raw_q8k(x));
    let mut acc = 0f32;
    let mut acc_m = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let (sc, m) = scales_mins(&wb.scales);
        let mut s = 0i32;
        for j in 0..4 {
            let q = &wb.qs[32 * j..32 * j + 32];
            let (mut lo, mut hi) = (0i32, 0i32);
            for b in 0..32 {
                lo += (q[b] & 0xF) as i32 * xb.qs[64 * j + b] as i32;
                hi += (q[b] >> 4) as i32 * xb.qs[64 * j + 32 + b] as i32;
            }
            s += sc[2 * j] as i32 * lo + sc[2 * j + 1] as i32 * hi;
        }
        let mins: i32 = min_lanes(&m, &xb.bsums).iter().sum();
        acc = (xb.d * f16::from_bits(wb.d).to_f32()).mul_add(s as f32, acc);
        acc_m = (xb.d * f16::from_bits(wb.dmin).to_f32()).mul_add(mins as f32, acc_m);
    }
    acc - acc_m
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

/// Byte layout of a Q8_0 block (ggml's `block_q8_0`).
#[repr(C)]
struct RawQ8_0 {
    d: u16,
    qs: [i8; 32],
}

/// Byte layout of a Q5_0 block (ggml's `block_q5_0`).
#[repr(C)]
struct RawQ5_0 {
    d: u16,
    qh: [u8; 4],
    qs: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<RawQ8_0>() == std::mem::size_of::<BlockQ8_0>());
const _: () = assert!(std::mem::align_of::<RawQ8_0>() == std::mem::align_of::<BlockQ8_0>());
const _: () = assert!(std::mem::size_of::<RawQ5_0>() == std::mem::size_of::<BlockQ5_0>());
const _: () = assert!(std::mem::align_of::<RawQ5_0>() == std::mem::align_of::<BlockQ5_0>());

#[allow(unsafe_code)]
fn raw_q8_0(xs: &[BlockQ8_0]) -> &[RawQ8_0] {
    // SAFETY: candle's BlockQ8_0 is `#[repr(C)] { d: f16, qs: [i8; 32] }`, the same fields in the same order as
    // RawQ8_0; size and alignment equality is asserted at compile time above.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<RawQ8_0>(), xs.len()) }
}

#[allow(unsafe_code)]
fn raw_q5_0(xs: &[BlockQ5_0]) -> &[RawQ5_0] {
    // SAFETY: candle's BlockQ5_0 is `#[repr(C)] { d: f16, qh: [u8; 4], qs: [u8; 16] }`, the same fields in the same
    // order as RawQ5_0; size and alignment equality is asserted at compile time above.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<RawQ5_0>(), xs.len()) }
}

/// Activation rows quantized to 8 bits in blocks of 32 (ggml's Q8_0 rounding), laid out for the 32-wide kernels:
/// per block its scale as f32, its 32 values, and `-16 *` and `-128 *` their sum (`off5`, `off8`): what unsigned
/// Q5_0 weights (`weight + 16`) and unsigned Q8_0 weights (`weight + 128`) add to the block's products, taken back.
#[derive(Debug, Clone, Default)]
pub struct Act32 {
    kb: usize,
    d: Vec<f32>,
    qs: Vec<i8>,
    off5: Vec<i32>,
    off8: Vec<i32>,
}

/// One row of an [`Act32`].
#[derive(Clone, Copy)]
pub struct Act32Row<'a> {
    d: &'a [f32],
    qs: &'a [i8],
    off5: &'a [i32],
    off8: &'a [i32],
}

impl Act32 {
    /// Quantizes `m` rows of `k` values (`k` a multiple of 32).
    pub fn quantize(x: &[f32], k: usize, m: usize) -> Self {
        use candle_core::quantized::k_quants::GgmlType;
        let kb = k / 32;
        let mut blocks = vec![BlockQ8_0::zeros(); kb];
        let mut a = Act32 {
            kb,
            d: Vec::with_capacity(m * kb),
            qs: Vec::with_capacity(m * k),
            off5: Vec::with_capacity(m * kb),
            off8: Vec::with_capacity(m * kb),
        };
        for row in x.chunks(k).take(m) {
            BlockQ8_0::from_float(row, &mut blocks);
            for b in raw_q8_0(&blocks) {
                a.d.push(f16::from_bits(b.d).to_f32());
                a.qs.extend_from_slice(&b.qs);
                let sum = b.qs.iter().map(|&v| v as i32).sum::<i32>();
                a.off5.push(-16 * sum);
                a.off8.push(-128 * sum);
            }
        }
        a
    }

    pub fn row(&self, r: usize) -> Act32Row<'_> {
        let kb = self.kb;
        Act32Row {
            d: &self.d[r * kb..(r + 1) * kb],
            qs: &self.qs[r * kb * 32..(r + 1) * kb * 32],
            off5: &self.off5[r * kb..(r + 1) * kb],
            off8: &self.off8[r * kb..(r + 1) * kb],
        }
    }
}

/// The dot products of `R` rows from their 8 lanes of a 32-wide definition, summed in `lane_tree`'s order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
#[allow(unsafe_code)]
fn lanes_out<const R: usize>(acc: [std::arch::x86_64::__m256; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, a) in out.iter_mut().zip(acc) {
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 f32.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        *o = lane_tree(lanes);
    }
    out
}

/// Reference definition of the dot product of one Q8_0 row with one activation row (no SIMD): per block the exact
/// integer sum of its 32 products, accumulated into lane `b % 8`.
pub fn q8_0_dot_scalar(w: &[BlockQ8_0], x: Act32Row<'_>) -> f32 {
    let w = raw_q8_0(w);
    let mut acc = [0f32; 8];
    for (b, wb) in w.iter().enumerate() {
        let d = f16::from_bits(wb.d).to_f32() * x.d[b];
        let s: i32 = (0..32)
            .map(|i| wb.qs[i] as i32 * x.qs[32 * b + i] as i32)
            .sum();
        acc[b % 8] = d.mul_add(s as f32, acc[b % 8]);
    }
    lane_tree(acc)
}

/// The 32 weights of a Q5_0 block, each in `-16..16`.
#[inline]
fn q5_0_values(b: &RawQ5_0) -> [i32; 32] {
    let qh = u32::from_le_bytes(b.qh);
    std::array::from_fn(|i| {
        let low = if i < 16 {
            b.qs[i] & 0xF
        } else {
            b.qs[i - 16] >> 4
        };
        (low as i32 | ((((qh >> i) & 1) as i32) << 4)) - 16
    })
}

/// A 32-value block with an f16 scale.
trait Scaled {
    fn d_bits(&self) -> u16;
}

impl Scaled for RawQ5_0 {
    fn d_bits(&self) -> u16 {
        self.d
    }
}

impl Scaled for RawQ8_0 {
    fn d_bits(&self) -> u16 {
        self.d
    }
}

/// The scales of 32-value blocks `b0..b0 + n` (`n <= 8`) as f32 in the lanes of a vector, zeros after: put into a
/// vector one by one (storing them and loading the vector stalls on the store, which cost the one-token step a
/// third of its time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn scales8<B: Scaled>(w: &[B], b0: usize, n: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let mut v = _mm_setzero_si128();
    macro_rules! put {
        ($($j:literal),*) => {
            $(if $j < n {
                v = _mm_insert_epi16::<$j>(v, w[b0 + $j].d_bits() as i32);
            })*
        };
    }
    put!(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cvtph_ps(v)
}

/// Reference definition of the dot product of one Q5_0 row with one activation row (no SIMD): per block the exact
/// integer sum of its 32 products, accumulated into lane `b % 8`.
pub fn q5_0_dot_scalar(w: &[BlockQ5_0], x: Act32Row<'_>) -> f32 {
    let w = raw_q5_0(w);
    let mut acc = [0f32; 8];
    for (b, wb) in w.iter().enumerate() {
        let d = f16::from_bits(wb.d).to_f32() * x.d[b];
        let v = q5_0_values(wb);
        let s: i32 = (0..32).map(|i| v[i] * x.qs[32 * b + i] as i32).sum();
        acc[b % 8] = d.mul_add(s as f32, acc[b % 8]);
    }
    lane_tree(acc)
}

/// A family of kernel variants, from slowest to fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kernels {
    /// The definitions without SIMD (any CPU).
    Scalar,
    /// AVX2 + FMA (`maddubs` + `madd` per 32 products).
    Avx2,
    /// AVX-512 with VNNI (`vpdpbusd`: 64 products per instruction).
    Vnni,
    /// The VNNI variant, with AMX-INT8 tile multiplies for Q4_K and Q6_K blocks of [`amx::MIN_ROWS`] rows or more.
    Amx,
}

impl Kernels {
    pub const ALL: [Kernels; 4] = [Kernels::Scalar, Kernels::Avx2, Kernels::Vnni, Kernels::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Scalar => "scalar",
            Kernels::Avx2 => "avx2",
            Kernels::Vnni => "vnni",
            Kernels::Amx => "amx",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Ok(Kernels::Scalar),
            "avx2" => Ok(Kernels::Avx2),
            "vnni" | "avx512" | "avx512vnni" => Ok(Kernels::Vnni),
            "amx" => Ok(Kernels::Amx),
            other => Err(format!(
                "unknown CPU kernels `{other}` (scalar, avx2, vnni or amx)"
            )),
        }
    }

    /// Whether this CPU can run the variant.
    pub fn supported(self) -> bool {
        match self {
            Kernels::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernels::Vnni => {
                Kernels::Avx2.supported()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Kernels::Amx => Kernels::Vnni.supported() && amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest variant this CPU supports.
    pub fn best() -> Self {
        Kernels::ALL
            .into_iter()
            .rev()
            .find(|k| k.supported())
            .unwrap_or(Kernels::Scalar)
    }

    fn code(self) -> u8 {
        self as u8 + 1
    }

    fn from_code(c: u8) -> Option<Self> {
        Kernels::ALL.get((c as usize).checked_sub(1)?).copied()
    }
}

impl std::fmt::Display for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// 0: not chosen yet; otherwise `Kernels::code`.
static ACTIVE: AtomicU8 = AtomicU8::new(0);

/// The variant every matmul uses: `PARSE_CPU_KERNELS` if set (an unknown or unsupported value is logged and the
/// best supported variant used instead), else the best this CPU supports. Chosen once per process.
pub fn active() -> Kernels {
    if let Some(k) = Kernels::from_code(ACTIVE.load(Ordering::Relaxed)) {
        return k;
    }
    let best = Kernels::best();
    let chosen = match std::env::var(parse_core::env::CPU_KERNELS) {
        Ok(v) if !v.trim().is_empty() => match Kernels::parse(&v) {
            Ok(k) if k.supported() => k,
            Ok(k) => {
                tracing::warn!(requested = %k, using = %best, "PARSE_CPU_KERNELS: this CPU lacks the features");
                best
            }
            Err(e) => {
                tracing::warn!(using = %best, "PARSE_CPU_KERNELS: {e}");
                best
            }
        },
        _ => best,
    };
    match ACTIVE.compare_exchange(0, chosen.code(), Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => {
            tracing::info!(kernels = %chosen, best = %best, "CPU kernels chosen");
            chosen
        }
        Err(c) => Kernels::from_code(c).unwrap_or(chosen),
    }
}

/// Quantizes `x` (rows of whole 256-value blocks) to Q8_K, the activation format of the K-quant kernels, with
/// exactly the rounding of candle's `BlockQ8K::from_float` on every variant (AVX-512 where the active variant has
/// it, AVX2 where it has that; tested equal), blocks of rows shared among the threads so that no thread waits on
/// the caller to quantize every layer's input.
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    use rayon::prelude::*;
    // Blocks are quantized one by one, so any split gives the same bits: a block of rows (8 rows of an 8,960-wide
    // input are 280 blocks) is shared among the threads, where a single row would cost more to hand out.
    const SHARED_FROM: usize = 64;
    const SHARE: usize = 16;
    let x = &x[..QK_K * out.len()];
    if out.len() >= SHARED_FROM && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(SHARE)
            .zip(x.par_chunks(QK_K * SHARE))
            .for_each(|(o, x)| quantize_q8k_blocks(x, o));
    } else {
        quantize_q8k_blocks(x, out);
    }
}

/// [`quantize_q8k`] on this thread.
fn quantize_q8k_blocks(x: &[f32], out: &mut [BlockQ8K]) {
    use candle_core::quantized::k_quants::GgmlType;
    #[cfg(target_arch = "x86_64")]
    if active() >= Kernels::Vnni {
        #[allow(unsafe_code)]
        // SAFETY: the active variant (VNNI or AMX) implies AVX-512 F/BW/VL/DQ.
        unsafe {
            vnni::quantize_q8k_avx512(x, out)
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if active() >= Kernels::Avx2 {
        #[allow(unsafe_code)]
        // SAFETY: the active variant implies AVX2; `x` holds 256 values for every block of `out` (the caller's).
        unsafe {
            avx2::quantize_q8k_avx2(x, out)
        };
        return;
    }
    BlockQ8K::from_float(x, out)
}

/// Whether a block of `m` rows goes to the AMX tiles (the active variant is AMX and the block is large enough).
pub fn use_amx(m: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        m >= amx_min_rows() && active() == Kernels::Amx
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = m;
        false
    }
}

/// Whether a block of `m` rows of an `n` x `k` Q4_K matrix in the lanes layout goes to the AMX tiles
/// ([`amx::q4k_lanes`]: `groups` in the pick) or to the row groups ([`groups::q4k_lanes`]: the pick's "panels"):
/// never without the AMX variant, and with it by timing ([`choose`], under the format `Q4_K lanes: tiles or row
/// groups`). The row groups read the layout as it lies; the tiles must scale every weight into a B operand first,
/// whatever the rows, so few rows favour the groups and many the tiles, with a crossing that differs by CPU.
pub fn amx_lanes(n: usize, k: usize, m: usize) -> choose::Pick<'static> {
    #[cfg(target_arch = "x86_64")]
    {
        if active() != Kernels::Amx {
            return choose::Pick::fixed(false);
        }
        choose::chooser().pick(choose::Key {
            format: "Q4_K lanes: tiles or row groups",
            n,
            k,
            m,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (n, k, m);
        choose::Pick::fixed(false)
    }
}

/// The fewest rows a block sends to the AMX tiles.
#[cfg(target_arch = "x86_64")]
fn amx_min_rows() -> usize {
    amx::MIN_ROWS
}

/// The kernel for a block of `m` rows of a Q4_K or Q6_K matrix of `n` rows by `k` columns: the row groups of
/// [`groups`] or the panels. Only with an AVX-512 VNNI variant active and where the block does not go to the AMX
/// tiles; then by timing ([`choose`]).
pub fn groups_k(format: &'static str, n: usize, k: usize, m: usize) -> choose::Pick<'static> {
    #[cfg(target_arch = "x86_64")]
    {
        if active() < Kernels::Vnni || use_amx(m) {
            return choose::Pick::fixed(false);
        }
        choose::chooser().pick(choose::Key { format, n, k, m })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, n, k, m);
        choose::Pick::fixed(false)
    }
}

/// The kernel for a block of `m` rows of a Q5_0 or Q8_0 matrix ([`groups::q5_0_groups`], [`groups::q8_0_groups`]
/// or the panels), chosen by timing as [`groups_k`] chooses.
pub fn groups_32(format: &'static str, n: usize, k: usize, m: usize) -> choose::Pick<'static> {
    #[cfg(target_arch = "x86_64")]
    {
        if active() < Kernels::Vnni {
            return choose::Pick::fixed(false);
        }
        choose::chooser().pick(choose::Key { format, n, k, m })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, n, k, m);
        choose::Pick::fixed(false)
    }
}

/// Switches every later matmul of this process to `k` (tests and benchmarks compare variants in one process).
pub fn set_active(k: Kernels) -> Result<(), String> {
    if !k.supported() {
        return Err(format!("this CPU cannot run the {k} kernels"));
    }
    ACTIVE.store(k.code(), Ordering::Relaxed);
    Ok(())
}

/// Runs a panel: `out[r * stride + c] = dot(W[c], xs[r])` for every weight row `c` of `w` (`kb` blocks each) and
/// activation row `r < xs.len() <= TILE_ROWS`, with the variant `k` (which must be supported; the caller took it
/// from [`active`]).
macro_rules! panel {
    ($k:expr, $w:expr, $kb:expr, $xs:expr, $out:expr, $stride:expr, $scalar:path, $avx2:path, $vnni:path) => {{
        let (k, w, kb, xs, out, stride) = ($k, $w, $kb, $xs, $out, $stride);
        debug_assert!(xs.len() <= TILE_ROWS && kb > 0 && w.len() % kb == 0);
        match k {
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            // SAFETY: `k` is supported by this CPU (set_active and active() only hand out supported variants).
            Kernels::Avx2 => unsafe { $avx2(w, kb, xs, out, stride) },
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            // SAFETY: as above (AMX implies VNNI).
            Kernels::Vnni | Kernels::Amx => unsafe { $vnni(w, kb, xs, out, stride) },
            _ => {
                for (c, wc) in w.chunks(kb).enumerate() {
                    for (r, x) in xs.iter().enumerate() {
                        out[r * stride + c] = $scalar(wc, *x);
                    }
                }
            }
        }
    }};
}

pub fn q4k_panel(
    k: Kernels,
    w: &[BlockQ4K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    panel!(
        k,
        w,
        kb,
        xs,
        out,
        stride,
        q4k_dot_scalar,
        avx2::q4k_panel,
        vnni::q4k_panel
    )
}

pub fn q6k_panel(
    k: Kernels,
    w: &[BlockQ6K],
    kb: usize,
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
    stride: usize,
) {
    panel!(
        k,
        w,
        kb,
        xs,
        out,
        stride,
        q6k_dot_scalar,
        avx2::q6k_panel,
        vnni::q6k_panel
    )
}

pub fn q8_0_panel(
    k: Kernels,
    w: &[BlockQ8_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    panel!(
        k,
        w,
        kb,
        xs,
        out,
        stride,
        q8_0_dot_scalar,
        avx2::q8_0_panel,
        vnni::q8_0_panel
    )
}

pub fn q5_0_panel(
    k: Kernels,
    w: &[BlockQ5_0],
    kb: usize,
    xs: &[Act32Row<'_>],
    out: &mut [f32],
    stride: usize,
) {
    panel!(
        k,
        w,
        kb,
        xs,
        out,
        stride,
        q5_0_dot_scalar,
        avx2::q5_0_panel,
        vnni::q5_0_panel
    )
}

/// How far ahead of the weight row being computed a panel prefetches, in bytes (whole rows; measured on the default
/// target with `engine-bench`: 1.5 KB decoded 3%, 11% and 14% faster than 2, 4 and 8 KB).
const PREFETCH_BYTES: usize = 1536;

/// Expands to a `#[target_feature]` panel function for one format: a loop over weight rows that calls the
/// variant's tile kernel `$tile::<R>` (instantiated for 1..=TILE_ROWS activation rows, or the sizes listed,
/// inlined into the loop).
macro_rules! panel_fn {
    ($name:ident, $tile:ident, $feat:literal, $w:ty, $x:ty) => {
        panel_fn!($name, $tile, $feat, $w, $x, [1, 2, 3, 4, 5, 6, 7, 8]);
    };
    ($name:ident, $tile:ident, $feat:literal, $w:ty, $x:ty, [$($rows:literal),+]) => {
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(w: &[$w], kb: usize, xs: &[$x], out: &mut [f32], stride: usize) {
            #[target_feature(enable = $feat)]
            unsafe fn run<const R: usize>(
                w: &[$w],
                kb: usize,
                xs: &[$x],
                out: &mut [f32],
                stride: usize,
            ) {
                let xs: &[$x; R] = xs.try_into().expect("tile size");
                let row_bytes = kb * std::mem::size_of::<$w>();
                let ahead_rows = PREFETCH_BYTES.div_ceil(row_bytes).max(1);
                for (c, wc) in w.chunks_exact(kb).enumerate() {
                    // Decode streams the weights once: ask for the row after next while this one is computed.
                    if let Some(ahead) = w.get((c + ahead_rows) * kb) {
                        let p = (ahead as *const $w).cast::<i8>();
                        for off in (0..row_bytes).step_by(64) {
                            // SAFETY: the row `ahead` starts has `row_bytes` bytes; prefetching never faults.
                            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(off)) };
                        }
                    }
                    // SAFETY: the caller's CPU has the features this function was compiled for.
                    let d: [f32; R] = unsafe { $tile::<R>(wc, xs) };
                    for (r, v) in d.into_iter().enumerate() {
                        out[r * stride + c] = v;
                    }
                }
            }
            // SAFETY: as above; each arm instantiates `run` for the tile size it matched.
            unsafe {
                match xs.len() {
                    0 => {}
                    $($rows => run::<$rows>(w, kb, xs, out, stride),)+
                    n => unreachable!("{} panel called with {n} activation rows", stringify!($name)),
                }
            }
        }
    };
}
use panel_fn;

/// Defines `$name::<R>`, a tile that runs `$one` (horizontal sums per super-block) for one activation row and
/// `$rows` (the rows' sums reduced together) for several; `R` is a constant, so the branch goes at compile time.
macro_rules! tile_any_fn {
    ($name:ident, $one:ident, $rows:ident, $feat:literal, $w:ty) => {
        #[target_feature(enable = $feat)]
        #[inline]
        unsafe fn $name<const R: usize>(w: &[$w], xs: &[&[BlockQ8K]; R]) -> [f32; R] {
            // SAFETY: the caller's CPU has this function's features, which both tiles need.
            unsafe { if R == 1 { $one(w, xs) } else { $rows(w, xs) } }
        }
    };
}
use tile_any_fn;

#[cfg(test)]
mod tests;
