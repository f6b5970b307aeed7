//! The GGUF container (docs/gguf.md, "The container"): header, metadata, tensor table and aligned data,
//! read from a memory mapping without trusting any count or offset in it. Version 2 and 3, little-endian;
//! split files (`-00001-of-0000N.gguf`) are opened together.
//!
//! No crate is used for the container: the ones on crates.io replace invalid UTF-8 in strings silently,
//! truncate long arrays (the vocabulary) unless told otherwise, or change `serde_json`'s number handling for
//! the whole program. The format is small; here every read is bounds-checked and every count is checked
//! against the bytes left before anything is allocated by it.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;

use crate::kernels::QType;
use crate::weights::{file_buffer, Buffer};

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// Most dimensions a tensor may have (as ggml).
const MAX_DIMS: usize = 4;

/// How deeply arrays may nest in metadata (real files nest none).
const MAX_ARRAY_DEPTH: usize = 2;

/// Whether `path` is a regular file that starts with the GGUF magic (an Ollama blob has no extension, so
/// the name decides nothing).
pub fn is_gguf(path: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(path) else { return false };
    if !meta.is_file() {
        return false;
    }
    let mut head = [0u8; 4];
    crate::files::open_regular(path).and_then(|mut f| Ok(f.read_exact(&mut head)?)).is_ok() && head == MAGIC
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The GGUF name of the value's type, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F32(_) => "float32",
            MetaValue::F64(_) => "float64",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// An integer of any width, if it is one.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A number of any type as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }
}

/// A ggml element type by its id in the file. Only some are run (`storage`); the rest are named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType(pub u32);

/// ggml's type ids and names (ids 4 and 5 were removed from ggml and never appear).
const GGML_NAMES: [(u32, &str); 35] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
    (40, "NVFP4"),
    (41, "Q1_0"),
    (42, "Q2_0"),
];

/// How tandem holds a tensor of a given ggml type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    F16,
    BF16,
    I32,
    I64,
    Quant(QType),
}

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const I32: GgmlType = GgmlType(26);
    pub const I64: GgmlType = GgmlType(27);
    pub const BF16: GgmlType = GgmlType(30);

    pub fn name(self) -> Option<&'static str> {
        GGML_NAMES.iter().find(|(id, _)| *id == self.0).map(|(_, n)| *n)
    }

    /// What tandem runs this type as, if it does.
    pub fn storage(self) -> Option<Storage> {
        match self {
            GgmlType::F32 => Some(Storage::F32),
            GgmlType::F16 => Some(Storage::F16),
            GgmlType::BF16 => Some(Storage::BF16),
            GgmlType::I32 => Some(Storage::I32),
            GgmlType::I64 => Some(Storage::I64),
            GgmlType(id) => QType::ALL.into_iter().find(|q| q.ggml_id() == id).map(Storage::Quant),
        }
    }

    /// Bytes of a tensor of this type with `ne0` elements per row and `rows` rows; `None` if `ne0` is not
    /// a whole number of blocks or the size overflows.
    fn bytes(self, ne0: u64, rows: u64) -> Option<u64> {
        let row = match self.storage()? {
            Storage::F32 | Storage::I32 => ne0.checked_mul(4)?,
            Storage::F16 | Storage::BF16 => ne0.checked_mul(2)?,
            Storage::I64 => ne0.checked_mul(8)?,
            Storage::Quant(q) => q.row_bytes(usize::try_from(ne0).ok()?)? as u64,
        };
        row.checked_mul(rows)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "an unknown type (id {})", self.0),
        }
    }
}

/// The types `storage` accepts, for errors.
pub fn supported_types() -> String {
    let mut v: Vec<&str> = vec!["F32", "F16", "BF16"];
    v.extend(QType::ALL.iter().map(|q| q.name()));
    v.join(", ")
}

/// One entry of the tensor table, checked against its file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte range in its file.
    pub start: usize,
    pub len: usize,
    /// Index of the split file holding it.
    pub file: usize,
}

impl TensorInfo {
    /// The shape in row-major order (as safetensors and PyTorch write it): ggml's dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// One file of a GGUF model, mapped.
pub struct GgufFile {
    pub path: PathBuf,
    /// The file's bytes (a mapping, or a huge-page copy with `--huge-pages`).
    pub buffer: Arc<Buffer>,
    pub version: u32,
    pub meta: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

/// A bounds-checked reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            bail!(
                "truncated: {} at byte {} needs {n} bytes but the file ends at {}",
                what(),
                self.at,
                self.bytes.len()
            );
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).ok().filter(|&n| n <= self.left()).ok_or_else(|| {
            anyhow!("truncated or corrupt: {} claims {n} bytes but only {} remain in the file", what(), self.left())
        })?;
        let bytes = self.take(n, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => bail!("{} is not UTF-8 (invalid byte at offset {})", what(), e.valid_up_to()),
        }
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => bail!("{} is a bool stored as {b}, not 0 or 1", what()),
            },
            8 => MetaValue::Str(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!("{} nests arrays more than {MAX_ARRAY_DEPTH} deep", what());
                }
                let item = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte (a string at least its 8-byte length): a count the
                // rest of the file cannot hold is corrupt, and must not size an allocation.
                let min = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => bail!("{} is an array of unknown value type {other}", what()),
                };
                let n = usize::try_from(n).ok().filter(|n| n.checked_mul(min).is_some_and(|b| b <= self.left()));
                let n = n.ok_or_else(|| {
                    anyhow!("truncated or corrupt: {} claims more elements than the rest of the file holds", what())
                })?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item, depth + 1, what)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => bail!("{} has unknown value type {other}", what()),
        })
    }
}

impl GgufFile {
    /// Map and parse one file; `index` is its position among the split files (0 for a single file).
    /// `to_quantize`: the weights are about to be quantized (see `weights::file_buffer`).
    pub fn open(path: &Path, index: usize, to_quantize: bool) -> Result<GgufFile> {
        let file = crate::files::open_regular(path)?;
        // SAFETY: the file is mapped read-only and tandem never writes it; a model file rewritten while
        // tandem runs is outside what any loader can defend against.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let parsed = parse(&map, index).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let (version, meta, tensors) = parsed;
        let buffer = Arc::new(file_buffer(map, to_quantize).with_context(|| format!("{}", path.display()))?);
        Ok(GgufFile { path: path.to_path_buf(), buffer, version, meta, tensors })
    }
}

/// Header, metadata and tensor table of `bytes`, each tensor checked to lie inside them.
fn parse(bytes: &[u8], index: usize) -> Result<(u32, BTreeMap<String, MetaValue>, Vec<TensorInfo>)> {
    if bytes.len() < 4 || bytes[..4] != MAGIC {
        let got = &bytes[..bytes.len().min(4)];
        bail!("not a GGUF file: it starts with {got:02x?}, not the magic \"GGUF\"");
    }
    let mut c = Cursor { bytes, at: 4 };
    let version = c.u32(&|| "the version".into())?;
    match version {
        2 | 3 => {}
        1 => bail!("GGUF version 1 (from 2023, before 64-bit counts) is not supported; convert the model again"),
        v if v.swap_bytes() <= 3 => {
            bail!("a big-endian GGUF file (version {}); tandem reads little-endian files", v.swap_bytes())
        }
        v => bail!("unknown GGUF version {v}; tandem reads versions 2 and 3"),
    }
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    let n_kv = c.u64(&|| "the metadata count".into())?;
    // A key-value pair takes at least 8 + 4 + 1 bytes and a tensor entry 8 + 4 + 8 + 4 + 8.
    if n_kv > (c.left() / 13) as u64 {
        bail!("truncated or corrupt header: {n_kv} metadata entries cannot fit in a file of {} bytes", bytes.len());
    }
    if n_tensors > (c.left() / 32) as u64 {
        bail!("truncated or corrupt header: {n_tensors} tensors cannot fit in a file of {} bytes", bytes.len());
    }
    let mut meta = BTreeMap::new();
    for i in 0..n_kv as usize {
        let key = c.string(&|| format!("the key of metadata entry {i}"))?;
        let what = || format!("metadata `{key}`");
        let ty = c.u32(&what)?;
        let value = c.value(ty, 0, &what)?;
        if meta.insert(key.clone(), value).is_some() {
            bail!("metadata `{key}` appears twice");
        }
    }
    let alignment = match meta.get("general.alignment") {
        None => 32,
        Some(MetaValue::U32(a)) if a.is_power_of_two() => *a as usize,
        Some(v) => bail!("metadata `general.alignment` must be a power of two (uint32), got {v:?}"),
    };
    let mut infos = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors as usize {
        let name = c.string(&|| format!("the name of tensor {i}"))?;
        let what = || format!("tensor `{name}`");
        let n_dims = c.u32(&what)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            bail!("tensor `{name}` has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}");
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let ty = GgmlType(c.u32(&what)?);
        let offset = c.u64(&what)?;
        if !names.insert(name.clone()) {
            bail!("tensor `{name}` appears twice");
        }
        infos.push((name, dims, ty, offset));
    }
    let data_start = c.at.next_multiple_of(alignment);
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, ty, offset) in infos {
        if ty.storage().is_none() {
            bail!("tensor `{name}` has type {ty}, which tandem does not run (it runs {})", supported_types());
        }
        if dims.contains(&0) {
            bail!("tensor `{name}` has a zero dimension {dims:?}");
        }
        let rows = dims[1..].iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let len = rows.and_then(|r| ty.bytes(dims[0], r)).ok_or_else(|| match ty.storage() {
            Some(Storage::Quant(q)) if dims[0] % q.block_elems() as u64 != 0 => anyhow!(
                "tensor `{name}` ({ty}) has rows of {} elements, not a multiple of its {}-element blocks",
                dims[0],
                q.block_elems()
            ),
            _ => anyhow!("tensor `{name}` has dimensions {dims:?} too large to address"),
        })?;
        if offset % alignment as u64 != 0 {
            bail!("tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}");
        }
        let start = (data_start as u64).checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len)).filter(|&e| e <= bytes.len() as u64);
        let Some(end) = end else {
            bail!(
                "truncated: tensor `{name}` ({len} bytes at data offset {offset}) ends past the end of the file ({} bytes)",
                bytes.len()
            );
        };
        let start = (end - len) as usize;
        tensors.push(TensorInfo { name, dims, ty, start, len: len as usize, file: index });
    }
    Ok((version, meta, tensors))
}

/// A GGUF model: one file or all parts of a split one, with the first part's metadata.
pub struct GgufModel {
    pub files: Vec<GgufFile>,
    tensors: BTreeMap<String, TensorInfo>,
}

/// `stem-00001-of-00003.gguf` → (`stem`, 3), for the first part of a split model.
fn split_name(path: &Path) -> Option<(String, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let base = name.strip_suffix(".gguf")?;
    let (rest, count) = base.rsplit_once("-of-")?;
    let (stem, no) = rest.rsplit_once('-')?;
    let ok = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !ok(no) || !ok(count) {
        return None;
    }
    Some((stem.to_string(), no.parse().ok()?, count.parse().ok()?))
}

impl GgufModel {
    /// Open `path`, and the other parts when it is the first part of a split model.
    pub fn open(path: &Path, to_quantize: bool) -> Result<GgufModel> {
        let first = GgufFile::open(path, 0, to_quantize)?;
        let count = match first.meta.get("split.count") {
            None => 1,
            Some(v) => {
                v.as_i128().and_then(|n| usize::try_from(n).ok()).filter(|&n| (1..=99_999).contains(&n)).ok_or_else(
                    || anyhow!("{}: metadata `split.count` must be a count of files, got {v:?}", path.display()),
                )?
            }
        };
        let no = first.meta.get("split.no").and_then(MetaValue::as_i128).unwrap_or(0);
        if no != 0 {
            bail!(
                "{} is part {} of a model split into {count} files; pass the first part (…-00001-of-{count:05}.gguf)",
                path.display(),
                no + 1
            );
        }
        let mut files = vec![first];
        if count > 1 {
            let Some((stem, _, named)) = split_name(path) else {
                bail!(
                    "{}: the file says it is the first of {count} parts, but its name is not of the form NAME-00001-of-{count:05}.gguf, so the other parts cannot be found",
                    path.display()
                );
            };
            if named != count {
                bail!("{}: the name says {named} parts but metadata `split.count` says {count}", path.display());
            }
            for i in 1..count {
                let part = path.with_file_name(format!("{stem}-{:05}-of-{count:05}.gguf", i + 1));
                if !crate::files::exists(&part) {
                    bail!("{}: part {} of {count} ({}) is missing", path.display(), i + 1, part.display());
                }
                let f = GgufFile::open(&part, i, to_quantize)?;
                let pno = f.meta.get("split.no").and_then(MetaValue::as_i128);
                if pno != Some(i as i128) {
                    bail!("{}: metadata `split.no` is {pno:?}, expected {i}", part.display());
                }
                files.push(f);
            }
        }
        let mut tensors = BTreeMap::new();
        for f in &files {
            for t in &f.tensors {
                if tensors.insert(t.name.clone(), t.clone()).is_some() {
                    bail!("{}: tensor `{}` appears in more than one part", f.path.display(), t.name);
                }
            }
        }
        if let Some(want) = files[0].meta.get("split.tensors.count").and_then(MetaValue::as_i128) {
            if want != tensors.len() as i128 {
                bail!(
                    "{}: metadata `split.tensors.count` says {want} tensors but the parts hold {}",
                    path.display(),
                    tensors.len()
                );
            }
        }
        Ok(GgufModel { files, tensors })
    }

    /// Open `path` to read its metadata only: the file is mapped but not read in up front.
    pub fn open_metadata(path: &Path) -> Result<GgufModel> {
        GgufModel::open(path, true)
    }

    pub fn path(&self) -> &Path {
        &self.files[0].path
    }

    pub fn meta(&self) -> &BTreeMap<String, MetaValue> {
        &self.files[0].meta
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    /// The bytes of a tensor.
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.files[t.file].buffer.bytes()[t.start..t.start + t.len]
    }

    fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta().get(key)
    }

    fn wrong(&self, key: &str, want: &str, v: &MetaValue) -> anyhow::Error {
        anyhow!("{}: metadata `{key}` must be {want}, got a {} ({v:?})", self.path().display(), v.type_name())
    }

    /// A non-negative integer key (any integer type), if present.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_i128()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
            })
            .transpose()
    }

    /// A required non-negative integer key.
    pub fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| self.wrong(key, "a number", v))).transpose()
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "a bool", v)),
        }
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    /// An array key, if present.
    pub fn array_opt(&self, key: &str) -> Result<Option<&[MetaValue]>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(key, "an array", v)),
        }
    }

    /// A key that is either one non-negative integer or one per layer (`n` of them).
    pub fn per_layer_usize(&self, key: &str, n: usize) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => {
                if a.len() != n {
                    bail!(
                        "{}: metadata `{key}` has {} entries, expected one per layer ({n})",
                        self.path().display(),
                        a.len()
                    );
                }
                a.iter()
                    .map(|v| {
                        v.as_i128()
                            .and_then(|x| usize::try_from(x).ok())
                            .ok_or_else(|| self.wrong(key, "an array of non-negative integers", v))
                    })
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            }
            Some(_) => Ok(self.usize_opt(key)?.map(|v| vec![v; n])),
        }
    }

    pub fn missing(&self, key: &str) -> anyhow::Error {
        anyhow!("{}: required metadata `{key}` is missing", self.path().display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(
            split_name(Path::new("/m/gemma-4-E2B-Q8_0-00001-of-00003.gguf")),
            Some(("gemma-4-E2B-Q8_0".into(), 1, 3))
        );
        assert_eq!(split_name(Path::new("/m/model.gguf")), None);
        assert_eq!(split_name(Path::new("/m/x-1-of-3.gguf")), None);
    }

    #[test]
    fn type_names_and_sizes() {
        assert_eq!(GgmlType(23).to_string(), "IQ4_XS");
        assert_eq!(GgmlType(99).to_string(), "an unknown type (id 99)");
        assert_eq!(GgmlType(8).storage(), Some(Storage::Quant(QType::Q8_0)));
        assert_eq!(GgmlType(8).bytes(64, 2), Some(2 * 2 * 34));
        assert_eq!(GgmlType(8).bytes(48, 1), None);
        assert_eq!(GgmlType::BF16.bytes(3, 5), Some(30));
    }
}
