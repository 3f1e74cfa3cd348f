//! One quantized matrix times blocks of activation rows, through the engine's CPU kernels (`QMatrix::matmul`, the
//! call a forward pass makes): the fastest of `--reps` calls after `--warmup` (which also settle the timed choice
//! between row groups and panels, `kernels::choose`), in ms and in multiply-adds per second.
//!
//! A matrix larger than the last-level cache streams its weights from memory on every call, as a model's do; one
//! that fits stays cached between calls. Timing both shapes tells whether a kernel's memory time and compute overlap:
//! `--shape 71680x1536` (62 MB in Q4_K) against `--shape 8960x1536` (8 MB) on a CPU with 32 MB of L3.
//!
//! `cargo run --release -p parse-bench --bin matmul-bench -- --formats q4k,q6k --shape 71680x1536 --rows 1,8,16`
//! (`PARSE_CPU_KERNELS` forces a kernel variant.)

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::quantized::GgmlDType;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Weight formats: q4k, q6k, q5_0, q8_0.
    #[arg(long, value_delimiter = ',', default_value = "q4k,q6k")]
    formats: Vec<String>,
    /// Weight rows x columns (columns a multiple of the format's block: 256 for the K-quants, 32 otherwise).
    #[arg(long, default_value = "71680x1536")]
    shape: String,
    /// Activation rows per call, one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    rows: Vec<usize>,
    /// Untimed calls first (the kernel choice is timed over the first calls of each block size).
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Timed calls; the fastest is reported.
    #[arg(long, default_value_t = 50)]
    reps: usize,
}

/// The most a matrix, or the activations or outputs of a call, may take (a mistyped shape is refused, not allocated).
const MAX_BYTES: usize = 4 << 30;

fn format(name: &str) -> Result<GgmlDType> {
    Ok(match name.trim() {
        "q4k" => GgmlDType::Q4K,
        "q6k" => GgmlDType::Q6K,
        "q5_0" => GgmlDType::Q5_0,
        "q8_0" => GgmlDType::Q8_0,
        other => bail!("unknown format {other:?}: use q4k, q6k, q5_0 or q8_0"),
    })
}

fn shape(s: &str) -> Result<(usize, usize)> {
    let (r, c) = s
        .split_once('x')
        .with_context(|| format!("--shape {s:?}: expected ROWSxCOLS, e.g. 71680x1536"))?;
    let (r, c): (usize, usize) = (
        r.trim().parse().context("--shape: rows")?,
        c.trim().parse().context("--shape: columns")?,
    );
    if r == 0 || c == 0 {
        bail!("--shape {s:?}: rows and columns must be positive");
    }
    Ok((r, c))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (n, k) = shape(&args.shape)?;
    if args.rows.contains(&0) || args.reps == 0 {
        bail!("--rows and --reps must be positive");
    }
    for name in &args.formats {
        let dtype = format(name)?;
        let bytes = parse_engine::quant::storage_bytes(dtype, n, k)
            .with_context(|| format!("--shape {n}x{k} does not fit {name} (its block size)"))?;
        let rows = args.rows.iter().max().copied().unwrap_or(1);
        let buffers = n.max(k).saturating_mul(rows).saturating_mul(4);
        if bytes > MAX_BYTES || buffers > MAX_BYTES {
            bail!(
                "--shape {n}x{k} with {rows} rows needs more than {MAX_BYTES} bytes; this bench stays under it"
            );
        }
        // In the layout a model's matrix takes at load on this CPU.
        let w = parse_engine::quant::random_matrix(dtype, n, k, 7)
            .with_context(|| format!("a {name} matrix of {n}x{k}"))?
            .into_fast_cpu_format();
        let mb = w.storage_bytes() as f64 / 1e6;
        for &m in &args.rows {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                .collect();
            let mut out = vec![0f32; m * n];
            for _ in 0..args.warmup {
                w.matmul(&x, m, &mut out)?;
            }
            let mut best = f64::MAX;
            for _ in 0..args.reps {
                let t = Instant::now();
                w.matmul(&x, m, &mut out)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            let macs = (n * k * m) as f64;
            println!(
                "{name} {n}x{k} ({mb:.1} MB), {m} rows: {:.3} ms, {:.1} G multiply-adds/s",
                best * 1e3,
                macs / best / 1e9
            );
        }
    }
    Ok(())
}
