//! Operator commands against a router: `workers`, `drain`, `stats`, `policy` (the admin API, bearer token from
//! `--token` or `PARSE_ADMIN_TOKEN`) and `bench` (the Generation API). Every command takes `--json`.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use parse_client::{Client, GenerateRequest};
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
    #[arg(long, env = "PARSE_ADMIN_ADDR", default_value = "127.0.0.1:50052")]
    pub admin: String,
    /// Bearer token (or PARSE_ADMIN_TOKEN).
    #[arg(long, env = "PARSE_ADMIN_TOKEN", hide_env_values = true)]
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
    #[arg(long, env = "PARSE_ROUTER_ADDR", default_value = "127.0.0.1:50051")]
    pub router: String,
    /// Requests in all.
    #[arg(short = 'n', long, default_value_t = 16)]
    pub requests: usize,
    /// Requests at once.
    #[arg(short = 'c', long, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Mode (the router's default when not given).
    #[arg(long)]
    pub mode: Option<String>,
    /// Prompts, one per line (cycled); without it a built-in set.
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    #[arg(long)]
    pub json: bool,
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

async fn admin_client(a: &AdminArgs) -> Result<(AdminClient<Channel>, String), CliError> {
    let token = a.token.clone().filter(|t| !t.is_empty()).ok_or_else(|| {
        CliError::Usage("the admin API needs --token or PARSE_ADMIN_TOKEN".into())
    })?;
    let uri = if a.admin.contains("://") {
        a.admin.clone()
    } else {
        format!("http://{}", a.admin)
    };
    let ch = tonic::transport::Endpoint::from_shared(uri)
        .map_err(|e| CliError::Usage(format!("bad address {}: {e}", a.admin)))?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| CliError::Unhealthy(format!("{} unreachable: {e}", a.admin)))?;
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

pub fn workers(a: &AdminArgs) -> Result<(), CliError> {
    let ws = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(a).await?;
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

pub fn drain(d: &DrainArgs) -> Result<(), CliError> {
    let r = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(&d.admin).await?;
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

pub fn stats(a: &AdminArgs) -> Result<(), CliError> {
    let s = runtime()?.block_on(async {
        let (mut c, bearer) = admin_client(a).await?;
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

pub fn policy(cmd: &PolicyCommand) -> Result<(), CliError> {
    let rt = runtime()?;
    match cmd {
        PolicyCommand::Get(a) => {
            let p = rt.block_on(async {
                let (mut c, bearer) = admin_client(a).await?;
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
                let (mut c, bearer) = admin_client(&s.admin).await?;
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

/// `bench`: N requests at concurrency C through the router, a progress bar on stderr, a summary at the end.
pub fn bench(b: &BenchArgs) -> Result<(), CliError> {
    if b.requests == 0 || b.concurrency == 0 {
        return Err(CliError::Usage("-n and -c must be at least 1".into()));
    }
    if !(b.timeout_s.is_finite() && b.timeout_s > 0.0) {
        return Err(CliError::Usage("timeout-s must be a number > 0".into()));
    }
    let prompts: Vec<String> = match &b.prompts {
        Some(p) => std::fs::read_to_string(p)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        None => BUILTIN_PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if prompts.is_empty() {
        return Err(CliError::Usage("the prompts file has no prompt".into()));
    }
    let rt = runtime()?;
    let client = rt.block_on(Client::connect(&b.router))?;
    let start = Instant::now();
    let results = rt.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::channel(b.requests);
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(b.concurrency));
        for i in 0..b.requests {
            let (mut c, tx, sem) = (client.clone(), tx.clone(), sem.clone());
            let req = GenerateRequest {
                prompt: prompts[i % prompts.len()].clone(),
                max_new_tokens: b.max_new_tokens,
                mode: b.mode.clone().unwrap_or_default(),
                ..Default::default()
            };
            let timeout = Duration::from_secs_f64(b.timeout_s);
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await;
                let t = Instant::now();
                let r = tokio::time::timeout(timeout, c.generate(req)).await;
                let _ = tx.send((r, t.elapsed())).await;
            });
        }
        drop(tx);
        // On stderr, and hidden where stderr is not a terminal (indicatif's default).
        let bar = indicatif::ProgressBar::new(b.requests as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("[{bar:30}] {pos}/{len} {elapsed}")
                .expect("valid template")
                .progress_chars("#> "),
        );
        let mut results = Vec::new();
        while let Some(r) = rx.recv().await {
            results.push(r);
            bar.inc(1);
        }
        bar.finish();
        results
    });
    let wall = start.elapsed().as_secs_f64();
    let (mut ok, mut failed, mut tokens, mut proposed, mut accepted, mut passes) =
        (0usize, 0usize, 0u64, 0u64, 0u64, 0u64);
    let (mut draft_failovers, mut target_failovers) = (0u64, 0u64);
    let mut lat = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    for (r, took) in results {
        match r {
            Ok(Ok(resp)) => {
                ok += 1;
                lat.push(took.as_secs_f64() * 1e3);
                if let Some(s) = resp.stats {
                    tokens += s.output_tokens as u64;
                    proposed += s.draft_tokens_proposed as u64;
                    accepted += s.draft_tokens_accepted as u64;
                    passes += s.target_passes as u64;
                    draft_failovers += s.draft_failovers as u64;
                    target_failovers += s.target_failovers as u64;
                }
            }
            Ok(Err(e)) => {
                failed += 1;
                errors.push(e.to_string());
            }
            Err(_) => {
                failed += 1;
                errors.push(format!("no answer within {} s", b.timeout_s));
            }
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let summary = json!({
        "requests": b.requests, "concurrency": b.concurrency, "ok": ok, "failed": failed,
        "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens as f64 / wall,
        "requests_per_s": ok as f64 / wall,
        "latency_p50_ms": pct(&lat, 0.5), "latency_p90_ms": pct(&lat, 0.9), "latency_p99_ms": pct(&lat, 0.99),
        "acceptance": ratio(accepted, proposed), "target_passes_per_token": ratio(passes, tokens),
        "draft_failovers": draft_failovers, "target_failovers": target_failovers,
        "errors": errors.iter().take(5).collect::<Vec<_>>(),
    });
    if b.json {
        out(summary);
    } else {
        out(format!(
            "{:<24} {:>12}",
            "requests ok / failed",
            format!("{ok} / {failed}")
        ));
        out(format!("{:<24} {:>12}", "concurrency", b.concurrency));
        out(format!("{:<24} {:>12}", "output tokens", tokens));
        out(format!("{:<24} {:>12.1}", "wall s", wall));
        out(format!("{:<24} {:>12.2}", "tokens/s", tokens as f64 / wall));
        out(format!("{:<24} {:>12.0}", "latency p50 ms", pct(&lat, 0.5)));
        out(format!("{:<24} {:>12.0}", "latency p90 ms", pct(&lat, 0.9)));
        out(format!(
            "{:<24} {:>12.0}",
            "latency p99 ms",
            pct(&lat, 0.99)
        ));
        out(format!(
            "{:<24} {:>12.3}",
            "draft acceptance",
            ratio(accepted, proposed)
        ));
        out(format!(
            "{:<24} {:>12.3}",
            "target passes/token",
            ratio(passes, tokens)
        ));
        for e in errors.iter().take(5) {
            out(format!("error: {e}"));
        }
    }
    if failed > 0 {
        return Err(CliError::Unhealthy(format!(
            "{failed} of {} requests failed",
            b.requests
        )));
    }
    Ok(())
}
