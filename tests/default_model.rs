//! The model pair that ships in models/default: it loads, speculative decoding on it is lossless, its trained
//! drafter is really accepted, and the CLI uses it when no --model is given.

mod common;

use common::{heldout_prompts, shipped_dir};

use std::process::Command;

use serde_json::Value;
use tandem::config::validate_pair;
use tandem::decode::draft_policy::DraftLength;
use tandem::decode::generate::{generate, GenerateOptions};
use tandem::decode::sampling::SamplingParams;
use tandem::decode::speculative::generate_speculative;
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

#[test]
fn drafting_on_the_shipped_pair_is_lossless_and_accepted() {
    let target = TargetModel::load(&shipped_dir().join("target")).unwrap();
    let assistant = Assistant::load(&shipped_dir().join("assistant")).unwrap();
    validate_pair(&target.cfg, &assistant.cfg).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 48,
        ignore_eos: true,
        sampling: SamplingParams::default(),
        top_logprobs: None,
        context_limit: target.cfg.max_position_embeddings,
    };
    let (mut rounds, mut accepted) = (0, 0);
    for prompt in heldout_prompts().iter().take(8) {
        let plain = generate(&target, prompt, &opts, |_| {}).unwrap().tokens;
        for dl in [DraftLength::Fixed(4), DraftLength::Fixed(2), DraftLength::Auto] {
            let (g, s) =
                generate_speculative(&target, &assistant, prompt, &opts, &mut dl.into(), false, |_| {}).unwrap();
            assert_eq!(g.tokens, plain, "{dl:?}");
            if dl == DraftLength::Fixed(4) {
                rounds += s.draft_rounds;
                accepted += s.accepted_tokens;
            }
        }
    }
    // Greedy and deterministic: this is a regression check on the drafter as much as on the pair.
    let per_round = accepted as f64 / rounds as f64;
    assert!(per_round >= 1.5, "only {per_round:.2} drafts accepted per round at k = 4");
}

#[test]
fn generate_without_model_uses_the_default_pair_and_streams_text() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert!(!v["text"].as_str().unwrap().is_empty());
    assert_eq!(v["tokens"].as_array().unwrap().len(), 24);
    assert!(v["stats"]["draft_rounds"].as_u64().unwrap() > 0, "drafting is on by default");
}
