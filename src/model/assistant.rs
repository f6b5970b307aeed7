//! The assistant (MTP) drafter (docs/drafter.md): a few query-only layers over the target's store-layer K/V,
//! fed `[target embedding of the last token ; target hidden]`, chained through `post_projection`.

use std::path::Path;

use anyhow::{bail, Result};

use crate::config::{load_assistant_config, AssistantConfig, DraftHead, LayerType};
use crate::kernels::{self, DType};
use crate::model::cache::LayerKv;
use crate::model::ops::{add_normed, attend, gelu_mlp, norm_heads, norm_rows};
use crate::model::rope::{Angles, Rope};
use crate::model::sections::section;
use crate::weights::{StoredDtype, Tensor, WeightStore};
use std::sync::Mutex;

struct DraftLayer {
    kind: LayerType,
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ff_norm: Vec<f32>,
    post_ff_norm: Vec<f32>,
    q: Tensor,
    q_norm: Vec<f32>,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    scalar: f32,
}

struct Centroids {
    weight: Tensor,
    /// `token_ordering` as `[num_centroids, V / num_centroids]`: the tokens of each cluster.
    ordering: Vec<u32>,
    top_k: usize,
}

/// Drafter logits: the whole vocabulary (tied head) or only the candidates of the chosen clusters.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftLogits {
    Full(Vec<f32>),
    Sparse { ids: Vec<u32>, logits: Vec<f32> },
}

impl DraftLogits {
    /// The greedy draft: the highest logit, ties to the lowest token id (torch's argmax over the vocabulary).
    pub fn argmax(&self) -> u32 {
        match self {
            DraftLogits::Full(l) => kernels::argmax(l) as u32,
            DraftLogits::Sparse { ids, logits } => {
                let mut best = (f32::NEG_INFINITY, u32::MAX);
                for (&id, &v) in ids.iter().zip(logits) {
                    if v > best.0 || (v == best.0 && id < best.1) {
                        best = (v, id);
                    }
                }
                best.1
            }
        }
    }

    /// The greedy draft ([`DraftLogits::argmax`]) and its probability under the softmax of these logits
    /// (the centroid head's: among its candidates): the drafter's confidence in it, which `auto` uses to
    /// stop drafting (docs/speculative.md, "Confidence"). The logits must be finite.
    pub fn argmax_and_probability(&self) -> (u32, f32) {
        let values = match self {
            DraftLogits::Full(l) => l,
            DraftLogits::Sparse { logits, .. } => logits,
        };
        let m = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut e = vec![0f32; values.len()];
        kernels::exp_shifted(values, m, &mut e);
        let z: f64 = e.iter().map(|&x| f64::from(x)).sum();
        (self.argmax(), if z > 0.0 { (1.0 / z) as f32 } else { 0.0 })
    }

    /// The vocabulary-sized logits transformers returns: non-candidates hold `min(candidates) − 1`.
    pub fn to_full(&self, vocab: usize, dt: DType) -> Vec<f32> {
        match self {
            DraftLogits::Full(l) => l.clone(),
            DraftLogits::Sparse { ids, logits } => {
                let min = logits.iter().copied().fold(f32::INFINITY, f32::min);
                let mut out = vec![dt.round(min - 1.0); vocab];
                for (&id, &v) in ids.iter().zip(logits) {
                    out[id as usize] = v;
                }
                out
            }
        }
    }
}

pub struct DraftStep {
    pub logits: DraftLogits,
    /// `post_projection` of the drafter's final-normed state: the next step's `h`.
    pub hidden: Vec<f32>,
}

/// One row of a batched draft step ([`Assistant::step_batch`]): the target's scaled embedding of the input
/// token, the previous hidden state (both of size Hb), that sequence's target store-layer K/V and the query
/// position `p`.
pub struct DraftRow<'a> {
    pub embedding: &'a [f32],
    pub h: &'a [f32],
    pub sliding: &'a LayerKv,
    pub full: &'a LayerKv,
    pub p: usize,
}

impl<'a> DraftRow<'a> {
    /// The target K/V a drafter layer of `kind` reads.
    fn kv(&self, kind: LayerType) -> &'a LayerKv {
        match kind {
            LayerType::Sliding => self.sliding,
            LayerType::Full => self.full,
        }
    }
}

/// Quantize a drafter's matrices in `store` with `recipe`; returns the summary line.
pub fn quantize_assistant(
    store: &mut WeightStore,
    cfg: &AssistantConfig,
    recipe: crate::quantize::Recipe,
) -> Result<String> {
    let plan = crate::quantize::assistant_plan(recipe, cfg.text.num_layers(), store);
    Ok(crate::quantize::apply(store, &plan)?.line("the assistant", recipe))
}

/// Draft positions and their RoPE tables (sliding layers, full layers).
type RoundAngles = (Vec<usize>, Option<Angles>, Option<Angles>);

pub struct Assistant {
    pub cfg: AssistantConfig,
    pub dtype: DType,
    pre_proj: Tensor,
    post_proj: Tensor,
    embed: Tensor,
    final_norm: Vec<f32>,
    layers: Vec<DraftLayer>,
    centroids: Option<Centroids>,
    rope_sliding: Rope,
    rope_full: Rope,
    /// The last draft step's positions and RoPE tables (sliding, full): every draft step of a round
    /// queries the same positions, so only a round's first computes them.
    angles: Mutex<Option<RoundAngles>>,
}

impl Assistant {
    /// Load the assistant in `dir` and check that it belongs to a target with config `target`.
    pub fn load_for(dir: &Path, target: &crate::config::TextConfig) -> Result<Assistant> {
        Assistant::load_for_with(dir, target, None, |_| {})
    }

    /// [`Assistant::load_for`], quantizing the drafter's matrices with `recipe` (`--quantize-assistant`).
    pub fn load_for_with(
        dir: &Path,
        target: &crate::config::TextConfig,
        recipe: Option<crate::quantize::Recipe>,
        say: impl FnOnce(String),
    ) -> Result<Assistant> {
        use anyhow::Context;
        let a = Assistant::load_with(dir, recipe, say).context("cannot load the assistant")?;
        crate::config::validate_pair(target, &a.cfg).context("the assistant does not match the target")?;
        Ok(a)
    }

    pub fn load(dir: &Path) -> Result<Assistant> {
        Assistant::load_with(dir, None, |_| {})
    }

    pub fn load_with(
        dir: &Path,
        recipe: Option<crate::quantize::Recipe>,
        say: impl FnOnce(String),
    ) -> Result<Assistant> {
        if crate::gguf::is_gguf(dir) {
            let m = crate::gguf::GgufModel::open(dir, recipe.is_some())?;
            let cfg = crate::gguf::gemma4::assistant_config(&m)?;
            let mut store = crate::gguf::gemma4::assistant_store(&m)?;
            if let Some(r) = recipe {
                crate::gguf::gemma4::refuse_requantize(&m, r)?;
                say(quantize_assistant(&mut store, &cfg, r)?);
                store.move_floats_to_huge_pages()?;
            }
            crate::quantize::pack_for_kernels(&mut store);
            return Assistant::from_store(cfg, &store).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()));
        }
        crate::files::require_dir(dir, "assistant directory")?;
        let cfg = load_assistant_config(dir)?;
        let mut store = WeightStore::open_with(dir, recipe.is_some())?;
        if let Some(r) = recipe {
            say(quantize_assistant(&mut store, &cfg, r)?);
            store.move_floats_to_huge_pages()?;
        }
        crate::quantize::pack_for_kernels(&mut store);
        Assistant::from_store(cfg, &store)
    }

    pub fn from_store(cfg: AssistantConfig, store: &WeightStore) -> Result<Assistant> {
        let t = &cfg.text;
        let (v, hd, hb, hq) = (t.vocab_size, t.hidden_size, cfg.backbone_hidden_size, t.num_heads);
        let held = store.count_layers("model.layers.");
        if held < t.num_layers() {
            bail!("the assistant config declares {} layers but its weights hold {held}", t.num_layers());
        }
        let vec = |name: &str, n: usize| -> Result<Vec<f32>> { store.require_full(name, &[n])?.to_f32() };
        let embed = store.require_full("model.embed_tokens.weight", &[v, hd])?;
        let dtype = embed.compute_dtype()?;
        let mut layers = Vec::new();
        for (i, lc) in t.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let d = lc.head_dim;
            let scalar = match store.get_full(&format!("{p}layer_scalar")) {
                Some(_) => store.require_full(&format!("{p}layer_scalar"), &[1])?.to_f32()?[0],
                None => 1.0,
            };
            layers.push(DraftLayer {
                kind: lc.kind,
                input_norm: vec(&format!("{p}input_layernorm.weight"), hd)?,
                post_attn_norm: vec(&format!("{p}post_attention_layernorm.weight"), hd)?,
                pre_ff_norm: vec(&format!("{p}pre_feedforward_layernorm.weight"), hd)?,
                post_ff_norm: vec(&format!("{p}post_feedforward_layernorm.weight"), hd)?,
                q: store.require_full(&format!("{p}self_attn.q_proj.weight"), &[hq * d, hd])?,
                q_norm: vec(&format!("{p}self_attn.q_norm.weight"), d)?,
                o: store.require_full(&format!("{p}self_attn.o_proj.weight"), &[hd, hq * d])?,
                gate: store.require_full(&format!("{p}mlp.gate_proj.weight"), &[lc.intermediate_size, hd])?,
                up: store.require_full(&format!("{p}mlp.up_proj.weight"), &[lc.intermediate_size, hd])?,
                down: store.require_full(&format!("{p}mlp.down_proj.weight"), &[hd, lc.intermediate_size])?,
                scalar: dtype.round(scalar),
            });
        }
        let has_centroid_tensors = store.get_full("masked_embedding.centroids.weight").is_some()
            || store.get_full("masked_embedding.token_ordering").is_some();
        let centroids = match cfg.head {
            DraftHead::Centroid { num_centroids, top_k } => {
                if !has_centroid_tensors {
                    bail!("the assistant config sets use_ordered_embeddings (centroid head) but the checkpoint has no masked_embedding tensors");
                }
                let weight = store.require_full("masked_embedding.centroids.weight", &[num_centroids, hd])?;
                let ordering = token_ordering(store, v)?;
                Some(Centroids { weight, ordering, top_k })
            }
            DraftHead::Tied => {
                if has_centroid_tensors {
                    bail!("the assistant checkpoint has masked_embedding (centroid head) tensors but its config has use_ordered_embeddings false");
                }
                None
            }
        };
        let d_s = t.geometry(LayerType::Sliding).map_or(2, |g| g.0);
        let d_f = t.geometry(LayerType::Full).map_or(2, |g| g.0);
        Ok(Assistant {
            pre_proj: store.require_full("pre_projection.weight", &[hd, 2 * hb])?,
            post_proj: store.require_full("post_projection.weight", &[hb, hd])?,
            final_norm: vec("model.norm.weight", hd)?,
            rope_sliding: Rope::new(&t.rope_sliding, d_s),
            rope_full: Rope::new(&t.rope_full, d_f),
            angles: Mutex::new(None),
            embed,
            dtype,
            layers,
            centroids,
            cfg,
        })
    }

    /// One draft step at query position `p` (docs/drafter.md, "Positions"): full layers see the donor
    /// keys `0..p`, sliding layers the last W+1 of them. `embedding` is the target's scaled embedding of the
    /// input token and `h` the previous target (or drafter) hidden state, both of size Hb. One row of
    /// [`Assistant::step_batch`].
    pub fn step(&self, embedding: &[f32], h: &[f32], sliding: &LayerKv, full: &LayerKv, p: usize) -> DraftStep {
        let row = DraftRow { embedding, h, sliding, full, p };
        self.step_batch(&[row]).pop().expect("one step per row")
    }

    /// Draft steps for many rows at once (different sequences: each row has its own position and its own
    /// target K/V). The matmuls (projections, MLP, head) run once over all rows, so the weights are read
    /// once; RoPE and attention run per row. Row `i` has the bits `step` would give it alone
    /// (docs/numerics.md, "Batch invariance").
    pub fn step_batch(&self, rows: &[DraftRow<'_>]) -> Vec<DraftStep> {
        let t = &self.cfg.text;
        let (dt, eps, hq, hb) = (self.dtype, t.rms_norm_eps, t.num_heads, self.cfg.backbone_hidden_size);
        let n = rows.len();
        if n == 0 {
            return Vec::new();
        }
        let mut u = Vec::with_capacity(n * 2 * hb);
        for (i, r) in rows.iter().enumerate() {
            assert!(
                r.embedding.len() == hb && r.h.len() == hb,
                "draft row {i}: embedding and h must have {hb} values (got {} and {})",
                r.embedding.len(),
                r.h.len()
            );
            u.extend_from_slice(r.embedding);
            u.extend_from_slice(r.h);
        }
        let mut x = vec![0f32; n * t.hidden_size];
        section("draft pre-projection", || kernels::matmul(&u, n, self.pre_proj.mat(), &mut x));
        dt.round_slice(&mut x);
        // RoPE's cos and sin per row, once per layer type (they depend only on the position).
        let (angles_sliding, angles_full) = self.angles_at(rows);
        for layer in &self.layers {
            let (rope, angles) = match layer.kind {
                LayerType::Sliding => (&self.rope_sliding, &angles_sliding),
                LayerType::Full => (&self.rope_full, &angles_full),
            };
            let angles = angles.as_ref().expect("a table for every layer type the drafter has");
            let d = rows[0].kv(layer.kind).head_dim;
            let a = section("draft norms", || norm_rows(&x, n, &layer.input_norm, eps, dt));
            let mut q = vec![0f32; n * hq * d];
            section("draft q", || kernels::matmul(&a, n, layer.q.mat(), &mut q));
            section("draft q norm, rope", || {
                dt.round_slice(&mut q);
                norm_heads(&mut q, d, Some(&layer.q_norm), eps, dt);
                for (i, qr) in q.chunks_exact_mut(hq * d).enumerate() {
                    let (cos, sin) = angles.row(i);
                    rope.apply(qr, cos, sin, dt);
                }
            });
            // No causal mask: every donor key is in the past. Sliding layers keep W+1 of them
            // (docs/drafter.md, "Which target K/V it reads").
            let mut o = vec![0f32; n * hq * d];
            let attend_row = |((qr, or), r): ((&[f32], &mut [f32]), &DraftRow<'_>)| {
                let (p, kv) = (r.p, r.kv(layer.kind));
                debug_assert_eq!(kv.head_dim, d, "every row's K/V has the layer's head_dim");
                let lo = match layer.kind {
                    LayerType::Sliding => p.saturating_sub(t.sliding_window + 1),
                    LayerType::Full => 0,
                };
                attend(qr, kv, 1, hq, |_| lo..p, dt, or);
            };
            section("draft attention", || {
                let work = q.chunks_exact(hq * d).zip(o.chunks_exact_mut(hq * d)).zip(rows).collect();
                kernels::par_map(work, attend_row)
            });
            let mut out = vec![0f32; n * t.hidden_size];
            section("draft o", || kernels::matmul(&o, n, layer.o.mat(), &mut out));
            let xn = section("draft norms", || {
                dt.round_slice(&mut out);
                add_normed(&mut x, &out, &layer.post_attn_norm, eps, dt);
                norm_rows(&x, n, &layer.pre_ff_norm, eps, dt)
            });
            let m = section("draft mlp", || gelu_mlp(&xn, n, layer.gate.mat(), layer.up.mat(), layer.down.mat(), dt));
            section("draft norms", || {
                add_normed(&mut x, &m, &layer.post_ff_norm, eps, dt);
                let s = layer.scalar;
                x.iter_mut().for_each(|v| *v *= s);
                dt.round_slice(&mut x);
            });
        }
        let hd = section("draft norms", || norm_rows(&x, n, &self.final_norm, eps, dt));
        let mut hidden = vec![0f32; n * hb];
        section("draft post-projection", || kernels::matmul(&hd, n, self.post_proj.mat(), &mut hidden));
        dt.round_slice(&mut hidden);
        let logits = section("draft head", || self.head(&hd, n));
        if n == 1 {
            return logits
                .into_iter()
                .map(|logits| DraftStep { logits, hidden: std::mem::take(&mut hidden) })
                .collect();
        }
        logits
            .into_iter()
            .zip(hidden.chunks_exact(hb))
            .map(|(logits, h)| DraftStep { logits, hidden: h.to_vec() })
            .collect()
    }

    /// RoPE's tables (sliding, full) at the rows' positions: the last step's when the positions are
    /// the same (a round's later draft steps), else computed and remembered.
    fn angles_at(&self, rows: &[DraftRow<'_>]) -> (Option<Angles>, Option<Angles>) {
        let mut memo = self.angles.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((positions, sliding, full)) = memo.as_ref() {
            if positions.iter().copied().eq(rows.iter().map(|r| r.p)) {
                return (sliding.clone(), full.clone());
            }
        }
        let has = |kind: LayerType| self.layers.iter().any(|l| l.kind == kind);
        let table =
            |kind: LayerType, rope: &Rope| has(kind).then(|| rope.angles_of(rows.iter().map(|r| r.p), self.dtype));
        let (sliding, full) = (table(LayerType::Sliding, &self.rope_sliding), table(LayerType::Full, &self.rope_full));
        *memo = Some((rows.iter().map(|r| r.p).collect(), sliding.clone(), full.clone()));
        (sliding, full)
    }

    /// The head over the `n` rows of `hd`: one matmul for all rows (the tied head's logits, or the
    /// centroid scores), then, for the centroid head, each row's candidates.
    fn head(&self, hd: &[f32], n: usize) -> Vec<DraftLogits> {
        let dt = self.dtype;
        let embed = self.embed.mat();
        let Some(c) = &self.centroids else {
            let mut logits = vec![0f32; n * embed.rows()];
            kernels::matmul(hd, n, embed, &mut logits);
            dt.round_slice(&mut logits);
            if n == 1 {
                return vec![DraftLogits::Full(logits)];
            }
            return logits.chunks_exact(embed.rows()).map(|l| DraftLogits::Full(l.to_vec())).collect();
        };
        let num_c = c.weight.shape[0];
        let mut all_scores = vec![0f32; n * num_c];
        kernels::matmul(hd, n, c.weight.mat(), &mut all_scores);
        dt.round_slice(&mut all_scores);
        let per = embed.rows() / num_c;
        let width = hd.len() / n;
        let mut order: Vec<u32> = Vec::with_capacity(num_c);
        let mut rows = Vec::with_capacity(n);
        for (scores, x) in all_scores.chunks_exact(num_c).zip(hd.chunks_exact(width)) {
            // The top-k clusters (which of equal scores win is immaterial: ties at the boundary are
            // measure-zero for trained weights, and any choice is a valid draft under lossless verification).
            order.clear();
            order.extend(0..num_c as u32);
            order.select_nth_unstable_by(c.top_k - 1, |&a, &b| {
                scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b))
            });
            let mut ids = Vec::with_capacity(c.top_k * per);
            for &cl in &order[..c.top_k] {
                ids.extend_from_slice(&c.ordering[cl as usize * per..(cl as usize + 1) * per]);
            }
            rows.push((x, ids));
        }
        // Each row's candidates are its own gather (128 KiB of scattered rows for the shipped drafter):
        // rows run side by side on the pool, each with the bits it gets alone. A single row runs on this
        // thread outside any region (`par_map` of one item), so its gather still splits over the pool.
        kernels::par_map(rows, |(x, ids): (&[f32], Vec<u32>)| {
            let mut logits = vec![0f32; ids.len()];
            kernels::matmul_gather(x, embed, &ids, &mut logits);
            dt.round_slice(&mut logits);
            DraftLogits::Sparse { ids, logits }
        })
    }
}

/// `masked_embedding.token_ordering`: must be a permutation of the vocabulary (an all-zero buffer is what an
/// uninitialised export leaves, and would map every cluster to token 0).
fn token_ordering(store: &WeightStore, vocab: usize) -> Result<Vec<u32>> {
    let name = "masked_embedding.token_ordering";
    let t = store.get_full(name).ok_or_else(|| anyhow::anyhow!("missing tensor `{name}`"))?;
    if t.shape != [vocab] {
        bail!("tensor `{name}` has shape {:?}, expected [{vocab}]", t.shape);
    }
    let values: Vec<i64> = match t.dtype {
        StoredDtype::I64 => t.to_i64()?,
        _ => bail!("tensor `{name}` must be I64"),
    };
    let mut seen = vec![false; vocab];
    for &v in &values {
        if v < 0 || v as usize >= vocab || std::mem::replace(&mut seen[v as usize], true) {
            bail!("tensor `{name}` is not a permutation of the vocabulary (value {v})");
        }
    }
    Ok(values.into_iter().map(|v| v as u32).collect())
}
