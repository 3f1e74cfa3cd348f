//! Operator commands against a router: `workers`, `drain`, `stats`, `policy` (the admin API, bearer token from
//! `--token` or `PARSE_ADMIN_TOKEN`) and `bench` (the Generation API). Every command takes `--json`.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use parse_client::{Client, GenerateRequest};
use parse_proto::security::Security;
use parse_proto::v1::admin_client::AdminClient;
use parse_proto::v1::{
    Counters, DrainWorkerRequest, GetPolicyRequest, GetStatsRequest, ListWorkersRequest, Policy,
    SetPolicyRequest,
};
use serde_json::json;
use tonic::transport::Channel;

use crate::CliError;

/// Where the admin API is and how to get in.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The router's admin address.
    #[arg(long, env = parse_core::env::ADMIN_ADDR, default_value = "127.0.0.1:50052")]
    pub admin: String,
    /// Bearer token (or PARSE_ADMIN_TOKEN).
    #[arg(long, env = parse_core::env::ADMIN_TOKEN, hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct DrainArgs {
    /// The worker's id (see `parsectl workers`).
    pub id: String,
    #[command(flatten)]
    pub admin: AdminArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum PolicyCommand {
    /// Show the defaults requests get when they do not say.
    Get(AdminArgs),
    /// Change some of them.
    Set(PolicySetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct PolicySetArgs {
    #[arg(long)]
    pub mode: Option<String>,
    #[arg(long, allow_hyphen_values = true)]
    pub tau: Option<f32>,
    #[arg(long)]
    pub verdict: Option<String>,
    /// Segments in a request's first draft.
    #[arg(long)]
    pub draft_segments: Option<u32>,
    /// Tokens one draft may hold.
    #[arg(long)]
    pub max_draft_tokens: Option<u32>,
    #[command(flatten)]
    pub admin: AdminArgs,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The router's Generation address.
    #[arg(long, env = parse_core::env::ROUTER_ADDR, default_value = "127.0.0.1:50051")]
    pub router: String,
    /// Requests per cell (one cell per mode and concurrency).
    #[arg(short = 'n', long, default_value_t = 16)]
    pub requests: usize,
    /// Requests at once; a list sweeps them (`-c 1,4,8`).
    #[arg(short = 'c', long, value_delimiter = ',', default_value = "4")]
    pub concurrency: Vec<usize>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Modes, each measured at every concurrency (`--mode target,token-spec,parse+token-spec`); the router's
    /// default when not given.
    #[arg(long, value_delimiter = ',')]
    pub mode: Vec<String>,
    /// Drafter: model, ngram or model+ngram (the router's default when not given).
    #[arg(long)]
    pub drafter: Option<String>,
    /// Whether speculation adapts to load (`--adaptive false`: every round drafts, as a fault check that needs
    /// draft sessions wants); the router's default when not given.
    #[arg(long)]
    pub adaptive: Option<bool>,
    /// Prompts, one per line (cycled); without it a built-in set. Each cell's requests share the workers' prefix
    /// caches among themselves (a prompt repeated within a cell, or the first tokens prompts share), in a
    /// `cache_salt` namespace of the cell's own, so that no cell takes the prompts of a cell before it (or of an
    /// earlier run).
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    #[arg(long)]
    pub json: bool,
    /// Also write the run as a result record (JSON, `parse-record/1`) to this file. With `target` among the
    /// modes, each other cell's record carries the share of its replies equal to `target`'s for the same prompt.
    #[arg(long)]
    pub record: Option<std::path::PathBuf>,
    /// Mark the record's cells for the README's table (the docs' headline figures).
    #[arg(long, requires = "record")]
    pub headline: bool,
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn status_error(s: tonic::Status) -> CliError {
    CliError::Admin(s)
}

async fn admin_client(
    a: &AdminArgs,
    sec: &Security,
) -> Result<(AdminClient<Channel>, String), CliError> {
    let token = a.token.clone().filter(|t| !t.is_empty()).ok_or_else(|| {
        CliError::Usage("the admin API needs --token or PARSE_ADMIN_TOKEN".into())
    })?;
    let ch = sec
        .endpoint(&a.admin)
        .map_err(|e| CliError::Usage(format!("bad address {}: {e}", a.admin)))?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| {
            CliError::Unhealthy(format!(
                "{} unreachable: {}",
                a.admin,
                parse_proto::security::error_chain(&e)
            ))
        })?;
    Ok((AdminClient::new(ch), format!("Bearer {token}")))
}

fn authed<T>(msg: T, bearer: &str) -> Result<tonic::Request<T>, CliError> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(Duration::from_secs(30));
    r.metadata_mut().insert(
        "authorization",
        bearer
            .parse()
            .map_err(|_| CliError::Usage("the token is not a valid header value".into()))?,
    );
    Ok(r)
}

fn out(line: impl std::fmt::Display) {
    let _ = writeln!(std::io::stdout(), "{line}");
}

pub fn workers(a: &AdminArgs, sec: &Security) -> Result<(), CliError> {
    let ws = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(a, sec).await?;
        c.list_workers(authed(ListWorkersRequest {}, &bearer)?)
            .await
            .map_err(status_error)
    })?;
    let ws = ws.into_inner().workers;
    if a.json {
        let v: Vec<_> = ws
            .iter()
            .map(|w| {
                json!({"id": w.id, "role": w.role, "address": w.address, "healthy": w.healthy,
                       "draining": w.draining, "outstanding": w.outstanding})
            })
            .collect();
        out(json!({ "workers": v }));
    } else {
        out(format!(
            "{:<24} {:<7} {:<22} {:<8} {:>11}",
            "ID", "ROLE", "ADDRESS", "STATE", "OUTSTANDING"
        ));
        for w in &ws {
            let state = if w.draining {
                "draining"
            } else if w.healthy {
                "ready"
            } else {
                "lost"
            };
            out(format!(
                "{:<24} {:<7} {:<22} {:<8} {:>11}",
                w.id, w.role, w.address, state, w.outstanding
            ));
        }
    }
    Ok(())
}

pub fn drain(d: &DrainArgs, sec: &Security) -> Result<(), CliError> {
    let r = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(&d.admin, sec).await?;
        c.drain_worker(authed(DrainWorkerRequest { id: d.id.clone() }, &bearer)?)
            .await
            .map_err(status_error)
    })?;
    let r = r.into_inner();
    if d.admin.json {
        out(json!({"id": d.id, "draining": true, "open_sessions": r.open_sessions}));
    } else {
        out(format!(
            "{}: draining ({} open sessions to finish; it deregisters and exits when they are done)",
            d.id, r.open_sessions
        ));
    }
    Ok(())
}

fn counters_json(c: &Counters) -> serde_json::Value {
    json!({
        "requests": c.requests, "failed": c.failed, "output_tokens": c.output_tokens,
        "draft_tokens_proposed": c.draft_tokens_proposed, "draft_tokens_accepted": c.draft_tokens_accepted,
        "target_passes": c.target_passes, "acceptance": c.acceptance,
        "target_passes_per_token": c.target_passes_per_token, "latency_p50_ms": c.latency_p50_ms,
        "latency_p90_ms": c.latency_p90_ms, "latency_p99_ms": c.latency_p99_ms,
    })
}

fn counters_row(name: &str, role: &str, c: &Counters) -> String {
    format!(
        "{:<24} {:<7} {:>8} {:>6} {:>9} {:>10} {:>11} {:>9.0} {:>9.0} {:>9.0}",
        name,
        role,
        c.requests,
        c.failed,
        c.output_tokens,
        format!("{:.3}", c.acceptance),
        format!("{:.3}", c.target_passes_per_token),
        c.latency_p50_ms,
        c.latency_p90_ms,
        c.latency_p99_ms
    )
}

pub fn stats(a: &AdminArgs, sec: &Security) -> Result<(), CliError> {
    let s = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(a, sec).await?;
        c.get_stats(authed(GetStatsRequest {}, &bearer)?)
            .await
            .map_err(status_error)
    })?;
    let s = s.into_inner();
    let overall = s.overall.unwrap_or_default();
    if a.json {
        let ws: Vec<_> = s
            .workers
            .iter()
            .map(|w| json!({"id": w.id, "role": w.role, "counters": counters_json(&w.counters.unwrap_or_default())}))
            .collect();
        out(json!({"overall": counters_json(&overall), "workers": ws}));
    } else {
        out(format!(
            "{:<24} {:<7} {:>8} {:>6} {:>9} {:>10} {:>11} {:>9} {:>9} {:>9}",
            "",
            "ROLE",
            "REQUESTS",
            "FAILED",
            "TOKENS",
            "ACCEPT",
            "PASSES/TOK",
            "P50 MS",
            "P90 MS",
            "P99 MS"
        ));
        out(counters_row("overall", "", &overall));
        for w in &s.workers {
            out(counters_row(
                &w.id,
                &w.role,
                &w.counters.unwrap_or_default(),
            ));
        }
    }
    Ok(())
}

fn print_policy(p: &Policy, json_out: bool) {
    if json_out {
        out(
            json!({"default_mode": p.default_mode, "tau": p.tau, "verdict": p.verdict,
                   "draft_segments": p.draft_segments, "max_draft_tokens": p.max_draft_tokens}),
        );
    } else {
        out(format!(
            "default mode {}, tau {}, verdict {}, first draft {} segments, at most {} draft tokens",
            p.default_mode, p.tau, p.verdict, p.draft_segments, p.max_draft_tokens
        ));
    }
}

pub fn policy(cmd: &PolicyCommand, sec: &Security) -> Result<(), CliError> {
    let rt = runtime()?;
    match cmd {
        PolicyCommand::Get(a) => {
            let p = rt.block_on(async {
                let (mut c, bearer) = admin_client(a, sec).await?;
                c.get_policy(authed(GetPolicyRequest {}, &bearer)?)
                    .await
                    .map_err(status_error)
            })?;
            print_policy(&p.into_inner(), a.json);
        }
        PolicyCommand::Set(s) => {
            let req = SetPolicyRequest {
                default_mode: s.mode.clone(),
                tau: s.tau,
                verdict: s.verdict.clone(),
                draft_segments: s.draft_segments,
                max_draft_tokens: s.max_draft_tokens,
            };
            let p = rt.block_on(async {
                let (mut c, bearer) = admin_client(&s.admin, sec).await?;
                c.set_policy(authed(req, &bearer)?)
                    .await
                    .map_err(status_error)
            })?;
            print_policy(&p.into_inner(), s.admin.json);
        }
    }
    Ok(())
}

const BUILTIN_PROMPTS: [&str; 4] = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive?",
    "Write a function that returns the n-th Fibonacci number.",
];

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        0.0
    } else {
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }
}

/// What one request of a bench cell gave.
struct Sample {
    /// The prompt's index in the run's prompts.
    prompt: usize,
    /// The reply's text.
    text: String,
    latency_ms: f64,
    /// Time to the first output text.
    ttft_ms: Option<f64>,
    stats: parse_client::Stats,
}

/// One cell of a bench: a mode at a concurrency.
struct Cell {
    mode: String,
    concurrency: usize,
    wall_s: f64,
    samples: Vec<Sample>,
    errors: Vec<String>,
}

impl Cell {
    fn sum(&self, f: fn(&parse_client::Stats) -> u32) -> u64 {
        self.samples.iter().map(|s| f(&s.stats) as u64).sum()
    }

    fn summary(&self) -> serde_json::Value {
        let sorted = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v
        };
        let lat = sorted(self.samples.iter().map(|s| s.latency_ms).collect());
        let ttft = sorted(self.samples.iter().filter_map(|s| s.ttft_ms).collect());
        // A request's own rate: its output tokens over its time from arrival to last output.
        let per_request: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.latency_ms > 0.0)
            .map(|s| s.stats.output_tokens as f64 / (s.latency_ms / 1e3))
            .collect();
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let tokens = self.sum(|s| s.output_tokens);
        json!({
            "mode": self.mode, "concurrency": self.concurrency,
            "ok": self.samples.len(), "failed": self.errors.len(),
            "output_tokens": tokens, "wall_s": self.wall_s,
            "tokens_per_s": tokens as f64 / self.wall_s,
            "request_tokens_per_s": mean(&per_request),
            "requests_per_s": self.samples.len() as f64 / self.wall_s,
            "ttft_p50_ms": pct(&ttft, 0.5), "ttft_p90_ms": pct(&ttft, 0.9),
            "latency_p50_ms": pct(&lat, 0.5), "latency_p90_ms": pct(&lat, 0.9), "latency_p99_ms": pct(&lat, 0.99),
            "acceptance": ratio(self.sum(|s| s.draft_tokens_accepted), self.sum(|s| s.draft_tokens_proposed)),
            "target_passes_per_token": ratio(self.sum(|s| s.target_passes), tokens),
            "paused_tokens": self.sum(|s| s.paused_tokens),
            "copy_rounds": self.sum(|s| s.copy_rounds),
            "draft_failovers": self.sum(|s| s.draft_failovers),
            "target_failovers": self.sum(|s| s.target_failovers),
            "errors": self.errors.iter().take(5).collect::<Vec<_>>(),
        })
    }
}

/// One streamed request: its latency, time to first text and final stats.
async fn timed(
    mut c: Client,
    prompt: usize,
    req: GenerateRequest,
    timeout: Duration,
) -> Result<Sample, String> {
    use tokio_stream::StreamExt;
    let t = Instant::now();
    let run = async {
        let mut stream = c.generate_stream(req).await.map_err(|e| e.to_string())?;
        let mut ttft = None;
        let mut text = String::new();
        while let Some(ev) = stream.next().await {
            match ev.map_err(|e| e.to_string())? {
                parse_client::Event::Delta(d) => {
                    if ttft.is_none() && !d.text.is_empty() {
                        ttft = Some(t.elapsed().as_secs_f64() * 1e3);
                    }
                    text.push_str(&d.text);
                }
                parse_client::Event::Finished(f) => {
                    return Ok(Sample {
                        prompt,
                        text,
                        latency_ms: t.elapsed().as_secs_f64() * 1e3,
                        ttft_ms: ttft,
                        stats: f.stats.unwrap_or_default(),
                    });
                }
            }
        }
        Err("the stream ended without a final message".to_string())
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", timeout.as_secs_f64())))
}

/// `bench`: for every mode and concurrency, N streamed requests through the router (a progress bar on stderr), then
/// a table (or `--json`: the totals and one object per cell): aggregate and per-request tokens/s, time to first
/// token, latency percentiles, acceptance, target passes per token.
pub fn bench(b: &BenchArgs, sec: &Security) -> Result<(), CliError> {
    if b.requests == 0 || b.concurrency.is_empty() || b.concurrency.contains(&0) {
        return Err(CliError::Usage("-n and -c must be at least 1".into()));
    }
    if !(b.timeout_s.is_finite() && b.timeout_s > 0.0) {
        return Err(CliError::Usage("timeout-s must be a number > 0".into()));
    }
    let prompts: Vec<String> = match &b.prompts {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| {
                CliError::Usage(format!("cannot read the prompts file {}: {e}", p.display()))
            })?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        None => BUILTIN_PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if prompts.is_empty() {
        return Err(CliError::Usage("the prompts file has no prompt".into()));
    }
    let modes: Vec<String> = if b.mode.is_empty() {
        vec![String::new()]
    } else {
        b.mode.clone()
    };
    let rt = runtime()?;
    let client = rt.block_on(Client::connect_with(
        &b.router,
        parse_client::ClientOptions {
            security: sec.clone(),
            ..Default::default()
        },
    ))?;
    let total = (modes.len() * b.concurrency.len() * b.requests) as u64;
    let prompts_len = prompts.len();
    // On stderr, and hidden where stderr is not a terminal (indicatif's default).
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{bar:30}] {pos}/{len} {elapsed} {msg}")
            .expect("valid template")
            .progress_chars("#> "),
    );
    let mut cells = Vec::new();
    // Each cell's prefix-cache namespace: this run's, then the cell's number.
    let run_salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        .max(1);
    for mode in &modes {
        for &concurrency in &b.concurrency {
            let cache_salt = run_salt.wrapping_add(cells.len() as u64 * 0x9E37_79B9_7F4A_7C15);
            bar.set_message(format!("{} at {concurrency}", display_mode(mode)));
            let start = Instant::now();
            let results = rt.block_on(async {
                let (tx, mut rx) = tokio::sync::mpsc::channel(b.requests);
                let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
                for i in 0..b.requests {
                    let (c, tx, sem) = (client.clone(), tx.clone(), sem.clone());
                    let req = GenerateRequest {
                        prompt: prompts[i % prompts.len()].clone(),
                        max_new_tokens: b.max_new_tokens,
                        mode: mode.clone(),
                        drafter: b.drafter.clone().unwrap_or_default(),
                        adaptive: b.adaptive,
                        sampling: Some(parse_client::Sampling {
                            cache_salt,
                            ..Default::default()
                        }),
                        ..Default::default()
                    };
                    let timeout = Duration::from_secs_f64(b.timeout_s);
                    tokio::spawn(async move {
                        let _permit = sem.acquire_owned().await;
                        let _ = tx.send(timed(c, i % prompts_len, req, timeout).await).await;
                    });
                }
                drop(tx);
                let mut results = Vec::new();
                while let Some(r) = rx.recv().await {
                    results.push(r);
                    bar.inc(1);
                }
                results
            });
            let wall_s = start.elapsed().as_secs_f64();
            let (samples, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
            cells.push(Cell {
                mode: display_mode(mode).to_string(),
                concurrency,
                wall_s,
                samples: samples.into_iter().filter_map(Result::ok).collect(),
                errors: errors.into_iter().filter_map(Result::err).collect(),
            });
        }
    }
    bar.finish();
    let ok: usize = cells.iter().map(|c| c.samples.len()).sum();
    let failed: usize = cells.iter().map(|c| c.errors.len()).sum();
    let failovers =
        |f: fn(&parse_client::Stats) -> u32| -> u64 { cells.iter().map(|c| c.sum(f)).sum() };
    let summaries: Vec<serde_json::Value> = cells.iter().map(Cell::summary).collect();
    if b.json {
        out(json!({
            "requests": total, "ok": ok, "failed": failed,
            "draft_failovers": failovers(|s| s.draft_failovers),
            "target_failovers": failovers(|s| s.target_failovers),
            "cells": summaries,
        }));
    } else {
        out(format!(
            "{:<18} {:>4} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>7} {:>8}",
            "mode",
            "c",
            "ok/fail",
            "tok/s",
            "req tok/s",
            "ttft p50",
            "lat p50",
            "lat p90",
            "lat p99",
            "accept",
            "pass/tok"
        ));
        for s in &summaries {
            let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
            out(format!(
                "{:<18} {:>4} {:>9} {:>9.2} {:>11.2} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>7.3} {:>8.3}",
                s["mode"].as_str().unwrap_or_default(),
                s["concurrency"],
                format!("{}/{}", s["ok"], s["failed"]),
                f("tokens_per_s"),
                f("request_tokens_per_s"),
                f("ttft_p50_ms"),
                f("latency_p50_ms"),
                f("latency_p90_ms"),
                f("latency_p99_ms"),
                f("acceptance"),
                f("target_passes_per_token"),
            ));
        }
        out("(tok/s: all output tokens over the cell's wall time; req tok/s: the mean of each request's own rate; \
             times in ms)"
            .to_string());
        for e in cells.iter().flat_map(|c| c.errors.iter()).take(5) {
            out(format!("error: {e}"));
        }
    }
    if let Some(path) = &b.record {
        bench_record(b, &cells, &summaries)
            .write(path)
            .map_err(|e| CliError::Usage(format!("cannot write the record: {e}")))?;
    }
    if failed > 0 {
        return Err(CliError::Unhealthy(format!(
            "{failed} of {total} requests failed"
        )));
    }
    Ok(())
}

/// The run as a result record: a cell per mode and concurrency. Replies are greedy, so `target`'s reply to a prompt
/// is its reference; each other cell's quality is the share of its replies equal to that reference.
fn bench_record(
    b: &BenchArgs,
    cells: &[Cell],
    summaries: &[serde_json::Value],
) -> parse_record::Record {
    let mut record = parse_record::Record::new(
        "parsectl bench",
        format!(
            "{} requests per cell through the router, up to {} new tokens",
            b.requests, b.max_new_tokens
        ),
        json!({
            "requests": b.requests, "concurrency": b.concurrency, "max_new_tokens": b.max_new_tokens,
            "modes": b.mode, "drafter": b.drafter, "adaptive": b.adaptive,
            "prompts": b.prompts.as_ref().map(|p| p.display().to_string()),
        }),
    );
    let reference: std::collections::HashMap<usize, &str> = cells
        .iter()
        .filter(|c| c.mode == "target")
        .flat_map(|c| c.samples.iter().map(|s| (s.prompt, s.text.as_str())))
        .collect();
    let target_rate = |concurrency: usize| {
        summaries
            .iter()
            .find(|s| s["mode"] == "target" && s["concurrency"] == concurrency)
            .and_then(|s| s["tokens_per_s"].as_f64())
    };
    for (c, s) in cells.iter().zip(summaries) {
        let mut cell = parse_record::Cell::new(format!("{}, {} clients", c.mode, c.concurrency));
        for k in [
            "tokens_per_s",
            "ttft_p50_ms",
            "latency_p50_ms",
            "acceptance",
            "target_passes_per_token",
        ] {
            cell = cell.figure(k, s[k].clone());
        }
        cell = cell
            .figure("ok", s["ok"].clone())
            .figure("failed", s["failed"].clone());
        if let (Some(t), Some(x)) = (target_rate(c.concurrency), s["tokens_per_s"].as_f64())
            && c.mode != "target"
        {
            cell = cell.figure("x_target", x / t);
        }
        if c.mode != "target" && !reference.is_empty() {
            let scored: Vec<bool> = c
                .samples
                .iter()
                .filter_map(|s| reference.get(&s.prompt).map(|r| *r == s.text))
                .collect();
            cell = cell.quality(parse_record::Quality {
                metric: "replies equal to target's".into(),
                value: scored.iter().filter(|e| **e).count() as f64 / scored.len().max(1) as f64,
                reference: Some(1.0),
                n: scored.len(),
            });
        }
        if b.headline {
            cell = cell.headline();
        }
        record.push(cell);
    }
    record
}

fn display_mode(mode: &str) -> &str {
    if mode.is_empty() { "(default)" } else { mode }
}
