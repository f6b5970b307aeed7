//! The `tandem` command line.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{ArgGroup, Args, Parser, Subcommand};
use serde_json::json;

use tandem::bench::{self, BenchOptions, Preset};
use tandem::config::TextConfig;
use tandem::decode::draft_policy::{DraftLength, DraftPolicy, MAX_DRAFT};
use tandem::decode::generate::{FinishReason, GenerateOptions, Generation};
use tandem::decode::sampling::SamplingParams;
use tandem::decode::speculative::SpecStats;
use tandem::engine::{Engine, Event, Limits, Models, Outcome, Prompt, Request};
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;
use tandem::params;
use tandem::quantize::LoadQuant;
use tandem::text::stream::terminal_safe;
use tandem::text::{has_tokenizer, ChatTemplate, TextTokenizer, TOKENIZER_FILE};

#[derive(Parser)]
#[command(name = "tandem", version, about = "Gemma 4 on CPU, with speculative decoding by its assistant drafters")]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true, allow_hyphen_values = true)]
    threads: Option<usize>,
    /// Copy the weights into memory backed by transparent huge pages instead of memory-mapping the files
    /// (faster decoding where the machine allows huge pages; costs a copy at load).
    #[arg(long, global = true)]
    huge_pages: bool,
    /// Quantize the model's matrices at load: q8_0, q4_0 or q4_k_m (llama.cpp's mixtures; the drafter
    /// stays bf16 unless --quantize-assistant). See docs/quantization.md.
    #[arg(long, global = true, value_name = "RECIPE")]
    quantize: Option<String>,
    /// Quantize the assistant (drafter) with the same recipe as well.
    #[arg(long, global = true)]
    quantize_assistant: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate from a prompt: token ids, raw text, or one chat message.
    Generate(GenerateArgs),
    /// Talk to the model in the terminal: a multi-turn conversation through its chat template.
    Chat(ChatArgs),
    /// Measure speed on a random-weight model at real Gemma 4 dimensions, built in memory.
    Bench(BenchArgs),
    /// Serve an OpenAI-compatible HTTP API on the batched engine (docs/serve.md).
    Serve(tandem::serve::ServeArgs),
    /// Write a model (target or assistant; a directory or a GGUF file) as a GGUF file that llama.cpp also
    /// runs, quantized with --quantize q8_0|q4_0|q4_k_m when given (docs/gguf.md).
    Quantize(QuantizeArgs),
}

#[derive(Args)]
struct QuantizeArgs {
    /// The model to write: a checkpoint directory (a Gemma 4 target or assistant) or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The GGUF file to write (replaced if it exists).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

/// `--seed`: a number, or `None` for a random one (-1).
#[derive(Clone, Copy, Debug)]
struct Seed(Option<u64>);

/// Options shared by `generate` and `chat`.
#[derive(Args)]
struct RunArgs {
    /// Model directory (config.json + safetensors; tokenizer.json for text) or GGUF file. Default: the small
    /// model pair that ships with tandem (models/default), with its assistant.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Most tokens to generate (per reply in `chat`). Default: 128 for `generate`, 1024 for `chat`.
    #[arg(long, allow_hyphen_values = true)]
    max_new_tokens: Option<usize>,
    /// 0 means greedy; otherwise at least 1e-4.
    #[arg(long, default_value = "0", allow_hyphen_values = true, value_parser = |s: &str| params::parse_float("temperature", s))]
    temperature: f32,
    /// Keep the K most likely tokens; 0 or -1 disable top-k.
    #[arg(long, default_value = "0", allow_hyphen_values = true, value_parser = params::parse_top_k)]
    top_k: usize,
    #[arg(long, default_value = "1", allow_hyphen_values = true, value_parser = |s: &str| params::parse_float("top-p", s))]
    top_p: f32,
    #[arg(long, default_value = "0", allow_hyphen_values = true, value_parser = |s: &str| params::parse_float("min-p", s))]
    min_p: f32,
    /// 1.0 disables the penalty.
    #[arg(long, default_value = "1", allow_hyphen_values = true, value_parser = |s: &str| params::parse_float("repeat-penalty", s))]
    repeat_penalty: f32,
    /// Sampling seed; -1 picks a random one.
    #[arg(long, default_value = "0", allow_hyphen_values = true, value_parser = |s: &str| params::parse_seed(s).map(Seed))]
    seed: Seed,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Total tokens (prompt + generated) allowed; default and maximum: the model's max_position_embeddings.
    #[arg(long, allow_hyphen_values = true)]
    context: Option<usize>,
    /// Assistant (MTP drafter) directory or GGUF file: decode speculatively, with exactly the target's output.
    #[arg(long)]
    assistant: Option<PathBuf>,
    /// Draft tokens per round: a number, or `auto` (adapt to measured acceptance and costs). Default: the
    /// drafter's `num_assistant_tokens`, else auto.
    #[arg(long, value_name = "K|auto")]
    draft_tokens: Option<String>,
    /// Load the assistant but decode without drafting.
    #[arg(long)]
    no_draft: bool,
    /// Stop when the generated text contains STRING (not printed). Repeatable. Needs a tokenizer.
    #[arg(long, value_name = "STRING", allow_hyphen_values = true, value_parser = params::parse_stop)]
    stop: Vec<String>,
    /// Let the model think before it answers (the chat template's `enable_thinking`).
    #[arg(long)]
    thinking: bool,
    /// Print thinking blocks (`<|channel>thought ... <channel|>`) instead of hiding them.
    #[arg(long)]
    show_thinking: bool,
}

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt_ids", "prompt", "chat"])))]
struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Prompt as comma-separated token ids, e.g. 2,17,33.
    #[arg(long)]
    prompt_ids: Option<String>,
    /// Prompt as text, tokenized as transformers' `tokenizer(TEXT)` does (with BOS if the tokenizer adds one): a raw
    /// completion.
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// One user message, formatted by the model's chat template (with the reply's opening).
    #[arg(long, value_name = "TEXT")]
    chat: Option<String>,
    /// System message before the `--chat` message.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    system: Option<String>,
    /// Report the log-probability of each token and of the N most likely alternatives.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    top_logprobs: Option<usize>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Add every round's drafted tokens and acceptance to the JSON output.
    #[arg(long)]
    trace: bool,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    run: RunArgs,
    /// System message at the start of the conversation (kept across /reset).
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
}

#[derive(Args)]
struct BenchArgs {
    /// Model dimensions: e2b, e4b or 26b-a4b (the MoE size: 128 experts, top 8).
    #[arg(long, default_value = "e2b")]
    preset: String,
    /// Decoder layers to build (the real models have 35 / 42; fewer fit in memory and run faster).
    #[arg(long, allow_hyphen_values = true, default_value_t = 10)]
    layers: usize,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, allow_hyphen_values = true, default_value_t = 128)]
    prefill: usize,
    /// Decode steps to time.
    #[arg(long, allow_hyphen_values = true, default_value_t = 32)]
    decode: usize,
    /// Largest multi-row forward to time (rows 1..=R).
    #[arg(long, allow_hyphen_values = true, default_value_t = 8)]
    rows: usize,
    /// Draft steps to time (median reported).
    #[arg(long, allow_hyphen_values = true, default_value_t = 15)]
    draft_steps: usize,
    /// Instead: run held-out prompts greedily with and without drafting on a real pair (default: the
    /// pair that ships in models/default, or --model and --assistant) and report acceptance and the
    /// decode speed-up.
    #[arg(long, conflicts_with = "concurrency")]
    pair: bool,
    /// Instead: run this many requests at once through the engine, for each level (e.g. 1,2,4,8), with
    /// drafting off and on; --prefill and --decode are each request's prompt and new tokens. Model: the
    /// random preset (with its random drafter), or --model [--assistant].
    #[arg(long, value_name = "LEVELS")]
    concurrency: Option<String>,
    /// --concurrency: repetitions, each running every level and mode once (the median repetition
    /// reported, and each ratio as the median of the repetitions' own). --pair: passes over the
    /// prompts, each prompt plain then with drafting (the speed-up the median of the passes' own).
    #[arg(long, allow_hyphen_values = true, default_value_t = 3)]
    repeats: usize,
    /// --concurrency: measure plain decoding only.
    #[arg(long)]
    no_draft: bool,
    /// --concurrency: also measure each level with a request with a prompt of N tokens joining once the
    /// streams run (its prefill shows in the streams' inter-token latency; its own time to first token
    /// is reported)
    #[arg(long, value_name = "N", allow_hyphen_values = true, default_value_t = 0)]
    join_prompt: usize,
    /// The checkpoint to measure (default: a random model of --preset with --layers, and its random
    /// drafter, built in memory).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The assistant to measure with --model.
    #[arg(long)]
    assistant: Option<PathBuf>,
    /// --pair, --concurrency: JSON list of prompts (objects with `ids`, or lists of ids; --concurrency
    /// cycles through them, cut to --prefill tokens, and uses random ids without them).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Draft tokens per round with drafting (a number or `auto`; default 4; auto for --concurrency; with
    /// --pair, the pair's own default as `generate` uses it: the drafter's `num_assistant_tokens`, else
    /// auto).
    #[arg(long)]
    draft_tokens: Option<String>,
    /// --pair: tokens generated per prompt.
    #[arg(long, requires = "pair", allow_hyphen_values = true, default_value_t = 64)]
    max_new_tokens: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// `eprintln!` that cannot panic: a closed or full stderr loses the message, never the process.
macro_rules! say {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// Stdout went away: the reader closed the pipe (`tandem generate ... | head`). The run ends quietly.
#[derive(Debug)]
struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Write `text` to stdout now. A closed pipe is [`StdoutClosed`]; any other failure (a full disk) is an
/// error that says so.
fn emit(text: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|_| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow!("cannot write to stdout: {e}")),
    }
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
        Err(e) if e.chain().any(|c| c.is::<StdoutClosed>()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

/// More worker threads than this is a typo, not a machine (each one reserves a stack).
const MAX_THREADS: usize = 1024;

fn run(cli: Cli) -> Result<()> {
    tandem::kernels::check_isa_env().map_err(|e| anyhow!(e))?;
    let threads = match cli.threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) if n > MAX_THREADS => bail!("--threads must be at most {MAX_THREADS}, got {n}"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| anyhow!("cannot start {threads} threads: {e}"))?;
    tandem::weights::use_huge_pages(cli.huge_pages);
    let quant = LoadQuant::new(cli.quantize.as_deref(), cli.quantize_assistant)?;
    match cli.command {
        Command::Generate(args) => run_generate(args, quant),
        Command::Chat(args) => run_chat(args, quant),
        Command::Bench(args) => run_bench(args, threads, quant),
        Command::Serve(args) => tandem::serve::run(args, quant),
        Command::Quantize(args) => run_quantize(args, quant),
    }
}

fn run_quantize(args: QuantizeArgs, quant: LoadQuant) -> Result<()> {
    if quant.assistant {
        bail!("--quantize-assistant is for loading a pair; `quantize` writes one model: pass the assistant as --model");
    }
    let w = tandem::gguf::convert::convert(&args.model, &args.out, quant.recipe, |l| say!("{l}"))?;
    for warning in &w.warnings {
        say!("warning: {warning}");
    }
    say!("wrote {} ({} tensors, {:.1} MB) in {:.1} s", args.out.display(), w.tensors, w.bytes as f64 / 1e6, w.seconds);
    Ok(())
}

/// A loaded model (and assistant) on the engine, with the run's generation settings.
struct Session {
    engine: Engine,
    opts: GenerateOptions,
    /// With an assistant: the draft-length policy, kept for the whole session so that `auto` carries
    /// what it learned from one turn to the next, and whether drafting is on (chat's `/draft` switches it).
    draft: Option<DraftPolicy>,
    drafting: bool,
    stop: Vec<String>,
    show_thinking: bool,
}

/// How much the run needs the tokenizer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TextNeed {
    /// Required; the string says for what, with its verb (e.g. "text prompts need").
    Required(&'static str),
    /// Used for the JSON `text` when it is there.
    Optional,
}

impl RunArgs {
    /// The target directory: `--model`, else the shipped default.
    fn model_dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(m) => Ok(m.clone()),
            None => {
                let dir = bench::default_model_dir().join("target");
                if !dir.join("config.json").is_file() {
                    bail!("no --model given and the default model is missing at {}", dir.display());
                }
                Ok(dir)
            }
        }
    }

    /// The assistant directory: `--assistant`, else the default pair's assistant when the model is the default.
    fn assistant_dir(&self) -> Option<PathBuf> {
        match (&self.assistant, &self.model) {
            (Some(a), _) => Some(a.clone()),
            (None, None) => Some(bench::default_model_dir().join("assistant")),
            (None, Some(_)) => None,
        }
    }
}

fn open_session(
    run: &RunArgs,
    quant: LoadQuant,
    default_max_new: usize,
    need: TextNeed,
    top_logprobs: Option<usize>,
    trace: bool,
    chat: bool,
) -> Result<Session> {
    let model_dir = run.model_dir()?;
    let assistant_dir = run.assistant_dir();
    let sampling = SamplingParams {
        temperature: run.temperature,
        top_k: run.top_k,
        top_p: run.top_p,
        min_p: run.min_p,
        repeat_penalty: run.repeat_penalty,
        seed: run.seed.0.unwrap_or_else(params::random_seed),
        ..SamplingParams::default()
    };
    sampling.validate()?;
    let need = if run.stop.is_empty() || matches!(need, TextNeed::Required(_)) {
        need
    } else {
        TextNeed::Required("--stop needs")
    };
    if let TextNeed::Required(what) = need {
        if !has_tokenizer(&model_dir) {
            let gguf = tandem::gguf::is_gguf(&model_dir);
            if !gguf && !model_dir.join("config.json").is_file() {
                TargetModel::load(&model_dir)?; // not a model directory at all: say that
            }
            let hint =
                if what.starts_with("text prompts") || what.starts_with("--chat") { "; use --prompt-ids" } else { "" };
            let missing = if gguf { "tokenizer metadata (tokenizer.ggml.tokens)" } else { TOKENIZER_FILE };
            bail!("{what} a tokenizer: {} has no {missing}{hint}", model_dir.display());
        }
    }
    let model = TargetModel::load_with(&model_dir, quant.recipe, |l| say!("{l}"))?;
    if let Some(w) = memory_warning(model.working_set_bytes(), tandem::system::physical_memory_bytes()) {
        say!("{w}");
    }
    let tokenizer = match need {
        TextNeed::Required(_) => Some(load_tokenizer(&model_dir, model.cfg.vocab_size)?),
        TextNeed::Optional if has_tokenizer(&model_dir) => match load_tokenizer(&model_dir, model.cfg.vocab_size) {
            Ok(t) => Some(t),
            Err(e) => {
                say!("warning: no text output: {}", one_line(&e));
                None
            }
        },
        TextNeed::Optional => None,
    };
    let max_ctx = model.cfg.max_position_embeddings;
    let context_limit = match run.context {
        Some(0) => bail!("--context must be at least 1"),
        Some(c) if c > max_ctx => bail!("--context {c} exceeds the model's max_position_embeddings ({max_ctx})"),
        Some(c) => c,
        None => max_ctx,
    };
    let opts = GenerateOptions {
        max_new_tokens: run.max_new_tokens.unwrap_or(default_max_new),
        ignore_eos: run.ignore_eos,
        sampling,
        top_logprobs,
        context_limit,
    };
    let assistant = match &assistant_dir {
        Some(dir) => Some(Assistant::load_for_with(dir, &model.cfg, quant.assistant_recipe(), |l| say!("{l}"))?),
        None => None,
    };
    if assistant_dir.is_none() && (run.draft_tokens.is_some() || trace) {
        bail!("--draft-tokens and --trace need --assistant");
    }
    let setting = run.draft_tokens.as_deref().map(DraftLength::parse).transpose()?;
    let template = match (&tokenizer, chat) {
        (Some(tok), true) => {
            let src = tok.chat_template().ok_or_else(|| {
                anyhow!(
                    "{} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); use --prompt",
                    tok.dir().display()
                )
            })?;
            Some(ChatTemplate::new(src)?)
        }
        _ => None,
    };
    let models = Models { target: model, assistant, tokenizer, template };
    let draft = models.draft_policy(setting);
    let drafting = draft.is_some() && !run.no_draft;
    // Test hook: slow every step down so that a test can interrupt a reply.
    let step_delay =
        std::env::var("TANDEM_TEST_TOKEN_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
    // One user: the K/V budget is whatever memory the machine has free (a request that cannot fit says so).
    let kv_bytes = tandem::system::available_memory_bytes().map_or(Limits::default().kv_bytes, |b| b as usize);
    let engine = Engine::start(models, Limits { step_delay, kv_bytes, ..Limits::default() });
    Ok(Session { engine, opts, draft, drafting, stop: run.stop.clone(), show_thinking: run.show_thinking })
}

fn load_tokenizer(dir: &Path, vocab_size: usize) -> Result<TextTokenizer> {
    let tok = TextTokenizer::load(dir).context("cannot load the tokenizer")?;
    if tok.base_len() > vocab_size {
        bail!(
            "the tokenizer in {} has a vocabulary of {} tokens but the model's has {vocab_size}: they do not belong together",
            dir.display(),
            tok.base_len()
        );
    }
    // Added tokens past the embedding: transformers loads such a tokenizer (GemmaTokenizer adds `<mask>`
    // when the vocabulary lacks it), so do too, and refuse only a prompt that uses one of them.
    if tok.len() > vocab_size {
        let extra: Vec<String> = (vocab_size..tok.len().min(vocab_size + 5))
            .map(|id| format!("{} = {:?}", id, tok.id_to_token(id as u32).unwrap_or_default()))
            .collect();
        say!(
            "warning: the tokenizer has {} tokens but the model's vocabulary has {vocab_size}; the ones beyond it ({}{}) cannot be used",
            tok.len(),
            extra.join(", "),
            if tok.len() > vocab_size + 5 { ", ..." } else { "" }
        );
    }
    Ok(tok)
}

impl Session {
    fn models(&self) -> &Models {
        self.engine.models()
    }

    /// Chat's `/draft off|on|auto|K`: switch drafting for the next replies; returns what it is now.
    fn switch_drafting(&mut self, arg: &str) -> Result<String> {
        let Some(policy) = &mut self.draft else {
            bail!("/draft needs an assistant (start the chat with --assistant DIR)");
        };
        match arg {
            "" => {}
            "off" => self.drafting = false,
            "on" => self.drafting = true,
            k => {
                let len = DraftLength::parse(k).map_err(|_| {
                    anyhow!("/draft takes off, on, auto or a number of draft tokens from 1 to {MAX_DRAFT}")
                })?;
                *policy = DraftPolicy::from(len);
                self.drafting = true;
            }
        }
        Ok(if self.drafting {
            format!("drafting on, draft tokens {}", policy.describe())
        } else {
            "drafting off".into()
        })
    }

    /// Run one request on the engine. `on_tokens` sees each committed run of ids with the text they add,
    /// and returns false to stop (the request is cancelled); `interrupted`, when set, cancels it too.
    fn generate(
        &mut self,
        prompt: Prompt,
        trace: bool,
        interrupted: Option<&AtomicBool>,
        mut on_tokens: impl FnMut(&[u32], &str) -> bool,
    ) -> Result<Outcome> {
        let req = Request {
            prompt,
            opts: self.opts.clone(),
            stop: self.stop.clone(),
            show_thinking: self.show_thinking,
            draft: if self.drafting { self.draft.clone() } else { None },
            trace,
        };
        let handle = self.engine.submit(req)?;
        loop {
            let event = match handle.recv_timeout(Duration::from_millis(50)) {
                Ok(e) => e,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if interrupted.is_some_and(|f| f.swap(false, Ordering::SeqCst)) {
                        handle.cancel();
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the engine stopped before the request ended"),
            };
            match event {
                Event::Tokens { ids, text, .. } => {
                    if !on_tokens(&ids, &text) || interrupted.is_some_and(|f| f.swap(false, Ordering::SeqCst)) {
                        handle.cancel();
                    }
                }
                Event::Done(outcome) => {
                    if let (Some(p), true) = (&outcome.draft, self.drafting) {
                        self.draft = Some(p.clone());
                    }
                    return Ok(*outcome);
                }
                Event::Error(e) => bail!(e),
            }
        }
    }
}

/// A warning when the weights decoding keeps reading cannot stay in memory next to everything else:
/// tandem still runs (the weights are memory-mapped) but reads them from disk for every token.
fn memory_warning(working_set: usize, memory: Option<u64>) -> Option<String> {
    let memory = memory?;
    let gb = |b: f64| b / 1e9;
    ((working_set as f64) > 0.85 * memory as f64).then(|| {
        format!(
            "warning: decoding reads {:.1} GB of weights but this machine has {:.1} GB of memory; they cannot \
             stay cached, so every token will wait on the disk",
            gb(working_set as f64),
            gb(memory as f64)
        )
    })
}

/// Write text to stdout now; on a terminal, control characters are neutralised.
fn print_text(text: &str, tty: bool) -> Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    if tty {
        emit(&terminal_safe(text))
    } else {
        emit(text)
    }
}

fn run_generate(args: GenerateArgs, quant: LoadQuant) -> Result<()> {
    if args.chat.is_none() {
        if args.system.is_some() {
            bail!("--system needs --chat: it is the system message of a chat turn");
        }
        if args.run.thinking {
            bail!("--thinking needs --chat: it is an option of the chat template");
        }
    }
    let explicit_ids = match &args.prompt_ids {
        Some(s) => Some(params::parse_ids(s)?),
        None => None,
    };
    let need = if explicit_ids.is_some() {
        TextNeed::Optional
    } else if args.chat.is_some() {
        TextNeed::Required("--chat needs")
    } else {
        TextNeed::Required("text prompts need")
    };
    let mut s = open_session(&args.run, quant, 128, need, args.top_logprobs, args.trace, args.chat.is_some())?;
    let prompt = match (&explicit_ids, &args.prompt, &args.chat) {
        (Some(ids), _, _) => Prompt::Ids(ids.clone()),
        (None, Some(text), _) => Prompt::Text(text.clone()),
        (None, None, Some(user)) => {
            let mut messages = Vec::new();
            if let Some(sys) = &args.system {
                messages.push(json!({"role": "system", "content": sys}));
            }
            messages.push(json!({"role": "user", "content": user}));
            Prompt::Chat { messages: json!(messages), thinking: args.run.thinking }
        }
        (None, None, None) => unreachable!("clap requires one of the prompt options"),
    };
    let text_mode = explicit_ids.is_none();
    let tty = std::io::stdout().is_terminal();

    let mut out_err: Option<anyhow::Error> = None;
    let mut first = true;
    let on_tokens = |ids: &[u32], text: &str| -> bool {
        let printed = if args.json {
            Ok(())
        } else if text_mode {
            print_text(text, tty)
        } else {
            let mut line = String::new();
            for t in ids {
                line += &format!("{}{t}", if first { "" } else { " " });
                first = false;
            }
            emit(&line)
        };
        match printed {
            Ok(()) => true,
            Err(e) => {
                out_err.get_or_insert(e);
                false
            }
        }
    };
    let outcome = s.generate(prompt, args.trace, None, on_tokens).context("generation failed")?;
    if let Some(e) = out_err {
        return Err(e);
    }
    let g = &outcome.generation;
    if outcome.inside_thinking && text_mode && !args.json {
        say!("note: the output ended inside a thinking block (--show-thinking prints it)");
    }
    if g.context_limited {
        say!("note: stopped at the context limit of {} tokens", s.opts.context_limit);
    }
    if args.json {
        let mut stats = serde_json::to_value(&g.stats)?;
        let mut rounds = None;
        if let Some(sp) = &outcome.spec {
            let mut sv = serde_json::to_value(sp)?;
            rounds = sv.as_object_mut().and_then(|o| o.remove("rounds"));
            if let (Some(dst), Some(src)) = (stats.as_object_mut(), sv.as_object()) {
                dst.extend(src.clone());
            }
        }
        let mut obj = json!({
            "prompt_ids": outcome.prompt_ids,
            "tokens": g.tokens,
            "text": outcome.text,
            "finish_reason": g.finish_reason,
            "stats": stats,
        });
        if args.top_logprobs.is_some() {
            obj["logprobs"] = serde_json::to_value(&g.logprobs)?;
        }
        if let Some(r) = rounds {
            obj["rounds"] = r;
        }
        emit(&format!("{obj}\n"))?;
    } else {
        emit("\n")?;
        say!("{}", summary(g, outcome.spec.as_ref()));
    }
    Ok(())
}

/// The one-line human summary on stderr.
fn summary(g: &Generation, spec: Option<&SpecStats>) -> String {
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

// ---------------------------------------------------------------------------------------------
// chat
// ---------------------------------------------------------------------------------------------

const CHAT_HELP: &str =
    "/reset starts over, /draft off|on|auto|K switches drafting, /exit (or Ctrl-D) quits, Ctrl-C stops a reply";

/// Lines from stdin, read on their own thread so that Ctrl-C at the prompt is noticed. `None` is end of
/// input.
fn stdin_lines() -> mpsc::Receiver<Option<Result<String, String>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        loop {
            let mut bytes = Vec::new();
            let item = match stdin.lock().read_until(b'\n', &mut bytes) {
                Ok(0) => None,
                // A line that is not UTF-8 is refused on its own; the lines after it still count.
                Ok(_) => Some(String::from_utf8(bytes).map_err(|e| {
                    format!(
                        "that line is not UTF-8 text (invalid byte at offset {}); it was not sent",
                        e.utf8_error().valid_up_to()
                    )
                })),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = tx.send(Some(Err(format!("cannot read the input: {e}"))));
                    None
                }
            };
            let end = item.is_none();
            if tx.send(item).is_err() || end {
                return;
            }
        }
    });
    rx
}

/// What a chat input line asks for.
#[derive(Debug, PartialEq, Eq)]
enum ChatInput<'a> {
    Nothing,
    Exit,
    Reset,
    Help,
    Draft(&'a str),
    /// A message for the model (`//` at the start sends one that begins with `/`).
    Message(&'a str),
    Bad(String),
}

/// Every line that starts with `/` is a command; a command that takes no argument refuses one.
fn parse_chat_input(input: &str) -> ChatInput<'_> {
    let trimmed = input.trim();
    if trimmed.is_empty() {
        return ChatInput::Nothing;
    }
    if let Some(rest) = input.trim_start().strip_prefix("//") {
        return ChatInput::Message(&input[input.len() - rest.len() - 1..]);
    }
    let Some(cmd) = trimmed.strip_prefix('/') else { return ChatInput::Message(input) };
    let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(n, a)| (n, a.trim()));
    let no_arg = |c: ChatInput<'static>| {
        if arg.is_empty() {
            c
        } else {
            ChatInput::Bad(format!("/{name} takes no argument ({CHAT_HELP})"))
        }
    };
    match name {
        "exit" | "quit" => no_arg(ChatInput::Exit),
        "reset" => no_arg(ChatInput::Reset),
        "help" => no_arg(ChatInput::Help),
        "draft" => ChatInput::Draft(arg),
        _ => ChatInput::Bad(format!(
            "unknown command /{name} (start a message with // to send a leading /; {CHAT_HELP})"
        )),
    }
}

fn run_chat(args: ChatArgs, quant: LoadQuant) -> Result<()> {
    let mut s = open_session(&args.run, quant, 1024, TextNeed::Required("chat needs"), None, false, true)?;
    let interactive = std::io::stdin().is_terminal();
    let tty = std::io::stdout().is_terminal();
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| anyhow!("cannot handle Ctrl-C: {e}"))?;
    }
    let system = args.system.as_ref().map(|sys| json!({"role": "system", "content": sys}));
    let mut history: Vec<serde_json::Value> = system.iter().cloned().collect();
    say!(
        "tandem chat: {}{} ({})",
        args.run.model_dir()?.display(),
        args.run.assistant_dir().map(|a| format!(" with assistant {}", a.display())).unwrap_or_default(),
        CHAT_HELP
    );
    let lines = stdin_lines();
    let prompt_mark = || -> Result<()> {
        if interactive {
            emit("> ")?;
        }
        Ok(())
    };
    prompt_mark()?;
    loop {
        let line = match lines.recv_timeout(Duration::from_millis(50)) {
            Ok(Some(Ok(line))) => line,
            Ok(Some(Err(e))) => {
                say!("error: {e}");
                prompt_mark()?;
                continue;
            }
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                if interactive {
                    emit("\n")?;
                }
                return Ok(());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if interrupted.swap(false, Ordering::SeqCst) {
                    say!("\n({CHAT_HELP})");
                    prompt_mark()?;
                }
                continue;
            }
        };
        let input = match parse_chat_input(line.trim_end_matches(['\n', '\r'])) {
            ChatInput::Message(m) => m,
            ChatInput::Exit => return Ok(()),
            other => {
                match other {
                    ChatInput::Reset => {
                        history = system.iter().cloned().collect();
                        say!("(conversation cleared)");
                    }
                    ChatInput::Draft(arg) => match s.switch_drafting(arg) {
                        Ok(state) => say!("({state})"),
                        Err(e) => say!("error: {}", one_line(&e)),
                    },
                    ChatInput::Help => say!("({CHAT_HELP})"),
                    ChatInput::Bad(e) => say!("error: {e}"),
                    ChatInput::Nothing | ChatInput::Exit | ChatInput::Message(_) => {}
                }
                prompt_mark()?;
                continue;
            }
        };
        history.push(json!({"role": "user", "content": input}));
        let chat = Prompt::Chat { messages: json!(history), thinking: args.run.thinking };
        let prompt = match s.models().prompt_ids(&chat) {
            Ok(p) if p.len() >= s.opts.context_limit => {
                history.pop();
                say!(
                    "error: the conversation with this message is {} tokens and the context limit is {}: /reset starts over (or raise --context)",
                    p.len(),
                    s.opts.context_limit
                );
                prompt_mark()?;
                continue;
            }
            Ok(p) => p,
            Err(e) => {
                history.pop();
                say!("error: {}", one_line(&e));
                prompt_mark()?;
                continue;
            }
        };
        // A Ctrl-C from here on stops this reply (one at the prompt was taken above).
        let mut out_err: Option<anyhow::Error> = None;
        let result =
            s.generate(Prompt::Ids(prompt), false, Some(&interrupted), |_, text| match print_text(text, tty) {
                Ok(()) => true,
                Err(e) => {
                    out_err.get_or_insert(e);
                    false
                }
            });
        if let Some(e) = out_err {
            return Err(e);
        }
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                history.pop();
                emit("\n")?;
                say!("error: {}", one_line(&e));
                prompt_mark()?;
                continue;
            }
        };
        emit("\n")?;
        let g = &outcome.generation;
        if outcome.inside_thinking {
            say!("(the reply ended inside its thinking; --show-thinking prints it)");
        }
        let reason = if outcome.cancelled {
            "interrupted"
        } else if outcome.stop_string {
            "stop string"
        } else if g.context_limited {
            "context limit"
        } else {
            match g.finish_reason {
                FinishReason::Stop => "end of turn",
                FinishReason::Length => "length limit",
            }
        };
        say!("{}", reply_summary(g, outcome.spec.as_ref(), reason));
        history.push(json!({"role": "assistant", "content": outcome.text.unwrap_or_default()}));
        prompt_mark()?;
    }
}

/// The speed/acceptance line after each chat reply.
fn reply_summary(g: &Generation, spec: Option<&SpecStats>, reason: &str) -> String {
    let st = &g.stats;
    let prompt = match st.cached_prompt_tokens {
        0 => format!("{} tokens at {:.0} tok/s", st.prompt_tokens, st.prefill_tokens_per_s),
        n => format!(
            "{} tokens ({n} reused from earlier turns, {} at {:.0} tok/s)",
            st.prompt_tokens,
            st.prompt_tokens - n,
            st.prefill_tokens_per_s
        ),
    };
    let mut line = format!("[{} tokens, {:.1} tok/s; prompt {prompt}", st.generated_tokens, st.decode_tokens_per_s);
    if let Some(sp) = spec {
        line += &format!(
            "; drafts accepted {}/{} ({:.0}%), {:.2} per round",
            sp.accepted_tokens,
            sp.drafted_tokens,
            100.0 * sp.acceptance_rate,
            sp.mean_accepted_per_round
        );
    }
    line + &format!("; {reason}]")
}

fn run_bench(args: BenchArgs, threads: usize, quant: LoadQuant) -> Result<()> {
    if args.pair && args.prompts.is_none() && args.model.is_some() != args.assistant.is_some() {
        bail!("--pair needs both --model and --assistant (or neither, for the shipped pair)");
    }
    if args.prompts.is_some() && !args.pair && args.concurrency.is_none() {
        bail!("--prompts goes with --pair or --concurrency");
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if let Some(levels) = &args.concurrency {
        return run_concurrency_bench(&args, levels, quant);
    }
    if args.pair {
        let dir = bench::default_model_dir();
        let opts = bench::PairOptions {
            target: args.model.unwrap_or_else(|| dir.join("target")),
            assistant: args.assistant.unwrap_or_else(|| dir.join("assistant")),
            prompts: args.prompts.unwrap_or_else(|| dir.join("heldout_prompts.json")),
            draft: args.draft_tokens.as_deref().map(DraftLength::parse).transpose()?,
            max_new_tokens: args.max_new_tokens,
            repeats: args.repeats,
            quant,
        };
        let report = bench::run_pair(&opts, |msg| say!("{msg}"))?;
        if args.json {
            emit(&format!("{}\n", serde_json::to_string(&report)?))?;
        } else {
            emit(&report.table())?;
        }
        return Ok(());
    }
    let opts = BenchOptions {
        prefill_tokens: args.prefill,
        decode_steps: args.decode,
        max_rows: args.rows,
        draft_steps: args.draft_steps,
        draft: DraftLength::parse(args.draft_tokens.as_deref().unwrap_or("4"))?,
        threads,
    };
    let (models, name) = bench_models(&args, quant, |cfg| bench::check_options(&opts, cfg))?;
    let report = bench::run(&models, &name, &opts, |msg| say!("{msg}"))?;
    if args.json {
        emit(&format!("{}\n", serde_json::to_string(&report)?))?;
    } else {
        emit(&report.table())?;
    }
    Ok(())
}

/// The model `bench` measures: `--model DIR [--assistant DIR]`, or the random preset with its random
/// drafter.
fn bench_models(
    args: &BenchArgs,
    quant: LoadQuant,
    check: impl Fn(&TextConfig) -> Result<()>,
) -> Result<(Models, String)> {
    match &args.model {
        Some(dir) => {
            let target = TargetModel::load_with(dir, quant.recipe, |l| say!("{l}"))?;
            check(&target.cfg)?;
            let assistant = match &args.assistant {
                Some(a) => Some(Assistant::load_for_with(a, &target.cfg, quant.assistant_recipe(), |l| say!("{l}"))?),
                None => None,
            };
            let name = match &args.assistant {
                Some(a) => format!("{} with {}", dir.display(), a.display()),
                None => dir.display().to_string(),
            };
            Ok((Models { target, assistant, tokenizer: None, template: None }, name))
        }
        None => {
            if args.assistant.is_some() {
                bail!("--assistant needs --model (the random model comes with its own random drafter)");
            }
            let preset = Preset::parse(&args.preset)?;
            check(&preset.config(args.layers)?)?;
            say!("building a random {preset:?} model with {} layers and its drafter in memory...", args.layers);
            bench::random_models(preset, args.layers, quant, |l| say!("{l}"))
        }
    }
}

/// `bench --concurrency`: many streams through the engine, on a checkpoint or the random preset.
fn run_concurrency_bench(args: &BenchArgs, levels: &str, quant: LoadQuant) -> Result<()> {
    let levels = levels
        .split(',')
        .map(|l| l.trim().parse::<usize>().map_err(|_| anyhow!("--concurrency: {l:?} is not a number of streams")))
        .collect::<Result<Vec<_>>>()?;
    let (models, name) = bench_models(args, quant, |_| Ok(()))?;
    let draft = match (&args.draft_tokens, args.no_draft, &models.assistant) {
        (_, true, _) | (None, false, None) => None,
        (Some(k), false, _) => Some(DraftLength::parse(k)?),
        (None, false, Some(_)) => Some(DraftLength::Auto),
    };
    let opts = bench::ConcurrencyOptions {
        levels,
        prompt_tokens: args.prefill,
        new_tokens: args.decode,
        draft,
        repeats: args.repeats,
        join_prompt: args.join_prompt,
        prompts: match &args.prompts {
            Some(p) => bench::read_prompts(p)?,
            None => Vec::new(),
        },
    };
    let report = bench::run_concurrency(&models, &name, &opts, |msg| say!("{msg}"))?;
    if args.json {
        emit(&format!("{}\n", serde_json::to_string(&report)?))?;
    } else {
        emit(&report.table())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_only_when_the_weights_cannot_stay_in_memory() {
        const GB: u64 = 1_000_000_000;
        assert!(memory_warning(5 * GB as usize, Some(24 * GB)).is_none());
        assert!(memory_warning(5 * GB as usize, None).is_none());
        let w = memory_warning(62 * GB as usize, Some(24 * GB)).unwrap();
        assert!(w.starts_with("warning: decoding reads 62.0 GB of weights but this machine has 24.0 GB"), "{w}");
    }
}
