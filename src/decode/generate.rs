//! Plain (non-speculative) generation: prefill, then one target step per token.

use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::decode::sampling::SamplingParams;
use crate::decode::sequence::{run_alone, Sequence};
use crate::decode::speculative::Drafter;
use crate::model::{Keep, KvCache, TargetModel};

/// Prompt rows per prefill forward: large enough to keep the matmuls compute-bound, small enough to keep
/// activations in cache.
pub const PREFILL_CHUNK: usize = 256;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    /// Log-probabilities of each chosen token plus the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
    /// Total tokens (prompt + generated) the run may reach.
    pub context_limit: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// `max_new_tokens` or the context limit.
    Length,
    /// An end-of-sequence token.
    Stop,
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// Prompt tokens whose K/V an earlier run left in the cache (not run again; not in the prefill speed).
    #[serde(skip_serializing_if = "is_zero")]
    pub cached_prompt_tokens: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Set when generation stopped at the context limit before `max_new_tokens`.
    pub context_limited: bool,
    pub logprobs: Vec<TokenLogprob>,
    pub stats: Stats,
}

impl Generation {
    /// Nothing generated yet.
    pub fn new(prompt_tokens: usize) -> Generation {
        Generation {
            tokens: Vec::new(),
            finish_reason: FinishReason::Length,
            context_limited: false,
            logprobs: Vec::new(),
            stats: Stats { prompt_tokens, ..Stats::default() },
        }
    }
}

/// Check a prompt against the model before any work: non-empty, ids in range, fits the context.
pub fn validate_prompt(model: &TargetModel, prompt: &[u32], context_limit: usize) -> Result<()> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= model.cfg.vocab_size) {
        bail!("prompt token id {t} is outside the vocabulary of {} tokens", model.cfg.vocab_size);
    }
    if prompt.len() >= context_limit {
        bail!(
            "the prompt has {} tokens but the context limit is {context_limit}: nothing can be generated",
            prompt.len()
        );
    }
    Ok(())
}

/// A logit row must be finite: NaN or infinite logits (NaN/Inf weights, a degenerate config) would
/// otherwise be sampled as if they meant something. `step` is the 1-based number of the token chosen
/// from this row.
pub fn check_logits(logits: &[f32], step: usize) -> Result<()> {
    if logits.iter().all(|x| x.is_finite()) {
        return Ok(());
    }
    let (i, x) = logits.iter().enumerate().find(|(_, x)| !x.is_finite()).expect("one is not finite");
    bail!(
        "the model's logits are not finite at generation step {step} (token {i}: {x}); its weights or config are corrupt \
         (NaN or infinite values)"
    )
}

/// Run the prompt through the model in chunks, reusing whatever prefix of it `cache` already holds;
/// returns the last row's logits and hidden state. Records the prefill speed and the reused tokens.
pub fn prefill(
    model: &TargetModel,
    cache: &mut KvCache,
    prompt: &[u32],
    stats: &mut Stats,
) -> Result<crate::model::Forward> {
    let t0 = Instant::now();
    let cached = cache.reuse_prefix(prompt);
    let mut last = None;
    for chunk in prompt[cached..].chunks(PREFILL_CHUNK) {
        last = Some(model.forward(cache, chunk, Keep::Last)?);
    }
    stats.cached_prompt_tokens = cached;
    stats.prefill_tokens_per_s = (prompt.len() - cached) as f64 / t0.elapsed().as_secs_f64().max(1e-9);
    last.ok_or_else(|| anyhow::anyhow!("the prompt is empty"))
}

/// What a caller wants after seeing tokens (see [`generate_until`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop now and keep only the first `n` of the tokens just delivered (a stop string ended inside them,
    /// or the user interrupted). The finish reason is `Stop`.
    StopAfter(usize),
}

/// Generate up to `max_new_tokens` after `prompt`; `on_token` sees each token as it is chosen.
pub fn generate(
    model: &TargetModel,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    generate_until(model, &mut model.new_cache(), prompt, opts, |t| {
        on_token(t);
        Flow::Continue
    })
}

/// [`generate`], where `on_token` may also end generation, in a cache that may hold an earlier run (its
/// positions that the prompt starts with are reused) and holds this run afterwards.
pub fn generate_until(
    model: &TargetModel,
    cache: &mut KvCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Flow,
) -> Result<Generation> {
    let mut seq = Sequence::new(model, prompt, opts, None, false)?;
    run_alone::<dyn Drafter>(model, None, cache, &mut seq, |ts| ts.first().map_or(Flow::Continue, |&t| on_token(t)))?;
    Ok(seq.into_results().0)
}
