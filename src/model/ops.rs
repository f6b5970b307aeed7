//! Building blocks shared by the target and the drafter, rounding where transformers does (docs/numerics.md,
//! "Rounding points").

use std::ops::Range;

use crate::kernels::{self, DType, Weight};
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

/// Activations per task in [`gelu_mlp`]'s element-wise part (when gate and up are not split).
const ACT_PIECE: usize = 2048;

/// `gelu(gate(x)) ⊙ up(x)` in place over `g` (gate's output) and `u` (up's), with transformers'
/// roundings.
fn gelu_product(g: &mut [f32], u: &mut [f32], dt: DType) {
    dt.round_slice(g);
    dt.round_slice(u);
    kernels::gelu_tanh(g);
    dt.round_slice(g);
    for (a, b) in g.iter_mut().zip(u.iter()) {
        *a *= b;
    }
    dt.round_slice(g);
}

/// `down(gelu(gate(x)) ⊙ up(x))` with transformers' roundings (docs/model.md, "MLP").
///
/// When gate and up are large enough to split over threads, each task takes a range of the
/// intermediate rows of both, multiplies it and applies the activation and product to its own
/// results, in one parallel region: the results never leave the core that computed them before the
/// down projection reads them, where three regions (gate, up, the element-wise part, each split its
/// own way) moved every activation between cores twice. The same kernels compute every element,
/// so the bits do not change.
pub fn gelu_mlp(x: &[f32], rows: usize, gate: Weight, up: Weight, down: Weight, dt: DType) -> Vec<f32> {
    let inter = gate.rows();
    let mut g = vec![0f32; rows * inter];
    match kernels::split_rows(&gate, rows) {
        Some(ends) if up.rows() == inter && rows > 0 => {
            let starts = std::iter::once(0).chain(ends.iter().copied());
            let mut parts: Vec<(usize, Vec<&mut [f32]>)> =
                starts.take(ends.len()).map(|a| (a, Vec::with_capacity(rows))).collect();
            for row in g.chunks_mut(inter) {
                for (p, part) in parts.iter_mut().zip(kernels::cut_at(row, &ends)) {
                    p.1.push(part);
                }
            }
            kernels::par_map(parts, |(a, mut outs)| {
                let n = outs[0].len();
                let mut gp = vec![0f32; rows * n];
                let mut up_ = vec![0f32; rows * n];
                kernels::matmul(x, rows, gate.slice_rows(a, n), &mut gp);
                kernels::matmul(x, rows, up.slice_rows(a, n), &mut up_);
                gelu_product(&mut gp, &mut up_, dt);
                for (o, r) in outs.iter_mut().zip(gp.chunks_exact(n)) {
                    o.copy_from_slice(r);
                }
            });
        }
        _ => {
            let mut u = vec![0f32; rows * inter];
            kernels::matmul(x, rows, gate, &mut g);
            kernels::matmul(x, rows, up, &mut u);
            // Element-wise, so in pieces on the kernels' pool: a verify's five rows would otherwise
            // leave the other cores idle for six passes over rows × intermediate values.
            let pieces: Vec<(&mut [f32], &mut [f32])> = g.chunks_mut(ACT_PIECE).zip(u.chunks_mut(ACT_PIECE)).collect();
            kernels::par_map(pieces, |(g, u)| gelu_product(g, u, dt));
        }
    }
    let mut out = vec![0f32; rows * down.rows()];
    kernels::matmul(&g, rows, down, &mut out);
    dt.round_slice(&mut out);
    out
}

/// Keys x head_dim from which one KV head's keys count as long: 16 MiB of bf16 keys (16K at head_dim 512),
/// past what the last-level cache holds twice (below it, splitting heads is faster).
const LONG_KEYS: usize = 1 << 23;

/// Query rows whose keys and values are read together (a verify forward is one block; a prefill chunk
/// is split so that the score matrix stays small).
const ROW_BLOCK: usize = 17;

/// Attention of `rows` query rows (`q`: `[rows, hq, D]`) over a layer's K/V, scale 1.0 (docs/model.md,
/// "Attention"): row `r` sees the absolute key positions `keys(r)`. Scores and probabilities are rounded
/// like transformers' eager path (bf16 matmul outputs, f32 softmax cast back).
///
/// For each KV head, the queries of the heads that share it, over a block of rows, are one matmul
/// against that head's keys and one `weighted_rows` over its values: each key and value is read once per
/// block, by the same register-tiled kernels as the weights. A row's scores past its own key range are
/// computed and then zeroed, which adds exact zeros; so, as every kernel here gives each (row, head) the
/// same bits whatever it is batched with, the output does not depend on `rows` or the thread count.
/// A KV head's query heads are split across threads only when there are fewer tasks than threads and
/// its keys are short (`LONG_KEYS`).
pub fn attend(
    q: &[f32],
    kv: &LayerKv,
    rows: usize,
    hq: usize,
    keys: impl Fn(usize) -> Range<usize> + Sync,
    dt: DType,
    out: &mut [f32],
) {
    let d = kv.head_dim;
    let group = hq / kv.kv_heads;
    let blocks = rows.div_ceil(ROW_BLOCK).max(1);
    let block_rows = rows.div_ceil(blocks);
    // Split a KV head's query heads across threads only while its keys are short: the kernels split
    // long ones themselves (the matmul by keys, weighted_rows by columns), which reads K and V once
    // instead of once per thread.
    let threads = rayon::current_num_threads();
    let mut sub = group;
    let long = keys(rows.saturating_sub(1)).len() * d >= LONG_KEYS;
    // Work this small runs on this thread (below), where one task per KV head does it in fewer calls.
    let work_size = rows * hq * keys(rows.saturating_sub(1)).len() * d;
    let parallel = work_size > 1 << 16;
    while parallel && !long && blocks * (hq / sub) < threads && sub.is_multiple_of(2) {
        sub /= 2;
    }
    let tasks: Vec<(usize, usize)> =
        (0..blocks).flat_map(|b| (0..hq / sub).map(move |hs| (b * block_rows, hs * sub))).collect();
    let work = |&(r0, h0): &(usize, usize)| -> Vec<f32> {
        let (g, nr) = (h0 / group, (r0 + block_rows).min(rows) - r0);
        let ranges: Vec<Range<usize>> = (r0..r0 + nr).map(&keys).filter(|r| !r.is_empty()).collect();
        let lo = ranges.iter().map(|r| r.start).min().unwrap_or(0);
        let hi = ranges.iter().map(|r| r.end).max().unwrap_or(0);
        let (m, n) = (nr * sub, hi - lo);
        let mut o = vec![0f32; m * d];
        if n == 0 {
            return o;
        }
        debug_assert!(lo >= kv.start && hi <= kv.end(), "cache lacks positions {lo}..{hi}");
        let mut x = Vec::with_capacity(m * d);
        for r in r0..r0 + nr {
            x.extend_from_slice(&q[(r * hq + h0) * d..][..sub * d]);
        }
        let mut s = vec![0f32; m * n];
        kernels::matmul(&x, m, kv.keys(g, lo..hi), &mut s);
        for (i, scores) in s.chunks_exact_mut(sub * n).enumerate() {
            let range = keys(r0 + i);
            let (a, b) = if range.is_empty() { (0, 0) } else { (range.start - lo, range.end - lo) };
            for p in scores.chunks_exact_mut(n) {
                p[..a].fill(0.0);
                p[b..].fill(0.0);
                let p = &mut p[a..b];
                if !p.is_empty() {
                    dt.round_slice(p);
                    // No probability comes out subnormal (below 2^-126 it is zero), and bf16 rounding
                    // keeps a normal one normal: `p · v` takes no microcode assist on Intel
                    // (docs/numerics.md, "Subnormal probabilities").
                    kernels::softmax(p);
                    dt.round_slice(p);
                }
            }
        }
        kernels::weighted_rows(&s, m, kv.values(g, lo..hi), &mut o);
        dt.round_slice(&mut o);
        o
    };
    let results: Vec<Vec<f32>> =
        if parallel { kernels::par_map(tasks.iter().collect(), work) } else { tasks.iter().map(work).collect() };
    for (&(r0, h0), o) in tasks.iter().zip(&results) {
        for (i, oi) in o.chunks_exact(sub * d).enumerate() {
            out[((r0 + i) * hq + h0) * d..][..sub * d].copy_from_slice(oi);
        }
    }
}
