//! The engine's scheduler, stepped by hand so that joins, leaves and cancellations happen at chosen steps:
//! many requests of mixed prompt lengths and draft settings share every forward, and each one's tokens
//! equal its solo run (greedy with any draft setting; seeded sampling with drafting off or a fixed k).
//! Also the queue, the K/V budget, prefix reuse from finished sequences, and cancellation.

mod common;

use std::path::PathBuf;

use common::{fixture_dir, heldout_prompts, shipped_dir, stats};
use tandem::decode::draft_policy::{DraftLength, DraftPolicy};
use tandem::decode::generate::{generate, GenerateOptions};
use tandem::decode::sampling::SamplingParams;
use tandem::decode::speculative::generate_speculative;
use tandem::engine::{Event, Handle, Limits, Models, Outcome, Prompt, Request, Scheduler, StepClock};
use tandem::model::assistant::Assistant;
use tandem::model::TargetModel;

/// The scheduler's limits with prompt chunks of a fixed size next to decoding sequences (the first
/// one `MIN_BUSY_PREFILL_ROWS`, then 32): the cost-based size depends on timing, and these tests
/// choose the steps at which requests join and are cancelled.
fn limits() -> Limits {
    Limits { busy_step_ratio: f64::INFINITY, prefill_rows_busy: 32, ..Limits::default() }
}

fn models(target: PathBuf, assistant: Option<PathBuf>) -> Models {
    Models {
        target: TargetModel::load(&target).unwrap(),
        assistant: assistant.map(|a| Assistant::load(&a).unwrap()),
        tokenizer: None,
        template: None,
    }
}

fn opts(m: &Models, max_new: usize, sampling: SamplingParams) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: max_new,
        ignore_eos: true,
        sampling,
        top_logprobs: None,
        context_limit: m.target.cfg.max_position_embeddings,
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        repeat_penalty: 1.1,
        seed,
        ..SamplingParams::default()
    }
}

/// A deterministic pseudo-random prompt of `n` ids below `vocab` (avoiding the low special ids).
fn prompt(vocab: usize, n: usize, salt: u64) -> Vec<u32> {
    let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % (vocab as u64 - 3)) as u32
        })
        .collect()
}

/// Step costs in which a row adds 1 % to a forward and a draft step 2-4 %: drafting pays.
const CHEAP_ROWS: StepClock =
    StepClock::Model { forward_base: 1e-3, forward_row: 1e-5, draft_base: 2e-5, draft_row: 2e-6 };

/// The same request run alone through the single-sequence path.
fn solo(m: &Models, ids: &[u32], o: &GenerateOptions, draft: Option<DraftLength>) -> Vec<u32> {
    match (draft, &m.assistant) {
        (Some(d), Some(a)) => {
            generate_speculative(&m.target, a, ids, o, &mut d.into(), false, |_| {}).unwrap().0.tokens
        }
        _ => generate(&m.target, ids, o, |_| {}).unwrap().tokens,
    }
}

struct Case {
    ids: Vec<u32>,
    opts: GenerateOptions,
    draft: Option<DraftLength>,
    /// Step at which it joins.
    join: usize,
    /// Step after which it is cancelled.
    cancel: Option<usize>,
    handle: Option<Handle>,
    streamed: Vec<u32>,
    outcome: Option<Outcome>,
}

/// Step the scheduler until every case has ended, submitting and cancelling at their steps; collect the
/// streamed tokens and outcomes. Returns the largest number of rows in one step.
fn drive(s: &mut Scheduler<'_>, cases: &mut [Case]) -> usize {
    let mut most_rows = 0;
    for step in 0..10_000 {
        for c in cases.iter_mut() {
            if c.join == step {
                c.handle = Some(s.submit(request(&c.ids, &c.opts, c.draft)).unwrap());
            }
            if c.cancel == Some(step) {
                c.handle.as_ref().unwrap().cancel();
            }
        }
        let report = s.step();
        most_rows = most_rows.max(report.rows);
        for c in cases.iter_mut() {
            let Some(h) = c.handle.as_ref() else { continue };
            while let Some(e) = h.try_recv() {
                match e {
                    Event::Tokens { ids, .. } => c.streamed.extend(ids),
                    Event::Done(o) => c.outcome = Some(*o),
                    Event::Error(e) => panic!("request failed: {e}"),
                }
            }
        }
        if cases.iter().all(|c| c.outcome.is_some()) {
            assert!(s.is_idle());
            return most_rows;
        }
    }
    panic!("the scheduler did not finish");
}

fn check(m: &Models, cases: &[Case]) {
    for (i, c) in cases.iter().enumerate() {
        let o = c.outcome.as_ref().unwrap();
        assert_eq!(o.generation.tokens, c.streamed, "case {i}: streamed tokens differ from the outcome");
        let alone = solo(m, &c.ids, &c.opts, c.draft);
        if c.cancel.is_some() && o.cancelled {
            assert!(
                alone.starts_with(&o.generation.tokens),
                "case {i}: a cancelled request's tokens are a prefix of its solo run"
            );
            assert!(o.generation.tokens.len() < alone.len(), "case {i} was cancelled after it ended");
        } else {
            assert_eq!(
                o.generation.tokens, alone,
                "case {i} ({:?}, draft {:?}) differs from its solo run",
                c.opts.sampling, c.draft
            );
        }
    }
}

fn case(ids: Vec<u32>, opts: GenerateOptions, draft: Option<DraftLength>, join: usize, cancel: Option<usize>) -> Case {
    Case { ids, opts, draft, join, cancel, handle: None, streamed: Vec::new(), outcome: None }
}

fn request(ids: &[u32], opts: &GenerateOptions, draft: Option<DraftLength>) -> Request {
    Request {
        prompt: Prompt::Ids(ids.to_vec()),
        opts: opts.clone(),
        stop: Vec::new(),
        show_thinking: false,
        draft: draft.map(DraftPolicy::from),
        trace: false,
    }
}

/// Submit every case now (instead of at its join step).
fn submit_all(s: &mut Scheduler<'_>, cases: &mut [Case]) {
    for c in cases.iter_mut() {
        c.join = usize::MAX;
        c.handle = Some(s.submit(request(&c.ids, &c.opts, c.draft)).unwrap());
    }
}

#[test]
fn sixteen_requests_on_the_shipped_pair_equal_their_solo_runs() {
    let m = models(shipped_dir().join("target"), Some(shipped_dir().join("assistant")));
    let prompts = heldout_prompts();
    let drafts = [
        None,
        Some(DraftLength::Fixed(1)),
        Some(DraftLength::Fixed(3)),
        Some(DraftLength::Fixed(5)),
        Some(DraftLength::Auto),
    ];
    let mut cases = Vec::new();
    for i in 0..18 {
        let ids: Vec<u32> = prompts[i % prompts.len()].iter().copied().take(4 + (i * 7) % 40).collect();
        let greedy = i % 3 != 2;
        let (sampling, draft) = if greedy {
            (SamplingParams::default(), drafts[i % drafts.len()])
        } else {
            // Seeded sampling: drafting off or a fixed k (auto's k depends on load).
            (sampled(i as u64), [None, Some(DraftLength::Fixed(3)), Some(DraftLength::Fixed(2))][i % 3])
        };
        let cancel = (i % 7 == 3).then_some(6 + i);
        cases.push(case(ids, opts(&m, 20 + (i % 5) * 6, sampling), draft, (i % 4) * 3, cancel));
    }
    let limits = Limits { prefill_rows: 64, ..limits() };
    let mut s = Scheduler::new(&m, limits);
    let most = drive(&mut s, &mut cases);
    assert!(most > 8, "requests shared forwards (at most {most} rows per step)");
    check(&m, &cases);
    assert!(cases.iter().any(|c| c.outcome.as_ref().unwrap().cancelled), "some requests were cancelled mid-stream");
    let accepted: usize =
        cases.iter().filter_map(|c| c.outcome.as_ref().unwrap().spec.as_ref()).map(|s| s.accepted_tokens).sum();
    assert!(accepted > 50, "the trained drafter was accepted under load ({accepted} drafts)");
}

#[test]
fn fixtures_with_moe_and_both_drafter_heads_equal_their_solo_runs() {
    for (target, assistant) in [
        ("t1-f32", Some("d1-centroid")),
        ("t1-f32", Some("d2-tied")),
        ("t2-moe", None),
        ("t5-e2b", None),
        ("t1-bf16", None),
    ] {
        let m = models(fixture_dir(target), assistant.map(fixture_dir));
        let vocab = m.target.cfg.vocab_size;
        let mut cases = Vec::new();
        for i in 0..8 {
            let draft = if m.assistant.is_some() {
                [None, Some(DraftLength::Fixed(2)), Some(DraftLength::Fixed(4)), Some(DraftLength::Auto)][i % 4]
            } else {
                None
            };
            let sampling = if i % 2 == 0 { SamplingParams::default() } else { sampled(100 + i as u64) };
            let draft =
                if i % 2 == 1 && draft == Some(DraftLength::Auto) { Some(DraftLength::Fixed(3)) } else { draft };
            // Prompts on both sides of the sliding window (8 tokens in the fixtures).
            cases.push(case(prompt(vocab, 3 + i * 5, i as u64 + 7), opts(&m, 12 + i, sampling), draft, i % 3, None));
        }
        let mut s = Scheduler::new(&m, Limits { prefill_rows: 16, ..limits() });
        drive(&mut s, &mut cases);
        check(&m, &cases);
    }
}

#[test]
fn a_burst_of_requests_is_prefilled_in_one_forward_and_then_decodes_together() {
    let m = models(fixture_dir("t1-f32"), None);
    let vocab = m.target.cfg.vocab_size;
    let mut cases: Vec<Case> = (0..8)
        .map(|i| case(prompt(vocab, 40 + i, 40 + i as u64), opts(&m, 6, SamplingParams::default()), None, 0, None))
        .collect();
    // The default limits: nothing decodes yet, so the whole burst (348 rows, more than one prompt's
    // prefill chunk) fits the idle prefill budget.
    let mut s = Scheduler::new(&m, Limits::default());
    submit_all(&mut s, &mut cases);
    let first = s.step();
    assert_eq!((first.rows, first.sequences), ((40..48).sum(), 8), "every prompt in the first forward");
    let second = s.step();
    assert_eq!((second.rows, second.sequences), (8, 8), "all eight decode from the second step on");
    drive(&mut s, &mut cases);
    check(&m, &cases);
}

#[test]
fn a_short_request_next_to_a_long_prompt_gets_its_first_token_early_but_the_long_one_advances() {
    let m = models(fixture_dir("t1-f32"), None);
    let vocab = m.target.cfg.vocab_size;
    let first_token_after = |budget: usize| -> usize {
        let mut cases = vec![
            case(prompt(vocab, 200, 1), opts(&m, 5, SamplingParams::default()), None, 0, None),
            case(prompt(vocab, 10, 2), opts(&m, 5, SamplingParams::default()), None, 0, None),
        ];
        let mut s = Scheduler::new(&m, Limits { prefill_rows: budget, ..limits() });
        submit_all(&mut s, &mut cases);
        let mut steps = 0;
        let mut got = false;
        while !got {
            assert!(steps < 100, "the short request never got a token");
            let r = s.step();
            steps += 1;
            if steps == 1 {
                assert_eq!(r.rows, budget, "the whole budget is used");
            }
            while let Some(e) = cases[1].handle.as_ref().unwrap().try_recv() {
                match e {
                    Event::Tokens { ids, .. } => {
                        got = true;
                        cases[1].streamed.extend(ids);
                    }
                    Event::Done(o) => cases[1].outcome = Some(*o),
                    Event::Error(e) => panic!("{e}"),
                }
            }
        }
        drive(&mut s, &mut cases);
        check(&m, &cases);
        steps
    };
    // 64 rows: the long prompt, admitted first, keeps 8; the short one takes its 10 and has its first
    // token after the first step (in order of arrival it would wait for the 200 rows: 4 steps).
    assert_eq!(first_token_after(64), 1);
    // 12 rows: the long prompt's 8 go first every step, so the short one's 10 rows take three steps
    // of 4 (shortest first alone would give it 10 in the first).
    assert_eq!(first_token_after(12), 3);
}

#[test]
fn the_queue_and_the_kv_budget_hold_requests_until_they_fit() {
    let m = models(fixture_dir("t1-f32"), None);
    let vocab = m.target.cfg.vocab_size;
    // At most two at once: the third waits, then runs, and all equal their solo runs.
    let mut cases: Vec<Case> = (0..3)
        .map(|i| case(prompt(vocab, 5 + i, i as u64), opts(&m, 10, SamplingParams::default()), None, 0, None))
        .collect();
    let mut s = Scheduler::new(&m, Limits { max_active: 2, ..limits() });
    submit_all(&mut s, &mut cases);
    s.step();
    assert_eq!(s.load(), (1, 2), "two run, one waits");
    drive(&mut s, &mut cases);
    check(&m, &cases);

    // A budget that fits one reservation at a time serialises the requests.
    let one = {
        let mut probe = Scheduler::new(&m, Limits { pool: 0, ..limits() });
        let _h = probe.submit(request(&prompt(vocab, 8, 1), &opts(&m, 10, SamplingParams::default()), None)).unwrap();
        probe.step();
        probe.kv_in_use()
    };
    assert!(one > 0);
    let mut s = Scheduler::new(&m, Limits { kv_bytes: one + one / 2, pool: 0, ..limits() });
    let mut cases: Vec<Case> =
        (0..3).map(|i| case(prompt(vocab, 8, 1 + i), opts(&m, 10, SamplingParams::default()), None, 0, None)).collect();
    submit_all(&mut s, &mut cases);
    s.step();
    assert_eq!(s.load(), (2, 1), "only one reservation fits the budget");
    drive(&mut s, &mut cases);
    check(&m, &cases);

    // A request larger than the whole budget is refused at submission.
    let mut s = Scheduler::new(&m, Limits { kv_bytes: one / 4, ..limits() });
    let e = s
        .submit(request(&prompt(vocab, 8, 1), &opts(&m, 10, SamplingParams::default()), None))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("bytes of K/V") && e.contains("budget"), "{e}");
}

#[test]
fn a_finished_sequence_lends_its_prefix_to_the_next_request() {
    let m = models(shipped_dir().join("target"), Some(shipped_dir().join("assistant")));
    let p = heldout_prompts()[0].clone();
    let o = opts(&m, 16, SamplingParams::default());
    let mut s = Scheduler::new(&m, limits());
    let mut first = vec![case(p.clone(), o.clone(), Some(DraftLength::Fixed(3)), 0, None)];
    drive(&mut s, &mut first);
    // The next turn starts with the whole first exchange.
    let mut next_ids = p.clone();
    next_ids.extend(&first[0].outcome.as_ref().unwrap().generation.tokens);
    next_ids.extend(&p[1..6]);
    let mut second = vec![case(next_ids, o, Some(DraftLength::Fixed(3)), 0, None)];
    drive(&mut s, &mut second);
    let g = &second[0].outcome.as_ref().unwrap().generation;
    assert!(
        g.stats.cached_prompt_tokens >= p.len(),
        "reused {} of {} prompt tokens",
        g.stats.cached_prompt_tokens,
        p.len()
    );
    check(&m, &second);
}

#[test]
fn seeded_sampling_with_auto_under_load_keeps_the_plain_distribution() {
    // With `auto`, a sampled request's k depends on the load, so its tokens may differ from a solo run;
    // their distribution must not. 2400 requests, 24 at a time, against the exact marginals.
    // t1-bf16 with d4-trained, a drafter fitted to its greedy picks (often accepted), after a prompt that
    // ends in 16 of the target's own greedy tokens (what the drafter was trained on). Tiny, so this runs
    // fast on the scalar kernels too.
    let m = models(fixture_dir("t1-bf16"), Some(fixture_dir("d4-trained")));
    let mut prompt: Vec<u32> = vec![2, 17, 33, 90, 121, 7, 64, 200];
    prompt.extend(generate(&m.target, &prompt, &opts(&m, 16, SamplingParams::default()), |_| {}).unwrap().tokens);
    let params = SamplingParams { temperature: 0.7, top_k: 6, ..SamplingParams::default() };
    let (m1, m2) = stats::exact_marginals(&m.target, &prompt, &params);
    let n = 2400;
    // Step costs from a fixed model in which rows are cheap next to the weights (the memory-bound shape
    // that makes drafting pay), so that how often `auto` drafts does not depend on the machine's load.
    let mut s = Scheduler::new(&m, Limits { clock: CHEAP_ROWS, ..limits() });
    let mut counts = (std::collections::HashMap::new(), std::collections::HashMap::new());
    let mut drafted = 0;
    for batch in 0..n / 24 {
        let mut cases: Vec<Case> = (0..24)
            .map(|i| {
                let seed = (batch * 24 + i) as u64;
                // Mixed company: some requests are longer, some draft a fixed k, so every auto request
                // chooses its k under a different load.
                let o = opts(&m, if i % 3 == 0 { 8 } else { 3 }, SamplingParams { seed, ..params.clone() });
                let draft = if i % 4 == 1 { DraftLength::Fixed(1 + i % 3) } else { DraftLength::Auto };
                case(prompt.clone(), o, Some(draft), i % 4, None)
            })
            .collect();
        submit_all(&mut s, &mut cases);
        drive(&mut s, &mut cases);
        for c in &cases {
            let o = c.outcome.as_ref().unwrap();
            let t = &o.generation.tokens;
            *counts.0.entry(t[1]).or_insert(0) += 1;
            *counts.1.entry(t[2]).or_insert(0) += 1;
            if c.draft == Some(DraftLength::Auto) {
                drafted += o.spec.as_ref().map_or(0, |sp| sp.drafted_tokens);
            }
        }
    }
    assert!(drafted > 20, "auto drafted under load ({drafted} drafts)");
    for (i, (c, e)) in [(&counts.0, &m1), (&counts.1, &m2)].into_iter().enumerate() {
        let (stat, crit) = stats::chi_square(c, e, n);
        println!("token {}: chi2 {stat:.1} (critical {crit:.1})", i + 1);
        assert!(stat < crit, "token {} under load differs from plain sampling: chi2 {stat} >= {crit}", i + 1);
    }
}

#[test]
fn auto_under_load_drafts_as_the_step_costs_say() {
    // The same eight greedy `auto` requests under two cost models: where rows are cheap next to the
    // weights the scheduler drafts deep; where every row costs as much as the weights and a draft step
    // as much as a forward, drafts cannot pay and it drafts little (a probe now and then). The tokens are
    // the same either way.
    let m = models(fixture_dir("t1-bf16"), Some(fixture_dir("d4-trained")));
    let mut base: Vec<u32> = vec![2, 17, 33, 90, 121, 7, 64, 200];
    base.extend(generate(&m.target, &base, &opts(&m, 16, SamplingParams::default()), |_| {}).unwrap().tokens);
    let dear = StepClock::Model { forward_base: 1e-3, forward_row: 1e-3, draft_base: 2e-3, draft_row: 1e-3 };
    let run = |clock: StepClock| {
        let mut s = Scheduler::new(&m, Limits { clock, ..limits() });
        let mut cases: Vec<Case> = (0..8)
            .map(|i| {
                let mut ids = base.clone();
                ids.truncate(base.len() - i);
                case(ids, opts(&m, 24, SamplingParams::default()), Some(DraftLength::Auto), 0, None)
            })
            .collect();
        submit_all(&mut s, &mut cases);
        drive(&mut s, &mut cases);
        let drafted: usize =
            cases.iter().map(|c| c.outcome.as_ref().unwrap().spec.as_ref().map_or(0, |sp| sp.drafted_tokens)).sum();
        let accepted: usize =
            cases.iter().map(|c| c.outcome.as_ref().unwrap().spec.as_ref().map_or(0, |sp| sp.accepted_tokens)).sum();
        println!("{clock:?}: {drafted} drafted, {accepted} accepted");
        let tokens: Vec<Vec<u32>> =
            cases.iter().map(|c| c.outcome.as_ref().unwrap().generation.tokens.clone()).collect();
        (drafted, tokens)
    };
    let (cheap_drafts, cheap_tokens) = run(CHEAP_ROWS);
    let (dear_drafts, dear_tokens) = run(dear);
    println!("drafts: {cheap_drafts} with cheap rows, {dear_drafts} with dear ones");
    assert_eq!(cheap_tokens, dear_tokens, "greedy tokens depend on the draft lengths");
    assert!(cheap_drafts >= 4 * dear_drafts.max(8), "cheap rows: {cheap_drafts} drafts; dear rows: {dear_drafts}");
}
