//! Quantizing a checkpoint at load (docs/quantization.md): which tensor gets which block format under
//! each recipe, and the quantization itself, tensor by tensor on all cores into memory we own.
//!
//! The recipes follow llama.cpp's `llama-quantize` mixtures so that a model quantized here matches a
//! llama.cpp file of the same name tensor for tensor, with one deliberate difference: the per-layer
//! embedding table stays at 8 bits (Q8_0) in every recipe, where llama.cpp gives it the output
//! tensor's type (Q6_K in Q4_K_M), since 4-bit per-layer embeddings are known to collapse E4B.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;

use crate::config::TextConfig;
use crate::kernels::{quant, MatRef, QType};
use crate::weights::{StoredDtype, Tensor, WeightStore};

/// A quantization mixture, named as `--quantize` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// Every matrix Q8_0.
    Q8_0,
    /// Matrices Q4_0, the (tied) output embedding Q6_K.
    Q4_0,
    /// Matrices Q4_K; V projections and FFN down projections of about a third of the layers Q6_K;
    /// the output embedding Q6_K.
    Q4KM,
}

impl Recipe {
    pub const NAMES: &'static str = "q8_0, q4_0, q4_k_m";

    pub fn parse(s: &str) -> Result<Recipe> {
        match s.trim().to_ascii_lowercase().as_str() {
            "q8_0" => Ok(Recipe::Q8_0),
            "q4_0" => Ok(Recipe::Q4_0),
            "q4_k_m" => Ok(Recipe::Q4KM),
            _ => bail!("--quantize {s:?}: not a recipe tandem knows ({})", Recipe::NAMES),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Recipe::Q8_0 => "q8_0",
            Recipe::Q4_0 => "q4_0",
            Recipe::Q4KM => "q4_k_m",
        }
    }

    fn default_type(self) -> QType {
        match self {
            Recipe::Q8_0 => QType::Q8_0,
            Recipe::Q4_0 => QType::Q4_0,
            Recipe::Q4KM => QType::Q4_K,
        }
    }

    /// The output (or tied input/output) embedding.
    fn output_type(self, cols: usize) -> QType {
        let wanted = self.default_type();
        if !cols.is_multiple_of(wanted.block_elems()) || wanted == QType::Q8_0 {
            QType::Q8_0
        } else {
            QType::Q6_K
        }
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to quantize at load: the target with `recipe`, and the drafter too when `assistant` is set
/// (`--quantize RECIPE [--quantize-assistant]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadQuant {
    pub recipe: Option<Recipe>,
    pub assistant: bool,
}

impl LoadQuant {
    pub fn new(recipe: Option<&str>, assistant: bool) -> Result<LoadQuant> {
        let recipe = recipe.map(Recipe::parse).transpose()?;
        if assistant && recipe.is_none() {
            bail!("--quantize-assistant needs --quantize RECIPE");
        }
        Ok(LoadQuant { recipe, assistant })
    }

    /// The recipe for the drafter, if it is quantized too.
    pub fn assistant_recipe(&self) -> Option<Recipe> {
        self.recipe.filter(|_| self.assistant)
    }
}

/// llama.cpp's choice of the layers that get more bits in its `_M` mixtures: the first and last eighth,
/// and every third layer in between.
fn more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
}

/// A 256-block format on a row that is not a whole number of super-blocks falls back to a 32-block
/// format of about the same size (as llama.cpp does); a row that is not a whole number of 32-blocks
/// stays unquantized (`None`).
fn fit(q: QType, cols: usize) -> Option<QType> {
    let q = if cols.is_multiple_of(q.block_elems()) {
        q
    } else {
        match q {
            QType::Q4_K => QType::Q5_0,
            QType::Q5_K => QType::Q5_1,
            QType::Q6_K => QType::Q8_0,
            other => other,
        }
    };
    cols.is_multiple_of(q.block_elems()).then_some(q)
}

/// Where a tensor sits in a decoder layer, from its name below the text prefix (`layers.N.…`).
enum Role {
    /// The (tied) output embedding: the vocabulary head.
    Output,
    /// The per-layer embedding table.
    PerLayerEmbed,
    /// A V projection, with its index among the model's V projections.
    V(usize),
    /// An FFN down projection (dense or experts) of layer `i`.
    Down(usize),
    /// Any other matrix read by a matmul.
    Matrix,
}

/// The plan for one model: full tensor name → format.
pub struct Plan {
    pub recipe: Recipe,
    pub tensors: Vec<(String, QType)>,
}

/// The plan for a Gemma 4 target: every matrix read by a matmul, with the recipe's type for its role.
/// Norms, scalars, the MoE router and the per-layer model projection (small, read once per token) stay
/// in their dtype.
pub fn target_plan(recipe: Recipe, cfg: &TextConfig, store: &WeightStore) -> Plan {
    let p = store.prefix().to_string();
    let n_layers = cfg.num_layers();
    let mut roles: Vec<(String, Role)> = Vec::new();
    roles.push((format!("{p}embed_tokens.weight"), if cfg.tie_word_embeddings { Role::Output } else { Role::Matrix }));
    if !cfg.tie_word_embeddings {
        roles.push(("lm_head.weight".to_string(), Role::Output));
    }
    if cfg.ple.is_some() {
        roles.push((format!("{p}embed_tokens_per_layer.weight"), Role::PerLayerEmbed));
    }
    let mut v_index = 0;
    for i in 0..n_layers {
        let l = format!("{p}layers.{i}.");
        for m in ["q_proj", "k_proj", "o_proj"] {
            roles.push((format!("{l}self_attn.{m}.weight"), Role::Matrix));
        }
        let v = format!("{l}self_attn.v_proj.weight");
        if store.get_full(&v).is_some() {
            roles.push((v, Role::V(v_index)));
            v_index += 1;
        }
        for m in ["mlp.gate_proj.weight", "mlp.up_proj.weight", "experts.gate_up_proj"] {
            roles.push((format!("{l}{m}"), Role::Matrix));
        }
        for m in ["mlp.down_proj.weight", "experts.down_proj"] {
            roles.push((format!("{l}{m}"), Role::Down(i)));
        }
        for m in ["per_layer_input_gate.weight", "per_layer_projection.weight"] {
            roles.push((format!("{l}{m}"), Role::Matrix));
        }
    }
    plan(recipe, store, roles, v_index, n_layers)
}

/// The plan for a drafter (`--quantize-assistant`): its projections and layers as a target's, its tied
/// head as an output embedding; the centroid scorer stays in its dtype (it picks which candidates the
/// head scores at all).
pub fn assistant_plan(recipe: Recipe, n_layers: usize, store: &WeightStore) -> Plan {
    let mut roles: Vec<(String, Role)> = vec![
        ("model.embed_tokens.weight".into(), Role::Output),
        ("pre_projection.weight".into(), Role::Matrix),
        ("post_projection.weight".into(), Role::Matrix),
    ];
    for i in 0..n_layers {
        let l = format!("model.layers.{i}.");
        for m in ["self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"] {
            roles.push((format!("{l}{m}"), Role::Matrix));
        }
        roles.push((format!("{l}mlp.down_proj.weight"), Role::Down(i)));
    }
    plan(recipe, store, roles, 0, n_layers)
}

fn plan(recipe: Recipe, store: &WeightStore, roles: Vec<(String, Role)>, n_v: usize, n_layers: usize) -> Plan {
    let mut tensors = Vec::new();
    for (name, role) in roles {
        let Some(t) = store.get_full(&name) else { continue };
        if t.shape.len() < 2 || !matches!(t.dtype, StoredDtype::Float(_)) {
            continue;
        }
        let cols = *t.shape.last().expect("2-D or more");
        let wanted = match role {
            Role::Output => recipe.output_type(cols),
            Role::PerLayerEmbed => QType::Q8_0,
            Role::V(i) if recipe == Recipe::Q4KM && more_bits(i, n_v) => QType::Q6_K,
            Role::Down(i) if recipe == Recipe::Q4KM && more_bits(i, n_layers) => QType::Q6_K,
            _ => recipe.default_type(),
        };
        if let Some(q) = fit(wanted, cols) {
            tensors.push((name, q));
        }
    }
    Plan { recipe, tensors }
}

/// What a quantization did, for the load message.
pub struct Summary {
    pub tensors: usize,
    pub bytes_before: usize,
    pub bytes_after: usize,
    pub seconds: f64,
    /// Tensors per format, in `QType::ALL` order.
    pub per_type: Vec<(QType, usize)>,
}

impl Summary {
    pub fn line(&self, what: &str, recipe: Recipe) -> String {
        let types: Vec<String> = self.per_type.iter().map(|(q, n)| format!("{n} {q}")).collect();
        format!(
            "quantized {what} to {recipe}: {} tensors ({}), {:.2} GB -> {:.2} GB in {:.1} s",
            self.tensors,
            types.join(", "),
            self.bytes_before as f64 / 1e9,
            self.bytes_after as f64 / 1e9,
            self.seconds
        )
    }
}

/// Rows quantized per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Quantize the plan's tensors in place in `store`, each into memory of its quantized size (the source
/// stays memory-mapped and is read once), on rayon's pool, with a progress bar on a terminal.
pub fn apply(store: &mut WeightStore, plan: &Plan) -> Result<Summary> {
    let t0 = Instant::now();
    let total: u64 = plan.tensors.iter().filter_map(|(n, _)| store.get_full(n)).map(|t| t.bytes().len() as u64).sum();
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("quantizing to {msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
            .map_err(|e| anyhow!("progress bar: {e}"))?
            .progress_chars("=> "),
    );
    bar.set_message(plan.recipe.name());
    let mut summary = Summary { tensors: 0, bytes_before: 0, bytes_after: 0, seconds: 0.0, per_type: Vec::new() };
    let mut counts = [0usize; QType::ALL.len()];
    for (name, q) in &plan.tensors {
        let Some(src) = store.get_full(name).cloned() else { continue };
        let quantized = quantize_tensor(&src, *q, &bar)?;
        summary.tensors += 1;
        summary.bytes_before += src.bytes().len();
        summary.bytes_after += quantized.bytes().len();
        counts[QType::ALL.iter().position(|t| t == q).expect("a known type")] += 1;
        store.insert(quantized);
        src.release_pages();
    }
    bar.finish_and_clear();
    summary.per_type = QType::ALL.into_iter().zip(counts).filter(|(_, n)| *n > 0).collect();
    summary.seconds = t0.elapsed().as_secs_f64();
    Ok(summary)
}

/// Repack the store's Q8_0, Q4_K and Q6_K matrices into 16-row strips (`QType::Q8_0x16`, `Q4_Kx16`,
/// `Q6_Kx16`) where this CPU's kernels read those faster (AVX-512 VNNI; docs/quantization.md, "Q8_0 in
/// 16-row strips", "Q4_K and Q6_K in 16-row strips"): all but the per-layer embedding table, which is
/// only read a row at a time, a centroid drafter's embedding (only gathered), and matrices whose rows
/// are not whole strips. A matrix in a file mapping (a GGUF file's) is copied and its pages released, so
/// resident memory stays the model's size (Q4_K strips are 148 bytes per 144: the sub-block scales
/// unpacked). Returns how many were packed.
pub fn pack_for_kernels(store: &mut WeightStore) -> usize {
    use crate::kernels::{q4kx16, q6kx16, q8x16};
    if !q8x16::pays() {
        return 0;
    }
    let mut names: Vec<String> = store.names().map(String::from).collect();
    names.sort();
    let centroids = store.get_full("masked_embedding.centroids.weight").is_some();
    let mut packed = 0;
    for name in names {
        let Some(t) = store.get_full(&name).cloned() else { continue };
        let StoredDtype::Quant { q, from } = t.dtype else { continue };
        let cols = *t.shape.last().unwrap_or(&0);
        let rows = t.numel().checked_div(cols).unwrap_or(0);
        // A drafter's centroid head reads its embedding only as gathered candidate rows, which a packed
        // table would have to unpack at every draft step.
        let gathered = name == "model.embed_tokens.weight" && centroids;
        if gathered || name.ends_with("embed_tokens_per_layer.weight") {
            continue;
        }
        let (to, data) = match q {
            QType::Q8_0 if q8x16::packable(rows, cols) => (QType::Q8_0x16, q8x16::pack(t.bytes(), rows, cols)),
            QType::Q4_K if q4kx16::packable(rows, cols) => (QType::Q4_Kx16, q4kx16::pack(t.bytes(), rows, cols)),
            QType::Q6_K if q6kx16::packable(rows, cols) => (QType::Q6_Kx16, q6kx16::pack(t.bytes(), rows, cols)),
            _ => continue,
        };
        store.insert(Tensor::owned_quant(&name, to, from, t.shape.clone(), data));
        t.release_pages();
        packed += 1;
    }
    packed
}

/// One float tensor (`[.., cols]`, all leading dimensions as rows) quantized to `q`.
pub fn quantize_tensor(src: &Tensor, q: QType, bar: &indicatif::ProgressBar) -> Result<Tensor> {
    let from = src.float_dtype()?;
    let cols = *src.shape.last().ok_or_else(|| anyhow!("tensor `{}` is a scalar", src.name))?;
    let row_bytes =
        q.row_bytes(cols).ok_or_else(|| anyhow!("tensor `{}`: rows of {cols} are not whole {q} blocks", src.name))?;
    let rows = src.numel() / cols.max(1);
    let w = MatRef::new(from, rows, cols, src.bytes());
    let mut out = vec![0u8; rows * row_bytes];
    let src_row_bytes = (cols * from.size()) as u64;
    out.par_chunks_mut(row_bytes * ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
        let mut x = vec![0f32; cols];
        for (i, o) in chunk.chunks_exact_mut(row_bytes).enumerate() {
            w.row_f32(c * ROWS_PER_TASK + i, &mut x);
            quant::quantize_row(q, &x, o);
        }
        bar.inc(src_row_bytes * (chunk.len() / row_bytes) as u64);
    });
    Ok(Tensor::owned_quant(&src.name, q, from, src.shape.clone(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_matches_llama_cpp_pattern() {
        // 10 layers: n/8 = 1, 7n/8 = 8 -> layers 0, 8, 9 and (i - 1) % 3 == 2 -> 3, 6.
        let picked: Vec<usize> = (0..10).filter(|&i| more_bits(i, 10)).collect();
        assert_eq!(picked, vec![0, 3, 6, 8, 9]);
        // 35 layers (E2B): n/8 = 4, 7n/8 = 30.
        let picked: Vec<usize> = (0..35).filter(|&i| more_bits(i, 35)).collect();
        assert_eq!(picked, vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34]);
    }

    #[test]
    fn fallbacks() {
        assert_eq!(fit(QType::Q4_K, 384), Some(QType::Q5_0));
        assert_eq!(fit(QType::Q6_K, 384), Some(QType::Q8_0));
        assert_eq!(fit(QType::Q5_K, 704), Some(QType::Q5_1));
        assert_eq!(fit(QType::Q4_K, 1536), Some(QType::Q4_K));
        assert_eq!(fit(QType::Q8_0, 40), None);
        assert_eq!(Recipe::Q4KM.output_type(1536), QType::Q6_K);
        assert_eq!(Recipe::Q4KM.output_type(384), QType::Q8_0);
        assert_eq!(Recipe::Q8_0.output_type(1536), QType::Q8_0);
        assert_eq!(Recipe::Q4_0.output_type(1536), QType::Q6_K);
    }

    /// Packing at load: every Q8_0 matrix of whole strips but the per-layer embedding table, where the
    /// kernels pay for it; the values read back are the plain matrix's.
    #[test]
    fn packs_q8_0_and_k_quant_matrices_for_the_kernels() {
        let bar = indicatif::ProgressBar::hidden();
        let float = |name: &str, rows: usize| {
            let data: Vec<u8> = (0..rows * 64).flat_map(|i| ((i % 97) as f32 / 50.0 - 1.0).to_le_bytes()).collect();
            Tensor::owned(name, crate::kernels::DType::F32, vec![rows, 64], data)
        };
        let float4 = |name: &str, rows: usize| {
            let data: Vec<u8> = (0..rows * 256).flat_map(|i| ((i % 89) as f32 / 40.0 - 1.0).to_le_bytes()).collect();
            Tensor::owned(name, crate::kernels::DType::F32, vec![rows, 256], data)
        };
        let q = |t: Tensor, qt| quantize_tensor(&t, qt, &bar).unwrap();
        let mut store = WeightStore::from_tensors(vec![
            q(float("model.layers.0.mlp.up_proj.weight", 48), QType::Q8_0),
            q(float("model.embed_tokens_per_layer.weight", 32), QType::Q8_0),
            q(float("model.layers.0.self_attn.k_proj.weight", 40), QType::Q8_0),
            q(float("model.layers.0.mlp.down_proj.weight", 32), QType::Q4_0),
            q(float4("model.layers.0.mlp.gate_proj.weight", 32), QType::Q4_K),
            q(float4("model.layers.0.self_attn.v_proj.weight", 24), QType::Q4_K),
            q(float4("model.layers.1.mlp.down_proj.weight", 48), QType::Q6_K),
        ]);
        let plain = store.get_full("model.layers.0.mlp.up_proj.weight").unwrap().clone();
        let pays = crate::kernels::q8x16::pays();
        let plain4 = store.get_full("model.layers.0.mlp.gate_proj.weight").unwrap().clone();
        assert_eq!(pack_for_kernels(&mut store), 3 * pays as usize);
        let qtype = |name: &str| match store.get_full(name).unwrap().dtype {
            StoredDtype::Quant { q, .. } => q,
            _ => unreachable!(),
        };
        let up = if pays { QType::Q8_0x16 } else { QType::Q8_0 };
        assert_eq!(qtype("model.layers.0.mlp.up_proj.weight"), up);
        assert_eq!(qtype("model.embed_tokens_per_layer.weight"), QType::Q8_0);
        assert_eq!(qtype("model.layers.0.self_attn.k_proj.weight"), QType::Q8_0, "40 rows: not whole strips");
        assert_eq!(qtype("model.layers.0.mlp.down_proj.weight"), QType::Q4_0);
        let gate = if pays { QType::Q4_Kx16 } else { QType::Q4_K };
        assert_eq!(qtype("model.layers.0.mlp.gate_proj.weight"), gate);
        assert_eq!(qtype("model.layers.0.self_attn.v_proj.weight"), QType::Q4_K, "24 rows: not whole strips");
        let down = if pays { QType::Q6_Kx16 } else { QType::Q6_K };
        assert_eq!(qtype("model.layers.1.mlp.down_proj.weight"), down);
        // A centroid drafter's embedding stays plain; a tied drafter's is packed.
        for centroids in [true, false] {
            let mut tensors = vec![q(float("model.embed_tokens.weight", 32), QType::Q8_0)];
            if centroids {
                tensors.push(float("masked_embedding.centroids.weight", 16));
            }
            let mut drafter = WeightStore::from_tensors(tensors);
            pack_for_kernels(&mut drafter);
            let want = if pays && !centroids { QType::Q8_0x16 } else { QType::Q8_0 };
            let got = drafter.get_full("model.embed_tokens.weight").unwrap().dtype;
            assert!(matches!(got, StoredDtype::Quant { q, .. } if q == want), "centroids {centroids}");
        }
        let packed = store.get_full("model.layers.0.mlp.up_proj.weight").unwrap();
        let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
        for r in 0..48 {
            packed.mat().row_f32(r, &mut a);
            plain.mat().row_f32(r, &mut b);
            assert_eq!(a, b, "row {r}");
        }
        let packed4 = store.get_full("model.layers.0.mlp.gate_proj.weight").unwrap();
        let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
        for r in 0..32 {
            packed4.mat().row_f32(r, &mut a);
            plain4.mat().row_f32(r, &mut b);
            assert_eq!(a, b, "Q4_K row {r}");
        }
    }

    #[test]
    fn recipe_names() {
        for r in [Recipe::Q8_0, Recipe::Q4_0, Recipe::Q4KM] {
            assert_eq!(Recipe::parse(r.name()).unwrap(), r);
        }
        assert_eq!(Recipe::parse("Q4_K_M").unwrap(), Recipe::Q4KM);
        let e = Recipe::parse("q3").unwrap_err().to_string();
        assert!(e.contains("q8_0, q4_0, q4_k_m"), "{e}");
    }
}
