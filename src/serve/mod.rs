//! `tandem serve`: an OpenAI-compatible HTTP API on the batched engine (docs/serve.md).
//!
//! axum on a small tokio runtime takes requests; each checked request is submitted to the [`Engine`]
//! (its own scheduler thread) and read back by a blocking task that turns engine events into the
//! response (a JSON body, or SSE chunks). Dropping the response (a client that goes away) cancels the
//! request within one scheduler step.

pub mod error;
mod handlers;
pub mod metrics;
pub mod output;
pub mod request;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use axum::extract::{Request as HttpRequest, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use subtle::ConstantTimeEq;

use crate::decode::draft_policy::DraftLength;
use crate::engine::{Engine, Limits, Models};
use crate::model::assistant::Assistant;
use crate::model::TargetModel;
use crate::serve::error::ApiError;
use crate::text::{has_tokenizer, ChatTemplate, TextTokenizer};

/// `tandem serve` options.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// Model directory or GGUF file. Default: the small pair that ships in models/default, with its assistant.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Assistant (MTP drafter) directory or GGUF file.
    #[arg(long)]
    pub assistant: Option<PathBuf>,
    /// Address to bind (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (also from TANDEM_API_KEY).
    #[arg(long, allow_hyphen_values = true)]
    pub api_key: Option<String>,
    /// The model name clients use (default: the model directory's name; `tandem-default` for the shipped pair).
    #[arg(long, allow_hyphen_values = true)]
    pub served_model_name: Option<String>,
    /// Sequences decoding at once; more wait in the queue.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true)]
    pub max_concurrency: usize,
    /// Requests waiting beyond those; more are refused with 429.
    #[arg(long, default_value_t = 256, allow_hyphen_values = true)]
    pub max_queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 4 << 20, allow_hyphen_values = true)]
    pub max_body_bytes: usize,
    /// Total tokens (prompt + generated) per request; default and maximum: the model's max_position_embeddings.
    #[arg(long, allow_hyphen_values = true)]
    pub context: Option<usize>,
    /// K/V memory for all requests together, e.g. 8G or 512M (default: the memory free at start).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub kv_memory: Option<String>,
    /// Default draft tokens per round: a number, `auto`, or 0 (off); requests may set their own.
    #[arg(long, value_name = "K|auto", allow_hyphen_values = true)]
    pub draft_tokens: Option<String>,
    /// A Jinja chat template to use instead of the checkpoint's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Allow browser requests from ORIGIN (repeatable; `*` for any).
    #[arg(long, value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// Seconds that in-flight requests get to finish after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 30, allow_hyphen_values = true)]
    pub shutdown_grace: u64,
    /// While requests decode, a newcomer's prompt goes in chunks that keep a step within R times what
    /// the decoding requests' rows cost alone: larger, newcomers get their first token sooner; smaller,
    /// running streams keep their pace (docs/engine.md, "Prefill next to decoding").
    #[arg(long, value_name = "R", default_value_t = Limits::default().busy_step_ratio, allow_hyphen_values = true)]
    pub prefill_step_ratio: f64,
}

/// Everything a server needs, checked.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub model: PathBuf,
    pub assistant: Option<PathBuf>,
    pub addr: String,
    pub api_key: Option<String>,
    pub served_model_name: String,
    pub max_concurrency: usize,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    pub context: Option<usize>,
    pub kv_bytes: Option<usize>,
    /// `Limits::busy_step_ratio` (`--prefill-step-ratio`).
    pub prefill_step_ratio: f64,
    /// `None`: the drafter's default; `Some(None)`: off.
    pub draft: Option<Option<DraftLength>>,
    pub chat_template: Option<PathBuf>,
    pub cors: Vec<String>,
    pub shutdown_grace: Duration,
    /// Stop on SIGTERM / Ctrl-C (the command does; in-process tests do not).
    pub handle_signals: bool,
    /// A pause after every scheduler step (a test hook that makes requests long enough to interrupt).
    pub step_delay: Option<Duration>,
    /// A test hook: requests are answered by this script instead of the engine (after all the checks).
    pub script: Option<Script>,
    /// Quantize the models at load (`--quantize`).
    pub quant: crate::quantize::LoadQuant,
}

/// What a scripted server answers a request with: the engine events for its prompt ids (see
/// [`crate::engine::Handle::replay`]). Only tests set it: it exercises the reply paths (thinking, tool
/// calls) that the shipped pair never produces.
#[derive(Clone)]
pub struct Script(pub Arc<ScriptFn>);

/// A script: prompt ids in, engine events out.
pub type ScriptFn = dyn Fn(&[u32]) -> Vec<crate::engine::Event> + Send + Sync;

impl std::fmt::Debug for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Script(..)")
    }
}

impl ServerConfig {
    /// A server for `model` (and `assistant`) on 127.0.0.1:0 (a free port), with the command's defaults and
    /// no signal handling: what tests and the fuzz harness start from.
    pub fn new(model: PathBuf, assistant: Option<PathBuf>) -> ServerConfig {
        ServerConfig {
            model,
            assistant,
            addr: "127.0.0.1:0".into(),
            api_key: None,
            served_model_name: "tandem".into(),
            max_concurrency: 64,
            max_queue: 256,
            prefill_step_ratio: Limits::default().busy_step_ratio,
            max_body_bytes: 4 << 20,
            context: None,
            kv_bytes: None,
            draft: None,
            chat_template: None,
            cors: Vec::new(),
            shutdown_grace: Duration::from_secs(30),
            handle_signals: false,
            step_delay: None,
            script: None,
            quant: crate::quantize::LoadQuant::default(),
        }
    }
}

/// `8G`, `512M`, `64K` or a number of bytes.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => bail!("size {t:?}: use a number of bytes or K, M, G, T (e.g. 8G)"),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let x: f64 =
        num.trim().parse().map_err(|_| anyhow!("size {t:?}: use a number of bytes or K, M, G, T (e.g. 8G)"))?;
    if !(x.is_finite() && x > 0.0) || x * mult as f64 > usize::MAX as f64 {
        bail!("size {t:?}: must be positive");
    }
    Ok((x * mult as f64) as usize)
}

impl ServeArgs {
    pub fn config(&self) -> Result<ServerConfig> {
        let shipped = crate::bench::default_model_dir();
        let model = self.model.clone().unwrap_or_else(|| shipped.join("target"));
        if !crate::files::exists(&model) {
            bail!("model {} does not exist", model.display());
        }
        if !model.join("config.json").is_file() && !crate::gguf::is_gguf(&model) {
            bail!("{} is not a model directory (no config.json), nor a GGUF file", model.display());
        }
        let assistant = match (&self.assistant, &self.model) {
            (Some(a), _) => Some(a.clone()),
            (None, None) => Some(shipped.join("assistant")),
            (None, Some(_)) => None,
        };
        if self.max_concurrency == 0 {
            bail!("--max-concurrency must be at least 1");
        }
        if self.max_body_bytes == 0 {
            bail!("--max-body-bytes must be at least 1");
        }
        if !(self.prefill_step_ratio.is_finite() && self.prefill_step_ratio >= 1.0) {
            bail!("--prefill-step-ratio must be a number of at least 1, got {}", self.prefill_step_ratio);
        }
        if self.context == Some(0) {
            bail!("--context must be at least 1");
        }
        let draft = match self.draft_tokens.as_deref() {
            None => None,
            Some("0") | Some("off") => Some(None),
            Some(k) => Some(Some(DraftLength::parse(k)?)),
        };
        if assistant.is_none() && matches!(draft, Some(Some(_))) {
            bail!("--draft-tokens needs --assistant");
        }
        let served_model_name = match &self.served_model_name {
            Some(n) if n.trim().is_empty() => bail!("--served-model-name must not be empty"),
            Some(n) => n.clone(),
            None if self.model.is_none() => "tandem-default".into(),
            None => model
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "tandem".into()),
        };
        let api_key = self.api_key.clone().or_else(|| std::env::var("TANDEM_API_KEY").ok()).filter(|k| !k.is_empty());
        let step_delay = std::env::var("TANDEM_TEST_TOKEN_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        Ok(ServerConfig {
            model,
            assistant,
            addr: format!("{}:{}", self.host, self.port),
            api_key,
            served_model_name,
            max_concurrency: self.max_concurrency,
            max_queue: self.max_queue,
            prefill_step_ratio: self.prefill_step_ratio,
            max_body_bytes: self.max_body_bytes,
            context: self.context,
            kv_bytes: self.kv_memory.as_deref().map(parse_size).transpose().context("--kv-memory")?,
            draft,
            chat_template: self.chat_template.clone(),
            cors: self.cors.clone(),
            shutdown_grace: Duration::from_secs(self.shutdown_grace),
            handle_signals: true,
            step_delay,
            script: None,
            quant: crate::quantize::LoadQuant::default(),
        })
    }
}

/// Sampling defaults: OpenAI's, unless the checkpoint's generation_config.json sets them.
#[derive(Clone, Debug)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Defaults {
    fn read(dir: &std::path::Path) -> Result<Defaults> {
        let mut d = Defaults { temperature: 1.0, top_p: 1.0, top_k: 0, min_p: 0.0, repetition_penalty: 1.0 };
        let path = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(d) };
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        if v.get("do_sample") == Some(&serde_json::Value::Bool(false)) {
            d.temperature = 0.0;
        } else if let Some(t) = num("temperature") {
            d.temperature = t as f32;
        }
        if let Some(x) = num("top_p") {
            d.top_p = x as f32;
        }
        if let Some(x) = v.get("top_k").and_then(serde_json::Value::as_u64) {
            d.top_k = x as usize;
        }
        if let Some(x) = num("min_p") {
            d.min_p = x as f32;
        }
        if let Some(x) = num("repetition_penalty") {
            d.repetition_penalty = x as f32;
        }
        Ok(d)
    }
}

/// The loaded models with what requests are checked against.
pub struct Loaded {
    pub engine: Engine,
    pub template: Option<ChatTemplate>,
    /// The template renders `tool_responses` (Gemma 4's): OpenAI `tool` messages are attached to the
    /// assistant message that called them.
    pub template_tool_responses: bool,
    pub defaults: Defaults,
    pub context: usize,
    /// The server's default draft length (`None`: the drafter's own default), and whether it is off.
    pub draft: Option<DraftLength>,
    pub draft_off: bool,
}

/// Load the models and start the engine (what a server does before it turns ready).
pub fn load(cfg: &ServerConfig) -> Result<Loaded> {
    let model = TargetModel::load_with(&cfg.model, cfg.quant.recipe, |l| eprintln!("{l}"))?;
    let vocab = model.cfg.vocab_size;
    let tokenizer = if has_tokenizer(&cfg.model) {
        let tok = TextTokenizer::load(&cfg.model).context("cannot load the tokenizer")?;
        if tok.base_len() > vocab {
            bail!(
                "the tokenizer has a vocabulary of {} tokens but the model's has {vocab}: they do not belong together",
                tok.base_len()
            );
        }
        Some(tok)
    } else {
        None
    };
    let template_src = match &cfg.chat_template {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?),
        None => tokenizer.as_ref().and_then(|t| t.chat_template().map(str::to_string)),
    };
    let template = template_src.as_deref().map(ChatTemplate::new).transpose()?;
    let template_tool_responses = template_src.as_deref().is_some_and(|s| s.contains("tool_responses"));
    let assistant = match &cfg.assistant {
        Some(dir) => {
            Some(Assistant::load_for_with(dir, &model.cfg, cfg.quant.assistant_recipe(), |l| eprintln!("{l}"))?)
        }
        None => None,
    };
    let max_ctx = model.cfg.max_position_embeddings;
    let context = match cfg.context {
        Some(c) if c > max_ctx => bail!("--context {c} exceeds the model's max_position_embeddings ({max_ctx})"),
        Some(c) => c,
        None => max_ctx,
    };
    let defaults = Defaults::read(&cfg.model)?;
    let kv_bytes = cfg
        .kv_bytes
        .unwrap_or_else(|| crate::system::available_memory_bytes().map_or(Limits::default().kv_bytes, |b| b as usize));
    let models = Models { target: model, assistant, tokenizer, template: None };
    let limits = Limits {
        max_active: cfg.max_concurrency,
        kv_bytes,
        step_delay: cfg.step_delay,
        busy_step_ratio: cfg.prefill_step_ratio,
        ..Limits::default()
    };
    let engine = Engine::start_observed(models, limits, Some(Box::new(metrics::step)));
    Ok(Loaded {
        engine,
        template,
        template_tool_responses,
        defaults,
        context,
        draft: cfg.draft.flatten(),
        draft_off: cfg.draft == Some(None),
    })
}

const LOADING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;

/// What every handler shares.
pub struct AppState {
    cfg: ServerConfig,
    phase: AtomicU8,
    loaded: OnceLock<Arc<Loaded>>,
    /// Requests admitted and not yet over (running or queued in the engine).
    inflight: AtomicUsize,
    /// Set when the shutdown grace period is over: requests still running end with an error.
    abort: Arc<AtomicBool>,
    created: u64,
}

impl AppState {
    fn ready(&self) -> Result<Arc<Loaded>, ApiError> {
        match self.phase.load(Ordering::SeqCst) {
            LOADING => Err(ApiError::unavailable("the model is still loading")),
            DRAINING => Err(ApiError::unavailable("the server is shutting down")),
            _ => self.loaded.get().cloned().ok_or_else(|| ApiError::unavailable("the model is still loading")),
        }
    }
}

/// Requests on every path but /health need the key, when there is one.
async fn auth(State(st): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map_or("", |(_, k)| k.trim());
            if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
                metrics::http_error(401);
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

/// axum's own 405 has no body: give it an error object.
async fn method_errors(resp: Response) -> Response {
    if resp.status() == StatusCode::METHOD_NOT_ALLOWED {
        metrics::http_error(405);
        return ApiError::method_not_allowed().into_response();
    }
    resp
}

fn router(state: Arc<AppState>) -> Result<Router> {
    let limit = state.cfg.max_body_bytes;
    let mut app = Router::new()
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/tokenize", post(handlers::tokenize))
        .route("/detokenize", post(handlers::detokenize))
        .fallback(handlers::not_found)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::map_response(method_errors))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    if !state.cfg.cors.is_empty() {
        use tower_http::cors::{AllowOrigin, Any, CorsLayer};
        let origins = if state.cfg.cors.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            let list = state
                .cfg
                .cors
                .iter()
                .map(|o| HeaderValue::from_str(o).map_err(|_| anyhow!("--cors {o:?} is not a valid origin")))
                .collect::<Result<Vec<_>>>()?;
            AllowOrigin::list(list)
        };
        app = app.layer(CorsLayer::new().allow_origin(origins).allow_methods(Any).allow_headers(Any));
    }
    Ok(app.with_state(state))
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop as on SIGTERM (stop accepting, let requests finish within the grace period) and wait.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop.notify_one();
        self.join()
    }

    /// Wait until the server stops (a signal, or a failure to load).
    pub fn wait(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop.notify_one();
            let _ = self.join();
        }
    }
}

/// Bind, start answering (503 until the models are loaded), load, serve. Returns once bound.
pub fn start(cfg: ServerConfig) -> Result<Server> {
    let workers = 2;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(cfg.max_concurrency + cfg.max_queue + 64)
        .thread_name("tandem-http")
        .enable_all()
        .build()
        .context("cannot start the HTTP runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&cfg.addr))
        .with_context(|| format!("cannot listen on {}", cfg.addr))?;
    let addr = listener.local_addr()?;
    metrics::handle();
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState {
        cfg,
        phase: AtomicU8::new(LOADING),
        loaded: OnceLock::new(),
        inflight: AtomicUsize::new(0),
        abort: Arc::new(AtomicBool::new(false)),
        created,
    });
    let app = router(state.clone())?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new().name("tandem-serve".into()).spawn(move || {
        let result = runtime.block_on(async move {
            let failed: Arc<std::sync::Mutex<Option<anyhow::Error>>> = Arc::default();
            let drain = Arc::new(tokio::sync::Notify::new());
            // Load in the background: /health answers 503 meanwhile.
            {
                let (state, failed, drain) = (state.clone(), failed.clone(), drain.clone());
                tokio::task::spawn_blocking(move || match load(&state.cfg) {
                    Ok(l) => {
                        let _ = state.loaded.set(Arc::new(l));
                        let _ = state.phase.compare_exchange(LOADING, READY, Ordering::SeqCst, Ordering::SeqCst);
                        eprintln!("tandem serve: ready");
                    }
                    Err(e) => {
                        if let Ok(mut f) = failed.lock() {
                            *f = Some(e);
                        }
                        drain.notify_one();
                    }
                });
            }
            let signals = state.cfg.handle_signals;
            let grace = state.cfg.shutdown_grace;
            let st = state.clone();
            let shutdown = async move {
                tokio::select! {
                    _ = stop2.notified() => {}
                    _ = drain.notified() => {}
                    _ = wait_signal(signals) => {}
                }
                st.phase.store(DRAINING, Ordering::SeqCst);
                // After the grace period, requests still running are ended with an error.
                let abort = st.abort.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    abort.store(true, Ordering::SeqCst);
                });
            };
            let served = axum::serve(listener, app).with_graceful_shutdown(shutdown);
            let result = served.await.context("the HTTP server failed");
            // Give the request tasks the moment they need to end their streams after an abort.
            let mut waited = 0;
            while state.inflight.load(Ordering::SeqCst) > 0 && waited < 100 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += 1;
            }
            if let Some(e) = failed.lock().ok().and_then(|mut f| f.take()) {
                return Err(e.context("cannot load the model"));
            }
            result
        });
        // Blocking tasks still running (a load stuck on a slow disk or a pipe) are abandoned, not awaited.
        runtime.shutdown_timeout(Duration::from_secs(1));
        result
    })?;
    Ok(Server { addr, stop, thread: Some(thread) })
}

async fn wait_signal(enabled: bool) {
    if !enabled {
        return std::future::pending().await;
    }
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `tandem serve`.
pub fn run(args: ServeArgs, quant: crate::quantize::LoadQuant) -> Result<()> {
    let mut cfg = args.config()?;
    cfg.quant = quant;
    let (name, model) = (cfg.served_model_name.clone(), cfg.model.clone());
    let server = start(cfg)?;
    eprintln!("tandem serve: {} as `{name}` on http://{} (loading...)", model.display(), server.addr());
    server.wait()
}
