//! Streaming text out of generated ids: an incremental detokenizer that only emits text once it is final
//! (never a broken UTF-8 sequence or half a byte-fallback character, never text twice), stop strings
//! (the stop text itself is not emitted), and hiding of thinking blocks (`<|channel>` … `<channel|>`).

use anyhow::Result;

use super::tokenizer::Decode;

/// Marks the start and end of a thinking block in Gemma 4 output.
pub const THINKING_OPEN: &str = "<|channel>";
pub const THINKING_CLOSE: &str = "<channel|>";

/// Incremental detokenizer. It decodes a short window of ids (from `prefix` on) and emits only what the
/// newest ids added to the window's text, once that text is final: not inside a run of byte-fallback
/// tokens (the decoder turns a whole run into UTF-8, or into U+FFFD per byte when any of it is invalid, so
/// even bytes that already form characters can change until the run ends) and not ending in U+FFFD (an
/// incomplete UTF-8 sequence, for decoders that do not mark their byte tokens). Everything emitted so far
/// is kept, so that a decoder whose window text does not extend its earlier text cannot make it print
/// twice. The emitted text always equals the decode of all ids once `finish` is called.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix: usize,
    /// End of the ids whose text has been emitted.
    read: usize,
    emitted: String,
}

impl IncrementalDecoder {
    pub fn new() -> IncrementalDecoder {
        IncrementalDecoder::default()
    }

    /// Add one id; returns the text that became final (often empty).
    pub fn push(&mut self, dec: &dyn Decode, id: u32) -> Result<String> {
        self.ids.push(id);
        if dec.is_byte_token(id) {
            return Ok(String::new());
        }
        let prefix_text = dec.decode_ids(&self.ids[self.prefix..self.read])?;
        let new_text = dec.decode_ids(&self.ids[self.prefix..])?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = if new_text.starts_with(&prefix_text) {
            new_text[prefix_text.len()..].to_string()
        } else {
            // The window's text changed under us: fall back to the whole decode, emitting only what extends
            // the text already printed.
            match self.full_extension(dec, false)? {
                Some(d) => d,
                None => return Ok(String::new()),
            }
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        self.emitted.push_str(&delta);
        Ok(delta)
    }

    /// No more ids: emit whatever is still held back (a trailing incomplete sequence decodes to U+FFFD).
    pub fn finish(&mut self, dec: &dyn Decode) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let delta = self.full_extension(dec, true)?.unwrap_or_default();
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        self.emitted.push_str(&delta);
        Ok(delta)
    }

    /// The part of the full decode past the emitted text, if the emitted text is a prefix of it (and, unless
    /// `at_end`, the full decode does not end in U+FFFD).
    fn full_extension(&self, dec: &dyn Decode, at_end: bool) -> Result<Option<String>> {
        let full = dec.decode_ids(&self.ids)?;
        if (!at_end && full.ends_with('\u{FFFD}')) || !full.starts_with(&self.emitted) {
            return Ok(None);
        }
        Ok(Some(full[self.emitted.len()..].to_string()))
    }

    /// All text emitted so far.
    pub fn text(&self) -> &str {
        &self.emitted
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// Split `pending` at the first occurrence of any pattern: `Found(before, after)`, or
/// `NotFound(safe, held)` where `held` is the longest suffix that could still grow into a pattern.
enum Scan<'a> {
    Found(&'a str, &'a str),
    NotFound(&'a str, &'a str),
}

fn scan<'a>(pending: &'a str, patterns: &[&str]) -> Scan<'a> {
    let mut best: Option<(usize, usize)> = None;
    for (i, p) in patterns.iter().enumerate() {
        if p.is_empty() {
            continue;
        }
        if let Some(pos) = pending.find(p) {
            if best.is_none_or(|(b, _)| pos < b) {
                best = Some((pos, i));
            }
        }
    }
    if let Some((pos, i)) = best {
        return Scan::Found(&pending[..pos], &pending[pos + patterns[i].len()..]);
    }
    // Hold back the longest suffix that is a proper prefix of some pattern.
    let mut hold = 0;
    for p in patterns {
        for (start, _) in pending.char_indices() {
            let suffix = &pending[start..];
            if suffix.len() < p.len() && p.starts_with(suffix) {
                hold = hold.max(suffix.len());
                break;
            }
        }
    }
    let cut = pending.len() - hold;
    Scan::NotFound(&pending[..cut], &pending[cut..])
}

/// Stop strings: text passes through until one of them appears; that string and everything after it are
/// dropped. Text that might be the start of a stop string is held back until it is decided.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Feed text; returns the text that is safe to pass on. After a stop string, returns empty text.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(text);
        let patterns: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        let (out, rest) = match scan(&self.pending, &patterns) {
            Scan::Found(before, _) => {
                self.stopped = true;
                (before.to_string(), String::new())
            }
            Scan::NotFound(safe, held) => (safe.to_string(), held.to_string()),
        };
        self.pending = rest;
        out
    }

    /// Whether a stop string has appeared.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The end of the text: whatever was held back is not a stop string after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Hides thinking blocks (`<|channel>` … `<channel|>`) unless `show`.
#[derive(Debug, Default)]
pub struct ThinkingFilter {
    show: bool,
    inside: bool,
    pending: String,
}

impl ThinkingFilter {
    pub fn new(show: bool) -> ThinkingFilter {
        ThinkingFilter { show, inside: false, pending: String::new() }
    }

    /// Feed text; returns the visible part.
    pub fn push(&mut self, text: &str) -> String {
        if self.show {
            return text.to_string();
        }
        self.pending.push_str(text);
        let mut out = String::new();
        loop {
            let marker = if self.inside { THINKING_CLOSE } else { THINKING_OPEN };
            let pending = std::mem::take(&mut self.pending);
            match scan(&pending, &[marker]) {
                Scan::Found(before, after) => {
                    if !self.inside {
                        out.push_str(before);
                    }
                    self.inside = !self.inside;
                    self.pending = after.to_string();
                }
                Scan::NotFound(safe, held) => {
                    if !self.inside {
                        out.push_str(safe);
                    }
                    self.pending = held.to_string();
                    return out;
                }
            }
        }
    }

    /// Whether the text so far ends inside a thinking block.
    pub fn inside(&self) -> bool {
        self.inside
    }

    /// The end of the text: flush what was held back (nothing, inside a hidden block).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        if self.inside && !self.show {
            String::new()
        } else {
            rest
        }
    }
}

/// What a caller of [`TextStream::push`] gets back.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text to show now.
    pub visible: String,
    /// Set when a stop string completed: how many of the pushed ids to keep (through the one that
    /// completed it).
    pub keep: Option<usize>,
}

/// The whole output path: ids → text (incremental) → stop strings → thinking filter.
pub struct TextStream<'a> {
    dec: &'a dyn Decode,
    skip_ids: Vec<u32>,
    decoder: IncrementalDecoder,
    stops: StopStrings,
    thinking: ThinkingFilter,
    /// The decoded text up to a stop string (thinking included).
    text: String,
}

impl<'a> TextStream<'a> {
    /// `skip_ids` (the end-of-sequence ids that end generation) are not decoded.
    pub fn new(dec: &'a dyn Decode, skip_ids: Vec<u32>, stops: Vec<String>, show_thinking: bool) -> TextStream<'a> {
        TextStream {
            dec,
            skip_ids,
            decoder: IncrementalDecoder::new(),
            stops: StopStrings::new(stops),
            thinking: ThinkingFilter::new(show_thinking),
            text: String::new(),
        }
    }

    /// Feed accepted ids (one, or a whole speculative run).
    pub fn push(&mut self, ids: &[u32]) -> Result<Pushed> {
        let mut out = Pushed::default();
        for (i, &id) in ids.iter().enumerate() {
            if self.stops.stopped() {
                break;
            }
            if self.skip_ids.contains(&id) {
                continue;
            }
            let delta = self.decoder.push(self.dec, id)?;
            let passed = self.stops.push(&delta);
            self.text.push_str(&passed);
            out.visible.push_str(&self.thinking.push(&passed));
            if self.stops.stopped() {
                out.keep = Some(i + 1);
            }
        }
        Ok(out)
    }

    /// The end of generation: flush everything held back.
    pub fn finish(&mut self) -> Result<String> {
        let mut visible = String::new();
        if !self.stops.stopped() {
            let delta = self.decoder.finish(self.dec)?;
            let mut passed = self.stops.push(&delta);
            if !self.stops.stopped() {
                passed.push_str(&self.stops.finish());
            }
            self.text.push_str(&passed);
            visible.push_str(&self.thinking.push(&passed));
        }
        visible.push_str(&self.thinking.finish());
        Ok(visible)
    }

    /// The decoded text so far (up to a stop string; thinking blocks included).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn stopped(&self) -> bool {
        self.stops.stopped()
    }

    /// Whether the text ends inside a hidden thinking block.
    pub fn inside_thinking(&self) -> bool {
        self.thinking.inside()
    }
}

/// Text made safe for a terminal: control characters other than newline and tab (escape sequences a
/// model could emit) become U+FFFD.
pub fn terminal_safe(s: &str) -> String {
    s.chars().map(|c| if c.is_control() && c != '\n' && c != '\t' { '\u{FFFD}' } else { c }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy decoder: ids < 256 are bytes, id 300 is "<sp>" (a special-looking token), others "·".
    struct Bytes;
    impl Decode for Bytes {
        fn decode_ids(&self, ids: &[u32]) -> Result<String> {
            let mut out = String::new();
            let mut buf = Vec::new();
            for &id in ids {
                if id < 256 {
                    buf.push(id as u8);
                    continue;
                }
                out.push_str(&String::from_utf8_lossy(&buf));
                buf.clear();
                out.push_str(if id == 300 { "<sp>" } else { "·" });
            }
            out.push_str(&String::from_utf8_lossy(&buf));
            Ok(out)
        }
    }

    fn stream_all(ids: &[u32]) -> Vec<String> {
        let mut d = IncrementalDecoder::new();
        let mut pieces: Vec<String> = ids.iter().map(|&id| d.push(&Bytes, id).unwrap()).collect();
        pieces.push(d.finish(&Bytes).unwrap());
        pieces
    }

    #[test]
    fn multibyte_characters_are_emitted_whole() {
        let text = "a中🙂é";
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        let pieces = stream_all(&ids);
        assert_eq!(pieces.concat(), text);
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "{pieces:?}");
        }
        assert_eq!(pieces.iter().filter(|p| !p.is_empty()).count(), 4);
    }

    /// Words that decode with a leading space, the first one stripped (SentencePiece decoders with a
    /// `Strip` step do this): the window text starts differently from the full text.
    struct Words;
    impl Decode for Words {
        fn decode_ids(&self, ids: &[u32]) -> Result<String> {
            let s: String = ids.iter().map(|i| format!(" w{i}")).collect();
            Ok(s.strip_prefix(' ').unwrap_or(&s).to_string())
        }
    }

    #[test]
    fn leading_space_stripping_decoders_stream_exactly() {
        let ids = [3, 1, 4, 1, 5];
        let mut d = IncrementalDecoder::new();
        let mut out = String::new();
        for id in ids {
            out.push_str(&d.push(&Words, id).unwrap());
        }
        out.push_str(&d.finish(&Words).unwrap());
        assert_eq!(out, "w3 w1 w4 w1 w5");
        assert_eq!(d.text(), out);
    }

    #[test]
    fn invalid_bytes_are_flushed_at_the_end() {
        let ids = [0x61, 0xF0, 0x9F, 0x62, 0xE4, 0xB8];
        let pieces = stream_all(&ids);
        assert_eq!(pieces.concat(), Bytes.decode_ids(&ids).unwrap());
        assert!(pieces.last().unwrap().ends_with('\u{FFFD}'));
        // A second finish adds nothing.
        let mut d = IncrementalDecoder::new();
        for id in ids {
            d.push(&Bytes, id).unwrap();
        }
        assert!(!d.finish(&Bytes).unwrap().is_empty());
        assert_eq!(d.finish(&Bytes).unwrap(), "");
    }

    #[test]
    fn stop_strings_hold_back_and_cut() {
        let mut s = StopStrings::new(vec!["END".into(), "<stop>".into()]);
        let mut out = String::new();
        for piece in ["Hello E", "N", "D? no, <st", "op> never"] {
            out.push_str(&s.push(piece));
        }
        assert_eq!(out, "Hello ");
        assert!(s.stopped());
        let mut s = StopStrings::new(vec!["END".into()]);
        let a = s.push("the EN");
        assert_eq!(a, "the ");
        assert_eq!(s.finish(), "EN");
    }

    #[test]
    fn thinking_is_hidden_across_splits() {
        let text = "<|channel>thought\nhidden<channel|>shown <|chan and more";
        for split in 1..text.len() {
            if !text.is_char_boundary(split) {
                continue;
            }
            let mut f = ThinkingFilter::new(false);
            let mut out = f.push(&text[..split]);
            out.push_str(&f.push(&text[split..]));
            out.push_str(&f.finish());
            assert_eq!(out, "shown <|chan and more", "split at {split}");
        }
        let mut f = ThinkingFilter::new(true);
        assert_eq!(f.push(text), text);
    }

    #[test]
    fn text_stream_reports_how_many_ids_to_keep() {
        let ids: Vec<u32> = "ab STOP cd".bytes().map(u32::from).collect();
        let mut ts = TextStream::new(&Bytes, vec![1], vec!["STOP".into()], false);
        let got = ts.push(&ids).unwrap();
        assert_eq!(got.visible, "ab ");
        assert_eq!(got.keep, Some(7));
        assert_eq!(ts.text(), "ab ");
        assert_eq!(ts.finish().unwrap(), "");
    }

    #[test]
    fn terminal_safety() {
        assert_eq!(terminal_safe("a\x1b[2Jb\n\tc\u{9b}"), "a\u{FFFD}[2Jb\n\tc\u{FFFD}");
    }
}
