use super::*;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn reference(w: &[f32], x: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            out[r * n + c] = (0..k).map(|j| w[c * k + j] * x[r * k + j]).sum();
        }
    }
    out
}

/// A head re-quantized for a draft: to fewer bits it changes format (and stays close to the values); to as many
/// or more bits, or where the rows do not divide into the format's blocks, it is left as it is.
#[test]
fn requantizing_saves_bytes_or_leaves_the_matrix_alone() {
    let (rows, cols) = (16, 256);
    let w = random(rows * cols, 11);
    let q8 = QMatrix::from_f32(GgmlDType::Q8_0, rows, cols, &w).unwrap();
    let q5 = q8.clone().requantized_to(GgmlDType::Q5_0).unwrap();
    assert_eq!(q5.dtype(), GgmlDType::Q5_0);
    assert!(q5.storage_bytes() < q8.storage_bytes());
    let err = q5
        .to_f32()
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // Q5_0 steps of (max |w| of a block, here <= 1) / 16, off by up to one step at the clipped end of its range
    // (-16..=15); the Q8_0 rounding before adds at most a 254th.
    assert!(err <= 1.0 / 16.0 + 1.0 / 254.0, "max error {err}");
    let q4k = QMatrix::from_f32(GgmlDType::Q4K, rows, cols, &w).unwrap();
    let same = q4k.clone().requantized_to(GgmlDType::Q5_0).unwrap();
    assert_eq!(same.dtype(), GgmlDType::Q4K);
    assert_eq!(same.to_f32(), q4k.to_f32());
    let f32_odd = QMatrix::from_f32(GgmlDType::F32, 2, 40, &w[..80]).unwrap();
    let kept = f32_odd.requantized_to(GgmlDType::Q5_0).unwrap();
    assert_eq!(kept.dtype(), GgmlDType::F32);
}

#[test]
fn random_matrices_are_centred_and_sized_like_their_fan_in() {
    for dtype in [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let (rows, cols) = (64, 512);
        let m = random_matrix(dtype, rows, cols, 5).unwrap();
        assert_eq!((m.dtype(), m.rows(), m.cols()), (dtype, rows, cols));
        let v = m.to_f32();
        let n = v.len() as f32;
        let mean = v.iter().sum::<f32>() / n;
        let sd = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n).sqrt();
        let target = 1.0 / (cols as f32).sqrt();
        assert!(v.iter().all(|x| x.is_finite()), "{dtype:?}");
        assert!(mean.abs() < 0.2 * target, "{dtype:?}: mean {mean}");
        assert!(
            sd > 0.6 * target && sd < 1.6 * target,
            "{dtype:?}: sd {sd} for {target}"
        );
        // The same seed gives the same matrix.
        assert_eq!(random_matrix(dtype, rows, cols, 5).unwrap().to_f32(), v);
    }
    assert!(random_matrix(GgmlDType::Q4K, 4, 100, 1).is_err());
    assert!(random_matrix(GgmlDType::Q2K, 4, 256, 1).is_err());
}

#[test]
fn every_format_matches_its_dequantized_reference() {
    let (n, k, m) = (37, 512, 5);
    let w = random(n * k, 1);
    let x = random(m * k, 2);
    // Tolerances are relative to the RMS of the exact product: the activations are quantized too (to Q8_0 or
    // Q8_K), so even Q8_0 weights give ~1% error.
    // A wrong block layout gives errors above 1.
    for (dtype, tol) in [
        (GgmlDType::F32, 1e-5),
        (GgmlDType::F16, 0.01),
        (GgmlDType::Q4_0, 0.3),
        (GgmlDType::Q4_1, 0.3),
        (GgmlDType::Q5_0, 0.15),
        (GgmlDType::Q5_1, 0.15),
        (GgmlDType::Q8_0, 0.03),
        (GgmlDType::Q2K, 1.0),
        (GgmlDType::Q3K, 0.5),
        (GgmlDType::Q4K, 0.3),
        (GgmlDType::Q5K, 0.15),
        (GgmlDType::Q6K, 0.08),
    ] {
        let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        assert_eq!(q.dtype(), dtype);
        let exact = reference(&w, &x, n, k, m);
        let rms = (exact.iter().map(|v| v * v).sum::<f32>() / exact.len() as f32).sqrt();
        let mut got = vec![0f32; m * n];
        q.matmul(&x, m, &mut got).unwrap();
        let max_err = exact
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / rms;
        assert!(max_err < tol, "{dtype:?}: relative error {max_err}");
        // The kernel must also agree with the dequantized weights (only activation rounding differs).
        let deq = reference(&q.to_f32(), &x, n, k, m);
        let deq_err = deq
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / rms;
        assert!(deq_err < 0.03, "{dtype:?}: kernel vs dequantized {deq_err}");
    }
}

#[test]
fn rows_are_bitwise_independent_of_the_block() {
    let (n, k) = (70, 256);
    let w = random(n * k, 3);
    let x = random(19 * k, 4);
    for dtype in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::F32,
    ] {
        let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        let mut all = vec![0f32; 19 * n];
        q.matmul(&x, 19, &mut all).unwrap();
        for r in 0..19 {
            let mut one = vec![0f32; n];
            q.matmul(&x[r * k..(r + 1) * k], 1, &mut one).unwrap();
            assert_eq!(
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                all[r * n..(r + 1) * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                "{dtype:?} row {r}"
            );
        }
    }
}

/// The calls that time the row groups against the panels (kernels::choose) give the bits the chosen kernel
/// gives afterwards: a block's output is the same on every call, trial or not. (On a CPU without AVX-512 VNNI
/// every call takes the panels and this holds trivially.)
#[test]
fn timed_trials_of_the_kernels_give_the_same_bits_as_the_choice() {
    let (n, k, m) = (48, 512, 9);
    let w = random(n * k, 5);
    let x = random(m * k, 6);
    for dtype in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
    ] {
        let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        let bits = |q: &QMatrix| {
            let mut out = vec![0f32; m * n];
            q.matmul(&x, m, &mut out).unwrap();
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let first = bits(&q);
        for call in 1..3 * crate::kernels::choose::TRIALS {
            assert_eq!(bits(&q), first, "{dtype:?} call {call}");
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    assert!(QMatrix::from_f32(GgmlDType::Q4K, 2, 100, &[0.0; 200]).is_err());
    assert!(QMatrix::from_bytes(GgmlDType::Q8_0, 2, 32, &[0u8; 10]).is_err());
    let q = QMatrix::from_f32(GgmlDType::F32, 2, 4, &[0.0; 8]).unwrap();
    let mut out = vec![0f32; 2];
    assert!(q.matmul(&[0.0; 3], 1, &mut out).is_err());
}
