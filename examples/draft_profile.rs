//! Draft steps of an assistant over a prefilled target cache, repeated: for `perf record` of the
//! drafter alone (the shipped pair's four draft steps are about a third of a speculative round).
//!
//! cargo run --release --example draft_profile -- TARGET_DIR ASSISTANT_DIR [ITERATIONS] [SEQUENCES]
//!
//! Prefills 128 tokens into each of SEQUENCES target caches (default 1), then runs ITERATIONS draft
//! steps with one row per sequence, all in one batched step as the engine runs them, and prints the
//! median time of one.

use std::time::Instant;
use tandem::decode::speculative::Drafter;
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: draft_profile TARGET_DIR ASSISTANT_DIR [ITERATIONS] [SEQUENCES]";
    let (Some(tdir), Some(adir)) = (args.first(), args.get(1)) else { anyhow::bail!(usage) };
    let iters: usize = args.get(2).map_or(Ok(2000), |s| s.parse())?;
    let n_seqs: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    anyhow::ensure!(iters > 0 && n_seqs > 0, "{usage}: every count must be positive");
    let target = TargetModel::load(std::path::Path::new(tdir))?;
    let assistant = Assistant::load_for(std::path::Path::new(adir), &target.cfg)?;
    let vocab = target.cfg.vocab_size as u32;
    let mut caches = Vec::with_capacity(n_seqs);
    let mut hiddens = Vec::with_capacity(n_seqs);
    for s in 0..n_seqs as u32 {
        let prompt: Vec<u32> = (0..128u32).map(|i| 3 + (i * 7919 + s * 104_729) % (vocab - 3)).collect();
        let mut cache = target.new_cache();
        tandem::decode::generate::prefill(&target, &mut cache, &prompt, &mut Default::default())?;
        let h = target.forward(&mut cache, &[5], tandem::model::Keep::Last)?.hidden_row(0).to_vec();
        caches.push(cache);
        hiddens.push(h);
    }
    let rows: Vec<_> = caches.iter().zip(&hiddens).map(|(c, h)| (c, 7u32, h.as_slice(), c.len())).collect();
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let steps = assistant.draft_batch(&target, &rows);
        times.push(t.elapsed().as_secs_f64());
        std::hint::black_box(steps);
    }
    times.sort_by(f64::total_cmp);
    println!("{n_seqs} rows: {:.1} µs per draft step (median of {iters})", times[iters / 2] * 1e6);
    Ok(())
}
