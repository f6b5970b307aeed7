//! Draft steps of an assistant over a prefilled target cache, repeated: for `perf record` of the
//! drafter alone (the shipped pair's four draft steps are about a third of a speculative round).
//!
//! cargo run --release --example draft_profile -- TARGET_DIR ASSISTANT_DIR [ITERATIONS] [SEQUENCES] [VERIFY_ROWS] [--sections]
//!
//! Prefills 128 tokens into each of SEQUENCES target caches (default 1), then runs ITERATIONS draft
//! steps with one row per sequence, all in one batched step as the engine runs them, and prints the
//! median time of one.
//!
//! With VERIFY_ROWS > 0, every fourth draft step follows a target forward of that many rows per
//! sequence (rolled back, untimed), as in a speculative round at k = 4, and the medians are also
//! printed by the step's place after that forward: the first step finds the drafter's weights evicted
//! by the target's.
//!
//! With `--sections`, the draft steps also time their parts (`tandem::model::sections`;
//! docs/numerics.md, "Where a step's time goes") and print them.

use std::time::Instant;
use tandem::decode::speculative::Drafter;
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let sections = args.iter().any(|a| a == "--sections");
    args.retain(|a| a != "--sections");
    let usage = "usage: draft_profile TARGET_DIR ASSISTANT_DIR [ITERATIONS] [SEQUENCES] [VERIFY_ROWS] [--sections]";
    let (Some(tdir), Some(adir)) = (args.first(), args.get(1)) else { anyhow::bail!(usage) };
    let iters: usize = args.get(2).map_or(Ok(2000), |s| s.parse())?;
    let n_seqs: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let verify_rows: usize = args.get(4).map_or(Ok(0), |s| s.parse())?;
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
    let toks: Vec<u32> = (0..verify_rows as u32).map(|i| 100 + i).collect();
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters {
        if verify_rows > 0 && i % 4 == 0 {
            for cache in caches.iter_mut() {
                target.forward(cache, &toks, tandem::model::Keep::All)?;
                cache.rollback(verify_rows)?;
            }
        }
        let rows: Vec<_> = caches.iter().zip(&hiddens).map(|(c, h)| (c, 7u32, h.as_slice(), c.len())).collect();
        // Only the draft steps are timed by sections (not the verify forwards between them).
        tandem::model::sections::enable(sections);
        let t = Instant::now();
        let steps = assistant.draft_batch(&target, &rows);
        times.push(t.elapsed().as_secs_f64());
        tandem::model::sections::enable(false);
        std::hint::black_box(steps);
    }
    if verify_rows > 0 {
        for place in 0..4.min(iters) {
            let mut v: Vec<f64> = times.iter().skip(place).step_by(4).copied().collect();
            v.sort_by(f64::total_cmp);
            println!("step {} after a {verify_rows}-row forward: {:.1} µs (median)", place + 1, v[v.len() / 2] * 1e6);
        }
    }
    if sections {
        let wall = std::time::Duration::from_secs_f64(times.iter().sum());
        print!("{}", tandem::model::sections::report(iters, wall));
    }
    times.sort_by(f64::total_cmp);
    println!("{n_seqs} rows: {:.1} µs per draft step (median of {iters})", times[iters / 2] * 1e6);
    Ok(())
}
