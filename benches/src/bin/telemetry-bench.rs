//! The cost of observability: the same requests through a local cluster of real processes (target worker, draft
//! worker, router, default model pair) with telemetry off, then on: spans exported over OTLP/gRPC to a receiver in
//! this process (`OTEL_EXPORTER_OTLP_ENDPOINT`), worker metrics listeners on, and all three `/metrics` scraped every
//! second (more often than a usual 15-30 s scrape interval). Off and on alternate for `--rounds` rounds, a fresh
//! cluster each time, so that drift on a shared machine falls on both; the figure is output tokens per second,
//! summed over the rounds, and the on/off ratio.
//!
//! `cargo run --release -p parse-bench --bin telemetry-bench -- [--n 6] [--max-new-tokens 64] [--rounds 2]`
//! (needs the workspace's release binaries: `cargo build --release --workspace`).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use parse_bench::{humaneval_prompts, model_dir};
use parse_proto::v1::GenerateRequest;
use parse_proto::v1::generation_client::GenerationClient;
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// HumanEval development prompts sent one after another (the first N).
    #[arg(long, default_value_t = 6)]
    n: usize,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    /// Off/on pairs, each on a fresh cluster.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value = "parse+token-spec")]
    mode: String,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Default, Clone)]
struct Receiver(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("no parent")?.join(name);
    if !p.exists() {
        bail!(
            "{} is not built: cargo build --release --workspace",
            p.display()
        );
    }
    Ok(p)
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Kills the process when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A local cluster; `otlp`: the receiver's port (telemetry on), with metrics listeners on the returned ports.
struct Cluster {
    _procs: Vec<Proc>,
    router: u16,
    metrics: Vec<String>,
}

fn start(otlp: Option<u16>) -> Result<Cluster> {
    let dir = model_dir();
    let target = dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let draft = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let (tp, dp, rp, hp, tm, dm) = (
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
    );
    let spawn = |name: &str, args: Vec<String>| -> Result<Proc> {
        let mut c = Command::new(bin(name)?);
        c.args(args).env("RUST_LOG", "warn").stdout(Stdio::null());
        c.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
        if let Some(p) = otlp {
            c.env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://127.0.0.1:{p}"),
            );
        }
        Ok(Proc(c.spawn()?))
    };
    let on = otlp.is_some();
    let mut t_args = vec![
        "--model".to_string(),
        target.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{tp}"),
    ];
    let mut d_args = vec![
        "--model".to_string(),
        draft.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{dp}"),
    ];
    let mut r_args = vec![
        "--listen".to_string(),
        format!("127.0.0.1:{rp}"),
        "--target".into(),
        format!("127.0.0.1:{tp}"),
        "--draft".into(),
        format!("127.0.0.1:{dp}"),
    ];
    let mut metrics = Vec::new();
    if on {
        t_args.extend(["--metrics-listen".into(), format!("127.0.0.1:{tm}")]);
        d_args.extend(["--metrics-listen".into(), format!("127.0.0.1:{dm}")]);
        r_args.extend(["--openai-listen".into(), format!("127.0.0.1:{hp}")]);
        metrics = vec![
            format!("127.0.0.1:{hp}"),
            format!("127.0.0.1:{tm}"),
            format!("127.0.0.1:{dm}"),
        ];
    } else {
        r_args.push("--no-openai".into());
    }
    let procs = vec![
        spawn("parse-target-worker", t_args)?,
        spawn("parse-draft-worker", d_args)?,
        spawn("parse-router", r_args)?,
    ];
    Ok(Cluster {
        _procs: procs,
        router: rp,
        metrics,
    })
}

/// One GET /metrics over plain HTTP/1.0; returns the body's length.
async fn scrape(addr: &str) -> Result<usize> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    if !buf.starts_with(b"HTTP/1.0 200") && !buf.starts_with(b"HTTP/1.1 200") {
        bail!("{addr}/metrics did not answer 200");
    }
    Ok(buf.len())
}

/// Sends the prompts one after another; returns (output tokens, seconds).
async fn run(c: &Cluster, prompts: &[String], args: &Args) -> Result<(u64, f64)> {
    let url = format!("http://127.0.0.1:{}", c.router);
    let start = Instant::now();
    let mut client = loop {
        match GenerationClient::connect(url.clone()).await {
            Ok(cl) => break cl,
            Err(_) if start.elapsed() < Duration::from_secs(300) => {
                tokio::time::sleep(Duration::from_millis(300)).await
            }
            Err(e) => bail!("router: {e}"),
        }
    };
    let req = |p: &str, max: u32| GenerateRequest {
        prompt: p.to_string(),
        max_new_tokens: max,
        mode: args.mode.clone(),
        ..Default::default()
    };
    // Warm-up (workers up, first prefill) outside the timing.
    loop {
        match client.generate(req("Say hi.", 4)).await {
            Ok(_) => break,
            Err(s)
                if s.code() == tonic::Code::Unavailable
                    && start.elapsed() < Duration::from_secs(300) =>
            {
                tokio::time::sleep(Duration::from_millis(300)).await
            }
            Err(s) => bail!("warm-up: {s}"),
        }
    }
    let scraper = {
        let addrs = c.metrics.clone();
        tokio::spawn(async move {
            loop {
                for a in &addrs {
                    if let Err(e) = scrape(a).await {
                        eprintln!("scrape: {e}");
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let t = Instant::now();
    let mut tokens = 0u64;
    for p in prompts {
        let r = client
            .generate(req(p, args.max_new_tokens))
            .await?
            .into_inner();
        tokens += r.stats.map_or(0, |s| u64::from(s.output_tokens));
    }
    let secs = t.elapsed().as_secs_f64();
    scraper.abort();
    Ok((tokens, secs))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let prompts = humaneval_prompts(args.n)?;
    let rt = tokio::runtime::Runtime::new()?;
    let receiver = Receiver::default();
    let otlp = free_port()?;
    {
        let r = receiver.clone();
        rt.spawn(async move {
            let addr = format!("127.0.0.1:{otlp}").parse().expect("address");
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(r))
                .serve(addr)
                .await
            {
                eprintln!("OTLP receiver: {e}");
            }
        });
    }
    let (mut off, mut on) = ((0u64, 0f64), (0u64, 0f64));
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        for telemetry in [false, true] {
            let cluster = start(telemetry.then_some(otlp))?;
            let (tokens, secs) = rt.block_on(run(&cluster, &prompts, &args))?;
            drop(cluster);
            let acc = if telemetry { &mut on } else { &mut off };
            acc.0 += tokens;
            acc.1 += secs;
            eprintln!(
                "round {round} telemetry {}: {tokens} tokens in {secs:.1} s ({:.2} tok/s)",
                if telemetry { "on" } else { "off" },
                tokens as f64 / secs
            );
            rounds.push(
                json!({"round": round, "telemetry": telemetry, "tokens": tokens, "seconds": secs}),
            );
        }
    }
    // Spans still in the exporters' batches were flushed at shutdown.
    std::thread::sleep(Duration::from_millis(500));
    let (off_tps, on_tps) = (off.0 as f64 / off.1, on.0 as f64 / on.1);
    let spans = receiver.0.load(Ordering::Relaxed);
    println!("| telemetry | output tokens | seconds | tok/s |");
    println!("|---|---:|---:|---:|");
    println!("| off | {} | {:.1} | {off_tps:.2} |", off.0, off.1);
    println!(
        "| on (OTLP spans, worker metrics, 1 s scrapes) | {} | {:.1} | {on_tps:.2} |",
        on.0, on.1
    );
    println!(
        "\non / off: {:.3} ({spans} spans received)",
        on_tps / off_tps
    );
    if spans == 0 {
        bail!("no span reached the receiver: telemetry was not on");
    }
    if let Some(out) = &args.out {
        std::fs::write(
            out,
            serde_json::to_string_pretty(&json!({
                "n": args.n, "max_new_tokens": args.max_new_tokens, "mode": args.mode,
                "off_tok_s": off_tps, "on_tok_s": on_tps, "ratio": on_tps / off_tps,
                "spans": spans, "rounds": rounds,
            }))?,
        )?;
    }
    Ok(())
}
