use super::*;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A Q4_K, Q6_K or Q5_0 matrix in the lanes layout reads, shards and multiplies exactly as the same matrix in
/// rows.
#[test]
fn the_lanes_layout_reads_and_multiplies_as_the_rows_do() {
    let (n, k) = (48, 3 * 256);
    let w = random(n * k, 21);
    for (dtype, tiles) in [
        (GgmlDType::Q4K, None),
        (GgmlDType::Q6K, None),
        (GgmlDType::Q5_0, Some(Q5_0Tiles::Masks16)),
        (GgmlDType::Q5_0, Some(Q5_0Tiles::Words8)),
    ] {
        let rows = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        let lanes = match &rows {
            QMatrix::Q4K(mat) => {
                let kb = mat.blocks_per_row();
                assert_eq!(
                    from_lanes(&to_lanes(&mat.blocks, kb), kb).len(),
                    mat.blocks.len()
                );
                QMatrix::Q4KLanes(mat.to_lanes())
            }
            QMatrix::Q6K(mat) => {
                // 210-byte blocks: 52 words and a 2-byte tail per row; a permutation of every byte, the
                // runs of four words in the kernel's order.
                let mut slots = Q6K_RUN_SLOTS;
                slots.sort_unstable();
                assert_eq!(slots, std::array::from_fn(|i| i), "a slot for every run");
                let kb = mat.blocks_per_row();
                let there = to_lanes(&mat.blocks, kb);
                assert_ne!(block_bytes(&there), block_bytes(&mat.blocks));
                let mut sorted = (
                    block_bytes(&there).to_vec(),
                    block_bytes(&mat.blocks).to_vec(),
                );
                sorted.0.sort_unstable();
                sorted.1.sort_unstable();
                assert_eq!(sorted.0, sorted.1);
                QMatrix::Q6KLanes(mat.to_lanes())
            }
            QMatrix::Q5_0(mat) => {
                // A permutation of bits (the fifth bits regrouped into masks or words), undone exactly.
                let (kb, tiles) = (mat.blocks_per_row(), tiles.unwrap());
                let there = q5_0_to_tiles(&mat.blocks, kb, tiles);
                assert_ne!(block_bytes(&there), block_bytes(&mat.blocks));
                let ones = |b: &[u8]| b.iter().map(|v| v.count_ones()).sum::<u32>();
                assert_eq!(ones(block_bytes(&there)), ones(block_bytes(&mat.blocks)));
                assert_eq!(
                    block_bytes(&q5_0_permute(&there, kb, tiles, false)),
                    block_bytes(&mat.blocks)
                );
                QMatrix::Q5_0Lanes(mat.to_q5_0_lanes(tiles), tiles)
            }
            _ => unreachable!("made as {dtype:?}"),
        };
        assert_eq!(lanes.dtype(), dtype);
        assert_eq!(
            lanes.raw_bytes(),
            rows.raw_bytes(),
            "{dtype:?}: the layout is a permutation, undone for readers"
        );
        assert_eq!(lanes.to_f32(), rows.to_f32());
        for r in [0, 15, 16, 47] {
            let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
            lanes.row_to_f32(r, &mut a);
            rows.row_to_f32(r, &mut b);
            assert_eq!(a, b, "{dtype:?} row {r}");
        }
        // Every block size, on whichever kernels this CPU runs (the layout's kernel where the active variant
        // runs it, the rows otherwise): the same bits as the rows.
        for m in [1, 2, 3, 8, 9, 17, 40] {
            let x = random(m * k, 22 + m as u64);
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
            lanes.matmul(&x, m, &mut a).unwrap();
            rows.matmul(&x, m, &mut b).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{dtype:?}, {m} rows");
        }
        // Shards come out in the rows' values.
        assert_eq!(
            lanes.select_rows(16..32).to_f32(),
            rows.select_rows(16..32).to_f32()
        );
        assert_eq!(
            lanes.gather_rows(&[0..16, 32..48]).to_f32(),
            rows.gather_rows(&[0..16, 32..48]).to_f32()
        );
        assert_eq!(
            lanes.select_cols(256..768).unwrap().to_f32(),
            rows.select_cols(256..768).unwrap().to_f32()
        );
    }
}

/// The K-quant row-group matmuls give the same bits in long runs of rows a thread and in L2-sized items
/// ([`long_chunks`]), in the lanes layout and in rows (a row count that leaves a remainder for the panels).
#[cfg(target_arch = "x86_64")]
#[test]
fn long_runs_of_rows_compute_what_short_items_do() {
    let k = 2 * 256;
    for (dtype, n, lanes) in [
        (GgmlDType::Q4K, 16 * 37, true),
        (GgmlDType::Q6K, 16 * 37, true),
        (GgmlDType::Q4K, 600, false),
    ] {
        let w = random(n * k, 31);
        let mat = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        let mat = match (mat, lanes) {
            (QMatrix::Q4K(m), true) => QMatrix::Q4KLanes(m.to_lanes()),
            (QMatrix::Q6K(m), true) => QMatrix::Q6KLanes(m.to_lanes()),
            (m, _) => m,
        };
        for m in [1, 3, 8, 20] {
            let x = random(m * k, 32 + m as u64);
            let outs = [true, false, true].map(|long| {
                LONG_CHUNKS_IN_TEST.with(|c| c.set(Some(long)));
                let mut out = vec![0f32; m * n];
                mat.matmul(&x, m, &mut out).unwrap();
                out.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
            });
            LONG_CHUNKS_IN_TEST.with(|c| c.set(None));
            assert!(
                outs[0].iter().any(|&b| b != 0),
                "{dtype:?}, {m} rows: computed"
            );
            assert_eq!(
                outs[0], outs[1],
                "{dtype:?}, {m} rows: long runs against short items"
            );
            assert_eq!(outs[0], outs[2], "{dtype:?}, {m} rows: long runs again");
        }
    }
}

/// [`drive`] lays every row of every chunk where it belongs, and what a chunk's work leaves unwritten is zero,
/// in a buffer kept from an earlier call (dirty) as in a fresh one, and beyond the size it keeps.
#[test]
fn drive_lays_out_every_row_and_zeroes_what_the_work_leaves() {
    for (n, m, chunk) in [(1000, 3, 64), (37, 8, 5), (KEPT_RESULTS / 4 + 7, 5, 4096)] {
        for call in 0..2 {
            let mut out = vec![f32::NAN; n * m];
            let work = |c0: usize, dst: &mut [f32]| {
                let cw = dst.len() / m;
                for r in 0..m {
                    for j in (0..cw).filter(|j| !(c0 + j).is_multiple_of(3)) {
                        dst[r * cw + j] = (r * n + c0 + j) as f32;
                    }
                }
            };
            drive(n, m, chunk, work, &mut out);
            for (i, v) in out.iter().enumerate() {
                let want = if (i % n).is_multiple_of(3) {
                    0.0
                } else {
                    i as f32
                };
                assert_eq!(
                    v.to_bits(),
                    want.to_bits(),
                    "{n} x {m} by {chunk} (call {call}): value {i}"
                );
            }
        }
    }
    assert!(RESULTS.lock().unwrap().len() <= KEPT_BUFFERS);
}

/// The split follows the CPU (AMD before family 25: L2-sized items, others: long runs). The split leaves the
/// bits as they are ([`long_runs_of_rows_compute_what_short_items_do`]).
#[cfg(target_arch = "x86_64")]
#[test]
fn long_runs_follow_the_cpu() {
    assert_eq!(long_chunks(), long_chunks_by_cpu());
}

/// Cutting a matrix by rows or by whole blocks of columns computes the same products (rows: bitwise; columns:
/// the partial products add up to the whole within rounding).
#[test]
fn row_and_column_shards_compute_the_whole_product() {
    let (n, k, m) = (24, 1024, 5);
    let w = random(n * k, 3);
    let x = random(m * k, 4);
    for dtype in [
        GgmlDType::F32,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
        let mut whole = vec![0f32; m * n];
        q.matmul(&x, m, &mut whole).unwrap();
        // Rows 8..16.
        let part = q.select_rows(8..16);
        let mut out = vec![0f32; m * 8];
        part.matmul(&x, m, &mut out).unwrap();
        for r in 0..m {
            assert_eq!(
                &out[r * 8..(r + 1) * 8],
                &whole[r * n + 8..r * n + 16],
                "{dtype:?}"
            );
        }
        // Columns 0..512 and 512..1024.
        let mut sum = vec![0f32; m * n];
        for cols in [0..512, 512..1024] {
            let part = q.select_cols(cols.clone()).unwrap();
            let xs: Vec<f32> = (0..m)
                .flat_map(|r| x[r * k + cols.start..r * k + cols.end].to_vec())
                .collect();
            let mut out = vec![0f32; m * n];
            part.matmul(&xs, m, &mut out).unwrap();
            for (s, o) in sum.iter_mut().zip(out) {
                *s += o;
            }
        }
        let diff = sum
            .iter()
            .zip(&whole)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-3, "{dtype:?}: column shards differ by {diff}");
    }
    let q = QMatrix::from_f32(GgmlDType::Q4K, n, k, &w).unwrap();
    assert!(q.select_cols(0..300).is_err());
}
