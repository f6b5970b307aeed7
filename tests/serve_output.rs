//! The reply splitter of `tandem serve` (thinking → `reasoning_content`, Gemma 4 tool calls → `tool_calls`)
//! on Gemma 4 output text, fed whole and in every chunking into two and three pieces: the result must not
//! depend on where the stream breaks.

use serde_json::{json, Value};
use tandem::serve::output::{parse_tool_call, Delta, OutputParser, ToolCall};

/// Text as Gemma 4 writes it (the tool call exactly as transformers rendered the Gemma 4 template's
/// `tool_calls` in tests/fixtures/text-tiny/text_goldens.json, case `tool_calls`).
const CALL: &str = "<|tool_call>call:get_weather{big:1e+20,days:3,hourly:true,location:<|\"|>Paris<|\"|>,nothing:None,\
options:{a:<|\"|>x<|\"|>,z:1},ratio:0.5,tags:[<|\"|>a<|\"|>,<|\"|>b<|\"|>]}<tool_call|>";

fn call_args() -> Value {
    json!({"location": "Paris", "days": 3, "ratio": 0.5, "big": 1e20, "hourly": true, "nothing": null,
        "tags": ["a", "b"], "options": {"z": 1, "a": "x"}})
}

fn char_bounds(s: &str) -> Vec<usize> {
    s.char_indices().map(|(i, _)| i).chain([s.len()]).collect()
}

/// Feed `text` cut at the given byte offsets.
fn feed(text: &str, cuts: &[usize], tools: bool) -> Delta {
    let mut p = OutputParser::new(tools);
    let mut out = Delta::default();
    let mut last = 0;
    for &c in cuts.iter().chain([&text.len()]) {
        let d = p.push(&text[last..c]);
        out.reasoning += &d.reasoning;
        out.content += &d.content;
        out.tool_calls.extend(d.tool_calls);
        last = c;
    }
    let d = p.finish();
    out.reasoning += &d.reasoning;
    out.content += &d.content;
    out.tool_calls.extend(d.tool_calls);
    out
}

/// Whole, then every cut into two pieces, then every cut into three (on a stride for long texts).
fn check_all_chunkings(text: &str, tools: bool, expected: &Delta) {
    assert_eq!(&OutputParser::split(text, tools), expected, "whole");
    let b = char_bounds(text);
    for &i in &b {
        assert_eq!(&feed(text, &[i], tools), expected, "cut at {i}");
    }
    let stride = (b.len() / 40).max(1);
    for &i in b.iter().step_by(stride) {
        for &j in b.iter().filter(|&&j| j >= i) {
            assert_eq!(&feed(text, &[i, j], tools), expected, "cuts at {i}, {j}");
        }
    }
}

fn delta(reasoning: &str, content: &str, calls: Vec<ToolCall>) -> Delta {
    Delta { reasoning: reasoning.into(), content: content.into(), tool_calls: calls }
}

#[test]
fn thinking_goes_to_reasoning_in_any_chunking() {
    let text = "<|channel>thought\nThe user wants a greeting. Keep it short.<channel|>Bonjour !";
    check_all_chunkings(text, false, &delta("The user wants a greeting. Keep it short.", "Bonjour !", vec![]));
    // An empty thought (the template's opening when thinking is off) leaves nothing behind.
    check_all_chunkings("<|channel>thought\n<channel|>Hi", false, &delta("", "Hi", vec![]));
    // A reply cut inside its thinking: all of it is reasoning.
    check_all_chunkings("<|channel>thought\nStill thinking", false, &delta("Still thinking", "", vec![]));
    // Text that only resembles a marker stays content.
    check_all_chunkings("a <|chan b <channel c", false, &delta("", "a <|chan b <channel c", vec![]));
    // Only the channel name with its newline is dropped.
    check_all_chunkings("é<|channel>thoughtless<channel|>ü", false, &delta("thoughtless", "éü", vec![]));
}

#[test]
fn tool_calls_are_parsed_in_any_chunking() {
    let call = parse_tool_call(&CALL["<|tool_call>".len()..CALL.len() - "<tool_call|>".len()]).unwrap();
    assert_eq!(call.name, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&call.arguments).unwrap(), call_args());
    let text = format!("<|channel>thought\nI need the weather tool.<channel|>Let me check.{CALL}");
    check_all_chunkings(&text, true, &delta("I need the weather tool.", "Let me check.", vec![call.clone()]));
    // Two calls in a row, one without arguments.
    let two = format!("{CALL}<|tool_call>call:current_time{{}}<tool_call|>");
    let time = ToolCall { name: "current_time".into(), arguments: "{}".into() };
    check_all_chunkings(&two, true, &delta("", "", vec![call.clone(), time]));
    // Without tools offered, the text stays content as written.
    check_all_chunkings(&text, false, &delta("I need the weather tool.", &format!("Let me check.{CALL}"), vec![]));
    // A call cut short by the length limit, or one that is not in the call syntax, comes back as content.
    let cut = &CALL[..40];
    check_all_chunkings(cut, true, &delta("", cut, vec![]));
    let junk = "<|tool_call>not a call<tool_call|>after";
    check_all_chunkings(junk, true, &delta("", junk, vec![]));
}

#[test]
fn tool_call_argument_syntax() {
    let args = |body: &str| parse_tool_call(body).map(|c| serde_json::from_str::<Value>(&c.arguments).unwrap());
    assert_eq!(args("call:f{}"), Some(json!({})));
    assert_eq!(
        args("call:f{a:-1.5,b:[],c:{},d:<|\"|>x, y: {z}<|\"|>}"),
        Some(json!({"a": -1.5, "b": [], "c": {}, "d": "x, y: {z}"}))
    );
    assert_eq!(args("call:f{<|\"|>key<|\"|>:false}"), Some(json!({"key": false})));
    for bad in ["f{}", "call:{}", "call:f", "call:f{a}", "call:f{a:1", "call:f{a:1}x", "call:f{a:[1,}", "call:f{a:zz}"]
    {
        assert_eq!(args(bad), None, "{bad}");
    }
    // Deep nesting is refused, not a stack overflow.
    let deep = format!("call:f{{a:{}1{}}}", "[".repeat(10_000), "]".repeat(10_000));
    assert_eq!(args(&deep), None);
}
