//! Continuous batching: one `forward_batch` over several sequences (each its own cache, positions, rows and
//! `Keep`) gives every sequence the bits its own `forward` gives, and leaves the same caches; one
//! `step_batch` over rows of different sequences gives each row the bits of its own drafter `step`.

mod common;

use common::*;
use tandem::config::{validate_pair, KvMode, LayerType};
use tandem::decode::speculative::Drafter;
use tandem::model::assistant::{Assistant, DraftLogits, DraftRow, DraftStep};
use tandem::model::{Forward, Keep, KvCache, SeqInput, TargetModel};

/// The batched target fixtures: PLE + MoE + KV sharing + double-wide (t1), bf16, MoE, E2B-like, unified.
const TARGETS: [&str; 5] = ["t1-f32", "t1-bf16", "t2-moe", "t5-e2b", "t4-unified"];

/// Deterministic token ids in `1..vocab` (a small LCG).
fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            1 + ((s >> 33) as usize % (vocab - 1)) as u32
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A cache holding `history`, run in chunks of 64 rows.
fn prefilled(m: &TargetModel, history: &[u32]) -> KvCache {
    let mut c = m.new_cache();
    for chunk in history.chunks(64) {
        m.forward(&mut c, chunk, Keep::Last).unwrap();
    }
    c
}

fn assert_forward_eq(a: &Forward, b: &Forward, what: &str) {
    assert_eq!(a.rows, b.rows, "{what}: rows");
    assert!(bits(&a.logits) == bits(&b.logits), "{what}: logits differ");
    assert!(bits(&a.hidden) == bits(&b.hidden), "{what}: hidden states differ");
}

/// Same positions, tokens, and the same bits in every cached key and value.
fn assert_cache_eq(m: &TargetModel, a: &KvCache, b: &KvCache, what: &str) {
    assert_eq!(a.tokens(), b.tokens(), "{what}: tokens");
    for (i, l) in m.cfg.layers.iter().enumerate() {
        if l.kv_mode == KvMode::Reuse {
            continue;
        }
        let (x, y) = (a.layer(i), b.layer(i));
        assert_eq!((x.start, x.entries()), (y.start, y.entries()), "{what}: layer {i} extent");
        assert!(bits(&x.to_f32(false)) == bits(&y.to_f32(false)), "{what}: layer {i} keys");
        assert!(bits(&x.to_f32(true)) == bits(&y.to_f32(true)), "{what}: layer {i} values");
    }
}

/// Run `plan` (history length, new tokens, keep) per sequence: batched on one set of caches, one by one on
/// another, and compare everything; returns both sets of caches for what follows.
fn batched_vs_solo(m: &TargetModel, name: &str, plan: &[(Vec<u32>, Vec<u32>, Keep)]) -> (Vec<KvCache>, Vec<KvCache>) {
    let mut batch_caches: Vec<KvCache> = plan.iter().map(|(hist, _, _)| prefilled(m, hist)).collect();
    let mut solo_caches: Vec<KvCache> = plan.iter().map(|(hist, _, _)| prefilled(m, hist)).collect();
    let mut seqs: Vec<SeqInput<'_>> = batch_caches
        .iter_mut()
        .zip(plan)
        .map(|(cache, (_, tokens, keep))| SeqInput { cache, tokens, keep: *keep })
        .collect();
    let batched = m.forward_batch(&mut seqs).unwrap();
    assert_eq!(batched.len(), plan.len());
    for (i, ((cache, (hist, tokens, keep)), got)) in solo_caches.iter_mut().zip(plan).zip(&batched).enumerate() {
        let want = m.forward(cache, tokens, *keep).unwrap();
        let what = format!("{name} sequence {i} (history {}, {} rows, {keep:?})", hist.len(), tokens.len());
        assert_eq!(got.rows, if *keep == Keep::All { tokens.len() } else { 1 }, "{what}");
        assert_forward_eq(got, &want, &what);
    }
    for (i, (a, b)) in batch_caches.iter().zip(&solo_caches).enumerate() {
        assert_cache_eq(m, a, b, &format!("{name} sequence {i} cache"));
    }
    (batch_caches, solo_caches)
}

#[test]
fn a_batched_forward_equals_each_sequence_alone_bit_for_bit() {
    for name in TARGETS {
        let m = TargetModel::load(&fixture_dir(name)).unwrap();
        let (v, w) = (m.cfg.vocab_size, m.cfg.sliding_window);
        // Histories: empty (a fresh prefill), inside the window, past it, and past the point where the
        // sliding layers drop old entries (2 x (W + 1 + 64)).
        let long = 2 * (w + 1 + 64) + 7;
        let plan = vec![
            (vec![], ids(1, 12, v), Keep::Last),                     // prefill chunk
            (ids(2, 5, v), ids(3, 1, v), Keep::Last),                // decode row
            (ids(4, w + 9, v), ids(5, 5, v), Keep::All),             // verify, 1 + 4 rows
            (ids(6, long, v), ids(7, 1, v), Keep::All),              // decode row, trimmed cache
            (ids(8, long + 3, v), ids(9, 2 * w + 3, v), Keep::Last), // prefill chunk wider than the window
        ];
        let (mut a, mut b) = batched_vs_solo(&m, name, &plan);

        // What follows behaves the same: a next batched step of one row each, against solo steps.
        let next: Vec<Vec<u32>> = (0..plan.len()).map(|i| ids(100 + i as u64, 1 + i % 2, v)).collect();
        let mut seqs: Vec<SeqInput<'_>> =
            a.iter_mut().zip(&next).map(|(cache, tokens)| SeqInput { cache, tokens, keep: Keep::All }).collect();
        let batched = m.forward_batch(&mut seqs).unwrap();
        for (i, ((cache, tokens), got)) in b.iter_mut().zip(&next).zip(&batched).enumerate() {
            let want = m.forward(cache, tokens, Keep::All).unwrap();
            assert_forward_eq(got, &want, &format!("{name} next step, sequence {i}"));
        }
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_cache_eq(&m, x, y, &format!("{name} next step, sequence {i} cache"));
        }

        // The order of the sequences in the batch does not matter.
        let reversed: Vec<_> = plan.iter().rev().cloned().collect();
        batched_vs_solo(&m, name, &reversed);
    }
}

#[test]
fn a_batch_of_one_is_forward_and_decode_rows_batch_alike() {
    // Many single decode rows (the common continuous-batching step), on the fixtures with KV sharing.
    for name in ["t1-f32", "t5-e2b"] {
        let m = TargetModel::load(&fixture_dir(name)).unwrap();
        let v = m.cfg.vocab_size;
        let plan: Vec<_> =
            (0..6).map(|i| (ids(20 + i, 3 + 17 * i as usize, v), ids(40 + i, 1, v), Keep::Last)).collect();
        batched_vs_solo(&m, name, &plan);
        batched_vs_solo(&m, name, &plan[..1]);
    }
}

#[test]
fn rolling_back_after_a_batched_verify_works_as_after_a_solo_one() {
    for name in ["t1-f32", "t1-bf16", "t5-e2b"] {
        let m = TargetModel::load(&fixture_dir(name)).unwrap();
        let (v, w) = (m.cfg.vocab_size, m.cfg.sliding_window);
        let long = 2 * (w + 1 + 64) + 1;
        let plan = vec![
            (ids(50, 3, v), ids(51, 5, v), Keep::All),
            (ids(52, long, v), ids(53, 7, v), Keep::All),
            (ids(54, w, v), ids(55, 1, v), Keep::Last),
            (ids(56, long + 40, v), ids(57, 4, v), Keep::All),
        ];
        let (mut a, mut b) = batched_vs_solo(&m, name, &plan);
        // Reject all but the first 1, 3, 0 and 2 of the verified rows.
        let rollback = [4, 4, 0, 2];
        for ((x, y), &r) in a.iter_mut().zip(b.iter_mut()).zip(&rollback) {
            x.rollback(r).unwrap();
            y.rollback(r).unwrap();
        }
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_cache_eq(&m, x, y, &format!("{name} sequence {i} after rollback"));
        }
        // The corrected tokens, batched again, against solo.
        let fix: Vec<Vec<u32>> = (0..plan.len()).map(|i| ids(60 + i as u64, 1 + i, v)).collect();
        let mut seqs: Vec<SeqInput<'_>> =
            a.iter_mut().zip(&fix).map(|(cache, tokens)| SeqInput { cache, tokens, keep: Keep::All }).collect();
        let batched = m.forward_batch(&mut seqs).unwrap();
        for (i, ((cache, tokens), got)) in b.iter_mut().zip(&fix).zip(&batched).enumerate() {
            let want = m.forward(cache, tokens, Keep::All).unwrap();
            assert_forward_eq(got, &want, &format!("{name} after rollback, sequence {i}"));
        }
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_cache_eq(&m, x, y, &format!("{name} after rollback, sequence {i} cache"));
        }
        // And a rolled-back batched cache answers as one that never saw the rejected rows (their extents may
        // differ: sliding layers trim on their own schedule).
        let mut fresh = prefilled(&m, &[plan[1].0.clone(), plan[1].1[..3].to_vec(), fix[1].clone()].concat());
        let t = ids(70, 1, v);
        let x = m.forward(&mut fresh, &t, Keep::All).unwrap();
        let y = m.forward(&mut a[1], &t, Keep::All).unwrap();
        assert_forward_eq(&x, &y, &format!("{name} rolled back vs never drafted"));
    }
}

#[test]
fn batch_errors_name_the_sequence_and_change_no_cache() {
    let m = TargetModel::load(&fixture_dir("t1-f32")).unwrap();
    let v = m.cfg.vocab_size;
    let mut c0 = prefilled(&m, &ids(80, 4, v));
    let mut c1 = prefilled(&m, &ids(81, 6, v));
    let (good, bad) = (ids(82, 2, v), vec![3, v as u32]);
    let empty: Vec<u32> = Vec::new();
    for (tokens, want) in [(&empty, "sequence 1"), (&bad, "sequence 1")] {
        let mut seqs = [
            SeqInput { cache: &mut c0, tokens: &good, keep: Keep::All },
            SeqInput { cache: &mut c1, tokens, keep: Keep::Last },
        ];
        let err = m.forward_batch(&mut seqs).err().expect("refused").to_string();
        assert!(err.contains(want), "{err}");
    }
    assert_eq!((c0.len(), c1.len()), (4, 6), "a refused batch changes no cache");
    assert!(m.forward_batch(&mut []).unwrap().is_empty());
    // A single forward keeps its plain messages.
    let err = m.forward(&mut c0, &bad, Keep::All).err().unwrap().to_string();
    assert!(err.contains("outside the vocabulary") && !err.contains("sequence"), "{err}");
}

fn assert_step_eq(a: &DraftStep, b: &DraftStep, what: &str) {
    assert!(bits(&a.hidden) == bits(&b.hidden), "{what}: hidden differs");
    match (&a.logits, &b.logits) {
        (DraftLogits::Full(x), DraftLogits::Full(y)) => assert!(bits(x) == bits(y), "{what}: logits differ"),
        (DraftLogits::Sparse { ids: i, logits: x }, DraftLogits::Sparse { ids: j, logits: y }) => {
            assert_eq!(i, j, "{what}: candidates differ");
            assert!(bits(x) == bits(y), "{what}: logits differ");
        }
        _ => panic!("{what}: head kinds differ"),
    }
}

#[test]
fn a_batched_draft_step_equals_each_row_alone_bit_for_bit() {
    let target = TargetModel::load(&fixture_dir("t1-f32")).unwrap();
    let (v, w, hb) = (target.cfg.vocab_size, target.cfg.sliding_window, target.cfg.hidden_size);
    // Sequences of different lengths: inside the window, past it, past the sliding layers' trimming.
    let lens = [3, w + 2, 40, 2 * (w + 1 + 64) + 5];
    let mut caches = Vec::new();
    let mut last = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let mut c = target.new_cache();
        let out = target.forward(&mut c, &ids(90 + i as u64, n, v), Keep::Last).unwrap();
        last.push((tandem::kernels::argmax(out.logits_row(0)) as u32, out.hidden_row(0).to_vec()));
        caches.push(c);
    }
    for name in ["d1-centroid", "d2-tied"] {
        let a = Assistant::load(&fixture_dir(name)).unwrap();
        validate_pair(&target.cfg, &a.cfg).unwrap();
        // Rows: each sequence at its own position, plus one at an earlier position of the longest.
        let mut rows_in: Vec<(usize, usize)> = (0..lens.len()).map(|i| (i, caches[i].len())).collect();
        rows_in.push((3, caches[3].len() - 2));
        let embs: Vec<Vec<f32>> = rows_in
            .iter()
            .map(|&(i, _)| {
                let mut e = vec![0f32; hb];
                target.embed_token(last[i].0, &mut e);
                e
            })
            .collect();
        let mut hs: Vec<Vec<f32>> = rows_in.iter().map(|&(i, _)| last[i].1.clone()).collect();
        // Two chained steps, as a drafting round does (the second reads the first's hidden state).
        for step in 0..2 {
            let rows: Vec<DraftRow<'_>> = rows_in
                .iter()
                .zip(&embs)
                .zip(&hs)
                .map(|((&(i, p), embedding), h)| DraftRow {
                    embedding,
                    h,
                    sliding: caches[i].store_kv(&target.cfg, LayerType::Sliding).unwrap(),
                    full: caches[i].store_kv(&target.cfg, LayerType::Full).unwrap(),
                    p,
                })
                .collect();
            let batched = a.step_batch(&rows);
            assert_eq!(batched.len(), rows.len());
            for (j, (r, got)) in rows.iter().zip(&batched).enumerate() {
                let want = a.step(r.embedding, r.h, r.sliding, r.full, r.p);
                assert_step_eq(got, &want, &format!("{name} step {step} row {j} (p {})", r.p));
            }
            // Through the Drafter trait: the batched override equals the per-row default.
            let trait_rows: Vec<(&KvCache, u32, &[f32], usize)> =
                rows_in.iter().zip(&hs).map(|(&(i, p), h)| (&caches[i], last[i].0, h.as_slice(), p)).collect();
            for (j, got) in a.draft_batch(&target, &trait_rows).iter().enumerate() {
                let (c, t, h, p) = trait_rows[j];
                assert_step_eq(got, &a.draft_step(&target, c, t, h, p), &format!("{name} draft_batch row {j}"));
            }
            hs = batched.into_iter().map(|s| s.hidden).collect();
        }
        assert!(a.step_batch(&[]).is_empty());
    }
}
