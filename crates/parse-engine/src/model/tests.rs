use super::*;
use parse_core::mask::MaskRow;

pub(crate) fn tiny(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 97,
        hidden_size: 64,
        intermediate_size: 96,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        rms_eps: 1e-6,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        max_context: 256,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn branches_in_one_block_equal_separate_causal_passes() {
    let model = Model::random(tiny(Arch::Qwen2), 7).unwrap();
    let trunk = [5u32, 9, 3, 44];
    let mut cache = KvCache::new(model.config());
    model.forward_causal(&mut cache, &trunk, &[3]).unwrap();
    // Block: shared stem [10, 11] then branch A [12, 13] off the stem's end and branch B [20] off its start.
    let tokens = [10u32, 11, 12, 13, 20];
    let c = trunk.len();
    let positions = [c, c + 1, c + 2, c + 3, c + 1].map(|p| p as u32);
    let rows = vec![
        MaskRow {
            cached: c,
            spans: vec![0..1],
        },
        MaskRow {
            cached: c,
            spans: vec![0..2],
        },
        MaskRow {
            cached: c,
            spans: vec![0..3],
        },
        MaskRow {
            cached: c,
            spans: vec![0..4],
        },
        MaskRow {
            cached: c,
            spans: vec![0..1, 4..5],
        },
    ];
    let packed = model
        .forward(
            &mut cache.clone(),
            &tokens,
            &positions,
            &BlockMask::from_rows(rows),
            &[0, 1, 2, 3, 4],
        )
        .unwrap();
    let seqs: [(&[u32], usize); 5] = [
        (&[10], 0),
        (&[10, 11], 1),
        (&[10, 11, 12], 2),
        (&[10, 11, 12, 13], 3),
        (&[10, 20], 4),
    ];
    for (seq, row) in seqs {
        let mut c2 = cache.clone();
        let want = model
            .forward_causal(&mut c2, seq, &[seq.len() - 1])
            .unwrap();
        let diff = max_diff(want.row(0), packed.row(row));
        assert!(diff < 1e-4, "row {row}: {diff}");
    }
}

#[test]
fn a_packed_forward_of_several_sessions_is_bitwise_each_alone() {
    for arch in [Arch::Qwen2, Arch::Llama] {
        let model = Model::random(tiny(arch), 11).unwrap();
        let mut a = KvCache::new(model.config());
        let mut b = KvCache::new(model.config());
        model
            .forward_causal(&mut a, &[3, 4, 5, 6, 7], &[4])
            .unwrap();
        model.forward_causal(&mut b, &[9, 8], &[1]).unwrap();
        let c = KvCache::new(model.config());
        // Alone: a decodes one token, b verifies a 3-row block, c is prefilled.
        let (mut a1, mut b1, mut c1) = (a.clone(), b.clone(), c.clone());
        let la = model.forward_causal(&mut a1, &[42], &[0]).unwrap();
        let lb = model
            .forward_causal(&mut b1, &[1, 2, 3], &[0, 1, 2])
            .unwrap();
        let lc = model
            .forward_causal(&mut c1, &[60, 61, 62, 63], &[3])
            .unwrap();
        let (mut a2, mut b2, mut c2) = (a.clone(), b.clone(), c.clone());
        let (pa, pb, pc) = ([5u32], [2u32, 3, 4], [0u32, 1, 2, 3]);
        let (ma, mb, mc) = (
            BlockMask::causal(5, 1),
            BlockMask::causal(2, 3),
            BlockMask::causal(0, 4),
        );
        let mut items = [
            Packed {
                cache: &mut a2,
                tokens: &[42],
                positions: &pa,
                mask: &ma,
                readout: &[0],
            },
            Packed {
                cache: &mut b2,
                tokens: &[1, 2, 3],
                positions: &pb,
                mask: &mb,
                readout: &[0, 1, 2],
            },
            Packed {
                cache: &mut c2,
                tokens: &[60, 61, 62, 63],
                positions: &pc,
                mask: &mc,
                readout: &[3],
            },
        ];
        let out = model.forward_packed(&mut items).unwrap();
        assert_eq!(out, vec![la, lb, lc], "{arch:?}");
        assert_eq!((a2.k, a2.v, a2.len), (a1.k, a1.v, a1.len));
        assert_eq!((b2.k, b2.v, b2.len), (b1.k, b1.v, b1.len));
        assert_eq!((c2.k, c2.v, c2.len), (c1.k, c1.v, c1.len));
    }
}

#[test]
fn a_bad_block_in_a_packed_forward_changes_no_cache() {
    let model = Model::random(tiny(Arch::Qwen2), 2).unwrap();
    let mut a = KvCache::new(model.config());
    let mut b = KvCache::new(model.config());
    model.forward_causal(&mut a, &[1, 2], &[1]).unwrap();
    let (ma, mb) = (BlockMask::causal(2, 1), BlockMask::causal(0, 1));
    let mut items = [
        Packed {
            cache: &mut a,
            tokens: &[3],
            positions: &[2],
            mask: &ma,
            readout: &[0],
        },
        Packed {
            cache: &mut b,
            tokens: &[500],
            positions: &[0],
            mask: &mb,
            readout: &[0],
        },
    ];
    assert!(matches!(
        model.forward_packed(&mut items),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!((a.len(), b.len()), (2, 0));
}

#[test]
fn truncate_then_reappend_equals_never_appending() {
    let model = Model::random(tiny(Arch::Llama), 3).unwrap();
    let mut a = KvCache::new(model.config());
    model.forward_causal(&mut a, &[1, 2, 3], &[2]).unwrap();
    let mut b = a.clone();
    model.forward_causal(&mut b, &[50, 51, 52], &[2]).unwrap();
    b.truncate(3);
    assert_eq!(b.len(), 3);
    let x = model.forward_causal(&mut a, &[7, 8], &[0, 1]).unwrap();
    let y = model.forward_causal(&mut b, &[7, 8], &[0, 1]).unwrap();
    assert_eq!(x, y);
}

#[test]
fn bad_input_is_a_typed_error_and_leaves_the_cache_alone() {
    let model = Model::random(tiny(Arch::Qwen2), 1).unwrap();
    let mut cache = KvCache::new(model.config());
    model.forward_causal(&mut cache, &[1, 2], &[1]).unwrap();
    let causal = BlockMask::causal(2, 2);
    type Case = (Vec<u32>, Vec<u32>, BlockMask, Vec<usize>);
    let cases: Vec<Case> = vec![
        (vec![], vec![], BlockMask::causal(2, 0), vec![]),
        (vec![1, 2], vec![2], causal.clone(), vec![0]),
        (vec![1, 200], vec![2, 3], causal.clone(), vec![0]),
        (vec![1, 2], vec![2, 3], causal.clone(), vec![2]),
        (vec![1, 2], vec![2, 3], BlockMask::causal(3, 2), vec![0]),
        (vec![1, 2], vec![2, 3], BlockMask::causal(2, 3), vec![0]),
        (vec![1, 2], vec![2, 999], causal.clone(), vec![0]),
    ];
    for (tokens, positions, mask, readout) in cases {
        let err = model.forward(&mut cache, &tokens, &positions, &mask, &readout);
        assert!(
            matches!(err, Err(Error::InvalidInput(_))),
            "{tokens:?} {positions:?}: {err:?}"
        );
        assert_eq!(cache.len(), 2);
    }
    let long: Vec<u32> = vec![1; 300];
    assert!(matches!(
        model.forward_causal(&mut cache, &long, &[0]),
        Err(Error::ContextExceeded { .. })
    ));
    let mut bad = tiny(Arch::Qwen2);
    bad.n_kv_heads = 3;
    assert!(Model::random(bad, 1).is_err());
}
