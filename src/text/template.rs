//! Chat templates: the checkpoint's Jinja template rendered with minijinja the way transformers renders
//! it with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`,
//! `namespace`, its own `tojson`), plus what Python-flavoured templates expect from Jinja2: string, list
//! and dict methods (`split`, `strip`, `get`, `items`, …), Python's `str()` when printing values (`None`,
//! `True`, `1.0`, `1e+20`, `['a', 1]`), Python's whitespace for `trim`/`strip`, and Jinja2's tests where
//! minijinja differs (`sequence`, `number`).
//!
//! A template is code from the checkpoint, so rendering runs on a budget and every way out of it is a
//! one-line `chat template: ...` error, never a panic, an abort, a hang or exhausted memory:
//! - fuel ([`FUEL`], minijinja's `fuel` feature): about one unit per instruction executed and per 64 bytes
//!   of data created or iterated (strings, lists, output); builtins that can build large values (`indent`,
//!   `*`, `~`, `range`, `slice`, `batch`, `format`, `join`, `replace`, …) check the cost before
//!   they allocate, so fuel bounds both time (a fraction of a second) and memory (about `FUEL * 64` bytes);
//! - nesting depth: minijinja's recursion limit ([`RECURSION_LIMIT`]) for macros, loops and blocks, and
//!   [`MAX_VALUE_DEPTH`] levels for printing values, `tojson` and values stored in a namespace;
//! - size: the rendered text is at most [`MAX_OUTPUT_BYTES`], and a value printed with Python's `str()` or
//!   serialized by `tojson` at most [`MAX_VALUE_BYTES`]; `tojson`'s `indent` at most [`MAX_JSON_INDENT`];
//!   `str.format` widths and precisions at most [`MAX_FORMAT_WIDTH`] (minijinja does not charge for them);
//! - `loop.cycle()` with no items (minijinja divides by zero there) is an error, as in Jinja2;
//! - a namespace cannot be stored inside a namespace (`{% set ns.a = ns %}`), so no value refers to itself.
//!
//! The limits are far above what chat templates use: the Gemma 4 template renders a 1,500-message
//! conversation with tools (1.4 MB of text, more than a 256K-token context holds) on 0.31 M fuel, under
//! a tenth of [`FUEL`].

use std::fmt::Write as _;

use anyhow::{anyhow, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde_json::{Map, Value as Json};

const NAME: &str = "chat_template";

/// Fuel per render (see the module doc): about 256 MB of data at most.
pub const FUEL: u64 = 4_000_000;
/// minijinja's recursion budget (its own maximum is 500; loops and `if` count 1, macro calls about 10).
pub const RECURSION_LIMIT: usize = 300;
/// Largest rendered text, in bytes.
pub const MAX_OUTPUT_BYTES: usize = 64 << 20;
/// Largest value printed with `str()` or serialized by `tojson`, in bytes.
pub const MAX_VALUE_BYTES: usize = 16 << 20;
/// Deepest nesting of lists and maps printed or serialized.
pub const MAX_VALUE_DEPTH: usize = 128;
/// Largest width, precision or field number in a `str.format` replacement field.
pub const MAX_FORMAT_WIDTH: usize = 4096;
/// Largest `tojson` indent, in spaces.
pub const MAX_JSON_INDENT: usize = 256;

/// What `.cycle(` is renamed to, so the call reaches [`python_methods`] instead of minijinja's loop object.
const CYCLE_METHOD: &str = "_tandem_cycle";
/// What the value of a `{% set ns.attr = ... %}` is wrapped in (see [`no_namespace`]).
const NO_NAMESPACE_FN: &str = "_tandem_no_namespace";
const NO_NAMESPACE_OPEN: &str = "_tandem_no_namespace(";

pub struct ChatTemplate {
    env: Environment<'static>,
    fuel: u64,
}

/// What to render besides the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    /// Tool (function) schemas, as a JSON list.
    pub tools: Option<Json>,
    /// Further template variables (`enable_thinking`, …), as transformers passes `**kwargs`.
    pub extra: Map<String, Json>,
}

impl ChatTemplate {
    /// Compile a template. Jinja2's `{% generation %}` blocks (transformers' assistant-mask extension)
    /// render their body, as they do there.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::with_fuel(source, FUEL)
    }

    /// Like [`new`](Self::new) with another fuel budget per render (the fuzz targets use a small one).
    pub fn with_fuel(source: &str, fuel: u64) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .expect("default delimiters"),
        );
        env.set_fuel(Some(fuel));
        env.set_recursion_limit(RECURSION_LIMIT);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(|out, _state, value| {
            if !value.is_undefined() {
                out.write_str(&try_py_str(value)?)
                    .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write output"))?;
            }
            Ok(())
        });
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.add_filter("string", |v: Value| try_py_str(&v));
        env.add_test("sequence", |v: Value| {
            v.is_undefined() || matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::String)
        });
        env.add_test("number", |v: Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function(NO_NAMESPACE_FN, no_namespace);
        env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, std::time::SystemTime::now()));
        let source = rewrite_source(&rewrite_generation_blocks(source));
        env.add_template_owned(NAME, source).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        Ok(ChatTemplate { env, fuel })
    }

    /// Render `messages` (a JSON list of message objects) with the named special tokens (`bos_token`, …) as
    /// variables, exactly as `tokenizer.apply_chat_template(messages, tokenize=False, ...)` does.
    pub fn render(&self, messages: &Json, special_tokens: &[(String, String)], opts: &RenderOptions) -> Result<String> {
        let messages = alias_reasoning_fields(messages);
        let mut ctx = Map::new();
        for (k, v) in special_tokens {
            ctx.insert(k.clone(), Json::String(v.clone()));
        }
        ctx.extend(opts.extra.clone());
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), opts.tools.clone().unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), Json::Bool(opts.add_generation_prompt));
        let tmpl = self.env.get_template(NAME).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        let mut out = LimitedOutput { buf: Vec::new() };
        match tmpl.render_captured_to(Value::from(Serde(&ctx)), &mut out) {
            Ok(_) => String::from_utf8(out.buf).map_err(|_| anyhow!("chat template: output is not UTF-8")),
            Err(_) if out.buf.len() > MAX_OUTPUT_BYTES => {
                Err(anyhow!("chat template: output longer than {} MiB", MAX_OUTPUT_BYTES >> 20))
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(anyhow!(
                "chat template: out of fuel (the template ran longer or built more data than {} units allow)",
                self.fuel
            )),
            Err(e) => Err(anyhow!("chat template: {}", describe(&e))),
        }
    }
}

/// The rendered text, refusing to grow past [`MAX_OUTPUT_BYTES`].
struct LimitedOutput {
    buf: Vec<u8>,
}

impl std::io::Write for LimitedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > MAX_OUTPUT_BYTES {
            self.buf.resize(MAX_OUTPUT_BYTES + 1, 0);
            return Err(std::io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Two rewrites, found with minijinja's own lexer (so text, strings and comments are left alone):
/// `x.cycle(...)` → `x._tandem_cycle(...)` (see [`loop_cycle`]), and `{% set ns.a = EXPR %}` →
/// `{% set ns.a = _tandem_no_namespace(EXPR) %}` (see [`no_namespace`]). A template the lexer rejects is
/// returned as it is, for the compiler to report.
fn rewrite_source(source: &str) -> String {
    use minijinja::machinery::{tokenize, Token};
    let mut tokens = Vec::new();
    for t in tokenize(source, false, SyntaxConfig::default()) {
        match t {
            Ok(t) => tokens.push(t),
            Err(_) => return source.to_string(),
        }
    }
    // (byte offset, bytes to replace, text to put there), in source order.
    let mut edits: Vec<(usize, usize, &str)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i..] {
            [(Token::Dot, _), (Token::Ident("cycle"), span), (Token::ParenOpen, _), ..] => {
                let (start, end) = (span.start_offset as usize, span.end_offset as usize);
                edits.push((start, end - start, CYCLE_METHOD));
                i += 3;
            }
            [(Token::BlockStart, _), (Token::Ident("set"), _), ..] => {
                let body_end =
                    tokens[i..].iter().position(|t| matches!(t.0, Token::BlockEnd)).map_or(tokens.len(), |p| i + p);
                let body = &tokens[i + 2..body_end];
                if let Some(eq) = body.iter().position(|t| matches!(t.0, Token::Assign)) {
                    let dotted = body[..eq].iter().any(|t| matches!(t.0, Token::Dot));
                    if dotted && eq + 1 < body.len() && body_end < tokens.len() {
                        let (first, last) = (&body[eq + 1].1, &body[body.len() - 1].1);
                        edits.push((first.start_offset as usize, 0, NO_NAMESPACE_OPEN));
                        edits.push((last.end_offset as usize, 0, ")"));
                    }
                }
                i = body_end;
            }
            _ => i += 1,
        }
    }
    if edits.is_empty() {
        return source.to_string();
    }
    let mut out = String::with_capacity(source.len() + 32 * edits.len());
    let mut copied = 0;
    for (at, len, text) in edits {
        match source.get(copied..at) {
            Some(piece) if at + len <= source.len() => out.push_str(piece),
            _ => return source.to_string(),
        }
        out.push_str(text);
        copied = at + len;
    }
    out.push_str(&source[copied..]);
    out
}

/// A value stored in a namespace attribute: refused when it holds a namespace anywhere inside, so no
/// namespace can ever reach itself (minijinja prints, compares and hashes values by recursion, and a
/// self-referential value would overflow the stack). Jinja2 allows it; chat templates do not need it.
fn no_namespace(state: &State, args: Rest<Value>) -> Result<Value, Error> {
    fn visit(v: &Value, depth: usize, nodes: &mut u64) -> Result<(), Error> {
        *nodes += 1;
        if let Some(obj) = v.as_object() {
            if obj.type_name().ends_with("Namespace") {
                return Err(Error::new(ErrorKind::InvalidOperation, "a namespace cannot be stored inside a namespace"));
            }
        }
        if !matches!(v.kind(), ValueKind::Seq | ValueKind::Map) {
            return Ok(());
        }
        if depth >= MAX_VALUE_DEPTH {
            return Err(value_too_big("set"));
        }
        for item in v.try_iter()? {
            if v.kind() == ValueKind::Map {
                visit(&v.get_item(&item)?, depth + 1, nodes)?;
            }
            visit(&item, depth + 1, nodes)?;
        }
        Ok(())
    }
    let mut nodes = 0;
    for v in args.iter() {
        visit(v, 0, &mut nodes)?;
    }
    state.consume_fuel(nodes / 16)?;
    Ok(match args.len() {
        1 => args[0].clone(),
        _ => Value::from(args.0),
    })
}

/// Jinja2's `loop.cycle(*items)`: the item at the loop's index modulo their number.
fn loop_cycle(value: &Value, args: &[Value]) -> Result<Value, Error> {
    // minijinja's loop object is a map-like object with `index0`, `revindex0`, `depth0`, `first`, `last`.
    let attr = |name: &str| value.as_object().and_then(|_| value.get_attr(name).ok()).filter(|v| !v.is_undefined());
    let is_loop = ["revindex0", "depth0", "first", "last"].iter().all(|name| attr(name).is_some());
    let index0 = attr("index0").filter(|_| is_loop).and_then(|i| i.as_usize());
    let Some(index0) = index0 else {
        return Err(Error::new(ErrorKind::UnknownMethod, format!("{} has no method named cycle", value.kind())));
    };
    if args.is_empty() {
        return Err(Error::new(ErrorKind::InvalidOperation, "loop.cycle() needs at least one item"));
    }
    Ok(args[index0 % args.len()].clone())
}

/// A minijinja error on one line, with its cause when there is one.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(d) = e.detail() {
        if !s.contains(d) {
            s = format!("{s}: {d}");
        }
    }
    s.replace('\n', " ")
}

/// transformers copies a message's reasoning (`reasoning_content`, `thinking` or `reasoning`) to both
/// `thinking` (first) and `reasoning_content`.
fn alias_reasoning_fields(messages: &Json) -> Json {
    let Some(list) = messages.as_array() else { return messages.clone() };
    let out = list
        .iter()
        .map(|m| {
            let Some(obj) = m.as_object() else { return m.clone() };
            let reasoning = ["reasoning_content", "thinking", "reasoning"]
                .iter()
                .find_map(|k| obj.get(*k).filter(|v| !v.is_null()));
            match reasoning {
                None => m.clone(),
                Some(r) => {
                    let mut new = Map::new();
                    new.insert("thinking".into(), r.clone());
                    for (k, v) in obj {
                        new.insert(k.clone(), v.clone());
                    }
                    new.insert("reasoning_content".into(), r.clone());
                    Json::Object(new)
                }
            }
        })
        .collect();
    Json::Array(out)
}

/// `{% generation %}` … `{% endgeneration %}` → `{% if true %}` … `{% endif %}`, keeping whitespace control.
fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // `{%}` is not a tag that ends at once: look for the end after the opening `{%`.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = inner.strip_prefix('-').map_or(("", inner), |b| ("-", b));
        let (body, trail) = body.strip_suffix('-').map_or((body, ""), |b| (b, "-"));
        match body.trim() {
            "generation" => write!(out, "{{%{lead} if true {trail}%}}").unwrap(),
            "endgeneration" => write!(out, "{{%{lead} endif {trail}%}}").unwrap(),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

// ---------------------------------------------------------------------------------------------
// Python behaviour
// ---------------------------------------------------------------------------------------------

/// Python's `str.isspace()` characters (what `str.strip()` removes).
pub fn is_py_space(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\x0b' | '\x0c' | '\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}')
        || ('\u{2000}'..='\u{200a}').contains(&c)
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let s = if left { s.trim_start_matches(pred) } else { s };
    if right {
        s.trim_end_matches(pred)
    } else {
        s
    }
}

/// Jinja2's `trim(value, chars=None)`: Python's `str.strip`.
fn trim(value: Value, chars: Option<String>) -> Result<Value, Error> {
    let s = match value.as_str() {
        Some(s) => s.to_string(),
        None => try_py_str(&value)?,
    };
    Ok(Value::from(py_strip(&s, chars.as_deref(), true, true)))
}

/// String methods with Python's whitespace, then minijinja-contrib's Python methods.
fn python_methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if method == CYCLE_METHOD {
        return loop_cycle(value, args);
    }
    if let (Some(s), "format") = (value.as_str(), method) {
        check_format_widths(s)?;
    }
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [v] if v.is_none() => None,
            [v] => Some(
                v.as_str().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str"))?,
            ),
            _ => return Err(Error::from(ErrorKind::TooManyArguments)),
        };
        let (l, r) = match method {
            "strip" => (true, true),
            "lstrip" => (true, false),
            _ => (false, true),
        };
        return Ok(Value::from(py_strip(s, chars, l, r)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `str.format` pads to any width or precision it is given (`'{:>9999999999}'`) and minijinja does not
/// charge fuel for it, so numbers in replacement fields above [`MAX_FORMAT_WIDTH`] are refused.
fn check_format_widths(s: &str) -> Result<(), Error> {
    let bytes = s.as_bytes();
    let (mut depth, mut i) = (0usize, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'{' if depth == 0 && bytes.get(i + 1) == Some(&b'{') => i += 1,
            b'{' => depth += 1,
            b'}' if depth > 0 => depth -= 1,
            b'0'..=b'9' if depth > 0 => {
                let run = bytes[i..].iter().take_while(|b| b.is_ascii_digit()).count();
                let n: u128 = s[i..i + run].parse().unwrap_or(u128::MAX);
                if n > MAX_FORMAT_WIDTH as u128 {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("format: width or precision above {MAX_FORMAT_WIDTH}"),
                    ));
                }
                i += run - 1;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4 ≤ |x| < 1e16.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{:e}", x.abs()); // e.g. "1.2345e3", "5e-1"
    let (mant, exp) = sci.split_once('e').expect("scientific format");
    let exp: i32 = exp.parse().expect("exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let decpt = exp + 1; // position of the decimal point relative to the digits
    let n = digits.len() as i32;
    let body = if decpt <= -4 || decpt > 16 {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits.clone() };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    } else if decpt <= 0 {
        format!("0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        format!("{}.{}", &digits[..decpt as usize], &digits[decpt as usize..])
    };
    format!("{sign}{body}")
}

/// Python's `str(x)` of a template value (what Jinja2 prints for `{{ x }}`); values nested deeper than
/// [`MAX_VALUE_DEPTH`] or longer than [`MAX_VALUE_BYTES`] print as `...`.
pub fn py_str(v: &Value) -> String {
    try_py_str(v).unwrap_or_else(|_| "...".into())
}

/// Python's `repr(x)`, with `py_str`'s limits.
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    match repr_into(&mut out, v, 0) {
        Ok(()) => out,
        Err(_) => "...".into(),
    }
}

/// `str(x)`, or an error past [`MAX_VALUE_DEPTH`] / [`MAX_VALUE_BYTES`].
fn try_py_str(v: &Value) -> Result<String, Error> {
    match v.kind() {
        ValueKind::String => Ok(v.as_str().unwrap_or_default().to_string()),
        _ => {
            let mut out = String::new();
            repr_into(&mut out, v, 0)?;
            Ok(out)
        }
    }
}

fn value_too_big(what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "{what}: value nested deeper than {MAX_VALUE_DEPTH} levels or longer than {} MiB",
            MAX_VALUE_BYTES >> 20
        ),
    )
}

/// Appends `repr(v)`. Every value visited appends at least one byte, so the size check bounds the work too
/// (a list holding itself many times over stops at the limit).
fn repr_into(out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
    if depth > MAX_VALUE_DEPTH || out.len() > MAX_VALUE_BYTES {
        return Err(value_too_big("str()"));
    }
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if !v.is_integer() => {
            out.push_str(&f64::try_from(v.clone()).map(py_float_repr).unwrap_or_else(|_| v.to_string()))
        }
        ValueKind::Number => write!(out, "{v}").unwrap(),
        ValueKind::String => out.push_str(&py_str_repr(v.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = v.try_iter() {
                for (i, x) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(out, &x, depth + 1)?;
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    let val = v.get_item(&k).unwrap_or(Value::UNDEFINED);
                    repr_into(out, &k, depth + 1)?;
                    out.push_str(": ");
                    repr_into(out, &val, depth + 1)?;
                }
            }
            out.push('}');
        }
        _ => write!(out, "{v}").unwrap(),
    }
    if out.len() > MAX_VALUE_BYTES {
        return Err(value_too_big("str()"));
    }
    Ok(())
}

/// Whether Python's `str.isprintable()` holds for `c` (an approximation without Unicode tables: controls,
/// separators other than space, format characters and private use are not printable).
fn py_printable(c: char) -> bool {
    let u = c as u32;
    !(u < 0x20
        || (0x7f..=0xa0).contains(&u)
        || u == 0xad
        || u == 0x1680
        || (0x2000..=0x200f).contains(&u)
        || (0x2028..=0x202f).contains(&u)
        || (0x205f..=0x2064).contains(&u)
        || u == 0x3000
        || u == 0xfeff
        || (0xe000..=0xf8ff).contains(&u)
        || u >= 0xf0000)
}

fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => write!(out, "\\x{:02x}", c as u32).unwrap(),
            c if (c as u32) < 0x10000 => write!(out, "\\u{:04x}", c as u32).unwrap(),
            c => write!(out, "\\U{:08x}", c as u32).unwrap(),
        }
    }
    out.push(quote);
    out
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` (positional arguments in that order, or keywords).
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let pos = |i: usize| args.get(i).cloned();
    let ensure_ascii =
        kwargs.get::<Option<bool>>("ensure_ascii")?.or_else(|| pos(0).map(|v| v.is_true())).unwrap_or(false);
    let indent_v = kwargs.get::<Option<Value>>("indent")?.or_else(|| pos(1));
    let separators = kwargs.get::<Option<Value>>("separators")?.or_else(|| pos(2));
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.or_else(|| pos(3).map(|v| v.is_true())).unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match &indent_v {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = v.as_i64().unwrap_or(0).max(0);
            if n > MAX_JSON_INDENT as i64 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent larger than {MAX_JSON_INDENT}"),
                ));
            }
            Some(" ".repeat(n as usize))
        }
    };
    let (item_sep, key_sep) = match &separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let a = v.get_item_by_index(0).ok().and_then(|x| x.as_str().map(str::to_string));
            let b = v.get_item_by_index(1).ok().and_then(|x| x.as_str().map(str::to_string));
            match (a, b) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
            }
        }
        _ => (if indent.is_some() { ",".into() } else { ", ".into() }, ": ".into()),
    };
    let opts = JsonOpts { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap(),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    write!(out, "\\u{:04x}", unit).unwrap();
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => py_repr(k),
        _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: keys must be str, int, float, bool or None")),
    })
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, level: usize) -> Result<(), Error> {
    if level > MAX_VALUE_DEPTH || out.len() > MAX_VALUE_BYTES {
        return Err(value_too_big("tojson"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if !v.is_integer() => {
            let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
            out.push_str(&if f.is_nan() {
                "NaN".into()
            } else if f.is_infinite() {
                if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
            } else {
                py_float_repr(f)
            });
        }
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => json_string(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                write_json(out, item, o, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                pairs.push((json_key(&k)?, val));
            }
            if o.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                json_string(out, k, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, val, o, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize {}", v.kind()))),
    }
    Ok(())
}

/// `strftime_now(format)` for templates that print today's date, in UTC: `%Y %m %d %e %H %M %S %y %B %b
/// %A %a %j %p %I %%` and `%-d`-style unpadded variants.
fn strftime_utc(fmt: &str, now: std::time::SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let secs = now.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |v: i64, w: usize| if unpadded { v.to_string() } else { format!("{v:0w$}") };
        match spec {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y % 100, 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&num(h, 2)),
            Some('I') => out.push_str(&num(if h % 12 == 0 { 12 } else { h % 12 }, 2)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&num(mi, 2)),
            Some('S') => out.push_str(&num(s, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (21.5, "21.5"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (123456789.125, "123456789.125"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e300, "1.5e+300"),
        ] {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn python_str_of_values() {
        let v = Value::from(Serde(serde_json::json!(["a", 1, null, true, 1.5, {"k": "it's"}])));
        assert_eq!(py_str(&v), "['a', 1, None, True, 1.5, {'k': \"it's\"}]");
        assert_eq!(py_str(&Value::from("x\ny")), "x\ny");
        assert_eq!(py_repr(&Value::from("x\ny\u{0}")), "'x\\ny\\x00'");
    }

    #[test]
    fn strftime_known_date() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_709_251_199); // 2024-02-29 23:59:59 UTC
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j %-d %%", t), "2024-02-29 23:59:59 Thu Feb 060 29 %");
        assert_eq!(strftime_utc("%d %B %Y", std::time::UNIX_EPOCH), "01 January 1970");
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration -%}{% endfor %}",
        )
        .unwrap();
        let out =
            t.render(&serde_json::json!([{"role": "user", "content": "hi"}]), &[], &RenderOptions::default()).unwrap();
        assert_eq!(out, "[hi]");
    }

    #[test]
    fn generation_rewrite_survives_odd_tags() {
        // `{%}` once made the rewrite slice a string backwards (found by the template fuzz target).
        for src in ["{%}", "{%}}", "{%-}", "x{%", "{% generation -%}{%}"] {
            let _ = rewrite_generation_blocks(src);
            assert!(ChatTemplate::new(src).is_err(), "{src}");
        }
    }

    #[test]
    fn python_compatibility() {
        let t = ChatTemplate::new(concat!(
            "{{ '  a b  '.strip() }}|{{ 'a,b'.split(',') }}|{{ {'x': 1}.get('y', 'd') }}|{{ none }}|{{ true }}|",
            "{{ 3.0 }}|{{ [1, 'a'] | tojson }}|{{ {'b': 1, 'a': [true, none]} | tojson(indent=2) }}|",
            "{{ ' \u{1f}x\u{1c} ' | trim }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ 'x' is sequence }}|",
            "{{ true is number }}|{% for k, v in {'b': 1, 'A': 2} | dictsort %}{{ k }}{% endfor %}|",
            "{{ ['a', 'b'] | map('upper') | list }}|{{ undefined_thing | default('dflt') }}|{{ none | default('x') }}"
        ))
        .unwrap();
        let out = t.render(&serde_json::json!([]), &[], &RenderOptions::default()).unwrap();
        assert_eq!(
            out,
            "a b|['a', 'b']|d|None|True|3.0|[1, \"a\"]|{\n  \"b\": 1,\n  \"a\": [\n    true,\n    null\n  ]\n}|x|\"\\u00e9\"|True|True|Ab|['A', 'B']|dflt|None"
        );
    }

    fn render_err(source: &str) -> String {
        let messages = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]);
        let t0 = std::time::Instant::now();
        let res = ChatTemplate::new(source).and_then(|t| t.render(&messages, &[], &RenderOptions::default()));
        assert!(t0.elapsed().as_secs_f64() < 5.0, "{source}: took {:?}", t0.elapsed());
        let err = match res {
            Ok(out) => panic!("{source}: rendered {} bytes", out.len()),
            Err(e) => e.to_string(),
        };
        assert!(err.starts_with("chat template: ") && !err.contains('\n'), "{source}: {err}");
        err
    }

    #[test]
    fn loop_cycle_without_items_is_an_error() {
        for src in [
            "{% for m in messages %}{{ loop.cycle() }}{% endfor %}",
            "{% for m in messages %}{{ loop . cycle ( ) }}{% endfor %}",
            "{% for m in messages %}{{ loop.cycle(*[]) }}{% endfor %}",
            "{% for m in messages %}{% set l = loop %}{{ l.cycle() }}{% endfor %}",
        ] {
            let err = render_err(src);
            assert!(err.contains("loop.cycle() needs at least one item"), "{src}: {err}");
        }
        // An empty loop never calls it; with items it works as in Jinja2, and text is left alone.
        let t = ChatTemplate::new("{% for x in [] %}{{ loop.cycle() }}{% endfor %}{% for m in messages %}{{ loop.cycle('a', 'b') }}{% endfor %}|.cycle(|{{ '.cycle()' }}").unwrap();
        let out = t.render(&serde_json::json!([1, 2, 3]), &[], &RenderOptions::default()).unwrap();
        assert_eq!(out, "aba|.cycle(|.cycle()");
        let err = render_err("{{ messages.cycle(1) }}");
        assert!(err.contains("has no method named cycle"), "{err}");
    }

    #[test]
    fn huge_values_are_errors() {
        for src in [
            "{{ ''|indent(9223372036854775807) }}",
            "{{ 'x\ny'|indent(9223372036854775807) }}",
            "{% set ns = namespace(s='ab') %}{% for i in range(80) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
            "{{ [1, 2, 3]|slice(9223372036854775807) }}",
            "{{ [1, 2, 3]|batch(9223372036854775807, 'x')|list|length }}",
            "{{ 'ab' * 9223372036854775807 }}",
            "{{ range(9223372036854775807)|list|length }}",
            "{{ '{:>9999999999}'.format(1) }}",
            "{{ 'a'.replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') * 99999999 }}",
            "{{ {'a': 1}|tojson(indent=9223372036854775807) }}",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
        ] {
            let err = render_err(src);
            assert!(
                err.contains("out of fuel") || err.contains("too") || err.contains("longer than") || err.contains("larger than") || err.contains("above"),
                "{src}: {err}"
            );
        }
    }

    #[test]
    fn set_inside_a_loop_stays_in_the_loop() {
        // As in Jinja2, `set` in a loop body does not outlive the iteration, so this does not double.
        let t = ChatTemplate::new("{% set s = 'ab' %}{% for i in range(80) %}{% set s = s ~ s %}{% endfor %}{{ s }}")
            .unwrap();
        assert_eq!(t.render(&serde_json::json!([]), &[], &RenderOptions::default()).unwrap(), "ab");
    }

    #[test]
    fn self_referential_values_are_errors() {
        for src in [
            "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns|string }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns|tojson }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = [ns, ns, ns, ns] %}{{ ns }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = [ns, ns, ns, ns] %}{{ ns|tojson }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns|trim }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = {'x': [1, {'y': ns}]} %}{{ ns|trim }}",
            "{% set n1 = namespace(a=1) %}{% set n2 = namespace(a=n1) %}{% set n1.a = n2 %}{{ n1 == n1 }}",
            "{% set ns = namespace(a=1) %}{% set ns.b, ns.a = 1, ns %}{{ ns }}",
            "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ','.join([ns]) }}",
        ] {
            let err = render_err(src);
            assert!(err.contains("a namespace cannot be stored inside a namespace"), "{src}: {err}");
        }
        // Lists and namespaces built up as usual still work.
        let t = ChatTemplate::new("{% set ns = namespace(l=[], n=0) %}{% for m in messages %}{% set ns.l = ns.l + [m] %}{% set ns.n, x = ns.n + 1, 2 %}{% endfor %}{{ ns.l|length }} {{ ns.n }}{% set ns.s %}a{% endset %}{{ ns.s }}").unwrap();
        assert_eq!(t.render(&serde_json::json!([1, 2, 3]), &[], &RenderOptions::default()).unwrap(), "3 3a");
        // Values nested deeper than the limit print as an error, not a stack overflow.
        for src in [
            "{% set ns = namespace(l=[]) %}{% for i in range(300) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}"
                .to_string(),
            "{{ ".to_string() + &"[".repeat(300) + &"]".repeat(300) + " }}",
        ] {
            let err = render_err(&src);
            assert!(err.contains("nested deeper than 128") || err.contains("recursion"), "{src}: {err}");
        }
        let src = "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}";
        let err = render_err(src);
        assert!(err.contains("a namespace cannot be stored inside a namespace"), "{src}: {err}");
    }

    #[test]
    fn deep_recursion_is_an_error() {
        let err = render_err("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert!(err.contains("recursion"), "{err}");
        let deep = "{% if true %}".repeat(2000) + &"{% endif %}".repeat(2000);
        render_err(&deep);
    }

    /// 1,500 messages with tool calls and tool results, 1.4 MB of text.
    fn long_conversation() -> (Json, Json) {
        let mut msgs = vec![serde_json::json!({"role": "system", "content": "You are helpful. ".repeat(50)})];
        for i in 0..1000 {
            let content = format!("message {i}: {}", "The quick brown fox jumps over the lazy dog. ".repeat(30));
            if i % 2 == 0 {
                msgs.push(serde_json::json!({"role": "user", "content": content}));
            } else {
                msgs.push(
                    serde_json::json!({"role": "assistant", "content": content, "tool_calls": [{"type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}}}]}),
                );
                msgs.push(serde_json::json!({"role": "tool", "name": "get_weather", "content": "sunny"}));
            }
        }
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"},
            "days": {"type": "array", "items": {"type": "integer"}},
            "opts": {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}}}, "required": ["city"]}}}]);
        (Json::Array(msgs), tools)
    }

    #[test]
    fn long_conversations_render_on_a_tenth_of_the_fuel() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut sources = vec![
            std::fs::read_to_string(dir.join("models/default/target/chat_template.jinja")).unwrap(),
            std::fs::read_to_string(dir.join("tests/fixtures/text-tiny/chat_template.jinja")).unwrap(),
        ];
        // The published Gemma 4 template, where this machine has a copy (it is not part of the repository).
        if let Ok(s) = std::fs::read_to_string("/work/shared/reference/gemma4-chat-template.jinja") {
            sources.push(s);
        }
        let (messages, tools) = long_conversation();
        let specials = [("bos_token".to_string(), "<bos>".to_string())];
        for src in &sources {
            let t = ChatTemplate::with_fuel(src, FUEL / 10).unwrap();
            let opts = RenderOptions { add_generation_prompt: true, tools: Some(tools.clone()), ..Default::default() };
            let out = t.render(&messages, &specials, &opts).unwrap();
            assert!(out.len() > 1_000_000, "{}", out.len());
        }
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no ' ~ 'way') }}").unwrap();
        let err = t.render(&serde_json::json!([]), &[], &RenderOptions::default()).unwrap_err().to_string();
        assert!(err.contains("no way"), "{err}");
    }
}
