//! AVX-512 VNNI kernels for block-quantized weights (`quant`): integer products with `vpdpbusd`
//! (64 `u8 × s8` products summed four by four into 16 i32 lanes per instruction), then one scaled
//! float step per 4 blocks of 32 (per super-block for the k-quants).
//!
//! `vpdpbusd` wants one unsigned operand. The k-quants Q4_K / Q5_K have unsigned levels and multiply
//! them directly with the signed activations. The others (Q8_0, Q4_0, Q5_0, Q5_1, Q6_K) multiply their
//! signed levels (offset removed) with the activations moved to `x + 128` (`u8`), and start each lane
//! from `-128 · Σ w` over its weights, computed once per decoded weight vector and shared by every
//! activation row: the lane then holds exactly `Σ x · w`.
//!
//! Layouts. 32-element formats: a step is 4 blocks, two vectors per operand; vector 0 holds elements
//! 0..16 of the 4 blocks, vector 1 elements 16..32 (a 128-bit lane per block), so that both
//! `vpdpbusd` of a step add into the same lanes and lane `4b..4b+4` sums 8 products of block `b`.
//! One conversion, one scale product and one FMA then serve 4 blocks. The activations are laid out
//! so once per call (`Format::prep`: `x + 128` in that order, with each block's scale spread over its
//! 4 lanes). k-quants: a step is one super-block, four vectors of 64 elements in natural order;
//! each i32 lane's sum (4 products, below 2^15) is multiplied by its sub-block scale with
//! `vpdpwssd` (the scale vector's high i16 halves are zero), so the whole super-block stays in i32
//! lanes and is converted once.
//!
//! Tiles: `R` weight rows × `C` activation rows. Each step's weights are decoded once per tile and
//! used for every activation row of the group; the next tile's bytes are prefetched along the way.
//!
//! Batch invariance: an output element is one 16-lane f32 accumulator updated once per step with the
//! same operations whatever the tile, the group, or the thread chunk, then reduced by a fixed tree:
//! row `i` of an `m`-row product equals that row alone. The lane sums are exact integers (below 2^24
//! in magnitude), so only the order of the float additions differs from the reference
//! `quant::dot_row`.

use super::quant::{QActs, QMatRef, QType};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether the CPU runs these kernels: AVX-512 F/BW/VL with VNNI (and the AVX2/FMA/F16C they lean
/// on). Detected once.
pub fn supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| super::avx512::supported() && is_x86_feature_detected!("avx512vnni"))
}

/// `out[i][j] = Σ_k acts[i, k] · w[j, k]`; `out[i]` has `w.rows` elements.
pub fn matmul(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    assert!(supported(), "AVX-512 VNNI quantized kernels on a CPU without them");
    assert!(acts.kind == w.qtype.act() && acts.cols == w.cols, "activations quantized for another format or width");
    assert_eq!(out.len(), acts.rows, "one output row per activation row");
    assert!(out.iter().all(|o| o.len() == w.rows), "output rows of the chunk's width");
    // SAFETY: the CPU has the features (asserted); shapes checked above, so every block and activation
    // read stays inside `w.data` and `acts`.
    unsafe {
        match w.qtype {
            QType::Q8_0 => run::<Q8_0>(acts, w, out),
            QType::Q4_0 => run::<Q4_0>(acts, w, out),
            QType::Q5_0 => run::<Q5_0>(acts, w, out),
            QType::Q5_1 => run::<Q5_1>(acts, w, out),
            QType::Q4_K => run::<Q4K>(acts, w, out),
            QType::Q5_K => run::<Q5K>(acts, w, out),
            QType::Q6_K => run::<Q6K>(acts, w, out),
        }
    }
}

/// One activation row as the kernels read it: its prepared vectors (`Format::prep`, `LINES` per step),
/// and (k-quants) its super-block scales and 16-element sums.
#[derive(Clone, Copy)]
struct Act {
    x: *const __m512i,
    d: *const f32,
    bs: *const i16,
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

    /// `acc` plus step `st` of the row `w` came from times step `st` of `a`.
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; `a` has step `st`.
    unsafe fn dot(w: &Self::W, a: &Act, st: usize, acc: __m512) -> __m512;
}

/// The largest activation group: 8 rows take 16 accumulators at 2 weight rows per tile.
const GROUP_MAX: usize = 8;

/// The m activation rows in groups of at most `GROUP_MAX` (sizes as equal as they come).
fn groups(m: usize) -> Vec<(usize, usize)> {
    let n = m.div_ceil(GROUP_MAX);
    let (base, extra) = (m / n, m % n);
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for g in 0..n {
        let c = base + usize::from(g < extra);
        out.push((at, c));
        at += c;
    }
    out
}

/// Weight rows per tile for groups of up to `c` activation rows (accumulators: at most 16).
fn tile_rows(c: usize) -> usize {
    if c <= 6 {
        4
    } else {
        2
    }
}

/// Walk the product: weight-row tiles outside, activation groups inside, so each tile's rows are read
/// from memory once and from L1 by the later groups.
///
/// # Safety
/// AVX-512 VNNI CPU; shapes as checked by `matmul`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run<F: Format>(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    let (m, n) = (acts.rows, w.rows);
    let be = w.qtype.block_elems();
    let nb = w.cols / be;
    let (full, tail) = (nb / F::SB, nb % F::SB);
    let steps = nb.div_ceil(F::SB);
    let rb = w.row_bytes();
    let per_row = steps * F::LINES;
    let mut buf: Vec<__m512i> = vec![_mm512_setzero_si512(); m * per_row];
    for i in 0..m {
        F::prep(acts, i, steps, buf.as_mut_ptr().add(i * per_row));
    }
    let act = |i: usize| Act {
        x: buf.as_ptr().add(i * per_row),
        d: acts.d.as_ptr().add(i * nb),
        bs: if acts.bsums.is_empty() { std::ptr::null() } else { acts.bsums.as_ptr().add(i * nb * 16) },
    };
    let acts_v: Vec<Act> = (0..m).map(act).collect();
    let groups = groups(m);
    let rmax = tile_rows(groups[0].1);
    let shape = Shape { rb, full, tail };
    let mut j = 0;
    while j < n {
        let r = if n - j >= rmax { rmax } else { 1 };
        let wp = w.data.as_ptr().add(j * rb);
        for (gi, &(g0, c)) in groups.iter().enumerate() {
            // The first group's pass prefetches the next tile (the same number of rows, or what is left).
            let pf = if gi == 0 { r.min(n - j - r) * rb } else { 0 };
            let x = &acts_v[g0..g0 + c];
            macro_rules! shape {
                ($r:literal, $c:literal) => {{
                    let res = tile::<F, $r, $c>(wp, &shape, pf, x.try_into().expect("group size"));
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
    pf: usize,
    x: &[Act; C],
) -> [[f32; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let next = w.wrapping_add(R * s.rb);
    let (mut pf_at, mut pf_end, pf_step) = (0, 0, pf.div_ceil(s.full.max(1)));
    let step_bytes = F::SB * F::BB;
    for st in 0..s.full {
        // This step's share of the next tile, a line at a time.
        pf_end = (pf_end + pf_step).min(pf);
        while pf_at < pf_end {
            // SAFETY: a prefetch never faults and has no architectural effect; the address is in the
            // chunk anyway.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(pf_at) as *const i8);
            pf_at += 64;
        }
        let mut wd: [F::W; R] = std::mem::zeroed();
        for (r, d) in wd.iter_mut().enumerate() {
            *d = F::decode(w.add(r * s.rb + st * step_bytes));
        }
        for c in 0..C {
            for r in 0..R {
                acc[r][c] = F::dot(&wd[r], &x[c], st, acc[r][c]);
            }
        }
    }
    if s.tail > 0 {
        // The last blocks, copied into a zeroed step: zero scales, so the missing blocks add zeros
        // (their prepared activations are zero too).
        let st = s.full;
        let mut wd: [F::W; R] = std::mem::zeroed();
        for (r, d) in wd.iter_mut().enumerate() {
            let mut tmp = [0u8; 4 * 34];
            std::ptr::copy_nonoverlapping(w.add(r * s.rb + st * step_bytes), tmp.as_mut_ptr(), s.tail * F::BB);
            *d = F::decode(tmp.as_ptr());
        }
        for c in 0..C {
            for r in 0..R {
                acc[r][c] = F::dot(&wd[r], &x[c], st, acc[r][c]);
            }
        }
    }
    let mut res = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            res[r][c] = hsum(acc[r][c]);
        }
    }
    res
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

/// A decoded step of a 32-element format: signed levels (elements 0..16, then 16..32, of the 4
/// blocks), `-128 · Σ w` per lane, the block scales over their lanes, and (Q5_1) the minimums in the
/// first lane of each block.
#[derive(Clone, Copy)]
struct Step32 {
    w0: __m512i,
    w1: __m512i,
    nc: __m512i,
    d: __m512,
    m: __m512,
}

/// `-128 · Σ w` over each lane's 8 weights.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn neg_corr(w0: __m512i, w1: __m512i) -> __m512i {
    let c = _mm512_set1_epi8(0x80u8 as i8);
    let s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, w0), c, w1);
    _mm512_sub_epi32(_mm512_setzero_si512(), s)
}

/// `x + 128` for the step's 4 blocks at `q` in the kernels' order (elements 0..16 of each block, then
/// 16..32), and the block scales spread over their lanes; `n` blocks present, the rest zero.
///
/// # Safety
/// AVX-512 F/BW; `q` readable for `32 n` bytes, `d` for `n` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn prep32_step(q: *const i8, d: *const f32, n: usize, out: *mut __m512i) {
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
    let c = _mm512_set1_epi8(0x80u8 as i8);
    out.write(_mm512_xor_si512(_mm512_shuffle_i64x2::<0x88>(a, b), c));
    out.add(1).write(_mm512_xor_si512(_mm512_shuffle_i64x2::<0xdd>(a, b), c));
    out.add(2).write(_mm512_castps_si512(spread4(dv)));
}

/// Q8_0 / Q4_0 / Q5_0 activations: 3 vectors per step.
///
/// # Safety
/// As `Format::prep`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn prep32(acts: &QActs, r: usize, steps: usize, out: *mut __m512i, lines: usize) {
    let nb = acts.blocks();
    let (q, d) = (acts.row_qs(r).as_ptr(), acts.row_d(r).as_ptr());
    for st in 0..steps {
        let n = (nb - 4 * st).min(4);
        let o = out.add(st * lines);
        prep32_step(q.add(128 * st), d.add(4 * st), n, o);
        if lines == 4 {
            let s = acts.s.as_ptr().add(r * nb + 4 * st);
            let mut st4 = [0f32; 4];
            std::ptr::copy_nonoverlapping(s, st4.as_mut_ptr(), n);
            o.add(3).write(_mm512_castps_si512(first_of4(_mm_loadu_ps(st4.as_ptr()))));
        }
    }
}

/// `acc + f32(Σ w·x) · (d_w · d_x)` over the step's 4 blocks (lane by lane).
///
/// # Safety
/// AVX-512 VNNI; `a` has step `st` (3 or 4 vectors per step, `lines`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot32(w: &Step32, a: &Act, st: usize, lines: usize, acc: __m512) -> __m512 {
    let x = a.x.add(st * lines);
    let s = _mm512_dpbusd_epi32(w.nc, x.read(), w.w0);
    let s = _mm512_dpbusd_epi32(s, x.add(1).read(), w.w1);
    let dd = _mm512_mul_ps(w.d, _mm512_castsi512_ps(x.add(2).read()));
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc)
}

struct Q8_0;
struct Q4_0;
struct Q5_0;
struct Q5_1;
struct Q4K;
struct Q5K;
struct Q6K;

impl Format for Q8_0 {
    const BB: usize = 34;
    const SB: usize = 4;
    const LINES: usize = 3;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, 3)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        let w0 = lanes16(b.add(2), 34);
        let w1 = lanes16(b.add(18), 34);
        Step32 { w0, w1, nc: neg_corr(w0, w1), d: spread4(f16x4(b, 34)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, 3, acc)
    }
}

impl Format for Q4_0 {
    const BB: usize = 18;
    const SB: usize = 4;
    const LINES: usize = 3;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, 3)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        // Low nibbles are elements 0..16, high nibbles 16..32.
        let q = lanes16(b.add(2), 18);
        let (m4, c8) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(8));
        let w0 = _mm512_sub_epi8(_mm512_and_si512(q, m4), c8);
        let w1 = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(q), m4), c8);
        Step32 { w0, w1, nc: neg_corr(w0, w1), d: spread4(f16x4(b, 18)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, 3, acc)
    }
}

/// The 5-bit levels of 4 Q5_0 / Q5_1 blocks (`qs` 16 bytes at `b + qs_at`, `qh` at `b + qh_at`), as
/// unsigned levels minus `off` (0 or 16).
///
/// # Safety
/// AVX-512 F/BW; the 4 blocks readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn levels5(b: *const u8, bb: usize, qs_at: usize, qh_at: usize, off: bool) -> (__m512i, __m512i) {
    let q = lanes16(b.add(qs_at), bb);
    let m4 = _mm512_set1_epi8(0x0f);
    let (lo, hi) = (_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4));
    let (k0, k1) = qh_masks(b.add(qh_at), bb);
    let c16 = _mm512_set1_epi8(16);
    if off {
        // level - 16: subtract 16 where the fifth bit is clear.
        (_mm512_mask_sub_epi8(lo, !k0, lo, c16), _mm512_mask_sub_epi8(hi, !k1, hi, c16))
    } else {
        (_mm512_mask_add_epi8(lo, k0, lo, c16), _mm512_mask_add_epi8(hi, k1, hi, c16))
    }
}

impl Format for Q5_0 {
    const BB: usize = 22;
    const SB: usize = 4;
    const LINES: usize = 3;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, 3)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        let (w0, w1) = levels5(b, 22, 6, 2, true);
        Step32 { w0, w1, nc: neg_corr(w0, w1), d: spread4(f16x4(b, 22)), m: _mm512_setzero_ps() }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot32(w, a, st, 3, acc)
    }
}

impl Format for Q5_1 {
    const BB: usize = 24;
    const SB: usize = 4;
    const LINES: usize = 4;
    type W = Step32;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep32(acts, r, steps, out, 4)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Step32 {
        let (w0, w1) = levels5(b, 24, 8, 4, false);
        Step32 { w0, w1, nc: neg_corr(w0, w1), d: spread4(f16x4(b, 24)), m: first_of4(f16x4(b.add(2), 24)) }
    }

    /// As `dot32`, then `+ m · s_x` in the first lane of each block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &Step32, a: &Act, st: usize, acc: __m512) -> __m512 {
        let acc = dot32(w, a, st, 4, acc);
        _mm512_fmadd_ps(w.m, _mm512_castsi512_ps(a.x.add(st * 4 + 3).read()), acc)
    }
}

// ---------------------------------------------------------------------------------------------------
// k-quants

/// The super-block's 256 activation levels (natural order), `+ 128` when `offset`.
///
/// # Safety
/// AVX-512 F/BW; `out` holds `4 · steps` vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn prep_k(acts: &QActs, r: usize, steps: usize, out: *mut __m512i, offset: bool) {
    let q = acts.row_qs(r).as_ptr();
    let c = if offset { _mm512_set1_epi8(0x80u8 as i8) } else { _mm512_setzero_si512() };
    for i in 0..4 * steps {
        out.add(i).write(_mm512_xor_si512(_mm512_loadu_si512(q.add(64 * i) as *const _), c));
    }
}

/// Lane `l` of vector `t` takes scale `2t + l / 8` (Q4_K / Q5_K sub-blocks of 32).
static SC_K4: [[i32; 16]; 4] = {
    let mut t = [[0i32; 16]; 4];
    let mut v = 0;
    while v < 4 {
        let mut l = 0;
        while l < 16 {
            t[v][l] = (2 * v + l / 8) as i32;
            l += 1;
        }
        v += 1;
    }
    t
};

/// Lane `l` of vector `t` takes scale `4t + l / 4` (Q6_K groups of 16).
static SC_K6: [[i32; 16]; 4] = {
    let mut t = [[0i32; 16]; 4];
    let mut v = 0;
    while v < 4 {
        let mut l = 0;
        while l < 16 {
            t[v][l] = (4 * v + l / 4) as i32;
            l += 1;
        }
        v += 1;
    }
    t
};

/// A decoded Q4_K / Q5_K super-block: unsigned levels (4 vectors of 64, natural order), each lane's
/// sub-block scale (i32 with a zero high half), the minimums as i16 pairs `mn[j], mn[j]` (against the
/// activation's two 16-sums of sub-block `j`), and the f16 scale and minimum scale.
#[derive(Clone, Copy)]
struct KMin {
    q: [__m512i; 4],
    sc: [__m512i; 4],
    mn: __m256i,
    d: __m512,
    dmin: __m512,
}

/// Everything of a Q4_K / Q5_K super-block at `p` but its levels.
///
/// # Safety
/// AVX-512F + F16C; `p` is a Q4_K / Q5_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn kmin_scales(p: *const u8, w: &mut KMin) {
    let word = |at: usize| (p.add(at) as *const u32).read_unaligned();
    let (sc8, mn8) = super::quant::scales_mins_k4(word(4), word(8), word(12));
    let (sc8, mn8) = (sc8 as i64, mn8 as i64);
    let sc32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc8));
    for (s, idx) in w.sc.iter_mut().zip(&SC_K4) {
        *s = _mm512_permutexvar_epi32(_mm512_loadu_si512(idx.as_ptr() as *const _), sc32);
    }
    let mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn8));
    w.mn = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
    w.d = _mm512_broadcastss_ps(dm);
    w.dmin = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
}

/// `acc + f32(Σ_j sc_j Σ q·x) · (d · d_x) − f32(Σ_j mn_j · bsums_j) · (dmin · d_x)` for a Q4_K / Q5_K
/// super-block against Q8_K activations.
///
/// # Safety
/// AVX-512 VNNI; `a` has super-block `st`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn dot_kmin(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
    let x = a.x.add(4 * st);
    let mut s = _mm512_setzero_si512();
    for t in 0..4 {
        let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q[t], x.add(t).read());
        s = _mm512_dpwssd_epi32(s, p, w.sc[t]);
    }
    let dx = _mm512_set1_ps(*a.d.add(st));
    let ms = _mm256_madd_epi16(w.mn, _mm256_loadu_si256(a.bs.add(16 * st) as *const __m256i));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w.d, dx), acc);
    let msf = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(ms));
    _mm512_fnmadd_ps(msf, _mm512_mul_ps(w.dmin, dx), acc)
}

impl Format for Q4K {
    const BB: usize = 144;
    const SB: usize = 1;
    const LINES: usize = 4;
    type W = KMin;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, false)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        let mut w: KMin = std::mem::zeroed();
        kmin_scales(b, &mut w);
        let m4 = _mm512_set1_epi8(0x0f);
        for c in 0..4 {
            // Low nibbles of the 32 bytes are elements 64c..64c+32, high nibbles the next 32.
            let v = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            w.q[c] = _mm512_and_si512(z, m4);
        }
        w
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_kmin(w, a, st, acc)
    }
}

impl Format for Q5K {
    const BB: usize = 176;
    const SB: usize = 1;
    const LINES: usize = 4;
    type W = KMin;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, false)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        let mut w: KMin = std::mem::zeroed();
        kmin_scales(b, &mut w);
        let (m4, b4) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x10));
        // Bits 2c and 2c+1 of qh[l] are the fifth bits of elements 64c + l and 64c + 32 + l: with
        // `h = [qh, qh >> 1]`, chunk c's fifth bits are bit 2c of h's bytes, moved to bit 4 (16-bit
        // shifts; the mask keeps each byte's own bit).
        let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
        let h = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<1>(qh));
        let hs = [_mm512_slli_epi16::<4>(h), _mm512_slli_epi16::<2>(h), h, _mm512_srli_epi16::<2>(h)];
        for (c, (q, hc)) in w.q.iter_mut().zip(hs).enumerate() {
            let v = _mm256_loadu_si256(b.add(48 + 32 * c) as *const __m256i);
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            *q = _mm512_or_si512(_mm512_and_si512(z, m4), _mm512_and_si512(hc, b4));
        }
        w
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, st: usize, acc: __m512) -> __m512 {
        dot_kmin(w, a, st, acc)
    }
}

/// A decoded Q6_K super-block: signed levels (offset 32 removed; 4 vectors of 64, natural order),
/// `-128 · Σ w` per lane, each lane's group scale (i32 with a zero high half), and the f16 scale.
#[derive(Clone, Copy)]
struct K6 {
    w: [__m512i; 4],
    nc: [__m512i; 4],
    sc: [__m512i; 4],
    d: __m512,
}

impl Format for Q6K {
    const BB: usize = 210;
    const SB: usize = 1;
    const LINES: usize = 4;
    type W = K6;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn prep(acts: &QActs, r: usize, steps: usize, out: *mut __m512i) {
        prep_k(acts, r, steps, out, true)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> K6 {
        let mut w: K6 = std::mem::zeroed();
        let (m4, m2, c32) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30), _mm512_set1_epi8(32));
        for h in 0..2 {
            // Byte l of ql's 64: low nibble element 128h + l, high nibble 128h + 64 + l. qh[l] bits
            // 2k, 2k+1 are bits 4, 5 of element 128h + l + 32k: with `q = [qh, qh >> 2]`, bits 0-1 of
            // q's bytes for the first vector and bits 4-5 for the second.
            let ql = _mm512_loadu_si512(b.add(64 * h) as *const _);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
            let a = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16::<4>(q), m2));
            let bb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), _mm512_and_si512(q, m2));
            w.w[2 * h] = _mm512_sub_epi8(a, c32);
            w.w[2 * h + 1] = _mm512_sub_epi8(bb, c32);
        }
        let c = _mm512_set1_epi8(0x80u8 as i8);
        for t in 0..4 {
            let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, w.w[t]);
            w.nc[t] = _mm512_sub_epi32(_mm512_setzero_si512(), s);
        }
        let sc32 = _mm512_and_si512(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i)),
            _mm512_set1_epi32(0xffff),
        );
        for (s, idx) in w.sc.iter_mut().zip(&SC_K6) {
            *s = _mm512_permutexvar_epi32(_mm512_loadu_si512(idx.as_ptr() as *const _), sc32);
        }
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128((b.add(208) as *const u16).read_unaligned() as i32));
        w.d = _mm512_broadcastss_ps(d);
        w
    }

    /// `acc + f32(Σ_g sc_g Σ (q − 32)·x) · (d · d_x)`, lane by lane: each lane's 4-product sum (below
    /// 2^14) times its group scale, over the 4 vectors (below 2^23).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dot(w: &K6, a: &Act, st: usize, acc: __m512) -> __m512 {
        let x = a.x.add(4 * st);
        let mut s = _mm512_setzero_si512();
        for t in 0..4 {
            let p = _mm512_dpbusd_epi32(w.nc[t], x.add(t).read(), w.w[t]);
            s = _mm512_dpwssd_epi32(s, p, w.sc[t]);
        }
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w.d, _mm512_set1_ps(*a.d.add(st))), acc)
    }
}
