//! Token selection: greedy and stochastic sampling with the Hugging Face transformers logits
//! processors, a seeded portable RNG, and log-probabilities.
//!
//! The processors mirror `transformers` 5.23.0 (`generation/logits_process.py`), applied in the
//! order `GenerationMixin._get_logits_processor` builds them for a decoder-only model with one beam:
//!
//! 1. `RepetitionPenaltyLogitsProcessor` (a *processor*: applied in greedy mode too),
//!    then the OpenAI API's `logit_bias` and presence/frequency penalties (also processors, as in vLLM;
//!    all off by default, so a transformers run is unchanged),
//! 2. only when sampling (`do_sample`, here `temperature > 0`), the *warpers*:
//!    `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`,
//!    each with `min_tokens_to_keep = 1` and filter value `-inf`.
//!
//! Everything is computed on `f32` logits (transformers casts the last-position logits to float32
//! before processing); sums of probabilities are accumulated in `f64`.
//!
//! Deviations, all in cases transformers leaves undefined or errors on:
//! - NaN logits are treated as `-inf` (never selected) instead of poisoning the distribution;
//! - when probabilities tie at the top-p boundary, the token with the lower id ranks first (torch's
//!   unstable sort leaves the order of equal logits unspecified);
//! - if every logit is `-inf`, `probs` is a one-hot on id 0 rather than NaNs; `+inf` logits share
//!   the probability mass uniformly.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Sampling configuration. The default is greedy decoding with every processor off.
///
/// Note that transformers' `generate` fills an unset `top_k` with 50 (and a model's
/// `generation_config.json` may set more); here 0 really means off, so to reproduce a transformers
/// run pass the effective values explicitly.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding (argmax); otherwise the logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` highest logits (and everything tied with the k-th); 0 = off.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Min-p threshold relative to the most likely token, in [0, 1]; 0 = off.
    pub min_p: f32,
    /// Repetition penalty (CTRL style), > 0; 1 = off.
    pub repeat_penalty: f32,
    /// Seed of the sampler's RNG.
    pub seed: u64,
    /// OpenAI's presence penalty in [-2, 2]: subtracted once from the logit of every id that occurs in
    /// the history from `penalty_start` on (the generated tokens); 0 = off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty in [-2, 2]: subtracted from an id's logit once per occurrence from
    /// `penalty_start` on; 0 = off.
    pub frequency_penalty: f32,
    /// Where the presence and frequency penalties start counting in the history (the prompt's length,
    /// so that they count the generated tokens only, as OpenAI and vLLM do).
    pub penalty_start: usize,
    /// OpenAI's `logit_bias`: added to the logit of each id (ids outside the row are ignored), in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_start: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// The smallest positive temperature accepted (0 is greedy).
pub const MIN_TEMPERATURE: f32 = 1e-4;

/// An impossible sampling parameter; `Display` is a one-line message naming it and its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid sampling parameter {name} = {value}: must be {allowed}")]
    InvalidParameter { name: &'static str, value: String, allowed: &'static str },
}

impl SamplingParams {
    /// Check that every parameter is in its allowed range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        fn bad(name: &'static str, value: f32, allowed: &'static str) -> Result<(), SamplingError> {
            Err(SamplingError::InvalidParameter { name, value: format!("{value:?}"), allowed })
        }
        // Below MIN_TEMPERATURE, dividing the logits overflows f32 for ordinary logit values and the
        // distribution turns into a uniform draw over the overflowed tokens: refuse it.
        if !(self.temperature.is_finite() && (self.temperature == 0.0 || self.temperature >= MIN_TEMPERATURE)) {
            return bad("temperature", self.temperature, "0 (greedy) or a finite number >= 1e-4");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1] (1 = off)");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", self.min_p, "in [0, 1] (0 = off)");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat_penalty", self.repeat_penalty, "finite and > 0 (1 = off)");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "in [-2, 2] (0 = off)");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "in [-2, 2] (0 = off)");
        }
        if let Some(&(_, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad("logit_bias", b, "in [-100, 100]");
        }
        Ok(())
    }

    /// Greedy decoding: `temperature == 0`.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether any processor changes the logits before the warpers (greedy decoding then takes the
    /// argmax of the processed logits, not of the raw ones).
    pub fn has_processors(&self) -> bool {
        self.repeat_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}

/// xoshiro256++ seeded through splitmix64: the same seed gives the same stream everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        // splitmix64 never yields four zeros in a row, so the state is never all-zero.
        let s = [next(), next(), next(), next()];
        Rng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, 1) with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }
}

/// Sampling parameters plus the RNG they seed.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// Does not validate; call [`SamplingParams::validate`] first. Out-of-range parameters never
    /// panic, they just give meaningless distributions.
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Apply the processors in transformers' order, in place: NaN → -inf, repetition penalty over
    /// the distinct ids of `history` (prompt + generated; ids outside the vocabulary are ignored),
    /// then, only when sampling, temperature, top-k, top-p and min-p. Removed entries become -inf.
    pub fn process(&self, logits: &mut [f32], history: &[u32]) {
        self.process_inner(logits, history);
    }

    /// [`Sampler::process`], returning the ascending ids of the surviving (finite or `+inf`)
    /// logits once a warper has narrowed them down (`None`: not tracked, scan everything).
    fn process_inner(&self, logits: &mut [f32], history: &[u32]) -> Option<Vec<u32>> {
        let p = &self.params;
        nan_to_neg_inf(logits);
        if p.repeat_penalty != 1.0 {
            repetition_penalty(logits, history, p.repeat_penalty);
        }
        if !p.logit_bias.is_empty() {
            logit_bias(logits, &p.logit_bias);
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let counted = history.get(p.penalty_start..).unwrap_or(&[]);
            presence_frequency_penalty(logits, counted, p.presence_penalty, p.frequency_penalty);
        }
        if p.is_greedy() {
            return None;
        }
        if p.temperature != 1.0 {
            let t = p.temperature;
            for l in logits.iter_mut() {
                *l /= t;
            }
            nan_to_neg_inf(logits);
        }
        let mut cands = None;
        if p.top_k != 0 && p.top_k < logits.len() {
            cands = Some(top_k_filter(logits, p.top_k));
        }
        if p.top_p < 1.0 {
            cands = Some(top_p_filter(logits, cands.as_deref(), p.top_p));
        }
        if p.min_p > 0.0 {
            cands = Some(min_p_filter(logits, cands.as_deref(), p.min_p));
        }
        cands
    }

    /// The distribution [`Sampler::sample`] draws from: softmax of the processed logits, or for
    /// greedy decoding a one-hot on the argmax.
    pub fn probs(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        let cands = self.process_inner(&mut l, history);
        let mut out = vec![0.0; l.len()];
        if l.is_empty() {
            return out;
        }
        if self.params.is_greedy() {
            out[crate::kernels::argmax(&l)] = 1.0;
            return out;
        }
        match cands {
            Some(ids) => {
                let w = softmax_over(&l, &ids);
                if w.is_empty() {
                    out[0] = 1.0;
                }
                for (&i, &p) in ids.iter().zip(&w) {
                    out[i as usize] = p;
                }
            }
            None => softmax_into(&l, &mut out),
        }
        out
    }

    /// Greedy: argmax of the processed logits, ties to the lowest id (no RNG draw). Sampling: one
    /// draw from [`Sampler::probs`], identical to `sample_from(&probs(..))` (one `next_f64`).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.params.is_greedy() {
            if !self.params.has_processors() {
                // argmax skips NaN, so this equals the argmax of the processed logits.
                return crate::kernels::argmax(logits) as u32;
            }
            let mut l = logits.to_vec();
            self.process_inner(&mut l, history);
            return crate::kernels::argmax(&l) as u32;
        }
        let mut l = logits.to_vec();
        match self.process_inner(&mut l, history) {
            // Same weights, in the same id order, as the zero-padded dense `probs`.
            Some(ids) if !ids.is_empty() => {
                let w = softmax_over(&l, &ids);
                let pick = draw(&mut self.rng, ids.iter().zip(&w).map(|(&i, &w)| (i as usize, w)));
                pick.unwrap_or(0) as u32
            }
            _ => {
                let mut probs = vec![0.0; l.len()];
                if !l.is_empty() {
                    softmax_into(&l, &mut probs);
                }
                self.sample_from(&probs)
            }
        }
    }

    /// Draw an index with probability proportional to `weights` (non-negative, unnormalised),
    /// using an `f64` cumulative sum and one `next_f64`. Never returns an index whose weight is 0;
    /// negative, NaN and infinite weights count as 0. If no weight is positive, returns 0 (and
    /// draws nothing).
    pub fn sample_from(&mut self, weights: &[f32]) -> u32 {
        draw(&mut self.rng, weights.iter().copied().enumerate()).unwrap_or(0) as u32
    }
}

/// Inverse-CDF draw over `(index, weight)` pairs in the given order; weights that are not finite
/// and positive are skipped. `None` if there is no positive weight.
fn draw<I: Iterator<Item = (usize, f32)> + Clone>(rng: &mut Rng, items: I) -> Option<usize> {
    let usable = |w: f32| w > 0.0 && w.is_finite();
    let total: f64 = items.clone().filter(|&(_, w)| usable(w)).map(|(_, w)| w as f64).sum();
    if total <= 0.0 {
        return None;
    }
    let r = rng.next_f64() * total;
    let mut cum = 0.0f64;
    let mut last = None;
    for (i, w) in items {
        if !usable(w) {
            continue;
        }
        cum += w as f64;
        last = Some(i);
        if r < cum {
            return last;
        }
    }
    // r rounded up to `total`: the last usable index.
    last
}

/// Numerically stable log-softmax in `f32` (max subtraction, log-sum-exp accumulated in `f64`).
/// NaN entries stay NaN and are ignored by the others; `+inf` entries share the mass; if every
/// entry is `-inf` the result is all `-inf`.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = max_ignoring_nan(logits);
    if m == f32::NEG_INFINITY {
        return logits.iter().map(|&x| if x.is_nan() { x } else { f32::NEG_INFINITY }).collect();
    }
    if m == f32::INFINITY {
        let n = logits.iter().filter(|&&x| x == f32::INFINITY).count();
        let lp = -(n as f32).ln();
        return logits
            .iter()
            .map(|&x| {
                if x.is_nan() {
                    x
                } else if x == f32::INFINITY {
                    lp
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
    }
    let sum: f64 = logits.iter().filter(|x| !x.is_nan()).map(|&x| (x - m).exp() as f64).sum();
    let lse = m as f64 + sum.ln();
    logits.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// The `n` largest values as `(id, value)`, descending, ties to the lower id first; NaN ranks
/// below everything. O(V log n) with a bounded heap.
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut heap: BinaryHeap<Ranked> = BinaryHeap::with_capacity(n.min(values.len()) + 1);
    for (i, &v) in values.iter().enumerate() {
        let e = Ranked { v, id: i as u32 };
        if heap.len() < n {
            heap.push(e);
        } else if let Some(mut worst) = heap.peek_mut() {
            if e < *worst {
                *worst = e;
            }
        }
    }
    heap.into_sorted_vec().into_iter().map(|e| (e.id, e.v)).collect()
}

// ---------------------------------------------------------------------------------------------
// Internals

/// Total preorder on f32 where NaN is the smallest (all NaNs equal) and -0.0 == 0.0.
fn cmp_f32(a: f32, b: f32) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// Rank order: a value earlier in the ranking (larger, or equal with a lower id) compares `Less`.
#[derive(Clone, Copy, Debug)]
struct Ranked {
    v: f32,
    id: u32,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        cmp_f32(other.v, self.v).then(self.id.cmp(&other.id))
    }
}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Ranked {}

fn nan_to_neg_inf(logits: &mut [f32]) {
    for l in logits.iter_mut() {
        if l.is_nan() {
            *l = f32::NEG_INFINITY;
        }
    }
}

fn max_ignoring_nan(x: &[f32]) -> f32 {
    x.iter().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// [`shifted_exp`] of each of `ids`' logits: one SIMD pass over the whole vector when `ids` covers much
/// of it (a 262,144-token vocabulary without top-k), one call each otherwise.
fn shifted_exps(logits: &[f32], ids: &[u32], m: f32) -> Vec<f32> {
    if m.is_finite() && ids.len() * 8 >= logits.len() {
        let mut all = vec![0f32; logits.len()];
        crate::kernels::exp_shifted(logits, m, &mut all);
        if ids.len() == logits.len() {
            return all; // ids are 0..n
        }
        ids.iter().map(|&i| all[i as usize]).collect()
    } else {
        ids.iter().map(|&i| shifted_exp(logits[i as usize], m)).collect()
    }
}

/// `exp(l - m)` where `m` is the maximum; an infinite maximum gives its `+inf` entries weight 1.
#[inline]
fn shifted_exp(l: f32, m: f32) -> f32 {
    if m == f32::INFINITY {
        if l == f32::INFINITY {
            1.0
        } else {
            0.0
        }
    } else {
        // As `kernels::exp_shifted`: below 2^-126 (subnormal) counts as zero.
        crate::kernels::flush_subnormal((l - m).exp())
    }
}

/// A probability computed in f64, as f32, with values below 2^-126 zero: they would be f32
/// subnormals, each of which costs a microcode assist on Intel wherever it is read or written.
#[inline]
fn prob_f32(p: f64) -> f32 {
    if p < f32::MIN_POSITIVE as f64 {
        0.0
    } else {
        p as f32
    }
}

/// Softmax of NaN-free logits into `out` (same length, non-empty); all `-inf` gives a one-hot
/// on index 0.
fn softmax_into(l: &[f32], out: &mut [f32]) {
    let m = max_ignoring_nan(l);
    if m == f32::NEG_INFINITY {
        out.fill(0.0);
        out[0] = 1.0;
        return;
    }
    if m.is_finite() {
        crate::kernels::exp_shifted(l, m, out);
    } else {
        for (o, &x) in out.iter_mut().zip(l) {
            *o = if x == f32::NEG_INFINITY { 0.0 } else { shifted_exp(x, m) };
        }
    }
    let inv = 1.0 / out.iter().map(|&e| e as f64).sum::<f64>();
    for o in out.iter_mut() {
        *o = prob_f32(*o as f64 * inv);
    }
}

/// Softmax restricted to `ids` (every other logit is `-inf`), aligned with `ids`; empty if
/// `ids` is empty. Gives the same values as [`softmax_into`] on the full vector.
fn softmax_over(l: &[f32], ids: &[u32]) -> Vec<f32> {
    let m = ids.iter().fold(f32::NEG_INFINITY, |m, &i| m.max(l[i as usize]));
    let mut w = shifted_exps(l, ids, m);
    let z: f64 = w.iter().map(|&e| e as f64).sum();
    for e in w.iter_mut() {
        *e = prob_f32(*e as f64 / z);
    }
    w
}

/// The ids in `cands` (or all ids) whose logit is not `-inf`, ascending.
fn surviving(logits: &[f32], cands: Option<&[u32]>) -> Vec<u32> {
    match cands {
        Some(ids) => ids.iter().copied().filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect(),
        None => (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect(),
    }
}

/// OpenAI's `logit_bias`: add each bias to its id's logit (ids beyond the row are ignored).
fn logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
    nan_to_neg_inf(logits);
}

/// OpenAI's presence and frequency penalties over `counted` (the generated ids): an id seen `n > 0`
/// times loses `presence + n * frequency` (vLLM's formula; ids beyond the row are ignored).
fn presence_frequency_penalty(logits: &mut [f32], counted: &[u32], presence: f32, frequency: f32) {
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &id in counted {
        if (id as usize) < logits.len() {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    for (id, n) in counts {
        logits[id as usize] -= presence + n as f32 * frequency;
    }
    nan_to_neg_inf(logits);
}

/// `RepetitionPenaltyLogitsProcessor`: each distinct id once, `l < 0 ? l * p : l / p`.
fn repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let v = logits.len();
    let mut seen = vec![0u64; v.div_ceil(64)];
    for &id in history {
        let i = id as usize;
        if i >= v {
            continue;
        }
        let (w, bit) = (i / 64, 1u64 << (i % 64));
        if seen[w] & bit != 0 {
            continue;
        }
        seen[w] |= bit;
        let x = logits[i];
        logits[i] = if x < 0.0 { x * penalty } else { x / penalty };
    }
}

/// `TopKLogitsWarper`: remove every logit strictly below the k-th largest (ties with it are
/// kept). `0 < k < len`. Returns the surviving ids.
fn top_k_filter(logits: &mut [f32], k: usize) -> Vec<u32> {
    let thr = if k <= 4096 {
        // Bounded heap: one comparison per logit once it is full.
        top_n(logits, k)[k - 1].1
    } else {
        let mut tmp = logits.to_vec();
        *tmp.select_nth_unstable_by(k - 1, |a, b| cmp_f32(*b, *a)).1
    };
    let mut kept = Vec::with_capacity(k);
    for (i, l) in logits.iter_mut().enumerate() {
        if *l < thr {
            *l = f32::NEG_INFINITY;
        } else if *l > f32::NEG_INFINITY {
            kept.push(i as u32);
        }
    }
    kept
}

/// A top-p candidate: ordered by rank (larger logit first, then lower id), with its probability.
#[derive(Clone, Copy, Debug)]
struct Cand {
    v: f32,
    id: u32,
    p: f64,
}

impl Cand {
    fn rank(&self, other: &Self) -> Ordering {
        cmp_f32(other.v, self.v).then(self.id.cmp(&other.id))
    }
}

/// `TopPLogitsWarper`. transformers sorts ascending and removes where the cumulative probability
/// is `<= 1 - top_p`, keeping the most likely token. Equivalently, walking in descending order, a
/// token is removed when the mass strictly ahead of it is `>= top_p`.
///
/// Only the surviving candidates are considered, and they are never fully sorted. Tokens with
/// probability below `(1 - top_p) / n` are dropped up front: together they weigh less than
/// `1 - top_p` and rank below everything else, so they lie in the removed tail. A quickselect
/// guided by the probability mass then narrows down the cut, and only a small window is sorted.
fn top_p_filter(logits: &mut [f32], cands: Option<&[u32]>, top_p: f32) -> Vec<u32> {
    let ids = surviving(logits, cands);
    if ids.len() <= 1 {
        return ids;
    }
    let m = ids.iter().fold(f32::NEG_INFINITY, |m, &i| m.max(logits[i as usize]));
    let mut cs: Vec<Cand> = ids
        .iter()
        .zip(shifted_exps(logits, &ids, m))
        .map(|(&i, e)| Cand { v: logits[i as usize], id: i, p: e as f64 })
        .collect();
    let z: f64 = cs.iter().map(|c| c.p).sum();
    let top_p = top_p as f64;
    let eps = (1.0 - top_p) / cs.len() as f64;
    let inv_z = 1.0 / z;
    cs.retain_mut(|c| {
        c.p *= inv_z;
        if c.p < eps && c.v < m {
            logits[c.id as usize] = f32::NEG_INFINITY;
            false
        } else {
            true
        }
    });
    // Invariant: cs[..lo] rank ahead of cs[lo..hi], which rank ahead of cs[hi..]; `ahead` is
    // the mass of cs[..lo]; the cut (first removed position) lies in [lo, hi].
    let (mut lo, mut hi) = (0usize, cs.len());
    let mut ahead = 0.0f64;
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        cs[lo..hi].select_nth_unstable_by(mid - lo, Cand::rank);
        let left: f64 = cs[lo..mid].iter().map(|c| c.p).sum();
        if ahead + left >= top_p {
            hi = mid; // the token at `mid` is removed, so the cut is at or before it
        } else {
            ahead += left + cs[mid].p; // `mid` is kept
            lo = mid + 1;
        }
    }
    cs[lo..hi].sort_unstable_by(Cand::rank);
    let mut cut = hi;
    for (r, c) in cs.iter().enumerate().take(hi).skip(lo) {
        // r > 0: the most likely token is always kept.
        if r > 0 && ahead >= top_p {
            cut = r;
            break;
        }
        ahead += c.p;
    }
    for c in &cs[cut..] {
        logits[c.id as usize] = f32::NEG_INFINITY;
    }
    let mut kept: Vec<u32> = cs[..cut].iter().map(|c| c.id).collect();
    kept.sort_unstable();
    kept
}

/// `MinPLogitsWarper`: remove tokens whose probability (softmax of the current logits) is below
/// `min_p` times the largest probability; the most likely token is always kept.
fn min_p_filter(logits: &mut [f32], cands: Option<&[u32]>, min_p: f32) -> Vec<u32> {
    let ids = surviving(logits, cands);
    if ids.len() <= 1 {
        return ids;
    }
    // The first maximum (ids ascending), like torch.topk(probs, 1).
    let best = ids.iter().copied().fold(ids[0], |b, i| if logits[i as usize] > logits[b as usize] { i } else { b });
    let m = logits[best as usize];
    let z: f64 = shifted_exps(logits, &ids, m).iter().map(|&e| e as f64).sum();
    let top_prob = (1.0 / z) as f32; // exp(m - m) / z
    let thr = min_p * top_prob;
    let mut kept = Vec::with_capacity(ids.len());
    for i in ids {
        let l = &mut logits[i as usize];
        let p = prob_f32(shifted_exp(*l, m) as f64 / z);
        if p < thr && i != best {
            *l = f32::NEG_INFINITY;
        } else {
            kept.push(i);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    const NINF: f32 = f32::NEG_INFINITY;

    fn sampling(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..SamplingParams::default() }
    }

    fn processed(params: SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        Sampler::new(params).process(&mut l, history);
        l
    }

    fn kept(l: &[f32]) -> Vec<usize> {
        (0..l.len()).filter(|&i| l[i] > NINF).collect()
    }

    #[test]
    fn low_temperature_probabilities_have_no_subnormals() {
        // Logits spread over 20 at temperature 0.1: most probabilities fall below 2^-126. They are
        // zero, for the whole-vocabulary pass and the restricted ones alike (top-p, min-p), and the
        // rest still sums to 1.
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0).collect();
        for p in [
            sampling(0.1),
            SamplingParams { top_p: 0.999, ..sampling(0.1) },
            SamplingParams { min_p: 1e-30, ..sampling(0.1) },
            SamplingParams { top_k: 3000, ..sampling(0.1) },
        ] {
            let probs = Sampler::new(p.clone()).probs(&logits, &[]);
            assert!(probs.iter().all(|v| !v.is_subnormal()), "{p:?}");
            assert!(probs.iter().filter(|&&v| v == 0.0).count() > 2000, "{p:?}");
            let total: f64 = probs.iter().map(|&v| v as f64).sum();
            assert!((total - 1.0).abs() < 1e-5, "{p:?}: {total}");
        }
    }

    // ---- processors -------------------------------------------------------------------------

    #[test]
    fn repetition_penalty_signs_and_distinct_ids() {
        let p = SamplingParams { repeat_penalty: 2.0, ..sampling(1.0) };
        // id 2 appears three times but is penalised once; 99 is outside the vocabulary.
        let out = processed(p, &[-1.0, 4.0, 2.0, 0.0, 5.0], &[0, 0, 2, 2, 2, 3, 99]);
        assert_eq!(out, vec![-2.0, 4.0, 1.0, 0.0, 5.0]);
        // penalty < 1 rewards repeats.
        let p = SamplingParams { repeat_penalty: 0.5, ..sampling(1.0) };
        let out = processed(p, &[-1.0, 4.0, 2.0], &[0, 1, 1]);
        assert_eq!(out, vec![-0.5, 8.0, 2.0]);
    }

    #[test]
    fn repetition_penalty_applies_in_greedy_mode() {
        let p = SamplingParams { repeat_penalty: 2.0, ..SamplingParams::default() };
        let mut s = Sampler::new(p.clone());
        assert_eq!(s.sample(&[3.0, 2.0], &[]), 0);
        assert_eq!(s.sample(&[3.0, 2.0], &[0]), 1); // 3/2 = 1.5 < 2
        assert_eq!(s.probs(&[3.0, 2.0], &[0]), vec![0.0, 1.0]);
        // Greedy applies no warpers: top_k / temperature-only settings are ignored.
        let p = SamplingParams { top_k: 1, top_p: 0.1, min_p: 1.0, ..p };
        assert_eq!(processed(p, &[1.0, 2.0, 3.0], &[]), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_ids_only() {
        // History: prompt [0, 0] then generated [1, 1, 2]; counting starts after the prompt.
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, penalty_start: 2, ..sampling(1.0) };
        let out = processed(p, &[1.0, 1.0, 1.0, 1.0], &[0, 0, 1, 1, 2]);
        assert_eq!(out, vec![1.0, 1.0 - 0.5 - 2.0 * 0.25, 1.0 - 0.5 - 0.25, 1.0]);
        // Applied in greedy mode too: the penalised argmax moves.
        let p = SamplingParams { presence_penalty: 2.0, penalty_start: 1, ..SamplingParams::default() };
        let mut s = Sampler::new(p);
        assert_eq!(s.sample(&[3.0, 2.0], &[0]), 0); // the prompt's 0 is not counted
        assert_eq!(s.sample(&[3.0, 2.0], &[0, 0]), 1); // the generated 0 is: 3 - 2 < 2

        // A start past the history counts nothing; ids beyond the row are ignored.
        let p = SamplingParams { frequency_penalty: 1.0, penalty_start: 9, ..sampling(1.0) };
        assert_eq!(processed(p.clone(), &[1.0, 1.0], &[0, 1]), vec![1.0, 1.0]);
        let p = SamplingParams { penalty_start: 0, ..p };
        assert_eq!(processed(p, &[1.0, 1.0], &[0, 7]), vec![0.0, 1.0]);
    }

    #[test]
    fn logit_bias_adds_and_bans() {
        let p = SamplingParams { logit_bias: vec![(0, -100.0), (2, 1.5), (9, 5.0)], ..SamplingParams::default() };
        let mut s = Sampler::new(p.clone());
        assert!(p.has_processors());
        assert_eq!(s.sample(&[3.0, 2.0, 1.0], &[]), 2);
        assert_eq!(processed(p, &[3.0, 2.0, 1.0], &[]), vec![-97.0, 2.0, 2.5]);
        let inf = SamplingParams { logit_bias: vec![(0, -1.0)], ..sampling(1.0) };
        assert_eq!(processed(inf, &[f32::NEG_INFINITY, 0.0], &[])[0], f32::NEG_INFINITY);
    }

    #[test]
    fn penalty_ranges_are_checked() {
        let d = SamplingParams::default;
        assert!(SamplingParams { presence_penalty: 2.5, ..d() }.validate().is_err());
        assert!(SamplingParams { frequency_penalty: -2.5, ..d() }.validate().is_err());
        assert!(SamplingParams { frequency_penalty: f32::NAN, ..d() }.validate().is_err());
        assert!(SamplingParams { logit_bias: vec![(1, 101.0)], ..d() }.validate().is_err());
        assert!(SamplingParams { presence_penalty: -2.0, logit_bias: vec![(1, -100.0)], ..d() }.validate().is_ok());
    }

    #[test]
    fn temperature_divides() {
        assert_eq!(processed(sampling(0.5), &[1.0, 2.0, -4.0], &[]), vec![2.0, 4.0, -8.0]);
        assert_eq!(processed(sampling(2.0), &[1.0, NINF], &[]), vec![0.5, NINF]);
    }

    #[test]
    fn top_k_keeps_ties_at_boundary() {
        let k = |top_k| SamplingParams { top_k, ..sampling(1.0) };
        let l = [1.0, 3.0, 2.0, 2.0, 0.0];
        assert_eq!(processed(k(2), &l, &[]), vec![NINF, 3.0, 2.0, 2.0, NINF]);
        assert_eq!(processed(k(1), &l, &[]), vec![NINF, 3.0, NINF, NINF, NINF]);
        assert_eq!(processed(k(1), &[5.0, 1.0, 5.0], &[]), vec![5.0, NINF, 5.0]);
        assert_eq!(processed(k(0), &l, &[]), l.to_vec()); // off
        assert_eq!(processed(k(5), &l, &[]), l.to_vec()); // k >= V: off
        assert_eq!(processed(k(100), &l, &[]), l.to_vec());
        // Fewer finite logits than k: nothing more is removed.
        assert_eq!(processed(k(3), &[1.0, NINF, 2.0, NINF], &[]), vec![1.0, NINF, 2.0, NINF]);
    }

    #[test]
    fn top_p_smallest_nucleus() {
        let p = |top_p| SamplingParams { top_p, ..sampling(1.0) };
        // softmax([1,2,3]) = [0.0900, 0.2447, 0.6652]
        let l = [1.0, 2.0, 3.0];
        assert_eq!(kept(&processed(p(0.6), &l, &[])), vec![2]);
        assert_eq!(kept(&processed(p(0.7), &l, &[])), vec![1, 2]);
        assert_eq!(kept(&processed(p(0.95), &l, &[])), vec![0, 1, 2]);
        assert_eq!(kept(&processed(p(1.0), &l, &[])), vec![0, 1, 2]);
        // Exact quarters: a token whose preceding mass reaches top_p exactly is removed
        // (transformers: cumsum 0.5 <= 1 - 0.5). Ties rank lower id first.
        let flat = [0.0; 4];
        assert_eq!(kept(&processed(p(0.5), &flat, &[])), vec![0, 1]);
        assert_eq!(kept(&processed(p(0.6), &flat, &[])), vec![0, 1, 2]);
        // Always keeps at least one token.
        assert_eq!(kept(&processed(p(1e-6), &flat, &[])), vec![0]);
        assert_eq!(kept(&processed(p(1e-6), &[0.0, 9.0, 9.0], &[])), vec![1]);
        assert_eq!(kept(&processed(p(0.5), &[NINF, 1.0, NINF], &[])), vec![1]);
    }

    #[test]
    fn top_p_uses_distribution_after_top_k() {
        let l = [2.0, 1.0, 0.0, 0.0];
        // Alone: probs [0.610, 0.224, 0.083, 0.083] -> nucleus {0, 1} for 0.7.
        let p = SamplingParams { top_p: 0.7, ..sampling(1.0) };
        assert_eq!(kept(&processed(p.clone(), &l, &[])), vec![0, 1]);
        // After top-k 2 the probs are [0.731, 0.269] -> only {0}.
        let p = SamplingParams { top_k: 2, ..p };
        assert_eq!(kept(&processed(p, &l, &[])), vec![0]);
    }

    /// Reference top-p by a full sort, to check the incremental partial selection.
    fn top_p_reference(l: &[f32], top_p: f64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..l.len()).filter(|&i| l[i] > NINF).collect();
        idx.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
        let m = l[idx[0]] as f64;
        let z: f64 = idx.iter().map(|&i| (l[i] as f64 - m).exp()).sum();
        let mut ahead = 0.0;
        let mut out = Vec::new();
        for (r, &i) in idx.iter().enumerate() {
            if r > 0 && ahead >= top_p {
                break;
            }
            ahead += (l[i] as f64 - m).exp() / z;
            out.push(i);
        }
        out.sort();
        out
    }

    #[test]
    fn top_p_large_vocab_matches_full_sort() {
        for seed in [42, 43, 44] {
            let mut rng = Rng::new(seed);
            // Quantised logits so that many ties occur; a few -inf.
            let l: Vec<f32> =
                (0..5000).map(|i| if i % 97 == 0 { NINF } else { (rng.next_f32() * 800.0).round() / 100.0 }).collect();
            for top_p in [0.001f32, 0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 0.999] {
                let p = SamplingParams { top_p, ..sampling(1.0) };
                let got = kept(&processed(p, &l, &[]));
                assert_eq!(got, top_p_reference(&l, top_p as f64), "top_p {top_p}");
            }
        }
    }

    #[test]
    fn top_k_large_k_matches_count() {
        let mut rng = Rng::new(9);
        let l: Vec<f32> = (0..20_000).map(|_| (rng.next_f32() * 300.0).round()).collect();
        for k in [1usize, 7, 4096, 4097, 12_345] {
            let p = SamplingParams { top_k: k, ..sampling(1.0) };
            let got = processed(p, &l, &[]);
            let mut sorted = l.clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let thr = sorted[k - 1];
            let want: Vec<usize> = (0..l.len()).filter(|&i| l[i] >= thr).collect();
            assert_eq!(kept(&got), want, "k {k}");
            assert!(want.len() >= k);
        }
    }

    #[test]
    fn min_p_threshold_relative_to_top() {
        let mp = |min_p| SamplingParams { min_p, ..sampling(1.0) };
        let l: Vec<f32> = [0.1f32, 0.4, 0.2, 0.3].iter().map(|p| p.ln()).collect();
        // threshold 0.6 * 0.4 = 0.24
        assert_eq!(kept(&processed(mp(0.6), &l, &[])), vec![1, 3]);
        // threshold 0.2 * 0.4 = 0.08: all kept
        assert_eq!(kept(&processed(mp(0.2), &l, &[])), vec![0, 1, 2, 3]);
        // min_p = 1 keeps exactly the tokens tied with the maximum.
        assert_eq!(kept(&processed(mp(1.0), &[1.0, 3.0, 3.0, 2.9], &[])), vec![1, 2]);
        assert_eq!(kept(&processed(mp(0.0), &l, &[])), vec![0, 1, 2, 3]);
    }

    #[test]
    fn min_p_applies_after_temperature() {
        // ratio of probabilities e^-1 = 0.37 < 0.5 at T = 1; e^-0.5 = 0.61 >= 0.5 at T = 2.
        let p = SamplingParams { min_p: 0.5, ..sampling(1.0) };
        assert_eq!(kept(&processed(p.clone(), &[0.0, -1.0], &[])), vec![0]);
        let p = SamplingParams { temperature: 2.0, ..p };
        assert_eq!(kept(&processed(p, &[0.0, -1.0], &[])), vec![0, 1]);
    }

    /// Outputs of transformers 5.23.0 (torch 2.15, CPU) for the full chain
    /// RepetitionPenalty -> Temperature -> TopK -> TopP -> MinP on 16 logits.
    #[test]
    fn matches_transformers_chain() {
        const NINF: f64 = f64::NEG_INFINITY;
        struct Case {
            logits: [f32; 16],
            history: [u32; 6],
            expect: [f64; 16], // f32 values printed by torch
        }
        let check = |params: SamplingParams, cases: &[Case]| {
            for c in cases {
                let got = processed(params.clone(), &c.logits, &c.history);
                for (i, (&g, &e)) in got.iter().zip(&c.expect).enumerate() {
                    let e = e as f32;
                    assert!(
                        (g == f32::NEG_INFINITY && e == f32::NEG_INFINITY) || (g - e).abs() <= 1e-6 * e.abs().max(1.0),
                        "{params:?} logits {:?}: id {i} got {g}, expected {e}",
                        c.logits
                    );
                }
            }
        };
        let a = SamplingParams {
            temperature: 0.8,
            top_k: 10,
            top_p: 0.9,
            min_p: 0.1,
            repeat_penalty: 1.3,
            seed: 0,
            ..Default::default()
        };
        check(
            a,
            &[
                Case {
                    logits: [
                        -1.41, -2.79, 1.21, -3.42, 0.29, -1.07, -3.54, 0.06, -3.7, -0.53, -3.44, -3.27, -0.6, 2.61,
                        -3.01, -2.21,
                    ],
                    history: [1, 12, 1, 7, 1, 4],
                    expect: [
                        NINF,
                        NINF,
                        1.5125000476837158,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        3.2624998092651367,
                        NINF,
                        NINF,
                    ],
                },
                Case {
                    logits: [
                        -1.68, -2.85, -3.06, -1.53, 2.53, -2.55, 0.65, 1.11, -1.02, 0.38, -3.5, -3.52, -2.35, 1.44,
                        -0.58, -1.49,
                    ],
                    history: [14, 11, 9, 7, 5, 7],
                    expect: [
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        3.1624999046325684,
                        NINF,
                        NINF,
                        1.067307710647583,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        1.8000000715255737,
                        NINF,
                        NINF,
                    ],
                },
            ],
        );
        let b = SamplingParams {
            temperature: 1.5,
            top_k: 12,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 0.8,
            seed: 0,
            ..Default::default()
        };
        check(
            b,
            &[
                Case {
                    logits: [
                        -0.38, 0.48, 3.39, -0.27, 0.06, 0.7, -2.52, 0.1, 1.04, 2.34, -3.25, -1.57, -3.27, 2.48, 1.55,
                        -3.66,
                    ],
                    history: [12, 14, 5, 0, 2, 1],
                    expect: [
                        NINF,
                        0.3999999761581421,
                        2.825000047683716,
                        NINF,
                        0.03999999910593033,
                        0.5833333134651184,
                        NINF,
                        0.06666667014360428,
                        0.6933333277702332,
                        1.559999942779541,
                        NINF,
                        NINF,
                        NINF,
                        1.653333306312561,
                        1.2916666269302368,
                        NINF,
                    ],
                },
                Case {
                    logits: [
                        -3.71, 3.04, 0.8, 2.22, -1.39, 0.73, -2.44, -2.13, -1.65, -3.96, -3.32, 1.24, -0.75, 0.41,
                        3.45, -3.33,
                    ],
                    history: [8, 10, 7, 9, 0, 2],
                    expect: [
                        NINF,
                        2.0266666412353516,
                        0.6666666865348816,
                        1.4800000190734863,
                        NINF,
                        0.4866666793823242,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        NINF,
                        0.8266666531562805,
                        -0.5,
                        0.273333340883255,
                        2.299999952316284,
                        NINF,
                    ],
                },
            ],
        );
    }

    // ---- selection ----------------------------------------------------------------------------

    #[test]
    fn greedy_ties_to_lowest_id() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &[]), 1);
        assert_eq!(s.probs(&[1.0, 3.0, 3.0, 2.0], &[]), vec![0.0, 1.0, 0.0, 0.0]);
        let p = SamplingParams { repeat_penalty: 1.5, ..SamplingParams::default() };
        let mut s = Sampler::new(p);
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &[3]), 1);
    }

    #[test]
    fn nan_and_inf_do_not_panic() {
        let l = [f32::NAN, 1.0, f32::NAN, 0.5];
        for params in [
            SamplingParams::default(),
            SamplingParams { repeat_penalty: 1.2, ..SamplingParams::default() },
            SamplingParams { top_k: 2, top_p: 0.9, min_p: 0.1, repeat_penalty: 1.2, ..sampling(0.7) },
        ] {
            let mut s = Sampler::new(params);
            for _ in 0..50 {
                let t = s.sample(&l, &[0, 1]);
                assert!(t == 1 || t == 3, "picked a NaN id {t}");
            }
            let all_nan = [f32::NAN; 5];
            assert!(s.sample(&all_nan, &[0]) < 5);
            let p = s.probs(&all_nan, &[]);
            assert_eq!(p.iter().sum::<f32>(), 1.0);
            let t = s.sample(&[f32::INFINITY, 0.0, f32::INFINITY], &[]);
            assert!(t == 0 || t == 2);
            assert!(s.sample(&[NINF, NINF], &[]) < 2);
            assert_eq!(s.sample(&[], &[]), 0);
        }
        // A temperature that overflows finite logits to inf still gives a distribution.
        let s = Sampler::new(sampling(1e-39));
        let p = s.probs(&[-1.0, 2.0, 2.0], &[]);
        assert_eq!(p, vec![0.0, 0.5, 0.5]);
    }

    #[test]
    fn sample_equals_sample_from_probs() {
        let mut rng = Rng::new(77);
        let logits: Vec<f32> = (0..3000).map(|_| rng.next_f32() * 12.0 - 6.0).collect();
        let hist = [5u32, 17, 17, 2999, 40];
        for params in [
            sampling(1.0),
            SamplingParams { top_k: 50, ..sampling(0.9) },
            SamplingParams { top_p: 0.8, repeat_penalty: 1.3, ..sampling(1.2) },
            SamplingParams { min_p: 0.3, ..sampling(0.5) },
            SamplingParams { top_k: 200, top_p: 0.9, min_p: 0.05, ..sampling(0.7) },
        ] {
            let mut a = Sampler::new(params.clone());
            let mut b = Sampler::new(params.clone());
            for _ in 0..200 {
                let probs = b.probs(&logits, &hist);
                assert_eq!(a.sample(&logits, &hist), b.sample_from(&probs), "{params:?}");
            }
            let probs = b.probs(&logits, &hist);
            let s: f64 = probs.iter().map(|&p| p as f64).sum();
            assert!((s - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn sample_from_never_returns_zero_weight() {
        let mut s = Sampler::new(sampling(1.0));
        let w = [0.0, 1.0, 0.0, 0.0, 2.0, 0.0, -1.0, f32::NAN];
        let mut counts = [0usize; 8];
        for _ in 0..3000 {
            counts[s.sample_from(&w) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[3] + counts[5] + counts[6] + counts[7], 0);
        assert!(counts[1] > 800 && counts[4] > 1700, "{counts:?}");
        assert_eq!(s.sample_from(&[0.0, 0.0]), 0);
        assert_eq!(s.sample_from(&[0.0, 0.0, 3.0]), 2);
    }

    #[test]
    fn chi_square_after_temperature_and_top_p() {
        // Permuted logits; temperature 0.7 then top_p 0.9 keeps ids 1, 5, 3, 6.
        let logits = [0.0f32, 2.0, -1.0, 1.0, -3.0, 1.5, 0.5, -0.5];
        let t = 0.7f64;
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
        let z: f64 = e.iter().sum();
        let nucleus = [1usize, 5, 3, 6];
        // Hand check of the nucleus: mass ahead of id 6 is 0.888 < 0.9, ahead of id 0 is 0.949.
        let ahead6: f64 = [1, 5, 3].iter().map(|&i| e[i] / z).sum();
        assert!(ahead6 < 0.9 && ahead6 + e[6] / z >= 0.9);
        let zn: f64 = nucleus.iter().map(|&i| e[i]).sum();
        let mut expected = [0.0f64; 8];
        for &i in &nucleus {
            expected[i] = e[i] / zn;
        }

        let params = SamplingParams { top_p: 0.9, seed: 1234, ..sampling(0.7) };
        let mut s = Sampler::new(params);
        let probs = s.probs(&logits, &[]);
        for i in 0..8 {
            assert!((probs[i] as f64 - expected[i]).abs() < 1e-6, "{probs:?} vs {expected:?}");
        }
        let n = 20_000;
        let mut counts = [0usize; 8];
        for _ in 0..n {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        for i in 0..8 {
            if expected[i] == 0.0 {
                assert_eq!(counts[i], 0, "removed id {i} was drawn");
            }
        }
        let chi2: f64 = nucleus
            .iter()
            .map(|&i| {
                let ex = expected[i] * n as f64;
                (counts[i] as f64 - ex).powi(2) / ex
            })
            .sum();
        // 3 degrees of freedom: P(chi2 > 30) ~ 1e-6. Fixed seed, so deterministic.
        assert!(chi2 < 30.0, "chi2 {chi2}, counts {counts:?}");
    }

    // ---- RNG ----------------------------------------------------------------------------------

    #[test]
    fn rng_reference_vectors() {
        // splitmix64(0) = e220a8397b1dcdaf 6e789e6aa1b965f4 06c45d188009454f f88bb8a8724c81ec
        let r = Rng::new(0);
        assert_eq!(r.s, [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f, 0xf88bb8a8724c81ec]);
        let mut r = Rng::new(0);
        assert_eq!(r.next_u64(), 0x53175d61490b23df);
        assert_eq!(r.next_u64(), 0x61da6f3dc380d507);
        assert_eq!(r.next_u64(), 0x5c0fdf91ec9a7bfc);
        // xoshiro256++ from the state [1, 2, 3, 4].
        let mut r = Rng { s: [1, 2, 3, 4] };
        let out: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(out, vec![0x2800001, 0x3800067, 0xcc00003800067, 0xcc201994400b2]);
    }

    #[test]
    fn rng_determinism_and_ranges() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..100).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..100).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = Rng::new(8);
            (0..100).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mut r = Rng::new(3);
        for _ in 0..10_000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            let y = r.next_f32();
            assert!((0.0..1.0).contains(&y));
        }
        // Sampler streams: same seed, same tokens; different seed, different tokens.
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37) % 64) as f32 / 16.0).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..sampling(1.0) });
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<u32>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    // ---- params -------------------------------------------------------------------------------

    #[test]
    fn validate_names_the_parameter() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::default().is_greedy());
        let ok = SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 1.0,
            min_p: 1.0,
            repeat_penalty: 0.5,
            seed: 1,
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
        assert!(!ok.is_greedy());
        let bad = |p: SamplingParams, name: &str| {
            let msg = p.validate().expect_err(name).to_string();
            assert!(msg.contains(name), "{msg}");
            assert!(!msg.contains('\n'));
        };
        let d = SamplingParams::default;
        for t in [-0.1, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, 9e-5] {
            bad(SamplingParams { temperature: t, ..d() }, "temperature");
        }
        for p in [0.0, -0.5, 1.01, f32::NAN] {
            bad(SamplingParams { top_p: p, ..d() }, "top_p");
        }
        for p in [-0.01, 1.5, f32::NAN] {
            bad(SamplingParams { min_p: p, ..d() }, "min_p");
        }
        for p in [0.0, -1.0, f32::INFINITY, f32::NAN] {
            bad(SamplingParams { repeat_penalty: p, ..d() }, "repeat_penalty");
        }
        let msg = SamplingParams { top_p: 0.0, ..d() }.validate().unwrap_err().to_string();
        assert_eq!(msg, "invalid sampling parameter top_p = 0.0: must be in (0, 1] (1 = off)");
    }

    // ---- log_softmax / top_n ------------------------------------------------------------------

    #[test]
    fn log_softmax_normalised_and_stable() {
        let l = [1.0f32, 2.0, 3.0, -1.0, NINF];
        let ls = log_softmax(&l);
        let s: f64 = ls.iter().map(|&x| (x as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
        assert_eq!(ls[4], NINF);
        assert!((ls[1] - ls[0] - 1.0).abs() < 1e-6);
        let big = log_softmax(&[1000.0, 1000.0, -1000.0]);
        assert!((big[0] + std::f32::consts::LN_2).abs() < 1e-6);
        assert_eq!(big[0], big[1]);
        let v: Vec<f32> = (0..262_144).map(|i| ((i * 7919) % 1000) as f32 / 50.0).collect();
        let s: f64 = log_softmax(&v).iter().map(|&x| (x as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-4, "{s}");
        assert_eq!(log_softmax(&[NINF, NINF]), vec![NINF, NINF]);
        assert!(log_softmax(&[]).is_empty());
    }

    #[test]
    fn top_n_order_and_ties() {
        let v = [1.0, 5.0, 3.0, 5.0, 2.0, f32::NAN, 3.0];
        assert_eq!(top_n(&v, 3), vec![(1, 5.0), (3, 5.0), (2, 3.0)]);
        assert_eq!(top_n(&v, 4), vec![(1, 5.0), (3, 5.0), (2, 3.0), (6, 3.0)]);
        assert!(top_n(&v, 0).is_empty());
        let all = top_n(&v, 100);
        assert_eq!(all.len(), 7);
        assert_eq!(all[5], (0, 1.0));
        assert_eq!(all[6].0, 5); // NaN last
                                 // Large input: matches a full sort.
        let big: Vec<f32> = (0..10_000).map(|i| ((i * 7919) % 1013) as f32).collect();
        let mut idx: Vec<u32> = (0..big.len() as u32).collect();
        idx.sort_by(|&a, &b| big[b as usize].partial_cmp(&big[a as usize]).unwrap().then(a.cmp(&b)));
        let want: Vec<(u32, f32)> = idx[..20].iter().map(|&i| (i, big[i as usize])).collect();
        assert_eq!(top_n(&big, 20), want);
    }
}
