//! Safetensors checkpoints: one file or an index of shards, memory-mapped and kept in their own dtype.
//!
//! Names are resolved relative to the text model's prefix (`model.`, `model.language_model.`,
//! `language_model.model.`, ...), detected from where `embed_tokens.weight` lives.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::{Advice, Mmap, MmapMut};
use safetensors::tensor::Dtype as StDtype;
use safetensors::{SafeTensorError, SafeTensors};
use serde_json::Value;

use crate::kernels::{DType, MatRef, QMatRef, QType, Weight};

/// Bytes backing tensors: a read-only file mapping, memory we own (random models for benchmarks), or
/// a copy in anonymous memory backed by huge pages (`--huge-pages`; see docs/engine.md, "Weights in memory").
pub enum Buffer {
    Mapped(Mmap),
    Owned(Vec<u8>),
    Huge { map: Mmap, off: usize, len: usize },
}

impl Buffer {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Mapped(m) => m,
            Buffer::Owned(v) => v,
            Buffer::Huge { map, off, len } => &map[*off..*off + *len],
        }
    }
}

static HUGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on, weights loaded (and random models built) are copied into anonymous memory advised to use
/// transparent huge pages, instead of staying memory-mapped: one TLB entry covers 2 MiB instead of 4 KiB
/// while a decode step streams through them. Costs a copy of the weights at load and memory the kernel
/// cannot reclaim as it can the page cache.
pub fn use_huge_pages(on: bool) {
    HUGE_PAGES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`use_huge_pages`] is on.
pub fn huge_pages() -> bool {
    HUGE_PAGES.load(std::sync::atomic::Ordering::Relaxed)
}

const HUGE_PAGE: usize = 2 << 20;

/// A copy of `src` in anonymous memory that starts on a 2 MiB boundary and is advised `MADV_HUGEPAGE`
/// before it is first touched, then made read-only.
fn huge_copy(src: &[u8]) -> Result<Buffer> {
    let len = src.len();
    let total = len.checked_add(HUGE_PAGE).ok_or_else(|| anyhow!("{len} bytes do not fit in memory"))?;
    let mut map = MmapMut::map_anon(total).with_context(|| format!("cannot allocate {len} bytes for the weights"))?;
    let off = map.as_ptr().align_offset(HUGE_PAGE).min(HUGE_PAGE);
    // Only advice: where transparent huge pages are off, the memory is simply backed by small pages.
    let _ = map.advise_range(Advice::HugePage, off, len);
    map[off..off + len].copy_from_slice(src);
    let map = map.make_read_only().context("cannot make the weight copy read-only")?;
    Ok(Buffer::Huge { map, off, len })
}

/// Before the first forward pays for it page by page, map every page of a file mapping that fits in free
/// memory (as llama.cpp's `MAP_POPULATE`); one that does not fit is left to page in on demand.
fn populate(mmap: &Mmap) {
    let fits = crate::system::available_memory_bytes().is_some_and(|free| (mmap.len() as u64) < free / 2);
    if fits && mmap.advise(Advice::PopulateRead).is_err() {
        // Kernels before 5.14 have no MADV_POPULATE_READ: at least start reading ahead.
        let _ = mmap.advise(Advice::WillNeed);
    }
}

/// A model file's mapping as tensors will read it: copied into huge pages with `--huge-pages`, otherwise
/// kept mapped and read in up front (`populate`). A file about to be quantized (`to_quantize`) is neither:
/// each tensor is read once by the quantizer and its pages released.
pub(crate) fn file_buffer(mmap: Mmap, to_quantize: bool) -> Result<Buffer> {
    if huge_pages() && !to_quantize {
        return huge_copy(&mmap).context("cannot copy into huge pages");
    }
    if !to_quantize {
        populate(&mmap);
    }
    Ok(Buffer::Mapped(mmap))
}

/// Element type as stored; float and quantized types are usable as weights, integers appear in drafters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    Float(DType),
    /// Block-quantized at load (or in a file), from weights of dtype `from`.
    Quant {
        q: QType,
        from: DType,
    },
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
            StoredDtype::Quant { .. } | StoredDtype::Other(_) => None,
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
        let buf = match huge_pages() && len >= HUGE_PAGE {
            true => huge_copy(&data).unwrap_or(Buffer::Owned(data)),
            false => Buffer::Owned(data),
        };
        Tensor { name: name.to_string(), dtype: StoredDtype::Float(dtype), shape, buf: Arc::new(buf), offset: 0, len }
    }

    /// A quantized tensor in memory we own (quantized at load): `data` holds `shape`'s rows of `q` blocks.
    pub fn owned_quant(name: &str, q: QType, from: DType, shape: Vec<usize>, data: Vec<u8>) -> Tensor {
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape.iter().product::<usize>().checked_div(cols).unwrap_or(0);
        assert_eq!(Some(data.len()), q.row_bytes(cols).map(|b| b * rows), "quantized tensor size");
        let len = data.len();
        let buf = match huge_pages() && len >= HUGE_PAGE {
            true => huge_copy(&data).unwrap_or(Buffer::Owned(data)),
            false => Buffer::Owned(data),
        };
        let dtype = StoredDtype::Quant { q, from };
        Tensor { name: name.to_string(), dtype, shape, buf: Arc::new(buf), offset: 0, len }
    }

    /// A view of `len` bytes at `offset` of a shared buffer (a model file), checked to hold `shape`.
    pub(crate) fn mapped(
        name: &str,
        dtype: StoredDtype,
        shape: Vec<usize>,
        buf: Arc<Buffer>,
        offset: usize,
        len: usize,
    ) -> Tensor {
        assert!(offset.checked_add(len).is_some_and(|e| e <= buf.bytes().len()), "tensor view inside its buffer");
        Tensor { name: name.to_string(), dtype, shape, buf, offset, len }
    }

    pub fn owned_i64(name: &str, values: &[i64]) -> Tensor {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = data.len();
        Tensor {
            name: name.to_string(),
            dtype: StoredDtype::I64,
            shape: vec![values.len()],
            buf: Arc::new(Buffer::Owned(data)),
            offset: 0,
            len,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf.bytes()[self.offset..self.offset + self.len]
    }

    pub fn float_dtype(&self) -> Result<DType> {
        match self.dtype {
            StoredDtype::Float(d) => Ok(d),
            StoredDtype::Quant { q, .. } => {
                bail!("tensor `{}` is {q}; expected a float tensor (bf16, f16 or f32)", self.name)
            }
            StoredDtype::I64 => bail!("tensor `{}` is I64; expected a float tensor (bf16, f16 or f32)", self.name),
            StoredDtype::Other(d) => bail!("tensor `{}` is {d}; expected bf16, f16 or f32", self.name),
        }
    }

    /// Let the kernel drop this tensor's pages of a file mapping (after it was quantized into memory of its
    /// own, its source is not read again): the resident memory of a quantized model is then the quantized
    /// size, not that plus the checkpoint's. Pages shared with neighbouring tensors are kept.
    pub fn release_pages(&self) {
        let Buffer::Mapped(map) = &*self.buf else { return };
        const PAGE: usize = 4096;
        let start = (map.as_ptr() as usize + self.offset).next_multiple_of(PAGE) - map.as_ptr() as usize;
        let end =
            ((map.as_ptr() as usize + self.offset + self.len) / PAGE * PAGE).saturating_sub(map.as_ptr() as usize);
        if end > start {
            // SAFETY: the mapping is a read-only file mapping (`Mmap`): MADV_DONTNEED only drops its resident
            // pages, and a later access would read them from the file again; it cannot change what any
            // slice of it holds.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }

    /// The dtype the weights had before any quantization: the precision the forward pass rounds to.
    pub fn compute_dtype(&self) -> Result<DType> {
        match self.dtype {
            StoredDtype::Quant { from, .. } => Ok(from),
            _ => self.float_dtype(),
        }
    }

    /// A weight tensor as a matrix view (`[rows, cols]`, all leading dimensions as rows).
    pub fn mat(&self) -> Weight<'_> {
        let cols = *self.shape.last().unwrap_or(&1);
        let rows = self.shape.iter().product::<usize>().checked_div(cols).unwrap_or(0);
        match self.dtype {
            StoredDtype::Float(d) => Weight::Float(MatRef::new(d, rows, cols, self.bytes())),
            StoredDtype::Quant { q, .. } => Weight::Quant(QMatRef::new(q, rows, cols, self.bytes())),
            _ => unreachable!("validated as a weight at load"),
        }
    }

    /// Elements of the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
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
        WeightStore::open_with(dir, false)
    }

    /// [`WeightStore::open`] for a store about to be quantized (`to_quantize`): its files are neither copied
    /// into huge pages nor read into memory up front, so that the unquantized weights are never held
    /// whole next to the quantized ones (`quantize::apply` reads each tensor once and releases its pages,
    /// and [`WeightStore::move_floats_to_huge_pages`] copies what stays in float afterwards).
    pub fn open_with(dir: &Path, to_quantize: bool) -> Result<WeightStore> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut tensors = HashMap::new();
        if crate::files::exists(&index) {
            let text = crate::files::read_text(&index)?;
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
                    bail!(
                        "{}: `weight_map.{name}` names {file:?}, which is not a file in the model directory",
                        index.display()
                    );
                }
                files.insert(file.to_string());
            }
            for file in &files {
                load_file(&dir.join(file), &mut tensors, to_quantize)?;
            }
            for (name, file) in map {
                if !tensors.contains_key(name) {
                    bail!(
                        "{}: tensor `{name}` is listed in {} but missing from it",
                        index.display(),
                        file.as_str().unwrap_or("?")
                    );
                }
            }
        } else if crate::files::exists(&single) {
            load_file(&single, &mut tensors, to_quantize)?;
        } else {
            bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display());
        }
        let prefix = TEXT_PREFIXES
            .iter()
            .find(|p| tensors.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| {
                anyhow!(
                    "{}: no `embed_tokens.weight` under any known prefix ({})",
                    dir.display(),
                    TEXT_PREFIXES[..4].join(", ")
                )
            })?
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

    /// Name the file the tensors came from, for errors.
    pub fn set_source(&mut self, path: &Path) {
        self.source = path.to_path_buf();
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How many decoder layers the checkpoint holds under `layers_prefix` (full names, e.g.
    /// `model.layers.`): one more than the highest `N` of any `{layers_prefix}N.` tensor, 0 if none.
    pub fn count_layers(&self, layers_prefix: &str) -> usize {
        self.tensors
            .keys()
            .filter_map(|k| k.strip_prefix(layers_prefix)?.split('.').next()?.parse::<usize>().ok())
            .map(|i| i.saturating_add(1))
            .max()
            .unwrap_or(0)
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
        let t = self.tensors.get(full).ok_or_else(|| anyhow!("{}: missing tensor `{full}`", self.source.display()))?;
        check_shape(t, shape, &self.source)?;
        t.compute_dtype().map_err(|e| anyhow!("{}: {e}", self.source.display()))?;
        Ok(t.clone())
    }

    /// Every tensor's full name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// With `--huge-pages`, copy every float tensor of at least one huge page that still lives in a file
    /// mapping into huge-page memory of its own (what `open` does for whole files).
    pub fn move_floats_to_huge_pages(&mut self) -> Result<()> {
        if !huge_pages() {
            return Ok(());
        }
        for t in self.tensors.values_mut() {
            if matches!(t.dtype, StoredDtype::Float(_)) && t.len >= HUGE_PAGE && matches!(*t.buf, Buffer::Mapped(_)) {
                let copy = huge_copy(t.bytes())
                    .with_context(|| format!("tensor `{}`: cannot copy into huge pages", t.name))?;
                t.buf = Arc::new(copy);
                t.offset = 0;
            }
        }
        Ok(())
    }

    /// Replace (or add) a tensor under its full name.
    pub fn insert(&mut self, t: Tensor) {
        self.tensors.insert(t.name.clone(), t);
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

fn load_file(path: &Path, out: &mut HashMap<String, Tensor>, to_quantize: bool) -> Result<()> {
    let file = crate::files::open_regular(path)?;
    // SAFETY: the file is mapped read-only; tandem never writes it, and a model directory being
    // rewritten while it runs is outside what any loader can defend against.
    let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    let (header_len, meta) = SafeTensors::read_metadata(&mmap[..])
        .map_err(|e| anyhow!("{}: {}", path.display(), describe_header_error(&mmap, e)))?;
    let data_start = 8 + header_len;
    let file_len = mmap.len();
    let buf = Arc::new(file_buffer(mmap, to_quantize).with_context(|| format!("{}", path.display()))?);
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        let dtype = StoredDtype::from_st(info.dtype);
        // The crate checked that the offsets tile the data exactly and that the byte counts match the
        // shapes without overflow; check again with checked arithmetic, since a wrong view is memory unsafety.
        let bytes_end = data_start.checked_add(end).filter(|&e| start <= end && e <= file_len);
        if bytes_end.is_none() {
            bail!("{}: truncated: tensor `{name}` ends past the end of the file ({file_len} bytes)", path.display());
        }
        let n = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if let Some(size) = dtype.size() {
            if n.and_then(|n| n.checked_mul(size)) != Some(end - start) {
                bail!(
                    "{}: tensor `{name}` holds {} bytes, which does not match its shape {:?}",
                    path.display(),
                    end - start,
                    info.shape
                );
            }
        }
        if out.contains_key(&name) {
            bail!("{}: tensor `{name}` appears in more than one file", path.display());
        }
        out.insert(
            name.clone(),
            Tensor {
                name,
                dtype,
                shape: info.shape.clone(),
                buf: buf.clone(),
                offset: data_start + start,
                len: end - start,
            },
        );
    }
    Ok(())
}

/// What is wrong with a safetensors header, in words (the crate's errors print as debug names), naming the
/// tensor where the header lets us.
fn describe_header_error(bytes: &[u8], e: SafeTensorError) -> String {
    let header = || -> Option<serde_json::Map<String, Value>> {
        let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
        let text = std::str::from_utf8(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
        serde_json::from_str::<Value>(text).ok()?.as_object().cloned()
    };
    // Tensors as (name, dtype, shape, start, end) in the order of their data, where they parse.
    let tensors = || -> Vec<(String, String, Vec<u64>, u64, u64)> {
        let mut v: Vec<_> = header()
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| k != "__metadata__")
            .filter_map(|(k, t)| {
                let dtype = t.get("dtype")?.as_str()?.to_string();
                let shape = t.get("shape")?.as_array()?.iter().map(Value::as_u64).collect::<Option<Vec<_>>>()?;
                let off = t.get("data_offsets")?.as_array()?;
                Some((k, dtype, shape, off.first()?.as_u64()?, off.get(1)?.as_u64()?))
            })
            .collect();
        v.sort_by_key(|t| (t.3, t.4));
        v
    };
    match e {
        SafeTensorError::HeaderTooSmall => format!("not a safetensors file: {} bytes, shorter than the 8-byte header length", bytes.len()),
        SafeTensorError::HeaderTooLarge => "not a safetensors file: the header length is over 100 MB".into(),
        SafeTensorError::InvalidHeaderLength => {
            format!("truncated or not a safetensors file: the header length runs past the end of the file ({} bytes)", bytes.len())
        }
        SafeTensorError::InvalidHeader => "not a safetensors file: the header is not UTF-8 text".into(),
        SafeTensorError::InvalidHeaderStart | SafeTensorError::InvalidHeaderDeserialization | SafeTensorError::JsonError(_) => {
            "not a safetensors file: the header is not a valid safetensors JSON table (name -> dtype, shape, data_offsets)".into()
        }
        SafeTensorError::InvalidOffset(name) => {
            format!("tensor `{name}`: its data_offsets do not follow the previous tensor's (overlapping, out of order or reversed)")
        }
        SafeTensorError::ValidationOverflow => "a tensor's shape is too large to address (its size overflows)".into(),
        SafeTensorError::TensorInvalidInfo => {
            let size = |d: &str| match d {
                "F64" | "I64" | "U64" => Some(8),
                "F32" | "I32" | "U32" => Some(4),
                "F16" | "BF16" | "I16" | "U16" => Some(2),
                "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
                _ => None,
            };
            let bad = tensors().into_iter().find(|(_, d, shape, s, e)| {
                let need = shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x)).and_then(|n| n.checked_mul(size(d)?));
                need != e.checked_sub(*s)
            });
            match bad {
                Some((name, d, shape, s, e)) => {
                    format!("tensor `{name}` ({d}, shape {shape:?}) has data_offsets [{s}, {e}], which do not hold its shape")
                }
                None => "a tensor's data_offsets do not match its dtype and shape".into(),
            }
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            let data_end = tensors().iter().map(|t| t.4).max().unwrap_or(0);
            let have = bytes.len() as u64;
            let n = header().map(|_| u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")));
            match n.map(|n| 8 + n + data_end) {
                Some(want) if want > have => {
                    format!("truncated: the header describes {want} bytes but the file has {have}")
                }
                Some(want) => format!(
                    "{} unexpected bytes after the last tensor: the header describes {want} bytes but the file has {have}",
                    have - want
                ),
                None => "the tensor data does not fill the file exactly".into(),
            }
        }
        other => format!("not a valid safetensors file ({other:?})"),
    }
}
