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

/// Query rows whose keys and values are read together (a verify forward is one block).
const ROW_BLOCK: usize = 17;

/// Attention of `rows` query rows (`q`: `[rows, hq, D]`) over a layer's K/V, scale 1.0 (spec §3.4): row `r`
/// sees the absolute key positions `keys(r)`. Scores and probabilities are rounded like the reference's
/// eager path (bf16 matmul outputs, f32 softmax cast back).
///
/// Each key and value is read once for all the query heads that share its KV head and for a block of up to
/// `ROW_BLOCK` rows (Gemma 4 has up to 16 query heads per KV head, and a verify forward's rows see nearly
/// the same keys), so at long contexts the cost of attention grows far slower than heads x rows. Heads are
/// split across threads only when there are fewer tasks than threads. Each (row, head)'s arithmetic is the
/// same however the work is grouped, so the output does not depend on `rows` or the thread count.
pub fn attend(q: &[f32], kv: &LayerKv, rows: usize, hq: usize, keys: impl Fn(usize) -> Range<usize> + Sync, dt: DType, out: &mut [f32]) {
    let d = kv.head_dim;
    let group = hq / kv.kv_heads;
    let blocks = rows.div_ceil(ROW_BLOCK);
    let block_rows = rows.div_ceil(blocks.max(1));
    let threads = rayon::current_num_threads();
    let mut sub = group;
    while blocks * (hq / sub) < threads && sub % 2 == 0 {
        sub /= 2;
    }
    let tasks: Vec<(usize, usize)> = (0..blocks).flat_map(|b| (0..hq / sub).map(move |hs| (b * block_rows, hs * sub))).collect();
    let work = |&(r0, h0): &(usize, usize)| -> Vec<f32> {
        let g = h0 / group;
        let ranges: Vec<Range<usize>> = (r0..(r0 + block_rows).min(rows)).map(&keys).collect();
        // Scores of row i, head j, key t at offset[i] + j * len_i + (t - start_i).
        let mut offset = Vec::with_capacity(ranges.len());
        let mut total = 0;
        for range in &ranges {
            debug_assert!(range.is_empty() || (range.start >= kv.start && range.end <= kv.end()), "cache lacks positions {range:?}");
            offset.push(total);
            total += sub * range.len();
        }
        let lo = ranges.iter().filter(|r| !r.is_empty()).map(|r| r.start).min().unwrap_or(0);
        let hi = ranges.iter().map(|r| r.end).max().unwrap_or(0);
        let mut s = vec![0f32; total];
        let mut buf = vec![0f32; d];
        for t in lo..hi {
            let k = kv.key(t, g, &mut buf);
            for (i, range) in ranges.iter().enumerate().filter(|(_, r)| r.contains(&t)) {
                let (n, at) = (range.len(), offset[i] + t - range.start);
                let qs = &q[((r0 + i) * hq + h0) * d..][..sub * d];
                for (j, qv) in qs.chunks_exact(d).enumerate() {
                    s[at + j * n] = dt.round(kernels::dot(qv, k));
                }
            }
        }
        for (i, range) in ranges.iter().enumerate() {
            for p in s[offset[i]..offset[i] + sub * range.len()].chunks_exact_mut(range.len().max(1)) {
                kernels::softmax(p);
                dt.round_slice(p);
            }
        }
        let mut o = vec![0f32; ranges.len() * sub * d];
        for t in lo..hi {
            let v = kv.value(t, g, &mut buf);
            for (i, range) in ranges.iter().enumerate().filter(|(_, r)| r.contains(&t)) {
                let (n, at) = (range.len(), offset[i] + t - range.start);
                for (j, oj) in o[i * sub * d..][..sub * d].chunks_exact_mut(d).enumerate() {
                    kernels::axpy(s[at + j * n], v, oj);
                }
            }
        }
        dt.round_slice(&mut o);
        o
    };
    let work_size = rows * hq * keys(rows.saturating_sub(1)).len() * d;
    let results: Vec<Vec<f32>> =
        if work_size > 1 << 16 { tasks.par_iter().map(work).collect() } else { tasks.iter().map(work).collect() };
    for (&(r0, h0), o) in tasks.iter().zip(&results) {
        for (i, oi) in o.chunks_exact(sub * d).enumerate() {
            out[((r0 + i) * hq + h0) * d..][..sub * d].copy_from_slice(oi);
        }
    }
}
