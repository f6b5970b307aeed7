//! The few numerical kernels an LLM forward pass needs.
//!
//! Activations are always `f32` slices; weights are [`MatRef`] views in their checkpoint dtype, read
//! directly from the memory map. Every kernel has a portable scalar version (`scalar`), which is the
//! reference the SIMD versions are tested against.
//!
//! The SIMD versions live one file per instruction set (`avx2`, `avx512`, `avx512bf16`, plus `x86`
//! for what they share); [`isa`] picks the best one the CPU has once per process, and every kernel
//! also has a `*_with(isa, ..)` form so tests can run each path. `unsafe` lives only in those files;
//! this one dispatches, and `tiling` (safe) cuts a matmul into threads, cache blocks and tiles.
//!
//! Matmul results are *batch invariant*: each output element is produced by the same sequence of
//! floating-point operations whatever `m`, the tiling or the thread count, so row `i` of a 16-row
//! verification matmul is bit-identical to the same row computed alone (for a given [`Isa`]).

pub mod bandwidth;
pub mod quant;
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_quant;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_quant;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod pool;
pub mod q4kx16;
pub mod q6kx16;
pub mod q8x16;
#[cfg(test)]
mod quant_tests;
#[cfg(test)]
mod tests;
mod tiling;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

pub use quant::{QMatRef, QType};

/// Whether the loaded target's per-step weights fit in the last-level cache (`note_step_bytes`).
static STEP_FITS_CACHE: AtomicBool = AtomicBool::new(false);

/// Tell the kernels how many bytes of weights a decode step reads (a target calls it when it loads):
/// when they fit in the last-level cache, one-row bf16 products on Zen 4 ask for their weights ahead
/// in software, which pays where the weights come from cache and costs where they come from memory
/// (docs/numerics.md, "One-row bf16 products on Zen 4"). Only speed depends on it, never a result.
pub fn note_step_bytes(bytes: usize) {
    STEP_FITS_CACHE.store(last_level_cache_bytes().is_some_and(|c| bytes <= c), Ordering::Relaxed);
}

/// See [`note_step_bytes`].
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn step_fits_cache() -> bool {
    STEP_FITS_CACHE.load(Ordering::Relaxed)
}

/// The size of CPU 0's highest-level cache as Linux reports it (`/sys/devices/system/cpu`), once;
/// `None` elsewhere or when it cannot be read.
pub fn last_level_cache_bytes() -> Option<usize> {
    static LLC: OnceLock<Option<usize>> = OnceLock::new();
    *LLC.get_or_init(|| {
        let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
        let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
        let mut best: Option<(u32, usize)> = None;
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let (Some(level), Some(size)) = (read(entry.path().join("level")), read(entry.path().join("size"))) else {
                continue;
            };
            let (Ok(level), Some(bytes)) = (level.parse::<u32>(), parse_cache_size(&size)) else { continue };
            if best.is_none_or(|(l, _)| level > l) {
                best = Some((level, bytes));
            }
        }
        best.map(|(_, bytes)| bytes)
    })
}

/// `32768K`, `32M` or a plain number of bytes, as sysfs writes a cache's size.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

/// Storage dtype of a weight tensor (and the "model dtype" whose rounding the forward pass mimics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// Round an f32 to this dtype and back (round to nearest even, like torch's casts).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::BF16 => bf16::from_f32(x).to_f32(),
            DType::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// Round every element to this dtype (a no-op for f32): the cast points of the reference forward.
    pub fn round_slice(self, xs: &mut [f32]) {
        self.round_slice_with(isa(), xs)
    }

    pub fn round_slice_with(self, isa: Isa, xs: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self == DType::BF16 {
            match runnable(isa) {
                Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => return avx512::round_bf16_slice(xs),
                Isa::Avx2 => return avx2::round_bf16_slice(xs),
                Isa::Scalar => {}
            }
        }
        if self != DType::F32 {
            for x in xs.iter_mut() {
                *x = self.round(*x);
            }
        }
    }

    /// Decode element `i` of a little-endian buffer of this dtype.
    #[inline]
    pub fn load(self, data: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap()),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])).to_f32(),
            DType::F16 => f16::from_bits(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])).to_f32(),
        }
    }
}

/// A row-major `[rows, cols]` matrix in its storage dtype.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        assert_eq!(data.len(), rows * cols * dtype.size(), "matrix buffer size");
        MatRef { dtype, rows, cols, data }
    }

    /// Rows `start..start+n` as a matrix of their own.
    pub fn slice_rows(&self, start: usize, n: usize) -> MatRef<'a> {
        assert!(start + n <= self.rows);
        let row_bytes = self.cols * self.dtype.size();
        MatRef {
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
            data: &self.data[start * row_bytes..(start + n) * row_bytes],
        }
    }

    /// Row `r` widened to f32 (exact), one whole row at a time so that the loop vectorises: an
    /// embedding lookup per token was a scalar load per element (docs/numerics.md, "Where a step's
    /// time goes").
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let size = self.dtype.size();
        let bytes = &self.data[r * self.cols * size..(r + 1) * self.cols * size];
        match self.dtype {
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            // bf16 is the upper half of an f32.
            DType::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
    }
}

/// A weight matrix in any storage format: float ([`MatRef`]) or block-quantized ([`QMatRef`]).
#[derive(Clone, Copy, Debug)]
pub enum Weight<'a> {
    Float(MatRef<'a>),
    Quant(QMatRef<'a>),
}

impl<'a> From<MatRef<'a>> for Weight<'a> {
    fn from(m: MatRef<'a>) -> Self {
        Weight::Float(m)
    }
}

impl<'a> From<QMatRef<'a>> for Weight<'a> {
    fn from(m: QMatRef<'a>) -> Self {
        Weight::Quant(m)
    }
}

impl<'a> Weight<'a> {
    pub fn rows(&self) -> usize {
        match self {
            Weight::Float(w) => w.rows,
            Weight::Quant(w) => w.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::Float(w) => w.cols,
            Weight::Quant(w) => w.cols,
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        match self {
            Weight::Float(w) => w.cols * w.dtype.size(),
            Weight::Quant(w) => w.row_bytes(),
        }
    }

    pub fn data(&self) -> &'a [u8] {
        match self {
            Weight::Float(w) => w.data,
            Weight::Quant(w) => w.data,
        }
    }

    /// Rows `start..start+n` as a matrix of their own.
    pub fn slice_rows(&self, start: usize, n: usize) -> Weight<'a> {
        match self {
            Weight::Float(w) => Weight::Float(w.slice_rows(start, n)),
            Weight::Quant(w) => Weight::Quant(w.slice_rows(start, n)),
        }
    }

    /// Row `r` as f32 (dequantized).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::Float(w) => w.row_f32(r, out),
            Weight::Quant(w) => w.row_f32(r, out),
        }
    }

    /// The same format over other bytes (`rows` whole rows).
    fn with_data<'b>(&self, rows: usize, data: &'b [u8]) -> Weight<'b> {
        match self {
            Weight::Float(w) => Weight::Float(MatRef::new(w.dtype, rows, w.cols, data)),
            Weight::Quant(w) => Weight::Quant(QMatRef::new(w.qtype, rows, w.cols, data)),
        }
    }
}

/// Instruction-set level of the kernels, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust loops (the reference).
    Scalar,
    /// AVX2 + FMA + F16C, 256-bit vectors.
    Avx2,
    /// AVX-512 F/BW/VL (+ FMA, F16C), 512-bit vectors; bf16 weights widened to f32.
    Avx512,
    /// AVX-512 plus AVX512_BF16: bf16 weights multiplied directly with `vdpbf16ps`.
    Avx512Bf16,
    /// AVX512_BF16 plus AMX-BF16: bf16 matmuls on the tile unit (`tdpbf16ps`), the rest as
    /// `Avx512Bf16`.
    Amx,
}

impl Isa {
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// Parse a name as accepted by `TANDEM_ISA` (case-insensitive).
    pub fn parse(s: &str) -> Option<Isa> {
        let s = s.trim();
        Isa::ALL.into_iter().find(|i| i.name().eq_ignore_ascii_case(s))
    }

    /// The best level this CPU supports, ignoring `TANDEM_ISA`. Detected once.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// Every level this CPU can run, lowest first.
    pub fn available() -> Vec<Isa> {
        let best = Isa::detected();
        Isa::ALL.into_iter().filter(|&i| i <= best).collect()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if amx::supported() {
            return Isa::Amx;
        }
        if avx512bf16::supported() {
            return Isa::Avx512Bf16;
        }
        if avx512::supported() {
            return Isa::Avx512;
        }
        if avx2::supported() {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The instruction set the kernels use: the detected one, or a lower one named by the environment
/// variable `TANDEM_ISA` (`scalar|avx2|avx512|avx512bf16|amx`). An unknown name, or one the CPU cannot
/// run, is ignored. Decided once per process.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = Isa::detected();
        match std::env::var("TANDEM_ISA").ok().as_deref().and_then(Isa::parse) {
            Some(wanted) if wanted <= best => wanted,
            _ => best,
        }
    })
}

/// Check `TANDEM_ISA` for a program to report at start: an unknown name, or a level this CPU cannot run,
/// is an error there (the kernels themselves fall back to the detected level).
pub fn check_isa_env() -> Result<(), String> {
    let Ok(v) = std::env::var("TANDEM_ISA") else { return Ok(()) };
    let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
    match Isa::parse(&v) {
        None => Err(format!("TANDEM_ISA={v:?} is not an instruction set tandem knows ({})", names.join(", "))),
        Some(w) if w > Isa::detected() => {
            Err(format!("TANDEM_ISA={v}: this CPU cannot run it (the best it runs is {})", Isa::detected()))
        }
        Some(_) => Ok(()),
    }
}

/// `isa` lowered to what this CPU can actually run (so `*_with` never executes unsupported code).
#[inline]
fn runnable(isa: Isa) -> Isa {
    isa.min(Isa::detected())
}

/// `out[i, j] = Σ_k x[i, k] · w[j, k]` for `i < m`: `x` is `[m, w.cols]`, `out` is `[m, w.rows]`.
///
/// With bf16 weights `x` is rounded to bf16 first (exact when the model runs in bf16, as the reference
/// does) and products are accumulated in f32. With quantized weights `x` is quantized per block into the
/// format's 8-bit companion first (see `quant`). Large matrices are split over rayon's global pool by
/// weight rows; the result does not depend on the thread count.
pub fn matmul<'a>(x: &[f32], m: usize, w: impl Into<Weight<'a>>, out: &mut [f32]) {
    matmul_with(isa(), x, m, w, out)
}

/// [`matmul`] of several weights against the same activations (a layer's K and V projections). The
/// products too small to be split over threads run side by side, one task each, in one parallel
/// region, rather than one after the other on this thread; the others run as [`matmul`] runs them.
/// Every output gets the bits [`matmul`] gives it: the same kernels, whichever thread runs them.
pub fn matmul_each(x: &[f32], m: usize, jobs: &mut [(Weight<'_>, &mut [f32])]) {
    let isa = isa();
    let alone = |w: &Weight<'_>| !tiling::would_split(w.rows(), w.row_bytes(), w.cols(), m);
    let (small, large): (Vec<_>, Vec<_>) = jobs.iter_mut().partition(|j| alone(&j.0));
    if small.len() > 1 && pool::width() > 1 {
        let slots: Vec<std::sync::Mutex<&mut (Weight<'_>, &mut [f32])>> =
            small.into_iter().map(std::sync::Mutex::new).collect();
        pool::for_each(slots.len(), &|i| {
            let mut job = slots[i].lock().unwrap_or_else(|e| e.into_inner());
            let (w, out) = &mut **job;
            matmul_with(isa, x, m, *w, out);
        });
    } else {
        for (w, out) in small {
            matmul_with(isa, x, m, *w, out);
        }
    }
    for (w, out) in large {
        matmul_with(isa, x, m, *w, out);
    }
}

/// Where each range of `w`'s rows ends for a caller that splits a product by those rows itself (one
/// task per range), or `None` where [`matmul`], called on this thread now, would not split it over
/// threads. Ranges start at multiples of every tile height, so each keeps whole tiles.
pub fn split_rows(w: &Weight<'_>, m: usize) -> Option<Vec<usize>> {
    tiling::split_rows(w.rows(), w.row_bytes(), w.cols(), m)
}

/// `row` cut at the increasing offsets `ends` (as [`split_rows`] gives them): one piece per end.
pub fn cut_at<'a>(row: &'a mut [f32], ends: &'a [usize]) -> impl Iterator<Item = &'a mut [f32]> {
    tiling::cut_at(row, ends)
}

/// [`matmul`] on a given instruction set (lowered to what the CPU supports).
pub fn matmul_with<'a>(isa: Isa, x: &[f32], m: usize, w: impl Into<Weight<'a>>, out: &mut [f32]) {
    match w.into() {
        Weight::Float(w) => matmul_split(isa, x, m, w, out, Split::Auto),
        Weight::Quant(w) => matmul_quant(isa, x, m, w, out, Split::Auto),
    }
}

/// The quantized matmul: activations quantized once, then weight-row chunks over threads.
pub(crate) fn matmul_quant(isa: Isa, x: &[f32], m: usize, w: QMatRef, out: &mut [f32], split: Split) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul input shape");
    assert_eq!(out.len(), m * n, "matmul output shape");
    if m == 0 || n == 0 {
        return;
    }
    thread_local! {
        /// The quantized activations' buffers, kept between calls. Taken while in use: a nested call on
        /// the same thread (rayon runs other work while a caller waits) finds them empty.
        static ACTS: std::cell::Cell<quant::QActs> = std::cell::Cell::new(quant::QActs::default());
    }
    let mut acts = ACTS.take();
    #[cfg(target_arch = "x86_64")]
    let simd = runnable(isa) >= Isa::Avx512 && avx512_quant::supported();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    quant::quantize_acts_with(w.qtype, x, m, k, &mut acts, simd);
    // Packed strips are sliced in whole strips (the automatic split's chunks already are).
    let split = match split {
        Split::Rows(r) if w.qtype.unpacked().is_some() => Split::Rows(r.next_multiple_of(quant::STRIP)),
        s => s,
    };
    let mut chunks = |f: &(dyn Fn(QMatRef, &mut [&mut [f32]]) + Sync)| {
        tiling::for_row_ranges(n, w.row_bytes(), k, m, out, split, |rows, outs| {
            f(w.slice_rows(rows.start, rows.len()), outs)
        })
    };
    if w.qtype == QType::Q8_0x16 {
        thread_local! {
            static OFFS: std::cell::Cell<Vec<i32>> = const { std::cell::Cell::new(Vec::new()) };
        }
        let mut offs = OFFS.take();
        q8x16::offsets(&acts, &mut offs);
        chunks(&|wc, outs| q8x16::matmul(isa, &acts, &offs, wc, outs));
        OFFS.set(offs);
        ACTS.set(acts);
        return;
    }
    if matches!(w.qtype, QType::Q4_Kx16 | QType::Q6_Kx16) {
        thread_local! {
            static WORDS: std::cell::Cell<Vec<i32>> = const { std::cell::Cell::new(Vec::new()) };
        }
        let mut words = WORDS.take();
        if w.qtype == QType::Q4_Kx16 {
            q4kx16::sub_sums(&acts, &mut words);
            chunks(&|wc, outs| q4kx16::matmul(isa, &acts, &words, wc, outs));
        } else {
            q6kx16::offsets(&acts, &mut words);
            chunks(&|wc, outs| q6kx16::matmul(isa, &acts, &words, wc, outs));
        }
        WORDS.set(words);
        ACTS.set(acts);
        return;
    }
    match runnable(isa) {
        // The activations laid out for the kernels once, for every chunk.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx if avx512_quant::supported() => {
            avx512_quant::with_prepared(&acts, w.qtype, |p| {
                chunks(&|wc, outs| avx512_quant::matmul_prepared(p, wc, outs))
            })
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => chunks(&|wc, outs| avx2_quant::matmul(&acts, wc, outs)),
        _ => chunks(&|wc, outs| quant::matmul(&acts, wc, outs)),
    }
    ACTS.set(acts);
}

/// How a matmul's weight rows are divided among threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// Decide from the matrix size and the pool size.
    Auto,
    /// Chunks of (about) this many rows, parallel even for tiny matrices (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    Rows(usize),
}

pub(crate) fn matmul_split(isa: Isa, x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul input shape");
    assert_eq!(out.len(), m * n, "matmul output shape");
    assert_eq!(w.data.len(), n * k * w.dtype.size(), "matmul weight buffer size");
    if m == 0 || n == 0 {
        return;
    }
    match runnable(isa) {
        Isa::Scalar => scalar::matmul(x, m, w, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::matmul(x, m, w, out, split),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::matmul(x, m, w, out, split),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => match w.dtype {
            DType::BF16 => avx512bf16::matmul(x, m, w, out, split),
            _ => avx512::matmul(x, m, w, out, split),
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => match w.dtype {
            DType::BF16 => amx::matmul(x, m, w, out, split),
            _ => avx512::matmul(x, m, w, out, split),
        },
        #[cfg(not(target_arch = "x86_64"))]
        _ => {
            let _ = split;
            scalar::matmul(x, m, w, out)
        }
    }
}

/// RMSNorm of one row: `out = x · (mean(x²) + eps)^(-1/2) · w` (no `1 + w` offset; `w = None` for v_norm).
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    rms_norm_with(isa(), x, w, eps, out)
}

pub fn rms_norm_with(isa: Isa, x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "rms_norm shapes");
    if let Some(w) = w {
        assert_eq!(w.len(), x.len(), "rms_norm weight shape");
    }
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::rms_norm(x, w, eps, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::rms_norm(x, w, eps, out),
        _ => scalar::rms_norm(x, w, eps, out),
    }
}

/// tanh-approximated GELU in place (`gelu_pytorch_tanh`).
///
/// The SIMD versions compute the same function as `x · sigmoid(2y)` with a vector `exp`; they agree
/// with the scalar version to ~1e-6 relative (the scalar one loses relative accuracy for x ≪ 0,
/// where `1 + tanh` cancels).
pub fn gelu_tanh(x: &mut [f32]) {
    gelu_tanh_with(isa(), x)
}

pub fn gelu_tanh_with(isa: Isa, x: &mut [f32]) {
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::gelu_tanh(x),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::gelu_tanh(x),
        _ => scalar::gelu_tanh(x),
    }
}

/// Final-logit softcapping `c·tanh(x/c)` in place, rounding each step to `dt` as the reference does.
pub fn softcap(x: &mut [f32], cap: f32, dt: DType) {
    softcap_with(isa(), x, cap, dt)
}

pub fn softcap_with(isa: Isa, x: &mut [f32], cap: f32, dt: DType) {
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx if dt != DType::F16 => avx512::softcap(x, cap, dt == DType::BF16),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if dt != DType::F16 => avx2::softcap(x, cap, dt == DType::BF16),
        _ => scalar::softcap(x, cap, dt),
    }
}

/// `v`, or zero if it is subnormal (magnitude below 2^-126, f32::MIN_POSITIVE), decided by its exponent
/// bits (no floating-point operation, so no assist): the scalar form of the rule the softmax and the
/// sampler's numerators follow (docs/numerics.md, "Subnormal probabilities").
#[inline]
pub fn flush_subnormal(v: f32) -> f32 {
    if v.to_bits() & 0x7f80_0000 == 0 {
        0.0
    } else {
        v
    }
}

/// Softmax in place, f32. A row whose entries are all `-inf` stays all zero. Exponentials and results
/// below 2^-126 (subnormal) are zero, which moves the sum (at least 1) by less than n · 2^-126; the SIMD
/// versions never compute them, since on Intel each operation on a subnormal takes a microcode assist
/// (docs/numerics.md, "Subnormal probabilities").
pub fn softmax(x: &mut [f32]) {
    softmax_with(isa(), x)
}

pub fn softmax_with(isa: Isa, x: &mut [f32]) {
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::softmax(x),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::softmax(x),
        _ => scalar::softmax(x),
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(isa(), a, b)
}

pub fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot shapes");
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::dot(a, b),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::dot(a, b),
        _ => scalar::dot(a, b),
    }
}

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_with(isa(), a, x, y)
}

pub fn axpy_with(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy shapes");
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::axpy(a, x, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::axpy(a, x, y),
        _ => scalar::axpy(a, x, y),
    }
}

/// `out[i] = exp(x[i] - m)` (`-inf` gives 0): softmax numerators over a whole vocabulary. Results below
/// 2^-126 (subnormal) are zero, as in [`softmax`]: at a low temperature most of a vocabulary's
/// numerators are, and computing them cost a microcode assist each on Intel.
pub fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    exp_shifted_with(isa(), x, m, out)
}

pub fn exp_shifted_with(isa: Isa, x: &[f32], m: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "exp_shifted shapes");
    match runnable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::exp_shifted(x, m, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::exp_shifted(x, m, out),
        _ => scalar::exp_shifted(x, m, out),
    }
}

/// `f` of every item, in parallel on the forward's threads (a spinning pool, `pool.rs`), results
/// in order. For the forward's per-head and per-sequence work; a call inside another parallel
/// region runs on its thread.
pub fn par_map<T: Send, U: Send>(items: Vec<T>, f: impl Fn(T) -> U + Sync) -> Vec<U> {
    pool::map(items, f)
}

/// `out[i, :] = Σ_t p[i, t] · v[t, :]` for the `m` rows of `p` (`[m, v.rows]`); `out` is `[m, v.cols]`.
/// Attention's probabilities times its values, with `v` read once for all rows. Each output element
/// adds its terms in `t` order (fused multiply-adds in the SIMD versions), so the result does not depend
/// on `m`: a row gets the same bits alone or in a batch.
pub fn weighted_rows(p: &[f32], m: usize, v: MatRef, out: &mut [f32]) {
    weighted_rows_with(isa(), p, m, v, out)
}

pub fn weighted_rows_with(isa: Isa, p: &[f32], m: usize, v: MatRef, out: &mut [f32]) {
    assert!(p.len() == m * v.rows && out.len() == m * v.cols, "weighted_rows shapes");
    let (n, d) = (v.rows, v.cols);
    // Large products are split by columns, whole 64-column blocks each: every thread reads its share of
    // each value row, so the values are read once in all (a long context's V is tens of MB).
    let threads = rayon::current_num_threads();
    let parts = if threads > 1 && m * n * d >= WEIGHTED_PAR_MIN_MACS { threads.min(d / 64) } else { 1 };
    if parts <= 1 {
        return weighted_cols(isa, p, m, v, 0..d, out);
    }
    let chunk = d.div_ceil(parts).div_ceil(64) * 64;
    let ranges: Vec<std::ops::Range<usize>> = (0..d).step_by(chunk).map(|c| c..d.min(c + chunk)).collect();
    let results: Vec<Vec<f32>> = par_map(ranges.clone(), |r| {
        let mut o = vec![0f32; m * r.len()];
        weighted_cols(isa, p, m, v, r, &mut o);
        o
    });
    for (r, o) in ranges.iter().zip(&results) {
        for (i, row) in o.chunks_exact(r.len()).enumerate() {
            out[i * d + r.start..i * d + r.end].copy_from_slice(row);
        }
    }
}

/// Multiply-adds below which [`weighted_rows`] stays on one thread.
const WEIGHTED_PAR_MIN_MACS: usize = 4 << 20;

/// [`weighted_rows`] for the columns `cols` only; `out` is `[m, cols.len()]`.
fn weighted_cols(isa: Isa, p: &[f32], m: usize, v: MatRef, cols: std::ops::Range<usize>, out: &mut [f32]) {
    match (runnable(isa), v.dtype) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx, DType::BF16 | DType::F32) => {
            avx512::weighted_rows(p, m, v, cols, out)
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::BF16 | DType::F32) => avx2::weighted_rows(p, m, v, cols, out),
        _ => scalar::weighted_rows(p, m, v, cols, out),
    }
}

/// Index of the largest value; ties go to the lowest index (torch's argmax). NaN never wins.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// `out[i] = Σ_k x[k] · w[ids[i], k]`: one input row against selected weight rows (the centroid head's
/// candidates), each result bit-identical to that row's entry of a full `matmul`, except with AMX. With
/// AVX512_BF16 or AVX2 and bf16 weights the rows are read where they are stored, by the kernel's one-row
/// path; otherwise they are copied into one contiguous block and multiplied by `matmul`.
///
/// With AMX the bf16 rows are read in place by the AVX512_BF16 path too, so they get the bits of an
/// `Isa::Avx512Bf16` matmul, not of the AMX one: a tile needs its rows at one stride, and copying the
/// shipped drafter's 512 candidates (128 KiB) into a block took half of its head's time
/// (docs/numerics.md, "AMX"). Nothing compares them with a full matmul: the candidates' logits are the
/// drafter's whole distribution, the same for a row alone or in a batch.
pub fn matmul_gather<'a>(x: &[f32], w: impl Into<Weight<'a>>, ids: &[u32], out: &mut [f32]) {
    let w = w.into();
    assert_eq!(ids.len(), out.len(), "matmul_gather output size");
    #[cfg(target_arch = "x86_64")]
    if let Weight::Float(f) = &w {
        match (isa(), f.dtype) {
            (Isa::Avx512Bf16 | Isa::Amx, DType::BF16) => return avx512bf16::gather(x, *f, ids, out, Split::Auto),
            (Isa::Avx2, DType::BF16) => return avx2::gather(x, *f, ids, out, Split::Auto),
            _ => {}
        }
    }
    // Packed strips: the candidates' rows in their file format (the bits of a plain matrix's gather).
    let w = match w {
        Weight::Quant(q) if q.qtype.unpacked().is_some() => {
            let file = q.qtype.unpacked().expect("checked by the guard");
            let rb = file.row_bytes(q.cols).expect("a packed matrix has whole blocks");
            let mut plain = vec![0u8; ids.len() * rb];
            for (&id, dst) in ids.iter().zip(plain.chunks_exact_mut(rb)) {
                q.unpack_row(id as usize, dst);
            }
            let ids: Vec<u32> = (0..ids.len() as u32).collect();
            return matmul_gather(x, QMatRef::new(file, ids.len(), q.cols, &plain), &ids, out);
        }
        w => w,
    };
    let row = w.row_bytes();
    thread_local! {
        /// The gathered rows, kept from call to call instead of allocated for each: every draft step
        /// gathers the same amount (128 KiB for the shipped drafter, more for the real ones).
        static BLOCK: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BLOCK.with(|b| {
        let mut block = b.take();
        block.clear();
        for &id in ids {
            let at = id as usize * row;
            block.extend_from_slice(&w.data()[at..at + row]);
        }
        matmul(x, 1, w.with_data(ids.len(), &block), out);
        b.replace(block);
    });
}
