//! Cluster benchmark: the PARSE loop over gRPC against the same loop in process, and throughput under concurrency.
//!
//! One process, one run: the default pair first runs in process on the first N HumanEval development prompts, then
//! the same engines move into a target worker, a draft worker and a router on loopback (each server on its own
//! runtime), the same prompts go through the router, and then 1, 4 and 16 clients send requests at once.
//!
//! `cargo run --release -p parse-bench --bin cluster-bench -- [--n 4] [--max-new-tokens 96] [--mode parse]`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use parse_bench::{humaneval_prompts, model_dir};
use parse_client::{Client, GenerateRequest};
use parse_core::{AcceptPolicy, DraftWindow, GenerationRequest, Mode, SegmenterConfig};
use parse_draft_worker::{DraftWorker, DraftWorkerConfig};
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_engine::{Engine, EngineConfig, Message};
use parse_router::{Router, RouterConfig};
use parse_target_worker::{TargetWorker, TargetWorkerConfig};
use serde_json::json;
use tokio::runtime::Runtime;

#[derive(Parser)]
struct Args {
    /// HumanEval development prompts used (the first N).
    #[arg(long, default_value_t = 4)]
    n: usize,
    #[arg(long, default_value_t = 96)]
    max_new_tokens: usize,
    #[arg(long, default_value = "parse")]
    mode: String,
    /// Concurrency levels (clients sending one request each at once).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Output tokens per request in the concurrency runs.
    #[arg(long, default_value_t = 32)]
    concurrent_tokens: u32,
    #[arg(long)]
    out: Option<PathBuf>,
}

fn runtime() -> Result<Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Starts a server on its own runtime; returns the runtime (dropping it stops the server) and the address.
fn serve<F>(make: impl FnOnce(tokio::net::TcpListener) -> F) -> Result<(Runtime, String)>
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let rt = runtime()?;
    let (listener, addr) = rt.block_on(parse_proto::serve::bind("127.0.0.1:0".parse()?))?;
    let fut = make(listener);
    rt.spawn(async move {
        if let Err(e) = fut.await {
            eprintln!("server ended: {e}");
        }
    });
    Ok((rt, addr.to_string()))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mode: Mode = args
        .mode
        .parse()
        .map_err(|e: parse_core::Error| anyhow::anyhow!(e.message))?;
    let texts = humaneval_prompts(args.n)?;
    let dir = model_dir();
    let mut target = Engine::load(&EngineConfig::new(
        dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    ))?;
    let mut draft = Engine::load(&EngineConfig {
        // As the draft worker loads it (its head in Q5_0), so that both sides draft the same tokens.
        load: parse_engine::LoadOptions::draft(),
        ..EngineConfig::new(dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    })?;
    // No prefix caching: every part of this run sends the same prompts again (in process, then through the router,
    // then at each concurrency), and each would take the prompts of the part before it.
    target.set_prefix_budget(0);
    draft.set_prefix_budget(0);
    let tok = target.tokenizer().clone();

    // In process.
    let (mut local_tokens, mut local_gen_ms, mut local_wall_ms) = (0usize, 0.0, 0.0);
    let mut local_outputs = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let req = GenerationRequest {
            session: format!("local-{i}"),
            prompt: tok.encode_chat(&[Message::user(text)])?,
            max_new_tokens: args.max_new_tokens,
            mode,
            sampling: Default::default(),
            policy: AcceptPolicy::default(),
            segmenter: SegmenterConfig::default(),
            window: DraftWindow::default(),
            eos: tok.eos_ids().to_vec(),
            judge_suffix: tok.judge_suffix()?,
        };
        let t = Instant::now();
        let out = {
            let mut v = EngineVerifier::new(&mut target);
            let mut d = EngineDrafter::new(&mut draft);
            parse_core::generate(&mut d, &mut v, &req, &mut |_, _| true)
                .map_err(|e| anyhow::anyhow!(e.message))?
        };
        local_wall_ms += t.elapsed().as_secs_f64() * 1e3;
        local_tokens += out.stats.output_tokens;
        local_gen_ms += out.stats.total_ms - out.stats.prefill_ms;
        local_outputs.push(out.tokens);
        eprint!(".");
    }
    eprintln!(" in process");

    // The same engines behind gRPC; their schedulers stop with the bench.
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop_at_exit = stop.clone().drop_guard();
    let tw = TargetWorker::new(target, TargetWorkerConfig::default(), stop.clone())
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let dw = DraftWorker::new(draft, DraftWorkerConfig::default(), stop.clone())
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let (_trt, taddr) = serve(|l| parse_target_worker::serve(tw, l, std::future::pending()))?;
    let (_drt, daddr) = serve(|l| parse_draft_worker::serve(dw, l, std::future::pending()))?;
    let rrt = runtime()?;
    // Two routers on the same workers: the default one, and one whose draft workers do not write ahead.
    let make_router = |draft_ahead: bool| {
        rrt.block_on(async {
            Router::new(RouterConfig {
                drafts: vec![daddr.clone()],
                targets: vec![taddr.clone()],
                draft_ahead,
                ..Default::default()
            })
        })
    };
    let (router, router_no_ahead) = (make_router(true)?, make_router(false)?);
    let (_rrt2, raddr) = serve(|l| parse_router::serve(router, l, std::future::pending()))?;
    let (_rrt3, raddr_no_ahead) =
        serve(|l| parse_router::serve(router_no_ahead, l, std::future::pending()))?;
    let client_rt = runtime()?;
    let client = client_rt.block_on(Client::connect(&raddr))?;
    let client_no_ahead = client_rt.block_on(Client::connect(&raddr_no_ahead))?;
    let request = |text: &str, max: u32| GenerateRequest {
        prompt: text.to_string(),
        max_new_tokens: max,
        mode: args.mode.clone(),
        ..Default::default()
    };

    // Without drafting ahead first, so that any warm-up favours the default.
    let (mut plain_tokens, mut plain_gen_ms, mut plain_identical) = (0usize, 0.0, 0);
    for (i, text) in texts.iter().enumerate() {
        let r = client_rt.block_on(
            client_no_ahead
                .clone()
                .generate(request(text, args.max_new_tokens as u32)),
        )?;
        let s = r.stats.unwrap_or_default();
        plain_tokens += s.output_tokens as usize;
        plain_gen_ms += s.total_ms - s.prefill_ms;
        plain_identical += usize::from(r.token_ids == local_outputs[i]);
        eprint!(".");
    }
    eprintln!(" through the router, no drafting ahead");

    let (mut remote_tokens, mut remote_gen_ms, mut remote_wall_ms) = (0usize, 0.0, 0.0);
    let mut identical = 0;
    let (mut hits, mut misses, mut verifies) = (0, 0, 0);
    for (i, text) in texts.iter().enumerate() {
        let t = Instant::now();
        let r = client_rt.block_on(
            client
                .clone()
                .generate(request(text, args.max_new_tokens as u32)),
        )?;
        remote_wall_ms += t.elapsed().as_secs_f64() * 1e3;
        let s = r.stats.unwrap_or_default();
        remote_tokens += s.output_tokens as usize;
        remote_gen_ms += s.total_ms - s.prefill_ms;
        (hits, misses, verifies) = (
            hits + s.draft_prefetch_hits,
            misses + s.draft_prefetch_misses,
            verifies + s.verify_passes,
        );
        identical += usize::from(r.token_ids == local_outputs[i]);
        eprint!(".");
    }
    eprintln!(" through the router");

    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let t = Instant::now();
        let tokens: usize = client_rt.block_on(async {
            let mut tasks = Vec::new();
            for k in 0..c {
                let mut cl = client.clone();
                let req = request(&texts[k % texts.len()], args.concurrent_tokens);
                tasks.push(tokio::spawn(async move { cl.generate(req).await }));
            }
            let mut total = 0;
            for t in tasks {
                match t.await {
                    Ok(Ok(r)) => total += r.token_ids.len(),
                    Ok(Err(e)) => eprintln!("request failed: {e}"),
                    Err(e) => eprintln!("task failed: {e}"),
                }
            }
            total
        });
        let s = t.elapsed().as_secs_f64();
        levels.push(json!({"clients": c, "output_tokens": tokens, "seconds": s, "tokens_per_s": tokens as f64 / s}));
        eprintln!("{c} clients: {tokens} tokens in {s:.1} s");
    }

    let local_tps = local_tokens as f64 / (local_gen_ms / 1e3);
    let remote_tps = remote_tokens as f64 / (remote_gen_ms / 1e3);
    let report = json!({
        "mode": args.mode,
        "prompts": texts.len(),
        "max_new_tokens": args.max_new_tokens,
        "in_process": {"output_tokens": local_tokens, "tokens_per_s_after_prefill": local_tps, "wall_s": local_wall_ms / 1e3},
        "remote": {"output_tokens": remote_tokens, "tokens_per_s_after_prefill": remote_tps, "wall_s": remote_wall_ms / 1e3,
            "verify_passes": verifies, "draft_prefetch_hits": hits, "draft_prefetch_misses": misses},
        "remote_over_in_process_tokens_per_s": remote_tps / local_tps,
        "remote_over_in_process_wall": remote_wall_ms / local_wall_ms,
        "outputs_identical": identical,
        "no_draft_ahead": {"output_tokens": plain_tokens, "tokens_per_s_after_prefill": plain_tokens as f64 / (plain_gen_ms / 1e3), "outputs_identical": plain_identical},
        "draft_ahead_over_not_tokens_per_s": remote_tps / (plain_tokens as f64 / (plain_gen_ms / 1e3)),
        "concurrency": levels,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = &args.out {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
