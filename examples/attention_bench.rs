//! Time `attend` at Gemma 4 E2B full-attention shapes (8 query heads, 1 KV head, head_dim 512, bf16
//! cache) for 1..=8 query rows over a long context: the cost that grows with context in a verify forward.
//!
//! cargo run --release --example attention_bench -- [context]

use std::time::Instant;

use tandem::config::LayerType;
use tandem::kernels::DType;
use tandem::model::cache::LayerKv;
use tandem::model::ops::attend;

fn main() {
    let ctx: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let (hq, d) = (8, 512);
    let vals = |seed: u32| -> Vec<f32> {
        (0..ctx * d)
            .map(|i| DType::BF16.round((((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5))
            .collect()
    };
    let kv = LayerKv::from_values(LayerType::Full, 1, d, 0, DType::BF16, &vals(1), &vals(2));
    let mut base = 0.0;
    println!("context {ctx}: rows, ms per attend, vs 1 row");
    for rows in 1..=8 {
        let q: Vec<f32> =
            (0..rows * hq * d).map(|i| DType::BF16.round(((i * 7919) % 1000) as f32 / 1000.0 - 0.5)).collect();
        let mut out = vec![0f32; rows * hq * d];
        let keys = |r: usize| 0..ctx - rows + r + 1;
        attend(&q, &kv, rows, hq, keys, DType::BF16, &mut out);
        let n = 20;
        let t = Instant::now();
        for _ in 0..n {
            attend(&q, &kv, rows, hq, keys, DType::BF16, &mut out);
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        if rows == 1 {
            base = ms;
        }
        println!("{rows:4} {ms:9.3} {:6.2}x", ms / base);
    }
}
