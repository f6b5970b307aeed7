//! Speculative decoding with the assistant drafter (docs/speculative.md): draft k tokens, verify them in one multi-row
//! target forward, keep the longest accepted prefix plus one target token, roll the caches back.
//!
//! Lossless by construction. Greedy: a draft is kept only if it is the target's own argmax. Sampling:
//! drafts are *sampled* from the drafter's processed distribution q (same processors as the target) and
//! accepted with probability min(1, p/q); on rejection the token comes from normalised max(p − q, 0)
//! (Leviathan et al.), so every emitted token is distributed exactly as plain sampling from p.

use anyhow::Result;
use serde::Serialize;

use crate::config::LayerType;
use crate::decode::draft_policy::DraftPolicy;
use crate::decode::generate::{Flow, GenerateOptions, Generation};
use crate::decode::sequence::{run_alone, Sequence};
use crate::model::assistant::{Assistant, DraftRow, DraftStep};
use crate::model::{KvCache, TargetModel};

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
    on_tokens: impl FnMut(&[u32]) -> Flow,
) -> Result<(Generation, SpecStats)> {
    let mut seq = Sequence::new(target, prompt, opts, Some(policy), trace)?;
    run_alone(target, Some((drafter, policy)), cache, &mut seq, on_tokens)?;
    let (gen, spec) = seq.into_results();
    Ok((gen, spec.expect("a sequence with a draft policy keeps drafting statistics")))
}
