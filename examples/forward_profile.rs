//! A target forward over R rows, repeated: for `perf record` / `valgrind --tool=callgrind` of one
//! step without the rest of a run around it.
//!
//! cargo run --release --example forward_profile -- MODEL_DIR [ROWS] [ITERATIONS]
//!
//! Prefills 128 tokens, then runs ITERATIONS forwards of ROWS tokens (each rolled back) and prints
//! the median time of one.

use std::time::Instant;
use tandem::model::{Keep, TargetModel};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().ok_or_else(|| anyhow::anyhow!("usage: forward_profile MODEL_DIR [ROWS] [ITERATIONS]"))?;
    let rows: usize = args.get(1).map_or(Ok(1), |s| s.parse())?;
    let iters: usize = args.get(2).map_or(Ok(20), |s| s.parse())?;
    let model = TargetModel::load(std::path::Path::new(dir))?;
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..128u32).map(|i| 3 + (i * 7919) % (vocab - 3)).collect();
    let mut cache = model.new_cache();
    tandem::decode::generate::prefill(&model, &mut cache, &prompt, &mut Default::default())?;
    let toks: Vec<u32> = (0..rows as u32).map(|i| 100 + i).collect();
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        model.forward(&mut cache, &toks, Keep::All)?;
        times.push(t.elapsed().as_secs_f64());
        cache.rollback(rows)?;
    }
    times.sort_by(f64::total_cmp);
    println!("{rows} rows: {:.3} ms per forward (median of {iters})", times[iters / 2] * 1e3);
    Ok(())
}
