//! Building blocks shared by the target and the drafter, with the reference's rounding points.

use std::ops::Range;

use rayon::prelude::*;

use crate::kernels::{self, DType, MatRef};
use crate::model::cache::LayerKv;

/// RMSNorm of each row, rounded to the model dtype.
pub fn norm_rows(x: &[f32], rows: usize, w: &[f32], eps: f32, dt: DType) -> Vec<f32> {
    let width = x.len() / rows;
    let mut out = vec![0f32; x.len()];
    for (o, r) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        kernels::rms_norm(r, Some(w), eps, o);
    }
    dt.round_slice(&mut out);
    out
}

/// RMSNorm over each head of `x` (`[.., d]`) in place (`w = None` is v_norm).
pub fn norm_heads(x: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32, dt: DType) {
    let mut tmp = vec![0f32; d];
    for head in x.chunks_exact_mut(d) {
        kernels::rms_norm(head, w, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
    dt.round_slice(x);
}

/// `h = h + round(rms(y; w))`, rounded.
pub fn add_normed(h: &mut [f32], y: &[f32], w: &[f32], eps: f32, dt: DType) {
    let width = w.len();
    let mut tmp = vec![0f32; width];
    for (hr, yr) in h.chunks_exact_mut(width).zip(y.chunks_exact(width)) {
        kernels::rms_norm(yr, Some(w), eps, &mut tmp);
        dt.round_slice(&mut tmp);
        for (a, b) in hr.iter_mut().zip(&tmp) {
            *a += *b;
        }
        dt.round_slice(hr);
    }
}

/// `down(gelu(gate(x)) ⊙ up(x))` with the reference's roundings.
pub fn gelu_mlp(x: &[f32], rows: usize, gate: MatRef, up: MatRef, down: MatRef, dt: DType) -> Vec<f32> {
    let inter = gate.rows;
    let mut g = vec![0f32; rows * inter];
    let mut u = vec![0f32; rows * inter];
    kernels::matmul(x, rows, gate, &mut g);
    kernels::matmul(x, rows, up, &mut u);
    dt.round_slice(&mut g);
    dt.round_slice(&mut u);
    kernels::gelu_tanh(&mut g);
    dt.round_slice(&mut g);
    for (a, b) in g.iter_mut().zip(&u) {
        *a *= b;
    }
    dt.round_slice(&mut g);
    let mut out = vec![0f32; rows * down.rows];
    kernels::matmul(&g, rows, down, &mut out);
    dt.round_slice(&mut out);
    out
}

/// Attention of `rows` query rows (`q`: `[rows, hq, D]`) over a layer's K/V, scale 1.0 (spec §3.4): row `r`
/// sees the absolute key positions `keys(r)`. Scores and probabilities are rounded like the reference's
/// eager path (bf16 matmul outputs, f32 softmax cast back).
///
/// The query heads that share a KV head are processed together, so each key and value is read once per
/// group rather than once per head (Gemma 4 has up to 16 query heads per KV head); groups are split only
/// when there are fewer groups than threads. Each head's arithmetic is the same either way.
pub fn attend(q: &[f32], kv: &LayerKv, rows: usize, hq: usize, keys: impl Fn(usize) -> Range<usize> + Sync, dt: DType, out: &mut [f32]) {
    let d = kv.head_dim;
    let group = hq / kv.kv_heads;
    let threads = rayon::current_num_threads();
    let mut sub = group;
    while rows * (hq / sub) < threads && sub % 2 == 0 {
        sub /= 2;
    }
    let per_row = hq / sub;
    let work = |(idx, o): (usize, &mut [f32])| {
        let (r, h0) = (idx / per_row, (idx % per_row) * sub);
        let g = h0 / group;
        let range = keys(r);
        debug_assert!(range.start >= kv.start && range.end <= kv.end(), "cache lacks positions {range:?}");
        let qs = &q[(r * hq + h0) * d..(r * hq + h0 + sub) * d];
        let n = range.len();
        let mut s = vec![0f32; sub * n];
        let mut buf = vec![0f32; d];
        for (i, t) in range.clone().enumerate() {
            let k = kv.key(t, g, &mut buf);
            for (j, qv) in qs.chunks_exact(d).enumerate() {
                s[j * n + i] = dt.round(kernels::dot(qv, k));
            }
        }
        for p in s.chunks_exact_mut(n.max(1)) {
            kernels::softmax(p);
            dt.round_slice(p);
        }
        o.iter_mut().for_each(|x| *x = 0.0);
        for (i, t) in range.enumerate() {
            let v = kv.value(t, g, &mut buf);
            for (j, oj) in o.chunks_exact_mut(d).enumerate() {
                kernels::axpy(s[j * n + i], v, oj);
            }
        }
        dt.round_slice(o);
    };
    let work_size = rows * hq * keys(rows.saturating_sub(1)).len() * d;
    if work_size > 1 << 16 {
        out.par_chunks_mut(sub * d).enumerate().for_each(work);
    } else {
        out.chunks_mut(sub * d).enumerate().for_each(work);
    }
}
