//! The operator CLI. `generate --local` runs the models in process; `generate --router ADDR` asks a cluster through
//! the client SDK, with the same output and `--json` contract.

pub mod certs;
pub mod ops;

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use parse_core::{Mode, Verdict};
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_engine::{Engine, EngineConfig, Message, SamplingParams};
use parse_proto::security::Security;
use parse_text::TextSink;
use serde_json::json;

/// Exit code for bad input (arguments, prompt).
pub const EXIT_USAGE: u8 = 2;
/// Exit code for a failure while running.
pub const EXIT_FAILURE: u8 = 1;

/// Environment variable naming the model cache directory.
pub const ENV_MODEL_DIR: &str = parse_core::env::MODEL_DIR;
/// File names of the default pair inside the model cache (see `deploy/models/fetch.py`).
pub const DEFAULT_TARGET_FILE: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const DEFAULT_DRAFT_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{}", .0.message)]
    Core(parse_core::Error),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Engine(#[from] parse_engine::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Remote(#[from] parse_client::ClientError),
    #[error("{0}")]
    Unhealthy(String),
    #[error("{:?}: {}", .0.code(), .0.message())]
    Admin(tonic::Status),
}

impl From<parse_text::Error> for CliError {
    fn from(e: parse_text::Error) -> Self {
        CliError::Engine(e.into())
    }
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Engine(parse_engine::Error::InvalidInput(_)) => {
                EXIT_USAGE
            }
            CliError::Engine(parse_engine::Error::ContextExceeded { .. }) => EXIT_USAGE,
            CliError::Remote(parse_client::ClientError::InvalidArgument(_)) => EXIT_USAGE,
            CliError::Admin(s) if s.code() == tonic::Code::InvalidArgument => EXIT_USAGE,
            _ => EXIT_FAILURE,
        }
    }
}

#[derive(Debug, Parser)]
#[command(name = "parsectl", version, about = "PARSE cluster operator CLI")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Mutual TLS to a router (and its admin API, and a worker's health) that runs it.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsArgs {
    /// This client's certificate (PEM), signed by the cluster CA; with --tls-key and --tls-ca.
    #[arg(long, global = true, env = parse_core::env::TLS_CERT)]
    pub tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (PEM).
    #[arg(long, global = true, env = parse_core::env::TLS_KEY)]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM) the server's certificate must chain to.
    #[arg(long, global = true, env = parse_core::env::TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// The name the server's certificate must carry [default: the host dialled].
    #[arg(long, global = true, env = parse_core::env::TLS_SERVER_NAME)]
    pub tls_server_name: Option<String>,
}

impl TlsArgs {
    pub fn load(&self) -> Result<Security, CliError> {
        let given = [
            self.tls_cert.is_some(),
            self.tls_key.is_some(),
            self.tls_ca.is_some(),
        ];
        if given.iter().any(|g| *g) && !given.iter().all(|g| *g) {
            return Err(CliError::Usage(
                "TLS needs all three of --tls-cert, --tls-key and --tls-ca".into(),
            ));
        }
        parse_proto::security::SecurityArgs {
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_server_name: self.tls_server_name.clone(),
            ..Default::default()
        }
        .load()
        .map_err(|e| CliError::Usage(e.0))
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a reply to one prompt.
    Generate(Box<GenerateArgs>),
    /// Check a server's gRPC health (grpc.health.v1), optionally waiting until it serves.
    Health(HealthArgs),
    /// List the router's workers (admin API).
    Workers(ops::AdminArgs),
    /// Drain a worker: no new requests, in-flight ones finish, then it deregisters and exits (admin API).
    Drain(ops::DrainArgs),
    /// Request statistics, overall and per worker (admin API).
    Stats(ops::AdminArgs),
    /// Get or set the defaults requests get (admin API).
    #[command(subcommand)]
    Policy(ops::PolicyCommand),
    /// N requests per mode and concurrency through the router (`-c 1,4,8 --mode target,parse+token-spec` sweeps
    /// them), with a progress bar and a table: tokens/s, time to first token, latency percentiles, acceptance.
    Bench(ops::BenchArgs),
    /// Write a throw-away cluster CA, router / worker / client certificates and a cluster token into a directory
    /// (for `deploy/local/up.sh --tls` and trying the chart's TLS; use your own CA in production).
    Certs(certs::CertsArgs),
}

#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// host:port of a router or worker.
    pub addr: String,
    /// Keep trying for this many seconds before giving up.
    #[arg(long, default_value_t = 0.0)]
    pub wait_s: f64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Liveness: the server answers health at all (SERVING or NOT_SERVING). A worker that lost its etcd
    /// registration is NOT_SERVING (not ready) but alive: restarting it would not bring etcd back.
    #[arg(long)]
    pub live: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Target model: a .gguf file or a safetensors directory [default: the default pair's target in the cache].
    #[arg(long, env = parse_core::env::TARGET_MODEL)]
    pub target_model: Option<PathBuf>,
    /// Draft model [default: the default pair's draft in the cache].
    #[arg(long, env = parse_core::env::DRAFT_MODEL)]
    pub draft_model: Option<PathBuf>,
    /// A tokenizer.json to use instead of the one the model brings.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Model cache directory of the default pair.
    #[arg(long, env = ENV_MODEL_DIR)]
    pub model_dir: Option<PathBuf>,
}

impl ModelArgs {
    fn cache_dir(&self) -> PathBuf {
        self.model_dir.clone().unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
                .join(".cache/parse/models")
        })
    }

    /// The model file for a mode, checked to exist.
    pub fn path_for(&self, mode: Mode) -> Result<PathBuf, CliError> {
        let (explicit, file) = match mode {
            Mode::Draft => (&self.draft_model, DEFAULT_DRAFT_FILE),
            _ => (&self.target_model, DEFAULT_TARGET_FILE),
        };
        let path = explicit
            .clone()
            .unwrap_or_else(|| self.cache_dir().join(file));
        if !path.exists() {
            let hint = if explicit.is_none() {
                " (fetch the default pair with deploy/models/fetch.py, or pass --target-model/--draft-model)"
            } else {
                ""
            };
            return Err(CliError::Usage(format!(
                "model not found: {}{hint}",
                path.display()
            )));
        }
        Ok(path)
    }
}

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Run the models in this process.
    #[arg(long, conflicts_with = "router", required_unless_present = "router")]
    pub local: bool,
    /// Ask a PARSE router at host:port instead.
    #[arg(long, env = parse_core::env::ROUTER)]
    pub router: Option<String>,
    /// Where the models compute (--local only).
    #[command(flatten)]
    pub compute: parse_engine::ComputeArgs,
    /// Seconds the cluster may take (sent as the gRPC deadline; --router only).
    #[arg(long)]
    pub timeout_s: Option<f64>,
    /// Generation mode [default: the project's default, parse+token-spec; through a router: the router's default].
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 disables the top-k cut.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// System prompt [default: the model template's own default].
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Segment verdict (parse modes) [default: the project's default, see docs/parse.md].
    #[arg(long, value_enum)]
    pub verdict: Option<Verdict>,
    /// Acceptance threshold: > 1 accepts only exact matches, 0 accepts every draft [default: the project's
    /// default for the verdict].
    #[arg(long)]
    pub tau: Option<f32>,
    /// Rows after a mismatch that must agree with the target again (entropy verdict).
    #[arg(long, default_value_t = parse_core::policy::DEFAULT_LOOKAHEAD)]
    pub lookahead: usize,
    /// Do not accept at least the tokens equal to the target's greedy choice.
    #[arg(long)]
    pub no_exact_floor: bool,
    /// Shortest segment, in tokens.
    #[arg(long, default_value_t = 4)]
    pub min_segment_tokens: usize,
    /// Longest segment, in tokens.
    #[arg(long, default_value_t = 48)]
    pub max_segment_tokens: usize,
    /// Segments drafted per verification at the start (the window adapts).
    #[arg(long, default_value_t = 2)]
    pub draft_segments: usize,
    /// Print one JSON object instead of text and a stats line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub models: ModelArgs,
    /// The user's prompt.
    pub prompt: String,
}

pub fn run(cli: Cli) -> Result<(), CliError> {
    let sec = &cli.tls.load()?;
    match cli.command {
        Command::Generate(args) => generate(&args, sec),
        Command::Health(args) => health(&args, sec),
        Command::Workers(a) => ops::workers(&a, sec),
        Command::Drain(d) => ops::drain(&d, sec),
        Command::Stats(a) => ops::stats(&a, sec),
        Command::Policy(p) => ops::policy(&p, sec),
        Command::Bench(b) => ops::bench(&b, sec),
        Command::Certs(c) => certs::certs(&c),
    }
}

/// Loads a model; `draft`: the draft model, loaded as the draft worker loads it (its head in Q5_0,
/// [`parse_engine::LoadOptions::draft`]), so that every mode gives the same tokens in process and through a cluster.
fn load(
    path: PathBuf,
    tokenizer: &Option<PathBuf>,
    compute: &parse_engine::ComputeArgs,
    draft: bool,
) -> Result<Engine, CliError> {
    let mut cfg = EngineConfig::new(path);
    if draft {
        cfg.load = parse_engine::LoadOptions::draft();
    }
    cfg.tokenizer = tokenizer.clone();
    cfg.compute = compute.compute()?;
    Ok(Engine::load(&cfg)?)
}

fn generate(args: &GenerateArgs, sec: &Security) -> Result<(), CliError> {
    if args.prompt.trim().is_empty() {
        return Err(CliError::Usage("empty prompt".into()));
    }
    if let Some(addr) = &args.router {
        return generate_remote(addr, args, sec);
    }
    let mode = args.mode.unwrap_or(Mode::DEFAULT);
    let uses_target = mode != Mode::Draft;
    let uses_draft = mode != Mode::Target;
    let mut target = match uses_target {
        true => Some(load(
            args.models.path_for(Mode::Target)?,
            &args.models.tokenizer,
            &args.compute,
            false,
        )?),
        false => None,
    };
    let mut draft = match uses_draft {
        true => Some(load(
            args.models.path_for(Mode::Draft)?,
            &args.models.tokenizer,
            &args.compute,
            true,
        )?),
        false => None,
    };
    let tokenizer = target
        .as_ref()
        .or(draft.as_ref())
        .map(|e| e.tokenizer().clone())
        .ok_or_else(|| CliError::Usage("no model".into()))?;
    if let (Some(t), Some(d)) = (&target, &draft)
        && t.tokenizer().vocab_size() != d.tokenizer().vocab_size()
    {
        return Err(CliError::Usage(
            "the draft and target models must share a tokenizer".into(),
        ));
    }
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(Message::system(s));
    }
    messages.push(Message::user(&args.prompt));
    let req = parse_core::GenerationRequest {
        session: "cli".into(),
        prompt: tokenizer.encode_chat(&messages)?,
        max_new_tokens: args.max_new_tokens,
        mode,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            cache_salt: 0,
        },
        policy: parse_core::AcceptPolicy::for_verdict(args.verdict, args.tau)
            .with_exact_floor(!args.no_exact_floor)
            .with_lookahead(args.lookahead),
        segmenter: parse_core::SegmenterConfig {
            min_tokens: args.min_segment_tokens,
            max_tokens: args.max_segment_tokens,
            ..Default::default()
        },
        window: parse_core::DraftWindow {
            initial_segments: args.draft_segments,
            max_segments: args.draft_segments.max(8),
            ..Default::default()
        },
        eos: tokenizer.eos_ids().to_vec(),
        judge_suffix: tokenizer.judge_suffix()?,
    };
    req.validate().map_err(|e| CliError::Usage(e.message))?;
    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let mut text_sink = TextSink::new(tokenizer.clone(), args.stop.clone());
    let mut failure = None;
    let mut sink = |tokens: &[u32], _source: parse_core::Source| -> bool {
        match text_sink.push(tokens) {
            Ok(out) => {
                if stream {
                    let _ = stdout.write_all(out.as_bytes());
                    let _ = stdout.flush();
                }
                !text_sink.stopped()
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        }
    };
    let mut outcome = {
        let mut verifier = target.as_mut().map(EngineVerifier::new);
        let mut drafter = draft.as_mut().map(EngineDrafter::new);
        parse_core::generate_with(
            drafter.as_mut().map(|d| d as &mut dyn parse_core::Drafter),
            verifier
                .as_mut()
                .map(|v| v as &mut dyn parse_core::Verifier),
            &req,
            &mut sink,
        )
        .map_err(CliError::Core)?
    };
    if let Some(e) = failure {
        return Err(e.into());
    }
    // The answer ends at the token that completed a stop string (the router's rule).
    if text_sink.stopped() {
        outcome.stop_at(text_sink.kept());
    }
    let tail = text_sink.flush();
    if stream {
        let _ = stdout.write_all(tail.as_bytes());
    }
    let text = text_sink.text().to_string();
    // A stop string makes the sink stop the loop, which then reports `stop` itself.
    let finish = outcome.finish_reason.as_str();
    if args.json {
        let v = json!({
            "text": text,
            "token_ids": outcome.tokens,
            "finish_reason": finish,
            "stats": outcome.stats,
        });
        let _ = writeln!(stdout, "{v}");
    } else {
        let s = &outcome.stats;
        println!();
        eprintln!(
            "[{} | output {} tok | {:.1} tok/s | target passes/token {:.2} | draft accepted {}/{} | segments {}/{} | finish {finish}]",
            s.mode,
            s.output_tokens,
            s.tokens_per_s,
            s.target_passes_per_token,
            s.draft_tokens_accepted,
            s.draft_tokens_proposed,
            s.segments_accepted,
            s.segments_proposed,
        );
    }
    Ok(())
}

/// `generate --router`: the same request through the client SDK.
fn generate_remote(addr: &str, args: &GenerateArgs, sec: &Security) -> Result<(), CliError> {
    use parse_client::{Client, ClientOptions, Event};
    use tokio_stream::StreamExt;

    if args.max_new_tokens == 0 || args.max_new_tokens > u32::MAX as usize {
        return Err(CliError::Usage("max-new-tokens must be at least 1".into()));
    }
    let timeout = match args.timeout_s {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(CliError::Usage(
                "timeout-s must be a positive number".into(),
            ));
        }
        Some(t) => Some(std::time::Duration::from_secs_f64(t)),
        None => None,
    };
    // Left out, the router's default.
    let mode = args
        .mode
        .map(|m| m.as_str().to_string())
        .unwrap_or_default();
    let req = parse_client::GenerateRequest {
        prompt: args.prompt.clone(),
        system: args.system.clone().unwrap_or_default(),
        max_new_tokens: args.max_new_tokens as u32,
        sampling: Some(parse_client::Sampling {
            temperature: args.temperature,
            top_k: args.top_k as u32,
            top_p: Some(args.top_p),
            seed: args.seed,
            cache_salt: 0,
        }),
        mode,
        tau: args.tau,
        verdict: args.verdict.map(|v| v.as_str().into()).unwrap_or_default(),
        exact_floor: Some(!args.no_exact_floor),
        segmenter: Some(parse_client::Segmenter {
            min_tokens: Some(args.min_segment_tokens as u32),
            max_tokens: Some(args.max_segment_tokens as u32),
            ..Default::default()
        }),
        stop: args.stop.clone(),
        draft_segments: args.draft_segments as u32,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut client = Client::connect_with(
            addr,
            ClientOptions {
                request_timeout: timeout,
                security: sec.clone(),
                ..Default::default()
            },
        )
        .await?;
        let mut stream = client.generate_stream(req).await?;
        let mut stdout = std::io::stdout();
        let mut text = String::new();
        let mut token_ids: Vec<u32> = Vec::new();
        let mut finished = None;
        while let Some(ev) = stream.next().await {
            match ev? {
                Event::Delta(d) => {
                    if !args.json {
                        let _ = stdout.write_all(d.text.as_bytes());
                        let _ = stdout.flush();
                    }
                    text.push_str(&d.text);
                    token_ids.extend(d.token_ids);
                }
                Event::Finished(f) => finished = Some(f),
            }
        }
        let f = finished.ok_or_else(|| {
            CliError::Remote(parse_client::ClientError::Unavailable(
                "the stream ended without a result".into(),
            ))
        })?;
        let s = f.stats.unwrap_or_default();
        if args.json {
            let v = json!({
                "text": text,
                "token_ids": token_ids,
                "finish_reason": f.finish_reason,
                "request_id": f.request_id,
                "stats": stats_json(&s),
            });
            // A closed stdout (`| head`) is not an error of the generation.
            let _ = writeln!(stdout, "{v}");
        } else {
            println!();
            eprintln!(
                "[{} | output {} tok | {:.1} tok/s | target passes/token {:.2} | draft accepted {}/{} | segments {}/{} | finish {}]",
                s.mode,
                s.output_tokens,
                s.tokens_per_s,
                s.target_passes_per_token,
                s.draft_tokens_accepted,
                s.draft_tokens_proposed,
                s.segments_accepted,
                s.segments_proposed,
                f.finish_reason,
            );
        }
        Ok(())
    })
}

/// The wire stats under the same keys as the local `--json` output, plus the cluster's failover figures.
pub fn stats_json(s: &parse_client::Stats) -> serde_json::Value {
    json!({
        "mode": s.mode,
        "prompt_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "draft_tokens_proposed": s.draft_tokens_proposed,
        "draft_tokens_accepted": s.draft_tokens_accepted,
        "segments_proposed": s.segments_proposed,
        "segments_accepted": s.segments_accepted,
        "target_passes": s.target_passes,
        "verify_passes": s.verify_passes,
        "extend_passes": s.extend_passes,
        "target_positions": s.target_positions,
        "target_passes_per_token": s.target_passes_per_token,
        "target_positions_per_token": s.target_positions_per_token,
        "draft_ms": s.draft_ms,
        "verify_ms": s.verify_ms,
        "extend_ms": s.extend_ms,
        "prefill_ms": s.prefill_ms,
        "total_ms": s.total_ms,
        "tokens_per_s": s.tokens_per_s,
        "draft_failovers": s.draft_failovers,
        "target_failovers": s.target_failovers,
        "fell_back_to_target": s.fell_back_to_target,
        "draft_prefetch_hits": s.draft_prefetch_hits,
        "draft_prefetch_misses": s.draft_prefetch_misses,
        "paused_tokens": s.paused_tokens,
        "pauses": s.pauses,
        "copy_rounds": s.copy_rounds,
        "cached_prompt_tokens": s.cached_prompt_tokens,
    })
}

/// `health`: SERVING exits 0; anything else (unreachable, NOT_SERVING) exits 1 once the wait is over.
fn health(args: &HealthArgs, sec: &Security) -> Result<(), CliError> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    if !(args.wait_s.is_finite() && args.wait_s >= 0.0) {
        return Err(CliError::Usage("wait-s must be a number >= 0".into()));
    }
    let endpoint = sec
        .endpoint(&args.addr)
        .map_err(|e| CliError::Usage(format!("bad address {}: {e}", args.addr)))?
        .connect_timeout(std::time::Duration::from_secs(2));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(args.wait_s);
    let status = rt.block_on(async {
        loop {
            let answer = match endpoint.connect().await {
                Ok(ch) => {
                    let mut req = tonic::Request::new(HealthCheckRequest {
                        service: String::new(),
                    });
                    req.set_timeout(std::time::Duration::from_secs(2));
                    match HealthClient::new(ch).check(req).await {
                        Ok(r) => match ServingStatus::try_from(r.into_inner().status) {
                            Ok(ServingStatus::Serving) => Ok("SERVING".to_string()),
                            Ok(ServingStatus::NotServing) if args.live => {
                                Ok("NOT_SERVING (alive)".to_string())
                            }
                            Ok(s) => Err(s.as_str_name().to_string()),
                            Err(_) => Err("UNKNOWN".to_string()),
                        },
                        Err(s) => Err(format!("{:?}: {}", s.code(), s.message())),
                    }
                }
                Err(e) => Err(format!(
                    "unreachable: {}",
                    parse_proto::security::error_chain(&e)
                )),
            };
            if answer.is_ok() || std::time::Instant::now() >= deadline {
                return answer;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    });
    let mut stdout = std::io::stdout();
    let (ok, text) = match &status {
        Ok(s) => (true, s.clone()),
        Err(s) => (false, s.clone()),
    };
    if args.json {
        let _ = writeln!(
            stdout,
            "{}",
            json!({"addr": args.addr, "serving": ok, "status": text})
        );
    } else {
        let _ = writeln!(stdout, "{}: {text}", args.addr);
    }
    if ok {
        Ok(())
    } else {
        Err(CliError::Unhealthy(format!(
            "{} is not serving: {text}",
            args.addr
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> Result<(), CliError> {
        run(Cli::try_parse_from(args).expect("arguments parse"))
    }

    /// A file the CLI cannot read or write is named in the error, with the exit code of what went wrong.
    #[test]
    fn file_errors_name_the_path() {
        let missing = std::env::temp_dir().join(format!("parsectl-missing-{}", std::process::id()));
        let m = missing.to_str().unwrap();
        let e = run_args(&[
            "parsectl",
            "bench",
            "--router",
            "127.0.0.1:1",
            "-n",
            "1",
            "--prompts",
            m,
        ])
        .unwrap_err();
        assert!(e.to_string().contains(m), "{e}");
        assert_eq!(e.exit_code(), EXIT_USAGE, "{e}");
        // A directory under a regular file cannot be created.
        let file = std::env::temp_dir().join(format!("parsectl-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let dir = file.join("certs");
        let e = run_args(&["parsectl", "certs", dir.to_str().unwrap()]).unwrap_err();
        std::fs::remove_file(&file).unwrap();
        assert!(e.to_string().contains(dir.to_str().unwrap()), "{e}");
        assert_eq!(e.exit_code(), EXIT_FAILURE, "{e}");
    }
}
