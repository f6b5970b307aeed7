//! Text in, text out on the command line: `generate --prompt/--chat`, stop strings, the JSON `text`
//! field, the piped `chat` session, and one-line errors for text without a tokenizer.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::{fixture_dir, scratch_copy};
use serde_json::Value;
use tandem::text::TextTokenizer;

fn tandem(args: &[&str]) -> (i32, String, String) {
    tandem_with_input(args, None)
}

fn tandem_with_input(args: &[&str], input: Option<&str>) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tandem");
    {
        let mut stdin = child.stdin.take().unwrap();
        if let Some(text) = input {
            stdin.write_all(text.as_bytes()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn dir(name: &str) -> String {
    fixture_dir(name).display().to_string()
}

fn json_run(args: &[&str]) -> Value {
    let (code, out, err) = tandem(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {out:?}"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn generation_goldens() -> Vec<Value> {
    let path = fixture_dir("text-tiny").join("text_goldens.json");
    let g: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    g["generation"].as_array().unwrap().clone()
}

/// Greedy steps up to the first one whose top-1/top-2 margin is within fp noise.
fn reliable_steps(golden: &Value) -> usize {
    golden["margins"].as_array().unwrap().iter().position(|m| m.as_f64().unwrap() < 1e-3).unwrap_or(usize::MAX)
}

fn golden_args(g: &Value) -> Vec<String> {
    let mut a: Vec<String> = vec!["generate".into(), "--model".into(), dir("text-tiny")];
    if g["mode"] == "chat" {
        a.extend([
            "--system".into(),
            g["system"].as_str().unwrap().into(),
            "--chat".into(),
            g["user"].as_str().unwrap().into(),
        ]);
    } else {
        a.extend(["--prompt".into(), g["prompt"].as_str().unwrap().into()]);
    }
    let n = g["tokens"].as_array().unwrap().len().to_string();
    a.extend(["--ignore-eos".into(), "--max-new-tokens".into(), n]);
    a
}

#[test]
fn text_prompts_match_transformers_end_to_end() {
    for g in generation_goldens() {
        let base = golden_args(&g);
        for extra in
            [vec![], vec!["--assistant", "ASSISTANT"], vec!["--assistant", "ASSISTANT", "--draft-tokens", "auto"]]
        {
            let mut args: Vec<String> = base.clone();
            args.extend(
                extra.iter().map(|s| if *s == "ASSISTANT" { dir("text-tiny-assistant") } else { s.to_string() }),
            );
            args.push("--json".into());
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let v = json_run(&refs);
            assert_eq!(ids(&v["prompt_ids"]), ids(&g["prompt_ids"]), "{} prompt ids", g["mode"]);
            let want = ids(&g["tokens"]);
            let got = ids(&v["tokens"]);
            let n = reliable_steps(&g).min(want.len());
            assert_eq!(got[..n], want[..n], "{} tokens {extra:?}", g["mode"]);
            if n == want.len() {
                assert_eq!(v["text"], g["text"], "{} text {extra:?}", g["mode"]);
            }
            // Plain output: the same text on stdout, then a newline.
            args.pop();
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, err) = tandem(&refs);
            assert_eq!(code, 0, "{err}");
            assert_eq!(out, format!("{}\n", v["text"].as_str().unwrap()), "{extra:?}");
            assert!(err.contains("generated"), "{err}");
        }
    }
}

#[test]
fn stop_strings_cut_the_text_and_the_tokens() {
    let tok = TextTokenizer::load(&fixture_dir("text-tiny")).unwrap();
    for g in generation_goldens() {
        let golden_text = g["text"].as_str().unwrap();
        let tokens = ids(&g["tokens"]);
        // A stop string from the middle of the golden text (on char boundaries).
        let chars: Vec<(usize, char)> = golden_text.char_indices().collect();
        let (a, b) = (chars[chars.len() / 3].0, chars[chars.len() / 3 + 3].0);
        let stop = &golden_text[a..b];
        let cut = golden_text.find(stop).unwrap();
        // The token that completes the first occurrence ends the generation.
        let keep = (1..=tokens.len()).find(|&k| tok.decode(&tokens[..k], false).unwrap().contains(stop)).unwrap();
        for assistant in [false, true] {
            let mut args = golden_args(&g);
            args.extend(["--stop".into(), "NEVER-SEEN".into(), "--stop".into(), stop.to_string()]);
            if assistant {
                args.extend(["--assistant".into(), dir("text-tiny-assistant")]);
            }
            let mut json_args = args.clone();
            json_args.push("--json".into());
            let refs: Vec<&str> = json_args.iter().map(String::as_str).collect();
            let v = json_run(&refs);
            assert_eq!(v["text"].as_str().unwrap(), &golden_text[..cut], "stop {stop:?}");
            assert_eq!(ids(&v["tokens"]), tokens[..keep].to_vec(), "stop {stop:?}, assistant {assistant}");
            assert_eq!(v["finish_reason"], "stop");
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, _) = tandem(&refs);
            assert_eq!(code, 0);
            assert_eq!(out, format!("{}\n", &golden_text[..cut]));
        }
    }
}

#[test]
fn prompt_ids_get_a_text_field_when_there_is_a_tokenizer() {
    let v = json_run(&[
        "generate",
        "--model",
        &dir("text-tiny"),
        "--prompt-ids",
        "2,105,371",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]);
    let tok = TextTokenizer::load(&fixture_dir("text-tiny")).unwrap();
    assert_eq!(v["text"].as_str().unwrap(), tok.decode(&ids(&v["tokens"]), false).unwrap());
    // Plain output of --prompt-ids stays token ids.
    let (code, out, _) = tandem(&[
        "generate",
        "--model",
        &dir("text-tiny"),
        "--prompt-ids",
        "2,105,371",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ]);
    assert_eq!(code, 0);
    let printed: Vec<u32> = out.split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(printed, ids(&v["tokens"]));
    // Without a tokenizer the field stays null.
    let v =
        json_run(&["generate", "--model", &dir("t1-f32"), "--prompt-ids", "2,17", "--max-new-tokens", "2", "--json"]);
    assert!(v["text"].is_null());
}

#[test]
fn eos_ends_the_text_without_printing_it() {
    // This greedy reply ends with <eos> (id 1) after 7 tokens; generation_config.json lists [1, 106].
    let model = dir("text-tiny");
    let args = ["generate", "--model", &model, "--chat", "What?"];
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let v = json_run(&json_args);
    let tokens = ids(&v["tokens"]);
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(*tokens.last().unwrap(), 1, "{tokens:?}");
    let tok = TextTokenizer::load(&fixture_dir("text-tiny")).unwrap();
    let text = tok.decode(&tokens[..tokens.len() - 1], false).unwrap();
    assert_eq!(v["text"].as_str().unwrap(), text);
    let (code, out, _) = tandem(&args);
    assert_eq!(code, 0);
    assert_eq!(out, format!("{text}\n"));
    assert!(!out.contains("<eos>"));
    // With --ignore-eos the end-of-sequence token is text like any other.
    json_args.extend(["--ignore-eos", "--max-new-tokens", "7"]);
    let v = json_run(&json_args);
    assert_eq!(v["text"].as_str().unwrap(), format!("{text}<eos>"));
}

fn expect_error(args: &[&str], needle: &str) {
    let (code, _out, err) = tandem(args);
    assert_eq!(code, 1, "{args:?} should fail with status 1: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err:?}");
    assert!(lines[0].starts_with("error: "), "{err:?}");
    assert!(err.contains(needle), "{args:?}: {err:?} should mention {needle:?}");
}

#[test]
fn text_without_a_tokenizer_is_a_clear_error() {
    let t1 = dir("t1-f32");
    expect_error(
        &["generate", "--model", &t1, "--prompt", "hi"],
        &format!("text prompts need a tokenizer: {t1} has no tokenizer.json; use --prompt-ids"),
    );
    expect_error(&["generate", "--model", &t1, "--chat", "hi"], "--chat needs a tokenizer");
    expect_error(&["generate", "--model", &t1, "--prompt-ids", "2,3", "--stop", "x"], "--stop needs a tokenizer");
    expect_error(&["chat", "--model", &t1], "chat needs a tokenizer");
    // Not a model directory at all: that is the error, not the missing tokenizer.
    expect_error(&["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "does not exist");
}

#[test]
fn broken_text_setups_are_clear_errors() {
    let d = scratch_copy("text-tiny");
    std::fs::write(d.join("tokenizer.json"), "{ not json").unwrap();
    expect_error(&["generate", "--model", d.to_str().unwrap(), "--prompt", "hi"], "cannot load the tokenizer");
    // With token ids the run still works, without text.
    let (code, out, err) =
        tandem(&["generate", "--model", d.to_str().unwrap(), "--prompt-ids", "2,3", "--max-new-tokens", "2", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("warning"), "{err}");
    assert!(serde_json::from_str::<Value>(out.trim()).unwrap()["text"].is_null());

    let d = scratch_copy("text-tiny");
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();
    expect_error(&["generate", "--model", d.to_str().unwrap(), "--chat", "hi"], "has no chat template");
    // The template may also live in tokenizer_config.json.
    let tc_path = d.join("tokenizer_config.json");
    let mut tc: Value = serde_json::from_str(&std::fs::read_to_string(&tc_path).unwrap()).unwrap();
    tc["chat_template"] = Value::String("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into());
    std::fs::write(&tc_path, tc.to_string()).unwrap();
    let v = json_run(&["generate", "--model", d.to_str().unwrap(), "--chat", "hi", "--max-new-tokens", "1", "--json"]);
    let tok = TextTokenizer::load(&d).unwrap();
    assert_eq!(ids(&v["prompt_ids"]), tok.encode("<bos>hi", false).unwrap());
    // A template that fails to compile, or raises.
    tc["chat_template"] = Value::String("{% for %}".into());
    std::fs::write(&tc_path, tc.to_string()).unwrap();
    expect_error(&["generate", "--model", d.to_str().unwrap(), "--chat", "hi"], "chat template");
    tc["chat_template"] = Value::String("{{ raise_exception('only system messages') }}".into());
    std::fs::write(&tc_path, tc.to_string()).unwrap();
    expect_error(&["generate", "--model", d.to_str().unwrap(), "--chat", "hi"], "only system messages");

    // A tokenizer larger than the model's vocabulary.
    let d = scratch_copy("t1-f32");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir("text-tiny").join(f), d.join(f)).unwrap();
    }
    expect_error(&["generate", "--model", d.to_str().unwrap(), "--prompt", "hi"], "do not belong together");

    // A prompt longer than the context.
    expect_error(
        &["generate", "--model", &dir("text-tiny"), "--prompt", "a long prompt that does not fit", "--context", "4"],
        "context limit is 4",
    );
}

fn reply_of(args: &[&str]) -> String {
    let (code, out, err) = tandem(args);
    assert_eq!(code, 0, "{err}");
    out.strip_suffix('\n').unwrap().to_string()
}

#[test]
fn piped_chat_keeps_history_and_resets() {
    let model = dir("text-tiny");
    let common = ["--model", model.as_str(), "--max-new-tokens", "8", "--system", "Be brief."];
    let mut gen_args = vec!["generate", "--chat", "Hello"];
    gen_args.extend(common);
    let first = reply_of(&gen_args);
    let mut chat_args = vec!["chat"];
    chat_args.extend(common);
    let (code, out, err) =
        tandem_with_input(&chat_args, Some("Hello\nHello\n/reset\n\n/bogus\nHello\n/exit\nnever read\n"));
    assert_eq!(code, 0, "{err}");
    // The first reply equals generate --chat; after /reset the same question gets the same reply; the
    // second question sees the first exchange, so its prompt differs.
    assert!(out.starts_with(&format!("{first}\n")), "{out:?} vs {first:?}");
    assert!(out.ends_with(&format!("\n{first}\n")), "{out:?} vs {first:?}");
    let middle = &out[first.len() + 1..out.len() - first.len() - 1];
    assert_ne!(middle, format!("{first}\n"), "the second turn should see the history");
    assert_eq!(err.matches(" tokens, ").count(), 3, "one summary line per reply: {err}");
    assert!(err.contains("(conversation cleared)"), "{err}");
    assert!(err.contains("unknown command /bogus"), "{err}");
    assert!(!out.contains("> "), "no prompt marks when stdin is not a terminal: {out:?}");
    // End of input ends the session too.
    let (code, _, _) = tandem_with_input(&chat_args, Some("Hello\n"));
    assert_eq!(code, 0);
}

#[test]
fn piped_chat_with_an_assistant_gives_the_same_replies() {
    let model = dir("text-tiny");
    let assistant = dir("text-tiny-assistant");
    let input = "Hello\nWhat now?\n";
    let (c1, plain, e1) = tandem_with_input(&["chat", "--model", &model, "--max-new-tokens", "12"], Some(input));
    let (c2, spec, e2) = tandem_with_input(
        &["chat", "--model", &model, "--assistant", &assistant, "--max-new-tokens", "12"],
        Some(input),
    );
    assert_eq!((c1, c2), (0, 0), "{e1} {e2}");
    assert_eq!(plain, spec);
    assert!(e2.contains("drafts accepted"), "{e2}");
}

#[test]
fn chat_switches_drafting_per_reply() {
    let model = dir("text-tiny");
    let assistant = dir("text-tiny-assistant");
    let args = ["chat", "--model", model.as_str(), "--assistant", assistant.as_str(), "--max-new-tokens", "12"];
    let input = "Hello\n/draft off\n/reset\nHello\n/draft 3\n/reset\nHello\n/draft\n/draft 0\n/draft on\n";
    let (code, out, err) = tandem_with_input(&args, Some(input));
    assert_eq!(code, 0, "{err}");
    // The same question three times (drafting on, off, on with k = 3): the same reply each time.
    let replies: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(replies.len() % 3, 0, "{out:?}");
    let n = replies.len() / 3;
    assert!(replies[..n] == replies[n..2 * n] && replies[..n] == replies[2 * n..], "{out:?}");
    let summaries: Vec<&str> = err.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(summaries.len(), 3, "{err}");
    assert!(
        summaries[0].contains("drafts accepted")
            && !summaries[1].contains("drafts accepted")
            && summaries[2].contains("drafts accepted"),
        "{err}"
    );
    assert!(err.contains("(drafting off)") && err.matches("(drafting on, draft tokens 3)").count() == 3, "{err}");
    assert!(err.contains("error: /draft takes off, on, auto or a number"), "{err}");
    // Without an assistant there is nothing to switch.
    let (code, _, err) = tandem_with_input(&["chat", "--model", model.as_str()], Some("/draft on\n"));
    assert_eq!(code, 0);
    assert!(err.contains("error: /draft needs an assistant"), "{err}");
}

#[test]
fn chat_says_when_the_conversation_outgrows_the_context() {
    let model = dir("text-tiny");
    let args = ["chat", "--model", model.as_str(), "--max-new-tokens", "8", "--context", "40"];
    let (code, _, err) = tandem_with_input(&args, Some("Hello\nHello\nHello\nHello\n/reset\nHello\n"));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("context limit is 40: /reset starts over (or raise --context)"), "{err}");
    // After /reset the conversation fits again.
    assert!(err.trim_end().ends_with("length limit]") || err.trim_end().ends_with("end of turn]"), "{err}");
}
