//! Time one sampling step over a Gemma-size vocabulary (262,144 logits) under common settings: what
//! each verified row costs speculative sampling on top of the forward pass.
//!
//! cargo run --release --example sampling_bench

use std::time::Instant;
use tandem::decode::sampling::{Sampler, SamplingParams};
fn main() {
    let v = 262_144;
    let logits: Vec<f32> = (0..v).map(|i| (((i as u64 * 2654435761) % 10007) as f32 / 10007.0) * 20.0 - 10.0).collect();
    for (name, p) in [
        ("greedy", SamplingParams::default()),
        ("t=1", SamplingParams { temperature: 1.0, ..SamplingParams::default() }),
        ("t=0.8 top_p=0.95", SamplingParams { temperature: 0.8, top_p: 0.95, ..SamplingParams::default() }),
        (
            "t=1 top_k=64 top_p=0.95",
            SamplingParams { temperature: 1.0, top_k: 64, top_p: 0.95, ..SamplingParams::default() },
        ),
        ("t=1 rep 1.1", SamplingParams { temperature: 1.0, repeat_penalty: 1.1, ..SamplingParams::default() }),
        // Logits / T spread over 200: most of exp(l - max) is below 2^-126 (subnormal) or underflows.
        ("t=0.1", SamplingParams { temperature: 0.1, ..SamplingParams::default() }),
    ] {
        let mut s = Sampler::new(p);
        let hist: Vec<u32> = (0..500).collect();
        let t = Instant::now();
        for _ in 0..20 {
            s.sample(&logits, &hist);
        }
        let a = t.elapsed().as_secs_f64() * 1e3 / 20.0;
        let t = Instant::now();
        for _ in 0..20 {
            std::hint::black_box(s.probs(&logits, &hist));
        }
        let b = t.elapsed().as_secs_f64() * 1e3 / 20.0;
        println!("{name:28} sample {a:.3} ms   probs {b:.3} ms");
    }
}
