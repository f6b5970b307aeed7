//! A tokenizer built from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys), so that a GGUF file
//! runs without the checkpoint's `tokenizer.json`.
//!
//! Only `tokenizer.ggml.model = "gemma4"` is read. It tokenizes as llama.cpp does for that model (the file's
//! origin), which this module re-implements:
//! - Special tokens are cut out of the raw text first: tokens of type control (3), user-defined (4) and
//!   unknown (2), longest text first, each one everywhere in the text left to right. Without special-token
//!   parsing only user-defined tokens are cut out; control and unknown ones are then ordinary text.
//! - Before that, llama.cpp adjusts some types by token text, and so does this: end-of-generation texts
//!   (`<eos>`, `<turn|>`, `<|tool_response>`, `<end_of_turn>`, `<|im_end|>`, …) and fill-in-the-middle texts
//!   become control tokens, whatever the file says (so a user-defined `<|tool_response>` is then matched
//!   only with special-token parsing, and hidden when decoding without special tokens).
//! - Each remaining piece of text has its spaces replaced by `▁` and is split into runs of newlines and
//!   runs of anything else; each run is merged by BPE (lowest merge rank first, leftmost first on ties),
//!   starting from single characters. A run of newlines that is itself a token is taken whole.
//! - A merged piece that is not a token becomes its UTF-8 bytes as `<0xNN>` tokens (bytes without such a
//!   token are dropped).
//! - BOS is always added when asked for (llama.cpp forces `add_bos_token` on for this model), EOS only when
//!   `add_eos_token` is set. `tokenizer.ggml.pre` is ignored: the model fixes the pre-tokenizer.
//! - Decoding joins the pieces of the tokens: normal tokens with `▁` turned back into spaces, byte tokens as
//!   their bytes, user-defined tokens as their text, control and unknown tokens as their text unless special
//!   tokens are skipped, unused and undefined tokens as nothing.
//!
//! Where llama.cpp, and so this, differs from the checkpoint's `tokenizer.json` read by transformers (Hugging
//! Face tokenizers); on ordinary text the two agree:
//! - Special-token text typed in the input: `tokenizer.json` matches every added token (special or not) of
//!   the file; here only what the GGUF token types (after the adjustments above) make special. A token that
//!   the converter wrote as a normal token (e.g. `<|turn>` or `<unused0>` in some files) is split by BPE like
//!   other text, and with special-token parsing off even `<bos>` is ordinary text.
//! - Pre-tokenization: a `tokenizer.json` whose pre-tokenizer is a custom regex `Split` cannot carry it into
//!   the GGUF; here the text is only split at newlines, so runs of spaces or newlines followed by spaces can
//!   merge differently (tokens such as `\n▁▁▁▁` are never produced). The plain Gemma pipeline (no split)
//!   could also merge across a newline where llama.cpp does not (no such merge in the vocabularies tested).
//! - Named special tokens for chat templates are only those the GGUF has ids for (`bos_token`,
//!   `eos_token`, `unk_token`, `pad_token`, `mask_token`, `eot_token`); model-specific names from
//!   `tokenizer_config.json` (`sot_token`, `boi_token`, …) do not survive the conversion.
//!
//! Where this departs from llama.cpp:
//! - Decoding: a run of byte tokens that is not valid UTF-8 becomes one U+FFFD per byte, as the
//!   `ByteFallback` decoder of `tokenizer.json` does (llama.cpp returns the raw bytes). llama.cpp's
//!   `llama_detokenize` also removes spaces before `?!.,` and in some apostrophe contractions
//!   (`clean_spaces`); that is not done here, so decoding is the plain concatenation of pieces, which is what
//!   llama.cpp streams when generating, and what `tokenizer.json` decodes to.
//! - Ties among special tokens of equal length are resolved by lower id first (llama.cpp's order is
//!   unspecified there); for fill-in-the-middle texts, the lowest id of each kind is the one promoted.
//! - `tokenizer.ggml.add_space_prefix` is ignored (llama.cpp uses it only to strip one leading space in
//!   `llama_detokenize` for this model).
//! - Malformed metadata (lengths that differ, ids out of range, merges not `"a b"`, a byte-type token not
//!   `<0xNN>`) is an error, where llama.cpp tolerates some of it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use anyhow::{bail, Result};

/// The tokenizer part of a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys), as read from the file.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. "gemma4", "llama", "gpt2".
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges` ("a b").
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// The tokenizer models this module reads.
pub const SUPPORTED_MODELS: [&str; 1] = ["gemma4"];

// Token attributes (bit flags), as llama.cpp derives them from the token types.
const ATTR_UNKNOWN: u8 = 1 << 0;
const ATTR_UNUSED: u8 = 1 << 1;
const ATTR_NORMAL: u8 = 1 << 2;
const ATTR_CONTROL: u8 = 1 << 3;
const ATTR_USER_DEFINED: u8 = 1 << 4;
const ATTR_BYTE: u8 = 1 << 5;

/// Texts that end generation; llama.cpp makes such tokens control tokens whatever their type.
const END_OF_GENERATION_TEXTS: [&str; 22] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle texts by kind (prefix, suffix, middle, pad, repo, separator): the first token of each
/// kind found becomes a control token.
const FILL_IN_MIDDLE_TEXTS: [&[&str]; 6] = [
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    &["<|file_sep|>"],
];

/// Texts llama.cpp always renders (user-defined), whatever their type.
const ALWAYS_RENDERED_TEXTS: [&str; 4] = ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// A tokenizer for a GGUF vocabulary of model "gemma4" (SPM-style BPE over raw UTF-8 with `▁` for spaces).
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    texts: Vec<String>,
    attrs: Vec<u8>,
    /// Byte value of each byte token (attribute BYTE).
    byte_value: Vec<Option<u8>>,
    ids: HashMap<String, u32>,
    /// `"left right"` → merge rank.
    ranks: HashMap<String, u32>,
    /// `<0xNN>` token of each byte value.
    byte_token: [Option<u32>; 256],
    /// Tokens cut out of raw text before BPE (control, user-defined, unknown), longest first.
    specials: Vec<u32>,
    /// Distinct byte lengths of the special tokens' texts, and their first bytes.
    special_lengths: Vec<usize>,
    special_first: [bool; 256],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

/// Two neighbouring pieces of a word that a merge joins. Ordered by merge rank, then position (the derived
/// order), so that a min-heap yields the merge to apply next; the lengths recognize a pair that an earlier
/// merge has changed.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Pair {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
}

/// A piece of the input while special tokens are cut out: raw text (byte range) or a token.
#[derive(Clone, Copy)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

fn check_id(what: &str, id: Option<u32>, n: usize) -> Result<()> {
    if let Some(id) = id {
        if id as usize >= n {
            bail!("GGUF tokenizer: {what} token id {id} is out of range (the vocabulary has {n} tokens)");
        }
    }
    Ok(())
}

fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl GgufTokenizer {
    /// Build the tokenizer, checking the metadata; every error is one line.
    pub fn new(v: &GgufVocab) -> Result<GgufTokenizer> {
        if !SUPPORTED_MODELS.contains(&v.model.as_str()) {
            bail!(
                "tokenizer model {:?} in GGUF is not supported; tandem reads {} vocabularies",
                v.model,
                SUPPORTED_MODELS.join(", ")
            );
        }
        let n = v.tokens.len();
        if n == 0 {
            bail!("GGUF tokenizer: tokenizer.ggml.tokens is empty");
        }
        if u32::try_from(n).is_err() {
            bail!("GGUF tokenizer: {n} tokens are too many");
        }
        if let Some(s) = &v.scores {
            if s.len() != n {
                bail!("GGUF tokenizer: {} scores for {n} tokens", s.len());
            }
        }
        if let Some(t) = &v.token_types {
            if t.len() != n {
                bail!("GGUF tokenizer: {} token types for {n} tokens", t.len());
            }
        }
        for (what, id) in
            [("BOS", v.bos), ("EOS", v.eos), ("unknown", v.unk), ("padding", v.pad), ("mask", v.mask), ("EOT", v.eot)]
        {
            check_id(what, id, n)?;
        }
        let Some(merges) = &v.merges else {
            bail!("GGUF tokenizer: model {:?} needs tokenizer.ggml.merges, which the file lacks", v.model);
        };

        // Texts (an empty token gets a placeholder text, as llama.cpp does) and the text → id map, where a
        // later duplicate wins.
        let mut texts = Vec::with_capacity(n);
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in v.tokens.iter().enumerate() {
            let text = if t.is_empty() { format!("[EMPTY_{i}]") } else { t.clone() };
            ids.insert(text.clone(), i as u32);
            texts.push(text);
        }

        let mut attrs: Vec<u8> = match &v.token_types {
            None => vec![ATTR_NORMAL; n],
            Some(types) => types
                .iter()
                .map(|t| match t {
                    1 => ATTR_NORMAL,
                    2 => ATTR_UNKNOWN,
                    3 => ATTR_CONTROL,
                    4 => ATTR_USER_DEFINED,
                    5 => ATTR_UNUSED,
                    6 => ATTR_BYTE,
                    _ => 0,
                })
                .collect(),
        };

        // Type adjustments by text.
        for t in END_OF_GENERATION_TEXTS {
            if let Some(&id) = ids.get(t) {
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        let mut end_of_generation: Vec<u32> =
            END_OF_GENERATION_TEXTS.iter().filter_map(|t| ids.get(*t).copied()).collect();
        for kind in FILL_IN_MIDDLE_TEXTS {
            if let Some(id) = kind.iter().filter_map(|t| ids.get(*t).copied()).min() {
                attrs[id as usize] |= ATTR_CONTROL;
                end_of_generation.push(id);
            }
        }
        end_of_generation.extend(v.eos);
        end_of_generation.extend(v.eot);
        for t in ALWAYS_RENDERED_TEXTS {
            if let Some(&id) = ids.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        let eog_has = |t: &str| end_of_generation.iter().any(|&id| texts[id as usize] == t);
        let call = eog_has("<|call|>") || eog_has("<|calls|>");
        if eog_has("<|end|>") && call && (eog_has("<|return|>") || eog_has("<|flush|>")) {
            if let Some(&id) = ids.get("<|end|>") {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        if (eog_has("<|tool_response>") || eog_has("<|plamo:eos|>")) && eog_has("</s>") {
            if let Some(&id) = ids.get("</s>") {
                attrs[id as usize] = ATTR_NORMAL;
            }
        }

        let mut byte_value = vec![None; n];
        for (i, &a) in attrs.iter().enumerate() {
            if a & ATTR_BYTE != 0 {
                let Some(b) = parse_byte_token(&texts[i]) else {
                    bail!("GGUF tokenizer: token {i} {:?} has the byte type but is not of the form <0xNN>", texts[i]);
                };
                byte_value[i] = Some(b);
            }
        }
        let mut byte_token = [None; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }

        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
            let Some(at) = split.filter(|&at| at + 1 < m.len()) else {
                bail!("GGUF tokenizer: merge {rank} {m:?} is not of the form \"a b\"");
            };
            // The key is the merge as written: its left part never has a space past its first character, so
            // `left + " " + right` names one pair.
            let key = format!("{} {}", &m[..at], &m[at + 1..]);
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            ranks.entry(key).or_insert(rank);
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        specials.sort_by(|&a, &b| texts[b as usize].len().cmp(&texts[a as usize].len()).then(a.cmp(&b)));
        let mut special_lengths: Vec<usize> = specials.iter().map(|&i| texts[i as usize].len()).collect();
        special_lengths.dedup();
        let mut special_first = [false; 256];
        for &i in &specials {
            special_first[texts[i as usize].as_bytes()[0] as usize] = true;
        }

        let tok = GgufTokenizer {
            texts,
            attrs,
            byte_value,
            ids,
            ranks,
            byte_token,
            specials,
            special_lengths,
            special_first,
            bos: v.bos,
            eos: v.eos,
            // llama.cpp turns BOS on for this model whatever the file says.
            add_bos: true,
            add_eos: v.add_eos.unwrap_or(false),
        };
        Ok(tok)
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Whether `id` is a byte token (`<0xNN>` of the byte type).
    pub fn is_byte_token(&self, id: u32) -> bool {
        self.byte_value.get(id as usize).is_some_and(Option::is_some)
    }

    /// Whether `id` is a control or unknown token (left out when decoding without special tokens).
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & (ATTR_CONTROL | ATTR_UNKNOWN) != 0)
    }

    /// Token ids of `text`. `add_special` adds BOS (and EOS where the file asks for it); `parse_special`
    /// matches control and unknown tokens' text in `text` (user-defined tokens are always matched).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            let Some(bos) = self.bos else { bail!("cannot tokenize: the GGUF vocabulary has no BOS token id") };
            out.push(bos);
        }
        for frag in self.cut_specials(text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(a, b) => self.encode_text(&text[a..b], &mut out),
            }
        }
        if add_special && self.add_eos {
            let Some(eos) = self.eos else { bail!("cannot tokenize: the GGUF vocabulary has no EOS token id") };
            out.push(eos);
        }
        Ok(out)
    }

    /// Cut the special tokens out of `text`: for each special token, longest first, every occurrence in each
    /// remaining piece of raw text, left to right.
    fn cut_specials(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Text(0, text.len())];
        // Only special tokens that occur somewhere in the text can match in a piece of it.
        let present = self.specials_present(text);
        for &id in self.specials.iter().filter(|&&id| present.contains(self.texts[id as usize].as_str())) {
            if !parse_special && self.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let needle = self.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(mut a, b) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = text[a..b].find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(a, a + at));
                    }
                    next.push(Fragment::Token(id));
                    a += at + needle.len();
                }
                if a < b {
                    next.push(Fragment::Text(a, b));
                }
            }
            frags = next;
        }
        frags
    }

    /// The texts of special tokens that occur in `text` (and maybe of other tokens of the same lengths).
    fn specials_present<'t>(&self, text: &'t str) -> HashSet<&'t str> {
        let mut found = HashSet::new();
        for (i, &b) in text.as_bytes().iter().enumerate() {
            if !self.special_first[b as usize] {
                continue;
            }
            for &len in &self.special_lengths {
                if let Some(s) = text.get(i..i + len) {
                    if self.ids.contains_key(s) {
                        found.insert(s);
                    }
                }
            }
        }
        found
    }

    /// Tokens of a piece of raw text (no special tokens in it).
    fn encode_text(&self, raw: &str, out: &mut Vec<u32>) {
        let escaped = raw.replace(' ', "▁");
        let mut rest = escaped.as_str();
        while !rest.is_empty() {
            let newline = rest.starts_with('\n');
            let end = rest.find(|c: char| (c == '\n') != newline).unwrap_or(rest.len());
            let (word, tail) = rest.split_at(end);
            rest = tail;
            if newline {
                if let Some(&id) = self.ids.get(word) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_word(word, out);
        }
    }

    /// BPE over one word: start from its characters, merge the pair of lowest rank (leftmost on ties) until
    /// none is left, then map the pieces to tokens (bytes for a piece that is not one).
    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        struct Sym {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (k, (start, c)) in word.char_indices().enumerate() {
            syms.push(Sym { start, len: c.len_utf8(), prev: k.checked_sub(1), next: None });
            if k > 0 {
                syms[k - 1].next = Some(k);
            }
        }
        let mut heap: BinaryHeap<Reverse<Pair>> = BinaryHeap::new();
        let mut key = String::new();
        let push = |heap: &mut BinaryHeap<_>, key: &mut String, syms: &[Sym], l: usize, r: usize| {
            let (ls, rs) = (&syms[l], &syms[r]);
            key.clear();
            key.push_str(&word[ls.start..ls.start + ls.len]);
            key.push(' ');
            key.push_str(&word[rs.start..rs.start + rs.len]);
            if let Some(&rank) = self.ranks.get(key.as_str()) {
                heap.push(Reverse(Pair { rank, left: l, right: r, left_len: ls.len, right_len: rs.len }));
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &mut key, &syms, i - 1, i);
        }
        while let Some(Reverse(Pair { left: l, right: r, left_len: llen, right_len: rlen, .. })) = heap.pop() {
            if syms[l].len != llen || syms[r].len != rlen || llen == 0 || rlen == 0 {
                continue;
            }
            syms[l].len += rlen;
            syms[r].len = 0;
            let after = syms[r].next;
            syms[l].next = after;
            if let Some(a) = after {
                syms[a].prev = Some(l);
            }
            if let Some(p) = syms[l].prev {
                push(&mut heap, &mut key, &syms, p, l);
            }
            if let Some(a) = after {
                push(&mut heap, &mut key, &syms, l, a);
            }
        }
        for s in syms.iter().filter(|s| s.len > 0) {
            let piece = &word[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_token[b as usize])),
            }
        }
    }

    /// Text of `ids`: the pieces joined, a run of byte tokens as its UTF-8 text (one U+FFFD per byte when it
    /// is not valid UTF-8). With `skip_special`, control and unknown tokens are left out. An id out of range
    /// is an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut text = String::new();
        let mut bytes: Vec<u8> = Vec::new();
        let flush = |text: &mut String, bytes: &mut Vec<u8>| {
            match std::str::from_utf8(bytes) {
                Ok(s) => text.push_str(s),
                Err(_) => text.extend(std::iter::repeat_n('\u{FFFD}', bytes.len())),
            }
            bytes.clear();
        };
        for &id in ids {
            let Some(&attr) = self.attrs.get(id as usize) else {
                bail!("cannot decode: token id {id} is out of range (the vocabulary has {} tokens)", self.len());
            };
            if attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 && skip_special {
                continue;
            }
            let t = &self.texts[id as usize];
            if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED) != 0 {
                flush(&mut text, &mut bytes);
                text.push_str(t);
            } else if attr & ATTR_NORMAL != 0 {
                flush(&mut text, &mut bytes);
                text.push_str(&t.replace('▁', " "));
            } else if let Some(b) = self.byte_value[id as usize] {
                bytes.push(b);
            }
        }
        flush(&mut text, &mut bytes);
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[&str], types: &[i32], merges: &[&str]) -> GgufVocab {
        GgufVocab {
            model: "gemma4".into(),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            token_types: Some(types.to_vec()),
            merges: Some(merges.iter().map(|s| s.to_string()).collect()),
            bos: Some(1),
            eos: Some(2),
            ..Default::default()
        }
    }

    fn small() -> GgufTokenizer {
        let mut tokens = vec!["<pad>", "<bos>", "<eos>", "<|x|>", "a", "b", "ab", "▁", "▁ab", "\n", "\n\n", "<turn|>"];
        let mut types = vec![3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1];
        let bytes: Vec<String> = (0..=255).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(bytes.iter().map(String::as_str));
        types.extend(std::iter::repeat_n(6, 256));
        GgufTokenizer::new(&vocab(&tokens, &types, &["a b", "▁ ab"])).unwrap()
    }

    #[test]
    fn encodes_merges_specials_and_bytes() {
        let t = small();
        assert_eq!(t.encode("ab ab", true, true).unwrap(), vec![1, 6, 8]);
        assert_eq!(t.encode("", true, true).unwrap(), vec![1]);
        assert_eq!(t.encode("", false, true).unwrap(), Vec::<u32>::new());
        // `<bos>` is a control token: matched only with special parsing; `<|x|>` is user-defined: always.
        assert_eq!(t.encode("<bos><|x|>", false, true).unwrap(), vec![1, 3]);
        let plain = t.encode("<bos><|x|>", false, false).unwrap();
        assert_eq!(plain.last(), Some(&3));
        assert!(plain.len() > 2);
        // `<turn|>` is normal in the file but ends generation: a control token.
        assert_eq!(t.encode("<turn|>", false, true).unwrap(), vec![11]);
        assert!(t.is_special(11));
        // Newline runs taken whole when they are a token; "é" falls back to its bytes.
        assert_eq!(t.encode("\n\n", false, true).unwrap(), vec![10]);
        let e = t.encode("é", false, true).unwrap();
        assert!(e.iter().all(|&id| t.is_byte_token(id)) && e.len() == 2);
        assert_eq!(t.decode(&e, false).unwrap(), "é");
        assert_eq!(t.decode(&e[..1], false).unwrap(), "\u{FFFD}");
        assert_eq!(t.decode(&[1, 6, 8, 3, 2], false).unwrap(), "<bos>ab ab<|x|><eos>");
        assert_eq!(t.decode(&[1, 6, 8, 3, 2], true).unwrap(), "ab ab<|x|>");
        assert!(t.decode(&[9999], false).is_err());
    }

    #[test]
    fn rejects_malformed_metadata() {
        let ok = vocab(&["<pad>", "<bos>", "<eos>", "a"], &[3, 3, 3, 1], &[]);
        assert!(GgufTokenizer::new(&ok).is_ok());
        let cases: Vec<(GgufVocab, &str)> = vec![
            (GgufVocab { model: "llama".into(), ..ok.clone() }, "tokenizer model \"llama\" in GGUF is not supported"),
            (GgufVocab { token_types: Some(vec![1]), ..ok.clone() }, "1 token types for 4 tokens"),
            (GgufVocab { scores: Some(vec![0.0; 3]), ..ok.clone() }, "3 scores for 4 tokens"),
            (GgufVocab { bos: Some(7), ..ok.clone() }, "BOS token id 7 is out of range"),
            (GgufVocab { merges: Some(vec!["ab".into()]), ..ok.clone() }, "is not of the form"),
            (GgufVocab { merges: Some(vec![" a".into()]), ..ok.clone() }, "is not of the form"),
            (GgufVocab { merges: None, ..ok.clone() }, "needs tokenizer.ggml.merges"),
            (GgufVocab { tokens: vec![], token_types: None, ..ok.clone() }, "is empty"),
            (GgufVocab { token_types: Some(vec![3, 3, 6, 1]), ..ok.clone() }, "not of the form <0xNN>"),
        ];
        for (v, want) in cases {
            let e = GgufTokenizer::new(&v).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
            assert!(!e.contains('\n'), "{e:?}");
        }
    }
}
