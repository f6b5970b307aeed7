//! Replays the fuzz targets' committed corpus (`fuzz/seeds/<target>/`, minimized with `cargo fuzz cmin`)
//! and every crash reproducer they found (`fuzz/regressions/<target>/`) through the same harness the
//! fuzz targets run (`fuzz/harness.rs`), so what the fuzzers found stays fixed on stable Rust. Any panic
//! fails the test with the input's file name; see fuzz/README.md for running the fuzzers themselves.

#[path = "../fuzz/harness.rs"]
mod harness;

use std::path::Path;

fn replay(target: &str) {
    let (_, run) = harness::TARGETS.iter().find(|(name, _)| *name == target).expect("a known target");
    let root = harness::repo_root().join("fuzz");
    let mut count = 0;
    for kind in ["seeds", "regressions"] {
        let dir = root.join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
        files.sort();
        for file in files {
            let data = std::fs::read(&file).unwrap();
            let shown = file.strip_prefix(&root).unwrap_or(Path::new("?")).display().to_string();
            let result = std::panic::catch_unwind(|| run(&data));
            assert!(result.is_ok(), "fuzz/{shown} panicked in the {target} harness");
            count += 1;
        }
    }
    assert!(count > 0, "no inputs for {target} under fuzz/seeds or fuzz/regressions");
}

#[test]
fn config() {
    replay("config");
}

#[test]
fn weights() {
    replay("weights");
}

#[test]
fn template() {
    replay("template");
}

#[test]
fn tokenizer() {
    replay("tokenizer");
}

#[test]
fn messages() {
    replay("messages");
}

#[test]
fn params() {
    replay("params");
}

#[test]
fn requests() {
    replay("requests");
}

#[test]
fn chunks_round_trip() {
    let parts: [&[u8]; 3] = [b"{}", b"", b"\0\x01"];
    assert_eq!(harness::chunks(&harness::join_chunks(&parts), 4), parts);
    assert_eq!(harness::chunks(b"\xff\xff\xff\xffab", 4), [b"ab"]);
    assert_eq!(harness::chunks(b"ab", 4), [b"ab"]);
}
