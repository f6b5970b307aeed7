//! AVX2 + FMA + F16C kernels, 8 f32 lanes: the same scheme as `avx512` at half the width.
//!
//! With only 16 ymm registers a matmul tile has at most 12 accumulators (see `plan`). AVX2 has no
//! masked 16-bit loads, so a K tail shorter than a vector is copied into a zeroed stack buffer
//! first; f32 tails use `vmaskmovps` (masked-off lanes never fault).

use super::tiling::{
    for_row_chunks, pack_panels, pack_panels_by_row, store_tile, Panels, Plan, Tile, L1_BUDGET, L1_BYTES,
};
use super::x86::{drive, gather, prefetch_rows_ahead, short_rows, Accs, Prefetch};
use super::{DType, MatRef, Split};
use std::arch::x86_64::*;
use std::ops::Range;

pub fn supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Tile shape for `m` activation rows, ≤ 12 accumulators (16 ymm registers in all): a single
/// group, i.e. one pass over the weights, up to m = 4 (m = 5 while its x panel fits L1); larger m in
/// groups of at most 5 (as equal as they come; m = 5 with a long K in 3 + 2) with K chunks, each
/// chunk of a weight tile read from memory once and from L1 by the other groups.
///
/// With 8 lanes, 5 or more x rows of work per weight are compute-bound on the AVX2 machines measured
/// (Zen 3): a single group of m = 5..12 against one weight row (`(1, m)`) loads 2m x vectors per
/// weight vector, and once the panel outgrows L1 those come from L2 and the FMAs wait for them. In
/// groups of 4 against 2 weight rows the x chunk stays in L1: `matmul_bench` at [6144, 1536] measured
/// m = 5 / 6 / 8 at 1.60 / 1.65 / 1.99x the time of m = 1, against 2.36 / 2.35 / 3.01x with `(1, m)`.
/// For m = 3, 4 the same holds once the x panel outgrows L1 (the down projection's K = 6144: groups of
/// 2 against 4 weight rows took m = 3 / 4 from 1.37 / 1.87x to 1.14 / 1.28x).
///
/// m = 5 (one sequence verifying four drafts) is one `(2, 5)` group over all of K while its x panel
/// fits L1 (K up to 1,632: panels of f32): ten accumulators, the most AVX2's registers hold next to
/// two weight rows and one x step. `matmul_bench --hot --threads 1`, m = 5 against m = 1 on Zen 3:
/// 2.31-2.41x at [1536, 384] and 2.68-2.99x at [384, 1536], against 3.67-3.76x in groups of 3 and 2;
/// with two threads from memory at [6144, 1536], 1.19-1.32x against 1.41-1.50x. Chunking K for it
/// (k-outer order) took that to 1.9-2.1x, and at K = 6144 no `(2, 5)` order beat the groups.
///
/// Larger m goes in groups of at most 5 for the same reason: at [1536, 384] (hot, one thread) m = 9 /
/// 10 / 15 / 20 took 155 / 163 / 247 / 339 µs against 215 / 212 / 288 / 367 µs in groups of at most
/// 4, and at [6144, 1536] (two threads, from memory) 1.46 / 1.55 / 2.16 / 2.86 ms against 1.69 /
/// 1.75 / 2.36 / 3.00 ms. Row counts that split into groups of 4 or fewer anyway (6-8, 12, 16) are
/// unchanged.
fn plan(m: usize, k: usize, step: usize, x_bytes: usize, w_bytes: usize) -> Plan {
    let (rows, group) = match m {
        0..=2 => (4, m.max(1)),
        3..=4 if m * k * x_bytes <= L1_BUDGET => (2, m),
        3..=4 => (4, 2),
        5 if m * k.div_ceil(step) * step * x_bytes <= L1_BYTES => {
            return Plan::new(m, k, 2, 5, step, x_bytes, w_bytes).whole_k(k)
        }
        5 => (2, 3),
        _ => (2, m.div_ceil(m.div_ceil(5))),
    };
    Plan::new(m, k, rows, group, step, x_bytes, w_bytes)
}

/// Every tile shape `plan` produces (tails use 1 weight row with the same x rows).
macro_rules! shapes {
    ($mac:ident!($($args:tt)*)) => {
        $mac!($($args)* [
            (4, 1), (4, 2),
            (2, 1), (2, 2), (2, 3), (2, 4), (2, 5),
            (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
        ])
    };
}

/// A tile's accumulators, parked in memory between K chunks (row-major `rows × group`, ≤ 12).
type Acc = [__m256; 12];

thread_local! {
    static ACCS: std::cell::Cell<Vec<Acc>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `n` accumulator sets (`x86::Accs`: the thread's last ones, reused).
fn acc_storage(n: usize) -> Accs<Acc> {
    // SAFETY: __m256 is plain data; any bit pattern (here zeros) is a valid value.
    Accs::take(&ACCS, n, unsafe { std::mem::zeroed::<Acc>() })
}

pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX2 kernels on a CPU without AVX2/FMA/F16C");
    let k = w.cols;
    match w.dtype {
        DType::BF16 if short_rows(m, &w) => {
            let xp = pack_row(x, k);
            let xs = xp.data();
            for_row_chunks(w, 1, out, split, |wc, outs| {
                let (rb, base) = (wc.cols * 2, wc.data.as_ptr());
                // SAFETY: the CPU has the features (asserted above); the panel covers K rounded up to
                // 16, and rows 0..wc.rows of the chunk are in `wc.data`.
                unsafe { dot_rows(xs.as_ptr(), wc.cols, wc.rows, |i| base.add(i * rb), &mut *outs[0]) }
            });
        }
        DType::BF16 if short_tiles(m, &w) => {
            let xp = pack_eo(x, m, k, m);
            let (xd, ws) = (xp.data(), k * 2);
            for_row_chunks(w, m, out, split, |wc, outs| {
                let (xs, mut acc) = (xd.as_ptr(), acc_storage(1));
                let mut j = 0;
                while j < wc.rows {
                    let r = if wc.rows - j >= 2 { 2 } else { 1 };
                    let t = Tile::whole(m, j, r, k);
                    let wp = wc.data[j * ws..].as_ptr();
                    macro_rules! call {
                        ($r:literal, $c:literal) => {{
                            // SAFETY: as for `drive!`: the panel holds `m` rows of K rounded up to 16,
                            // and weight rows j..j+r of the chunk start at `wp`.
                            let res = unsafe { tile_bf16::<$r, $c>(xs, wp, ws, &t, &mut acc[0]) };
                            store_tile(&res, outs, 0, j, $r);
                        }};
                    }
                    match (r, m) {
                        (2, 2) => call!(2, 2),
                        (2, 3) => call!(2, 3),
                        (2, 4) => call!(2, 4),
                        (2, 5) => call!(2, 5),
                        (1, 2) => call!(1, 2),
                        (1, 3) => call!(1, 3),
                        (1, 4) => call!(1, 4),
                        (1, 5) => call!(1, 5),
                        _ => unreachable!("short_tiles takes 2 to 5 rows"),
                    }
                    j += r;
                }
            });
        }
        DType::BF16 => {
            let plan = plan(m, k, 16, 4, 2);
            let xp = pack_eo(x, m, k, plan.group);
            shapes!(drive!(tile_bf16, acc_storage, xp, m, w, out, split, plan,));
        }
        DType::F16 => {
            let plan = plan(m, k, 8, 4, 2);
            let xp = pack_panels(x, m, k, 8, plan.group, |src, dst| dst[..src.len()].copy_from_slice(src));
            shapes!(drive!(tile_f16, acc_storage, xp, m, w, out, split, plan,));
        }
        DType::F32 => {
            let plan = plan(m, k, 8, 4, 4);
            let xp = pack_panels(x, m, k, 8, plan.group, |src, dst| dst[..src.len()].copy_from_slice(src));
            shapes!(drive!(tile_f32, acc_storage, xp, m, w, out, split, plan,));
        }
    }
}

/// 2 to 5 x rows against a small matrix with short rows (as `short_rows`: a drafter's matrices, or
/// attention's scores over a few hundred keys): the tiles, two weight rows by all the x rows over all of
/// K, are walked here without the tile driver, whose set-up, prefetch plan and dispatch per call cost
/// as much as the 4-8 kernel steps of such a tile. Same tiles, same bits.
fn short_tiles(m: usize, w: &MatRef) -> bool {
    (2..=5).contains(&m) && short_rows(1, w)
}

/// `vmaskmovps` mask selecting the first `min(n, 8)` lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn tail_mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n.min(8) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// `out[i..i + 8] = f(x[i..i + 8])` over the whole vectors of `x` with plain loads and stores, then
/// the tail (if any) through masked ones. Masked stores only where needed: on Zen 3 a loop that
/// stores every vector with `vmaskmovps` ran at half the speed, the loads after each masked store
/// apparently waiting for its data, so that the iterations of a long-latency body (`exp`, a
/// division) no longer overlapped.
///
/// # Safety
/// Needs AVX2; `x` and `out` cover `n` values (they may be the same buffer).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn map_vectors(x: *const f32, out: *mut f32, n: usize, mut f: impl FnMut(__m256, usize) -> __m256) {
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(out.add(i), f(_mm256_loadu_ps(x.add(i)), i));
        i += 8;
    }
    if i < n {
        let mask = tail_mask(n - i);
        _mm256_maskstore_ps(out.add(i), mask, f(_mm256_maskload_ps(x.add(i), mask), i));
    }
}

/// `x` rounded to the nearest bf16 (ties to even, NaN kept quiet), as f32; as `half::bf16::from_f32`.
#[inline]
#[target_feature(enable = "avx2")]
fn round_bf16(x: __m256) -> __m256 {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let rounded = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let v = _mm256_blendv_epi8(rounded, quiet, nan);
    _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000u32 as i32)))
}

/// Round ≤ 16 activations to bf16 and store them as f32, the 8 even-indexed then the 8 odd-indexed
/// ones (zero-padded), matching the shift / mask widening of 16 packed bf16 weights.
///
/// # Safety
/// Needs AVX2; `src.len() <= 16`, `dst.len() == 16`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pack_bf16_eo(src: &[f32], dst: &mut [f32]) {
    assert!(src.len() <= 16 && dst.len() == 16);
    let (n, p) = (src.len(), src.as_ptr());
    let a = round_bf16(_mm256_maskload_ps(p, tail_mask(n)));
    let b = if n > 8 { round_bf16(_mm256_maskload_ps(p.add(8), tail_mask(n - 8))) } else { _mm256_setzero_ps() };
    store_eo(a, b, dst.as_mut_ptr());
}

/// Store 16 values given as `a` (0-7) and `b` (8-15) at `dst`, the even-indexed ones first.
///
/// # Safety
/// Needs AVX2; `dst` writable for 16 f32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_eo(a: __m256, b: __m256, dst: *mut f32) {
    // shuffle gives [a0 a2 b0 b2 | a4 a6 b4 b6]; the 64-bit permute puts the a's first.
    let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
    let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
    _mm256_storeu_ps(dst, _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(even))));
    _mm256_storeu_ps(dst.add(8), _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(odd))));
}

/// `pack_bf16_eo` over a whole x row, step `s` to `dst[s · stride..]` (`pack_panels_by_row`): one
/// call per row instead of one per 16 values, and plain loads for the whole steps. Same values.
///
/// # Safety
/// Needs AVX2; `dst` covers `stride · (steps - 1) + 16` values for the row's `row.len().div_ceil(16)` steps.
#[target_feature(enable = "avx2")]
unsafe fn pack_row_bf16_eo(row: &[f32], dst: &mut [f32], stride: usize) {
    let whole = row.len() / 16;
    let steps = row.len().div_ceil(16);
    assert!(steps == 0 || dst.len() >= (steps - 1) * stride + 16);
    for s in 0..whole {
        let p = row.as_ptr().add(16 * s);
        store_eo(
            round_bf16(_mm256_loadu_ps(p)),
            round_bf16(_mm256_loadu_ps(p.add(8))),
            dst.as_mut_ptr().add(s * stride),
        );
    }
    if whole * 16 < row.len() {
        pack_bf16_eo(&row[whole * 16..], &mut dst[whole * stride..whole * stride + 16]);
    }
}

/// x packed for `tile_bf16` / `dot_rows` in groups of `group` rows. The caller has checked that the
/// CPU has AVX2.
fn pack_eo(x: &[f32], m: usize, k: usize, group: usize) -> Panels<f32> {
    // SAFETY: the CPU has the features (checked by the caller); `pack_panels_by_row` hands each row
    // the steps of its panel.
    pack_panels_by_row(x, m, k, 16, group, |row, dst, stride| unsafe { pack_row_bf16_eo(row, dst, stride) })
}

/// Sums of `a, b, c, d` in the four lanes; each vector goes through the same fixed tree.
#[inline]
#[target_feature(enable = "avx")]
fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s))
}

#[inline]
#[target_feature(enable = "avx")]
fn reduce_tile<const R: usize, const C: usize>(acc: &[[__m256; C]; R]) -> [[f32; 4]; C] {
    let z = _mm256_setzero_ps();
    let mut res = [[0f32; 4]; C];
    for c in 0..C {
        let v = |r: usize| if r < R { acc[r][c] } else { z };
        // SAFETY: `res[c]` is 16 bytes; unaligned store.
        unsafe { _mm_storeu_ps(res[c].as_mut_ptr(), hsum4(v(0), v(1), v(2), v(3))) };
    }
    res
}

/// Start a tile call: zeros on the first K chunk, else the parked accumulators.
#[inline]
#[target_feature(enable = "avx")]
fn acc_load<const R: usize, const C: usize>(t: &Tile, acc: &Acc) -> [[__m256; C]; R] {
    const { assert!(R <= 4 && R * C <= 12, "tile shape must fit hsum4 and Acc") };
    let mut a = [[_mm256_setzero_ps(); C]; R];
    if !t.first {
        for r in 0..R {
            a[r].copy_from_slice(&acc[r * C..(r + 1) * C]);
        }
    }
    a
}

/// End a tile call: the reduced sums after the last K chunk, else park the accumulators.
#[inline]
#[target_feature(enable = "avx")]
fn acc_finish<const R: usize, const C: usize>(t: &Tile, a: &[[__m256; C]; R], acc: &mut Acc) -> [[f32; 4]; C] {
    if t.last {
        return reduce_tile(a);
    }
    for r in 0..R {
        acc[r * C..(r + 1) * C].copy_from_slice(&a[r]);
    }
    [[0.0; 4]; C]
}

/// `n ≤ 32` bytes from `src`, zero-extended to 32.
///
/// # Safety
/// `src` readable for `bytes` bytes.
#[inline(always)]
unsafe fn tail_copy(src: *const u8, bytes: usize) -> [u8; 32] {
    let mut buf = [0u8; 32];
    std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), bytes);
    buf
}

/// Tile kernel, bf16 weights widened to f32: `R` weight rows × `C` x rows (a `pack_bf16_eo` panel)
/// over K range `t.k0..t.k1`.
///
/// # Safety
/// AVX2 + FMA; `x` is a panel of `C` rows covering `t.k1` (rounded up to 16), `w` has `R` rows of
/// `ws` bytes with at least `t.k1` bf16 each.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_bf16<const R: usize, const C: usize>(
    x: *const f32,
    w: *const u8,
    ws: usize,
    t: &Tile,
    acc: &mut Acc,
) -> [[f32; 4]; C] {
    let mut a = acc_load::<R, C>(t, acc);
    let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let mut pf = Prefetch::new(t);
    let mut kk = t.k0;
    macro_rules! step {
        ($p:ident => $load:expr) => {{
            let xs = x.add(kk * C);
            // Up to 8 accumulators, a weight row at a time against every x row. The `(2, 5)` tile
            // widens both weight rows first and then takes one x step at a time: in the other order
            // the compiler keeps all ten x vectors live and spills accumulators to the stack. Each
            // accumulator gets the same two FMAs in the same order either way.
            if C < 5 {
                for r in 0..R {
                    let $p = w.add(r * ws + kk * 2);
                    let v: __m256i = $load;
                    let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                    let wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
                    for c in 0..C {
                        a[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(c * 16)), we, a[r][c]);
                        a[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(c * 16 + 8)), wo, a[r][c]);
                    }
                }
            } else {
                let mut we = [_mm256_setzero_ps(); R];
                let mut wo = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    let $p = w.add(r * ws + kk * 2);
                    let v: __m256i = $load;
                    we[r] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                    wo[r] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
                }
                for c in 0..C {
                    let xe = _mm256_loadu_ps(xs.add(c * 16));
                    let xo = _mm256_loadu_ps(xs.add(c * 16 + 8));
                    for r in 0..R {
                        a[r][c] = _mm256_fmadd_ps(xe, we[r], a[r][c]);
                        a[r][c] = _mm256_fmadd_ps(xo, wo[r], a[r][c]);
                    }
                }
            }
        }};
    }
    while kk + 16 <= t.k1 {
        pf.step();
        step!(p => _mm256_loadu_si256(p as *const _));
        kk += 16;
    }
    if kk < t.k1 {
        let n = (t.k1 - kk) * 2;
        step!(p => _mm256_loadu_si256(tail_copy(p, n).as_ptr() as *const _));
    }
    acc_finish(t, &a, acc)
}

/// `out[i] = x · row(i)` for one activation row (a one-row `pack_bf16_eo` panel) and `n` bf16 weight
/// rows of `k`, eight rows at a time (the last few four at a time), without the tile driver
/// (`short_rows`; the drafter's matrices and its centroid head's candidates). A row gets the bits `tile_bf16` gives it in any tile: its
/// accumulator takes the same even and odd products of the same 16-element steps from zero, the tail
/// through the same zeroed copy, and `hsum4` sums each vector by the same tree.
///
/// # Safety
/// AVX2 + FMA; `x` covers `k` rounded up to 16; `row(i)` points at `k` readable bf16 for every
/// `i < n`; `out.len() == n`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows(x: *const f32, k: usize, n: usize, row: impl Fn(usize) -> *const u8, out: &mut [f32]) {
    debug_assert_eq!(out.len(), n);
    // Eight rows at a time while there are eight: eight independent accumulators keep both FMA
    // pipes busy, where four wait on the latency of their two-FMA steps.
    let whole = n / 8 * 8;
    let (head, out) = out.split_at_mut(whole);
    for (g, res) in head.chunks_exact_mut(8).enumerate() {
        let i0 = 8 * g;
        prefetch_rows_ahead(i0, n, 2 * k, &row);
        prefetch_rows_ahead(i0 + 4, n, 2 * k, &row);
        let a = dot_group::<8>(x, k, std::array::from_fn(|r| row(i0 + r)));
        _mm_storeu_ps(res.as_mut_ptr(), hsum4(a[0], a[1], a[2], a[3]));
        _mm_storeu_ps(res.as_mut_ptr().add(4), hsum4(a[4], a[5], a[6], a[7]));
    }
    for (g, res) in out.chunks_mut(4).enumerate() {
        let i0 = whole + 4 * g;
        prefetch_rows_ahead(i0, n, 2 * k, &row);
        let rows = |r: usize| if r < res.len() { row(i0 + r) } else { std::ptr::null() };
        let a = match res.len() {
            4 => dot_group::<4>(x, k, std::array::from_fn(rows)),
            3 => widen(dot_group::<3>(x, k, std::array::from_fn(rows))),
            2 => widen(dot_group::<2>(x, k, std::array::from_fn(rows))),
            _ => widen(dot_group::<1>(x, k, std::array::from_fn(rows))),
        };
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), hsum4(a[0], a[1], a[2], a[3]));
        res.copy_from_slice(&sums[..res.len()]);
    }
}

/// `R` accumulators padded with zero vectors to four.
#[inline]
#[target_feature(enable = "avx")]
fn widen<const R: usize>(a: [__m256; R]) -> [__m256; 4] {
    std::array::from_fn(|r| if r < R { a[r] } else { _mm256_setzero_ps() })
}

/// `dot_rows`' accumulators for `R` rows at `rows` (the steps of `tile_bf16::<R, 1>`).
///
/// # Safety
/// As `dot_rows`, for each of the `R` rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_group<const R: usize>(x: *const f32, k: usize, rows: [*const u8; R]) -> [__m256; R] {
    let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let mut a = [_mm256_setzero_ps(); R];
    let mut kk = 0;
    macro_rules! step {
        ($p:ident => $load:expr) => {{
            let (xe, xo) = (_mm256_loadu_ps(x.add(kk)), _mm256_loadu_ps(x.add(kk + 8)));
            for r in 0..R {
                let $p = rows[r].add(kk * 2);
                let v: __m256i = $load;
                a[r] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)), a[r]);
                a[r] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v, hi)), a[r]);
            }
        }};
    }
    while kk + 16 <= k {
        step!(p => _mm256_loadu_si256(p as *const _));
        kk += 16;
    }
    if kk < k {
        let n = (k - kk) * 2;
        step!(p => _mm256_loadu_si256(tail_copy(p, n).as_ptr() as *const _));
    }
    a
}

/// `out[i] = x · w[ids[i]]` for one activation row, reading each weight row where it is stored (the
/// drafter's centroid head: its candidates are scattered over the embedding), split over the pool
/// (`split_gather`). Every row gets the bits `matmul` gives it (see `dot_rows`).
pub fn gather(x: &[f32], w: MatRef, ids: &[u32], out: &mut [f32], split: Split) {
    assert!(supported(), "AVX2 kernels on a CPU without AVX2/FMA/F16C");
    gather!(pack_row, dot_rows, x, w, ids, out, split);
}

/// One activation row as `dot_rows` reads it (a one-row `pack_bf16_eo` panel). The caller has checked
/// that the CPU has AVX2.
fn pack_row(x: &[f32], k: usize) -> Panels<f32> {
    pack_eo(x, 1, k, 1)
}

/// Tile kernel for weights widened to f32 by `$full` (8 at `$p`) / `$tail` (the last `$n` < 8 at
/// `$q`); x is a plain f32 panel.
macro_rules! tile_wide {
    ($(#[$doc:meta])* $name:ident, $features:literal, $size:literal, |$p:ident| $full:expr, |$q:ident, $n:ident| $tail:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const C: usize>(x: *const f32, w: *const u8, ws: usize, t: &Tile, acc: &mut Acc) -> [[f32; 4]; C] {
            let mut a = acc_load::<R, C>(t, acc);
            let mut pf = Prefetch::new(t);
            let mut kk = t.k0;
            macro_rules! step {
                ($wv:ident) => {{
                    let xs = x.add(kk * C);
                    // One x vector at a time for the widest tiles, as in `tile_bf16`.
                    if C < 5 {
                        for r in 0..R {
                            for c in 0..C {
                                a[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(c * 8)), $wv[r], a[r][c]);
                            }
                        }
                    } else {
                        for c in 0..C {
                            let xv = _mm256_loadu_ps(xs.add(c * 8));
                            for r in 0..R {
                                a[r][c] = _mm256_fmadd_ps(xv, $wv[r], a[r][c]);
                            }
                        }
                    }
                }};
            }
            while kk + 8 <= t.k1 {
                pf.step();
                let mut wv = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    let $p = w.add(r * ws + kk * $size);
                    wv[r] = $full;
                }
                step!(wv);
                kk += 8;
            }
            if kk < t.k1 {
                let $n = t.k1 - kk;
                let mut wv = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    let $q = w.add(r * ws + kk * $size);
                    wv[r] = $tail;
                }
                step!(wv);
            }
            acc_finish(t, &a, acc)
        }
    };
}

tile_wide!(
    /// Tile kernel, f16 weights (`vcvtph2ps`). AVX2 has no masked 16-bit load: the tail goes through
    /// a zeroed stack copy.
    ///
    /// # Safety
    /// AVX2 + FMA + F16C; `x` is a panel of `C` rows covering `t.k1` (rounded up to 8), `w` has `R`
    /// rows of `ws` bytes with at least `t.k1` f16 each.
    tile_f16, "avx2,fma,f16c", 2,
    |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const _)),
    |p, n| _mm256_cvtph_ps(_mm_loadu_si128(tail_copy(p, n * 2).as_ptr() as *const _))
);

tile_wide!(
    /// Tile kernel, f32 weights (only 2-byte aligned in general: unaligned loads; `vmaskmovps` for
    /// the tail never touches masked-off lanes).
    ///
    /// # Safety
    /// As `tile_f16`, with f32 weights.
    tile_f32, "avx2,fma", 4,
    |p| _mm256_loadu_ps(p as *const f32),
    |p, n| _mm256_maskload_ps(p as *const f32, tail_mask(n))
);

// ---- vector kernels ----

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert!(supported() && a.len() == b.len());
    // SAFETY: features asserted; equal lengths, masked tail.
    unsafe { dot_impl(a, b) }
}

/// # Safety
/// The CPU must have AVX2 and FMA; `a` and `b` must have the same length.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
    let (n, pa, pb) = (a.len(), a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (u, s) in acc.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * u)), _mm256_loadu_ps(pb.add(i + 8 * u)), *s);
        }
        i += 32;
    }
    while i < n {
        let mask = tail_mask(n - i);
        acc[0] = _mm256_fmadd_ps(_mm256_maskload_ps(pa.add(i), mask), _mm256_maskload_ps(pb.add(i), mask), acc[0]);
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert!(supported() && x.len() == y.len());
    // SAFETY: features asserted; equal lengths, masked tail.
    unsafe { axpy_impl(a, x, y) }
}

/// # Safety
/// The CPU must have AVX2 and FMA; `x` and `y` must have the same length.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_impl(a: f32, x: &[f32], y: &mut [f32]) {
    let (n, px, py) = (x.len(), x.as_ptr(), y.as_mut_ptr());
    let av = _mm256_set1_ps(a);
    // x is read in step with y: the same whole vectors and the same masked tail.
    map_vectors(py, py, n, |y, i| {
        let x = if i + 8 <= n { _mm256_loadu_ps(px.add(i)) } else { _mm256_maskload_ps(px.add(i), tail_mask(n - i)) };
        _mm256_fmadd_ps(av, x, y)
    });
}

pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    assert!(supported() && x.len() == out.len() && w.is_none_or(|w| w.len() == x.len()));
    // SAFETY: features asserted; all slices have x's length.
    unsafe { rms_norm_impl(x, w, eps, out) }
}

/// # Safety
/// The CPU must have AVX2 and FMA; `out` (and `w`, when given) must have `x`'s length.
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_impl(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ms = dot_impl(x, x) / n as f32;
    let inv = _mm256_set1_ps(1.0 / (ms + eps).sqrt());
    // Same order as the scalar version: (x · inv) · w.
    match w {
        None => map_vectors(x.as_ptr(), out.as_mut_ptr(), n, |v, _| _mm256_mul_ps(v, inv)),
        Some(w) => {
            let pw = w.as_ptr();
            map_vectors(x.as_ptr(), out.as_mut_ptr(), n, |v, i| {
                let wv = if i + 8 <= n {
                    _mm256_loadu_ps(pw.add(i))
                } else {
                    _mm256_maskload_ps(pw.add(i), tail_mask(n - i))
                };
                _mm256_mul_ps(_mm256_mul_ps(v, inv), wv)
            })
        }
    }
}

/// e^x to ~1 ulp, as `avx512::exp`, but with 2^n built from exponent bits in two halves (each a
/// normal number for n in [-150, 128]) since AVX2 has no `vscalefps`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp(x: __m256) -> __m256 {
    // max/min return their second operand when one is NaN, so NaN passes through the clamp.
    let x = _mm256_min_ps(_mm256_set1_ps(89.0), _mm256_max_ps(_mm256_set1_ps(-104.0), x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let pow2 = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
    let v = _mm256_mul_ps(_mm256_mul_ps(y, pow2(n1)), pow2(n2));
    // NaN input: the integer path above produced garbage exponents; keep the NaN.
    _mm256_blendv_ps(v, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

pub fn softmax(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { softmax_impl(x) }
}

/// # Safety
/// The CPU must have AVX2 and FMA (every access is masked to `x`).
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    // Lanes past the end read as -inf (max ignores them, exp makes them 0).
    let load = |i: usize| {
        let mask = tail_mask(n - i);
        _mm256_blendv_ps(ninf, _mm256_maskload_ps(p.add(i), mask), _mm256_castsi256_ps(mask))
    };
    let mut mx = ninf;
    let mut i = 0;
    while i + 8 <= n {
        mx = _mm256_max_ps(mx, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    if i < n {
        mx = _mm256_max_ps(mx, load(i));
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let (mv, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    // Subnormal exponentials and results are zero and never computed, as in `avx512::softmax`.
    map_vectors(p, p, n, |v, i| {
        // The tail's missing lanes load as 0; as -inf they add nothing to the sum.
        let v = if i + 8 <= n { v } else { load(i) };
        let e = exp_normal(_mm256_sub_ps(v, mv));
        sum = _mm256_add_ps(sum, e);
        e
    });
    let s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let total = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    let inv = _mm256_set1_ps(1.0 / total);
    let (up, floor) = (_mm256_set1_ps(2f32.powi(64)), _mm256_set1_ps(total * 2f32.powi(-63)));
    map_vectors(p, p, n, |v, _| {
        let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(_mm256_mul_ps(v, up), floor);
        flush8(_mm256_mul_ps(_mm256_and_ps(keep, v), inv))
    });
}

/// `exp(d)` with results below 2^-126 zero and never computed, as `avx512::exp_normal`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_normal(d: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(d, _mm256_set1_ps(-87.4));
    flush8(_mm256_and_ps(keep, exp(_mm256_blendv_ps(_mm256_set1_ps(-80.0), d, keep))))
}

/// `v` with its subnormal lanes set to zero (by the exponent bits: no floating-point operation).
#[inline]
#[target_feature(enable = "avx2")]
fn flush8(v: __m256) -> __m256 {
    let exponent = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7f80_0000));
    let zero_exp = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
    _mm256_castsi256_ps(_mm256_andnot_si256(zero_exp, _mm256_castps_si256(v)))
}

pub fn gelu_tanh(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { gelu_impl(x) }
}

/// u / (1 + e^(-2y)) with y = √(2/π)·(u + 0.044715·u³); see `avx512::gelu_impl`.
///
/// # Safety
/// The CPU must have AVX2 and FMA (every access is masked to `x`).
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let (c, a, m2, one) =
        (_mm256_set1_ps(0.797_884_6), _mm256_set1_ps(0.044715), _mm256_set1_ps(-2.0), _mm256_set1_ps(1.0));
    map_vectors(p, p, n, |u, _| {
        let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, u), u), u);
        let y = _mm256_mul_ps(c, _mm256_add_ps(u, cube));
        _mm256_div_ps(u, _mm256_add_ps(one, exp(_mm256_mul_ps(m2, y))))
    });
}

/// Round every element to bf16 in place (ties to even, as `half::bf16::from_f32`).
pub fn round_bf16_slice(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { round_bf16_slice_impl(x) }
}

/// # Safety
/// The CPU must have AVX2 (every access is masked to `x`).
#[target_feature(enable = "avx2")]
unsafe fn round_bf16_slice_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    map_vectors(p, p, n, |v, _| round_bf16(v));
}

/// Final-logit softcapping `c·tanh(x/c)` in place, as `avx512::softcap` (the same formulas at 8 lanes).
pub fn softcap(x: &mut [f32], cap: f32, bf16: bool) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { softcap_impl(x, cap, bf16) }
}

/// # Safety
/// The CPU must have AVX2 and FMA (every access is masked to `x`).
#[target_feature(enable = "avx2,fma")]
unsafe fn softcap_impl(x: &mut [f32], cap: f32, bf16: bool) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let (c, one, two) = (_mm256_set1_ps(cap), _mm256_set1_ps(1.0), _mm256_set1_ps(2.0));
    let r = |v: __m256| if bf16 { round_bf16(v) } else { v };
    // tanh y = y·(1 + y²·(c3 + y²·(c5 + ...))), Horner in y².
    const SERIES: [f32; 6] =
        [21844.0 / 6081075.0, -1382.0 / 155925.0, 62.0 / 2835.0, -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0];
    let sign = _mm256_set1_ps(-0.0);
    map_vectors(p, p, n, |v, _| {
        let y = r(_mm256_div_ps(v, c));
        let e = exp(_mm256_mul_ps(two, y));
        let big = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        let y2 = _mm256_mul_ps(y, y);
        let mut poly = _mm256_set1_ps(SERIES[0]);
        for k in &SERIES[1..] {
            poly = _mm256_fmadd_ps(poly, y2, _mm256_set1_ps(*k));
        }
        let small = _mm256_fmadd_ps(_mm256_mul_ps(poly, y2), y, y);
        let abs = _mm256_andnot_ps(sign, y);
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(abs, _mm256_set1_ps(0.3));
        let t = r(_mm256_blendv_ps(big, small, is_small));
        r(_mm256_mul_ps(t, c))
    });
}

/// XOR of all 32-byte blocks of `buf` (whole blocks only): touches every byte, for bandwidth tests.
pub fn read_xor(buf: &[u8]) -> u64 {
    assert!(supported());
    // SAFETY: features asserted; reads whole 32-byte blocks inside `buf`.
    unsafe { read_xor_impl(buf) }
}

/// # Safety
/// The CPU must have AVX2 (only whole 32-byte blocks inside `buf` are read).
#[target_feature(enable = "avx2")]
unsafe fn read_xor_impl(buf: &[u8]) -> u64 {
    let mut acc = [_mm256_setzero_si256(); 8];
    let p = buf.as_ptr();
    let blocks = buf.len() / 256;
    for b in 0..blocks {
        for (u, a) in acc.iter_mut().enumerate() {
            *a = _mm256_xor_si256(*a, _mm256_loadu_si256(p.add(b * 256 + u * 32) as *const _));
        }
    }
    for b in blocks * 8..buf.len() / 32 {
        acc[0] = _mm256_xor_si256(acc[0], _mm256_loadu_si256(p.add(b * 32) as *const _));
    }
    let v = acc.into_iter().fold(_mm256_setzero_si256(), |s, a| _mm256_xor_si256(s, a));
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut _, v);
    lanes.iter().fold(0, |s, l| s ^ l)
}

/// `out[i, :] = Σ_t p[i, t] · v[t, cols]` (bf16 or f32 `v`; `out` is `[m, cols.len()]`): per output
/// element a chain of FMAs in `t` order, so any blocking of rows or columns gives the same bits. Register
/// tiles of up to 4 rows x 16 columns over 64 value rows at a time (see the AVX-512 version); columns
/// past the last multiple of 16 go through the same FMA chain one at a time.
pub fn weighted_rows(p: &[f32], m: usize, v: MatRef, cols: Range<usize>, out: &mut [f32]) {
    assert!(supported() && matches!(v.dtype, DType::BF16 | DType::F32));
    assert!(p.len() == m * v.rows && cols.end <= v.cols && out.len() == m * cols.len());
    let (n, d, w) = (v.rows, v.cols, cols.len());
    let full = cols.start + w / 16 * 16;
    out.fill(0.0);
    for t0 in (0..n).step_by(64) {
        let keys = t0..n.min(t0 + 64);
        let mut i0 = 0;
        while i0 < m {
            let mb = (m - i0).min(4);
            for c in (cols.start..full).step_by(16) {
                // SAFETY: features asserted; rows i0..i0+mb of p and out exist, columns c..c+16 are inside
                // cols, keys are rows of v.
                unsafe {
                    match mb {
                        1 => weighted_block::<1>(p, i0, c, keys.clone(), &cols, v, out),
                        2 => weighted_block::<2>(p, i0, c, keys.clone(), &cols, v, out),
                        3 => weighted_block::<3>(p, i0, c, keys.clone(), &cols, v, out),
                        _ => weighted_block::<4>(p, i0, c, keys.clone(), &cols, v, out),
                    }
                }
            }
            i0 += mb;
        }
    }
    for i in 0..m {
        for j in full..cols.end {
            out[i * w + j - cols.start] =
                (0..n).fold(0f32, |acc, t| p[i * n + t].mul_add(v.dtype.load(v.data, t * d + j), acc));
        }
    }
}

/// Continues the sums in `out` (zero before the first keys).
///
/// # Safety
/// The CPU must have AVX2 and FMA. `p` is `[m, v.rows]` and `out` `[m, cols.len()]` with rows
/// `i0..i0 + MB` inside `m`; columns `c..c + 16` lie inside `cols`, which lies inside `0..v.cols`;
/// `keys` are rows of `v`, whose dtype is bf16 or f32 and whose `data` holds `v.rows * v.cols` elements.
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_block<const MB: usize>(
    p: &[f32],
    i0: usize,
    c: usize,
    keys: Range<usize>,
    cols: &Range<usize>,
    v: MatRef,
    out: &mut [f32],
) {
    let (n, d, w) = (v.rows, v.cols, cols.len());
    let po = out.as_mut_ptr().add(c - cols.start);
    let mut acc = [[_mm256_setzero_ps(); 2]; MB];
    for (i, a) in acc.iter_mut().enumerate() {
        for (k, ak) in a.iter_mut().enumerate() {
            *ak = _mm256_loadu_ps(po.add((i0 + i) * w + 8 * k));
        }
    }
    let bf16 = v.dtype == DType::BF16;
    let base = v.data.as_ptr();
    let pp = p.as_ptr().add(i0 * n);
    for t in keys {
        let vk: [__m256; 2] = std::array::from_fn(|k| {
            let at = t * d + c + 8 * k;
            if bf16 {
                let h = _mm_loadu_si128(base.add(2 * at) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_loadu_ps(base.add(4 * at) as *const f32)
            }
        });
        for (i, a) in acc.iter_mut().enumerate() {
            let x = _mm256_set1_ps(*pp.add(i * n + t));
            for k in 0..2 {
                a[k] = _mm256_fmadd_ps(x, vk[k], a[k]);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (k, ak) in a.iter().enumerate() {
            _mm256_storeu_ps(po.add((i0 + i) * w + 8 * k), *ak);
        }
    }
}

pub fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    assert!(supported() && x.len() == out.len());
    let full = x.len() / 8 * 8;
    // SAFETY: features asserted; whole vectors inside both slices.
    unsafe { exp_shifted_impl(&x[..full], m, &mut out[..full]) }
    super::scalar::exp_shifted(&x[full..], m, &mut out[full..]);
}

/// # Safety
/// The CPU must have AVX2 and FMA; `x` and `out` must have the same length, a multiple of 8.
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_impl(x: &[f32], m: f32, out: &mut [f32]) {
    let mv = _mm256_set1_ps(m);
    for (xs, os) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
        _mm256_storeu_ps(os.as_mut_ptr(), exp_normal(_mm256_sub_ps(_mm256_loadu_ps(xs.as_ptr()), mv)));
    }
}
