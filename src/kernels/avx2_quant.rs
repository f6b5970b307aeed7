//! AVX2 kernels for block-quantized weights (`quant`): integer products inside each block with
//! `vpmaddubsw` (u8 × s8 pairs into i16) and `vpmaddwd` (i16 pairs into i32), then one scaled float
//! step per block (per super-block for the k-quants).
//!
//! Each weight block is decoded once per tile into vectors of levels (and scale vectors) and used for
//! every activation row of the tile. The signed formats (Q8_0, Q4_0, Q5_0, and IQ4_NL / IQ4_XS, whose
//! nibbles become their table's int8 levels by one `vpshufb`) use `|w|` as the unsigned
//! operand and move the sign onto the activation (`vpsignb`); Q5_1, Q4_K and Q5_K have unsigned levels
//! and multiply them directly; Q6_K multiplies its unsigned levels `0..63` and removes the offset 32
//! with the activation's 16-element sums. Every `u8 · s8` pair stays far below `vpmaddubsw`'s i16
//! saturation (at most `2 · 128 · 127`, for a Q8_0 level of -128). IQ4_XS's lane sums (sub-block scales
//! up to 32 in magnitude times levels up to 127, 32 elements per lane over a super-block) stay below
//! `8 · 4 · 127 · 127 · 32 < 2^24`.
//!
//! Batch invariance: an output element is one 8-lane f32 accumulator updated once per block with the
//! same operations (`acc += f32(lane sums) · (d_w · d_x)`, plus the minimum / offset terms), then
//! reduced by a fixed tree. Which tile computed it, and which other rows shared the tile, never enters:
//! row `i` of an `m`-row product equals that row alone. The lane sums are exact integers (below 2^24
//! per lane), so only the order of the float additions differs from the reference `quant::dot_row`.

use super::quant::{QActs, QMatRef, QType, IQ4_VALUES};
use std::arch::x86_64::*;

/// `out[i][j] = Σ_k acts[i, k] · w[j, k]`; `out[i]` has `w.rows` elements.
pub fn matmul(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    assert!(super::avx2::supported(), "AVX2 quantized kernels on a CPU without AVX2/FMA/F16C");
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
            QType::IQ4_NL => run::<IQ4NL>(acts, w, out),
            QType::IQ4_XS => run::<IQ4XS>(acts, w, out),
            QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => {
                panic!("packed strips go through `q8x16` / `q4kx16` / `q6kx16` (matmul_quant)")
            }
        }
    }
}

/// One activation row as the kernels read it: levels, per-block scales, and (by kind) the Q8_1 scaled
/// sums or the Q8_K 16-element sums.
#[derive(Clone, Copy)]
struct Act {
    q: *const i8,
    d: *const f32,
    s: *const f32,
    bs: *const i16,
}

/// A weight format: how to decode one block, and how to add one block's product with an activation
/// row to an accumulator.
trait Format {
    /// Bytes and elements per block.
    const BB: usize;
    const BE: usize;
    /// A decoded block (plain vectors; all-zero bits is a valid value).
    type W: Copy;

    /// # Safety
    /// AVX2 + FMA + F16C; `b` points at a whole block.
    unsafe fn decode(b: *const u8) -> Self::W;

    /// `acc` plus block `bi` of the row `w` came from times block `bi` of `a`.
    ///
    /// # Safety
    /// AVX2 + FMA + F16C; `a` has at least `bi + 1` blocks.
    unsafe fn dot(w: &Self::W, a: &Act, bi: usize, acc: __m256) -> __m256;
}

/// The m activation rows in groups of at most 4 (sizes as equal as they come: 6 = 3 + 3), except
/// that 5 (a sequence verifying four drafts) is one group: each block is decoded once for the five
/// rows instead of twice. `matmul_bench --hot --threads 1` at [1536, 384] and [1536, 512], m = 5 on
/// Zen 3: Q8_0 116 -> 99 µs, Q4_K 117 -> 99, Q6_K 136 -> 107, Q4_0 171 -> 148 against 3 + 2.
fn groups(m: usize) -> Vec<(usize, usize)> {
    if m == 5 {
        return vec![(0, 5)];
    }
    let n = m.div_ceil(4);
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

/// Walk the product: weight-row tiles outside, activation groups inside, so each tile's rows are read
/// from memory once and from L1 by the later groups.
///
/// # Safety
/// AVX2 + FMA + F16C; shapes as checked by `matmul`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<F: Format>(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    let (m, n) = (acts.rows, w.rows);
    let nb = w.cols / F::BE;
    let rb = w.row_bytes();
    let act = |i: usize| Act {
        q: acts.qs.as_ptr().add(i * acts.cols),
        d: acts.d.as_ptr().add(i * nb),
        s: if acts.s.is_empty() { std::ptr::null() } else { acts.s.as_ptr().add(i * nb) },
        bs: if acts.bsums.is_empty() { std::ptr::null() } else { acts.bsums.as_ptr().add(i * nb * 16) },
    };
    let acts_v: Vec<Act> = (0..m).map(act).collect();
    let groups = groups(m);
    // Two weight rows per tile for one or two activation rows (two independent chains per row);
    // one for bigger groups (registers).
    let rmax = if m <= 2 { 2 } else { 1 };
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
                    let res = tile::<F, $r, $c>(wp, rb, nb, pf, x.try_into().expect("group size"));
                    for (rr, row) in res.iter().enumerate() {
                        for (cc, &v) in row.iter().enumerate() {
                            out[g0 + cc][j + rr] = v;
                        }
                    }
                }};
            }
            match (r, c) {
                (1, 1) => shape!(1, 1),
                (1, 2) => shape!(1, 2),
                (1, 3) => shape!(1, 3),
                (1, 4) => shape!(1, 4),
                (1, 5) => shape!(1, 5),
                (2, 1) => shape!(2, 1),
                (2, 2) => shape!(2, 2),
                _ => unreachable!("tile shape"),
            }
        }
        j += r;
    }
}

/// `R` weight rows (`rb` bytes apart from `w`, `nb` blocks each) times the `C` activation rows `x`,
/// prefetching the `pf` bytes after the tile's rows as it goes (the hardware prefetchers alone left
/// Q8_0 at half the bandwidth bf16 weights get).
///
/// # Safety
/// AVX2 + FMA + F16C; `w` holds `R` rows of `nb` blocks, each `x` row `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<F: Format, const R: usize, const C: usize>(
    w: *const u8,
    rb: usize,
    nb: usize,
    pf: usize,
    x: &[Act; C],
) -> [[f32; C]; R] {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let next = w.wrapping_add(R * rb);
    let (mut pf_at, mut pf_end, pf_step) = (0, 0, pf.div_ceil(nb.max(1)));
    // SAFETY (zeroed): `W` is plain vector data, for which all-zero bits are valid.
    let mut wd: [F::W; R] = std::mem::zeroed();
    for bi in 0..nb {
        // This block's share of the next tile, a line at a time.
        pf_end = (pf_end + pf_step).min(pf);
        while pf_at < pf_end {
            // SAFETY: a prefetch never faults and has no architectural effect; the address is in the
            // chunk anyway.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(pf_at) as *const i8);
            pf_at += 64;
        }
        for (r, d) in wd.iter_mut().enumerate() {
            *d = F::decode(w.add(r * rb + bi * F::BB));
        }
        for c in 0..C {
            for r in 0..R {
                acc[r][c] = F::dot(&wd[r], &x[c], bi, acc[r][c]);
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

/// The sum of the 8 lanes, always by the same tree.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The f16 at `p`, broadcast.
///
/// # Safety
/// F16C; `p` readable for 2 bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_bcast(p: *const u8) -> __m256 {
    let bits = (p as *const u16).read_unaligned();
    _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The two f16 at `p` (scale, then minimum), each broadcast.
///
/// # Safety
/// F16C; `p` readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_pair_bcast(p: *const u8) -> (__m256, __m256) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
    (_mm256_broadcastss_ps(v), _mm256_broadcastss_ps(_mm_movehdup_ps(v)))
}

/// 16 bytes of nibbles as 32 levels: the low nibbles (elements 0..16), then the high ones.
///
/// # Safety
/// AVX2; `p` readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(0x0f))
}

/// Byte `j` = 0xff where bit `j` of the 32-bit `qh` at `p` is set, else 0.
///
/// # Safety
/// AVX2; `p` readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bits32(p: *const u8) -> __m256i {
    let qh = _mm256_set1_epi32((p as *const i32).read_unaligned());
    // Byte j takes byte j / 8 of qh (in-lane shuffle: every 32-bit lane holds qh), then tests bit j % 8.
    let spread = _mm256_shuffle_epi8(
        qh,
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// A decoded block of a signed 32-element format: `|w|`, `w` (for the sign) and the scale.
#[derive(Clone, Copy)]
struct Signed32 {
    aw: __m256i,
    w: __m256i,
    d: __m256,
}

/// `acc + f32(Σ w·x) · (d_w · d_x)` for a signed 32-element block against Q8_0 activations.
///
/// # Safety
/// AVX2 + FMA; `a` has block `bi`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_signed32(w: &Signed32, a: &Act, bi: usize, acc: __m256) -> __m256 {
    let x = _mm256_loadu_si256(a.q.add(32 * bi) as *const __m256i);
    let p = _mm256_maddubs_epi16(w.aw, _mm256_sign_epi8(x, w.w));
    let s = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    let dx = _mm256_broadcast_ss(&*a.d.add(bi));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.d, dx), acc)
}

#[inline]
#[target_feature(enable = "avx2")]
fn signed32(w: __m256i, d: __m256) -> Signed32 {
    Signed32 { aw: _mm256_abs_epi8(w), w, d }
}

struct Q8_0;
struct Q4_0;
struct Q5_0;
struct Q5_1;
struct Q4K;
struct Q5K;
struct Q6K;
struct IQ4NL;
struct IQ4XS;

impl Format for Q8_0 {
    const BB: usize = 34;
    const BE: usize = 32;
    type W = Signed32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Signed32 {
        signed32(_mm256_loadu_si256(b.add(2) as *const __m256i), f16_bcast(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Signed32, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_signed32(w, a, bi, acc)
    }
}

impl Format for Q4_0 {
    const BB: usize = 18;
    const BE: usize = 32;
    type W = Signed32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Signed32 {
        signed32(_mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)), f16_bcast(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Signed32, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_signed32(w, a, bi, acc)
    }
}

impl Format for Q5_0 {
    const BB: usize = 22;
    const BE: usize = 32;
    type W = Signed32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Signed32 {
        // level - 16 = nibble with 0xf0 (i.e. -16) or'ed in where the fifth bit is clear.
        let low = nibbles32(b.add(6));
        let w = _mm256_or_si256(low, _mm256_andnot_si256(bits32(b.add(2)), _mm256_set1_epi8(0xf0u8 as i8)));
        signed32(w, f16_bcast(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Signed32, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_signed32(w, a, bi, acc)
    }
}

/// A decoded Q5_1 block: unsigned levels, scale and minimum.
#[derive(Clone, Copy)]
struct Min32 {
    q: __m256i,
    d: __m256,
    m: __m256,
}

impl Format for Q5_1 {
    const BB: usize = 24;
    const BE: usize = 32;
    type W = Min32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Min32 {
        let q = _mm256_or_si256(nibbles32(b.add(8)), _mm256_and_si256(bits32(b.add(4)), _mm256_set1_epi8(0x10)));
        let (d, m) = f16_pair_bcast(b);
        Min32 { q, d, m }
    }

    /// `acc + f32(Σ q·x) · (d_w · d_x)`, then `+ m · s_x` in lane 0 (the other lanes add `m · 0`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Min32, a: &Act, bi: usize, acc: __m256) -> __m256 {
        let x = _mm256_loadu_si256(a.q.add(32 * bi) as *const __m256i);
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(w.q, x), _mm256_set1_epi16(1));
        let dx = _mm256_broadcast_ss(&*a.d.add(bi));
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.d, dx), acc);
        let sx = _mm256_zextps128_ps256(_mm_load_ss(a.s.add(bi)));
        _mm256_fmadd_ps(w.m, sx, acc)
    }
}

/// `vpshufb` controls: entry `j` puts i16 number `j` of a 128-bit lane in every i16 of both lanes.
static BCAST16: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        let mut b = 0;
        while b < 32 {
            t[j][b] = (2 * j + b % 2) as u8;
            b += 1;
        }
        j += 1;
    }
    t
};

/// `vpshufb` controls: entry `k` puts i16 number `2k` of the low lane in every i16 of the low lane,
/// and number `2k + 1` of the high lane in every i16 of the high lane.
static PAIR16: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut b = 0;
        while b < 32 {
            t[k][b] = (4 * k + 2 * (b / 16) + b % 2) as u8;
            b += 1;
        }
        k += 1;
    }
    t
};

/// A decoded Q4_K / Q5_K super-block: the levels of its 8 sub-blocks, each sub-block's scale in
/// every i16 lane, the minimums each twice (lane pair `2j, 2j+1` = `mn[j]`, against the activation's
/// two 16-sums of sub-block `j`), and the super-block's scale and minimum scale.
#[derive(Clone, Copy)]
struct KMin {
    q: [__m256i; 8],
    sc: [__m256i; 8],
    mn: __m256i,
    d: __m256,
    dmin: __m256,
}

/// The 8 scales (bytes 0..8) and 8 minimums (bytes 8..16) of the Q4_K / Q5_K super-block at `p`,
/// unpacked from their 12 bytes of 6-bit fields as [`super::quant::scale_min_k4`] reads each, in vector
/// registers: the block's first 16 bytes in one load (the f16 pair, then the 12 bytes as words `u0`,
/// `u1`, `u2`), then per 32-bit lane `[u0, u2, u1, u2 >> 4]` masked to the low six or four bits of each
/// byte, and the top two bits of `u0` / `u1`'s bytes moved above the nibbles of lanes 1 and 3. Eight
/// vector operations where the same unpacking on 32-bit words took three loads, a dozen integer
/// operations and two moves into vector registers, once per super-block and weight row
/// (docs/quantization.md, "Scales of the k-quants"). `scales_mins_k4_matches_the_scalar_unpacking`
/// checks the bytes.
///
/// # Safety
/// AVX2 CPU; `p` readable for 16 bytes (a Q4_K / Q5_K block).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scales_mins_k4(p: *const u8) -> __m128i {
    let a = _mm_loadu_si128(p as *const __m128i);
    // [u0, u2, u1, u2], u2's minimums' nibbles shifted down in lane 3.
    let lo = _mm_srlv_epi32(_mm_shuffle_epi32::<0b11_10_11_01>(a), _mm_setr_epi32(0, 0, 0, 4));
    let lo = _mm_and_si128(lo, _mm_setr_epi32(0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f));
    // [u0, u0, u1, u1]: bits 6-7 of each byte to bits 4-5 (`(u >> 6 & 3) << 4` per byte), lanes 1 and 3.
    let hi = _mm_srli_epi32::<2>(_mm_shuffle_epi32::<0b10_10_01_01>(a));
    let hi = _mm_and_si128(hi, _mm_setr_epi32(0, 0x3030_3030, 0, 0x3030_3030));
    _mm_or_si128(lo, hi)
}

/// Decode the 12 packed bytes of 6-bit scales and minimums at `p` and the f16 pair before them into
/// `w` (everything but the levels).
///
/// # Safety
/// AVX2 + F16C; `p` is a Q4_K / Q5_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kmin_scales(p: *const u8, w: &mut KMin) {
    let scmn = scales_mins_k4(p);
    let sc16 = _mm_cvtepu8_epi16(scmn);
    let scb = _mm256_broadcastsi128_si256(sc16);
    for (s, ctl) in w.sc.iter_mut().zip(&BCAST16) {
        *s = _mm256_shuffle_epi8(scb, _mm256_loadu_si256(ctl.as_ptr() as *const __m256i));
    }
    let mn16 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scmn, scmn));
    w.mn = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
    let (d, dmin) = f16_pair_bcast(p);
    w.d = d;
    w.dmin = dmin;
}

/// `acc + f32(Σ_j sc_j Σ q·x) · (d · d_x) − f32(Σ_j mn_j · bsums_j) · (dmin · d_x)` for a Q4_K / Q5_K
/// super-block against Q8_K activations.
///
/// # Safety
/// AVX2 + FMA; `a` has block `bi`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_kmin(w: &KMin, a: &Act, bi: usize, acc: __m256) -> __m256 {
    let x = a.q.add(256 * bi);
    let mut s = _mm256_setzero_si256();
    for j in 0..8 {
        let p = _mm256_maddubs_epi16(w.q[j], _mm256_loadu_si256(x.add(32 * j) as *const __m256i));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, w.sc[j]));
    }
    let ms = _mm256_madd_epi16(w.mn, _mm256_loadu_si256(a.bs.add(16 * bi) as *const __m256i));
    let dx = _mm256_broadcast_ss(&*a.d.add(bi));
    let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.d, dx), acc);
    _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(w.dmin, dx), acc)
}

impl Format for Q4K {
    const BB: usize = 144;
    const BE: usize = 256;
    type W = KMin;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        // SAFETY (zeroed): plain vectors.
        let mut w: KMin = std::mem::zeroed();
        kmin_scales(b, &mut w);
        let m4 = _mm256_set1_epi8(0x0f);
        for c in 0..4 {
            let v = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
            w.q[2 * c] = _mm256_and_si256(v, m4);
            w.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
        }
        w
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_kmin(w, a, bi, acc)
    }
}

impl Format for Q5K {
    const BB: usize = 176;
    const BE: usize = 256;
    type W = KMin;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> KMin {
        // SAFETY (zeroed): plain vectors.
        let mut w: KMin = std::mem::zeroed();
        kmin_scales(b, &mut w);
        let (m4, b4) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x10));
        // Bits 2c and 2c+1 of qh[l] are the fifth bits of elements 64c + l and 64c + 32 + l: shift
        // qh right by 2 per chunk and move bits 0 and 1 to bit 4 (16-bit shifts; the mask keeps
        // each byte's own bit).
        let mut qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
        for c in 0..4 {
            let v = _mm256_loadu_si256(b.add(48 + 32 * c) as *const __m256i);
            let h0 = _mm256_and_si256(_mm256_slli_epi16::<4>(qh), b4);
            let h1 = _mm256_and_si256(_mm256_slli_epi16::<3>(qh), b4);
            w.q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
            w.q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4), h1);
            qh = _mm256_srli_epi16::<2>(qh);
        }
        w
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &KMin, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_kmin(w, a, bi, acc)
    }
}

/// A decoded Q6_K super-block: unsigned levels `0..63` of its 8 32-element vectors; for vector `v`,
/// the scale of group `2v` in the low 128-bit lane and of group `2v + 1` in the high one (i16); all
/// 16 group scales in order (for the offset term); the scale.
#[derive(Clone, Copy)]
struct K6 {
    q: [__m256i; 8],
    sc: [__m256i; 8],
    sc16: __m256i,
    d: __m256,
}

impl Format for Q6K {
    const BB: usize = 210;
    const BE: usize = 256;
    type W = K6;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> K6 {
        // SAFETY (zeroed): plain vectors.
        let mut w: K6 = std::mem::zeroed();
        let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            // Element l + 32k of the half: a nibble of ql (low for k = 0, 1; high for 2, 3) with bits
            // 2k, 2k+1 of qh[l] as bits 4, 5.
            let q = &mut w.q[4 * h..4 * h + 4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), _mm256_and_si256(qh, m2));
            q[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
            );
        }
        let sp = b.add(192);
        w.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sp as *const __m128i));
        for h in 0..2 {
            let s8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(sp.add(8 * h) as *const __m128i)));
            for (k, ctl) in PAIR16.iter().enumerate() {
                w.sc[4 * h + k] = _mm256_shuffle_epi8(s8, _mm256_loadu_si256(ctl.as_ptr() as *const __m256i));
            }
        }
        w.d = f16_bcast(b.add(208));
        w
    }

    /// `acc + (f32(Σ_{g<8} sc_g Σ q·x) + f32(Σ_{g≥8} sc_g Σ q·x) − f32(32 Σ_g sc_g·bsums_g)) · (d · d_x)`,
    /// lane by lane. The halves are converted apart so that every lane sum is exact (below 2^24 even
    /// for scales of -128 and all-extreme levels, which one sum of both halves would not be).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &K6, a: &Act, bi: usize, acc: __m256) -> __m256 {
        let x = a.q.add(256 * bi);
        let mut s = [_mm256_setzero_si256(); 2];
        for v in 0..8 {
            let p = _mm256_maddubs_epi16(w.q[v], _mm256_loadu_si256(x.add(32 * v) as *const __m256i));
            s[v / 4] = _mm256_add_epi32(s[v / 4], _mm256_madd_epi16(p, w.sc[v]));
        }
        let (s0, s1) = (_mm256_cvtepi32_ps(s[0]), _mm256_cvtepi32_ps(s[1]));
        let off = _mm256_madd_epi16(w.sc16, _mm256_loadu_si256(a.bs.add(16 * bi) as *const __m256i));
        let off = _mm256_cvtepi32_ps(_mm256_slli_epi32::<5>(off));
        let dd = _mm256_mul_ps(w.d, _mm256_broadcast_ss(&*a.d.add(bi)));
        let acc = _mm256_fmadd_ps(s0, dd, acc);
        let acc = _mm256_fmadd_ps(s1, dd, acc);
        _mm256_fnmadd_ps(off, dd, acc)
    }
}

/// The IQ4 levels, in both 128-bit lanes (a `vpshufb` table).
#[inline]
#[target_feature(enable = "avx2")]
fn iq4_table() -> __m256i {
    // SAFETY: 16 readable bytes.
    let t = unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i) };
    _mm256_broadcastsi128_si256(t)
}

impl Format for IQ4NL {
    const BB: usize = 18;
    const BE: usize = 32;
    type W = Signed32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Signed32 {
        signed32(_mm256_shuffle_epi8(iq4_table(), nibbles32(b.add(2))), f16_bcast(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Signed32, a: &Act, bi: usize, acc: __m256) -> __m256 {
        dot_signed32(w, a, bi, acc)
    }
}

/// A decoded IQ4_XS super-block: each sub-block's levels as `|w|` and `w` (for the sign), its signed
/// scale in every i16 lane, and the super-block's scale.
#[derive(Clone, Copy)]
struct Xs {
    aw: [__m256i; 8],
    w: [__m256i; 8],
    sc: [__m256i; 8],
    d: __m256,
}

impl Format for IQ4XS {
    const BB: usize = 136;
    const BE: usize = 256;
    type W = Xs;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(b: *const u8) -> Xs {
        // SAFETY (zeroed): plain vectors.
        let mut w: Xs = std::mem::zeroed();
        let t = iq4_table();
        for j in 0..8 {
            // Sub-block j: low nibbles of its 16 bytes are elements 0..16, high nibbles 16..32.
            let q = _mm256_shuffle_epi8(t, nibbles32(b.add(8 + 16 * j)));
            w.w[j] = q;
            w.aw[j] = _mm256_abs_epi8(q);
        }
        let sc8 = super::quant::iq4xs_scales(std::slice::from_raw_parts(b, 8)) as i64;
        let sc16 = _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc8)), _mm_set1_epi16(32));
        let scb = _mm256_broadcastsi128_si256(sc16);
        for (s, ctl) in w.sc.iter_mut().zip(&BCAST16) {
            *s = _mm256_shuffle_epi8(scb, _mm256_loadu_si256(ctl.as_ptr() as *const __m256i));
        }
        w.d = f16_bcast(b);
        w
    }

    /// `acc + f32(Σ_j sc_j Σ w·x) · (d · d_x)` against Q8_K activations.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &Xs, a: &Act, bi: usize, acc: __m256) -> __m256 {
        let x = a.q.add(256 * bi);
        let mut s = _mm256_setzero_si256();
        for j in 0..8 {
            let xv = _mm256_loadu_si256(x.add(32 * j) as *const __m256i);
            let p = _mm256_maddubs_epi16(w.aw[j], _mm256_sign_epi8(xv, w.w[j]));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, w.sc[j]));
        }
        let dx = _mm256_broadcast_ss(&*a.d.add(bi));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.d, dx), acc)
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::quant::scale_min_k4;
    use crate::kernels::tests::Rng;

    /// The vector unpacking of a super-block's 6-bit scales and minimums gives, byte for byte, what the
    /// scalar reference reads for each sub-block, for random bytes (every bit pattern of the fields).
    #[test]
    fn scales_mins_k4_matches_the_scalar_unpacking() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 on this CPU: scales_mins_k4 not tested");
            return;
        }
        let mut rng = Rng(7);
        for _ in 0..2000 {
            let block: Vec<u8> = (0..16).map(|_| rng.next() as u8).collect();
            // SAFETY: 16 readable bytes; the CPU has AVX2.
            let v = unsafe { super::scales_mins_k4(block.as_ptr()) };
            let mut got = [0u8; 16];
            // SAFETY: 16 writable bytes.
            unsafe { std::arch::x86_64::_mm_storeu_si128(got.as_mut_ptr() as *mut _, v) };
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, &block[4..16]);
                assert_eq!((got[j], got[8 + j]), (sc, mn), "sub-block {j} of {block:?}");
            }
        }
    }
}
