//! One request's generation as a state machine, advanced one round at a time by whoever owns the model:
//! [`crate::decode::generate::generate_until`] and
//! [`crate::decode::speculative::generate_speculative_until`] drive one sequence alone, the engine
//! (`crate::engine`) drives many, packing their rows into one forward per step. The same code decides
//! every token in both cases, so a request's output does not depend on what it is batched with
//! (docs/speculative.md, "The loop").
//!
//! A round: the sequence is [`Phase::Prefill`] until its prompt has run (in chunks); then each round it
//! is [`Phase::Commit`] (hand the tokens of the last round to the caller, check the stop conditions),
//! then [`Phase::Ready`] (choose k, draft k tokens, then run `1 + k` rows: the last token and the drafts)
//! until [`Phase::Done`]. Plain decoding is the same loop with k = 0.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::decode::draft_policy::DraftPolicy;
use crate::decode::generate::{
    check_logits, validate_prompt, FinishReason, Flow, GenerateOptions, Generation, TokenLogprob, PREFILL_CHUNK,
};
use crate::decode::sampling::{log_softmax, top_n, Sampler};
use crate::decode::speculative::{Drafter, Round, SpecStats};
use crate::model::assistant::{DraftLogits, DraftStep};
use crate::model::cache::MAX_ROLLBACK;
use crate::model::{Forward, Keep, KvCache, TargetModel};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Prompt positions still to run.
    Prefill,
    /// Tokens of the last round to hand over ([`Sequence::commit`]).
    Commit,
    /// Ready for the next round ([`Sequence::plan`], drafts, then [`Sequence::verify_rows`]).
    Ready,
    Done,
}

/// A draft token and the drafter distribution it was drawn from (for the acceptance test).
struct Draft {
    token: u32,
    /// Sampling only: (token, probability) of q's support.
    q: Vec<(u32, f32)>,
    /// The drafter's probability of `token` (greedy: of its argmax under its raw logits, NaN when the
    /// policy is not `auto`; sampling: under q). `auto` stops drafting on it (docs/speculative.md,
    /// "Confidence").
    confidence: f32,
}

pub struct Sequence {
    opts: GenerateOptions,
    /// Ids that end generation (empty with `ignore_eos`).
    eos: Vec<u32>,
    vocab: usize,
    sampler: Sampler,
    greedy: bool,
    /// Prompt then committed tokens (drafts are pushed while a round is built, then taken off).
    history: Vec<u32>,
    prompt_len: usize,
    /// Prompt positions in the cache.
    prefilled: usize,
    gen: Generation,
    spec: Option<SpecStats>,
    phase: Phase,
    /// Tokens decided in the last round, not yet committed.
    emitted: Vec<u32>,
    /// The hidden state the next draft step starts from (the last verified row's).
    h: Vec<f32>,
    /// The round being built: its draft count and drafts, and the drafter's last hidden state.
    k: usize,
    drafts: Vec<Draft>,
    draft_h: Vec<f32>,
    draft_s: f64,
    /// The last verified round: (drafted, accepted, seconds of drafting), and its drafts' confidences.
    last_round: (usize, usize, f64),
    last_confidences: Vec<f32>,
    /// Greedy drafts' confidence is computed only for `auto`, which uses it (a softmax over the
    /// drafter's logits: a whole vocabulary for the tied head); otherwise it is NaN.
    wants_confidence: bool,
    t_start: Instant,
    t_decode: Option<Instant>,
}

impl Sequence {
    /// A sequence for `prompt` on `model`. With `draft`, the most tokens its policy may draft per round,
    /// it keeps drafting statistics (`trace`: every round too); rounds draft when [`Sequence::plan`] gets
    /// the policy.
    pub fn new(
        model: &TargetModel,
        prompt: &[u32],
        opts: &GenerateOptions,
        draft: Option<&DraftPolicy>,
        trace: bool,
    ) -> Result<Sequence> {
        validate_prompt(model, prompt, opts.context_limit)?;
        opts.sampling.validate()?;
        let spec = draft.map(|p| SpecStats {
            accepted_per_position: vec![0; p.max_draft().min(MAX_ROLLBACK - 1)],
            rounds: trace.then(Vec::new),
            ..SpecStats::default()
        });
        let eos = if opts.ignore_eos { Vec::new() } else { model.cfg.eos_token_ids.clone() };
        Ok(Sequence {
            opts: opts.clone(),
            eos,
            vocab: model.cfg.vocab_size,
            sampler: Sampler::new(opts.sampling.clone()),
            greedy: opts.sampling.is_greedy(),
            history: prompt.to_vec(),
            prompt_len: prompt.len(),
            prefilled: 0,
            gen: Generation::new(prompt.len()),
            spec,
            phase: if opts.max_new_tokens == 0 { Phase::Done } else { Phase::Prefill },
            emitted: Vec::new(),
            h: Vec::new(),
            k: 0,
            drafts: Vec::new(),
            draft_h: Vec::new(),
            draft_s: 0.0,
            last_round: (0, 0, 0.0),
            last_confidences: Vec::new(),
            wants_confidence: draft.is_some_and(|p| p.auto().is_some()),
            t_start: Instant::now(),
            t_decode: None,
        })
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn prompt(&self) -> &[u32] {
        &self.history[..self.prompt_len]
    }

    /// Positions the sequence may still occupy in the cache (prompt + what it may generate).
    pub fn reserved_positions(&self) -> usize {
        (self.prompt_len + self.opts.max_new_tokens).min(self.opts.context_limit)
    }

    /// Reuse the prefix of the prompt that `cache` already holds (from an earlier run).
    pub fn start(&mut self, cache: &mut KvCache) {
        self.prefilled = cache.reuse_prefix(self.prompt());
        self.gen.stats.cached_prompt_tokens = self.prefilled;
        self.t_start = Instant::now();
    }

    /// Prompt tokens not yet in the cache.
    pub fn prefill_remaining(&self) -> usize {
        self.prompt_len.saturating_sub(self.prefilled)
    }

    /// The next prefill chunk (at most `max_rows` prompt tokens), to run with `Keep::Last`.
    pub fn prefill_chunk(&self, max_rows: usize) -> Vec<u32> {
        debug_assert_eq!(self.phase, Phase::Prefill);
        let end = (self.prefilled + max_rows.max(1)).min(self.prompt_len);
        self.history[self.prefilled..end].to_vec()
    }

    /// Take the forward of a prefill chunk of `rows` tokens; after the last one, choose the first token.
    pub fn absorb_prefill(&mut self, rows: usize, fwd: &Forward) -> Result<()> {
        self.prefilled += rows;
        if self.prefilled < self.prompt_len {
            return Ok(());
        }
        let run = (self.prompt_len - self.gen.stats.cached_prompt_tokens) as f64;
        self.gen.stats.prefill_tokens_per_s = run / self.t_start.elapsed().as_secs_f64().max(1e-9);
        self.t_decode = Some(Instant::now());
        let logits = fwd.logits_row(fwd.rows - 1);
        check_logits(logits, 1)?;
        let token = self.sampler.sample(logits, &self.history);
        if let Some(n) = self.opts.top_logprobs {
            push_logprob(&mut self.gen, logits, token, n);
        }
        self.h = fwd.hidden_row(fwd.rows - 1).to_vec();
        self.emitted = vec![token];
        self.phase = Phase::Commit;
        Ok(())
    }

    /// Hand the last round's tokens to `on_tokens` (up to an end-of-sequence id), then decide whether the
    /// sequence goes on. Returns the tokens committed (after any cut `on_tokens` asked for).
    pub fn commit(&mut self, on_tokens: impl FnOnce(&[u32]) -> Flow) -> Vec<u32> {
        debug_assert_eq!(self.phase, Phase::Commit);
        let emitted = std::mem::take(&mut self.emitted);
        let mut stop = false;
        let mut keep = 0;
        for &t in &emitted {
            self.history.push(t);
            self.gen.tokens.push(t);
            keep += 1;
            if self.eos.contains(&t) {
                self.gen.finish_reason = FinishReason::Stop;
                stop = true;
                break;
            }
        }
        self.gen.logprobs.truncate(self.gen.tokens.len().min(self.gen.logprobs.len()));
        let mut committed = emitted[..keep].to_vec();
        if let Flow::StopAfter(n) = on_tokens(&emitted[..keep]) {
            let n = n.min(keep);
            self.gen.tokens.truncate(self.gen.tokens.len() - (keep - n));
            committed.truncate(n);
            self.gen.finish_reason = FinishReason::Stop;
            self.finish();
        } else if stop || self.gen.tokens.len() >= self.opts.max_new_tokens {
            self.finish();
        } else if self.history.len() >= self.opts.context_limit {
            self.gen.context_limited = true;
            self.finish();
        } else {
            self.phase = Phase::Ready;
        }
        committed
    }

    /// End the sequence now (also for a cancelled request): the statistics are final.
    pub fn finish(&mut self) {
        self.phase = Phase::Done;
        self.gen.stats.generated_tokens = self.gen.tokens.len();
        self.gen.logprobs.truncate(self.gen.tokens.len());
        if let Some(t) = self.t_decode {
            if self.gen.tokens.len() > 1 {
                self.gen.stats.decode_tokens_per_s =
                    (self.gen.tokens.len() - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9);
            }
        }
        if let Some(spec) = self.spec.as_mut() {
            if spec.drafted_tokens > 0 {
                spec.acceptance_rate = spec.accepted_tokens as f64 / spec.drafted_tokens as f64;
            }
            if spec.draft_rounds > 0 {
                spec.mean_accepted_per_round = spec.accepted_tokens as f64 / spec.draft_rounds as f64;
            }
        }
    }

    /// Start a round: how many tokens to draft (0 without a policy, or when the budget allows none).
    pub fn plan(&mut self, policy: Option<&mut DraftPolicy>) -> usize {
        let k = match policy {
            Some(p) => {
                let k_max = self.draft_room(p.max_draft());
                p.choose(k_max)
            }
            None => 0,
        };
        self.begin_round(k)
    }

    /// The most drafts the next round may have under `cap`: the token budget and the context leave room
    /// for the drafts and the target's own token after them.
    pub fn draft_room(&self, cap: usize) -> usize {
        let remaining = self.opts.max_new_tokens - self.gen.tokens.len();
        let room = self.opts.context_limit - self.history.len() - 1;
        cap.min(MAX_ROLLBACK - 1).min(remaining - 1).min(room)
    }

    /// Start a round of `k` drafts (chosen by the caller; at most [`Sequence::draft_room`]).
    pub fn begin_round(&mut self, k: usize) -> usize {
        debug_assert_eq!(self.phase, Phase::Ready);
        debug_assert!(k <= self.draft_room(MAX_ROLLBACK));
        self.k = k;
        self.drafts.clear();
        self.draft_h = self.h.clone();
        self.draft_s = 0.0;
        self.k
    }

    /// Draft tokens still to make this round.
    pub fn drafts_wanted(&self) -> usize {
        self.k - self.drafts.len()
    }

    /// The next draft step's input: (token, hidden state, query position). The position stays the last
    /// committed token's for every step of a round (docs/drafter.md, "Positions").
    pub fn draft_input(&self) -> (u32, &[f32], usize) {
        let token = self.drafts.last().map_or(*self.history.last().expect("non-empty"), |d| d.token);
        (token, &self.draft_h, self.prompt_len + self.gen.tokens.len() - 1)
    }

    /// Take a draft step's output: pick the draft (greedy: the argmax; sampling: a sample from the
    /// drafter's processed distribution), and remember the hidden state for the next step.
    pub fn add_draft(&mut self, step: DraftStep, seconds: f64) -> Result<()> {
        check_draft(&step.logits, self.vocab, self.gen.tokens.len() + self.drafts.len() + 1)?;
        let d = if self.greedy {
            let (token, confidence) = if self.wants_confidence {
                step.logits.argmax_and_probability()
            } else {
                (step.logits.argmax(), f32::NAN)
            };
            Draft { token, q: Vec::new(), confidence }
        } else {
            // The repetition penalty sees the drafts so far, as the target will.
            sample_draft(&mut self.sampler, &step.logits, &self.history)
        };
        self.history.push(d.token);
        self.drafts.push(d);
        self.draft_h = step.hidden;
        self.draft_s += seconds;
        Ok(())
    }

    /// The drafter's confidence in each draft of the round so far.
    pub fn draft_confidences(&self) -> Vec<f32> {
        self.drafts.iter().map(|d| d.confidence).collect()
    }

    /// End the round's drafting here: the drafts so far are verified (`auto` decided that one more
    /// would not pay, docs/speculative.md, "Confidence").
    pub fn stop_drafting(&mut self) {
        self.k = self.drafts.len();
    }

    /// The rows of this round's target forward: the last committed token, then the drafts (`Keep::All`).
    pub fn verify_rows(&self) -> Vec<u32> {
        let n_committed = self.history.len() - self.drafts.len();
        let mut rows = vec![self.history[n_committed - 1]];
        rows.extend(self.drafts.iter().map(|d| d.token));
        rows
    }

    /// Take the round's forward: accept the longest prefix of drafts the target agrees with (greedy) or
    /// accepts (sampling: min(1, p/q), a rejection resampled from max(p − q, 0)), add the target's own
    /// next token, roll the cache back over the rejected rows.
    pub fn absorb_verify(
        &mut self,
        cache: &mut KvCache,
        out: &Forward,
        verify_s: f64,
        policy: Option<&mut DraftPolicy>,
    ) -> Result<()> {
        let k = self.k;
        let n_committed = self.history.len() - k;
        self.history.truncate(n_committed);
        for r in 0..out.rows {
            check_logits(out.logits_row(r), self.gen.tokens.len() + r + 1)?;
        }
        let mut accepted = 0;
        let mut bonus = None;
        for (i, d) in self.drafts.iter().enumerate() {
            let logits = out.logits_row(i);
            if self.greedy {
                let y = self.sampler.sample(logits, &self.history);
                if y != d.token {
                    bonus = Some(y);
                    break;
                }
            } else {
                let pd = self.sampler.probs(logits, &self.history);
                let q_tok = d.q.iter().find(|(t, _)| *t == d.token).map_or(0.0, |x| x.1);
                let u = self.sampler.rng().next_f64();
                if (u * q_tok as f64) >= pd[d.token as usize] as f64 {
                    // Rejected: draw from the normalised residual max(p − q, 0).
                    let mut residual = pd.clone();
                    for &(t, qv) in &d.q {
                        residual[t as usize] = (residual[t as usize] - qv).max(0.0);
                    }
                    let pick = if residual.iter().any(|&w| w > 0.0) {
                        self.sampler.sample_from(&residual)
                    } else {
                        self.sampler.sample_from(&pd)
                    };
                    bonus = Some(pick);
                    break;
                }
            }
            if let Some(n) = self.opts.top_logprobs {
                push_logprob(&mut self.gen, logits, d.token, n);
            }
            self.history.push(d.token);
            accepted += 1;
        }
        let bonus = match bonus {
            Some(b) => b,
            None => self.sampler.sample(out.logits_row(accepted), &self.history),
        };
        self.history.truncate(n_committed);
        if let Some(n) = self.opts.top_logprobs {
            push_logprob(&mut self.gen, out.logits_row(accepted), bonus, n);
        }
        cache.rollback(k - accepted)?;
        self.h = out.hidden_row(accepted).to_vec();
        self.last_confidences = self.draft_confidences();
        if let Some(p) = policy {
            p.record(k, accepted, self.draft_s, verify_s);
            p.record_confidences(&self.last_confidences, accepted);
        }
        if let (Some(spec), true) = (self.spec.as_mut(), k > 0) {
            spec.draft_seconds += self.draft_s;
            spec.verify_seconds += verify_s;
            spec.draft_rounds += 1;
            spec.drafted_tokens += k;
            spec.accepted_tokens += accepted;
            for slot in spec.accepted_per_position.iter_mut().take(accepted) {
                *slot += 1;
            }
            if let Some(r) = spec.rounds.as_mut() {
                r.push(Round { drafted: self.drafts.iter().map(|d| d.token).collect(), accepted });
            }
        }
        self.last_round = (k, accepted, self.draft_s);
        self.emitted = self.drafts[..accepted].iter().map(|d| d.token).collect();
        self.emitted.push(bonus);
        self.drafts.clear();
        self.k = 0;
        self.phase = Phase::Commit;
        Ok(())
    }

    /// The last verified round: (drafts, accepted drafts, seconds spent drafting them).
    pub fn last_round(&self) -> (usize, usize, f64) {
        self.last_round
    }

    /// The drafter's confidence in each draft of the last verified round.
    pub fn last_confidences(&self) -> &[f32] {
        &self.last_confidences
    }

    pub fn generation(&self) -> &Generation {
        &self.gen
    }

    /// The final generation and drafting statistics (call after [`Phase::Done`]).
    pub fn into_results(self) -> (Generation, Option<SpecStats>) {
        (self.gen, self.spec)
    }
}

fn push_logprob(gen: &mut Generation, logits: &[f32], token: u32, n: usize) {
    let lp = log_softmax(logits);
    gen.logprobs.push(TokenLogprob { token, logprob: lp[token as usize], top: top_n(&lp, n) });
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

/// Sample a draft from the drafter's processed distribution. Centroid-head logits cover only the candidate
/// tokens; the others have probability 0 under q, which the residual step accounts for.
fn sample_draft(sampler: &mut Sampler, logits: &DraftLogits, history: &[u32]) -> Draft {
    match logits {
        DraftLogits::Full(l) => {
            let q = sampler.probs(l, history);
            let token = sampler.sample_from(&q);
            let support = q.iter().enumerate().filter(|(_, &p)| p > 0.0).map(|(i, &p)| (i as u32, p)).collect();
            Draft { token, q: support, confidence: q[token as usize] }
        }
        DraftLogits::Sparse { ids, logits } => {
            // Run the processors on the candidates alone, with the history mapped to candidate indices.
            let index: HashMap<u32, u32> = ids.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
            let local_history: Vec<u32> = history.iter().filter_map(|t| index.get(t).copied()).collect();
            let q = sampler.probs(logits, &local_history);
            let pick = sampler.sample_from(&q) as usize;
            let support = ids.iter().zip(&q).filter(|(_, &p)| p > 0.0).map(|(&t, &p)| (t, p)).collect();
            Draft { token: ids[pick], q: support, confidence: q[pick] }
        }
    }
}

/// Drive one sequence alone to its end on `cache`: chunked prefill, then rounds, drafting with `drafter`
/// as `policy` decides (both or neither). `on_tokens` sees each round's committed tokens.
pub fn run_alone<D: Drafter + ?Sized>(
    target: &TargetModel,
    drafter: Option<(&D, &mut DraftPolicy)>,
    cache: &mut KvCache,
    seq: &mut Sequence,
    mut on_tokens: impl FnMut(&[u32]) -> Flow,
) -> Result<()> {
    if seq.phase() == Phase::Done {
        return Ok(());
    }
    let (drafter, mut policy) = match drafter {
        Some((d, p)) => (Some(d), Some(p)),
        None => (None, None),
    };
    seq.start(cache);
    loop {
        match seq.phase() {
            Phase::Prefill => {
                let chunk = seq.prefill_chunk(PREFILL_CHUNK);
                let fwd = target.forward(cache, &chunk, Keep::Last)?;
                seq.absorb_prefill(chunk.len(), &fwd)?;
            }
            Phase::Commit => {
                seq.commit(&mut on_tokens);
            }
            Phase::Ready => {
                seq.plan(policy.as_deref_mut());
                if let Some(d) = drafter {
                    while seq.drafts_wanted() > 0 {
                        let t = Instant::now();
                        let (token, h, p) = seq.draft_input();
                        let step = d.draft_step(target, cache, token, h, p);
                        seq.add_draft(step, t.elapsed().as_secs_f64())?;
                        if seq.drafts_wanted() > 0
                            && !policy.as_deref().is_none_or(|p| p.keep_drafting(&seq.draft_confidences()))
                        {
                            seq.stop_drafting();
                        }
                    }
                }
                let t = Instant::now();
                let out = target.forward(cache, &seq.verify_rows(), Keep::All)?;
                seq.absorb_verify(cache, &out, t.elapsed().as_secs_f64(), policy.as_deref_mut())?;
            }
            Phase::Done => return Ok(()),
        }
    }
}
