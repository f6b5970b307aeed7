//! AVX-512 VNNI kernels for block-quantized weights (`quant`): integer products with `vpdpbusd`
//! (64 `u8 × s8` products summed four by four into 16 i32 lanes per instruction), then one scaled
//! float step per 4 blocks of 32 (per super-block for the k-quants).
//!
//! `vpdpbusd` wants one unsigned operand. The k-quants multiply their unsigned levels directly with
//! the signed activations (Q6_K's offset of 32 comes back as `-32 · Σ x`, from the activations'
//! 16-element sums). The others (Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL) make their levels the unsigned side
//! too (Q8_0 and IQ4_NL as `w + 128`, Q4_0 and Q5_0 with their offset kept, Q5_1 as stored) against
//! the signed Q8_0 / Q8_1 activations, and start each lane from `-off · Σ x` over its activations
//! (Q5_1: from zero), computed once when the activations are prepared: the lane then holds exactly
//! `Σ x · w` (docs/quantization.md, "Kernels"). IQ4_NL / IQ4_XS turn their nibbles into the table's
//! levels with one `vpshufb`; IQ4_XS takes them as `w + 128` (`u8`) against the signed Q8_K
//! activations and starts each lane (a group of 16) from `-128 · Σ x`, as Q6_K does with its offset
//! of 32.
//!
//! Layouts. The activations are laid out once per product (`with_prepared`, `Format::prep`) in the
//! order the weights decode to, and shared by every thread chunk. 32-element formats: a step is 4
//! blocks, two vectors per operand; vector 0 holds elements 0..16 of the 4 blocks, vector 1 elements
//! 16..32 (a 128-bit lane per block), so that both `vpdpbusd` of a step add into the same lanes and
//! lane `4b..4b+4` sums 8 products of block `b`. One conversion, one scale product and one FMA then
//! serve 4 blocks (the activations: as quantized, in that order, then each block's scale over its 4
//! lanes and each lane's starting sum). Q8_0 rows of 16 blocks or more (`q8_lanes`) go a whole
//! block per i32 lane instead (`Q8Lanes`): a step is 16 blocks, eight vectors per operand (the
//! blocks transposed as they are read), and one conversion, scale product and FMA serve all 16
//! (docs/quantization.md, "Q8_0 a block per lane"). k-quants: a step is one super-block, four vectors per
//! operand, transposed so that lane `l` of all four belongs to one sub-block (`prep_k`): Q4_K / Q5_K
//! a sub-block of 32 per qword (lanes `2j, 2j + 1`), Q6_K and IQ4_XS a group of 16 per i32 lane. The
//! four `vpdpbusd` then chain into the same i32 lanes (16 products each), converted once and
//! multiplied by per-lane float scales (`d · sc`, exact) times `d_x`: 4 `vpdpbusd`, one conversion
//! and 2 (Q6_K) or 3 (Q4_K / Q5_K, with the minimums against `d_x · bsums`) float operations per
//! super-block and activation row. The weights get there with one two-source permute per vector
//! (plus nibble and high-bit work).
//!
//! Tiles: `R` weight rows × `C` activation rows. Each step's weights are decoded once per tile, a row
//! at a time, and used for every activation row of the group; the next tile's bytes are prefetched
//! along the way.
//!
//! Batch invariance: an output element is one 16-lane f32 accumulator updated once per step with the
//! same operations whatever the tile, the group, or the thread chunk, then reduced by a fixed tree:
//! row `i` of an `m`-row product equals that row alone. The lane sums are exact integers (below 2^24
//! in magnitude), so only the order and grouping of the float operations differ from the reference
//! `quant::dot_row`.

use super::quant::{QActs, QMatRef, QType, IQ4_VALUES};
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::OnceLock;

/// Whether the CPU runs these kernels: AVX-512 F/BW/VL with VNNI (and the AVX2/FMA/F16C they lean
/// on). Detected once.
pub fn supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| super::avx512::supported() && is_x86_feature_detected!("avx512vnni"))
}

/// The activation rows `x` quantized into `a` (kind, shape and buffers already set by
/// `quant::quantize_acts_with`), block by block, with exactly the portable quantizer's results for
/// finite activations: the same maxima, the same products rounded half to even (`vcvtps2dq` under the
/// default rounding mode, as `nearest_int` rounds), the same clamps, scales and sums. (A block with a
/// NaN or an infinity gets levels of its own, as meaningless as the portable ones.)
///
/// # Safety
/// AVX-512 F/BW/VL and F16C; `a`'s buffers sized for `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn quantize_blocks(x: &[f32], a: &mut QActs) {
    use super::quant::ActKind;
    if a.kind == ActKind::Q8_K {
        for (bi, (xb, qb)) in x.chunks_exact(256).zip(a.qs.chunks_exact_mut(256)).enumerate() {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(xb.as_ptr().add(16 * i)));
            let mut am = _mm512_abs_ps(v[0]);
            for vi in &v[1..] {
                am = _mm512_max_ps(am, _mm512_abs_ps(*vi));
            }
            let amax = _mm512_reduce_max_ps(am);
            if amax == 0.0 {
                continue; // levels, scale and sums stay 0
            }
            // The first element of the largest magnitude, with its sign (`signed_max`).
            let mut max = 0.0;
            for (i, vi) in v.iter().enumerate() {
                let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(*vi), _mm512_set1_ps(amax));
                if hit != 0 {
                    max = xb[16 * i + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let s = _mm512_set1_ps(iscale);
            for (i, vi) in v.iter().enumerate() {
                let q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(s, *vi)), _mm512_set1_epi32(127));
                _mm_storeu_si128(qb.as_mut_ptr().add(16 * i).cast(), _mm512_cvtsepi32_epi8(q));
                a.bsums[bi * 16 + i] = _mm512_reduce_add_epi32(q) as i16;
            }
            a.d[bi] = 1.0 / iscale;
        }
        return;
    }
    let q8_1 = a.kind == ActKind::Q8_1;
    for (bi, (xb, qb)) in x.chunks_exact(32).zip(a.qs.chunks_exact_mut(32)).enumerate() {
        let (v0, v1) = (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        let q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), hi), lo);
        let q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)), hi), lo);
        _mm_storeu_si128(qb.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(qb.as_mut_ptr().add(16).cast(), _mm512_cvtsepi32_epi8(q1));
        a.d[bi] = half::f16::from_f32(d).to_f32();
        if q8_1 {
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            a.s[bi] = half::f16::from_f32(d * sum as f32).to_f32();
        }
    }
}

/// Whether the CPU also has AVX-512 VBMI (byte permutes), for `decode_vbmi`. Detected once.
fn vbmi() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
}

/// `out[i][j] = Σ_k acts[i, k] · w[j, k]`; `out[i]` has `w.rows` elements.
#[cfg_attr(not(test), allow(dead_code))]
pub fn matmul(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    with_prepared(acts, w.qtype, |p| matmul_prepared(p, w, out))
}

/// Activation rows laid out for one weight format's kernels (`Format::prep`): made once per product
/// and read by every thread chunk.
pub struct Prepared<'a> {
    acts: &'a QActs,
    qtype: QType,
    x: &'a [__m512i],
    per_row: usize,
}

thread_local! {
    /// The prepared vectors' buffer, kept between products. Taken while in use: a nested product on
    /// the same thread (rayon runs other work while a caller waits) finds it empty and allocates.
    static PREP_BUF: Cell<Vec<__m512i>> = const { Cell::new(Vec::new()) };
}

/// `f` with `acts` prepared for weights of format `qtype`.
pub fn with_prepared<T>(acts: &QActs, qtype: QType, f: impl FnOnce(&Prepared) -> T) -> T {
    assert!(supported(), "AVX-512 VNNI quantized kernels on a CPU without them");
    assert!(acts.kind == qtype.act(), "activations quantized for another format");
    let mut buf = PREP_BUF.with(Cell::take);
    // SAFETY: the CPU has the features (asserted); `prep_rows` sizes the buffer itself.
    let per_row = unsafe {
        match qtype {
            QType::Q8_0 if q8_lanes(acts.cols) => prep_rows::<Q8Lanes>(acts, &mut buf),
            QType::Q8_0 => prep_rows::<Q8_0<false>>(acts, &mut buf),
            QType::Q4_0 => prep_rows::<Q4_0>(acts, &mut buf),
            QType::Q5_0 => prep_rows::<Q5_0>(acts, &mut buf),
            QType::Q5_1 => prep_rows::<Q5_1>(acts, &mut buf),
            QType::Q4_K => prep_rows::<Q4K>(acts, &mut buf),
            QType::Q5_K => prep_rows::<Q5K>(acts, &mut buf),
            QType::Q6_K => prep_rows::<Q6K>(acts, &mut buf),
            QType::IQ4_NL => prep_rows::<IQ4NL>(acts, &mut buf),
            QType::IQ4_XS => prep_rows::<IQ4XS>(acts, &mut buf),
            QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => {
                panic!("packed strips go through `q8x16` / `q4kx16` / `q6kx16` (matmul_quant)")
            }
        }
    };
    let res = f(&Prepared { acts, qtype, x: &buf, per_row });
    PREP_BUF.with(|b| b.set(buf));
    res
}

/// Every row of `acts` prepared into `buf` (replacing its contents); returns the vectors per row.
///
/// # Safety
/// AVX-512 VNNI CPU.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn prep_rows<F: Format>(acts: &QActs, buf: &mut Vec<__m512i>) -> usize {
    let nb = acts.cols / acts.block();
    let steps = nb.div_ceil(F::SB);
    let per_row = steps * F::LINES;
    buf.clear();
    buf.reserve(acts.rows * per_row);
    for i in 0..acts.rows {
        F::prep(acts, i, steps, buf.as_mut_ptr().add(i * per_row));
    }
    // SAFETY: reserved above, and every `prep` wrote all its `steps · LINES` vectors.
    buf.set_len(acts.rows * per_row);
    per_row
}

/// `out[i][j] = Σ_k acts[i, k] · w[j, k]` from prepared activations; `out[i]` has `w.rows` elements.
pub fn matmul_prepared(p: &Prepared, w: QMatRef, out: &mut [&mut [f32]]) {
    let walk = if one_row_streams(p.acts.rows, &w) { Walk::Rows } else { Walk::Tiles };
    matmul_walk(p, w, out, walk)
}

/// How `run` goes through the weight rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Walk {
    /// Tiles of up to 4 weight rows, the next tile prefetched.
    Tiles,
    /// One weight row at a time and no software prefetch: a single stream per core, which Zen 4's
    /// hardware prefetcher keeps fed (`one_row_streams`).
    Rows,
}

/// Shortest weight rows (bytes) that one activation row reads in `Walk::Rows` on Zen 4: Q8_0's, and
/// the other formats' (whose heavier decoding gains more from the tile's four rows side by side).
const ONE_ROW_MIN_BYTES_Q8_0: usize = 1024;
const ONE_ROW_MIN_BYTES: usize = 2048;

/// Whether `m` activation rows over `w` go through `Walk::Rows`: one row on Zen 4, over rows long
/// enough. Measured with `matmul_bench --quant` on E2B's shapes: Q8_0 1.4-1.6x faster at K = 1536 to
/// 6144; the others 1.1-1.3x faster over K = 6144 but up to 1.4x slower over K = 1536, where a row is a
/// few steps and the four rows of a tile hide each other's latency (docs/quantization.md, "One
/// quantized row on Zen 4").
fn one_row_streams(m: usize, w: &QMatRef) -> bool {
    let min_row = if w.qtype == QType::Q8_0 { ONE_ROW_MIN_BYTES_Q8_0 } else { ONE_ROW_MIN_BYTES };
    m == 1 && w.row_bytes() >= min_row && super::x86::zen4()
}

/// `matmul_prepared` walking the weight rows as `walk` says, whatever the CPU; the tests compare
/// the walks' bits.
pub(super) fn matmul_walk(p: &Prepared, w: QMatRef, out: &mut [&mut [f32]], walk: Walk) {
    assert!(p.qtype == w.qtype && p.acts.cols == w.cols, "activations prepared for another format or width");
    assert_eq!(out.len(), p.acts.rows, "one output row per activation row");
    assert!(out.iter().all(|o| o.len() == w.rows), "output rows of the chunk's width");
    // SAFETY: `with_prepared` checked the CPU; shapes checked above, so every block and activation
    // read stays inside `w.data` and the prepared rows.
    unsafe {
        match w.qtype {
            QType::Q8_0 if q8_lanes(w.cols) => run::<Q8Lanes>(p, w, out, walk),
            QType::Q8_0 if vbmi() => run::<Q8_0<true>>(p, w, out, walk),
            QType::Q8_0 => run::<Q8_0<false>>(p, w, out, walk),
            QType::Q4_0 => run::<Q4_0>(p, w, out, walk),
            QType::Q5_0 => run::<Q5_0>(p, w, out, walk),
            QType::Q5_1 => run::<Q5_1>(p, w, out, walk),
            QType::Q4_K => run::<Q4K>(p, w, out, walk),
            QType::Q5_K => run::<Q5K>(p, w, out, walk),
            QType::Q6_K => run::<Q6K>(p, w, out, walk),
            QType::IQ4_NL => run::<IQ4NL>(p, w, out, walk),
            QType::IQ4_XS => run::<IQ4XS>(p, w, out, walk),
            QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => {
                panic!("packed strips go through `q8x16` / `q4kx16` / `q6kx16` (matmul_quant)")
            }
        }
    }
}

/// One activation row as the kernels read it: its prepared vectors (`Format::prep`, `LINES` per step)
/// and its block scales.
#[derive(Clone, Copy)]
struct Act {
    x: *const __m512i,
    d: *const f32,
}

/// A weight format: how to lay out the activations, decode one step of a weight row, and add one
/// step's product with an activation row to an accumulator.
trait Format {
    /// Bytes per block, blocks per step, prepared activation vectors per step.
    const BB: usize;
    const SB: usize;
    const LINES: usize;
    /// A decoded step (plain vectors; all-zero bits is a valid value).
    type W: Copy;
    /// Whether a tile decodes and uses its weight rows one at a time (Q4_K and Q5_K, whose decoded
    /// super-block is six vectors: four rows of it beside the accumulators would not fit the
    /// registers) rather than all rows' steps first, then activation row by activation row, each
    /// activation vector loaded once for the tile's rows (the 32-element formats, and Q6_K and
    /// IQ4_XS, five vectors: docs/quantization.md, "Tiles of the k-quants"). Each accumulator gets the
    /// same steps in the same order either way.
    const ROW_AT_A_TIME: bool;
    /// Whether a tile asks for the next tile into L2 (`prefetcht1`) rather than L1 (`prefetcht0`)
    /// (docs/quantization.md, "Prefetching Q8_0 tiles").
    const PREFETCH_L2: bool = false;

    /// Fill `out` (`LINES` vectors per step, `steps` steps) from activation row `r`.
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; `out` holds `steps · LINES` vectors.
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i);

    /// Decode the `SB` blocks at `b`.
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; `b` readable for `SB · BB` bytes.
    unsafe fn decode(b: *const u8) -> Self::W;

    /// Decode the row's last `t < SB` blocks at `b` (the rest of the step zero): by default a copy
    /// into a zeroed step (zero scales, so the missing blocks add zeros; their prepared activations
    /// are zero too).
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; `b` readable for `t · BB` bytes, `t · BB` at most 136.
    #[inline(always)]
    unsafe fn decode_tail(b: *const u8, t: usize) -> Self::W {
        let mut tmp = [0u8; 4 * 34];
        debug_assert!(t * Self::BB <= tmp.len());
        std::ptr::copy_nonoverlapping(b, tmp.as_mut_ptr(), t * Self::BB);
        Self::decode(tmp.as_ptr())
    }

    /// `dot` of one decoded step with each of the activation rows `x`, into `acc`.
    ///
    /// # Safety
    /// As `dot`.
    #[inline(always)]
    unsafe fn dots<const C: usize>(w: &Self::W, x: &[Act; C], st: usize, acc: &mut [__m512; C]) {
        for (a, xc) in acc.iter_mut().zip(x) {
            *a = Self::dot(w, xc, st, *a);
        }
    }

    /// `acc` plus step `st` of the row `w` came from times step `st` of `a`.
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; `a` has step `st`.
    unsafe fn dot(w: &Self::W, a: &Act, st: usize, acc: __m512) -> __m512;
}

/// How far ahead, at least, a tile of a format prefetched into L2 asks for weights.
const PF_AHEAD_BYTES: usize = 4096;

/// The largest activation group: 8 rows take 16 accumulators at 2 weight rows per tile.
const GROUP_MAX: usize = 8;

/// Group `g` of the m activation rows, cut into `m.div_ceil(GROUP_MAX)` groups of at most
/// `GROUP_MAX` (sizes as equal as they come): its first row and its size.
fn group(m: usize, g: usize) -> (usize, usize) {
    let n = m.div_ceil(GROUP_MAX);
    let (base, extra) = (m / n, m % n);
    (g * base + g.min(extra), base + usize::from(g < extra))
}

/// Weight rows per tile for groups of up to `c` activation rows (accumulators: at most 24; at 4 × 5
/// and 4 × 6 the k-quants keep a few on the stack, and still beat 2-row tiles).
fn tile_rows(c: usize) -> usize {
    if c <= 6 {
        4
    } else {
        2
    }
}

/// Walk the product: weight-row tiles outside, activation groups inside, so each tile's rows are read
/// from memory once and from L1 by the later groups. `Walk::Rows` takes a weight row at a time
/// without prefetching. Either way every output gets the same operations in the same order.
///
/// # Safety
/// AVX-512 VNNI CPU; shapes as checked by `matmul`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run<F: Format>(p: &Prepared, w: QMatRef, out: &mut [&mut [f32]], walk: Walk) {
    let (m, n) = (p.acts.rows, w.rows);
    let nb = w.cols / w.qtype.block_elems();
    let (full, tail) = (nb / F::SB, nb % F::SB);
    let rb = w.row_bytes();
    let act = |i: usize| Act { x: p.x.as_ptr().add(i * p.per_row), d: p.acts.d.as_ptr().add(i * nb) };
    let ngroups = m.div_ceil(GROUP_MAX);
    let rmax = if walk == Walk::Rows { 1 } else { tile_rows(group(m, 0).1) };
    let shape = Shape { rb, full, tail };
    // Tiles ahead whose bytes a tile asks for: the next one, or for formats prefetched into L2 the
    // first that starts at least `PF_AHEAD_BYTES` on (short rows: the shipped pair's 408-byte Q8_0 rows).
    let ahead = if F::PREFETCH_L2 { PF_AHEAD_BYTES.div_ceil(rmax * rb).max(1) } else { 1 };
    let mut j = 0;
    while j < n {
        let r = if n - j >= rmax { rmax } else { 1 };
        let wp = w.data.as_ptr().add(j * rb);
        for gi in 0..ngroups {
            let (g0, c) = group(m, gi);
            // The first group's pass prefetches the tile `ahead` on (the same number of rows, or what is left).
            let (pf_off, pf) = if gi == 0 && walk == Walk::Tiles {
                ((ahead - 1) * r * rb, r.min(n.saturating_sub(j + ahead * r)) * rb)
            } else {
                (0, 0)
            };
            macro_rules! shape {
                ($r:literal, $c:literal) => {{
                    let x: [Act; $c] = std::array::from_fn(|i| act(g0 + i));
                    let res = tile::<F, $r, $c>(wp, &shape, pf_off, pf, &x);
                    for (rr, row) in res.iter().enumerate() {
                        for (cc, &v) in row.iter().enumerate() {
                            out[g0 + cc][j + rr] = v;
                        }
                    }
                }};
            }
            match (r, c) {
                (4, 1) => shape!(4, 1),
                (4, 2) => shape!(4, 2),
                (4, 3) => shape!(4, 3),
                (4, 4) => shape!(4, 4),
                (4, 5) => shape!(4, 5),
                (4, 6) => shape!(4, 6),
                (2, 1) => shape!(2, 1),
                (2, 2) => shape!(2, 2),
                (2, 3) => shape!(2, 3),
                (2, 4) => shape!(2, 4),
                (2, 5) => shape!(2, 5),
                (2, 6) => shape!(2, 6),
                (2, 7) => shape!(2, 7),
                (2, 8) => shape!(2, 8),
                (1, 1) => shape!(1, 1),
                (1, 2) => shape!(1, 2),
                (1, 3) => shape!(1, 3),
                (1, 4) => shape!(1, 4),
                (1, 5) => shape!(1, 5),
                (1, 6) => shape!(1, 6),
                (1, 7) => shape!(1, 7),
                (1, 8) => shape!(1, 8),
                _ => unreachable!("tile shape"),
            }
        }
        j += r;
    }
}

/// A weight row's geometry: bytes per row, whole steps, blocks in the last partial step.
struct Shape {
    rb: usize,
    full: usize,
    tail: usize,
}

/// `R` weight rows (`s.rb` bytes apart from `w`) times the `C` activation rows `x`, prefetching the
/// `pf` bytes after the tile's rows as it goes.
///
/// # Safety
/// AVX-512 VNNI CPU; `w` holds `R` rows, each `x` row the same number of blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<F: Format, const R: usize, const C: usize>(
    w: *const u8,
    s: &Shape,
    pf_off: usize,
    pf: usize,
    x: &[Act; C],
) -> [[f32; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let next = w.wrapping_add(R * s.rb + pf_off);
    let (mut pf_at, mut pf_end, pf_step) = (0, 0, pf.div_ceil(s.full.max(1)));
    let step_bytes = F::SB * F::BB;
    for st in 0..s.full {
        // This step's share of the next tile, a line at a time.
        pf_end = (pf_end + pf_step).min(pf);
        while pf_at < pf_end {
            // SAFETY: a prefetch never faults and has no architectural effect; the address is in the
            // chunk anyway.
            let at = next.wrapping_add(pf_at) as *const i8;
            if F::PREFETCH_L2 {
                _mm_prefetch::<_MM_HINT_T1>(at);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(at);
            }
            pf_at += 64;
        }
        if F::ROW_AT_A_TIME {
            // One weight row at a time against every activation row: its decoded step is all the
            // registers a row needs beside the accumulators.
            unroll::<R>(|r| {
                let wd = F::decode(w.add(r * s.rb + st * step_bytes));
                F::dots(&wd, x, st, &mut acc[r]);
            });
        } else {
            let mut wd: [F::W; R] = std::mem::zeroed();
            for (r, d) in wd.iter_mut().enumerate() {
                *d = F::decode(w.add(r * s.rb + st * step_bytes));
            }
            for (c, xc) in x.iter().enumerate() {
                for (r, wr) in wd.iter().enumerate() {
                    acc[r][c] = F::dot(wr, xc, st, acc[r][c]);
                }
            }
        }
    }
    if s.tail > 0 {
        // The last blocks (`Format::decode_tail`).
        let st = s.full;
        unroll::<R>(|r| {
            let wd = F::decode_tail(w.add(r * s.rb + st * step_bytes), s.tail);
            F::dots(&wd, x, st, &mut acc[r]);
        });
    }
    let mut res = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            res[r][c] = hsum(acc[r][c]);
        }
    }
    res
}

/// `f(r)` for `r` in `0..R` (at most 4), unrolled: with constant indices a tile's accumulators stay
/// in registers (a loop over the rows kept them on the stack).
#[inline(always)]
fn unroll<const R: usize>(mut f: impl FnMut(usize)) {
    const { assert!(R <= 4) };
    if R > 0 {
        f(0);
    }
    if R > 1 {
        f(1);
    }
    if R > 2 {
        f(2);
    }
    if R > 3 {
        f(3);
    }
}

/// The sum of the 16 lanes, always by the same tree.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

// ---------------------------------------------------------------------------------------------------
// Formats of 32-element blocks

/// Lane `l` takes element `l / 4` of a 4-element vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn by4() -> __m512i {
    _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
}

/// The four f32 of `v` (low 128 bits) spread over 4 lanes each.
#[inline]
#[target_feature(enable = "avx512f")]
fn spread4(v: __m128) -> __m512 {
    _mm512_permutexvar_ps(by4(), _mm512_castps128_ps512(v))
}

/// The four f32 of `v` in lanes 0, 4, 8, 12; zeros elsewhere.
#[inline]
#[target_feature(enable = "avx512f")]
fn first_of4(v: __m128) -> __m512 {
    _mm512_maskz_permutexvar_ps(0x1111, by4(), _mm512_castps128_ps512(v))
}

/// The f16 at `p + i · bb` for the 4 blocks of a step, as f32.
///
/// # Safety
/// F16C; the four 2-byte values readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x4(p: *const u8, bb: usize) -> __m128 {
    let h = |i: usize| (p.add(i * bb) as *const u16).read_unaligned() as u64;
    let bits = h(0) | (h(1) << 16) | (h(2) << 32) | (h(3) << 48);
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

/// The 16 bytes at `p + i · bb` for the 4 blocks of a step, block `i` in 128-bit lane `i`.
///
/// # Safety
/// AVX-512F; each 16 bytes readable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lanes16(p: *const u8, bb: usize) -> __m512i {
    let l = |i: usize| _mm_loadu_si128(p.add(i * bb) as *const __m128i);
    let v = _mm512_castsi128_si512(l(0));
    let v = _mm512_inserti32x4::<1>(v, l(1));
    let v = _mm512_inserti32x4::<2>(v, l(2));
    _mm512_inserti32x4::<3>(v, l(3))
}

/// The nibbles of 4 blocks' 16 packed bytes at `p + i · bb`: low nibbles (elements 0..16 of each block,
/// a 128-bit lane per block) and high nibbles (elements 16..32), as bytes `0..16`.
///
/// # Safety
/// AVX-512 F/BW; each 16 bytes readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn nibbles4(p: *const u8, bb: usize) -> (__m512i, __m512i) {
    let q = lanes16(p, bb);
    let m4 = _mm512_set1_epi8(0x0f);
    (_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4))
}

/// Of the 4 blocks' 32-bit `qh` at `p + i · bb`: the bits of elements 0..16 (block `i` at bits
/// `16i..16i+16`), and those of elements 16..32.
///
/// # Safety
/// Each 4 bytes readable.
#[inline]
unsafe fn qh_masks(p: *const u8, bb: usize) -> (u64, u64) {
    let q = |i: usize| (p.add(i * bb) as *const u32).read_unaligned() as u64;
    let (q0, q1, q2, q3) = (q(0), q(1), q(2), q(3));
    let lo = (q0 & 0xffff) | ((q1 & 0xffff) << 16) | ((q2 & 0xffff) << 32) | ((q3 & 0xffff) << 48);
    let hi = (q0 >> 16) | ((q1 >> 16) << 16) | ((q2 >> 16) << 32) | ((q3 >> 16) << 48);
    (lo, hi)
}

/// A decoded step of a 32-element format: its levels as unsigned bytes, `w + off` (elements 0..16,
/// then 16..32, of the 4 blocks: `vpdpbusd` multiplies unsigned by signed bytes, and the activations
/// are the signed side), the block scales over their lanes, and (Q5_1) the minimums in the first
/// lane of each block. The offset's share, `off · Σ x`, comes with the activations (`prep32`), so a
/// weight step needs no correction of its own.
#[derive(Clone, Copy)]
struct Step32 {
    w0: __m512i,
    w1: __m512i,
    d: __m512,
    m: __m512,
}

/// What the fourth prepared vector of a 32-element step holds: `-off · Σ x` per i32 lane (the
/// formats whose unsigned levels carry an offset `off`), or the blocks' `s_x` in the first lane of
/// each block (Q5_1, whose levels have none: it adds `m · s_x`).
#[derive(Clone, Copy)]
enum Extra {
    Offset(i32),
    Sums,
}

/// The step's 4 signed activation blocks at `q` in the kernels' order (elements 0..16 of each block,
/// then 16..32), the block scales spread over their lanes, and `extra`'s vector (`s`: the row's block
/// sums from the first of these blocks); `n` blocks present, the rest zero.
///
/// # Safety
/// AVX-512 F/BW/VNNI; `q` readable for `32 n` bytes, `d` (and for `Sums`, `s`) for `n` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn prep32_step(q: *const i8, d: *const f32, s: *const f32, n: usize, extra: Extra, out: *mut __m512i) {
    let (a, b, dv) = if n == 4 {
        (_mm512_loadu_si512(q as *const _), _mm512_loadu_si512(q.add(64) as *const _), _mm_loadu_ps(d))
    } else {
        let (mut qt, mut dt) = ([0i8; 128], [0f32; 4]);
        std::ptr::copy_nonoverlapping(q, qt.as_mut_ptr(), 32 * n);
        std::ptr::copy_nonoverlapping(d, dt.as_mut_ptr(), n);
        (
            _mm512_loadu_si512(qt.as_ptr() as *const _),
            _mm512_loadu_si512(qt.as_ptr().add(64) as *const _),
            _mm_loadu_ps(dt.as_ptr()),
        )
    };
    let (x0, x1) = (_mm512_shuffle_i64x2::<0x88>(a, b), _mm512_shuffle_i64x2::<0xdd>(a, b));
    out.write(x0);
    out.add(1).write(x1);
    out.add(2).write(_mm512_castps_si512(spread4(dv)));
    out.add(3).write(match extra {
        Extra::Offset(off) => {
            // Σ x over each i32 lane's 8 elements (4 in each vector), times -off: exact in i32.
            let ones = _mm512_set1_epi8(1);
            let sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x0), ones, x1);
            _mm512_mullo_epi32(sum, _mm512_set1_epi32(-off))
        }
        Extra::Sums => {
            let mut s4 = [0f32; 4];
            std::ptr::copy_nonoverlapping(s, s4.as_mut_ptr(), n);
            _mm512_castps_si512(first_of4(_mm_loadu_ps(s4.as_ptr())))
        }
    });
}

/// Activations for the 32-element formats: 4 vectors per step (`prep32_step`).
///
/// # Safety
/// As `Format::prep`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn prep32(acts: &QActs, r: usize, steps: usize, out: *mut __m512i, extra: Extra) {
    let nb = acts.blocks();
    let (q, d) = (acts.row_qs(r).as_ptr(), acts.row_d(r).as_ptr());
    // Only Q5_1's activations carry block sums.
    let s = if matches!(extra, Extra::Sums) { acts.s.as_ptr().add(r * nb) } else { std::ptr::null() };
    for st in 0..steps {
        let n = (nb - 4 * st).min(4);
        prep32_step(q.add(128 * st), d.add(4 * st), s.wrapping_add(4 * st), n, extra, out.add(st * 4));
    }
}

/// `acc + f32(Σ w·x) · (d_w · d_x)` over the step's 4 blocks (lane by lane): the unsigned levels'
/// products started from the activations' `-off · Σ x` (`offset`; Q5_1: from zero). Each lane's sum
/// is exact in i32 (below 2^19), the same integer as the signed levels' products.
///
/// # Safety
/// AVX-512 VNNI; `a` has step `st`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot32(w: &Step32, a: &Act, st: usize, offset: bool, acc: __m512) -> __m512 {
    let x = a.x.add(st * 4);
    let s = if offset { x.add(3).read() } else { _mm512_setzero_si512() };
    let s = _mm512_dpbusd_epi32(s, w.w0, x.read());
    let s = _mm512_dpbusd_epi32(s, w.w1, x.add(1).read());
    let dd = _mm512_mul_ps(w.d, _mm512_castsi512_ps(x.add(2).read()));
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc)
}

/// Q8_0; with `VBMI`, decoded with byte permutes (`decode_vbmi`): only where the CPU has them (`vbmi`).
struct Q8_0<const VBMI: bool>;
struct Q4_0;
struct Q5_0;
struct Q5_1;
struct Q4K;
struct Q5K;
struct Q6K;
struct IQ4NL;
struct IQ4XS;

impl<const VBMI: bool> Format for Q8_0<VBMI> {
    const PREFETCH_L2: bool = true;
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 34;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, Extra::Offset(128))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        if VBMI {
            return decode_vbmi(b);
        }
        // w + 128 as unsigned bytes: the sign bit flipped.
        let c = _mm512_set1_epi8(0x80u8 as i8);
        let w0 = _mm512_xor_si512(lanes16(b.add(2), 34), c);
        let w1 = _mm512_xor_si512(lanes16(b.add(18), 34), c);
        Step32 { w0, w1, d: spread4(f16x4(b, 34)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, true, acc)
    }
}

/// The byte indices `vpermt2b` takes for `decode_vbmi`: index `i < 64` is byte `i` of the first source,
/// `64 + i` byte `i` of the second. Quants 0..16 of the 4 blocks (128-bit lane per block) from bytes
/// 0..128 of the step; quants 16..32 from bytes 16..80 and 72..136; the 4 blocks' f16 scales, each in 4
/// consecutive 16-bit lanes of the low 256 bits, from bytes 0..128.
#[repr(align(64))]
struct ByteIdx([u8; 64]);
static Q8_LO: ByteIdx = ByteIdx(q8_idx(2, 0, 64));
static Q8_HI: ByteIdx = ByteIdx(q8_idx(18, 16, 72));
static Q8_D: ByteIdx = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 32 {
        // 16-bit lane j/2 holds block (j/2)/4's scale; byte j its byte j % 2.
        t[j] = (34 * (j / 8) + j % 2) as u8;
        j += 1;
    }
    ByteIdx(t)
};

/// Byte `16 b + e` of a vector = byte `34 b + at + e` of the step, taken from a first source loaded
/// at step byte `lo` and a second at `hi` (bytes below `lo + 64` come from the first).
const fn q8_idx(at: usize, lo: usize, hi: usize) -> [u8; 64] {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let o = 34 * (i / 16) + at + i % 16;
        t[i] = if o < lo + 64 { (o - lo) as u8 } else { (64 + o - hi) as u8 };
        i += 1;
    }
    t
}

/// `vpermt2b`: byte `i` is `idx[i] < 64 ? a[idx[i]] : b[idx[i] - 64]` (AVX-512 VBMI), in `asm!` so
/// that the kernels' functions need not enable VBMI (which would let the compiler use it anywhere in
/// them, on CPUs that may lack it).
///
/// # Safety
/// AVX-512 VBMI CPU.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn permute_bytes(a: __m512i, idx: __m512i, b: __m512i) -> __m512i {
    let mut r = a;
    // SAFETY: register-only instruction; the caller checked the CPU.
    std::arch::asm!("vpermt2b {r}, {i}, {b}", r = inout(zmm_reg) r, i = in(zmm_reg) idx, b = in(zmm_reg) b,
                    options(pure, nomem, nostack, preserves_flags));
    r
}

/// The step `Q8_0` decodes, the same three vectors (so the same bits), where the CPU has AVX-512 VBMI:
/// from four overlapping 64-byte loads of the step's 136 bytes, its quants and scales picked out by
/// `vpermt2b`, in place of eight 16-byte loads, six inserts and four scalar scale loads, about half
/// the instructions.
///
/// # Safety
/// AVX-512 VNNI + VBMI CPU; `b` readable for 136 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn decode_vbmi(b: *const u8) -> Step32 {
    let ld = |at: usize| _mm512_loadu_si512(b.add(at) as *const _);
    let ix = |t: &ByteIdx| _mm512_load_si512(t.0.as_ptr() as *const _);
    let (v0, v64, v16, v72) = (ld(0), ld(64), ld(16), ld(72));
    let c = _mm512_set1_epi8(0x80u8 as i8);
    let w0 = _mm512_xor_si512(permute_bytes(v0, ix(&Q8_LO), v64), c);
    let w1 = _mm512_xor_si512(permute_bytes(v16, ix(&Q8_HI), v72), c);
    let d = _mm512_cvtph_ps(_mm512_castsi512_si256(permute_bytes(v0, ix(&Q8_D), v64)));
    Step32 { w0, w1, d, m: _mm512_setzero_ps() }
}

impl Format for Q4_0 {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 18;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, Extra::Offset(8))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        // Low nibbles are elements 0..16, high nibbles 16..32.
        let (lo, hi) = nibbles4(b.add(2), 18);
        Step32 { w0: lo, w1: hi, d: spread4(f16x4(b, 18)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, true, acc)
    }
}

/// The 5-bit levels of 4 Q5_0 / Q5_1 blocks (`qs` 16 bytes at `b + qs_at`, `qh` at `b + qh_at`), as
/// unsigned levels `0..32`.
///
/// # Safety
/// AVX-512 F/BW; the 4 blocks readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn levels5(b: *const u8, bb: usize, qs_at: usize, qh_at: usize) -> (__m512i, __m512i) {
    let (lo, hi) = nibbles4(b.add(qs_at), bb);
    let (k0, k1) = qh_masks(b.add(qh_at), bb);
    let c16 = _mm512_set1_epi8(16);
    (_mm512_mask_add_epi8(lo, k0, lo, c16), _mm512_mask_add_epi8(hi, k1, hi, c16))
}

impl Format for Q5_0 {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 22;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, Extra::Offset(16))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        let (w0, w1) = levels5(b, 22, 6, 2);
        Step32 { w0, w1, d: spread4(f16x4(b, 22)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, true, acc)
    }
}

impl Format for Q5_1 {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 24;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, Extra::Sums)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        let (w0, w1) = levels5(b, 24, 8, 4);
        Step32 { w0, w1, d: spread4(f16x4(b, 24)), m: first_of4(f16x4(b.add(2), 24)) }
    }

    /// As `dot32`, then `+ m · s_x` in the first lane of each block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        let acc = dot32(w, a, st, false, acc);
        _mm512_fmadd_ps(w.m, _mm512_castsi512_ps(a.x.add(st * 4 + 3).read()), acc)
    }
}

// ---------------------------------------------------------------------------------------------------
// k-quants

/// K-quant activations, 5 vectors per super-block: 4 of levels, transposed so that each column
/// of the 4 vectors (`g` bytes wide: lane `l` of every vector) holds one sub-block, in pieces of `g`
/// elements: `g · l` bytes into vector `k` is element `4 g l + g k` (Q4_K / Q5_K: `g` = 8, a
/// sub-block of 32 per qword; Q6_K: `g` = 4, a group of 16 per i32 lane). Then, per i32 lane `l`
/// (the 16-element sums `bsums[l]`): Q4_K / Q5_K `d_x · bsums[l]` in f32, Q6_K `-32 · bsums[l]` and IQ4_XS
/// `-128 · bsums[l]` in i32 (`six`: the group-of-16 layout, with offset `off`).
///
/// # Safety
/// AVX-512 F/BW; `out` holds `5 · steps` vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn prep_k(acts: &QActs, r: usize, steps: usize, out: *mut __m512i, six: bool, off: i32) {
    let q = acts.row_qs(r).as_ptr();
    let (d, bs) = (acts.row_d(r).as_ptr(), acts.bsums.as_ptr().add(r * steps * 16));
    for st in 0..steps {
        let (q, o) = (q.add(256 * st), out.add(5 * st));
        let v = |i: usize| _mm512_loadu_si512(q.add(64 * i) as *const _);
        let (v0, v1, v2, v3) = (v(0), v(1), v(2), v(3));
        for k in 0..4 {
            // Pieces k, 4 + k, 8 + k, .. of the first 128 bytes, then of the next 128.
            let (lo, hi) = if six {
                let idx = _mm512_add_epi32(
                    _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0),
                    _mm512_set1_epi32(k as i32),
                );
                (_mm512_permutex2var_epi32(v0, idx, v1), _mm512_permutex2var_epi32(v2, idx, v3))
            } else {
                let idx = _mm512_add_epi64(_mm512_setr_epi64(0, 4, 8, 12, 0, 0, 0, 0), _mm512_set1_epi64(k as i64));
                (_mm512_permutex2var_epi64(v0, idx, v1), _mm512_permutex2var_epi64(v2, idx, v3))
            };
            o.add(k).write(_mm512_shuffle_i64x2::<0x44>(lo, hi));
        }
        let sums = _mm512_cvtepi16_epi32(_mm256_loadu_si256(bs.add(16 * st) as *const __m256i));
        o.add(4).write(if six {
            _mm512_mullo_epi32(sums, _mm512_set1_epi32(-off))
        } else {
            _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(*d.add(st))))
        });
    }
}

/// A decoded Q4_K / Q5_K super-block: unsigned levels in the activations' order (`prep_k`), and
/// per i32 lane `l` the float scale `d · sc[l / 2]` and minimum `dmin · mn[l / 2]` of its sub-block
/// (exact: an f16 times a 6-bit integer; Q4_K's odd sub-blocks keep their levels in the high
/// nibble, `16 q`, and have `d · sc / 16`).
#[derive(Clone, Copy)]
struct KMin {
    q: [__m512i; 4],
    sc: __m512,
    mn: __m512,
}

/// Qword indices of the levels' bytes (first 64 bytes `0..8`, next 64 `8..16`) for vector `k` of a
/// Q4_K / Q5_K super-block: sub-blocks `2c` and `2c + 1` are the low and high nibbles of the 32
/// bytes of chunk `c`, and their eighth `k` is qword `k` of the chunk.
#[inline]
#[target_feature(enable = "avx512f")]
fn kmin_idx(k: usize) -> __m512i {
    _mm512_add_epi64(_mm512_setr_epi64(0, 0, 4, 4, 8, 8, 12, 12), _mm512_set1_epi64(k as i64))
}

/// The scales and minimums of the Q4_K / Q5_K super-block at `p`, as `KMin` has them (`odd16`: odd
/// sub-blocks' scales divided by 16).
///
/// # Safety
/// AVX-512F + F16C; `p` is a Q4_K / Q5_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn kmin_scales(p: *const u8, odd16: bool) -> (__m512, __m512) {
    // Lanes 0..8 the scales, 8..16 the minimums; times d (8 lanes) and dmin (8 lanes).
    let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(super::avx2_quant::scales_mins_k4(p)));
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32));
    let by8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut dd = _mm512_permutexvar_ps(by8, _mm512_castps128_ps512(dm));
    if odd16 {
        let k = 1.0 / 16.0;
        dd = _mm512_mul_ps(dd, _mm512_setr_ps(1., k, 1., k, 1., k, 1., k, 1., 1., 1., 1., 1., 1., 1., 1.));
    }
    let v = _mm512_mul_ps(v, dd);
    let sc = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v);
    let mn = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), v);
    (sc, mn)
}

/// `acc + f32(Σ q·x) · (d · sc · d_x) − (dmin · mn) · (d_x · bsums)` lane by lane for a Q4_K / Q5_K
/// super-block against Q8_K activations: the 4 vectors' products add into the same i32 lanes (16
/// products of one sub-block each, below 2^19), converted once.
///
/// # Safety
/// AVX-512 VNNI; `a` has super-block `st`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn dot_kmin(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
    let x = a.x.add(5 * st);
    let mut s = _mm512_setzero_si512();
    for (k, q) in w.q.iter().enumerate() {
        s = _mm512_dpbusd_epi32(s, *q, x.add(k).read());
    }
    let t = _mm512_mul_ps(w.sc, _mm512_set1_ps(*a.d.add(st)));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), t, acc);
    _mm512_fnmadd_ps(w.mn, _mm512_castsi512_ps(x.add(4).read()), acc)
}

impl Format for Q4K {
    const ROW_AT_A_TIME: bool = true;
    const BB: usize = 144;
    const SB: usize = 1;
    const LINES: usize = 5;
    type W = KMin;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, false, 0)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        let (sc, mn) = kmin_scales(b, true);
        // Low nibbles (even sub-blocks) as they are, high nibbles (odd sub-blocks) in place: 16 q.
        let (v, w) = (_mm512_loadu_si512(b.add(16) as *const _), _mm512_loadu_si512(b.add(80) as *const _));
        let (lo, hi) = (0x0f0f_0f0f_0f0f_0f0fu64 as i64, 0xf0f0_f0f0_f0f0_f0f0u64 as i64);
        let m = _mm512_setr_epi64(lo, hi, lo, hi, lo, hi, lo, hi);
        let q = std::array::from_fn(|k| _mm512_and_si512(_mm512_permutex2var_epi64(v, kmin_idx(k), w), m));
        KMin { q, sc, mn }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_kmin(w, a, st, acc)
    }
}

impl Format for Q5K {
    const ROW_AT_A_TIME: bool = true;
    const BB: usize = 176;
    const SB: usize = 1;
    const LINES: usize = 5;
    type W = KMin;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, false, 0)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        let (sc, mn) = kmin_scales(b, false);
        let (v, w) = (_mm512_loadu_si512(b.add(48) as *const _), _mm512_loadu_si512(b.add(112) as *const _));
        let (m4, c16) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(16));
        // Bit j of qh[l] is the fifth bit of element l of sub-block j, and qword j of vector k holds
        // sub-block j's elements 8k..8k+8: qh's qword k, tested against bit j in qword j.
        let bit = |j: i64| 0x0101_0101_0101_0101i64 << j;
        let sel = _mm512_setr_epi64(bit(0), bit(1), bit(2), bit(3), bit(4), bit(5), bit(6), bit(7));
        let q = std::array::from_fn(|k| {
            let z = _mm512_permutex2var_epi64(v, kmin_idx(k), w);
            let z = _mm512_and_si512(_mm512_mask_srli_epi64::<4>(z, 0xaa, z), m4);
            let qh = _mm512_set1_epi64((b.add(16 + 8 * k) as *const i64).read_unaligned());
            _mm512_mask_add_epi8(z, _mm512_test_epi8_mask(qh, sel), z, c16)
        });
        KMin { q, sc, mn }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_kmin(w, a, st, acc)
    }
}

/// A decoded Q6_K super-block: unsigned levels (offset 32 kept) in the activations' order
/// (`prep_k`: i32 lane `l` of every vector is group `l`), and each lane's float scale `d · sc[l]`
/// (exact: an f16 times an i8).
#[derive(Clone, Copy)]
struct K6 {
    q: [__m512i; 4],
    sc: __m512,
}

impl Format for Q6K {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 210;
    const SB: usize = 1;
    const LINES: usize = 5;
    type W = K6;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, true, 32)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> K6 {
        // Half h's 64 bytes of ql: byte i's low nibble is element 128h + i, its high nibble element
        // 128h + 64 + i; so group l's elements 4k..4k+4 are the low (l % 8 < 4) or high nibbles of
        // i32 lane 4 (l % 4) + k of half l / 8. Their bits 4-5 are bits 2j, 2j + 1 (j = l % 8 / 2)
        // of qh's i32 lane 8 (l / 8) + 4 (l % 2) + k, rotated into place.
        let (v0, v1) = (_mm512_loadu_si512(b as *const _), _mm512_loadu_si512(b.add(64) as *const _));
        let qh = _mm512_loadu_si512(b.add(128) as *const _);
        let (m4, m6) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x3f));
        let rot = _mm512_setr_epi32(4, 4, 2, 2, 0, 0, 30, 30, 4, 4, 2, 2, 0, 0, 30, 30);
        let q = std::array::from_fn(|k| {
            let k = k as i32;
            let il = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 16, 20, 24, 28, 16, 20, 24, 28);
            let z = _mm512_permutex2var_epi32(v0, _mm512_add_epi32(il, _mm512_set1_epi32(k)), v1);
            let z = _mm512_mask_srli_epi32::<4>(z, 0xf0f0, z);
            let ih = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 8, 12, 8, 12, 8, 12, 8, 12);
            let h = _mm512_rolv_epi32(_mm512_permutexvar_epi32(_mm512_add_epi32(ih, _mm512_set1_epi32(k)), qh), rot);
            // Bits 0-3 from z, 4-7 from h; then bits 6-7 cleared.
            _mm512_and_si512(_mm512_ternarylogic_epi32::<0xca>(m4, z, h), m6)
        });
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i)));
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128((b.add(208) as *const u16).read_unaligned() as i32));
        K6 { q, sc: _mm512_mul_ps(sc, _mm512_broadcastss_ps(d)) }
    }

    /// `acc + f32(Σ (q − 32)·x) · (d · sc · d_x)` lane by lane: each lane's 16 products of one group,
    /// started from `-32 · bsums` (exact, below 2^17), converted once.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &K6, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_k16(w, a, st, acc)
    }
}

/// `acc + f32(lane sums) · (sc · d_x)` lane by lane for a Q6_K or IQ4_XS super-block: each lane's 16
/// products of one group (unsigned levels times the activations), started from the activations'
/// offset term (`prep_k`: `-32 · bsums` or `-128 · bsums`), converted once.
///
/// # Safety
/// AVX-512 VNNI; `a` has super-block `st`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn dot_k16(w: &K6, a: &Act, st: usize, acc: __m512) -> __m512 {
    let x = a.x.add(5 * st);
    let mut s = x.add(4).read();
    for (k, q) in w.q.iter().enumerate() {
        s = _mm512_dpbusd_epi32(s, *q, x.add(k).read());
    }
    let t = _mm512_mul_ps(w.sc, _mm512_set1_ps(*a.d.add(st)));
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), t, acc)
}

/// The IQ4 levels plus `add` (wrapping), in all four 128-bit lanes (a `vpshufb` table).
#[inline]
#[target_feature(enable = "avx512f")]
fn iq4_table(add: i8) -> __m512i {
    let t: [i8; 16] = std::array::from_fn(|i| IQ4_VALUES[i].wrapping_add(add));
    // SAFETY: 16 readable bytes.
    _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) })
}

impl Format for IQ4NL {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 18;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, Extra::Offset(128))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        // As Q4_0 (low nibbles elements 0..16, high nibbles 16..32), each nibble looked up in the table.
        let (lo, hi) = nibbles4(b.add(2), 18);
        // As `level + 128`, unsigned.
        let t = iq4_table(-128);
        let (w0, w1) = (_mm512_shuffle_epi8(t, lo), _mm512_shuffle_epi8(t, hi));
        Step32 { w0, w1, d: spread4(f16x4(b, 18)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, true, acc)
    }
}

impl Format for IQ4XS {
    const ROW_AT_A_TIME: bool = false;
    const BB: usize = 136;
    const SB: usize = 1;
    const LINES: usize = 5;
    type W = K6;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, true, 128)
    }

    /// Group `l` of 16 (i32 lane `l`) is sub-block `l / 2`'s low (even `l`) or high (odd `l`) nibbles,
    /// and its elements `4k..4k + 4` (vector `k`) the nibbles of i32 word `4 (l / 2) + k` of the 128
    /// bytes of indices, looked up as `level + 128`. Each lane's scale is `d · (ls − 32)` of its
    /// sub-block (exact: an f16 times a 6-bit integer).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> K6 {
        let (v0, v1) = (_mm512_loadu_si512(b.add(8) as *const _), _mm512_loadu_si512(b.add(72) as *const _));
        let (m4, t) = (_mm512_set1_epi8(0x0f), iq4_table(-128));
        let il = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let q = std::array::from_fn(|k| {
            let z = _mm512_permutex2var_epi32(v0, _mm512_add_epi32(il, _mm512_set1_epi32(k as i32)), v1);
            let z = _mm512_and_si512(_mm512_mask_srli_epi32::<4>(z, 0xaaaa, z), m4);
            _mm512_shuffle_epi8(t, z)
        });
        let sc8 = super::quant::iq4xs_scales(std::slice::from_raw_parts(b, 8)) as i64;
        let ls = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc8));
        let sc = _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32)));
        let sc = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), sc);
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const u16).read_unaligned() as i32));
        K6 { q, sc: _mm512_mul_ps(sc, _mm512_broadcastss_ps(d)) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &K6, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_k16(w, a, st, acc)
    }
}

// ---------------------------------------------------------------------------------------------------
// Q8_0 a whole block per lane

/// A decoded `Q8Lanes` step: vector `v`, lane `l` holds bytes `4v..4v + 4` of block `l`'s levels as
/// `w + 128`; `d` block `l`'s scale in lane `l`.
#[derive(Clone, Copy)]
struct StepLanes {
    w: [__m512i; 8],
    d: __m512,
}

/// 16 blocks of 32 bytes (`blk[l]`, block `l`) as 8 vectors whose lane `l` holds dword `v` of block
/// `l`: a 16 x 8 transpose of 32-bit words in 32 operations. (No closures here or in the callers'
/// vector code: a closure does not get its function's target features, and its intrinsics would
/// become calls.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn transpose_blocks(blk: &[__m256i; 16]) -> [__m512i; 8] {
    // z_j: block j in the low half, block j + 8 in the high half; then an 8 x 8 transpose in each half.
    let z0 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[0]), blk[8]);
    let z1 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[1]), blk[9]);
    let z2 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[2]), blk[10]);
    let z3 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[3]), blk[11]);
    let z4 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[4]), blk[12]);
    let z5 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[5]), blk[13]);
    let z6 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[6]), blk[14]);
    let z7 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(blk[7]), blk[15]);
    let t0 = _mm512_unpacklo_epi32(z0, z1);
    let t1 = _mm512_unpackhi_epi32(z0, z1);
    let t2 = _mm512_unpacklo_epi32(z2, z3);
    let t3 = _mm512_unpackhi_epi32(z2, z3);
    let t4 = _mm512_unpacklo_epi32(z4, z5);
    let t5 = _mm512_unpackhi_epi32(z4, z5);
    let t6 = _mm512_unpacklo_epi32(z6, z7);
    let t7 = _mm512_unpackhi_epi32(z6, z7);
    // Per 128-bit lane: u0 = dword 0 (low lanes) / 4 (high lanes) of blocks 0..4 of the half, u4 of blocks 4..8.
    let u0 = _mm512_unpacklo_epi64(t0, t2);
    let u1 = _mm512_unpackhi_epi64(t0, t2);
    let u2 = _mm512_unpacklo_epi64(t1, t3);
    let u3 = _mm512_unpackhi_epi64(t1, t3);
    let u4 = _mm512_unpacklo_epi64(t4, t6);
    let u5 = _mm512_unpackhi_epi64(t4, t6);
    let u6 = _mm512_unpacklo_epi64(t5, t7);
    let u7 = _mm512_unpackhi_epi64(t5, t7);
    let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    [
        _mm512_permutex2var_epi64(u0, lo, u4),
        _mm512_permutex2var_epi64(u1, lo, u5),
        _mm512_permutex2var_epi64(u2, lo, u6),
        _mm512_permutex2var_epi64(u3, lo, u7),
        _mm512_permutex2var_epi64(u0, hi, u4),
        _mm512_permutex2var_epi64(u1, hi, u5),
        _mm512_permutex2var_epi64(u2, hi, u6),
        _mm512_permutex2var_epi64(u3, hi, u7),
    ]
}

/// The first `t <= 16` of 16 blocks' 32 bytes, `stride` bytes apart from `p` (the rest zero), as
/// `transpose_blocks` takes them.
///
/// # Safety
/// AVX-512 F/BW/VL; `t` runs of 32 bytes readable from `p`, `stride` apart.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load_blocks(p: *const u8, stride: usize, t: usize) -> [__m256i; 16] {
    let mut blk = [_mm256_setzero_si256(); 16];
    for (l, v) in blk.iter_mut().enumerate().take(t) {
        *v = _mm256_loadu_si256(p.add(stride * l) as *const __m256i);
    }
    blk
}

/// The mask of the 32-bit lanes below `t <= 16`.
fn lanes_below(t: usize) -> u16 {
    ((1u32 << t) - 1) as u16
}

/// The levels and scales of `t <= 16` Q8_0 blocks stored as they are (34 bytes each) at `b`,
/// transposed to a block per lane (lanes from `t` on zero).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn q8_lanes_from_blocks(b: *const u8, t: usize) -> StepLanes {
    let c = _mm512_set1_epi8(0x80u8 as i8);
    let m = lanes_below(t);
    // The missing blocks' lanes stay zero (their activations are zero too).
    let mut w = transpose_blocks(&load_blocks(b.add(2), 34, t));
    for v in w.iter_mut() {
        *v = _mm512_mask_xor_epi32(*v, m, *v, c);
    }
    // Each scale read as the low half of a 32-bit word (its block's first two levels above it).
    let offs = _mm512_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238, 272, 306, 340, 374, 408, 442, 476, 510);
    let words = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), m, offs, b as *const i32);
    StepLanes { w, d: _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)) }
}

/// Blocks per step of `Q8Lanes`: one per i32 lane.
const LANE_BLOCKS: usize = 16;

/// Whether Q8_0 rows of `cols` weights go through `Q8Lanes`: rows of `LANE_BLOCKS` blocks or more.
/// Shorter ones (the shipped pair's 384) would leave lanes idle in their only step and pay the
/// transposition for few products: [1536, 384] took 34 µs instead of 19 at one row, 60 instead of 50
/// at five (docs/quantization.md, "Q8_0 a block per lane"). A property of the matrix, not of the
/// number of rows, so each output keeps one sequence of operations.
fn q8_lanes(cols: usize) -> bool {
    cols / 32 >= LANE_BLOCKS
}

/// Q8_0 with a whole block per i32 lane, 16 blocks a step: eight `vpdpbusd` finish 16 blocks, and
/// one conversion, scale product and FMA serve all of them, where the 4-block step needs four of
/// each (docs/quantization.md, "Q8_0 a block per lane"). The blocks are transposed as they are read
/// (`q8_lanes_from_blocks`), the activations once when they are prepared.
struct Q8Lanes;

impl Format for Q8Lanes {
    const PREFETCH_L2: bool = true;
    const ROW_AT_A_TIME: bool = true;
    const BB: usize = 34;
    const SB: usize = LANE_BLOCKS;
    const LINES: usize = 10;
    type W = StepLanes;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        let nb = acts.blocks();
        let (q, d) = (acts.row_qs(r).as_ptr(), acts.row_d(r).as_ptr());
        let ones = _mm512_set1_epi8(1);
        for st in 0..steps {
            let t = (nb - LANE_BLOCKS * st).min(LANE_BLOCKS);
            let (q, d) = (q.add(32 * LANE_BLOCKS * st), d.add(LANE_BLOCKS * st));
            let x = transpose_blocks(&load_blocks(q as *const u8, 32, t));
            let o = out.add(st * Self::LINES);
            let mut sum = _mm512_setzero_si512();
            for (v, xv) in x.iter().enumerate() {
                o.add(v).write(*xv);
                sum = _mm512_dpbusd_epi32(sum, ones, *xv);
            }
            // -128 · Σ x of each block: the levels are multiplied as w + 128.
            o.add(8).write(_mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
            let m = lanes_below(t);
            o.add(9).write(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, d)));
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> StepLanes {
        q8_lanes_from_blocks(b, LANE_BLOCKS)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode_tail(b: *const u8, t: usize) -> StepLanes {
        q8_lanes_from_blocks(b, t)
    }

    /// Per activation row: its lanes' sums started from `-128 · Σ x`, eight `vpdpbusd`, then one
    /// conversion, scale product (`d_w · d_x`) and FMA. The rows' eight-step chains are interleaved so
    /// that independent ones follow each other (one row's chain after another: 1.2x slower at five
    /// rows). No closures (see `transpose_blocks`).
    #[inline(always)]
    unsafe fn dots<const C: usize>(w: &StepLanes, x: &[Act; C], st: usize, acc: &mut [__m512; C]) {
        let mut xs = [std::ptr::null::<__m512i>(); C];
        let mut s = [_mm512_setzero_si512(); C];
        for c in 0..C {
            xs[c] = x[c].x.add(st * Self::LINES);
            s[c] = xs[c].add(8).read();
        }
        for (v, wv) in w.w.iter().enumerate() {
            for c in 0..C {
                s[c] = _mm512_dpbusd_epi32(s[c], *wv, xs[c].add(v).read());
            }
        }
        for c in 0..C {
            let dd = _mm512_mul_ps(w.d, _mm512_castsi512_ps(xs[c].add(9).read()));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[c]), dd, acc[c]);
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &StepLanes, a: &Act, st: usize, acc: __m512) -> __m512 {
        let mut one = [acc];
        Self::dots(w, &[*a], st, &mut one);
        one[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::quantize_acts;
    use crate::kernels::tests::Rng;

    /// `Q8Lanes` decodes `t` blocks (a whole step, or a row's last partial one) to lane `l` of vector
    /// `v` = levels `4v..4v + 4` of block `l` as `w + 128`, scale `l` in lane `l`, and zeros in the
    /// lanes past `t`; its prepared activations hold the same arrangement, `-128 · Σ x` per block and
    /// the block scales.
    #[test]
    fn q8_lanes_transpose_blocks() {
        if !supported() {
            eprintln!("no AVX-512 VNNI on this CPU: Q8Lanes not tested");
            return;
        }
        let mut rng = Rng(41);
        for t in 1..=LANE_BLOCKS {
            let mut step: Vec<u8> = (0..34 * t).map(|_| rng.next() as u8).collect();
            for b in step.chunks_exact_mut(34) {
                b[..2].copy_from_slice(&half::f16::from_f32(rng.f32()).to_bits().to_le_bytes());
            }
            // SAFETY: `34 t` readable bytes; the CPU has the features (checked above).
            let got = unsafe {
                if t == LANE_BLOCKS {
                    Q8Lanes::decode(step.as_ptr())
                } else {
                    Q8Lanes::decode_tail(step.as_ptr(), t)
                }
            };
            let (mut w, mut d) = ([[0u8; 64]; 8], [0f32; 16]);
            // SAFETY: AVX-512F (checked above); each store writes 64 bytes inside its array.
            unsafe {
                for (o, v) in w.iter_mut().zip(&got.w) {
                    _mm512_storeu_si512(o.as_mut_ptr() as *mut _, *v);
                }
                _mm512_storeu_ps(d.as_mut_ptr(), got.d);
            }
            for l in 0..LANE_BLOCKS {
                let want_d =
                    if l < t { half::f16::from_le_bytes([step[34 * l], step[34 * l + 1]]).to_f32() } else { 0.0 };
                assert_eq!(d[l].to_bits(), want_d.to_bits(), "{t} blocks: scale of lane {l}");
                for (v, wv) in w.iter().enumerate() {
                    for j in 0..4 {
                        let want = if l < t { step[34 * l + 2 + 4 * v + j] ^ 0x80 } else { 0 };
                        assert_eq!(wv[4 * l + j], want, "{t} blocks: lane {l}, vector {v}, byte {j}");
                    }
                }
            }
        }
        for blocks in [16, 22, 48] {
            let cols = 32 * blocks;
            let acts = quantize_acts(QType::Q8_0, &rng.vec(2 * cols, 2.0), 2, cols);
            let steps = blocks.div_ceil(LANE_BLOCKS);
            let mut buf = Vec::new();
            // SAFETY: the CPU has the features (checked above).
            let per_row = unsafe { prep_rows::<Q8Lanes>(&acts, &mut buf) };
            assert_eq!(per_row, steps * Q8Lanes::LINES);
            for r in 0..2 {
                let (q, dx) = (acts.row_qs(r), acts.row_d(r));
                for st in 0..steps {
                    // SAFETY: a 512-bit vector is 64 bytes.
                    let lines: Vec<[i32; 16]> = (0..Q8Lanes::LINES)
                        .map(|i| unsafe {
                            std::mem::transmute::<__m512i, [i32; 16]>(buf[r * per_row + st * Q8Lanes::LINES + i])
                        })
                        .collect();
                    for l in 0..LANE_BLOCKS {
                        let blk = LANE_BLOCKS * st + l;
                        let x: &[i8] = if blk < blocks { &q[32 * blk..32 * blk + 32] } else { &[0; 32] };
                        for (v, line) in lines[..8].iter().enumerate() {
                            let bytes = line[l].to_le_bytes().map(|b| b as i8);
                            assert_eq!(
                                bytes,
                                x[4 * v..4 * v + 4],
                                "{blocks} blocks, row {r}, step {st}, lane {l}, vector {v}"
                            );
                        }
                        let sum: i32 = x.iter().map(|&v| v as i32).sum();
                        assert_eq!(lines[8][l], -128 * sum, "{blocks} blocks, row {r}, step {st}, lane {l}: offset");
                        let want_d = if blk < blocks { dx[blk] } else { 0.0 };
                        assert_eq!(f32::from_bits(lines[9][l] as u32).to_bits(), want_d.to_bits(), "activation scale");
                    }
                }
            }
        }
    }

    /// `decode_vbmi` decodes every step, whole or a row's last partial one, to the very vectors `Q8_0`
    /// does, so products over it have the same bits at every row count.
    #[test]
    fn q8_0_vbmi_is_q8_0() {
        if !supported() || !vbmi() {
            eprintln!("no AVX-512 VNNI + VBMI on this CPU: decode_vbmi not tested");
            return;
        }
        let mut rng = Rng(31);
        for (rows, blocks) in [(1, 1), (5, 3), (9, 4), (13, 7), (16, 48)] {
            let cols = 32 * blocks;
            let mut data: Vec<u8> = (0..rows * 34 * blocks).map(|_| rng.next() as u8).collect();
            for b in data.chunks_exact_mut(34) {
                b[..2].copy_from_slice(&half::f16::from_f32(rng.f32() * 0.05).to_bits().to_le_bytes());
            }
            let w = QMatRef::new(QType::Q8_0, rows, cols, &data);
            for m in [1, 2, 5, 8, 11] {
                let acts = quantize_acts(QType::Q8_0, &rng.vec(m * cols, 2.0), m, cols);
                let product = |vbmi: bool| {
                    let mut got = vec![f32::NAN; m * rows];
                    let mut outs: Vec<&mut [f32]> = got.chunks_mut(rows).collect();
                    with_prepared(&acts, QType::Q8_0, |p| unsafe {
                        // SAFETY: the CPU has the features (checked above); shapes match.
                        if vbmi {
                            run::<Q8_0<true>>(p, w, &mut outs, Walk::Tiles)
                        } else {
                            run::<Q8_0<false>>(p, w, &mut outs, Walk::Tiles)
                        }
                    });
                    got
                };
                let (a, b) = (product(false), product(true));
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "rows {rows}, blocks {blocks}, m {m}: the VBMI decode changed the product"
                );
            }
        }
        // Decoded steps directly, whole ones of random bytes.
        for _ in 0..200 {
            let step: Vec<u8> = (0..4 * 34).map(|_| rng.next() as u8).collect();
            // SAFETY: 136 readable bytes; the CPU has the features.
            let (a, b) = unsafe { (Q8_0::<false>::decode(step.as_ptr()), Q8_0::<true>::decode(step.as_ptr())) };
            // SAFETY: AVX-512F (checked above); each store writes 16 lanes inside `v`.
            let bits = |s: &Step32| unsafe {
                let mut v = [0u32; 48];
                _mm512_storeu_si512(v.as_mut_ptr() as *mut _, s.w0);
                _mm512_storeu_si512(v.as_mut_ptr().add(16) as *mut _, s.w1);
                _mm512_storeu_ps(v.as_mut_ptr().add(32) as *mut f32, s.d);
                v
            };
            assert_eq!(bits(&a), bits(&b), "decoded step differs");
        }
    }
}
