//! A model directory's tokenizer (`tokenizer.json`, `tokenizer_config.json`, the chat template) as GGUF
//! tokenizer metadata, as llama.cpp's converter writes it for Gemma 4 (docs/gguf.md, "Writing"): the
//! `gemma4` tokenizer model, every token by id, merges, token types (byte tokens, control tokens for the
//! special ones, user-defined for the chat-structure tokens a chat parser must see), scores of -1000, and
//! the named special ids.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::file::MetaValue;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// Special tokens the converter keeps visible in decoded text (typed user-defined, not control), so that a
/// chat parser can read tool calls and thinking channels.
const VISIBLE: [&str; 7] =
    ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|\"|>"];

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !crate::files::exists(path) {
        return Ok(None);
    }
    let text = crate::files::read_text(path)?;
    Ok(Some(serde_json::from_str(&text).map_err(|e| anyhow!("{}: malformed JSON: {e}", path.display()))?))
}

/// A `<0xNN>` byte-fallback token.
fn is_byte_token(t: &str) -> bool {
    t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') && t[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

/// The tokenizer metadata for the model in `dir`; `None` when it has no `tokenizer.json`.
pub fn tokenizer_meta(dir: &Path) -> Result<Option<Vec<(String, MetaValue)>>> {
    let path = dir.join("tokenizer.json");
    let Some(file) = read_json(&path)? else { return Ok(None) };
    let bad = |what: &str| anyhow!("{}: {what}", path.display());
    let model = file.get("model").ok_or_else(|| bad("no `model`"))?;
    if model.get("type").and_then(Value::as_str) != Some("BPE")
        || model.get("byte_fallback") != Some(&Value::Bool(true))
    {
        bail!("{}: GGUF's gemma4 tokenizer needs a byte-fallback BPE tokenizer.json", path.display());
    }
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| bad("no `model.vocab`"))?;
    let mut tokens: Vec<Option<String>> = Vec::new();
    let mut put = |id: u64, t: &str| -> Result<()> {
        let id =
            usize::try_from(id).ok().filter(|&i| i < (1 << 24)).ok_or_else(|| bad("a token id is out of range"))?;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some(t.to_string());
        Ok(())
    };
    for (t, id) in vocab {
        put(id.as_u64().ok_or_else(|| bad("a vocabulary id is not a number"))?, t)?;
    }
    for a in file.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let id = a.get("id").and_then(Value::as_u64).ok_or_else(|| bad("an added token has no id"))?;
        let content = a.get("content").and_then(Value::as_str).ok_or_else(|| bad("an added token has no content"))?;
        put(id, content)?;
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.ok_or_else(|| bad(&format!("no token has id {i}: the vocabulary has a hole"))))
        .collect::<Result<_>>()?;
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let id_of = |t: &str| index.get(t).copied();

    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let named = |key: &str| -> Option<usize> {
        let v = config.get(key)?;
        let t = v.as_str().or_else(|| v.get("content").and_then(Value::as_str))?;
        id_of(t)
    };
    // Control tokens are transformers' "all special tokens" (the named ones and the extra special tokens of
    // tokenizer_config.json), not every added token marked special, as the converter does.
    let mut special = std::collections::HashSet::new();
    for key in ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"] {
        special.extend(named(key));
    }
    for key in ["extra_special_tokens", "additional_special_tokens"] {
        for v in config.get(key).and_then(Value::as_array).into_iter().flatten() {
            special.extend(v.as_str().or_else(|| v.get("content").and_then(Value::as_str)).and_then(id_of));
        }
    }
    let types: Vec<MetaValue> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            MetaValue::I32(if VISIBLE.contains(&t.as_str()) {
                USER_DEFINED
            } else if is_byte_token(t) {
                BYTE
            } else if special.contains(&i) {
                CONTROL
            } else {
                NORMAL
            })
        })
        .collect();
    let merges: Vec<MetaValue> = match model.get("merges").and_then(Value::as_array) {
        None => Vec::new(),
        Some(m) => m
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(MetaValue::Str(s.clone())),
                Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                    (Some(a), Some(b)) => Ok(MetaValue::Str(format!("{a} {b}"))),
                    _ => Err(bad("a merge is not a pair of strings")),
                },
                _ => Err(bad("a merge is neither \"a b\" nor a pair")),
            })
            .collect::<Result<_>>()?,
    };

    let n = tokens.len();
    let mut meta = vec![
        ("tokenizer.ggml.model".to_string(), MetaValue::Str("gemma4".into())),
        ("tokenizer.ggml.tokens".to_string(), MetaValue::Array(tokens.iter().cloned().map(MetaValue::Str).collect())),
        ("tokenizer.ggml.scores".to_string(), MetaValue::Array(vec![MetaValue::F32(-1000.0); n])),
        ("tokenizer.ggml.token_type".to_string(), MetaValue::Array(types)),
    ];
    if !merges.is_empty() {
        meta.push(("tokenizer.ggml.merges".into(), MetaValue::Array(merges)));
    }
    for (key, name) in [
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
        ("mask_token", "mask_token_id"),
    ] {
        if let Some(id) = named(key) {
            meta.push((format!("tokenizer.ggml.{name}"), MetaValue::U32(id as u32)));
        }
    }
    meta.push(("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)));
    let add_eos = config.get("add_eos_token").and_then(Value::as_bool).unwrap_or(false);
    meta.push(("tokenizer.ggml.add_eos_token".into(), MetaValue::Bool(add_eos)));
    meta.push(("tokenizer.ggml.add_space_prefix".into(), MetaValue::Bool(false)));
    let template = match crate::files::exists(&dir.join("chat_template.jinja")) {
        true => Some(crate::files::read_text(&dir.join("chat_template.jinja"))?),
        false => config.get("chat_template").and_then(Value::as_str).map(str::to_string),
    };
    if let Some(t) = template {
        meta.push(("tokenizer.chat_template".into(), MetaValue::Str(t)));
    }
    Ok(Some(meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens() {
        assert!(is_byte_token("<0x0A>") && is_byte_token("<0xff>"));
        assert!(!is_byte_token("<0x0G>") && !is_byte_token("<0x0A>x") && !is_byte_token("0x0A"));
    }
}
