//! Quantized targets (`--quantize`): the recipes pick the documented formats, the forward pass stays batch
//! invariant (a row of a batched or verify forward equals the row alone), and speculative decoding stays
//! lossless against the quantized target itself: greedy output equals its own plain greedy output, and
//! sampled output keeps its exact sampling distribution.

mod common;

use std::collections::HashMap;

use common::stats::{chi_square, exact_marginals};
use common::*;
use tandem::decode::draft_policy::DraftLength;
use tandem::decode::generate::{generate, GenerateOptions};
use tandem::decode::sampling::{Rng, SamplingParams};
use tandem::decode::speculative::generate_speculative;
use tandem::kernels::DType;
use tandem::kernels::QType;
use tandem::model::assistant::Assistant;
use tandem::model::target::{Keep, SeqInput};
use tandem::model::TargetModel;
use tandem::quantize::Recipe;
use tandem::weights::{StoredDtype, Tensor, WeightStore};

const RECIPES: [Recipe; 3] = [Recipe::Q8_0, Recipe::Q4_0, Recipe::Q4KM];

fn load(name: &str, recipe: Recipe) -> TargetModel {
    let mut said = String::new();
    let m = TargetModel::load_with(&fixture_dir(name), Some(recipe), |l| said = l).unwrap();
    assert!(said.starts_with(&format!("quantized the model to {recipe}: ")), "{said}");
    m
}

fn opts(max_new: usize, sampling: SamplingParams, ctx: usize) -> GenerateOptions {
    GenerateOptions { max_new_tokens: max_new, ignore_eos: true, sampling, top_logprobs: None, context_limit: ctx }
}

fn prompt(rng: &mut Rng, vocab: u32) -> Vec<u32> {
    let len = 3 + (rng.next_u64() % 20) as usize;
    (0..len).map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32).collect()
}

#[test]
fn recipes_choose_llama_cpp_formats_with_fallbacks_and_keep_small_tensors() {
    // The shipped target: hidden 384 (not whole 256-blocks), so 1536-wide down projections are the only
    // k-quant rows; everything 384 wide falls back.
    let dir = shipped_dir().join("target");
    let cfg = tandem::config::load_model_config(&dir).unwrap().text;
    let store = WeightStore::open(&dir).unwrap();
    let plan = tandem::quantize::target_plan(Recipe::Q4KM, &cfg, &store);
    let ty = |suffix: &str| plan.tensors.iter().find(|(n, _)| n.ends_with(suffix)).map(|(_, q)| *q);
    assert_eq!(ty("embed_tokens.weight"), Some(QType::Q8_0), "tied output, 384 wide: Q6_K falls back to Q8_0");
    assert_eq!(ty("layers.0.self_attn.q_proj.weight"), Some(QType::Q5_0), "Q4_K falls back to Q5_0");
    // llama.cpp's `use_more_bits` over 6 layers: the last eighth (layer 5) and every third from 0 (layer 2).
    assert_eq!(cfg.num_layers(), 6);
    for i in 0..6 {
        let want = if i == 2 || i == 5 { QType::Q6_K } else { QType::Q4_K };
        assert_eq!(ty(&format!("layers.{i}.mlp.down_proj.weight")), Some(want), "layer {i} down projection");
    }
    assert!(plan.tensors.iter().all(|(n, _)| !n.contains("norm")), "norms stay in their dtype");
    let q8 = tandem::quantize::target_plan(Recipe::Q8_0, &cfg, &store);
    assert!(q8.tensors.iter().all(|(_, q)| *q == QType::Q8_0));
    assert_eq!(q8.tensors.len(), plan.tensors.len(), "the same tensors in every recipe");

    // Loading quantizes exactly the plan's tensors into memory of the quantized size.
    let bf16 = TargetModel::load(&dir).unwrap();
    let q = TargetModel::load_with(&dir, Some(Recipe::Q8_0), |_| {}).unwrap();
    let (a, b) = (bf16.bytes_per_token() as f64, q.bytes_per_token() as f64);
    assert!(b < 0.56 * a && b > 0.5 * a, "Q8_0 reads {b} bytes per token against bf16's {a}");
    assert_eq!(q.dtype, bf16.dtype, "the forward still rounds to the checkpoint's dtype");

    // The per-layer embedding table stays at 8 bits even under 4-bit recipes (t5-e2b's is 48 wide, not whole
    // blocks, so it stays unquantized there; a 256-wide one is Q8_0).
    let e2b = fixture_dir("t5-e2b");
    let cfg = tandem::config::load_model_config(&e2b).unwrap().text;
    let wide = Tensor::owned("embed_tokens_per_layer.weight", DType::BF16, vec![8, 256], vec![0; 8 * 256 * 2]);
    let store = WeightStore::from_tensors(vec![wide]);
    for r in RECIPES {
        let plan = tandem::quantize::target_plan(r, &cfg, &store);
        assert_eq!(plan.tensors, vec![("embed_tokens_per_layer.weight".to_string(), QType::Q8_0)], "{r}");
    }
    let mut store = WeightStore::open(&e2b).unwrap();
    let plan = tandem::quantize::target_plan(Recipe::Q4_0, &cfg, &store);
    tandem::quantize::apply(&mut store, &plan).unwrap();
    for (name, q) in &plan.tensors {
        let t = store.get_full(name).unwrap();
        assert!(matches!(t.dtype, StoredDtype::Quant { q: got, .. } if got == *q), "{name}");
    }
}

#[test]
fn a_batched_forward_of_a_quantized_target_equals_each_sequence_alone_bit_for_bit() {
    for name in ["t1-f32", "t2-moe", "t4-unified", "t5-e2b"] {
        for recipe in RECIPES {
            let m = load(name, recipe);
            let v = m.cfg.vocab_size;
            let mut rng = Rng::new(3);
            let seqs: Vec<(Vec<u32>, Vec<u32>)> = (0..4)
                .map(|i| {
                    (prompt(&mut rng, v as u32), (0..1 + 2 * i).map(|_| 3 + (rng.next_u64() % 200) as u32).collect())
                })
                .collect();
            let prefill = |hist: &[u32]| {
                let mut c = m.new_cache();
                m.forward(&mut c, hist, Keep::Last).unwrap();
                c
            };
            let mut batch: Vec<_> = seqs.iter().map(|(h, _)| prefill(h)).collect();
            let mut solo: Vec<_> = seqs.iter().map(|(h, _)| prefill(h)).collect();
            let mut inputs: Vec<SeqInput<'_>> = batch
                .iter_mut()
                .zip(&seqs)
                .map(|(cache, (_, tokens))| SeqInput { cache, tokens, keep: Keep::All })
                .collect();
            let got = m.forward_batch(&mut inputs).unwrap();
            for (i, ((cache, (_, tokens)), g)) in solo.iter_mut().zip(&seqs).zip(&got).enumerate() {
                // Row by row alone: a verify's rows equal the same tokens decoded one at a time.
                for (r, &t) in tokens.iter().enumerate() {
                    let want = m.forward(cache, &[t], Keep::All).unwrap();
                    let same = want.logits.iter().zip(g.logits_row(r)).all(|(a, b)| a.to_bits() == b.to_bits())
                        && want.hidden.iter().zip(g.hidden_row(r)).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name} {recipe}: sequence {i} row {r} differs from the row alone");
                }
            }
        }
    }
}

#[test]
fn greedy_speculative_decoding_on_a_quantized_target_equals_its_plain_greedy() {
    let mut rng = Rng::new(17);
    for recipe in RECIPES {
        let target = load("t1-f32", recipe);
        // Drafters in bf16 and quantized: the centroid head's gathered rows and the tied head read the
        // quantized embedding through the same kernels.
        for (name, quantize_drafter) in [("d1-centroid", recipe == Recipe::Q4KM), ("d2-tied", true)] {
            let dir = fixture_dir(name);
            let a = Assistant::load_for_with(&dir, &target.cfg, quantize_drafter.then_some(recipe), |_| {}).unwrap();
            for _ in 0..4 {
                let p = prompt(&mut rng, 256);
                let o = opts(24, SamplingParams::default(), 512);
                let plain = generate(&target, &p, &o, |_| {}).unwrap().tokens;
                for dl in [DraftLength::Fixed(1), DraftLength::Fixed(4), DraftLength::Auto] {
                    let (g, _) = generate_speculative(&target, &a, &p, &o, &mut dl.into(), false, |_| {}).unwrap();
                    assert_eq!(g.tokens, plain, "{recipe} {name} {dl:?}");
                }
            }
        }
    }
    // The shipped pair with a Q4_K_M target (its down projections are real Q4_K/Q6_K rows): lossless, and
    // the bf16 drafter is still accepted.
    let dir = shipped_dir();
    let target = TargetModel::load_with(&dir.join("target"), Some(Recipe::Q4KM), |_| {}).unwrap();
    let a = Assistant::load_for(&dir.join("assistant"), &target.cfg).unwrap();
    let (mut rounds, mut accepted) = (0, 0);
    for p in heldout_prompts().iter().take(4) {
        let o = opts(32, SamplingParams::default(), target.cfg.max_position_embeddings);
        let plain = generate(&target, p, &o, |_| {}).unwrap().tokens;
        let (g, s) =
            generate_speculative(&target, &a, p, &o, &mut DraftLength::Fixed(4).into(), false, |_| {}).unwrap();
        assert_eq!(g.tokens, plain);
        rounds += s.draft_rounds;
        accepted += s.accepted_tokens;
    }
    assert!(accepted as f64 / rounds as f64 >= 1.5, "{accepted} accepted in {rounds} rounds");
}

#[test]
fn speculative_sampling_on_a_quantized_target_has_its_exact_sampling_distribution() {
    let target = load("t1-f32", Recipe::Q4_0);
    let prompt: Vec<u32> = vec![2, 17, 33, 90, 121, 7, 64, 200, 31, 5, 11, 19];
    let params = SamplingParams { temperature: 1.0, top_k: 6, ..SamplingParams::default() };
    let (m1, m2) = exact_marginals(&target, &prompt, &params);
    let a = Assistant::load(&fixture_dir("d1-centroid")).unwrap();
    let n = 2000;
    let (mut c1, mut c2) = (HashMap::new(), HashMap::new());
    for seed in 0..n as u64 {
        let o = opts(3, SamplingParams { seed, ..params.clone() }, 512);
        let t = generate_speculative(&target, &a, &prompt, &o, &mut DraftLength::Fixed(3).into(), false, |_| {})
            .unwrap()
            .0
            .tokens;
        *c1.entry(t[1]).or_insert(0) += 1;
        *c2.entry(t[2]).or_insert(0) += 1;
    }
    for (i, (c, m)) in [(c1, &m1), (c2, &m2)].into_iter().enumerate() {
        let (stat, crit) = chi_square(&c, m, n);
        assert!(stat < crit, "token {}: chi2 {stat} >= {crit}", i + 1);
    }
}
