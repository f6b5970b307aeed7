//! The Gemma 4 text model forward pass (docs/model.md), over one or many new rows at once.
//!
//! Activations live in f32 buffers; at every point where the reference casts to the model dtype we round
//! (`DType::round_slice`), so a bf16 checkpoint computes what transformers computes in bf16, up to
//! accumulation order. Weights stay in their checkpoint dtype and are read by the kernels directly.

use std::path::Path;

use anyhow::{bail, Result};

use crate::config::{load_model_config, KvMode, LayerType, TextConfig};
use crate::kernels::{self, DType};
use crate::model::cache::KvCache;
use crate::model::ops::{add_normed, attend, gelu_mlp, norm_heads, norm_rows};
use crate::model::rope::{Angles, Rope};
use crate::model::sections::section;
use crate::quantize::Recipe;
use crate::weights::{Tensor, WeightStore};

/// Logits per task when they are rounded and softcapped in parallel.
const LOGIT_PIECE: usize = 4096;

/// Quantize a target's matrices in `store` with `recipe`; returns the summary line.
pub fn quantize_target(store: &mut WeightStore, cfg: &TextConfig, recipe: Recipe) -> Result<String> {
    let plan = crate::quantize::target_plan(recipe, cfg, store);
    Ok(crate::quantize::apply(store, &plan)?.line("the model", recipe))
}

/// Which rows of a forward need logits and final hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    All,
    Last,
}

/// Result of a forward over `rows` kept rows.
pub struct Forward {
    pub rows: usize,
    /// `[rows, vocab]`: final (softcapped) logits, values of the model dtype.
    pub logits: Vec<f32>,
    /// `[rows, hidden]`: post-final-norm hidden states (what the drafter consumes).
    pub hidden: Vec<f32>,
}

impl Forward {
    pub fn logits_row(&self, i: usize) -> &[f32] {
        let v = self.logits.len() / self.rows;
        &self.logits[i * v..(i + 1) * v]
    }

    pub fn hidden_row(&self, i: usize) -> &[f32] {
        let h = self.hidden.len() / self.rows;
        &self.hidden[i * h..(i + 1) * h]
    }
}

/// One sequence of a batched forward ([`TargetModel::forward_batch`]): its cache, the tokens to run at
/// positions `cache.len()..` (a prefill chunk, one decode row, or a verify's 1 + k rows) and which rows'
/// outputs it wants.
pub struct SeqInput<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub keep: Keep,
}

/// RoPE's cos and sin for every row of a batched forward, computed once per layer type and shared by
/// all its layers, q and k alike (they depend only on the position).
struct RowAngles {
    sliding: Option<Angles>,
    full: Option<Angles>,
    /// Per sequence: the table row of its first row, and that row's position.
    first: Vec<(usize, usize)>,
}

impl RowAngles {
    fn new(model: &TargetModel, spans: &[Span]) -> RowAngles {
        let positions = || spans.iter().flat_map(|sp| sp.pos..sp.pos + sp.rows);
        let has = |kind: LayerType| model.cfg.layers.iter().any(|l| l.kind == kind);
        let table = |kind: LayerType, rope: &Rope| has(kind).then(|| rope.angles_of(positions(), model.dtype));
        RowAngles {
            sliding: table(LayerType::Sliding, &model.rope_sliding),
            full: table(LayerType::Full, &model.rope_full),
            first: spans.iter().map(|sp| (sp.at, sp.pos)).collect(),
        }
    }

    /// cos and sin at `pos` for sequence `seq`, for a layer of type `kind`.
    fn row(&self, kind: LayerType, seq: usize, pos: usize) -> (&[f32], &[f32]) {
        let table = match kind {
            LayerType::Sliding => &self.sliding,
            LayerType::Full => &self.full,
        };
        let (at, first) = self.first[seq];
        table.as_ref().expect("a table for every layer type the model has").row(at + pos - first)
    }
}

/// Where one sequence's rows sit in the buffers of a batched forward.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// Its first row in the batch.
    at: usize,
    /// Its rows still computed.
    rows: usize,
    /// The position of its first computed row.
    pos: usize,
}

struct Attention {
    q: Tensor,
    q_norm: Vec<f32>,
    /// `None` on reuse layers.
    k: Option<Tensor>,
    /// `None` on reuse layers and on k_eq_v full layers.
    v: Option<Tensor>,
    k_norm: Option<Vec<f32>>,
    o: Tensor,
}

struct Moe {
    router: Tensor,
    router_scale: Vec<f32>,
    per_expert_scale: Vec<f32>,
    /// `[E, 2·Ie, H]`: rows `[0, Ie)` gate, `[Ie, 2·Ie)` up.
    gate_up: Tensor,
    /// `[E, H, Ie]`.
    down: Tensor,
    pre_norm_2: Vec<f32>,
    post_norm_1: Vec<f32>,
    post_norm_2: Vec<f32>,
}

struct LayerPle {
    gate: Tensor,
    proj: Tensor,
    post_norm: Vec<f32>,
}

struct Layer {
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ff_norm: Vec<f32>,
    post_ff_norm: Vec<f32>,
    attn: Attention,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    moe: Option<Moe>,
    ple: Option<LayerPle>,
    scalar: f32,
}

struct Ple {
    embed: Tensor,
    scale: f32,
    model_proj: Tensor,
    proj_norm: Vec<f32>,
}

pub struct TargetModel {
    pub cfg: TextConfig,
    /// The model dtype (that of `embed_tokens`): where the reference rounds, we round to it.
    pub dtype: DType,
    embed: Tensor,
    embed_scale: f32,
    lm_head: Tensor,
    final_norm: Vec<f32>,
    ple: Option<Ple>,
    layers: Vec<Layer>,
    rope_sliding: Rope,
    rope_full: Rope,
}

impl TargetModel {
    /// Load a model directory (config.json, generation_config.json, safetensors).
    pub fn load(dir: &Path) -> Result<TargetModel> {
        TargetModel::load_with(dir, None, |_| {})
    }

    /// Load a model directory, quantizing its matrices with `recipe` (docs/quantization.md); `say` gets
    /// the one-line summary of the quantization.
    /// `dir` may also be a GGUF file (docs/gguf.md).
    pub fn load_with(dir: &Path, recipe: Option<Recipe>, say: impl FnOnce(String)) -> Result<TargetModel> {
        if crate::gguf::is_gguf(dir) {
            return TargetModel::load_gguf(dir, recipe, say);
        }
        crate::files::require_dir(dir, "model directory")?;
        let cfg = load_model_config(dir)?.text;
        let mut store = WeightStore::open_with(dir, recipe.is_some())?;
        if let Some(r) = recipe {
            say(quantize_target(&mut store, &cfg, r)?);
            store.move_floats_to_huge_pages()?;
        }
        crate::quantize::pack_for_kernels(&mut store);
        TargetModel::from_store(cfg, &store)
    }

    fn load_gguf(path: &Path, recipe: Option<Recipe>, say: impl FnOnce(String)) -> Result<TargetModel> {
        let m = crate::gguf::GgufModel::open(path, recipe.is_some())?;
        let cfg = crate::gguf::gemma4::target_config(&m)?;
        let mut store = crate::gguf::gemma4::target_store(&m)?;
        if let Some(r) = recipe {
            crate::gguf::gemma4::refuse_requantize(&m, r)?;
            say(quantize_target(&mut store, &cfg, r)?);
            store.move_floats_to_huge_pages()?;
        }
        crate::quantize::pack_for_kernels(&mut store);
        TargetModel::from_store(cfg, &store).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Build from tensors (names below the text-model prefix), checking every name and shape.
    pub fn from_store(cfg: TextConfig, store: &WeightStore) -> Result<TargetModel> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let held = store.count_layers(&format!("{}layers.", store.prefix()));
        if held < cfg.num_layers() {
            bail!("the config declares {} layers but the weights hold {held}", cfg.num_layers());
        }
        let vec = |name: &str, n: usize| -> Result<Vec<f32>> { store.require(name, &[n])?.to_f32() };
        let embed = store.require("embed_tokens.weight", &[v, h])?;
        let dtype = embed.compute_dtype()?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            // lm_head sits at the top level in every layout.
            match store.get_full("lm_head.weight") {
                Some(t) => {
                    if t.shape != [v, h] {
                        bail!("tensor `lm_head.weight` has shape {:?}, expected {:?}", t.shape, [v, h]);
                    }
                    t.compute_dtype()?;
                    t.clone()
                }
                None => bail!("`tie_word_embeddings` is false but the checkpoint has no `lm_head.weight`"),
            }
        };
        let l_count = cfg.num_layers();
        let ple = match cfg.ple {
            Some(p) => Some(Ple {
                embed: store.require("embed_tokens_per_layer.weight", &[p.vocab_size, l_count * p.dim])?,
                scale: dtype.round((p.dim as f32).sqrt()),
                model_proj: store.require("per_layer_model_projection.weight", &[l_count * p.dim, h])?,
                proj_norm: vec("per_layer_projection_norm.weight", p.dim)?,
            }),
            None => None,
        };
        let mut layers = Vec::with_capacity(l_count);
        for (i, lc) in cfg.layers.iter().enumerate() {
            let p = format!("layers.{i}.");
            let (d, kvh, hq) = (lc.head_dim, lc.kv_heads, cfg.num_heads);
            let reuse = lc.kv_mode == KvMode::Reuse;
            let attn = Attention {
                q: store.require(&format!("{p}self_attn.q_proj.weight"), &[hq * d, h])?,
                q_norm: vec(&format!("{p}self_attn.q_norm.weight"), d)?,
                k: (!reuse)
                    .then(|| store.require(&format!("{p}self_attn.k_proj.weight"), &[kvh * d, h]))
                    .transpose()?,
                v: (!reuse && !lc.k_eq_v)
                    .then(|| store.require(&format!("{p}self_attn.v_proj.weight"), &[kvh * d, h]))
                    .transpose()?,
                k_norm: (!reuse).then(|| vec(&format!("{p}self_attn.k_norm.weight"), d)).transpose()?,
                o: store.require(&format!("{p}self_attn.o_proj.weight"), &[h, hq * d])?,
            };
            let inter = lc.intermediate_size;
            let moe = match cfg.moe {
                Some(m) => Some(Moe {
                    router: store.require(&format!("{p}router.proj.weight"), &[m.num_experts, h])?,
                    router_scale: vec(&format!("{p}router.scale"), h)?,
                    per_expert_scale: vec(&format!("{p}router.per_expert_scale"), m.num_experts)?,
                    gate_up: store
                        .require(&format!("{p}experts.gate_up_proj"), &[m.num_experts, 2 * m.intermediate_size, h])?,
                    down: store.require(&format!("{p}experts.down_proj"), &[m.num_experts, h, m.intermediate_size])?,
                    pre_norm_2: vec(&format!("{p}pre_feedforward_layernorm_2.weight"), h)?,
                    post_norm_1: vec(&format!("{p}post_feedforward_layernorm_1.weight"), h)?,
                    post_norm_2: vec(&format!("{p}post_feedforward_layernorm_2.weight"), h)?,
                }),
                None => None,
            };
            let layer_ple = match cfg.ple {
                Some(pc) => Some(LayerPle {
                    gate: store.require(&format!("{p}per_layer_input_gate.weight"), &[pc.dim, h])?,
                    proj: store.require(&format!("{p}per_layer_projection.weight"), &[h, pc.dim])?,
                    post_norm: vec(&format!("{p}post_per_layer_input_norm.weight"), h)?,
                }),
                None => None,
            };
            // layer_scalar is a buffer; older exports may lack it (default 1).
            let scalar = match store.get(&format!("{p}layer_scalar")) {
                Some(_) => store.require(&format!("{p}layer_scalar"), &[1])?.to_f32()?[0],
                None => 1.0,
            };
            layers.push(Layer {
                input_norm: vec(&format!("{p}input_layernorm.weight"), h)?,
                post_attn_norm: vec(&format!("{p}post_attention_layernorm.weight"), h)?,
                pre_ff_norm: vec(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                post_ff_norm: vec(&format!("{p}post_feedforward_layernorm.weight"), h)?,
                attn,
                gate: store.require(&format!("{p}mlp.gate_proj.weight"), &[inter, h])?,
                up: store.require(&format!("{p}mlp.up_proj.weight"), &[inter, h])?,
                down: store.require(&format!("{p}mlp.down_proj.weight"), &[h, inter])?,
                moe,
                ple: layer_ple,
                scalar: dtype.round(scalar),
            });
        }
        let d_s = cfg.geometry(LayerType::Sliding).map_or(2, |g| g.0);
        let d_f = cfg.geometry(LayerType::Full).map_or(2, |g| g.0);
        let model = TargetModel {
            rope_sliding: Rope::new(&cfg.rope_sliding, d_s),
            rope_full: Rope::new(&cfg.rope_full, d_f),
            final_norm: vec("norm.weight", h)?,
            embed_scale: dtype.round((h as f32).sqrt()),
            dtype,
            embed,
            lm_head,
            ple,
            layers,
            cfg,
        };
        kernels::note_step_bytes(model.bytes_per_token());
        Ok(model)
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg, self.dtype)
    }

    /// Bytes of weights that decoding keeps reading: one step's, plus every MoE expert (over many
    /// tokens the router picks them all). When they do not fit in memory, each token pages from disk.
    pub fn working_set_bytes(&self) -> usize {
        let experts: usize = self
            .layers
            .iter()
            .filter_map(|l| l.moe.as_ref())
            .map(|m| m.gate_up.bytes().len() + m.down.bytes().len())
            .sum();
        let chosen: usize = match self.cfg.moe {
            Some(mc) => self
                .layers
                .iter()
                .filter_map(|l| l.moe.as_ref())
                .map(|m| (m.gate_up.bytes().len() + m.down.bytes().len()) / mc.num_experts * mc.top_k)
                .sum(),
            None => 0,
        };
        self.bytes_per_token() - chosen + experts
    }

    /// Bytes of weights one decode step reads (every matrix once; embedding rows are negligible).
    pub fn bytes_per_token(&self) -> usize {
        let mut n = self.lm_head.bytes().len();
        if let Some(p) = &self.ple {
            n += p.model_proj.bytes().len();
        }
        for l in &self.layers {
            let a = &l.attn;
            n += a.q.bytes().len() + a.o.bytes().len();
            n += a.k.as_ref().map_or(0, |t| t.bytes().len()) + a.v.as_ref().map_or(0, |t| t.bytes().len());
            n += l.gate.bytes().len() + l.up.bytes().len() + l.down.bytes().len();
            if let Some(p) = &l.ple {
                n += p.gate.bytes().len() + p.proj.bytes().len();
            }
            if let (Some(m), Some(mc)) = (&l.moe, self.cfg.moe) {
                let per_expert = (m.gate_up.bytes().len() + m.down.bytes().len()) / mc.num_experts;
                n += m.router.bytes().len() + per_expert * mc.top_k;
            }
        }
        n
    }

    /// The scaled input embedding of a token (`Emb[t] · bf16(√H)`), which the drafter also consumes.
    pub fn embed_token(&self, token: u32, out: &mut [f32]) {
        self.embed.mat().row_f32(token as usize, out);
        out.iter_mut().for_each(|x| *x *= self.embed_scale);
        self.dtype.round_slice(out);
    }

    /// Run `tokens` at positions `cache.len()..`, appending to the cache. Returns logits and hidden states
    /// of every row (`Keep::All`) or of the last one. One sequence of [`TargetModel::forward_batch`].
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], keep: Keep) -> Result<Forward> {
        let mut seqs = [SeqInput { cache, tokens, keep }];
        Ok(self.forward_batch(&mut seqs)?.pop().expect("one result per sequence"))
    }

    /// One forward over many sequences at once (continuous batching): each has its own cache, positions
    /// (`cache.len()..`), rows and [`Keep`]. The rows of all sequences are concatenated so that every weight
    /// matmul runs once over all of them (the weights are read once per step); RoPE, the cache append and
    /// attention run per sequence. Result `i` has the bits `forward(seqs[i])` alone would give, and the
    /// caches end up the same, because every kernel gives a row the same bits whatever it is batched with
    /// (docs/numerics.md, "Batch invariance"). On an error no cache has changed.
    pub fn forward_batch(&self, seqs: &mut [SeqInput<'_>]) -> Result<Vec<Forward>> {
        let cfg = &self.cfg;
        let (h_dim, dt) = (cfg.hidden_size, self.dtype);
        let named = |i: usize| if seqs.len() > 1 { format!("sequence {i} of the batch: ") } else { String::new() };
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                bail!("{}forward needs at least one token", named(i));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                bail!("{}token id {t} is outside the vocabulary of {} tokens", named(i), cfg.vocab_size);
            }
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut spans = Vec::with_capacity(seqs.len());
        let mut n = 0;
        for s in seqs.iter() {
            spans.push(Span { at: n, rows: s.tokens.len(), pos: s.cache.len() });
            n += s.tokens.len();
        }

        // Embeddings, per-layer inputs and RoPE's angles.
        let (mut h, mut ple_in, angles) = section("inputs", || {
            let mut h = vec![0f32; n * h_dim];
            let mut rows_out = h.chunks_exact_mut(h_dim);
            for s in seqs.iter() {
                // The shorter iterator first: `zip` would take (and lose) one more row otherwise.
                for (&t, row) in s.tokens.iter().zip(rows_out.by_ref()) {
                    self.embed_token(t, row);
                }
            }
            let ple_in = match &*seqs {
                [one] => self.ple_inputs(one.tokens, &h),
                _ => self.ple_inputs(&seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect::<Vec<_>>(), &h),
            };
            (h, ple_in, RowAngles::new(self, &spans))
        });
        let ple_width = cfg.ple.map_or(0, |p| cfg.num_layers() * p.dim);

        // Reuse layers never write the cache, so past the first reuse layer only the rows whose outputs are
        // wanted need to run: there, each `Keep::Last` sequence keeps its last row only.
        let first_reuse = cfg.layers.iter().position(|l| l.kv_mode == KvMode::Reuse);
        for (li, layer) in self.layers.iter().enumerate() {
            if Some(li) == first_reuse && seqs.iter().zip(&spans).any(|(s, sp)| s.keep == Keep::Last && sp.rows > 1) {
                let mut to = 0;
                for (s, sp) in seqs.iter().zip(spans.iter_mut()) {
                    let skip = if s.keep == Keep::Last { sp.rows - 1 } else { 0 };
                    let (from, rows) = (sp.at + skip, sp.rows - skip);
                    h.copy_within(from * h_dim..(from + rows) * h_dim, to * h_dim);
                    if let Some(pin) = ple_in.as_mut() {
                        pin.copy_within(from * ple_width..(from + rows) * ple_width, to * ple_width);
                    }
                    *sp = Span { at: to, rows, pos: sp.pos + skip };
                    to += rows;
                }
                n = to;
                h.truncate(n * h_dim);
                if let Some(pin) = ple_in.as_mut() {
                    pin.truncate(n * ple_width);
                }
            }
            self.attention_block(li, layer, seqs, &spans, &angles, &mut h);
            self.mlp_block(layer, &mut h, n);
            if let (Some(lp), Some(pin), Some(pc)) = (&layer.ple, ple_in.as_ref(), cfg.ple) {
                section("per-layer input", || self.ple_block(li, lp, pc.dim, pin, &mut h, n));
            }
            let s = layer.scalar;
            section("layer scalar", || {
                h.iter_mut().for_each(|x| *x *= s);
                dt.round_slice(&mut h);
            });
        }
        for s in seqs.iter_mut() {
            s.cache.advance(s.tokens);
        }

        // Final norm and head over the kept rows of every sequence at once.
        let kept: Vec<usize> =
            seqs.iter().zip(&spans).map(|(s, sp)| if s.keep == Keep::Last { 1 } else { sp.rows }).collect();
        let total: usize = kept.iter().sum();
        let mut hidden = vec![0f32; total * h_dim];
        section("norms", || {
            let mut out_rows = hidden.chunks_exact_mut(h_dim);
            for (sp, &k) in spans.iter().zip(&kept) {
                let rows = &h[(sp.at + sp.rows - k) * h_dim..(sp.at + sp.rows) * h_dim];
                for (x, o) in rows.chunks_exact(h_dim).zip(out_rows.by_ref()) {
                    kernels::rms_norm(x, Some(&self.final_norm), cfg.rms_norm_eps, o);
                }
            }
            dt.round_slice(&mut hidden);
        });
        let mut logits = vec![0f32; total * cfg.vocab_size];
        section("head", || kernels::matmul(&hidden, total, self.lm_head.mat(), &mut logits));
        // Rounding and softcapping in pieces on the kernels' pool: a verify's five rows of a 4,096-token
        // vocabulary (the shipped pair) are 20,480 tanh, which on one thread took as long as a matmul.
        let cap = cfg.final_logit_softcapping;
        section("logit softcap", || {
            kernels::par_map(logits.chunks_mut(LOGIT_PIECE).collect(), |chunk| {
                dt.round_slice(chunk);
                if let Some(c) = cap {
                    kernels::softcap(chunk, c, dt);
                }
            })
        });

        // Split per sequence, from the back (the first sequence keeps the buffers).
        let mut out = Vec::with_capacity(seqs.len());
        let mut end = total;
        for &k in kept.iter().rev() {
            end -= k;
            let (mut l, mut hs) = if end == 0 {
                (std::mem::take(&mut logits), std::mem::take(&mut hidden))
            } else {
                (logits.split_off(end * cfg.vocab_size), hidden.split_off(end * h_dim))
            };
            if seqs.len() > 1 {
                l.shrink_to_fit();
                hs.shrink_to_fit();
            }
            out.push(Forward { rows: k, logits: l, hidden: hs });
        }
        out.reverse();
        Ok(out)
    }

    /// Per-layer inputs `[n, L, P]` (docs/model.md, "Per-layer embeddings (PLE)"), if the model has PLE.
    fn ple_inputs(&self, tokens: &[u32], x0: &[f32]) -> Option<Vec<f32>> {
        let (ple, pc) = (self.ple.as_ref()?, self.cfg.ple?);
        let (dt, n, l_count, p) = (self.dtype, tokens.len(), self.cfg.num_layers(), pc.dim);
        let width = l_count * p;
        let mut ctx = vec![0f32; n * width];
        kernels::matmul(x0, n, ple.model_proj.mat(), &mut ctx);
        dt.round_slice(&mut ctx);
        let proj_scale = (self.cfg.hidden_size as f64).powf(-0.5) as f32;
        // Each step below is element-wise (or per slice), done over whole buffers so that it
        // vectorises: the same operations in the same order for every element.
        ctx.iter_mut().for_each(|x| *x *= proj_scale);
        dt.round_slice(&mut ctx);
        let mut normed = vec![0f32; p];
        for slice in ctx.chunks_exact_mut(p) {
            kernels::rms_norm(slice, Some(&ple.proj_norm), self.cfg.rms_norm_eps, &mut normed);
            slice.copy_from_slice(&normed);
        }
        dt.round_slice(&mut ctx);
        let mut tok = vec![0f32; width];
        let input_scale = std::f64::consts::FRAC_1_SQRT_2 as f32;
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= pc.vocab_size {
                // Matches an out-of-range lookup being impossible in the reference: treat as padding.
                tok.iter_mut().for_each(|x| *x = 0.0);
            } else {
                ple.embed.mat().row_f32(t as usize, &mut tok);
            }
            tok.iter_mut().for_each(|e| *e *= ple.scale);
            dt.round_slice(&mut tok);
            let c = &mut ctx[i * width..(i + 1) * width];
            c.iter_mut().zip(&tok).for_each(|(c, e)| *c += e);
            dt.round_slice(c);
            c.iter_mut().for_each(|c| *c *= input_scale);
            dt.round_slice(c);
        }
        Some(ctx)
    }

    /// `h += post_attn_norm(o_proj(attention(input_norm(h))))` over the rows of all sequences (`spans`
    /// says where each sequence's rows sit and at which position they start, `angles` holds RoPE's cos
    /// and sin for them): projections over all rows at once, RoPE at each row's position, cache append
    /// and attention per sequence.
    fn attention_block(
        &self,
        li: usize,
        layer: &Layer,
        seqs: &mut [SeqInput<'_>],
        spans: &[Span],
        angles: &RowAngles,
        h: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let lc = &cfg.layers[li];
        let rows = h.len() / cfg.hidden_size;
        let (h_dim, d, hq, kvh, dt, eps) =
            (cfg.hidden_size, lc.head_dim, cfg.num_heads, lc.kv_heads, self.dtype, cfg.rms_norm_eps);
        let a = section("norms", || norm_rows(h, rows, &layer.input_norm, eps, dt));
        let rope = if lc.kind == LayerType::Sliding { &self.rope_sliding } else { &self.rope_full };
        // Apply RoPE to every row of `x` (`[rows, width]`) at that row's own position.
        let rope_rows = |x: &mut [f32], width: usize| {
            for (i, sp) in spans.iter().enumerate() {
                for r in 0..sp.rows {
                    let (cos, sin) = angles.row(lc.kind, i, sp.pos + r);
                    rope.apply(&mut x[(sp.at + r) * width..(sp.at + r + 1) * width], cos, sin, dt);
                }
            }
        };

        let mut q = vec![0f32; rows * hq * d];
        section("q", || kernels::matmul(&a, rows, layer.attn.q.mat(), &mut q));
        section("q/k/v norms, rope", || {
            dt.round_slice(&mut q);
            norm_heads(&mut q, d, Some(&layer.attn.q_norm), eps, dt);
        });

        if let Some(kw) = &layer.attn.k {
            let mut k = vec![0f32; rows * kvh * d];
            // k_eq_v: V is the raw K projection (before k_norm and RoPE).
            let mut v = match &layer.attn.v {
                Some(vw) => {
                    // One KV head's K and V are small matrices: side by side on two threads.
                    let mut v = vec![0f32; rows * kvh * d];
                    section("k, v", || kernels::matmul_each(&a, rows, &mut [(kw.mat(), &mut k), (vw.mat(), &mut v)]));
                    dt.round_slice(&mut k);
                    dt.round_slice(&mut v);
                    v
                }
                None => {
                    section("k, v", || kernels::matmul(&a, rows, kw.mat(), &mut k));
                    dt.round_slice(&mut k);
                    k.clone()
                }
            };
            section("q/k/v norms, rope", || {
                norm_heads(&mut k, d, layer.attn.k_norm.as_deref(), eps, dt);
                norm_heads(&mut v, d, None, eps, dt);
                rope_rows(&mut k, kvh * d);
            });
            let w = kvh * d;
            section("cache append", || {
                for (s, sp) in seqs.iter_mut().zip(spans) {
                    debug_assert_eq!(sp.pos, s.cache.len(), "layers that write the cache see every row");
                    let at = sp.at * w..(sp.at + sp.rows) * w;
                    s.cache.append(li, &k[at.clone()], &v[at]);
                }
            });
        }
        section("q/k/v norms, rope", || rope_rows(&mut q, hq * d));

        // Causal; sliding layers see W keys including their own position (docs/model.md, "Masks and windows").
        let window = if lc.kind == LayerType::Sliding { cfg.sliding_window } else { usize::MAX };
        let mut o = vec![0f32; rows * hq * d];
        let w = hq * d;
        let attend_one = |(s, sp, o): (&SeqInput<'_>, &Span, &mut [f32])| {
            let pos = sp.pos;
            let keys = |r: usize| (pos + r + 1).saturating_sub(window)..pos + r + 1;
            attend(&q[sp.at * w..(sp.at + sp.rows) * w], s.cache.layer(lc.kv_source), sp.rows, hq, keys, dt, o);
        };
        let mut outs = Vec::with_capacity(spans.len());
        let mut rest = &mut o[..];
        for sp in spans {
            let (mine, tail) = rest.split_at_mut(sp.rows * w);
            outs.push(mine);
            rest = tail;
        }
        let work: Vec<_> = seqs.iter().zip(spans).zip(outs).map(|((s, sp), o)| (s, sp, o)).collect();
        section("attention", || kernels::par_map(work, attend_one));

        let mut out = vec![0f32; rows * h_dim];
        section("o", || kernels::matmul(&o, rows, layer.attn.o.mat(), &mut out));
        section("norms", || {
            dt.round_slice(&mut out);
            add_normed(h, &out, &layer.post_attn_norm, eps, dt);
        });
    }

    /// Dense MLP, plus the MoE branch when the model has one; `h += post_ff_norm(...)`.
    fn mlp_block(&self, layer: &Layer, h: &mut [f32], rows: usize) {
        let cfg = &self.cfg;
        let (dt, eps) = (self.dtype, cfg.rms_norm_eps);
        let x = section("norms", || norm_rows(h, rows, &layer.pre_ff_norm, eps, dt));
        let mut m = section("mlp", || gelu_mlp(&x, rows, layer.gate.mat(), layer.up.mat(), layer.down.mat(), dt));
        if let (Some(moe), Some(mc)) = (&layer.moe, cfg.moe) {
            let m1 = norm_rows(&m, rows, &moe.post_norm_1, eps, dt);
            let m2 = section("experts", || self.experts(moe, mc, h, rows));
            let m2 = norm_rows(&m2, rows, &moe.post_norm_2, eps, dt);
            for ((o, a), b) in m.iter_mut().zip(&m1).zip(&m2) {
                *o = dt.round(a + b);
            }
        }
        section("norms", || add_normed(h, &m, &layer.post_ff_norm, eps, dt));
    }

    /// The MoE branch on the pre-FFN residual `r` (docs/model.md, "Mixture of experts"): route, run each
    /// chosen expert over the rows that chose it (weights read once per expert).
    fn experts(&self, moe: &Moe, mc: crate::config::MoeConfig, r: &[f32], rows: usize) -> Vec<f32> {
        let (h_dim, dt, eps) = (self.cfg.hidden_size, self.dtype, self.cfg.rms_norm_eps);
        let (e_count, ie) = (mc.num_experts, mc.intermediate_size);
        // Router.
        let mut z = vec![0f32; rows * h_dim];
        let root = (h_dim as f64).powf(-0.5) as f32;
        for (zr, rr) in z.chunks_exact_mut(h_dim).zip(r.chunks_exact(h_dim)) {
            kernels::rms_norm(rr, None, eps, zr);
            for (x, s) in zr.iter_mut().zip(&moe.router_scale) {
                *x = dt.round(dt.round(dt.round(*x) * s) * root);
            }
        }
        let mut scores = vec![0f32; rows * e_count];
        kernels::matmul(&z, rows, moe.router.mat(), &mut scores);
        dt.round_slice(&mut scores);
        // chosen[e] = (row, rank among the row's top-k, weight) for each row that routes to expert e.
        let k = mc.top_k;
        let mut chosen: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); e_count];
        for (row, s) in scores.chunks_exact_mut(e_count).enumerate() {
            kernels::softmax(s);
            let mut idx: Vec<usize> = (0..e_count).collect();
            idx.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
            let sum: f32 = idx[..k].iter().map(|&e| s[e]).sum();
            for (rank, &e) in idx[..k].iter().enumerate() {
                chosen[e].push((row, rank, s[e] / sum * moe.per_expert_scale[e]));
            }
        }
        let xe = norm_rows(r, rows, &moe.pre_norm_2, eps, dt);
        // Weighted expert outputs in f32, `[rows, k, H]`, summed in rank order and rounded once at the end,
        // as transformers' default ("grouped_mm") experts path does.
        let mut parts = vec![0f32; rows * k * h_dim];
        let gu_all = moe.gate_up.mat();
        let dn_all = moe.down.mat();
        for (e, users) in chosen.iter().enumerate() {
            if users.is_empty() {
                continue;
            }
            let m = users.len();
            let mut xin = Vec::with_capacity(m * h_dim);
            for &(row, _, _) in users {
                xin.extend_from_slice(&xe[row * h_dim..(row + 1) * h_dim]);
            }
            let mut gu = vec![0f32; m * 2 * ie];
            kernels::matmul(&xin, m, gu_all.slice_rows(e * 2 * ie, 2 * ie), &mut gu);
            dt.round_slice(&mut gu);
            let mut act = vec![0f32; m * ie];
            for (a, g) in act.chunks_exact_mut(ie).zip(gu.chunks_exact(2 * ie)) {
                a.copy_from_slice(&g[..ie]);
                kernels::gelu_tanh(a);
                for (x, u) in a.iter_mut().zip(&g[ie..]) {
                    *x = dt.round(dt.round(*x) * u);
                }
            }
            let mut y = vec![0f32; m * h_dim];
            kernels::matmul(&act, m, dn_all.slice_rows(e * h_dim, h_dim), &mut y);
            dt.round_slice(&mut y);
            for (yr, &(row, rank, w)) in y.chunks_exact(h_dim).zip(users) {
                let at = (row * k + rank) * h_dim;
                for (o, v) in parts[at..at + h_dim].iter_mut().zip(yr) {
                    *o = v * w;
                }
            }
        }
        let mut out = vec![0f32; rows * h_dim];
        for (o, p) in out.chunks_exact_mut(h_dim).zip(parts.chunks_exact(k * h_dim)) {
            for part in p.chunks_exact(h_dim) {
                for (a, b) in o.iter_mut().zip(part) {
                    *a += b;
                }
            }
        }
        dt.round_slice(&mut out);
        out
    }

    /// Per-layer input gate (docs/model.md, "Per-layer input gate").
    fn ple_block(&self, li: usize, lp: &LayerPle, p: usize, ple_in: &[f32], h: &mut [f32], rows: usize) {
        let (dt, l_count) = (self.dtype, self.cfg.num_layers());
        let mut g = vec![0f32; rows * p];
        kernels::matmul(h, rows, lp.gate.mat(), &mut g);
        dt.round_slice(&mut g);
        kernels::gelu_tanh(&mut g);
        dt.round_slice(&mut g);
        for (r, gr) in g.chunks_exact_mut(p).enumerate() {
            let pin = &ple_in[(r * l_count + li) * p..(r * l_count + li + 1) * p];
            for (x, y) in gr.iter_mut().zip(pin) {
                *x *= y;
            }
        }
        dt.round_slice(&mut g);
        let mut out = vec![0f32; rows * self.cfg.hidden_size];
        kernels::matmul(&g, rows, lp.proj.mat(), &mut out);
        dt.round_slice(&mut out);
        add_normed(h, &out, &lp.post_norm, self.cfg.rms_norm_eps, dt);
    }
}
