//! The operator CLI. `generate --local` runs a model in process; later commands talk to a cluster.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use parse_engine::{Engine, EngineConfig, GenerateRequest, Message, SamplingParams};
use serde_json::json;

/// Exit code for bad input (arguments, prompt).
pub const EXIT_USAGE: u8 = 2;
/// Exit code for a failure while running.
pub const EXIT_FAILURE: u8 = 1;

/// Environment variable naming the model cache directory.
pub const ENV_MODEL_DIR: &str = "PARSE_MODEL_DIR";
/// File names of the default pair inside the model cache (see `deploy/models/fetch.py`).
pub const DEFAULT_TARGET_FILE: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const DEFAULT_DRAFT_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Engine(#[from] parse_engine::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Engine(parse_engine::Error::InvalidInput(_)) => {
                EXIT_USAGE
            }
            CliError::Engine(parse_engine::Error::ContextExceeded { .. }) => EXIT_USAGE,
            _ => EXIT_FAILURE,
        }
    }
}

#[derive(Debug, Parser)]
#[command(name = "parsectl", version, about = "PARSE cluster operator CLI")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a reply to one prompt.
    Generate(GenerateArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// The target model alone.
    Target,
    /// The draft model alone.
    Draft,
}

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Target model: a .gguf file or a safetensors directory [default: the default pair's target in the cache].
    #[arg(long, env = "PARSE_TARGET_MODEL")]
    pub target_model: Option<PathBuf>,
    /// Draft model [default: the default pair's draft in the cache].
    #[arg(long, env = "PARSE_DRAFT_MODEL")]
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
            Mode::Target => (&self.target_model, DEFAULT_TARGET_FILE),
            Mode::Draft => (&self.draft_model, DEFAULT_DRAFT_FILE),
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
    #[arg(long, required = true)]
    pub local: bool,
    #[arg(long, value_enum, default_value_t = Mode::Target)]
    pub mode: Mode,
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
    /// Print one JSON object instead of text and a stats line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub models: ModelArgs,
    /// The user's prompt.
    pub prompt: String,
}

pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Generate(args) => generate(&args),
    }
}

fn generate(args: &GenerateArgs) -> Result<(), CliError> {
    if args.prompt.trim().is_empty() {
        return Err(CliError::Usage("empty prompt".into()));
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    let path = args.models.path_for(args.mode)?;
    let mut cfg = EngineConfig::new(path);
    cfg.tokenizer = args.models.tokenizer.clone();
    let mut engine = Engine::load(&cfg)?;
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(Message::new("system", s));
    }
    messages.push(Message::new("user", &args.prompt));
    let prompt_tokens = engine.tokenizer().encode_chat(&messages)?;
    let req = GenerateRequest {
        prompt_tokens,
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop: args.stop.clone(),
    };
    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let out = parse_engine::generate(&mut engine, "cli", &req, |delta, _| {
        if stream {
            let _ = stdout.write_all(delta.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if args.json {
        let v = json!({
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason.as_str(),
            "stats": out.stats,
        });
        println!("{v}");
    } else {
        let s = &out.stats;
        println!();
        eprintln!(
            "[{} | prompt {} tok | output {} tok | prefill {:.0} ms | decode {:.1} tok/s | finish {}]",
            args.mode
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default(),
            s.prompt_tokens,
            s.output_tokens,
            s.prefill_ms,
            s.decode_tokens_per_s,
            out.finish_reason.as_str()
        );
    }
    Ok(())
}
