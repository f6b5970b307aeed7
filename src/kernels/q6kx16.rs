//! Q6_K packed in strips of 16 rows (`QType::Q6_Kx16`): the layout a Q6_K matrix is repacked into at
//! load on CPUs with AVX-512 VNNI, as Q4_K is (`q4kx16`, whose module notes explain the idea). Each
//! lane of a `vpdpbusd` is one weight row; a sub-block of 16 takes four of them, started from the
//! activations' offset term, then one `vpmulld` by the 16 rows' scales; the float work is once per
//! super-block for 16 rows (docs/quantization.md, "Q4_K and Q6_K in 16-row strips").
//!
//! Layout: rows `16s..16s + 16` form strip `s`, `BLOCK_BYTES` per super-block of 256 columns, the
//! super-blocks in column order. A strip super-block is
//! - the 16 rows' f16 `d` (32 bytes);
//! - the i8 sub-block scales, sub-block after sub-block, 16 rows each (256 bytes);
//! - per sub-block `g` of 16 columns, 192 bytes: two lines of 64 bytes of the levels' low 4 bits, line
//!   `h` holding, row after row, 4 bytes whose low nibbles are the row's levels `16g + 8h .. 16g + 8h +
//!   4` and whose high nibbles are the next four (as in `q4kx16`); then a line of their top 2 bits,
//!   byte `4r + e` holding, from bit 0 up, those of level `e` of row `r` in line 0's low nibbles, its
//!   high nibbles, line 1's low nibbles, its high nibbles.
//!
//! So a strip is read front to back as one stream. That is 3,360 bytes for the 16 rows' 3,360 of
//! plain Q6_K: 210 bytes per row and super-block.
//!
//! Bits: both kernels here (portable, AVX-512 VNNI) compute, for weight row `j` and activation row
//! `i`, per super-block the exact integer `T = Σ_sub sc · (Σ q · x − 32 · Σ x)` (levels `q` in
//! 0..64), then `acc = fma(f32(T), d · d_x, acc)`, super-block after super-block from zero.

pub use super::quant::STRIP;
use super::quant::{unpack, QActs, QMatRef, QType, Unpacked, QK_K};
use half::f16;

/// Bytes per row and super-block (as plain Q6_K).
pub const ROW_BYTES: usize = 210;
/// Bytes of one super-block of a strip.
pub const BLOCK_BYTES: usize = STRIP * ROW_BYTES;
/// Offsets inside a strip super-block: scales, then the sub-blocks' 192 bytes of levels (`d` at 0).
const SC: usize = 2 * STRIP;
const LEVELS: usize = SC + 16 * STRIP;
/// Bytes of a sub-block's levels in a strip.
const SUB: usize = 3 * 64;

/// Whether a `[rows, cols]` Q6_K matrix can be packed.
pub fn packable(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(STRIP) && cols.is_multiple_of(QK_K) && rows > 0
}

/// Where level `k` (0..256) of row `r` sits: the byte of its low 4 bits and whether they are its high
/// nibble; the byte of its top 2 bits and their shift.
#[inline]
fn level_at(r: usize, k: usize) -> ((usize, bool), (usize, u32)) {
    let (g, h, high) = (k / 16, k % 16 / 8, k % 8 >= 4);
    let at = LEVELS + g * SUB + 4 * r + k % 4;
    ((at + 64 * h, high), (at + 128, (2 * (2 * h + high as usize)) as u32))
}

/// Level `k` (0..64) of row `r` of a strip super-block.
#[inline]
fn level(blk: &[u8], r: usize, k: usize) -> u8 {
    let ((lo, high), (hi, shift)) = level_at(r, k);
    let nib = if high { blk[lo] >> 4 } else { blk[lo] & 0x0f };
    nib | (((blk[hi] >> shift) & 3) << 4)
}

/// Plain Q6_K rows (`rows` × `cols`, `packable`) packed into strips.
pub fn pack(plain: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(packable(rows, cols), "Q6_Kx16 needs rows in 16s and whole super-blocks");
    let nb = cols / QK_K;
    let rb = nb * ROW_BYTES;
    assert_eq!(plain.len(), rows * rb, "Q6_K matrix size");
    let mut out = vec![0u8; plain.len()];
    use rayon::prelude::*;
    out.par_chunks_exact_mut(nb * BLOCK_BYTES).enumerate().for_each(|(s, strip)| {
        let mut u = Unpacked::new();
        for (b, dst) in strip.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            for r in 0..STRIP {
                let src = &plain[(s * STRIP + r) * rb + b * ROW_BYTES..][..ROW_BYTES];
                unpack(QType::Q6_K, src, &mut u);
                dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
                for g in 0..16 {
                    dst[SC + STRIP * g + r] = src[192 + g];
                }
                for k in 0..QK_K {
                    let q = (u.q[k] + 32) as u8;
                    let ((lo, high), (hi, shift)) = level_at(r, k);
                    dst[lo] |= if high { (q & 0x0f) << 4 } else { q & 0x0f };
                    dst[hi] |= (q >> 4) << shift;
                }
            }
        }
    });
    out
}

/// Row `r`'s super-blocks in a packed matrix, in column order, each as plain Q6_K bytes (what
/// `QMatRef::unpack_row` and `row_f32` read).
pub(super) fn row_blocks<'a>(w: &QMatRef<'a>, r: usize) -> impl Iterator<Item = [u8; ROW_BYTES]> + 'a {
    debug_assert_eq!(w.qtype, QType::Q6_Kx16);
    let sb = STRIP * (w.cols / QK_K) * ROW_BYTES;
    let i = r % STRIP;
    w.data[(r / STRIP) * sb..][..sb].chunks_exact(BLOCK_BYTES).map(move |src| {
        let mut o = [0u8; ROW_BYTES];
        // Plain: per half h, ql byte l holds levels 128h + l (low nibble) and 128h + 64 + l; byte
        // 32 + l levels 128h + 32 + l and 128h + 96 + l; qh byte l their top bits, two by two.
        for h in 0..2 {
            for l in 0..32 {
                let q = |t: usize| level(src, i, 128 * h + l + 32 * t);
                o[64 * h + l] = (q(0) & 0x0f) | ((q(2) & 0x0f) << 4);
                o[64 * h + l + 32] = (q(1) & 0x0f) | ((q(3) & 0x0f) << 4);
                o[128 + 32 * h + l] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
            }
        }
        for g in 0..16 {
            o[192 + g] = src[SC + STRIP * g + i];
        }
        o[208..210].copy_from_slice(&src[2 * i..2 * i + 2]);
        o
    })
}

/// Per activation row and super-block, `-32 ·` the sum of each sub-block of 16 (`[rows,
/// super-blocks, 16]`): what a sub-block's product with the stored (offset) levels must be corrected by.
pub fn offsets(acts: &QActs, out: &mut Vec<i32>) {
    out.clear();
    out.extend(acts.bsums.iter().map(|&b| -32 * b as i32));
}

/// The product of activation rows and a packed chunk on the portable path: each output gets exactly
/// the operations the SIMD kernel gives it (see the module's "Bits").
pub fn matmul_scalar(acts: &QActs, offs: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    let nb = w.cols / QK_K;
    for (s, strip) in w.data.chunks_exact(STRIP * nb * ROW_BYTES).enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            let (x, dx) = (acts.row_qs(i), acts.row_d(i));
            let mut acc = [0f32; STRIP];
            for (b, blk) in strip.chunks_exact(BLOCK_BYTES).enumerate() {
                let xb = &x[b * QK_K..(b + 1) * QK_K];
                let off = &offs[(i * nb + b) * 16..][..16];
                for (r, a) in acc.iter_mut().enumerate() {
                    let mut t = 0i32;
                    for (g, &o) in off.iter().enumerate() {
                        let isum: i32 =
                            o + (16 * g..16 * g + 16).map(|k| level(blk, r, k) as i32 * xb[k] as i32).sum::<i32>();
                        t += blk[SC + STRIP * g + r] as i8 as i32 * isum;
                    }
                    let d = f16::from_le_bytes([blk[2 * r], blk[2 * r + 1]]).to_f32();
                    *a = (t as f32).mul_add(d * dx[b], *a);
                }
            }
            o[s * STRIP..s * STRIP + STRIP].copy_from_slice(&acc);
        }
    }
}

/// The product of activation rows and a packed chunk (`out[i]`: the chunk's rows), on the best kernel
/// `isa` allows.
pub fn matmul(isa: super::Isa, acts: &QActs, offs: &[i32], w: QMatRef, out: &mut [&mut [f32]]) {
    super::quant::check_strips(QType::Q6_Kx16, acts, offs, 16, &w, out);
    #[cfg(target_arch = "x86_64")]
    {
        if super::q8x16::vnni(isa) {
            return super::q4kx16::simd::run::<simd::Q6K>(acts, offs, w, out);
        }
    }
    let _ = isa;
    matmul_scalar(acts, offs, w, out)
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::*;
    use std::arch::x86_64::*;

    /// Q6_K strips.
    pub(in super::super) struct Q6K;

    impl super::super::q4kx16::simd::Tiles for Q6K {
        const ROW_BYTES: usize = ROW_BYTES;

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn tile<const R: usize, const C: usize>(
            acts: &QActs,
            offs: &[i32],
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
            let off = offs.as_ptr().add(i0 * nb * 16);
            let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            for b in 0..nb {
                super::super::q4kx16::simd::prefetch_ahead::<R>(ws, sb, BLOCK_BYTES, b + pf, pf > 0 && b + pf < nb);
                let blk = |r: usize| ws.add(r * sb + b * BLOCK_BYTES);
                let mut t = [[_mm512_setzero_si512(); C]; R];
                for g in 0..16 {
                    let mut s = [[_mm512_setzero_si512(); C]; R];
                    for (r, sr) in s.iter_mut().enumerate() {
                        let lines = blk(r).add(LEVELS + g * SUB);
                        let h = _mm512_loadu_si512(lines.add(128).cast());
                        let tops = [_mm512_slli_epi16::<4>(h), _mm512_slli_epi16::<2>(h), h, _mm512_srli_epi16::<2>(h)];
                        for (c, sc) in sr.iter_mut().enumerate() {
                            *sc = _mm512_set1_epi32(*off.add((c * nb + b) * 16 + g));
                        }
                        for half in 0..2 {
                            let line = _mm512_loadu_si512(lines.add(64 * half).cast());
                            let lo = _mm512_ternarylogic_epi32::<0xf8>(_mm512_and_si512(line, m4), tops[2 * half], m30);
                            let hi = _mm512_ternarylogic_epi32::<0xf8>(
                                _mm512_and_si512(_mm512_srli_epi16::<4>(line), m4),
                                tops[2 * half + 1],
                                m30,
                            );
                            for (c, sc) in sr.iter_mut().enumerate() {
                                let xi = x.add((c * k + b * QK_K + 16 * g + 8 * half) / 4);
                                *sc = _mm512_dpbusd_epi32(*sc, lo, _mm512_set1_epi32(xi.read_unaligned()));
                                *sc = _mm512_dpbusd_epi32(*sc, hi, _mm512_set1_epi32(xi.add(1).read_unaligned()));
                            }
                        }
                    }
                    for r in 0..R {
                        let scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(blk(r).add(SC + STRIP * g).cast()));
                        for c in 0..C {
                            t[r][c] = _mm512_add_epi32(t[r][c], _mm512_mullo_epi32(s[r][c], scale));
                        }
                    }
                }
                for r in 0..R {
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk(r).cast()));
                    for c in 0..C {
                        let dxv = _mm512_set1_ps(*dx.add(c * nb + b));
                        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), _mm512_mul_ps(d, dxv), acc[r][c]);
                    }
                }
            }
            super::super::q4kx16::simd::store(&acc, out, i0, s0);
        }
    }
}
