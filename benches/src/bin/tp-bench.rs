//! Tensor-parallel benchmark, all in one run on one machine:
//!
//! 1. Collectives over TCP on loopback (a group of `--world` ranks as threads of this process): all-reduce and
//!    all-gather latency (median) and bandwidth by message size.
//! 2. The default target's step cost at TP = 1 and TP = `--world` (ranks as threads here, over the same loopback
//!    TCP), in both layouts: a one-token decode step and a `--block`-token verification block on a warm cache,
//!    reported as ratios to this run's TP = 1.
//!
//! The ranks share this machine's cores, so on a small CPU box the ratio shows what the split and the collectives
//! cost, not the speed-up of ranks with cores (or GPUs) of their own.
//!
//! `cargo run --release -p parse-bench --bin tp-bench -- [--world 2] [--context 256] [--steps 16] [--block 32]`

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use parse_bench::{median, model_dir};
use parse_comm::{Comm, loopback_group};
use parse_engine::tp::{Layout, Member};
use parse_engine::{Engine, EngineConfig, EngineOps};
use serde_json::json;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Message sizes of the collectives, in f32 values.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,256,4096,65536,1048576"
    )]
    sizes: Vec<usize>,
    /// Repetitions per collective and size.
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// Tokens in the cache before the measured steps.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Decode steps and blocks timed per configuration (median reported).
    #[arg(long, default_value_t = 16)]
    steps: usize,
    #[arg(long, default_value_t = 32)]
    block: usize,
    /// Skip the model part (collectives only).
    #[arg(long)]
    comm_only: bool,
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Runs `f` on every rank of a loopback group at once; returns rank 0's result.
fn on_group<T: Send + 'static>(
    world: usize,
    f: impl Fn(Arc<dyn Comm>) -> T + Send + Sync + 'static,
) -> Result<T> {
    let comms = loopback_group(world, Duration::from_secs(30))?;
    let f = Arc::new(f);
    let handles: Vec<JoinHandle<T>> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(Arc::new(c)))
        })
        .collect();
    let mut out = None;
    for (r, h) in handles.into_iter().enumerate() {
        let v = h.join().map_err(|_| anyhow::anyhow!("rank {r} panicked"))?;
        if r == 0 {
            out = Some(v);
        }
    }
    out.context("no rank 0")
}

fn collectives(args: &Args) -> Result<Vec<serde_json::Value>> {
    let (sizes, reps) = (args.sizes.clone(), args.reps);
    let rows = on_group(args.world, move |c| {
        let mut rows = Vec::new();
        for &n in &sizes {
            let mut buf = vec![1f32; n];
            let mut reduce = Vec::new();
            let mut gather = Vec::new();
            for _ in 0..5 {
                c.all_reduce_sum(&mut buf).expect("warm-up");
            }
            for _ in 0..reps {
                c.barrier().expect("barrier");
                let t = Instant::now();
                c.all_reduce_sum(&mut buf).expect("all-reduce");
                reduce.push(t.elapsed().as_secs_f64());
                c.barrier().expect("barrier");
                let t = Instant::now();
                let g = c.all_gather(&buf).expect("all-gather");
                gather.push(t.elapsed().as_secs_f64());
                std::hint::black_box(g);
                buf.fill(1.0);
            }
            let (r, g) = (median(reduce), median(gather));
            let bytes = (n * 4) as f64;
            rows.push(json!({
                "floats": n,
                "bytes": n * 4,
                "all_reduce_us": r * 1e6,
                "all_reduce_mb_per_s": bytes / r / 1e6,
                "all_gather_us": g * 1e6,
                "all_gather_mb_per_s": bytes / g / 1e6,
            }));
        }
        rows
    })?;
    Ok(rows)
}

/// Median seconds of a decode step and of a block, on a session holding `context` tokens.
fn step_costs(e: &mut impl EngineOps, args: &Args) -> Result<(f64, f64)> {
    let prompt: Vec<u32> = (0..args.context as u32).map(|i| 200 + i % 5000).collect();
    e.open_session("bench")?;
    e.forward_causal("bench", &prompt, &[0])?;
    let base = e.engine().session_len("bench")?;
    let mut decode = Vec::new();
    for i in 0..args.steps {
        let t = Instant::now();
        e.forward_causal("bench", &[300 + i as u32], &[0])?;
        decode.push(t.elapsed().as_secs_f64());
        e.truncate("bench", base)?;
    }
    let block: Vec<u32> = (0..args.block as u32).map(|i| 400 + i).collect();
    let readout: Vec<usize> = (0..block.len()).collect();
    let mut blocks = Vec::new();
    for _ in 0..args.steps.div_ceil(4).max(3) {
        let t = Instant::now();
        e.forward_causal("bench", &block, &readout)?;
        blocks.push(t.elapsed().as_secs_f64());
        e.truncate("bench", base)?;
    }
    e.release("bench")?;
    Ok((median(decode), median(blocks)))
}

fn main() -> Result<()> {
    let args = Args::parse();
    eprintln!("collectives over loopback TCP, world {}", args.world);
    let comm_rows = collectives(&args)?;
    for r in &comm_rows {
        eprintln!(
            "  {:>9} B: all-reduce {:>9.1} us ({:>7.1} MB/s), all-gather {:>9.1} us ({:>7.1} MB/s)",
            r["bytes"],
            r["all_reduce_us"].as_f64().unwrap_or(0.0),
            r["all_reduce_mb_per_s"].as_f64().unwrap_or(0.0),
            r["all_gather_us"].as_f64().unwrap_or(0.0),
            r["all_gather_mb_per_s"].as_f64().unwrap_or(0.0)
        );
    }
    let mut report = json!({"world": args.world, "collectives": comm_rows});
    if !args.comm_only {
        let path = model_dir().join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        let load = || Engine::load(&EngineConfig::new(&path));
        let mut single = load()?;
        let (d1, b1) = step_costs(&mut single, &args)?;
        drop(single);
        eprintln!(
            "TP = 1: decode step {:.1} ms, {}-token block {:.1} ms",
            d1 * 1e3,
            args.block,
            b1 * 1e3
        );
        let mut layouts = Vec::new();
        for (name, layout) in [("exact", Layout::Exact), ("megatron", Layout::Megatron)] {
            let engines: Vec<Engine> = (0..args.world).map(|_| load()).collect::<Result<_, _>>()?;
            let comms = loopback_group(args.world, Duration::from_secs(30))?;
            let mut leader = None;
            let mut followers = Vec::new();
            for (e, c) in engines.into_iter().zip(comms) {
                match parse_engine::tp::join(e, Arc::new(c), layout)? {
                    Member::Leader(l) => leader = Some(l),
                    Member::Follower(f) => followers.push(std::thread::spawn(move || f.follow())),
                    Member::Alone(_) => anyhow::bail!("a group of one"),
                }
            }
            let mut leader = leader.context("no leader")?;
            let (d, b) = step_costs(&mut leader, &args)?;
            leader.stop_followers()?;
            for f in followers {
                f.join()
                    .map_err(|_| anyhow::anyhow!("a follower panicked"))??;
            }
            eprintln!(
                "TP = {} {name}: decode step {:.1} ms ({:.2}x TP = 1), block {:.1} ms ({:.2}x)",
                args.world,
                d * 1e3,
                d / d1,
                b * 1e3,
                b / b1
            );
            layouts.push(json!({
                "layout": name,
                "decode_ms": d * 1e3,
                "block_ms": b * 1e3,
                "decode_over_tp1": d / d1,
                "block_over_tp1": b / b1,
            }));
        }
        report["model"] = json!({
            "context": args.context,
            "block": args.block,
            "tp1": {"decode_ms": d1 * 1e3, "block_ms": b1 * 1e3},
            "tp": layouts,
        });
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = &args.out {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
