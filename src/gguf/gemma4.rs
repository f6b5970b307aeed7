//! Gemma 4 in GGUF as llama.cpp's converter writes it (docs/gguf.md, "Gemma 4 in GGUF"): the `gemma4` target
//! and `gemma4-assistant` drafter architectures. The metadata becomes the same configuration a Hugging Face
//! `config.json` gives (built as that JSON and parsed by `config`, so every check there applies), and the
//! tensors are renamed to the checkpoint names the model loaders expect. Nothing is converted: each tensor
//! stays a view of the mapped file in its stored type, except the few small ones noted below.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};

use super::file::{GgmlType, GgufModel, MetaValue, Storage, TensorInfo};
use crate::config::{parse_assistant_config, parse_text_config, AssistantConfig, TextConfig};
use crate::kernels::DType;
use crate::weights::{StoredDtype, Tensor, WeightStore};

/// The metadata key written by tandem's own GGUF writer for the precision the model computes in (the dtype
/// its weights had before quantization). Files without it compute in their float type, or f32 when the
/// embedding is quantized, as llama.cpp does.
pub const COMPUTE_DTYPE_KEY: &str = "tandem.compute_dtype";

/// The architecture a GGUF file declares, checked to be one tandem runs.
fn architecture(m: &GgufModel) -> Result<&str> {
    let arch = m.str_opt("general.architecture")?.ok_or_else(|| m.missing("general.architecture"))?;
    match arch {
        "gemma4" | "gemma4-assistant" => Ok(arch),
        other => bail!(
            "{}: architecture {other:?} is not one tandem runs (it runs \"gemma4\" targets and \"gemma4-assistant\" drafters)",
            m.path().display()
        ),
    }
}

/// Whether the file is a drafter.
pub fn is_assistant(m: &GgufModel) -> Result<bool> {
    Ok(architecture(m)? == "gemma4-assistant")
}

/// Rows of a tensor's row-major shape, checked to be 2-D.
fn rows_of(m: &GgufModel, name: &str) -> Result<Option<usize>> {
    match m.tensor(name) {
        None => Ok(None),
        Some(t) if t.dims.len() == 2 => Ok(Some(t.dims[1] as usize)),
        Some(t) => bail!("{}: tensor `{name}` has dimensions {:?}, expected 2", m.path().display(), t.dims),
    }
}

/// The configuration both architectures share, as `config.json`'s text-model fields.
fn text_fields(m: &GgufModel, arch: &str) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("{arch}.{s}");
    let path = m.path().display();
    let n = m.usize_req(&k("block_count"))?;
    if n == 0 || n > crate::config::MAX_LAYERS {
        bail!("{path}: metadata `{}` is {n}; expected 1 to {} layers", k("block_count"), crate::config::MAX_LAYERS);
    }
    let hidden = m.usize_req(&k("embedding_length"))?;
    let vocab =
        rows_of(m, "token_embd.weight")?.ok_or_else(|| anyhow!("{path}: missing tensor `token_embd.weight`"))?;

    let uniform = |key: &str, v: Vec<usize>| -> Result<usize> {
        match v.iter().all(|&x| x == v[0]) {
            true => Ok(v[0]),
            false => {
                bail!("{path}: metadata `{}` differs between layers ({v:?}); tandem runs one value for all", k(key))
            }
        }
    };
    let heads =
        m.per_layer_usize(&k("attention.head_count"), n)?.ok_or_else(|| m.missing(&k("attention.head_count")))?;
    let heads = uniform("attention.head_count", heads)?;
    let kv = m.per_layer_usize(&k("attention.head_count_kv"), n)?.unwrap_or_else(|| vec![heads; n]);

    let swa: Vec<bool> = match m.array_opt(&k("attention.sliding_window_pattern"))? {
        Some(a) if a.len() == n => a
            .iter()
            .map(|v| match v {
                MetaValue::Bool(b) => Ok(*b),
                other => {
                    bail!("{path}: metadata `{}` must hold bools, got {other:?}", k("attention.sliding_window_pattern"))
                }
            })
            .collect::<Result<_>>()?,
        Some(a) => bail!(
            "{path}: metadata `{}` has {} entries, expected one per layer ({n})",
            k("attention.sliding_window_pattern"),
            a.len()
        ),
        None => return Err(m.missing(&k("attention.sliding_window_pattern"))),
    };
    // transformers makes the last layer full attention whatever the config says; a file that says otherwise
    // would be computed differently by llama.cpp, so it is refused rather than silently changed.
    if swa[n - 1] {
        bail!(
            "{path}: metadata `{}` makes the last layer sliding; Gemma 4's last layer is full attention",
            k("attention.sliding_window_pattern")
        );
    }
    let head_full = m.usize_req(&k("attention.key_length"))?;
    let head_swa = m.usize_req(&k("attention.key_length_swa"))?;
    for (key, want) in [("attention.value_length", head_full), ("attention.value_length_swa", head_swa)] {
        if let Some(v) = m.usize_opt(&k(key))? {
            if v != want {
                bail!("{path}: metadata `{}` ({v}) differs from the key length ({want}); Gemma 4 has equal K and V widths", k(key));
            }
        }
    }
    // Every full layer must agree, and so must every sliding one (the converter writes them per type).
    let kv_of = |sliding: bool| -> Result<Option<usize>> {
        let v: Vec<usize> = (0..n).filter(|&i| swa[i] == sliding).map(|i| kv[i]).collect();
        match v.first() {
            None => Ok(None),
            Some(&f) if v.iter().all(|&x| x == f) => Ok(Some(f)),
            Some(_) => bail!(
                "{path}: metadata `{}` differs between layers of one attention type",
                k("attention.head_count_kv")
            ),
        }
    };
    let (kv_swa, kv_full) = (kv_of(true)?, kv_of(false)?);

    let shared = m.usize_opt(&k("attention.shared_kv_layers"))?.unwrap_or(0);
    let ff = m.per_layer_usize(&k("feed_forward_length"), n)?.ok_or_else(|| m.missing(&k("feed_forward_length")))?;
    // The converter writes one width per layer when reuse layers have the doubled MLP.
    let first_shared = n.saturating_sub(shared);
    let base = ff[0];
    let double_wide = ff[first_shared..].iter().any(|&w| w != base);
    for (i, &w) in ff.iter().enumerate() {
        let want = if double_wide && i >= first_shared { base.saturating_mul(2) } else { base };
        if w != want {
            bail!(
                "{path}: metadata `{}` is {ff:?}; tandem runs one width, doubled on the K/V-sharing layers at most",
                k("feed_forward_length")
            );
        }
    }

    let mut obj = Map::new();
    obj.insert("vocab_size".into(), json!(vocab));
    obj.insert("hidden_size".into(), json!(hidden));
    obj.insert("intermediate_size".into(), json!(base));
    obj.insert("use_double_wide_mlp".into(), json!(double_wide));
    obj.insert("num_hidden_layers".into(), json!(n));
    obj.insert("num_attention_heads".into(), json!(heads));
    obj.insert("num_key_value_heads".into(), json!(kv_swa.or(kv_full).unwrap_or(1)));
    obj.insert("head_dim".into(), json!(head_swa));
    let mut per_layer = Map::new();
    for i in (0..n).filter(|&i| !swa[i]) {
        per_layer.insert(i.to_string(), json!({"head_dim": head_full, "num_key_value_heads": kv_full.unwrap_or(1)}));
    }
    obj.insert("per_layer_config".into(), Value::Object(per_layer));
    let types: Vec<&str> = swa.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    obj.insert("layer_types".into(), json!(types));
    obj.insert("num_kv_shared_layers".into(), json!(shared));
    let eps = m
        .f64_opt(&k("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
    obj.insert("rms_norm_eps".into(), json!(eps));
    obj.insert("sliding_window".into(), json!(m.usize_req(&k("attention.sliding_window"))?));
    if let Some(c) = m.usize_opt(&k("context_length"))? {
        obj.insert("max_position_embeddings".into(), json!(c));
    }
    if let Some(c) = m.f64_opt(&k("final_logit_softcapping"))? {
        obj.insert("final_logit_softcapping".into(), json!(c));
    }
    obj.insert("rope_parameters".into(), rope(m, arch, head_full, head_swa)?);
    // Full layers without V weights take V from K (`attention_k_eq_v`, the 26B and 31B).
    let own = |i: usize| i < first_shared;
    let full_own: Vec<usize> = (0..n).filter(|&i| !swa[i] && own(i)).collect();
    let no_v = full_own.iter().filter(|&&i| m.tensor(&format!("blk.{i}.attn_v.weight")).is_none()).count();
    if no_v > 0 && no_v < full_own.len() {
        bail!("{path}: some full-attention layers have `attn_v` weights and some do not");
    }
    obj.insert("attention_k_eq_v".into(), json!(no_v > 0));
    Ok(obj)
}

/// `rope_parameters` from the frequency bases and the `rope_freqs` tensor: llama.cpp encodes proportional
/// RoPE on full layers as frequency factors of 1 for the rotated pairs and 1e30 (no rotation) for the rest.
fn rope(m: &GgufModel, arch: &str, head_full: usize, head_swa: usize) -> Result<Value> {
    let k = |s: &str| format!("{arch}.{s}");
    let path = m.path().display();
    for (key, want) in [("rope.dimension_count", head_full), ("rope.dimension_count_swa", head_swa)] {
        if let Some(v) = m.usize_opt(&k(key))? {
            if v != want {
                bail!(
                    "{path}: metadata `{}` is {v}, but tandem runs Gemma 4's RoPE over the whole head ({want})",
                    k(key)
                );
            }
        }
    }
    if let Some(t) = m.str_opt(&k("rope.scaling.type"))? {
        if t != "none" {
            bail!("{path}: metadata `{}` is {t:?}; Gemma 4 has no RoPE scaling", k("rope.scaling.type"));
        }
    }
    let theta_full = m.f64_opt(&k("rope.freq_base"))?.unwrap_or(1_000_000.0);
    let theta_swa = m.f64_opt(&k("rope.freq_base_swa"))?.unwrap_or(10_000.0);
    let full = match m.tensor("rope_freqs.weight") {
        None => json!({"rope_type": "default", "rope_theta": theta_full}),
        Some(t) => {
            let v = float_values(m, t)?;
            if v.len() != head_full / 2 {
                bail!(
                    "{path}: tensor `rope_freqs.weight` has {} entries, expected {} (half the full-attention head)",
                    v.len(),
                    head_full / 2
                );
            }
            let rotated = v.iter().take_while(|&&x| x == 1.0).count();
            if rotated == 0 || v[rotated..].iter().any(|&x| x < 1e29) {
                bail!("{path}: tensor `rope_freqs.weight` is not Gemma 4's proportional RoPE (ones, then 1e30)");
            }
            // The factor as the f32 whose `floor(factor · D / 2)` is exactly the number of rotated pairs (the
            // nearest f32 to 2r/D can fall just short of it when D is not a power of two).
            let mut factor = (2.0 * rotated as f64 / head_full as f64) as f32;
            while ((factor as f64) * head_full as f64 / 2.0).floor() < rotated as f64 {
                factor = f32::from_bits(factor.to_bits() + 1);
            }
            json!({"rope_type": "proportional", "partial_rotary_factor": factor as f64, "rope_theta": theta_full})
        }
    };
    Ok(json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
        "full_attention": full,
    }))
}

/// A small float tensor's values.
fn float_values(m: &GgufModel, t: &TensorInfo) -> Result<Vec<f32>> {
    let b = m.bytes(t);
    let dtype = match t.ty.storage() {
        Some(Storage::F32) => DType::F32,
        Some(Storage::F16) => DType::F16,
        Some(Storage::BF16) => DType::BF16,
        _ => bail!("{}: tensor `{}` must be a float tensor, got {}", m.path().display(), t.name, t.ty),
    };
    Ok((0..b.len() / dtype.size()).map(|i| dtype.load(b, i)).collect())
}

/// Tokens that end generation in Gemma 4 files besides the named ids, found by their text as llama.cpp
/// finds them (`generation_config.json`'s stop list does not travel in GGUF).
const STOP_TEXTS: [&str; 3] = ["<eos>", "<turn|>", "<|tool_response>"];

/// Token ids that end generation: the named EOS / end-of-turn / end-of-message ids, then the tokens of
/// `STOP_TEXTS` the vocabulary has.
fn stop_ids(m: &GgufModel) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = m.usize_opt(key)? {
            let id =
                u32::try_from(id).map_err(|_| anyhow!("{}: metadata `{key}` is out of range", m.path().display()))?;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    for (i, t) in m.array_opt("tokenizer.ggml.tokens")?.unwrap_or(&[]).iter().enumerate() {
        if matches!(t, MetaValue::Str(s) if STOP_TEXTS.contains(&s.as_str())) && !ids.contains(&(i as u32)) {
            ids.push(i as u32);
        }
    }
    Ok(ids)
}

/// The target configuration of a `gemma4` file.
pub fn target_config(m: &GgufModel) -> Result<TextConfig> {
    if architecture(m)? != "gemma4" {
        bail!(
            "{} is a Gemma 4 assistant drafter (architecture \"gemma4-assistant\"); pass it with --assistant, and a target with --model",
            m.path().display()
        );
    }
    let mut obj = text_fields(m, "gemma4")?;
    let k = |s: &str| format!("gemma4.{s}");
    let ple = m.usize_opt(&k("embedding_length_per_layer_input"))?.unwrap_or(0);
    obj.insert("hidden_size_per_layer_input".into(), json!(ple));
    if ple > 0 {
        let rows = rows_of(m, "per_layer_token_embd.weight")?
            .ok_or_else(|| anyhow!("{}: missing tensor `per_layer_token_embd.weight`", m.path().display()))?;
        obj.insert("vocab_size_per_layer_input".into(), json!(rows));
    }
    if let Some(e) = m.usize_opt(&k("expert_count"))?.filter(|&e| e > 0) {
        obj.insert("enable_moe_block".into(), json!(true));
        obj.insert("num_experts".into(), json!(e));
        obj.insert("top_k_experts".into(), json!(m.usize_req(&k("expert_used_count"))?));
        let n = m.usize_req(&k("block_count"))?;
        let w = m
            .per_layer_usize(&k("expert_feed_forward_length"), n)?
            .ok_or_else(|| m.missing(&k("expert_feed_forward_length")))?;
        if w.iter().any(|&x| x != w[0]) {
            bail!("{}: metadata `{}` differs between layers", m.path().display(), k("expert_feed_forward_length"));
        }
        obj.insert("moe_intermediate_size".into(), json!(w[0]));
    }
    obj.insert("tie_word_embeddings".into(), json!(m.tensor("output.weight").is_none()));
    let vocab = obj["vocab_size"].as_u64().unwrap_or(0);
    let id = |key: &str| -> Result<Value> {
        Ok(match m.usize_opt(key)? {
            Some(id) if (id as u64) < vocab => json!(id),
            Some(id) => {
                bail!("{}: metadata `{key}` is {id}, outside the vocabulary of {vocab} tokens", m.path().display())
            }
            None => Value::Null,
        })
    };
    obj.insert("bos_token_id".into(), id("tokenizer.ggml.bos_token_id")?);
    obj.insert("pad_token_id".into(), id("tokenizer.ggml.padding_token_id")?);
    let stops = stop_ids(m)?;
    if !stops.is_empty() {
        obj.insert("eos_token_id".into(), json!(stops));
    }
    parse_text_config(&obj, "gemma4_text", "")
        .with_context(|| format!("{}: the GGUF metadata, read as a Gemma 4 configuration", m.path().display()))
}

/// The drafter configuration of a `gemma4-assistant` file.
pub fn assistant_config(m: &GgufModel) -> Result<AssistantConfig> {
    if architecture(m)? != "gemma4-assistant" {
        bail!(
            "{} is a Gemma 4 target (architecture \"gemma4\"), not an assistant drafter; pass it with --model",
            m.path().display()
        );
    }
    let arch = "gemma4-assistant";
    let mut text = text_fields(m, arch)?;
    let n = text["num_hidden_layers"].as_u64().unwrap_or(0);
    text.insert("num_kv_shared_layers".into(), json!(n));
    text.insert("hidden_size_per_layer_input".into(), json!(0));
    text.insert("vocab_size_per_layer_input".into(), json!(0));
    let mut obj = Map::new();
    obj.insert("model_type".into(), json!("gemma4_assistant"));
    obj.insert("text_config".into(), Value::Object(text));
    obj.insert("backbone_hidden_size".into(), json!(m.usize_req(&format!("{arch}.embedding_length_out"))?));
    let hd = obj["text_config"]["hidden_size"].as_u64().unwrap_or(0) as usize;
    let centroids = match rows_of(m, "masked_embd_centroids.weight")? {
        Some(c) => Some(c),
        None => meta_centroids(m, hd)?.map(|(c, _, _)| c),
    };
    let has_ordering = m.tensor("masked_embd_ordering").is_some() || m.meta().contains_key(ORDERING_KEY);
    if centroids.is_some() != has_ordering {
        bail!("{}: a centroid head needs both its centroids and its token ordering", m.path().display());
    }
    if let Some(c) = centroids {
        obj.insert("use_ordered_embeddings".into(), json!(true));
        obj.insert("num_centroids".into(), json!(c));
        let top_k = m.usize_opt(&format!("{arch}.centroid_top_k"))?.unwrap_or(32);
        obj.insert("centroid_intermediate_top_k".into(), json!(top_k));
    }
    parse_assistant_config(&Value::Object(obj)).with_context(|| {
        format!("{}: the GGUF metadata, read as a Gemma 4 assistant configuration", m.path().display())
    })
}

/// `gemma4` tensors outside the layers: (GGUF name, checkpoint name below the text-model prefix;
/// `lm_head.weight` is top-level).
const TARGET_TOP: [(&str, &str); 6] = [
    ("token_embd.weight", "embed_tokens.weight"),
    ("per_layer_token_embd.weight", "embed_tokens_per_layer.weight"),
    ("per_layer_model_proj.weight", "per_layer_model_projection.weight"),
    ("per_layer_proj_norm.weight", "per_layer_projection_norm.weight"),
    ("output_norm.weight", "norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// Layer tensors of both architectures: (after `blk.N.`, after `layers.N.`).
const LAYER: [(&str, &str); 11] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("layer_output_scale.weight", "layer_scalar"),
];

/// Layer tensors only the target has: its own K/V, per-layer embeddings and mixture of experts.
const TARGET_LAYER: [(&str, &str); 14] = [
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("inp_gate.weight", "per_layer_input_gate.weight"),
    ("proj.weight", "per_layer_projection.weight"),
    ("post_norm.weight", "post_per_layer_input_norm.weight"),
    ("ffn_gate_inp.weight", "router.proj.weight"),
    ("ffn_gate_inp.scale", "router.scale"),
    ("ffn_down_exps.scale", "router.per_expert_scale"),
    ("ffn_gate_up_exps.weight", "experts.gate_up_proj"),
    ("ffn_down_exps.weight", "experts.down_proj"),
    ("pre_ffw_norm_2.weight", "pre_feedforward_layernorm_2.weight"),
    ("post_ffw_norm_1.weight", "post_feedforward_layernorm_1.weight"),
    ("post_ffw_norm_2.weight", "post_feedforward_layernorm_2.weight"),
];

/// `gemma4-assistant` tensors outside the layers: (GGUF name, checkpoint name).
const ASSISTANT_TOP: [(&str, &str); 6] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("nextn.pre_projection.weight", "pre_projection.weight"),
    ("nextn.post_projection.weight", "post_projection.weight"),
    ("masked_embd_centroids.weight", "masked_embedding.centroids.weight"),
    ("masked_embd_ordering", "masked_embedding.token_ordering"),
];

/// Which way a name is translated.
#[derive(Clone, Copy)]
enum Dir {
    FromGguf,
    ToGguf,
}

/// Translate one name with a top-level table, the layer tables and the layer prefixes (`blk.` and
/// `layers_prefix`); `Err` for a name the layout does not have.
type Table = [(&'static str, &'static str)];

fn translate(name: &str, dir: Dir, top: &Table, layer: &[&Table], layers_prefix: &str) -> Result<String, ()> {
    let pick = |&(g, c): &(&'static str, &'static str)| match dir {
        Dir::FromGguf => (g, c),
        Dir::ToGguf => (c, g),
    };
    if let Some((_, to)) = top.iter().map(pick).find(|(from, _)| *from == name) {
        return Ok(to.to_string());
    }
    let (from_prefix, to_prefix) = match dir {
        Dir::FromGguf => ("blk.", layers_prefix),
        Dir::ToGguf => (layers_prefix, "blk."),
    };
    let (i, rest) = name.strip_prefix(from_prefix).and_then(|r| r.split_once('.')).ok_or(())?;
    let i: usize = i.parse().map_err(|_| ())?;
    let to = layer.iter().flat_map(|t| t.iter()).map(pick).find(|(from, _)| *from == rest).ok_or(())?.1;
    Ok(format!("{to_prefix}{i}.{to}"))
}

/// Where tandem's writer keeps the centroid head of a drafter (docs/gguf.md, "The centroid head"): in
/// metadata, since llama.cpp refuses a file with tensors it does not load and fails on the tensor names it
/// reserves for them. The centroids as f32 values (row after row), the dtype they had, and the ordering.
pub const CENTROIDS_KEY: &str = "gemma4-assistant.masked_embd_centroids";
pub const CENTROIDS_DTYPE_KEY: &str = "gemma4-assistant.masked_embd_centroids_dtype";
pub const ORDERING_KEY: &str = "gemma4-assistant.masked_embd_ordering";

/// The metadata centroids: (count, dtype, values), checked to be whole rows of `hd`.
fn meta_centroids(m: &GgufModel, hd: usize) -> Result<Option<(usize, DType, Vec<f32>)>> {
    let Some(a) = m.array_opt(CENTROIDS_KEY)? else { return Ok(None) };
    let path = m.path().display();
    let values = a
        .iter()
        .map(|v| match v {
            MetaValue::F32(x) => Ok(*x),
            other => bail!("{path}: metadata `{CENTROIDS_KEY}` must hold float32 values, got {other:?}"),
        })
        .collect::<Result<Vec<f32>>>()?;
    if hd == 0 || values.is_empty() || values.len() % hd != 0 {
        bail!("{path}: metadata `{CENTROIDS_KEY}` holds {} values, not whole rows of {hd}", values.len());
    }
    let dtype = match m.str_opt(CENTROIDS_DTYPE_KEY)?.unwrap_or("f32") {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => bail!("{path}: metadata `{CENTROIDS_DTYPE_KEY}` is {other:?}; expected f32, f16 or bf16"),
    };
    Ok(Some((values.len() / hd, dtype, values)))
}

/// The drafter's centroid head from metadata, as the checkpoint's two tensors.
fn centroid_tensors(m: &GgufModel, hd: usize) -> Result<Vec<Tensor>> {
    let Some((n, dtype, values)) = meta_centroids(m, hd)? else { return Ok(Vec::new()) };
    let mut bytes = Vec::with_capacity(values.len() * dtype.size());
    for v in values {
        match dtype {
            DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    let order = m.array_opt(ORDERING_KEY)?.ok_or_else(|| m.missing(ORDERING_KEY))?;
    let order = order
        .iter()
        .map(|v| v.as_i128().and_then(|x| i64::try_from(x).ok()))
        .collect::<Option<Vec<i64>>>()
        .ok_or_else(|| anyhow!("{}: metadata `{ORDERING_KEY}` must hold integers", m.path().display()))?;
    Ok(vec![
        Tensor::owned("masked_embedding.centroids.weight", dtype, vec![n, hd], bytes),
        Tensor::owned_i64("masked_embedding.token_ordering", &order),
    ])
}

/// The checkpoint name of a `gemma4` tensor; `None` for tensors read into the configuration or joined
/// later (`ffn_gate_exps` / `ffn_up_exps`, see `join_split_experts`).
fn target_name(gguf: &str) -> Result<Option<String>, ()> {
    if gguf == "rope_freqs.weight" {
        return Ok(None);
    }
    if let Some((_, "ffn_gate_exps.weight" | "ffn_up_exps.weight")) = block(gguf) {
        return Ok(None);
    }
    translate(gguf, Dir::FromGguf, &TARGET_TOP, &[&LAYER, &TARGET_LAYER], "layers.").map(Some)
}

/// The checkpoint name of a `gemma4-assistant` tensor.
fn assistant_name(gguf: &str) -> Result<Option<String>, ()> {
    if gguf == "rope_freqs.weight" {
        return Ok(None);
    }
    translate(gguf, Dir::FromGguf, &ASSISTANT_TOP, &[&LAYER], "model.layers.").map(Some)
}

/// The GGUF name of a target checkpoint tensor (name below the text-model prefix).
pub fn target_gguf_name(name: &str) -> Option<String> {
    translate(name, Dir::ToGguf, &TARGET_TOP, &[&LAYER, &TARGET_LAYER], "layers.").ok()
}

/// The GGUF name of a drafter checkpoint tensor.
pub fn assistant_gguf_name(name: &str) -> Option<String> {
    translate(name, Dir::ToGguf, &ASSISTANT_TOP, &[&LAYER], "model.layers.").ok()
}

/// `blk.N.rest` → (N, rest).
fn block(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (i, rest) = rest.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

/// The dtype a file's model computes in: tandem's own key, else the embedding's float type, else f32.
fn compute_dtype(m: &GgufModel) -> Result<DType> {
    if let Some(s) = m.str_opt(COMPUTE_DTYPE_KEY)? {
        return match s {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::BF16),
            other => {
                bail!("{}: metadata `{COMPUTE_DTYPE_KEY}` is {other:?}; expected f32, f16 or bf16", m.path().display())
            }
        };
    }
    Ok(match m.tensor("token_embd.weight").and_then(|t| t.ty.storage()) {
        Some(Storage::F16) => DType::F16,
        Some(Storage::BF16) => DType::BF16,
        _ => DType::F32,
    })
}

/// A tensor of the file as a store tensor named `name`.
fn view(m: &GgufModel, t: &TensorInfo, name: String, compute: DType) -> Result<Tensor> {
    let shape = t.shape();
    let buf = m.files[t.file].buffer.clone();
    let dtype = match t.ty.storage() {
        Some(Storage::F32) => StoredDtype::Float(DType::F32),
        Some(Storage::F16) => StoredDtype::Float(DType::F16),
        Some(Storage::BF16) => StoredDtype::Float(DType::BF16),
        Some(Storage::Quant(q)) => StoredDtype::Quant { q, from: compute },
        Some(Storage::I64) => StoredDtype::I64,
        Some(Storage::I32) => {
            // Only the centroid ordering is an integer tensor; the loaders read it as I64.
            let v: Vec<i64> =
                m.bytes(t).chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")).into()).collect();
            let mut owned = Tensor::owned_i64(&name, &v);
            owned.shape = shape;
            return Ok(owned);
        }
        None => unreachable!("unsupported types are refused when the file is opened"),
    };
    Ok(Tensor::mapped(&name, dtype, shape, buf, t.start, t.len))
}

/// Every tensor of the file under its checkpoint name, or an error naming one tandem does not know.
fn store(m: &GgufModel, rename: fn(&str) -> Result<Option<String>, ()>, what: &str) -> Result<WeightStore> {
    let compute = compute_dtype(m)?;
    let mut tensors = Vec::new();
    for t in m.tensors() {
        match rename(&t.name) {
            Ok(Some(name)) => tensors.push(view(m, t, name, compute)?),
            Ok(None) => {}
            Err(()) => {
                bail!("{}: tensor `{}` is not part of the {what} layout tandem knows", m.path().display(), t.name)
            }
        }
    }
    let mut s = WeightStore::from_tensors(tensors);
    s.set_source(m.path());
    Ok(s)
}

/// The target's tensors, named as in a checkpoint (text-model prefix empty).
pub fn target_store(m: &GgufModel) -> Result<WeightStore> {
    let mut s = store(m, target_name, "Gemma 4")?;
    join_split_experts(m, &mut s)?;
    Ok(s)
}

/// The drafter's tensors, named as in a checkpoint (with the centroid head from metadata, if it is there).
pub fn assistant_store(m: &GgufModel) -> Result<WeightStore> {
    let mut s = store(m, assistant_name, "Gemma 4 assistant")?;
    let hd = m.usize_req("gemma4-assistant.embedding_length")?;
    for t in centroid_tensors(m, hd)? {
        s.insert(t);
    }
    Ok(s)
}

/// Files that keep each layer's expert gate and up matrices apart (`ffn_gate_exps`, `ffn_up_exps`) get
/// them joined into the checkpoint's `experts.gate_up_proj` (per expert: the gate rows, then the up rows),
/// in memory of their own in the stored type.
fn join_split_experts(m: &GgufModel, s: &mut WeightStore) -> Result<()> {
    let compute = compute_dtype(m)?;
    for t in m.tensors() {
        let Some((i, "ffn_gate_exps.weight")) = block(&t.name) else { continue };
        let up_name = format!("blk.{i}.ffn_up_exps.weight");
        let up =
            m.tensor(&up_name).ok_or_else(|| anyhow!("{}: `{}` has no `{up_name}`", m.path().display(), t.name))?;
        if up.dims != t.dims || up.ty != t.ty || t.dims.len() != 3 {
            bail!("{}: `{}` and `{up_name}` differ in shape or type", m.path().display(), t.name);
        }
        let (gate, upb) = (m.bytes(t), m.bytes(up));
        let experts = t.dims[2] as usize;
        let per = gate.len() / experts;
        let mut data = Vec::with_capacity(2 * gate.len());
        for e in 0..experts {
            data.extend_from_slice(&gate[e * per..(e + 1) * per]);
            data.extend_from_slice(&upb[e * per..(e + 1) * per]);
        }
        let shape = vec![experts, 2 * t.dims[1] as usize, t.dims[0] as usize];
        let name = format!("layers.{i}.experts.gate_up_proj");
        let joined = match view(m, t, name.clone(), compute)?.dtype {
            StoredDtype::Float(d) => Tensor::owned(&name, d, shape, data),
            StoredDtype::Quant { q, from } => Tensor::owned_quant(&name, q, from, shape, data),
            _ => bail!("{}: `{}` must be a float or quantized tensor", m.path().display(), t.name),
        };
        s.insert(joined);
    }
    for t in m.tensors() {
        if let Some((i, "ffn_up_exps.weight")) = block(&t.name) {
            if m.tensor(&format!("blk.{i}.ffn_gate_exps.weight")).is_none() {
                bail!("{}: `{}` has no matching `blk.{i}.ffn_gate_exps.weight`", m.path().display(), t.name);
            }
        }
    }
    Ok(())
}

/// The first block-quantized weight's type, if the file has any.
pub fn quantized_type(m: &GgufModel) -> Option<GgmlType> {
    m.tensors().find(|t| matches!(t.ty.storage(), Some(Storage::Quant(_)))).map(|t| t.ty)
}

/// `--quantize` on a file that is already quantized: refused, since quantizing quantized weights again only
/// loses precision.
pub fn refuse_requantize(m: &GgufModel, recipe: crate::quantize::Recipe) -> Result<()> {
    match quantized_type(m) {
        Some(t) => bail!(
            "{}: --quantize {} needs float weights, but this file is already quantized ({t}); run it without --quantize",
            m.path().display(),
            recipe.name()
        ),
        None => Ok(()),
    }
}

/// The tokenizer metadata of a file (`tokenizer.ggml.*`, `tokenizer.chat_template`); `None` when it has no
/// vocabulary.
pub fn vocab(m: &GgufModel) -> Result<Option<crate::text::gguf_vocab::GgufVocab>> {
    let Some(tokens) = m.array_opt("tokenizer.ggml.tokens")? else { return Ok(None) };
    let path = m.path().display();
    let strings = |key: &str, a: &[MetaValue]| -> Result<Vec<String>> {
        a.iter()
            .map(|v| match v {
                MetaValue::Str(s) => Ok(s.clone()),
                other => bail!("{path}: metadata `{key}` must hold strings, got {other:?}"),
            })
            .collect()
    };
    let numbers = |key: &str| -> Result<Option<Vec<f64>>> {
        m.array_opt(key)?
            .map(|a| {
                a.iter()
                    .map(|v| v.as_f64().ok_or_else(|| anyhow!("{path}: metadata `{key}` must hold numbers")))
                    .collect()
            })
            .transpose()
    };
    let id = |key: &str| -> Result<Option<u32>> {
        m.usize_opt(key)?
            .map(|v| u32::try_from(v).map_err(|_| anyhow!("{path}: metadata `{key}` is out of range")))
            .transpose()
    };
    let merges = m.array_opt("tokenizer.ggml.merges")?.map(|a| strings("tokenizer.ggml.merges", a)).transpose()?;
    Ok(Some(crate::text::gguf_vocab::GgufVocab {
        model: m.str_opt("tokenizer.ggml.model")?.ok_or_else(|| m.missing("tokenizer.ggml.model"))?.to_string(),
        pre: m.str_opt("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: strings("tokenizer.ggml.tokens", tokens)?,
        scores: numbers("tokenizer.ggml.scores")?.map(|v| v.into_iter().map(|x| x as f32).collect()),
        token_types: numbers("tokenizer.ggml.token_type")?.map(|v| v.into_iter().map(|x| x as i32).collect()),
        merges,
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        unk: id("tokenizer.ggml.unknown_token_id")?,
        pad: id("tokenizer.ggml.padding_token_id")?,
        mask: id("tokenizer.ggml.mask_token_id")?,
        eot: id("tokenizer.ggml.eot_token_id")?,
        add_bos: m.bool_opt("tokenizer.ggml.add_bos_token")?,
        add_eos: m.bool_opt("tokenizer.ggml.add_eos_token")?,
        add_space_prefix: m.bool_opt("tokenizer.ggml.add_space_prefix")?,
        chat_template: m.str_opt("tokenizer.chat_template")?.map(str::to_string),
    }))
}
