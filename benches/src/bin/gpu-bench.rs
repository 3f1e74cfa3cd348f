//! The engine on a GPU (the candle backend on `--device cuda:N`): checks against the CPU kernel model and step
//! timings, on random models at the real shapes of the shipped pair (Qwen2.5 0.5B and 1.5B) and of Qwen2.5-7B.
//!
//! Checks: each weight format's quantized matmul against its definition (`--format-rows`); each shape's logits over a
//! 32-token prompt against the f32 definition of the same random model (its weights dequantized, no activation
//! rounding): the definition run on the device within 1% of the largest logit with at least 90% of the rows' argmax
//! the same (the wiring), the device on the GGUF formats no further from it than twice the CPU kernel model is, plus
//! 1%; truncate and re-append gives the logits the first append gave; a pass of several sessions of different lengths
//! (1 and 4 rows each) attended in one batch per class of the KV pool gives the per-session path's logits on a
//! one-layer cut of the shape (within 1e-4). Timings (each shape, a session holding `--context` tokens): one decode
//! step, verification blocks of `--blocks` rows with logits at every row (what a PARSE verification reads), a
//! `--prefill`-token prefill; each block's cost is reported as a multiple of a decode step and per token as a
//! fraction of one. Batched passes (continuous batching's shape): `--sessions` sessions at `--context` tokens each
//! bring `--batch-rows` rows to one pass; their rows per second against one session's, with attention per session and
//! batched.
//!
//! Built with `--features cuda` (deploy/gpu/build-cuda.sh) and run on the GPU host by deploy/gpu/run-on-gpu.sh.
//! On a build without CUDA, `--device cpu` runs the same program on candle's CPU backend (CI runs it that way on
//! a cut-down shape, so the program itself is tested everywhere).
//!
//!   gpu-bench --device cuda:0 --json /tmp/gpu.json
//!   gpu-bench --device cpu --shapes 0.5b --layers 2 --context 64 --blocks 8 --prefill 64 --reps 2

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::quantized::GgmlDType;
use clap::Parser;
use parse_engine::candle::TensorCache;
use parse_engine::mask::BlockMask;
use parse_engine::model::{Layer, Packed, Weights};
use parse_engine::ops::RopeStyle;
use parse_engine::{Arch, CandleModel, DeviceSpec, KvCache, Logits, Model, ModelConfig};
use serde_json::json;

#[derive(Parser)]
#[command(
    about = "The candle backend on a GPU: checks against the CPU kernel model, and step timings"
)]
struct Args {
    /// cuda:N, or cpu (candle's CPU backend: a check of this program, not a GPU figure).
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Model shapes: 0.5b, 1.5b (the shipped pair's), 7b (Qwen2.5-7B's).
    #[arg(long, value_delimiter = ',', default_value = "0.5b,1.5b,7b")]
    shapes: Vec<String>,
    /// Keep only this many layers of each shape (quick runs; the timings are then not the model's).
    #[arg(long)]
    layers: Option<usize>,
    /// Tokens the session holds when steps and blocks are timed.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Verification block sizes (rows; logits at every row).
    #[arg(long, value_delimiter = ',', default_value = "8,32,64,128")]
    blocks: Vec<usize>,
    /// Prompt length of the timed prefill.
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Timed repetitions of each step (after 2 warm-ups); the median is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Sessions packed into one pass for the batched timings (continuous batching: each session holds `--context`
    /// tokens and brings `--batch-rows` rows); 1 is the baseline the others are compared with. Empty: none.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    sessions: Vec<usize>,
    /// Rows each session brings to a batched pass: 1 is a decode step, more a verification block.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch_rows: Vec<usize>,
    /// Row counts for the format checks: each weight format's quantized matmul on the device against its
    /// definition (the dequantized weights times the activations, in f64 on the host). Empty: none.
    #[arg(long, value_delimiter = ',', default_value = "1,8,9,32,64")]
    format_rows: Vec<usize>,
    /// Skip the comparison with the CPU kernel model (timings only).
    #[arg(long)]
    no_check: bool,
    /// Run the shapes' passes with every quantized matmul dequantizing its weights and multiplying on cuBLAS
    /// (candle's fallback) instead of the MMVQ / MMQ kernels, to compare the two at each row count.
    #[arg(long)]
    dequantize: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the run as a result record (`parse-record/1`) here.
    #[arg(long)]
    record: Option<PathBuf>,
}

/// A shape: the configuration and the weight formats of the checkpoints it stands for.
struct Shape {
    name: &'static str,
    cfg: ModelConfig,
    layers: GgmlDType,
    embed: GgmlDType,
    head: Option<GgmlDType>,
}

fn qwen2(
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: hidden / heads,
        rms_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_style: RopeStyle::Neox,
        max_context: 32768,
    }
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        // 896 is not a multiple of Q4_K's 256: the 0.5B file's matrices are Q5_0 / Q8_0, its head tied.
        "0.5b" => Shape {
            name: "0.5b",
            cfg: qwen2(151936, 896, 4864, 24, 14, 2),
            layers: GgmlDType::Q5_0,
            embed: GgmlDType::Q8_0,
            head: None,
        },
        "1.5b" => Shape {
            name: "1.5b",
            cfg: qwen2(151936, 1536, 8960, 28, 12, 2),
            layers: GgmlDType::Q4K,
            embed: GgmlDType::Q4K,
            head: Some(GgmlDType::Q6K),
        },
        "7b" => Shape {
            name: "7b",
            cfg: qwen2(152064, 3584, 18944, 28, 28, 4),
            layers: GgmlDType::Q4K,
            embed: GgmlDType::Q4K,
            head: Some(GgmlDType::Q6K),
        },
        other => bail!("unknown shape `{other}` (0.5b, 1.5b, 7b)"),
    })
}

fn rel_diff(a: &Logits, b: &Logits) -> f32 {
    let (mut diff, mut scale) = (0f32, 1e-6f32);
    for i in 0..a.len().min(b.len()) {
        for (x, y) in a.row(i).iter().zip(b.row(i)) {
            diff = diff.max((x - y).abs());
            scale = scale.max(x.abs());
        }
    }
    diff / scale
}

fn argmax_agreement(a: &Logits, b: &Logits) -> f64 {
    let n = a.len().min(b.len());
    let same = (0..n)
        .filter(|&i| {
            parse_engine::sampling::argmax(a.row(i)) == parse_engine::sampling::argmax(b.row(i))
        })
        .count();
    same as f64 / n.max(1) as f64
}

/// The definition of `m`: every matrix it multiplies by dequantized to f32 (exact), the head untied, so that
/// neither weights nor activations are rounded to a block format in a product. The embedding stays as stored (a
/// row of it is read, dequantized exactly).
fn definition(m: &Model) -> Result<Model> {
    let w = m.weights();
    let layers = w
        .layers
        .iter()
        .map(|l| Layer {
            attn_norm: l.attn_norm.clone(),
            wq: l.wq.dequantized(),
            wk: l.wk.dequantized(),
            wv: l.wv.dequantized(),
            bq: l.bq.clone(),
            bk: l.bk.clone(),
            bv: l.bv.clone(),
            wo: l.wo.weight().dequantized().into(),
            ffn_norm: l.ffn_norm.clone(),
            w_gate: l.w_gate.dequantized(),
            w_up: l.w_up.dequantized(),
            w_down: l.w_down.weight().dequantized().into(),
        })
        .collect();
    let head = w.lm_head.as_ref().unwrap_or(&w.embed).dequantized();
    Ok(Model::new(
        m.config().clone(),
        Weights {
            embed: w.embed.clone(),
            layers,
            norm: w.norm.clone(),
            lm_head: Some(head),
        },
    )?)
}

/// A causal block of `tokens` after what `cache` holds.
fn run(
    m: &CandleModel,
    cache: &mut TensorCache,
    tokens: &[u32],
    readout: &[usize],
) -> Result<Logits> {
    let base = cache.len();
    let pos: Vec<u32> = (base..base + tokens.len()).map(|p| p as u32).collect();
    Ok(m.forward(
        cache,
        tokens,
        &pos,
        &BlockMask::causal(base, tokens.len()),
        readout,
    )?)
}

fn tokens(n: usize, vocab: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729 + 13) % vocab) as u32)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median milliseconds of `f` over `reps` runs after two warm-ups. Every run reads logits back to the host, which
/// waits for the device.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(ms))
}

/// Rows of logits a shape's check compares with the definition (one prompt, logits at every row).
const CHECK_ROWS: usize = 32;

fn bench_shape(args: &Args, dev: &candle_core::Device, s: &Shape) -> Result<serde_json::Value> {
    let mut cfg = s.cfg.clone();
    if let Some(l) = args.layers {
        cfg.n_layers = l.max(1);
    }
    let t = Instant::now();
    let kernels = Model::random_in(cfg.clone(), s.layers, s.embed, s.head, 42)
        .with_context(|| format!("random {} model", s.name))?;
    let made_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut model = CandleModel::from_model(&kernels, dev)?;
    let upload_s = t.elapsed().as_secs_f64();
    eprintln!(
        "{}: {} layers, weights {:.0} MiB, made in {made_s:.1} s, uploaded in {upload_s:.1} s",
        s.name,
        cfg.n_layers,
        kernels.weight_bytes() as f64 / (1 << 20) as f64
    );
    let vocab = cfg.vocab_size;
    let mut check = serde_json::Value::Null;
    let mut ok = true;
    if !args.no_check {
        let prompt = tokens(CHECK_ROWS, vocab, 1);
        let all: Vec<usize> = (0..prompt.len()).collect();
        // The definition: the same weights dequantized to f32, activations never quantized, on the CPU kernel
        // model. The CPU kernel model on the GGUF formats and the device both quantize activations (Q8_K on the
        // CPU, Q8_1 in candle's CUDA kernels), and on a random deep model those roundings grow layer by layer, so
        // each is measured against the definition rather than against the other.
        let def = definition(&kernels)?;
        let want = def.forward_causal(&mut KvCache::new(&cfg), &prompt, &all)?;
        let cpu = kernels.forward_causal(&mut KvCache::new(&cfg), &prompt, &all)?;
        // The wiring (embedding, rotary, attention, masks, caches, readout): the definition on the device.
        let def_dev = CandleModel::from_model(&def, dev)?;
        drop(def);
        let wired = run(&def_dev, &mut def_dev.new_cache(), &prompt, &all)?;
        drop(def_dev);
        let mut cache = model.new_cache();
        let got = run(&model, &mut cache, &prompt, &all)?;
        let (wiring, wiring_agree) = (rel_diff(&want, &wired), argmax_agreement(&want, &wired));
        let (drift, agree) = (rel_diff(&want, &got), argmax_agreement(&want, &got));
        let (cpu_drift, cpu_agree) = (rel_diff(&want, &cpu), argmax_agreement(&want, &cpu));
        // Truncate and re-append: the same 8 tokens after the prompt, twice.
        let more = tokens(8, vocab, 2);
        let rows: Vec<usize> = (0..more.len()).collect();
        let first = run(&model, &mut cache, &more, &rows)?;
        cache.truncate(prompt.len());
        let again = run(&model, &mut cache, &more, &rows)?;
        let trunc = rel_diff(&first, &again);
        let finite = (0..got.len()).all(|i| got.row(i).iter().all(|x| x.is_finite()));
        // The wiring within 1% of the definition; the device's quantized kernels no further from it than twice the
        // CPU kernel model's own distance (plus 1% of the largest logit).
        ok = wiring < 0.01
            && wiring_agree >= 0.9
            && drift <= 2.0 * cpu_drift + 0.01
            && trunc < 1e-3
            && finite;
        check = json!({
            "wiring_rel_diff": wiring,
            "wiring_argmax_agreement": wiring_agree,
            "logits_rel_diff": drift,
            "argmax_agreement": agree,
            "cpu_kernels_rel_diff": cpu_drift,
            "cpu_kernels_argmax_agreement": cpu_agree,
            "truncate_rel_diff": trunc,
            "finite": finite,
            "ok": ok,
        });
        eprintln!(
            "{}: against the f32 definition (largest difference / largest logit, argmax agreement): the device on \
             f32 weights {wiring:.2e} {:.0}%, the device on the GGUF formats {drift:.4} {:.0}%, the CPU kernel \
             model {cpu_drift:.4} {:.0}%; truncate+re-append {trunc:.2e}: {}",
            s.name,
            wiring_agree * 100.0,
            agree * 100.0,
            cpu_agree * 100.0,
            if ok { "ok" } else { "FAILED" }
        );
    }
    drop(kernels);
    // Timings on a session holding `context` tokens.
    let mut cache = model.new_cache();
    let ctx = tokens(args.context, vocab, 3);
    for chunk in ctx.chunks(512) {
        run(&model, &mut cache, chunk, &[chunk.len() - 1])?;
    }
    let base = cache.len();
    let step = time(args.reps, || {
        run(&model, &mut cache, &[7], &[0])?;
        cache.truncate(base);
        Ok(())
    })?;
    let mut rows = vec![json!({"rows": 1, "ms": step, "x_step": 1.0, "per_token": 1.0})];
    for &r in &args.blocks {
        let block = tokens(r, vocab, 4);
        let all: Vec<usize> = (0..r).collect();
        let ms = time(args.reps, || {
            run(&model, &mut cache, &block, &all)?;
            cache.truncate(base);
            Ok(())
        })?;
        // As measured, so that a run stopped by a time limit still leaves its timings.
        eprintln!(
            "{}: a block of {r} rows {ms:.2} ms ({:.2} steps of {step:.2} ms)",
            s.name,
            ms / step
        );
        rows.push(
            json!({"rows": r, "ms": ms, "x_step": ms / step, "per_token": ms / step / r as f64}),
        );
    }
    let decode_paths = check_decode_paths(args, dev, s, &cfg, &mut model, &ctx)?;
    ok = ok && decode_paths["ok"].as_bool() != Some(false);
    let batched = bench_batched(args, s.name, &mut model, &ctx)?;
    let prompt = tokens(args.prefill, vocab, 5);
    let prefill = time(args.reps.min(3), || {
        let mut c = model.new_cache();
        run(&model, &mut c, &prompt, &[prompt.len() - 1])?;
        Ok(())
    })?;
    Ok(json!({
        "shape": s.name,
        "layers": cfg.n_layers,
        "formats": format!("{:?} layers, {:?} embedding, head {:?}", s.layers, s.embed, s.head),
        "context": base,
        "check": check,
        "ok": ok,
        "steps": rows,
        "batched": batched,
        "decode_paths": decode_paths,
        "prefill": {"tokens": args.prefill, "ms": prefill, "tok_per_s": args.prefill as f64 / prefill * 1e3},
    }))
}

/// The largest difference between two row-major matrices as a share of the largest entry of the first.
fn rel_diff_rows(want: &[f64], got: &[f32]) -> f64 {
    let scale = want.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
    let diff = want
        .iter()
        .zip(got)
        .fold(0f64, |m, (w, g)| m.max((w - *g as f64).abs()));
    diff / scale
}

/// Each weight format's quantized matmul on `dev` against its definition: the matrix's dequantized values times
/// the activations in f64 on the host, at every row count of `--format-rows`. On CUDA, each also with candle's
/// MMVQ / MMQ kernels switched off (`dmmv`: dequantize, then a dense product), so that a shape whose logits
/// disagree with the CPU kernel model can be traced to a format and a path. A path within 1% of the definition's
/// largest entry is `ok`.
fn check_formats(args: &Args, dev: &candle_core::Device) -> Result<Vec<serde_json::Value>> {
    use candle_core::Module;
    use candle_core::quantized::{QMatMul, ggml_file};
    let (n, k) = (512, 1536);
    let mut paths = vec![("fast", false)];
    if dev.is_cuda() {
        paths.push(("dmmv", true));
    }
    let mut out = Vec::new();
    for (i, dtype) in [
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ]
    .into_iter()
    .enumerate()
    {
        let w = parse_engine::quant::random_matrix(dtype, n, k, 77 + i as u64)?;
        let wf = w.to_f32();
        let q = ggml_file::qtensor_from_ggml(dtype, &w.raw_bytes(), vec![n, k], dev)?;
        let mm = QMatMul::from_qtensor(q)?;
        for &r in &args.format_rows {
            let x: Vec<f32> = (0..r * k)
                .map(|j| ((j * 7919 + 17) % 2003) as f32 / 1001.0 - 1.0)
                .collect();
            let want: Vec<f64> = (0..r)
                .flat_map(|a| {
                    let (x, wf) = (&x, &wf);
                    (0..n).map(move |b| {
                        (0..k)
                            .map(|c| x[a * k + c] as f64 * wf[b * k + c] as f64)
                            .sum::<f64>()
                    })
                })
                .collect();
            let xt = candle_core::Tensor::from_vec(x, (r, k), dev)?;
            for &(path, dmmv) in &paths {
                set_dmmv(dmmv);
                let got = mm
                    .forward(&xt)
                    .and_then(|y| y.flatten_all()?.to_vec1::<f32>());
                set_dmmv(false);
                let diff = rel_diff_rows(&want, &got?);
                out.push(json!({
                    "format": format!("{dtype:?}"),
                    "rows": r,
                    "path": path,
                    "rel_diff": diff,
                    "ok": diff < 0.01,
                }));
            }
        }
    }
    Ok(out)
}

/// candle's switch that keeps CUDA quantized matmuls off the MMVQ / MMQ kernels.
fn set_dmmv(on: bool) {
    #[cfg(feature = "cuda")]
    candle_core::quantized::cuda::set_force_dmmv(on);
    #[cfg(not(feature = "cuda"))]
    let _ = on;
}

/// Batched attention against session by session (see [`compare_decode_paths`]), in passes of 1 and 4 rows per
/// session, where the batched passes include decode rows of several sessions: judged on a one-layer cut of the shape
/// (the same first layer and embedding), where the two paths differ only in the order of the attention's sums (within
/// 1e-4 of the largest logit, argmax the same); on the whole model reported only, since a difference in the last bit
/// can flip an activation's rounding to Q8_1 in a later layer, and random layers amplify that (an H100 gave 0 at one
/// layer, 1.5e-4 at two, 1e-2 at eight, 2e-2 at 28, argmax the same everywhere).
fn check_decode_paths(
    args: &Args,
    dev: &candle_core::Device,
    s: &Shape,
    cfg: &ModelConfig,
    model: &mut CandleModel,
    ctx: &[u32],
) -> Result<serde_json::Value> {
    let most = args.sessions.iter().copied().max().unwrap_or(0);
    if most < 2 || !args.batch_rows.contains(&1) {
        return Ok(serde_json::Value::Null);
    }
    let n = most.min(8);
    let mut cut = cfg.clone();
    cut.n_layers = 1;
    let mut one =
        CandleModel::from_model(&Model::random_in(cut, s.layers, s.embed, s.head, 42)?, dev)?;
    let mut out = Vec::new();
    for rows in [1, 4] {
        let (d1, a1) = compare_decode_paths(&mut one, ctx, n, rows)?;
        let (d, a) = compare_decode_paths(model, ctx, n, rows)?;
        let ok = d1 < 1e-4 && a1 == 1.0;
        eprintln!(
            "{}: a pass of {n} sessions of different lengths, {rows} rows each, batched attention against per \
             session: one layer {d1:.2e} of the largest logit apart, argmax {:.0}% the same: {}; the whole model \
             {d:.2e}, {:.0}%",
            s.name,
            a1 * 100.0,
            if ok { "ok" } else { "FAILED" },
            a * 100.0
        );
        out.push(json!({
            "sessions": n,
            "rows": rows,
            "one_layer_rel_diff": d1,
            "one_layer_argmax_agreement": a1,
            "rel_diff": d,
            "argmax_agreement": a,
            "ok": ok,
        }));
    }
    let ok = out.iter().all(|c| c["ok"].as_bool() == Some(true));
    Ok(json!({"passes": out, "ok": ok}))
}

/// A pass of `n` sessions holding different lengths (the context less 0..n tokens, so the batched path pads, and
/// at a context of a power of two the longest sessions' blocks take them into the next capacity class of the KV
/// pool), `rows` causal rows each, run session by session and in one batched attention: the largest difference of
/// any session's logits at any row between the two as a share of its largest logit, and the share of rows with
/// the same argmax.
fn compare_decode_paths(
    model: &mut CandleModel,
    ctx: &[u32],
    n: usize,
    rows: usize,
) -> Result<(f32, f64)> {
    let mut logits = Vec::new();
    for on in [false, true] {
        model.set_batched_decode(on);
        let mut caches = Vec::with_capacity(n);
        for i in 0..n {
            let mut c = model.new_cache();
            for chunk in ctx[..ctx.len() - i].chunks(512) {
                run(model, &mut c, chunk, &[chunk.len() - 1])?;
            }
            caches.push(c);
        }
        let toks: Vec<Vec<u32>> = (0..n)
            .map(|i| (0..rows).map(|j| (i * 31 + j * 5 + 7) as u32).collect())
            .collect();
        let pos: Vec<Vec<u32>> = caches
            .iter()
            .map(|c| (c.len()..c.len() + rows).map(|p| p as u32).collect())
            .collect();
        let masks: Vec<BlockMask> = caches
            .iter()
            .map(|c| BlockMask::causal(c.len(), rows))
            .collect();
        let readout: Vec<usize> = (0..rows).collect();
        let mut items: Vec<Packed<'_, TensorCache>> = caches
            .iter_mut()
            .enumerate()
            .map(|(i, cache)| Packed {
                cache,
                tokens: &toks[i],
                positions: &pos[i],
                mask: &masks[i],
                readout: &readout,
            })
            .collect();
        logits.push(model.forward_packed(&mut items)?);
    }
    model.set_batched_decode(model.device().is_cuda());
    let pairs = || logits[0].iter().zip(&logits[1]);
    let diff = pairs().map(|(a, b)| rel_diff(a, b)).fold(0f32, f32::max);
    let agree = pairs().map(|(a, b)| argmax_agreement(a, b)).sum::<f64>() / n as f64;
    Ok((diff, agree))
}

/// Continuous batching's shape: `n` sessions, each holding the same `ctx`, one pass with `r` rows of each (a
/// decode step at 1 row, a verification block with logits at every row above), for every `n` in `--sessions` and
/// `r` in `--batch-rows`. Reported per pass and as rows per second, against one session's rows per second.
fn bench_batched(
    args: &Args,
    shape: &str,
    model: &mut CandleModel,
    ctx: &[u32],
) -> Result<Vec<serde_json::Value>> {
    let most = args.sessions.iter().copied().max().unwrap_or(0);
    if most == 0 || args.batch_rows.is_empty() {
        return Ok(Vec::new());
    }
    let vocab = model.config().vocab_size;
    let mut caches = Vec::with_capacity(most);
    for _ in 0..most {
        let mut c = model.new_cache();
        for chunk in ctx.chunks(512) {
            run(model, &mut c, chunk, &[chunk.len() - 1])?;
        }
        caches.push(c);
    }
    let base = ctx.len();
    let mut out = Vec::new();
    for &r in &args.batch_rows {
        let block = tokens(r, vocab, 6);
        let pos: Vec<u32> = (base..base + r).map(|p| p as u32).collect();
        let mask = BlockMask::causal(base, r);
        let all: Vec<usize> = (0..r).collect();
        // Both ways: session by session, and in one batched attention per capacity class of the KV pool (the CUDA
        // default).
        for (path, on) in [("sessions", false), ("batch", true)] {
            model.set_batched_decode(on);
            let model = &*model;
            let mut one = None;
            for &n in &args.sessions {
                let ms = time(args.reps, || {
                    let mut items: Vec<Packed<'_, TensorCache>> = caches[..n]
                        .iter_mut()
                        .map(|cache| Packed {
                            cache,
                            tokens: &block,
                            positions: &pos,
                            mask: &mask,
                            readout: &all,
                        })
                        .collect();
                    model.forward_packed(&mut items)?;
                    for c in &mut caches[..n] {
                        c.truncate(base);
                    }
                    Ok(())
                })?;
                let rows_per_s = (n * r) as f64 / ms * 1e3;
                let base_rate = *one.get_or_insert(rows_per_s / n as f64);
                eprintln!(
                    "{shape}: {n} sessions x {r} rows, attention {path}: {ms:.2} ms a pass, {rows_per_s:.0} rows/s"
                );
                out.push(json!({
                    "sessions": n,
                    "rows": r,
                    "attention": path,
                    "ms": ms,
                    "rows_per_s": rows_per_s,
                    "x_one_session": rows_per_s / base_rate,
                }));
            }
        }
    }
    model.set_batched_decode(model.device().is_cuda());
    Ok(out)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let spec: DeviceSpec = args.device.parse()?;
    let dev = spec.open()?;
    if args.reps == 0 || args.prefill == 0 || args.context == 0 {
        bail!("--reps, --prefill and --context must be at least 1");
    }
    if args.sessions.contains(&0) || args.batch_rows.contains(&0) || args.format_rows.contains(&0) {
        bail!("--sessions, --batch-rows and --format-rows take counts of at least 1");
    }
    if args.sessions.first().is_some_and(|&n| n != 1) {
        bail!("--sessions starts with 1: the batched passes are compared with one session's");
    }
    let shapes = args
        .shapes
        .iter()
        .map(|s| shape(s))
        .collect::<Result<Vec<_>>>()?;
    let formats = check_formats(&args, &dev)?;
    if !formats.is_empty() {
        println!(
            "weight formats against their definition ({}x{} matrices): largest difference / largest entry",
            512, 1536
        );
        println!("| format | rows | path | rel diff | ok |");
        println!("|---|---:|---|---:|---|");
        for f in &formats {
            println!(
                "| {} | {} | {} | {:.2e} | {} |",
                f["format"].as_str().unwrap_or("?"),
                f["rows"],
                f["path"].as_str().unwrap_or("?"),
                f["rel_diff"].as_f64().unwrap_or(f64::NAN),
                f["ok"]
            );
        }
    }
    let mut results = Vec::new();
    set_dmmv(args.dequantize);
    for s in &shapes {
        results.push(bench_shape(&args, &dev, s)?);
    }
    set_dmmv(false);
    println!(
        "device {spec}, session holding {} tokens, median of {} runs",
        args.context, args.reps
    );
    println!("| shape | rows | ms | x decode step | per token (x step) |");
    println!("|---|---:|---:|---:|---:|");
    for r in &results {
        for row in r["steps"].as_array().into_iter().flatten() {
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.3} |",
                r["shape"].as_str().unwrap_or("?"),
                row["rows"],
                row["ms"].as_f64().unwrap_or(f64::NAN),
                row["x_step"].as_f64().unwrap_or(f64::NAN),
                row["per_token"].as_f64().unwrap_or(f64::NAN)
            );
        }
        println!(
            "| {} | prefill {} | {:.1} | | {:.0} tok/s |",
            r["shape"].as_str().unwrap_or("?"),
            r["prefill"]["tokens"],
            r["prefill"]["ms"].as_f64().unwrap_or(f64::NAN),
            r["prefill"]["tok_per_s"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if results
        .iter()
        .any(|r| r["batched"].as_array().is_some_and(|b| !b.is_empty()))
    {
        println!(
            "\nbatched passes: n sessions, each holding {} tokens, r rows each",
            args.context
        );
        println!(
            "| shape | sessions | rows each | attention | ms per pass | rows/s | x one session's rows/s |"
        );
        println!("|---|---:|---:|---|---:|---:|---:|");
        for r in &results {
            for b in r["batched"].as_array().into_iter().flatten() {
                println!(
                    "| {} | {} | {} | {} | {:.2} | {:.0} | {:.2} |",
                    r["shape"].as_str().unwrap_or("?"),
                    b["sessions"],
                    b["rows"],
                    b["attention"].as_str().unwrap_or("?"),
                    b["ms"].as_f64().unwrap_or(f64::NAN),
                    b["rows_per_s"].as_f64().unwrap_or(f64::NAN),
                    b["x_one_session"].as_f64().unwrap_or(f64::NAN)
                );
            }
        }
    }
    let all_ok = results.iter().all(|r| r["ok"].as_bool() == Some(true))
        && formats.iter().all(|f| f["ok"].as_bool() == Some(true));
    let out =
        json!({"device": spec.to_string(), "formats": formats, "results": results, "ok": all_ok});
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &args.record {
        result_record(&args, &spec.to_string(), &results).write(p)?;
    }
    if !all_ok {
        bail!(
            "a check failed: a weight format against its definition, or a shape against the CPU kernel model (see above)"
        );
    }
    Ok(())
}

/// The run as a result record: per shape, the decode step, each block, the prefill and each batched pass as cells.
/// A shape's check against the f32 definition (the share of rows whose argmax agrees) is the quality beside its
/// figures: the device computes other bits than the CPU, so the outputs are not fixed by construction.
fn result_record(args: &Args, device: &str, results: &[serde_json::Value]) -> parse_record::Record {
    use parse_record::{Cell, Quality};
    let mut record = parse_record::Record::new(
        "gpu-bench",
        format!(
            "Model passes on {device} after {} tokens of context",
            args.context
        ),
        json!({
            "device": device, "shapes": args.shapes, "layers": args.layers, "context": args.context,
            "blocks": args.blocks, "prefill": args.prefill, "reps": args.reps, "sessions": args.sessions,
            "batch_rows": args.batch_rows, "dequantize": args.dequantize,
        }),
    );
    for r in results {
        let shape = r["shape"].as_str().unwrap_or("?");
        let quality = r["check"]["argmax_agreement"].as_f64().map(|a| Quality {
            metric: "argmax agreement with the f32 definition".into(),
            value: a,
            reference: None,
            n: CHECK_ROWS,
        });
        let with_quality = |c: Cell| match &quality {
            Some(q) => c.quality(q.clone()),
            None => c,
        };
        for row in r["steps"].as_array().into_iter().flatten() {
            let rows = row["rows"].as_u64().unwrap_or(0);
            let label = if rows == 1 {
                format!("{shape}: one-token decode step")
            } else {
                format!("{shape}: block of {rows} rows, logits at every row")
            };
            record.push(with_quality(
                Cell::new(label)
                    .figure("ms", row["ms"].clone())
                    .figure("x_decode_step", row["x_step"].clone()),
            ));
        }
        record.push(with_quality(
            Cell::new(format!(
                "{shape}: prefill of {} tokens",
                r["prefill"]["tokens"]
            ))
            .figure("ms", r["prefill"]["ms"].clone())
            .figure("tokens_per_s", r["prefill"]["tok_per_s"].clone()),
        ));
        for b in r["batched"].as_array().into_iter().flatten() {
            record.push(with_quality(
                Cell::new(format!(
                    "{shape}: {} sessions x {} rows in one pass, attention {}",
                    b["sessions"],
                    b["rows"],
                    b["attention"].as_str().unwrap_or("?")
                ))
                .figure("ms", b["ms"].clone())
                .figure("rows_per_s", b["rows_per_s"].clone())
                .figure("x_one_session", b["x_one_session"].clone()),
            ));
        }
    }
    record
}
