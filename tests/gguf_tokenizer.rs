//! The tokenizer built from GGUF metadata (`TextTokenizer::from_gguf`) against llama.cpp's `llama-tokenize` on
//! the same files, and how it differs from the checkpoints' `tokenizer.json` (transformers).
//!
//! The fixtures in `tests/fixtures/gguf_vocab/` hold each file's `tokenizer.*` metadata and the goldens;
//! `scripts/gguf_vocab_goldens.py` writes them (see there for the files and the commands).

use std::path::{Path, PathBuf};

use serde_json::Value;
use tandem::text::gguf_vocab::GgufVocab;
use tandem::text::{ChatTemplate, Decode, IncrementalDecoder, RenderOptions, TextTokenizer};

const FIXTURES: [&str; 3] = ["tiny", "target", "e2b10"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Fixture {
    doc: Value,
    vocab: GgufVocab,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn opt_id(v: &Value) -> Option<u32> {
    v.as_u64().map(|x| x as u32)
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Expand the compact token list: strings, and `{"run": [prefix, first, count]}` for `prefix{first}`, ….
fn tokens(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for t in v.as_array().unwrap() {
        match t {
            Value::String(s) => out.push(s.clone()),
            Value::Object(o) => {
                let run = o["run"].as_array().unwrap();
                let (prefix, first, count) =
                    (run[0].as_str().unwrap(), run[1].as_u64().unwrap(), run[2].as_u64().unwrap());
                out.extend((first..first + count).map(|k| format!("{prefix}{k}")));
            }
            _ => panic!("bad token entry {t}"),
        }
    }
    out
}

fn load(name: &str) -> Fixture {
    let path = root().join("tests/fixtures/gguf_vocab").join(format!("{name}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let v = &doc["vocab"];
    let scores = match &v["scores"] {
        Value::Array(a) => Some(a.iter().map(|x| x.as_f64().unwrap() as f32).collect()),
        Value::Object(o) => Some(vec![o["fill"].as_f64().unwrap() as f32; o["len"].as_u64().unwrap() as usize]),
        _ => None,
    };
    let token_types = v["token_types"].as_array().map(|runs| {
        runs.iter()
            .flat_map(|r| {
                let r = r.as_array().unwrap();
                std::iter::repeat_n(r[0].as_i64().unwrap() as i32, r[1].as_u64().unwrap() as usize)
            })
            .collect()
    });
    let vocab = GgufVocab {
        model: v["model"].as_str().unwrap().to_string(),
        pre: v["pre"].as_str().map(str::to_string),
        tokens: tokens(&v["tokens"]),
        scores,
        token_types,
        merges: v["merges"].as_array().map(|a| a.iter().map(|m| m.as_str().unwrap().to_string()).collect()),
        bos: opt_id(&v["bos"]),
        eos: opt_id(&v["eos"]),
        unk: opt_id(&v["unk"]),
        pad: opt_id(&v["pad"]),
        mask: opt_id(&v["mask"]),
        eot: opt_id(&v["eot"]),
        add_bos: v["add_bos"].as_bool(),
        add_eos: v["add_eos"].as_bool(),
        add_space_prefix: v["add_space_prefix"].as_bool(),
        chat_template: v["chat_template"].as_str().map(str::to_string),
    };
    Fixture { doc, vocab }
}

fn build(f: &Fixture) -> TextTokenizer {
    let source = Path::new("/models").join(f.doc["gguf"].as_str().unwrap());
    TextTokenizer::from_gguf(&f.vocab, &source).unwrap()
}

fn cases(f: &Fixture) -> &Vec<Value> {
    f.doc["cases"].as_array().unwrap()
}

#[test]
fn encodes_as_llama_cpp() {
    for name in FIXTURES {
        let f = load(name);
        let tok = build(&f);
        assert_eq!(tok.len(), f.vocab.tokens.len());
        assert!(cases(&f).len() >= 40);
        for case in cases(&f) {
            let text = case["text"].as_str().unwrap();
            for (key, bos, special) in [
                ("bos_special", true, true),
                ("bos_plain", true, false),
                ("nobos_special", false, true),
                ("nobos_plain", false, false),
            ] {
                let want = ids(&case["llama"][key]);
                let got = tok.encode_with(text, bos, special).unwrap();
                assert_eq!(got, want, "{name} {key} {text:?}");
            }
            // `encode` parses special tokens, as llama.cpp does by default.
            assert_eq!(tok.encode(text, true).unwrap(), ids(&case["llama"]["bos_special"]));
        }
    }
}

/// Random strings of words, whitespace, special-token text and its parts, and characters that need byte
/// fallback (`fuzz` in the fixtures): same ids as llama.cpp, and decoding gives the text back (with `▁` as a
/// space).
#[test]
fn random_strings_encode_as_llama_cpp() {
    let mut total = 0;
    for name in FIXTURES {
        let f = load(name);
        let tok = build(&f);
        for case in f.doc["fuzz"].as_array().into_iter().flatten() {
            let text = case["text"].as_str().unwrap();
            let with_bos = ids(&case["llama"]["bos_special"]);
            let plain = ids(&case["llama"]["nobos_plain"]);
            assert_eq!(tok.encode_with(text, true, true).unwrap(), with_bos, "{name} {text:?}");
            assert_eq!(tok.encode_with(text, false, false).unwrap(), plain, "{name} {text:?}");
            // A `▁` typed in the text is a space to the tokenizer, and comes back as one.
            let back = text.replace('▁', " ");
            assert_eq!(tok.decode(&plain, false).unwrap(), back, "{name} {text:?}");
            assert_eq!(tok.decode(&with_bos[1..], false).unwrap(), back, "{name} {text:?}");
            total += 1;
        }
    }
    assert!(total >= 600, "{total}");
}

#[test]
fn decodes_as_llama_cpp() {
    for name in FIXTURES {
        let f = load(name);
        let tok = build(&f);
        let bos = f.vocab.bos.unwrap();
        let bos_text = tok.id_to_token(bos).unwrap();
        for case in cases(&f) {
            let text = case["text"].as_str().unwrap();
            let ids_bos = ids(&case["llama"]["bos_special"]);
            let pieces: Vec<Vec<u8>> =
                case["llama_pieces"].as_array().unwrap().iter().map(|p| hex_bytes(p.as_str().unwrap())).collect();
            assert_eq!(pieces.len(), ids_bos.len(), "{name} {text:?}");
            // Token by token, where a piece is text by itself (a lone byte of a longer character is not).
            for (&id, piece) in ids_bos.iter().zip(&pieces) {
                if let Ok(p) = std::str::from_utf8(piece) {
                    assert_eq!(tok.decode(&[id], false).unwrap(), p, "{name} {text:?} id {id}");
                }
            }
            // The pieces joined are the text: llama.cpp's tokenization is lossless on these strings.
            let joined = String::from_utf8(pieces.concat()).unwrap();
            assert_eq!(joined, format!("{bos_text}{text}"), "{name}");
            assert_eq!(tok.decode(&ids_bos, false).unwrap(), joined, "{name} {text:?}");
            for key in ["nobos_special", "nobos_plain"] {
                assert_eq!(tok.decode(&ids(&case["llama"][key]), false).unwrap(), text, "{name} {key} {text:?}");
            }
            // Without special tokens: text typed without special parsing comes back whole, minus the BOS, unless
            // it has text of a token that stays control even then.
            let plain = ids(&case["llama"]["bos_plain"]);
            let skipped = tok.decode(&plain, true).unwrap();
            assert_eq!(skipped, text, "{name} skip-special {text:?}");
        }
    }
}

#[test]
fn byte_tokens_and_streaming_contract() {
    let f = load("tiny");
    let tok = build(&f);
    let euro = tok.encode("€", false).unwrap();
    assert_eq!(euro.len(), 3, "{euro:?}");
    assert!(euro.iter().all(|&id| tok.is_byte_token(id)));
    assert_eq!(tok.decode_ids(&euro).unwrap(), "€");
    // An incomplete run decodes to one U+FFFD per byte, as the ByteFallback decoder does.
    assert_eq!(tok.decode_ids(&euro[..2]).unwrap(), "\u{FFFD}\u{FFFD}");
    assert!(!tok.is_byte_token(tok.token_to_id("<bos>").unwrap()));
    assert!(tok.decode(&[u32::MAX], false).is_err());
    // Streaming detokenization over the GGUF tokenizer gives the full decode, characters whole.
    for case in cases(&f) {
        let ids = ids(&case["llama"]["bos_special"]);
        let mut d = IncrementalDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            let piece = d.push(&tok, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            streamed.push_str(&piece);
        }
        streamed.push_str(&d.finish(&tok).unwrap());
        assert_eq!(streamed, tok.decode(&ids, false).unwrap());
    }
}

#[test]
fn carries_chat_template_and_named_tokens() {
    for name in FIXTURES {
        let f = load(name);
        let tok = build(&f);
        assert_eq!(tok.chat_template(), f.vocab.chat_template.as_deref(), "{name}");
        assert!(tok.chat_template().is_some(), "{name}");
        assert_eq!(tok.class(), None);
        assert!(tok.dir().ends_with(f.doc["gguf"].as_str().unwrap()));
        for (key, id) in [
            ("bos_token", f.vocab.bos),
            ("eos_token", f.vocab.eos),
            ("unk_token", f.vocab.unk),
            ("pad_token", f.vocab.pad),
            ("mask_token", f.vocab.mask),
            ("eot_token", f.vocab.eot),
        ] {
            let want = id.map(|id| f.vocab.tokens[id as usize].as_str());
            assert_eq!(tok.special_token(key), want, "{name} {key}");
        }
        assert_eq!(tok.special_token("bos_token"), Some("<bos>"));
        assert_eq!(tok.special_token("eos_token"), Some("<eos>"));
        // The template renders with those tokens, and its output tokenizes with one BOS at the start.
        let template = ChatTemplate::new(tok.chat_template().unwrap()).unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "Hello there"}]);
        let opts = RenderOptions { add_generation_prompt: true, ..Default::default() };
        let prompt = template.render(&messages, tok.special_tokens(), &opts).unwrap();
        assert!(prompt.starts_with("<bos>"), "{name}: {prompt:?}");
        let ids = tok.encode(&prompt, false).unwrap();
        assert_eq!(ids[0], f.vocab.bos.unwrap(), "{name}");
        assert_eq!(ids.iter().filter(|&&id| Some(id) == f.vocab.bos).count(), 1, "{name}");
        assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
    }
}

/// Where llama.cpp (and so `from_gguf`) and the checkpoint's `tokenizer.json` disagree, per fixture: the texts
/// that tokenize differently (with BOS, special tokens parsed). The reasons are in `src/text/gguf_vocab.rs`.
fn documented_differences(name: &str) -> &'static [&'static str] {
    match name {
        // Same special tokens, no custom pre-tokenizer: no difference.
        "tiny" => &[],
        // A custom regex Split pre-tokenizer (runs of spaces, newline + spaces) and added tokens that the GGUF
        // has as normal tokens (`<|turn>`, `<|think|>`, `<unused0>`).
        "target" => &[
            "   three leading spaces",
            "multiple    spaces     inside",
            "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
            "def square(x):\n    return x ** 2  # four-space indent\n",
            "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n",
            "<bos><|turn>user\nHi<turn|>\n",
            "x<|turn>y<turn|>z",
            "<|image|> <|audio|> <|think|>",
            "<unused0> <unused1>",
        ],
        // Added tokens that the GGUF has as normal tokens (`<|turn>`).
        "e2b10" => {
            &["<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n", "<bos><|turn>user\nHi<turn|>\n", "x<|turn>y<turn|>z"]
        }
        _ => unreachable!(),
    }
}

#[test]
fn differs_from_tokenizer_json_only_where_documented() {
    for name in FIXTURES {
        let f = load(name);
        let tok = build(&f);
        let mut differing: Vec<String> = Vec::new();
        for case in cases(&f) {
            let text = case["text"].as_str().unwrap();
            let hf = &case["hf"];
            let ours_bos = tok.encode(text, true).unwrap();
            let ours_nobos = tok.encode(text, false).unwrap();
            let same = ours_bos == ids(&hf["bos"]) && ours_nobos == ids(&hf["nobos"]);
            if !same {
                eprintln!("{name}: {text:?}\n  gguf/llama.cpp {ours_bos:?}\n  tokenizer.json {:?}", ids(&hf["bos"]));
                differing.push(text.to_string());
            }
        }
        let want: Vec<String> = documented_differences(name).iter().map(|s| s.to_string()).collect();
        assert_eq!(differing, want, "{name}: texts where the GGUF tokenizer and tokenizer.json differ");
        // The HF goldens are what tandem's own tokenizer.json loader gives, where the checkpoint is here.
        if let Some(dir) = f.doc["hf_dir"].as_str() {
            let json_tok = TextTokenizer::load(&root().join(dir)).unwrap();
            for case in cases(&f) {
                let text = case["text"].as_str().unwrap();
                assert_eq!(json_tok.encode(text, true).unwrap(), ids(&case["hf"]["bos"]), "{name} {text:?}");
            }
        }
    }
}

#[test]
fn rejects_unsupported_and_malformed_vocabularies() {
    let f = load("tiny");
    let src = Path::new("/models/x.gguf");
    let err = |v: &GgufVocab| TextTokenizer::from_gguf(v, src).err().map(|e| e.to_string()).unwrap_or_default();
    let check = |v: GgufVocab, want: &str| {
        let e = err(&v);
        assert!(e.contains(want), "{e:?} lacks {want:?}");
        assert!(e.starts_with("/models/x.gguf: "), "{e:?}");
        assert!(!e.contains('\n'), "{e:?}");
    };
    check(
        GgufVocab { model: "llama".into(), ..f.vocab.clone() },
        "tokenizer model \"llama\" in GGUF is not supported; tandem reads gemma4",
    );
    check(GgufVocab { model: "xyz".into(), ..f.vocab.clone() }, "\"xyz\"");
    let n = f.vocab.tokens.len();
    check(GgufVocab { scores: Some(vec![0.0; n - 1]), ..f.vocab.clone() }, "scores for 768 tokens");
    check(GgufVocab { token_types: Some(vec![1; n + 1]), ..f.vocab.clone() }, "769 token types for 768 tokens");
    check(GgufVocab { bos: Some(n as u32), ..f.vocab.clone() }, "BOS token id 768 is out of range");
    check(GgufVocab { eot: Some(u32::MAX), ..f.vocab.clone() }, "EOT token id");
    let mut merges = f.vocab.merges.clone().unwrap();
    merges[3] = "nospace".into();
    check(GgufVocab { merges: Some(merges), ..f.vocab.clone() }, "merge 3 \"nospace\" is not of the form \"a b\"");
    check(GgufVocab { merges: None, ..f.vocab.clone() }, "tokenizer.ggml.merges");
    // A vocabulary without token types has no special tokens: everything is text, byte tokens included.
    let untyped = TextTokenizer::from_gguf(&GgufVocab { token_types: None, ..f.vocab.clone() }, src).unwrap();
    assert!(!untyped.is_byte_token(untyped.token_to_id("<0x41>").unwrap()));
}
