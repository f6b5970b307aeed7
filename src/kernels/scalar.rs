//! Portable reference kernels. Simple loops, f32 accumulation; the SIMD kernels must agree with these.

use std::ops::Range;

use super::DType;
use super::MatRef;

pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul input shape");
    assert_eq!(out.len(), m * n, "matmul output shape");
    let mut xr = vec![0f32; k];
    let mut wr = vec![0f32; k];
    for i in 0..m {
        for (d, s) in xr.iter_mut().zip(&x[i * k..(i + 1) * k]) {
            *d = if w.dtype == DType::BF16 { DType::BF16.round(*s) } else { *s };
        }
        for j in 0..n {
            w.row_f32(j, &mut wr);
            out[i * n + j] = dot(&xr, &wr);
        }
    }
}

pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    match w {
        Some(w) => {
            assert_eq!(w.len(), x.len());
            for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
                *o = v * inv * g;
            }
        }
        None => {
            for (o, v) in out.iter_mut().zip(x) {
                *o = v * inv;
            }
        }
    }
}

pub fn gelu_tanh(x: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    for v in x.iter_mut() {
        let u = *v;
        *v = 0.5 * u * (1.0 + (C * (u + 0.044715 * u * u * u)).tanh());
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    // Subnormal exponentials and results are zero (`kernels::softmax`).
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = super::flush_subnormal((*v - max).exp());
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v = super::flush_subnormal(*v * inv));
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

pub fn softcap(x: &mut [f32], cap: f32, dt: DType) {
    for v in x.iter_mut() {
        let y = dt.round(dt.round(*v / cap).tanh());
        *v = dt.round(y * cap);
    }
}

/// `out[i, :] = Σ_t p[i, t] · v[t, cols]`, terms added in `t` order; `out` is `[m, cols.len()]`.
pub fn weighted_rows(p: &[f32], m: usize, v: MatRef, cols: Range<usize>, out: &mut [f32]) {
    let (n, d, w) = (v.rows, v.cols, cols.len());
    out.fill(0.0);
    let mut row = vec![0f32; d];
    for t in 0..n {
        v.row_f32(t, &mut row);
        for i in 0..m {
            let a = p[i * n + t];
            for (o, &x) in out[i * w..(i + 1) * w].iter_mut().zip(&row[cols.clone()]) {
                *o += a * x;
            }
        }
    }
}

pub fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = super::flush_subnormal((v - m).exp());
    }
}
