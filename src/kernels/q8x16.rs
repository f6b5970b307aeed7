//! Q8_0 packed in strips of 16 rows (`QType::Q8_0x16`): the layout a Q8_0 matrix is repacked into at
//! load on CPUs with AVX-512 VNNI, so that one `vpdpbusd` multiplies 4 levels of 16 weight rows by 4
//! levels of an activation row broadcast to every lane, with nothing to transpose or gather: each lane
//! ends a block holding one weight row's exact block sum (docs/quantization.md, "Q8_0 in 16-row
//! strips").
//!
//! Layout: rows `16s..16s + 16` form strip `s`, `BLOCK_BYTES` per block of 32 columns, the blocks in
//! column order. A strip block is the 16 rows' f16 scales (32 bytes), then 8 lines of 64 bytes: line
//! `l` holds, row after row, each row's levels `4l..4l + 4` plus 128 (as u8). A strip is as large as
//! its 16 plain Q8_0 rows, so the packed matrix is the plain one's size; rows must be a multiple of 16.
//!
//! Bits: both kernels here (portable, AVX-512 VNNI) compute, for weight row `j` and activation row
//! `i`, `acc = fma(f32(Σ_b), d_w · d_x, acc)` block after block from zero, where `Σ_b` is the block's
//! exact integer dot product. Nothing depends on the number of rows, the tile or the thread split, and
//! the two give the same bits.

use super::quant::{QActs, QMatRef, QType};
use half::f16;

pub use super::quant::STRIP;
/// Bytes of one block of a strip: 16 f16 scales and 16 × 32 levels.
pub const BLOCK_BYTES: usize = 2 * STRIP + 32 * STRIP;
/// Bytes of a strip block's scales (the levels follow).
const SCALES: usize = 2 * STRIP;

/// Whether a `[rows, cols]` Q8_0 matrix can be packed.
pub fn packable(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(STRIP) && cols.is_multiple_of(32) && rows > 0
}

/// Where level `k` (0..32) of row `r` (0..16) of a strip block sits, from the block's start.
#[inline]
fn level_at(r: usize, k: usize) -> usize {
    SCALES + (k / 4) * 64 + r * 4 + k % 4
}

/// Plain Q8_0 rows (`rows` × `cols`, `packable`) packed into strips.
pub fn pack(plain: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(packable(rows, cols), "Q8_0x16 needs rows in 16s and whole blocks");
    let nb = cols / 32;
    let rb = nb * 34;
    assert_eq!(plain.len(), rows * rb, "Q8_0 matrix size");
    let mut out = vec![0u8; plain.len()];
    use rayon::prelude::*;
    out.par_chunks_exact_mut(STRIP * rb).enumerate().for_each(|(s, strip)| {
        for (b, dst) in strip.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            for r in 0..STRIP {
                let src = &plain[(s * STRIP + r) * rb + b * 34..][..34];
                dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                for (k, &q) in src[2..].iter().enumerate() {
                    dst[level_at(r, k)] = q ^ 0x80;
                }
            }
        }
    });
    out
}

/// Whether this process's kernels read packed Q8_0 faster than plain (AVX-512 VNNI, whatever the
/// selected level above it), so that loading should pack (`quantize::pack_for_kernels`).
pub fn pays() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use super::Isa;
        matches!(super::isa(), Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx) && super::avx512_quant::supported()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Row `r`'s blocks in a packed matrix, in column order: each as its f16 scale's bytes and its 32
/// levels as stored (plus 128).
fn row_blocks<'a>(w: &QMatRef<'a>, r: usize) -> impl Iterator<Item = ([u8; 2], [u8; 32])> + 'a {
    debug_assert_eq!(w.qtype, QType::Q8_0x16);
    let sb = STRIP * (w.cols / 32) * 34;
    let i = r % STRIP;
    w.data[(r / STRIP) * sb..][..sb]
        .chunks_exact(BLOCK_BYTES)
        .map(move |src| ([src[2 * i], src[2 * i + 1]], std::array::from_fn(|k| src[level_at(i, k)])))
}

/// Row `r` of a packed matrix as plain Q8_0 bytes (`out`: one row's).
pub fn unpack_row(w: &QMatRef, r: usize, out: &mut [u8]) {
    assert_eq!(out.len(), w.cols / 32 * 34, "Q8_0 row size");
    for ((d, q), dst) in row_blocks(w, r).zip(out.chunks_exact_mut(34)) {
        dst[..2].copy_from_slice(&d);
        for (o, v) in dst[2..].iter_mut().zip(q) {
            *o = v ^ 0x80;
        }
    }
}

/// Row `r` of a packed matrix dequantized (what plain Q8_0 dequantizes to).
pub fn dequantize_row(w: &QMatRef, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), w.cols, "dequantize_row shapes");
    for ((d, q), o) in row_blocks(w, r).zip(out.chunks_exact_mut(32)) {
        let d = f16::from_le_bytes(d).to_f32();
        for (o, v) in o.iter_mut().zip(q) {
            *o = d * ((v ^ 0x80) as i8) as f32;
        }
    }
}

/// Per activation row and block, `-128 ·` the sum of the block's levels: what a block's product with
/// the stored (offset) levels must be corrected by (`[rows, blocks]`).
pub fn offsets(acts: &QActs, out: &mut Vec<i32>) {
    out.clear();
    out.extend(acts.qs.chunks_exact(32).map(|b| -128 * b.iter().map(|&v| v as i32).sum::<i32>()));
}

/// The product of activation rows and a packed chunk on the portable path: each output gets exactly
/// the operations the SIMD kernels give it (see the module's "Bits").
pub fn matmul_scalar(acts: &QActs, offs: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    let nb = w.cols / 32;
    for (s, strip) in w.data.chunks_exact(STRIP * nb * 34).enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            let (x, dx) = (acts.row_qs(i), acts.row_d(i));
            let mut acc = [0f32; STRIP];
            for (b, blk) in strip.chunks_exact(BLOCK_BYTES).enumerate() {
                let xb = &x[b * 32..b * 32 + 32];
                for (r, a) in acc.iter_mut().enumerate() {
                    let isum: i32 = offs[i * nb + b]
                        + xb.iter().enumerate().map(|(k, &v)| blk[level_at(r, k)] as i32 * v as i32).sum::<i32>();
                    let dw = f16::from_le_bytes([blk[2 * r], blk[2 * r + 1]]).to_f32();
                    *a = (isum as f32).mul_add(dw * dx[b], *a);
                }
            }
            o[s * STRIP..s * STRIP + STRIP].copy_from_slice(&acc);
        }
    }
}

/// The product of activation rows and a packed chunk (`out[i]`: the chunk's rows), on the best kernel
/// `isa` allows.
pub fn matmul(isa: super::Isa, acts: &QActs, offs: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    super::quant::check_strips(QType::Q8_0x16, acts, offs, 1, &w, out);
    #[cfg(target_arch = "x86_64")]
    {
        if vnni(isa) {
            return simd::matmul_vnni(acts, offs, w, out);
        }
    }
    let _ = isa;
    matmul_scalar(acts, offs, w, out)
}

/// Whether `isa` (as this CPU can run it) takes the strips' AVX-512 VNNI kernels.
#[cfg(target_arch = "x86_64")]
pub(super) fn vnni(isa: super::Isa) -> bool {
    use super::Isa;
    matches!(super::runnable(isa), Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx) && super::avx512_quant::supported()
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use super::*;
    use std::arch::x86_64::*;

    /// Blocks ahead of the one in hand that a tile prefetches (2 KB per strip). Measured with
    /// `matmul_bench --quant q8_0x16` from memory on the Xeon, into L1: five rows over [6144, 1536]
    /// 437 µs without, 377 at 4 blocks, 388 at 6; one row unchanged. On Zen 4 the hardware prefetcher
    /// keeps a strip's single stream fed and prefetching into L1 only cost: one row 298-310 µs without
    /// against 329-347 with, five rows 313-343 against 387-440; into L2 at five rows and more it pays a
    /// little (five rows 473-487 against 500-509 in a slower phase; the shipped pair's 6-row Q8_0
    /// verify, three alternations, 0.74-1.00 ms against 0.76-1.07), so Zen 4 prefetches that way
    /// only (docs/quantization.md, "Q8_0 in 16-row strips").
    const PREFETCH: usize = 4;

    /// The prefetch for a tile of `c` activation rows on this CPU: blocks ahead (0: none), and
    /// whether into L2 rather than L1.
    fn prefetch(c: usize) -> (usize, bool) {
        match (super::super::x86::zen4(), c >= 5) {
            (false, _) => (PREFETCH, false),
            (true, true) => (PREFETCH, true),
            (true, false) => (0, false),
        }
    }

    /// The most activation rows a tile takes (accumulators: `2 · C` i32 and `C` f32 per strip).
    const GROUP_MAX: usize = 7;

    /// The product on AVX-512 VNNI: strips outside, groups of up to 8 activation rows inside (a
    /// strip's 544-byte blocks read from memory once, from L1 by the later groups).
    pub(super) fn matmul_vnni(acts: &QActs, offs: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
        assert!(super::super::avx512_quant::supported(), "VNNI kernel on a CPU without it");
        let m = acts.rows;
        let nb = w.cols / 32;
        let strips = w.rows / STRIP;
        let groups = m.div_ceil(GROUP_MAX);
        let sb = STRIP * nb * 34;
        let mut s = 0;
        while s < strips {
            // Strips per tile: four for one row (eight i32 chains hide vpdpbusd's latency), two for
            // up to seven rows (two i32 chains per output up to four rows, one from five), one beyond.
            let per = |c: usize| match c {
                1 => 4,
                2..=7 => 2,
                _ => 1,
            };
            let r = per(m.div_ceil(groups)).min(strips - s);
            for g in 0..groups {
                let (i0, c) = (g * m / groups, (g + 1) * m / groups - g * m / groups);
                let ws = w.data[s * sb..].as_ptr();
                let (pf, l2) = prefetch(c);
                // SAFETY: VNNI checked above; `r` strips from `s` and rows `i0..i0 + c` exist.
                unsafe {
                    match (r, c) {
                        (4, 1) => tile::<4, 1, true>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 2) => tile::<2, 2, true>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 3) => tile::<2, 3, true>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 4) => tile::<2, 4, true>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 5) => tile::<2, 5, false>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 6) => tile::<2, 6, false>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (2, 7) => tile::<2, 7, false>(acts, offs, ws, sb, nb, (pf, l2), i0, s, out),
                        (_, c) => {
                            for t in 0..r {
                                let (p, st) = (ws.add(t * sb), s + t);
                                match c {
                                    1 => tile::<1, 1, true>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    2 => tile::<1, 2, true>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    3 => tile::<1, 3, true>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    4 => tile::<1, 4, true>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    5 => tile::<1, 5, false>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    6 => tile::<1, 6, false>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    7 => tile::<1, 7, false>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                    _ => tile::<1, 8, false>(acts, offs, p, sb, nb, (pf, l2), i0, st, out),
                                }
                            }
                        }
                    }
                }
            }
            s += r;
        }
    }

    /// `R` strips (the first at `ws`, `sb` bytes apart; strip index `s0` in the chunk) times activation
    /// rows `i0..i0 + C`, prefetching `pf` blocks ahead (0: not at all), into L2 if `l2`.
    ///
    /// # Safety
    /// AVX-512 VNNI CPU; the strips and rows exist.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const C: usize, const SPLIT: bool>(
        acts: &QActs,
        offs: &[i32],
        ws: *const u8,
        sb: usize,
        nb: usize,
        (pf, l2): (usize, bool),
        i0: usize,
        s0: usize,
        out: &mut [&mut [f32]],
    ) {
        let k = acts.cols;
        let x = acts.qs.as_ptr().add(i0 * k) as *const i32;
        let dx = acts.d.as_ptr().add(i0 * nb);
        let off = offs.as_ptr().add(i0 * nb);
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for b in 0..nb {
            let mut lo = [[_mm512_setzero_si512(); C]; R];
            let mut hi = [[_mm512_setzero_si512(); C]; R];
            for c in 0..C {
                let o = _mm512_set1_epi32(*off.add(c * nb + b));
                for lr in lo.iter_mut() {
                    lr[c] = o;
                }
            }
            // The block `pf` ahead of each strip: a strip is one stream, which the Xeon's hardware
            // prefetchers alone kept too few lines ahead of a multi-row tile (`PREFETCH`).
            if pf > 0 && b + pf < nb {
                for r in 0..R {
                    let p = ws.add(r * sb + (b + pf) * BLOCK_BYTES);
                    for j in 0..9 {
                        if l2 {
                            _mm_prefetch::<_MM_HINT_T1>(p.add(j * 64).cast());
                        } else {
                            _mm_prefetch::<_MM_HINT_T0>(p.add(j * 64).cast());
                        }
                    }
                }
            }
            for l in 0..8 {
                for (r, (lr, hr)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                    let wv = _mm512_loadu_si512(ws.add(r * sb + b * BLOCK_BYTES + SCALES + l * 64).cast());
                    for c in 0..C {
                        let xv = _mm512_set1_epi32(x.add((c * k + b * 32) / 4 + l).read_unaligned());
                        if !SPLIT || l % 2 == 0 {
                            lr[c] = _mm512_dpbusd_epi32(lr[c], wv, xv);
                        } else {
                            hr[c] = _mm512_dpbusd_epi32(hr[c], wv, xv);
                        }
                    }
                }
            }
            for r in 0..R {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.add(r * sb + b * BLOCK_BYTES).cast()));
                for c in 0..C {
                    let isum = if SPLIT { _mm512_add_epi32(lo[r][c], hi[r][c]) } else { lo[r][c] };
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(c * nb + b)));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r][c]);
                }
            }
        }
        for (r, ar) in acc.iter().enumerate() {
            for (c, a) in ar.iter().enumerate() {
                _mm512_storeu_ps(out[i0 + c][(s0 + r) * STRIP..].as_mut_ptr(), *a);
            }
        }
    }
}
