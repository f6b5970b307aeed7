//! Two bf16 drafters (the published assistants are bf16) for the bf16 target t1-bf16 against transformers
//! 5.23.0 goldens: `d3-bf16` (random weights, centroid head) and `d4-trained` (tied head, trained to agree
//! with the target; tests/speculative.rs checks that it is mostly accepted).

mod common;

use common::*;
use tandem::config::{validate_pair, LayerType};
use tandem::kernels::{isa, DType, Isa};
use tandem::model::assistant::Assistant;
use tandem::model::cache::LayerKv;
use tandem::model::TargetModel;

/// Instruction sets whose kernels reproduce each drafter's goldens bit for bit (measured; the goldens were
/// computed by torch on a CPU without AVX-512). Elsewhere only the distance bound is asserted: d4-trained is
/// one bf16 step (0.03) off with AVX2.
fn bit_exact(name: &str) -> &'static [Isa] {
    match name {
        "d3-bf16" => &[Isa::Scalar, Isa::Avx2],
        "d4-trained" => &[Isa::Scalar],
        _ => &[],
    }
}

/// The first `n` positions of a golden `[heads, T, D]` K/V pair as a cache layer stored in `dtype`.
fn donor(g: &Golden, key: &str, kind: LayerType, n: usize, dtype: DType) -> LayerKv {
    let (shape, k) = g.tensor(&format!("{key}_k"));
    let (_, v) = g.tensor(&format!("{key}_v"));
    let (heads, t, d) = (shape[0], shape[1], shape[2]);
    let first = |x: &[f32]| -> Vec<f32> { (0..heads).flat_map(|h| x[h * t * d..(h * t + n) * d].to_vec()).collect() };
    LayerKv::from_values(kind, heads, d, 0, dtype, &first(k), &first(v))
}

/// Max |golden − same weights in f32| over every case: how far exact arithmetic lands from the bf16 goldens.
fn f32_distance(g: &Golden, what: &str) -> f32 {
    [5, 8, 9, 10, 20]
        .iter()
        .map(|n| {
            max_diff(
                &g.tensor(&format!("draft_{what}_len{n}")).1,
                &g.tensor(&format!("draft_{what}_f32_compute_len{n}")).1,
            )
        })
        .fold(0.0, f32::max)
}

/// One drafter step per donor length, then the first drafting round (four steps) from the n = 20 inputs;
/// returns the largest logit and hidden differences.
fn run_cases(name: &str, target: &str) -> (f32, f32, DType) {
    let t = TargetModel::load(&fixture_dir(target)).unwrap();
    let tg = Golden::load(target);
    let a = Assistant::load(&fixture_dir(name)).unwrap();
    validate_pair(&t.cfg, &a.cfg).unwrap();
    let g = Golden::load(name);
    assert_eq!(g.json["target"], target);
    let (hb, v) = (a.cfg.backbone_hidden_size, a.cfg.text.vocab_size);
    let (mut ml, mut mh) = (0f32, 0f32);
    for n in [5usize, 8, 9, 10, 20] {
        let (_, input) = g.tensor(&format!("inputs_embeds_len{n}"));
        let s = donor(&tg, "kv_sliding", LayerType::Sliding, n, a.dtype);
        let f = donor(&tg, "kv_full", LayerType::Full, n, a.dtype);
        let step = a.step(&input[..hb], &input[hb..], &s, &f, n);
        let logits = step.logits.to_full(v, a.dtype);
        ml = ml.max(max_diff(&logits, &g.tensor(&format!("draft_logits_len{n}")).1));
        mh = mh.max(max_diff(&step.hidden, &g.tensor(&format!("draft_hidden_len{n}")).1));
        let want = g.json["cases"][n.to_string()]["draft_token"].as_u64().unwrap() as u32;
        assert_eq!(step.logits.argmax(), want, "{name} n={n}");
        if n == 20 {
            // The whole round: the same K/V and position, each step fed the previous pick and hidden state.
            let want_tokens: Vec<u32> = g.json["cases"]["20"]["chain_tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let (_, chain_logits) = g.tensor("chain_logits_len20");
            let (_, chain_hidden) = g.tensor("chain_hidden_len20");
            let (mut token, mut h) = (step.logits.argmax(), step.hidden.clone());
            let mut emb = vec![0f32; hb];
            for j in 1..4 {
                t.embed_token(token, &mut emb);
                let next = a.step(&emb, &h, &s, &f, n);
                let logits = next.logits.to_full(v, a.dtype);
                ml = ml.max(max_diff(&logits, &chain_logits[j * v..(j + 1) * v]));
                mh = mh.max(max_diff(&next.hidden, &chain_hidden[j * h.len()..(j + 1) * h.len()]));
                token = next.logits.argmax();
                assert_eq!(token, want_tokens[j], "{name} round step {j}");
                h = next.hidden;
            }
        }
    }
    (ml, mh, a.dtype)
}

/// A bf16 drafter against its goldens. As for the bf16 targets (tests/parity.rs): at least twice as close
/// to them as exact arithmetic is, and bit for bit where the summation order is the reference's.
fn check_bf16(name: &str, target: &str) {
    let (ml, mh, dtype) = run_cases(name, target);
    assert_eq!(dtype, DType::BF16);
    let g = Golden::load(name);
    let (el, eh) = (f32_distance(&g, "logits"), f32_distance(&g, "hidden"));
    println!("{name} ({}): logits {ml:.2e} hidden {mh:.2e}; f32 compute is {el:.2e} / {eh:.2e} away", isa());
    assert!(el > 0.0 && eh > 0.0, "{name}: the f32-compute goldens should differ from the bf16 ones");
    assert!(
        ml <= 0.5 * el && mh <= 0.5 * eh,
        "{name}: logits {ml} (bound {}), hidden {mh} (bound {})",
        0.5 * el,
        0.5 * eh
    );
    if bit_exact(name).contains(&isa()) {
        assert!(ml == 0.0 && mh == 0.0, "{name}: not bit-exact with the {} kernels: logits {ml}, hidden {mh}", isa());
    }
}

#[test]
fn the_bf16_drafter_matches_transformers() {
    check_bf16("d3-bf16", "t1-bf16");
}

#[test]
fn the_trained_drafter_matches_transformers() {
    check_bf16("d4-trained", "t1-bf16");
}
