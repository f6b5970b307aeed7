//! Time `attend` at Gemma 4 E2B full-attention shapes (8 query heads, 1 KV head, head_dim 512, bf16
//! cache) for 1..=8 query rows over a long context: the cost that grows with context in a verify forward.
//!
//! cargo run --release --example attention_bench -- [CONTEXT [HEADS HEAD_DIM [sharp]]]
//!
//! `133 6 64` gives the shipped target's sliding layers at a short context. `sharp` scales the
//! queries by 100, so that the scores span about 200 as a trained model's sharp heads do (scale 1.0):
//! at `133 6 64` about a tenth of the probabilities are then subnormal and most of the rest underflow,
//! where each subnormal cost Intel a microcode assist (docs/numerics.md, "Subnormal probabilities").
//! Without it the scores span a few units and none are.

use std::time::Instant;

use tandem::config::LayerType;
use tandem::kernels::DType;
use tandem::model::cache::LayerKv;
use tandem::model::ops::attend;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (ctx, hq, d) = (arg(0, 4096), arg(1, 8), arg(2, 512));
    let q_scale = if args.get(3).is_some_and(|s| s == "sharp") { 100.0 } else { 1.0 };
    let vals = |seed: u32| -> Vec<f32> {
        (0..ctx * d)
            .map(|i| DType::BF16.round((((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5))
            .collect()
    };
    let kv = LayerKv::from_values(LayerType::Full, 1, d, 0, DType::BF16, &vals(1), &vals(2));
    let mut base = 0.0;
    println!("context {ctx}, {hq} heads of {d}, query scale {q_scale}: rows, µs per attend, vs 1 row");
    for rows in 1..=8 {
        let q: Vec<f32> = (0..rows * hq * d)
            .map(|i| DType::BF16.round((((i * 7919) % 1000) as f32 / 1000.0 - 0.5) * q_scale))
            .collect();
        let mut out = vec![0f32; rows * hq * d];
        let keys = |r: usize| 0..ctx - rows + r + 1;
        attend(&q, &kv, rows, hq, keys, DType::BF16, &mut out);
        let n = 400;
        let t = Instant::now();
        for _ in 0..n {
            attend(&q, &kv, rows, hq, keys, DType::BF16, &mut out);
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        if rows == 1 {
            base = ms;
        }
        println!("{rows:4} {:9.2} {:6.2}x", ms * 1e3, ms / base);
    }
}
