//! The checkpoint's tokenizer (`tokenizer.json`), loaded the way transformers 5.23.0 loads it, or the
//! vocabulary in a GGUF file's metadata (see [`super::gguf_vocab`], which tokenizes as llama.cpp does).
//!
//! What transformers does on top of `tokenizer.json`, and so what this does too:
//! - `add_bos_token` / `add_eos_token` in `tokenizer_config.json` are ignored once a `tokenizer.json`
//!   exists: BOS comes only from the file's post-processor (none when it is null).
//! - A `GemmaTokenizer` class (`tokenizer_class` in `tokenizer_config.json`) rebuilds the pipeline
//!   itself: BPE with byte fallback and fused unknowns, spaces replaced by `▁`, and the matching decoder.
//!   The file's vocabulary, merges and post-processor are kept; its normalizer, pre-tokenizer and decoder
//!   are not.
//! - Named special tokens (`bos_token`, …, and model-specific ones such as `eot_token`) and extra special
//!   tokens are registered as special if the file does not already have them; `added_tokens_decoder` in
//!   `tokenizer_config.json` replaces the file's added tokens for the Gemma class. Without
//!   `added_tokens_decoder`, `special_tokens_map.json` (legacy) overrides the named tokens.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};
use tokenizers::{AddedToken, Tokenizer};

use super::gguf_vocab::{GgufTokenizer, GgufVocab};

/// The file that makes a model directory speak text.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// transformers' standard special-token attributes, in its order.
const STANDARD_SPECIALS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Class defaults of `GemmaTokenizer` for the named tokens a config leaves out.
const GEMMA_DEFAULTS: [(&str, &str); 5] = [
    ("unk_token", "<unk>"),
    ("bos_token", "<bos>"),
    ("eos_token", "<eos>"),
    ("pad_token", "<pad>"),
    ("mask_token", "<mask>"),
];

/// What turns text into ids and back.
enum Backend {
    /// `tokenizer.json` through the `tokenizers` library; `plain` is a copy that leaves special tokens' text
    /// unmatched, made when first needed.
    Json { tok: Box<Tokenizer>, plain: OnceLock<Box<Tokenizer>> },
    /// A GGUF file's vocabulary.
    Gguf(Box<GgufTokenizer>),
}

pub struct TextTokenizer {
    inner: Backend,
    /// Named special tokens (`bos_token` → `<bos>`, …, model-specific `*_token` keys): what a chat
    /// template sees as variables.
    named: Vec<(String, String)>,
    chat_template: Option<String>,
    class: Option<String>,
    /// The model directory, or the GGUF file the vocabulary came from.
    dir: PathBuf,
    /// Indexed by id: byte-fallback tokens (empty when the decoder has no ByteFallback step).
    byte_tokens: Vec<bool>,
}

/// Whether `dir` has a tokenizer.
/// A GGUF file has one when its metadata holds a vocabulary.
pub fn has_tokenizer(dir: &Path) -> bool {
    if crate::gguf::is_gguf(dir) {
        return crate::gguf::GgufModel::open_metadata(dir)
            .is_ok_and(|m| m.meta().contains_key("tokenizer.ggml.tokens"));
    }
    crate::files::exists(&dir.join(TOKENIZER_FILE))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !crate::files::exists(path) {
        return Ok(None);
    }
    let text = crate::files::read_text(path)?;
    let v: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: malformed JSON: {e}", path.display()))?;
    Ok(Some(v))
}

/// A token given as a string or as a serialized AddedToken (`{"content": ...}`).
fn token_content(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn set_named(named: &mut Vec<(String, String)>, key: &str, value: String) {
    match named.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => named.push((key.to_string(), value)),
    }
}

fn added_token_from_json(content: &str, o: &Map<String, Value>, special_default: bool) -> AddedToken {
    let flag = |k: &str, d: bool| o.get(k).and_then(Value::as_bool).unwrap_or(d);
    let special = flag("special", special_default);
    AddedToken {
        content: content.to_string(),
        single_word: flag("single_word", false),
        lstrip: flag("lstrip", false),
        rstrip: flag("rstrip", false),
        normalized: flag("normalized", !special),
        special,
    }
}

impl TextTokenizer {
    /// Load `dir/tokenizer.json` with `tokenizer_config.json`, `special_tokens_map.json` and the chat
    /// template (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`).
    pub fn load(dir: &Path) -> Result<TextTokenizer> {
        if crate::gguf::is_gguf(dir) {
            // A GGUF file carries its tokenizer in its metadata (docs/gguf.md).
            let m = crate::gguf::GgufModel::open_metadata(dir)?;
            let v = crate::gguf::gemma4::vocab(&m)?
                .ok_or_else(|| anyhow!("{} has no tokenizer (no `tokenizer.ggml.tokens` metadata)", dir.display()))?;
            return TextTokenizer::from_gguf(&v, dir);
        }
        let path = dir.join(TOKENIZER_FILE);
        if !crate::files::exists(&path) {
            bail!("{} has no {TOKENIZER_FILE}", dir.display());
        }
        let mut file = read_json(&path)?.unwrap_or(Value::Null);
        let Some(file_obj) = file.as_object_mut() else {
            bail!("{}: expected a JSON object", path.display());
        };
        let config_path = dir.join("tokenizer_config.json");
        let config = match read_json(&config_path)? {
            Some(Value::Object(o)) => o,
            Some(_) => bail!("{}: expected a JSON object", config_path.display()),
            None => Map::new(),
        };
        let class = config.get("tokenizer_class").and_then(Value::as_str).map(str::to_string);
        let gemma_class = matches!(class.as_deref(), Some("GemmaTokenizer" | "GemmaTokenizerFast"));

        // Named and extra special tokens.
        let mut named: Vec<(String, String)> = Vec::new();
        let mut extra: Vec<String> = Vec::new();
        for key in STANDARD_SPECIALS {
            if let Some(t) = config.get(key).and_then(token_content) {
                named.push((key.to_string(), t));
            }
        }
        if gemma_class {
            for (key, default) in GEMMA_DEFAULTS {
                if !config.contains_key(key) {
                    set_named(&mut named, key, default.to_string());
                }
            }
        }
        let list_of = |v: &Value| -> Vec<String> {
            v.as_array().map(|a| a.iter().filter_map(token_content).collect()).unwrap_or_default()
        };
        match config.get("extra_special_tokens") {
            Some(Value::Array(_)) => extra.extend(list_of(&config["extra_special_tokens"])),
            Some(Value::Object(o)) => {
                for (k, v) in o {
                    if let Some(t) = token_content(v) {
                        set_named(&mut named, k, t);
                    }
                }
            }
            _ => {}
        }
        if extra.is_empty() {
            if let Some(v) = config.get("additional_special_tokens") {
                extra.extend(list_of(v));
            }
        }
        for (key, v) in &config {
            if key.ends_with("_token") && !STANDARD_SPECIALS.contains(&key.as_str()) {
                if let Some(t) = token_content(v) {
                    set_named(&mut named, key, t);
                }
            }
        }
        let has_decoder_map = config.get("added_tokens_decoder").is_some_and(Value::is_object);
        if !has_decoder_map {
            let map_path = dir.join("special_tokens_map.json");
            if let Some(Value::Object(map)) = read_json(&map_path)? {
                for (k, v) in &map {
                    if k == "extra_special_tokens" || k == "additional_special_tokens" {
                        for t in list_of(v) {
                            if !extra.contains(&t) {
                                extra.push(t);
                            }
                        }
                    } else if let Some(t) = token_content(v) {
                        set_named(&mut named, k, t);
                    }
                }
            }
        }

        // The Gemma class's own pipeline.
        let is_bpe = file_obj.get("model").and_then(|m| m.get("type")).and_then(Value::as_str) == Some("BPE");
        if gemma_class && is_bpe {
            let unk =
                named.iter().find(|(k, _)| k == "unk_token").map(|(_, v)| v.clone()).unwrap_or_else(|| "<unk>".into());
            file_obj
                .insert("normalizer".into(), json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
            file_obj.insert(
                "pre_tokenizer".into(),
                json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            );
            file_obj.insert(
                "decoder".into(),
                json!({"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"}
                ]}),
            );
            if let Some(model) = file_obj.get_mut("model").and_then(Value::as_object_mut) {
                model.insert("dropout".into(), Value::Null);
                model.insert("unk_token".into(), Value::String(unk));
                model.insert("continuing_subword_prefix".into(), Value::Null);
                model.insert("end_of_word_suffix".into(), Value::Null);
                model.insert("fuse_unk".into(), Value::Bool(true));
                model.insert("byte_fallback".into(), Value::Bool(true));
                model.insert("ignore_merges".into(), Value::Bool(false));
            }
            if has_decoder_map {
                file_obj.insert("added_tokens".into(), Value::Array(Vec::new()));
            }
        }

        if let Some(p) = file_obj.get("post_processor") {
            check_post_processor(p).map_err(|e| anyhow!("{}: post_processor: {e}", path.display()))?;
        }
        let decoder_json = file_obj.get("decoder").cloned().unwrap_or(Value::Null);
        let mut inner: Tokenizer = serde_json::from_value(file)
            .map_err(|e| anyhow!("{}: not a tokenizer the `tokenizers` library can read: {e}", path.display()))?;

        // added_tokens_decoder from tokenizer_config.json, in id order.
        if let Some(Value::Object(dec)) = config.get("added_tokens_decoder") {
            let mut entries: Vec<(u64, AddedToken)> = Vec::new();
            for (id, v) in dec {
                let (Ok(id), Some(o)) = (id.parse::<u64>(), v.as_object()) else { continue };
                if let Some(content) = o.get("content").and_then(Value::as_str) {
                    entries.push((id, added_token_from_json(content, o, false)));
                }
            }
            entries.sort_by_key(|e| e.0);
            let present: HashSet<String> =
                inner.get_added_tokens_decoder().values().map(|t| t.content.clone()).collect();
            let missing: Vec<AddedToken> =
                entries.into_iter().map(|e| e.1).filter(|t| !present.contains(&t.content)).collect();
            inner.add_tokens(missing).map_err(|e| anyhow!("{}: {e}", config_path.display()))?;
        }
        // Named and extra special tokens the tokenizer does not have as special ones yet.
        let special_now: HashSet<String> =
            inner.get_added_tokens_decoder().values().filter(|t| t.special).map(|t| t.content.clone()).collect();
        let mut to_add: Vec<AddedToken> = Vec::new();
        for t in named.iter().map(|(_, v)| v).chain(extra.iter()) {
            if !special_now.contains(t) && !to_add.iter().any(|a| &a.content == t) {
                to_add.push(AddedToken::from(t.clone(), true));
            }
        }
        if !to_add.is_empty() {
            inner.add_special_tokens(to_add).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        }

        // Chat template: the .jinja file wins over the config entry.
        let template_path = dir.join("chat_template.jinja");
        let chat_template = if crate::files::exists(&template_path) {
            Some(crate::files::read_text(&template_path)?)
        } else {
            match config.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            }
        };

        let byte_tokens = byte_token_table(&inner, &decoder_json);
        Ok(TextTokenizer {
            inner: Backend::Json { tok: Box::new(inner), plain: OnceLock::new() },
            named,
            chat_template,
            class,
            dir: dir.to_path_buf(),
            byte_tokens,
        })
    }

    /// The tokenizer of a GGUF file's metadata (`source` is the file, for messages and [`Self::dir`]). It
    /// tokenizes as llama.cpp does for the file; the named special tokens are those the file gives ids for
    /// (`bos_token`, `eos_token`, `unk_token`, `pad_token`, `mask_token`, `eot_token`), and the chat template
    /// is `tokenizer.chat_template`.
    pub fn from_gguf(v: &GgufVocab, source: &Path) -> Result<TextTokenizer> {
        let tok = GgufTokenizer::new(v).map_err(|e| anyhow!("{}: {e}", source.display()))?;
        let mut named: Vec<(String, String)> = Vec::new();
        for (key, id) in [
            ("bos_token", v.bos),
            ("eos_token", v.eos),
            ("unk_token", v.unk),
            ("pad_token", v.pad),
            ("mask_token", v.mask),
            ("eot_token", v.eot),
        ] {
            if let Some(text) = id.and_then(|id| tok.id_to_token(id)) {
                named.push((key.to_string(), text.to_string()));
            }
        }
        let byte_tokens = (0..tok.len() as u32).map(|id| tok.is_byte_token(id)).collect();
        Ok(TextTokenizer {
            inner: Backend::Gguf(Box::new(tok)),
            named,
            chat_template: v.chat_template.clone(),
            class: None,
            dir: source.to_path_buf(),
            byte_tokens,
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS), as
    /// `tokenizer(text)` does in transformers.
    /// For a GGUF vocabulary, special-token text in `text` is matched (llama.cpp's default); see
    /// [`Self::encode_with`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special_tokens, true)
    }

    /// Token ids of `text`, choosing whether special-token text in it becomes special tokens. With
    /// `parse_special` false, a GGUF vocabulary tokenizes control and unknown tokens' text as ordinary text
    /// (user-defined tokens still match), as llama.cpp does; `tokenizer.json` treats special tokens' text the
    /// same way (added tokens that are not special still match).
    pub fn encode_with(&self, text: &str, add_special_tokens: bool, parse_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Backend::Json { tok, plain } => {
                let t = if parse_special {
                    tok
                } else {
                    plain.get_or_init(|| {
                        let mut t = tok.clone();
                        t.set_encode_special_tokens(true);
                        t
                    })
                };
                let enc = t.encode(text, add_special_tokens).map_err(|e| anyhow!("cannot tokenize: {e}"))?;
                Ok(enc.get_ids().to_vec())
            }
            Backend::Gguf(t) => t.encode(text, add_special_tokens, parse_special),
        }
    }

    /// Text of `ids`; with `skip_special_tokens`, special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match &self.inner {
            Backend::Json { tok: t, .. } => {
                t.decode(ids, skip_special_tokens).map_err(|e| anyhow!("cannot decode: {e}"))
            }
            Backend::Gguf(t) => t.decode(ids, skip_special_tokens),
        }
    }

    /// The token strings of `ids` (`None` for an unknown id).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Backend::Json { tok: t, .. } => t.id_to_token(id),
            Backend::Gguf(t) => t.id_to_token(id).map(str::to_string),
        }
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Backend::Json { tok: t, .. } => t.token_to_id(token),
            Backend::Gguf(t) => t.token_to_id(token),
        }
    }

    /// Tokens of the model vocabulary itself, without the added (special) ones; a GGUF vocabulary has all
    /// its tokens in one list.
    pub fn base_len(&self) -> usize {
        match &self.inner {
            Backend::Json { tok: t, .. } => t.get_vocab_size(false),
            Backend::Gguf(t) => t.len(),
        }
    }

    /// Vocabulary size including added tokens.
    pub fn len(&self) -> usize {
        match &self.inner {
            Backend::Json { tok: t, .. } => t.get_vocab_size(true),
            Backend::Gguf(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The named special tokens, as a chat template sees them (`bos_token`, `eos_token`, …).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.named
    }

    /// A named special token, e.g. `special_token("eot_token")`.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.named.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// `tokenizer_class` from `tokenizer_config.json` (`None` for a GGUF vocabulary).
    pub fn class(&self) -> Option<&str> {
        self.class.as_deref()
    }

    /// The model directory, or for a GGUF vocabulary the GGUF file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Anything that turns ids into text; the streaming detokenizer works over this.
pub trait Decode {
    /// The text of `ids`, special tokens included.
    fn decode_ids(&self, ids: &[u32]) -> Result<String>;

    /// Whether `id` is a byte-fallback token (`<0xNN>`) that the decoder joins with its neighbours. A run of
    /// them decodes as a whole: to its UTF-8 text if valid, else to one U+FFFD per byte, so a run is only
    /// final once a token of another kind follows.
    fn is_byte_token(&self, _id: u32) -> bool {
        false
    }
}

impl Decode for TextTokenizer {
    fn decode_ids(&self, ids: &[u32]) -> Result<String> {
        self.decode(ids, false)
    }

    fn is_byte_token(&self, id: u32) -> bool {
        self.byte_tokens.get(id as usize).copied().unwrap_or(false)
    }
}

/// The `tokenizers` crate trusts a `TemplateProcessing` post-processor read from JSON (its builder checks
/// what deserializing does not): a template naming a special token it does not define, `$B` in the
/// single-sequence template, or a special token with more ids than tokens panics when text is encoded.
fn check_post_processor(p: &Value) -> Result<()> {
    match p.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for q in p.get("processors").and_then(Value::as_array).into_iter().flatten() {
                check_post_processor(q)?;
            }
        }
        Some("TemplateProcessing") => {
            let specials = p.get("special_tokens").and_then(Value::as_object);
            for (which, pair) in [("single", false), ("pair", true)] {
                for piece in p.get(which).and_then(Value::as_array).into_iter().flatten() {
                    if let Some(id) = piece.get("SpecialToken").and_then(|t| t.get("id")).and_then(Value::as_str) {
                        if !specials.is_some_and(|m| m.contains_key(id)) {
                            bail!("the {which} template uses special token {id:?}, which `special_tokens` does not define");
                        }
                    }
                    let seq = piece.get("Sequence").and_then(|t| t.get("id")).and_then(Value::as_str);
                    if !pair && seq == Some("B") {
                        bail!("the single template uses the second sequence ($B)");
                    }
                }
            }
            for (id, t) in specials.into_iter().flatten() {
                let len = |field: &str| t.get(field).and_then(Value::as_array).map(Vec::len);
                if len("ids") != len("tokens") {
                    bail!("special token {id:?} has {:?} ids but {:?} tokens", len("ids"), len("tokens"));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Byte-fallback token ids, when the decoder has a ByteFallback step: `<0x00>`..`<0xFF>` in the vocabulary.
fn byte_token_table(inner: &Tokenizer, decoder_json: &Value) -> Vec<bool> {
    if !decoder_json.to_string().contains("\"ByteFallback\"") {
        return Vec::new();
    }
    let mut table = vec![false; inner.get_vocab_size(true)];
    for b in 0..=255u32 {
        if let Some(id) = inner.token_to_id(&format!("<0x{b:02X}>")) {
            if let Some(slot) = table.get_mut(id as usize) {
                *slot = true;
            }
        }
    }
    table
}
