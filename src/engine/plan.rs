//! Draft lengths under load (docs/engine.md, "Draft length under load"): drafts compete with the other
//! sequences' rows for the flat part of the cost curve, so the engine chooses every `auto` sequence's k
//! together, from each one's measured acceptance per position and the measured cost of a forward by its
//! total row count and of a draft step by its batch size, for the most expected tokens per second of the
//! whole step.

use crate::decode::draft_policy::{timing_ema, AUTO_MAX_DRAFT};

/// Largest row count and draft batch whose costs are tracked (larger ones are extrapolated).
const MAX_ROWS: usize = 512;
const MAX_BATCH: usize = 128;

/// Measured step costs (exponential moving averages, seconds).
#[derive(Clone, Debug)]
pub struct Costs {
    forward: Table,
    /// The first draft step of a round, which finds the drafter's weights evicted by the target's
    /// forward, and the steps after it, which find them in cache.
    draft_first: Table,
    draft_more: Table,
    /// What one prompt row adds to a step (a prefill chunk's rows skip the output head).
    prefill_row: Option<f64>,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            forward: Table::new(MAX_ROWS),
            draft_first: Table::new(MAX_BATCH),
            draft_more: Table::new(MAX_BATCH),
            prefill_row: None,
        }
    }
}

/// Estimated times by row count (or batch size), with how many samples each has had.
#[derive(Clone, Debug)]
struct Table {
    est: Vec<Option<f64>>,
    samples: Vec<u32>,
}

impl Table {
    fn new(max: usize) -> Self {
        Table { est: vec![None; max + 1], samples: vec![0; max + 1] }
    }

    /// A count's first sample often carries one-time costs (buffers growing to a new row count, the
    /// weights' first touch), and the planner may not choose that count again for many rounds: a
    /// second sample below it replaces it. After that, `timing_ema`.
    fn record(&mut self, i: usize, x: f64) {
        if let (Some(slot), Some(n)) = (self.est.get_mut(i), self.samples.get_mut(i)) {
            *slot = Some(match *slot {
                Some(o) if *n == 1 && x < o => x,
                old => timing_ema(old, x),
            });
            *n = n.saturating_add(1);
        }
    }
}

fn ema(slot: &mut Option<f64>, x: f64) {
    *slot = Some(timing_ema(*slot, x));
}

/// The cost at `n` from the measured points: linear between the nearest below and above, else along the
/// slope of the two highest below; `None` before anything at or below `n` was measured.
fn lookup(table: &[Option<f64>], n: usize) -> Option<f64> {
    let n = n.max(1);
    let above = (n + 1..table.len()).find_map(|i| table[i].map(|t| (i, t)));
    // More rows never cost less: what the next larger count measured bounds this one (a stalled step).
    let bound = above.map_or(f64::INFINITY, |hi| hi.1);
    if let Some(Some(t)) = table.get(n) {
        return Some(t.min(bound));
    }
    let mut below = (1..n.min(table.len())).rev().filter_map(|i| table[i].map(|t| (i, t)));
    let lo = below.next()?;
    let slope = match (above, below.next()) {
        (Some(hi), _) => (hi.1 - lo.1) / (hi.0 - lo.0) as f64,
        (None, Some(lower)) => ((lo.1 - lower.1) / (lo.0 - lower.0) as f64).max(0.0),
        // One point: assume each further row costs 5% of it (a memory-bound step); probes refine it.
        (None, None) => 0.05 * lo.1,
    };
    Some((lo.1 + slope * (n - lo.0) as f64).min(bound))
}

/// [`lookup`], or below the smallest count measured, that one's cost (a smaller count costs no more).
fn lookup_or_above(table: &[Option<f64>], n: usize) -> Option<f64> {
    lookup(table, n).or_else(|| table.iter().skip(n.max(1)).find_map(|t| *t))
}

impl Costs {
    pub fn record_forward(&mut self, rows: usize, seconds: f64) {
        self.forward.record(rows, seconds);
    }

    /// A draft step for `batch` sequences at draft position `depth` (0: the round's first).
    pub fn record_draft(&mut self, batch: usize, depth: usize, seconds: f64) {
        let table = if depth == 0 { &mut self.draft_first } else { &mut self.draft_more };
        table.record(batch, seconds);
    }

    /// A step of `prompt_rows` prefill rows next to `logit_rows` rows that compute logits: what the
    /// prompt rows cost is what the step took beyond the logit rows' measured cost.
    pub fn record_prefill(&mut self, prompt_rows: usize, logit_rows: usize, seconds: f64) {
        // Alone, a chunk's cost is mostly reading the weights, not what its rows add.
        if prompt_rows == 0 || logit_rows == 0 {
            return;
        }
        if let Some(base) = lookup_or_above(&self.forward.est, logit_rows) {
            ema(&mut self.prefill_row, (seconds - base).max(0.0) / prompt_rows as f64);
        }
    }

    /// Prompt rows to add to a step of `logit_rows` decoding rows so that it costs at most `ratio`
    /// times those rows alone, between `min` and `max`. The decoding rows' cost is interpolated from
    /// the measured row counts, or, below the smallest one measured (sequences that draft never step
    /// with one row each), that one's cost: fewer rows cost no more. While no forward at all has been
    /// measured: 0, so that this step measures one (a prompt row's cost is measured against it); then
    /// `min` until a prompt row's cost is known (a first chunk of `max` rows could cost the running
    /// streams many steps' time at once).
    pub fn busy_prefill_rows(&self, logit_rows: usize, ratio: f64, min: usize, max: usize) -> usize {
        let Some(base) = lookup_or_above(&self.forward.est, logit_rows) else {
            return 0;
        };
        let Some(row) = self.prefill_row else {
            return min.min(max);
        };
        if row <= 0.0 {
            return max;
        }
        let rows = ((ratio - 1.0).max(0.0) * base / row).floor();
        (rows.min(max as f64) as usize).clamp(min.min(max), max)
    }

    fn forward(&self, rows: usize) -> Option<f64> {
        lookup(&self.forward.est, rows)
    }

    /// A draft step for `batch` sequences at draft position `depth`; below the smallest batch
    /// measured, that batch's cost (a smaller batch costs no more), so that a scheduler that has only
    /// ever drafted for many sequences at once can still plan. Later positions not yet measured cost
    /// what the first does.
    fn draft(&self, depth: usize, batch: usize) -> Option<f64> {
        let first = lookup_or_above(&self.draft_first.est, batch);
        if depth == 0 {
            return first;
        }
        lookup_or_above(&self.draft_more.est, batch).or(first)
    }
}

/// After a draft step, which of the `auto` sequences that may draft one more (at draft position
/// `depth`, 1 or more) should (docs/engine.md, "Confidence under load"). `values[i]` is the tokens
/// one more draft is expected to add to sequence i's round (`AutoDraft::next_draft_value`); `rows`
/// the step's logit rows so far, `plain_rows` the rows it would have without any drafts (one per
/// decoding sequence), and `fixed_next` the sequences with a fixed k drafting at `depth` anyway.
/// A token is worth what a plain step spends per token; a sequence drafts on iff its expected tokens,
/// so valued, exceed its share of the next draft step plus its extra forward row, with the shares
/// taken over the sequences that go on (recomputed until no more drop out). `None` (no one stops)
/// until the costs this needs are measured.
pub fn keep_drafting(
    costs: &Costs,
    rows: usize,
    plain_rows: usize,
    fixed_next: usize,
    depth: usize,
    values: &[f64],
) -> Option<Vec<bool>> {
    // Below the smallest row count measured (sequences that draft never step with one row each), that
    // count's cost: fewer rows cost no more.
    let per_token = lookup_or_above(&costs.forward.est, plain_rows)? / plain_rows.max(1) as f64;
    let now = costs.forward(rows)?;
    let draft_fixed = if fixed_next > 0 { costs.draft(depth, fixed_next)? } else { 0.0 };
    let mut keep: Vec<bool> = values.iter().map(|&v| v > 0.0).collect();
    loop {
        let n = keep.iter().filter(|&&k| k).count();
        if n == 0 {
            return Some(keep);
        }
        let draft_share = (costs.draft(depth, fixed_next + n)? - draft_fixed).max(0.0) / n as f64;
        let row_share = (costs.forward(rows + n)? - now).max(0.0) / n as f64;
        let mut dropped = false;
        for (k, &v) in keep.iter_mut().zip(values) {
            if *k && v * per_token <= draft_share + row_share {
                *k = false;
                dropped = true;
            }
        }
        if !dropped {
            return Some(keep);
        }
    }
}

/// An `auto` sequence ready for a round.
pub struct Candidate {
    /// Acceptance rate of each draft position given that it is reached.
    pub rates: [f64; AUTO_MAX_DRAFT],
    /// The most drafts its budget allows this round.
    pub k_max: usize,
    /// Draft at least one token this round (to keep its acceptance estimates fresh).
    pub probe: bool,
}

/// Expected tokens a round of `k` drafts yields (the target's own token included).
fn expected(rates: &[f64], k: usize) -> f64 {
    let mut reach = 1.0;
    let mut e = 1.0;
    for r in &rates[..k] {
        reach *= r;
        e += reach;
    }
    e
}

/// The k of every candidate, given the rest of the step: `base_rows` (prefill chunks and the rows of
/// sequences whose k is fixed), `base_tokens` (what those sequences yield), and `fixed_depth[j]`, the
/// number of fixed sequences drafting at depth j. `None` until the costs this needs have been measured.
pub fn choose(
    costs: &Costs,
    base_rows: usize,
    base_tokens: f64,
    fixed_depth: &[usize],
    cands: &[Candidate],
) -> Option<Vec<usize>> {
    // The step without drafts must have been measured (or be reachable from smaller measured steps), and
    // some draft step.
    costs.forward(base_rows + cands.len())?;
    costs.draft(0, 1)?;
    let mut ks: Vec<usize> = cands.iter().map(|c| usize::from(c.probe && c.k_max > 0)).collect();
    let objective = |ks: &[usize]| -> f64 {
        let rows = base_rows + cands.len() + ks.iter().sum::<usize>();
        let depth = ks.iter().copied().max().unwrap_or(0).max(fixed_depth.len());
        let mut time = costs.forward(rows).unwrap_or(f64::INFINITY);
        for j in 0..depth {
            let n = fixed_depth.get(j).copied().unwrap_or(0) + ks.iter().filter(|&&k| k > j).count();
            if n > 0 {
                time += costs.draft(j, n).unwrap_or(f64::INFINITY);
            }
        }
        let tokens = base_tokens + cands.iter().zip(ks).map(|(c, &k)| expected(&c.rates, k)).sum::<f64>();
        tokens / time
    };
    // A draft expected to add under a twentieth of a token is not worth the risk that a noisy timing
    // makes it look free.
    let can_grow = |ks: &[usize], i: usize| {
        let c = &cands[i];
        ks[i] < c.k_max.min(AUTO_MAX_DRAFT) && expected(&c.rates, ks[i] + 1) - expected(&c.rates, ks[i]) >= 0.05
    };
    let mut current = objective(&ks);
    loop {
        // One sequence one draft deeper, or every sequence that can grow together. The second matters
        // when a new depth's draft step costs more than one sequence's draft repays while several
        // sequences' drafts share it: one at a time, the greedy search would never take the first.
        let mut best: Option<(Vec<usize>, f64)> = None;
        let mut consider = |trial: Vec<usize>| {
            let v = objective(&trial);
            if v > current * 1.01 && best.as_ref().is_none_or(|b| v > b.1) {
                best = Some((trial, v));
            }
        };
        let growable: Vec<usize> = (0..cands.len()).filter(|&i| can_grow(&ks, i)).collect();
        for &i in &growable {
            let mut trial = ks.clone();
            trial[i] += 1;
            consider(trial);
        }
        if growable.len() > 1 {
            let mut trial = ks.clone();
            for &i in &growable {
                trial[i] += 1;
            }
            consider(trial);
        }
        match best {
            Some((trial, v)) => {
                ks = trial;
                current = v;
            }
            None => return Some(ks),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine where a forward costs `base` plus `per_row` per row, and a draft step `draft` plus
    /// `draft_row` per sequence.
    fn costs(base: f64, per_row: f64, draft: f64, draft_row: f64) -> Costs {
        let mut c = Costs::default();
        for r in [1, 2, 4, 8, 16, 32, 64, 128] {
            c.record_forward(r, base + per_row * r as f64);
        }
        for n in [1, 2, 4, 8, 16, 32] {
            for depth in [0, 1] {
                c.record_draft(n, depth, draft + draft_row * n as f64);
            }
        }
        c
    }

    /// A measured estimate equal to `want` up to rounding.
    fn near(t: Option<f64>, want: f64) -> bool {
        t.is_some_and(|t| (t - want).abs() < 1e-12)
    }

    fn cand(rate: f64) -> Candidate {
        Candidate { rates: [rate; AUTO_MAX_DRAFT], k_max: 8, probe: false }
    }

    #[test]
    fn nothing_is_drafted_before_the_costs_are_known() {
        assert!(choose(&Costs::default(), 0, 0.0, &[], &[cand(0.9)]).is_none());
    }

    #[test]
    fn useless_drafters_do_not_draft_and_good_ones_draft_deep_on_an_idle_memory_bound_machine() {
        let c = costs(0.040, 0.001, 0.001, 0.0001);
        assert_eq!(choose(&c, 0, 0.0, &[], &[cand(0.0)]).unwrap(), vec![0]);
        assert!(choose(&c, 0, 0.0, &[], &[cand(0.9)]).unwrap()[0] >= 5);
    }

    #[test]
    fn drafts_get_shorter_as_the_batch_fills_the_flat_part_of_the_curve() {
        // Flat up to 16 rows, then every row costs like the first.
        let mut c = Costs::default();
        for r in 1..=128 {
            c.record_forward(r, if r <= 16 { 0.040 } else { 0.040 + 0.0025 * (r - 16) as f64 });
        }
        for n in 1..=32 {
            c.record_draft(n, 0, 0.001 + 0.0001 * n as f64);
        }
        let alone: usize = choose(&c, 0, 0.0, &[], &[cand(0.7)]).unwrap().iter().sum();
        let crowded: Vec<usize> = choose(&c, 0, 0.0, &[], &(0..16).map(|_| cand(0.7)).collect::<Vec<_>>()).unwrap();
        let per_seq = crowded.iter().sum::<usize>() as f64 / 16.0;
        assert!(alone >= 3 && per_seq < 1.5, "alone k = {alone}, crowded k = {crowded:?}");
        // A probe drafts one token even when it does not pay.
        let probe = Candidate { probe: true, ..cand(0.0) };
        assert_eq!(choose(&c, 0, 0.0, &[], &[probe]).unwrap(), vec![1]);
    }

    #[test]
    fn sequences_draft_together_when_one_alone_does_not_repay_the_draft_step() {
        // A small target (each row costs a tenth of the step) and a draft step of 0.2 ms: one sequence
        // of four drafting alone adds a row and a whole draft step for 0.84 tokens (no gain), all four
        // together add four rows and the same draft step for 3.4 tokens.
        let c = costs(0.0010, 0.0001, 0.0002, 0.00001);
        let ks = choose(&c, 0, 0.0, &[], &(0..4).map(|_| cand(0.84)).collect::<Vec<_>>()).unwrap();
        assert!(ks.iter().all(|&k| k >= 1), "{ks:?}");
        // A useless drafter still does not draft, together or alone.
        assert_eq!(choose(&c, 0, 0.0, &[], &(0..4).map(|_| cand(0.02)).collect::<Vec<_>>()).unwrap(), vec![0; 4]);
    }

    #[test]
    fn a_busy_scheduler_plans_without_ever_having_run_one_row() {
        // Eight sequences always decode together: forwards of 8-9 rows and draft steps of 8 are all that
        // was ever measured. The plan must still be made (and must not draft a useless drafter).
        let mut c = Costs::default();
        c.record_forward(8, 0.050);
        c.record_forward(9, 0.051);
        c.record_draft(8, 0, 0.004);
        let ks = choose(&c, 0, 0.0, &[], &(0..8).map(|_| cand(0.01)).collect::<Vec<_>>()).unwrap();
        assert_eq!(ks, vec![0; 8]);
        assert!(
            choose(&c, 0, 0.0, &[], &(0..8).map(|_| cand(0.9)).collect::<Vec<_>>()).unwrap().iter().sum::<usize>() > 0
        );
        assert_eq!(c.draft(0, 1), Some(0.004));
        assert_eq!(c.draft(0, 8), Some(0.004));
        assert_eq!(c.draft(3, 8), Some(0.004));
    }

    #[test]
    fn a_busy_step_takes_the_prompt_rows_its_cost_ratio_allows() {
        let mut c = Costs::default();
        // No decoding step measured: none, so that this one is; then the minimum until a prompt row's
        // cost is known.
        assert_eq!(c.busy_prefill_rows(4, 2.0, 8, 32), 0);
        c.record_forward(4, 0.100);
        assert_eq!(c.busy_prefill_rows(4, 2.0, 8, 32), 8);
        assert_eq!(c.busy_prefill_rows(4, 2.0, 64, 32), 32);
        // 4 logit rows take 100 ms; a step with 16 prompt rows took 180 ms: 5 ms a prompt row.
        c.record_prefill(16, 4, 0.180);
        assert_eq!(c.busy_prefill_rows(4, 2.0, 8, 32), 20);
        assert_eq!(c.busy_prefill_rows(4, 1.5, 8, 32), 10);
        assert_eq!(c.busy_prefill_rows(4, 1.1, 8, 32), 8);
        assert_eq!(c.busy_prefill_rows(4, 9.0, 8, 32), 32);
        // A burst of newcomers next to a few streams (a large ratio) takes big chunks up to the maximum.
        assert_eq!(c.busy_prefill_rows(4, 4.5, 8, 256), 70);
        assert_eq!(c.busy_prefill_rows(4, 20.0, 8, 256), 256);
        // Sequences that always draft never step with one row each: below the smallest row count
        // measured, its cost stands in.
        let mut d = Costs::default();
        d.record_forward(5, 0.100);
        d.record_prefill(16, 5, 0.180);
        assert_eq!(d.busy_prefill_rows(1, 2.0, 8, 32), 20);
        assert_eq!(d.busy_prefill_rows(2, 1.5, 8, 32), 10);
    }

    #[test]
    fn a_stalled_step_is_bounded_by_the_steady_costs() {
        let mut c = Costs::default();
        for _ in 0..10 {
            c.record_forward(5, 0.100);
            c.record_forward(6, 0.110);
        }
        // One 5-row step took 20 times as long: counted as twice the estimate, then bounded by what 6 rows
        // cost.
        c.record_forward(5, 2.0);
        assert!(near(c.forward(5), 0.110), "{:?}", c.forward(5));
        // A stall moves an estimate by a fifth at most: 6 rows go to 0.132, above 5 rows' own 0.120.
        c.record_forward(6, 2.0);
        let six = c.forward(6).expect("measured");
        assert!(near(Some(six), 0.132), "{six}");
        assert!(near(c.forward(5), 0.120), "{:?}", c.forward(5));
        // Draft steps: a larger batch's cost bounds a smaller one's, measured or not.
        c.record_draft(2, 0, 0.010);
        c.record_draft(1, 0, 0.050);
        assert!(near(c.draft(0, 1), 0.010), "{:?}", c.draft(0, 1));
    }

    #[test]
    fn a_slow_first_sample_gives_way_to_the_next_and_later_draft_positions_have_their_own_cost() {
        let mut c = Costs::default();
        // The first 2-row step paid for growing its buffers: the second replaces it; the third is
        // averaged as usual.
        c.record_forward(2, 0.0070);
        c.record_forward(2, 0.0050);
        assert_eq!(c.forward(2), Some(0.0050));
        c.record_forward(2, 0.0060);
        assert!(near(c.forward(2), 0.0052), "{:?}", c.forward(2));
        // A higher second sample is averaged, not taken.
        c.record_forward(3, 0.0050);
        c.record_forward(3, 0.0100);
        assert!(near(c.forward(3), 0.0060), "{:?}", c.forward(3));
        // The first draft position finds the drafter evicted; later ones find it in cache. Until a
        // later one is measured, it costs what the first does.
        c.record_draft(1, 0, 0.0002);
        assert_eq!(c.draft(2, 1), Some(0.0002));
        c.record_draft(1, 1, 0.0001);
        assert_eq!((c.draft(0, 1), c.draft(1, 1), c.draft(3, 1)), (Some(0.0002), Some(0.0001), Some(0.0001)));
        // So a sequence that drafts deep is charged the cheaper steps after the first. A forward costs
        // 1 ms whatever its rows; at 0.5 ms a draft step, two drafts would not pay (1.96 tokens in
        // 2 ms), at 0.5 ms for the first and 0.1 ms for the others three pay (2.18 tokens in 1.7 ms).
        let mut c = Costs::default();
        c.record_forward(1, 0.0010);
        c.record_forward(5, 0.0010);
        c.record_draft(1, 0, 0.0005);
        assert_eq!(choose(&c, 0, 0.0, &[], &[cand(0.6)]).unwrap(), vec![1]);
        c.record_draft(1, 1, 0.0001);
        let deep = choose(&c, 0, 0.0, &[], &[cand(0.6)]).unwrap();
        assert!(deep[0] >= 3, "{deep:?}");
    }

    #[test]
    fn costs_interpolate_and_extrapolate() {
        let mut c = Costs::default();
        c.record_forward(1, 1.0);
        c.record_forward(9, 2.0);
        assert_eq!(c.forward(5), Some(1.5));
        assert_eq!(c.forward(17), Some(3.0));
        assert_eq!(Costs::default().forward(3), None);
    }
    #[test]
    fn a_draft_goes_on_when_its_expected_tokens_pay_for_its_share_of_the_step() {
        // A plain step of 2 sequences costs 13 ms (6.5 ms a token); a draft step 1 ms + 0.1 ms a
        // sequence; a row 1.5 ms. Both sequences have drafted once (4 rows).
        let c = costs(0.010, 0.0015, 0.001, 0.0001);
        // 0.9 token (5.85 ms of plain decoding) pays for a row and a share of a draft step; 0.05 does not.
        assert_eq!(keep_drafting(&c, 4, 2, 0, 1, &[0.9, 0.05]), Some(vec![true, false]));
        // On a machine where rows are dear (compute-bound), even the confident draft stops...
        let dear = costs(0.002, 0.008, 0.001, 0.0001);
        assert_eq!(keep_drafting(&dear, 4, 2, 0, 1, &[0.9, 0.05]), Some(vec![false, false]));
        // ... and where a draft step is dear, two sequences that share it go on where one alone would not.
        let steps = costs(0.010, 0.0001, 0.006, 0.0001);
        assert_eq!(keep_drafting(&steps, 4, 2, 0, 1, &[0.7, 0.7]), Some(vec![true, true]));
        assert_eq!(keep_drafting(&steps, 4, 2, 0, 1, &[0.7]), Some(vec![false]));
        // A sequence with a fixed k drafts at this depth anyway: the step is paid for.
        assert_eq!(keep_drafting(&steps, 4, 2, 1, 1, &[0.7]), Some(vec![true]));
        // Nothing measured yet: no one is stopped here.
        assert_eq!(keep_drafting(&Costs::default(), 4, 2, 0, 1, &[0.05]), None);
    }
}
