//! Throughput of the dot-product instructions the matmul kernels are built on, on this core, with 12
//! independent accumulators in registers (no memory traffic): how many nanoseconds one instruction
//! costs, and the multiply-adds per nanosecond that gives. When a bf16 forward over a few rows turns
//! compute-bound, this says how soon (docs/numerics.md, "Threads"; docs/performance-history.md, "The shipped pair").
//!
//! cargo run --release --example dot_throughput

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::time::Instant;

    const ITERS: usize = 20_000_000;

    /// `ITERS` rounds of the instruction `$op` on 12 accumulators (a fixed-size array the compiler
    /// unrolls into registers); ns per instruction.
    macro_rules! timed {
        ($zero:expr, |$a:ident| $op:expr) => {{
            let t = Instant::now();
            let mut acc = [$zero; 12];
            for _ in 0..ITERS {
                for v in acc.iter_mut() {
                    let $a = *v;
                    *v = $op;
                }
            }
            std::hint::black_box(acc);
            t.elapsed().as_secs_f64() * 1e9 / (ITERS * 12) as f64
        }};
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dpbf16() -> f64 {
        // SAFETY (transmutes): __m512bh is 32 u16 in a zmm, like __m512i.
        let x: __m512bh = unsafe { std::mem::transmute(std::hint::black_box(_mm512_set1_epi16(0x3c00))) };
        let w: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3c01)) };
        timed!(_mm512_setzero_ps(), |a| _mm512_dpbf16_ps(a, x, w))
    }

    #[target_feature(enable = "avx512f")]
    fn fma512() -> f64 {
        let (x, w) = (std::hint::black_box(_mm512_set1_ps(1.0001)), std::hint::black_box(_mm512_set1_ps(1e-7)));
        timed!(_mm512_setzero_ps(), |a| _mm512_fmadd_ps(a, x, w))
    }

    #[target_feature(enable = "avx512f,avx512vnni")]
    fn dpbusd() -> f64 {
        let x = std::hint::black_box(_mm512_set1_epi8(1));
        timed!(_mm512_setzero_si512(), |a| _mm512_dpbusd_epi32(a, x, x))
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma256() -> f64 {
        let (x, w) = (std::hint::black_box(_mm256_set1_ps(1.0001)), std::hint::black_box(_mm256_set1_ps(1e-7)));
        timed!(_mm256_setzero_ps(), |a| _mm256_fmadd_ps(a, x, w))
    }

    pub fn main() {
        let row =
            |name: &str, macs: f64, ns: f64| println!("{name:<34} {ns:6.3} ns  {:6.1} multiply-adds/ns", macs / ns);
        println!("instruction (12 chains, one core)   per instr  throughput");
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features are checked just above (and in each branch below).
            row("vfmadd ymm (8 f32)", 8.0, unsafe { fma256() });
        }
        if is_x86_feature_detected!("avx512f") {
            row("vfmadd zmm (16 f32)", 16.0, unsafe { fma512() });
        }
        if is_x86_feature_detected!("avx512bf16") {
            row("vdpbf16ps zmm (32 bf16 pairs)", 32.0, unsafe { dpbf16() });
        }
        if is_x86_feature_detected!("avx512vnni") {
            row("vpdpbusd zmm (64 u8 x i8)", 64.0, unsafe { dpbusd() });
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("x86-64 only");
}
