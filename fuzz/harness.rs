//! What each fuzz target does with its input, shared by the cargo-fuzz targets (`fuzz_targets/*.rs`) and
//! by `tests/fuzz_regressions.rs`, which replays the committed corpus and every crash reproducer on
//! stable Rust. Every function takes arbitrary bytes and must return without panicking, aborting,
//! hanging or exhausting memory: errors are the expected outcome for almost all inputs.
//!
//! Multi-file inputs are split into chunks, each a 4-byte little-endian length followed by that many
//! bytes (the last chunk takes whatever remains when the length overshoots); see [`chunks`].

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use serde_json::{json, Value};
use tandem::text::{ChatTemplate, Decode, RenderOptions, TextTokenizer};

/// What a fuzz target runs on one input.
pub type Target = fn(&[u8]);

/// The fuzz targets by name, as `fuzz/fuzz_targets/<name>.rs` and `fuzz/seeds/<name>/` call them.
pub const TARGETS: &[(&str, Target)] = &[
    ("config", config),
    ("weights", weights),
    ("template", template),
    ("tokenizer", tokenizer),
    ("messages", messages),
    ("params", params),
    ("requests", requests),
];

/// Fuel for hostile templates: a twentieth of the default, so one input costs milliseconds, not seconds.
pub const TEMPLATE_FUEL: u64 = 200_000;

/// Splits `data` into at most `max` length-prefixed chunks.
pub fn chunks(data: &[u8], max: usize) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() && out.len() < max {
        if rest.len() < 4 {
            out.push(rest);
            break;
        }
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let body = &rest[4..];
        let n = n.min(body.len());
        out.push(&body[..n]);
        rest = &body[n..];
    }
    out
}

/// The inverse of [`chunks`] (for writing seeds).
pub fn join_chunks(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// The repository root (the directory with `models/default`), from either crate.
pub fn repo_root() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    while !dir.join("models/default").is_dir() {
        assert!(dir.pop(), "no models/default above {}", env!("CARGO_MANIFEST_DIR"));
    }
    dir
}

/// A fresh directory under /dev/shm (else the temp dir), removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> ScratchDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = base.join(format!("tandem-fuzz-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        ScratchDir(dir)
    }

    fn write(&self, name: &str, data: &[u8]) {
        std::fs::write(self.0.join(name), data).expect("scratch file");
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// (a) `config.json` of a target and of an assistant (two chunks): both parsed, then checked as a pair,
/// with a `generation_config.json` (third chunk) applied to the target.
pub fn config(data: &[u8]) {
    let parts = chunks(data, 3);
    let json = |i: usize| parts.get(i).and_then(|p| serde_json::from_slice::<Value>(p).ok());
    let target = json(0).map(|j| tandem::config::parse_model_config(&j));
    let draft = json(1).map(|j| tandem::config::parse_assistant_config(&j));
    if let Some(Ok(mut target)) = target {
        if let Some(gen) = json(2) {
            let _ = tandem::config::apply_generation_config(&mut target.text, &gen);
        }
        let _ = target.text.num_layers();
        if let Some(Ok(draft)) = &draft {
            let _ = tandem::config::validate_pair(&target.text, draft);
        }
    }
}

/// (b) A checkpoint directory: chunk 0 is `model.safetensors.index.json` (absent when empty), chunk 1
/// `model.safetensors`, chunks 2 and 3 `model-00002.safetensors` and `model-00003.safetensors`.
pub fn weights(data: &[u8]) {
    let parts = chunks(data, 4);
    let dir = ScratchDir::new();
    for (i, part) in parts.iter().enumerate() {
        match i {
            0 if part.is_empty() => {}
            0 => dir.write("model.safetensors.index.json", part),
            1 => dir.write("model.safetensors", part),
            i => dir.write(&format!("model-{i:05}.safetensors"), part),
        }
    }
    let Ok(store) = tandem::weights::WeightStore::open(&dir.0) else { return };
    let _ = store.prefix();
    let _ = store.count_layers(&format!("{}layers.", store.prefix()));
    if let Some(t) = store.get("embed_tokens.weight").cloned() {
        if let Ok(t) = store.require("embed_tokens.weight", &t.shape) {
            let m = t.mat();
            let _ = (m.rows(), m.cols());
            if t.shape.iter().product::<usize>() <= 1 << 16 {
                let _ = t.to_f32();
            }
        }
    }
    for name in ["masked_embedding.centroids.weight", "masked_embedding.token_ordering"] {
        if let Some(t) = store.get_full(name) {
            let _ = t.to_i64();
            let _ = t.float_dtype();
        }
    }
}

/// Conversation every template is rendered with: system, user, assistant with a tool call, tool result.
fn fixed_messages() -> (Value, Value) {
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    ]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    (messages, tools)
}

fn render_fixed(template: &ChatTemplate, specials: &[(String, String)]) -> Option<String> {
    let (messages, tools) = fixed_messages();
    let mut opts = RenderOptions { add_generation_prompt: true, tools: Some(tools), ..Default::default() };
    opts.extra.insert("enable_thinking".into(), Value::Bool(true));
    template.render(&messages, specials, &opts).ok()
}

/// (c) A hostile chat template: compiled and rendered with a fixed conversation, tools and special tokens.
pub fn template(data: &[u8]) {
    let Ok(source) = std::str::from_utf8(data) else { return };
    let Ok(t) = ChatTemplate::with_fuel(source, TEMPLATE_FUEL) else { return };
    let specials = [("bos_token".to_string(), "<bos>".to_string()), ("eos_token".to_string(), "<eos>".to_string())];
    let _ = render_fixed(&t, &specials);
}

/// (c) A tokenizer directory: chunk 0 is `tokenizer_config.json`, chunk 1 `tokenizer.json`, chunk 2
/// `chat_template.jinja` (absent when missing). Loaded, then text is encoded and decoded and the chat
/// template, if any, rendered.
pub fn tokenizer(data: &[u8]) {
    let parts = chunks(data, 3);
    let dir = ScratchDir::new();
    let names = ["tokenizer_config.json", "tokenizer.json", "chat_template.jinja"];
    for (part, name) in parts.iter().zip(names) {
        dir.write(name, part);
    }
    let Ok(tok) = TextTokenizer::load(&dir.0) else { return };
    for (text, special) in [("Hello <bos> wörld\n\t  x", true), ("<|turn>user\nhi<turn|>", false)] {
        if let Ok(ids) = tok.encode(text, special) {
            let _ = tok.decode(&ids, false);
            let _ = tok.decode(&ids, true);
            for &id in ids.iter().take(8) {
                let _ = tok.id_to_token(id);
                let _ = tok.is_byte_token(id);
            }
        }
    }
    let _ = tok.decode(&[0, 1, 2, u32::MAX], false);
    if let Some(src) = tok.chat_template() {
        if let Ok(t) = ChatTemplate::with_fuel(src, TEMPLATE_FUEL) {
            if let Some(text) = render_fixed(&t, tok.special_tokens()) {
                let _ = tok.encode(&text, false);
            }
        }
    }
}

/// The shipped pair's tokenizer and template, and the text fixture's (a richer template: tools, tool
/// calls, `tojson`, `dictsort`), loaded once.
fn shipped() -> &'static [(TextTokenizer, ChatTemplate)] {
    static SHIPPED: OnceLock<Vec<(TextTokenizer, ChatTemplate)>> = OnceLock::new();
    SHIPPED.get_or_init(|| {
        ["models/default/target", "tests/fixtures/text-tiny"]
            .iter()
            .map(|d| {
                let tok = TextTokenizer::load(&repo_root().join(d)).expect("shipped tokenizer");
                let t = ChatTemplate::new(tok.chat_template().expect("shipped template"))
                    .expect("shipped template compiles");
                (tok, t)
            })
            .collect()
    })
}

/// (d) Chat messages as JSON (a list, or `{"messages": [...], "tools": [...], "add_generation_prompt":
/// bool, ...further template variables}`), rendered with the shipped templates and tokenized.
pub fn messages(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<Value>(data) else { return };
    let mut opts = RenderOptions::default();
    let messages = match json {
        Value::Object(mut o) => {
            let messages = o.remove("messages").unwrap_or(Value::Null);
            opts.tools = o.remove("tools");
            opts.add_generation_prompt = o.remove("add_generation_prompt").is_some_and(|v| v == Value::Bool(true));
            opts.extra = o;
            messages
        }
        other => other,
    };
    for (tok, template) in shipped() {
        if let Ok(text) = template.render(&messages, tok.special_tokens(), &opts) {
            if let Ok(ids) = tok.encode(&text, false) {
                let _ = tok.decode(&ids, false);
            }
        }
    }
}

/// (e) Command-line values, one per line: prompt ids, seed, top-k, temperature, top-p, min-p, repeat
/// penalty, draft tokens, stop string. Parsed by the library's functions; parameters that validate are
/// used to sample from a fixed set of logits.
pub fn params(data: &[u8]) {
    use tandem::decode::sampling::{Sampler, SamplingParams};
    use tandem::params::*;
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.split('\n');
    let mut next = || lines.next().unwrap_or("");
    let ids = parse_ids(next());
    let seed = parse_seed(next());
    let top_k = parse_top_k(next());
    let floats: Vec<_> =
        ["temperature", "top-p", "min-p", "repeat-penalty"].iter().map(|n| parse_float(n, next())).collect();
    if let Ok(d) = tandem::decode::draft_policy::DraftLength::parse(next()) {
        let policy = tandem::decode::draft_policy::DraftPolicy::from(d);
        let _ = (policy.describe(), policy.max_draft(), d.to_string());
    }
    let _ = parse_stop(next());
    let (Ok(seed), Ok(top_k)) = (seed, top_k) else { return };
    let [Ok(temperature), Ok(top_p), Ok(min_p), Ok(repeat_penalty)] = floats[..] else { return };
    let params = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        seed: seed.unwrap_or(7),
        ..SamplingParams::default()
    };
    if params.validate().is_err() {
        return;
    }
    let history = ids.unwrap_or_default();
    let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 32.0) / 4.0).collect();
    let mut sampler = Sampler::new(params);
    let mut l = logits.clone();
    sampler.process(&mut l, &history);
    let probs = sampler.probs(&logits, &history);
    assert!(probs.iter().all(|p| p.is_finite()), "probabilities must be finite: {probs:?}");
    let id = sampler.sample(&logits, &history);
    assert!((id as usize) < logits.len(), "sampled id {id} outside the vocabulary");
}

/// (f) A request body for `tandem serve`: byte 0 picks the endpoint and model (bit 0: chat or completions;
/// bit 1: the shipped pair, or the text fixture whose template renders tools), the rest is the JSON body,
/// checked and turned into an engine request as the server does (nothing is generated). The same bytes,
/// as model output text, go through the reply splitter (thinking, tool calls).
pub fn requests(data: &[u8]) {
    use tandem::serve::{output::OutputParser, request, Loaded, ServerConfig};
    static LOADED: OnceLock<Vec<Loaded>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let root = repo_root();
        let shipped = root.join("models/default");
        let tiny = root.join("tests/fixtures/text-tiny");
        let mut cfgs = vec![
            ServerConfig::new(shipped.join("target"), Some(shipped.join("assistant"))),
            ServerConfig::new(tiny, None),
        ];
        for c in &mut cfgs {
            c.kv_bytes = Some(64 << 20);
        }
        cfgs.iter().map(|c| tandem::serve::load(c).expect("the fuzz models load")).collect()
    });
    let Some((&select, body)) = data.split_first() else { return };
    let l = &loaded[usize::from(select & 2 != 0)];
    if let Ok(obj) = request::parse_body(body) {
        let _ = request::check_model(&obj, "tandem");
        let _ = if select & 1 == 0 { request::chat_job(&obj, l) } else { request::completion_job(&obj, l) };
    }
    if let Ok(text) = std::str::from_utf8(body) {
        let _ = OutputParser::split(text, select & 4 == 0);
    }
}
