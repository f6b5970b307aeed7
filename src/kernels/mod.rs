//! The few numerical kernels an LLM forward pass needs.
//!
//! Activations are always `f32` slices; weights are [`MatRef`] views in their checkpoint dtype, read
//! directly from the memory map. Every kernel has a portable scalar version (`scalar`), which is the
//! reference the SIMD versions are tested against.

pub mod scalar;

use half::{bf16, f16};

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
        MatRef { dtype: self.dtype, rows: n, cols: self.cols, data: &self.data[start * row_bytes..(start + n) * row_bytes] }
    }

    /// Row `r` widened to f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let base = r * self.cols;
        for (j, o) in out.iter_mut().enumerate() {
            *o = self.dtype.load(self.data, base + j);
        }
    }
}

/// `out[i, j] = Σ_k x[i, k] · w[j, k]` for `i < m`: `x` is `[m, w.cols]`, `out` is `[m, w.rows]`.
///
/// With bf16 weights `x` is rounded to bf16 first (exact when the model runs in bf16, as the reference
/// does) and products are accumulated in f32.
pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32]) {
    scalar::matmul(x, m, w, out)
}

/// RMSNorm of one row: `out = x · (mean(x²) + eps)^(-1/2) · w` (no `1 + w` offset; `w = None` for v_norm).
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    scalar::rms_norm(x, w, eps, out)
}

/// tanh-approximated GELU in place (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: &mut [f32]) {
    scalar::gelu_tanh(x)
}

/// Softmax in place, f32. A row whose entries are all `-inf` stays all zero.
pub fn softmax(x: &mut [f32]) {
    scalar::softmax(x)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    scalar::dot(a, b)
}

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    scalar::axpy(a, x, y)
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
