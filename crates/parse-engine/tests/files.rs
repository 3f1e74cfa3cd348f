//! Loading from files the test writes itself: tiny GGUF models in every supported weight format (llama and qwen2
//! architectures), safetensors checkpoints, and broken files that must give typed errors.

use std::path::Path;

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use parse_engine::load::{self, GgufFile, LoadOptions};
use parse_engine::{Arch, Error, KvCache, Model, ModelConfig, ops::RopeStyle};

fn tiny(arch: Arch) -> ModelConfig {
    common::tiny_k(arch, 128)
}

fn tensor(data: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Writes `model` as GGUF, matrix `i` (in file order) quantized to `formats[i % len]`.
fn write_gguf(
    path: &Path,
    model: &Model,
    arch_name: &str,
    formats: &[GgmlDType],
    corrupt_q_shape: bool,
) {
    let cfg = model.config();
    let w = model.weights();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut i = 0;
    let mut mat =
        |name: String, m: &parse_engine::quant::QMatrix, tensors: &mut Vec<(String, QTensor)>| {
            let (rows, cols) = (m.rows(), m.cols());
            let shape = if corrupt_q_shape && name.ends_with("attn_k.weight") {
                [cols, rows]
            } else {
                [rows, cols]
            };
            let t = tensor(m.to_f32(), &shape);
            tensors.push((
                name,
                QTensor::quantize(&t, formats[i % formats.len()]).unwrap(),
            ));
            i += 1;
        };
    let vec = |name: String, v: &[f32], tensors: &mut Vec<(String, QTensor)>| {
        let t = tensor(v.to_vec(), &[v.len()]);
        tensors.push((name, QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    };
    mat("token_embd.weight".into(), &w.embed, &mut tensors);
    if let Some(head) = &w.lm_head {
        mat("output.weight".into(), head, &mut tensors);
    }
    vec("output_norm.weight".into(), &w.norm, &mut tensors);
    for (li, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("blk.{li}.{s}");
        vec(p("attn_norm.weight"), &l.attn_norm, &mut tensors);
        vec(p("ffn_norm.weight"), &l.ffn_norm, &mut tensors);
        mat(p("attn_q.weight"), &l.wq, &mut tensors);
        mat(p("attn_k.weight"), &l.wk, &mut tensors);
        mat(p("attn_v.weight"), &l.wv, &mut tensors);
        mat(p("attn_output.weight"), l.wo.weight(), &mut tensors);
        mat(p("ffn_gate.weight"), &l.w_gate, &mut tensors);
        mat(p("ffn_up.weight"), &l.w_up, &mut tensors);
        mat(p("ffn_down.weight"), l.w_down.weight(), &mut tensors);
        for (name, b) in [
            ("attn_q.bias", &l.bq),
            ("attn_k.bias", &l.bk),
            ("attn_v.bias", &l.bv),
        ] {
            if let Some(b) = b {
                vec(p(name), b, &mut tensors);
            }
        }
    }
    let k = |s: &str| format!("{arch_name}.{s}");
    let meta: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String(arch_name.into()),
        ),
        (k("context_length"), Value::U32(cfg.max_context as u32)),
        (k("embedding_length"), Value::U32(cfg.hidden_size as u32)),
        (
            k("feed_forward_length"),
            Value::U32(cfg.intermediate_size as u32),
        ),
        (k("block_count"), Value::U32(cfg.n_layers as u32)),
        (k("attention.head_count"), Value::U32(cfg.n_heads as u32)),
        (
            k("attention.head_count_kv"),
            Value::U32(cfg.n_kv_heads as u32),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_eps),
        ),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

fn load_path(path: &Path) -> parse_engine::Result<Model> {
    let mut g = GgufFile::open(path)?;
    load::load_gguf(&mut g, &LoadOptions::default())
}

fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut c = KvCache::new(model.config());
    let readout: Vec<usize> = (0..tokens.len()).collect();
    let l = model.forward_causal(&mut c, tokens, &readout).unwrap();
    (0..tokens.len()).flat_map(|i| l.row(i).to_vec()).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let rms = (b.iter().map(|v| v * v).sum::<f32>() / b.len() as f32).sqrt();
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / rms
}

/// The model with matrix `i` (in the file order of `write_gguf`) quantized in memory to `formats[i % len]`.
fn quantized_copy(model: &Model, formats: &[GgmlDType]) -> Model {
    use parse_engine::quant::QMatrix;
    let mut w = model.weights().clone();
    let mut i = 0;
    let mut q = |m: &mut QMatrix| {
        *m =
            QMatrix::from_f32(formats[i % formats.len()], m.rows(), m.cols(), &m.to_f32()).unwrap();
        i += 1;
    };
    q(&mut w.embed);
    for l in w.layers.iter_mut() {
        for m in [
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            l.wo.weight_mut(),
            &mut l.w_gate,
            &mut l.w_up,
            l.w_down.weight_mut(),
        ] {
            q(m);
        }
    }
    Model::new(model.config().clone(), w).unwrap()
}

/// Every weight format goes through the GGUF byte path unchanged: the loaded model's logits are bitwise those of
/// the same model quantized in memory. With the default options, formats without fast CPU kernels are converted
/// to Q8_0, which stays close to the source.
#[test]
fn gguf_models_in_every_weight_format_load_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [1u32, 17, 250, 3, 99, 42];
    let exact_opts = LoadOptions {
        fast_cpu_formats: false,
        ..Default::default()
    };
    for arch in [Arch::Llama, Arch::Qwen2] {
        let reference = Model::random(tiny(arch), 11).unwrap();
        let arch_name = if arch == Arch::Llama {
            "llama"
        } else {
            "qwen2"
        };
        for formats in [
            vec![GgmlDType::F32],
            vec![GgmlDType::F16],
            vec![GgmlDType::Q8_0],
            vec![
                GgmlDType::Q4_0,
                GgmlDType::Q4_1,
                GgmlDType::Q5_0,
                GgmlDType::Q5_1,
            ],
            vec![
                GgmlDType::Q2K,
                GgmlDType::Q3K,
                GgmlDType::Q4K,
                GgmlDType::Q5K,
                GgmlDType::Q6K,
            ],
        ] {
            let path = dir.path().join(format!("{arch_name}-{formats:?}.gguf"));
            write_gguf(&path, &reference, arch_name, &formats, false);
            let mut g = GgufFile::open(&path).unwrap();
            let model = load::load_gguf(&mut g, &exact_opts).unwrap();
            assert_eq!(model.config(), reference.config());
            let want = logits(&quantized_copy(&reference, &formats), &tokens);
            assert!(
                logits(&model, &tokens) == want,
                "{arch_name} {formats:?}: logits differ"
            );
            // Default options: Q4_1/Q5_1 become Q8_0 (Q5_0 stays). The logits move (max 0.054 of their RMS measured here)
            // far less than 4- and 5-bit quantization moves them from the f32 model (~0.6).
            let fast = load_path(&path).unwrap();
            let err = rel_err(&logits(&fast, &tokens), &want);
            assert!(
                err < 0.15,
                "{arch_name} {formats:?}: fast-format drift {err}"
            );
        }
    }
}

/// A draft's head, stored Q8_0 and requantized to Q5_0 at load (`LoadOptions::draft`), then takes the layout this
/// CPU's kernels read fastest, as the file's own Q5_0 matrices do (one of Q5_0's lanes layouts where the AVX2 or
/// AVX-512 VNNI kernels run), with the logits of the same load in rows bit for bit.
#[test]
fn a_head_requantized_at_load_takes_the_fast_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny(Arch::Qwen2);
    cfg.vocab_size = 304; // whole groups of 16 rows
    let base = Model::random(cfg.clone(), 5).unwrap();
    let mut weights = base.weights().clone();
    let head: Vec<f32> = base
        .weights()
        .embed
        .to_f32()
        .iter()
        .map(|v| 0.5 - v)
        .collect();
    weights.lm_head = Some(
        parse_engine::quant::QMatrix::from_f32(
            GgmlDType::F32,
            cfg.vocab_size,
            cfg.hidden_size,
            &head,
        )
        .unwrap(),
    );
    let model = Model::new(cfg, weights).unwrap();
    let path = dir.path().join("head.gguf");
    write_gguf(&path, &model, "qwen2", &[GgmlDType::Q8_0], false);
    let load = |fast: bool| {
        let mut g = GgufFile::open(&path).unwrap();
        let opts = LoadOptions {
            fast_cpu_formats: fast,
            ..LoadOptions::draft()
        };
        load::load_gguf(&mut g, &opts).unwrap()
    };
    let (fast, rows) = (load(true), load(false));
    let head = fast.weights().lm_head.as_ref().expect("a head of its own");
    assert_eq!(head.dtype(), GgmlDType::Q5_0);
    let simd = parse_engine::kernels::active() >= parse_engine::kernels::Kernels::Avx2;
    assert_eq!(
        head.in_lanes(),
        simd,
        "the head in lanes exactly where the AVX2 or VNNI kernels run"
    );
    assert!(!rows.weights().lm_head.as_ref().unwrap().in_lanes());
    let tokens = [1u32, 17, 250, 3, 99, 42];
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(logits(&fast, &tokens)), bits(logits(&rows, &tokens)));
}

#[test]
fn broken_gguf_files_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::random(tiny(Arch::Qwen2), 5).unwrap();
    let good = dir.path().join("good.gguf");
    write_gguf(&good, &model, "qwen2", &[GgmlDType::Q8_0], false);
    let bytes = std::fs::read(&good).unwrap();

    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        load_path(&truncated),
        Err(Error::InvalidModel { .. })
    ));

    let header_only = dir.path().join("header.gguf");
    std::fs::write(&header_only, &bytes[..64]).unwrap();
    assert!(matches!(
        load_path(&header_only),
        Err(Error::InvalidModel { .. })
    ));

    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a gguf file at all").unwrap();
    assert!(matches!(
        load_path(&garbage),
        Err(Error::InvalidModel { .. })
    ));

    let mut flipped = bytes.clone();
    flipped[0] ^= 0xff;
    let bad_magic = dir.path().join("magic.gguf");
    std::fs::write(&bad_magic, &flipped).unwrap();
    assert!(matches!(
        load_path(&bad_magic),
        Err(Error::InvalidModel { .. })
    ));

    assert!(matches!(
        load_path(&dir.path().join("absent.gguf")),
        Err(Error::Io { .. })
    ));

    let gpt2 = dir.path().join("gpt2.gguf");
    write_gguf(&gpt2, &model, "gpt2", &[GgmlDType::Q8_0], false);
    assert!(matches!(load_path(&gpt2), Err(Error::UnsupportedArchitecture(a)) if a == "gpt2"));

    let transposed = dir.path().join("transposed.gguf");
    write_gguf(&transposed, &model, "qwen2", &[GgmlDType::F32], true);
    assert!(
        matches!(load_path(&transposed), Err(Error::ShapeMismatch { tensor, .. }) if tensor.contains("attn_k"))
    );
}

#[test]
fn sessions_over_capacity_fail_before_touching_the_cache() {
    let model = Model::random(tiny(Arch::Qwen2), 2).unwrap();
    let per_token = model.config().kv_bytes_per_token();
    let tokenizer = parse_engine::Tokenizer::from_file(&common::tokenizer_path()).unwrap();
    let mut e =
        parse_engine::Engine::from_parts(model, tokenizer, 10 * per_token, Path::new("tiny"));
    e.open_session("a").unwrap();
    e.open_session("b").unwrap();
    assert!(matches!(e.open_session("a"), Err(Error::SessionExists(_))));
    e.forward_causal("a", &[1, 2, 3, 4, 5, 6], &[5]).unwrap();
    let err = e.forward_causal("b", &[1, 2, 3, 4, 5], &[4]);
    assert!(
        matches!(err, Err(Error::CapacityExceeded { needed, available, .. }) if needed == 5 * per_token && available == 4 * per_token)
    );
    assert_eq!(e.session_len("b").unwrap(), 0);
    e.forward_causal("b", &[1, 2, 3, 4], &[3]).unwrap();
    e.truncate("a", 2).unwrap();
    // One session may hold at most its share of the store: 0.5 of 10 tokens' bytes is 5 tokens.
    e.set_kv_session_share(0.5).unwrap();
    let err = e.forward_causal("b", &[1, 2], &[1]);
    assert!(
        matches!(err, Err(Error::SessionShareExceeded { would_hold, .. }) if would_hold == 6 * per_token),
        "{err:?}"
    );
    assert_eq!(e.session_len("b").unwrap(), 4);
    e.forward_causal("b", &[1], &[0]).unwrap();
    assert!(e.set_kv_session_share(0.0).is_err() && e.set_kv_session_share(1.5).is_err());
    e.set_kv_session_share(1.0).unwrap();
    e.truncate("b", 4).unwrap();
    assert_eq!(e.sessions().used(), 6 * per_token);
    assert_eq!(e.release("a").unwrap(), 2 * per_token);
    assert!(matches!(
        e.forward_causal("a", &[1], &[0]),
        Err(Error::UnknownSession(_))
    ));
    assert!(matches!(e.truncate("b", 9), Err(Error::InvalidInput(_))));
    // Empty prompts are refused by the chat encoder and by generation.
    assert!(matches!(
        e.tokenizer()
            .encode_chat(&[parse_engine::Message::user("  ")])
            .map_err(Error::from),
        Err(Error::InvalidInput(_))
    ));
    let req = parse_engine::PlainRequest {
        prompt_tokens: vec![],
        max_new_tokens: 4,
        sampling: Default::default(),
        stop: vec![],
    };
    assert!(matches!(
        parse_engine::generate_plain(&mut e, "g", &req, |_, _| {}),
        Err(Error::InvalidInput(_))
    ));
    let req = parse_engine::PlainRequest {
        prompt_tokens: vec![1],
        max_new_tokens: 0,
        ..req
    };
    assert!(matches!(
        parse_engine::generate_plain(&mut e, "g", &req, |_, _| {}),
        Err(Error::InvalidInput(_))
    ));
}

#[test]
fn safetensors_checkpoints_load_exactly() {
    let dir = tempfile::tempdir().unwrap();
    for (arch, model_type) in [(Arch::Qwen2, "qwen2"), (Arch::Llama, "llama")] {
        let mut cfg = tiny(arch);
        cfg.rope_style = RopeStyle::Neox;
        let model = Model::random(cfg.clone(), 9).unwrap();
        let w = model.weights();
        let mut ts = std::collections::HashMap::new();
        let mut put = |name: String, data: Vec<f32>, shape: &[usize]| {
            ts.insert(name, tensor(data, shape));
        };
        put(
            "model.embed_tokens.weight".into(),
            w.embed.to_f32(),
            &[cfg.vocab_size, cfg.hidden_size],
        );
        put(
            "model.norm.weight".into(),
            w.norm.clone(),
            &[cfg.hidden_size],
        );
        for (i, l) in w.layers.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            for (name, m) in [
                ("self_attn.q_proj.weight", &l.wq),
                ("self_attn.k_proj.weight", &l.wk),
                ("self_attn.v_proj.weight", &l.wv),
                ("self_attn.o_proj.weight", l.wo.weight()),
                ("mlp.gate_proj.weight", &l.w_gate),
                ("mlp.up_proj.weight", &l.w_up),
                ("mlp.down_proj.weight", l.w_down.weight()),
            ] {
                put(p(name), m.to_f32(), &[m.rows(), m.cols()]);
            }
            put(
                p("input_layernorm.weight"),
                l.attn_norm.clone(),
                &[cfg.hidden_size],
            );
            put(
                p("post_attention_layernorm.weight"),
                l.ffn_norm.clone(),
                &[cfg.hidden_size],
            );
            for (name, b) in [
                ("self_attn.q_proj.bias", &l.bq),
                ("self_attn.k_proj.bias", &l.bk),
                ("self_attn.v_proj.bias", &l.bv),
            ] {
                if let Some(b) = b {
                    put(p(name), b.clone(), &[b.len()]);
                }
            }
        }
        let sub = dir.path().join(model_type);
        std::fs::create_dir_all(&sub).unwrap();
        candle_core::safetensors::save(&ts, sub.join("model.safetensors")).unwrap();
        let config = serde_json::json!({
            "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_context,
            "tie_word_embeddings": true
        });
        std::fs::write(sub.join("config.json"), config.to_string()).unwrap();
        let loaded = load::load_safetensors(&sub, &LoadOptions::default()).unwrap();
        assert_eq!(loaded.config(), model.config());
        let tokens = [3u32, 1, 4, 1, 5];
        assert_eq!(
            logits(&loaded, &tokens),
            logits(&model, &tokens),
            "{model_type}"
        );
        // A missing tensor is named.
        ts_remove_and_check(&sub);
    }
}

fn ts_remove_and_check(dir: &Path) {
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(dir.join("config.json"), bad.join("config.json")).unwrap();
    let mut ts =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    ts.remove("model.norm.weight");
    candle_core::safetensors::save(&ts, bad.join("model.safetensors")).unwrap();
    assert!(matches!(
        load::load_safetensors(&bad, &LoadOptions::default()),
        Err(Error::MissingTensor(t)) if t == "model.norm.weight"
    ));
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn good_bytes() -> &'static [u8] {
        static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        BYTES.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let model = Model::random(tiny(Arch::Qwen2), 5).unwrap();
            let p = dir.path().join("good.gguf");
            write_gguf(&p, &model, "qwen2", &[GgmlDType::Q8_0], false);
            std::fs::read(&p).unwrap()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A GGUF file with bytes changed (its header, metadata and tensor table first of all) or cut short: a
        /// model or a typed error, never a panic.
        #[test]
        fn a_damaged_gguf_is_a_model_or_a_typed_error(
            flips in proptest::collection::vec((0usize..4096, any::<u8>()), 1..6),
            cut in proptest::option::of(0usize..8192),
        ) {
            let mut bytes = good_bytes().to_vec();
            for (at, v) in flips {
                let at = at % bytes.len();
                bytes[at] = v;
            }
            if let Some(c) = cut {
                bytes.truncate(c.min(bytes.len()));
            }
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("damaged.gguf");
            std::fs::write(&p, &bytes).unwrap();
            match load_path(&p) {
                Ok(m) => prop_assert!(m.config().vocab_size > 0),
                // Typed errors of every kind (invalid model, missing tensor, unsupported setting), each with its message.
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
