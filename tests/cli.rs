//! The command line: the JSON contract, and a clear one-line error with a non-zero exit for bad input.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

fn tandem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("run tandem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn gen_args<'a>(dir: &'a Path, extra: &[&'a str]) -> Vec<String> {
    let mut v: Vec<String> =
        vec!["generate".into(), "--model".into(), dir.display().to_string(), "--prompt-ids".into(), "2,17,33".into()];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Run and expect failure with one line on stderr that contains `needle`.
fn expect_error(args: &[String], needle: &str) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _out, err) = tandem(&refs);
    assert_ne!(code, 0, "{args:?} should fail");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{args:?} panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() == 1, "{args:?}: expected one line, got {err:?}");
    assert!(err.contains(needle), "{args:?}: error {err:?} should mention {needle:?}");
}

#[test]
fn json_output_follows_the_contract() {
    let dir = fixture_dir("t1-f32");
    let args = gen_args(&dir, &["--max-new-tokens", "5", "--ignore-eos", "--json", "--top-logprobs", "3"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = tandem(&refs);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "stdout must be exactly one JSON object: {out:?}");
    let v: Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([2, 17, 33]));
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    assert!(v["text"].is_null());
    assert_eq!(v["finish_reason"], "length");
    let lp = v["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 5);
    for (entry, tok) in lp.iter().zip(v["tokens"].as_array().unwrap()) {
        assert_eq!(&entry["token"], tok);
        let top = entry["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(&top[0][0], tok);
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }
    for key in ["prompt_tokens", "generated_tokens", "prefill_tokens_per_s", "decode_tokens_per_s"] {
        assert!(v["stats"][key].is_number(), "stats.{key}");
    }
    // Without --top-logprobs there is no logprobs field.
    let args = gen_args(&dir, &["--max-new-tokens", "2", "--json"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, out, _) = tandem(&refs);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v.get("logprobs").is_none());
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let dir = fixture_dir("t2-moe");
    let run = |seed: &str| {
        let args = gen_args(
            &dir,
            &[
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--json",
                "--temperature",
                "1.0",
                "--top-p",
                "0.95",
                "--seed",
                seed,
            ],
        );
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = tandem(&refs);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Value>(out.trim()).unwrap()["tokens"].clone()
    };
    assert_eq!(run("42"), run("42"));
    assert_ne!(run("42"), run("43"));
}

#[test]
fn eos_stops_generation_unless_ignored() {
    // Greedy output of t1-f32 from the golden prompt; make its first repeated-free later token an eos id.
    let g = Golden::load("t1-f32");
    let want = g.ids("greedy_tokens");
    let dir = scratch_copy("t1-f32");
    let at = (1..want.len()).find(|&i| !want[..i].contains(&want[i])).unwrap();
    let eos = want[at];
    std::fs::write(dir.join("generation_config.json"), format!("{{\"eos_token_id\": [{eos}, 255]}}")).unwrap();
    let prompt = g.ids("greedy_prompt").iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let base =
        ["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &prompt, "--max-new-tokens", "10", "--json"];
    let (code, out, _) = tandem(&base);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(v["tokens"].as_array().unwrap().len(), at + 1);
    let mut ignoring = base.to_vec();
    ignoring.push("--ignore-eos");
    let v: Value = serde_json::from_str(tandem(&ignoring).1.trim()).unwrap();
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 10);
}

#[test]
fn context_limit_stops_with_a_message() {
    let dir = fixture_dir("t1-f32");
    let args = gen_args(&dir, &["--max-new-tokens", "50", "--ignore-eos", "--json", "--context", "10"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = tandem(&refs);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 7);
    assert_eq!(v["finish_reason"], "length");
    assert!(err.contains("context limit"), "{err}");
}

#[test]
fn bad_arguments_fail_cleanly() {
    let dir = fixture_dir("t1-f32");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (gen_args(Path::new("/nonexistent/model"), &[]), "does not exist"),
        (gen_args(&dir, &["--temperature", "-1"]), "temperature"),
        (gen_args(&dir, &["--top-p", "0"]), "top_p"),
        (gen_args(&dir, &["--top-p", "1.5"]), "top_p"),
        (gen_args(&dir, &["--min-p", "2"]), "min_p"),
        (gen_args(&dir, &["--repeat-penalty", "0"]), "repeat_penalty"),
        (gen_args(&dir, &["--context", "3"]), "context limit"),
        (gen_args(&dir, &["--context", "100000"]), "max_position_embeddings"),
        (
            vec!["generate".into(), "--model".into(), dir.display().to_string(), "--prompt-ids".into(), "2,999".into()],
            "999",
        ),
        (
            vec!["generate".into(), "--model".into(), dir.display().to_string(), "--prompt-ids".into(), "2,x".into()],
            "\"x\"",
        ),
        (
            vec!["generate".into(), "--model".into(), dir.display().to_string(), "--prompt-ids".into(), "".into()],
            "no token ids",
        ),
    ];
    for (args, needle) in cases {
        expect_error(&args, needle);
    }
    let mut threads = vec!["--threads".to_string(), "99999".into()];
    threads.extend(gen_args(&dir, &[]));
    expect_error(&threads, "--threads must be at most 1024");
    expect_error(&["bench".into(), "--layers".into(), "100".into()], "at most 35");
    expect_error(&["bench".into(), "--pair".into(), "--repeats".into(), "0".into()], "--repeats must be at least 1");
    expect_error(&gen_args(&dir, &["--system", "hi"]), "--system needs --chat");
    expect_error(&gen_args(&dir, &["--thinking"]), "--thinking needs --chat");
}

#[test]
fn broken_model_directories_fail_cleanly() {
    // Each case: (what to break, expected text in the error).
    type Breaker = fn(&Path);
    let cases: Vec<(Breaker, &str)> = vec![
        (|d| std::fs::remove_file(d.join("config.json")).unwrap(), "config.json"),
        (|d| std::fs::write(d.join("config.json"), "{\"model_type\": ").unwrap(), "malformed JSON"),
        (|d| std::fs::write(d.join("config.json"), "{\"model_type\": \"llama\"}").unwrap(), "model_type"),
        (|d| std::fs::remove_file(d.join("model.safetensors")).unwrap(), "no model.safetensors"),
        (
            |d| {
                let p = d.join("model.safetensors");
                let bytes = std::fs::read(&p).unwrap();
                std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
            },
            "truncated",
        ),
        (|d| std::fs::write(d.join("model.safetensors"), b"garbage").unwrap(), "safetensors"),
        (
            |d| {
                let p = d.join("config.json");
                let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                v["intermediate_size"] = 97.into();
                std::fs::write(&p, v.to_string()).unwrap();
            },
            "expected [97, 64]",
        ),
        (
            |d| {
                let p = d.join("config.json");
                let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                v["num_hidden_layers"] = 7.into();
                v["layer_types"].as_array_mut().unwrap().push("full_attention".into());
                std::fs::write(&p, v.to_string()).unwrap();
            },
            "the config declares 7 layers but the weights hold 6",
        ),
        (|d| std::fs::write(d.join("generation_config.json"), "[1,2").unwrap(), "generation_config.json"),
    ];
    for (breaker, needle) in cases {
        let dir = scratch_copy("t1-f32");
        breaker(&dir);
        expect_error(&gen_args(&dir, &[]), needle);
    }
    // A layer the weights lack, in a checkpoint with another prefix.
    let dir = scratch_copy("t3-dense");
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let text = &mut v["text_config"];
    text["num_hidden_layers"] = 7.into();
    text["layer_types"].as_array_mut().unwrap().push("full_attention".into());
    let full_geometry = text["per_layer_config"]["5"].clone();
    text["per_layer_config"]["6"] = full_geometry;
    std::fs::write(&p, v.to_string()).unwrap();
    expect_error(&gen_args(&dir, &[]), "the config declares 7 layers but the weights hold 6");
    // Sharded checkpoints: a missing shard, and an index naming a tensor its shard lacks.
    let dir = scratch_copy("t2-moe");
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    expect_error(&gen_args(&dir, &[]), "model-00002-of-00002.safetensors");
    let dir = scratch_copy("t2-moe");
    let p = dir.join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["weight_map"]["model.language_model.extra.weight"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&p, v.to_string()).unwrap();
    expect_error(&gen_args(&dir, &[]), "extra.weight");
}

#[test]
fn speculative_json_has_acceptance_statistics_and_trace() {
    let dir = fixture_dir("t1-f32");
    let assistant = fixture_dir("d1-centroid");
    let plain_args = gen_args(&dir, &["--max-new-tokens", "20", "--ignore-eos", "--json"]);
    let refs: Vec<&str> = plain_args.iter().map(String::as_str).collect();
    let plain: Value = serde_json::from_str(tandem(&refs).1.trim()).unwrap();
    let a = assistant.display().to_string();
    for extra in [vec!["--draft-tokens", "3"], vec!["--draft-tokens", "auto"], vec![]] {
        let mut args =
            gen_args(&dir, &["--max-new-tokens", "20", "--ignore-eos", "--json", "--trace", "--assistant", &a]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = tandem(&refs);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["tokens"], plain["tokens"], "drafting must not change greedy output ({extra:?})");
        let s = &v["stats"];
        for key in ["draft_rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_per_round"] {
            assert!(s[key].is_number(), "stats.{key} ({extra:?})");
        }
        assert!(s["accepted_per_position"].is_array());
        let rounds = v["rounds"].as_array().expect("--trace adds rounds");
        assert_eq!(rounds.len() as u64, s["draft_rounds"].as_u64().unwrap());
        let drafted: usize = rounds.iter().map(|r| r["drafted"].as_array().unwrap().len()).sum();
        assert_eq!(drafted as u64, s["drafted_tokens"].as_u64().unwrap());
    }
    // --no-draft: plain decoding even with an assistant.
    let args = gen_args(&dir, &["--max-new-tokens", "20", "--ignore-eos", "--json", "--assistant", &a, "--no-draft"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let v: Value = serde_json::from_str(tandem(&refs).1.trim()).unwrap();
    assert_eq!(v["tokens"], plain["tokens"]);
    assert!(v["stats"].get("draft_rounds").is_none());
    // The human summary reports acceptance.
    let args = gen_args(&dir, &["--max-new-tokens", "8", "--assistant", &a]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _, err) = tandem(&refs);
    assert_eq!(code, 0);
    assert!(err.contains("drafts accepted"), "{err}");
}

#[test]
fn mismatched_or_broken_assistants_fail_cleanly() {
    let target = fixture_dir("t5-e2b");
    let d1 = fixture_dir("d1-centroid").display().to_string();
    expect_error(&gen_args(&target, &["--assistant", &d1]), "KV heads");
    let t1 = fixture_dir("t1-f32");
    expect_error(&gen_args(&t1, &["--assistant", &d1, "--draft-tokens", "0"]), "--draft-tokens");
    expect_error(&gen_args(&t1, &["--assistant", &d1, "--draft-tokens", "lots"]), "--draft-tokens");
    expect_error(&gen_args(&t1, &["--draft-tokens", "3"]), "--assistant");
    expect_error(&gen_args(&t1, &["--assistant", "/nonexistent/drafter"]), "does not exist");
    // A target directory given as the assistant, and the flag/tensor disagreement of the head.
    expect_error(&gen_args(&t1, &["--assistant", t1.to_str().unwrap()]), "not an assistant");
    let dir = scratch_copy("d1-centroid");
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["use_ordered_embeddings"] = false.into();
    std::fs::write(&p, v.to_string()).unwrap();
    expect_error(&gen_args(&t1, &["--assistant", dir.to_str().unwrap()]), "use_ordered_embeddings");
    let dir = scratch_copy("d2-tied");
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["use_ordered_embeddings"] = true.into();
    std::fs::write(&p, v.to_string()).unwrap();
    expect_error(&gen_args(&t1, &["--assistant", dir.to_str().unwrap()]), "use_ordered_embeddings");
}

#[test]
fn pair_bench_reports_acceptance_and_identical_output() {
    let dir = std::env::temp_dir().join(format!("tandem-prompts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.json");
    std::fs::write(&prompts, r#"[{"text": "a", "ids": [2, 17, 33]}, [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]]"#)
        .unwrap();
    let t1 = fixture_dir("t1-f32").display().to_string();
    let d1 = fixture_dir("d1-centroid").display().to_string();
    let p = prompts.display().to_string();
    let args =
        ["bench", "--pair", "--model", &t1, "--assistant", &d1, "--prompts", &p, "--max-new-tokens", "12", "--json"];
    let (code, out, err) = tandem(&args);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["prompts"], 2);
    assert_eq!(v["generated_tokens"], 24);
    assert_eq!(v["identical_output"], true);
    for key in [
        "plain_decode_tokens_per_s",
        "speculative_decode_tokens_per_s",
        "speedup",
        "mean_accepted_per_round",
        "acceptance_rate",
        "round_other_ms",
    ] {
        assert!(v[key].is_number(), "{key}");
    }
    // Every round drafts and verifies, and the projection from those step times is a speed-up.
    for key in ["round_draft_ms", "round_verify_ms", "projected_speedup"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert_eq!(v["draft_tokens"], "4");
    assert_eq!(v["acceptance_by_position"].as_array().unwrap().len(), 4);
    // The draft length is the pair's own default as `generate` uses it (the drafter's
    // `num_assistant_tokens`, else auto), and --draft-tokens overrides it: a copy of d1-centroid saying
    // 3, then saying nothing.
    let d3 = dir.join("d1-three");
    std::fs::create_dir_all(&d3).unwrap();
    for e in std::fs::read_dir(fixture_dir("d1-centroid")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d3.join(e.file_name())).unwrap();
    }
    let gen = d3.join("generation_config.json");
    let mut g: Value = serde_json::from_str(&std::fs::read_to_string(&gen).unwrap()).unwrap();
    g["num_assistant_tokens"] = 3.into();
    std::fs::write(&gen, g.to_string()).unwrap();
    let d3s = d3.display().to_string();
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = args.to_vec();
        a[5] = &d3s;
        a.extend(["--repeats", "1"].iter().chain(extra));
        let (code, out, err) = tandem(&a);
        assert_eq!(code, 0, "{err}");
        let w: Value = serde_json::from_str(out.trim()).unwrap();
        (w["draft_tokens"].as_str().unwrap().to_string(), w["acceptance_by_position"].as_array().unwrap().len())
    };
    assert_eq!(run(&[]), ("3".to_string(), 3));
    assert_eq!(run(&["--draft-tokens", "2"]), ("2".to_string(), 2));
    g.as_object_mut().unwrap().remove("num_assistant_tokens");
    std::fs::write(&gen, g.to_string()).unwrap();
    assert_eq!(run(&[]).0, "auto");
    // Three passes by default: the speed-up is the median of theirs.
    let mut passes: Vec<f64> =
        v["speedup_by_repetition"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(passes.len(), 3);
    passes.sort_by(f64::total_cmp);
    assert_eq!(v["speedup"].as_f64().unwrap(), passes[1]);
    // Bad prompt files are one-line errors.
    std::fs::write(&prompts, r#"[{"text": "no ids"}]"#).unwrap();
    let (code, _, err) = tandem(&args);
    assert_ne!(code, 0);
    assert!(err.contains("no list of token ids") && err.lines().count() == 1, "{err}");
}

#[test]
fn bench_measures_a_checkpoint_through_the_engine() {
    let t1 = fixture_dir("t1-bf16").display().to_string();
    let d4 = fixture_dir("d4-trained").display().to_string();
    let pair = ["bench", "--model", &t1, "--assistant", &d4];
    let sizes = ["--prefill", "16", "--decode", "8", "--rows", "3", "--draft-steps", "2", "--json"];
    let args: Vec<&str> = pair.iter().chain(&sizes).copied().collect();
    let (code, out, err) = tandem(&args);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["model"].as_str().unwrap().contains("t1-bf16"), "{v}");
    for key in ["prefill_tokens_per_s", "decode_tokens_per_s", "draft_step_ms", "machine_read_gb_per_s"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert_eq!(v["rows"].as_array().unwrap().len(), 3);
    assert_eq!(v["draft_head"], "tied");
    let sp = &v["speculative"];
    assert_eq!(sp["draft_tokens"], "4");
    assert!(sp["decode_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0), "{sp}");
    // d4-trained was fitted to t1-bf16: its drafts are accepted.
    assert!(sp["mean_accepted_per_round"].as_f64().unwrap() > 0.5, "{sp}");
    assert_eq!(v["projected_speedup"].as_array().unwrap().len(), 2);
    // Without an assistant: no drafting figures; an assistant without a model is refused.
    let (code, out, err) =
        tandem(&["bench", "--model", &t1, "--prefill", "8", "--decode", "4", "--rows", "2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["speculative"].is_null() && v["draft_head"].is_null(), "{v}");
    expect_error(&["bench".into(), "--assistant".into(), d4.clone()], "--assistant needs --model");
}

#[test]
fn huge_page_copies_give_the_same_tokens_as_mapped_files() {
    let t1 = fixture_dir("t1-bf16");
    let d4 = fixture_dir("d4-trained").display().to_string();
    let extra = ["--assistant", &d4, "--max-new-tokens", "12", "--ignore-eos", "--json"];
    let mut args = gen_args(&t1, &extra);
    let run = |args: &[String]| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = tandem(&refs);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        v["tokens"].clone()
    };
    let mapped = run(&args);
    args.insert(0, "--huge-pages".into());
    assert_eq!(run(&args), mapped);
    assert_eq!(mapped.as_array().unwrap().len(), 12);
}

#[test]
fn quantize_flags_are_checked_and_a_quantized_run_reports_itself() {
    let dir = fixture_dir("t1-f32");
    expect_error(&gen_args(&dir, &["--quantize", "q3_k"]), "not a recipe tandem knows (q8_0, q4_0, q4_k_m)");
    expect_error(&gen_args(&dir, &["--quantize-assistant"]), "--quantize-assistant needs --quantize");
    let args = gen_args(&dir, &["--quantize", "q4_0", "--max-new-tokens", "4", "--json"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = tandem(&refs);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("quantized the model to q4_0:"), "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 4);
}
