//! Speculative decoding with the assistant drafter (docs/speculative.md): draft k tokens, verify them in one multi-row
//! target forward, keep the longest accepted prefix plus one target token, roll the caches back.
//!
//! Lossless by construction. Greedy: a draft is kept only if it is the target's own argmax. Sampling:
//! drafts are *sampled* from the drafter's processed distribution q (same processors as the target) and
//! accepted with probability min(1, p/q); on rejection the token comes from normalised max(p − q, 0)
//! (Leviathan et al.), so every emitted token is distributed exactly as plain sampling from p.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::config::LayerType;
use crate::decode::draft_policy::DraftPolicy;
use crate::decode::generate::{check_logits, prefill, validate_prompt, FinishReason, Flow, GenerateOptions, Generation, TokenLogprob};
use crate::decode::sampling::{log_softmax, top_n, Sampler};
use crate::model::assistant::{Assistant, DraftLogits, DraftRow, DraftStep};
use crate::model::cache::MAX_ROLLBACK;
use crate::model::{Keep, KvCache, TargetModel};

#[derive(Clone, Debug, Serialize)]
pub struct Round {
    pub drafted: Vec<u32>,
    pub accepted: usize,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SpecStats {
    pub draft_rounds: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub acceptance_rate: f64,
    pub mean_accepted_per_round: f64,
    /// How often the i-th draft of a round was accepted.
    pub accepted_per_position: Vec<usize>,
    /// Wall time spent in draft steps and in verify forwards (rounds with drafts only).
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rounds: Option<Vec<Round>>,
}

/// Whatever proposes draft tokens. The assistant model is the real one; tests plug in drafters with
/// controlled proposals to exercise partial and full acceptance.
pub trait Drafter {
    /// One draft step at query position `p` (the last committed token's position; the target cache holds
    /// `0..p`): the input token, the previous hidden state, and the target whose caches it may read.
    fn draft_step(&self, target: &TargetModel, cache: &KvCache, token: u32, h: &[f32], p: usize) -> DraftStep;

    /// One draft step for each of several sequences (`(cache, token, h, p)` each); a drafter that can
    /// batch them overrides this. Row i must equal `draft_step` on row i alone.
    fn draft_batch(&self, target: &TargetModel, rows: &[(&KvCache, u32, &[f32], usize)]) -> Vec<DraftStep> {
        rows.iter().map(|&(cache, token, h, p)| self.draft_step(target, cache, token, h, p)).collect()
    }
}

impl Drafter for Assistant {
    fn draft_step(&self, target: &TargetModel, cache: &KvCache, token: u32, h: &[f32], p: usize) -> DraftStep {
        let sliding = cache.store_kv(&target.cfg, LayerType::Sliding).expect("validated pair");
        let full = cache.store_kv(&target.cfg, LayerType::Full).expect("validated pair");
        let mut emb = vec![0f32; target.cfg.hidden_size];
        target.embed_token(token, &mut emb);
        self.step(&emb, h, sliding, full, p)
    }

    /// All rows in one [`Assistant::step_batch`]: the drafter's weights are read once for all sequences.
    fn draft_batch(&self, target: &TargetModel, rows: &[(&KvCache, u32, &[f32], usize)]) -> Vec<DraftStep> {
        let hb = target.cfg.hidden_size;
        let mut embs = vec![0f32; rows.len() * hb];
        for (e, &(_, token, _, _)) in embs.chunks_exact_mut(hb).zip(rows) {
            target.embed_token(token, e);
        }
        let batch: Vec<DraftRow<'_>> = rows
            .iter()
            .zip(embs.chunks_exact(hb))
            .map(|(&(cache, _, h, p), embedding)| DraftRow {
                embedding,
                h,
                sliding: cache.store_kv(&target.cfg, LayerType::Sliding).expect("validated pair"),
                full: cache.store_kv(&target.cfg, LayerType::Full).expect("validated pair"),
                p,
            })
            .collect();
        self.step_batch(&batch)
    }
}

/// A draft token and the drafter distribution it was drawn from (for the acceptance test).
struct Draft {
    token: u32,
    /// Sampling only: (token, probability) of q's support.
    q: Vec<(u32, f32)>,
}

/// Generate with drafting. `on_tokens` sees each round's accepted tokens at once.
pub fn generate_speculative<D: Drafter + ?Sized>(
    target: &TargetModel,
    drafter: &D,
    prompt: &[u32],
    opts: &GenerateOptions,
    policy: &mut DraftPolicy,
    trace: bool,
    mut on_tokens: impl FnMut(&[u32]),
) -> Result<(Generation, SpecStats)> {
    generate_speculative_until(target, drafter, &mut target.new_cache(), prompt, opts, policy, trace, |ts| {
        on_tokens(ts);
        Flow::Continue
    })
}

/// [`generate_speculative`], where `on_tokens` may also end generation (keeping part of the run), in a
/// cache that may hold an earlier run (see [`crate::decode::generate::generate_until`]).
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative_until<D: Drafter + ?Sized>(
    target: &TargetModel,
    drafter: &D,
    cache: &mut KvCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    policy: &mut DraftPolicy,
    trace: bool,
    mut on_tokens: impl FnMut(&[u32]) -> Flow,
) -> Result<(Generation, SpecStats)> {
    validate_prompt(target, prompt, opts.context_limit)?;
    opts.sampling.validate()?;
    let k_cap = policy.max_draft().min(MAX_ROLLBACK - 1);
    let eos = &target.cfg.eos_token_ids;
    let mut sampler = Sampler::new(opts.sampling.clone());
    let greedy = opts.sampling.is_greedy();
    let mut history = prompt.to_vec();
    let mut gen = Generation::new(prompt.len());
    let mut spec = SpecStats {
        accepted_per_position: vec![0; k_cap],
        rounds: trace.then(Vec::new),
        ..SpecStats::default()
    };
    if opts.max_new_tokens == 0 {
        return Ok((gen, spec));
    }

    let first = prefill(target, cache, prompt, &mut gen.stats)?;
    let t1 = Instant::now();

    // Iteration 0: the prefill's last row gives the first token.
    check_logits(first.logits_row(0), 1)?;
    let token = sampler.sample(first.logits_row(0), &history);
    let mut emitted = vec![token];
    if let Some(n) = opts.top_logprobs {
        push_logprob(&mut gen, first.logits_row(0), token, n);
    }
    let mut h = first.hidden_row(0).to_vec();

    loop {
        // Commit this round's tokens, honouring EOS and the budgets exactly.
        let mut stop = false;
        let mut keep = 0;
        for &t in &emitted {
            history.push(t);
            gen.tokens.push(t);
            keep += 1;
            if !opts.ignore_eos && eos.contains(&t) {
                gen.finish_reason = FinishReason::Stop;
                stop = true;
                break;
            }
        }
        gen.logprobs.truncate(gen.tokens.len().min(gen.logprobs.len()));
        if let Flow::StopAfter(n) = on_tokens(&emitted[..keep]) {
            gen.tokens.truncate(gen.tokens.len() - (keep - n.min(keep)));
            gen.finish_reason = FinishReason::Stop;
            break;
        }
        if stop || gen.tokens.len() >= opts.max_new_tokens {
            break;
        }
        if history.len() >= opts.context_limit {
            gen.context_limited = true;
            break;
        }

        // Draft.
        let n_committed = history.len();
        let remaining = opts.max_new_tokens - gen.tokens.len();
        let k_max = k_cap.min(remaining - 1).min(opts.context_limit - n_committed - 1);
        let k = policy.choose(k_max);
        let p = n_committed - 1; // the last committed token's position; the cache holds 0..p-1
        let last = *history.last().expect("non-empty");
        let td = Instant::now();
        let mut drafts: Vec<Draft> = Vec::with_capacity(k);
        if k > 0 {
            let mut tok = last;
            let mut hp = h.clone();
            for _ in 0..k {
                let step = drafter.draft_step(target, cache, tok, &hp, p);
                check_draft(&step.logits, target.cfg.vocab_size, gen.tokens.len() + drafts.len() + 1)?;
                let d = if greedy {
                    Draft { token: step.logits.argmax(), q: Vec::new() }
                } else {
                    // The repetition penalty sees the drafts so far, as the target will.
                    sample_draft(&mut sampler, &step.logits, &history)
                };
                tok = d.token;
                history.push(tok);
                drafts.push(d);
                hp = step.hidden;
            }
            history.truncate(n_committed);
        }
        let draft_s = td.elapsed().as_secs_f64();

        // Verify all drafts in one forward.
        let tv = Instant::now();
        let mut rows = vec![last];
        rows.extend(drafts.iter().map(|d| d.token));
        let out = target.forward(cache, &rows, Keep::All)?;
        for r in 0..out.rows {
            check_logits(out.logits_row(r), gen.tokens.len() + r + 1)?;
        }
        let mut accepted = 0;
        let mut bonus = None;
        for (i, d) in drafts.iter().enumerate() {
            let logits = out.logits_row(i);
            if greedy {
                let y = sampler.sample(logits, &history);
                if y != d.token {
                    bonus = Some(y);
                    break;
                }
            } else {
                let pd = sampler.probs(logits, &history);
                let q_tok = d.q.iter().find(|(t, _)| *t == d.token).map_or(0.0, |x| x.1);
                let u = sampler.rng().next_f64();
                if (u * q_tok as f64) >= pd[d.token as usize] as f64 {
                    // Rejected: draw from the normalised residual max(p − q, 0).
                    let mut residual = pd.clone();
                    for &(t, qv) in &d.q {
                        residual[t as usize] = (residual[t as usize] - qv).max(0.0);
                    }
                    let pick = if residual.iter().any(|&w| w > 0.0) { sampler.sample_from(&residual) } else { sampler.sample_from(&pd) };
                    bonus = Some(pick);
                    break;
                }
            }
            if let Some(n) = opts.top_logprobs {
                push_logprob(&mut gen, logits, d.token, n);
            }
            history.push(d.token);
            accepted += 1;
        }
        let bonus = match bonus {
            Some(b) => b,
            None => sampler.sample(out.logits_row(accepted), &history),
        };
        history.truncate(n_committed);
        if let Some(n) = opts.top_logprobs {
            push_logprob(&mut gen, out.logits_row(accepted), bonus, n);
        }
        cache.rollback(k - accepted)?;
        h = out.hidden_row(accepted).to_vec();
        let verify_s = tv.elapsed().as_secs_f64();
        policy.record(k, accepted, draft_s, verify_s);

        if k > 0 {
            spec.draft_seconds += draft_s;
            spec.verify_seconds += verify_s;
            spec.draft_rounds += 1;
            spec.drafted_tokens += k;
            spec.accepted_tokens += accepted;
            for slot in spec.accepted_per_position.iter_mut().take(accepted) {
                *slot += 1;
            }
            if let Some(r) = spec.rounds.as_mut() {
                r.push(Round { drafted: drafts.iter().map(|d| d.token).collect(), accepted });
            }
        }
        emitted = drafts[..accepted].iter().map(|d| d.token).collect();
        emitted.push(bonus);
    }

    let decode_s = t1.elapsed().as_secs_f64();
    gen.stats.generated_tokens = gen.tokens.len();
    gen.logprobs.truncate(gen.tokens.len());
    if gen.tokens.len() > 1 {
        gen.stats.decode_tokens_per_s = (gen.tokens.len() - 1) as f64 / decode_s.max(1e-9);
    }
    if spec.drafted_tokens > 0 {
        spec.acceptance_rate = spec.accepted_tokens as f64 / spec.drafted_tokens as f64;
    }
    if spec.draft_rounds > 0 {
        spec.mean_accepted_per_round = spec.accepted_tokens as f64 / spec.draft_rounds as f64;
    }
    Ok((gen, spec))
}

/// The drafter's logits must be finite and name only tokens of the target's vocabulary (NaN logits would
/// make its argmax or sampling propose anything, including ids past the vocabulary).
fn check_draft(logits: &DraftLogits, vocab: usize, step: usize) -> Result<()> {
    let (ids, values): (&[u32], &[f32]) = match logits {
        DraftLogits::Full(l) => (&[], l),
        DraftLogits::Sparse { ids, logits } => (ids, logits),
    };
    if matches!(logits, DraftLogits::Full(l) if l.len() != vocab) || ids.iter().any(|&t| t as usize >= vocab) {
        bail!("the assistant proposed a token outside the target's vocabulary of {vocab} at draft step {step}");
    }
    if !values.iter().all(|x| x.is_finite()) {
        bail!(
            "the assistant's logits are not finite at draft step {step}; its weights are corrupt (NaN or infinite \
             values): run without it (--no-draft)"
        );
    }
    Ok(())
}

fn push_logprob(gen: &mut Generation, logits: &[f32], token: u32, n: usize) {
    let lp = log_softmax(logits);
    gen.logprobs.push(TokenLogprob { token, logprob: lp[token as usize], top: top_n(&lp, n) });
}

/// Sample a draft from the drafter's processed distribution. Centroid-head logits cover only the candidate
/// tokens; the others have probability 0 under q, which the residual step accounts for.
fn sample_draft(sampler: &mut Sampler, logits: &DraftLogits, history: &[u32]) -> Draft {
    match logits {
        DraftLogits::Full(l) => {
            let q = sampler.probs(l, history);
            let token = sampler.sample_from(&q);
            let support = q.iter().enumerate().filter(|(_, &p)| p > 0.0).map(|(i, &p)| (i as u32, p)).collect();
            Draft { token, q: support }
        }
        DraftLogits::Sparse { ids, logits } => {
            // Run the processors on the candidates alone, with the history mapped to candidate indices.
            let index: HashMap<u32, u32> = ids.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
            let local_history: Vec<u32> = history.iter().filter_map(|t| index.get(t).copied()).collect();
            let q = sampler.probs(logits, &local_history);
            let pick = sampler.sample_from(&q) as usize;
            let support = ids.iter().zip(&q).filter(|(_, &p)| p > 0.0).map(|(&t, &p)| (t, p)).collect();
            Draft { token: ids[pick], q: support }
        }
    }
}
