//! AMX matmul for bf16 weights (Intel Sapphire Rapids and later): `tdpbf16ps` multiplies a 16 × 32
//! bf16 tile of weights by a 32 × 16 tile of activations into 16 × 16 f32 accumulators, 8,192
//! multiply-adds in one instruction. On the machine tandem is measured on that is about 28x the
//! multiply-adds per nanosecond of `vdpbf16ps` (1,100 against 40 per core), so a forward over 16 rows
//! costs about what one row costs: reading the weights. See docs/numerics.md, "AMX".
//!
//! Layout: the weight tile is 16 weight rows × 32 K elements, loaded straight from the memory map
//! with the row stride (no repacking). The activations are rounded to bf16 once per call and packed
//! as the instruction's second operand wants them (`pack`): for each 32-element K step, 16 rows of
//! K pairs, each holding the pair of every activation row of the group. The result tile is then
//! weight rows × activation rows, stored and written out transposed.
//!
//! Bits: each output element accumulates its K pairs in order, one 32-element step after another,
//! starting from zero. Nothing depends on which other rows share the tile, on the number of rows
//! or on the thread split, so the kernel is batch invariant like the others. Its bits differ from
//! `avx512bf16`'s (that one keeps 16 partial sums and adds them by a tree), so `Isa::Amx` is its own
//! level and is used for every bf16 matmul of a process, one row or many.
//!
//! The tile registers need the kernel's permission (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, Linux 5.16+),
//! asked once in `supported`. The instructions are written with `asm!`: Rust has no stable AMX
//! intrinsics. A thread keeps its tile configuration from call to call and loads another only when
//! the number of activation rows per group changes.

use super::avx512::bf16_bits16;
use super::{DType, MatRef, Split};
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Weight rows per tile (the tile's row count) and K elements per step (64 bytes of bf16).
const TR: usize = 16;
const KS: usize = 32;
/// Activation rows of a result tile from which its write-out transposes the tile instead of gathering
/// each row's column (a gather costs about 4 ns here, a 16 x 16 transpose about 25).
const TRANSPOSE_FROM: usize = 6;

pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| super::avx512bf16::supported() && cpu_has_amx_bf16() && os_grants_tiles())
}

fn cpu_has_amx_bf16() -> bool {
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE. XCR0 bits 17/18: the OS saves tile state.
    // SAFETY: cpuid is always available on x86_64; xgetbv is checked for with OSXSAVE first.
    unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let l7 = __cpuid_count(7, 0);
        if l7.edx & (1 << 22) == 0 || l7.edx & (1 << 24) == 0 {
            return false;
        }
        if __cpuid(1).ecx & (1 << 27) == 0 {
            return false;
        }
        let (lo, _hi): (u32, u32);
        asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi, options(nomem, nostack, preserves_flags));
        lo & (0b11 << 17) == 0b11 << 17
    }
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only asks for permission to use the tile
    // registers; it touches no memory of ours. The syscall clobbers rcx and r11.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// The tile configuration `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
struct TileCfg {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Tiles 0-3: accumulators (16 weight rows × `mc` activation rows of f32); 4-5: weights (16 rows ×
/// 64 bytes); 6-7: activations (16 K pairs × `mc` rows of 4 bytes).
fn config(mc: usize) -> TileCfg {
    let mut c = TileCfg { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    for t in 0..8 {
        c.rows[t] = TR as u8;
        c.colsb[t] = if t == 4 || t == 5 { (KS * 2) as u16 } else { (mc * 4) as u16 };
    }
    c
}

thread_local! {
    /// The `mc` of the configuration this thread's tile registers hold (0: none). It is kept from
    /// call to call: `ldtilecfg` costs 70-200 ns here, as much as a small matmul's compute, and a
    /// decode step's matmuls all have the same number of activation rows.
    static CONFIGURED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Configure this thread's tiles for groups of `mc` activation rows, unless they are already.
///
/// # Safety
/// AMX usable by this process (`supported`).
unsafe fn configure(mc: usize) {
    if CONFIGURED.get() != mc {
        let cfg = config(mc);
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileCfg, options(nostack, readonly));
        CONFIGURED.set(mc);
    }
}

/// The activations as `tdpbf16ps`'s second operand: rows in groups of `mc`; group `g`, K step `s`
/// is a block of 16 lines (K pairs) of `mc` u32, each the bf16 pair of one activation row. Padding
/// (rows past `m`, K past `k`) is zero.
struct Packed {
    data: Vec<u32>,
    mc: usize,
    steps: usize,
}

impl Packed {
    fn block(&self, g: usize, s: usize) -> *const u32 {
        self.data[(g * self.steps + s) * TR * self.mc..].as_ptr()
    }
}

thread_local! {
    /// The packed activations' buffer, kept from call to call (every element is written by `pack`).
    static PACKED: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Transpose 16 vectors of 16 u32 in place: afterwards `r[p]` lane `c` is what `r[c]` lane `p` was.
///
/// # Safety
/// AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for b in (0..16).step_by(4) {
        r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for b in [0, 8] {
        for j in b..b + 4 {
            t[j] = _mm512_shuffle_i32x4::<0x88>(r[j], r[j + 4]);
            t[j + 4] = _mm512_shuffle_i32x4::<0xdd>(r[j], r[j + 4]);
        }
    }
    for j in 0..8 {
        r[j] = _mm512_shuffle_i32x4::<0x88>(t[j], t[j + 8]);
        r[j + 8] = _mm512_shuffle_i32x4::<0xdd>(t[j], t[j + 8]);
    }
}

/// # Safety
/// AVX-512 F/BW/VL (checked by `supported`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack(x: &[f32], m: usize, k: usize) -> Packed {
    // Groups of equal size (18 rows: two of 9, not 16 and 2): an activation tile costs its lines.
    let mc = m.div_ceil(m.div_ceil(16));
    let steps = k.div_ceil(KS);
    let groups = m.div_ceil(mc);
    let mut data = PACKED.take();
    data.resize(groups * steps * TR * mc, 0);
    // The 16 pairs of one row's K step, zero past k.
    let pairs = |row: usize, s: usize| {
        let src = &x[row * k + s * KS..row * k + k.min((s + 1) * KS)];
        let lo = bf16_bits16(&src[..src.len().min(16)]);
        let hi = if src.len() > 16 { bf16_bits16(&src[16..]) } else { _mm256_setzero_si256() };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    };
    let lanes: u16 = if mc == 16 { !0 } else { (1 << mc) - 1 };
    for g in 0..groups {
        let rows = (m - g * mc).min(mc);
        for s in 0..steps {
            let base = data[(g * steps + s) * TR * mc..].as_mut_ptr();
            if mc == 1 {
                // One row: its 16 pairs are the block's 16 lines of one u32.
                _mm512_storeu_si512(base.cast(), pairs(g, s));
                continue;
            }
            // Line p of the block holds pair p of each row of the group: the rows' pairs, transposed.
            let mut r = [_mm512_setzero_si512(); 16];
            for (c, v) in r.iter_mut().enumerate().take(rows) {
                *v = pairs(g * mc + c, s);
            }
            transpose16(&mut r);
            for (p, v) in r.iter().enumerate() {
                _mm512_mask_storeu_epi32(base.add(p * mc).cast(), lanes, *v);
            }
        }
    }
    Packed { data, mc, steps }
}

pub fn matmul(x: &[f32], m: usize, w: MatRef, out: &mut [f32], split: Split) {
    assert!(supported(), "AMX kernels on a CPU (or kernel) without them");
    assert_eq!(w.dtype, DType::BF16);
    // SAFETY: the CPU has AVX-512 (`supported`).
    let xp = unsafe { pack(x, m, w.cols) };
    super::tiling::for_row_chunks(w, m, out, split, |wc, outs| {
        // SAFETY: the CPU has AMX and the OS granted the tiles (`supported`); `xp` covers `m` rows
        // of `wc.cols`.
        unsafe { chunk(&xp, m, wc, outs) }
    });
    PACKED.set(xp.data);
}

thread_local! {
    /// Weight rows copied into zero-padded lines (a chunk's last rows short of a tile, or K that is
    /// not a whole number of steps), kept from call to call.
    static PADDED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One thread's chunk of weight rows against every activation row.
///
/// # Safety
/// AMX-TILE + AMX-BF16 usable by this process (which implies AVX-512); `xp` packs `m` rows of
/// `w.cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn chunk(xp: &Packed, m: usize, w: MatRef, outs: &mut [&mut [f32]]) {
    let (n, k, mc, steps) = (w.rows, w.cols, xp.mc, xp.steps);
    let ws = k * 2;
    let groups = m.div_ceil(mc);
    configure(mc);
    let mut padded = PADDED.take();
    let mut res = [[0f32; 16]; TR];
    // Element (i, c) of a stored tile is at i·16 + c.
    let column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    let whole_k = k % KS == 0;
    let mut r0 = 0;
    while r0 < n {
        let rows = (n - r0).min(2 * TR);
        // Two weight tiles (32 rows) when there are that many; the second only when needed.
        let two = rows > TR;
        let (a, stride) = if (rows == 2 * TR || rows == TR) && whole_k {
            (w.data[r0 * ws..].as_ptr(), ws)
        } else {
            let kp = steps * KS;
            padded.clear();
            padded.resize(2 * TR * kp, 0);
            for i in 0..rows {
                for (d, s) in padded[i * kp..i * kp + k].iter_mut().zip(w.data[(r0 + i) * ws..].chunks_exact(2)) {
                    *d = u16::from_le_bytes([s[0], s[1]]);
                }
            }
            (padded.as_ptr() as *const u8, kp * 2)
        };
        for g0 in (0..groups).step_by(2) {
            let g2 = g0 + 1 < groups;
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nomem, nostack));
            for s in 0..steps {
                let a0 = a.add(s * KS * 2);
                asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) a0, s = in(reg) stride, options(nostack, readonly));
                if two {
                    let a1 = a0.add(TR * stride);
                    asm!("tileloadd tmm5, [{p} + {s}*1]", p = in(reg) a1, s = in(reg) stride, options(nostack, readonly));
                }
                asm!("tileloadd tmm6, [{p} + {s}*1]", p = in(reg) xp.block(g0, s), s = in(reg) mc * 4,
                     options(nostack, readonly));
                asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nomem, nostack));
                if two {
                    asm!("tdpbf16ps tmm1, tmm5, tmm6", options(nomem, nostack));
                }
                if g2 {
                    asm!("tileloadd tmm7, [{p} + {s}*1]", p = in(reg) xp.block(g0 + 1, s), s = in(reg) mc * 4,
                         options(nostack, readonly));
                    asm!("tdpbf16ps tmm2, tmm4, tmm7", options(nomem, nostack));
                    if two {
                        asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nomem, nostack));
                    }
                }
            }
            // Accumulator tile t: weight rows r0 + 16·(t % 2).., activation group g0 + t / 2.
            for t in 0..4 {
                let (half, g) = (t % 2, g0 + t / 2);
                if (half == 1 && !two) || g >= groups {
                    continue;
                }
                let dst = res.as_mut_ptr() as *mut u8;
                match t {
                    0 => asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) dst, s = in(reg) 64usize, options(nostack)),
                    1 => asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) dst, s = in(reg) 64usize, options(nostack)),
                    2 => asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) dst, s = in(reg) 64usize, options(nostack)),
                    _ => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) dst, s = in(reg) 64usize, options(nostack)),
                }
                let i0 = half * TR;
                let wrows = rows.saturating_sub(i0).min(TR);
                let keep = if wrows >= 16 { !0 } else { (1u16 << wrows) - 1 };
                let cols = mc.min(m - g * mc);
                // Column c of the tile: 16 weight rows' results for activation row g·mc + c. A few
                // columns are gathered; from `TRANSPOSE_FROM` on, the whole tile is transposed.
                if cols >= TRANSPOSE_FROM {
                    let mut t: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(res[i].as_ptr().cast()));
                    transpose16(&mut t);
                    for (c, col) in t.iter().enumerate().take(cols) {
                        let o = outs[g * mc + c][r0 + i0..r0 + i0 + wrows].as_mut_ptr();
                        _mm512_mask_storeu_ps(o, keep, _mm512_castsi512_ps(*col));
                    }
                } else {
                    for c in 0..cols {
                        let col = _mm512_i32gather_ps::<4>(column, res.as_ptr().cast::<f32>().add(c) as *const _);
                        let o = outs[g * mc + c][r0 + i0..r0 + i0 + wrows].as_mut_ptr();
                        _mm512_mask_storeu_ps(o, keep, col);
                    }
                }
            }
        }
        r0 += rows;
    }
    PADDED.set(padded);
}
