//! End-to-end throughput and quality harness: every mode on the same prompts, in one run, on one machine.
//!
//! `cargo run --release -p parse-bench -- --suite humaneval --n 20` (the defaults: `target`, `token-spec` and the
//! shipped default, `parse+token-spec` with `relative` at `tau = 0.9`)
//!
//! Reports per mode, verdict and tau: tokens/s and its ratio to `target` (same run), target passes and positions
//! per output token, token and segment acceptance, and quality against the same run's `target` mode: HumanEval
//! pass@1 (each record's `test` run in a `python3` subprocess with a timeout), ASDiv exact numeric answer, and for
//! MT-Bench / XSum the share of outputs identical to the target's and their mean common-prefix fraction. Writes
//! `<out-dir>/<suite>.json`, `<out-dir>/<suite>.md`, `<out-dir>/<suite>.svg` (speed-up against quality, one line
//! per mode and verdict over the tau sweep, target mode as the cross-hair) and `<out-dir>/<suite>-work.svg` (the
//! target's forward passes per output token against quality, likewise).
//!
//! Replies are measured whole, as a user receives them (up to the budget). HumanEval replies are scored on their
//! first code block; with `--cut-at-code-block` generation stops once that block is closed (as HumanEval harnesses
//! stop at the end of the function): the loop hands output over in chunks, so the harness keeps tokens only up to
//! the closing fence and counts, per prompt, how many of the kept tokens the draft wrote. Output tokens, per-token
//! figures, tok/s and the draft share then use the kept tokens; the time of the whole run (overshoot of the last
//! chunk included) stays in.
//!
//! With `--router ADDR --clients N` the requests go through a running cluster instead, N at a time (prompts taken
//! in order), each reply streamed and dropped once its answer is over (the router then stops it); tok/s is then the
//! aggregate: kept output tokens of all prompts over the run's wall time, prefill included (the same work in every
//! mode). `--repeat R` runs every configuration's cell R times through the router, each repetition in the reverse
//! order of the last, and reports each repetition's ratio to its own `target` cell with their mean and its 95%
//! interval; the other columns pool all cells. `--cpu-metrics ADDR,...` (the cluster's `/metrics` addresses) adds each
//! cell's CPU time per output token (`process_cpu_seconds_total` summed over the cluster's processes), which does not
//! count a virtual machine's steal time. The loop's counters come back only with a reply that runs to its end,
//! so through a router the passes and acceptance columns count those replies alone (HumanEval's, stopped at the code
//! block's close, mostly do not).
//!
//! Every prompt's result is also kept in `<out-dir>/<suite>-runs/<run>/<i>.json`; `--resume` reuses them, so a long
//! run survives an interruption (timings of reused prompts come from the run that made them: same machine and
//! build, but not the same process). MT-Bench and XSum have no reference answer here: their quality is the ROUGE-L F1
//! of each output against the same run's `target` output (1.0 = the target's own text).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Parser;
use parse_bench::model_dir;
use parse_bench::plot::{Series, scatter_svg};
use parse_core::pace::{Costs, Pacing};
use parse_core::{
    AcceptPolicy, CopyConfig, CopyFirst, DraftWindow, DrafterKind, GenerationRequest, Mode,
    NgramConfig, NgramDrafter, SegmenterConfig, Source, Stats, Verdict,
};
use parse_engine::drafter_verifier::{EngineDrafter, EngineVerifier};
use parse_engine::{Engine, EngineConfig, Message};
use parse_text::{StreamDecoder, Tokenizer};
use serde_json::{Value, json};

mod report;
use report::*;

mod cluster;
use cluster::*;

mod score;
use score::*;

#[derive(Parser)]
struct Args {
    /// humaneval, asdiv, mtbench or xsum.
    #[arg(long)]
    suite: String,
    /// A JSONL file of records in a suite's format [default: <suite>-dev.jsonl from deploy/eval/fetch.py's cache].
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Records used (the first N).
    #[arg(long, default_value_t = 20)]
    n: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "target,token-spec,parse+token-spec"
    )]
    modes: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "relative")]
    verdict: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "0.9")]
    tau: Vec<f32>,
    /// Output budget per prompt [default: by suite].
    #[arg(long)]
    max_new_tokens: Option<usize>,
    #[arg(long, default_value = "bench-results")]
    out_dir: PathBuf,
    /// HumanEval: stop each reply at the close of its first code block (the part that is scored) instead of
    /// measuring the whole reply.
    #[arg(long)]
    cut_at_code_block: bool,
    /// Where to write the run's result record [default: <out-dir>/<suite>.record.json].
    #[arg(long)]
    record: Option<PathBuf>,
    /// Mark the record's cells other than the first (the reference) for the README's table.
    #[arg(long)]
    headline: bool,
    /// Seconds a HumanEval test may run.
    #[arg(long, default_value_t = 10)]
    test_timeout: u64,
    /// Skip the first K records (with --n: records K..K+N).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Rows after a mismatch that must agree again (entropy verdict).
    #[arg(long, default_value_t = parse_core::policy::DEFAULT_LOOKAHEAD)]
    lookahead: usize,
    /// Reuse per-prompt results of an earlier (interrupted) run with the same settings.
    #[arg(long)]
    resume: bool,
    /// Drafters for the speculative modes, each run with every one: `model` (the draft model), `ngram` (prompt
    /// lookup, no model) and `model+ngram` (copies from long prompt-lookup matches, the draft model for the rest).
    #[arg(long, value_delimiter = ',', default_value = "model")]
    drafters: Vec<String>,
    /// Letting the target write alone where speculation does not pay (`DraftWindow::adaptive`, the router's
    /// default: greedy token-spec and PARSE rounds; in process each request judges on its own figures), each
    /// speculative run with every value given: `--adaptive false,true` runs both; the adaptive runs'
    /// labels say `adaptive`.
    #[arg(long, value_delimiter = ',', default_value = "false")]
    adaptive: Vec<bool>,
    /// Send the requests to the router at this address (a running cluster with the default pair) instead of
    /// running the models in process.
    #[arg(long)]
    router: Option<String>,
    /// With --router: requests at once.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// With --router: run every configuration this many times, each repetition in the reverse order of the last
    /// (A B, B A, A B, ...), so that a drift of the machine's speed meets every configuration alike. tok/s is then
    /// over all the cells of a configuration, and each repetition's ratio to the `target` cell of the same
    /// repetition is reported, with their mean and its 95% interval: under load one cell's ratio spreads too widely
    /// from cluster to cluster to tell a few points from noise.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// With --router: the cluster's `/metrics` addresses (`host:port`: the router's and every worker's), read before
    /// and after each cell. The sum of their `process_cpu_seconds_total` over a cell is its CPU time, reported per
    /// output token and, with --repeat, as each repetition's `target` figure over the configuration's (above 1: fewer
    /// CPU seconds per token than `target`). CPU time does not count the time a virtual machine's host takes the
    /// cores away (steal), so it spreads far less than tokens per second on a shared machine.
    #[arg(long, value_delimiter = ',')]
    cpu_metrics: Vec<String>,
}

struct Record {
    prompt: String,
    raw: Value,
}

impl Args {
    /// Whether replies stop at the close of their first code block (`--cut-at-code-block`, HumanEval only).
    fn cuts_at_code_block(&self) -> bool {
        self.cut_at_code_block && self.suite == "humaneval"
    }
}

fn records(args: &Args) -> Result<Vec<Record>> {
    let path = match &args.prompts {
        Some(p) => p.clone(),
        None => parse_bench::eval_file(&args.suite)?,
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .skip(args.skip)
        .take(args.n)
        .enumerate()
    {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let prompt = match args.suite.as_str() {
            "humaneval" => format!(
                "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n```python\n{}```",
                s("prompt").context("humaneval record without `prompt`")?
            ),
            "asdiv" => format!(
                "{} {}\nSolve it step by step, then give the final number on the last line as 'Answer: <number>'.",
                s("passage").unwrap_or_default(),
                s("question").context("asdiv record without `question`")?
            ),
            "mtbench" => v
                .get("turns")
                .and_then(|t| t.get(0))
                .and_then(|t| t.as_str())
                .context("mtbench record without `turns`")?
                .to_string(),
            "xsum" => {
                let doc: String = s("document")
                    .context("xsum record without `document`")?
                    .chars()
                    .take(2000)
                    .collect();
                format!("Summarize the following article in one sentence.\n\n{doc}")
            }
            other => bail!("unknown suite `{other}` (humaneval, asdiv, mtbench, xsum)"),
        };
        out.push(Record { prompt, raw: v });
    }
    Ok(out)
}

/// Names the per-prompt result folders; bumped when what a saved result means changes (2: HumanEval output kept up
/// to the close of the first code block).
const RESULTS_FORMAT: &str = "r2";

fn default_budget(suite: &str) -> usize {
    match suite {
        "humaneval" => 384,
        "asdiv" => 256,
        "mtbench" => 256,
        _ => 96,
    }
}

/// One prompt's result, kept on disk for `--resume`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    /// Output kept (up to the end of the answer).
    tokens: Vec<u32>,
    /// Of `tokens`, how many the draft wrote.
    draft_tokens_in_output: usize,
    /// The loop's own figures (its output count includes any overshoot of the last chunk).
    stats: Stats,
    /// Through a router: when the first streamed tokens arrived (ms after the call), and how many of the kept tokens
    /// they were. The rest over the rest of the time is the request's decode rate, the in-process figure's measure
    /// (prefill left out there too).
    #[serde(default)]
    first: Option<(f64, usize)>,
}

/// Keeps output up to the end of the answer: with `closes_code_block`, the close of the reply's first code block.
struct AnswerEnd<'a> {
    tokenizer: &'a Tokenizer,
    closes_code_block: bool,
    decoder: StreamDecoder,
    text: String,
    kept: Vec<u32>,
    from_draft: usize,
    done: bool,
}

impl<'a> AnswerEnd<'a> {
    fn new(tokenizer: &'a Tokenizer, closes_code_block: bool) -> Self {
        AnswerEnd {
            tokenizer,
            closes_code_block,
            decoder: StreamDecoder::new(),
            text: String::new(),
            kept: Vec::new(),
            from_draft: 0,
            done: false,
        }
    }

    /// Takes a chunk of output; returns whether generation should go on.
    fn push(&mut self, tokens: &[u32], source: Source) -> bool {
        for &t in tokens {
            if self.done {
                break;
            }
            self.kept.push(t);
            self.from_draft += usize::from(source == Source::Draft);
            if self.closes_code_block {
                // A token that fails to decode is kept and judged by the tests like any other.
                if let Ok(Some(delta)) = self.decoder.push(self.tokenizer, t) {
                    self.text.push_str(&delta);
                    self.done = self.text.matches("```").count() >= 2;
                }
            }
        }
        !self.done
    }
}

/// ROUGE-L F1 between two token sequences (longest common subsequence).
fn rouge_l(reference: &[u32], candidate: &[u32]) -> f64 {
    if reference.is_empty() || candidate.is_empty() {
        return f64::from(u8::from(reference == candidate));
    }
    let mut prev = vec![0usize; candidate.len() + 1];
    for r in reference {
        let mut cur = vec![0usize; candidate.len() + 1];
        for (j, c) in candidate.iter().enumerate() {
            cur[j + 1] = if r == c {
                prev[j] + 1
            } else {
                cur[j].max(prev[j + 1])
            };
        }
        prev = cur;
    }
    let lcs = prev[candidate.len()] as f64;
    let (p, r) = (lcs / candidate.len() as f64, lcs / reference.len() as f64);
    if lcs == 0.0 {
        0.0
    } else {
        2.0 * p * r / (p + r)
    }
}

struct RunCfg {
    mode: Mode,
    verdict: Verdict,
    tau: f32,
    /// Where drafts come from.
    drafter: DrafterKind,
    adaptive: bool,
}

/// Cell `k`'s prefix-cache namespace in a run whose namespaces start at `run` (never 0, the default namespace).
fn cell_salt(run: u64, k: usize) -> u64 {
    run.wrapping_add((k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .max(1)
}

fn label(c: &RunCfg) -> String {
    let l = match c.mode {
        Mode::Parse | Mode::ParseTokenSpec => {
            format!("{} {:?} tau={}", c.mode.as_str(), c.verdict, c.tau).to_lowercase()
        }
        m => m.as_str().to_string(),
    };
    let l = match c.drafter {
        DrafterKind::Model => l,
        other => format!("{l} {}", other.as_str()),
    };
    if c.adaptive {
        format!("{l} adaptive")
    } else {
        l
    }
}

/// One prompt in one configuration, in process.
#[allow(clippy::too_many_arguments)]
fn run_in_process(
    target: &mut Engine,
    draft: &mut Engine,
    tok: &Arc<Tokenizer>,
    args: &Args,
    cfg: &RunCfg,
    pacing: &Pacing,
    prompt: &[u32],
    budget: usize,
    session: &str,
    cache_salt: u64,
) -> Result<Saved> {
    let req = GenerationRequest {
        session: session.to_string(),
        prompt: prompt.to_vec(),
        max_new_tokens: budget,
        mode: cfg.mode,
        sampling: parse_core::SamplingParams {
            cache_salt,
            ..Default::default()
        },
        policy: AcceptPolicy {
            verdict: cfg.verdict,
            tau: cfg.tau,
            exact_floor: true,
            lookahead: args.lookahead,
        },
        segmenter: SegmenterConfig::default(),
        window: DraftWindow {
            adaptive: cfg.adaptive,
            ..Default::default()
        },
        eos: tok.eos_ids().to_vec(),
        judge_suffix: tok.judge_suffix()?,
    };
    let mut v = EngineVerifier::new(target);
    let mut d: Box<dyn parse_core::Drafter + '_> = match cfg.drafter {
        DrafterKind::Model => Box::new(EngineDrafter::new(draft)),
        DrafterKind::Ngram => Box::new(NgramDrafter::new(
            NgramConfig::default(),
            tok.piece_fn(),
            tok.eos_ids().to_vec(),
        )?),
        DrafterKind::ModelNgram => Box::new(CopyFirst::new(
            EngineDrafter::new(draft),
            CopyConfig::default(),
            tok.eos_ids().to_vec(),
        )?),
    };
    let mut end = AnswerEnd::new(tok, args.cuts_at_code_block());
    let o = parse_core::generate_paced(
        d.as_mut(),
        &mut v,
        &req,
        &mut |t, s| end.push(t, s),
        pacing.clone(),
    )
    .map_err(|e| anyhow::anyhow!("{}: {}", label(cfg), e.message))?;
    debug_assert!(o.tokens.starts_with(&end.kept));
    Ok(Saved {
        tokens: end.kept,
        draft_tokens_in_output: end.from_draft,
        stats: o.stats,
        first: None,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let recs = records(&args)?;
    if recs.is_empty() {
        bail!("no records");
    }
    let budget = args
        .max_new_tokens
        .unwrap_or_else(|| default_budget(&args.suite));
    let mut runs = vec![RunCfg {
        mode: Mode::Target,
        verdict: Verdict::Likelihood,
        tau: 0.0,
        drafter: DrafterKind::Model,
        adaptive: false,
    }];
    let kinds = args
        .drafters
        .iter()
        .map(|d| d.parse::<DrafterKind>())
        .collect::<Result<Vec<DrafterKind>, parse_core::Error>>()
        .map_err(|e| anyhow::anyhow!(e.message))?;
    for m in &args.modes {
        let mode: Mode = m
            .parse()
            .map_err(|e: parse_core::Error| anyhow::anyhow!(e.message))?;
        match mode {
            Mode::Target => {}
            Mode::Parse | Mode::ParseTokenSpec => {
                for v in &args.verdict {
                    let verdict: Verdict = v
                        .parse()
                        .map_err(|e: parse_core::Error| anyhow::anyhow!(e.message))?;
                    for &tau in &args.tau {
                        for &drafter in &kinds {
                            for &adaptive in &args.adaptive {
                                runs.push(RunCfg {
                                    mode,
                                    verdict,
                                    tau,
                                    drafter,
                                    adaptive,
                                });
                            }
                        }
                    }
                }
            }
            // The draft alone has nothing to look up.
            Mode::Draft => runs.push(RunCfg {
                mode,
                verdict: Verdict::Likelihood,
                tau: 0.0,
                drafter: DrafterKind::Model,
                adaptive: false,
            }),
            _ => {
                for &drafter in &kinds {
                    for &adaptive in &args.adaptive {
                        runs.push(RunCfg {
                            mode,
                            verdict: Verdict::Likelihood,
                            tau: 0.0,
                            drafter,
                            adaptive,
                        });
                    }
                }
            }
        }
    }
    if args.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    if !args.cpu_metrics.is_empty() && args.router.is_none() {
        bail!("--cpu-metrics needs --router: it reads the cluster's processes");
    }
    if args.repeat > 1 && args.router.is_none() {
        bail!(
            "--repeat needs --router: in process every prompt already runs in every configuration in turn"
        );
    }
    // Through a router the models run there; the tokenizer here only reads the replies.
    let mut engines = match args.router {
        Some(_) => None,
        None => {
            let dir = model_dir();
            Some((
                Engine::load(&EngineConfig::new(
                    dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
                ))?,
                Engine::load(&EngineConfig {
                    // As the draft worker loads it (its head in Q5_0).
                    load: parse_engine::LoadOptions::draft(),
                    ..EngineConfig::new(dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
                })?,
            ))
        }
    };
    let tok = match &engines {
        Some((target, _)) => target.tokenizer().clone(),
        None => Arc::new(Tokenizer::from_file(
            &parse_bench::reference_tokenizer_path(),
        )?),
    };
    let prompts: Vec<Vec<u32>> = recs
        .iter()
        .map(|r| tok.encode_chat(&[Message::user(&r.prompt)]))
        .collect::<Result<_, _>>()?;

    let mut rows = Vec::new();
    let runs_dir = args.out_dir.join(format!("{}-runs", args.suite));
    let run_dir = |cfg: &RunCfg| {
        runs_dir.join(format!(
            "{}-b{budget}-la{}{}-{RESULTS_FORMAT}",
            label(cfg).replace([' ', '=', '+'], "_"),
            args.lookahead,
            if args.cuts_at_code_block() {
                "-cut"
            } else {
                ""
            }
        ))
    };
    for cfg in &runs {
        std::fs::create_dir_all(run_dir(cfg))?;
    }
    // Each cell's prefix-cache namespace (`SamplingParams::cache_salt`): the requests of a cell share the prompts
    // they begin alike with (the chat layout, an instruction), but no cell takes whole prompts from a cell before it
    // (the same prompts in another configuration), nor from an earlier run on the same cluster.
    let run_salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    // In process, each prompt runs in every configuration before the next prompt: the machine's speed drifts over
    // minutes (a shared host), and configurations run one after the other would each meet a different part of the
    // drift, while interleaved they meet the same. In process the requests of a configuration share what they measure, as a router's do (at a
    // load of one): one pace's figures per configuration, kept across the prompts.
    if let Some((target, draft)) = engines.as_mut() {
        let pacings: Vec<Pacing> = runs
            .iter()
            .map(|cfg| Pacing {
                costs: Arc::new(Costs::default()),
                kind: label(cfg),
                load: Arc::new(|| 1),
                off_at: None,
            })
            .collect();
        for (i, p) in prompts.iter().enumerate() {
            for (k, (cfg, pacing)) in runs.iter().zip(&pacings).enumerate() {
                let saved = run_dir(cfg).join(format!("{}.json", i + args.skip));
                if args.resume && saved.exists() {
                    continue;
                }
                let s = run_in_process(
                    target,
                    draft,
                    &tok,
                    &args,
                    cfg,
                    pacing,
                    p,
                    budget,
                    &format!("bench-{i}"),
                    cell_salt(run_salt, k),
                )?;
                std::fs::write(&saved, serde_json::to_string(&s)?)?;
            }
            eprint!(".");
        }
        eprintln!(" {} prompts x {} runs", prompts.len(), runs.len());
    }
    // Through a router, every cell runs before any is scored (scoring runs HumanEval's tests, which would load the
    // machine between cells): `cells[c]` holds configuration c's cells, one per repetition, each with its wall time.
    // With --cpu-metrics each also holds its CPU seconds.
    let mut cells: Vec<Vec<Cell>> = runs.iter().map(|_| Vec::new()).collect();
    // A bad address fails here, before any cell runs; a scrape that fails later drops the run's CPU figures (with a
    // warning), not the cells it has run.
    let mut cpu_on = !args.cpu_metrics.is_empty();
    if cpu_on {
        cluster_cpu(&args.cpu_metrics)?;
    }
    let read_cpu = |on: &mut bool| -> Option<f64> {
        if !*on {
            return None;
        }
        match cluster_cpu(&args.cpu_metrics) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("\nwarning: {e:#}: no CPU figures for this run");
                *on = false;
                None
            }
        }
    };
    if let Some(addr) = &args.router {
        for rep in 0..args.repeat {
            let order: Vec<usize> = if rep % 2 == 0 {
                (0..runs.len()).collect()
            } else {
                (0..runs.len()).rev().collect()
            };
            for c in order {
                let cpu_before = read_cpu(&mut cpu_on);
                let salt = cell_salt(run_salt, rep * runs.len() + c);
                let (outs, wall_s) =
                    through_router(addr, &args, &runs[c], &recs, &tok, budget, salt)?;
                let cpu_s = read_cpu(&mut cpu_on).zip(cpu_before).map(|(b, a)| b - a);
                let tokens: usize = outs.iter().map(|o| o.tokens.len()).sum();
                let cpu_note = cpu_s
                    .map(|c| format!(", {:.1} CPU ms a token", 1e3 * c / tokens.max(1) as f64))
                    .unwrap_or_default();
                eprintln!(
                    " {} (repetition {}): {:.2} tok/s{cpu_note}",
                    label(&runs[c]),
                    rep + 1,
                    tokens as f64 / wall_s.max(1e-9)
                );
                cells[c].push((outs, wall_s, cpu_s));
            }
        }
        if !cpu_on {
            for cell in cells.iter_mut().flatten() {
                cell.2 = None;
            }
        }
    }
    // The `target` cells' outputs, one list per repetition, which the others are compared with.
    let mut target_outputs: Vec<Vec<Vec<u32>>> = Vec::new();
    for (c, cfg) in runs.iter().enumerate() {
        let mut total = Stats::default();
        let mut quality = 0.0;
        let mut prefix_share = 0.0;
        let mut draft_in_output = 0;
        let (mut first_ms, mut after_first_ms, mut after_first_tokens) = (0.0, 0.0, 0usize);
        let sets: Vec<(Vec<Saved>, Option<f64>, Option<f64>)> = if args.router.is_some() {
            std::mem::take(&mut cells[c])
                .into_iter()
                .map(|(outs, wall_s, cpu_s)| (outs, Some(wall_s), cpu_s))
                .collect()
        } else {
            let mut outs = Vec::with_capacity(prompts.len());
            for i in 0..prompts.len() {
                let saved = run_dir(cfg).join(format!("{}.json", i + args.skip));
                let text = std::fs::read_to_string(&saved)
                    .with_context(|| format!("{}", saved.display()))?;
                outs.push(
                    serde_json::from_str::<Saved>(&text)
                        .with_context(|| format!("{}", saved.display()))?,
                );
            }
            vec![(outs, None, None)]
        };
        let wall_s = sets.iter().map(|(_, w, _)| *w).sum::<Option<f64>>();
        // CPU milliseconds per output token of each repetition's cell, and over all of them.
        let cell_tokens = |outs: &[Saved]| outs.iter().map(|o| o.tokens.len()).sum::<usize>();
        let cpu_by_repeat: Vec<f64> = sets
            .iter()
            .filter_map(|(outs, _, cpu)| cpu.map(|c| 1e3 * c / cell_tokens(outs).max(1) as f64))
            .collect();
        let cpu_pooled = sets
            .iter()
            .map(|(_, _, c)| *c)
            .sum::<Option<f64>>()
            .map(|c| {
                1e3 * c
                    / sets
                        .iter()
                        .map(|(o, _, _)| cell_tokens(o))
                        .sum::<usize>()
                        .max(1) as f64
            });
        // tok/s of each repetition's cell, for its ratio to the same repetition's `target` cell.
        let by_repeat: Vec<f64> = sets
            .iter()
            .filter_map(|(outs, w, _)| w.map(|w| cell_tokens(outs) as f64 / w.max(1e-9)))
            .collect();
        let cells_scored = sets.len();
        for (rep, (outs, _, _)) in sets.into_iter().enumerate() {
            let mut rep_outputs = Vec::with_capacity(outs.len());
            for (i, out) in outs.into_iter().enumerate() {
                let s = &out.stats;
                draft_in_output += out.draft_tokens_in_output;
                if let Some((ms, n)) = out.first {
                    first_ms += ms;
                    after_first_tokens += out.tokens.len() - n;
                    after_first_ms += s.total_ms - ms;
                }
                for (a, b) in [
                    (&mut total.output_tokens, out.tokens.len()),
                    (&mut total.draft_tokens_proposed, s.draft_tokens_proposed),
                    (&mut total.draft_tokens_accepted, s.draft_tokens_accepted),
                    (&mut total.segments_proposed, s.segments_proposed),
                    (&mut total.segments_accepted, s.segments_accepted),
                    (&mut total.target_passes, s.target_passes),
                    (&mut total.target_positions, s.target_positions),
                ] {
                    *a += b;
                }
                total.draft_ms += s.draft_ms;
                total.verify_ms += s.verify_ms;
                total.extend_ms += s.extend_ms;
                total.prefill_ms += s.prefill_ms;
                total.total_ms += s.total_ms;
                let reply = tok.decode(&out.tokens, true)?;
                quality += match args.suite.as_str() {
                    "humaneval" => f64::from(u8::from(humaneval_pass(
                        &recs[i].raw,
                        &reply,
                        args.test_timeout,
                    )?)),
                    "asdiv" => f64::from(u8::from(asdiv_correct(&recs[i].raw, &reply))),
                    _ => match target_outputs.get(rep).and_then(|t| t.get(i)) {
                        Some(t) => rouge_l(t, &out.tokens),
                        None => 1.0,
                    },
                };
                if let Some(t) = target_outputs.get(rep).and_then(|t| t.get(i)) {
                    let common = t
                        .iter()
                        .zip(&out.tokens)
                        .take_while(|(a, b)| a == b)
                        .count();
                    prefix_share += common as f64 / t.len().max(out.tokens.len()).max(1) as f64;
                }
                rep_outputs.push(out.tokens);
                eprint!(".");
            }
            if cfg.mode == Mode::Target {
                target_outputs.push(rep_outputs);
            }
        }
        eprintln!(" {}", label(cfg));
        // Quality and agreement are means over every scored cell (prompts times repetitions).
        let n = (prompts.len() * cells_scored) as f64;
        if cfg.mode == Mode::Target {
            prefix_share = n;
        }
        // Decode throughput: output tokens over generation time, prefill excluded (it is the same in every mode);
        // through a router, over the wall time of the run.
        let gen_s = wall_s.unwrap_or((total.total_ms - total.prefill_ms) / 1e3);
        let tps = total.output_tokens as f64 / gen_s.max(1e-9);
        let per_tok = |x: usize| x as f64 / total.output_tokens.max(1) as f64;
        let ratio = |a: usize, b: usize| {
            if b == 0 {
                f64::NAN
            } else {
                a as f64 / b as f64
            }
        };
        rows.push(json!({
            "run": label(cfg),
            "mode": cfg.mode.as_str(),
            "verdict": format!("{:?}", cfg.verdict).to_lowercase(),
            "tau": cfg.tau,
            "prompts": prompts.len(),
            "output_tokens": total.output_tokens,
            "tokens_per_s": tps,
            "target_passes_per_token": per_tok(total.target_passes),
            "target_positions_per_token": per_tok(total.target_positions),
            "token_acceptance": ratio(total.draft_tokens_accepted, total.draft_tokens_proposed),
            "segment_acceptance": ratio(total.segments_accepted, total.segments_proposed),
            "quality": quality / n,
            "solved": quality,
            "draft_share": per_tok(draft_in_output),
            "prefix_agreement_with_target": prefix_share / n,
            "draft_s": total.draft_ms / 1e3,
            "verify_s": total.verify_ms / 1e3,
            "extend_s": total.extend_ms / 1e3,
            "prefill_s": total.prefill_ms / 1e3,
            "repeats": cells_scored,
            "tokens_per_s_by_repeat": by_repeat,
        }));
        if let Some(c) = cpu_pooled {
            let row = rows.last_mut().expect("just pushed");
            row["cpu_ms_per_token"] = json!(c);
            row["cpu_ms_per_token_by_repeat"] = json!(cpu_by_repeat);
        }
        if wall_s.is_some() {
            // Through a router the wall time holds each request's prefill (the target's, and the draft's where it
            // drafts); the rate after each request's first streamed tokens leaves it out, as the in-process
            // figure does, so the two compare.
            let row = rows.last_mut().expect("just pushed");
            row["decode_tokens_per_s"] =
                json!(after_first_tokens as f64 / (after_first_ms / 1e3).max(1e-9));
            row["time_to_first_tokens_s"] = json!(first_ms / 1e3 / n);
        }
    }
    let base_tps = rows[0]["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    let base_q = rows[0]["quality"].as_f64().unwrap_or(f64::NAN);
    let quality_name = match args.suite.as_str() {
        "humaneval" => "pass@1",
        "asdiv" => "accuracy",
        _ => "ROUGE-L vs target",
    };
    let mut md = format!(
        "### {} ({} prompts, up to {budget} new tokens, greedy)\n\n| run | tok/s | x target | target passes/tok | target positions/tok | draft share of output | token acc. | segment acc. | {quality_name} | delta vs target | draft / verify / extend s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        args.suite,
        prompts.len()
    );
    for r in rows.iter_mut() {
        let tps = r["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        let q = r["quality"].as_f64().unwrap_or(f64::NAN);
        r["speedup_vs_target"] = json!(tps / base_tps);
        r["quality_delta_points"] = json!((q - base_q) * 100.0);
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} | {:.3} | {:.3} | {:.1}% | {:+.1} | {:.0} / {:.0} / {:.0} |\n",
            r["run"].as_str().unwrap_or_default(),
            tps,
            tps / base_tps,
            f("target_passes_per_token"),
            f("target_positions_per_token"),
            f("draft_share"),
            f("token_acceptance"),
            f("segment_acceptance"),
            q * 100.0,
            (q - base_q) * 100.0,
            f("draft_s"),
            f("verify_s"),
            f("extend_s"),
        ));
    }
    if args.repeat > 1 {
        md.push_str(&format!(
            "\nEach repetition's ratio to its own `target` cell ({} repetitions, in the order A B, B A, ...), their mean and its 95% interval (t-distribution).\n\n| run | x target by repetition | mean | 95% interval |\n|---|---|---:|---:|\n",
            args.repeat
        ));
        let base: Vec<f64> = tps_by_repeat(&rows[0]);
        for r in rows.iter_mut().skip(1) {
            let ratios: Vec<f64> = tps_by_repeat(r)
                .iter()
                .zip(&base)
                .map(|(a, b)| a / b)
                .collect();
            let (mean, half) = mean_and_ci95(&ratios);
            md.push_str(&format!(
                "| {} | {} | {mean:.3} | {:.3} to {:.3} |\n",
                r["run"].as_str().unwrap_or_default(),
                listed(&ratios, 2),
                mean - half,
                mean + half,
            ));
            r["speedup_by_repeat"] = json!(ratios);
            r["speedup_mean"] = json!(mean);
            r["speedup_ci95"] = json!([mean - half, mean + half]);
        }
    }
    if rows[0]["cpu_ms_per_token"].is_number() {
        md.push_str(&cpu_table(&mut rows, &args.cpu_metrics));
    }
    if args.router.is_some() {
        let base = rows[0]["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "\nThrough the router, {} client(s): the rate after each request's first streamed tokens (prefill left out, as in process) and the mean time to them.\n\n| run | decode tok/s | x target | first tokens s |\n|---|---:|---:|---:|\n",
            args.clients
        ));
        for r in &rows {
            let d = r["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
            md.push_str(&format!(
                "| {} | {d:.2} | {:.2} | {:.2} |\n",
                r["run"].as_str().unwrap_or_default(),
                d / base,
                r["time_to_first_tokens_s"].as_f64().unwrap_or(f64::NAN),
            ));
        }
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let report = json!({ "suite": args.suite, "max_new_tokens": budget, "runs": rows });
    std::fs::write(
        args.out_dir.join(format!("{}.json", args.suite)),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(args.out_dir.join(format!("{}.md", args.suite)), &md)?;
    let record = result_record(&args, quality_name, budget, prompts.len(), &rows);
    let record_path = args
        .record
        .clone()
        .unwrap_or_else(|| args.out_dir.join(format!("{}.record.json", args.suite)));
    record.write(&record_path)?;
    let svg = args.out_dir.join(format!("{}.svg", args.suite));
    plot(&svg, &args.suite, quality_name, &rows, base_q)?;
    println!("{md}");
    Ok(())
}

#[cfg(test)]
mod tests;
