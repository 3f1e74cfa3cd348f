use super::*;

#[test]
fn grouped_dots_and_weighted_sums_equal_the_plain_loops_bitwise() {
    for hd in [64usize, 128, 40] {
        for group in [1usize, 3, 6, 7] {
            let qs: Vec<f32> = (0..group * hd)
                .map(|i| ((i * 7919) % 1000) as f32 / 337.0 - 1.3)
                .collect();
            let k: Vec<f32> = (0..hd)
                .map(|i| ((i * 104729) % 997) as f32 / 211.0 - 2.1)
                .collect();
            let mut got = vec![0f32; group];
            dot_heads(&qs, &k, &mut got);
            for h in 0..group {
                assert_eq!(
                    got[h].to_bits(),
                    dot(&qs[h * hd..(h + 1) * hd], &k).to_bits(),
                    "hd {hd} head {h}"
                );
            }
            let v: Vec<f32> = (0..5 * hd)
                .map(|i| ((i * 31) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let p = [0.3f32, 0.1, 0.25, 0.05, 0.3];
            let mut want = vec![0f32; hd];
            for (i, pi) in p.iter().enumerate() {
                for (a, b) in want.iter_mut().zip(&v[i * hd..(i + 1) * hd]) {
                    *a = pi.mul_add(*b, *a);
                }
            }
            let mut o = vec![0f32; hd];
            weighted_sum(
                p.iter().enumerate().map(|(i, &pi)| (pi, i * hd)),
                &v,
                &mut o,
            );
            assert_eq!(
                o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "hd {hd}"
            );
        }
    }
}

#[test]
fn dot_paths_agree_bitwise() {
    for n in [1usize, 8, 16, 37, 128, 200] {
        let a: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 337.0 - 1.3)
            .collect();
        let b: Vec<f32> = (0..n)
            .map(|i| ((i * 104729) % 997) as f32 / 211.0 - 2.1)
            .collect();
        assert_eq!(
            dot(&a, &b).to_bits(),
            dot_portable(&a, &b).to_bits(),
            "n = {n}"
        );
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - exact).abs() < 1e-3 * exact.abs().max(1.0));
    }
}

#[test]
fn rope_rotates_pairs_and_keeps_norm() {
    let rope = Rope::new(4, 10000.0, RopeStyle::Neox);
    let mut x = vec![1.0, 2.0, 3.0, 4.0];
    rope.apply(&mut x, &[0], 1);
    assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    rope.apply(&mut x, &[3], 1);
    let norm: f32 = x.iter().map(|v| v * v).sum();
    assert!((norm - 30.0).abs() < 1e-4);
    // Pair (0, 2) rotated by 3 rad at frequency 1.
    assert!((x[0] - (1.0 * 3f32.cos() - 3.0 * 3f32.sin())).abs() < 1e-5);
}

/// Keys, values and queries of one attention call for the tests (values in -2..2), with rows that see the cache
/// less `r % drop` keys, the block's first token and its tokens `r / 2..=r`.
fn attention_case(
    (n_heads, n_kv_heads, head_dim, cached): (usize, usize, usize, usize),
    rows: usize,
    drop: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<MaskRow>, AttnShape) {
    let val = |i: usize, m: usize| ((i * 7919 + m) % 2003) as f32 / 500.0 - 2.0;
    let kv = n_kv_heads * head_dim;
    let k: Vec<f32> = (0..(cached + rows) * kv).map(|i| val(i, 1)).collect();
    let v: Vec<f32> = (0..(cached + rows) * kv).map(|i| val(i, 2)).collect();
    let q: Vec<f32> = (0..rows * n_heads * head_dim).map(|i| val(i, 3)).collect();
    let mask: Vec<MaskRow> = (0..rows)
        .map(|r| MaskRow {
            cached: cached.saturating_sub(r % drop),
            spans: vec![0..1, (r / 2)..(r + 1)],
        })
        .collect();
    let s = AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        block_start: cached,
    };
    (k, v, q, mask, s)
}

#[test]
fn attentions_avx512_path_gives_the_same_bits_as_the_others() {
    if !wide_attention_runs() {
        eprintln!("skipped: no AVX-512 on this CPU");
        return;
    }
    for case in [
        (12, 2, 128, 37),
        (14, 2, 64, 37),
        (4, 4, 48, 37),
        (9, 1, 16, 37),
        (12, 2, 128, 16),
        (14, 2, 128, 80),
        (6, 1, 128, 3),
    ] {
        let (n_heads, n_kv_heads, head_dim, cached) = case;
        // Rows see up to `cached + 5` keys: whole runs of 16 and the rest, or fewer than 16 in all. A tree of
        // rows: each sees the cache and some of the block.
        let (k, v, q, mask, s) = attention_case(case, 5, 2);
        let mut narrow = vec![0f32; q.len()];
        let mut wide = vec![0f32; q.len()];
        attention_with(false, &q, &k, &v, &mask, &s, &mut narrow);
        attention_with(true, &q, &k, &v, &mask, &s, &mut wide);
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&narrow),
            bits(&wide),
            "{n_heads} heads, {n_kv_heads} KV heads of {head_dim}, {cached} cached"
        );
        assert!(narrow.iter().all(|x| x.is_finite() && *x != 0.0));
    }
}

#[test]
fn eight_keys_scored_side_by_side_equal_dot_heads_bitwise() {
    for hd in [16usize, 64, 128] {
        for group in [1usize, 4, 6, 7] {
            let qs: Vec<f32> = (0..group * hd)
                .map(|i| ((i * 7919) % 1000) as f32 / 337.0 - 1.3)
                .collect();
            let keys: Vec<Vec<f32>> = (0..8)
                .map(|e| {
                    (0..hd)
                        .map(|i| ((i * 104729 + e * 31) % 997) as f32 / 211.0 - 2.1)
                        .collect()
                })
                .collect();
            let mut got = vec![0f32; group * 8];
            if !scores8(&qs, std::array::from_fn(|e| &keys[e][..]), &mut got) {
                eprintln!("skipped: no AVX2 and FMA");
                return;
            }
            let mut want = vec![0f32; group];
            for (e, k) in keys.iter().enumerate() {
                dot_heads(&qs, k, &mut want);
                for h in 0..group {
                    assert_eq!(
                        got[h * 8 + e].to_bits(),
                        want[h].to_bits(),
                        "hd {hd}, head {h}, key {e}"
                    );
                }
            }
        }
    }
    // A head width without whole runs of 16 is left to dot_heads.
    let k = [1f32; 40];
    assert!(!scores8(
        &[1f32; 40],
        std::array::from_fn(|_| &k[..]),
        &mut [0f32; 8]
    ));
}

#[test]
fn rows_taken_together_give_the_bits_of_rows_taken_alone() {
    for case in [
        (12, 2, 128, 70),
        (14, 2, 64, 37),
        (4, 4, 48, 37),
        (9, 1, 40, 5),
        (8, 1, 16, 0),
    ] {
        let (n_heads, n_kv_heads, head_dim, cached) = case;
        // Rows that see different caches and spans; more keys than a run of KEY_RUN where the cache is long.
        let rows = 7;
        let kv = n_kv_heads * head_dim;
        let (k, v, q, mask, s) = attention_case(case, rows, 3);
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut alone = vec![0f32; q.len()];
        // One row a task.
        attention_narrow(&q, &k, &v, &mask, &s, &mut alone, 1);
        // Each row by itself, as a block of one row.
        let width = n_heads * head_dim;
        for r in 0..rows {
            let mut one = vec![0f32; width];
            attention_narrow(
                &q[r * width..(r + 1) * width],
                &k,
                &v,
                &mask[r..r + 1],
                &s,
                &mut one,
                1,
            );
            assert_eq!(
                bits(&one),
                bits(&alone[r * width..(r + 1) * width]),
                "row {r}"
            );
        }
        for rb in [1, 2, 3, 7, 8] {
            let mut together = vec![0f32; q.len()];
            attention_narrow(&q, &k, &v, &mask, &s, &mut together, rb);
            assert_eq!(
                bits(&alone),
                bits(&together),
                "{n_heads} heads, {n_kv_heads} KV heads of {head_dim}, {rb} rows a task"
            );
        }
        assert!(alone.iter().all(|x| x.is_finite() && *x != 0.0));
        // Against the plain loops: softmax-weighted values, within float rounding.
        for r in 0..rows {
            let m = &mask[r];
            let keys: Vec<usize> = (0..m.cached)
                .chain(m.spans.iter().flat_map(|sp| sp.clone().map(|j| cached + j)))
                .collect();
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv_heads);
                let qh = &q[(r * n_heads + h) * head_dim..][..head_dim];
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|&t| {
                        let kt = &k[t * kv + kvh * head_dim..][..head_dim];
                        qh.iter()
                            .zip(kt)
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            / (head_dim as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..head_dim {
                    let want: f64 = keys
                        .iter()
                        .zip(&e)
                        .map(|(&t, w)| w / z * v[t * kv + kvh * head_dim + d] as f64)
                        .sum();
                    let got = alone[(r * n_heads + h) * head_dim + d] as f64;
                    assert!(
                        (got - want).abs() < 1e-3,
                        "row {r} head {h} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn attention_over_one_key_returns_its_value() {
    let s = AttnShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 2,
        block_start: 1,
    };
    let k = vec![1.0, 0.0, 0.0, 1.0];
    let v = vec![5.0, 6.0, 7.0, 8.0];
    let mask = vec![MaskRow {
        cached: 0,
        spans: vec![0..1],
    }];
    let mut out = vec![0.0; 4];
    attention(&[1.0, 1.0, 2.0, 2.0], &k, &v, &mask, &s, &mut out);
    assert_eq!(out, vec![7.0, 8.0, 7.0, 8.0]);
}
