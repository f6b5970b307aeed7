//! A checkpoint (configuration + tensors, float or quantized) as GGUF in llama.cpp's Gemma 4 layout
//! (docs/gguf.md, "Writing"): the inverse of `gemma4`'s reading, so that a written file reads back into the
//! same configuration and the same tensor bytes.

use anyhow::{anyhow, bail, Result};

use super::file::{GgmlType, MetaValue};
use super::gemma4::{
    assistant_gguf_name, target_gguf_name, CENTROIDS_DTYPE_KEY, CENTROIDS_KEY, COMPUTE_DTYPE_KEY, ORDERING_KEY,
};
use super::write::OutTensor;
use crate::config::{AssistantConfig, DraftHead, KvMode, LayerType, RopeKind, TextConfig};
use crate::kernels::DType;
use crate::weights::{StoredDtype, Tensor, WeightStore};

/// Metadata and owned extra tensors (the RoPE factors) of an export.
pub struct Export {
    pub meta: Vec<(String, MetaValue)>,
    /// Tensors whose bytes the export made (name, ggml dims, type, bytes).
    pub extra: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    /// (GGUF name, store tensor) for everything else, in write order.
    pub tensors: Vec<(String, Tensor)>,
}

impl Export {
    /// The tensors to hand to `write::write`.
    pub fn out_tensors(&self) -> Result<Vec<OutTensor<'_>>> {
        let mut out = Vec::new();
        for (name, t) in &self.tensors {
            out.push(OutTensor {
                name: name.clone(),
                dims: t.shape.iter().rev().map(|&d| d as u64).collect(),
                ty: ggml_type(t)?,
                data: t.bytes(),
            });
        }
        for (name, dims, ty, data) in &self.extra {
            out.push(OutTensor { name: name.clone(), dims: dims.clone(), ty: *ty, data });
        }
        Ok(out)
    }
}

fn ggml_type(t: &Tensor) -> Result<GgmlType> {
    Ok(match t.dtype {
        StoredDtype::Float(DType::F32) => GgmlType::F32,
        StoredDtype::Float(DType::F16) => GgmlType::F16,
        StoredDtype::Float(DType::BF16) => GgmlType::BF16,
        StoredDtype::Quant { q, .. } if q.unpacked().is_some() => {
            bail!("tensor `{}` is packed for this CPU's kernels; export writes a store as loaded from its file", t.name)
        }
        StoredDtype::Quant { q, .. } => GgmlType(q.ggml_id()),
        StoredDtype::I64 => GgmlType::I64,
        StoredDtype::Other(d) => bail!("tensor `{}` is {d}, which GGUF export does not write", t.name),
    })
}

fn u32v(x: usize) -> MetaValue {
    MetaValue::U32(x as u32)
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// The keys both architectures share, under `arch.`.
fn text_meta(arch: &str, c: &TextConfig, shared: usize, meta: &mut Vec<(String, MetaValue)>) -> Result<()> {
    let mut put = |k: &str, v: MetaValue| meta.push((format!("{arch}.{k}"), v));
    let n = c.num_layers();
    let geom = |kind| c.geometry(kind);
    let (d_full, _) = geom(LayerType::Full).or(geom(LayerType::Sliding)).expect("a model has layers");
    let (d_swa, _) = geom(LayerType::Sliding).or(geom(LayerType::Full)).expect("a model has layers");
    put("block_count", u32v(n));
    put("context_length", u32v(c.max_position_embeddings));
    put("embedding_length", u32v(c.hidden_size));
    put(
        "feed_forward_length",
        MetaValue::Array(c.layers.iter().map(|l| MetaValue::I32(l.intermediate_size as i32)).collect()),
    );
    put("attention.head_count", u32v(c.num_heads));
    put(
        "attention.head_count_kv",
        MetaValue::Array(c.layers.iter().map(|l| MetaValue::I32(l.kv_heads as i32)).collect()),
    );
    put("attention.key_length", u32v(d_full));
    put("attention.value_length", u32v(d_full));
    put("attention.key_length_swa", u32v(d_swa));
    put("attention.value_length_swa", u32v(d_swa));
    put("rope.dimension_count", u32v(d_full));
    put("rope.dimension_count_swa", u32v(d_swa));
    if c.rope_sliding.kind != RopeKind::Default || c.rope_sliding.factor != 1.0 || c.rope_full.factor != 1.0 {
        bail!("GGUF has no way to say this model's RoPE (sliding layers must use default RoPE, and no layer a factor)");
    }
    put("rope.freq_base", MetaValue::F32(c.rope_full.theta));
    put("rope.freq_base_swa", MetaValue::F32(c.rope_sliding.theta));
    put("attention.layer_norm_rms_epsilon", MetaValue::F32(c.rms_norm_eps));
    put("attention.sliding_window", u32v(c.sliding_window));
    if let Some(cap) = c.final_logit_softcapping {
        put("final_logit_softcapping", MetaValue::F32(cap));
    }
    put("attention.shared_kv_layers", u32v(shared));
    put(
        "attention.sliding_window_pattern",
        MetaValue::Array(c.layers.iter().map(|l| MetaValue::Bool(l.kind == LayerType::Sliding)).collect()),
    );
    Ok(())
}

/// `rope_freqs.weight`: 1 for the rotated frequency pairs of full layers, 1e30 for the others.
fn rope_freqs(c: &TextConfig) -> Option<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let (d, _) = c.geometry(LayerType::Full)?;
    let RopeKind::Proportional { partial_rotary_factor } = c.rope_full.kind else { return None };
    let rotated = (partial_rotary_factor as f64 * d as f64 / 2.0).floor() as usize;
    let v: Vec<u8> = (0..d / 2).flat_map(|i| if i < rotated { 1.0f32 } else { 1e30 }.to_le_bytes()).collect();
    Some(("rope_freqs.weight".into(), vec![(d / 2) as u64], GgmlType::F32, v))
}

/// A 1-D float tensor (norms, scales) as F32, as llama.cpp's converter writes them: its CPU backend does not
/// multiply f32 activations by bf16 vectors. Exact (f16 and bf16 values are f32 values), and tandem reads
/// vectors as f32 anyway, so the file computes the same in both engines.
fn widen_vector(t: &Tensor) -> Tensor {
    match t.dtype {
        StoredDtype::Float(d) if t.shape.len() <= 1 && d != DType::F32 => {
            let bytes = (0..t.numel()).flat_map(|i| d.load(t.bytes(), i).to_le_bytes()).collect();
            Tensor::owned(&t.name, DType::F32, t.shape.clone(), bytes)
        }
        _ => t.clone(),
    }
}

/// Every tensor of `store` under its GGUF name. With `text_prefix`, `rename` gets names below the store's
/// text-model prefix and tensors outside it (other modalities) are left out; `lm_head.weight` is top-level.
fn tensors(
    store: &WeightStore,
    rename: fn(&str) -> Option<String>,
    text_prefix: bool,
    skip: &[&str],
) -> Result<Vec<(String, Tensor)>> {
    let p = if text_prefix { store.prefix().to_string() } else { String::new() };
    let mut names: Vec<&str> = store.names().collect();
    names.sort();
    let mut out = Vec::new();
    for full in names {
        let short = match full.strip_prefix(p.as_str()) {
            Some(s) => s,
            None if full == "lm_head.weight" => full,
            None => continue,
        };
        if skip.contains(&short) {
            continue;
        }
        let gguf =
            rename(short).ok_or_else(|| anyhow!("tensor `{full}` has no place in llama.cpp's Gemma 4 layout"))?;
        let t = store.get_full(full).ok_or_else(|| anyhow!("tensor `{full}` is listed but cannot be read"))?;
        out.push((gguf, widen_vector(t)));
    }
    Ok(out)
}

/// A target checkpoint as GGUF.
pub fn target(c: &TextConfig, store: &WeightStore, name: &str) -> Result<Export> {
    let mut meta = vec![
        ("general.architecture".to_string(), MetaValue::Str("gemma4".into())),
        ("general.name".to_string(), MetaValue::Str(name.into())),
    ];
    let shared = c.layers.iter().filter(|l| l.kv_mode == KvMode::Reuse).count();
    text_meta("gemma4", c, shared, &mut meta)?;
    let ple = c.ple.map_or(0, |p| p.dim);
    meta.push(("gemma4.embedding_length_per_layer_input".into(), u32v(ple)));
    if let Some(m) = c.moe {
        meta.push(("gemma4.expert_count".into(), u32v(m.num_experts)));
        meta.push(("gemma4.expert_used_count".into(), u32v(m.top_k)));
        meta.push(("gemma4.expert_feed_forward_length".into(), u32v(m.intermediate_size)));
    }
    let dtype = store
        .get("embed_tokens.weight")
        .ok_or_else(|| anyhow!("missing tensor `embed_tokens.weight`"))?
        .compute_dtype()?;
    meta.push((COMPUTE_DTYPE_KEY.into(), MetaValue::Str(dtype_name(dtype).into())));
    let mut ids = c.eos_token_ids.iter();
    if let Some(&eos) = ids.next() {
        meta.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)));
    }
    if let Some(&eot) = ids.next() {
        meta.push(("tokenizer.ggml.eot_token_id".into(), MetaValue::U32(eot)));
    }
    // Tied models have no `lm_head`; a tied checkpoint that still stores one would be written twice.
    let skip: &[&str] = if c.tie_word_embeddings { &["lm_head.weight"] } else { &[] };
    let tensors = tensors(store, target_gguf_name, true, skip)?;
    Ok(Export { meta, extra: rope_freqs(c).into_iter().collect(), tensors })
}

/// A drafter checkpoint as GGUF (`gemma4-assistant`).
pub fn assistant(c: &AssistantConfig, store: &WeightStore, name: &str) -> Result<Export> {
    let arch = "gemma4-assistant";
    let mut meta = vec![
        ("general.architecture".to_string(), MetaValue::Str(arch.into())),
        ("general.name".to_string(), MetaValue::Str(name.into())),
    ];
    let n = c.text.num_layers();
    text_meta(arch, &c.text, n, &mut meta)?;
    meta.push((format!("{arch}.embedding_length_per_layer_input"), u32v(0)));
    meta.push((format!("{arch}.embedding_length_out"), u32v(c.backbone_hidden_size)));
    meta.push((format!("{arch}.nextn_predict_layers"), u32v(n)));
    if let DraftHead::Centroid { top_k, .. } = c.head {
        meta.push((format!("{arch}.centroid_top_k"), u32v(top_k)));
    }
    let dtype = store
        .get_full("model.embed_tokens.weight")
        .ok_or_else(|| anyhow!("missing tensor `model.embed_tokens.weight`"))?
        .compute_dtype()?;
    meta.push((COMPUTE_DTYPE_KEY.into(), MetaValue::Str(dtype_name(dtype).into())));
    let extra: Vec<_> = rope_freqs(&c.text).into_iter().collect();
    // The centroid head travels in metadata (see `gemma4::CENTROIDS_KEY`).
    let centroids = "masked_embedding.centroids.weight";
    let ordering = "masked_embedding.token_ordering";
    if let Some(t) = store.get_full(centroids) {
        let dtype = t.float_dtype()?;
        let values = (0..t.numel()).map(|i| MetaValue::F32(dtype.load(t.bytes(), i))).collect();
        meta.push((CENTROIDS_KEY.into(), MetaValue::Array(values)));
        meta.push((CENTROIDS_DTYPE_KEY.into(), MetaValue::Str(dtype_name(dtype).into())));
        let order = store.get_full(ordering).ok_or_else(|| anyhow!("a centroid head without `{ordering}`"))?;
        let order = order
            .to_i64()?
            .into_iter()
            .map(|x| i32::try_from(x).map(MetaValue::I32).map_err(|_| anyhow!("`{ordering}` holds {x}")))
            .collect::<Result<Vec<_>>>()?;
        meta.push((ORDERING_KEY.into(), MetaValue::Array(order)));
    }
    let tensors = tensors(store, assistant_gguf_name, false, &[centroids, ordering])?;
    Ok(Export { meta, extra, tensors })
}
