//! GGUF files (docs/gguf.md): every fixture written as GGUF by tandem reads back into the same model
//! (bit-identical logits, identical drafts), quantized files equal quantizing on load, and broken or
//! foreign files are refused with errors that name the problem.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tandem::config::{load_assistant_config, load_model_config};
use tandem::decode::draft_policy::{DraftLength, DraftPolicy};
use tandem::decode::generate::GenerateOptions;
use tandem::decode::sampling::SamplingParams;
use tandem::decode::speculative::generate_speculative;
use tandem::gguf::{export, write, GgufModel};
use tandem::model::assistant::{quantize_assistant, Assistant};
use tandem::model::target::quantize_target;
use tandem::model::{Keep, TargetModel};
use tandem::quantize::Recipe;
use tandem::weights::WeightStore;

/// The (target, drafter) fixture pairs; `t1-f32` is the target of the first two.
const PAIRS: [(&str, &str); 4] =
    [("t1-f32", "d1-centroid"), ("t1-f32", "d2-tied"), ("t1-bf16", "d3-bf16"), ("t1-bf16", "d4-trained")];

/// A path for a test's GGUF file in the build's scratch directory (`target/tmp`): each run rewrites its
/// files there rather than leaving a new directory in the system's temp.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf-test");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Writes `e` to `path` through a fresh temporary name and a rename, as `tandem quantize` does. Tests run in
/// parallel and several of them write the same fixture's file: truncating it in place would pull the pages
/// from under another test's live memory map (SIGBUS); a rename leaves that map on the old file.
fn write_file(path: &Path, e: &export::Export) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{n}"));
    let f = std::io::BufWriter::new(std::fs::File::create(&tmp).unwrap());
    write::write(f, &e.meta, &e.out_tensors().unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `fixture` written as a GGUF target, quantized with `recipe` first when given.
fn target_gguf(fixture: &str, recipe: Option<Recipe>) -> PathBuf {
    let dir = fixture_dir(fixture);
    let cfg = load_model_config(&dir).unwrap().text;
    let mut store = WeightStore::open(&dir).unwrap();
    if let Some(r) = recipe {
        quantize_target(&mut store, &cfg, r).unwrap();
    }
    let path = scratch(&format!("{fixture}-{}.gguf", recipe.map_or("float", |r| r.name())));
    write_file(&path, &export::target(&cfg, &store, fixture).unwrap());
    path
}

fn assistant_gguf(fixture: &str, recipe: Option<Recipe>) -> PathBuf {
    let dir = fixture_dir(fixture);
    let cfg = load_assistant_config(&dir).unwrap();
    let mut store = WeightStore::open(&dir).unwrap();
    if let Some(r) = recipe {
        quantize_assistant(&mut store, &cfg, r).unwrap();
    }
    let path = scratch(&format!("{fixture}-{}.gguf", recipe.map_or("float", |r| r.name())));
    write_file(&path, &export::assistant(&cfg, &store, fixture).unwrap());
    path
}

const TARGETS: [&str; 7] = ["t1-f32", "t1-bf16", "t2-moe", "t3-dense", "t4-unified", "t5-e2b", "t6-long"];

#[test]
fn every_target_reads_back_from_gguf_with_bit_identical_logits() {
    for name in TARGETS {
        let a = TargetModel::load(&fixture_dir(name)).unwrap();
        let b = TargetModel::load(&target_gguf(name, None)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(a.cfg, b.cfg, "{name}: configuration");
        assert_eq!(a.dtype, b.dtype, "{name}: compute dtype");
        let prompt: Vec<u32> = (0..20).map(|i| (3 + i * 37 % 250) as u32).collect();
        let (x, y) = (
            a.forward(&mut a.new_cache(), &prompt, Keep::All).unwrap(),
            b.forward(&mut b.new_cache(), &prompt, Keep::All).unwrap(),
        );
        assert!(x.logits == y.logits && x.hidden == y.hidden, "{name}: logits differ after the GGUF round trip");
    }
}

#[test]
fn quantized_gguf_equals_quantizing_on_load() {
    for (name, r) in [("t5-e2b", Recipe::Q8_0), ("t3-dense", Recipe::Q4KM), ("t2-moe", Recipe::Q4_0)] {
        let a = TargetModel::load_with(&fixture_dir(name), Some(r), |_| {}).unwrap();
        let b = TargetModel::load(&target_gguf(name, Some(r))).unwrap();
        assert_eq!(a.cfg, b.cfg, "{name}");
        let prompt: Vec<u32> = vec![2, 40, 41, 42, 90, 7, 200, 13];
        let (x, y) = (
            a.forward(&mut a.new_cache(), &prompt, Keep::All).unwrap(),
            b.forward(&mut b.new_cache(), &prompt, Keep::All).unwrap(),
        );
        assert!(x.logits == y.logits, "{name} {}: logits differ", r.name());
        // And a quantized file is not quantized again.
        let e = TargetModel::load_with(&target_gguf(name, Some(r)), Some(Recipe::Q8_0), |_| {}).err().unwrap();
        assert!(format!("{e:#}").contains("already quantized"), "{e:#}");
    }
}

#[test]
fn drafters_read_back_from_gguf_and_draft_the_same_tokens() {
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ignore_eos: true,
        sampling: SamplingParams::default(),
        top_logprobs: None,
        context_limit: 512,
    };
    for (t, d) in PAIRS {
        let target = TargetModel::load(&fixture_dir(t)).unwrap();
        for recipe in [None, Some(Recipe::Q8_0)] {
            let a = Assistant::load_for_with(&fixture_dir(d), &target.cfg, recipe, |_| {})
                .unwrap_or_else(|e| panic!("{d}: {e:#}"));
            let b =
                Assistant::load_for(&assistant_gguf(d, recipe), &target.cfg).unwrap_or_else(|e| panic!("{d}: {e:#}"));
            let prompt: Vec<u32> = vec![2, 17, 33, 90, 121, 7, 64, 200, 31, 5];
            let run = |x: &Assistant| {
                let mut policy: DraftPolicy = DraftLength::Fixed(3).into();
                generate_speculative(&target, x, &prompt, &opts, &mut policy, true, |_| {}).unwrap()
            };
            let ((ga, sa), (gb, sb)) = (run(&a), run(&b));
            assert_eq!(ga.tokens, gb.tokens, "{d}");
            let drafts = |s: &tandem::decode::speculative::SpecStats| {
                s.rounds.as_ref().unwrap().iter().map(|r| (r.drafted.clone(), r.accepted)).collect::<Vec<_>>()
            };
            assert_eq!(drafts(&sa), drafts(&sb), "{d} ({recipe:?}): drafts differ after the GGUF round trip");
        }
    }
}

#[test]
fn foreign_and_broken_files_are_refused_with_the_reason() {
    let good = std::fs::read(target_gguf("t1-f32", None)).unwrap();
    let err = |bytes: &[u8], name: &str| {
        let path = scratch(name);
        std::fs::write(&path, bytes).unwrap();
        format!("{:#}", TargetModel::load(&path).err().expect("refused"))
    };
    // Truncated: inside the tensor data.
    let e = err(&good[..good.len() - 100], "truncated.gguf");
    assert!(e.contains("truncated: tensor") && e.contains("ends past the end of the file"), "{e}");
    // A drafter passed as the target, and the other way round.
    let d = assistant_gguf("d2-tied", None);
    let e = format!("{:#}", TargetModel::load(&d).err().unwrap());
    assert!(e.contains("assistant drafter") && e.contains("--assistant"), "{e}");
    let t1 = TargetModel::load(&fixture_dir("t1-f32")).unwrap();
    let e = format!("{:#}", Assistant::load_for(&target_gguf("t1-f32", None), &t1.cfg).err().unwrap());
    assert!(e.contains("not an assistant drafter"), "{e}");
    // Another architecture, and a missing key: rewrite the metadata.
    let cfg = load_model_config(&fixture_dir("t1-f32")).unwrap().text;
    let store = WeightStore::open(&fixture_dir("t1-f32")).unwrap();
    let mut ex = export::target(&cfg, &store, "t1").unwrap();
    ex.meta[0].1 = tandem::gguf::MetaValue::Str("llama".into());
    let p = scratch("llama.gguf");
    write_file(&p, &ex);
    let e = format!("{:#}", TargetModel::load(&p).err().unwrap());
    assert!(e.contains("architecture \"llama\" is not one tandem runs"), "{e}");
    let mut ex = export::target(&cfg, &store, "t1").unwrap();
    ex.meta.retain(|(k, _)| k != "gemma4.attention.sliding_window");
    let p = scratch("nowindow.gguf");
    write_file(&p, &ex);
    let e = format!("{:#}", TargetModel::load(&p).err().unwrap());
    assert!(e.contains("required metadata `gemma4.attention.sliding_window` is missing"), "{e}");
    // A last layer marked sliding (transformers would silently make it full; llama.cpp would not).
    let mut ex = export::target(&cfg, &store, "t1").unwrap();
    for (k, v) in ex.meta.iter_mut() {
        if k == "gemma4.attention.sliding_window_pattern" {
            if let tandem::gguf::MetaValue::Array(a) = v {
                *a.last_mut().unwrap() = tandem::gguf::MetaValue::Bool(true);
            }
        }
    }
    let p = scratch("lastsliding.gguf");
    write_file(&p, &ex);
    let e = format!("{:#}", TargetModel::load(&p).err().unwrap());
    assert!(e.contains("makes the last layer sliding"), "{e}");
    // A tensor the layout does not have.
    let mut ex = export::target(&cfg, &store, "t1").unwrap();
    let at = ex.tensors.iter().position(|(n, _)| n.starts_with("blk.0.")).unwrap();
    ex.tensors[at].0 = "blk.0.mystery.weight".into();
    let p = scratch("mystery.gguf");
    write_file(&p, &ex);
    let e = format!("{:#}", TargetModel::load(&p).err().unwrap());
    assert!(e.contains("tensor `blk.0.mystery.weight` is not part of the Gemma 4 layout"), "{e}");
    // A file that is neither GGUF nor a directory.
    let e = err(b"not a model at all", "plain.gguf");
    assert!(e.contains("nor a GGUF file"), "{e}");
    // A split file whose other parts are missing: the first part names them.
    let mut ex = export::target(&cfg, &store, "t1").unwrap();
    ex.meta.push(("split.count".into(), tandem::gguf::MetaValue::U16(2)));
    ex.meta.push(("split.no".into(), tandem::gguf::MetaValue::U16(0)));
    let p = scratch("m-00001-of-00002.gguf");
    write_file(&p, &ex);
    let e = format!("{:#}", TargetModel::load(&p).err().unwrap());
    assert!(e.contains("part 2 of 2") && e.contains("m-00002-of-00002.gguf") && e.contains("is missing"), "{e}");
}

#[test]
fn split_files_are_read_together() {
    // Two parts: the first holds the metadata and the layers' tensors, the second the rest.
    let cfg = load_model_config(&fixture_dir("t5-e2b")).unwrap().text;
    let store = WeightStore::open(&fixture_dir("t5-e2b")).unwrap();
    let ex = export::target(&cfg, &store, "t5").unwrap();
    let all = ex.out_tensors().unwrap();
    let (first, second): (Vec<_>, Vec<_>) = all.into_iter().partition(|t| t.name.starts_with("blk."));
    let mut meta = ex.meta.clone();
    let split = |no: u16| {
        vec![
            ("split.no".to_string(), tandem::gguf::MetaValue::U16(no)),
            ("split.count".to_string(), tandem::gguf::MetaValue::U16(2)),
            ("split.tensors.count".to_string(), tandem::gguf::MetaValue::I32((first.len() + second.len()) as i32)),
        ]
    };
    meta.extend(split(0));
    let p1 = scratch("t5-00001-of-00002.gguf");
    write::write(std::fs::File::create(&p1).unwrap(), &meta, &first).unwrap();
    write::write(std::fs::File::create(scratch("t5-00002-of-00002.gguf")).unwrap(), &split(1), &second).unwrap();
    let m = GgufModel::open(&p1, false).unwrap();
    assert_eq!(m.files.len(), 2);
    let a = TargetModel::load(&fixture_dir("t5-e2b")).unwrap();
    let b = TargetModel::load(&p1).unwrap();
    let prompt = [2u32, 9, 8, 7];
    assert_eq!(
        a.forward(&mut a.new_cache(), &prompt, Keep::All).unwrap().logits,
        b.forward(&mut b.new_cache(), &prompt, Keep::All).unwrap().logits
    );
    // The second part alone is refused, pointing at the first.
    let e = format!("{:#}", TargetModel::load(&scratch("t5-00002-of-00002.gguf")).err().unwrap());
    assert!(e.contains("part 2 of a model split into 2 files; pass the first part"), "{e}");
}

fn tandem_cli(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("run tandem");
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), s(&out.stdout), s(&out.stderr))
}

#[test]
fn quantize_command_writes_a_gguf_that_runs_like_quantizing_on_load() {
    let dir = fixture_dir("text-tiny").display().to_string();
    let out = scratch("cli-text-tiny-q8_0.gguf");
    let (code, _, err) =
        tandem_cli(&["quantize", "--model", &dir, "--out", out.to_str().unwrap(), "--quantize", "q8_0"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("quantized the model to q8_0") && err.contains("wrote"), "{err}");
    assert!(!err.contains("warning"), "{err}");
    // Text, the tokenizer and the chat template come from the file alone.
    let run = |model: &str, extra: &[&str]| {
        let mut a = vec!["generate", "--model", model, "--chat", "Hello there", "--max-new-tokens", "12", "--json"];
        a.extend_from_slice(extra);
        let (code, stdout, err) = tandem_cli(&a);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        (v["prompt_ids"].clone(), v["tokens"].clone(), v["text"].clone())
    };
    assert_eq!(run(out.to_str().unwrap(), &[]), run(&dir, &["--quantize", "q8_0"]));

    // A layout llama.cpp misreads is written, with a warning.
    let out = scratch("cli-t5.gguf");
    let (code, _, err) =
        tandem_cli(&["quantize", "--model", fixture_dir("t5-e2b").to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("warning: llama.cpp will compute this model wrongly"), "{err}");
    // That fixture has no tokenizer, so neither has its file: text needs one.
    let (code, _, err) = tandem_cli(&["generate", "--model", out.to_str().unwrap(), "--prompt", "hi"]);
    assert!(code == 1 && err.contains("has no tokenizer metadata (tokenizer.ggml.tokens); use --prompt-ids"), "{err}");

    // Quantized files are not quantized again; the output is not the input; --quantize-assistant is refused.
    let q = gguf_fixture("t1-f32-q8_0.gguf");
    let other = scratch("cli-again.gguf");
    let (code, _, err) =
        tandem_cli(&["quantize", "--model", &q, "--out", other.to_str().unwrap(), "--quantize", "q4_0"]);
    assert!(code == 1 && err.contains("already quantized (Q8_0)"), "{err}");
    let (code, _, err) = tandem_cli(&["quantize", "--model", &q, "--out", &q]);
    assert!(code == 1 && err.contains("is the model itself"), "{err}");
    let (code, _, err) = tandem_cli(&[
        "quantize",
        "--model",
        &dir,
        "--out",
        other.to_str().unwrap(),
        "--quantize",
        "q8_0",
        "--quantize-assistant",
    ]);
    assert!(code == 1 && err.contains("pass the assistant as --model"), "{err}");
    // A float GGUF can be quantized into another.
    let (code, _, err) = tandem_cli(&[
        "quantize",
        "--model",
        &gguf_fixture("t6-long-f32.gguf"),
        "--out",
        other.to_str().unwrap(),
        "--quantize",
        "q4_k_m",
    ]);
    assert_eq!(code, 0, "{err}");
    let m = GgufModel::open(&other, false).unwrap();
    assert_eq!(m.tensor("blk.0.attn_output.weight").unwrap().ty.to_string(), "Q4_K");
}

fn gguf_fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name).display().to_string()
}

/// Damaged files never crash the loader: random byte changes in the header, metadata and tensor table of a
/// real file, and truncations anywhere, give an error or (when the change is harmless) a model.
#[test]
fn damaged_files_are_refused_without_crashing() {
    let good = std::fs::read(gguf_fixture("t1-f32-q8_0.gguf")).unwrap();
    let m = GgufModel::open(Path::new(&gguf_fixture("t1-f32-q8_0.gguf")), true).unwrap();
    let head = m.tensors().map(|t| t.start).min().unwrap();
    let mut rng = tandem::decode::sampling::Rng::new(7);
    let path = scratch("damaged.gguf");
    let (mut refused, mut loaded) = (0, 0);
    for i in 0..400 {
        let mut b = good.clone();
        if i % 4 == 3 {
            b.truncate((rng.next_u64() % good.len() as u64) as usize);
        } else {
            for _ in 0..1 + rng.next_u64() % 4 {
                let at = (rng.next_u64() % head as u64) as usize;
                b[at] = match rng.next_u64() % 3 {
                    0 => 0xff,
                    1 => 0,
                    _ => rng.next_u64() as u8,
                };
            }
        }
        std::fs::write(&path, &b).unwrap();
        match TargetModel::load(&path) {
            Ok(model) => {
                model.forward(&mut model.new_cache(), &[2, 3], Keep::Last).ok();
                loaded += 1;
            }
            Err(e) => {
                // The error names the file (and, through its chain, what is wrong with it).
                assert!(format!("{e:#}").contains("damaged.gguf"), "{e:#}");
                refused += 1;
            }
        }
        let _ = tandem::text::TextTokenizer::load(&path);
    }
    println!("{refused} refused, {loaded} loaded");
    assert!(refused > 200);
}
