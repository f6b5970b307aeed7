//! The Gemma 4 text model forward pass (docs/model.md), over one or many new rows at once.
//!
//! Activations live in f32 buffers; at every point where the reference casts to the model dtype we round
//! (`DType::round_slice`), so a bf16 checkpoint computes what transformers computes in bf16, up to
//! accumulation order. Weights stay in their checkpoint dtype and are read by the kernels directly.

use std::path::Path;

use anyhow::{bail, Result};
use rayon::prelude::*;

use crate::config::{load_model_config, KvMode, LayerType, TextConfig};
use crate::kernels::{self, DType};
use crate::model::cache::KvCache;
use crate::model::ops::{add_normed, attend, gelu_mlp, norm_heads, norm_rows};
use crate::model::rope::Rope;
use crate::weights::{Tensor, WeightStore};

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
        crate::files::require_dir(dir, "model directory")?;
        let cfg = load_model_config(dir)?.text;
        let store = WeightStore::open(dir)?;
        TargetModel::from_store(cfg, &store)
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
        let dtype = embed.float_dtype()?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            // lm_head sits at the top level in every layout.
            match store.get_full("lm_head.weight") {
                Some(t) => {
                    if t.shape != [v, h] {
                        bail!("tensor `lm_head.weight` has shape {:?}, expected {:?}", t.shape, [v, h]);
                    }
                    t.float_dtype()?;
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
                k: (!reuse).then(|| store.require(&format!("{p}self_attn.k_proj.weight"), &[kvh * d, h])).transpose()?,
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
        Ok(TargetModel {
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
        })
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg, self.dtype)
    }

    /// Bytes of weights that decoding keeps reading: one step's, plus every MoE expert (over many
    /// tokens the router picks them all). When they do not fit in memory, each token pages from disk.
    pub fn working_set_bytes(&self) -> usize {
        let experts: usize = self.layers.iter().filter_map(|l| l.moe.as_ref()).map(|m| m.gate_up.bytes().len() + m.down.bytes().len()).sum();
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
        for x in out.iter_mut() {
            *x = self.dtype.round(*x * self.embed_scale);
        }
    }

    /// Run `tokens` at positions `cache.len()..`, appending to the cache. Returns logits and hidden states
    /// of every row (`Keep::All`) or of the last one.
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], keep: Keep) -> Result<Forward> {
        let cfg = &self.cfg;
        let (h_dim, dt) = (cfg.hidden_size, self.dtype);
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!("token id {t} is outside the vocabulary of {} tokens", cfg.vocab_size);
        }
        let n = tokens.len();
        let pos0 = cache.len();

        // Embeddings.
        let mut h = vec![0f32; n * h_dim];
        for (row, &t) in h.chunks_exact_mut(h_dim).zip(tokens) {
            self.embed_token(t, row);
        }
        let mut ple_in = self.ple_inputs(tokens, &h);

        // Rows still computed; reuse layers never write the cache, so past the first reuse layer only the
        // rows whose outputs are wanted need to run.
        let mut first_row = 0;
        let first_reuse = cfg.layers.iter().position(|l| l.kv_mode == KvMode::Reuse);
        for (li, layer) in self.layers.iter().enumerate() {
            if keep == Keep::Last && Some(li) == first_reuse && n - first_row > 1 {
                first_row = n - 1;
                h.drain(..(n - 1) * h_dim);
                if let (Some(p), Some(pin)) = (cfg.ple, ple_in.as_mut()) {
                    pin.drain(..(n - 1) * cfg.num_layers() * p.dim);
                }
            }
            let rows = n - first_row;
            self.attention_block(li, layer, cache, &mut h, rows, pos0 + first_row, pos0);
            self.mlp_block(layer, &mut h, rows);
            if let (Some(lp), Some(pin), Some(pc)) = (&layer.ple, ple_in.as_ref(), cfg.ple) {
                self.ple_block(li, lp, pc.dim, pin, &mut h, rows);
            }
            let s = layer.scalar;
            h.iter_mut().for_each(|x| *x *= s);
            dt.round_slice(&mut h);
        }
        cache.advance(tokens);

        // Final norm and head over the kept rows.
        let rows = n - first_row;
        let skip = if keep == Keep::Last { rows - 1 } else { 0 };
        let kept = rows - skip;
        let mut hidden = vec![0f32; kept * h_dim];
        for (o, x) in hidden.chunks_exact_mut(h_dim).zip(h[skip * h_dim..].chunks_exact(h_dim)) {
            kernels::rms_norm(x, Some(&self.final_norm), cfg.rms_norm_eps, o);
        }
        dt.round_slice(&mut hidden);
        let mut logits = vec![0f32; kept * cfg.vocab_size];
        kernels::matmul(&hidden, kept, self.lm_head.mat(), &mut logits);
        logits.par_chunks_mut(1 << 16).for_each(|chunk| dt.round_slice(chunk));
        if let Some(c) = cfg.final_logit_softcapping {
            logits.par_chunks_mut(1 << 16).for_each(|chunk| kernels::softcap(chunk, c, dt));
        }
        Ok(Forward { rows: kept, logits, hidden })
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
        let mut normed = vec![0f32; p];
        for slice in ctx.chunks_exact_mut(p) {
            slice.iter_mut().for_each(|x| *x = dt.round(*x * proj_scale));
            kernels::rms_norm(slice, Some(&ple.proj_norm), self.cfg.rms_norm_eps, &mut normed);
            for (x, y) in slice.iter_mut().zip(&normed) {
                *x = dt.round(*y);
            }
        }
        let mut tok = vec![0f32; width];
        let input_scale = std::f64::consts::FRAC_1_SQRT_2 as f32;
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= pc.vocab_size {
                // Matches an out-of-range lookup being impossible in the reference: treat as padding.
                tok.iter_mut().for_each(|x| *x = 0.0);
            } else {
                ple.embed.mat().row_f32(t as usize, &mut tok);
            }
            for (c, e) in ctx[i * width..(i + 1) * width].iter_mut().zip(&tok) {
                let e = dt.round(e * ple.scale);
                *c = dt.round(dt.round(*c + e) * input_scale);
            }
        }
        Some(ctx)
    }

    /// `h += post_attn_norm(o_proj(attention(input_norm(h))))` for `rows` rows starting at position `pos`.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        li: usize,
        layer: &Layer,
        cache: &mut KvCache,
        h: &mut [f32],
        rows: usize,
        pos: usize,
        cache_pos0: usize,
    ) {
        let cfg = &self.cfg;
        let lc = &cfg.layers[li];
        let (h_dim, d, hq, kvh, dt, eps) = (cfg.hidden_size, lc.head_dim, cfg.num_heads, lc.kv_heads, self.dtype, cfg.rms_norm_eps);
        let a = norm_rows(h, rows, &layer.input_norm, eps, dt);
        let rope = if lc.kind == LayerType::Sliding { &self.rope_sliding } else { &self.rope_full };
        let mut cos = vec![0f32; d / 2];
        let mut sin = vec![0f32; d / 2];

        let mut q = vec![0f32; rows * hq * d];
        kernels::matmul(&a, rows, layer.attn.q.mat(), &mut q);
        dt.round_slice(&mut q);
        norm_heads(&mut q, d, Some(&layer.attn.q_norm), eps, dt);

        if let Some(kw) = &layer.attn.k {
            let mut k = vec![0f32; rows * kvh * d];
            kernels::matmul(&a, rows, kw.mat(), &mut k);
            dt.round_slice(&mut k);
            // k_eq_v: V is the raw K projection (before k_norm and RoPE).
            let mut v = match &layer.attn.v {
                Some(vw) => {
                    let mut v = vec![0f32; rows * kvh * d];
                    kernels::matmul(&a, rows, vw.mat(), &mut v);
                    dt.round_slice(&mut v);
                    v
                }
                None => k.clone(),
            };
            norm_heads(&mut k, d, layer.attn.k_norm.as_deref(), eps, dt);
            norm_heads(&mut v, d, None, eps, dt);
            for r in 0..rows {
                rope.angles(pos + r, dt, &mut cos, &mut sin);
                rope.apply(&mut k[r * kvh * d..(r + 1) * kvh * d], &cos, &sin, dt);
            }
            debug_assert_eq!(pos, cache_pos0, "layers that write the cache see every row");
            cache.append(li, &k, &v);
        }
        for r in 0..rows {
            rope.angles(pos + r, dt, &mut cos, &mut sin);
            rope.apply(&mut q[r * hq * d..(r + 1) * hq * d], &cos, &sin, dt);
        }

        let kv = cache.layer(lc.kv_source);
        // Causal; sliding layers see W keys including their own position (docs/model.md, "Masks and windows").
        let window = if lc.kind == LayerType::Sliding { cfg.sliding_window } else { usize::MAX };
        let keys = |r: usize| (pos + r + 1).saturating_sub(window)..pos + r + 1;
        let mut o = vec![0f32; rows * hq * d];
        attend(&q, kv, rows, hq, keys, dt, &mut o);

        let mut out = vec![0f32; rows * h_dim];
        kernels::matmul(&o, rows, layer.attn.o.mat(), &mut out);
        dt.round_slice(&mut out);
        add_normed(h, &out, &layer.post_attn_norm, eps, dt);
    }

    /// Dense MLP, plus the MoE branch when the model has one; `h += post_ff_norm(...)`.
    fn mlp_block(&self, layer: &Layer, h: &mut [f32], rows: usize) {
        let cfg = &self.cfg;
        let (dt, eps) = (self.dtype, cfg.rms_norm_eps);
        let x = norm_rows(h, rows, &layer.pre_ff_norm, eps, dt);
        let mut m = gelu_mlp(&x, rows, layer.gate.mat(), layer.up.mat(), layer.down.mat(), dt);
        if let (Some(moe), Some(mc)) = (&layer.moe, cfg.moe) {
            let m1 = norm_rows(&m, rows, &moe.post_norm_1, eps, dt);
            let m2 = self.experts(moe, mc, h, rows);
            let m2 = norm_rows(&m2, rows, &moe.post_norm_2, eps, dt);
            for ((o, a), b) in m.iter_mut().zip(&m1).zip(&m2) {
                *o = dt.round(a + b);
            }
        }
        add_normed(h, &m, &layer.post_ff_norm, eps, dt);
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
