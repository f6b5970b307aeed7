//! Exact sampling distributions and a chi-square test, for checking that speculative sampling (alone or
//! under load) draws tokens exactly as plain sampling does.
#![allow(dead_code)]

use std::collections::HashMap;

use tandem::decode::sampling::{Sampler, SamplingParams};
use tandem::model::{Keep, TargetModel};

/// Exact distribution of the generated tokens at indices 1 and 2 (the ones a first drafting round
/// produces) under plain sampling, by enumerating the support (top-k keeps it small).
pub fn exact_marginals(
    target: &TargetModel,
    prompt: &[u32],
    params: &SamplingParams,
) -> (HashMap<u32, f64>, HashMap<u32, f64>) {
    let sampler = Sampler::new(params.clone());
    let probs_after = |seq: &[u32]| -> Vec<(u32, f64)> {
        let mut cache = target.new_cache();
        let out = target.forward(&mut cache, seq, Keep::Last).unwrap();
        sampler
            .probs(out.logits_row(0), seq)
            .iter()
            .enumerate()
            .filter(|(_, p)| **p > 0.0)
            .map(|(i, p)| (i as u32, *p as f64))
            .collect()
    };
    let (mut m1, mut m2) = (HashMap::new(), HashMap::new());
    for (t0, p0) in probs_after(prompt) {
        let s0: Vec<u32> = prompt.iter().copied().chain([t0]).collect();
        for (t1, p1) in probs_after(&s0) {
            *m1.entry(t1).or_insert(0.0) += p0 * p1;
            let s1: Vec<u32> = s0.iter().copied().chain([t1]).collect();
            for (t2, p2) in probs_after(&s1) {
                *m2.entry(t2).or_insert(0.0) += p0 * p1 * p2;
            }
        }
    }
    (m1, m2)
}

/// Pearson chi-square of observed counts against expected probabilities (cells below 5 expected pooled),
/// and the 1e-4 critical value for its degrees of freedom (Wilson–Hilferty).
pub fn chi_square(counts: &HashMap<u32, usize>, expected: &HashMap<u32, f64>, n: usize) -> (f64, f64) {
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_obs, mut pool_exp) = (0.0, 0.0);
    for (t, p) in expected {
        let e = p * n as f64;
        let o = *counts.get(t).unwrap_or(&0) as f64;
        if e < 5.0 {
            pool_obs += o;
            pool_exp += e;
        } else {
            stat += (o - e).powi(2) / e;
            cells += 1;
        }
    }
    let outside: usize = counts.iter().filter(|(t, _)| !expected.contains_key(t)).map(|(_, c)| *c).sum();
    pool_obs += outside as f64;
    if pool_exp > 0.0 {
        stat += (pool_obs - pool_exp).powi(2) / pool_exp.max(1e-9);
        cells += 1;
    } else {
        assert_eq!(outside, 0, "tokens outside the support were drawn");
    }
    let df = (cells - 1) as f64;
    let z = 3.719; // one-sided 1e-4
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat, crit)
}
