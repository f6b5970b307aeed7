//! AVX-512 (F, BW, VL with FMA and F16C) kernels, 16 f32 lanes.
//!
//! Matmul register tiles hold up to 24 zmm accumulators (`plan`), each with 16 partial sums of one
//! output element, reduced once after the K loop. Weights are widened to f32 in registers: bf16 by a
//! shift / mask (see `pack_bf16_eo`), f16 with `vcvtph2ps`. Activations come as zero-padded panels
//! (`tiling::pack_panels`); the K tail of the weights uses masked loads (masked-off lanes are zero
//! and never fault), so any `cols` works and nothing past a row is read. Weight rows may be only
//! 2-byte aligned: every load is unaligned.

use super::tiling::{pack_panels, Plan, Tile, L1_BUDGET};
use super::x86::{drive, Accs, Prefetch};
use super::{DType, MatRef, Split};
use std::arch::x86_64::*;
use std::ops::Range;

pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Tile shape for `m` activation rows: `(weight rows, x rows per group)`, at most 24 accumulators,
/// leaving registers for the weight and x vectors. Up to m = 12 that is a single group, i.e. one pass
/// over the weights with all the compute riding on the memory stream (see `for_tiles`). Beyond, a
/// single group would need too many accumulators or re-read too much x per weight byte, so larger m
/// goes in groups of 8 with K chunks. `wide` kernels (bf16 widened to two f32 vectors per load) need
/// twice the registers per weight row.
pub(super) fn plan(m: usize, k: usize, wide: bool, step: usize, x_bytes: usize, w_bytes: usize) -> Plan {
    let (rows, group) = match (m, wide) {
        (0..=4, _) => (4, m.max(1)),
        // 5-8 rows whose x panel overflows L1: two groups sharing each K chunk of the weights beat one
        // K-chunked group (E4B's hidden size of 2560: 1.1x one row instead of 1.3x; E2B's down projection,
        // K = 6144, at 8 rows with AVX512_BF16: 1.4-1.5x one row instead of 1.7x).
        (5..=8, false) if m * k * x_bytes > L1_BUDGET => (4, 4),
        (5..=8, false) => (3, m),
        (5..=12, _) => (2, m),
        (_, false) => (3, 8),
        (_, true) => (2, 8),
    };
    Plan::new(m, k, rows, group, step, x_bytes, w_bytes)
}

/// A tile's accumulators, parked in memory between K chunks (row-major `rows × group`, ≤ 24).
pub(super) type Acc = [__m512; 24];

thread_local! {
    static ACCS: std::cell::Cell<Vec<Acc>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `n` accumulator sets (`x86::Accs`: the thread's last ones, reused).
pub(super) fn acc_storage(n: usize) -> Accs<Acc> {
    // SAFETY: __m512 is plain data; any bit pattern (here zeros) is a valid value.
    Accs::take(&ACCS, n, unsafe { std::mem::zeroed::<Acc>() })
}

/// Every tile shape `plan` produces (tails use 1 weight row with the same x rows).
macro_rules! shapes {
    ($mac:ident!($($args:tt)*)) => {
        $mac!($($args)* [
            (4, 1), (4, 2), (4, 3), (4, 4),
            (3, 1), (3, 2), (3, 3), (3, 4), (3, 5), (3, 6), (3, 7), (3, 8),
            (2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (2, 8), (2, 9), (2, 10), (2, 11), (2, 12),
            (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9), (1, 10), (1, 11), (1, 12),
        ])
    };
}
pub(super) use shapes;

pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AVX-512 kernels on a CPU without AVX-512");
    let k = w.cols;
    match w.dtype {
        DType::BF16 => {
            let plan = plan(m, k, true, 32, 4, 2);
            // SAFETY: the CPU has the features, asserted above (which `drive!` relies on too).
            let xp = pack_panels(x, m, k, 32, plan.group, |src, dst| unsafe { pack_bf16_eo(src, dst) });
            shapes!(drive!(tile_bf16, acc_storage, xp, m, w, out, split, plan,));
        }
        DType::F16 => {
            let plan = plan(m, k, false, 16, 4, 2);
            let xp = pack_panels(x, m, k, 16, plan.group, |src, dst| dst[..src.len()].copy_from_slice(src));
            shapes!(drive!(tile_f16, acc_storage, xp, m, w, out, split, plan,));
        }
        DType::F32 => {
            let plan = plan(m, k, false, 16, 4, 4);
            let xp = pack_panels(x, m, k, 16, plan.group, |src, dst| dst[..src.len()].copy_from_slice(src));
            shapes!(drive!(tile_f32, acc_storage, xp, m, w, out, split, plan,));
        }
    }
}

/// Round ≤ 32 activations to bf16 and store them as f32, the 16 even-indexed then the 16 odd-indexed
/// ones (zero-padded): a 512-bit load of 32 bf16 weights widens to its even lanes with one shift and
/// to its odd lanes with one mask, matching these two vectors.
///
/// # Safety
/// Needs AVX-512 F/BW; `src.len() <= 32`, `dst.len() == 32`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_bf16_eo(src: &[f32], dst: &mut [f32]) {
    assert!(src.len() <= 32 && dst.len() == 32);
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let (n, p) = (src.len(), src.as_ptr());
    let lo = round_bf16(_mm512_maskz_loadu_ps(tail_mask16(n), p));
    let hi =
        if n > 16 { round_bf16(_mm512_maskz_loadu_ps(tail_mask16(n - 16), p.add(16))) } else { _mm512_setzero_ps() };
    _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_permutex2var_ps(lo, even, hi));
    _mm512_storeu_ps(dst.as_mut_ptr().add(16), _mm512_permutex2var_ps(lo, odd, hi));
}

/// Mask of the first `min(n, 16)` lanes.
#[inline(always)]
fn tail_mask16(n: usize) -> u16 {
    if n >= 16 {
        !0
    } else {
        (1u16 << n) - 1
    }
}

/// `out[i..i + 16] = f(x[i..i + 16], i)` over the whole vectors of `x` with plain loads and stores, then
/// the tail (if any) through masked ones, as `avx2::map_vectors` (docs/numerics.md, "AVX2
/// tiles and prefetch"): a load that reads what a masked store just wrote waits for that store.
///
/// # Safety
/// Needs AVX-512 F; `x` and `out` cover `n` values (they may be the same buffer).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn map_vectors(x: *const f32, out: *mut f32, n: usize, mut f: impl FnMut(__m512, usize) -> __m512) {
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(out.add(i), f(_mm512_loadu_ps(x.add(i)), i));
        i += 16;
    }
    if i < n {
        let mask = tail_mask16(n - i);
        _mm512_mask_storeu_ps(out.add(i), mask, f(_mm512_maskz_loadu_ps(mask, x.add(i)), i));
    }
}

/// The 16 values of `p` from `i` (of `n`): a plain load for a whole vector, a masked one (zeros past
/// `n`) for the tail, as `map_vectors` reads its own input.
///
/// # Safety
/// Needs AVX-512 F; `p` covers `n` values and `i < n`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_upto(p: *const f32, i: usize, n: usize) -> __m512 {
    if i + 16 <= n {
        _mm512_loadu_ps(p.add(i))
    } else {
        _mm512_maskz_loadu_ps(tail_mask16(n - i), p.add(i))
    }
}

/// `x` rounded to the nearest bf16 (ties to even, NaN kept quiet), still as f32 bits: the vector
/// form of `half::bf16::from_f32`, so the SIMD paths see exactly the activations the scalar
/// reference does.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn round_bf16_bits(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    let nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
    _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), _mm512_set1_epi32(0xffff_0000u32 as i32))
}

/// Up to 16 values rounded to bf16 bits, packed into 16 u16 (zero past `h.len()`): how the bf16
/// kernels (`avx512bf16`, `amx`) take their activations.
///
/// # Safety
/// AVX-512 F/BW/VL; `h.len() <= 16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn bf16_bits16(h: &[f32]) -> __m256i {
    debug_assert!(h.len() <= 16);
    let mask = if h.len() >= 16 { !0 } else { (1u16 << h.len()) - 1 };
    _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(round_bf16_bits(_mm512_maskz_loadu_ps(mask, h.as_ptr()))))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16(x: __m512) -> __m512 {
    _mm512_castsi512_ps(round_bf16_bits(x))
}

/// Sums of each of `a, b, c, d` in the four lanes of the result. Each vector is reduced by the same
/// fixed tree whatever the others are, so every tile shape gives identical sums.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // 128-bit blocks: ab = [a0+a2, a1+a3, b0+b2, b1+b3], same for cd.
    let ab = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b));
    let cd = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(c, d), _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d));
    // Block q now holds 4 partial sums of vector q.
    let s = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd), _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd));
    // Within each block: (l0+l1) + (l2+l3), then gather lane 0 of each block.
    let s = _mm512_add_ps(s, _mm512_permute_ps::<0b10_11_00_01>(s));
    let s = _mm512_add_ps(s, _mm512_permute_ps::<0b01_00_11_10>(s));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, s))
}

/// Reduce `acc[r][c]` to `out[c][r]` (rows past R are zero): four weight rows at a time.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn reduce_tile<const R: usize, const C: usize>(acc: &[[__m512; C]; R]) -> [[f32; 4]; C] {
    let z = _mm512_setzero_ps();
    let mut res = [[0f32; 4]; C];
    for c in 0..C {
        let v = |r: usize| if r < R { acc[r][c] } else { z };
        let s = hsum4(v(0), v(1), v(2), v(3));
        // SAFETY: `res[c]` is 4 f32 = 16 bytes, an unaligned store is fine.
        unsafe { _mm_storeu_ps(res[c].as_mut_ptr(), s) };
    }
    res
}

/// Start a tile call: zeros on the first K chunk, else the parked accumulators.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn acc_load<const R: usize, const C: usize>(t: &Tile, acc: &Acc) -> [[__m512; C]; R] {
    const { assert!(R <= 4 && R * C <= 24, "tile shape must fit hsum4 and Acc") };
    let mut a = [[_mm512_setzero_ps(); C]; R];
    if !t.first {
        for r in 0..R {
            a[r].copy_from_slice(&acc[r * C..(r + 1) * C]);
        }
    }
    a
}

/// End a tile call: the reduced sums after the last K chunk, else park the accumulators.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn acc_finish<const R: usize, const C: usize>(
    t: &Tile,
    a: &[[__m512; C]; R],
    acc: &mut Acc,
) -> [[f32; 4]; C] {
    if t.last {
        return reduce_tile(a);
    }
    for r in 0..R {
        acc[r * C..(r + 1) * C].copy_from_slice(&a[r]);
    }
    [[0.0; 4]; C]
}

/// Tile kernel, bf16 weights widened to f32: `R` weight rows × `C` x rows (a `pack_bf16_eo` panel)
/// over K range `t.k0..t.k1`.
///
/// # Safety
/// AVX-512 F/BW/VL + FMA; `x` is a panel of `C` rows covering `t.k1` (rounded up to 32), `w` has `R`
/// rows of `ws` bytes with at least `t.k1` bf16 each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn tile_bf16<const R: usize, const C: usize>(
    x: *const f32,
    w: *const u8,
    ws: usize,
    t: &Tile,
    acc: &mut Acc,
) -> [[f32; 4]; C] {
    let mut a = acc_load::<R, C>(t, acc);
    let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let mut pf = Prefetch::new(t);
    let mut kk = t.k0;
    // One step: 32 bf16 per weight row, loaded by `$load` from `$p`.
    macro_rules! step {
        ($p:ident => $load:expr) => {{
            let (mut we, mut wo) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
            for r in 0..R {
                let $p = w.add(r * ws + kk * 2);
                let v: __m512i = $load;
                we[r] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
            let xs = x.add(kk * C);
            for c in 0..C {
                let (xe, xo) = (_mm512_loadu_ps(xs.add(c * 32)), _mm512_loadu_ps(xs.add(c * 32 + 16)));
                for r in 0..R {
                    a[r][c] = _mm512_fmadd_ps(xe, we[r], a[r][c]);
                    a[r][c] = _mm512_fmadd_ps(xo, wo[r], a[r][c]);
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

/// Tile kernel for weights widened to f32 by `$full` (16 at `$p`) / `$tail` (the last < 16, under
/// `$mask`); x is a plain f32 panel.
macro_rules! tile_wide {
    ($(#[$doc:meta])* $name:ident, $features:literal, $size:literal, |$p:ident| $full:expr, |$q:ident, $mask:ident| $tail:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const C: usize>(x: *const f32, w: *const u8, ws: usize, t: &Tile, acc: &mut Acc) -> [[f32; 4]; C] {
            let mut a = acc_load::<R, C>(t, acc);
            let mut pf = Prefetch::new(t);
            let mut kk = t.k0;
            macro_rules! step {
                ($wv:ident) => {{
                    let xs = x.add(kk * C);
                    for c in 0..C {
                        let xv = _mm512_loadu_ps(xs.add(c * 16));
                        for r in 0..R {
                            a[r][c] = _mm512_fmadd_ps(xv, $wv[r], a[r][c]);
                        }
                    }
                }};
            }
            while kk + 16 <= t.k1 {
                pf.step();
                let mut wv = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    let $p = w.add(r * ws + kk * $size);
                    wv[r] = $full;
                }
                step!(wv);
                kk += 16;
            }
            if kk < t.k1 {
                let $mask = tail_mask16(t.k1 - kk);
                let mut wv = [_mm512_setzero_ps(); R];
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
    /// Tile kernel, f16 weights (`vcvtph2ps`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL + FMA + F16C; `x` is a panel of `C` rows covering `t.k1` (rounded up to 16),
    /// `w` has `R` rows of `ws` bytes with at least `t.k1` f16 each.
    tile_f16, "avx512f,avx512bw,avx512vl,fma,f16c", 2,
    |p| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const _)),
    |p, mask| _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16))
);

tile_wide!(
    /// Tile kernel, f32 weights (only 2-byte aligned in general: unaligned loads).
    ///
    /// # Safety
    /// As `tile_f16`, with f32 weights.
    tile_f32, "avx512f,avx512bw,avx512vl,fma", 4,
    |p| _mm512_loadu_ps(p as *const f32),
    |p, mask| _mm512_maskz_loadu_ps(mask, p as *const f32)
);

// ---- vector kernels ----

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert!(supported() && a.len() == b.len());
    // SAFETY: features asserted; both slices have the same length, loads stay inside them.
    unsafe { dot_impl(a, b) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA; `a` and `b` must have the same length.
#[target_feature(enable = "avx512f,fma")]
unsafe fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
    let (n, pa, pb) = (a.len(), a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (u, s) in acc.iter_mut().enumerate() {
            *s = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * u)), _mm512_loadu_ps(pb.add(i + 16 * u)), *s);
        }
        i += 64;
    }
    while i < n {
        let mask = tail_mask16(n - i);
        acc[0] =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, pa.add(i)), _mm512_maskz_loadu_ps(mask, pb.add(i)), acc[0]);
        i += 16;
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s)
}

pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert!(supported() && x.len() == y.len());
    // SAFETY: features asserted; equal lengths, masked tail.
    unsafe { axpy_impl(a, x, y) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA; `x` and `y` must have the same length.
#[target_feature(enable = "avx512f,fma")]
unsafe fn axpy_impl(a: f32, x: &[f32], y: &mut [f32]) {
    let (n, px, py) = (x.len(), x.as_ptr(), y.as_mut_ptr());
    let av = _mm512_set1_ps(a);
    map_vectors(py, py, n, |y, i| _mm512_fmadd_ps(av, load_upto(px, i, n), y));
}

pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    assert!(supported() && x.len() == out.len() && w.is_none_or(|w| w.len() == x.len()));
    // SAFETY: features asserted; all slices have x's length.
    unsafe { rms_norm_impl(x, w, eps, out) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA; `out` (and `w`, when given) must have `x`'s length.
#[target_feature(enable = "avx512f,fma")]
unsafe fn rms_norm_impl(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ms = dot_impl(x, x) / n as f32;
    let inv = _mm512_set1_ps(1.0 / (ms + eps).sqrt());
    // Same order as the scalar version: (x · inv) · w.
    match w {
        None => map_vectors(x.as_ptr(), out.as_mut_ptr(), n, |v, _| _mm512_mul_ps(v, inv)),
        Some(w) => {
            let pw = w.as_ptr();
            map_vectors(x.as_ptr(), out.as_mut_ptr(), n, |v, i| {
                _mm512_mul_ps(_mm512_mul_ps(v, inv), load_upto(pw, i, n))
            })
        }
    }
}

/// e^x to ~1 ulp: x = n·ln2 + r with |r| ≤ ln2/2, a degree-6 polynomial for e^r (Cephes' expf
/// coefficients), then `vscalefps` for 2^n, which also gets overflow (inf) and the denormal range right.
/// exp(-inf) = 0, NaN stays NaN.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn exp(x: __m512) -> __m512 {
    // max/min return their second operand when one is NaN, so NaN passes through the clamp.
    let x = _mm512_min_ps(_mm512_set1_ps(89.0), _mm512_max_ps(_mm512_set1_ps(-104.0), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
    _mm512_scalef_ps(y, n)
}

pub fn softmax(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { softmax_impl(x) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA (every access is masked to `x`).
#[target_feature(enable = "avx512f,fma")]
unsafe fn softmax_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // Lanes past the end load -inf (the max ignores them, and their exp is 0).
    let load = |i: usize| {
        if i + 16 <= n {
            _mm512_loadu_ps(p.add(i))
        } else {
            _mm512_mask_loadu_ps(ninf, tail_mask16(n - i), p.add(i))
        }
    };
    let mut mx = ninf;
    let mut i = 0;
    while i < n {
        mx = _mm512_max_ps(mx, load(i));
        i += 16;
    }
    let max = _mm512_reduce_max_ps(mx);
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let (mv, mut sum) = (_mm512_set1_ps(max), _mm512_setzero_ps());
    // Subnormal exponentials and results are zero (`kernels::softmax`), and are never computed: an
    // operation that reads or writes a subnormal takes a microcode assist on Intel.
    map_vectors(p, p, n, |_, i| {
        let e = exp_normal(_mm512_sub_ps(load(i), mv));
        sum = _mm512_add_ps(sum, e);
        e
    });
    let total = _mm512_reduce_add_ps(sum);
    let inv = _mm512_set1_ps(1.0 / total);
    // Every e below 2^-127 · total gives e · inv < 2^-126 (inv is 1/total to half an ulp): those
    // lanes multiply 0 instead. The test is e · 2^64 >= total · 2^-63, where both sides are normal.
    let (up, floor) = (_mm512_set1_ps(2f32.powi(64)), _mm512_set1_ps(total * 2f32.powi(-63)));
    map_vectors(p, p, n, |v, _| {
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(_mm512_mul_ps(v, up), floor);
        flush16(_mm512_mul_ps(_mm512_maskz_mov_ps(keep, v), inv))
    });
}

/// `exp(d)`, with results below 2^-126 (subnormal) zero and never computed: every d below -87.4 has
/// e^d < 2^-126, so those lanes compute e^-80 instead and are then cleared; the few just above are
/// computed and cleared by their exponent bits. The test is "not less than", so NaN stays NaN.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn exp_normal(d: __m512) -> __m512 {
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, _mm512_set1_ps(-87.4));
    flush16(_mm512_maskz_mov_ps(keep, exp(_mm512_mask_blend_ps(keep, _mm512_set1_ps(-80.0), d))))
}

/// `v` with its subnormal lanes set to zero (by the exponent bits: no floating-point operation).
#[inline]
#[target_feature(enable = "avx512f")]
fn flush16(v: __m512) -> __m512 {
    _mm512_maskz_mov_ps(_mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7f80_0000)), v)
}

pub fn gelu_tanh(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { gelu_impl(x) }
}

/// 0.5·u·(1 + tanh y) = u·sigmoid(2y) = u / (1 + e^(-2y)), y = √(2/π)·(u + 0.044715·u³). This form
/// has no cancellation for u ≪ 0 and needs only `exp`.
///
/// # Safety
/// The CPU must have AVX-512 F and FMA (every access is masked to `x`).
#[target_feature(enable = "avx512f,fma")]
unsafe fn gelu_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let (c, a, m2, one) =
        (_mm512_set1_ps(0.797_884_6), _mm512_set1_ps(0.044715), _mm512_set1_ps(-2.0), _mm512_set1_ps(1.0));
    map_vectors(p, p, n, |u, _| {
        let cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(a, u), u), u);
        let y = _mm512_mul_ps(c, _mm512_add_ps(u, cube));
        _mm512_div_ps(u, _mm512_add_ps(one, exp(_mm512_mul_ps(m2, y))))
    });
}

/// XOR of all 64-byte blocks of `buf` (whole blocks only): touches every byte, for bandwidth tests.
pub fn read_xor(buf: &[u8]) -> u64 {
    assert!(supported());
    // SAFETY: features asserted; reads whole 64-byte blocks inside `buf`.
    unsafe { read_xor_impl(buf) }
}

/// # Safety
/// The CPU must have AVX-512 F (only whole 64-byte blocks inside `buf` are read).
#[target_feature(enable = "avx512f")]
unsafe fn read_xor_impl(buf: &[u8]) -> u64 {
    let mut acc = [_mm512_setzero_si512(); 8];
    let p = buf.as_ptr();
    let blocks = buf.len() / 512;
    for b in 0..blocks {
        for (u, a) in acc.iter_mut().enumerate() {
            *a = _mm512_xor_si512(*a, _mm512_loadu_si512(p.add(b * 512 + u * 64) as *const _));
        }
    }
    for b in blocks * 8..buf.len() / 64 {
        acc[0] = _mm512_xor_si512(acc[0], _mm512_loadu_si512(p.add(b * 64) as *const _));
    }
    let v = acc.into_iter().fold(_mm512_setzero_si512(), |s, a| _mm512_xor_si512(s, a));
    _mm512_reduce_or_epi64(v) as u64 ^ _mm512_reduce_add_epi64(v) as u64
}

/// Round every element to bf16 in place (ties to even, as `half::bf16::from_f32`).
pub fn round_bf16_slice(x: &mut [f32]) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { round_bf16_slice_impl(x) }
}

/// # Safety
/// The CPU must have AVX-512 F (every access is masked to `x`).
#[target_feature(enable = "avx512f")]
unsafe fn round_bf16_slice_impl(x: &mut [f32]) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    map_vectors(p, p, n, |v, _| round_bf16(v));
}

/// Final-logit softcapping `c·tanh(x/c)` in place; with `bf16`, each of the reference's three steps
/// (divide, tanh, multiply) is rounded to bf16. tanh(y) = 1 − 2/(e^(2y) + 1) for |y| ≥ 0.3 (exact limits at
/// ±inf), and its odd Taylor series to y¹³ below, where the first form would cancel (both ~1e-7 relative).
pub fn softcap(x: &mut [f32], cap: f32, bf16: bool) {
    assert!(supported());
    // SAFETY: features asserted; masked accesses stay inside `x`.
    unsafe { softcap_impl(x, cap, bf16) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA (every access is masked to `x`).
#[target_feature(enable = "avx512f,fma")]
unsafe fn softcap_impl(x: &mut [f32], cap: f32, bf16: bool) {
    let (n, p) = (x.len(), x.as_mut_ptr());
    let (c, one, two) = (_mm512_set1_ps(cap), _mm512_set1_ps(1.0), _mm512_set1_ps(2.0));
    let r = |v: __m512| if bf16 { round_bf16(v) } else { v };
    // tanh y = y·(1 + y²·(c3 + y²·(c5 + ...))), Horner in y².
    const SERIES: [f32; 6] =
        [21844.0 / 6081075.0, -1382.0 / 155925.0, 62.0 / 2835.0, -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0];
    map_vectors(p, p, n, |v, _| {
        let y = r(_mm512_div_ps(v, c));
        let e = exp(_mm512_mul_ps(two, y));
        let big = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
        let y2 = _mm512_mul_ps(y, y);
        let mut poly = _mm512_set1_ps(SERIES[0]);
        for k in &SERIES[1..] {
            poly = _mm512_fmadd_ps(poly, y2, _mm512_set1_ps(*k));
        }
        let small = _mm512_fmadd_ps(_mm512_mul_ps(poly, y2), y, y);
        let abs = _mm512_abs_ps(y);
        let is_small = _mm512_cmp_ps_mask(abs, _mm512_set1_ps(0.3), _CMP_LT_OQ);
        let t = r(_mm512_mask_blend_ps(is_small, big, small));
        r(_mm512_mul_ps(t, c))
    });
}

/// `out[i, :] = Σ_t p[i, t] · v[t, cols]` (bf16 or f32 `v`; `out` is `[m, cols.len()]`): per output
/// element a chain of FMAs in `t` order, so any blocking of rows or columns gives the same bits. Register
/// tiles of up to 6 rows x 64 columns, over `WEIGHTED_KEY_TILE` value rows at a time: those stay in L2
/// while every row and column block uses them, so the values stream from memory once, in order (a
/// column block at a time over all of them read each row 8 times, 128 bytes at a time: 4x slower at
/// 32K keys).
pub fn weighted_rows(p: &[f32], m: usize, v: MatRef, cols: Range<usize>, out: &mut [f32]) {
    assert!(supported() && matches!(v.dtype, DType::BF16 | DType::F32));
    assert!(p.len() == m * v.rows && cols.end <= v.cols && out.len() == m * cols.len());
    if v.rows == 0 {
        out.fill(0.0);
        return;
    }
    for t0 in (0..v.rows).step_by(WEIGHTED_KEY_TILE) {
        let keys = t0..v.rows.min(t0 + WEIGHTED_KEY_TILE);
        let mut i0 = 0;
        while i0 < m {
            let mb = (m - i0).min(6);
            for c in cols.clone().step_by(64) {
                let b = Block { i0, c, keys: keys.clone(), cols: cols.clone() };
                // SAFETY: features asserted; rows i0..i0+mb of p and out exist, columns c.. are masked to
                // cols.end <= v.cols, keys are rows of v.
                unsafe {
                    match mb {
                        1 => weighted_block::<1>(p, &b, v, out),
                        2 => weighted_block::<2>(p, &b, v, out),
                        3 => weighted_block::<3>(p, &b, v, out),
                        4 => weighted_block::<4>(p, &b, v, out),
                        5 => weighted_block::<5>(p, &b, v, out),
                        _ => weighted_block::<6>(p, &b, v, out),
                    }
                }
            }
            i0 += mb;
        }
    }
}

/// Value rows per pass of [`weighted_rows`] (64 KiB of bf16 at head_dim 512).
const WEIGHTED_KEY_TILE: usize = 64;

/// One register tile of [`weighted_rows`]: rows `i0..`, columns `c..c+64` (within `cols`), value rows `keys`.
struct Block {
    i0: usize,
    c: usize,
    keys: Range<usize>,
    cols: Range<usize>,
}

/// Continues the sums already in `out` unless the keys start at 0.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL and FMA. `p` is `[m, v.rows]` and `out` `[m, b.cols.len()]` with
/// rows `b.i0..b.i0 + MB` inside `m`; `b.c` lies inside `b.cols`, which lies inside `0..v.cols` (columns
/// past `b.cols.end` are masked off); `b.keys` are rows of `v`, whose dtype is bf16 or f32 and whose
/// `data` holds `v.rows * v.cols` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn weighted_block<const MB: usize>(p: &[f32], b: &Block, v: MatRef, out: &mut [f32]) {
    let (n, d, w) = (v.rows, v.cols, b.cols.len());
    let masks: [__mmask16; 4] = std::array::from_fn(|k| tail_mask16(b.cols.end.saturating_sub(b.c + 16 * k)));
    let po = out.as_mut_ptr().add(b.c - b.cols.start);
    let mut acc = [[_mm512_setzero_ps(); 4]; MB];
    if b.keys.start > 0 {
        for (i, a) in acc.iter_mut().enumerate() {
            for (k, ak) in a.iter_mut().enumerate() {
                *ak = _mm512_maskz_loadu_ps(masks[k], po.add((b.i0 + i) * w + 16 * k));
            }
        }
    }
    let bf16 = v.dtype == DType::BF16;
    let base = v.data.as_ptr();
    let pp = p.as_ptr().add(b.i0 * n);
    for t in b.keys.clone() {
        let vk: [__m512; 4] = std::array::from_fn(|k| {
            let at = t * d + b.c + 16 * k;
            if bf16 {
                let h = _mm256_maskz_loadu_epi16(masks[k], base.add(2 * at) as *const i16);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_maskz_loadu_ps(masks[k], base.add(4 * at) as *const f32)
            }
        });
        for (i, a) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*pp.add(i * n + t));
            for k in 0..4 {
                a[k] = _mm512_fmadd_ps(x, vk[k], a[k]);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for k in 0..4 {
            _mm512_mask_storeu_ps(po.add((b.i0 + i) * w + 16 * k), masks[k], a[k]);
        }
    }
}

pub fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    assert!(supported() && x.len() == out.len());
    // SAFETY: features asserted; equal lengths, masked tail.
    unsafe { exp_shifted_impl(x, m, out) }
}

/// # Safety
/// The CPU must have AVX-512 F and FMA; `x` and `out` must have the same length.
#[target_feature(enable = "avx512f,fma")]
unsafe fn exp_shifted_impl(x: &[f32], m: f32, out: &mut [f32]) {
    let mv = _mm512_set1_ps(m);
    map_vectors(x.as_ptr(), out.as_mut_ptr(), x.len(), |v, _| exp_normal(_mm512_sub_ps(v, mv)));
}
