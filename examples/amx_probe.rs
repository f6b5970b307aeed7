//! What the AMX tile instructions cost on this machine, one core, outside any matmul: the figures
//! docs/numerics.md ("AMX") quotes. A `tileloadd` of 1 KB (16 rows of 64 bytes, the weight tile of
//! `kernels/amx.rs`) from buffers of growing size (L1, L2, L3, memory) with the kernels' access
//! pattern, `tdpbf16ps` and `tdpbssd` back to back, a Q8_0 block step on int8 tiles as a kernel would
//! run it (docs/quantization.md, "Q8_0 on AMX int8 tiles (not landed)"), and `ldtilecfg`.
//!
//! cargo run --release --example amx_probe
//!
//! Needs a CPU and kernel with AMX (`TANDEM_ISA` unset or `amx`); elsewhere it says so and exits.

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::arch::asm;
    use std::time::Instant;
    use tandem::kernels::{isa, Isa};

    if isa() != Isa::Amx {
        println!("AMX is not usable here (kernels run as {})", isa().name());
        return;
    }
    // The 64-byte tile configuration `ldtilecfg` reads: palette 1 (byte 0), then for tiles 0-7 the
    // bytes per row (u16 at 16 + 2t) and the rows (byte 48 + t): eight tiles of 16 rows x 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut cfg = Config([0; 64]);
    cfg.0[0] = 1;
    for t in 0..8 {
        cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        cfg.0[48 + t] = 16;
    }
    // SAFETY: `isa()` returned Amx, so the CPU has AMX and the kernel granted this process the tiles;
    // every load below stays inside its buffer (16 rows of `stride` bytes from a row start).
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const Config, options(nostack, readonly));
        println!("tileloadd of 1 KB, walking a buffer as the matmul walks its weights:");
        for kb in [16usize, 256, 1024, 4096, 65536] {
            let buf = vec![1u8; kb << 10];
            let stride = 768; // a 384-wide bf16 row: the shipped target's
            let rows = buf.len() / stride / 16 * 16;
            let tiles = rows / 16 * (stride / 64);
            let passes = (400_000 / tiles).max(2);
            let t = Instant::now();
            for _ in 0..passes {
                for r0 in (0..rows).step_by(16) {
                    for s in 0..stride / 64 {
                        let p = buf.as_ptr().add(r0 * stride + s * 64);
                        asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly));
                    }
                }
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / (passes * tiles) as f64;
            println!("  {kb:>6} KB buffer: {ns:6.1} ns per tile ({:5.1} GB/s)", 1024.0 / ns);
        }
        let n = 1_000_000;
        let t = Instant::now();
        for _ in 0..n {
            asm!("tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm5, tmm6", options(nomem, nostack));
        }
        let ns = t.elapsed().as_secs_f64() * 1e9 / (2 * n) as f64;
        println!("tdpbf16ps (16 x 16 x 32), two accumulators: {ns:.1} ns ({:.0} multiply-adds per ns)", 8192.0 / ns);
        let n = 1_000_000;
        let t = Instant::now();
        for _ in 0..n {
            asm!("tdpbssd tmm0, tmm4, tmm6", "tdpbssd tmm1, tmm5, tmm6", options(nomem, nostack));
        }
        let ns = t.elapsed().as_secs_f64() * 1e9 / (2 * n) as f64;
        println!(
            "tdpbssd (16 x 16 x 64 int8), two accumulators: {ns:.1} ns ({:.0} multiply-adds per ns)",
            16384.0 / ns
        );
        // A Q8_0 step on int8 tiles as a kernel without repacking would run it (docs/quantization.md,
        // "Q8_0 on AMX int8 tiles (not landed)"): per block of 16 weight rows, one product into a
        // zeroed tile, the tile stored, and every weight row's int32 sums scaled and added to its
        // accumulator in f32 (lanes: activation rows).
        let mut c = vec![0i32; 2 * 16 * 16];
        let (dw, dx) = (vec![0.5f32; 16], vec![0.25f32; 16]);
        let w = vec![0u8; 256 << 10];
        for (what, w) in [("", None), (", with 2 KB of tile loads", Some(&w[..]))] {
            let n = 200_000;
            let t = Instant::now();
            let acc = q8_steps(n, &mut c, &dw, &dx, w);
            let ns = t.elapsed().as_secs_f64() * 1e9 / n as f64;
            println!(
                "a Q8_0 block step (tilezero, tdpbssd, tilestored, 16 rows scaled into f32{what}): {ns:.1} ns per 16 x 32 weights (sum {acc})"
            );
        }
        let n = 100_000;
        let t = Instant::now();
        for _ in 0..n {
            asm!("ldtilecfg [{}]", in(reg) &cfg as *const Config, options(nostack, readonly));
        }
        println!("ldtilecfg: {:.0} ns", t.elapsed().as_secs_f64() * 1e9 / n as f64);
        asm!("tilerelease", options(nomem, nostack));
    }
}

/// `n` block steps of the int8 design's inner loop: tile 0 zeroed, `tdpbssd` of tiles 4 and 6 into it,
/// stored to one half of `c` (16 rows of 64 bytes), then for each of the 16 rows of the other half (the
/// step before's) `acc_r += f32(c[r]) · (dw[r] · dx)`.
/// With `w`, each step first loads tiles 4 and 6 from it (1 KB each). Returns the accumulators' sum, so
/// that the work is not optimized away.
///
/// # Safety
/// AMX usable with the probe's tile configuration loaded; AVX-512 F; `c` holds 512 values, `dw` and
/// `dx` 16; `w` at least 1 KB.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q8_steps(n: usize, c: &mut [i32], dw: &[f32], dx: &[f32], w: Option<&[u8]>) -> f32 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 16];
    let x = _mm512_loadu_ps(dx.as_ptr());
    for i in 0..n {
        // Two stored tiles in turn: the rows read are the previous step's, so the loads do not wait
        // for the store just issued.
        let (now, before) = if i % 2 == 0 { (0, 256) } else { (256, 0) };
        if let Some(w) = w {
            // The step's weights (from a buffer in L2, walked) and activations (in L1), 1 KB each:
            // twice what a Q8_0 block step loads, so an upper bound.
            let p = w.as_ptr().add((i % (w.len() / 1024)) * 1024);
            asm!("tileloadd tmm4, [{p} + {s}*1]", "tileloadd tmm6, [{x} + {s}*1]",
                 p = in(reg) p, x = in(reg) w.as_ptr(), s = in(reg) 64usize, options(nostack, readonly));
        }
        asm!("tilezero tmm0", "tdpbssd tmm0, tmm4, tmm6", "tilestored [{p} + {s}*1], tmm0",
             p = in(reg) c.as_mut_ptr().add(now), s = in(reg) 64usize, options(nostack));
        for (r, a) in acc.iter_mut().enumerate() {
            let v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c.as_ptr().add(before + 16 * r) as *const _));
            *a = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(*dw.get_unchecked(r)), x), *a);
        }
    }
    let mut sum = _mm512_setzero_ps();
    for a in acc {
        sum = _mm512_add_ps(sum, a);
    }
    _mm512_reduce_add_ps(sum)
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("AMX is an x86_64 feature");
}
