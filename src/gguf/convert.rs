//! `tandem quantize`: a model (a checkpoint directory or a GGUF file; a target or an assistant) written as
//! a GGUF file, quantized with a recipe on the way (docs/gguf.md, "Writing").

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::file::{GgufModel, MetaValue};
use super::{export, gemma4, vocab, write};
use crate::config::{AssistantConfig, KvMode, LayerType, TextConfig};
use crate::quantize::Recipe;
use crate::weights::WeightStore;

/// llama.cpp's `general.file_type` for what the file holds.
fn file_type(recipe: Option<Recipe>, float: crate::kernels::DType) -> u32 {
    use crate::kernels::DType;
    match (recipe, float) {
        (Some(Recipe::Q8_0), _) => 7,
        (Some(Recipe::Q4_0), _) => 2,
        (Some(Recipe::Q4KM), _) => 15,
        (None, DType::F32) => 0,
        (None, DType::F16) => 1,
        (None, DType::BF16) => 32,
    }
}

/// Why llama.cpp (which does not read which layer a K/V-sharing layer takes its keys from) would compute
/// this target wrongly: it takes the layer `first_shared − 2` for a sliding reuse layer and
/// `first_shared − 1` for a full one.
pub fn llama_cpp_misreads(c: &TextConfig) -> Option<String> {
    let first = c.layers.iter().position(|l| l.kv_mode == KvMode::Reuse)?;
    for (i, l) in c.layers.iter().enumerate().skip(first) {
        let theirs = first.checked_sub(if l.kind == LayerType::Sliding { 2 } else { 1 });
        if theirs != Some(l.kv_source) {
            return Some(format!(
                "llama.cpp will compute this model wrongly: its layer {i} ({}) reuses the K/V of layer {}, but llama.cpp assumes layer {} (it needs the last two layers before the shared ones to be sliding, then full)",
                l.kind.name(),
                l.kv_source,
                theirs.map_or("-".into(), |t| t.to_string())
            ));
        }
    }
    None
}

/// What was written.
pub struct Written {
    pub tensors: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub warnings: Vec<String>,
}

/// What `convert` writes: a target or an assistant, by its configuration.
enum Config {
    Target(TextConfig),
    Assistant(AssistantConfig),
}

/// The tokenizer as GGUF metadata keys.
type TokenizerMeta = Vec<(String, MetaValue)>;

/// A checkpoint directory or a GGUF file opened for writing: its configuration, its tensors (kept as
/// their float type when `recipe` will quantize them) and its tokenizer as GGUF metadata.
fn open(model: &Path, recipe: Option<Recipe>) -> Result<(Config, WeightStore, TokenizerMeta)> {
    if super::is_gguf(model) {
        let m = GgufModel::open(model, recipe.is_some())?;
        if let Some(r) = recipe {
            gemma4::refuse_requantize(&m, r)?;
        }
        let tok =
            m.meta().iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())).collect();
        return Ok(if gemma4::is_assistant(&m)? {
            (Config::Assistant(gemma4::assistant_config(&m)?), gemma4::assistant_store(&m)?, tok)
        } else {
            (Config::Target(gemma4::target_config(&m)?), gemma4::target_store(&m)?, tok)
        });
    }
    crate::files::require_dir(model, "model")?;
    let json = crate::config::read_json(&model.join("config.json"))?;
    let is_assistant = json.get("model_type").and_then(|v| v.as_str()).is_some_and(|t| t.contains("assistant"));
    let store = WeightStore::open_with(model, recipe.is_some())?;
    let tok = vocab::tokenizer_meta(model)?.unwrap_or_default();
    let config = if is_assistant {
        Config::Assistant(crate::config::load_assistant_config(model)?)
    } else {
        Config::Target(crate::config::load_model_config(model)?.text)
    };
    Ok((config, store, tok))
}

/// Write `model` to `out` as GGUF, quantized with `recipe` when given; `say` gets the quantization summary.
pub fn convert(model: &Path, out: &Path, recipe: Option<Recipe>, mut say: impl FnMut(String)) -> Result<Written> {
    let t0 = Instant::now();
    if out.exists() && std::fs::canonicalize(out).ok() == std::fs::canonicalize(model).ok() {
        bail!("--out {} is the model itself; write to another file", out.display());
    }
    let mut warnings = Vec::new();
    let name = model.file_stem().and_then(|s| s.to_str()).unwrap_or("model").to_string();
    let (config, mut store, tokenizer) = open(model, recipe)?;
    let (mut ex, float) = match &config {
        Config::Assistant(cfg) => {
            if let Some(r) = recipe {
                say(crate::model::assistant::quantize_assistant(&mut store, cfg, r)?);
            }
            let float = store.get_full("model.embed_tokens.weight").map(|t| t.compute_dtype()).transpose()?;
            (export::assistant(cfg, &store, &name)?, float)
        }
        Config::Target(cfg) => {
            if let Some(r) = recipe {
                say(crate::model::target::quantize_target(&mut store, cfg, r)?);
            }
            warnings.extend(llama_cpp_misreads(cfg));
            let float = store.get("embed_tokens.weight").map(|t| t.compute_dtype()).transpose()?;
            (export::target(cfg, &store, &name)?, float)
        }
    };
    // The tokenizer's own keys replace the ones the configuration implies (its EOS id, say).
    ex.meta.retain(|(k, _)| !tokenizer.iter().any(|(t, _)| t == k));
    ex.meta.extend(tokenizer);
    let float = float.unwrap_or(crate::kernels::DType::F32);
    ex.meta.push(("general.file_type".into(), MetaValue::U32(file_type(recipe, float))));
    ex.meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    let tensors = ex.out_tensors()?;
    let tmp = out.with_extension("gguf.partial");
    let file = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    write::write(std::io::BufWriter::with_capacity(1 << 20, file), &ex.meta, &tensors)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("cannot move {} to {}", tmp.display(), out.display()))?;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(Written { tensors: tensors.len(), bytes, seconds: t0.elapsed().as_secs_f64(), warnings })
}
