//! A target forward over R rows, repeated: for `perf record` / `valgrind --tool=callgrind` of one
//! step without the rest of a run around it.
//!
//! cargo run --release --example forward_profile -- MODEL_DIR [ROWS] [ITERATIONS] [SEQUENCES] [--sections]
//!                                                  [--quantize RECIPE]
//!
//! Prefills 128 tokens into each of SEQUENCES caches (default 1), then runs ITERATIONS forwards of
//! ROWS tokens per sequence, all sequences in one batched forward as the engine steps them (each
//! rolled back), and prints the median time of one. With `--sections`, the forwards also time their
//! parts (`tandem::model::sections`; docs/numerics.md, "Where a step's time goes") and print them.
//! With `--quantize RECIPE` (q8_0, q4_0, q4_k_m), the model is quantized at load as `--quantize` does.

use std::time::Instant;
use tandem::model::{Keep, SeqInput, TargetModel};

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let sections = args.iter().any(|a| a == "--sections");
    args.retain(|a| a != "--sections");
    let usage = "usage: forward_profile MODEL_DIR [ROWS] [ITERATIONS] [SEQUENCES] [--sections] [--quantize RECIPE]";
    let recipe = match args.iter().position(|a| a == "--quantize") {
        Some(i) => {
            let r = args.get(i + 1).ok_or_else(|| anyhow::anyhow!("{usage}: --quantize needs a recipe"))?;
            let r = tandem::quantize::Recipe::parse(r)?;
            args.drain(i..i + 2);
            Some(r)
        }
        None => None,
    };
    let dir = args.first().ok_or_else(|| anyhow::anyhow!(usage))?;
    let rows: usize = args.get(1).map_or(Ok(1), |s| s.parse())?;
    let iters: usize = args.get(2).map_or(Ok(20), |s| s.parse())?;
    let n_seqs: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    anyhow::ensure!(rows > 0 && iters > 0 && n_seqs > 0, "{usage}: every count must be positive");
    let model = TargetModel::load_with(std::path::Path::new(dir), recipe, |line| eprintln!("{line}"))?;
    let vocab = model.cfg.vocab_size as u32;
    let mut caches = Vec::with_capacity(n_seqs);
    for s in 0..n_seqs as u32 {
        let prompt: Vec<u32> = (0..128u32).map(|i| 3 + (i * 7919 + s * 104_729) % (vocab - 3)).collect();
        let mut cache = model.new_cache();
        tandem::decode::generate::prefill(&model, &mut cache, &prompt, &mut Default::default())?;
        caches.push(cache);
    }
    let toks: Vec<u32> = (0..rows as u32).map(|i| 100 + i).collect();
    let mut times = Vec::with_capacity(iters);
    tandem::model::sections::enable(sections);
    for _ in 0..iters {
        let mut seqs: Vec<SeqInput<'_>> =
            caches.iter_mut().map(|cache| SeqInput { cache, tokens: &toks, keep: Keep::All }).collect();
        let t = Instant::now();
        model.forward_batch(&mut seqs)?;
        times.push(t.elapsed().as_secs_f64());
        drop(seqs);
        for cache in caches.iter_mut() {
            cache.rollback(rows)?;
        }
    }
    tandem::model::sections::enable(false);
    if sections {
        let wall = std::time::Duration::from_secs_f64(times.iter().sum());
        print!("{}", tandem::model::sections::report(iters, wall));
    }
    times.sort_by(f64::total_cmp);
    println!("{n_seqs} x {rows} rows: {:.3} ms per forward (median of {iters})", times[iters / 2] * 1e3);
    Ok(())
}
