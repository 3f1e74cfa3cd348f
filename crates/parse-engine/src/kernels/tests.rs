use super::*;
use candle_core::quantized::k_quants::GgmlType;
use rand::{Rng, SeedableRng};

fn blocks<T: GgmlType>(data: &[f32]) -> Vec<T> {
    let mut b = vec![T::zeros(); data.len() / T::BLCK_SIZE];
    T::from_float(data, &mut b);
    b
}

fn random(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The variants this CPU can run, saying which it cannot.
fn variants() -> Vec<Kernels> {
    Kernels::ALL
        .into_iter()
        .filter(|k| {
            let ok = k.supported();
            if !ok {
                eprintln!("skipping the {k} kernels: this CPU lacks the features");
            }
            ok
        })
        .collect()
}

/// Runs `panel` for every supported variant and tile size over 5 weight rows and checks every output against
/// the scalar definition bit for bit.
fn check<W: Clone, X: Copy>(
    name: &str,
    w: &[W],
    kb: usize,
    xs: &[X],
    panel: impl Fn(Kernels, &[W], usize, &[X], &mut [f32], usize),
    scalar: impl Fn(&[W], X) -> f32,
) {
    let cols = w.len() / kb;
    for k in variants() {
        for n in 1..=TILE_ROWS {
            let stride = cols + 3;
            let mut out = vec![f32::NAN; n * stride];
            panel(k, w, kb, &xs[..n], &mut out, stride);
            for r in 0..n {
                for c in 0..cols {
                    let want = scalar(&w[c * kb..(c + 1) * kb], xs[r]);
                    let got = out[r * stride + c];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{name} {k}: tile of {n}, row {r}, col {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_variant_equals_the_scalar_definition_bit_for_bit() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let kb = 6;
    let k = kb * QK_K;
    let w = random(&mut rng, 5 * k, 1.0);
    let xf: Vec<Vec<f32>> = (0..TILE_ROWS).map(|_| random(&mut rng, k, 3.0)).collect();
    let x8k: Vec<Vec<BlockQ8K>> = xf.iter().map(|x| blocks::<BlockQ8K>(x)).collect();
    let refs: Vec<&[BlockQ8K]> = x8k.iter().map(|r| r.as_slice()).collect();
    check(
        "q4k",
        &blocks::<BlockQ4K>(&w),
        kb,
        &refs,
        q4k_panel,
        q4k_dot_scalar,
    );
    check(
        "q6k",
        &blocks::<BlockQ6K>(&w),
        kb,
        &refs,
        q6k_panel,
        q6k_dot_scalar,
    );
    // 32-wide formats: an even and an odd number of blocks per row, and whole groups of 8 and a tail.
    for kb32 in [kb * 8, 7, 13] {
        let k32 = kb32 * 32;
        let w32 = random(&mut rng, 5 * k32, 1.0);
        let x: Vec<f32> = xf
            .iter()
            .flat_map(|r| r[..k32.min(k)].to_vec())
            .collect::<Vec<_>>();
        let x = if k32 <= k {
            x
        } else {
            random(&mut rng, TILE_ROWS * k32, 3.0)
        };
        let act = Act32::quantize(&x, k32, TILE_ROWS);
        let rows: Vec<Act32Row<'_>> = (0..TILE_ROWS).map(|r| act.row(r)).collect();
        check(
            "q8_0",
            &blocks::<BlockQ8_0>(&w32),
            kb32,
            &rows,
            q8_0_panel,
            q8_0_dot_scalar,
        );
        check(
            "q5_0",
            &blocks::<BlockQ5_0>(&w32),
            kb32,
            &rows,
            q5_0_panel,
            q5_0_dot_scalar,
        );
    }
}

/// Sets the first super-block of the first 16 Q6_K rows (`kb` blocks each) at the extremes of the scaled weights:
/// every weight -32 or 31, every group scale -128 or 127 (products -4064..=4096).
fn q6k_extremes(w6: &mut [BlockQ6K], kb: usize) {
    for (n, b) in w6.iter_mut().step_by(kb).take(16).enumerate() {
        #[allow(unsafe_code)]
        // SAFETY: BlockQ6K and RawQ6K have the same layout (asserted at compile time above).
        let raw = unsafe { &mut *(b as *mut BlockQ6K).cast::<RawQ6K>() };
        let q: u8 = if n % 2 == 0 { 0 } else { 63 };
        raw.ql = [(q & 0xF) | ((q & 0xF) << 4); 128];
        let h = q >> 4;
        raw.qh = [h | (h << 2) | (h << 4) | (h << 6); 64];
        raw.scales = [if n % 4 < 2 { -128 } else { 127 }; 16];
    }
}

/// Checks `out[r * stride + c]` against `want(r, c)` bit for bit for `m` rows and `cols` columns.
fn check_block(
    name: &str,
    out: &[f32],
    stride: usize,
    m: usize,
    cols: usize,
    want: impl Fn(usize, usize) -> f32,
) {
    for r in 0..m {
        for c in 0..cols {
            let (got, want) = (out[r * stride + c], want(r, c));
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{name} m {m}, row {r}, col {c}: {got} vs {want}"
            );
        }
    }
}

/// The first super-block of the first 16 Q4_K rows (of `kb` blocks) at the extremes: every nibble 15, every
/// scale and min 63 (the 6-bit fields all ones), and d, dmin of both signs.
#[cfg(target_arch = "x86_64")]
fn q4k_extremes(w: &mut [BlockQ4K], kb: usize) {
    for (n, b) in w.iter_mut().step_by(kb).take(16).enumerate() {
        #[allow(unsafe_code)]
        // SAFETY: BlockQ4K and RawQ4K have the same layout (asserted at compile time above).
        let raw = unsafe { &mut *(b as *mut BlockQ4K).cast::<RawQ4K>() };
        raw.qs = [if n % 2 == 0 { 0xFF } else { 0x0F }; 128];
        raw.scales = [0xFF; 12];
        if n % 3 == 0 {
            raw.d = f16::from_f32(-0.01).to_bits();
            raw.dmin = f16::from_f32(0.02).to_bits();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn row_groups_equal_the_scalar_definition_bit_for_bit() {
    if !Kernels::Vnni.supported() {
        eprintln!("skipping the row-group kernels: this CPU lacks AVX-512 VNNI");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let (kb, cols) = (3, 48);
    let k = kb * QK_K;
    let wf = random(&mut rng, cols * k, 1.0);
    let mut w = blocks::<BlockQ4K>(&wf);
    q4k_extremes(&mut w, kb);
    let mut w6 = blocks::<BlockQ6K>(&wf);
    q6k_extremes(&mut w6, kb);
    // Every count of rows a chunk of the Q4_K kernel takes (1-4 with the words held, 1-8 streamed), alone and
    // after whole chunks, on both sides of the streamed words' limit.
    for m in [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 33] {
        let mut xf = random(&mut rng, m * k, 3.0);
        // One row at the activations' extreme: every value the block's largest (quantized to -127).
        xf[..k].fill(2.5);
        let xq: Vec<BlockQ8K> = blocks::<BlockQ8K>(&xf);
        let xs: Vec<&[BlockQ8K]> = xq.chunks(kb).collect();
        let stride = cols + 5;
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: checked above that the VNNI variant is supported; the rows are short.
        unsafe {
            groups::q4k_groups(&w, kb, &xs, &mut out, stride)
        };
        check_block("q4k", &out, stride, m, cols, |r, c| {
            q4k_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
        });
        // The same weights in the lanes layout, through its kernel.
        let lanes = crate::layout::to_lanes(&w, kb);
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: as above; `lanes` is whole 16-row groups in the lanes layout.
        unsafe {
            groups::q4k_lanes(&lanes, kb, &xs, &mut out, stride)
        };
        check_block("q4k lanes", &out, stride, m, cols, |r, c| {
            q4k_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
        });
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: as above.
        unsafe {
            groups::q6k_groups(&w6, kb, &xs, &mut out, stride)
        };
        check_block("q6k", &out, stride, m, cols, |r, c| {
            q6k_dot_scalar(&w6[c * kb..(c + 1) * kb], xs[r])
        });
        // The same weights in the lanes layout, through its kernel.
        let lanes6 = crate::layout::to_lanes(&w6, kb);
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: as above; `lanes6` is whole 16-row groups in the lanes layout.
        unsafe {
            groups::q6k_lanes(&lanes6, kb, &xs, &mut out, stride)
        };
        check_block("q6k lanes", &out, stride, m, cols, |r, c| {
            q6k_dot_scalar(&w6[c * kb..(c + 1) * kb], xs[r])
        });
    }
}

/// Q5_0 and Q8_0 weights of `cols` rows of `kb` blocks, the first block of the first 16 rows at the extremes:
/// Q5_0 values all -16 (nibbles 0, fifth bits 0) or all 15 (nibbles 15, fifth bits 1), alternating fifth bits,
/// scales of both signs; Q8_0 weights at both ends of a byte (-128 is never quantized, but a file may hold it).
#[cfg(target_arch = "x86_64")]
fn blocks32_with_extremes(
    rng: &mut rand::rngs::StdRng,
    kb: usize,
    cols: usize,
) -> (Vec<BlockQ5_0>, Vec<BlockQ8_0>) {
    let k = kb * 32;
    let mut w = blocks::<BlockQ5_0>(&random(rng, cols * k, 1.0));
    for (n, b) in w.iter_mut().step_by(kb).take(16).enumerate() {
        #[allow(unsafe_code)]
        // SAFETY: BlockQ5_0 and RawQ5_0 have the same layout (asserted at compile time above).
        let raw = unsafe { &mut *(b as *mut BlockQ5_0).cast::<RawQ5_0>() };
        match n % 3 {
            0 => (raw.qs, raw.qh) = ([0; 16], [0; 4]),
            1 => (raw.qs, raw.qh) = ([0xFF; 16], [0xFF; 4]),
            _ => (raw.qs, raw.qh) = ([0xF0; 16], [0x5A, 0xA5, 0x0F, 0xF0]),
        }
        if n % 2 == 0 {
            raw.d = f16::from_f32(-0.03).to_bits();
        }
    }
    let mut w8 = blocks::<BlockQ8_0>(&random(rng, cols * k, 1.0));
    for (n, b) in w8.iter_mut().step_by(kb).take(16).enumerate() {
        #[allow(unsafe_code)]
        // SAFETY: BlockQ8_0 and RawQ8_0 have the same layout (asserted at compile time above).
        let raw = unsafe { &mut *(b as *mut BlockQ8_0).cast::<RawQ8_0>() };
        raw.qs = [if n % 2 == 0 { -128 } else { 127 }; 32];
        if n % 3 == 0 {
            raw.d = f16::from_f32(-0.02).to_bits();
        }
    }
    (w, w8)
}

/// `m` activation rows of `k` values for the 32-wide kernels, the first at the activations' extreme (every value
/// the block's largest, quantized to 127).
fn act32_with_extreme(rng: &mut rand::rngs::StdRng, k: usize, m: usize) -> Act32 {
    let mut xf = random(rng, m * k, 3.0);
    xf[..k].fill(2.5);
    Act32::quantize(&xf, k, m)
}

/// Shapes of the 32-wide kernels' tests: fewer blocks per row than lanes, whole groups of 8 and a tail, and the
/// draft's 28.
const SHAPES_32: [(usize, usize); 3] = [(6, 32), (13, 48), (28, 16)];

#[cfg(target_arch = "x86_64")]
#[test]
fn q5_0_and_q8_0_row_groups_equal_the_scalar_definition_bit_for_bit() {
    if !Kernels::Vnni.supported() {
        eprintln!("skipping the row-group kernels: this CPU lacks AVX-512 VNNI");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    for (kb, cols) in SHAPES_32 {
        let k = kb * 32;
        let (w, w8) = blocks32_with_extremes(&mut rng, kb, cols);
        for m in [1, 2, 5, 8, 17] {
            let act = act32_with_extreme(&mut rng, k, m);
            let xs: Vec<Act32Row<'_>> = (0..m).map(|r| act.row(r)).collect();
            let stride = cols + 5;
            let mut out = vec![f32::NAN; m * stride];
            #[allow(unsafe_code)]
            // SAFETY: checked above that the VNNI variant is supported.
            unsafe {
                groups::q5_0_groups(&w, kb, &xs, &mut out, stride)
            };
            check_block("q5_0", &out, stride, m, cols, |r, c| {
                q5_0_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
            });
            // The same weights in Q5_0's lanes layout, through its kernel (one row from registers, more through
            // the shared unpacking).
            let lanes = crate::layout::q5_0_to_tiles(&w, kb, crate::layout::Q5_0Tiles::Masks16);
            let mut out = vec![f32::NAN; m * stride];
            #[allow(unsafe_code)]
            // SAFETY: as above; `lanes` is whole 16-row groups in Q5_0's lanes layout.
            unsafe {
                groups::q5_0_lanes(&lanes, kb, &xs, &mut out, stride)
            };
            check_block("q5_0 lanes", &out, stride, m, cols, |r, c| {
                q5_0_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
            });
            let mut out = vec![f32::NAN; m * stride];
            #[allow(unsafe_code)]
            // SAFETY: as above.
            unsafe {
                groups::q8_0_groups(&w8, kb, &xs, &mut out, stride)
            };
            check_block("q8_0", &out, stride, m, cols, |r, c| {
                q8_0_dot_scalar(&w8[c * kb..(c + 1) * kb], xs[r])
            });
        }
    }
}

/// The AVX2 kernel of Q4_K in the lanes layout against the definition, at 1-17 activation rows (whole chunks of
/// four and every remainder) with the extremes of [`q4k_extremes`].
#[cfg(target_arch = "x86_64")]
#[test]
fn the_avx2_q4k_lanes_kernel_equals_the_scalar_definition_bit_for_bit() {
    if !Kernels::Avx2.supported() {
        eprintln!("skipping the avx2 lanes kernel: this CPU lacks AVX2");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    // Three super-blocks per row, and the default target's six.
    for (kb, cols) in [(3, 48), (6, 32)] {
        let k = kb * QK_K;
        let mut w = blocks::<BlockQ4K>(&random(&mut rng, cols * k, 1.0));
        q4k_extremes(&mut w, kb);
        let lanes = crate::layout::to_lanes(&w, kb);
        for m in [1, 2, 3, 4, 5, 8, 9, 17] {
            let mut xf = random(&mut rng, m * k, 3.0);
            // One row at the activations' extreme: every value the block's largest.
            xf[..k].fill(2.5);
            let xq: Vec<BlockQ8K> = blocks::<BlockQ8K>(&xf);
            let xs: Vec<&[BlockQ8K]> = xq.chunks(kb).collect();
            let stride = cols + 5;
            let mut out = vec![f32::NAN; m * stride];
            #[allow(unsafe_code)]
            // SAFETY: checked above that the AVX2 variant is supported (with FMA and F16C); `lanes` is whole
            // 16-row groups in the lanes layout.
            unsafe {
                q4k_lanes8(&lanes, kb, &xs, &mut out, stride)
            };
            check_block("q4k lanes8", &out, stride, m, cols, |r, c| {
                q4k_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
            });
        }
    }
}

/// The CPU family read from CPUID is the one the kernel reports (`/proc/cpuinfo`'s `cpu family`), which the
/// K-quant split's default goes by (`quant::long_chunks`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[test]
fn the_cpu_family_is_the_one_linux_reports() {
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return;
    };
    let reported = info
        .lines()
        .find(|l| l.starts_with("cpu family"))
        .and_then(|l| l.split(':').nth(1))
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .expect("a number after `cpu family`")
        });
    if let Some(family) = reported {
        assert_eq!(cpu_family(), family);
    }
}

/// The prefetch hint follows the CPU's vendor (AMD: every level).
#[cfg(target_arch = "x86_64")]
#[test]
fn the_prefetch_hint_follows_the_vendor() {
    assert_eq!(prefetch_l1(), amd_cpu());
}

/// The AVX2 Q6_K panel (two `maddubs` added as i16 before each `madd`, on activations laid out anew per call)
/// against the definition at 1-8 activation rows, with weights and scales at their extremes
/// ([`q6k_extremes`]) and activation rows at both ends of a byte: the i16 sums come closest to saturating there.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_avx2_q6k_panel_equals_the_scalar_definition_at_the_extremes() {
    if !Kernels::Avx2.supported() {
        eprintln!("skipping the avx2 q6k panel: this CPU lacks AVX2");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let (kb, cols) = (3, 40);
    let k = kb * QK_K;
    let mut w = blocks::<BlockQ6K>(&random(&mut rng, cols * k, 1.0));
    q6k_extremes(&mut w, kb);
    let mut xq: Vec<BlockQ8K> = blocks::<BlockQ8K>(&random(&mut rng, TILE_ROWS * k, 3.0));
    // Rows 0 and 1: every value -128 or every value 127 (the quantizer writes -127 at most, the definition takes
    // any byte), their sub-block sums to match.
    for (r, v) in [(0, -128i8), (1, 127)] {
        for b in &mut xq[r * kb..(r + 1) * kb] {
            #[allow(unsafe_code)]
            // SAFETY: BlockQ8K and RawQ8K have the same layout (asserted at compile time above).
            let raw = unsafe { &mut *(b as *mut BlockQ8K).cast::<RawQ8K>() };
            raw.qs = [v; QK_K];
            raw.bsums = [16 * i16::from(v); QK_K / 16];
        }
    }
    let xs: Vec<&[BlockQ8K]> = xq.chunks(kb).collect();
    for m in 1..=TILE_ROWS {
        let stride = cols + 3;
        let mut out = vec![f32::NAN; m * stride];
        q6k_panel(Kernels::Avx2, &w, kb, &xs[..m], &mut out, stride);
        check_block("q6k avx2", &out, stride, m, cols, |r, c| {
            q6k_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
        });
    }
}

/// The AVX2 kernel of Q5_0's 8-row lanes layout against the definition, at 1-17 activation rows with the
/// extremes of [`blocks32_with_extremes`].
#[cfg(target_arch = "x86_64")]
#[test]
fn the_avx2_q5_0_lanes_kernel_equals_the_scalar_definition_bit_for_bit() {
    if !Kernels::Avx2.supported() {
        eprintln!("skipping the avx2 lanes kernel: this CPU lacks AVX2");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    for (kb, cols) in SHAPES_32 {
        let k = kb * 32;
        let (w, _) = blocks32_with_extremes(&mut rng, kb, cols);
        let lanes = crate::layout::q5_0_to_tiles(&w, kb, crate::layout::Q5_0Tiles::Words8);
        for m in [1, 2, 3, 5, 8, 17] {
            let act = act32_with_extreme(&mut rng, k, m);
            let xs: Vec<Act32Row<'_>> = (0..m).map(|r| act.row(r)).collect();
            let stride = cols + 5;
            let mut out = vec![f32::NAN; m * stride];
            #[allow(unsafe_code)]
            // SAFETY: checked above that the AVX2 variant is supported (with FMA and F16C); `lanes` is whole
            // 8-row groups in that layout.
            unsafe {
                q5_0_lanes8(&lanes, kb, &xs, &mut out, stride)
            };
            check_block("q5_0 lanes8", &out, stride, m, cols, |r, c| {
                q5_0_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
            });
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn amx_tiles_equal_the_scalar_definition_bit_for_bit() {
    if !Kernels::Amx.supported() {
        eprintln!("skipping the amx kernels: this CPU or OS does not allow AMX tiles");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (kb, cols) = (3, 32);
    let k = kb * QK_K;
    let wf = random(&mut rng, cols * k, 1.0);
    let (w, mut w6) = (blocks::<BlockQ4K>(&wf), blocks::<BlockQ6K>(&wf));
    // The scaled weights the tiles split into two bytes at their extremes.
    q6k_extremes(&mut w6, kb);
    for m in [1, 3, amx::MIN_ROWS, 8, 16, 21] {
        let xq: Vec<BlockQ8K> = blocks::<BlockQ8K>(&random(&mut rng, m * k, 3.0));
        let acts = amx::Acts::new(&xq, kb, m);
        let stride = cols + 5;
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: checked above that the AMX variant is supported.
        unsafe {
            amx::q4k_groups(&w, kb, &acts, &mut out, stride)
        };
        check_block("q4k", &out, stride, m, cols, |r, c| {
            q4k_dot_scalar(&w[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb])
        });
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: checked above that the AMX variant is supported.
        unsafe {
            amx::q6k_groups(&w6, kb, &acts, &mut out, stride)
        };
        check_block("q6k", &out, stride, m, cols, |r, c| {
            q6k_dot_scalar(&w6[c * kb..(c + 1) * kb], &xq[r * kb..(r + 1) * kb])
        });
    }
    // Q4_K in the lanes layout with the activations as the tiles' A operand: blocks of one tile of fewer than 16
    // rows, whole tiles read in place, a last tile of fewer rows (padded), and rows that do not lie one after
    // the other (every second row of a larger block: all padded); at the weights' extremes too.
    let mut w = w;
    q4k_extremes(&mut w, kb);
    let lanes = crate::layout::to_lanes(&w, kb);
    for (m, spread) in [
        (1, 1),
        (2, 1),
        (5, 1),
        (16, 1),
        (21, 1),
        (32, 1),
        (35, 1),
        (7, 2),
        (19, 2),
    ] {
        let mut xf = random(&mut rng, m * spread * k, 3.0);
        xf[..k].fill(2.5);
        let xq: Vec<BlockQ8K> = blocks::<BlockQ8K>(&xf);
        let xs: Vec<&[BlockQ8K]> = xq.chunks(kb).step_by(spread).collect();
        let stride = cols + 5;
        let mut out = vec![f32::NAN; m * stride];
        #[allow(unsafe_code)]
        // SAFETY: checked above that the AMX variant is supported; `lanes` is whole 16-row groups.
        unsafe {
            amx::q4k_lanes(&lanes, kb, &xs, &mut out, stride)
        };
        check_block("q4k lanes tiles", &out, stride, m, cols, |r, c| {
            q4k_dot_scalar(&w[c * kb..(c + 1) * kb], xs[r])
        });
    }
}

#[test]
fn the_definitions_agree_with_candles_dot_products() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(10);
    let k = 6 * QK_K;
    let w = random(&mut rng, k, 1.0);
    let x = random(&mut rng, k, 3.0);
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * a.abs().max(1.0);
    let x8k = blocks::<BlockQ8K>(&x);
    let (w4, w6) = (blocks::<BlockQ4K>(&w), blocks::<BlockQ6K>(&w));
    let (a, b) = (BlockQ4K::vec_dot(k, &w4, &x8k), q4k_dot_scalar(&w4, &x8k));
    assert!(close(a, b), "q4k: {a} vs {b}");
    let (a, b) = (BlockQ6K::vec_dot(k, &w6, &x8k), q6k_dot_scalar(&w6, &x8k));
    assert!(close(a, b), "q6k: {a} vs {b}");
    let x80 = blocks::<BlockQ8_0>(&x);
    let act = Act32::quantize(&x, k, 1);
    let (w8, w5) = (blocks::<BlockQ8_0>(&w), blocks::<BlockQ5_0>(&w));
    let (a, b) = (
        BlockQ8_0::vec_dot(k, &w8, &x80),
        q8_0_dot_scalar(&w8, act.row(0)),
    );
    assert!(close(a, b), "q8_0: {a} vs {b}");
    let (a, b) = (
        BlockQ5_0::vec_dot(k, &w5, &x80),
        q5_0_dot_scalar(&w5, act.row(0)),
    );
    assert!(close(a, b), "q5_0: {a} vs {b}");
}

#[test]
fn q8k_quantization_equals_candles_on_every_variant() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let mut x = random(&mut rng, 6 * QK_K, 4.0);
    // Ties of magnitude with both signs, exact halves after scaling, and an all-zero block.
    x[3] = -4.5;
    x[7] = 4.5;
    x[QK_K + 1] = 2.0;
    for (i, v) in x[QK_K + 2..QK_K + 40].iter_mut().enumerate() {
        *v = (i as f32 + 0.5) * 2.0 / 127.0;
    }
    x[2 * QK_K..3 * QK_K].fill(0.0);
    // Halves exactly (the largest magnitude -127 makes the scale 1): each rounds away from zero.
    x[4 * QK_K] = -127.0;
    for (i, v) in x[4 * QK_K + 1..4 * QK_K + 60].iter_mut().enumerate() {
        *v = i as f32 - 29.5;
    }
    let mut want = vec![BlockQ8K::zeros(); 6];
    BlockQ8K::from_float(&x, &mut want);
    let bytes = |b: &[BlockQ8K]| {
        let raw = raw_q8k(b);
        raw.iter()
            .map(|r| (r.d.to_bits(), r.qs.to_vec(), r.bsums.to_vec()))
            .collect::<Vec<_>>()
    };
    for k in variants() {
        let before = active();
        set_active(k).unwrap();
        let mut got = vec![BlockQ8K::zeros(); 6];
        quantize_q8k(&x, &mut got);
        set_active(before).unwrap();
        assert!(
            bytes(&got) == bytes(&want),
            "{k}: Q8_K quantization differs from candle's"
        );
    }
}

#[test]
fn q8k_quantization_shared_among_threads_equals_candles() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let blocks = 8 * 35 + 3; // 8 rows of an 8,960-wide input, and a share left short
    let x = random(&mut rng, blocks * QK_K, 2.0);
    let mut want = vec![BlockQ8K::zeros(); blocks];
    BlockQ8K::from_float(&x, &mut want);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for k in variants() {
        let before = active();
        set_active(k).unwrap();
        let mut got = vec![BlockQ8K::zeros(); blocks];
        pool.install(|| quantize_q8k(&x, &mut got));
        set_active(before).unwrap();
        for (b, (g, w)) in raw_q8k(&got).iter().zip(raw_q8k(&want)).enumerate() {
            assert!(
                g.d.to_bits() == w.d.to_bits() && g.qs == w.qs && g.bsums == w.bsums,
                "{k}: block {b} differs from candle's"
            );
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_q8k_quantization_takes_nans_and_infinities_as_candle_does() {
    if !Kernels::Avx2.supported() {
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let mut x = random(&mut rng, 5 * QK_K, 3.0);
    // NaNs beside finite values; an infinity (every other value times a zero scale); both signs of infinity,
    // the first winning; values so small they are subnormal; the largest finite magnitude.
    x[5] = f32::NAN;
    x[250] = f32::NAN; // in the last 8 values, which a NaN-keeping maximum would end on
    x[QK_K + 9] = f32::INFINITY;
    x[2 * QK_K + 3] = f32::NEG_INFINITY;
    x[2 * QK_K + 200] = f32::INFINITY;
    for v in &mut x[3 * QK_K..4 * QK_K] {
        *v *= 1e-40;
    }
    x[4 * QK_K + 100] = -f32::MAX;
    let mut want = vec![BlockQ8K::zeros(); 5];
    BlockQ8K::from_float(&x, &mut want);
    let mut got = vec![BlockQ8K::zeros(); 5];
    // SAFETY: AVX2 is supported (checked above); x holds 256 values for each of the 5 blocks.
    #[allow(unsafe_code)]
    unsafe {
        avx2::quantize_q8k_avx2(&x, &mut got)
    };
    for (b, (g, w)) in raw_q8k(&got).iter().zip(raw_q8k(&want)).enumerate() {
        assert_eq!(g.d.to_bits(), w.d.to_bits(), "block {b}: d");
        assert_eq!(g.qs, w.qs, "block {b}: qs");
        assert_eq!(g.bsums, w.bsums, "block {b}: bsums");
    }
}

#[test]
fn kernel_names_parse_and_unknown_ones_are_errors() {
    for k in Kernels::ALL {
        assert_eq!(Kernels::parse(k.name()), Ok(k));
    }
    assert!(Kernels::parse("sse9").is_err());
    assert!(Kernels::best().supported());
}
