//! The engine's own `exp` for f32, written so that one value comes out as the same bits whether it is computed
//! alone (the scalar [`exp`]) or 8 or 16 at a time (AVX2, AVX-512), and the two loops that spend it: the softmax's
//! exponentials with their sum ([`exp_sum`]) and SwiGLU's gate ([`swiglu`]).
//!
//! The C library's `expf`, one value at a time, would run for 12 heads x the keys a row sees and the 8,960 gate
//! values of every layer, a visible share of a pass's CPU time (`perf record -e cpu-clock` of `engine-bench`). It
//! cannot be reproduced lane by lane without copying its tables, so the engine defines its own:
//!
//! `exp(x)`: clamp `x` to `[LO, HI]` (NaN passes), `k = round_ties_even(x * LOG2E)`, `r = x - k ln2` by two fused
//! multiply-adds (ln2 split in an f32 head and tail), `p(r)` the degree-7 Taylor polynomial of `e^r` by Horner's rule
//! in fused multiply-adds, then `(p * 2^k1) * 2^k2` with `k1 = k >> 1`, `k2 = k - k1` (both scales normal floats, so
//! results that underflow come out rounded, and `x >= HI` overflows to infinity). Every step is one IEEE operation
//! (a product, a fused multiply-add, a rounding to an integer), which the vector instructions perform lane by lane
//! with the same rounding, so every path gives the same bits. On `|r| <= ln2 / 2` the polynomial's truncation error
//! is below 6e-9 relative; the result is within 2 units in the last place of `e^x` (tested against f64's `exp`).
//!
//! Every row still computes from its own inputs alone in a fixed order, so batch invariance holds as before
//! (`ops` module contract); outputs differ from the former `expf`'s in the last bits of some exponentials.

/// Above this, `e^x` overflows f32 (`ln(f32::MAX)` is 88.72284).
const HI: f32 = 88.8;
/// Below this, `e^x` rounds to zero in f32 (`ln(2^-150)` is -103.97208).
const LO: f32 = -104.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 rounded to f32, and the rest (-1.9e-9).
const LN2_HI: f32 = std::f32::consts::LN_2;
const LN2_LO: f32 = (std::f64::consts::LN_2 - LN2_HI as f64) as f32;
/// `1/n!` for n = 7 down to 2 (the last two Horner steps add `1` each).
const C: [f32; 6] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// `e^x` by the module's arithmetic (the reference every vector path equals bit for bit).
#[inline]
pub fn exp(x: f32) -> f32 {
    // The clamps as the vector `min`/`max` do them (`a < b ? a : b` with the bound first), so NaN passes through.
    let x = if HI < x { HI } else { x };
    let x = if LO > x { LO } else { x };
    let k = (x * LOG2E).round_ties_even();
    let r = k.mul_add(-LN2_HI, x);
    let r = k.mul_add(-LN2_LO, r);
    let mut p = C[0];
    for c in &C[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // k is a whole number in [-150, 129] (NaN only where x is, and then p is NaN whatever the scales).
    let ki = k as i32;
    let (k1, k2) = (ki >> 1, ki - (ki >> 1));
    let scale = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    (p * scale(k1)) * scale(k2)
}

/// Replaces every `v[i]` by `exp(v[i] - shift)` and returns their sum, added in a fixed order whatever the path:
/// sixteen partial sums, partial `l` taking the values at `i = l mod 16` in order, then partials `l` and `l + 8`,
/// `l + 4`, `l + 2`, `l + 1` added pairwise (the softmax of one head's scores, `shift` their maximum).
pub fn exp_sum(v: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if wide() {
            #[allow(unsafe_code)]
            // SAFETY: AVX-512 F is available (checked once by `wide`).
            return unsafe { exp_sum_avx512(v, shift) };
        }
        if narrow() {
            #[allow(unsafe_code)]
            // SAFETY: AVX2 and FMA are available (checked once by `narrow`).
            return unsafe { exp_sum_avx2(v, shift) };
        }
    }
    exp_sum_portable(v, shift)
}

/// [`exp_sum`] one value at a time (the reference; also the path of CPUs without AVX2).
pub fn exp_sum_portable(v: &mut [f32], shift: f32) -> f32 {
    let mut part = [0f32; 16];
    for (i, x) in v.iter_mut().enumerate() {
        *x = exp(*x - shift);
        part[i % 16] += *x;
    }
    fold16(part)
}

/// The largest of `v` (NaNs skipped; `-inf` for none), the same on every path: the maximum of numbers does not
/// depend on the order they are taken in.
pub fn max_of(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if wide() {
            #[allow(unsafe_code)]
            // SAFETY: AVX-512 F is available (checked once by `wide`).
            return unsafe { max_avx512(v) };
        }
    }
    v.iter().fold(f32::NEG_INFINITY, |a, x| a.max(*x))
}

/// The fixed pairwise sum of sixteen partials: `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
fn fold16(mut p: [f32; 16]) -> f32 {
    for half in [8, 4, 2, 1] {
        for l in 0..half {
            p[l] += p[l + half];
        }
    }
    p[0]
}

/// `gate = silu(gate) * up = gate / (1 + exp(-gate)) * up`, element by element, with [`exp`] on every path.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    {
        if wide() {
            #[allow(unsafe_code)]
            // SAFETY: AVX-512 F is available (checked once by `wide`); it reads the shorter length of the two.
            return unsafe { swiglu_avx512(gate, up) };
        }
        if narrow() {
            #[allow(unsafe_code)]
            // SAFETY: AVX2 and FMA are available (checked once by `narrow`); it reads the shorter length of the two.
            return unsafe { swiglu_avx2(gate, up) };
        }
    }
    swiglu_portable(gate, up)
}

/// [`swiglu`] one value at a time (the reference).
pub fn swiglu_portable(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = (*g / (1.0 + exp(-*g))) * u;
    }
}

#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    })
}

#[cfg(target_arch = "x86_64")]
fn narrow() -> bool {
    static NARROW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NARROW.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

/// [`exp`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_set1_ps(HI), x);
    let x = _mm512_max_ps(_mm512_set1_ps(LO), x);
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(C[0]);
    for c in &C[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let one = _mm512_set1_ps(1.0);
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    let ki = _mm512_cvtps_epi32(k);
    let k1 = _mm512_srai_epi32::<1>(ki);
    let k2 = _mm512_sub_epi32(ki, k1);
    let bias = _mm512_set1_epi32(127);
    let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k1, bias)));
    let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k2, bias)));
    _mm512_mul_ps(_mm512_mul_ps(p, s1), s2)
}

/// [`exp`] on 8 lanes.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(_mm256_set1_ps(HI), x);
    let x = _mm256_max_ps(_mm256_set1_ps(LO), x);
    let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(C[0]);
    for c in &C[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let one = _mm256_set1_ps(1.0);
    p = _mm256_fmadd_ps(p, r, one);
    p = _mm256_fmadd_ps(p, r, one);
    let ki = _mm256_cvtps_epi32(k);
    let k1 = _mm256_srai_epi32::<1>(ki);
    let k2 = _mm256_sub_epi32(ki, k1);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k1, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k2, bias)));
    _mm256_mul_ps(_mm256_mul_ps(p, s1), s2)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn max_avx512(v: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = v.len();
    let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n. `max(x, acc)` returns acc where x is NaN, as f32::max skips it.
        acc = _mm512_max_ps(unsafe { _mm512_loadu_ps(v.as_ptr().add(i)) }, acc);
        i += 16;
    }
    let mut lanes = [0f32; 16];
    // SAFETY: lanes holds 16 f32.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
    v[i..]
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, x| a.max(*x))
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp_sum_avx512(v: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = v.len();
    let s = _mm512_set1_ps(shift);
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        // The tail's missing lanes load and add zeros (exp values are >= +0, so `+ 0.0` leaves a partial as it is).
        let mask: __mmask16 = if n - i >= 16 {
            0xffff
        } else {
            (1u16 << (n - i)) - 1
        };
        // SAFETY: the masked load and store touch only lanes below n - i.
        unsafe {
            let x = _mm512_maskz_loadu_ps(mask, v.as_ptr().add(i));
            let e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, s)));
            _mm512_mask_storeu_ps(v.as_mut_ptr().add(i), mask, e);
            acc = _mm512_add_ps(acc, e);
        }
        i += 16;
    }
    let mut part = [0f32; 16];
    // SAFETY: part holds 16 f32.
    unsafe { _mm512_storeu_ps(part.as_mut_ptr(), acc) };
    fold16(part)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(v: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = v.len();
    let s = _mm256_set1_ps(shift);
    // Partials 0..8 and 8..16.
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let n16 = n / 16 * 16;
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= n.
        unsafe {
            let a = exp8(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr().add(i)), s));
            let b = exp8(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr().add(i + 8)), s));
            _mm256_storeu_ps(v.as_mut_ptr().add(i), a);
            _mm256_storeu_ps(v.as_mut_ptr().add(i + 8), b);
            lo = _mm256_add_ps(lo, a);
            hi = _mm256_add_ps(hi, b);
        }
        i += 16;
    }
    let mut part = [0f32; 16];
    // SAFETY: part holds 16 f32.
    unsafe {
        _mm256_storeu_ps(part.as_mut_ptr(), lo);
        _mm256_storeu_ps(part.as_mut_ptr().add(8), hi);
    }
    for (l, x) in v[n16..].iter_mut().enumerate() {
        *x = exp(*x - shift);
        part[l] += *x;
    }
    fold16(part)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn swiglu_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len());
    let n16 = n / 16 * 16;
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= n for both slices.
        unsafe {
            let g = _mm512_loadu_ps(gate.as_ptr().add(i));
            let u = _mm512_loadu_ps(up.as_ptr().add(i));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            let y = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
            _mm512_storeu_ps(gate.as_mut_ptr().add(i), y);
        }
        i += 16;
    }
    swiglu_portable(&mut gate[n16..n], &up[n16..n]);
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len());
    let n8 = n / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), y);
        }
        i += 8;
    }
    swiglu_portable(&mut gate[n8..n], &up[n8..n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs over the whole range that matters, the edges and the special values.
    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..200_001)
            .map(|i| -110.0 + 200.0 * i as f32 / 200_000.0)
            .collect();
        xs.extend((0..4000).map(|i| (i as f32 - 2000.0) * 1e-3));
        xs.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            88.72,
            88.73,
            -87.33,
            -87.34,
            -103.9,
            -103.98,
            -104.5,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ]);
        xs
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulps_of_the_true_value_and_saturates_at_the_ends() {
        for x in inputs() {
            let got = exp(x);
            let want = (x as f64).exp() as f32;
            if want == 0.0 || want.is_infinite() {
                assert_eq!(got, want, "exp({x})");
            } else if want < f32::MIN_POSITIVE {
                // Subnormal results: the two scalings round once more; a unit of the subnormal scale at most.
                assert!(ulps(got, want) <= 1, "exp({x}) = {got:e}, want {want:e}");
            } else {
                assert!(ulps(got, want) <= 2, "exp({x}) = {got:e}, want {want:e}");
            }
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn every_path_gives_the_scalar_bits() {
        let xs = inputs();
        for n in [0usize, 1, 7, 8, 15, 16, 17, 31, 100, 513, xs.len()] {
            let base: Vec<f32> = xs[..n].to_vec();
            let shift = 1.5f32;
            let mut want = base.clone();
            let want_sum = exp_sum_portable(&mut want, shift);
            let mut paths = vec![("exp_sum", {
                let mut v = base.clone();
                let s = exp_sum(&mut v, shift);
                (v, s)
            })];
            #[cfg(target_arch = "x86_64")]
            {
                if narrow() {
                    let mut v = base.clone();
                    #[allow(unsafe_code)]
                    // SAFETY: checked just above.
                    let s = unsafe { exp_sum_avx2(&mut v, shift) };
                    paths.push(("avx2", (v, s)));
                }
                if wide() {
                    let mut v = base.clone();
                    #[allow(unsafe_code)]
                    // SAFETY: checked just above.
                    let s = unsafe { exp_sum_avx512(&mut v, shift) };
                    paths.push(("avx512", (v, s)));
                }
            }
            for (name, (v, s)) in paths {
                for (i, (a, b)) in v.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{name}: n {n}, value {i}");
                }
                assert_eq!(s.to_bits(), want_sum.to_bits(), "{name}: sum of {n}");
            }
            let plain = base.iter().fold(f32::NEG_INFINITY, |a, x| a.max(*x));
            assert_eq!(max_of(&base).to_bits(), plain.to_bits(), "max of {n}");
            // The values, one by one, are the scalar function's.
            for (i, (a, x)) in want.iter().zip(&base).enumerate() {
                assert_eq!(a.to_bits(), exp(*x - shift).to_bits(), "value {i}");
            }

            let up: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.37 - 2.0).collect();
            let gate: Vec<f32> = base.iter().map(|x| x * 0.25).collect();
            let mut want = gate.clone();
            swiglu_portable(&mut want, &up);
            let mut got = gate.clone();
            swiglu(&mut got, &up);
            let mut all = vec![("swiglu", got)];
            #[cfg(target_arch = "x86_64")]
            {
                if narrow() {
                    let mut v = gate.clone();
                    #[allow(unsafe_code)]
                    // SAFETY: checked just above.
                    unsafe {
                        swiglu_avx2(&mut v, &up)
                    };
                    all.push(("swiglu avx2", v));
                }
                if wide() {
                    let mut v = gate.clone();
                    #[allow(unsafe_code)]
                    // SAFETY: checked just above.
                    unsafe {
                        swiglu_avx512(&mut v, &up)
                    };
                    all.push(("swiglu avx512", v));
                }
            }
            for (name, v) in all {
                for (i, (a, b)) in v.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{name}: n {n}, value {i}");
                }
            }
        }
    }

    #[test]
    fn the_sum_takes_the_fixed_order() {
        // 17 values: partial 0 holds values 0 and 16; every other partial one value.
        let mut v: Vec<f32> = (0..17).map(|i| i as f32 * 0.1).collect();
        let shift = 0.0;
        let e: Vec<f32> = v.iter().map(|x| exp(*x)).collect();
        let mut part = [0f32; 16];
        part.copy_from_slice(&e[..16]);
        part[0] += e[16];
        let want = fold16(part);
        assert_eq!(exp_sum(&mut v, shift).to_bits(), want.to_bits());
        // and the pairs of the fold: ((p0 + p8) + (p4 + p12)) + ...
        let p = part;
        let q: Vec<f32> = (0..8).map(|l| p[l] + p[l + 8]).collect();
        let r: Vec<f32> = (0..4).map(|l| q[l] + q[l + 4]).collect();
        let s = [r[0] + r[2], r[1] + r[3]];
        assert_eq!(want.to_bits(), (s[0] + s[1]).to_bits());
    }
}
