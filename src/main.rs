//! The `tandem` command line.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use tandem::bench::{self, BenchOptions, Preset};
use tandem::decode::generate::{generate, FinishReason, GenerateOptions};
use tandem::config::validate_pair;
use tandem::decode::sampling::SamplingParams;
use tandem::decode::speculative::{generate_speculative, DraftLength, SpecStats, MAX_DRAFT};
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

#[derive(Parser)]
#[command(name = "tandem", version, about = "Gemma 4 on CPU, with speculative decoding by its assistant drafters")]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate tokens from a prompt.
    Generate(GenerateArgs),
    /// Measure speed on a random-weight model at real Gemma 4 dimensions, built in memory.
    Bench(BenchArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 2,17,33.
    #[arg(long)]
    prompt_ids: String,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// 1.0 disables the penalty.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Report the log-probability of each token and of the N most likely alternatives.
    #[arg(long, value_name = "N")]
    top_logprobs: Option<usize>,
    /// Total tokens (prompt + generated) allowed; default and maximum: the model's max_position_embeddings.
    #[arg(long)]
    context: Option<usize>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Assistant (MTP drafter) directory: decode speculatively, with exactly the target's output.
    #[arg(long)]
    assistant: Option<PathBuf>,
    /// Draft tokens per round: a number, or `auto` (adapt to measured acceptance and costs). Default: the
    /// drafter's `num_assistant_tokens`, else auto.
    #[arg(long, value_name = "K|auto")]
    draft_tokens: Option<String>,
    /// Load the assistant but decode without drafting.
    #[arg(long)]
    no_draft: bool,
    /// Add every round's drafted tokens and acceptance to the JSON output.
    #[arg(long)]
    trace: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// Model dimensions: e2b or e4b.
    #[arg(long, default_value = "e2b")]
    preset: String,
    /// Decoder layers to build (the real models have 35 / 42; fewer fit in memory and run faster).
    #[arg(long, default_value_t = 10)]
    layers: usize,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prefill: usize,
    /// Decode steps to time.
    #[arg(long, default_value_t = 32)]
    decode: usize,
    /// Largest multi-row forward to time (rows 1..=R).
    #[arg(long, default_value_t = 8)]
    rows: usize,
    /// Draft steps to time (median reported).
    #[arg(long, default_value_t = 15)]
    draft_steps: usize,
    /// Instead: run held-out prompts greedily with and without drafting on a real pair (default: the
    /// pair that ships in models/default) and report acceptance and the decode speed-up.
    #[arg(long)]
    pair: bool,
    /// --pair: target model directory.
    #[arg(long, requires = "pair")]
    model: Option<PathBuf>,
    /// --pair: assistant directory.
    #[arg(long, requires = "pair")]
    assistant: Option<PathBuf>,
    /// --pair: JSON list of prompts (objects with `ids`, or lists of ids).
    #[arg(long, requires = "pair")]
    prompts: Option<PathBuf>,
    /// --pair: draft tokens per round (a number or `auto`).
    #[arg(long, requires = "pair", default_value = "4")]
    draft_tokens: String,
    /// --pair: tokens generated per prompt.
    #[arg(long, requires = "pair", default_value_t = 64)]
    max_new_tokens: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

fn run(cli: Cli) -> Result<()> {
    let threads = match cli.threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| anyhow!("cannot start {threads} threads: {e}"))?;
    match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Bench(args) => run_bench(args, threads),
    }
}

fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|_| anyhow!("--prompt-ids: {t:?} is not a token id")))
        .collect()
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let prompt = parse_ids(&args.prompt_ids)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed: args.seed,
    };
    sampling.validate()?;
    let model = TargetModel::load(&args.model)?;
    let max_ctx = model.cfg.max_position_embeddings;
    let context_limit = match args.context {
        Some(0) => bail!("--context must be at least 1"),
        Some(c) if c > max_ctx => bail!("--context {c} exceeds the model's max_position_embeddings ({max_ctx})"),
        Some(c) => c,
        None => max_ctx,
    };
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        ignore_eos: args.ignore_eos,
        sampling,
        top_logprobs: args.top_logprobs,
        context_limit,
    };
    let assistant = match &args.assistant {
        Some(dir) => {
            let a = Assistant::load(dir).context("cannot load the assistant")?;
            validate_pair(&model.cfg, &a.cfg).context("the assistant does not match the target")?;
            Some(a)
        }
        None => None,
    };
    if args.assistant.is_none() && (args.draft_tokens.is_some() || args.trace) {
        bail!("--draft-tokens and --trace need --assistant");
    }
    let draft_len = match (&assistant, args.draft_tokens.as_deref()) {
        (None, _) => None,
        (Some(_), _) if args.no_draft => None,
        (Some(_), Some(k)) => Some(DraftLength::parse(k)?),
        (Some(a), None) => Some(match a.cfg.num_assistant_tokens {
            Some(k) => DraftLength::Fixed(k.min(MAX_DRAFT)),
            None => DraftLength::Auto,
        }),
    };

    let stdout = std::io::stdout();
    let mut first = true;
    let mut print_tokens = |ts: &[u32]| {
        if !args.json && !ts.is_empty() {
            let mut o = stdout.lock();
            for t in ts {
                let _ = write!(o, "{}{t}", if first { "" } else { " " });
                first = false;
            }
            let _ = o.flush();
        }
    };
    let (g, spec) = match (&assistant, draft_len) {
        (Some(a), Some(dl)) => {
            let (g, s) = generate_speculative(&model, a, &prompt, &opts, dl, args.trace, &mut print_tokens)
                .context("generation failed")?;
            (g, Some(s))
        }
        _ => (generate(&model, &prompt, &opts, |t| print_tokens(&[t])).context("generation failed")?, None),
    };
    if g.context_limited {
        eprintln!("note: stopped at the context limit of {context_limit} tokens");
    }
    if args.json {
        let mut stats = serde_json::to_value(&g.stats)?;
        let mut rounds = None;
        if let Some(s) = &spec {
            let mut sv = serde_json::to_value(s)?;
            rounds = sv.as_object_mut().and_then(|o| o.remove("rounds"));
            if let (Some(dst), Some(src)) = (stats.as_object_mut(), sv.as_object()) {
                dst.extend(src.clone());
            }
        }
        let mut obj = json!({
            "prompt_ids": prompt,
            "tokens": g.tokens,
            "text": null,
            "finish_reason": g.finish_reason,
            "stats": stats,
        });
        if args.top_logprobs.is_some() {
            obj["logprobs"] = serde_json::to_value(&g.logprobs)?;
        }
        if let Some(r) = rounds {
            obj["rounds"] = r;
        }
        println!("{obj}");
    } else {
        println!();
        eprintln!("{}", summary(&g, spec.as_ref()));
    }
    Ok(())
}

/// The one-line human summary on stderr.
fn summary(g: &tandem::decode::generate::Generation, spec: Option<&SpecStats>) -> String {
    let s = &g.stats;
    let mut line = format!(
        "{} prompt tokens, {} generated ({}); prefill {:.1} tok/s, decode {:.1} tok/s",
        s.prompt_tokens,
        s.generated_tokens,
        match g.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        },
        s.prefill_tokens_per_s,
        s.decode_tokens_per_s
    );
    if let Some(sp) = spec {
        line += &format!(
            "; drafting: {} rounds, {}/{} drafts accepted ({:.0}%), {:.2} per round",
            sp.draft_rounds,
            sp.accepted_tokens,
            sp.drafted_tokens,
            100.0 * sp.acceptance_rate,
            sp.mean_accepted_per_round
        );
    }
    line
}

fn run_bench(args: BenchArgs, threads: usize) -> Result<()> {
    if args.pair {
        let dir = bench::default_model_dir();
        let opts = bench::PairOptions {
            target: args.model.unwrap_or_else(|| dir.join("target")),
            assistant: args.assistant.unwrap_or_else(|| dir.join("assistant")),
            prompts: args.prompts.unwrap_or_else(|| dir.join("heldout_prompts.json")),
            draft: DraftLength::parse(&args.draft_tokens)?,
            max_new_tokens: args.max_new_tokens,
        };
        let report = bench::run_pair(&opts, |msg| eprintln!("{msg}"))?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", report.table());
        }
        return Ok(());
    }
    let preset = Preset::parse(&args.preset)?;
    let opts = BenchOptions {
        preset,
        layers: args.layers,
        prefill_tokens: args.prefill,
        decode_steps: args.decode,
        max_rows: args.rows,
        draft_steps: args.draft_steps,
        threads,
    };
    let report = bench::run(&opts, |msg| eprintln!("{msg}"))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
