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
    /// Instead of the report: load each model twice in this process, its Q4_K matrices in rows and in the lanes
    /// layout (`quant::set_lanes`), and time the two pass by pass, alternating, so that the machine's drift falls
    /// on both alike (one-token steps, then each of `--blocks` with logits at every row, `--reps` pairs each).
    #[arg(long)]
    ab_lanes: bool,
    /// Instead of the report: as `--ab-lanes`, with Q4_K in the lanes layout on both sides and only the Q6_K
    /// matrices in rows on one side and in lanes on the other (`quant::set_q6k_lanes`).
    #[arg(long)]
    ab_lanes_q6k: bool,
    /// Instead of the report: as `--ab-lanes`, with the K-quants in the lanes layout on both sides and only the Q5_0
    /// matrices (the draft's) in rows on one side and in lanes on the other (`quant::set_q5_0_lanes`).
    #[arg(long)]
    ab_lanes_q5_0: bool,
    /// Instead of the report: time each model's passes without and with the attention's AVX-512 path, alternating
    /// pass by pass in one process (`ops::set_wide_attention`; the same bits either way): one-token steps, then each
    /// of `--blocks` with logits at every row, `--reps` pairs each, after `--context` tokens
    #[arg(long)]
    ab_attention: bool,
    /// Instead of the report: time each model's passes with the attention's path without AVX-512 taking each row of
    /// a block alone, key by key, and taking the rows together with keys scored 8 at a time, alternating pass by pass
    /// in one process (`ops::set_rows_together`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_attention_rows: bool,
    /// Instead of the report: time each model's passes with the attention's AVX-512 path reading its key and value
    /// rows as it comes to them and prefetching them ahead, alternating pass by pass in one process
    /// (`ops::set_attention_prefetch`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_attention_prefetch: bool,
    /// Instead of the report: time each model's passes with the VNNI Q4_K kernel taking one activation row at a
    /// time (one chain per sub-block) and up to four with their chains interleaved, alternating pass by pass in one
    /// process (`kernels::set_interleaved_q4k`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_q4k_chains: bool,
    /// Instead of the report: time each model's passes with the VNNI Q4_K lanes kernel holding a chunk's 16 words
    /// in registers for every row and loading each as the rows use it (blocks of up to 16 rows), alternating pass by
    /// pass in one process (`kernels::set_streamed_q4k`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_q4k_streamed: bool,
    /// Instead of the report: time each model's passes with the row-group kernels prefetching the next group's
    /// weights into L2 (`prefetcht1`) and into every level (`prefetcht0`), alternating pass by pass in one process
    /// (`kernels::set_prefetch_l1`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_prefetch_l1: bool,
    /// Instead of the report: time each model's passes with the K-quant (Q4_K, Q6_K) row-group matmuls split into
    /// L2-sized items and into two runs of rows per thread, alternating pass by pass in one process
    /// (`quant::set_long_chunks`; the same bits either way; Q5_0 and Q8_0 keep the L2-sized items on both sides), as
    /// `--ab-attention` does
    #[arg(long)]
    ab_long_chunks: bool,
    /// Instead of the report: time each model's passes with the AVX2 Q6_K panels taking a `madd` per `maddubs` and
    /// adding two `maddubs` as i16 before each `madd` (on activations laid out for it), alternating pass by pass in
    /// one process (`kernels::set_paired_q6k`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_q6k_pairs: bool,
    /// Instead of the report: time each model's passes with the weighted sums of attention's path without AVX-512
    /// taking each (row, head) over all its keys in one pass and going by runs of keys, every (row, head) over a
    /// run's values before the next, alternating pass by pass in one process (`ops::set_values_by_runs`; the same
    /// bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_values_by_runs: bool,
    /// Instead of the report: time each model's passes with the AVX2 Q4_K lanes kernel's two-row blocks scheduled
    /// as the compiler chose and with each sub-block's words read in order, alternating pass by pass in one process
    /// (`kernels::set_q4k_two_rows_in_order`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_q4k_in_order: bool,
    /// Instead of the report: time each model's passes with the activations quantized to Q8_K as before (on the
    /// calling thread; by candle's loop one value at a time without AVX-512) and as now (blocks of rows shared among
    /// the threads; the AVX2 variant's quantizer 8 values at a time), alternating pass by pass in one process
    /// (`kernels::set_fast_q8k`; the same bits either way), as `--ab-attention` does
    #[arg(long)]
    ab_fast_q8k: bool,
    /// Instead of the report: time each model's passes with the matmuls' chunk results of several rows zeroed in a
    /// fresh buffer and laid out on the calling thread, and zeroed and laid out by the threads in a buffer kept
    /// between calls, alternating pass by pass in one process (`quant::set_parallel_copy_out`; the same bits either
    /// way), as `--ab-attention` does
    #[arg(long)]
    ab_parallel_copy_out: bool,
    /// Instead of the report: load each model twice in this process, its weights on 4 KB pages and on 2 MB pages
    /// (`alloc::set_huge_pages`), and time the two pass by pass, alternating, as `--ab-lanes` does
    #[arg(long)]
    ab_huge_pages: bool,
    /// Also time packed passes of n sessions, each holding `--context` tokens and bringing one decode row (the
    /// workers' continuous batching at n requests in `target` mode), beside one session's block of n rows; with an
    /// `--ab-*` switch of one model's engine, such passes with the switch off and on, alternating.
    #[arg(long, value_delimiter = ',')]
    sessions: Vec<usize>,
}

/// A default model loaded for an A/B run, with `--context` tokens in a session "bench": (engine, those tokens, the
/// session's length after them).
fn loaded(name: &str, args: &Args) -> Result<(Engine, Vec<u32>, usize)> {
    let path = model_dir().join(file_for(name)?);
    let mut e = Engine::load(&config_for(name, &path))
        .with_context(|| format!("loading {}", path.display()))?;
    let ctx = context_tokens(&e, args.context)?;
    e.open_session("bench")?;
    e.forward_causal("bench", &ctx, &[ctx.len() - 1])?;
    let base = e.session_len("bench")?;
    Ok((e, ctx, base))
}

/// Medians (ms) of blocks of `n` rows (logits at every row) on two sides, 0 and 1 (`side(j)` sets side `j` up and
/// returns the index of the engine it runs on), alternating pass by pass, which goes first alternating too, after
/// untimed first passes (the kernel choice's trials, `kernels::choose`, and the caches); `--reps` pairs.
fn ab_medians(
    args: &Args,
    n: usize,
    mut side: impl FnMut(usize) -> usize,
    engines: &mut [(Engine, Vec<u32>, usize)],
) -> Result<[f64; 2]> {
    let mut ms = [Vec::new(), Vec::new()];
    for i in 0..2 * choose::TRIALS as usize + 2 * args.reps {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for j in order {
            let (e, ctx, base) = &mut engines[side(j)];
            let tokens: Vec<u32> = (0..n).map(|t| ctx[(t * 7 + i) % ctx.len()]).collect();
            let all: Vec<usize> = (0..n).collect();
            let t = Instant::now();
            e.forward_causal("bench", &tokens, &all)?;
            if i >= 2 * choose::TRIALS as usize {
                ms[j].push(t.elapsed().as_secs_f64() * 1e3);
            }
            e.truncate("bench", *base)?;
        }
    }
    Ok(ms.map(median))
}

/// One-token steps, then each of `--blocks`.
fn ab_sizes(args: &Args) -> Vec<usize> {
    let mut sizes = vec![1];
    sizes.extend(args.blocks.iter().copied().filter(|&n| n > 1));
    sizes
}

/// Which matrices `--ab-lanes` and its variants switch between rows and lanes.
#[derive(Clone, Copy)]
enum LanesAb {
    All,
    Q6K,
    Q5_0,
}

/// `--ab-lanes`, `--ab-lanes-q6k` or `--ab-lanes-q5-0`: medians of alternating passes of the same model loaded with
/// and without the lanes layout (for every format, or for Q6_K or Q5_0 only).
fn ab_lanes(name: &str, args: &Args, which: LanesAb) -> Result<()> {
    let mut engines = Vec::new();
    for on in [false, true] {
        match which {
            LanesAb::All => parse_engine::quant::set_lanes(on),
            LanesAb::Q6K => {
                parse_engine::quant::set_lanes(true);
                parse_engine::quant::set_q6k_lanes(on);
            }
            LanesAb::Q5_0 => {
                parse_engine::quant::set_lanes(true);
                parse_engine::quant::set_q5_0_lanes(on);
            }
        }
        engines.push(loaded(name, args)?);
    }
    let which = match which {
        LanesAb::All => "rows",
        LanesAb::Q6K => "Q6_K in rows",
        LanesAb::Q5_0 => "Q5_0 in rows",
    };
    println!(
        "\n### {name}: {which} against the lanes layout, alternating pass by pass (median ms)\n"
    );
    println!("| block | rows | lanes | lanes / rows |");
    println!("|---:|---:|---:|---:|");
    for n in ab_sizes(args) {
        let [rows, lanes] = ab_medians(args, n, |j| j, &mut engines)?;
        println!("| {n} | {rows:.1} | {lanes:.1} | {:.3} |", lanes / rows);
    }
    Ok(())
}

/// Medians of alternating passes of one model with a switch of the engine off and on (`set`; the same bits either
/// way): `what` heads the table, `sides` names the two columns.
fn ab_switch(name: &str, args: &Args, what: &str, sides: [&str; 2], set: fn(bool)) -> Result<()> {
    let mut engines = vec![loaded(name, args)?];
    println!(
        "\n### {name}: {what}, alternating pass by pass (median ms, context {})\n",
        args.context
    );
    let [off, on] = sides;
    println!("| block | {off} | {on} | {on} / {off} |");
    println!("|---:|---:|---:|---:|");
    for n in ab_sizes(args) {
        let side = |j: usize| {
            set(j == 1);
            0
        };
        let medians = ab_medians(args, n, side, &mut engines);
        set(true);
        let [a, b] = medians?;
        println!("| {n} | {a:.1} | {b:.1} | {:.3} |", b / a);
    }
    if !args.sessions.is_empty() {
        println!("\n| sessions, one row each | {off} | {on} | {on} / {off} |");
        println!("|---:|---:|---:|---:|");
    }
    for &n in &args.sessions {
        let medians = ab_packed_medians(args, n, set, &mut engines[0]);
        set(true);
        let [a, b] = medians?;
        println!("| {n} | {a:.1} | {b:.1} | {:.3} |", b / a);
    }
    Ok(())
}

/// Medians (ms) of packed passes of `n` sessions, each holding the `--context` tokens and bringing one decode row
/// (as `--sessions` times them), with `set(false)` and `set(true)`, alternating pass by pass as [`ab_medians`] does.
fn ab_packed_medians(
    args: &Args,
    n: usize,
    set: fn(bool),
    (e, ctx, base): &mut (Engine, Vec<u32>, usize),
) -> Result<[f64; 2]> {
    let step = open_packed(e, ctx, *base, n)?;
    let mut ms = [Vec::new(), Vec::new()];
    for i in 0..2 * choose::TRIALS as usize + 2 * args.reps {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for j in order {
            set(j == 1);
            let t = Instant::now();
            for r in e.forward_batch(&step) {
                r?;
            }
            if i >= 2 * choose::TRIALS as usize {
                ms[j].push(t.elapsed().as_secs_f64() * 1e3);
            }
            for b in &step {
                e.truncate(&b.session, *base)?;
            }
        }
    }
    for b in &step {
        e.release(&b.session)?;
    }
    Ok(ms.map(median))
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

/// `--ab-attention`: one model's passes with and without the attention's AVX-512 path (`ops::set_wide_attention`).
fn ab_attention(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "attention without and with its AVX-512 path",
        ["without", "with"],
        parse_engine::ops::set_wide_attention,
    )
}

/// `--ab-attention-rows`: one model's passes with the attention's rows alone and together
/// (`ops::set_rows_together`).
fn ab_attention_rows(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "attention without AVX-512, rows alone and together",
        ["alone", "together"],
        parse_engine::ops::set_rows_together,
    )
}

/// `--ab-attention-prefetch`: one model's passes with the attention's AVX-512 path prefetching its rows or not
/// (`ops::set_attention_prefetch`).
fn ab_attention_prefetch(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "attention's AVX-512 path without and with prefetches",
        ["without", "with"],
        parse_engine::ops::set_attention_prefetch,
    )
}

/// `--ab-q4k-chains`: one model's passes with the VNNI Q4_K kernel's rows one at a time and interleaved up to four
/// (`kernels::set_interleaved_q4k`).
fn ab_q4k_chains(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "Q4_K rows one at a time and interleaved",
        ["one at a time", "interleaved"],
        parse_engine::kernels::set_interleaved_q4k,
    )
}

/// `--ab-q4k-streamed`: one model's passes with the VNNI Q4_K lanes kernel's words held in registers and streamed
/// (`kernels::set_streamed_q4k`).
fn ab_q4k_streamed(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "Q4_K words held in registers and streamed",
        ["held", "streamed"],
        parse_engine::kernels::set_streamed_q4k,
    )
}

/// `--ab-prefetch-l1`: one model's passes with the row groups' prefetches into L2 and into every level
/// (`kernels::set_prefetch_l1`).
fn ab_prefetch_l1(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "row-group prefetches into L2 and into L1",
        ["prefetcht1", "prefetcht0"],
        parse_engine::kernels::set_prefetch_l1,
    )
}

/// `--ab-long-chunks`: one model's passes with the K-quant row-group matmuls in L2-sized items and in long runs of
/// rows (`quant::set_long_chunks`).
fn ab_long_chunks(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "K-quant row-group matmuls in L2-sized items and in two runs a thread",
        ["L2-sized", "long runs"],
        parse_engine::quant::set_long_chunks,
    )
}

/// `--ab-q6k-pairs`: one model's passes with the AVX2 Q6_K panels' products one `madd` each and in pairs
/// (`kernels::set_paired_q6k`).
fn ab_q6k_pairs(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "Q6_K products one madd each and in pairs",
        ["one each", "pairs"],
        parse_engine::kernels::set_paired_q6k,
    )
}

/// `--ab-values-by-runs`: one model's passes with attention's weighted sums (without AVX-512) in one pass per (row,
/// head) and by runs of keys (`ops::set_values_by_runs`).
fn ab_values_by_runs(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "attention's weighted sums without AVX-512 in one pass per (row, head) and by runs of keys",
        ["one pass", "by runs"],
        parse_engine::ops::set_values_by_runs,
    )
}

/// `--ab-q4k-in-order`: one model's passes with the AVX2 Q4_K lanes kernel's two-row blocks as the compiler scheduled
/// them and with each sub-block's words read in order (`kernels::set_q4k_two_rows_in_order`).
fn ab_q4k_in_order(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "Q4_K two-row blocks as scheduled and in order",
        ["as scheduled", "in order"],
        parse_engine::kernels::set_q4k_two_rows_in_order,
    )
}

/// `--ab-fast-q8k`: one model's passes with the activations quantized to Q8_K as before and as now
/// (`kernels::set_fast_q8k`).
fn ab_fast_q8k(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "Q8_K activations quantized as before and shared among the threads, by AVX2 where that is the variant",
        ["before", "now"],
        parse_engine::kernels::set_fast_q8k,
    )
}

/// `--ab-parallel-copy-out`: one model's passes with the matmuls' results laid out on the calling thread and by the
/// threads (`quant::set_parallel_copy_out`).
fn ab_parallel_copy_out(name: &str, args: &Args) -> Result<()> {
    ab_switch(
        name,
        args,
        "matmul results laid out on the calling thread and by the threads",
        ["calling thread", "threads"],
        parse_engine::quant::set_parallel_copy_out,
    )
}

/// `--ab-huge-pages`: medians of alternating passes of the same model loaded with its weights on 4 KB pages and on
/// 2 MB pages (`alloc::set_huge_pages`; the same bits either way).
fn ab_huge_pages(name: &str, args: &Args) -> Result<()> {
    let mut engines = Vec::new();
    for on in [false, true] {
        parse_engine::alloc::set_huge_pages(on);
        engines.push(loaded(name, args)?);
    }
    println!(
        "\n### {name}: weights on 4 KB pages and on 2 MB pages, alternating pass by pass (median ms, context {})\n",
        args.context
    );
    println!("| block | 4 KB pages | 2 MB pages | 2 MB / 4 KB |");
    println!("|---:|---:|---:|---:|");
    for n in ab_sizes(args) {
        let [small, huge] = ab_medians(args, n, |j| j, &mut engines)?;
        println!("| {n} | {small:.1} | {huge:.1} | {:.3} |", huge / small);
    }
    Ok(())
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
    if args.ab_lanes || args.ab_lanes_q6k || args.ab_lanes_q5_0 {
        let which = if args.ab_lanes_q6k {
            LanesAb::Q6K
        } else if args.ab_lanes_q5_0 {
            LanesAb::Q5_0
        } else {
            LanesAb::All
        };
        for m in &args.models {
            ab_lanes(m, &args, which)?;
        }
        return Ok(());
    }
    if args.ab_attention {
        for m in &args.models {
            ab_attention(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_attention_rows {
        for m in &args.models {
            ab_attention_rows(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_attention_prefetch {
        for m in &args.models {
            ab_attention_prefetch(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_huge_pages {
        for m in &args.models {
            ab_huge_pages(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_q4k_streamed {
        for m in &args.models {
            ab_q4k_streamed(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_q4k_chains {
        for m in &args.models {
            ab_q4k_chains(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_prefetch_l1 {
        for m in &args.models {
            ab_prefetch_l1(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_long_chunks {
        for m in &args.models {
            ab_long_chunks(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_q6k_pairs {
        for m in &args.models {
            ab_q6k_pairs(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_values_by_runs {
        for m in &args.models {
            ab_values_by_runs(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_q4k_in_order {
        for m in &args.models {
            ab_q4k_in_order(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_fast_q8k {
        for m in &args.models {
            ab_fast_q8k(m, &args)?;
        }
        return Ok(());
    }
    if args.ab_parallel_copy_out {
        for m in &args.models {
            ab_parallel_copy_out(m, &args)?;
        }
        return Ok(());
    }
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
    Ok(())
}
