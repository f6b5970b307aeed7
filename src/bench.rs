//! `tandem bench`: speed of a checkpoint, or of a random-weight model at real Gemma 4 dimensions built
//! in memory, measured through the engine (see docs/engine.md) and at the kernels' level.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use serde::Serialize;
use serde_json::json;

use crate::config::{
    parse_assistant_config, parse_model_config, AssistantConfig, DraftHead, KvMode, LayerType, TextConfig,
};
use crate::kernels::{self, DType};
use crate::model::assistant::Assistant;
use crate::model::{Keep, TargetModel};
use crate::weights::{Tensor, WeightStore};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    E2b,
    E4b,
    /// 26B-A4B: the mixture-of-experts size (128 experts, top 8), where verify rows touch more experts.
    A26b,
}

impl Preset {
    pub fn parse(s: &str) -> Result<Preset> {
        match s.to_ascii_lowercase().as_str() {
            "e2b" => Ok(Preset::E2b),
            "e4b" => Ok(Preset::E4b),
            "26b-a4b" | "a26b" => Ok(Preset::A26b),
            other => bail!("--preset {other:?}: expected e2b, e4b or 26b-a4b"),
        }
    }

    /// The real checkpoint's text config (docs/model.md, "Published sizes"), cut to `layers` layers. The
    /// share of KV-sharing layers follows the real model (E2B 20/35, E4B 18/42), kept valid: a store layer
    /// of each type must precede the shared ones.
    pub fn config(self, layers: usize) -> Result<TextConfig> {
        let (h, inter, kv, period, shared_num, shared_den, double) = match self {
            Preset::E2b => (1536, 6144, 1, 5, 20, 35, true),
            Preset::E4b => (2560, 10240, 2, 6, 18, 42, false),
            Preset::A26b => (2816, 2112, 8, 6, 0, 30, false),
        };
        if layers < period {
            bail!("--layers must be at least {period} for this preset (one full-attention layer)");
        }
        if layers > shared_den {
            bail!("--layers must be at most {shared_den} for this preset (the real model's depth)");
        }
        let types: Vec<&str> =
            (0..layers).map(|i| if (i + 1) % period == 0 { "full_attention" } else { "sliding_attention" }).collect();
        // Largest share <= the real ratio that leaves a full layer before the first shared one.
        let mut shared = layers * shared_num / shared_den;
        while shared > 0 && !types[..layers - shared].contains(&"full_attention") {
            shared -= 1;
        }
        let mut j = json!({
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": kv, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "layer_types": types,
            "num_kv_shared_layers": shared, "use_double_wide_mlp": double, "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 262144, "final_logit_softcapping": 30.0,
            "max_position_embeddings": 131072,
        });
        if self == Preset::A26b {
            let o = j.as_object_mut().expect("object");
            for (k, v) in [
                ("num_attention_heads", json!(16)),
                ("num_global_key_value_heads", json!(2)),
                ("attention_k_eq_v", json!(true)),
                ("sliding_window", json!(1024)),
                ("hidden_size_per_layer_input", json!(0)),
                ("enable_moe_block", json!(true)),
                ("num_experts", json!(128)),
                ("top_k_experts", json!(8)),
                ("moe_intermediate_size", json!(704)),
            ] {
                o.insert(k.into(), v);
            }
        }
        Ok(parse_model_config(&j)?.text)
    }

    /// The assistant published for this size (docs/drafter.md, "Published drafters"): 4 layers
    /// [S,S,S,F], centroid head (26B-A4B: tied head).
    pub fn assistant_config(self, target: &TextConfig) -> Result<AssistantConfig> {
        let (s, f) = (target.geometry(LayerType::Sliding), target.geometry(LayerType::Full));
        let (Some((ds, kvs)), Some((df, kvf))) = (s, f) else { bail!("the target needs both layer types") };
        // E2B/E4B: a small drafter with the centroid head; 26B-A4B: a wider one with the tied head.
        let (hidden, inter, heads, centroids) = match self {
            Preset::E2b | Preset::E4b => (256, 2048, 4, true),
            Preset::A26b => (1024, 8192, 16, false),
        };
        let j = json!({
            "model_type": "gemma4_assistant", "backbone_hidden_size": target.hidden_size,
            "use_ordered_embeddings": centroids, "num_centroids": 2048, "centroid_intermediate_top_k": 32,
            "text_config": {
                "model_type": "gemma4_text", "vocab_size": target.vocab_size, "hidden_size": hidden,
                "intermediate_size": inter, "num_hidden_layers": 4, "num_attention_heads": heads,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "num_key_value_heads": kvs, "head_dim": ds, "global_head_dim": df,
                "num_global_key_value_heads": kvf, "attention_k_eq_v": kvs != kvf,
                "sliding_window": target.sliding_window, "num_kv_shared_layers": 4,
                "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
            }
        });
        parse_assistant_config(&j)
    }
}

/// A drafter of `cfg` with random bf16 weights and a random token ordering.
pub fn random_assistant(cfg: &AssistantConfig, seed: u64) -> Result<Assistant> {
    random_assistant_quantized(cfg, seed, None, |_| {})
}

/// [`random_assistant`], its matrices then quantized with `recipe` (`log` gets the summary).
pub fn random_assistant_quantized(
    cfg: &AssistantConfig,
    seed: u64,
    recipe: Option<crate::quantize::Recipe>,
    log: impl Fn(String),
) -> Result<Assistant> {
    let t = &cfg.text;
    let (v, hd, hb) = (t.vocab_size, t.hidden_size, cfg.backbone_hidden_size);
    let mut tensors = vec![
        random_tensor("pre_projection.weight", vec![hd, 2 * hb], 0.02, 0.0, seed),
        random_tensor("post_projection.weight", vec![hb, hd], 0.02, 0.0, seed + 1),
        random_tensor("model.embed_tokens.weight", vec![v, hd], 0.05, 0.0, seed + 2),
        random_tensor("model.norm.weight", vec![hd], 0.1, 1.0, seed + 3),
    ];
    for (i, lc) in t.layers.iter().enumerate() {
        let p = format!("model.layers.{i}.");
        let (d, s) = (lc.head_dim, seed + 10 * (i as u64 + 1));
        tensors.push(random_tensor(&format!("{p}self_attn.q_proj.weight"), vec![t.num_heads * d, hd], 0.02, 0.0, s));
        tensors.push(random_tensor(
            &format!("{p}self_attn.o_proj.weight"),
            vec![hd, t.num_heads * d],
            0.02,
            0.0,
            s + 1,
        ));
        tensors.push(random_tensor(&format!("{p}self_attn.q_norm.weight"), vec![d], 0.1, 1.0, s + 2));
        tensors.push(random_tensor(
            &format!("{p}mlp.gate_proj.weight"),
            vec![lc.intermediate_size, hd],
            0.02,
            0.0,
            s + 3,
        ));
        tensors.push(random_tensor(
            &format!("{p}mlp.up_proj.weight"),
            vec![lc.intermediate_size, hd],
            0.02,
            0.0,
            s + 4,
        ));
        tensors.push(random_tensor(
            &format!("{p}mlp.down_proj.weight"),
            vec![hd, lc.intermediate_size],
            0.02,
            0.0,
            s + 5,
        ));
        for n in
            ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        {
            tensors.push(random_tensor(&format!("{p}{n}.weight"), vec![hd], 0.1, 1.0, s + 6));
        }
    }
    if let DraftHead::Centroid { num_centroids, .. } = cfg.head {
        tensors.push(random_tensor("masked_embedding.centroids.weight", vec![num_centroids, hd], 0.05, 0.0, seed + 4));
        // A fixed stride permutation of the vocabulary (any permutation will do for timing).
        let ordering: Vec<i64> = (0..v as i64).map(|i| (i * 7919) % v as i64).collect();
        tensors.push(Tensor::owned_i64("masked_embedding.token_ordering", &ordering));
    }
    let mut store = WeightStore::from_tensors(tensors);
    if let Some(r) = recipe {
        log(crate::model::assistant::quantize_assistant(&mut store, cfg, r)?);
        crate::quantize::pack_for_kernels(&mut store);
    }
    Assistant::from_store(cfg.clone(), &store)
}

/// A model of `cfg` with random bf16 weights (small uniform values, norms near 1).
pub fn random_model(cfg: &TextConfig, seed: u64) -> Result<TargetModel> {
    random_model_quantized(cfg, seed, None, |_| {})
}

/// [`random_model`], its matrices then quantized with `recipe` (`log` gets the summary).
pub fn random_model_quantized(
    cfg: &TextConfig,
    seed: u64,
    recipe: Option<crate::quantize::Recipe>,
    log: impl Fn(String),
) -> Result<TargetModel> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    // What to build (name, shape, scale, offset, seed): sized first, so that a model the machine cannot
    // hold is an error rather than the out-of-memory killer.
    let mut specs: Vec<(String, Vec<usize>, f32, f32, u64)> = Vec::new();
    let mut seed = seed;
    let mut mat = |name: String, shape: Vec<usize>, scale: f32| {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        specs.push((name, shape, scale, 0.0, seed));
    };
    let norm = |name: String, n: usize, s: u64| (name, vec![n], 0.1, 1.0, s);
    mat("embed_tokens.weight".into(), vec![v, h], 0.05);
    let mut norms = vec![norm("norm.weight".into(), h, 1)];
    if let Some(p) = cfg.ple {
        let l = cfg.num_layers();
        mat("embed_tokens_per_layer.weight".into(), vec![p.vocab_size, l * p.dim], 0.05);
        mat("per_layer_model_projection.weight".into(), vec![l * p.dim, h], 0.02);
        norms.push(norm("per_layer_projection_norm.weight".into(), p.dim, 2));
    }
    for (i, lc) in cfg.layers.iter().enumerate() {
        let p = format!("layers.{i}.");
        let (d, kv, hq, inter) = (lc.head_dim, lc.kv_heads, cfg.num_heads, lc.intermediate_size);
        mat(format!("{p}self_attn.q_proj.weight"), vec![hq * d, h], 0.02);
        mat(format!("{p}self_attn.o_proj.weight"), vec![h, hq * d], 0.02);
        norms.push(norm(format!("{p}self_attn.q_norm.weight"), d, 3));
        if lc.kv_mode != KvMode::Reuse {
            mat(format!("{p}self_attn.k_proj.weight"), vec![kv * d, h], 0.02);
            if !lc.k_eq_v {
                mat(format!("{p}self_attn.v_proj.weight"), vec![kv * d, h], 0.02);
            }
            norms.push(norm(format!("{p}self_attn.k_norm.weight"), d, 4));
        }
        mat(format!("{p}mlp.gate_proj.weight"), vec![inter, h], 0.02);
        mat(format!("{p}mlp.up_proj.weight"), vec![inter, h], 0.02);
        mat(format!("{p}mlp.down_proj.weight"), vec![h, inter], 0.02);
        for n in
            ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        {
            norms.push(norm(format!("{p}{n}.weight"), h, 5 + i as u64));
        }
        if let Some(pc) = cfg.ple {
            mat(format!("{p}per_layer_input_gate.weight"), vec![pc.dim, h], 0.02);
            mat(format!("{p}per_layer_projection.weight"), vec![h, pc.dim], 0.02);
            norms.push(norm(format!("{p}post_per_layer_input_norm.weight"), h, 6));
        }
        if let Some(m) = cfg.moe {
            let (e, ie) = (m.num_experts, m.intermediate_size);
            mat(format!("{p}router.proj.weight"), vec![e, h], 0.02);
            mat(format!("{p}experts.gate_up_proj"), vec![e, 2 * ie, h], 0.02);
            mat(format!("{p}experts.down_proj"), vec![e, h, ie], 0.02);
            norms.push(norm(format!("{p}router.scale"), h, 7));
            norms.push(norm(format!("{p}router.per_expert_scale"), e, 8));
            for n in ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"] {
                norms.push(norm(format!("{p}{n}.weight"), h, 9));
            }
        }
    }
    specs.extend(norms);
    let bytes: usize = specs.iter().map(|s| 2 * s.1.iter().product::<usize>()).sum();
    if let Some(avail) = crate::system::available_memory_bytes() {
        if bytes as u64 > avail / 10 * 9 {
            bail!(
                "a random model of {} layers needs {:.1} GB of memory but {:.1} GB are available: use fewer --layers",
                cfg.num_layers(),
                bytes as f64 / 1e9,
                avail as f64 / 1e9
            );
        }
    }
    let tensors = specs
        .into_iter()
        .map(|(name, shape, scale, offset, seed)| random_tensor(&name, shape, scale, offset, seed))
        .collect();
    let mut store = WeightStore::from_tensors(tensors);
    if let Some(r) = recipe {
        log(crate::model::target::quantize_target(&mut store, cfg, r)?);
        crate::quantize::pack_for_kernels(&mut store);
    }
    TargetModel::from_store(cfg.clone(), &store)
}

/// bf16 tensor of `offset + scale·u`, `u` uniform in [-1, 1), from a fast counter-based hash.
fn random_tensor(name: &str, shape: Vec<usize>, scale: f32, offset: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut data = vec![0u8; n * 2];
    data.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        let mut state = seed ^ (c as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        for pair in chunk.chunks_exact_mut(2) {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let b = half::bf16::from_f32(offset + scale * u).to_bits().to_le_bytes();
            pair.copy_from_slice(&b);
        }
    });
    Tensor::owned(name, DType::BF16, shape, data)
}

pub struct BenchOptions {
    pub prefill_tokens: usize,
    pub decode_steps: usize,
    pub max_rows: usize,
    pub draft_steps: usize,
    /// Draft length for the speculative run through the engine (with an assistant).
    pub draft: crate::decode::draft_policy::DraftLength,
    pub threads: usize,
}

#[derive(Serialize)]
pub struct BenchReport {
    /// What was measured: a checkpoint's directory or the random preset's description.
    pub model: String,
    pub threads: usize,
    pub isa: String,
    pub weight_bytes_per_token: usize,
    /// Prompt tokens per second: time from submitting a request to the engine to its first token.
    pub prefill_tokens_per_s: f64,
    /// Plain decoding through the engine, one request alone.
    pub decode_tokens_per_s: f64,
    pub decode_ms_per_token: f64,
    pub effective_weight_gb_per_s: f64,
    pub machine_read_gb_per_s: f64,
    /// `(rows, ms, ratio to one row)` for a multi-row forward.
    pub rows: Vec<(usize, f64, f64)>,
    /// One draft step of the assistant, and its cost relative to a decode step (none without one).
    pub draft_head: Option<String>,
    pub draft_step_ms: f64,
    pub draft_step_ratio: f64,
    /// Decoding with drafting through the engine, the same request as the plain run.
    pub speculative: Option<SpeculativeRun>,
    /// Projected decode speed-up over plain decoding, `[k-1][accepted]`, from the measured costs:
    /// `(accepted + 1) · t_step / (k · t_draft + t_verify(k + 1))`.
    pub projected_speedup: Vec<Vec<f64>>,
}

#[derive(Serialize)]
pub struct SpeculativeRun {
    pub draft_tokens: String,
    pub decode_tokens_per_s: f64,
    /// Against the plain run.
    pub speedup: f64,
    pub mean_accepted_per_round: f64,
    pub acceptance_rate: f64,
}

impl BenchReport {
    pub fn table(&self) -> String {
        let mut s = String::new();
        s += &format!(
            "model: {}, {:.2} GB of weights read per token; {} threads, {}\n",
            self.model,
            self.weight_bytes_per_token as f64 / 1e9,
            self.threads,
            self.isa
        );
        s += &format!("prefill: {:.1} tok/s\n", self.prefill_tokens_per_s);
        s += &format!("decode:  {:.2} tok/s ({:.1} ms/token)\n", self.decode_tokens_per_s, self.decode_ms_per_token);
        s += &format!(
            "weights: {:.1} GB/s effective, machine read bandwidth {:.1} GB/s ({:.0}%)\n",
            self.effective_weight_gb_per_s,
            self.machine_read_gb_per_s,
            100.0 * self.effective_weight_gb_per_s / self.machine_read_gb_per_s
        );
        s += "rows  ms/forward  vs 1 row\n";
        for (r, ms, ratio) in &self.rows {
            s += &format!("{r:>4}  {ms:>10.2}  {ratio:>7.2}x\n");
        }
        let Some(head) = &self.draft_head else { return s };
        s += &format!(
            "draft step ({head} head): {:.2} ms = {:.1}% of a decode step\n",
            self.draft_step_ms,
            100.0 * self.draft_step_ratio
        );
        if let Some(sp) = &self.speculative {
            s += &format!(
                "decode with drafting ({}): {:.2} tok/s = {:.2}x plain; {:.2} accepted drafts per round ({:.0}%)\n",
                sp.draft_tokens,
                sp.decode_tokens_per_s,
                sp.speedup,
                sp.mean_accepted_per_round,
                100.0 * sp.acceptance_rate
            );
        }
        s += "projected speed-up by draft tokens k (rows) and mean accepted drafts per round (columns)\n   k";
        for a in 0..self.projected_speedup.len().max(1) + 1 {
            s += &format!("  {a:>5}");
        }
        s += "\n";
        for (k, row) in self.projected_speedup.iter().enumerate() {
            s += &format!("{:>4}", k + 1);
            for v in row {
                s += &format!("  {v:>4.2}x");
            }
            s += "\n";
        }
        s
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// The random model of a preset and its random drafter, as `Models`, with a description.
pub fn random_models(
    preset: Preset,
    layers: usize,
    quant: crate::quantize::LoadQuant,
    log: impl Fn(String),
) -> Result<(crate::engine::Models, String)> {
    let cfg = preset.config(layers)?;
    let target = random_model_quantized(&cfg, 7, quant.recipe, &log)?;
    let assistant = random_assistant_quantized(&preset.assistant_config(&cfg)?, 99, quant.assistant_recipe(), &log)?;
    let quantized = match (quant.recipe, quant.assistant) {
        (Some(r), true) => format!(", both quantized {r}"),
        (Some(r), false) => format!(", target quantized {r}"),
        (None, _) => String::new(),
    };
    let name = format!("random {preset:?} dims, {layers} layers, with a random drafter (nothing accepted){quantized}");
    Ok((crate::engine::Models { target, assistant: Some(assistant), tokenizer: None, template: None }, name))
}

/// Timings of one request run alone through the engine's scheduler, as `tandem generate` runs it.
struct EngineRun {
    /// Submission to the first token.
    first_token_s: f64,
    /// Seconds per token after the first (the first decode step, which warms caches, left out).
    per_token_s: f64,
    /// From the first token to the last, and the tokens generated in that time.
    decode_s: f64,
    decode_tokens: usize,
    tokens: Vec<u32>,
    spec: Option<crate::decode::speculative::SpecStats>,
    /// The draft policy handed back (with what `auto` learned).
    policy: Option<crate::decode::draft_policy::DraftPolicy>,
}

fn engine_run(
    models: &crate::engine::Models,
    prompt: &[u32],
    new_tokens: usize,
    draft: Option<crate::decode::draft_policy::DraftPolicy>,
) -> Result<EngineRun> {
    engine_run_on(models, &mut bench_scheduler(models), prompt, new_tokens, draft)
}

/// A scheduler that runs one request at a time and keeps no finished caches (no prefix reuse between
/// the benchmark's requests).
fn bench_scheduler(models: &crate::engine::Models) -> crate::engine::Scheduler<'_> {
    use crate::engine::{Limits, Scheduler};
    Scheduler::new(models, Limits { max_active: 1, pool: 0, ..Limits::default() })
}

/// [`engine_run`] on the scheduler `s` (idle, over `models`), which keeps what it measured for the
/// next request.
fn engine_run_on(
    models: &crate::engine::Models,
    s: &mut crate::engine::Scheduler<'_>,
    prompt: &[u32],
    new_tokens: usize,
    draft: Option<crate::decode::draft_policy::DraftPolicy>,
) -> Result<EngineRun> {
    use crate::engine::{Event, Prompt, Request};
    let opts = crate::decode::generate::GenerateOptions {
        max_new_tokens: new_tokens,
        ignore_eos: true,
        sampling: crate::decode::sampling::SamplingParams::default(),
        top_logprobs: None,
        context_limit: models.target.cfg.max_position_embeddings,
    };
    let t0 = Instant::now();
    let h = s.submit(Request {
        prompt: Prompt::Ids(prompt.to_vec()),
        opts,
        stop: Vec::new(),
        show_thinking: false,
        draft,
        trace: false,
    })?;
    // Arrival time and count of each event's tokens.
    let mut arrivals: Vec<(f64, usize)> = Vec::new();
    let mut tokens = Vec::new();
    loop {
        s.step();
        let now = t0.elapsed().as_secs_f64();
        while let Some(e) = h.try_recv() {
            match e {
                Event::Tokens { ids, .. } => {
                    arrivals.push((now, ids.len()));
                    tokens.extend(ids);
                }
                Event::Done(o) => {
                    let first = arrivals.first().map_or(now, |a| a.0);
                    let last = arrivals.last().map_or(now, |a| a.0);
                    let after_first = tokens.len().saturating_sub(arrivals.first().map_or(0, |a| a.1));
                    // Per token: from the second event on, so that the first decode step is left out.
                    let (t1, skip) = arrivals.get(1).map_or((first, 0), |a| (a.0, arrivals[0].1 + a.1));
                    let n = tokens.len().saturating_sub(skip);
                    return Ok(EngineRun {
                        first_token_s: first,
                        per_token_s: if n > 0 { (last - t1) / n as f64 } else { f64::NAN },
                        decode_s: last - first,
                        decode_tokens: after_first,
                        tokens,
                        spec: o.spec,
                        policy: o.draft,
                    });
                }
                Event::Error(e) => bail!("the benchmark request failed: {e}"),
            }
        }
    }
}

/// The sizes in `opts` fit a model with this config.
pub fn check_options(opts: &BenchOptions, cfg: &TextConfig) -> Result<()> {
    if opts.max_rows == 0 || opts.max_rows > crate::model::cache::MAX_ROLLBACK {
        bail!("--rows must be between 1 and {}", crate::model::cache::MAX_ROLLBACK);
    }
    if opts.prefill_tokens == 0 || opts.decode_steps == 0 {
        bail!("--prefill and --decode must be at least 1");
    }
    // Positions the run needs: the prompt and the decode steps (+ a warm-up step and drafts that are
    // rolled back), or the prompt and the multi-row forwards.
    let ctx = cfg.max_position_embeddings;
    match opts
        .prefill_tokens
        .checked_add(2)
        .and_then(|n| n.checked_add(opts.decode_steps.max(opts.max_rows)))
        .and_then(|n| n.checked_add(crate::model::cache::MAX_ROLLBACK))
    {
        Some(n) if n <= ctx => Ok(()),
        _ => bail!(
            "--prefill {} + --decode {} + --rows {} (+ room for drafts) exceed the model's context of {ctx} positions",
            opts.prefill_tokens,
            opts.decode_steps,
            opts.max_rows
        ),
    }
}

/// Prefill and decode through the engine, then the kernels' cost curve: multi-row forwards, draft
/// steps, and the speed-up they project.
pub fn run(models: &crate::engine::Models, name: &str, opts: &BenchOptions, log: impl Fn(&str)) -> Result<BenchReport> {
    let model = &models.target;
    let cfg = &model.cfg;
    check_options(opts, cfg)?;
    let bytes = model.bytes_per_token();
    log("measuring the machine's read bandwidth...");
    let machine = kernels::bandwidth::measure_read_bandwidth(1 << 30);
    let vocab = cfg.vocab_size as u64;
    let prompt: Vec<u32> = (0..opts.prefill_tokens as u64).map(|i| 3 + ((i * 7919) % (vocab - 3)) as u32).collect();

    log(&format!("prefill of {} tokens and {} decode steps through the engine...", prompt.len(), opts.decode_steps));
    // A warm-up request first: the first pass over a file's pages pays for mapping them.
    engine_run(models, &prompt[..prompt.len().min(8)], 2, None)?;
    let plain = engine_run(models, &prompt, opts.decode_steps + 2, None)?;
    let step_s = plain.per_token_s;
    let speculative = match &models.assistant {
        Some(_) => {
            log(&format!("the same with drafting ({})...", opts.draft));
            let run = engine_run(models, &prompt, opts.decode_steps + 2, Some(opts.draft.into()))?;
            let sp = run.spec.unwrap_or_default();
            let rounds = sp.draft_rounds.max(1) as f64;
            Some(SpeculativeRun {
                draft_tokens: opts.draft.to_string(),
                decode_tokens_per_s: 1.0 / run.per_token_s,
                speedup: step_s / run.per_token_s,
                mean_accepted_per_round: sp.accepted_tokens as f64 / rounds,
                acceptance_rate: sp.accepted_tokens as f64 / sp.drafted_tokens.max(1) as f64,
            })
        }
        None => None,
    };

    log("multi-row forwards...");
    let mut cache = model.new_cache();
    crate::decode::generate::prefill(model, &mut cache, &prompt, &mut Default::default())?;
    model.forward(&mut cache, &[5], Keep::Last)?;
    let mut rows_ms = Vec::new();
    let mut base = 0.0;
    for r in 1..=opts.max_rows {
        let toks: Vec<u32> = (0..r as u32).map(|i| 100 + i).collect();
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            model.forward(&mut cache, &toks, Keep::All)?;
            times.push(t.elapsed().as_secs_f64());
            cache.rollback(r)?;
        }
        let ms = median(times) * 1e3;
        if r == 1 {
            base = ms;
        }
        rows_ms.push((r, ms, ms / base));
    }
    let (mut draft_s, mut draft_head) = (f64::NAN, None);
    if let Some(assistant) = &models.assistant {
        log("draft steps...");
        let store = |kind| cache.store_kv(cfg, kind).ok_or_else(|| anyhow!("the target has no {kind:?} store layer"));
        let (sliding, full) = (store(LayerType::Sliding)?, store(LayerType::Full)?);
        let mut emb = vec![0f32; cfg.hidden_size];
        model.embed_token(17, &mut emb);
        let mut h = vec![0.01f32; cfg.hidden_size];
        let mut times = Vec::new();
        for _ in 0..opts.draft_steps.max(1) {
            let t = Instant::now();
            let step = assistant.step(&emb, &h, sliding, full, cache.len());
            times.push(t.elapsed().as_secs_f64());
            h = step.hidden;
        }
        draft_s = median(times);
        draft_head = Some(match assistant.cfg.head {
            crate::config::DraftHead::Centroid { .. } => "centroid".to_string(),
            _ => "tied".to_string(),
        });
    }
    let verify = |rows: usize| -> f64 { rows_ms.get(rows - 1).map_or(f64::NAN, |r| r.1) / 1e3 };
    // Against the one-row forward of the same table, so that a change in the machine's speed between
    // the decode measurement and the table does not skew the projection.
    let projected_speedup = match draft_head {
        Some(_) => (1..opts.max_rows)
            .map(|k| (0..=k).map(|a| (a + 1) as f64 * verify(1) / (k as f64 * draft_s + verify(k + 1))).collect())
            .collect(),
        None => Vec::new(),
    };
    Ok(BenchReport {
        model: name.to_string(),
        threads: opts.threads,
        isa: format!("{:?}", kernels::isa()),
        weight_bytes_per_token: bytes,
        prefill_tokens_per_s: prompt.len() as f64 / plain.first_token_s,
        decode_tokens_per_s: 1.0 / step_s,
        decode_ms_per_token: step_s * 1e3,
        effective_weight_gb_per_s: bytes as f64 / step_s / 1e9,
        machine_read_gb_per_s: machine,
        rows: rows_ms,
        draft_head,
        draft_step_ms: draft_s * 1e3,
        draft_step_ratio: draft_s / step_s,
        speculative,
        projected_speedup,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::validate_pair;

    /// A row of `bench --concurrency` with only the throughputs set.
    fn measured(concurrency: usize, draft: &str, aggregate: f64, decode: f64) -> ConcurrencyRow {
        ConcurrencyRow {
            concurrency,
            draft: draft.into(),
            aggregate_tokens_per_s: aggregate,
            per_stream_decode_tokens_per_s: decode / concurrency as f64,
            aggregate_decode_tokens_per_s: decode,
            ttft_ms_p50: 0.0,
            itl_ms_p50: 0.0,
            itl_ms_p99: 0.0,
            rows_per_step: 0.0,
            acceptance_rate: 0.0,
            join_prompt: 0,
            joiner_ttft_ms: None,
            aggregate_vs_one: None,
            decode_vs_one: None,
            aggregate_vs_off: None,
        }
    }

    #[test]
    fn concurrency_ratios_are_medians_of_each_repetitions_own() {
        // Three repetitions; the second ran in a fast phase. Per repetition, 8 streams over 1 stream:
        // 5, 5 and 6 (median 5), while the median repetitions' aggregates, 72 over 12, would say 6.
        let series = |c: usize, draft: &str, agg: [f64; 3]| -> Vec<ConcurrencyRow> {
            agg.iter().map(|&a| measured(c, draft, a, 2.0 * a)).collect()
        };
        let runs = vec![
            vec![series(1, "off", [10.0, 20.0, 12.0]), series(1, "auto", [10.0, 22.0, 11.0])],
            vec![series(8, "off", [50.0, 100.0, 72.0]), series(8, "auto", [55.0, 90.0, 80.0])],
        ];
        let rows = summarize_runs(&[1, 8], 1, &runs);
        let get = |c: usize, d: &str| rows.iter().find(|r| r.concurrency == c && r.draft == d).unwrap();
        let near = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-9;
        let eight = get(8, "off");
        assert_eq!(eight.aggregate_tokens_per_s, 72.0, "the median repetition's figures");
        assert!(near(eight.aggregate_vs_one, 5.0) && near(eight.decode_vs_one, 5.0));
        assert!(eight.aggregate_vs_off.is_none(), "drafting off has nothing to compare with");
        // auto against off in the same repetition: 1.1, 0.9 and 1.11 -> 1.1.
        assert!(near(get(8, "auto").aggregate_vs_off, 1.1));
        assert!(near(get(1, "auto").aggregate_vs_off, 1.0) && near(get(1, "off").aggregate_vs_one, 1.0));
        // Without 1 among the levels there is no single stream to compare with.
        let rows = summarize_runs(&[8], 1, &runs[1..]);
        assert!(rows.iter().all(|r| r.aggregate_vs_one.is_none() && r.decode_vs_one.is_none()));
    }

    #[test]
    fn presets_are_valid_pairs_at_real_dimensions() {
        for (preset, layers, hidden) in
            [(Preset::E2b, 10, 1536), (Preset::E2b, 35, 1536), (Preset::E4b, 12, 2560), (Preset::E4b, 42, 2560)]
        {
            let t = preset.config(layers).unwrap();
            assert_eq!((t.hidden_size, t.num_layers(), t.vocab_size), (hidden, layers, 262_144));
            assert!(t.store_layer(LayerType::Sliding).is_some() && t.store_layer(LayerType::Full).is_some());
            let a = preset.assistant_config(&t).unwrap();
            validate_pair(&t, &a).unwrap();
            assert_eq!(a.head, DraftHead::Centroid { num_centroids: 2048, top_k: 32 });
        }
        // Full-size sharing matches the real checkpoints: E2B 20 of 35 layers, E4B 18 of 42.
        let shared = |t: &TextConfig| t.layers.iter().filter(|l| l.kv_mode == KvMode::Reuse).count();
        assert_eq!(shared(&Preset::E2b.config(35).unwrap()), 20);
        assert_eq!(shared(&Preset::E4b.config(42).unwrap()), 18);
        assert!(Preset::E2b.config(3).is_err());
        assert!(Preset::E2b.config(36).is_err() && Preset::E4b.config(43).is_err());
        assert!(Preset::parse("e9b").is_err());
        // 26B-A4B: MoE, no PLE and no sharing, k_eq_v full layers, the tied-head drafter.
        for layers in [6, 30] {
            let t = Preset::parse("26b-a4b").unwrap().config(layers).unwrap();
            let m = t.moe.unwrap();
            assert_eq!((t.hidden_size, m.num_experts, m.top_k, m.intermediate_size), (2816, 128, 8, 704));
            assert!(t.ple.is_none() && t.layers.iter().all(|l| l.kv_mode != KvMode::Reuse));
            assert_eq!(t.geometry(LayerType::Full), Some((512, 2)));
            let a = Preset::A26b.assistant_config(&t).unwrap();
            validate_pair(&t, &a).unwrap();
            assert_eq!(a.head, DraftHead::Tied);
        }
    }
}

/// Where the default model pair that ships with tandem lives (built into the binary; `cargo run` from the
/// repository finds it).
pub fn default_model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default")
}

pub struct PairOptions {
    pub target: std::path::PathBuf,
    pub assistant: std::path::PathBuf,
    /// JSON list of prompts: each an object with `ids` (and optional `text`), or a plain list of ids.
    pub prompts: std::path::PathBuf,
    /// Draft length; `None`: the pair's own default, as `generate` and `serve` use it (the drafter's
    /// `num_assistant_tokens`, else `auto`).
    pub draft: Option<crate::decode::draft_policy::DraftLength>,
    pub max_new_tokens: usize,
    /// Passes over the prompts (each prompt plain, then with drafting, in every pass); the speed-up
    /// reported is the median of the passes' own.
    pub repeats: usize,
    /// Quantize at load (`--quantize`).
    pub quant: crate::quantize::LoadQuant,
}

#[derive(Serialize)]
pub struct PairReport {
    pub prompts: usize,
    pub generated_tokens: usize,
    pub draft_tokens: String,
    pub plain_decode_tokens_per_s: f64,
    pub speculative_decode_tokens_per_s: f64,
    /// The median of `speedup_by_repetition`.
    pub speedup: f64,
    /// Each pass's plain decode time over its speculative decode time.
    pub speedup_by_repetition: Vec<f64>,
    pub mean_accepted_per_round: f64,
    pub acceptance_rate: f64,
    /// Share of rounds whose i-th draft was accepted.
    pub acceptance_by_position: Vec<f64>,
    /// Greedy output with drafting equal to greedy output without, for every prompt.
    pub identical_output: bool,
    /// Mean time of one draft step and of one plain decode step, and their ratio.
    pub draft_step_ms: f64,
    pub target_step_ms: f64,
    pub draft_step_ratio: f64,
    /// Where a round's time goes (rounds with drafts; means over all passes): its draft steps, its
    /// verify forward, and the rest of the speculative decode's time (acceptance, sampling, cache
    /// rollback, scheduling, and the steps `auto` runs without drafts), each per round.
    pub round_draft_ms: f64,
    pub round_verify_ms: f64,
    pub round_other_ms: f64,
    /// The speed-up the measured step times alone would give: tokens per round (accepted drafts plus
    /// the target's own) times a plain step, over a round's draft and verify time.
    pub projected_speedup: f64,
    /// With `--quantize`: the quantized target against the same checkpoint unquantized.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quality: Option<QualityReport>,
}

/// How close a quantized target stays to its unquantized checkpoint, teacher-forced on the held-out
/// prompts followed by the unquantized model's greedy continuation of each.
#[derive(Serialize)]
pub struct QualityReport {
    pub recipe: String,
    /// Perplexity of the prompts' own tokens (each predicted from the ones before it).
    pub reference_perplexity: f64,
    pub perplexity: f64,
    /// `perplexity / reference_perplexity - 1`.
    pub perplexity_change: f64,
    /// Share of positions (prompts and continuations) where both models' most likely token is the same.
    pub top1_agreement: f64,
    /// Mean KL divergence (reference ‖ quantized) of the next-token distributions, in nats.
    pub mean_kl: f64,
    pub positions: usize,
}

/// Log-softmax of one row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&v| v as f64 - log_z).collect()
}

/// Compare `quantized` with `reference` on each prompt extended by `continuation` greedy tokens of the
/// reference (one teacher-forced forward each).
pub fn quality(
    reference: &crate::engine::Models,
    quantized: &TargetModel,
    recipe: crate::quantize::Recipe,
    prompts: &[Vec<u32>],
    continuation: usize,
) -> Result<QualityReport> {
    use crate::model::target::Keep;
    let (mut nll_ref, mut nll_q, mut scored) = (0f64, 0f64, 0usize);
    let (mut kl, mut agree, mut positions) = (0f64, 0usize, 0usize);
    for p in prompts {
        let run = engine_run(reference, p, continuation, None)?;
        let reference = &reference.target;
        let mut seq = p.clone();
        seq.extend_from_slice(&run.tokens);
        let (mut c1, mut c2) = (reference.new_cache(), quantized.new_cache());
        let a = reference.forward(&mut c1, &seq, Keep::All)?;
        let b = quantized.forward(&mut c2, &seq, Keep::All)?;
        for i in 0..seq.len() - 1 {
            let (la, lb) = (log_softmax(a.logits_row(i)), log_softmax(b.logits_row(i)));
            if i + 1 < p.len() {
                let next = seq[i + 1] as usize;
                nll_ref -= la[next];
                nll_q -= lb[next];
                scored += 1;
            }
            kl += la.iter().zip(&lb).map(|(x, y)| x.exp() * (x - y)).sum::<f64>();
            agree += (crate::kernels::argmax(a.logits_row(i)) == crate::kernels::argmax(b.logits_row(i))) as usize;
            positions += 1;
        }
    }
    let ppl = |nll: f64| (nll / scored.max(1) as f64).exp();
    Ok(QualityReport {
        recipe: recipe.name().into(),
        reference_perplexity: ppl(nll_ref),
        perplexity: ppl(nll_q),
        perplexity_change: ppl(nll_q) / ppl(nll_ref) - 1.0,
        top1_agreement: agree as f64 / positions.max(1) as f64,
        mean_kl: kl / positions.max(1) as f64,
        positions,
    })
}

impl PairReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} held-out prompts, {} tokens generated at temperature 0, draft tokens {}\n",
            self.prompts, self.generated_tokens, self.draft_tokens
        );
        s += &format!("plain decode:       {:.1} tok/s\n", self.plain_decode_tokens_per_s);
        s += &format!("speculative decode: {:.1} tok/s ({:.2}x", self.speculative_decode_tokens_per_s, self.speedup);
        let passes = &self.speedup_by_repetition;
        if passes.len() > 1 {
            let lo = passes.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = passes.iter().copied().fold(0.0, f64::max);
            s += &format!(", the median of {} passes: {lo:.2}x-{hi:.2}x", passes.len());
        }
        s += ")\n";
        s += &format!(
            "accepted drafts: {:.2} per round ({:.0}% of drafts)\nacceptance by position:",
            self.mean_accepted_per_round,
            100.0 * self.acceptance_rate
        );
        for a in &self.acceptance_by_position {
            s += &format!(" {:.0}%", 100.0 * a);
        }
        s += &format!(
            "\ndraft step {:.3} ms = {:.1}% of a target decode step ({:.3} ms)",
            self.draft_step_ms,
            100.0 * self.draft_step_ratio,
            self.target_step_ms
        );
        s += &format!(
            "\na round: draft {:.3} ms + verify {:.3} ms + other {:.3} ms; draft and verify alone would give {:.2}x",
            self.round_draft_ms, self.round_verify_ms, self.round_other_ms, self.projected_speedup
        );
        s += &format!(
            "\noutput identical with and without drafting: {}\n",
            if self.identical_output { "yes" } else { "NO" }
        );
        if let Some(q) = &self.quality {
            s += &format!(
                "{} vs unquantized, {} positions: perplexity {:.3} vs {:.3} ({:+.2}%), top-1 agreement {:.1}%, mean KL {:.5} nats\n",
                q.recipe,
                q.positions,
                q.perplexity,
                q.reference_perplexity,
                100.0 * q.perplexity_change,
                100.0 * q.top1_agreement,
                q.mean_kl
            );
        }
        s
    }
}

pub fn read_prompts(path: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    let json = crate::config::read_json(path)?;
    let items =
        json.as_array().ok_or_else(|| anyhow::anyhow!("{}: expected a JSON list of prompts", path.display()))?;
    let ids = |v: &serde_json::Value| -> Option<Vec<u32>> {
        v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    let prompts = items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            ids(item.get("ids").unwrap_or(item))
                .filter(|p| !p.is_empty())
                .ok_or_else(|| anyhow::anyhow!("{}: prompt {i} has no list of token ids", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(prompts)
}

/// Run every prompt greedily without and with drafting through the engine, one request at a time,
/// interleaved so both see the same machine. The drafting requests go through one scheduler, so
/// `auto` keeps the step costs it measured from one request to the next, as in a server (a `tandem
/// generate` process measures them anew).
pub fn run_pair(opts: &PairOptions, log: impl Fn(&str)) -> Result<PairReport> {
    let target = TargetModel::load_with(&opts.target, opts.quant.recipe, |l| log(&l))?;
    let assistant = Assistant::load_for_with(&opts.assistant, &target.cfg, opts.quant.assistant_recipe(), |l| log(&l))?;
    let models = crate::engine::Models { target, assistant: Some(assistant), tokenizer: None, template: None };
    let prompts = read_prompts(&opts.prompts)?;
    let (mut plain_s, mut spec_s, mut tokens) = (0.0, 0.0, 0usize);
    let (mut rounds, mut drafted, mut accepted) = (0usize, 0usize, 0usize);
    let (mut draft_s, mut verify_s) = (0.0, 0.0);
    let mut by_position: Vec<usize> = Vec::new();
    let mut identical = true;
    // One policy for all prompts, and one scheduler for the drafting runs (its measured step costs and
    // what `auto` learned of the drafter kept from request to request), as a server keeps them.
    let mut policy = models.draft_policy(opts.draft);
    let draft_tokens = policy.as_ref().map(|p| p.describe()).unwrap_or_default();
    let mut drafting = bench_scheduler(&models);
    // A warm-up request: the first pass over the files' pages pays for mapping them.
    engine_run(&models, &prompts[0], 2, None)?;
    let repeats = opts.repeats.max(1);
    let mut by_repetition = Vec::with_capacity(repeats);
    for rep in 0..repeats {
        let (rep_plain, rep_spec) = (plain_s, spec_s);
        for (i, p) in prompts.iter().enumerate() {
            let pass = if repeats > 1 { format!(", pass {}/{repeats}", rep + 1) } else { String::new() };
            log(&format!("prompt {}/{}{pass}", i + 1, prompts.len()));
            let plain = engine_run(&models, p, opts.max_new_tokens, None)?;
            let spec = engine_run_on(&models, &mut drafting, p, opts.max_new_tokens, policy.take())?;
            policy = spec.policy;
            let stats = spec.spec.unwrap_or_default();
            identical &= plain.tokens == spec.tokens;
            // Decode speed on the same tokens: the plain run's count after its first token.
            plain_s += plain.decode_s;
            spec_s += spec.decode_s;
            tokens += plain.decode_tokens;
            rounds += stats.draft_rounds;
            drafted += stats.drafted_tokens;
            accepted += stats.accepted_tokens;
            draft_s += stats.draft_seconds;
            verify_s += stats.verify_seconds;
            if by_position.len() < stats.accepted_per_position.len() {
                by_position.resize(stats.accepted_per_position.len(), 0);
            }
            for (a, b) in by_position.iter_mut().zip(&stats.accepted_per_position) {
                *a += b;
            }
        }
        by_repetition.push((plain_s - rep_plain) / (spec_s - rep_spec).max(1e-9));
    }
    let per_round = |x: f64| if rounds > 0 { x / rounds as f64 } else { 0.0 };
    let draft_step = if drafted > 0 { draft_s / drafted as f64 } else { 0.0 };
    let target_step = plain_s / tokens.max(1) as f64;
    let projected_speedup = if rounds > 0 && draft_s + verify_s > 0.0 {
        (accepted + rounds) as f64 * target_step / (draft_s + verify_s)
    } else {
        0.0
    };
    let quality = match opts.quant.recipe {
        Some(r) => {
            log("measuring quality against the unquantized target...");
            let target = TargetModel::load(&opts.target)?;
            let reference = crate::engine::Models { target, assistant: None, tokenizer: None, template: None };
            Some(quality(&reference, &models.target, r, &prompts, opts.max_new_tokens)?)
        }
        None => None,
    };
    Ok(PairReport {
        prompts: prompts.len(),
        generated_tokens: tokens / repeats + prompts.len(),
        draft_tokens,
        plain_decode_tokens_per_s: tokens as f64 / plain_s.max(1e-9),
        speculative_decode_tokens_per_s: tokens as f64 / spec_s.max(1e-9),
        speedup: median(by_repetition.clone()),
        speedup_by_repetition: by_repetition,
        mean_accepted_per_round: per_round(accepted as f64),
        acceptance_rate: if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
        acceptance_by_position: by_position.iter().map(|&n| per_round(n as f64)).collect(),
        identical_output: identical,
        draft_step_ms: draft_step * 1e3,
        target_step_ms: target_step * 1e3,
        draft_step_ratio: draft_step / target_step.max(1e-12),
        round_draft_ms: per_round(draft_s) * 1e3,
        round_verify_ms: per_round(verify_s) * 1e3,
        round_other_ms: per_round((spec_s - draft_s - verify_s).max(0.0)) * 1e3,
        projected_speedup,
        quality,
    })
}

/// `tandem bench --concurrency`: streams through the engine's scheduler.
pub struct ConcurrencyOptions {
    /// Concurrent requests to measure, each level in turn.
    pub levels: Vec<usize>,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// New tokens per request.
    pub new_tokens: usize,
    /// Drafting to compare with plain decoding (needs an assistant).
    pub draft: Option<crate::decode::draft_policy::DraftLength>,
    /// Repetitions of each (level, mode), interleaved; medians are reported.
    pub repeats: usize,
    /// When not 0: every measurement runs twice (interleaved), alone and with a request with a prompt
    /// this long joining once every stream has its first token (it generates one token): the
    /// latencies then show what its prefill costs the running streams, next to their pace without it.
    pub join_prompt: usize,
    /// Prompts to use (cycled, each cut to `prompt_tokens`); random ids when empty.
    pub prompts: Vec<Vec<u32>>,
}

/// One (concurrency, drafting) measurement.
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrencyRow {
    pub concurrency: usize,
    /// "off", or the draft setting.
    pub draft: String,
    /// Generated tokens of all streams per second of the run, prefill included.
    pub aggregate_tokens_per_s: f64,
    /// Median over streams of (tokens after the first) / (time from first to last token).
    pub per_stream_decode_tokens_per_s: f64,
    /// The same rates summed over the streams: decode throughput without the prompts' prefill before
    /// each stream's first token (prefill of later arrivals during a stream's decoding still counts),
    /// as llama-server's per-request `predicted_per_second` figures add up.
    pub aggregate_decode_tokens_per_s: f64,
    pub ttft_ms_p50: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    /// Mean rows per target forward.
    pub rows_per_step: f64,
    pub acceptance_rate: f64,
    /// Prompt tokens of the request that joined the running streams (0: none joined).
    pub join_prompt: usize,
    /// Its time from submission to its first token.
    pub joiner_ttft_ms: Option<f64>,
    /// Median over the repetitions of this mode's aggregate over the same repetition's plain single
    /// stream (when 1 is among the levels).
    pub aggregate_vs_one: Option<f64>,
    /// The same for the aggregate decode throughput.
    pub decode_vs_one: Option<f64>,
    /// With drafting: median over the repetitions of the aggregate over the same repetition's run
    /// with drafting off (and the same joiner).
    pub aggregate_vs_off: Option<f64>,
}

/// The repetition with the median aggregate throughput.
fn median_by_aggregate(runs: &[ConcurrencyRow]) -> ConcurrencyRow {
    let mut r = runs.to_vec();
    r.sort_by(|a, b| a.aggregate_tokens_per_s.total_cmp(&b.aggregate_tokens_per_s));
    r.swap_remove(r.len() / 2)
}

#[derive(Serialize)]
pub struct ConcurrencyReport {
    pub model: String,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub rows: Vec<ConcurrencyRow>,
}

impl ConcurrencyReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "{}; {} prompt tokens and {} new tokens per request, greedy; the median repetition, and each ratio the median of the repetitions' own\n",
            self.model, self.prompt_tokens, self.new_tokens
        );
        let joins = self.rows.iter().any(|r| r.join_prompt > 0);
        let drafts = self.rows.iter().any(|r| r.aggregate_vs_off.is_some());
        s += "streams  draft  aggregate tok/s  vs 1 stream  per-stream tok/s  decode tok/s  vs 1 stream  TTFT ms  ITL p50 ms  ITL p99 ms  rows/step  accepted";
        s += if drafts { "  vs off" } else { "" };
        s += if joins { "  joiner  joiner TTFT ms\n" } else { "\n" };
        let x = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}x"));
        for r in &self.rows {
            s += &format!(
                "{:>7}  {:>5}  {:>15.1}  {:>11}  {:>16.1}  {:>12.1}  {:>11}  {:>7.0}  {:>10.1}  {:>10.1}  {:>9.1}  {:>7.0}%",
                r.concurrency,
                r.draft,
                r.aggregate_tokens_per_s,
                x(r.aggregate_vs_one),
                r.per_stream_decode_tokens_per_s,
                r.aggregate_decode_tokens_per_s,
                x(r.decode_vs_one),
                r.ttft_ms_p50,
                r.itl_ms_p50,
                r.itl_ms_p99,
                r.rows_per_step,
                100.0 * r.acceptance_rate
            );
            if drafts {
                s += &format!("  {:>6}", x(r.aggregate_vs_off));
            }
            if joins {
                let ttft = r.joiner_ttft_ms.map_or("-".to_string(), |t| format!("{t:.0}"));
                let join = if r.join_prompt > 0 { r.join_prompt.to_string() } else { "-".into() };
                s += &format!("  {join:>6}  {ttft:>14}");
            }
            s += "\n";
        }
        s
    }
}

fn percentile(mut xs: Vec<f64>, q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

/// Run `c` requests at once through a scheduler until all end; one row of the report.
fn concurrency_once(
    models: &crate::engine::Models,
    c: usize,
    opts: &ConcurrencyOptions,
    draft: Option<crate::decode::draft_policy::DraftLength>,
    join_prompt: usize,
    rep: usize,
) -> Result<ConcurrencyRow> {
    use crate::engine::{Event, Limits, Prompt, Request, Scheduler};
    let vocab = models.target.cfg.vocab_size as u64;
    let gen = crate::decode::generate::GenerateOptions {
        max_new_tokens: opts.new_tokens,
        ignore_eos: true,
        sampling: crate::decode::sampling::SamplingParams::default(),
        top_logprobs: None,
        context_limit: models.target.cfg.max_position_embeddings,
    };
    let mut s = Scheduler::new(models, Limits { max_active: c + 1, pool: 0, ..Limits::default() });
    let salt = rep as u64 * 1000;
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for r in 0..c {
        let ids: Vec<u32> = match opts.prompts.len() {
            0 => (0..opts.prompt_tokens as u64)
                .map(|i| 3 + ((i * 7919 + (r as u64 + salt) * 104_729) % (vocab - 3)) as u32)
                .collect(),
            // Each repetition takes the next prompts, so that every level sees several (one stream
            // would otherwise always run the first) and acceptance is comparable across levels.
            n => opts.prompts[(rep * c + r) % n].iter().copied().take(opts.prompt_tokens).collect(),
        };
        let req = Request {
            prompt: Prompt::Ids(ids),
            opts: gen.clone(),
            stop: Vec::new(),
            show_thinking: false,
            draft: draft.map(Into::into),
            trace: false,
        };
        handles.push(s.submit(req)?);
    }
    // Per stream: the arrival time of each token.
    let mut arrivals: Vec<Vec<f64>> = vec![Vec::new(); c];
    let (mut steps, mut rows, mut drafted, mut accepted) = (0usize, 0usize, 0usize, 0usize);
    let mut open = c;
    let mut joiner = None;
    while open > 0 {
        if join_prompt > 0 && joiner.is_none() && arrivals.iter().all(|a| !a.is_empty()) {
            let ids: Vec<u32> =
                (0..join_prompt as u64).map(|i| 3 + ((i * 15_485_863 + salt) % (vocab - 3)) as u32).collect();
            let o = crate::decode::generate::GenerateOptions { max_new_tokens: 1, ..gen.clone() };
            let req = Request {
                prompt: Prompt::Ids(ids),
                opts: o,
                stop: Vec::new(),
                show_thinking: false,
                draft: None,
                trace: false,
            };
            joiner = Some((s.submit(req)?, t0.elapsed().as_secs_f64()));
        }
        let report = s.step();
        if report.rows > 0 {
            steps += 1;
            rows += report.rows;
        }
        let now = t0.elapsed().as_secs_f64();
        for (h, a) in handles.iter().zip(arrivals.iter_mut()) {
            while let Some(e) = h.try_recv() {
                match e {
                    Event::Tokens { ids, .. } => a.extend(std::iter::repeat_n(now, ids.len())),
                    Event::Done(o) => {
                        open -= 1;
                        if let Some(sp) = o.spec {
                            drafted += sp.drafted_tokens;
                            accepted += sp.accepted_tokens;
                        }
                    }
                    Event::Error(e) => bail!("a benchmark request failed: {e}"),
                }
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    // The newcomer may still be prefilling: step on until its first token (or its end).
    let mut joiner_ttft_ms = None;
    if let Some((h, submitted)) = joiner {
        loop {
            match h.try_recv() {
                Some(Event::Tokens { .. } | Event::Done(_)) => {
                    joiner_ttft_ms = Some((t0.elapsed().as_secs_f64() - submitted) * 1e3);
                    break;
                }
                Some(Event::Error(e)) => bail!("the joining request failed: {e}"),
                None => {
                    s.step();
                }
            }
        }
    }
    let total: usize = arrivals.iter().map(Vec::len).sum();
    let per_stream: Vec<f64> = arrivals
        .iter()
        .filter(|a| a.len() > 1)
        .map(|a| (a.len() - 1) as f64 / (a[a.len() - 1] - a[0]).max(1e-9))
        .collect();
    // Inter-token latency: a run of k tokens that arrive together after a gap g counts k gaps of g / k.
    let mut itl = Vec::new();
    for a in &arrivals {
        let mut i = 1;
        while i < a.len() {
            let mut j = i;
            while j + 1 < a.len() && a[j + 1] == a[i] {
                j += 1;
            }
            let k = j - i + 1;
            let gap = (a[i] - a[i - 1]) / k as f64;
            itl.extend(std::iter::repeat_n(gap * 1e3, k));
            i = j + 1;
        }
    }
    Ok(ConcurrencyRow {
        concurrency: c,
        draft: draft.map_or("off".into(), |d| d.to_string()),
        aggregate_tokens_per_s: total as f64 / wall,
        aggregate_decode_tokens_per_s: per_stream.iter().sum(),
        per_stream_decode_tokens_per_s: percentile(per_stream, 0.5),
        ttft_ms_p50: percentile(arrivals.iter().filter_map(|a| a.first()).map(|t| t * 1e3).collect(), 0.5),
        itl_ms_p50: percentile(itl.clone(), 0.5),
        itl_ms_p99: percentile(itl, 0.99),
        rows_per_step: rows as f64 / steps.max(1) as f64,
        acceptance_rate: if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
        join_prompt,
        joiner_ttft_ms,
        aggregate_vs_one: None,
        decode_vs_one: None,
        aggregate_vs_off: None,
    })
}

/// The report's rows from `runs[level][mode][repetition]` (modes: drafting off then on, each with the
/// `joins` joiner settings): per level and mode the median repetition, with its ratios as medians of
/// the repetitions' own (against the same repetition's plain single stream, if 1 is a level, and for
/// drafting against the same repetition's run with drafting off and the same joiner).
fn summarize_runs(levels: &[usize], joins: usize, runs: &[Vec<Vec<ConcurrencyRow>>]) -> Vec<ConcurrencyRow> {
    let one = levels.iter().position(|&c| c == 1).map(|l| &runs[l][0]);
    let pairwise = |a: &[ConcurrencyRow], b: &[ConcurrencyRow], f: fn(&ConcurrencyRow) -> f64| {
        percentile(a.iter().zip(b).map(|(a, b)| f(a) / f(b).max(1e-12)).collect(), 0.5)
    };
    let mut rows = Vec::new();
    for level in runs {
        for (m, r) in level.iter().enumerate() {
            let mut row = median_by_aggregate(r);
            if let Some(one) = one {
                row.aggregate_vs_one = Some(pairwise(r, one, |r| r.aggregate_tokens_per_s));
                row.decode_vs_one = Some(pairwise(r, one, |r| r.aggregate_decode_tokens_per_s));
            }
            if m >= joins {
                row.aggregate_vs_off = Some(pairwise(r, &level[m % joins], |r| r.aggregate_tokens_per_s));
            }
            rows.push(row);
        }
    }
    rows
}

/// Every concurrency level with drafting off and (with an assistant) on, `repeats` times, each
/// repetition running every level and mode once. Each row is the median repetition (by aggregate
/// throughput); its ratios are the medians of the repetitions' own ratios (each against the same
/// repetition's plain single stream, or its run with drafting off).
pub fn run_concurrency(
    models: &crate::engine::Models,
    name: &str,
    opts: &ConcurrencyOptions,
    log: impl Fn(&str),
) -> Result<ConcurrencyReport> {
    if opts.levels.is_empty() || opts.levels.iter().any(|&c| c == 0 || c > 256) {
        bail!("--concurrency takes levels from 1 to 256, e.g. 1,2,4,8");
    }
    if opts.prompt_tokens == 0 || opts.new_tokens == 0 {
        bail!("--prefill and --decode must be at least 1");
    }
    let ctx = models.target.cfg.max_position_embeddings;
    if opts.prompt_tokens.saturating_add(opts.new_tokens) >= ctx {
        bail!(
            "--prefill {} + --decode {} exceed the model's context of {ctx} positions",
            opts.prompt_tokens,
            opts.new_tokens
        );
    }
    let drafts: Vec<Option<crate::decode::draft_policy::DraftLength>> = match (opts.draft, &models.assistant) {
        (Some(d), Some(_)) => vec![None, Some(d)],
        (Some(_), None) => bail!("drafting in the concurrency bench needs an assistant"),
        (None, _) => vec![None],
    };
    let joins = if opts.join_prompt > 0 { vec![0, opts.join_prompt] } else { vec![0] };
    let modes: Vec<_> = drafts.iter().flat_map(|&d| joins.iter().map(move |&j| (d, j))).collect();
    // runs[level][mode][repetition]: every level and mode once per repetition, so that each
    // repetition's ratios compare runs minutes apart at most (this machine's memory speed drifts over
    // minutes: the same run differs 1.7x between a fast and a slow phase).
    let reps = opts.repeats.max(1);
    let mut runs: Vec<Vec<Vec<ConcurrencyRow>>> = vec![vec![Vec::with_capacity(reps); modes.len()]; opts.levels.len()];
    for rep in 0..reps {
        for (l, &c) in opts.levels.iter().enumerate() {
            for (m, &(mode, join)) in modes.iter().enumerate() {
                log(&format!(
                    "{c} streams, draft {}{}, run {}/{reps}",
                    mode.map_or("off".into(), |d| d.to_string()),
                    if join > 0 { format!(", a {join}-token prompt joining") } else { String::new() },
                    rep + 1,
                ));
                runs[l][m].push(concurrency_once(models, c, opts, mode, join, rep)?);
            }
        }
    }
    let rows = summarize_runs(&opts.levels, joins.len(), &runs);
    Ok(ConcurrencyReport {
        model: name.to_string(),
        prompt_tokens: opts.prompt_tokens,
        new_tokens: opts.new_tokens,
        rows,
    })
}
