//! Q4_K packed in strips of 16 rows (`QType::Q4_Kx16`): the layout a Q4_K matrix is repacked into at
//! load on CPUs with AVX-512 VNNI, as Q8_0 is (`q8x16`). One `vpdpbusd` multiplies 4 levels of 16
//! weight rows by 4 levels of an activation row broadcast to every lane, so each lane ends a sub-block
//! holding one weight row's exact sub-block sum, and the per-super-block float work is done once for
//! 16 weight rows instead of once per row (docs/quantization.md, "Q4_K and Q6_K in 16-row
//! strips").
//!
//! Layout: rows `16s..16s + 16` form strip `s`, `BLOCK_BYTES` per super-block of 256 columns, the
//! super-blocks in column order. A strip super-block is
//! - the 16 rows' f16 `d` (32 bytes), then their f16 `dmin` (32 bytes);
//! - the 6-bit sub-block scales as bytes, sub-block after sub-block, 16 rows each (128 bytes);
//! - the 6-bit minimums as bytes in pairs of sub-blocks: for pair `t`, row after row, the minimums of
//!   sub-blocks `2t` and `2t + 1` (128 bytes), so that widening 32 bytes to i16 gives each i32 lane
//!   one row's pair;
//! - 32 lines of 64 bytes of levels: line `4j + q` holds, row after row, 4 bytes whose low nibbles are
//!   the row's levels `32j + 8q .. 32j + 8q + 4` and whose high nibbles are the next four.
//!
//! That is 2,368 bytes for the 16 rows' 2,304 of plain Q4_K (the scales unpacked from their 12 bytes):
//! 148 bytes per row and super-block.
//!
//! Bits: both kernels here (portable, AVX-512 VNNI) compute, for weight row `j` and activation row
//! `i`, per super-block the exact integers `T = Σ_sub sc · (Σ q · x)` and `M = Σ_sub m · (Σ x)`, then
//! `acc = fma(f32(T), d · d_x, acc)` and `acc = fma(-f32(M), dmin · d_x, acc)`, super-block after
//! super-block from zero. Nothing depends on the number of rows, the tile or the thread split, and the
//! two give the same bits.

pub use super::quant::STRIP;
use super::quant::{scale_min_k4, QActs, QMatRef, QType, QK_K};
use half::f16;

/// Bytes of one super-block of a strip.
pub const BLOCK_BYTES: usize = STRIP * ROW_BYTES;
/// Bytes per row and super-block in the packed layout.
pub const ROW_BYTES: usize = 148;
/// Offsets inside a strip super-block: `dmin`, scales, minimums, levels (`d` at 0).
const DMIN: usize = 2 * STRIP;
const SC: usize = 4 * STRIP;
const MN: usize = SC + 8 * STRIP;
const LEVELS: usize = MN + 8 * STRIP;
/// Bytes of a plain Q4_K super-block.
const PLAIN: usize = 144;

/// Whether a `[rows, cols]` Q4_K matrix can be packed.
pub fn packable(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(STRIP) && cols.is_multiple_of(QK_K) && rows > 0
}

/// Where the byte holding level `k` (0..256) of row `r` (0..16) sits from the super-block's start,
/// and whether it is the high nibble.
#[inline]
fn level_at(r: usize, k: usize) -> (usize, bool) {
    let (j, e) = (k / 32, k % 32);
    (LEVELS + (4 * j + e / 8) * 64 + 4 * r + e % 4, e % 8 >= 4)
}

/// Where the minimum of sub-block `j` of row `r` sits.
#[inline]
fn min_at(r: usize, j: usize) -> usize {
    MN + (j / 2) * 32 + 2 * r + j % 2
}

/// Plain Q4_K rows (`rows` × `cols`, `packable`) packed into strips.
pub fn pack(plain: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(packable(rows, cols), "Q4_Kx16 needs rows in 16s and whole super-blocks");
    let nb = cols / QK_K;
    let rb = nb * PLAIN;
    assert_eq!(plain.len(), rows * rb, "Q4_K matrix size");
    let mut out = vec![0u8; rows * nb * ROW_BYTES];
    use rayon::prelude::*;
    out.par_chunks_exact_mut(nb * BLOCK_BYTES).enumerate().for_each(|(s, strip)| {
        for (b, dst) in strip.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            for r in 0..STRIP {
                let src = &plain[(s * STRIP + r) * rb + b * PLAIN..][..PLAIN];
                dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                dst[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&src[2..4]);
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, &src[4..16]);
                    dst[SC + STRIP * j + r] = sc;
                    dst[min_at(r, j)] = m;
                }
                // Plain: chunk c's byte l holds level 64c + l (low nibble) and 64c + 32 + l (high).
                for c in 0..4 {
                    for l in 0..32 {
                        let v = src[16 + 32 * c + l];
                        for (k, q) in [(64 * c + l, v & 0x0f), (64 * c + 32 + l, v >> 4)] {
                            let (at, high) = level_at(r, k);
                            dst[at] |= if high { q << 4 } else { q };
                        }
                    }
                }
            }
        }
    });
    out
}

/// Row `r`'s super-blocks in a packed matrix, in column order, each as plain Q4_K bytes (what
/// `QMatRef::unpack_row` and `row_f32` read).
pub(super) fn row_blocks<'a>(w: &QMatRef<'a>, r: usize) -> impl Iterator<Item = [u8; PLAIN]> + 'a {
    debug_assert_eq!(w.qtype, QType::Q4_Kx16);
    let sb = STRIP * (w.cols / QK_K) * ROW_BYTES;
    let i = r % STRIP;
    w.data[(r / STRIP) * sb..][..sb].chunks_exact(BLOCK_BYTES).map(move |src| {
        let mut o = [0u8; PLAIN];
        o[..2].copy_from_slice(&src[2 * i..2 * i + 2]);
        o[2..4].copy_from_slice(&src[DMIN + 2 * i..DMIN + 2 * i + 2]);
        // The 6-bit scales and minimums back into their 12 bytes (the inverse of `scale_min_k4`).
        let s = &mut o[4..16];
        for j in 0..8 {
            let (sc, m) = (src[SC + STRIP * j + i], src[min_at(i, j)]);
            if j < 4 {
                s[j] |= sc;
                s[j + 4] |= m;
            } else {
                s[j + 4] = (sc & 0x0f) | ((m & 0x0f) << 4);
                s[j - 4] |= (sc >> 4) << 6;
                s[j] |= (m >> 4) << 6;
            }
        }
        for c in 0..4 {
            for l in 0..32 {
                let nib = |k: usize| {
                    let (at, high) = level_at(i, k);
                    if high {
                        src[at] >> 4
                    } else {
                        src[at] & 0x0f
                    }
                };
                o[16 + 32 * c + l] = nib(64 * c + l) | (nib(64 * c + 32 + l) << 4);
            }
        }
        o
    })
}

/// Per activation row and super-block, the sums of its 8 sub-blocks of 32 (from the Q8_K sums of 16)
/// as i16 pairs, sub-blocks `2t` and `2t + 1` in word `t` (`[rows, super-blocks, 4]`): what the
/// minimums multiply.
pub fn sub_sums(acts: &QActs, out: &mut Vec<i32>) {
    out.clear();
    out.extend(acts.bsums.chunks_exact(4).map(|b| {
        let lo = (b[0] as i32 + b[1] as i32) as i16 as u16 as u32;
        let hi = (b[2] as i32 + b[3] as i32) as i16 as u16 as u32;
        (lo | (hi << 16)) as i32
    }));
}

/// The sum of sub-block `j`'s 32 activations from `sub_sums`' words.
#[inline]
fn sub_sum(words: &[i32], j: usize) -> i32 {
    let w = words[j / 2] as u32;
    (if j.is_multiple_of(2) { w as u16 } else { (w >> 16) as u16 }) as i16 as i32
}

/// The product of activation rows and a packed chunk on the portable path: each output gets exactly
/// the operations the SIMD kernel gives it (see the module's "Bits").
pub fn matmul_scalar(acts: &QActs, sums: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    let nb = w.cols / QK_K;
    for (s, strip) in w.data.chunks_exact(STRIP * nb * ROW_BYTES).enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            let (x, dx) = (acts.row_qs(i), acts.row_d(i));
            let mut acc = [0f32; STRIP];
            for (b, blk) in strip.chunks_exact(BLOCK_BYTES).enumerate() {
                let xb = &x[b * QK_K..(b + 1) * QK_K];
                let words = &sums[(i * nb + b) * 4..][..4];
                for (r, a) in acc.iter_mut().enumerate() {
                    let (mut t, mut m) = (0i32, 0i32);
                    for j in 0..8 {
                        let isum: i32 = (32 * j..32 * j + 32)
                            .map(|k| {
                                let (at, high) = level_at(r, k);
                                let q = if high { blk[at] >> 4 } else { blk[at] & 0x0f };
                                q as i32 * xb[k] as i32
                            })
                            .sum();
                        t += blk[SC + STRIP * j + r] as i32 * isum;
                        m += blk[min_at(r, j)] as i32 * sub_sum(words, j);
                    }
                    let d = f16::from_le_bytes([blk[2 * r], blk[2 * r + 1]]).to_f32();
                    let dmin = f16::from_le_bytes([blk[DMIN + 2 * r], blk[DMIN + 2 * r + 1]]).to_f32();
                    *a = (t as f32).mul_add(d * dx[b], *a);
                    *a = (-(m as f32)).mul_add(dmin * dx[b], *a);
                }
            }
            o[s * STRIP..s * STRIP + STRIP].copy_from_slice(&acc);
        }
    }
}

/// The product of activation rows and a packed chunk (`out[i]`: the chunk's rows), on the best kernel
/// `isa` allows.
pub fn matmul(isa: super::Isa, acts: &QActs, sums: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    super::quant::check_strips(QType::Q4_Kx16, acts, sums, 4, &w, out);
    #[cfg(target_arch = "x86_64")]
    {
        if super::q8x16::vnni(isa) {
            return simd::run::<simd::Q4K>(acts, sums, w, out);
        }
    }
    let _ = isa;
    matmul_scalar(acts, sums, w, out)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use super::*;
    use std::arch::x86_64::*;

    /// Super-blocks ahead of the one in hand that a tile prefetches into L2. On Zen 4 only tiles of
    /// five rows or more do (one strip each, much work per byte, which the hardware prefetcher alone
    /// let stall on memory; fewer rows lost to it): `matmul_bench --quant q4_kx16` / `q6_kx16`, two
    /// threads from memory, [6144, 1536], µs without → with: Q4_K five rows 272-283 → 257-282, eight
    /// 382-396 → 311-338; Q6_K five 366-379 → 335-340, eight 482-490 → 398-406; but two rows 208-219
    /// → 217-236 and Q6_K three 264-279 → 309-325. Elsewhere every tile does, as the Q8_0 strips
    /// were measured to want on the Xeon (not measured there for these).
    const PREFETCH: usize = 1;

    /// The most activation rows a tile takes (registers: an i32 sub-block sum and an i32 super-block
    /// sum per strip and row, the f32 accumulators beside them).
    const GROUP_MAX: usize = 8;

    /// A k-quant strip layout's kernel: `R` strips (the first at `ws`, `sb` bytes apart; strip index
    /// `s0` in the chunk) times activation rows `i0..i0 + C`, with the activations' per-super-block
    /// words `words` (the layout's own: `sub_sums`, `q6kx16::offsets`), prefetching `pf` super-blocks
    /// ahead (0: none).
    pub(in super::super) trait Tiles {
        /// Bytes per row and super-block.
        const ROW_BYTES: usize;
        /// # Safety
        /// AVX-512 VNNI CPU; the strips and rows exist.
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile<const R: usize, const C: usize>(
            acts: &QActs,
            words: &[i32],
            ws: *const u8,
            sb: usize,
            nb: usize,
            pf: usize,
            i0: usize,
            s0: usize,
            out: &mut [&mut [f32]],
        );
    }

    /// Q4_K strips.
    pub(in super::super) struct Q4K;

    /// If `go`, block `at` (of `block` bytes) of each of a tile's `R` strips (`sb` bytes apart from `ws`)
    /// asked for into L2.
    ///
    /// # Safety
    /// AVX-512 CPU (a prefetch itself never faults).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in super::super) unsafe fn prefetch_ahead<const R: usize>(
        ws: *const u8,
        sb: usize,
        block: usize,
        at: usize,
        go: bool,
    ) {
        if go {
            for r in 0..R {
                let p = ws.wrapping_add(r * sb + at * block);
                for j in 0..block.div_ceil(64) {
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(j * 64).cast());
                }
            }
        }
    }

    /// A tile's accumulators (strip `r`, activation row `c`) into rows `i0 + c` of `out`, at strip
    /// `s0 + r`'s 16 columns.
    ///
    /// # Safety
    /// AVX-512 CPU; the rows and columns exist.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in super::super) unsafe fn store<const R: usize, const C: usize>(
        acc: &[[__m512; C]; R],
        out: &mut [&mut [f32]],
        i0: usize,
        s0: usize,
    ) {
        for (r, ar) in acc.iter().enumerate() {
            for (c, a) in ar.iter().enumerate() {
                _mm512_storeu_ps(out[i0 + c][(s0 + r) * STRIP..].as_mut_ptr(), *a);
            }
        }
    }

    /// The product on AVX-512 VNNI: strips outside, groups of up to `GROUP_MAX` activation rows inside
    /// (a strip's super-blocks read from memory once, from L1/L2 by the later groups).
    pub(in super::super) fn run<F: Tiles>(acts: &QActs, words: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
        assert!(super::super::avx512_quant::supported(), "VNNI kernel on a CPU without it");
        let m = acts.rows;
        let nb = w.cols / QK_K;
        let strips = w.rows / STRIP;
        let groups = m.div_ceil(GROUP_MAX);
        let sb = STRIP * nb * F::ROW_BYTES;
        let zen4 = super::super::x86::zen4();
        let mut s = 0;
        while s < strips {
            // Strips per tile: four for one row (four chains hide vpdpbusd's latency), two for up to
            // four rows, one beyond.
            let per = |c: usize| match c {
                1 => 4,
                2..=4 => 2,
                _ => 1,
            };
            let r = per(m.div_ceil(groups)).min(strips - s);
            for g in 0..groups {
                let (i0, c) = (g * m / groups, (g + 1) * m / groups - g * m / groups);
                let ws = w.data[s * sb..].as_ptr();
                let pf = if c >= 5 || !zen4 { PREFETCH } else { 0 };
                // SAFETY: VNNI checked above; `r` strips from `s` and rows `i0..i0 + c` exist.
                unsafe {
                    match (r, c) {
                        (4, 1) => F::tile::<4, 1>(acts, words, ws, sb, nb, pf, i0, s, out),
                        (2, 2) => F::tile::<2, 2>(acts, words, ws, sb, nb, pf, i0, s, out),
                        (2, 3) => F::tile::<2, 3>(acts, words, ws, sb, nb, pf, i0, s, out),
                        (2, 4) => F::tile::<2, 4>(acts, words, ws, sb, nb, pf, i0, s, out),
                        (_, c) => {
                            for t in 0..r {
                                let (p, st) = (ws.add(t * sb), s + t);
                                match c {
                                    1 => F::tile::<1, 1>(acts, words, p, sb, nb, pf, i0, st, out),
                                    2 => F::tile::<1, 2>(acts, words, p, sb, nb, pf, i0, st, out),
                                    3 => F::tile::<1, 3>(acts, words, p, sb, nb, pf, i0, st, out),
                                    4 => F::tile::<1, 4>(acts, words, p, sb, nb, pf, i0, st, out),
                                    5 => F::tile::<1, 5>(acts, words, p, sb, nb, pf, i0, st, out),
                                    6 => F::tile::<1, 6>(acts, words, p, sb, nb, pf, i0, st, out),
                                    7 => F::tile::<1, 7>(acts, words, p, sb, nb, pf, i0, st, out),
                                    _ => F::tile::<1, 8>(acts, words, p, sb, nb, pf, i0, st, out),
                                }
                            }
                        }
                    }
                }
            }
            s += r;
        }
    }

    impl Tiles for Q4K {
        const ROW_BYTES: usize = ROW_BYTES;

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn tile<const R: usize, const C: usize>(
            acts: &QActs,
            sums: &[i32],
            ws: *const u8,
            sb: usize,
            nb: usize,
            pf: usize,
            i0: usize,
            s0: usize,
            out: &mut [&mut [f32]],
        ) {
            let k = acts.cols;
            let x = acts.qs.as_ptr().add(i0 * k) as *const i32;
            let dx = acts.d.as_ptr().add(i0 * nb);
            let words = sums.as_ptr().add(i0 * nb * 4);
            let nib = _mm512_set1_epi8(0x0f);
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            for b in 0..nb {
                prefetch_ahead::<R>(ws, sb, BLOCK_BYTES, b + pf, pf > 0 && b + pf < nb);
                let blk = |r: usize| ws.add(r * sb + b * BLOCK_BYTES);
                let mut t = [[_mm512_setzero_si512(); C]; R];
                for j in 0..8 {
                    let mut s = [[_mm512_setzero_si512(); C]; R];
                    for q in 0..4 {
                        for (r, sr) in s.iter_mut().enumerate() {
                            let line = _mm512_loadu_si512(blk(r).add(LEVELS + (4 * j + q) * 64).cast());
                            let lo = _mm512_and_si512(line, nib);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(line), nib);
                            for (c, sc) in sr.iter_mut().enumerate() {
                                let xi = x.add((c * k + b * QK_K + 32 * j + 8 * q) / 4);
                                *sc = _mm512_dpbusd_epi32(*sc, lo, _mm512_set1_epi32(xi.read_unaligned()));
                                *sc = _mm512_dpbusd_epi32(*sc, hi, _mm512_set1_epi32(xi.add(1).read_unaligned()));
                            }
                        }
                    }
                    for r in 0..R {
                        let scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk(r).add(SC + STRIP * j).cast()));
                        for c in 0..C {
                            t[r][c] = _mm512_add_epi32(t[r][c], _mm512_mullo_epi32(s[r][c], scale));
                        }
                    }
                }
                for r in 0..R {
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk(r).cast()));
                    let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk(r).add(DMIN).cast()));
                    for c in 0..C {
                        let wd = words.add((c * nb + b) * 4);
                        let mut mm = _mm512_setzero_si512();
                        for p in 0..4 {
                            let mins = _mm512_cvtepu8_epi16(_mm256_loadu_si256(blk(r).add(MN + 32 * p).cast()));
                            mm = _mm512_dpwssd_epi32(mm, mins, _mm512_set1_epi32(wd.add(p).read()));
                        }
                        let dxv = _mm512_set1_ps(*dx.add(c * nb + b));
                        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), _mm512_mul_ps(d, dxv), acc[r][c]);
                        acc[r][c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mm), _mm512_mul_ps(dmin, dxv), acc[r][c]);
                    }
                }
            }
            store(&acc, out, i0, s0);
        }
    }
}
