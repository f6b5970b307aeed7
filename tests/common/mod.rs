//! Shared helpers for the integration tests: fixture paths and golden files.
#![allow(dead_code)]

pub mod stats;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub const FIXTURES: [&str; 6] = ["t1-f32", "t1-bf16", "t2-moe", "t3-dense", "t4-unified", "t5-e2b"];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The model pair that ships in models/default.
pub fn shipped_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/default")
}

/// The shipped pair's held-out prompts, as token ids.
pub fn heldout_prompts() -> Vec<Vec<u32>> {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(shipped_dir().join("heldout_prompts.json")).unwrap()).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|p| p["ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect())
        .collect()
}

/// A scratch copy of a fixture directory that a test may break (a new directory on every call),
/// removed when the value is dropped.
pub fn scratch_copy(name: &str) -> Scratch {
    scratch_copy_of(&fixture_dir(name))
}

/// [`scratch_copy`] of any model directory (its files, not subdirectories).
pub fn scratch_copy_of(src: &Path) -> Scratch {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("tandem-scratch-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    Scratch(dir)
}

/// A directory of [`scratch_copy`]'s, deleted on drop (also when the test fails).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct Golden {
    pub json: Value,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Golden {
    pub fn load(name: &str) -> Golden {
        let dir = fixture_dir(name);
        let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"))
            .expect("json");
        let bytes = std::fs::read(dir.join("golden.safetensors")).expect("golden.safetensors");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("golden safetensors");
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "goldens are f32");
            let data = view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            tensors.insert(name, (view.shape().to_vec(), data));
        }
        Golden { json, tensors }
    }

    pub fn ids(&self, key: &str) -> Vec<u32> {
        self.json[key].as_array().expect(key).iter().map(|v| v.as_u64().unwrap() as u32).collect()
    }

    pub fn floats(&self, key: &str) -> Vec<f32> {
        self.json[key].as_array().expect(key).iter().map(|v| v.as_f64().unwrap() as f32).collect()
    }

    pub fn tensor(&self, key: &str) -> &(Vec<usize>, Vec<f32>) {
        self.tensors.get(key).unwrap_or_else(|| panic!("golden tensor {key}"))
    }

    pub fn dtype(&self) -> &str {
        self.json["dtype"].as_str().unwrap()
    }

    pub fn is_f32(&self) -> bool {
        self.dtype() == "float32"
    }
}

/// Largest absolute difference.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn mean_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}
