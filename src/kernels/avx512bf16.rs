//! AVX512_BF16 matmul for bf16 weights: `vdpbf16ps` multiplies 32 bf16 pairs and adds them into 16
//! f32 lanes in one instruction, so weights are used as stored, with no widening. The activations are
//! rounded to bf16 once per call (exactly what the reference does) and packed in natural order (in
//! panels, see `pack_panels`): lane `l` accumulates `x[2l]·w[2l] + x[2l+1]·w[2l+1]`. Everything else
//! falls back to `avx512`.
//!
//! Note that `vdpbf16ps` treats denormal inputs as zero and flushes denormal results; bf16 values that
//! small (< 1.2e-38) do not occur in practice, and the tests' tolerance covers the difference.

use super::avx512::{acc_finish, acc_load, acc_storage, bf16_bits16, hsum4, plan, shapes, Acc};
use super::tiling::{pack_panels, Panels, Tile};
use super::x86::{drive, gather, prefetch_rows_ahead, short_rows, Prefetch};
use super::{DType, MatRef, Split};
use std::arch::x86_64::*;

pub fn supported() -> bool {
    super::avx512::supported() && is_x86_feature_detected!("avx512bf16")
}

pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    assert_eq!(w.dtype, DType::BF16);
    if short_rows(m, &w) {
        let xp = pack_row(x, w.cols);
        let xs = xp.data();
        super::tiling::for_row_chunks(w, 1, out, split, |wc, outs| {
            let (rb, base) = (wc.cols * 2, wc.data.as_ptr());
            // SAFETY: as above; the panel covers K, and rows 0..wc.rows of the chunk are in `wc.data`.
            unsafe { dot_rows(xs.as_ptr(), wc.cols, wc.rows, |i| base.add(i * rb), &mut *outs[0]) }
        });
        return;
    }
    if m == 1 && streams_rows() {
        return stream_rows(x, w, out, split);
    }
    if streams_long(m, &w) {
        return stream_long(x, m, w, out, split);
    }
    if streams_many(m, &w) {
        return stream_many(x, m, w, out, split);
    }
    tiled(x, m, w, out, split)
}

/// The tile driver's `matmul`, whatever `streams_rows` says; the tests compare the streams with it.
pub(super) fn tiled(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    assert_eq!(w.dtype, DType::BF16);
    let plan = plan(m, w.cols, false, 32, 2, 2);
    // SAFETY: the CPU has the features, asserted above.
    let xp = pack_panels(x, m, w.cols, 32, plan.group, |src, dst| unsafe { pack_bf16(src, dst) });
    shapes!(drive!(tile, acc_storage, xp, m, w, out, split, plan,));
}

/// Whether one activation row reads its weight rows one at a time (`stream_rows`) rather than
/// through the tile driver: on Zen 4 (`x86::zen4`), where a core keeping one stream of weights in
/// flight reads 15-30 % faster than one keeping four (the (4, 1) tile, or `dot_rows`), with or without
/// software prefetch; on Sapphire Rapids the tile already reads at the measured bandwidth. See
/// docs/numerics.md, "One-row bf16 products".
fn streams_rows() -> bool {
    super::x86::zen4()
}

/// `out = x · wᵀ` for one activation row, a weight row at a time over the pool's row chunks: one
/// `vdpbf16ps` chain per row over K in 32-element steps. When the target's per-step weights fit in the
/// last-level cache (`step_fits_cache`), each chunk also asks for its weights `STREAM_AHEAD` bytes
/// ahead into L2 (`prefetcht1`), as `stream_many` does: the shipped pair's one-row forward, whose
/// weights come largely from L3, took 0.79-0.83 of the time with it (pairwise), while the kit's
/// E2B-sized model, read from memory, was 4-10 % slower (the hardware's prefetcher alone suffices
/// for one stream from memory).
/// A row gets the bits of the tile kernel: the same chain from zero, the same masked tail and the same
/// `hsum4` tree. Called by `matmul` where `streams_rows` says so; the tests call it on every CPU with
/// AVX512_BF16. See docs/numerics.md, "One-row bf16 products on Zen 4".
pub(super) fn stream_rows(x: &[f32], w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    assert!(w.dtype == DType::BF16 && x.len() == w.cols && out.len() == w.rows, "stream_rows shapes");
    let xp = pack_row(x, w.cols);
    let xs = xp.data();
    let prefetch = super::step_fits_cache();
    super::tiling::for_row_chunks(w, 1, out, split, |wc, outs| {
        let (k, p) = (wc.cols, wc.data.as_ptr());
        // SAFETY: the CPU has the features, asserted above; the panel covers K, and rows
        // 0..wc.rows of the chunk are in `wc.data` (`end` is its end).
        unsafe {
            if prefetch {
                let end = p.wrapping_add(wc.rows * k * 2);
                dot_each::<1, 1, true>(xs.as_ptr(), k, p, 0..wc.rows, outs, STREAM_AHEAD, end)
            } else {
                dot_each::<1, 1, false>(xs.as_ptr(), k, p, 0..wc.rows, outs, 0, std::ptr::null())
            }
        }
    });
}

/// Most activation rows per group in `stream_many`: 2 weight rows × 8 activation rows keep 16 chains
/// in registers.
const STREAM_GROUP: usize = 8;
/// Most activation rows `stream_many` takes (two groups).
const STREAM_MAX_M: usize = 2 * STREAM_GROUP;
/// Longest K `stream_many` takes: a group's panel is then at most 32 KiB and stays in L1 beside the
/// weights, while the second group's weights wait in L2. Longer rows go through `stream_long`.
const STREAM_MAX_K: usize = 2048;
/// Smallest matrix `stream_many` takes: smaller ones (attention's keys, a drafter's matrices)
/// are in cache, where the tiles are faster.
const STREAM_MIN_BYTES: usize = 256 << 10;
/// How far ahead of the weight row being read `stream_many` asks for weights into L2 (the first
/// group's pass): far enough to cover the memory's latency at the pace of 8 rows' products.
const STREAM_AHEAD: usize = 16 << 10;
/// With two groups, bytes of weight rows a chunk takes through both before it moves on: the second
/// group reads them from L2.
const STREAM_BLOCK: usize = 256 << 10;

/// Whether `m > 1` activation rows over the bf16 matrix `w` go through `stream_many`: on Zen 4
/// (`streams_rows`) for 2 to `STREAM_MAX_M` rows with K up to `STREAM_MAX_K`. See docs/numerics.md,
/// "A few bf16 rows on Zen 4".
fn streams_many(m: usize, w: &MatRef) -> bool {
    (2..=STREAM_MAX_M).contains(&m)
        && w.cols <= STREAM_MAX_K
        && w.rows * w.cols * 2 >= STREAM_MIN_BYTES
        && streams_rows()
}

/// Group `g` of `m` activation rows cut into `m.div_ceil(STREAM_GROUP)` groups of sizes as equal as
/// they come: its first row and its size.
fn stream_group(m: usize, g: usize) -> (usize, usize) {
    let n = m.div_ceil(STREAM_GROUP);
    let (base, extra) = (m / n, m % n);
    (g * base + g.min(extra), base + usize::from(g < extra))
}

/// `out = x · wᵀ` for a few activation rows, two weight rows at a time, every activation row of a
/// group against one load of the weights. The first group's pass asks for the weights
/// `STREAM_AHEAD` bytes ahead into L2 (`prefetcht1`), one line per line it reads, so the memory
/// keeps streaming while the products run: on Zen 4 the hardware's prefetcher alone stalls once a
/// core is busy computing, and 8 rows then cost twice one row instead of about the same. A second
/// group reads a `STREAM_BLOCK` of weight rows from L2 after the first. Every output gets the bits
/// of the tile kernel. Called by `matmul` where `streams_many` says so; the tests call it on every
/// CPU with AVX512_BF16.
pub(super) fn stream_many(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    assert!(w.dtype == DType::BF16 && x.len() == m * w.cols && out.len() == m * w.rows, "stream_many shapes");
    assert!((1..=STREAM_MAX_M).contains(&m), "stream_many takes 1 to {STREAM_MAX_M} rows");
    let groups = m.div_ceil(STREAM_GROUP);
    // Panels of the first group's size: with at most two groups (the first no smaller), the second
    // group's panel is what is left after the first.
    let (_, first) = stream_group(m, 0);
    // SAFETY: the CPU has the features, asserted above.
    let xp = pack_panels(x, m, w.cols, 32, first, |src, dst| unsafe { pack_bf16(src, dst) });
    let (xs, kp) = (xp.data(), xp.kp);
    let block = if groups == 1 { usize::MAX } else { (STREAM_BLOCK / (w.cols * 2).max(1)).max(2) };
    super::tiling::for_row_chunks(w, m, out, split, |wc, outs| {
        let (k, p) = (wc.cols, wc.data.as_ptr());
        let end = p.wrapping_add(wc.rows * k * 2);
        for i0 in (0..wc.rows).step_by(block) {
            let rows = i0..wc.rows.min(i0.saturating_add(block));
            for g in 0..groups {
                let (g0, c) = stream_group(m, g);
                let x = xs[g0 * kp..].as_ptr();
                let o = &mut outs[g0..g0 + c];
                let r = rows.clone();
                macro_rules! go {
                    ($($c:literal)*) => {
                        match c {
                            // SAFETY: as above; the group's panel of `c` rows covers K, and the
                            // chunk's rows are in `wc.data` (`end` is its end).
                            $($c => unsafe {
                                if g == 0 {
                                    dot_each::<2, $c, true>(x, k, p, r, o, STREAM_AHEAD, end)
                                } else {
                                    dot_each::<2, $c, false>(x, k, p, r, o, 0, end)
                                }
                            },)*
                            _ => unreachable!("group size"),
                        }
                    };
                }
                go!(1 2 3 4 5 6 7 8);
            }
        }
    });
}

/// `outs[c][i] = x_c · w[i]` for the weight rows `i` in `rows` (of `k` bf16 each from `w`) and the
/// `C` activation rows of the panel `x`, `R` weight rows at a time (the rows past a multiple of `R`
/// go one at a time). With `AHEAD`, each 64 bytes of weights read asks for the line `ahead`
/// bytes further into L2 (up to `end`). Each output is one chain over K in 32-element steps from
/// zero with the tile's masked tail, summed by `hsum4` (each vector on its own).
///
/// # Safety
/// AVX-512 F/BW/VL + BF16; `x` is a `C`-row `pack_bf16` panel covering `k`; `w` points at
/// `rows.end * k` readable bf16; `outs` has `C` slices of at least `rows.end` each.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn dot_each<const R: usize, const C: usize, const AHEAD: bool>(
    x: *const u16,
    k: usize,
    w: *const u8,
    rows: std::ops::Range<usize>,
    outs: &mut [&mut [f32]],
    ahead: usize,
    end: *const u8,
) {
    debug_assert!(outs.len() == C && outs.iter().all(|o| o.len() >= rows.end));
    let z = _mm512_setzero_ps();
    let tail = k % 32;
    let mask = (1u32 << tail) - 1;
    let whole = rows.start + (rows.len() / R) * R;
    // The next line to ask for: it runs `ahead` bytes in front of what has been read.
    let mut pf = w.wrapping_add(rows.start * k * 2 + ahead);
    if AHEAD && R > 1 {
        // The chunk's first `ahead` bytes: asked for at once, so the pass does not wait on them.
        let mut q = w.wrapping_add(rows.start * k * 2);
        while q < pf && q < end {
            _mm_prefetch::<_MM_HINT_T1>(q as *const i8);
            q = q.wrapping_add(64);
        }
    }
    for i in (rows.start..whole).step_by(R) {
        let p: [*const u8; R] = std::array::from_fn(|r| w.add((i + r) * k * 2));
        let mut a = [[z; C]; R];
        let mut kk = 0;
        while kk + 32 <= k {
            if AHEAD {
                for _ in 0..R {
                    if pf < end {
                        // A prefetch has no architectural effect and never faults; the address is
                        // inside the chunk.
                        _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
                    }
                    pf = pf.wrapping_add(64);
                }
            }
            let xs = x.add(kk * C);
            for (p, a) in p.iter().zip(a.iter_mut()) {
                let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(p.add(kk * 2) as *const _));
                for (c, a) in a.iter_mut().enumerate() {
                    let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.add(c * 32) as *const _));
                    *a = _mm512_dpbf16_ps(*a, xv, wv);
                }
            }
            kk += 32;
        }
        if tail != 0 {
            let xs = x.add(kk * C);
            for (p, a) in p.iter().zip(a.iter_mut()) {
                let wv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, p.add(kk * 2) as *const i16));
                for (c, a) in a.iter_mut().enumerate() {
                    let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.add(c * 32) as *const _));
                    *a = _mm512_dpbf16_ps(*a, xv, wv);
                }
            }
        }
        for (r, a) in a.iter().enumerate() {
            for c0 in (0..C).step_by(4) {
                let v = |c: usize| if c0 + c < C { a[c0 + c] } else { z };
                let mut s = [0f32; 4];
                _mm_storeu_ps(s.as_mut_ptr(), hsum4(v(0), v(1), v(2), v(3)));
                for (c, o) in outs[c0..C.min(c0 + 4)].iter_mut().enumerate() {
                    *o.get_unchecked_mut(i + r) = s[c];
                }
            }
        }
    }
    if R > 1 && whole < rows.end {
        dot_each::<1, C, AHEAD>(x, k, w, whole..rows.end, outs, ahead, end);
    }
}

/// Shortest K that `stream_long` takes: up to this, `stream_many`'s whole-row panel of 8 rows
/// (32 KiB) sits in L1.
const LONG_MIN_K: usize = STREAM_MAX_K + 1;
/// K elements per pass in `stream_long`: the panel's piece for 8 rows is then 16 KiB and stays in L1
/// beside the weights streaming through.
const LONG_KC: usize = 1024;
/// Bytes of weight rows `stream_long` takes through all of K before it moves on: the block sits in
/// L2 while the passes read it piece by piece, next to the following block coming in.
const LONG_BLOCK: usize = 192 << 10;

/// Whether `m` activation rows over the bf16 matrix `w` go through `stream_long`: on Zen 4
/// (`streams_rows`), 2 to `STREAM_MAX_M` rows over rows longer than `STREAM_MAX_K` (E2B's down
/// projections, K = 6144 and 12,288), of a matrix too large for the cache. See docs/numerics.md,
/// "A few bf16 rows on Zen 4".
fn streams_long(m: usize, w: &MatRef) -> bool {
    (2..=STREAM_MAX_M).contains(&m) && w.cols >= LONG_MIN_K && w.rows * w.cols * 2 >= STREAM_MIN_BYTES && streams_rows()
}

/// `out = x · wᵀ` for 2 to 16 activation rows over long weight rows, a block of weight rows at a
/// time: each block is read in passes of `LONG_KC` elements of K (the activations' piece of the pass
/// stays in L1), two weight rows × a group of up to 8 activation rows per call (a second group reads
/// the block from L2 after the first), with the 16-lane sums kept in a buffer between passes. Each 64 bytes of weights read asks for the same line of the next
/// block into L2 (`prefetcht1`), so the memory streams while the products run. `stream_many` reads
/// whole rows instead, and with K > 2048 its panel no longer fits L1: 8 rows over K = 6144 cost
/// 1.7x one row. Saving an f32 vector and loading it back is exact, so every output is still one
/// chain from zero over K with the tile's tail and `hsum4`: the bits of the tile kernel. Called by
/// `matmul` where `streams_long` says so; the tests call it on every CPU with AVX512_BF16.
pub(super) fn stream_long(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    assert!(w.dtype == DType::BF16 && x.len() == m * w.cols && out.len() == m * w.rows, "stream_long shapes");
    assert!((1..=STREAM_MAX_M).contains(&m), "stream_long takes 1 to {STREAM_MAX_M} rows");
    let groups = m.div_ceil(STREAM_GROUP);
    let (_, first) = stream_group(m, 0);
    // SAFETY: the CPU has the features, asserted above.
    let xp = pack_panels(x, m, w.cols, 32, first, |src, dst| unsafe { pack_bf16(src, dst) });
    let (xs, kp) = (xp.data(), xp.kp);
    super::tiling::for_row_chunks(w, m, out, split, |wc, outs| {
        let (k, rb, base) = (wc.cols, wc.cols * 2, wc.data.as_ptr());
        let block = ((LONG_BLOCK / rb.max(1)).max(2) / 2) * 2;
        let end = base.wrapping_add(wc.rows * rb);
        // Every weight row of a block: its sums for every activation row between passes (rows i and
        // i + 1 of a pair hold 2m vectors from (i - b0)·m, group by group).
        // SAFETY: the CPU has AVX-512 F, asserted above.
        let mut acc = vec![unsafe { _mm512_setzero_ps() }; block.min(wc.rows) * m];
        for b0 in (0..wc.rows).step_by(block) {
            let b1 = wc.rows.min(b0 + block);
            for k0 in (0..k).step_by(LONG_KC) {
                let ks = k0..k.min(k0 + LONG_KC);
                for g in 0..groups {
                    let (g0, c) = stream_group(m, g);
                    let x = xs[g0 * kp..].as_ptr();
                    // The first group asks for the next block; the second reads what is in L2.
                    let (ahead, stop) = if g == 0 { ((b1 - b0) * rb, end) } else { (0, base) };
                    let mut i = b0;
                    while i < b1 {
                        let r = if b1 - i >= 2 { 2 } else { 1 };
                        let (w, o, a) = (base.wrapping_add(i * rb), &mut outs[g0..g0 + c], (i - b0) * m + r * g0);
                        let ks = ks.clone();
                        macro_rules! go {
                            ($($c:literal)*) => {
                                match (r, c) {
                                    // SAFETY: as above; the group's panel of `c` rows covers K, rows
                                    // i..i + r of the chunk are in `wc.data` (`end` is its end), and
                                    // `acc` holds r·c vectors from `a` for them.
                                    $((2, $c) => unsafe {
                                        long_pass::<2, $c>(x, k, ks, w, &mut acc[a..], i, o, ahead, stop)
                                    },
                                    (1, $c) => unsafe {
                                        long_pass::<1, $c>(x, k, ks, w, &mut acc[a..], i, o, ahead, stop)
                                    },)*
                                    _ => unreachable!("stream_long shape"),
                                }
                            };
                        }
                        go!(1 2 3 4 5 6 7 8);
                        i += r;
                    }
                }
            }
        }
    });
}

/// One pass of `stream_long`: `R` weight rows (from `w`, `k` bf16 each) × the `C` activation rows of
/// the panel `x` over `ks` (a multiple of 32 from its start; the tail only at K's end). The sums
/// start from zero at K's start and come from `acc` otherwise; they go back to `acc`, or at K's end
/// are summed by `hsum4` into `outs[c][i + r]`. Each 64 bytes of weights read asks for the line
/// `ahead` bytes further into L2 (below `end`).
///
/// # Safety
/// AVX-512 F/BW/VL + BF16; `x` is a `C`-row `pack_bf16` panel covering `k`; `w` points at `R * k`
/// readable bf16; `acc` has at least `R * C` vectors; `outs` has `C` slices longer than `i + R - 1`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn long_pass<const R: usize, const C: usize>(
    x: *const u16,
    k: usize,
    ks: std::ops::Range<usize>,
    w: *const u8,
    acc: &mut [__m512],
    i: usize,
    outs: &mut [&mut [f32]],
    ahead: usize,
    end: *const u8,
) {
    debug_assert!(outs.len() == C && acc.len() >= R * C && ks.start.is_multiple_of(32));
    let z = _mm512_setzero_ps();
    let mut a = [[z; C]; R];
    if ks.start > 0 {
        for (r, a) in a.iter_mut().enumerate() {
            a.copy_from_slice(&acc[r * C..(r + 1) * C]);
        }
    }
    let p: [*const u8; R] = std::array::from_fn(|r| w.add(r * k * 2));
    let mut kk = ks.start;
    while kk + 32 <= ks.end {
        for (p, a) in p.iter().zip(a.iter_mut()) {
            let line = p.add(kk * 2);
            let pf = line.wrapping_add(ahead);
            if pf < end {
                // A prefetch has no architectural effect and never faults; the address is inside
                // the chunk.
                _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
            }
            let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(line as *const _));
            let xs = x.add(kk * C);
            for (c, a) in a.iter_mut().enumerate() {
                let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.add(c * 32) as *const _));
                *a = _mm512_dpbf16_ps(*a, xv, wv);
            }
        }
        kk += 32;
    }
    if kk < ks.end {
        // K's tail: the last pass only, as `LONG_KC` is a multiple of 32.
        let mask = (1u32 << (ks.end - kk)) - 1;
        let xs = x.add(kk * C);
        for (p, a) in p.iter().zip(a.iter_mut()) {
            let wv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, p.add(kk * 2) as *const i16));
            for (c, a) in a.iter_mut().enumerate() {
                let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.add(c * 32) as *const _));
                *a = _mm512_dpbf16_ps(*a, xv, wv);
            }
        }
    }
    if ks.end < k {
        for (r, a) in a.iter().enumerate() {
            acc[r * C..(r + 1) * C].copy_from_slice(a);
        }
        return;
    }
    for (r, a) in a.iter().enumerate() {
        for c0 in (0..C).step_by(4) {
            let v = |c: usize| if c0 + c < C { a[c0 + c] } else { z };
            let mut s = [0f32; 4];
            _mm_storeu_ps(s.as_mut_ptr(), hsum4(v(0), v(1), v(2), v(3)));
            for (c, o) in outs[c0..C.min(c0 + 4)].iter_mut().enumerate() {
                *o.get_unchecked_mut(i + r) = s[c];
            }
        }
    }
}

/// Round ≤ 32 activations to bf16 bits (zero-padded to 32).
///
/// # Safety
/// Needs AVX-512 F/BW/VL; `src.len() <= 32`, `dst.len() == 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_bf16(src: &[f32], dst: &mut [u16]) {
    assert!(src.len() <= 32 && dst.len() == 32);
    for (h, d) in src.chunks(16).zip(dst.chunks_mut(16)) {
        _mm256_storeu_si256(d.as_mut_ptr() as *mut _, bf16_bits16(h));
    }
}

/// Tile kernel: `R` weight rows × `C` x rows (a `pack_bf16` panel) over K range `t.k0..t.k1`.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16; `x` is a panel of `C` rows covering `t.k1` (rounded up to 32), `w` has
/// `R` rows of `ws` bytes with at least `t.k1` bf16 each.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn tile<const R: usize, const C: usize>(
    x: *const u16,
    w: *const u8,
    ws: usize,
    t: &Tile,
    acc: &mut Acc,
) -> [[f32; 4]; C] {
    let mut a = acc_load::<R, C>(t, acc);
    let mut pf = Prefetch::new(t);
    let mut kk = t.k0;
    // One step: 32 bf16 per weight row, loaded by `$load` from `$p`. (`__m512bh` is 32 × u16 in a
    // zmm; the transmutes only retype.)
    macro_rules! step {
        ($p:ident => $load:expr) => {{
            let mut wv = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let $p = w.add(r * ws + kk * 2);
                wv[r] = $load;
            }
            let xs = x.add(kk * C);
            for c in 0..C {
                let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.add(c * 32) as *const _));
                for r in 0..R {
                    a[r][c] = _mm512_dpbf16_ps(a[r][c], xv, std::mem::transmute::<__m512i, __m512bh>(wv[r]));
                }
            }
        }};
    }
    while kk + 32 <= t.k1 {
        pf.step();
        step!(p => _mm512_loadu_si512(p as *const _));
        kk += 32;
    }
    if kk < t.k1 {
        let mask = (1u32 << (t.k1 - kk)) - 1;
        step!(p => _mm512_maskz_loadu_epi16(mask, p as *const i16));
    }
    acc_finish(t, &a, acc)
}

/// `out[i] = x · w[ids[i]]` for one activation row, reading each weight row where it is stored (the
/// drafter's centroid head: its candidates are scattered over the embedding), split over the pool
/// (`split_gather`). Every row gets the bits `matmul` gives it (see `dot_rows`).
pub fn gather(x: &[f32], w: MatRef, ids: &[u32], out: &mut [f32], split: Split) {
    assert!(supported(), "AVX512_BF16 kernels on a CPU without them");
    gather!(pack_row, dot_rows, x, w, ids, out, split);
}

/// One activation row as `dot_rows` reads it (a one-row `pack_bf16` panel). The caller has checked
/// that the CPU has AVX512_BF16.
fn pack_row(x: &[f32], k: usize) -> Panels<u16> {
    // SAFETY: the CPU has the features (checked by the caller, `matmul` or `gather`).
    pack_panels(x, 1, k, 32, 1, |src, dst| unsafe { pack_bf16(src, dst) })
}

/// `out[i] = x · row(i)` for one activation row and `n` weight rows of `k` bf16, four rows at a time.
/// A row gets the bits the tile kernel gives it in any tile: its lanes accumulate over K in the same
/// 32-element steps from zero, and `hsum4` sums them by the same tree (each vector on its own).
///
/// # Safety
/// AVX-512 F/BW/VL + BF16; `x` is a one-row `pack_bf16` panel covering `k`; `row(i)` points at `k`
/// readable bf16 for every `i < n`; `out.len() == n`.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn dot_rows(x: *const u16, k: usize, n: usize, row: impl Fn(usize) -> *const u8, out: &mut [f32]) {
    debug_assert_eq!(out.len(), n);
    let whole = n / 4 * 4;
    let (head, tail) = out.split_at_mut(whole);
    for (g, res) in head.chunks_exact_mut(4).enumerate() {
        let i0 = 4 * g;
        prefetch_rows_ahead(i0, n, 2 * k, &row);
        let a = dot_group::<4>(x, k, std::array::from_fn(|r| row(i0 + r)));
        _mm_storeu_ps(res.as_mut_ptr(), hsum4(a[0], a[1], a[2], a[3]));
    }
    if !tail.is_empty() {
        let rows = |r: usize| row(whole + r);
        let z = _mm512_setzero_ps();
        let a = match tail.len() {
            3 => {
                let [a0, a1, a2] = dot_group::<3>(x, k, std::array::from_fn(rows));
                [a0, a1, a2, z]
            }
            2 => {
                let [a0, a1] = dot_group::<2>(x, k, std::array::from_fn(rows));
                [a0, a1, z, z]
            }
            _ => [dot_group::<1>(x, k, [rows(0)])[0], z, z, z],
        };
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), hsum4(a[0], a[1], a[2], a[3]));
        tail.copy_from_slice(&sums[..tail.len()]);
    }
}

/// `dot_rows`' accumulators for the `R` weight rows at `rows`: a `vdpbf16ps` chain per row over K in
/// 32-element steps from zero, the tail masked. `R` is a constant so that the accumulators stay in
/// registers (a loop over a slice of them kept them on the stack, a store and a reload per step).
///
/// # Safety
/// As `dot_rows`, for each of the `R` rows.
#[inline]
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn dot_group<const R: usize>(x: *const u16, k: usize, rows: [*const u8; R]) -> [__m512; R] {
    let mut a = [_mm512_setzero_ps(); R];
    let mut kk = 0;
    while kk < k {
        let mask = if k - kk >= 32 { u32::MAX } else { (1u32 << (k - kk)) - 1 };
        let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(kk) as *const _));
        for r in 0..R {
            let wv = _mm512_maskz_loadu_epi16(mask, rows[r].add(kk * 2) as *const i16);
            a[r] = _mm512_dpbf16_ps(a[r], xv, std::mem::transmute::<__m512i, __m512bh>(wv));
        }
        kk += 32;
    }
    a
}
