//! Request bodies: the OpenAI chat and completion parameters checked one by one (a wrong type or an
//! out-of-range value is a 400 naming the parameter), turned into an engine [`Request`] on token ids.
//! See docs/serve.md for what each field does and which values are refused.

use serde_json::{json, Map, Value};

use crate::decode::draft_policy::{DraftLength, MAX_DRAFT};
use crate::decode::generate::GenerateOptions;
use crate::decode::sampling::SamplingParams;
use crate::engine::{Prompt, Request};
use crate::serve::error::ApiError;
use crate::serve::Loaded;
use crate::text::RenderOptions;

/// Most stop strings a request may give, and the longest one in bytes.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 1024;
/// Most `top_logprobs` alternatives.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// A checked request, ready for the engine.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prompt_ids: Vec<u32>,
    pub request: Request,
    pub stream: bool,
    pub include_usage: bool,
    /// `Some(n)`: report log-probabilities with `n` alternatives.
    pub logprobs: Option<usize>,
    /// Parse tool calls out of the reply (the request offered tools).
    pub tools: bool,
    /// The draft setting in effect, for the response's statistics (`off`, `auto` or K).
    pub draft: String,
}

/// The object's fields, read with type checks (`null` counts as absent).
struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str, default: bool) -> Result<bool, ApiError> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a boolean"))),
        }
    }

    fn float(&self, name: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !x.is_finite() || (x as f32).is_infinite() {
                    return Err(ApiError::invalid(name, format!("`{name}` is out of range")));
                }
                Ok(Some(x as f32))
            }
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a number"))),
        }
    }

    /// A non-negative integer (JSON integers only; `5.0` is not one).
    fn uint(&self, name: &str) -> Result<Option<u64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(v) => Ok(Some(v)),
                None => Err(ApiError::invalid(name, format!("`{name}` must be a non-negative integer, got {n}"))),
            },
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be an integer"))),
        }
    }
}

/// The sampling and length parameters both endpoints share.
struct Common {
    max_tokens: Option<usize>,
    /// The field that set it (`max_tokens` or `max_completion_tokens`), for errors.
    max_tokens_param: &'static str,
    sampling: SamplingParams,
    seed: Option<u64>,
    stop: Vec<String>,
    ignore_eos: bool,
    draft: Option<DraftLength>,
    draft_off: bool,
    stream: bool,
    include_usage: bool,
}

fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or a list of strings"))?,
        Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings")),
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("`stop` has {} strings; at most {MAX_STOPS}", list.len())));
    }
    if list.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "`stop` strings must not be empty"));
    }
    if list.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid("stop", format!("`stop` strings must be at most {MAX_STOP_BYTES} bytes")));
    }
    Ok(list)
}

fn parse_logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let obj = v.as_object().ok_or_else(|| {
        ApiError::invalid("logit_bias", "`logit_bias` must be an object mapping token ids (as strings) to numbers")
    })?;
    if obj.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid("logit_bias", format!("`logit_bias` has more than {MAX_LOGIT_BIAS} entries")));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (k, b) in obj {
        let id: u32 = k.trim().parse().ok().filter(|&id: &u32| (id as usize) < vocab).ok_or_else(|| {
            ApiError::invalid("logit_bias", format!("`logit_bias` key {k:?} is not a token id below {vocab}"))
        })?;
        let b = b.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid("logit_bias", format!("`logit_bias` value for {k} must be a number in [-100, 100]"))
        })?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// `draft_tokens`: `"auto"`, 0 (off) or K in 1..=MAX_DRAFT.
fn parse_draft(v: Option<&Value>) -> Result<(Option<DraftLength>, bool), ApiError> {
    let bad = || {
        ApiError::invalid(
            "draft_tokens",
            format!("`draft_tokens` must be \"auto\", 0 (off) or a number from 1 to {MAX_DRAFT}"),
        )
    };
    match v {
        None => Ok((None, false)),
        Some(Value::String(s)) if s == "auto" => Ok((Some(DraftLength::Auto), false)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => Ok((None, true)),
            Some(k) if (k as usize) <= MAX_DRAFT => Ok((Some(DraftLength::Fixed(k as usize)), false)),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// A known parameter that is fine only at its default: anything else is a 400 naming it.
fn only_default(f: &Fields, name: &str, ok: impl Fn(&Value) -> bool, what: &str) -> Result<(), ApiError> {
    match f.get(name) {
        Some(v) if !ok(v) => Err(ApiError::unsupported(name, format!("`{name}` is not supported: {what}"))),
        _ => Ok(()),
    }
}

fn parse_common(f: &Fields, loaded: &Loaded) -> Result<Common, ApiError> {
    let d = &loaded.defaults;
    let vocab = loaded.engine.models().target.cfg.vocab_size;
    let mut sampling = SamplingParams {
        temperature: f.float("temperature")?.unwrap_or(d.temperature),
        top_p: f.float("top_p")?.unwrap_or(d.top_p),
        min_p: f.float("min_p")?.unwrap_or(d.min_p),
        repeat_penalty: f.float("repetition_penalty")?.unwrap_or(d.repetition_penalty),
        presence_penalty: f.float("presence_penalty")?.unwrap_or(0.0),
        frequency_penalty: f.float("frequency_penalty")?.unwrap_or(0.0),
        logit_bias: parse_logit_bias(f.get("logit_bias"), vocab)?,
        ..SamplingParams::default()
    };
    if !(0.0..=2.0).contains(&sampling.temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be in [0, 2], got {}", sampling.temperature),
        ));
    }
    if sampling.temperature > 0.0 && sampling.temperature < crate::decode::sampling::MIN_TEMPERATURE {
        return Err(ApiError::invalid("temperature", "`temperature` must be 0 (greedy) or at least 1e-4"));
    }
    sampling.top_k = match f.get("top_k") {
        None => d.top_k,
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => 0,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64().unwrap_or(0).min(usize::MAX as u64) as usize,
        Some(_) => return Err(ApiError::invalid("top_k", "`top_k` must be a non-negative integer (0 or -1 = off)")),
    };
    if let Err(e) = sampling.validate() {
        let crate::decode::sampling::SamplingError::InvalidParameter { name, .. } = &e;
        let param = if *name == "repeat_penalty" { "repetition_penalty" } else { name };
        return Err(ApiError::invalid(param, e.to_string().replace("repeat_penalty", "repetition_penalty")));
    }
    let seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
        Some(_) => {
            return Err(ApiError::invalid("seed", "`seed` must be a non-negative integer below 2^64 (or -1: random)"))
        }
    };
    let max_tokens = match (f.uint("max_completion_tokens")?, f.uint("max_tokens")?) {
        (Some(a), _) | (None, Some(a)) => Some(a.min(usize::MAX as u64) as usize),
        (None, None) => None,
    };
    let max_tokens_param =
        if f.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    if max_tokens == Some(0) {
        let p = max_tokens_param;
        return Err(ApiError::invalid(p, format!("`{p}` must be at least 1")));
    }
    let (draft, draft_off) = parse_draft(f.get("draft_tokens"))?;
    if draft.is_some() && loaded.engine.models().assistant.is_none() {
        return Err(ApiError::invalid("draft_tokens", "this server has no assistant model to draft with"));
    }
    let stream = f.bool("stream", false)?;
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed with `stream: true`",
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid("stream_options", "`stream_options.include_usage` must be a boolean"))
                }
            }
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object")),
    };
    only_default(f, "n", |v| v.as_u64() == Some(1), "only one choice per request (`n`: 1)")?;
    Ok(Common {
        max_tokens,
        max_tokens_param,
        sampling,
        seed,
        stop: parse_stop(f.get("stop"))?,
        ignore_eos: f.bool("ignore_eos", false)?,
        draft,
        draft_off,
        stream,
        include_usage,
    })
}

/// The fields of `obj` not in `known`: ignored, and counted in the metrics.
pub fn unknown_fields(obj: &Map<String, Value>, known: &[&str]) -> usize {
    obj.keys().filter(|k| !known.contains(&k.as_str())).count()
}

const CHAT_KNOWN: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "chat_template_kwargs",
    "top_k",
    "min_p",
    "repetition_penalty",
    "draft_tokens",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
    "metadata",
    "store",
    "service_tier",
    "ignore_eos",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
];

const COMPLETION_KNOWN: &[&str] = &[
    "model",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "repetition_penalty",
    "draft_tokens",
    "n",
    "best_of",
    "echo",
    "suffix",
    "user",
    "ignore_eos",
];

/// The body as a JSON object, or a 400.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad_request("the body must be a JSON object")),
    }
}

/// Check the `model` field against the served name (absent: the served model).
pub fn check_model(obj: &Map<String, Value>, served: &str) -> Result<(), ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m == served => Ok(()),
        Some(Value::String(m)) => Err(ApiError::model_not_found(m, served)),
        Some(_) => Err(ApiError::invalid("model", "`model` must be a string")),
    }
}

/// A message's content as text: a string, or a list of text parts (joined with newlines).
fn content_text(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let ty = p.get("type").and_then(Value::as_str);
                match (ty, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(format!("{at}[{j}].text"), "a text part needs a string `text`"))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::unsupported(
                            &format!("{at}[{j}].type"),
                            format!("content parts of type {other:?} are not supported (text only)"),
                        ))
                    }
                    (None, _) => return Err(ApiError::invalid(format!("{at}[{j}]"), "a content part needs a `type`")),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::invalid(at, "`content` must be a string or a list of text parts")),
    }
}

/// OpenAI messages → the template's messages. `developer` becomes `system`; content parts are joined;
/// assistant tool calls get their `arguments` as objects; with a template that takes `tool_responses`
/// (Gemma 4's), `tool` messages are attached to the assistant message whose calls they answer.
pub fn normalize_messages(v: Option<&Value>, tool_responses: bool) -> Result<Vec<Value>, ApiError> {
    let list = match v {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be a list of message objects")),
    };
    let mut out: Vec<Value> = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let obj = m.as_object().ok_or_else(|| ApiError::invalid(&at, "each message must be an object"))?;
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(format!("{at}.role"), "each message needs a string `role`"))?;
        let content = match obj.get("content") {
            None | Some(Value::Null) => None,
            Some(c) => Some(content_text(c, &format!("{at}.content"))?),
        };
        match role {
            "system" | "developer" | "user" => {
                let c = content.ok_or_else(|| {
                    ApiError::invalid(format!("{at}.content"), format!("a {role} message needs `content`"))
                })?;
                out.push(json!({"role": if role == "user" { "user" } else { "system" }, "content": c}));
            }
            "assistant" => {
                let mut msg = Map::new();
                msg.insert("role".into(), json!("assistant"));
                msg.insert("content".into(), json!(content.unwrap_or_default()));
                for key in ["reasoning_content", "reasoning", "thinking"] {
                    if let Some(Value::String(r)) = obj.get(key) {
                        msg.insert(key.into(), json!(r));
                    }
                }
                if let Some(calls) = obj.get("tool_calls").filter(|v| !v.is_null()) {
                    msg.insert("tool_calls".into(), Value::Array(normalize_tool_calls(calls, &at)?));
                }
                out.push(Value::Object(msg));
            }
            "tool" => {
                let c = content.unwrap_or_default();
                if !tool_responses {
                    let mut msg = json!({"role": "tool", "content": c});
                    if let Some(id) = obj.get("tool_call_id") {
                        msg["tool_call_id"] = id.clone();
                    }
                    out.push(msg);
                    continue;
                }
                let Some(prev) = out.iter_mut().rev().find(|m| m["role"] == "assistant") else {
                    return Err(ApiError::invalid(
                        &at,
                        "a tool message must follow the assistant message whose call it answers",
                    ));
                };
                let id = obj.get("tool_call_id").and_then(Value::as_str);
                let name = prev["tool_calls"]
                    .as_array()
                    .and_then(|calls| calls.iter().find(|c| id.is_some() && c["id"].as_str() == id))
                    .and_then(|c| c["function"]["name"].as_str())
                    .or_else(|| obj.get("name").and_then(Value::as_str))
                    .unwrap_or("unknown")
                    .to_string();
                let response = serde_json::from_str::<Value>(&c).ok().filter(|v| v.is_object()).unwrap_or(json!(c));
                let entry = json!({"name": name, "response": response});
                match prev.get_mut("tool_responses").and_then(Value::as_array_mut) {
                    Some(a) => a.push(entry),
                    None => prev["tool_responses"] = json!([entry]),
                }
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("unknown role {other:?}: system, developer, user, assistant or tool"),
                ))
            }
        }
    }
    Ok(out)
}

fn normalize_tool_calls(calls: &Value, at: &str) -> Result<Vec<Value>, ApiError> {
    let list =
        calls.as_array().ok_or_else(|| ApiError::invalid(format!("{at}.tool_calls"), "`tool_calls` must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let p = format!("{at}.tool_calls[{j}]");
        let f = c
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&p, "a tool call needs a `function` object"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(format!("{p}.function.name"), "a tool call needs a string `name`"))?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => {
                serde_json::from_str::<Value>(s).ok().filter(Value::is_object).unwrap_or(json!(s))
            }
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => {
                return Err(ApiError::invalid(format!("{p}.function.arguments"), "`arguments` must be a JSON string"))
            }
        };
        let mut call = json!({"type": "function", "function": {"name": name, "arguments": args}});
        if let Some(id) = c.get("id") {
            call["id"] = id.clone();
        }
        out.push(call);
    }
    Ok(out)
}

/// The effective sampling, budget and draft settings of a request whose prompt is `ids`.
fn build(
    loaded: &Loaded,
    c: Common,
    ids: Vec<u32>,
    logprobs: Option<usize>,
) -> Result<(Request, Vec<u32>, String), ApiError> {
    let models = loaded.engine.models();
    let vocab = models.target.cfg.vocab_size;
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("the prompt contains token id {t}, beyond the model's vocabulary of {vocab}"),
        ));
    }
    let ctx = loaded.context;
    if ids.len() >= ctx {
        let mut e = ApiError::bad_request(format!(
            "the prompt is {} tokens but this server's context is {ctx}: nothing can be generated",
            ids.len()
        ));
        e.code = Some("context_length_exceeded");
        return Err(e);
    }
    let room = ctx - ids.len();
    let max_new = match c.max_tokens {
        Some(m) if m > room => {
            let p = c.max_tokens_param;
            let mut e = ApiError::invalid(
                p,
                format!(
                    "the prompt is {} tokens and {p} is {m}, more than the context of {ctx} allows (at most {room})",
                    ids.len()
                ),
            );
            e.code = Some("context_length_exceeded");
            return Err(e);
        }
        Some(m) => m,
        None => room,
    };
    let mut sampling = c.sampling;
    sampling.seed = c.seed.unwrap_or_else(crate::params::random_seed);
    sampling.penalty_start = ids.len();
    let draft = if c.draft_off { None } else { models.draft_policy(c.draft.or(loaded.draft)) };
    let draft = if loaded.draft_off && c.draft.is_none() { None } else { draft };
    let label = draft.as_ref().map_or("off".to_string(), |p| p.describe());
    let opts = GenerateOptions {
        max_new_tokens: max_new,
        ignore_eos: c.ignore_eos,
        sampling,
        top_logprobs: logprobs,
        context_limit: ctx,
    };
    let req =
        Request { prompt: Prompt::Ids(ids.clone()), opts, stop: c.stop, show_thinking: true, draft, trace: false };
    Ok((req, ids, label))
}

/// A `/v1/chat/completions` body → a job (the messages rendered through the chat template and tokenized).
pub fn chat_job(obj: &Map<String, Value>, loaded: &Loaded) -> Result<(Job, usize), ApiError> {
    let f = Fields { obj };
    let unknown = unknown_fields(obj, CHAT_KNOWN);
    only_default(
        &f,
        "response_format",
        |v| v.get("type").and_then(Value::as_str) == Some("text"),
        "only `{\"type\": \"text\"}`",
    )?;
    only_default(&f, "functions", |_| false, "use `tools`")?;
    only_default(&f, "function_call", |_| false, "use `tool_choice`")?;
    only_default(&f, "audio", |_| false, "text only")?;
    only_default(&f, "modalities", |v| v == &json!(["text"]), "text only")?;
    only_default(&f, "prediction", |_| false, "predicted outputs are not supported")?;
    only_default(&f, "web_search_options", |_| false, "no web search")?;
    only_default(&f, "reasoning_effort", |_| false, "use `chat_template_kwargs: {\"enable_thinking\": true}`")?;
    let c = parse_common(&f, loaded)?;
    let logprobs = if f.bool("logprobs", false)? {
        let n = f.uint("top_logprobs")?.unwrap_or(0);
        if n as usize > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        Some(n as usize)
    } else {
        if f.get("top_logprobs").is_some() {
            return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
        }
        None
    };
    let (ids, has_tools) = chat_prompt(obj, loaded)?;
    let (stream, include_usage) = (c.stream, c.include_usage);
    let (request, prompt_ids, draft) = build(loaded, c, ids, logprobs)?;
    Ok((
        Job { endpoint: Endpoint::Chat, prompt_ids, request, stream, include_usage, logprobs, tools: has_tools, draft },
        unknown,
    ))
}

/// A chat body's prompt: its messages, tools and template arguments rendered and tokenized; and whether
/// it offered tools.
pub fn chat_prompt(obj: &Map<String, Value>, loaded: &Loaded) -> Result<(Vec<u32>, bool), ApiError> {
    let f = Fields { obj };
    let models = loaded.engine.models();
    let (Some(tok), Some(template)) = (models.tokenizer.as_ref(), loaded.template.as_ref()) else {
        return Err(ApiError::bad_request(
            "this model has no tokenizer or no chat template: use /v1/completions with token ids",
        ));
    };
    let tool_choice = match f.get("tool_choice") {
        None => "auto",
        Some(Value::String(s)) if s == "auto" || s == "none" => s.as_str(),
        Some(_) => {
            return Err(ApiError::unsupported(
                "tool_choice",
                "`tool_choice` may be \"auto\" or \"none\" (forcing a call needs constrained decoding, which tandem does not do)",
            ))
        }
    };
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                if t.get("type").and_then(Value::as_str) != Some("function")
                    || t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).is_none()
                {
                    return Err(ApiError::invalid(
                        format!("tools[{i}]"),
                        "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}",
                    ));
                }
            }
            Some(Value::Array(a.clone()))
        }
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    let tools = if tool_choice == "none" { None } else { tools };
    let messages = normalize_messages(obj.get("messages"), loaded.template_tool_responses)?;
    let mut extra = Map::new();
    match f.get("chat_template_kwargs") {
        None => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                if matches!(k.as_str(), "messages" | "tools" | "add_generation_prompt") {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs",
                        format!("`chat_template_kwargs` may not set `{k}`"),
                    ));
                }
                extra.insert(k.clone(), v.clone());
            }
        }
        Some(_) => return Err(ApiError::invalid("chat_template_kwargs", "`chat_template_kwargs` must be an object")),
    }
    let has_tools = tools.is_some();
    let opts = RenderOptions { add_generation_prompt: true, tools, extra };
    let text = template
        .render(&Value::Array(messages), tok.special_tokens(), &opts)
        .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
    let ids = tok
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize the prompt: {e:#}")))?;
    Ok((ids, has_tools))
}

/// A `/v1/completions` body → a job (a text prompt with the tokenizer's BOS, or token ids as given).
pub fn completion_job(obj: &Map<String, Value>, loaded: &Loaded) -> Result<(Job, usize), ApiError> {
    let f = Fields { obj };
    let unknown = unknown_fields(obj, COMPLETION_KNOWN);
    only_default(&f, "best_of", |v| v.as_u64() == Some(1), "only `best_of: 1`")?;
    only_default(&f, "echo", |v| v == &json!(false), "the prompt is not echoed")?;
    only_default(&f, "suffix", |v| v == &json!(""), "no insertion (suffix)")?;
    let c = parse_common(&f, loaded)?;
    let logprobs = match f.uint("logprobs")? {
        Some(n) if n as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid("logprobs", format!("`logprobs` must be at most {MAX_TOP_LOGPROBS}")))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let tokenizer = loaded.engine.models().tokenizer.as_ref();
    let text_ids = |s: &str| -> Result<Vec<u32>, ApiError> {
        let tok = tokenizer
            .ok_or_else(|| ApiError::invalid("prompt", "this model has no tokenizer: give the prompt as token ids"))?;
        tok.encode(s, true).map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e:#}")))
    };
    let as_ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|x| x.as_u64().filter(|&t| t <= u32::MAX as u64).map(|t| t as u32)).collect()
    };
    let bad =
        || ApiError::invalid("prompt", "`prompt` must be a string, a list of token ids, or a list holding one of them");
    let ids = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => text_ids(s)?,
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => as_ids(a).ok_or_else(bad)?,
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => text_ids(s)?,
            Value::Array(inner) => as_ids(inner).ok_or_else(bad)?,
            _ => return Err(bad()),
        },
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            return Err(ApiError::unsupported("prompt", "one prompt per request (a batch of prompts is not supported)"))
        }
        Some(_) => return Err(bad()),
    };
    let (stream, include_usage) = (c.stream, c.include_usage);
    let (request, prompt_ids, draft) = build(loaded, c, ids, logprobs)?;
    Ok((
        Job {
            endpoint: Endpoint::Completion,
            prompt_ids,
            request,
            stream,
            include_usage,
            logprobs,
            tools: false,
            draft,
        },
        unknown,
    ))
}
