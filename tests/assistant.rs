//! The drafter against transformers 5.23.0 goldens: one step for several donor lengths around the sliding
//! window, a whole drafting round, both heads; and mismatched pairs rejected.

mod common;

use common::*;
use tandem::config::{load_assistant_config, validate_pair, LayerType};
use tandem::kernels::DType;
use tandem::model::assistant::Assistant;
use tandem::model::cache::LayerKv;
use tandem::model::{Keep, TargetModel};

const DRAFTERS: [&str; 2] = ["d1-centroid", "d2-tied"];

/// The first `n` positions of a golden `[heads, T, D]` K/V pair as a cache layer.
fn donor(g: &Golden, key: &str, kind: LayerType, n: usize) -> LayerKv {
    let (shape, k) = g.tensor(&format!("{key}_k"));
    let (_, v) = g.tensor(&format!("{key}_v"));
    let (heads, t, d) = (shape[0], shape[1], shape[2]);
    // The golden is [head, t, d]: keep the first n positions of each head.
    let first = |x: &[f32]| -> Vec<f32> { (0..heads).flat_map(|h| x[h * t * d..(h * t + n) * d].to_vec()).collect() };
    LayerKv::from_values(kind, heads, d, 0, DType::F32, &first(k), &first(v))
}

#[test]
fn one_step_matches_transformers_around_the_sliding_window() {
    let target = Golden::load("t1-f32");
    for name in DRAFTERS {
        let a = Assistant::load(&fixture_dir(name)).unwrap();
        let g = Golden::load(name);
        let hb = a.cfg.backbone_hidden_size;
        // Donor lengths below (5), at (8), one above (9) and past (10, 20) the window W = 8.
        for n in [5usize, 8, 9, 10, 20] {
            let (_, input) = g.tensor(&format!("inputs_embeds_len{n}"));
            let s = donor(&target, "kv_sliding", LayerType::Sliding, n);
            let f = donor(&target, "kv_full", LayerType::Full, n);
            let step = a.step(&input[..hb], &input[hb..], &s, &f, n);
            let (_, want_logits) = g.tensor(&format!("draft_logits_len{n}"));
            let (_, want_hidden) = g.tensor(&format!("draft_hidden_len{n}"));
            let logits = step.logits.to_full(a.cfg.text.vocab_size, a.dtype);
            let (ml, mh) = (max_diff(&logits, want_logits), max_diff(&step.hidden, want_hidden));
            assert!(ml < 1e-4 && mh < 1e-4, "{name} n={n}: logits {ml}, hidden {mh}");
            let want_token = g.json["cases"][n.to_string()]["draft_token"].as_u64().unwrap() as u32;
            assert_eq!(step.logits.argmax(), want_token, "{name} n={n}");
        }
    }
}

#[test]
fn a_drafting_round_after_our_own_prefill_matches_transformers() {
    let target = TargetModel::load(&fixture_dir("t1-f32")).unwrap();
    let tg = Golden::load("t1-f32");
    let prompt = tg.ids("prompt");
    for name in DRAFTERS {
        let a = Assistant::load(&fixture_dir(name)).unwrap();
        validate_pair(&target.cfg, &a.cfg).unwrap();
        let g = Golden::load(name);
        let mut cache = target.new_cache();
        let out = target.forward(&mut cache, &prompt, Keep::Last).unwrap();
        let mut token = tandem::kernels::argmax(out.logits_row(0)) as u32;
        assert_eq!(token as u64, g.json["cases"]["20"]["token"].as_u64().unwrap());
        let mut h = out.hidden_row(0).to_vec();
        let s = cache.store_kv(&target.cfg, LayerType::Sliding).unwrap();
        let f = cache.store_kv(&target.cfg, LayerType::Full).unwrap();
        let (_, want_logits) = g.tensor("chain_logits_len20");
        let (_, want_hidden) = g.tensor("chain_hidden_len20");
        let v = a.cfg.text.vocab_size;
        let want_tokens: Vec<u32> = g.json["cases"]["20"]["chain_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let mut emb = vec![0f32; target.cfg.hidden_size];
        for j in 0..4 {
            target.embed_token(token, &mut emb);
            let step = a.step(&emb, &h, s, f, prompt.len());
            let logits = step.logits.to_full(v, a.dtype);
            let ml = max_diff(&logits, &want_logits[j * v..(j + 1) * v]);
            let mh = max_diff(&step.hidden, &want_hidden[j * h.len()..(j + 1) * h.len()]);
            assert!(ml < 2e-4 && mh < 2e-4, "{name} step {j}: logits {ml}, hidden {mh}");
            token = step.logits.argmax();
            assert_eq!(token, want_tokens[j], "{name} step {j}");
            h = step.hidden;
        }
    }
}

#[test]
fn head_kind_and_config_agree_or_loading_fails() {
    let d1 = load_assistant_config(&fixture_dir("d1-centroid")).unwrap();
    assert!(matches!(d1.head, tandem::config::DraftHead::Centroid { num_centroids: 16, top_k: 4 }));
    assert_eq!(d1.num_assistant_tokens, Some(4));
    let d2 = load_assistant_config(&fixture_dir("d2-tied")).unwrap();
    assert_eq!(d2.head, tandem::config::DraftHead::Tied);
}

#[test]
fn mismatched_pairs_are_rejected() {
    let d1 = load_assistant_config(&fixture_dir("d1-centroid")).unwrap();
    // t5-e2b's sliding store layer has 1 KV head; D1 was made for t1's 2.
    let t5 = tandem::config::load_model_config(&fixture_dir("t5-e2b")).unwrap().text;
    let e = format!("{:#}", validate_pair(&t5, &d1).unwrap_err());
    assert!(e.contains("sliding_attention") && e.contains("KV heads"), "{e}");
    let t1 = tandem::config::load_model_config(&fixture_dir("t1-f32")).unwrap().text;
    let mut bad = d1.clone();
    bad.backbone_hidden_size = 32;
    assert!(format!("{:#}", validate_pair(&t1, &bad).unwrap_err()).contains("backbone_hidden_size"));
    let mut bad = d1.clone();
    bad.text.vocab_size = 512;
    assert!(format!("{:#}", validate_pair(&t1, &bad).unwrap_err()).contains("vocabulary"));
    let mut bad = d1.clone();
    bad.text.layers[1].kv_heads = 2;
    assert!(format!("{:#}", validate_pair(&t1, &bad).unwrap_err()).contains("KV heads"));
    let mut bad = d1.clone();
    bad.text.rope_full.theta = 10_000.0;
    assert!(format!("{:#}", validate_pair(&t1, &bad).unwrap_err()).contains("RoPE"));
}
