//! Checks on the shipped default pair (fetched by `deploy/models/fetch.py`): batch invariance, an independent
//! reference implementation, and the GGUF-built tokenizer.

mod common;

use candle_core::quantized::gguf_file;
use parse_engine::{BlockMask, Engine, Message, sampling::argmax};

/// Prompt tokens plus a 40-token continuation the model itself chose greedily.
fn continuation(engine: &mut Engine, prompt: &str) -> (Vec<u32>, Vec<u32>) {
    let ids = engine
        .tokenizer()
        .encode_chat(&[Message::user(prompt)])
        .unwrap();
    engine.open_session("cont").unwrap();
    let mut logits = engine
        .forward_causal("cont", &ids, &[ids.len() - 1])
        .unwrap();
    let mut cont = Vec::new();
    for _ in 0..40 {
        let t = argmax(logits.row(0));
        cont.push(t);
        logits = engine.forward_causal("cont", &[t], &[0]).unwrap();
    }
    engine.release("cont").unwrap();
    (ids, cont)
}

/// Logits bits of every continuation position, feeding the continuation in blocks of `block` tokens.
fn logits_in_blocks(
    engine: &mut Engine,
    prompt: &[u32],
    cont: &[u32],
    block: usize,
) -> Vec<Vec<u32>> {
    engine.open_session("blocks").unwrap();
    engine
        .forward_causal("blocks", prompt, &[prompt.len() - 1])
        .unwrap();
    let mut rows = Vec::new();
    for chunk in cont.chunks(block) {
        let readout: Vec<usize> = (0..chunk.len()).collect();
        let l = engine.forward_causal("blocks", chunk, &readout).unwrap();
        for i in 0..chunk.len() {
            rows.push(l.row(i).iter().map(|v| v.to_bits()).collect());
        }
    }
    engine.release("blocks").unwrap();
    rows
}

fn check_batch_invariance(engine: &mut Engine) {
    let (prompt, cont) = continuation(engine, common::PROMPTS[0]);
    let one = logits_in_blocks(engine, &prompt, &cont, 1);
    for block in [7, 16, 40] {
        let other = logits_in_blocks(engine, &prompt, &cont, block);
        for (pos, (a, b)) in one.iter().zip(&other).enumerate() {
            assert!(
                a == b,
                "block size {block}: logits at position {pos} differ from one-token steps"
            );
        }
    }
}

#[test]
fn target_logits_are_bitwise_batch_invariant() {
    check_batch_invariance(&mut common::target().lock().unwrap_or_else(|e| e.into_inner()));
}

#[test]
fn draft_logits_are_bitwise_batch_invariant() {
    check_batch_invariance(&mut common::draft().lock().unwrap_or_else(|e| e.into_inner()));
}

/// A packed block with positions that are not consecutive (two branches) keeps the invariance: each branch's
/// logits equal those of the same tokens fed one at a time on their own.
#[test]
fn packed_branches_match_one_token_steps_on_the_real_target() {
    let mut e = common::target().lock().unwrap_or_else(|e| e.into_inner());
    let ids = e
        .tokenizer()
        .encode_chat(&[Message::user(common::PROMPTS[3])])
        .unwrap();
    let a = e.tokenizer().encode("101, 103 and 107").unwrap();
    let b = e.tokenizer().encode("Sure: 109").unwrap();
    let c = ids.len();
    e.open_session("packed").unwrap();
    e.forward_causal("packed", &ids, &[c - 1]).unwrap();
    let mut tokens = a.clone();
    tokens.extend(&b);
    let positions: Vec<u32> = (0..a.len())
        .chain(0..b.len())
        .map(|p| (c + p) as u32)
        .collect();
    let rows = (0..a.len())
        .map(|i| parse_engine::MaskRow {
            cached: c,
            spans: vec![0..i + 1],
        })
        .chain((0..b.len()).map(|i| parse_engine::MaskRow {
            cached: c,
            spans: vec![a.len()..a.len() + i + 1],
        }))
        .collect();
    let readout: Vec<usize> = (0..tokens.len()).collect();
    let packed = e
        .forward(
            "packed",
            &tokens,
            &positions,
            &BlockMask::from_rows(rows),
            &readout,
        )
        .unwrap();
    for (branch, offset) in [(&a, 0usize), (&b, a.len())] {
        e.truncate("packed", c).unwrap();
        for (i, t) in branch.iter().enumerate() {
            let l = e.forward_causal("packed", &[*t], &[0]).unwrap();
            let want: Vec<u32> = l.row(0).iter().map(|v| v.to_bits()).collect();
            let got: Vec<u32> = packed.row(offset + i).iter().map(|v| v.to_bits()).collect();
            assert!(want == got, "branch at {offset}, token {i}");
        }
    }
    e.release("packed").unwrap();
}

/// candle-transformers' quantized_qwen2 is an independent implementation of the same model. Both quantize
/// activations to 8 bits before each matmul, with different kernels, so their logits differ by that rounding noise
/// (measured on this file: mean |diff| ~0.09 against a run with f32 activations for ours, ~0.06 for the oracle):
/// where two candidates are within that noise, greedy choices may differ and free-running sequences then diverge.
/// The check: decode 32 tokens greedily with the oracle, feed the same tokens to our engine, and require (1) the
/// same argmax at every step where the oracle's top-2 margin exceeds the noise band (0.25), (2) mean |logit diff|
/// below 0.2 at every step, and (3) at least 150 of the 160 argmax choices agree. A wrong rotary layout, bias,
/// norm or mask moves logits by whole units and fails all three.
#[test]
fn target_greedy_tokens_match_candle_transformers_quantized_qwen2() {
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_qwen2::ModelWeights;
    let path = common::model_path(common::TARGET_FILE);
    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut oracle = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let mut e = common::target().lock().unwrap_or_else(|e| e.into_inner());
    let mut total_agree = 0;
    for prompt in common::PROMPTS {
        let ids = e.tokenizer().encode_chat(&[Message::user(prompt)]).unwrap();
        e.open_session("ours").unwrap();
        let mut ours = e.forward_causal("ours", &ids, &[ids.len() - 1]).unwrap();
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mut theirs = oracle.forward(&input, 0).unwrap();
        let mut agree = 0;
        let mut diverged = false;
        for i in 0..32 {
            let v: Vec<f32> = theirs
                .squeeze(0)
                .unwrap()
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .to_vec1()
                .unwrap();
            let a = ours.row(0);
            let t = argmax(&v);
            let mut sorted = v.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let margin = sorted[0] - sorted[1];
            let mean_diff =
                a.iter().zip(&v).map(|(x, y)| (x - y).abs()).sum::<f32>() / v.len() as f32;
            assert!(
                mean_diff < 0.2,
                "{prompt:?} step {i}: mean |logit diff| {mean_diff}"
            );
            if argmax(a) == t {
                agree += 1;
            } else {
                diverged = true;
                assert!(
                    margin < 0.25,
                    "{prompt:?} step {i}: oracle picks {t} by a margin of {margin}, we pick {}",
                    argmax(a)
                );
            }
            ours = e.forward_causal("ours", &[t], &[0]).unwrap();
            let input = Tensor::new(&[t], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            theirs = oracle.forward(&input, ids.len() + i).unwrap();
        }
        e.release("ours").unwrap();
        println!(
            "{prompt:?}: {agree}/32 greedy choices agree, free-running sequences identical: {}",
            !diverged
        );
        total_agree += agree;
    }
    assert!(
        total_agree >= 150,
        "only {total_agree}/160 greedy choices agree"
    );
}

fn eval_texts() -> Vec<String> {
    let mut texts = Vec::new();
    for (file, fields) in [
        ("humaneval-dev.jsonl", &["prompt"][..]),
        ("asdiv-dev.jsonl", &["passage", "question"][..]),
        ("xsum-dev.jsonl", &["document"][..]),
        ("mtbench-dev.jsonl", &["turns"][..]),
    ] {
        let path = common::eval_path(file);
        let data =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for line in data.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            for f in fields {
                match &v[*f] {
                    serde_json::Value::String(s) => texts.push(s.clone()),
                    serde_json::Value::Array(a) => {
                        texts.extend(a.iter().filter_map(|x| x.as_str()).map(String::from))
                    }
                    other => panic!("{file}: field {f} is {other:?}"),
                }
            }
        }
    }
    texts
}

#[test]
fn gguf_tokenizer_matches_the_reference_tokenizer_json_on_every_eval_prompt() {
    let reference = parse_engine::Tokenizer::from_file(&common::tokenizer_path())
        .expect("reference tokenizer loads");
    for file in [common::TARGET_FILE, common::DRAFT_FILE] {
        let mut f = std::fs::File::open(common::model_path(file)).unwrap();
        let content = gguf_file::Content::read(&mut f).unwrap();
        let ours = parse_engine::load::tokenizer_from_gguf(&content).unwrap();
        let texts = eval_texts();
        assert!(texts.len() > 1600, "eval prompts found: {}", texts.len());
        for text in &texts {
            let a = ours.encode(text).unwrap();
            assert_eq!(a, reference.encode(text).unwrap(), "{file}: {text:?}");
            assert_eq!(&ours.decode(&a, false).unwrap(), text);
        }
        // The chat layout with its special tokens encodes the same way too.
        let chat = ours.template().render(&[Message::user("hi")]);
        assert_eq!(
            ours.encode(&chat).unwrap(),
            reference.encode(&chat).unwrap()
        );
        assert!(ours.is_eos(ours.token_to_id("<|im_end|>").unwrap()));
    }
}
