//! Tokenizer, chat templates and streaming detokenization against the goldens transformers wrote for
//! `tests/fixtures/text-tiny` (see scripts/fixtures/make_text_fixtures.py).

mod common;

use std::path::{Path, PathBuf};

use common::fixture_dir;
use serde_json::{Map, Value};
use tandem::text::{ChatTemplate, Decode, IncrementalDecoder, RenderOptions, TextTokenizer};

fn goldens() -> Value {
    let path = fixture_dir("text-tiny").join("text_goldens.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::load(&fixture_dir("text-tiny")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn loads_with_the_declared_special_tokens() {
    let tok = tokenizer();
    assert_eq!(tok.len(), goldens()["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(tok.class(), Some("GemmaTokenizer"));
    assert!(tok.chat_template().is_some());
    assert_eq!(tok.special_token("bos_token"), Some("<bos>"));
    assert_eq!(tok.special_token("eot_token"), Some("<turn|>"));
    assert_eq!(tok.special_token("soc_token"), Some("<|channel>"));
    for (token, id) in [
        ("<pad>", 0),
        ("<eos>", 1),
        ("<bos>", 2),
        ("<|channel>", 100),
        ("<channel|>", 101),
        ("<|turn>", 105),
        ("<turn|>", 106),
    ] {
        assert_eq!(tok.token_to_id(token), Some(id), "{token}");
    }
}

#[test]
fn encodings_match_transformers() {
    let tok = tokenizer();
    let g = goldens();
    let cases = g["encodings"].as_array().unwrap();
    assert!(cases.len() > 40);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let add = case["add_special_tokens"].as_bool().unwrap();
        let got = tok.encode(text, add).unwrap();
        assert_eq!(got, ids(&case["ids"]), "encode({text:?}, add_special_tokens={add})");
        let names: Vec<String> = got.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        let want: Vec<String> =
            case["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
        assert_eq!(names, want, "tokens of {text:?}");
    }
}

#[test]
fn decodes_match_transformers() {
    let tok = tokenizer();
    for case in goldens()["decodes"].as_array().unwrap() {
        let skip = case["skip_special_tokens"].as_bool().unwrap();
        let got = tok.decode(&ids(&case["ids"]), skip).unwrap();
        assert_eq!(got, case["text"].as_str().unwrap(), "decode({}, skip_special_tokens={skip})", case["ids"]);
    }
}

/// Stream `ids` one at a time, checking the invariants after every step; returns the streamed text.
fn stream_checked(dec: &dyn Decode, ids: &[u32]) -> String {
    let full = dec.decode_ids(ids).unwrap();
    let mut d = IncrementalDecoder::new();
    let mut out = String::new();
    for (k, &id) in ids.iter().enumerate() {
        let piece = d.push(dec, id).unwrap();
        out.push_str(&piece);
        // Never a broken or half character: what is out so far never ends in U+FFFD and is a prefix of the
        // final text (so nothing printed is ever taken back or printed twice).
        assert!(!out.ends_with('\u{FFFD}'), "step {k} of {ids:?}: {out:?}");
        assert!(full.starts_with(&out), "step {k} of {ids:?}: {out:?} is not a prefix of {full:?}");
    }
    out.push_str(&d.finish(dec).unwrap());
    assert_eq!(d.finish(dec).unwrap(), "", "a second finish emits nothing");
    assert_eq!(out, full, "{ids:?}");
    out
}

#[test]
fn streaming_is_clean_on_adversarial_sequences() {
    let tok = tokenizer();
    let g = goldens();
    for case in g["stream"].as_array().unwrap() {
        let out = stream_checked(&tok, &ids(&case["ids"]));
        assert_eq!(out, case["text"].as_str().unwrap(), "{}", case["name"]);
    }
    // Every golden encoding, with and without BOS.
    for case in g["encodings"].as_array().unwrap() {
        stream_checked(&tok, &ids(&case["ids"]));
    }
    // Pseudo-random sequences biased towards byte-fallback tokens (ids 114..370), with specials mixed in.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let vocab = tok.len() as u64;
    for _ in 0..200 {
        let n = 1 + next() % 24;
        let seq: Vec<u32> = (0..n)
            .map(|_| match next() % 4 {
                0 | 1 => (114 + next() % 256) as u32,
                2 => (next() % 120) as u32,
                _ => (next() % vocab) as u32,
            })
            .collect();
        stream_checked(&tok, &seq);
    }
    // Characters spelled in byte tokens come out whole once the run of bytes ends, and a run that turns out
    // invalid (a valid "é" followed by half of "中") is shown as the decoder shows it, never "é" first.
    let byte = |b: u8| tok.token_to_id(&format!("<0x{b:02X}>")).unwrap();
    let x = tok.encode("x", false).unwrap();
    let mut d = IncrementalDecoder::new();
    let mut out = String::new();
    for b in "é中🙂".bytes() {
        assert_eq!(d.push(&tok, byte(b)).unwrap(), "", "nothing is final inside a byte run");
    }
    out.push_str(&d.push(&tok, x[0]).unwrap());
    assert_eq!(out, "é中🙂x");
    let seq: Vec<u32> = [byte(0xC3), byte(0xA9), byte(0xE4), byte(0xB8), x[0]].to_vec();
    assert_eq!(stream_checked(&tok, &seq), "\u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}x");
}

fn render_options(case: &Value) -> RenderOptions {
    let mut extra: Map<String, Value> = case["kwargs"].as_object().unwrap().clone();
    let add = extra.remove("add_generation_prompt").and_then(|v| v.as_bool()).unwrap_or(false);
    let tools = case.get("tools").filter(|t| !t.is_null()).cloned();
    RenderOptions { add_generation_prompt: add, tools, extra }
}

fn check_renderings(tok: &TextTokenizer, template: &ChatTemplate, cases: &[Value], label: &str) {
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let rendered = template.render(&case["messages"], tok.special_tokens(), &render_options(case)).unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "{label}: {name}");
        if let Some(want) = case.get("ids") {
            assert_eq!(tok.encode(&rendered, false).unwrap(), ids(want), "{label}: ids of {name}");
        }
    }
}

#[test]
fn fixture_template_renders_as_transformers() {
    let tok = tokenizer();
    let template = ChatTemplate::new(tok.chat_template().unwrap()).unwrap();
    let g = goldens();
    let cases = g["chat"].as_array().unwrap();
    assert!(cases.len() >= 10);
    check_renderings(&tok, &template, cases, "fixture template");
    for case in g["chat_errors"].as_array().unwrap() {
        let err = template
            .render(&case["messages"], tok.special_tokens(), &RenderOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(case["error"].as_str().unwrap()), "{err}");
    }
}

/// The real Gemma 4 template lives outside the repository (`../shared/reference/`); the goldens hold
/// only what transformers rendered from it.
#[test]
fn gemma4_template_renders_as_transformers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/gemma4-chat-template.jinja");
    let Ok(source) = std::fs::read_to_string(&path) else {
        eprintln!("skipped: {} is not here", path.display());
        return;
    };
    let tok = tokenizer();
    let template = ChatTemplate::new(&source).unwrap();
    let g = goldens();
    let cases = g["gemma4_template"].as_array().expect("goldens were built with the Gemma 4 template");
    assert!(cases.len() >= 12);
    check_renderings(&tok, &template, cases, "gemma4 template");
}

/// Modified copies of the tokenizer files: BOS comes from tokenizer.json's post-processor only, and the
/// Gemma class uses its own normalizer/pre-tokenizer/decoder while a generic class uses the file's.
#[test]
fn tokenizer_file_variants_load_as_in_transformers() {
    let src = fixture_dir("text-tiny");
    for (n, variant) in goldens()["variants"].as_array().unwrap().iter().enumerate() {
        let name = variant["name"].as_str().unwrap();
        let dir: PathBuf = std::env::temp_dir().join(format!("tandem-text-variant-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut tj: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap()).unwrap();
        for key in variant["tokenizer_json_null"].as_array().unwrap() {
            tj[key.as_str().unwrap()] = Value::Null;
        }
        std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
        let mut tc: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap()).unwrap();
        for (k, v) in variant["tokenizer_config_set"].as_object().unwrap() {
            tc[k] = v.clone();
        }
        std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
        let tok = TextTokenizer::load(&dir).unwrap();
        for e in variant["encodings"].as_array().unwrap() {
            let text = e["text"].as_str().unwrap();
            let got = tok.encode(text, true).unwrap();
            assert_eq!(got, ids(&e["ids"]), "{name}: encode({text:?})");
            assert_eq!(tok.decode(&got, false).unwrap(), e["decoded"].as_str().unwrap(), "{name}: decode");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn missing_or_broken_tokenizers_are_clear_errors() {
    let err = TextTokenizer::load(&fixture_dir("t1-f32")).err().unwrap().to_string();
    assert!(err.contains("no tokenizer.json"), "{err}");
    let dir = std::env::temp_dir().join(format!("tandem-text-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = format!("{:#}", TextTokenizer::load(&dir).err().unwrap());
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::write(dir.join("tokenizer.json"), "not json").unwrap();
    let err = format!("{:#}", TextTokenizer::load(&dir).err().unwrap());
    assert!(err.contains("malformed JSON"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn text_stream_hides_or_shows_thinking_and_skips_eos() {
    use tandem::text::TextStream;
    let tok = tokenizer();
    let mut ids = tok.encode("<|channel>thought\nlet me see 中<channel|>The answer: 4 🙂", false).unwrap();
    ids.push(106); // <turn|>, an end-of-turn id
    for (show, run) in [(false, 1usize), (true, 1), (false, 3), (true, 5)] {
        let mut ts = TextStream::new(&tok, vec![1, 106], vec![], show);
        let mut visible = String::new();
        // Deliver the ids one at a time or in speculative-style runs.
        for chunk in ids.chunks(run) {
            let p = ts.push(chunk).unwrap();
            assert_eq!(p.keep, None);
            visible.push_str(&p.visible);
        }
        visible.push_str(&ts.finish().unwrap());
        let full = "<|channel>thought\nlet me see 中<channel|>The answer: 4 🙂";
        assert_eq!(visible, if show { full } else { "The answer: 4 🙂" }, "show {show}, runs of {run}");
        assert_eq!(ts.text(), full);
    }
    // A stop string inside a run: keep the ids through the one that completes it.
    let ids = tok.encode("one two three", false).unwrap();
    let mut ts = TextStream::new(&tok, vec![], vec!["two".into()], false);
    let p = ts.push(&ids).unwrap();
    assert_eq!(p.visible, "one ");
    let k = p.keep.unwrap();
    assert!(
        tok.decode(&ids[..k], false).unwrap().contains("two")
            && !tok.decode(&ids[..k - 1], false).unwrap().contains("two")
    );
}
