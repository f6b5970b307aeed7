//! The endpoints, and the per-request task that reads engine events into a response (docs/serve.md).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, oneshot};

use crate::decode::generate::{FinishReason, TokenLogprob};
use crate::engine::{Engine, Event, Handle, Outcome};
use crate::serve::error::ApiError;
use crate::serve::output::{Delta, OutputParser, ToolCall};
use crate::serve::request::{self, Endpoint, Job};
use crate::serve::{metrics, AppState, Loaded};

type St = State<Arc<AppState>>;

fn fail(e: ApiError) -> Response {
    metrics::http_error(e.status.as_u16());
    e.into_response()
}

pub async fn health(State(st): St) -> Response {
    match st.ready() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => {
            let retry = [(axum::http::header::RETRY_AFTER, e.retry_after.unwrap_or(5).to_string())];
            (StatusCode::SERVICE_UNAVAILABLE, retry, Json(json!({"status": "unavailable", "error": e.body()["error"]})))
                .into_response()
        }
    }
}

pub async fn metrics(State(_): St) -> Response {
    match metrics::handle() {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => fail(ApiError::internal("metrics are not available (another recorder is installed)")),
    }
}

pub async fn not_found(uri: Uri) -> Response {
    fail(ApiError::not_found(uri.path()))
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.cfg.served_model_name, "object": "model", "created": st.created, "owned_by": "tandem"})
}

pub async fn models(State(st): St) -> Response {
    if let Err(e) = st.ready() {
        return fail(e);
    }
    Json(json!({"object": "list", "data": [model_object(&st)]})).into_response()
}

pub async fn model(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = st.ready() {
        return fail(e);
    }
    if id != st.cfg.served_model_name {
        return fail(ApiError::model_not_found(&id, &st.cfg.served_model_name));
    }
    Json(model_object(&st)).into_response()
}

/// The body as a JSON object (413 past the limit, 400 when it is not JSON).
fn body(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(st.cfg.max_body_bytes)
        } else {
            ApiError::bad_request(format!("cannot read the body: {}", r.body_text()))
        }
    })?;
    request::parse_body(&bytes)
}

pub async fn tokenize(State(st): St, b: Result<Bytes, BytesRejection>) -> Response {
    let run = move || -> Result<Value, ApiError> {
        let loaded = st.ready()?;
        let obj = body(&st, b)?;
        request::check_model(&obj, &st.cfg.served_model_name)?;
        let tok = loaded
            .engine
            .models()
            .tokenizer
            .as_ref()
            .ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
        let special = match obj.get("add_special_tokens") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("add_special_tokens", "`add_special_tokens` must be a boolean")),
        };
        let ids = match (obj.get("prompt"), obj.get("messages")) {
            (Some(Value::String(p)), None) => {
                tok.encode(p, special).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?
            }
            (None, Some(_)) => request::chat_prompt(&obj, &loaded)?.0,
            (Some(_), None) => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
            _ => return Err(ApiError::bad_request("give either `prompt` (a string) or `messages`")),
        };
        Ok(json!({"count": ids.len(), "max_model_len": loaded.context, "tokens": ids}))
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => fail(e),
        Err(e) => fail(ApiError::internal(format!("the request task failed: {e}"))),
    }
}

pub async fn detokenize(State(st): St, b: Result<Bytes, BytesRejection>) -> Response {
    let run = move || -> Result<Value, ApiError> {
        let loaded = st.ready()?;
        let obj = body(&st, b)?;
        request::check_model(&obj, &st.cfg.served_model_name)?;
        let models = loaded.engine.models();
        let tok = models.tokenizer.as_ref().ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
        let vocab = tok.len().max(models.target.cfg.vocab_size);
        let ids: Vec<u32> = match obj.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().filter(|&t| (t as usize) < vocab).map(|t| t as u32))
                .collect::<Option<_>>()
                .ok_or_else(|| ApiError::invalid("tokens", format!("`tokens` must be token ids below {vocab}")))?,
            _ => return Err(ApiError::invalid("tokens", "`tokens` must be a list of token ids")),
        };
        let text = tok.decode(&ids, false).map_err(|e| ApiError::invalid("tokens", format!("{e:#}")))?;
        Ok(json!({"prompt": text}))
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => fail(e),
        Err(e) => fail(ApiError::internal(format!("the request task failed: {e}"))),
    }
}

pub async fn chat(State(st): St, b: Result<Bytes, BytesRejection>) -> Response {
    generate(st, b, Endpoint::Chat).await
}

pub async fn completions(State(st): St, b: Result<Bytes, BytesRejection>) -> Response {
    generate(st, b, Endpoint::Completion).await
}

/// Counts a request as in flight until dropped.
struct Inflight(Arc<AppState>);

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn endpoint_name(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "chat",
        Endpoint::Completion => "completions",
    }
}

async fn generate(st: Arc<AppState>, b: Result<Bytes, BytesRejection>, endpoint: Endpoint) -> Response {
    let t0 = Instant::now();
    // Parsing, rendering the template and tokenizing can take a while on a large body: off the async workers.
    let st2 = st.clone();
    let prepared = tokio::task::spawn_blocking(move || -> Result<(Arc<Loaded>, Job), ApiError> {
        let loaded = st2.ready()?;
        let obj = body(&st2, b)?;
        request::check_model(&obj, &st2.cfg.served_model_name)?;
        let (job, unknown) = match endpoint {
            Endpoint::Chat => request::chat_job(&obj, &loaded)?,
            Endpoint::Completion => request::completion_job(&obj, &loaded)?,
        };
        metrics::unknown_fields(unknown);
        Ok((loaded, job))
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::internal(format!("the request task failed: {e}"))));
    let (loaded, job) = match prepared {
        Ok(x) => x,
        Err(e) => {
            metrics::request_done(endpoint_name(endpoint), "rejected");
            return fail(e);
        }
    };
    // Admission: running plus queued requests are bounded.
    let cap = st.cfg.max_concurrency + st.cfg.max_queue;
    if st.inflight.fetch_add(1, Ordering::SeqCst) >= cap {
        st.inflight.fetch_sub(1, Ordering::SeqCst);
        metrics::request_done(endpoint_name(endpoint), "rejected");
        return fail(ApiError::queue_full(cap));
    }
    let guard = Inflight(st.clone());
    let stream = job.stream;
    let ctx = Ctx {
        id: format!(
            "{}-{:016x}{:08x}",
            if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" },
            crate::params::random_seed(),
            crate::params::random_seed() as u32
        ),
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: st.cfg.served_model_name.clone(),
        job,
        t0,
    };
    let abort = st.abort.clone();
    let script = st.cfg.script.clone();
    // Submitting and reading the events happen in one blocking task, so that a client that hangs up
    // while the request is being submitted still cancels it (the task then finds its sink closed).
    let (started_tx, started_rx) = oneshot::channel::<Result<(), ApiError>>();
    let run = move |sink: Sink| {
        let submitted = match script {
            Some(s) => Ok(Handle::replay((s.0)(&ctx.job.prompt_ids))),
            None => loaded.engine.submit(ctx.job.request.clone()),
        };
        match submitted {
            Ok(handle) => {
                let _ = started_tx.send(Ok(()));
                pump(&loaded.engine, handle, ctx, sink, &abort, guard);
            }
            Err(e) => {
                let msg = format!("{e:#}");
                // The engine's thread is gone: the server's fault, not the request's.
                let err = if msg.contains("the engine has stopped") {
                    metrics::request_done(endpoint_name(endpoint), "error");
                    ApiError::internal(msg)
                } else {
                    metrics::request_done(endpoint_name(endpoint), "rejected");
                    ApiError::bad_request(msg)
                };
                drop(guard);
                let _ = started_tx.send(Err(err));
            }
        }
    };
    if stream {
        let (tx, rx) = mpsc::unbounded_channel::<String>();
        tokio::task::spawn_blocking(move || run(Sink::Stream(tx)));
        match started_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return fail(e),
            Err(_) => return fail(ApiError::internal("the request task ended before it started")),
        }
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|s| (Ok::<_, Infallible>(SseEvent::default().data(s)), rx))
        });
        Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(5))).into_response()
    } else {
        let (tx, rx) = oneshot::channel();
        tokio::task::spawn_blocking(move || run(Sink::Whole(Some(tx))));
        match started_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return fail(e),
            Err(_) => return fail(ApiError::internal("the request task ended before it started")),
        }
        match rx.await {
            Ok(Ok(v)) => Json(v).into_response(),
            Ok(Err(e)) => fail(e),
            Err(_) => fail(ApiError::internal("the request ended without a response")),
        }
    }
}

/// A request's identity and settings, for its response.
struct Ctx {
    id: String,
    created: u64,
    model: String,
    job: Job,
    t0: Instant,
}

/// Where a request's output goes: SSE data lines, or one JSON body.
enum Sink {
    Stream(mpsc::UnboundedSender<String>),
    Whole(Option<oneshot::Sender<Result<Value, ApiError>>>),
}

impl Sink {
    /// End the reply with an error: an error event on a stream, the error as the whole response.
    fn fail(self, err: ApiError) {
        match self {
            Sink::Stream(tx) => {
                let _ = tx.send(err.body().to_string());
            }
            Sink::Whole(Some(tx)) => {
                let _ = tx.send(Err(err));
            }
            Sink::Whole(None) => {}
        }
    }

    /// The client went away (the response was dropped).
    fn closed(&self) -> bool {
        match self {
            Sink::Stream(tx) => tx.is_closed(),
            Sink::Whole(Some(tx)) => tx.is_closed(),
            Sink::Whole(None) => true,
        }
    }

    fn send(&self, data: String) {
        if let Sink::Stream(tx) = self {
            let _ = tx.send(data);
        }
    }
}

/// The text of one token, for log-probabilities.
fn token_text(engine: &Engine, id: u32) -> String {
    match engine.models().tokenizer.as_ref() {
        Some(t) => t.decode(&[id], false).unwrap_or_else(|_| t.id_to_token(id).unwrap_or_default()),
        None => format!("<{id}>"),
    }
}

fn chat_logprobs(engine: &Engine, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = token_text(engine, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({"content": content})
}

/// The legacy completions format; `offset` is where the first token's text starts.
fn completion_logprobs(engine: &Engine, lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut text_offset = Vec::new();
    for l in lps {
        let t = token_text(engine, l.token);
        text_offset.push(*offset);
        *offset += t.len();
        tokens.push(t);
        token_logprobs.push(l.logprob);
        let mut m = Map::new();
        for &(id, lp) in &l.top {
            m.insert(token_text(engine, id), json!(lp));
        }
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
}

fn tool_call_json(index: usize, call: &ToolCall) -> Value {
    json!({
        "index": index,
        "id": format!("call_{:016x}", crate::params::random_seed()),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

fn finish_reason(o: &Outcome, tool_calls: bool) -> &'static str {
    if tool_calls {
        "tool_calls"
    } else if o.stop_string {
        "stop"
    } else {
        match o.generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

fn usage(o: &Outcome) -> Value {
    let prompt = o.prompt_ids.len();
    let completion = o.generation.tokens.len();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": o.generation.stats.cached_prompt_tokens},
    })
}

/// The request's speculative statistics (the `tandem` extension object).
fn extension(o: &Outcome, draft: &str) -> Value {
    let mut v = json!({"draft_tokens": draft});
    if let Some(s) = &o.spec {
        v["draft_rounds"] = json!(s.draft_rounds);
        v["drafted_tokens"] = json!(s.drafted_tokens);
        v["accepted_tokens"] = json!(s.accepted_tokens);
        v["acceptance_rate"] = json!(s.acceptance_rate);
        v["accepted_per_position"] = json!(s.accepted_per_position);
    }
    v["decode_tokens_per_s"] = json!(o.generation.stats.decode_tokens_per_s);
    v
}

/// Read a request's events until it ends, writing its response; cancel it when the client goes away or
/// the shutdown grace period ends.
fn pump(engine: &Engine, handle: Handle, ctx: Ctx, sink: Sink, abort: &AtomicBool, inflight: Inflight) {
    let ep = endpoint_name(ctx.job.endpoint);
    let chat = ctx.job.endpoint == Endpoint::Chat;
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let usage_null = ctx.job.include_usage;
    let chunk = |choice: Value| -> String {
        let mut c =
            json!({"id": ctx.id, "object": object, "created": ctx.created, "model": ctx.model, "choices": [choice]});
        if usage_null {
            c["usage"] = Value::Null;
        }
        c.to_string()
    };
    let mut parser = OutputParser::new(ctx.job.tools);
    let mut all = Delta::default();
    let mut all_text = String::new();
    let mut all_lps: Vec<TokenLogprob> = Vec::new();
    let mut offset = 0usize;
    let mut first_at: Option<Instant> = None;
    let mut last_at = ctx.t0;
    let mut cancelled_by: Option<&'static str> = None;
    let mut tool_index = 0usize;
    if chat {
        sink.send(chunk(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
        ));
    }
    // One streamed piece of output: text (split for chat) and its log-probabilities.
    let emit = |d: Delta,
                text: &str,
                lps: &[TokenLogprob],
                offset: &mut usize,
                all: &mut Delta,
                tool_index: &mut usize| {
        if let Sink::Stream(_) = sink {
            if chat {
                let lp = if ctx.job.logprobs.is_some() && !lps.is_empty() {
                    chat_logprobs(engine, lps)
                } else {
                    Value::Null
                };
                let mut lp_sent = false;
                if !d.reasoning.is_empty() {
                    sink.send(chunk(json!({"index": 0, "delta": {"reasoning_content": d.reasoning}, "logprobs": lp, "finish_reason": null})));
                    lp_sent = true;
                }
                if !d.content.is_empty() {
                    let lp = if lp_sent { Value::Null } else { lp.clone() };
                    sink.send(chunk(
                        json!({"index": 0, "delta": {"content": d.content}, "logprobs": lp, "finish_reason": null}),
                    ));
                    lp_sent = true;
                }
                for call in &d.tool_calls {
                    sink.send(chunk(json!({"index": 0, "delta": {"tool_calls": [tool_call_json(*tool_index, call)]}, "logprobs": null, "finish_reason": null})));
                    *tool_index += 1;
                }
                if !lp_sent && !lp.is_null() {
                    sink.send(chunk(json!({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": null})));
                }
            } else if !text.is_empty() || (ctx.job.logprobs.is_some() && !lps.is_empty()) {
                let lp =
                    if ctx.job.logprobs.is_some() { completion_logprobs(engine, lps, offset) } else { Value::Null };
                sink.send(chunk(json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null})));
            }
        }
        all.reasoning.push_str(&d.reasoning);
        all.content.push_str(&d.content);
        all.tool_calls.extend(d.tool_calls);
    };
    let outcome: Result<Outcome, String> = loop {
        let event = match handle.recv_timeout(Duration::from_millis(50)) {
            Ok(e) => e,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if cancelled_by.is_none() {
                    if sink.closed() {
                        cancelled_by = Some("client");
                        handle.cancel();
                    } else if abort.load(Ordering::SeqCst) {
                        cancelled_by = Some("shutdown");
                        handle.cancel();
                    }
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break Err("the engine stopped".into()),
        };
        match event {
            Event::Tokens { ids, text, logprobs } => {
                let now = Instant::now();
                if !ids.is_empty() {
                    match first_at {
                        None => {
                            first_at = Some(now);
                            metrics::time_to_first_token((now - ctx.t0).as_secs_f64());
                        }
                        Some(_) => metrics::inter_token((now - last_at).as_secs_f64()),
                    }
                    last_at = now;
                }
                all_text.push_str(&text);
                let d = if chat { parser.push(&text) } else { Delta::default() };
                emit(d, &text, &logprobs, &mut offset, &mut all, &mut tool_index);
                if ctx.job.logprobs.is_some() {
                    all_lps.extend(logprobs);
                }
                if cancelled_by.is_none() && sink.closed() {
                    cancelled_by = Some("client");
                    handle.cancel();
                }
                if cancelled_by.is_none() && abort.load(Ordering::SeqCst) {
                    cancelled_by = Some("shutdown");
                    handle.cancel();
                }
            }
            Event::Done(o) => break Ok(*o),
            Event::Error(e) => break Err(e),
        }
    };
    // The engine is done with the request: its slot is free before the client hears the end, so a client
    // that sends its next request at once is not refused for its own previous one.
    drop(inflight);
    let end = Instant::now();
    metrics::request_seconds((end - ctx.t0).as_secs_f64());
    let o = match outcome {
        Ok(o) => o,
        Err(e) => {
            metrics::request_done(ep, "error");
            sink.fail(ApiError::internal(format!("generation failed: {e}")));
            return;
        }
    };
    metrics::tokens(o.prompt_ids.len(), o.generation.stats.cached_prompt_tokens, o.generation.tokens.len());
    if let Some(s) = &o.spec {
        metrics::spec(s);
    }
    match cancelled_by {
        Some("client") => {
            metrics::request_done(ep, "cancelled");
            return;
        }
        Some(_) => {
            metrics::request_done(ep, "error");
            sink.fail(ApiError::unavailable("the server shut down before the request finished"));
            return;
        }
        None => {}
    }
    if chat {
        let d = parser.finish();
        emit(d, "", &[], &mut offset, &mut all, &mut tool_index);
    }
    let has_tools = !all.tool_calls.is_empty();
    let reason = finish_reason(&o, has_tools);
    metrics::request_done(ep, reason);
    let ext = extension(&o, &ctx.job.draft);
    match sink {
        Sink::Stream(tx) => {
            let last = if chat {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason})
            } else {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason})
            };
            let mut c: Value = serde_json::from_str(&chunk(last)).unwrap_or(Value::Null);
            c["tandem"] = ext;
            let _ = tx.send(c.to_string());
            if ctx.job.include_usage {
                let u = json!({"id": ctx.id, "object": object, "created": ctx.created, "model": ctx.model, "choices": [], "usage": usage(&o)});
                let _ = tx.send(u.to_string());
            }
            let _ = tx.send("[DONE]".into());
        }
        Sink::Whole(Some(tx)) => {
            let body = if chat {
                let mut message = json!({"role": "assistant", "content": if all.content.is_empty() && has_tools { Value::Null } else { json!(all.content) }});
                if !all.reasoning.is_empty() {
                    message["reasoning_content"] = json!(all.reasoning);
                }
                if has_tools {
                    message["tool_calls"] = Value::Array(
                        all.tool_calls
                            .iter()
                            .enumerate()
                            .map(|(i, c)| {
                                let mut v = tool_call_json(i, c);
                                v.as_object_mut().map(|m| m.remove("index"));
                                v
                            })
                            .collect(),
                    );
                }
                let lp = if ctx.job.logprobs.is_some() { chat_logprobs(engine, &all_lps) } else { Value::Null };
                json!({
                    "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
                    "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": reason}],
                    "usage": usage(&o), "tandem": ext,
                })
            } else {
                let mut off = 0;
                let lp = if ctx.job.logprobs.is_some() {
                    completion_logprobs(engine, &all_lps, &mut off)
                } else {
                    Value::Null
                };
                json!({
                    "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                    "choices": [{"index": 0, "text": all_text, "logprobs": lp, "finish_reason": reason}],
                    "usage": usage(&o), "tandem": ext,
                })
            };
            let _ = tx.send(Ok(body));
        }
        Sink::Whole(None) => {}
    }
}
