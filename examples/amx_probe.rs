//! What the AMX tile instructions cost on this machine, one core, outside any matmul: the figures
//! docs/numerics.md ("AMX") quotes. A `tileloadd` of 1 KB (16 rows of 64 bytes, the weight tile of
//! `kernels/amx.rs`) from buffers of growing size (L1, L2, L3, memory) with the kernels' access
//! pattern, `tdpbf16ps` back to back, and `ldtilecfg`.
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
        let n = 100_000;
        let t = Instant::now();
        for _ in 0..n {
            asm!("ldtilecfg [{}]", in(reg) &cfg as *const Config, options(nostack, readonly));
        }
        println!("ldtilecfg: {:.0} ns", t.elapsed().as_secs_f64() * 1e9 / n as f64);
        asm!("tilerelease", options(nomem, nostack));
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("AMX is an x86_64 feature");
}
