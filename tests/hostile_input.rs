//! Hostile input through the release binary: malformed checkpoints generated at test time from the
//! fixtures (truncations, bad offsets, wrong dtypes, NaN weights, FIFOs, devices, oversized dims), bad
//! command-line values, a closed or full stdout, and bad chat input. Every case must end with one specific
//! line on stderr and a non-zero exit (or, where the input is legitimate, a clean run), never a panic,
//! an abort or a hang.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fixture_dir, scratch_copy};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(60);

struct Run {
    code: i32,
    err: String,
}

/// Run the binary with `stdin`, killing it (and failing the test) if it outlives `TIMEOUT`.
fn run_with(args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tandem");
    let mut input = child.stdin.take().unwrap();
    let bytes = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&bytes);
    });
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > TIMEOUT {
            let _ = child.kill();
            panic!("{args:?} hung for {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = writer.join();
    let out = child.wait_with_output().unwrap();
    Run { code: out.status.code().unwrap_or(-1), err: String::from_utf8_lossy(&out.stderr).into() }
}

fn run(args: &[&str]) -> Run {
    run_with(args, &[], b"")
}

fn assert_no_crash(args: &[&str], r: &Run) {
    assert!(!r.err.contains("panicked") && !r.err.contains("RUST_BACKTRACE"), "{args:?} panicked: {}", r.err);
    assert!(r.code >= 0 && r.code != 101 && r.code != 134, "{args:?} crashed with {}: {}", r.code, r.err);
}

/// Expect exit status 1 and exactly one line on stderr, `error: ...`, containing `needle`.
fn expect_error(args: &[&str], needle: &str) {
    let r = run(args);
    assert_no_crash(args, &r);
    assert_eq!(r.code, 1, "{args:?} should fail with status 1: {}", r.err);
    let lines: Vec<&str> = r.err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {:?}", r.err);
    assert!(lines[0].starts_with("error: "), "{args:?}: {:?}", r.err);
    assert!(r.err.contains(needle), "{args:?}: error {:?} should mention {needle:?}", r.err);
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// A safetensors file as (header JSON, data bytes).
fn read_st(path: &Path) -> (Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), bytes[8 + n..].to_vec())
}

fn write_st(path: &Path, header: &Value, data: &[u8]) {
    let h = header.to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// Overwrite every element of an f32 tensor with `value`.
fn fill_f32(path: &Path, name: &str, value: f32) {
    let (header, mut data) = read_st(path);
    let off = header[name]["data_offsets"].as_array().unwrap();
    assert_eq!(header[name]["dtype"], "F32", "{name}");
    let (s, e) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
    for c in data[s..e].chunks_exact_mut(4) {
        c.copy_from_slice(&value.to_le_bytes());
    }
    write_st(path, &header, &data);
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

fn gen<'a>(dir: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["generate", "--model", dir, "--prompt-ids", "2,17,33", "--max-new-tokens", "4"];
    v.extend_from_slice(extra);
    v
}

/// Break a scratch copy of `fixture` with `breaker`, then expect `generate` on it to fail with `needle`.
fn broken(fixture: &str, needle: &str, breaker: impl FnOnce(&Path)) {
    let dir = scratch_copy(fixture);
    breaker(&dir);
    let d = dir.display().to_string();
    expect_error(&gen(&d, &[]), needle);
}

#[test]
fn oversized_or_overflowing_config_dims_are_refused_before_allocating() {
    let set = |k: &'static str, v: Value| move |d: &Path| edit_json(&d.join("config.json"), |c| c[k] = v);
    // 2^64 - 1 layers without layer_types was a capacity-overflow panic; 2^40 allocated a terabyte.
    let no_types = |n: u64| {
        move |d: &Path| {
            edit_json(&d.join("config.json"), |c| {
                c["num_hidden_layers"] = json!(n);
                c.as_object_mut().unwrap().remove("layer_types");
            })
        }
    };
    broken(
        "t1-f32",
        "num_hidden_layers` is 18446744073709551615; tandem runs models of at most 4096 layers",
        no_types(u64::MAX),
    );
    broken("t1-f32", "num_hidden_layers` is 1099511627776", no_types(1 << 40));
    broken("t1-f32", "num_hidden_layers` is 1000000000", no_types(1_000_000_000));
    // 2 x (2^63 + 8) wrapped to 16 and was reported as a shape mismatch against the wrapped shape.
    broken(
        "t1-f32",
        "moe_intermediate_size = 9223372036854775816",
        set("moe_intermediate_size", json!(9223372036854775816u64)),
    );
    broken("t1-f32", "hidden_size = 1099511627776", set("hidden_size", json!(1u64 << 40)));
    broken("t1-f32", "vocab_size_per_layer_input", set("vocab_size_per_layer_input", json!(1u64 << 50)));
    // More layers than the weights hold: said before any layer is built.
    broken("t1-f32", "the config declares 12 layers but the weights hold 6", |d| {
        edit_json(&d.join("config.json"), |c| {
            c["num_hidden_layers"] = json!(12);
            let types = c["layer_types"].as_array().unwrap().clone();
            c["layer_types"] = json!([types.clone(), types].concat());
        })
    });
}

#[test]
fn config_floats_that_break_f32_are_refused() {
    for cap in [json!(1e308), json!(1e-46), json!(0.0)] {
        broken("t1-f32", "final_logit_softcapping", |d| {
            edit_json(&d.join("config.json"), |c| c["final_logit_softcapping"] = cap)
        });
    }
    broken("t1-f32", "rms_norm_eps", |d| edit_json(&d.join("config.json"), |c| c["rms_norm_eps"] = json!(1e-50)));
    broken("t1-f32", "rope_theta", |d| {
        edit_json(&d.join("config.json"), |c| c["rope_parameters"]["sliding_attention"]["rope_theta"] = json!(1e300))
    });
}

#[test]
fn null_layer_types_explain_the_default_pattern() {
    // 4 layers by the default pattern are sliding, sliding, sliding, full: sharing 2 leaves no full store.
    broken("t1-f32", "default pattern", |d| {
        edit_json(&d.join("config.json"), |c| {
            c["num_hidden_layers"] = json!(4);
            c["layer_types"] = Value::Null;
        })
    });
}

#[test]
fn malformed_safetensors_get_specific_errors() {
    let st = |d: &Path| d.join("model.safetensors");
    broken("t1-f32", "truncated: the header describes", |d| {
        let b = std::fs::read(st(d)).unwrap();
        std::fs::write(st(d), &b[..b.len() - 1]).unwrap();
    });
    broken("t1-f32", "1 unexpected bytes after the last tensor", |d| {
        let mut b = std::fs::read(st(d)).unwrap();
        b.push(0);
        std::fs::write(st(d), b).unwrap();
    });
    broken("t1-f32", "shorter than the 8-byte header length", |d| std::fs::write(st(d), b"abc").unwrap());
    broken("t1-f32", "header length runs past the end of the file", |d| {
        std::fs::write(st(d), [0xff, 0xff, 0, 0, 0, 0, 0, 0, b'{']).unwrap()
    });
    broken("t1-f32", "over 100 MB", |d| std::fs::write(st(d), u64::MAX.to_le_bytes()).unwrap());
    broken("t1-f32", "not a valid safetensors JSON table", |d| {
        let h = b"[1,2]";
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h);
        std::fs::write(st(d), b).unwrap();
    });
    broken("t1-f32", "not UTF-8 text", |d| std::fs::write(st(d), [2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]).unwrap());
    // Offsets that overlap the previous tensor's data.
    broken("t1-f32", "data_offsets do not follow the previous tensor's", |d| {
        let (mut h, data) = read_st(&st(d));
        let name = h.as_object().unwrap().keys().find(|k| *k != "__metadata__").unwrap().clone();
        let end = h[&name]["data_offsets"][1].as_u64().unwrap();
        h[&name]["data_offsets"] = json!([4, end]);
        write_st(&st(d), &h, &data);
    });
    // A shape that does not match the bytes its offsets hold: the error names the tensor.
    broken("t1-f32", "which do not hold its shape", |d| {
        let (mut h, data) = read_st(&st(d));
        h["model.norm.weight"]["shape"] = json!([65]);
        write_st(&st(d), &h, &data);
    });
    // A dtype tandem does not compute in (same byte count: F32 -> I32).
    broken("t1-f32", "tensor `model.norm.weight` is I32; expected bf16, f16 or f32", |d| {
        let (mut h, data) = read_st(&st(d));
        h["model.norm.weight"]["dtype"] = json!("I32");
        write_st(&st(d), &h, &data);
    });
    // A shape so large that its byte count overflows.
    broken("t1-f32", "too large to address", |d| {
        let (mut h, data) = read_st(&st(d));
        h["model.norm.weight"]["shape"] = json!([u64::MAX, 2]);
        write_st(&st(d), &h, &data);
    });
}

#[test]
fn fifos_devices_and_directories_are_refused_without_blocking() {
    broken("t1-f32", "config.json is a named pipe (FIFO), not a regular file", |d| mkfifo(&d.join("config.json")));
    broken("t1-f32", "model.safetensors is a named pipe (FIFO), not a regular file", |d| {
        mkfifo(&d.join("model.safetensors"))
    });
    broken("t1-f32", "model.safetensors is a device, not a regular file", |d| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("model.safetensors")).unwrap();
    });
    broken("t1-f32", "config.json is a device", |d| {
        std::fs::remove_file(d.join("config.json")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("config.json")).unwrap();
    });
    broken("t1-f32", "generation_config.json is a directory", |d| {
        std::fs::create_dir(d.join("generation_config.json")).unwrap()
    });
    broken("t2-moe", "model.safetensors.index.json is a named pipe", |d| {
        mkfifo(&d.join("model.safetensors.index.json"))
    });
    expect_error(
        &["generate", "--model", "/etc/passwd", "--prompt-ids", "2"],
        "/etc/passwd is a file, not a model directory",
    );

    // Symlinks to regular files are followed: the Hugging Face cache is made of them.
    let dir = scratch_copy("t1-f32");
    let real = dir.join("weights.bin");
    std::fs::rename(dir.join("model.safetensors"), &real).unwrap();
    std::os::unix::fs::symlink(&real, dir.join("model.safetensors")).unwrap();
    let d = dir.display().to_string();
    let r = run(&gen(&d, &[]));
    assert_eq!(r.code, 0, "{}", r.err);
}

#[test]
fn non_finite_logits_are_an_error_naming_the_step() {
    // NaN or infinite weights used to emit token 0 forever with "logprob": null.
    broken("t1-f32", "the model's logits are not finite at generation step 1", |d| {
        fill_f32(&d.join("model.safetensors"), "model.norm.weight", f32::NAN)
    });
    broken("t1-f32", "logits are not finite", |d| {
        fill_f32(&d.join("model.safetensors"), "model.layers.0.mlp.down_proj.weight", f32::INFINITY)
    });
}

#[test]
fn a_broken_drafter_is_an_error_never_an_out_of_vocabulary_draft() {
    let target = fixture_dir("t1-f32").display().to_string();
    for (fixture, tensor) in [("d1-centroid", "model.norm.weight"), ("d2-tied", "model.norm.weight")] {
        let dir = scratch_copy(fixture);
        fill_f32(&dir.join("model.safetensors"), tensor, f32::NAN);
        let d = dir.display().to_string();
        expect_error(
            &[
                "generate",
                "--model",
                &target,
                "--assistant",
                &d,
                "--prompt-ids",
                "2,17,33",
                "--draft-tokens",
                "3",
                "--max-new-tokens",
                "8",
            ],
            "the assistant's logits are not finite at draft step",
        );
    }
    // A drafter whose sliding window is wider than the target's would read keys the target dropped.
    let dir = scratch_copy("d1-centroid");
    edit_json(&dir.join("config.json"), |c| c["text_config"]["sliding_window"] = json!(64));
    let d = dir.display().to_string();
    expect_error(
        &["generate", "--model", &target, "--assistant", &d, "--prompt-ids", "2,17,33"],
        "assistant sliding_window (64) exceeds the target's (8)",
    );
}

#[test]
fn negative_and_tiny_values_parse_with_meanings_or_reasons() {
    let d = fixture_dir("t1-f32").display().to_string();
    let ok = run(&gen(&d, &["--seed", "-1", "--top-k", "-1", "--temperature", "0.7"]));
    assert_eq!(ok.code, 0, "{}", ok.err);
    let ok = run(&gen(&d, &["--top-k", "0", "--temperature", "1e-4"]));
    assert_eq!(ok.code, 0, "{}", ok.err);
    for (args, needle) in [
        (vec!["--seed", "-2"], "-1 for a random seed"),
        (vec!["--top-k", "-3"], "0 or -1 = off"),
        (vec!["--temperature", "-inf"], "temperature = -inf"),
        (vec!["--temperature", "1e-40"], "temperature = 1e-40: must be 0 (greedy) or a finite number >= 1e-4"),
        (vec!["--top-p", "-0.5"], "top_p"),
        (vec!["--max-new-tokens", "-5"], "--max-new-tokens"),
        (vec!["--stop", ""], "the stop string is empty"),
    ] {
        let all = gen(&d, &args);
        let r = run(&all);
        assert_no_crash(&all, &r);
        assert_ne!(r.code, 0, "{all:?}");
        assert!(r.err.contains(needle), "{all:?}: {:?} should mention {needle:?}", r.err);
        assert!(!r.err.contains("unexpected argument"), "{all:?}: {:?}", r.err);
    }
    let r = run_with(&gen(&d, &[]), &[("TANDEM_ISA", "bogus")], b"");
    assert_eq!(r.code, 1);
    assert!(r.err.contains("TANDEM_ISA=\"bogus\" is not an instruction set"), "{}", r.err);
    for prefill in ["4000000000", "4294967301"] {
        expect_error(&["bench", "--prefill", prefill], "exceed the model's context");
    }
}

#[test]
fn a_closed_or_full_stdout_ends_the_run_without_a_panic() {
    // Closed pipe: the reader went away (`| head -c 10`); exit quietly.
    for extra in [&[][..], &["--json"][..]] {
        let mut args = vec!["generate", "--prompt", "def f(x):", "--max-new-tokens", "200"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // close the read end before anything is written
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
    // A full device is an error worth telling.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--prompt", "def f(x):", "--max-new-tokens", "20"])
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write to stdout") && !err.contains("panicked"), "{err}");
}

#[test]
fn chat_input_is_checked_line_by_line() {
    let d = fixture_dir("text-tiny").display().to_string();
    let args = ["chat", "--model", &d, "--max-new-tokens", "3"];
    // Invalid UTF-8 ended the session with exit 0, dropping every later line.
    let mut input = b"hello\n".to_vec();
    input.extend_from_slice(b"caf\xe9\n");
    input.extend_from_slice(b"/reset now\n/exit now\n/foo\nhow are you\n");
    let r = run_with(&args, &[], &input);
    assert_no_crash(&args, &r);
    assert_eq!(r.code, 0, "{}", r.err);
    assert!(r.err.contains("error: that line is not UTF-8 text"), "{}", r.err);
    assert!(r.err.contains("error: /reset takes no argument"), "{}", r.err);
    assert!(r.err.contains("error: /exit takes no argument"), "{}", r.err);
    assert!(r.err.contains("unknown command /foo"), "{}", r.err);
    // Both real messages got a reply (one summary line each), the refused lines none.
    assert_eq!(r.err.matches("tokens, ").count(), 2, "{}", r.err);
}

#[test]
fn tokenizers_larger_than_the_embedding_load_and_only_their_extra_ids_are_refused() {
    // transformers' GemmaTokenizer adds a mask token the vocabulary lacks: one id past the embedding.
    let dir = scratch_copy("text-tiny");
    edit_json(&dir.join("tokenizer_config.json"), |c| c["mask_token"] = json!("<brand-new-mask>"));
    let d = dir.display().to_string();
    let r = run(&["generate", "--model", &d, "--prompt", "hello", "--max-new-tokens", "2"]);
    assert_eq!(r.code, 0, "{}", r.err);
    assert!(r.err.contains("warning: the tokenizer has 769 tokens but the model's vocabulary has 768"), "{}", r.err);
    assert!(r.err.contains("<brand-new-mask>"), "{}", r.err);
    // Typing that token reaches the model only as an id it does not have: refused by name.
    let r = run(&["generate", "--model", &d, "--prompt", "a <brand-new-mask>", "--max-new-tokens", "2"]);
    assert_eq!(r.code, 1, "{}", r.err);
    assert!(
        r.err.contains(
            "\"<brand-new-mask>\" (the tokenizer's mask_token), id 768, which is beyond the model's vocabulary of 768"
        ),
        "{}",
        r.err
    );
}
