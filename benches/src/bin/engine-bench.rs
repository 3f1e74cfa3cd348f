//! Engine benchmark: decode speed and the per-token cost of multi-token blocks on a warm cache, for each model.
//!
//! All figures of one run come from the same process on the same machine; the block costs are reported as ratios
//! to this run's own one-token decode step, which is what verification cost depends on.
//!
//! `cargo run --release -p parse-bench --bin engine-bench -- [--models target,draft] [--context 256] [--reps 5]`
//!
//! With `--llama-bench PATH` (built by `benches/llama-cpp/build.sh`), the same run also measures llama.cpp's
//! `llama-bench` on the same GGUF files, threads and context depth, and prints both engines' figures and their
//! ratios in one table. `PARSE_CPU_KERNELS=avx2|vnni` forces this engine's kernel variant.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use parse_bench::{median, model_dir};
use parse_engine::kernels::{self, choose};
use parse_engine::{Block, Engine, EngineConfig, EngineOps, Message};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Which default models to measure: `target`, `draft` (loaded as a draft is: its output head in Q5_0,
    /// `LoadOptions::draft`), `draft-stored` (the draft with its head as stored, Q8_0).
    #[arg(long, value_delimiter = ',', default_value = "target,draft")]
    models: Vec<String>,
    /// Tokens in the cache before each measured step.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// One-token decode steps timed.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// Repetitions of each block size (median reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128")]
    blocks: Vec<usize>,
    /// Write the JSON report here as well.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Write the run as a result record (`parse-record/1`) here.
    #[arg(long)]
    record: Option<std::path::PathBuf>,
    /// Mark the record's decode and 64-row block cells for the README's table.
    #[arg(long, requires = "record")]
    headline: bool,
    /// llama.cpp's `llama-bench` binary: measure it on the same files in the same run and print the ratios.
    #[arg(long)]
    llama_bench: Option<std::path::PathBuf>,
    /// Also measure how often the draft's greedy token equals the target's over this many target-chosen tokens
    /// per prompt, with the draft as stored (Q5_0 matrices, a Q8_0 head), with its Q5_0 matrices requantized to Q8_0,
    /// and with its head in Q5_0 (as a draft loads).
    #[arg(long)]
    agreement: Option<usize>,
    /// Repetitions for llama-bench.
    #[arg(long, default_value_t = 3)]
    llama_reps: usize,
    /// Also time packed passes of n sessions, each holding `--context` tokens and bringing one decode row (the
    /// workers' continuous batching at n requests in `target` mode), beside one session's block of n rows.
    #[arg(long, value_delimiter = ',')]
    sessions: Vec<usize>,
}

/// Opens `n` sessions "packed-i", each holding the `--context` tokens `ctx` (`base` long), and returns a packed
/// step of one decode row for each.
fn open_packed(e: &mut Engine, ctx: &[u32], base: usize, n: usize) -> Result<Vec<Block>> {
    let mut step = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("packed-{i}");
        e.open_session(&name)?;
        e.forward_causal(&name, ctx, &[ctx.len() - 1])?;
        step.push(Block::causal(
            &name,
            base,
            &[ctx[(i * 7) % ctx.len()]],
            vec![0],
        ));
    }
    Ok(step)
}

/// llama.cpp's figures for one model: decode tok/s (`tg32` after `context` tokens) and 64-token prompt tok/s
/// (`pp64` after `context` tokens; llama-bench computes logits at the last row of a prompt only).
fn llama_cpp(bin: &std::path::Path, file: &std::path::Path, args: &Args) -> Result<(f64, f64)> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let out = std::process::Command::new(bin)
        .args(["-m", &file.display().to_string()])
        .args(["-t", &threads.to_string(), "-p", "64", "-n", "32"])
        .args([
            "-d",
            &args.context.to_string(),
            "-r",
            &args.llama_reps.to_string(),
        ])
        .args(["-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "llama-bench failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    let runs: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("llama-bench JSON")?;
    let pick = |prompt: u64, generated: u64| -> Result<f64> {
        runs.as_array()
            .into_iter()
            .flatten()
            .find(|r| {
                r["n_prompt"].as_u64() == Some(prompt) && r["n_gen"].as_u64() == Some(generated)
            })
            .and_then(|r| r["avg_ts"].as_f64())
            .with_context(|| format!("no pp{prompt}/tg{generated} result from llama-bench"))
    };
    Ok((pick(0, 32)?, pick(64, 0)?))
}

/// The CPU's model name and the SIMD features that matter to the kernels.
fn cpu_description() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let have: Vec<&str> = [
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx_vnni",
        "amx_int8",
    ]
    .into_iter()
    .filter(|f| flags.split_whitespace().any(|x| x == *f))
    .collect();
    format!("{} ({})", field("model name"), have.join(", "))
}

fn file_for(model: &str) -> Result<&'static str> {
    match model {
        "target" => Ok("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        "draft" | "draft-stored" => Ok("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        other => anyhow::bail!("unknown model `{other}` (target, draft or draft-stored)"),
    }
}

/// How `model` is loaded: the draft as the workers load a draft, `draft-stored` and the target as stored.
fn config_for(model: &str, path: &std::path::Path) -> EngineConfig {
    let mut cfg = EngineConfig::new(path);
    if model == "draft" {
        cfg.load = parse_engine::LoadOptions::draft();
    }
    cfg
}

fn context_tokens(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let text = "Write a Python module that parses a CSV file of sales records, groups them by region and month, \
                computes totals and averages, and prints a report. Explain each step. "
        .repeat(1 + n / 30);
    let mut ids = engine.tokenizer().encode_chat(&[Message::user(&text)])?;
    ids.truncate(n);
    Ok(ids)
}

fn bench_model(name: &str, args: &Args) -> Result<serde_json::Value> {
    let path = model_dir().join(file_for(name)?);
    // llama.cpp first, so its run does not share the machine with this engine's loaded model.
    let llama = match &args.llama_bench {
        Some(bin) => Some(llama_cpp(bin, &path, args)?),
        None => None,
    };
    let t0 = Instant::now();
    let mut e = Engine::load(&config_for(name, &path))
        .with_context(|| format!("loading {}", path.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let ctx = context_tokens(&e, args.context)?;
    e.open_session("bench")?;
    e.forward_causal("bench", &ctx, &[ctx.len() - 1])?;
    let base = e.session_len("bench")?;

    // Decode: one token at a time after the context (greedy tokens do not matter for cost; use a fixed token).
    let mut step_ms = Vec::new();
    for i in 0..args.decode_steps + 2 {
        let t = Instant::now();
        e.forward_causal("bench", &[ctx[i % ctx.len()]], &[0])?;
        if i >= 2 {
            step_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    e.truncate("bench", base)?;
    let decode_ms = median(step_ms);

    let mut blocks = Vec::new();
    for &n in &args.blocks {
        let tokens: Vec<u32> = (0..n).map(|i| ctx[(i * 7) % ctx.len()]).collect();
        let all: Vec<usize> = (0..n).collect();
        let mut all_ms = Vec::new();
        let mut last_ms = Vec::new();
        // A block size's first calls time the row groups against the panels (kernels::choose; only with an AVX-512
        // VNNI variant, the only ones with row groups); the output head, called once per pass, needs 2 x TRIALS
        // passes to settle. Measure what a running server runs after them.
        if kernels::active() >= kernels::Kernels::Vnni
            && (choose::MIN_TRIED..=choose::MAX_TRIED).contains(&n)
        {
            for _ in 0..2 * choose::TRIALS {
                e.forward_causal("bench", &tokens, &all)?;
                e.truncate("bench", base)?;
            }
        }
        for _ in 0..args.reps {
            let t = Instant::now();
            e.forward_causal("bench", &tokens, &all)?;
            all_ms.push(t.elapsed().as_secs_f64() * 1e3);
            e.truncate("bench", base)?;
            let t = Instant::now();
            e.forward_causal("bench", &tokens, &[n - 1])?;
            last_ms.push(t.elapsed().as_secs_f64() * 1e3);
            e.truncate("bench", base)?;
        }
        let (all_ms, last_ms) = (median(all_ms), median(last_ms));
        blocks.push(json!({
            "tokens": n,
            "ms_readout_all": all_ms,
            "ms_readout_last": last_ms,
            "per_token_vs_decode_readout_all": all_ms / n as f64 / decode_ms,
            "per_token_vs_decode_readout_last": last_ms / n as f64 / decode_ms,
        }));
    }
    let mut packed = Vec::new();
    for &n in &args.sessions {
        let step = open_packed(&mut e, &ctx, base, n)?;
        // As for the blocks above: a pass of n rows first times the row groups against the panels (kernels::choose);
        // those calls are not what a running server runs.
        let warm = if kernels::active() >= kernels::Kernels::Vnni
            && (choose::MIN_TRIED..=choose::MAX_TRIED).contains(&n)
        {
            2 * choose::TRIALS as usize
        } else {
            2
        };
        let mut ms = Vec::new();
        for rep in 0..args.reps + warm {
            let t = Instant::now();
            for r in e.forward_batch(&step) {
                r?;
            }
            if rep >= warm {
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            for b in &step {
                e.truncate(&b.session, base)?;
            }
        }
        for b in &step {
            e.release(&b.session)?;
        }
        let ms = median(ms);
        packed.push(json!({ "sessions": n, "ms": ms, "vs_decode": ms / decode_ms }));
    }
    e.truncate("bench", 0)?;
    let per_token = e.model().config().kv_bytes_per_token();
    let filler: Vec<u32> = (0..1000).map(|i| ctx[i % ctx.len()]).collect();
    for chunk in filler.chunks(250) {
        e.forward_causal("bench", chunk, &[chunk.len() - 1])?;
    }
    let kv_1000 = e.sessions().bytes("bench")?;
    e.release("bench")?;
    Ok(json!({
        "model": name,
        "file": path.display().to_string(),
        "weights_mib": e.model().weight_bytes() as f64 / (1 << 20) as f64,
        "load_s": load_s,
        "context": base,
        "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1e3 / decode_ms,
        "blocks": blocks,
        "packed": packed,
        "kv_bytes_per_token": per_token,
        "kv_mib_per_1000_tokens": kv_1000 as f64 / (1 << 20) as f64,
        "llama_cpp": llama.map(|(decode, pp64)| json!({ "decode_tokens_per_s": decode, "pp64_tokens_per_s": pp64 })),
    }))
}

/// The draft with every Q5_0 matrix requantized to Q8_0 (what the engine loaded before it had Q5_0 kernels).
fn requantized_q5_0(model: &parse_engine::Model) -> Result<parse_engine::Model> {
    use candle_core::quantized::GgmlDType;
    use parse_engine::quant::QMatrix;
    let mut w = model.weights().clone();
    let q = |m: &mut QMatrix| -> Result<()> {
        if m.dtype() == GgmlDType::Q5_0 {
            *m = QMatrix::from_f32(GgmlDType::Q8_0, m.rows(), m.cols(), &m.to_f32())?;
        }
        Ok(())
    };
    q(&mut w.embed)?;
    if let Some(h) = w.lm_head.as_mut() {
        q(h)?;
    }
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
            q(m)?;
        }
    }
    Ok(parse_engine::Model::new(model.config().clone(), w)?)
}

/// Share of positions where the draft's greedy token equals the target's, over `n` tokens the target chose
/// greedily after each prompt (the draft reads the target's tokens, as in speculation).
fn agreement(n: usize) -> Result<serde_json::Value> {
    const PROMPTS: [&str; 4] = [
        "Write a Python function that merges two sorted lists into one sorted list.",
        "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Explain briefly.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain the difference between a process and a thread.",
    ];
    let target = Engine::load(&EngineConfig::new(model_dir().join(file_for("target")?)))?;
    let draft_path = model_dir().join(file_for("draft")?);
    let draft = Engine::load(&EngineConfig::new(&draft_path))?;
    let draft_head = Engine::load(&config_for("draft", &draft_path))?;
    fn kernels(e: &Engine) -> Result<&parse_engine::Model> {
        e.model()
            .kernels()
            .ok_or_else(|| anyhow::anyhow!("the agreement check runs on the kernels backend"))
    }
    let (target_model, draft_model) = (kernels(&target)?, kernels(&draft)?);
    let requant = requantized_q5_0(draft_model)?;
    let head_q5_0 = kernels(&draft_head)?;
    let argmax = parse_engine::sampling::argmax;
    let mut same = [0usize; 3];
    let mut total = 0usize;
    for p in PROMPTS {
        let ids = target.tokenizer().encode_chat(&[Message::user(p)])?;
        let mut cache = parse_engine::KvCache::new(target_model.config());
        let mut logits = target_model.forward_causal(&mut cache, &ids, &[ids.len() - 1])?;
        let mut cont = Vec::with_capacity(n);
        for _ in 0..n {
            let t = argmax(logits.row(0));
            cont.push(t);
            logits = target_model.forward_causal(&mut cache, &[t], &[0])?;
        }
        let mut seq = ids.clone();
        seq.extend_from_slice(&cont);
        let rows: Vec<usize> = (ids.len() - 1..seq.len() - 1).collect();
        for (i, model) in [draft_model, &requant, head_q5_0].into_iter().enumerate() {
            let mut c = parse_engine::KvCache::new(model.config());
            let l = model.forward_causal(&mut c, &seq[..seq.len() - 1], &rows)?;
            same[i] += (0..n).filter(|&j| argmax(l.row(j)) == cont[j]).count();
        }
        total += n;
    }
    Ok(json!({
        "tokens": total,
        "draft_q5_0": same[0] as f64 / total as f64,
        "draft_requantized_q8_0": same[1] as f64 / total as f64,
        "draft_head_q5_0": same[2] as f64 / total as f64,
    }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut reports = Vec::new();
    for m in &args.models {
        let r = bench_model(m, &args)?;
        println!(
            "\n### {m} ({:.0} MiB of weights, context {} tokens)\n",
            r["weights_mib"].as_f64().unwrap_or(0.0),
            r["context"]
        );
        println!(
            "decode: {:.1} ms/token = {:.1} tokens/s; KV cache {:.1} MiB per 1,000 tokens\n",
            r["decode_ms_per_token"].as_f64().unwrap_or(0.0),
            r["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["kv_mib_per_1000_tokens"].as_f64().unwrap_or(0.0)
        );
        println!(
            "| block | ms (logits at all rows) | per token / decode step | ms (logits at last row) | per token / decode step |"
        );
        println!("|---:|---:|---:|---:|---:|");
        for b in r["blocks"].as_array().into_iter().flatten() {
            println!(
                "| {} | {:.1} | {:.3} | {:.1} | {:.3} |",
                b["tokens"],
                b["ms_readout_all"].as_f64().unwrap_or(0.0),
                b["per_token_vs_decode_readout_all"].as_f64().unwrap_or(0.0),
                b["ms_readout_last"].as_f64().unwrap_or(0.0),
                b["per_token_vs_decode_readout_last"]
                    .as_f64()
                    .unwrap_or(0.0)
            );
        }
        if let Some(packed) = r["packed"].as_array().filter(|p| !p.is_empty()) {
            println!("\n| sessions, one row each | ms a packed pass | x decode step | tokens/s |");
            println!("|---:|---:|---:|---:|");
            for p in packed {
                let ms = p["ms"].as_f64().unwrap_or(0.0);
                println!(
                    "| {} | {ms:.1} | {:.2} | {:.1} |",
                    p["sessions"],
                    p["vs_decode"].as_f64().unwrap_or(0.0),
                    p["sessions"].as_f64().unwrap_or(0.0) * 1e3 / ms
                );
            }
        }
        reports.push(r);
    }
    if args.llama_bench.is_some() {
        println!("\n### Against llama.cpp (same files, threads and context depth, one run)\n");
        println!("| model | measure | llama.cpp tok/s | ours tok/s | ours / llama.cpp |");
        println!("|---|---|---:|---:|---:|");
        for r in &reports {
            let l = &r["llama_cpp"];
            let ours_decode = r["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
            let block = r["blocks"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|b| b["tokens"] == 64);
            let rows = [
                (
                    "decode",
                    l["decode_tokens_per_s"].as_f64(),
                    Some(ours_decode),
                ),
                (
                    "64-token block, ours with logits at every row",
                    l["pp64_tokens_per_s"].as_f64(),
                    block
                        .and_then(|b| b["ms_readout_all"].as_f64())
                        .map(|ms| 64e3 / ms),
                ),
                (
                    "64-token block, logits at the last row",
                    l["pp64_tokens_per_s"].as_f64(),
                    block
                        .and_then(|b| b["ms_readout_last"].as_f64())
                        .map(|ms| 64e3 / ms),
                ),
            ];
            for (what, theirs, ours) in rows {
                if let (Some(t), Some(o)) = (theirs, ours) {
                    println!(
                        "| {} | {what} | {t:.1} | {o:.1} | {:.2} |",
                        r["model"].as_str().unwrap_or(""),
                        o / t
                    );
                }
            }
        }
    }
    let agree = match args.agreement {
        Some(n) => {
            let a = agreement(n)?;
            println!(
                "\nDraft/target greedy agreement over {} target tokens: draft as stored (Q5_0, Q8_0 head) {:.3}, Q5_0 requantized to Q8_0 {:.3}, head in Q5_0 (as a draft loads) {:.3}",
                a["tokens"],
                a["draft_q5_0"].as_f64().unwrap_or(0.0),
                a["draft_requantized_q8_0"].as_f64().unwrap_or(0.0),
                a["draft_head_q5_0"].as_f64().unwrap_or(0.0)
            );
            Some(a)
        }
        None => None,
    };
    let cpu = cpu_description();
    let kernels = parse_engine::kernels::active().to_string();
    println!(
        "\nCPU: {cpu}; kernels: {kernels}; threads: {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let choices = choose::chooser().choices();
    if !choices.is_empty() {
        println!("Kernels as timed on this run's first calls (kernels::choose):");
        for line in choose::summary(&choices) {
            println!("  {line}");
        }
    }
    let report = json!({
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "row_group_choices": choices.iter().map(|c| json!({
            "format": c.key.format, "rows": c.key.n, "cols": c.key.k, "block_rows": c.key.m,
            "groups": c.groups, "panels_ns": c.panels_ns, "groups_ns": c.groups_ns,
        })).collect::<Vec<_>>(),
        "cpu": cpu,
        "kernels": kernels,
        "models": reports,
        "agreement": agree,
    });
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(path) = &args.record {
        result_record(&args, &report).write(path)?;
    }
    Ok(())
}

/// The run as a result record: per model, the decode step, each block and each packed pass as cells, and llama.cpp's
/// figures beside ours where it ran. The kernels compute the same bits at every block size and in every pass
/// (batch invariance, tested), so the cells carry no quality of their own.
fn result_record(args: &Args, report: &serde_json::Value) -> parse_record::Record {
    use parse_record::Cell;
    let mut record = parse_record::Record::new(
        "engine-bench",
        format!(
            "Engine passes after {} tokens of context, kernels {}",
            args.context,
            report["kernels"].as_str().unwrap_or_default()
        ),
        json!({
            "models": args.models, "context": args.context, "reps": args.reps, "blocks": args.blocks,
            "sessions": args.sessions, "decode_steps": args.decode_steps, "kernels": report["kernels"],
        }),
    );
    for m in report["models"].as_array().into_iter().flatten() {
        let name = m["model"].as_str().unwrap_or_default();
        let decode_ms = m["decode_ms_per_token"].as_f64().unwrap_or(f64::NAN);
        let mut decode = Cell::new(format!("{name}: one-token decode step"))
            .figure("ms", decode_ms)
            .figure("tokens_per_s", m["decode_tokens_per_s"].clone());
        if let Some(l) = m["llama_cpp"]["decode_tokens_per_s"].as_f64() {
            decode = decode
                .figure("llama_cpp_tokens_per_s", l)
                .figure("x_llama_cpp", 1e3 / decode_ms / l);
        }
        if args.headline {
            decode = decode.headline();
        }
        record.push(decode);
        for b in m["blocks"].as_array().into_iter().flatten() {
            let n = b["tokens"].as_u64().unwrap_or(0);
            let ms = b["ms_readout_all"].as_f64().unwrap_or(f64::NAN);
            let mut cell = Cell::new(format!("{name}: block of {n} rows, logits at every row"))
                .figure("ms", ms)
                .figure("x_decode_step", ms / decode_ms)
                .figure("tokens_per_s", n as f64 * 1e3 / ms);
            if n == 64 {
                if let Some(l) = m["llama_cpp"]["pp64_tokens_per_s"].as_f64() {
                    cell = cell
                        .figure("llama_cpp_tokens_per_s", l)
                        .figure("x_llama_cpp", 64e3 / ms / l);
                }
                if args.headline {
                    cell = cell.headline();
                }
            }
            record.push(cell);
        }
        for p in m["packed"].as_array().into_iter().flatten() {
            let ms = p["ms"].as_f64().unwrap_or(f64::NAN);
            record.push(
                Cell::new(format!(
                    "{name}: packed pass of {} sessions, one row each",
                    p["sessions"]
                ))
                .figure("ms", ms)
                .figure("x_decode_step", p["vs_decode"].clone()),
            );
        }
    }
    record
}
