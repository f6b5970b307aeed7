//! The engine: a target model, its optional assistant, tokenizer and chat template, and a scheduler that
//! runs many requests at once (docs/engine.md).
//!
//! One scheduler owns the model. Each step packs rows of every active sequence into one target forward
//! (prefill chunks of newcomers, one row for a sequence decoding without drafts, `1 + k` rows for one
//! verifying `k` drafts), after one batched draft step per draft position for the sequences that draft.
//! Requests join and leave between steps. Every decision about a request's tokens is made by its own
//! [`Sequence`] (its own sampler and RNG, its own draft policy) and every kernel gives a row the same bits
//! whatever it is batched with, so a request's output does not depend on the company it keeps.
//!
//! [`Engine`] runs the scheduler on its own thread; [`Scheduler`] is the same thing advanced by hand, one
//! step at a time (tests use it to make joins, leaves and cancellations happen at chosen steps).

mod plan;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use serde_json::json;

use crate::config::{KvMode, LayerType};
use crate::decode::draft_policy::{DraftLength, DraftPolicy, AUTO_MAX_DRAFT, CONFIDENT_EXTRA, MAX_DRAFT};
use crate::decode::generate::{Flow, GenerateOptions, Generation, TokenLogprob, PREFILL_CHUNK};
use crate::decode::sequence::{Phase, Sequence};
use crate::decode::speculative::{Drafter, SpecStats};
use crate::model::assistant::Assistant;
use crate::model::cache::MAX_ROLLBACK;
use crate::model::{Forward, Keep, KvCache, SeqInput, TargetModel};
use crate::text::{ChatTemplate, RenderOptions, TextStream, TextTokenizer};

/// What the engine runs: loaded once, shared read-only by the scheduler and by callers preparing requests.
pub struct Models {
    pub target: TargetModel,
    pub assistant: Option<Assistant>,
    pub tokenizer: Option<TextTokenizer>,
    pub template: Option<ChatTemplate>,
}

/// A request's prompt.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Token ids as given.
    Ids(Vec<u32>),
    /// Raw text, tokenized with the tokenizer's special tokens (BOS) as transformers' `tokenizer(text)`.
    Text(String),
    /// Chat messages (a JSON list) through the chat template, with the reply's opening; `thinking` sets
    /// the template's `enable_thinking`.
    Chat { messages: serde_json::Value, thinking: bool },
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Prompt,
    /// Budget, sampling (with its seed), end-of-sequence handling, log-probabilities, context limit.
    pub opts: GenerateOptions,
    /// Stop strings (need a tokenizer).
    pub stop: Vec<String>,
    /// Keep thinking blocks in the streamed text.
    pub show_thinking: bool,
    /// Drafting: `None` decodes plainly; a policy (fixed k, or `auto` with what it learned so far) drafts
    /// with the engine's assistant. The final event hands the policy back, so a session can keep it.
    pub draft: Option<DraftPolicy>,
    /// Record every draft round in the statistics.
    pub trace: bool,
}

/// What a request's handle receives, in order: `Tokens` as they are committed, then one `Done` (or one
/// `Error`).
#[derive(Debug)]
pub enum Event {
    Tokens {
        ids: Vec<u32>,
        /// The text these tokens add (stop strings cut, thinking hidden unless asked for); empty without
        /// a tokenizer.
        text: String,
        /// With `top_logprobs`: one entry per id.
        logprobs: Vec<TokenLogprob>,
    },
    Done(Box<Outcome>),
    Error(String),
}

/// The end of a request.
#[derive(Debug)]
pub struct Outcome {
    pub prompt_ids: Vec<u32>,
    pub generation: Generation,
    /// Drafting statistics, when the request drafted.
    pub spec: Option<SpecStats>,
    /// The whole text (up to a stop string, thinking included), with a tokenizer.
    pub text: Option<String>,
    /// Ended by a stop string.
    pub stop_string: bool,
    /// The text ends inside a thinking block that was hidden.
    pub inside_thinking: bool,
    pub cancelled: bool,
    /// The request's draft policy, with what `auto` learned.
    pub draft: Option<DraftPolicy>,
}

/// A submitted request: its events, and a way to cancel it (within one scheduler step).
pub struct Handle {
    events: mpsc::Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Handle {
    /// The next event; `None` once the request is over and its events are drained.
    pub fn recv(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    pub fn try_recv(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }

    pub fn recv_timeout(&self, wait: std::time::Duration) -> Result<Event, mpsc::RecvTimeoutError> {
        self.events.recv_timeout(wait)
    }

    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// A flag that cancels the request when set (for a signal handler).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// A handle that replays `events` and is then over: a scripted request, for testing code that reads
    /// handles (the server's tool-call and thinking paths, which the shipped pair never exercises).
    pub fn replay(events: Vec<Event>) -> Handle {
        let (tx, rx) = mpsc::channel();
        for e in events {
            let _ = tx.send(e);
        }
        Handle { events: rx, cancel: Arc::new(AtomicBool::new(false)) }
    }

    /// Wait for the end: the outcome, or the request's error.
    pub fn wait(self) -> Result<Outcome> {
        while let Some(e) = self.recv() {
            match e {
                Event::Tokens { .. } => {}
                Event::Done(o) => return Ok(*o),
                Event::Error(e) => bail!(e),
            }
        }
        bail!("the engine stopped before the request ended")
    }
}

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Sequences decoding at once; more wait in the queue.
    pub max_active: usize,
    /// Prompt rows all newcomers together may add to one step when no sequence is decoding, and at most
    /// `PREFILL_CHUNK` (256) per newcomer: a burst of requests arriving together is prefilled in one
    /// forward where it fits, so that they all start decoding at once, while a single long prompt goes
    /// in steps of 256 rows.
    pub prefill_rows: usize,
    /// The most prompt rows while other sequences decode. Within it, a step takes only as many as keep
    /// it under `busy_step_ratio` times the decoding rows' own cost (measured; the ratio grows with the
    /// number of newcomers per decoding sequence), so that running streams keep their pace while a long
    /// prompt joins (docs/engine.md, "Prefill next to decoding"). Before a prompt row's cost is known,
    /// [`MIN_BUSY_PREFILL_ROWS`].
    pub prefill_rows_busy: usize,
    /// See `prefill_rows_busy`; at least [`MIN_BUSY_PREFILL_ROWS`] prompt rows go into every step.
    /// `f64::INFINITY`: `prefill_rows_busy` once a prompt row was measured (chunks that do not depend on timing).
    pub busy_step_ratio: f64,
    /// Bytes of K/V the sequences (and the pool of finished ones) may hold. A request reserves its prompt
    /// plus its `max_new_tokens` at admission and waits until that fits.
    pub kv_bytes: usize,
    /// Finished sequences' caches kept for prefix reuse (they count in `kv_bytes` and go first).
    pub pool: usize,
    /// A pause after every step of [`Engine`]'s thread (a test hook: lets a test interrupt a reply).
    pub step_delay: Option<std::time::Duration>,
    /// Where the step costs that steer `auto` and the prefill chunks come from.
    pub clock: StepClock,
}

/// The source of the step costs the scheduler plans with (docs/engine.md, "Draft length under load").
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum StepClock {
    /// The wall-clock time of each forward and draft step.
    #[default]
    Measured,
    /// A fixed cost model instead (a test hook): a forward over `r` rows takes `forward_base + r ·
    /// forward_row` seconds and a draft step for `b` sequences `draft_base + b · draft_row`, so that
    /// `auto`'s choices depend on the acceptance seen and not on how busy the machine is.
    Model { forward_base: f64, forward_row: f64, draft_base: f64, draft_row: f64 },
}

impl StepClock {
    /// The cost of a forward over `rows` rows that took `measured` seconds.
    fn forward(self, rows: usize, measured: f64) -> f64 {
        match self {
            StepClock::Measured => measured,
            StepClock::Model { forward_base, forward_row, .. } => forward_base + rows as f64 * forward_row,
        }
    }

    /// The cost of a draft step for `batch` sequences that took `measured` seconds.
    fn draft(self, batch: usize, measured: f64) -> f64 {
        match self {
            StepClock::Measured => measured,
            StepClock::Model { draft_base, draft_row, .. } => draft_base + batch as f64 * draft_row,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_active: 64,
            prefill_rows: IDLE_PREFILL_ROWS,
            prefill_rows_busy: PREFILL_CHUNK,
            busy_step_ratio: 1.5,
            kv_bytes: 8 << 30,
            pool: 4,
            step_delay: None,
            clock: StepClock::Measured,
        }
    }
}

impl Models {
    /// A draft policy for a setting, with this engine's assistant: `None` when there is no assistant or
    /// drafting is off; the default is the drafter's `num_assistant_tokens`, else `auto`.
    pub fn draft_policy(&self, setting: Option<DraftLength>) -> Option<DraftPolicy> {
        let a = self.assistant.as_ref()?;
        let len = setting.unwrap_or(match a.cfg.num_assistant_tokens {
            Some(k) => DraftLength::Fixed(k.min(MAX_DRAFT)),
            None => DraftLength::Auto,
        });
        Some(len.into())
    }

    /// The prompt's token ids (text through the tokenizer, chat through the template), checked against
    /// the model's vocabulary.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let tokenizer =
            || self.tokenizer.as_ref().ok_or_else(|| anyhow!("text prompts need a tokenizer; use token ids"));
        let ids = match prompt {
            Prompt::Ids(ids) => return Ok(ids.clone()),
            Prompt::Text(text) => tokenizer()?.encode(text, true)?,
            Prompt::Chat { messages, thinking } => {
                let tok = tokenizer()?;
                let template = self.template.as_ref().ok_or_else(|| {
                    anyhow!(
                        "{} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)",
                        tok.dir().display()
                    )
                })?;
                let mut opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
                if *thinking {
                    opts.extra.insert("enable_thinking".into(), json!(true));
                }
                let text = template.render(messages, tok.special_tokens(), &opts)?;
                tok.encode(&text, false)?
            }
        };
        let vocab = self.target.cfg.vocab_size;
        if let (Some(&id), Some(tok)) = (ids.iter().find(|&&t| t as usize >= vocab), self.tokenizer.as_ref()) {
            let text = tok.id_to_token(id).unwrap_or_default();
            let named = tok
                .special_tokens()
                .iter()
                .find(|(_, v)| *v == text)
                .map(|(k, _)| format!(" (the tokenizer's {k})"))
                .unwrap_or_default();
            bail!("the prompt contains token {text:?}{named}, id {id}, which is beyond the model's vocabulary of {vocab} tokens");
        }
        Ok(ids)
    }

    /// Check a request and build its sequence (errors here are the request's, before it is queued).
    pub fn prepare(&self, req: Request) -> Result<Prepared> {
        if !req.stop.is_empty() && self.tokenizer.is_none() {
            bail!("stop strings need a tokenizer");
        }
        if req.draft.is_some() && self.assistant.is_none() {
            bail!("drafting needs an assistant");
        }
        let prompt_ids = self.prompt_ids(&req.prompt)?;
        let seq = Sequence::new(&self.target, &prompt_ids, &req.opts, req.draft.as_ref(), req.trace)?;
        Ok(Prepared { seq, prompt_ids, req })
    }

    /// K/V bytes one position costs in every cached layer (sliding layers hold at most their window
    /// plus what rollbacks need, twice over before they trim).
    fn kv_bytes(&self, positions: usize) -> usize {
        let cfg = &self.target.cfg;
        let elem = if self.target.dtype == crate::kernels::DType::BF16 { 2 } else { 4 };
        let sliding_cap = 2 * (cfg.sliding_window + 1 + MAX_ROLLBACK);
        cfg.layers
            .iter()
            .filter(|l| l.kv_mode != KvMode::Reuse)
            .map(|l| {
                let n = if l.kind == LayerType::Sliding { positions.min(sliding_cap) } else { positions };
                2 * n * l.kv_heads * l.head_dim * elem
            })
            .sum()
    }
}

/// A checked request, ready to queue.
pub struct Prepared {
    seq: Sequence,
    prompt_ids: Vec<u32>,
    req: Request,
}

/// A sequence being decoded.
struct Active<'m> {
    seq: Sequence,
    cache: KvCache,
    policy: Option<DraftPolicy>,
    stream: Option<TextStream<'m>>,
    stream_err: Option<String>,
    prompt_ids: Vec<u32>,
    reserved: usize,
    tx: mpsc::Sender<Event>,
    cancel: Arc<AtomicBool>,
    /// `auto` rounds since this sequence last drafted, and rounds in all (for probes).
    idle_rounds: usize,
    rounds: usize,
    /// Log-probabilities already sent in `Tokens` events (the sequence records them when it absorbs a
    /// forward, before its tokens are committed).
    logprobs_sent: usize,
    /// Its number in the order of admission.
    admitted: u64,
}

/// `auto` rounds without drafting after which a sequence drafts one token, to refresh its estimates;
/// and every this many rounds a drafting one tries one draft more than chosen.
const PROBE_IDLE_EVERY: usize = 32;
/// Prompt rows a step next to decoding sequences takes at least, whatever the costs (see
/// [`Limits::prefill_rows_busy`]): a joining prompt always advances.
pub const MIN_BUSY_PREFILL_ROWS: usize = 8;
/// [`Limits::prefill_rows`] by default: eight 128-token prompts, or four newcomers' prompt chunks
/// (`PREFILL_CHUNK`), in one forward.
pub const IDLE_PREFILL_ROWS: usize = 4 * PREFILL_CHUNK;
const PROBE_LONGER_EVERY: usize = 16;

struct Waiting {
    prepared: Prepared,
    tx: mpsc::Sender<Event>,
    cancel: Arc<AtomicBool>,
}

/// What one step did, for tests and benchmarks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Rows in the step's target forward.
    pub rows: usize,
    /// Sequences in it.
    pub sequences: usize,
    /// Draft steps run (each one batched over the sequences drafting that deep).
    pub draft_steps: usize,
    /// Requests that ended in this step.
    pub finished: usize,
}

/// The scheduler, advanced with [`Scheduler::step`].
pub struct Scheduler<'m> {
    models: &'m Models,
    limits: Limits,
    waiting: VecDeque<Waiting>,
    active: Vec<Active<'m>>,
    /// Finished caches for prefix reuse, oldest first, with their sizes in bytes.
    pool: Vec<(KvCache, usize)>,
    /// Measured forward and draft-step costs, for choosing `auto` draft lengths across the batch.
    costs: plan::Costs,
    /// What every `auto` request taught about the drafter's acceptance: a new `auto` request starts from
    /// it instead of from nothing (a useless drafter is not re-tried by every request).
    shared_auto: DraftPolicy,
    /// Planned steps since an `auto` sequence last drafted: past `PROBE_IDLE_EVERY`, every `auto`
    /// sequence of the next plan drafts one token, so that a drafter that looked useless to short
    /// requests (which never reach their own probe) is tried again.
    auto_idle_steps: usize,
    /// Requests admitted so far (each `Active` keeps its number: the order of arrival).
    admitted: u64,
}

impl<'m> Scheduler<'m> {
    pub fn new(models: &'m Models, limits: Limits) -> Scheduler<'m> {
        Scheduler {
            models,
            limits,
            waiting: VecDeque::new(),
            active: Vec::new(),
            pool: Vec::new(),
            costs: plan::Costs::default(),
            shared_auto: DraftLength::Auto.into(),
            auto_idle_steps: 0,
            admitted: 0,
        }
    }

    /// Check and queue a request.
    pub fn submit(&mut self, req: Request) -> Result<Handle> {
        let prepared = self.models.prepare(req)?;
        self.enqueue(prepared)
    }

    /// Queue a prepared request; one whose reservation exceeds the whole K/V budget is an error.
    pub fn enqueue(&mut self, prepared: Prepared) -> Result<Handle> {
        let need = self.models.kv_bytes(prepared.seq.reserved_positions());
        if need > self.limits.kv_bytes {
            bail!(
                "the request needs {need} bytes of K/V (prompt {} + up to {} new tokens) but the engine's budget is {}",
                prepared.prompt_ids.len(),
                prepared.req.opts.max_new_tokens,
                self.limits.kv_bytes
            );
        }
        let (tx, events) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        self.waiting.push_back(Waiting { prepared, tx, cancel: cancel.clone() });
        Ok(Handle { events, cancel })
    }

    /// Requests waiting for admission, and sequences running.
    pub fn load(&self) -> (usize, usize) {
        (self.waiting.len(), self.active.len())
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// K/V bytes reserved by running sequences plus those held by the pool.
    pub fn kv_in_use(&self) -> usize {
        self.active.iter().map(|a| a.reserved).sum::<usize>() + self.pool.iter().map(|p| p.1).sum::<usize>()
    }

    /// Admit waiting requests while they fit (evicting pooled caches first), in arrival order.
    fn admit(&mut self) {
        while let Some(w) = self.waiting.front() {
            if w.cancel.load(Ordering::SeqCst) {
                let w = self.waiting.pop_front().expect("front exists");
                let mut seq = w.prepared.seq;
                seq.finish();
                let _ = w.tx.send(done(seq, w.prepared.prompt_ids, None, None, true));
                continue;
            }
            if self.active.len() >= self.limits.max_active {
                return;
            }
            let reserved = self.models.kv_bytes(w.prepared.seq.reserved_positions());
            let running: usize = self.active.iter().map(|a| a.reserved).sum();
            while running + reserved + self.pool.iter().map(|p| p.1).sum::<usize>() > self.limits.kv_bytes
                && !self.pool.is_empty()
            {
                self.pool.remove(0);
            }
            if running + reserved > self.limits.kv_bytes {
                return;
            }
            let w = self.waiting.pop_front().expect("front exists");
            let Prepared { mut seq, prompt_ids, req } = w.prepared;
            // The pooled cache sharing the longest prefix with the prompt, else a new one.
            let best = self
                .pool
                .iter()
                .enumerate()
                .map(|(i, (c, _))| (i, c.tokens().iter().zip(&prompt_ids).take_while(|(a, b)| a == b).count()))
                .max_by_key(|&(_, n)| n)
                .filter(|&(_, n)| n > 0);
            let mut cache = match best {
                Some((i, _)) => self.pool.remove(i).0,
                None => self.models.target.new_cache(),
            };
            seq.start(&mut cache);
            let stream = self.models.tokenizer.as_ref().map(|t| {
                let skip = if req.opts.ignore_eos { Vec::new() } else { self.models.target.cfg.eos_token_ids.clone() };
                TextStream::new(t, skip, req.stop.clone(), req.show_thinking)
            });
            let policy = match req.draft {
                Some(p) if p.is_fresh_auto() => Some(self.shared_auto.clone()),
                other => other,
            };
            self.active.push(Active {
                seq,
                cache,
                policy,
                stream,
                stream_err: None,
                prompt_ids,
                reserved,
                tx: w.tx,
                cancel: w.cancel,
                idle_rounds: 0,
                rounds: 0,
                logprobs_sent: 0,
                admitted: self.admitted,
            });
            self.admitted += 1;
        }
    }

    /// One step: admit, draft, one target forward over every sequence's rows, accept, stream, retire.
    pub fn step(&mut self) -> StepReport {
        self.admit();
        let mut report = StepReport::default();
        // Cancelled sequences leave now.
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].cancel.load(Ordering::SeqCst) {
                let a = self.active.swap_remove(i);
                self.retire(a, true);
                report.finished += 1;
            } else {
                i += 1;
            }
        }

        // Plan: prefill chunks within the step's budget, k for every sequence ready for a round.
        let ready = self.active.iter().filter(|a| a.seq.phase() == Phase::Ready).count();
        let prefilling = self.active.iter().filter(|a| a.seq.phase() == Phase::Prefill).count();
        let budget = if ready > 0 {
            // The decoding streams' pace weighs as much as the newcomers waiting for their first token:
            // with more newcomers than streams, the step may slow down in proportion.
            let l = &self.limits;
            let ratio = l.busy_step_ratio * (prefilling as f64 / ready as f64).max(1.0);
            self.costs.busy_prefill_rows(ready, ratio, MIN_BUSY_PREFILL_ROWS, l.prefill_rows_busy)
        } else {
            // One prompt chunk per newcomer: a burst is prefilled together, while a single long prompt
            // goes in steps short enough that a request arriving meanwhile is admitted soon.
            self.limits.prefill_rows.min(PREFILL_CHUNK.saturating_mul(prefilling.max(1)))
        };
        let mut plan: Vec<Option<(Vec<u32>, Keep)>> = vec![None; self.active.len()];
        for (i, rows) in self.prefill_shares(budget) {
            plan[i] = Some((self.active[i].seq.prefill_chunk(rows), Keep::Last));
        }
        let mut auto = Vec::new();
        for (i, a) in self.active.iter_mut().enumerate() {
            match a.seq.phase() {
                Phase::Ready if a.policy.as_ref().is_some_and(|p| p.auto().is_some()) => auto.push(i),
                Phase::Ready => {
                    a.seq.plan(a.policy.as_mut());
                }
                _ => {}
            }
        }
        self.plan_auto(&auto);

        // Draft: one batched step per draft position, over the sequences still drafting that deep.
        let mut failed: Vec<(usize, String)> = Vec::new();
        if let Some(assistant) = &self.models.assistant {
            for depth in 0.. {
                let drafting: Vec<usize> = (0..self.active.len())
                    .filter(|&i| self.active[i].seq.phase() == Phase::Ready && self.active[i].seq.drafts_wanted() > 0)
                    .filter(|&i| !failed.iter().any(|f| f.0 == i))
                    .collect();
                if drafting.is_empty() {
                    break;
                }
                let t = Instant::now();
                let steps = {
                    let rows: Vec<(&KvCache, u32, &[f32], usize)> = drafting
                        .iter()
                        .map(|&i| {
                            let a = &self.active[i];
                            let (token, h, p) = a.seq.draft_input();
                            (&a.cache, token, h, p)
                        })
                        .collect();
                    assistant.draft_batch(&self.models.target, &rows)
                };
                let elapsed = self.limits.clock.draft(drafting.len(), t.elapsed().as_secs_f64());
                self.costs.record_draft(drafting.len(), depth, elapsed);
                let secs = elapsed / drafting.len() as f64;
                report.draft_steps += 1;
                for (&i, step) in drafting.iter().zip(steps) {
                    if let Err(e) = self.active[i].seq.add_draft(step, secs) {
                        failed.push((i, format!("{e:#}")));
                    }
                }
                self.stop_unpaid_drafts(depth + 1, &failed);
            }
        }
        for a in self.active.iter().enumerate().filter(|(_, a)| a.seq.phase() == Phase::Ready) {
            if !failed.iter().any(|f| f.0 == a.0) {
                plan[a.0] = Some((a.1.seq.verify_rows(), Keep::All));
            }
        }

        // One forward over every planned row.
        let members: Vec<usize> = (0..self.active.len()).filter(|&i| plan[i].is_some()).collect();
        if !members.is_empty() {
            report.sequences = members.len();
            report.rows = members.iter().map(|&i| plan[i].as_ref().map_or(0, |p| p.0.len())).sum();
            let t = Instant::now();
            let result: Result<Vec<Forward>> = {
                let mut inputs: Vec<SeqInput<'_>> = Vec::with_capacity(members.len());
                for (i, a) in self.active.iter_mut().enumerate() {
                    if let Some((tokens, keep)) = &plan[i] {
                        inputs.push(SeqInput { cache: &mut a.cache, tokens, keep: *keep });
                    }
                }
                self.models.target.forward_batch(&mut inputs)
            };
            let secs = self.limits.clock.forward(report.rows, t.elapsed().as_secs_f64());
            // Only steps whose every row computes logits teach the cost of a row: a prefill chunk's rows
            // skip the output head, so steps holding one would make verify rows look cheaper than they are
            // (docs/engine.md, "Draft length under load").
            let prompt_rows: usize = plan.iter().flatten().filter(|p| p.1 == Keep::Last).map(|p| p.0.len()).sum();
            if prompt_rows == 0 {
                self.costs.record_forward(report.rows, secs);
            } else {
                self.costs.record_prefill(prompt_rows, report.rows - prompt_rows, secs);
            }
            match result {
                Ok(outs) => {
                    for (&i, out) in members.iter().zip(&outs) {
                        let (tokens, keep) = plan[i].as_ref().expect("planned");
                        let a = &mut self.active[i];
                        let r = match keep {
                            Keep::Last => a.seq.absorb_prefill(tokens.len(), out),
                            Keep::All => a.seq.absorb_verify(&mut a.cache, out, secs, a.policy.as_mut()),
                        };
                        if let (Keep::All, Some(p)) = (keep, a.policy.as_ref()) {
                            if r.is_ok() && p.auto().is_some() {
                                let (k, accepted, draft_s) = a.seq.last_round();
                                self.shared_auto.record(k, accepted, draft_s, secs);
                                self.shared_auto.record_confidences(a.seq.last_confidences(), accepted);
                            }
                        }
                        if let Err(e) = r {
                            failed.push((i, format!("{e:#}")));
                        }
                    }
                }
                Err(e) => failed.extend(members.iter().map(|&i| (i, format!("{e:#}")))),
            }
        }

        // Commit what each sequence decided; retire the ones that ended.
        for a in self.active.iter_mut() {
            if a.seq.phase() == Phase::Commit {
                let (stream, stream_err) = (&mut a.stream, &mut a.stream_err);
                let mut text = String::new();
                let ids = a.seq.commit(|ts| match stream.as_mut().map(|s| s.push(ts)) {
                    None => Flow::Continue,
                    Some(Ok(p)) => {
                        text = p.visible;
                        p.keep.map_or(Flow::Continue, Flow::StopAfter)
                    }
                    Some(Err(e)) => {
                        stream_err.get_or_insert(format!("cannot decode the output: {e:#}"));
                        Flow::StopAfter(ts.len())
                    }
                });
                let lp = &a.seq.generation().logprobs;
                let logprobs = lp[a.logprobs_sent.min(lp.len())..].to_vec();
                a.logprobs_sent = lp.len();
                if !ids.is_empty() || !text.is_empty() {
                    let _ = a.tx.send(Event::Tokens { ids, text, logprobs });
                }
            }
        }
        failed.sort_by_key(|f| std::cmp::Reverse(f.0));
        failed.dedup_by_key(|f| f.0);
        for (i, e) in failed {
            let a = self.active.swap_remove(i);
            let _ = a.tx.send(Event::Error(e));
            report.finished += 1;
        }
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].seq.phase() == Phase::Done {
                let a = self.active.swap_remove(i);
                self.retire(a, false);
                report.finished += 1;
            } else {
                i += 1;
            }
        }
        report
    }

    /// How a step's `budget` of prompt rows is shared among the prefilling sequences: `(index, rows)`.
    /// The prompts with the least left go first, so that a short request arriving next to a long prompt
    /// gets its first token without waiting for all of that prompt (and then decodes while the rest of
    /// it goes in chunks); but the earliest admitted of them always gets a share
    /// ([`MIN_BUSY_PREFILL_ROWS`]), so that a stream of short requests cannot hold a long one back for
    /// ever. Chunking never changes a result (docs/engine.md).
    fn prefill_shares(&self, budget: usize) -> Vec<(usize, usize)> {
        let mut order: Vec<usize> =
            (0..self.active.len()).filter(|&i| self.active[i].seq.phase() == Phase::Prefill).collect();
        let Some(&oldest) = order.iter().min_by_key(|&&i| self.active[i].admitted) else {
            return Vec::new();
        };
        // Stable: equal remainders in order of admission.
        order.sort_by_key(|&i| (self.active[i].seq.prefill_remaining(), self.active[i].admitted));
        let mut shares = vec![0usize; self.active.len()];
        let mut left = budget;
        let first = MIN_BUSY_PREFILL_ROWS.min(left).min(self.active[oldest].seq.prefill_remaining());
        shares[oldest] = first;
        left -= first;
        for &i in &order {
            let take = left.min(self.active[i].seq.prefill_remaining() - shares[i]);
            shares[i] += take;
            left -= take;
        }
        order.into_iter().filter(|&i| shares[i] > 0).map(|i| (i, shares[i])).collect()
    }

    /// Choose the k of every `auto` sequence in `auto` together (see `plan`), given what else the step
    /// holds; before the costs are known, each sequence's own policy chooses.
    fn plan_auto(&mut self, auto: &[usize]) {
        if auto.is_empty() {
            return;
        }
        // Prefill chunks are left out of the step's rows: they cost what they cost whatever the drafts,
        // and the measured costs are those of rows that compute logits (see `step`).
        let mut base_rows = 0;
        let mut base_tokens = 0.0;
        let mut fixed_depth: Vec<usize> = Vec::new();
        for a in self
            .active
            .iter()
            .filter(|a| a.seq.phase() == Phase::Ready && a.policy.as_ref().is_none_or(|p| p.auto().is_none()))
        {
            let k = a.seq.drafts_wanted();
            base_rows += 1 + k;
            base_tokens += 1.0;
            if fixed_depth.len() < k {
                fixed_depth.resize(k, 0);
            }
            fixed_depth.iter_mut().take(k).for_each(|n| *n += 1);
        }
        // A sequence's estimates start from what every request has measured of this drafter so far
        // (`shared_auto`), so that many requests starting together do not each explore a useless drafter
        // (here and in their own policies' choice below, before the step costs are known).
        if let Some(shared) = self.shared_auto.auto() {
            for &i in auto {
                if let Some(DraftPolicy::Auto(p)) = self.active[i].policy.as_mut() {
                    p.set_prior(shared);
                }
            }
        }
        let cands: Vec<plan::Candidate> = auto
            .iter()
            .map(|&i| {
                let a = &self.active[i];
                let auto = a.policy.as_ref().and_then(|p| p.auto());
                plan::Candidate {
                    rates: auto.map_or([0.0; AUTO_MAX_DRAFT], |p| p.rates()),
                    k_max: a.seq.draft_room(auto.map_or(AUTO_MAX_DRAFT, |p| p.depth_cap())),
                    probe: a.idle_rounds >= PROBE_IDLE_EVERY || self.auto_idle_steps >= PROBE_IDLE_EVERY,
                }
            })
            .collect();
        let chosen = plan::choose(&self.costs, base_rows, base_tokens, &fixed_depth, &cands);
        if let Some(ks) = &chosen {
            self.auto_idle_steps = if ks.iter().any(|&k| k > 0) { 0 } else { self.auto_idle_steps + 1 };
        }
        for (j, &i) in auto.iter().enumerate() {
            let a = &mut self.active[i];
            let k = match &chosen {
                Some(ks) => {
                    // One draft past the planned length: the confidence stop (`stop_unpaid_drafts`)
                    // ends the rounds where it would not pay (docs/engine.md, "Confidence under load").
                    let longer = ks[j] > 0 && a.rounds % PROBE_LONGER_EVERY == PROBE_LONGER_EVERY - 1;
                    let extra = if ks[j] > 0 { CONFIDENT_EXTRA + usize::from(longer) } else { 0 };
                    a.seq.begin_round((ks[j] + extra).min(cands[j].k_max))
                }
                None => a.seq.plan(a.policy.as_mut()),
            };
            a.rounds += 1;
            a.idle_rounds = if k == 0 { a.idle_rounds + 1 } else { 0 };
        }
    }

    /// After the draft step before draft position `depth`: the `auto` sequences whose next draft would
    /// not pay for itself stop drafting this round (`plan::keep_drafting`, from the drafter's confidence
    /// in their drafts so far; before the step costs are known, each sequence's own policy decides).
    fn stop_unpaid_drafts(&mut self, depth: usize, failed: &[(usize, String)]) {
        let ready: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].seq.phase() == Phase::Ready && !failed.iter().any(|f| f.0 == i))
            .collect();
        let (mut rows, mut fixed_next) = (0, 0);
        // (index, confidences so far, value of one more draft) of each `auto` sequence that may go on.
        let mut cands = Vec::new();
        for &i in &ready {
            let a = &self.active[i];
            let (confidences, wanted) = (a.seq.draft_confidences(), a.seq.drafts_wanted());
            let made = confidences.len();
            match a.policy.as_ref().and_then(|p| p.auto()) {
                Some(auto) => {
                    rows += 1 + made;
                    if wanted > 0 {
                        let value = auto.next_draft_value(&confidences);
                        cands.push((i, confidences, value));
                    }
                }
                None => {
                    rows += 1 + made + wanted;
                    fixed_next += usize::from(wanted > 0);
                }
            }
        }
        if cands.is_empty() {
            return;
        }
        let values: Vec<f64> = cands.iter().map(|c| c.2).collect();
        let keep =
            plan::keep_drafting(&self.costs, rows, ready.len(), fixed_next, depth, &values).unwrap_or_else(|| {
                cands
                    .iter()
                    .map(|(i, confidences, _)| {
                        self.active[*i].policy.as_ref().is_none_or(|p| p.keep_drafting(confidences))
                    })
                    .collect()
            });
        for ((i, _, _), k) in cands.iter().zip(keep) {
            if !k {
                self.active[*i].seq.stop_drafting();
            }
        }
    }

    /// A sequence ends: flush its text, send its outcome, pool its cache.
    fn retire(&mut self, mut a: Active<'m>, cancelled: bool) {
        if a.seq.phase() != Phase::Done {
            a.seq.finish();
        }
        let mut flush = String::new();
        if let Some(s) = a.stream.as_mut() {
            match s.finish() {
                Ok(rest) => flush = rest,
                Err(e) => {
                    a.stream_err.get_or_insert(format!("cannot decode the output: {e:#}"));
                }
            }
        }
        if !flush.is_empty() {
            let _ = a.tx.send(Event::Tokens { ids: Vec::new(), text: flush, logprobs: Vec::new() });
        }
        if let Some(e) = a.stream_err.take() {
            let _ = a.tx.send(Event::Error(e));
        } else {
            let _ = a.tx.send(done(a.seq, a.prompt_ids, a.stream.as_ref(), a.policy, cancelled));
        }
        if self.limits.pool > 0 && !a.cache.is_empty() {
            let bytes = self.models.kv_bytes(a.cache.len());
            self.pool.push((a.cache, bytes));
            if self.pool.len() > self.limits.pool {
                self.pool.remove(0);
            }
        }
    }
}

fn done(
    seq: Sequence,
    prompt_ids: Vec<u32>,
    stream: Option<&TextStream<'_>>,
    draft: Option<DraftPolicy>,
    cancelled: bool,
) -> Event {
    let (generation, spec) = seq.into_results();
    Event::Done(Box::new(Outcome {
        prompt_ids,
        generation,
        spec,
        text: stream.map(|s| s.text().to_string()),
        stop_string: stream.is_some_and(|s| s.stopped()),
        inside_thinking: stream.is_some_and(|s| s.inside_thinking()),
        cancelled,
        draft,
    }))
}

enum Msg {
    Submit(Box<Prepared>, mpsc::Sender<Result<Handle>>),
    Stop,
}

/// The scheduler on its own thread: submit from any thread, receive events on the handle.
pub struct Engine {
    models: Arc<Models>,
    tx: mpsc::Sender<Msg>,
    thread: Option<JoinHandle<()>>,
}

/// What the scheduler looks like after a step (for a server's metrics; docs/serve.md).
#[derive(Clone, Debug, Default)]
pub struct StepSnapshot {
    pub report: StepReport,
    /// Requests waiting for admission, and sequences running, after the step.
    pub waiting: usize,
    pub active: usize,
    /// K/V bytes reserved by running sequences plus those held by the pool.
    pub kv_in_use: usize,
}

/// Called on the scheduler thread after every step; it must be quick.
pub type StepObserver = Box<dyn FnMut(&StepSnapshot) + Send>;

impl Engine {
    pub fn start(models: Models, limits: Limits) -> Engine {
        Engine::start_observed(models, limits, None)
    }

    /// [`Engine::start`], with an observer that sees every step (and the idle state once work runs out).
    pub fn start_observed(models: Models, limits: Limits, mut observer: Option<StepObserver>) -> Engine {
        let models = Arc::new(models);
        let (tx, rx) = mpsc::channel::<Msg>();
        let m = models.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-scheduler".into())
            .spawn(move || {
                let delay = limits.step_delay;
                let mut s = Scheduler::new(&m, limits);
                loop {
                    // Block for work when idle; otherwise take what arrived and step.
                    let mut next = if s.is_idle() { rx.recv().ok() } else { rx.try_recv().ok() };
                    let idle = s.is_idle();
                    if idle && next.is_none() {
                        return; // every sender is gone
                    }
                    while let Some(msg) = next.take() {
                        match msg {
                            Msg::Submit(p, reply) => {
                                let _ = reply.send(s.enqueue(*p));
                            }
                            Msg::Stop => return,
                        }
                        next = rx.try_recv().ok();
                    }
                    let report = s.step();
                    if let Some(obs) = observer.as_mut() {
                        let (waiting, active) = s.load();
                        obs(&StepSnapshot { report, waiting, active, kv_in_use: s.kv_in_use() });
                    }
                    if let Some(d) = delay {
                        std::thread::sleep(d);
                    }
                }
            })
            .expect("spawn the scheduler thread");
        Engine { models, tx, thread: Some(thread) }
    }

    pub fn models(&self) -> &Models {
        &self.models
    }

    /// Check a request (in the caller's thread) and queue it.
    pub fn submit(&self, req: Request) -> Result<Handle> {
        let prepared = self.models.prepare(req)?;
        let (tx, rx) = mpsc::channel();
        self.tx.send(Msg::Submit(Box::new(prepared), tx)).map_err(|_| anyhow!("the engine has stopped"))?;
        rx.recv().map_err(|_| anyhow!("the engine has stopped"))?
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
