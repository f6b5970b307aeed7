//! Draft lengths compared under a fixed cost model: the shipped pair's held-out prompts run greedily
//! through the engine with each draft setting, every step costed by the model instead of the clock
//! (`StepClock::Model`), so the comparison is exact and repeatable where `bench --pair` is at the mercy of
//! a noisy machine. Prints, per setting, tokens per round, drafts per round and the modeled speed-up over
//! plain decoding.
//!
//! cargo run --release --example draft_model -- [FORWARD_BASE FORWARD_ROW DRAFT_BASE DRAFT_ROW [STREAMS]]
//!
//! Costs in milliseconds: a forward over r rows costs `FORWARD_BASE + r · FORWARD_ROW`, a draft step for
//! b sequences `DRAFT_BASE + b · DRAFT_ROW` (default 0.74 0.125 0.105 0.005: the shipped pair on a 2-core
//! Zen 4 VM). With STREAMS > 1, that many prompts run at once.

use tandem::decode::draft_policy::{DraftLength, DraftPolicy};
use tandem::decode::generate::GenerateOptions;
use tandem::decode::sampling::SamplingParams;
use tandem::engine::{Event, Limits, Models, Prompt, Request, Scheduler, StepClock};
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

fn main() -> anyhow::Result<()> {
    let args: Vec<f64> = std::env::args().skip(1).map(|s| s.parse()).collect::<Result<_, _>>()?;
    let arg = |i: usize, d: f64| args.get(i).copied().unwrap_or(d);
    let (fb, fr, db, dr) = (arg(0, 0.74) * 1e-3, arg(1, 0.125) * 1e-3, arg(2, 0.105) * 1e-3, arg(3, 0.005) * 1e-3);
    let streams = arg(4, 1.0) as usize;
    let dir = tandem::bench::default_model_dir();
    let target = TargetModel::load(&dir.join("target"))?;
    let assistant = Assistant::load_for(&dir.join("assistant"), &target.cfg)?;
    let models = Models { target, assistant: Some(assistant), tokenizer: None, template: None };
    let prompts = tandem::bench::read_prompts(&dir.join("heldout_prompts.json"))?;
    let clock = StepClock::Model { forward_base: fb, forward_row: fr, draft_base: db, draft_row: dr };
    let mut settings: Vec<Option<DraftLength>> = vec![None];
    settings.extend((1..=8).map(|k| Some(DraftLength::Fixed(k))));
    settings.push(Some(DraftLength::Auto));
    let mut plain_time = 0.0;
    println!("{streams} stream(s); setting, tokens/round, drafts/round, modeled decode speed-up");
    for setting in settings {
        let (time, tokens, rounds, drafted) = run(&models, &prompts, setting, clock, streams, (fb, fr, db, dr))?;
        if setting.is_none() {
            plain_time = time / tokens as f64;
        }
        let name = setting.map_or("off".to_string(), |s| s.to_string());
        println!(
            "{name:>5} {:6.2} {:6.2} {:6.3}x",
            tokens as f64 / rounds.max(1) as f64,
            drafted as f64 / rounds.max(1) as f64,
            plain_time / (time / tokens as f64)
        );
    }
    Ok(())
}

/// Modeled decode time (prefill steps left out), tokens, rounds and drafts over all prompts.
fn run(
    models: &Models,
    prompts: &[Vec<u32>],
    setting: Option<DraftLength>,
    clock: StepClock,
    streams: usize,
    (fb, fr, db, dr): (f64, f64, f64, f64),
) -> anyhow::Result<(f64, usize, usize, usize)> {
    let mut policy = setting.map(DraftPolicy::from);
    let (mut time, mut tokens, mut rounds, mut drafted) = (0.0, 0, 0, 0);
    for group in prompts.chunks(streams) {
        let mut s = Scheduler::new(models, Limits { max_active: streams, pool: 0, clock, ..Limits::default() });
        let handles: Vec<_> = group
            .iter()
            .map(|p| {
                s.submit(Request {
                    prompt: Prompt::Ids(p.clone()),
                    opts: GenerateOptions {
                        max_new_tokens: 64,
                        ignore_eos: true,
                        sampling: SamplingParams::default(),
                        top_logprobs: None,
                        context_limit: models.target.cfg.max_position_embeddings,
                    },
                    stop: Vec::new(),
                    show_thinking: false,
                    draft: if streams == 1 { policy.take() } else { policy.clone() },
                    trace: false,
                })
            })
            .collect::<Result<_, _>>()?;
        let mut done = 0;
        // Whether each request has its first token (from its prompt's prefill): the steps before all
        // have are prefill, which costs the same whatever the draft setting and is left out.
        let mut started = vec![false; handles.len()];
        while done < handles.len() {
            let decoding = started.iter().all(|&s| s);
            let r = s.step();
            if decoding && r.sequences > 0 {
                // Every row of a decode step is a sequence's last token or one of its drafts.
                let drafts = r.rows - r.sequences;
                time += fb + r.rows as f64 * fr + r.draft_steps as f64 * db + drafts as f64 * dr;
            }
            for (h, started) in handles.iter().zip(started.iter_mut()) {
                while let Some(e) = h.try_recv() {
                    match e {
                        Event::Tokens { .. } => *started = true,
                        Event::Done(o) => {
                            done += 1;
                            // The first token comes from the prefill.
                            tokens += o.generation.tokens.len() - 1;
                            if let Some(st) = &o.spec {
                                rounds += st.draft_rounds;
                                drafted += st.drafted_tokens;
                            }
                            if streams == 1 {
                                policy = o.draft;
                            }
                        }
                        Event::Error(e) => anyhow::bail!(e),
                    }
                }
            }
        }
    }
    if rounds == 0 {
        rounds = tokens;
    }
    Ok((time, tokens, rounds, drafted))
}
