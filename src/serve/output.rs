//! The model's raw reply text split the way the OpenAI API returns it: thinking
//! (`<|channel>thought ... <channel|>`) into `reasoning_content`, tool calls
//! (`<|tool_call>call:NAME{ARGS}<tool_call|>`) into `tool_calls` with JSON arguments, the rest into
//! `content`. It works on text as it streams, in any chunking: a marker split across chunks is held back
//! until it is decided (docs/serve.md).

use serde_json::{Map, Number, Value};

use crate::text::stream::{THINKING_CLOSE, THINKING_OPEN};

pub const TOOL_CALL_OPEN: &str = "<|tool_call>";
pub const TOOL_CALL_CLOSE: &str = "<tool_call|>";
/// Gemma 4's string delimiter inside tool-call arguments.
pub const STRING_DELIM: &str = "<|\"|>";
/// The channel name that opens a thinking block (dropped from the reasoning text).
const THOUGHT_HEAD: &str = "thought\n";

/// One parsed tool call: the function's name and its arguments as a JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What a piece of text adds to each part of the reply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }

    fn extend(&mut self, other: Delta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Content,
    /// Inside a thinking block; `head` while its channel name may still be arriving.
    Thinking {
        head: bool,
    },
    ToolCall,
}

/// The streaming splitter. `tools`: parse tool calls (when the request offered tools); without, their
/// text stays in `content`.
#[derive(Debug)]
pub struct OutputParser {
    state: State,
    pending: String,
    tools: bool,
}

/// The length of the longest suffix of `s` that is a proper prefix of one of `markers` (text that may
/// still become a marker).
fn held_suffix(s: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for m in markers {
        for n in (1..m.len().min(s.len() + 1)).rev() {
            if s.is_char_boundary(s.len() - n) && m.starts_with(&s[s.len() - n..]) {
                best = best.max(n);
                break;
            }
        }
    }
    best
}

impl OutputParser {
    pub fn new(tools: bool) -> OutputParser {
        OutputParser { state: State::Content, pending: String::new(), tools }
    }

    /// Feed text; returns what it adds (text that may still be part of a marker is held back).
    pub fn push(&mut self, text: &str) -> Delta {
        self.pending.push_str(text);
        let mut out = Delta::default();
        loop {
            let pending = std::mem::take(&mut self.pending);
            match self.state {
                State::Content => {
                    let mut markers = vec![THINKING_OPEN];
                    if self.tools {
                        markers.push(TOOL_CALL_OPEN);
                    }
                    let found = markers.iter().filter_map(|m| pending.find(m).map(|i| (i, *m))).min_by_key(|f| f.0);
                    match found {
                        Some((i, m)) => {
                            out.content.push_str(&pending[..i]);
                            self.pending = pending[i + m.len()..].to_string();
                            self.state =
                                if m == THINKING_OPEN { State::Thinking { head: true } } else { State::ToolCall };
                        }
                        None => {
                            let keep = held_suffix(&pending, &markers);
                            out.content.push_str(&pending[..pending.len() - keep]);
                            self.pending = pending[pending.len() - keep..].to_string();
                            return out;
                        }
                    }
                }
                State::Thinking { head: true } => {
                    if pending.len() < THOUGHT_HEAD.len() && THOUGHT_HEAD.starts_with(pending.as_str()) {
                        self.pending = pending;
                        return out;
                    }
                    self.pending = pending.strip_prefix(THOUGHT_HEAD).unwrap_or(&pending).to_string();
                    self.state = State::Thinking { head: false };
                }
                State::Thinking { head: false } => match pending.find(THINKING_CLOSE) {
                    Some(i) => {
                        out.reasoning.push_str(&pending[..i]);
                        self.pending = pending[i + THINKING_CLOSE.len()..].to_string();
                        self.state = State::Content;
                    }
                    None => {
                        let keep = held_suffix(&pending, &[THINKING_CLOSE]);
                        out.reasoning.push_str(&pending[..pending.len() - keep]);
                        self.pending = pending[pending.len() - keep..].to_string();
                        return out;
                    }
                },
                State::ToolCall => match pending.find(TOOL_CALL_CLOSE) {
                    Some(i) => {
                        let body = &pending[..i];
                        match parse_tool_call(body) {
                            Some(call) => out.tool_calls.push(call),
                            // Not a call we understand: keep its text, markers included, as content.
                            None => out.content.push_str(&format!("{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")),
                        }
                        self.pending = pending[i + TOOL_CALL_CLOSE.len()..].to_string();
                        self.state = State::Content;
                    }
                    None => {
                        self.pending = pending;
                        return out;
                    }
                },
            }
        }
    }

    /// The end of the text: whatever was held back. A tool call that never closed (the reply was cut
    /// short) comes back as content, markers included.
    pub fn finish(&mut self) -> Delta {
        let mut out = self.push("");
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Content => out.content.push_str(&rest),
            State::Thinking { .. } => out.reasoning.push_str(rest.strip_prefix(THOUGHT_HEAD).unwrap_or(&rest)),
            State::ToolCall => out.content.push_str(&format!("{TOOL_CALL_OPEN}{rest}")),
        }
        self.state = State::Content;
        out
    }

    /// Split a whole text at once.
    pub fn split(text: &str, tools: bool) -> Delta {
        let mut p = OutputParser::new(tools);
        let mut d = p.push(text);
        d.extend(p.finish());
        d
    }
}

/// `call:NAME{ARGS}` → the call, its arguments as JSON; `None` when it is not in that form.
pub fn parse_tool_call(body: &str) -> Option<ToolCall> {
    let rest = body.trim().strip_prefix("call:")?;
    let brace = rest.find('{')?;
    let name = rest[..brace].trim();
    if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '<' || c == '>') {
        return None;
    }
    let mut p = ArgParser { s: &rest[brace..], depth: 0 };
    let args = p.object(false)?;
    if !p.s.trim().is_empty() {
        return None;
    }
    Some(ToolCall { name: name.to_string(), arguments: Value::Object(args).to_string() })
}

/// Nesting the argument parser follows before it gives up (a hostile reply cannot overflow the stack).
const MAX_ARG_DEPTH: usize = 64;

/// Gemma 4's argument syntax (what its chat template writes with `format_argument`): strings between
/// `<|"|>` delimiters, `true`/`false`/`null`, numbers, `[a,b]`, `{key:value}` with bare or delimited keys.
struct ArgParser<'a> {
    s: &'a str,
    depth: usize,
}

impl ArgParser<'_> {
    fn skip_ws(&mut self) {
        self.s = self.s.trim_start();
    }

    fn eat(&mut self, t: &str) -> bool {
        self.skip_ws();
        match self.s.strip_prefix(t) {
            Some(r) => {
                self.s = r;
                true
            }
            None => false,
        }
    }

    fn string(&mut self) -> Option<String> {
        let r = self.s.strip_prefix(STRING_DELIM)?;
        let end = r.find(STRING_DELIM)?;
        self.s = &r[end + STRING_DELIM.len()..];
        Some(r[..end].to_string())
    }

    fn object(&mut self, _nested: bool) -> Option<Map<String, Value>> {
        self.depth += 1;
        if self.depth > MAX_ARG_DEPTH || !self.eat("{") {
            return None;
        }
        let mut m = Map::new();
        if self.eat("}") {
            self.depth -= 1;
            return Some(m);
        }
        loop {
            self.skip_ws();
            let key = if self.s.starts_with(STRING_DELIM) {
                self.string()?
            } else {
                let end = self.s.find(':')?;
                let k = self.s[..end].trim();
                if k.is_empty() || k.contains(['{', '}', '[', ']', ',']) {
                    return None;
                }
                self.s = &self.s[end..];
                k.to_string()
            };
            if !self.eat(":") {
                return None;
            }
            let v = self.value()?;
            m.insert(key, v);
            if self.eat(",") {
                continue;
            }
            if self.eat("}") {
                self.depth -= 1;
                return Some(m);
            }
            return None;
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        if self.s.starts_with(STRING_DELIM) {
            return self.string().map(Value::String);
        }
        if self.s.starts_with('{') {
            return self.object(true).map(Value::Object);
        }
        if self.eat("[") {
            self.depth += 1;
            if self.depth > MAX_ARG_DEPTH {
                return None;
            }
            let mut items = Vec::new();
            if !self.eat("]") {
                loop {
                    items.push(self.value()?);
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("]") {
                        break;
                    }
                    return None;
                }
            }
            self.depth -= 1;
            return Some(Value::Array(items));
        }
        let end = self.s.find([',', '}', ']']).unwrap_or(self.s.len());
        let word = self.s[..end].trim();
        self.s = &self.s[end..];
        match word {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            "null" | "None" => Some(Value::Null),
            w => {
                if let Ok(i) = w.parse::<i64>() {
                    Some(Value::Number(i.into()))
                } else {
                    w.parse::<f64>().ok().and_then(Number::from_f64).map(Value::Number)
                }
            }
        }
    }
}
