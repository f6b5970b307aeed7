//! Nanoseconds per value of the element-wise kernels at the lengths a small model's verify forward
//! gives them (attention scores of ~133 keys, hidden rows of 384, MLP rows of 1,536, logits of 4,096),
//! each over a buffer that stays in L1, as the forward calls them.
//!
//! cargo run --release --example elementwise_bench [-- REPEATS]

use std::time::Instant;
use tandem::kernels::{self, DType};

fn time(reps: usize, values: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e9 / (reps * values) as f64);
    }
    best
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let fill = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect() };
    println!("isa {}: ns per value (best of 5)", kernels::isa());
    for n in [133, 384, 1536, 4096] {
        let rows = 30 * 133 / n + 1;
        let src = fill(rows * n);
        let mut x = src.clone();
        let softmax = time(reps, rows * n, || {
            x.copy_from_slice(&src);
            x.chunks_exact_mut(n).for_each(kernels::softmax);
        });
        let gelu = time(reps, rows * n, || {
            x.copy_from_slice(&src);
            kernels::gelu_tanh(&mut x);
        });
        let softcap = time(reps, rows * n, || {
            x.copy_from_slice(&src);
            x.chunks_exact_mut(n).for_each(|r| kernels::softcap(r, 30.0, DType::BF16));
        });
        let round = time(reps, rows * n, || {
            x.copy_from_slice(&src);
            x.chunks_exact_mut(n).for_each(|r| DType::BF16.round_slice(r));
        });
        let w = fill(n);
        let mut out = vec![0f32; rows * n];
        let norm = time(reps, rows * n, || {
            for (r, o) in src.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
                kernels::rms_norm(r, Some(&w), 1e-6, o);
            }
        });
        println!(
            "n {n:5} x {rows:3}: softmax {softmax:.2}  gelu {gelu:.2}  softcap {softcap:.2}  round {round:.2}  rms_norm {norm:.2}"
        );
    }
}
