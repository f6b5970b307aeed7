//! Safetensors checkpoints: one file or an index of shards, memory-mapped and kept in their own dtype.
//!
//! Names are resolved relative to the text model's prefix (`model.`, `model.language_model.`,
//! `language_model.model.`, ...), detected from where `embed_tokens.weight` lives.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::Dtype as StDtype;
use safetensors::{SafeTensorError, SafeTensors};
use serde_json::Value;

use crate::kernels::{DType, MatRef};

/// Bytes backing tensors: a read-only file mapping, or memory we own (random models for benchmarks).
pub enum Buffer {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Buffer {
    fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Mapped(m) => m,
            Buffer::Owned(v) => v,
        }
    }
}

/// Element type as stored; only the float types are usable as weights, integers appear in drafters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    Float(DType),
    I64,
    Other(&'static str),
}

impl StoredDtype {
    fn from_st(d: StDtype) -> Self {
        match d {
            StDtype::F32 => StoredDtype::Float(DType::F32),
            StDtype::F16 => StoredDtype::Float(DType::F16),
            StDtype::BF16 => StoredDtype::Float(DType::BF16),
            StDtype::I64 => StoredDtype::I64,
            StDtype::F64 => StoredDtype::Other("F64"),
            StDtype::I32 => StoredDtype::Other("I32"),
            StDtype::I16 => StoredDtype::Other("I16"),
            StDtype::I8 => StoredDtype::Other("I8"),
            StDtype::U8 => StoredDtype::Other("U8"),
            StDtype::BOOL => StoredDtype::Other("BOOL"),
            _ => StoredDtype::Other("an unsupported dtype"),
        }
    }

    fn size(self) -> Option<usize> {
        match self {
            StoredDtype::Float(d) => Some(d.size()),
            StoredDtype::I64 => Some(8),
            StoredDtype::Other(_) => None,
        }
    }
}

/// One tensor: a view into a shared buffer.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    buf: Arc<Buffer>,
    offset: usize,
    len: usize,
}

impl Tensor {
    pub fn owned(name: &str, dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Tensor {
        assert_eq!(data.len(), shape.iter().product::<usize>() * dtype.size());
        let len = data.len();
        Tensor { name: name.to_string(), dtype: StoredDtype::Float(dtype), shape, buf: Arc::new(Buffer::Owned(data)), offset: 0, len }
    }

    pub fn owned_i64(name: &str, values: &[i64]) -> Tensor {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = data.len();
        Tensor { name: name.to_string(), dtype: StoredDtype::I64, shape: vec![values.len()], buf: Arc::new(Buffer::Owned(data)), offset: 0, len }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf.bytes()[self.offset..self.offset + self.len]
    }

    pub fn float_dtype(&self) -> Result<DType> {
        match self.dtype {
            StoredDtype::Float(d) => Ok(d),
            StoredDtype::I64 => bail!("tensor `{}` is I64; expected a float tensor (bf16, f16 or f32)", self.name),
            StoredDtype::Other(d) => bail!("tensor `{}` is {d}; expected bf16, f16 or f32", self.name),
        }
    }

    /// A 2-D float tensor as a matrix view.
    pub fn mat(&self) -> MatRef<'_> {
        let d = match self.dtype {
            StoredDtype::Float(d) => d,
            _ => unreachable!("validated as float at load"),
        };
        let cols = *self.shape.last().unwrap_or(&1);
        let rows = self.shape.iter().product::<usize>().checked_div(cols).unwrap_or(0);
        MatRef::new(d, rows, cols, self.bytes())
    }

    /// A float tensor widened to f32 (only for small tensors: norms, scales).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let d = self.float_dtype()?;
        let n = self.shape.iter().product::<usize>();
        let bytes = self.bytes();
        Ok((0..n).map(|i| d.load(bytes, i)).collect())
    }

    /// An I64 tensor as integers.
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        if self.dtype != StoredDtype::I64 {
            bail!("tensor `{}` must be I64", self.name);
        }
        Ok(self.bytes().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }
}

/// All tensors of a checkpoint by full name, plus the detected text-model prefix.
pub struct WeightStore {
    tensors: HashMap<String, Tensor>,
    prefix: String,
    source: PathBuf,
}

/// Where the text model's weights live in the known checkpoint layouts (docs/model.md, "Checkpoint layouts").
const TEXT_PREFIXES: [&str; 5] = ["model.language_model.", "model.", "language_model.model.", "language_model.", ""];

impl WeightStore {
    /// Open `model.safetensors` or `model.safetensors.index.json` (and its shards) in `dir`.
    pub fn open(dir: &Path) -> Result<WeightStore> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut tensors = HashMap::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
            let json: Value =
                serde_json::from_str(&text).map_err(|e| anyhow!("{}: malformed JSON: {e}", index.display()))?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| anyhow!("{}: field `weight_map` is missing or not an object", index.display()))?;
            let mut files = BTreeSet::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| anyhow!("{}: `weight_map.{name}` must be a file name", index.display()))?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    bail!("{}: `weight_map.{name}` names {file:?}, which is not a file in the model directory", index.display());
                }
                files.insert(file.to_string());
            }
            for file in &files {
                load_file(&dir.join(file), &mut tensors)?;
            }
            for (name, file) in map {
                if !tensors.contains_key(name) {
                    bail!("{}: tensor `{name}` is listed in {} but missing from it", index.display(), file.as_str().unwrap_or("?"));
                }
            }
        } else if single.exists() {
            load_file(&single, &mut tensors)?;
        } else {
            bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display());
        }
        let prefix = TEXT_PREFIXES
            .iter()
            .find(|p| tensors.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| anyhow!("{}: no `embed_tokens.weight` under any known prefix ({})", dir.display(), TEXT_PREFIXES[..4].join(", ")))?
            .to_string();
        Ok(WeightStore { tensors, prefix, source: dir.to_path_buf() })
    }

    /// A store over tensors built in memory, with names relative to an empty prefix.
    pub fn from_tensors(tensors: Vec<Tensor>) -> WeightStore {
        WeightStore {
            tensors: tensors.into_iter().map(|t| (t.name.clone(), t)).collect(),
            prefix: String::new(),
            source: PathBuf::from("<memory>"),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A text-model tensor by its name below the prefix, if present.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(&format!("{}{name}", self.prefix))
    }

    /// A tensor by its full name (e.g. a top-level `lm_head.weight`).
    pub fn get_full(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// A float tensor of the expected shape, or an error naming it.
    pub fn require(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.require_full(&format!("{}{name}", self.prefix), shape)
    }

    /// Like `require`, by full name (drafter tensors have one fixed naming scheme).
    pub fn require_full(&self, full: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .get(full)
            .ok_or_else(|| anyhow!("{}: missing tensor `{full}`", self.source.display()))?;
        check_shape(t, shape, &self.source)?;
        t.float_dtype().map_err(|e| anyhow!("{}: {e}", self.source.display()))?;
        Ok(t.clone())
    }
}

fn check_shape(t: &Tensor, shape: &[usize], source: &Path) -> Result<()> {
    // A 1-element buffer may be stored as a scalar `[]` or `[1]`.
    let same = t.shape == shape || (shape == [1] && t.shape.is_empty());
    if !same {
        bail!("{}: tensor `{}` has shape {:?}, expected {:?}", source.display(), t.name, t.shape, shape);
    }
    Ok(())
}

fn load_file(path: &Path, out: &mut HashMap<String, Tensor>) -> Result<()> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the file is mapped read-only; tandem never writes it, and a model directory being
    // rewritten while it runs is outside what any loader can defend against.
    let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    let (header_len, meta) = SafeTensors::read_metadata(&mmap[..]).map_err(|e| match e {
        SafeTensorError::MetadataIncompleteBuffer => {
            anyhow!("{}: truncated: the header promises more data than the file holds", path.display())
        }
        e => anyhow!("{}: not a valid safetensors file ({e})", path.display()),
    })?;
    let data_start = 8 + header_len;
    let file_len = mmap.len();
    let buf = Arc::new(Buffer::Mapped(mmap));
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        let dtype = StoredDtype::from_st(info.dtype);
        if data_start + end > file_len {
            bail!("{}: truncated: tensor `{name}` ends at byte {} but the file has {file_len}", path.display(), data_start + end);
        }
        let n: usize = info.shape.iter().product();
        if let Some(size) = dtype.size() {
            if end - start != n * size {
                bail!("{}: tensor `{name}` holds {} bytes, its shape {:?} needs {}", path.display(), end - start, info.shape, n * size);
            }
        }
        if out.contains_key(&name) {
            bail!("{}: tensor `{name}` appears in more than one file", path.display());
        }
        out.insert(
            name.clone(),
            Tensor { name, dtype, shape: info.shape.clone(), buf: buf.clone(), offset: data_start + start, len: end - start },
        );
    }
    Ok(())
}
