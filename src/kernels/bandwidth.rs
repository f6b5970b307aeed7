//! Read bandwidth of this machine, to put the matmuls' effective weight bandwidth in context.

use rayon::prelude::*;
use std::time::Instant;

/// Stream a buffer of `bytes` (at least 1 MiB) through the rayon pool with vector loads and return
/// the best of three passes in GB/s (10⁹ bytes per second). The buffer is written first so every page
/// is really mapped (a fresh zeroed allocation would read the shared zero page).
pub fn measure_read_bandwidth(bytes: usize) -> f64 {
    let bytes = bytes.max(1 << 20);
    let buf = vec![1u8; bytes];
    let threads = rayon::current_num_threads().max(1);
    // A few chunks per thread so a stalled thread's work can be stolen; whole 4 KiB pages.
    let chunk = (bytes / (threads * 4)).max(1 << 16).div_ceil(4096) * 4096;
    let isa = super::isa();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let h = buf.par_chunks(chunk).map(|c| read_xor(isa, c)).reduce(|| 0, |a, b| a ^ b);
        std::hint::black_box(h);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn read_xor(isa: super::Isa, c: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    match isa {
        super::Isa::Avx512 | super::Isa::Avx512Bf16 | super::Isa::Amx => return super::avx512::read_xor(c),
        super::Isa::Avx2 => return super::avx2::read_xor(c),
        super::Isa::Scalar => {}
    }
    let _ = isa;
    c.chunks_exact(8).fold(0u64, |s, b| s ^ u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}
