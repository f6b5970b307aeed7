//! Chat templates: the checkpoint's Jinja template rendered with minijinja the way transformers renders
//! it with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`,
//! `namespace`, its own `tojson`), plus what Python-flavoured templates expect from Jinja2: string, list
//! and dict methods (`split`, `strip`, `get`, `items`, …), Python's `str()` when printing values (`None`,
//! `True`, `1.0`, `1e+20`, `['a', 1]`), Python's whitespace for `trim`/`strip`, and Jinja2's tests where
//! minijinja differs (`sequence`, `number`).

use std::fmt::Write as _;

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Rest, Serde, ValueKind};
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde_json::{Map, Value as Json};

const NAME: &str = "chat_template";

pub struct ChatTemplate {
    env: Environment<'static>,
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
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .expect("default delimiters"),
        );
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(|out, _state, value| {
            if !value.is_undefined() {
                let _ = out.write_str(&py_str(value));
            }
            Ok(())
        });
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.add_filter("string", |v: Value| py_str(&v));
        env.add_test("sequence", |v: Value| v.is_undefined() || matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::String));
        env.add_test("number", |v: Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, std::time::SystemTime::now()));
        env.add_template_owned(NAME, rewrite_generation_blocks(source)).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        Ok(ChatTemplate { env })
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
        tmpl.render(Value::from(Serde(&ctx))).map_err(|e| anyhow!("chat template: {}", describe(&e)))
    }
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
            let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| obj.get(*k).filter(|v| !v.is_null()));
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
        let Some(end) = tag.find("%}") else {
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
    let s = value.as_str().map(str::to_string).unwrap_or_else(|| py_str(&value));
    Ok(Value::from(py_strip(&s, chars.as_deref(), true, true)))
}

/// String methods with Python's whitespace, then minijinja-contrib's Python methods.
fn python_methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [v] if v.is_none() => None,
            [v] => Some(v.as_str().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str"))?),
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

/// Python's `str(x)` of a template value (what Jinja2 prints for `{{ x }}`).
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr(x)`.
pub fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if !v.is_integer() => f64::try_from(v.clone()).map(py_float_repr).unwrap_or_else(|_| v.to_string()),
        ValueKind::Number => v.to_string(),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = v.try_iter().map(|it| it.map(|x| py_repr(&x)).collect()).unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let mut parts = Vec::new();
            if let Ok(keys) = v.try_iter() {
                for k in keys {
                    let val = v.get_item(&k).unwrap_or(Value::UNDEFINED);
                    parts.push(format!("{}: {}", py_repr(&k), py_repr(&val)));
                }
            }
            format!("{{{}}}", parts.join(", "))
        }
        _ => v.to_string(),
    }
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
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.or_else(|| pos(0).map(|v| v.is_true())).unwrap_or(false);
    let indent_v = kwargs.get::<Option<Value>>("indent")?.or_else(|| pos(1));
    let separators = kwargs.get::<Option<Value>>("separators")?.or_else(|| pos(2));
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.or_else(|| pos(3).map(|v| v.is_true())).unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match &indent_v {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
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
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
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
        let t = ChatTemplate::new("{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration -%}{% endfor %}").unwrap();
        let out = t.render(&serde_json::json!([{"role": "user", "content": "hi"}]), &[], &RenderOptions::default()).unwrap();
        assert_eq!(out, "[hi]");
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

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no ' ~ 'way') }}").unwrap();
        let err = t.render(&serde_json::json!([]), &[], &RenderOptions::default()).unwrap_err().to_string();
        assert!(err.contains("no way"), "{err}");
    }
}
