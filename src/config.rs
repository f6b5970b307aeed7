//! Gemma 4 target configs: both JSON layouts (ForCausalLM and ForConditionalGeneration), both spellings of
//! the full-attention geometry, every default of transformers 5.23.0, and validation with errors that name
//! the offending field.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    Sliding,
    Full,
}

impl LayerType {
    pub fn name(self) -> &'static str {
        match self {
            LayerType::Sliding => "sliding_attention",
            LayerType::Full => "full_attention",
        }
    }
}

/// How a layer gets its keys and values (docs/model.md, "KV sharing").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvMode {
    /// Projects and caches its own K/V.
    Own,
    /// Like `Own`, and publishes its K/V to the reuse layers of its type and to the drafter.
    Store,
    /// Attends to the K/V of the store layer of its type; has no K/V weights or cache.
    Reuse,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeKind {
    Default,
    /// Only the first `floor(partial_rotary_factor·D/2)` frequency pairs rotate; exponents use the full D.
    Proportional {
        partial_rotary_factor: f32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub kind: RopeKind,
    pub theta: f32,
    /// Divides every inverse frequency (default 1).
    pub factor: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub kind: LayerType,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Full layers of `attention_k_eq_v` models: no v_proj, V comes from the raw K projection.
    pub k_eq_v: bool,
    pub kv_mode: KvMode,
    /// The layer whose cache this layer attends to: itself unless `kv_mode == Reuse`.
    pub kv_source: usize,
    /// Dense MLP width (doubled on reuse layers of `use_double_wide_mlp` models).
    pub intermediate_size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PleConfig {
    /// Rows of `embed_tokens_per_layer`.
    pub vocab_size: usize,
    /// P: width of each layer's slice.
    pub dim: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
}

/// The text model's configuration, resolved per layer.
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    pub max_position_embeddings: usize,
    pub final_logit_softcapping: Option<f32>,
    pub tie_word_embeddings: bool,
    pub rope_sliding: RopeConfig,
    pub rope_full: RopeConfig,
    pub ple: Option<PleConfig>,
    pub moe: Option<MoeConfig>,
    pub layers: Vec<LayerConfig>,
    pub eos_token_ids: Vec<u32>,
}

/// How the checkpoint wraps the text model; decides which weight-name prefixes to expect first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    CausalLm,
    ConditionalGeneration,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub layout: Layout,
    pub text: TextConfig,
}

impl TextConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The store layer of each type (the layers whose K/V the drafter reads), if any.
    pub fn store_layer(&self, kind: LayerType) -> Option<usize> {
        self.layers.iter().position(|l| l.kind == kind && l.kv_mode == KvMode::Store)
    }

    pub fn rope(&self, kind: LayerType) -> &RopeConfig {
        match kind {
            LayerType::Sliding => &self.rope_sliding,
            LayerType::Full => &self.rope_full,
        }
    }

    /// Geometry (head_dim, kv_heads) shared by every layer of `kind`.
    pub fn geometry(&self, kind: LayerType) -> Option<(usize, usize)> {
        self.layers.iter().find(|l| l.kind == kind).map(|l| (l.head_dim, l.kv_heads))
    }
}

/// Parse a JSON file, with errors that name it.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = crate::files::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| anyhow!("{}: malformed JSON: {e}", path.display()))
}

/// Read `config.json` (and `generation_config.json`, when present) from a model directory.
pub fn load_model_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let mut cfg = parse_model_config(&read_json(&path)?).with_context(|| format!("{}", path.display()))?;
    let gen_path = dir.join("generation_config.json");
    if crate::files::exists(&gen_path) {
        apply_generation_config(&mut cfg.text, &read_json(&gen_path)?)
            .with_context(|| format!("{}", gen_path.display()))?;
    }
    Ok(cfg)
}

/// `generation_config.json` may override the stop ids (instruction-tuned checkpoints list e.g. `[1, 106]`).
pub fn apply_generation_config(text: &mut TextConfig, json: &Value) -> Result<()> {
    let obj = json.as_object().ok_or_else(|| anyhow!("expected a JSON object"))?;
    let f = Fields { obj, ctx: "" };
    if let Some(ids) = f.token_ids("eos_token_id")? {
        for &id in &ids {
            check_token_id("eos_token_id", id, text.vocab_size)?;
        }
        text.eos_token_ids = ids;
    }
    Ok(())
}

pub fn parse_model_config(json: &Value) -> Result<ModelConfig> {
    let obj = json.as_object().ok_or_else(|| anyhow!("expected a JSON object at the top level"))?;
    let model_type = obj
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("field `model_type` is missing or not a string"))?;
    match model_type {
        "gemma4" | "gemma4_unified" => {
            let text = obj
                .get("text_config")
                .and_then(Value::as_object)
                .ok_or_else(|| anyhow!("field `text_config` is missing or not an object (model_type {model_type})"))?;
            let inner_default = if model_type == "gemma4" { "gemma4_text" } else { "gemma4_unified_text" };
            let inner = text.get("model_type").and_then(Value::as_str).unwrap_or(inner_default);
            if inner != inner_default {
                bail!("field `text_config.model_type` is {inner:?}, expected {inner_default:?} inside {model_type:?}");
            }
            let mut text_cfg = parse_text_config(text, inner, "text_config.")?;
            // Top-level token ids, when the nested config lacks them, are the ones the model uses.
            let top = Fields { obj, ctx: "" };
            if !text.contains_key("eos_token_id") {
                if let Some(ids) = top.token_ids("eos_token_id")? {
                    text_cfg.eos_token_ids = ids;
                }
            }
            Ok(ModelConfig { layout: Layout::ConditionalGeneration, text: text_cfg })
        }
        "gemma4_text" | "gemma4_unified_text" => {
            Ok(ModelConfig { layout: Layout::CausalLm, text: parse_text_config(obj, model_type, "")? })
        }
        "gemma4_assistant" | "gemma4_unified_assistant" => bail!(
            "this is an assistant (drafter) config (model_type {model_type:?}); pass it with --assistant, and a Gemma 4 target with --model"
        ),
        other => bail!(
            "field `model_type` is {other:?}; tandem runs gemma4, gemma4_unified, gemma4_text and gemma4_unified_text"
        ),
    }
}

/// Parse a `gemma4_text` / `gemma4_unified_text` config object (docs/model.md, "Configuration").
pub fn parse_text_config(obj: &Map<String, Value>, model_type: &str, ctx: &str) -> Result<TextConfig> {
    let unified = model_type == "gemma4_unified_text";
    let f = Fields { obj, ctx };

    let vocab_size = f.positive("vocab_size", 262_144)?;
    let hidden_size = f.positive("hidden_size", 2304)?;
    let intermediate_size = f.positive("intermediate_size", 9216)?;
    let num_layers = f.positive("num_hidden_layers", 30)?;
    if num_layers > MAX_LAYERS {
        bail!("field `{ctx}num_hidden_layers` is {num_layers}; tandem runs models of at most {MAX_LAYERS} layers (Gemma 4 has up to 60)");
    }
    let num_heads = f.positive("num_attention_heads", 8)?;
    let num_kv_heads = f.positive("num_key_value_heads", 4)?;
    let head_dim = f.positive("head_dim", 256)?;
    let rms_norm_eps = f.float("rms_norm_eps", 1e-6)?;
    if !(rms_norm_eps > 0.0 && is_normal_f32(rms_norm_eps)) {
        bail!("field `{ctx}rms_norm_eps` must be a positive number within f32's normal range, got {rms_norm_eps}");
    }
    let sliding_window = f.positive("sliding_window", if unified { 1024 } else { 512 })?;
    let max_position_embeddings = f.positive("max_position_embeddings", if unified { 262_144 } else { 131_072 })?;

    let activation = f.string("hidden_activation")?.unwrap_or_else(|| "gelu_pytorch_tanh".into());
    if activation != "gelu_pytorch_tanh" {
        bail!("field `{ctx}hidden_activation` is {activation:?}; Gemma 4 uses \"gelu_pytorch_tanh\"");
    }
    if f.boolean("attention_bias", false)? {
        bail!("field `{ctx}attention_bias` is true; no Gemma 4 checkpoint has attention biases and tandem does not support them");
    }
    match obj.get("use_bidirectional_attention") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "vision" => {} // only changes masks of image tokens
        // "all" makes text attention non-causal (and halves the window): not a generative model.
        Some(Value::String(s)) if s == "all" => {
            bail!("field `{ctx}use_bidirectional_attention` is \"all\" (non-causal); tandem generates with causal models only")
        }
        Some(v) => bail!("field `{ctx}use_bidirectional_attention` must be null, \"vision\" or \"all\", got {v}"),
    }

    let final_logit_softcapping = match obj.get("final_logit_softcapping") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let c =
                v.as_f64().ok_or_else(|| anyhow!("field `{ctx}final_logit_softcapping` must be a number or null"))?;
            // The cap divides and multiplies the logits in f32: it must be a normal f32 value (1e308 is
            // infinite there, 1e-46 zero, and either turns every logit into NaN).
            if !(c > 0.0 && is_normal_f32(c)) {
                bail!(
                    "field `{ctx}final_logit_softcapping` must be a positive number within f32's normal range, got {c}"
                );
            }
            Some(c as f32)
        }
    };
    let tie_word_embeddings = f.boolean("tie_word_embeddings", true)?;

    // Layer types: default pattern 5 sliding + 1 full, last layer forced to full (as transformers does).
    let defaulted_types = matches!(obj.get("layer_types"), None | Some(Value::Null));
    let mut layer_types = match obj.get("layer_types") {
        None | Some(Value::Null) => (0..num_layers)
            .map(|i| if (i + 1) % 6 != 0 { LayerType::Sliding } else { LayerType::Full })
            .collect::<Vec<_>>(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("sliding_attention") => Ok(LayerType::Sliding),
                Some("full_attention") => Ok(LayerType::Full),
                _ => Err(anyhow!(
                    "field `{ctx}layer_types[{i}]` is {v}; expected \"sliding_attention\" or \"full_attention\""
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => bail!("field `{ctx}layer_types` must be a list, got {v}"),
    };
    if layer_types.len() != num_layers {
        bail!("field `{ctx}layer_types` has {} entries but `num_hidden_layers` is {num_layers}", layer_types.len());
    }
    if let Some(last) = layer_types.last_mut() {
        *last = LayerType::Full;
    }

    let (rope_sliding, rope_full) = parse_rope(obj, ctx)?;

    // Full-attention geometry: `per_layer_config` (written by transformers >= 5.2x) wins over
    // `global_head_dim` + `num_global_key_value_heads`.
    let k_eq_v = f.boolean("attention_k_eq_v", false)?;
    let mut geometry: Vec<(usize, usize)> = vec![(head_dim, num_kv_heads); num_layers];
    match obj.get("per_layer_config") {
        Some(Value::Object(per_layer)) => {
            for (key, over) in per_layer {
                let idx: usize = key
                    .trim()
                    .parse()
                    .map_err(|_| anyhow!("field `{ctx}per_layer_config` has key {key:?}, expected a layer index"))?;
                if idx >= num_layers {
                    bail!("field `{ctx}per_layer_config` names layer {idx} but the model has {num_layers} layers");
                }
                let over =
                    over.as_object().ok_or_else(|| anyhow!("field `{ctx}per_layer_config.{key}` must be an object"))?;
                let inner_ctx = format!("{ctx}per_layer_config.{key}.");
                let lf = Fields { obj: over, ctx: &inner_ctx };
                for (name, value) in over {
                    match name.as_str() {
                        "head_dim" | "num_key_value_heads" => {}
                        // Any other override must restate the global value, or we would compute the wrong model.
                        other if obj.get(other) == Some(value) => {}
                        other => {
                            bail!("field `{inner_ctx}{other}` overrides a per-layer value tandem does not support")
                        }
                    }
                }
                geometry[idx] = (lf.positive("head_dim", head_dim)?, lf.positive("num_key_value_heads", num_kv_heads)?);
            }
        }
        None | Some(Value::Null) => {
            let global_head_dim = f.positive("global_head_dim", 512)?;
            let global_kv = match obj.get("num_global_key_value_heads") {
                None | Some(Value::Null) => None,
                Some(_) => Some(f.positive("num_global_key_value_heads", 1)?),
            };
            for (i, t) in layer_types.iter().enumerate() {
                if *t == LayerType::Full {
                    let kv = if k_eq_v { global_kv.unwrap_or(num_kv_heads) } else { num_kv_heads };
                    geometry[i] = (global_head_dim, kv);
                }
            }
        }
        Some(v) => bail!("field `{ctx}per_layer_config` must be an object, got {v}"),
    }

    // KV sharing (docs/model.md, "KV sharing": the intended semantics rather than transformers 5.23.0's
    // buggy property).
    let num_shared = f.usize_or("num_kv_shared_layers", 0)?;
    if num_shared > num_layers {
        bail!("field `{ctx}num_kv_shared_layers` is {num_shared} but the model has only {num_layers} layers");
    }
    let first_shared = num_layers - num_shared;
    let mut modes = vec![KvMode::Own; num_layers];
    let store_of = |kind: LayerType| layer_types[..first_shared].iter().rposition(|t| *t == kind);
    let store_s = store_of(LayerType::Sliding);
    let store_f = store_of(LayerType::Full);
    for s in [store_s, store_f].into_iter().flatten() {
        modes[s] = KvMode::Store;
    }
    for m in modes.iter_mut().skip(first_shared) {
        *m = KvMode::Reuse;
    }

    let double_wide = f.boolean("use_double_wide_mlp", false)?;
    let mut layers = Vec::with_capacity(num_layers);
    for i in 0..num_layers {
        let kind = layer_types[i];
        let (hd, kv) = geometry[i];
        if hd % 2 != 0 {
            bail!("layer {i}: head_dim {hd} must be even for RoPE");
        }
        if num_heads % kv != 0 {
            bail!("layer {i}: num_attention_heads {num_heads} is not a multiple of its {kv} key/value heads");
        }
        let kv_source = if modes[i] == KvMode::Reuse {
            let store = if kind == LayerType::Sliding { store_s } else { store_f };
            store.ok_or_else(|| {
                let why = if defaulted_types {
                    format!(
                        " (`{ctx}layer_types` is missing or null, so the default pattern applies: every 6th layer and the last are full_attention)"
                    )
                } else {
                    String::new()
                };
                anyhow!(
                    "field `{ctx}num_kv_shared_layers` ({num_shared}) leaves no earlier {} layer to share K/V from (layer {i}){why}",
                    kind.name()
                )
            })?
        } else {
            i
        };
        layers.push(LayerConfig {
            kind,
            head_dim: hd,
            kv_heads: kv,
            k_eq_v: k_eq_v && kind == LayerType::Full,
            kv_mode: modes[i],
            kv_source,
            intermediate_size: if double_wide && modes[i] == KvMode::Reuse {
                2 * intermediate_size
            } else {
                intermediate_size
            },
        });
    }
    // A reuse layer reads its store layer's cache, so their geometries must agree; and the drafter reads
    // one geometry per layer type.
    for (i, l) in layers.iter().enumerate() {
        let first = layers.iter().find(|o| o.kind == l.kind).expect("layer exists");
        if (l.head_dim, l.kv_heads) != (first.head_dim, first.kv_heads) {
            bail!(
                "layer {i}: {} layers must share one head_dim/num_key_value_heads, got ({}, {}) and ({}, {})",
                l.kind.name(),
                first.head_dim,
                first.kv_heads,
                l.head_dim,
                l.kv_heads
            );
        }
    }

    let ple_dim = if unified { 0 } else { f.usize_or("hidden_size_per_layer_input", 256)? };
    let ple = if ple_dim > 0 {
        Some(PleConfig { vocab_size: f.positive("vocab_size_per_layer_input", 262_144)?, dim: ple_dim })
    } else {
        None
    };
    let moe = if !unified && f.boolean("enable_moe_block", false)? {
        let need = |name: &str| -> Result<usize> {
            match obj.get(name) {
                None | Some(Value::Null) => bail!("field `{ctx}{name}` is required when `enable_moe_block` is true"),
                Some(_) => f.positive(name, 0),
            }
        };
        let (num_experts, top_k, inter) =
            (need("num_experts")?, need("top_k_experts")?, need("moe_intermediate_size")?);
        if top_k > num_experts {
            bail!("field `{ctx}top_k_experts` ({top_k}) exceeds `num_experts` ({num_experts})");
        }
        Some(MoeConfig { num_experts, top_k, intermediate_size: inter })
    } else {
        None
    };

    let pad_token_id = f.token_id("pad_token_id", Some(0))?;
    let bos_token_id = f.token_id("bos_token_id", Some(2))?;
    let eos_token_ids = f.token_ids("eos_token_id")?.unwrap_or_else(|| vec![1]);
    for (name, id) in [("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id)] {
        if let Some(id) = id {
            check_token_id(name, id, vocab_size)?;
        }
    }
    for &id in &eos_token_ids {
        check_token_id("eos_token_id", id, vocab_size)?;
    }

    let cfg = TextConfig {
        vocab_size,
        hidden_size,
        num_heads,
        rms_norm_eps: rms_norm_eps as f32,
        sliding_window,
        max_position_embeddings,
        final_logit_softcapping,
        tie_word_embeddings,
        rope_sliding,
        rope_full,
        ple,
        moe,
        layers,
        eos_token_ids,
    };
    check_tensor_sizes(&cfg, ctx)?;
    Ok(cfg)
}

/// Most decoder layers a config may declare (checked before anything is sized by it; the weights are
/// then checked to hold exactly that many).
pub const MAX_LAYERS: usize = 4096;

/// Largest element count of one tensor a config may imply: anything larger cannot be a real checkpoint
/// on any machine, and sizes computed from it could overflow.
const MAX_TENSOR_ELEMENTS: usize = 1 << 44;

/// Whether `x` survives the conversion to f32 as a normal (finite, non-zero, non-subnormal) number.
fn is_normal_f32(x: f64) -> bool {
    (x as f32).is_normal()
}

/// The product of `dims` (named for the error) if it is a plausible tensor size.
fn tensor_elements(dims: &[(&str, usize)], ctx: &str) -> Result<usize> {
    let n = dims.iter().try_fold(1usize, |a, &(_, d)| a.checked_mul(d));
    match n {
        Some(n) if n <= MAX_TENSOR_ELEMENTS => Ok(n),
        _ => {
            let names: Vec<String> = dims.iter().map(|(name, d)| format!("{ctx}{name} = {d}")).collect();
            bail!(
                "fields {} imply a tensor of more than {MAX_TENSOR_ELEMENTS} elements; not a real checkpoint",
                names.join(" x ")
            )
        }
    }
}

/// Check that every weight shape the config implies can be computed without overflow, so that shape
/// checks against the checkpoint compare real numbers (e.g. `2 x moe_intermediate_size` cannot wrap).
fn check_tensor_sizes(c: &TextConfig, ctx: &str) -> Result<()> {
    let h = ("hidden_size", c.hidden_size);
    tensor_elements(&[("vocab_size", c.vocab_size), h], ctx)?;
    for l in &c.layers {
        let width = if l.kind == LayerType::Full { "global_head_dim" } else { "head_dim" };
        tensor_elements(&[("num_attention_heads", c.num_heads), (width, l.head_dim), h], ctx)?;
        tensor_elements(&[("num_key_value_heads", l.kv_heads), (width, l.head_dim), h], ctx)?;
        tensor_elements(&[("2", 2), ("intermediate_size", l.intermediate_size), h], ctx)?;
    }
    if let Some(m) = c.moe {
        tensor_elements(
            &[("num_experts", m.num_experts), ("2", 2), ("moe_intermediate_size", m.intermediate_size), h],
            ctx,
        )?;
    }
    if let Some(p) = c.ple {
        let width =
            tensor_elements(&[("num_hidden_layers", c.layers.len()), ("hidden_size_per_layer_input", p.dim)], ctx)?;
        tensor_elements(
            &[("vocab_size_per_layer_input", p.vocab_size), ("num_hidden_layers x hidden_size_per_layer_input", width)],
            ctx,
        )?;
        tensor_elements(&[("num_hidden_layers x hidden_size_per_layer_input", width), h], ctx)?;
    }
    Ok(())
}

fn check_token_id(name: &str, id: u32, vocab: usize) -> Result<()> {
    if id as usize >= vocab {
        bail!("field `{name}` is {id}, outside the vocabulary of {vocab} tokens");
    }
    Ok(())
}

fn parse_rope(obj: &Map<String, Value>, ctx: &str) -> Result<(RopeConfig, RopeConfig)> {
    let default_s = RopeConfig { kind: RopeKind::Default, theta: 10_000.0, factor: 1.0 };
    let default_f =
        RopeConfig { kind: RopeKind::Proportional { partial_rotary_factor: 0.25 }, theta: 1_000_000.0, factor: 1.0 };
    let params = match obj.get("rope_parameters") {
        None | Some(Value::Null) => return Ok((default_s, default_f)),
        Some(Value::Object(p)) => p,
        Some(v) => bail!("field `{ctx}rope_parameters` must be an object keyed by layer type, got {v}"),
    };
    let one = |kind: LayerType| -> Result<RopeConfig> {
        let key = kind.name();
        let p = params
            .get(key)
            .and_then(Value::as_object)
            .ok_or_else(|| anyhow!("field `{ctx}rope_parameters.{key}` is missing or not an object"))?;
        let pctx = format!("{ctx}rope_parameters.{key}.");
        let pf = Fields { obj: p, ctx: &pctx };
        let rope_type = pf.string("rope_type")?.unwrap_or_else(|| "default".into());
        let theta = match p.get("rope_theta") {
            Some(_) => pf.float("rope_theta", 0.0)?,
            None => bail!("field `{pctx}rope_theta` is missing"),
        };
        if !(theta > 1.0 && is_normal_f32(theta)) {
            bail!("field `{pctx}rope_theta` must be greater than 1, got {theta}");
        }
        let factor = pf.float("factor", 1.0)?;
        if !(factor > 0.0 && is_normal_f32(factor)) {
            bail!("field `{pctx}factor` must be positive, got {factor}");
        }
        let kind = match rope_type.as_str() {
            "default" => RopeKind::Default,
            "proportional" => {
                let p = pf.float("partial_rotary_factor", 1.0)?;
                if !(p > 0.0 && p <= 1.0) {
                    bail!("field `{pctx}partial_rotary_factor` must be in (0, 1], got {p}");
                }
                RopeKind::Proportional { partial_rotary_factor: p as f32 }
            }
            other => bail!("field `{pctx}rope_type` is {other:?}; Gemma 4 uses \"default\" or \"proportional\""),
        };
        // `factor` only exists for proportional RoPE in transformers; default RoPE ignores it.
        let factor = if kind == RopeKind::Default { 1.0 } else { factor };
        Ok(RopeConfig { kind, theta: theta as f32, factor: factor as f32 })
    };
    Ok((one(LayerType::Sliding)?, one(LayerType::Full)?))
}

/// Typed access to JSON fields with errors that name the field.
pub(crate) struct Fields<'a> {
    pub obj: &'a Map<String, Value>,
    pub ctx: &'a str,
}

impl Fields<'_> {
    fn present(&self, name: &str) -> Option<&Value> {
        match self.obj.get(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        match self.present(name) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| anyhow!("field `{}{name}` must be a non-negative integer, got {v}", self.ctx)),
        }
    }

    pub fn positive(&self, name: &str, default: usize) -> Result<usize> {
        let n = self.usize_or(name, default)?;
        if n == 0 {
            bail!("field `{}{name}` must be positive, got 0", self.ctx);
        }
        Ok(n)
    }

    pub fn float(&self, name: &str, default: f64) -> Result<f64> {
        match self.present(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("field `{}{name}` must be a number, got {v}", self.ctx)),
        }
    }

    pub fn boolean(&self, name: &str, default: bool) -> Result<bool> {
        match self.present(name) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("field `{}{name}` must be true or false, got {v}", self.ctx)),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<String>> {
        match self.present(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => bail!("field `{}{name}` must be a string, got {v}", self.ctx),
        }
    }

    pub fn token_id(&self, name: &str, default: Option<u32>) -> Result<Option<u32>> {
        match self.obj.get(name) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| anyhow!("field `{}{name}` must be a token id, got {v}", self.ctx)),
        }
    }

    /// A token id or a list of them (`eos_token_id` may be either).
    pub fn token_ids(&self, name: &str) -> Result<Option<Vec<u32>>> {
        let bad = |v: &Value| anyhow!("field `{}{name}` must be a token id or a list of token ids, got {v}", self.ctx);
        match self.present(name) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v)))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Ok(Some(vec![v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v))?])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn t1() -> Value {
        json!({"model_type":"gemma4_text","vocab_size":256,"hidden_size":64,"intermediate_size":96,"num_hidden_layers":6,
         "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"global_head_dim":32,
         "num_global_key_value_heads":1,"attention_k_eq_v":true,
         "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention"],
         "sliding_window":8,"num_kv_shared_layers":2,"use_double_wide_mlp":true,
         "hidden_size_per_layer_input":8,"vocab_size_per_layer_input":256,
         "enable_moe_block":true,"num_experts":4,"top_k_experts":2,"moe_intermediate_size":16,
         "final_logit_softcapping":30.0,"max_position_embeddings":512,"pad_token_id":0,"bos_token_id":2,"eos_token_id":1})
    }

    #[test]
    fn t1_resolves_modes_geometry_and_widths() {
        let c = parse_model_config(&t1()).unwrap();
        let t = &c.text;
        let modes: Vec<_> = t.layers.iter().map(|l| l.kv_mode).collect();
        use KvMode::*;
        assert_eq!(modes, vec![Own, Own, Store, Store, Reuse, Reuse]);
        assert_eq!(t.layers[4].kv_source, 2);
        assert_eq!(t.layers[5].kv_source, 3);
        assert_eq!((t.layers[0].head_dim, t.layers[0].kv_heads), (16, 2));
        assert_eq!((t.layers[1].head_dim, t.layers[1].kv_heads), (32, 1));
        assert!(t.layers[1].k_eq_v && !t.layers[0].k_eq_v);
        assert_eq!(t.layers[4].intermediate_size, 192);
        assert_eq!(t.layers[3].intermediate_size, 96);
        assert_eq!(t.ple, Some(PleConfig { vocab_size: 256, dim: 8 }));
        assert_eq!(t.moe, Some(MoeConfig { num_experts: 4, top_k: 2, intermediate_size: 16 }));
        assert_eq!(t.rope_full.kind, RopeKind::Proportional { partial_rotary_factor: 0.25 });
        assert_eq!(t.store_layer(LayerType::Sliding), Some(2));
        assert_eq!(t.store_layer(LayerType::Full), Some(3));
    }

    #[test]
    fn per_layer_config_spelling_matches_global_spelling() {
        let mut j = t1();
        let o = j.as_object_mut().unwrap();
        o.remove("global_head_dim");
        o.remove("num_global_key_value_heads");
        o.insert(
            "per_layer_config".into(),
            json!({"1":{"head_dim":32,"num_key_value_heads":1},"03":{"head_dim":32,"num_key_value_heads":1},
                   "5":{"head_dim":32,"num_key_value_heads":1}}),
        );
        assert_eq!(parse_model_config(&j).unwrap(), parse_model_config(&t1()).unwrap());
    }

    #[test]
    fn num_global_kv_heads_ignored_without_k_eq_v_and_defaults_apply() {
        let j = json!({"model_type":"gemma4_text","num_hidden_layers":6,"num_global_key_value_heads":1,
                       "num_key_value_heads":2});
        let t = parse_model_config(&j).unwrap().text;
        assert_eq!((t.layers[5].head_dim, t.layers[5].kv_heads), (512, 2));
        assert_eq!(t.layers[5].kind, LayerType::Full);
        assert_eq!(t.layers[4].kind, LayerType::Sliding);
        assert_eq!(t.vocab_size, 262_144);
        assert_eq!(t.sliding_window, 512);
        // No sharing: the last sliding and the last full layer still store (docs/model.md, "KV sharing").
        assert_eq!(t.store_layer(LayerType::Sliding), Some(4));
        assert_eq!(t.store_layer(LayerType::Full), Some(5));
        assert!(t.ple.is_some());
    }

    #[test]
    fn conditional_generation_wrapper_and_unified_defaults() {
        let j = json!({"model_type":"gemma4_unified","text_config":{"model_type":"gemma4_unified_text",
            "num_hidden_layers":2,"hidden_size_per_layer_input":256,"enable_moe_block":true},"eos_token_id":[1,106]});
        let c = parse_model_config(&j).unwrap();
        assert_eq!(c.layout, Layout::ConditionalGeneration);
        assert_eq!(c.text.sliding_window, 1024);
        assert!(c.text.ple.is_none() && c.text.moe.is_none());
        assert_eq!(c.text.eos_token_ids, vec![1, 106]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Value, &str)> = vec![
            (json!({"model_type":"llama"}), "model_type"),
            (json!({"hidden_size":4}), "model_type"),
            (json!({"model_type":"gemma4"}), "text_config"),
            (json!({"model_type":"gemma4_text","hidden_size":"big"}), "hidden_size"),
            (json!({"model_type":"gemma4_text","hidden_size":0}), "hidden_size"),
            (
                json!({"model_type":"gemma4_text","num_hidden_layers":2,"layer_types":["sliding_attention"]}),
                "layer_types",
            ),
            (json!({"model_type":"gemma4_text","num_hidden_layers":1,"layer_types":["local"]}), "layer_types[0]"),
            (json!({"model_type":"gemma4_text","num_kv_shared_layers":31}), "num_kv_shared_layers"),
            (json!({"model_type":"gemma4_text","enable_moe_block":true}), "num_experts"),
            (json!({"model_type":"gemma4_text","num_attention_heads":3}), "num_attention_heads"),
            (json!({"model_type":"gemma4_text","hidden_activation":"silu"}), "hidden_activation"),
            (json!({"model_type":"gemma4_text","eos_token_id":[1,"x"]}), "eos_token_id"),
            (json!({"model_type":"gemma4_text","vocab_size":10,"eos_token_id":11}), "eos_token_id"),
            (
                json!({"model_type":"gemma4_text","rope_parameters":{"full_attention":{}}}),
                "rope_parameters.sliding_attention",
            ),
            (
                json!({"model_type":"gemma4_text","rope_parameters":{"sliding_attention":{"rope_theta":1e4},
                "full_attention":{"rope_type":"yarn","rope_theta":1e6}}}),
                "rope_type",
            ),
            (json!({"model_type":"gemma4_text","per_layer_config":{"5":{"intermediate_size":7}}}), "intermediate_size"),
            (json!({"model_type":"gemma4_assistant"}), "--assistant"),
        ];
        for (j, needle) in cases {
            let e = format!("{:#}", parse_model_config(&j).unwrap_err());
            assert!(e.contains(needle), "error {e:?} should mention {needle:?}");
        }
    }

    #[test]
    fn generation_config_overrides_eos() {
        let mut t = parse_model_config(&t1()).unwrap().text;
        apply_generation_config(&mut t, &json!({"eos_token_id":[1, 7]})).unwrap();
        assert_eq!(t.eos_token_ids, vec![1, 7]);
        assert!(apply_generation_config(&mut t, &json!({"eos_token_id":[1000]})).is_err());
    }
}

/// The drafter's output head (docs/drafter.md, "Heads").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftHead {
    /// `logits = hd · E_dᵀ` over the whole vocabulary.
    Tied,
    /// Score only the tokens of the `top_k` best of `num_centroids` clusters (`use_ordered_embeddings`).
    Centroid { num_centroids: usize, top_k: usize },
}

/// A `gemma4_assistant` / `gemma4_unified_assistant` drafter config (docs/drafter.md, "Configuration").
#[derive(Clone, Debug, PartialEq)]
pub struct AssistantConfig {
    /// The drafter's own transformer (Q-only layers; `kv_mode` is meaningless here).
    pub text: TextConfig,
    /// Hb: the target's hidden size, which the drafter consumes and produces.
    pub backbone_hidden_size: usize,
    pub head: DraftHead,
    /// `num_assistant_tokens` from the drafter's `generation_config.json`, when present.
    pub num_assistant_tokens: Option<usize>,
}

pub fn load_assistant_config(dir: &Path) -> Result<AssistantConfig> {
    let path = dir.join("config.json");
    let mut cfg = parse_assistant_config(&read_json(&path)?).with_context(|| format!("{}", path.display()))?;
    let gen_path = dir.join("generation_config.json");
    if crate::files::exists(&gen_path) {
        let json = read_json(&gen_path)?;
        let obj = json.as_object().ok_or_else(|| anyhow!("{}: expected a JSON object", gen_path.display()))?;
        let f = Fields { obj, ctx: "" };
        cfg.num_assistant_tokens = match obj.get("num_assistant_tokens") {
            None | Some(Value::Null) => None,
            Some(_) => Some(f.positive("num_assistant_tokens", 1).with_context(|| format!("{}", gen_path.display()))?),
        };
    }
    Ok(cfg)
}

pub fn parse_assistant_config(json: &Value) -> Result<AssistantConfig> {
    let obj = json.as_object().ok_or_else(|| anyhow!("expected a JSON object at the top level"))?;
    let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (inner_default, hb_default) = match model_type {
        "gemma4_assistant" => ("gemma4_text", 1536),
        "gemma4_unified_assistant" => ("gemma4_unified_text", 3840),
        "gemma4" | "gemma4_unified" | "gemma4_text" | "gemma4_unified_text" => {
            bail!("field `model_type` is {model_type:?}: this is a target model, not an assistant drafter")
        }
        other => {
            bail!("field `model_type` is {other:?}; expected \"gemma4_assistant\" or \"gemma4_unified_assistant\"")
        }
    };
    let text = obj
        .get("text_config")
        .and_then(Value::as_object)
        .ok_or_else(|| anyhow!("field `text_config` is missing or not an object"))?;
    let inner = text.get("model_type").and_then(Value::as_str).unwrap_or(inner_default);
    if inner != inner_default {
        bail!("field `text_config.model_type` is {inner:?}, expected {inner_default:?} inside {model_type:?}");
    }
    let tf = Fields { obj: text, ctx: "text_config." };
    let layers = tf.positive("num_hidden_layers", 30)?;
    // Every drafter layer reads the target's K/V: sharing must be unset, 0 (meaning all) or all layers.
    let shared = tf.usize_or("num_kv_shared_layers", 0)?;
    if shared != 0 && shared != layers {
        bail!("field `text_config.num_kv_shared_layers` is {shared}; a drafter shares all {layers} layers");
    }
    if inner == "gemma4_text" {
        for name in ["hidden_size_per_layer_input", "vocab_size_per_layer_input"] {
            if tf.usize_or(name, 1)? != 0 {
                bail!("field `text_config.{name}` must be 0 in a drafter (no per-layer embeddings)");
            }
        }
        if tf.boolean("enable_moe_block", false)? || tf.boolean("use_double_wide_mlp", false)? {
            bail!("a drafter's text_config cannot enable MoE or the double-wide MLP");
        }
    }
    // Parse the geometry as an unshared model; the drafter has no K/V of its own.
    let mut unshared = text.clone();
    unshared.insert("num_kv_shared_layers".into(), Value::from(0));
    let text_cfg = parse_text_config(&unshared, inner, "text_config.")?;

    let f = Fields { obj, ctx: "" };
    let backbone_hidden_size = f.positive("backbone_hidden_size", hb_default)?;
    // pre_projection is [hidden, 2 x backbone]; post_projection [backbone, hidden].
    tensor_elements(
        &[("backbone_hidden_size", backbone_hidden_size), ("2", 2), ("text_config.hidden_size", text_cfg.hidden_size)],
        "",
    )?;
    if !f.boolean("tie_word_embeddings", true)? {
        bail!("field `tie_word_embeddings` is false; every Gemma 4 drafter ties its head to model.embed_tokens");
    }
    let head = if f.boolean("use_ordered_embeddings", false)? {
        let num_centroids = f.positive("num_centroids", 2048)?;
        let top_k = f.positive("centroid_intermediate_top_k", 32)?;
        if text_cfg.vocab_size % num_centroids != 0 {
            bail!("field `num_centroids` ({num_centroids}) does not divide the vocabulary ({})", text_cfg.vocab_size);
        }
        if top_k > num_centroids {
            bail!("field `centroid_intermediate_top_k` ({top_k}) exceeds `num_centroids` ({num_centroids})");
        }
        DraftHead::Centroid { num_centroids, top_k }
    } else {
        DraftHead::Tied
    };
    Ok(AssistantConfig { text: text_cfg, backbone_hidden_size, head, num_assistant_tokens: None })
}

/// Check that a drafter can run on a target (docs/drafter.md, "Pairing"): it reads the target's store-layer
/// K/V and hidden states, so their geometry, vocabulary and RoPE must agree. Errors name both sides.
pub fn validate_pair(target: &TextConfig, draft: &AssistantConfig) -> Result<()> {
    let d = &draft.text;
    if draft.backbone_hidden_size != target.hidden_size {
        bail!(
            "assistant backbone_hidden_size is {} but the target's hidden_size is {}: this drafter belongs to another model",
            draft.backbone_hidden_size,
            target.hidden_size
        );
    }
    if d.vocab_size != target.vocab_size {
        bail!("assistant vocabulary ({}) differs from the target's ({})", d.vocab_size, target.vocab_size);
    }
    // The drafter's sliding layers read the last W+1 keys of the target's sliding cache, which keeps the
    // target's window (plus what a rollback needs): a wider drafter window would read keys that are gone.
    if d.layers.iter().any(|l| l.kind == LayerType::Sliding) && d.sliding_window > target.sliding_window {
        bail!(
            "assistant sliding_window ({}) exceeds the target's ({}): its sliding layers would read keys the target does not keep",
            d.sliding_window,
            target.sliding_window
        );
    }
    for kind in [LayerType::Sliding, LayerType::Full] {
        let Some((dd, dkv)) = d.geometry(kind) else { continue };
        let store = target.store_layer(kind).ok_or_else(|| {
            anyhow!("the assistant has {} layers but the target has no {} store layer", kind.name(), kind.name())
        })?;
        let (td, tkv) = (target.layers[store].head_dim, target.layers[store].kv_heads);
        if (dd, dkv) != (td, tkv) {
            bail!(
                "assistant {} layers expect head_dim {dd} with {dkv} KV heads, but the target's store layer {store} has head_dim {td} with {tkv}",
                kind.name()
            );
        }
        if d.rope(kind) != target.rope(kind) {
            bail!("assistant RoPE parameters for {} differ from the target's", kind.name());
        }
    }
    Ok(())
}
