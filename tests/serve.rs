//! `tandem serve` end to end: the server on 127.0.0.1:0 with the shipped pair (and the tiny text fixture),
//! spoken to over raw HTTP/1.1 so that the tests see the bytes the server sends (docs/serve.md).

mod common;
#[path = "serve_support/http.rs"]
mod http;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use http::{get, post, request, send_request};
use tandem::decode::generate::{FinishReason, Generation};
use tandem::engine::{Event, Outcome};
use tandem::serve::{start, Script, Server, ServerConfig};

fn config() -> ServerConfig {
    let dir = common::shipped_dir();
    ServerConfig {
        model: dir.join("target"),
        assistant: Some(dir.join("assistant")),
        addr: "127.0.0.1:0".into(),
        api_key: None,
        served_model_name: "tandem-default".into(),
        max_concurrency: 8,
        max_queue: 16,
        max_body_bytes: 1 << 20,
        context: None,
        kv_bytes: Some(1 << 30),
        prefill_step_ratio: 1.5,
        draft: None,
        chat_template: None,
        cors: Vec::new(),
        shutdown_grace: Duration::from_secs(5),
        handle_signals: false,
        step_delay: None,
        script: None,
        quant: Default::default(),
    }
}

/// Start a server and wait until it has loaded.
fn serve(cfg: ServerConfig) -> Server {
    let s = start(cfg).expect("start");
    let t = Instant::now();
    while get(s.addr(), "/health").status != 200 {
        assert!(t.elapsed() < Duration::from_secs(60), "the server did not become ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    s
}

/// One server with the default settings for the tests that do not need their own.
fn shared() -> SocketAddr {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| serve(config())).addr()
}

fn chat(addr: SocketAddr, body: Value) -> Value {
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

/// The status and the OpenAI error object of a failed request.
fn error_of(r: &http::Resp) -> (u16, Value) {
    let v = r.json();
    let e = v["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty() && !m.contains('\n')), "{v}");
    assert!(e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{v}");
    (r.status, e)
}

fn tandem(args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

const SYSTEM: &str = "You are a helpful assistant.";
const USER: &str = "Write a function that adds two numbers.";

#[test]
fn greedy_chat_equals_tandem_generate_with_and_without_drafting() {
    let addr = shared();
    let g = tandem(&["generate", "--system", SYSTEM, "--chat", USER, "--max-new-tokens", "24", "--json"]);
    let expected = g["text"].as_str().unwrap();
    let n = g["tokens"].as_array().unwrap().len();
    let messages = json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]);
    for draft in [json!(0), json!(1), json!(4), json!("auto"), Value::Null] {
        let v = chat(addr, json!({"messages": messages, "max_tokens": 24, "temperature": 0, "draft_tokens": draft}));
        assert_eq!(content(&v), expected, "draft_tokens {draft}");
        assert_eq!(v["usage"]["completion_tokens"], n);
        assert_eq!(v["usage"]["prompt_tokens"], g["prompt_ids"].as_array().unwrap().len());
        assert_eq!(v["usage"]["total_tokens"], v["usage"]["prompt_tokens"].as_u64().unwrap() + n as u64);
        assert!(v["tandem"]["draft_tokens"].is_string());
    }
    // Developer is system; content parts are text.
    let parts = json!([{"role": "developer", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": USER}]}]);
    let v = chat(addr, json!({"messages": parts, "max_tokens": 24, "temperature": 0}));
    assert_eq!(content(&v), expected);
}

#[test]
fn completions_equal_tandem_generate_for_text_and_ids() {
    let addr = shared();
    let g = tandem(&["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--json"]);
    let ids = g["prompt_ids"].clone();
    for prompt in [json!("def fibonacci(n):"), ids.clone(), json!([ids]), json!(["def fibonacci(n):"])] {
        let r = post(addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0.0}));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], g["text"]);
        assert_eq!(v["usage"]["completion_tokens"], g["tokens"].as_array().unwrap().len());
    }
}

#[test]
fn streaming_follows_openai_framing_and_equals_the_whole_reply() {
    let addr = shared();
    let body =
        json!({"messages": [{"role": "user", "content": USER}], "max_tokens": 30, "temperature": 0, "draft_tokens": 4});
    let whole = chat(addr, body.clone());
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = post(addr, "/v1/chat/completions", &sb);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "tandem-default");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    // The same counts (cached_tokens depends on what earlier requests left for prefix reuse).
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage_chunk["usage"][k], whole["usage"][k]);
    }
    assert!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let (last, middle) = rest.split_last().unwrap();
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(last["choices"][0]["finish_reason"], whole["choices"][0]["finish_reason"]);
    let mut text = String::new();
    for c in middle {
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["usage"].is_null());
        text += c["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        assert!(c["choices"][0]["delta"].get("reasoning_content").is_none());
    }
    assert_eq!(text, content(&whole));
    // Without include_usage: no usage chunk, no usage field.
    sb.as_object_mut().unwrap().remove("stream_options");
    let events = post(addr, "/v1/chat/completions", &sb).events();
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], whole["choices"][0]["finish_reason"]);
    assert!(last.get("usage").is_none());
    // Completions stream the same text as they return whole.
    let cb = json!({"prompt": "import numpy as np\n", "max_tokens": 20, "temperature": 0});
    let whole = post(addr, "/v1/completions", &cb).json();
    let mut cs = cb.clone();
    cs["stream"] = json!(true);
    let events = post(addr, "/v1/completions", &cs).events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
}

#[test]
fn stop_strings_lengths_and_seeds() {
    let addr = shared();
    let base = json!({"messages": [{"role": "user", "content": USER}], "max_tokens": 24, "temperature": 0});
    let full = content(&chat(addr, base.clone()));
    assert!(full.len() > 20, "{full:?}");
    // A stop string taken from the middle of the greedy reply cuts it there.
    let cut = full.char_indices().map(|(i, _)| i).find(|&i| i >= 12).unwrap();
    let stop: String = full[cut..].chars().take(3).collect();
    let at = full.find(&stop).unwrap();
    let mut b = base.clone();
    b["stop"] = json!(["\u{0}never", stop]);
    let v = chat(addr, b);
    assert_eq!(content(&v), &full[..at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // max_tokens ends with `length` and exactly that many tokens.
    let mut b = base.clone();
    b["max_completion_tokens"] = json!(5);
    let v = chat(addr, b);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // A seed makes sampling repeatable; drafting does not change greedy output under penalties and bias.
    let sampled = json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
        "temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.02, "seed": 1234});
    let a = content(&chat(addr, sampled.clone()));
    assert_eq!(a, content(&chat(addr, sampled.clone())));
    let mut other = sampled.clone();
    other["seed"] = json!(99);
    let outs: Vec<String> = (0..3)
        .map(|i| {
            other["seed"] = json!(99 + i);
            content(&chat(addr, other.clone()))
        })
        .collect();
    assert!(outs.iter().any(|o| *o != a), "three other seeds all gave {a:?}");
    let penalised = |draft: Value| {
        content(&chat(
            addr,
            json!({"messages": [{"role": "user", "content": USER}], "max_tokens": 24, "temperature": 0,
                "presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.1,
                "logit_bias": {"100": -5, "300": 2.5}, "draft_tokens": draft}),
        ))
    };
    let plain = penalised(json!(0));
    assert_ne!(plain, full, "the penalties changed nothing");
    assert_eq!(penalised(json!(4)), plain);
    assert_eq!(penalised(json!("auto")), plain);
}

#[test]
fn logprobs_tokenize_and_detokenize() {
    let addr = shared();
    let v = chat(
        addr,
        json!({"messages": [{"role": "user", "content": USER}], "max_tokens": 6, "temperature": 0,
            "logprobs": true, "top_logprobs": 3}),
    );
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 6);
    for e in lp {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"]);
        assert_eq!(e["bytes"].as_array().unwrap().len(), e["token"].as_str().unwrap().len());
    }
    // Streamed, the log-probabilities arrive with their tokens: as many, the same values.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": USER}], "max_tokens": 6, "temperature": 0,
            "logprobs": true, "top_logprobs": 3, "stream": true, "draft_tokens": 4}),
    );
    let events = r.events();
    let streamed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .flat_map(|e| {
            let c: Value = serde_json::from_str(e).unwrap();
            c["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default()
        })
        .collect();
    assert_eq!(&streamed, lp);
    let r =
        post(addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 2}));
    let l = &r.json()["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2);
    let t = post(addr, "/tokenize", &json!({"prompt": "Hello world"})).json();
    let ids = t["tokens"].clone();
    assert_eq!(t["count"], ids.as_array().unwrap().len());
    let d = post(addr, "/detokenize", &json!({"tokens": ids})).json();
    assert!(d["prompt"].as_str().unwrap().ends_with("Hello world"));
    let m = post(addr, "/tokenize", &json!({"messages": [{"role": "user", "content": USER}]})).json();
    let g = tandem(&["generate", "--chat", USER, "--max-new-tokens", "1", "--json"]);
    assert_eq!(m["tokens"], g["prompt_ids"]);
}

#[test]
fn models_health_metrics_and_routes() {
    let addr = shared();
    assert_eq!(get(addr, "/health").json()["status"], "ok");
    let m = get(addr, "/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "tandem-default");
    assert_eq!(get(addr, "/v1/models/tandem-default").json()["id"], "tandem-default");
    let (s, e) = error_of(&get(addr, "/v1/models/gpt-4"));
    assert_eq!((s, e["code"].as_str()), (404, Some("model_not_found")));
    let (s, _) = error_of(&get(addr, "/v1/nothing"));
    assert_eq!(s, 404);
    let (s, _) = error_of(&get(addr, "/v1/chat/completions"));
    assert_eq!(s, 405);
    chat(
        addr,
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "draft_tokens": 4}),
    );
    let text = get(addr, "/metrics").text();
    for name in [
        "tandem_requests_total{",
        "tandem_prompt_tokens_total",
        "tandem_generation_tokens_total",
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_e2e_request_latency_seconds_bucket",
        "tandem_num_requests_running",
        "tandem_num_requests_waiting",
        "tandem_kv_cache_bytes",
        "tandem_step_rows_bucket",
        "tandem_spec_decode_num_draft_tokens_total",
        "tandem_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
}

#[test]
fn bad_requests_are_400_with_the_parameter_named() {
    let addr = shared();
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let with = |k: &str, v: Value| {
        let mut b = json!({"messages": msgs, "max_tokens": 4});
        b[k] = v;
        b
    };
    let cases: Vec<(Value, Option<&str>)> = vec![
        (with("temperature", json!("hot")), Some("temperature")),
        (with("temperature", json!(-1)), Some("temperature")),
        (with("top_p", json!(1.5)), Some("top_p")),
        (with("top_k", json!(-3)), Some("top_k")),
        (with("min_p", json!(2)), Some("min_p")),
        (with("presence_penalty", json!(3)), Some("presence_penalty")),
        (with("frequency_penalty", json!("x")), Some("frequency_penalty")),
        (with("repetition_penalty", json!(0)), Some("repetition_penalty")),
        (with("logit_bias", json!({"abc": 1})), Some("logit_bias")),
        (with("logit_bias", json!({"5": 101})), Some("logit_bias")),
        (with("logit_bias", json!({"99999999": 1})), Some("logit_bias")),
        (with("seed", json!(-5)), Some("seed")),
        (with("seed", json!(1.5)), Some("seed")),
        (with("max_tokens", json!(0)), Some("max_tokens")),
        (with("max_tokens", json!(-1)), Some("max_tokens")),
        (with("max_tokens", json!(1_000_000)), Some("max_tokens")),
        (with("max_completion_tokens", json!(1_000_000)), Some("max_completion_tokens")),
        (with("stop", json!(5)), Some("stop")),
        (with("stop", json!([""])), Some("stop")),
        (with("stream", json!("yes")), Some("stream")),
        (with("stream_options", json!({"include_usage": true})), Some("stream_options")),
        (with("logprobs", json!(1)), Some("logprobs")),
        (with("top_logprobs", json!(3)), Some("top_logprobs")),
        (with("draft_tokens", json!(99)), Some("draft_tokens")),
        (with("draft_tokens", json!("fast")), Some("draft_tokens")),
        (with("n", json!(2)), Some("n")),
        (with("response_format", json!({"type": "json_object"})), Some("response_format")),
        (with("tool_choice", json!("required")), Some("tool_choice")),
        (with("tools", json!([{"type": "function"}])), Some("tools[0]")),
        (with("chat_template_kwargs", json!(3)), Some("chat_template_kwargs")),
        (with("messages", json!([])), Some("messages")),
        (with("messages", json!("hi")), Some("messages")),
        (with("messages", json!([{"role": "wizard", "content": "x"}])), Some("messages[0].role")),
        (with("messages", json!([{"role": "user"}])), Some("messages[0].content")),
        (
            with("messages", json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
            Some("messages[0].content[0].type"),
        ),
        (with("model", json!(7)), Some("model")),
    ];
    for (body, param) in cases {
        let r = post(addr, "/v1/chat/completions", &body);
        let (s, e) = error_of(&r);
        assert_eq!(s, 400, "{body}: {}", r.text());
        assert_eq!(e["param"].as_str(), param, "{body}: {}", r.text());
    }
    // Malformed bodies.
    for raw in [&b"{not json"[..], b"[1, 2]", b"", b"\xff\xfe"] {
        let r = request(addr, "POST", "/v1/chat/completions", &[], raw);
        assert_eq!(error_of(&r).0, 400, "{}", r.text());
    }
    // A prompt longer than the context.
    let long: Vec<u32> = (0..2100).map(|i| 300 + (i % 500)).collect();
    let r = post(addr, "/v1/completions", &json!({"prompt": long, "max_tokens": 4}));
    let (s, e) = error_of(&r);
    assert_eq!((s, e["code"].as_str()), (400, Some("context_length_exceeded")));
    let r = post(addr, "/v1/completions", &json!({"prompt": [1, 2, 999999], "max_tokens": 4}));
    assert_eq!(error_of(&r).0, 400);
    let r = post(addr, "/v1/completions", &json!({"prompt": ["a", "b"], "max_tokens": 4}));
    assert_eq!(error_of(&r).1["code"], "unsupported_parameter");
    // An unknown model is 404; unknown fields are ignored.
    let r = post(addr, "/v1/chat/completions", &json!({"model": "gpt-4o", "messages": msgs}));
    assert_eq!(error_of(&r).0, 404);
    chat(addr, json!({"messages": msgs, "max_tokens": 2, "frobnicate": {"x": 1}, "user": "u1"}));
}

#[test]
fn api_key_body_limit_and_queue_limit() {
    let mut cfg = config();
    cfg.api_key = Some("s3cret".into());
    cfg.cors = vec!["http://app.example".into()];
    cfg.max_body_bytes = 2000;
    cfg.max_concurrency = 1;
    cfg.max_queue = 0;
    cfg.step_delay = Some(Duration::from_millis(25));
    let server = serve(cfg);
    let addr = server.addr();
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).to_string();
    let key = [("Authorization", "Bearer s3cret")];
    for h in [vec![], vec![("Authorization", "Bearer wrong")], vec![("Authorization", "s3cret")]] {
        let (s, e) = error_of(&request(addr, "POST", "/v1/chat/completions", &h, body.as_bytes()));
        assert_eq!((s, e["code"].as_str()), (401, Some("invalid_api_key")));
    }
    assert_eq!(error_of(&request(addr, "GET", "/v1/models", &[], b"")).0, 401);
    assert_eq!(error_of(&request(addr, "GET", "/metrics", &[], b"")).0, 401);
    assert_eq!(request(addr, "GET", "/health", &[], b"").status, 200);
    // A browser's preflight from the allowed origin is answered without the key; others get no grant.
    let preflight = |origin| {
        request(
            addr,
            "OPTIONS",
            "/v1/chat/completions",
            &[("Origin", origin), ("Access-Control-Request-Method", "POST")],
            b"",
        )
    };
    assert_eq!(preflight("http://app.example").header("access-control-allow-origin"), Some("http://app.example"));
    assert_eq!(preflight("http://evil.example").header("access-control-allow-origin"), None);
    assert_eq!(request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes()).status, 200);
    // With one slot and no queue, requests sent one after another are never refused: a request's slot is
    // free before its client hears the end.
    for _ in 0..10 {
        let r = request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes());
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The scheme is case-insensitive (RFC 9110).
    let lower = [("Authorization", "bearer s3cret")];
    assert_eq!(request(addr, "POST", "/v1/chat/completions", &lower, body.as_bytes()).status, 200);
    // Over the body limit: 413.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string();
    let (s, e) = error_of(&request(addr, "POST", "/v1/chat/completions", &key, big.as_bytes()));
    assert_eq!((s, e["code"].as_str()), (413, Some("request_too_large")));
    // One slot, no queue: a second request while one runs is 429 with Retry-After.
    let long =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "stream": true, "ignore_eos": true})
            .to_string();
    let mut held = send_request(addr, "POST", "/v1/chat/completions", &key, long.as_bytes());
    let mut first = [0u8; 64];
    held.read_exact(&mut first).unwrap();
    let r = request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes());
    let (s, e) = error_of(&r);
    assert_eq!((s, e["type"].as_str()), (429, Some("rate_limit_error")));
    assert!(r.header("retry-after").is_some());
    // Disconnecting cancels the running request: its slot and K/V are free again within moments, so
    // the next request runs (with one slot it could not start otherwise).
    drop(held);
    let t = Instant::now();
    loop {
        let r = request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes());
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429);
        assert!(t.elapsed() < Duration::from_secs(3), "the disconnected request was not cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The same for a client that waits for a whole (non-streamed) reply and hangs up.
    let whole =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": true}).to_string();
    let held = send_request(addr, "POST", "/v1/chat/completions", &key, whole.as_bytes());
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes()).status, 429);
    drop(held);
    let t = Instant::now();
    while request(addr, "POST", "/v1/chat/completions", &key, body.as_bytes()).status != 200 {
        assert!(t.elapsed() < Duration::from_secs(3), "the disconnected request was not cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let metrics = request(addr, "GET", "/metrics", &key, b"").text();
    assert!(metrics.contains("outcome=\"cancelled\""), "{metrics}");
}

#[test]
fn shutdown_lets_requests_finish_then_ends_the_rest_with_an_error_event() {
    let mut cfg = config();
    cfg.step_delay = Some(Duration::from_millis(20));
    // Long enough for the short request even on the scalar kernels with every other test running.
    cfg.shutdown_grace = Duration::from_secs(6);
    let server = serve(cfg);
    let addr = server.addr();
    let short = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": true}).to_string();
    // Drafting off: with accepted drafts a fast machine finishes 1000 tokens inside the grace period.
    let long = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000, "stream": true, "ignore_eos": true, "draft_tokens": 0}).to_string();
    let mut a = send_request(addr, "POST", "/v1/chat/completions", &[], short.as_bytes());
    let mut b = send_request(addr, "POST", "/v1/chat/completions", &[], long.as_bytes());
    let mut first = [0u8; 16];
    b.read_exact(&mut first).unwrap();
    let mut first_a = [0u8; 16];
    a.read_exact(&mut first_a).unwrap();
    let t = Instant::now();
    server.shutdown().unwrap();
    assert!(t.elapsed() < Duration::from_secs(15));
    let read = |s: &mut std::net::TcpStream, prefix: &[u8]| {
        let mut raw = prefix.to_vec();
        let _ = s.read_to_end(&mut raw);
        http::parse_response(&raw)
    };
    let ra = read(&mut a, &first_a);
    assert_eq!(ra.events().last().unwrap(), "[DONE]", "the short request finished");
    let rb = read(&mut b, &first);
    let events = rb.events();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "service_unavailable", "{events:?}");
    assert!(std::net::TcpStream::connect(addr).is_err(), "still accepting after shutdown");
}

#[test]
fn a_model_that_cannot_load_stops_the_server_with_the_reason() {
    let mut cfg = config();
    cfg.model = common::fixture_dir("text-tiny");
    // The shipped assistant does not belong to this target.
    let server = start(cfg).unwrap();
    let err = server.wait().unwrap_err();
    assert!(format!("{err:#}").contains("cannot load the model"), "{err:#}");
}

/// The real Gemma 4 template (outside the repository, as in tests/text.rs): OpenAI tool calls and `tool`
/// messages go in as the template's `tool_calls` / `tool_responses`, rendering what transformers did.
#[test]
fn openai_tool_messages_render_through_the_gemma4_template() {
    let template = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/gemma4-chat-template.jinja");
    if !template.is_file() {
        eprintln!("skipped: {} is not here", template.display());
        return;
    }
    let mut cfg = config();
    cfg.model = common::fixture_dir("text-tiny");
    cfg.assistant = None;
    cfg.chat_template = Some(template);
    let server = serve(cfg);
    let goldens: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture_dir("text-tiny").join("text_goldens.json")).unwrap(),
    )
    .unwrap();
    let case =
        |name: &str| goldens["gemma4_template"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone();
    let g = case("tool_responses");
    let args = g["messages"][1]["tool_calls"][0]["function"]["arguments"].clone();
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": args.to_string()}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": g["messages"][1]["tool_responses"][0]["response"].to_string()},
        {"role": "tool", "content": "plain string"},
    ]);
    let r = post(server.addr(), "/tokenize", &json!({"messages": messages, "tools": g["tools"]}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["tokens"], g["ids"]);
    let g = case("thinking_on");
    let r = post(
        server.addr(),
        "/tokenize",
        &json!({"messages": g["messages"], "chat_template_kwargs": {"enable_thinking": true}}),
    );
    assert_eq!(r.json()["tokens"], g["ids"]);
}

#[test]
fn a_request_larger_than_the_kv_budget_is_a_400_and_a_smaller_one_runs() {
    let mut cfg = config();
    cfg.kv_bytes = Some(512 << 10);
    let server = serve(cfg);
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let r = post(server.addr(), "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 2000}));
    let (s, e) = error_of(&r);
    assert_eq!(s, 400);
    assert!(e["message"].as_str().unwrap().contains("K/V"), "{e}");
    let r = post(server.addr(), "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// While the model loads, /health and the API answer 503; then 200. Here the chat template is read from a
/// FIFO (as `--chat-template <(...)` would be), so loading waits until the test writes it.
#[test]
fn health_is_503_while_loading_then_200() {
    let dir = std::env::temp_dir().join(format!("tandem-serve-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("template.jinja");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut cfg = config();
    cfg.chat_template = Some(fifo.clone());
    let server = start(cfg).unwrap();
    for _ in 0..3 {
        let r = get(server.addr(), "/health");
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(r.header("retry-after").is_some());
        let (s, e) = error_of(&post(server.addr(), "/v1/completions", &json!({"prompt": [1, 2]})));
        assert_eq!((s, e["type"].as_str()), (503, Some("service_unavailable")));
        std::thread::sleep(Duration::from_millis(50));
    }
    let template = "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}<|turn>model\n";
    std::fs::OpenOptions::new().write(true).open(&fifo).unwrap().write_all(template.as_bytes()).unwrap();
    let t = Instant::now();
    while get(server.addr(), "/health").status != 200 {
        assert!(t.elapsed() < Duration::from_secs(30), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let v = chat(server.addr(), json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}));
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let _ = std::fs::remove_dir_all(dir);
}

/// A scripted reply: these text pieces (one token each), then the end of turn.
fn scripted(pieces: &'static [&'static str]) -> Script {
    Script(std::sync::Arc::new(move |prompt: &[u32]| {
        let mut events: Vec<Event> = pieces
            .iter()
            .enumerate()
            .map(|(i, t)| Event::Tokens { ids: vec![400 + i as u32], text: t.to_string(), logprobs: Vec::new() })
            .collect();
        let mut generation = Generation::new(prompt.len());
        generation.tokens = (0..=pieces.len() as u32).map(|i| 400 + i).collect();
        generation.finish_reason = FinishReason::Stop;
        events.push(Event::Done(Box::new(Outcome {
            prompt_ids: prompt.to_vec(),
            generation,
            spec: None,
            text: Some(pieces.concat()),
            stop_string: false,
            inside_thinking: false,
            cancelled: false,
            draft: None,
        })));
        events
    }))
}

/// A Gemma 4 reply that thinks, says something and calls a tool, cut into pieces across the markers.
const TOOL_REPLY: &[&str] = &[
    "<|chan",
    "nel>thought\nThe user wants the weather; ",
    "call the tool.<chan",
    "nel|>Let me check.<|tool",
    "_call>call:get_weather{location:<|\"|>Par",
    "is<|\"|>,days:3}<tool_call|>",
];

/// The server's thinking and tool-call path end to end, with a scripted model (the shipped pair never
/// thinks or calls tools): reasoning_content, content and tool_calls, whole and streamed; then the
/// conversation goes on with the tool's result.
#[test]
fn scripted_thinking_and_tool_call_round_trip() {
    let mut cfg = config();
    cfg.script = Some(scripted(TOOL_REPLY));
    let server = serve(cfg);
    let addr = server.addr();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let v = chat(addr, json!({"messages": [user], "tools": tools}));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["reasoning_content"], "The user wants the weather; call the tool.");
    assert_eq!(m["content"], "Let me check.");
    let call = &m["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"location": "Paris", "days": 3}));
    assert_eq!(v["usage"]["completion_tokens"], TOOL_REPLY.len() + 1);
    // Streamed: the same parts as deltas, the call as one tool_calls delta with its index.
    let r = post(addr, "/v1/chat/completions", &json!({"messages": [user], "tools": tools, "stream": true}));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let joined = |k: &str| deltas.iter().filter_map(|d| d[k].as_str()).collect::<String>();
    assert_eq!(joined("reasoning_content"), m["reasoning_content"].as_str().unwrap());
    assert_eq!(joined("content"), "Let me check.");
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][0]["index"], 0);
    assert_eq!(calls[0][0]["function"], call["function"]);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // Without tools offered, the call's text is content (nothing is parsed out of it).
    let v = chat(addr, json!({"messages": [user]}));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("<|tool_call>call:get_weather"));
    // The next turn sends the call and its result back; the conversation renders and runs.
    let assistant = json!({"role": "assistant", "content": m["content"], "tool_calls": [call]});
    let tool = json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"sky\": \"clear\"}"});
    let v = chat(addr, json!({"messages": [user, assistant, tool], "tools": tools}));
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
}

/// `tandem serve` refuses bad options with a one-line error and exit status 1, before loading anything.
#[test]
fn serve_command_refuses_bad_options() {
    let cases: &[(&[&str], &str)] = &[
        (&["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (&["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (&["--prefill-step-ratio", "0.5"], "--prefill-step-ratio must be a number of at least 1"),
        (&["--prefill-step-ratio", "NaN"], "--prefill-step-ratio must be a number of at least 1"),
        (&["--context", "0"], "--context must be at least 1"),
        (&["--kv-memory", "8Q"], "--kv-memory"),
        (&["--kv-memory", "-1G"], "--kv-memory"),
        (&["--draft-tokens", "99"], "--draft-tokens"),
        (&["--served-model-name", " "], "--served-model-name must not be empty"),
        (&["--model", "/nonexistent/model"], "model /nonexistent/model does not exist"),
        (&["--model", "/etc/passwd"], "is not a model directory (no config.json), nor a GGUF file"),
        (&["--host", "not a host", "--port", "0"], "cannot listen on"),
        (&["--cors", "bad\norigin", "--port", "0"], "--cors"),
    ];
    for (args, want) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem")).arg("serve").args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().filter(|l| l.starts_with("error:")).count(), 1, "{args:?}: {err}");
    }
}

/// `chat_template_kwargs: {"enable_thinking": true}` is `tandem generate --thinking`: the same prompt and
/// greedy tokens (the text fixture's template renders thinking), with the text split by the reply splitter.
#[test]
fn enable_thinking_matches_tandem_generate_thinking() {
    let dir = common::fixture_dir("text-tiny");
    let mut cfg = config();
    cfg.model = dir.clone();
    cfg.assistant = None;
    let server = serve(cfg);
    let d = dir.to_str().unwrap();
    let mut prompts = Vec::new();
    for thinking in [false, true] {
        let mut args = vec!["generate", "--model", d, "--chat", "Say hello in French.", "--max-new-tokens", "24"];
        if thinking {
            args.push("--thinking");
        }
        args.push("--json");
        let g = tandem(&args);
        let body = json!({"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 24,
            "temperature": 0, "chat_template_kwargs": {"enable_thinking": thinking}});
        let t = post(server.addr(), "/tokenize", &body).json();
        assert_eq!(t["tokens"], g["prompt_ids"], "thinking {thinking}");
        prompts.push(t["tokens"].clone());
        let v = chat(server.addr(), body);
        let split = tandem::serve::output::OutputParser::split(g["text"].as_str().unwrap(), false);
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"], split.content, "thinking {thinking}");
        assert_eq!(m["reasoning_content"].as_str().unwrap_or(""), split.reasoning, "thinking {thinking}");
        assert_eq!(v["usage"]["completion_tokens"], g["tokens"].as_array().unwrap().len());
    }
    assert_ne!(prompts[0], prompts[1], "enable_thinking changed nothing in the prompt");
}
