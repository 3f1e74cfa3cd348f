//! Engine benchmark: decode speed and the per-token cost of multi-token blocks on a warm cache, for each model.
//!
//! All figures of one run come from the same process on the same machine; the block costs are reported as ratios
//! to this run's own one-token decode step, which is what verification cost depends on.
//!
//! `cargo run --release -p parse-bench --bin engine-bench -- [--models target,draft] [--context 256] [--reps 5]`

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use parse_bench::{median, model_dir};
use parse_engine::{Engine, EngineConfig, Message};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Which default models to measure.
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
}

fn file_for(model: &str) -> Result<&'static str> {
    match model {
        "target" => Ok("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        "draft" => Ok("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        other => anyhow::bail!("unknown model `{other}` (target or draft)"),
    }
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
    let t0 = Instant::now();
    let mut e = Engine::load(&EngineConfig::new(&path))
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
        "kv_bytes_per_token": per_token,
        "kv_mib_per_1000_tokens": kv_1000 as f64 / (1 << 20) as f64,
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
        reports.push(r);
    }
    let report = json!({ "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), "models": reports });
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
