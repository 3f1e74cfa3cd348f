//! Every CPU kernel variant this machine supports gives bitwise the same logits on the real pair, one token at a
//! time and in a block (variants the CPU lacks are skipped with a message). Its own test binary: it switches the
//! process-wide kernel choice.

mod common;

use parse_engine::Message;
use parse_engine::kernels::{self, Kernels};

/// Logits bits at every row of a 24-token block after the prompt, and at one further one-token step.
fn logits(engine: &mut parse_engine::Engine) -> Vec<Vec<u32>> {
    let ids = engine
        .tokenizer()
        .encode_chat(&[Message::user(common::PROMPTS[0])])
        .unwrap();
    engine.open_session("k").unwrap();
    let (prompt, block) = ids.split_at(ids.len() - 24);
    engine
        .forward_causal("k", prompt, &[prompt.len() - 1])
        .unwrap();
    let all: Vec<usize> = (0..block.len()).collect();
    let l = engine.forward_causal("k", block, &all).unwrap();
    let mut rows: Vec<Vec<u32>> = (0..block.len())
        .map(|i| l.row(i).iter().map(|v| v.to_bits()).collect())
        .collect();
    let one = engine.forward_causal("k", &[block[0]], &[0]).unwrap();
    rows.push(one.row(0).iter().map(|v| v.to_bits()).collect());
    engine.release("k").unwrap();
    rows
}

#[test]
fn every_supported_kernel_variant_gives_the_same_logits_on_the_real_pair() {
    let supported: Vec<Kernels> = Kernels::ALL.into_iter().filter(|k| k.supported()).collect();
    for k in Kernels::ALL.into_iter().filter(|k| !k.supported()) {
        eprintln!("skipping the {k} kernels: this CPU lacks the features");
    }
    // The scalar definitions are slow on a whole model; they are compared with every SIMD variant on random
    // blocks in the kernels' unit tests. Here: every SIMD variant against the first.
    let simd: Vec<Kernels> = supported
        .into_iter()
        .filter(|k| *k != Kernels::Scalar)
        .collect();
    if simd.len() < 2 {
        eprintln!("only {simd:?} runs here: nothing to compare");
        return;
    }
    for (name, engine) in [("target", common::target()), ("draft", common::draft())] {
        let mut e = engine.lock().unwrap();
        kernels::set_active(simd[0]).unwrap();
        let reference = logits(&mut e);
        for &k in &simd[1..] {
            kernels::set_active(k).unwrap();
            let got = logits(&mut e);
            for (row, (a, b)) in reference.iter().zip(&got).enumerate() {
                assert!(a == b, "{name}: {k} differs from {} at row {row}", simd[0]);
            }
        }
    }
    kernels::set_active(Kernels::best()).unwrap();
}
