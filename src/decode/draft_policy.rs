//! How many tokens to draft each round: a fixed k, or `auto`, which picks k from measured acceptance and
//! measured costs so that expected tokens per second is highest, and stops drafting when it does not pay.
//!
//! A policy outlives one request (a chat session or a benchmark keeps one for all its turns), so the costs
//! it has measured and what it has learned of the drafter carry over instead of being re-learned per prompt.

use anyhow::Result;

/// The most draft tokens per round (the verify forward then has up to this + 1 rows).
pub const MAX_DRAFT: usize = 16;

/// The most draft tokens per round `auto` considers: past 6-8 rows the verify forward stops being
/// nearly free on CPU, and acceptance that deep is rare.
pub const AUTO_MAX_DRAFT: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLength {
    Fixed(usize),
    /// Chosen each round from measured acceptance and costs; 0 (plain decoding) when drafting does not pay.
    Auto,
}

impl DraftLength {
    /// `auto` or a number of draft tokens from 1 to `MAX_DRAFT`.
    pub fn parse(s: &str) -> Result<DraftLength> {
        match s {
            "auto" => Ok(DraftLength::Auto),
            k => match k.parse::<usize>() {
                Ok(k) if (1..=MAX_DRAFT).contains(&k) => Ok(DraftLength::Fixed(k)),
                _ => anyhow::bail!("--draft-tokens must be a number from 1 to {MAX_DRAFT} or `auto`, got {k:?}"),
            },
        }
    }
}

impl std::fmt::Display for DraftLength {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftLength::Fixed(k) => write!(f, "{k}"),
            DraftLength::Auto => f.write_str("auto"),
        }
    }
}

/// A draft length with the state `auto` learns as it goes.
#[derive(Clone, Debug)]
pub enum DraftPolicy {
    Fixed(usize),
    Auto(Box<AutoDraft>),
}

impl From<DraftLength> for DraftPolicy {
    fn from(d: DraftLength) -> DraftPolicy {
        match d {
            DraftLength::Fixed(k) => DraftPolicy::Fixed(k.min(MAX_DRAFT)),
            DraftLength::Auto => DraftPolicy::Auto(Box::default()),
        }
    }
}

impl DraftPolicy {
    /// `auto` or the fixed number of draft tokens.
    pub fn describe(&self) -> String {
        match self {
            DraftPolicy::Fixed(k) => k.to_string(),
            DraftPolicy::Auto(_) => "auto".into(),
        }
    }

    /// The most draft tokens this policy ever asks for.
    pub fn max_draft(&self) -> usize {
        match self {
            DraftPolicy::Fixed(k) => *k,
            DraftPolicy::Auto(_) => AUTO_MAX_DRAFT,
        }
    }

    /// Draft tokens for the next round; `k_max` is what the budget and the context still allow.
    pub fn choose(&mut self, k_max: usize) -> usize {
        match self {
            DraftPolicy::Fixed(k) => (*k).min(k_max),
            DraftPolicy::Auto(a) => {
                let k_max = k_max.min(AUTO_MAX_DRAFT).min(a.depth_cap());
                match a.best_length(k_max) {
                    0 => 0,
                    k => (k + CONFIDENT_EXTRA).min(k_max),
                }
            }
        }
    }

    /// Whether this is `auto` that has not seen a round yet.
    pub fn is_fresh_auto(&self) -> bool {
        matches!(self, DraftPolicy::Auto(a) if a.accept[0].1 == 0.0 && a.verify_s[1].is_none())
    }

    /// `auto`'s estimates, for a caller that chooses k itself (the engine, across a batch).
    pub fn auto(&self) -> Option<&AutoDraft> {
        match self {
            DraftPolicy::Auto(a) => Some(a),
            DraftPolicy::Fixed(_) => None,
        }
    }

    /// What a round cost and how many of its `drafted` tokens were accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize, draft_s: f64, verify_s: f64) {
        if let DraftPolicy::Auto(a) = self {
            a.record(drafted, accepted, draft_s, verify_s);
        }
    }

    /// The drafter's confidence in each draft of a round (see [`AutoDraft::record_confidences`]).
    pub fn record_confidences(&mut self, confidences: &[f32], accepted: usize) {
        if let DraftPolicy::Auto(a) = self {
            a.record_confidences(confidences, accepted);
        }
    }

    /// After the drafts of a round so far, whose confidences are `confidences`: whether `auto` drafts
    /// another (always, for a fixed k: the round drafts what it planned).
    pub fn keep_drafting(&self, confidences: &[f32]) -> bool {
        match self {
            DraftPolicy::Auto(a) => a.keep_drafting(confidences),
            DraftPolicy::Fixed(_) => true,
        }
    }
}

/// Drafts past the length `auto` finds best from acceptance by position: the confidence stop ends a
/// round early where the next draft would not pay, so the rounds where the drafter is sure go deeper
/// (docs/speculative.md, "Confidence").
pub const CONFIDENT_EXTRA: usize = 1;

/// Confidence bins: a draft's confidence (the drafter's probability of the token it drafted) falls in
/// one of this many equal slices of `0..=1`.
pub const CONFIDENCE_BINS: usize = 10;

/// The bin of a confidence (values outside `0..=1` count as the nearest end, NaN as 0).
fn confidence_bin(c: f32) -> usize {
    if c.is_nan() {
        return 0;
    }
    ((c.clamp(0.0, 1.0) * CONFIDENCE_BINS as f32) as usize).min(CONFIDENCE_BINS - 1)
}

/// Pseudo-count that pulls a position's acceptance estimate towards the position before it (and the
/// first position towards one half): positions behave alike, and one unlucky try must not rule one out.
const PRIOR_WEIGHT: f64 = 2.0;
/// Each new observation of a position discounts the older ones, so the estimates follow the text.
const DECAY: f64 = 0.97;
/// Rounds between probes of a draft length one longer than the best (and, one probe in four, of a
/// plain step, to refresh its cost).
const PROBE_EVERY: usize = 16;
/// Rounds between single-draft probes while not drafting.
const PROBE_IDLE_EVERY: usize = 32;

/// A running estimate of a step's time, updated with the time `x` one step took: an exponential moving
/// average, with a sample over twice the estimate counted as twice the estimate. Steps stall now and then
/// (another process takes the core, a page fault); one stalled step would otherwise make its row count
/// look several times dearer until that count is measured again, which a policy that has stopped choosing
/// it may never do. A real slowdown still shows within a few steps (docs/speculative.md, "Adaptive draft length").
pub(crate) fn timing_ema(old: Option<f64>, x: f64) -> f64 {
    match old {
        Some(o) => 0.8 * o + 0.2 * x.min(2.0 * o),
        None => x,
    }
}

/// The time measured in `table` (indexed by row count or batch size) at the next count above `n` that
/// has one, or infinity: more rows never cost less, so that bounds the estimate for `n`. Only the next
/// one: the least of all larger counts would be biased low by their noise (docs/speculative.md,
/// "Adaptive draft length").
fn next_above(table: &[Option<f64>], n: usize) -> f64 {
    table.iter().skip(n + 1).find_map(|t| *t).unwrap_or(f64::INFINITY)
}

/// Running estimates behind `--draft-tokens auto`.
#[derive(Clone, Debug)]
pub struct AutoDraft {
    /// Per draft position: decayed (accepted, reached) counts, where a position is reached when every
    /// draft before it was accepted; so each ratio is an acceptance rate *given* the position is reached.
    accept: [(f64, f64); AUTO_MAX_DRAFT],
    draft_step_s: Option<f64>,
    /// Verify time by row count (exponential moving averages).
    verify_s: [Option<f64>; AUTO_MAX_DRAFT + 2],
    rounds_since_probe: usize,
    probes: usize,
    /// What the first position's estimate is pulled towards before evidence (see `rates`).
    first: f64,
    /// Per confidence bin: decayed (accepted, reached) counts of the drafts whose confidence fell in it.
    confidence: [(f64, f64); CONFIDENCE_BINS],
    /// What each bin's estimate is pulled towards before evidence (see `accept_given`).
    confidence_prior: [f64; CONFIDENCE_BINS],
}

impl Default for AutoDraft {
    fn default() -> Self {
        AutoDraft::new()
    }
}

impl AutoDraft {
    pub fn new() -> AutoDraft {
        AutoDraft {
            accept: [(0.0, 0.0); AUTO_MAX_DRAFT],
            draft_step_s: None,
            verify_s: [None; AUTO_MAX_DRAFT + 2],
            rounds_since_probe: 0,
            probes: 0,
            first: 0.5,
            confidence: [(0.0, 0.0); CONFIDENCE_BINS],
            // Before evidence, a draft is taken to be accepted as often as the drafter says it is right:
            // the bin's middle.
            confidence_prior: std::array::from_fn(|b| (b as f64 + 0.5) / CONFIDENCE_BINS as f64),
        }
    }

    /// The most drafts worth trying next: one past the deepest position ever reached. Drafts deepen one
    /// position per round as they are accepted, and a drafter whose first draft is never accepted costs
    /// one draft per round while the evidence builds up, not the several that the prior's one half
    /// would suggest for the deeper positions.
    pub fn depth_cap(&self) -> usize {
        1 + self.accept.iter().take_while(|a| a.1 > 0.0).count()
    }

    /// Pull the first position's estimate towards `first` instead of one half: the engine passes what
    /// all requests together have measured of the drafter, so that a new request starts from that
    /// instead of paying its own exploration; the request's own evidence takes over as it drafts.
    pub fn set_first(&mut self, first: f64) {
        self.first = first;
    }

    /// Start from what `shared` (every request's evidence together) has learned of the drafter: its
    /// first position's rate (`set_first`) and its acceptance by confidence, which pull this policy's
    /// own estimates until its evidence takes over.
    pub fn set_prior(&mut self, shared: &AutoDraft) {
        self.set_first(shared.rates()[0]);
        self.confidence_prior = std::array::from_fn(|b| shared.bin_rate(b));
    }

    fn bin_rate(&self, b: usize) -> f64 {
        let (a, n) = self.confidence[b];
        (a + PRIOR_WEIGHT * self.confidence_prior[b]) / (n + PRIOR_WEIGHT)
    }

    /// Estimated probability that a draft is accepted, given that every draft before it was and that
    /// the drafter's confidence in it is `c` (docs/speculative.md, "Confidence").
    pub fn accept_given(&self, c: f32) -> f64 {
        self.bin_rate(confidence_bin(c))
    }

    /// The drafts of a round had `confidences`, and the first `accepted` were accepted: every draft
    /// that was reached (all before it accepted) counts in its confidence's bin.
    pub fn record_confidences(&mut self, confidences: &[f32], accepted: usize) {
        for (i, &c) in confidences.iter().enumerate().take(accepted + 1) {
            let slot = &mut self.confidence[confidence_bin(c)];
            let hit = if i < accepted { 1.0 } else { 0.0 };
            *slot = (DECAY * slot.0 + hit, DECAY * slot.1 + 1.0);
        }
    }

    /// Expected tokens that one more draft adds to a round whose drafts so far had `confidences`: the
    /// probability that all of them are accepted times that the next one is, taken to be as likely as
    /// the last one (a drafter's confidence runs in stretches). With no drafts yet: the first
    /// position's rate.
    pub fn next_draft_value(&self, confidences: &[f32]) -> f64 {
        let Some(&last) = confidences.last() else {
            return self.rates()[0];
        };
        let reach: f64 = confidences.iter().map(|&c| self.accept_given(c)).product();
        reach * self.accept_given(last)
    }

    /// Alone (no batch around it): draft one more token iff what it is expected to add, valued at a
    /// plain step's time per token, exceeds what it costs: one draft step and one more verify row. With
    /// the costs not yet measured, yes (the round's k was chosen without them). See
    /// docs/speculative.md, "Confidence".
    pub fn keep_drafting(&self, confidences: &[f32]) -> bool {
        let j = confidences.len();
        let (Some(step), Some(plain), Some(now), Some(more)) =
            (self.draft_step_s, self.verify_cost(1), self.verify_cost(j + 1), self.verify_cost(j + 2))
        else {
            return true;
        };
        self.next_draft_value(confidences) * plain > step + (more - now).max(0.0)
    }

    /// Estimated acceptance rate of each position given that it is reached.
    pub fn rates(&self) -> [f64; AUTO_MAX_DRAFT] {
        let mut out = [0.0; AUTO_MAX_DRAFT];
        let mut prev = self.first;
        for (r, &(a, n)) in out.iter_mut().zip(&self.accept) {
            *r = (a + PRIOR_WEIGHT * prev) / (n + PRIOR_WEIGHT);
            prev = *r;
        }
        out
    }

    fn verify_cost(&self, rows: usize) -> Option<f64> {
        let raw = match self.verify_s[rows] {
            Some(t) => t,
            // Unmeasured row counts: interpolate from the nearest measured ones, else assume flat-ish cost.
            None => {
                let one = self.verify_s[1]?;
                let known = (2..self.verify_s.len()).rev().find_map(|r| self.verify_s[r].map(|t| (r, t)));
                match known {
                    Some((r, t)) => one + (t - one) * (rows - 1) as f64 / (r - 1) as f64,
                    None => one * (1.0 + 0.05 * (rows - 1) as f64),
                }
            }
        };
        Some(raw.min(next_above(&self.verify_s, rows)))
    }

    /// The k in 0..=k_max with the best expected tokens per second, from acceptance by position (a
    /// round then drafts up to [`CONFIDENT_EXTRA`] more, stopping by confidence: `DraftPolicy::choose`).
    /// Drafting at all must beat plain steps by a clear margin, so timing noise alone never keeps a
    /// useless drafter running.
    pub fn best_length(&mut self, k_max: usize) -> usize {
        // First measure a plain step, then a round of one draft.
        if self.verify_s[1].is_none() {
            return 0;
        }
        let k_max = k_max.min(self.depth_cap());
        let Some(step) = self.draft_step_s else {
            return k_max;
        };
        let rates = self.rates();
        let mut best = (0usize, 0f64);
        let mut reach = 1.0; // probability that the first j drafts are all accepted
        let mut expected = 1.0; // expected tokens per round
        for k in 0..=k_max {
            if k > 0 {
                reach *= rates[k - 1];
                expected += reach;
            }
            let cost = k as f64 * step + self.verify_cost(k + 1).unwrap_or(f64::INFINITY);
            let rate = expected / cost;
            let margin = if k > 0 && best.0 == 0 { 1.05 } else { 1.0 };
            // Drafts expected to add under a tenth of a token per round are not worth the risk that a
            // noisy timing makes them look free.
            if rate > best.1 * margin && (k == 0 || expected - 1.0 >= 0.1) {
                best = (k, rate);
            }
        }
        // Now and then try something else, so that stale or unlucky estimates get refreshed: a single
        // draft when not drafting; when drafting, one more draft than the best (to learn the next
        // position's acceptance and the cost of one more row) or, one time in four, a plain step.
        self.rounds_since_probe += 1;
        let every = if best.0 == 0 { PROBE_IDLE_EVERY } else { PROBE_EVERY };
        if self.rounds_since_probe >= every && k_max > 0 {
            self.rounds_since_probe = 0;
            self.probes += 1;
            return match best.0 {
                0 => 1,
                _ if self.probes.is_multiple_of(4) || best.0 == k_max => 0,
                k => k + 1,
            };
        }
        best.0
    }

    fn record(&mut self, drafted: usize, accepted: usize, draft_s: f64, verify_s: f64) {
        for (i, slot) in self.accept.iter_mut().enumerate().take(drafted.min(accepted + 1)) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            *slot = (DECAY * slot.0 + hit, DECAY * slot.1 + 1.0);
        }
        if drafted > 0 {
            self.draft_step_s = Some(timing_ema(self.draft_step_s, draft_s / drafted as f64));
        }
        if let Some(v) = self.verify_s.get_mut(drafted + 1) {
            *v = Some(timing_ema(*v, verify_s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The length `auto` finds best by position (before its confidence extra, see `DraftPolicy::choose`).
    fn best(p: &mut DraftPolicy, k_max: usize) -> usize {
        match p {
            DraftPolicy::Auto(a) => a.best_length(k_max),
            DraftPolicy::Fixed(k) => (*k).min(k_max),
        }
    }

    /// Feed the policy synthetic rounds: `accept(i)` says whether the draft at position i is right,
    /// `verify(rows)` and `draft` are the costs in seconds. Returns the k chosen in each round.
    fn simulate(
        rounds: usize,
        accept: impl Fn(usize) -> bool,
        verify: impl Fn(usize) -> f64,
        draft: f64,
    ) -> Vec<usize> {
        let mut a = DraftPolicy::from(DraftLength::Auto);
        (0..rounds)
            .map(|_| {
                let k = best(&mut a, 8);
                let accepted = (0..k).take_while(|&i| accept(i)).count();
                a.record(k, accepted, draft * k as f64, verify(k + 1));
                k
            })
            .collect()
    }

    #[test]
    fn useless_drafts_stop_even_when_verifying_more_rows_looks_free() {
        let ks = simulate(300, |_| false, |_| 0.010, 0.0);
        let drafting = ks[20..].iter().filter(|&&k| k > 0).count();
        assert!(drafting <= 10, "still drafting in {drafting} of 280 rounds: {ks:?}");
    }

    #[test]
    fn a_useless_drafter_costs_few_drafts_in_a_short_reply() {
        // A cheap draft step (10 % of a plain step) and nearly free verify rows: the prior alone must not
        // buy several deep drafting rounds before the misses add up.
        let ks = simulate(64, |_| false, |r| 0.010 * (1.0 + 0.02 * (r - 1) as f64), 0.001);
        let drafted: usize = ks.iter().sum();
        assert!(ks.iter().all(|&k| k <= 1) && drafted <= 10, "{drafted} drafts: {ks:?}");
    }

    #[test]
    fn a_new_policy_starts_from_the_given_first_rate() {
        let mut p = AutoDraft::new();
        assert_eq!(p.rates()[0], 0.5);
        p.set_first(0.05);
        assert_eq!(p.rates()[0], 0.05);
        // Its own evidence takes over: two hits out of two move it well above the prior.
        p.record(1, 1, 0.001, 0.01);
        p.record(2, 2, 0.002, 0.01);
        assert!(p.rates()[0] > 0.5, "{:?}", p.rates());
    }

    #[test]
    fn drafts_deepen_one_position_per_round() {
        let ks = simulate(20, |_| true, |r| 0.010 * (1.0 + 0.02 * (r - 1) as f64), 0.0003);
        let mut deepest = 0;
        for &k in &ks {
            assert!(k <= deepest + 1, "{ks:?}");
            deepest = deepest.max(k);
        }
        assert!(deepest >= 6, "{ks:?}");
    }

    #[test]
    fn good_drafts_grow_until_verification_cost_stops_them() {
        // Memory-bound target: verifying 5 rows costs 1.2x one row; drafts 3% of a step; always right.
        let ks = simulate(200, |_| true, |r| 0.010 * (1.0 + 0.05 * (r - 1) as f64), 0.0003);
        assert!(ks[50..].iter().all(|&k| k >= 6 || k == 0), "{ks:?}");
        // Compute-bound target: each extra row costs as much as the first; drafting cannot pay.
        let ks = simulate(200, |_| true, |r| 0.010 * r as f64, 0.0003);
        assert!(ks[50..].iter().filter(|&&k| k > 1).count() <= 10, "{ks:?}");
    }

    #[test]
    fn acceptance_that_fades_with_position_picks_a_middle_length() {
        // Position i is accepted for the first 3 positions only.
        let ks = simulate(300, |i| i < 3, |r| 0.010 * (1.0 + 0.05 * (r - 1) as f64), 0.0003);
        let tail = &ks[100..];
        let typical = tail.iter().filter(|&&k| k == 3 || k == 4).count();
        assert!(typical * 10 >= tail.len() * 8, "{ks:?}");
    }

    #[test]
    fn an_unlucky_miss_does_not_rule_a_position_out() {
        // Every position is accepted 85% of the time, independently (a fixed pseudo-random pattern);
        // verifying is nearly free. The policy must settle on long drafts even though, early on, some
        // position sees a miss on its first try.
        let mut state = 12345u64;
        let mut coin = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) as f64) < 0.85 * (1u64 << 31) as f64
        };
        let mut a = DraftPolicy::from(DraftLength::Auto);
        let ks: Vec<usize> = (0..400)
            .map(|_| {
                let k = best(&mut a, 8);
                let accepted = (0..k).take_while(|_| coin()).count();
                a.record(k, accepted, 0.0003 * k as f64, 0.010 * (1.0 + 0.04 * k as f64));
                k
            })
            .collect();
        let tail = &ks[200..];
        let mean = tail.iter().sum::<usize>() as f64 / tail.len() as f64;
        assert!(mean >= 4.0, "mean k {mean}: {ks:?}");
    }

    #[test]
    fn one_slow_round_does_not_steer_the_length_for_long() {
        // Drafts are right up to position 4; a round costs 10 ms plus 1 ms per row and 0.3 ms per draft,
        // so k = 4 is best (8 % ahead of k = 5). Round 60 takes 20 times as long, as any step may when
        // the machine stalls: the row count it measured must not look dear for the rest of the run.
        let mut a = DraftPolicy::from(DraftLength::Auto);
        let ks: Vec<usize> = (0..300)
            .map(|round| {
                let k = best(&mut a, 8);
                let accepted = (0..k).take_while(|&i| i < 4).count();
                let stall = if round == 60 { 20.0 } else { 1.0 };
                a.record(k, accepted, 0.0003 * k as f64, stall * 0.010 * (1.0 + 0.1 * k as f64));
                k
            })
            .collect();
        assert_eq!(ks[59], 4, "{ks:?}");
        let tail = &ks[70..];
        let at4 = tail.iter().filter(|&&k| k == 4).count();
        assert!(at4 * 10 >= tail.len() * 8, "k = 4 in {at4} of {} rounds after the stall: {ks:?}", tail.len());
    }

    #[test]
    fn a_policy_keeps_what_it_learned_across_requests() {
        let mut p = DraftPolicy::from(DraftLength::Auto);
        for _ in 0..100 {
            let k = p.choose(8);
            p.record(k, k, 0.0003 * k as f64, 0.010 * (1.0 + 0.04 * k as f64));
        }
        // A new request starts with the learned policy: no warm-up plain step.
        assert!(p.choose(8) >= 6);
        assert_eq!(DraftPolicy::from(DraftLength::Fixed(5)).choose(3), 3);
    }
    /// Rounds of a drafter whose confidence says how likely its draft is right: each draft's confidence
    /// is pseudo-random in 0..1 and the draft is right with probability √confidence (drafters tend to
    /// be underconfident). A round costs 1.2 ms per draft plus a verify of 10 ms and 1.5 ms per extra
    /// row (about the shipped pair's proportions). Returns tokens per second over the last three
    /// quarters of `rounds`.
    fn confident_drafter(setting: DraftLength, rounds: usize) -> f64 {
        let verify = |rows: usize| 0.010 * (1.0 + 0.15 * (rows - 1) as f64);
        let draft = 0.0012;
        let mut state = 987_654_321u64;
        let mut uniform = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut p = DraftPolicy::from(setting);
        let (mut tokens, mut time) = (0.0, 0.0);
        for round in 0..rounds {
            let cap = p.choose(8);
            let mut confidences: Vec<f32> = Vec::new();
            let mut rejected = None;
            while confidences.len() < cap {
                let c = uniform() as f32;
                if rejected.is_none() && uniform() >= f64::from(c).sqrt() {
                    rejected = Some(confidences.len());
                }
                confidences.push(c);
                if confidences.len() < cap && !p.keep_drafting(&confidences) {
                    break;
                }
            }
            let k = confidences.len();
            let accepted = rejected.unwrap_or(k);
            p.record(k, accepted, draft * k as f64, verify(k + 1));
            p.record_confidences(&confidences, accepted);
            if round >= rounds / 4 {
                tokens += (accepted + 1) as f64;
                time += draft * k as f64 + verify(k + 1);
            }
        }
        tokens / time
    }

    #[test]
    fn stopping_on_the_drafters_confidence_beats_every_fixed_length() {
        let fixed: Vec<f64> = (1..=8).map(|k| confident_drafter(DraftLength::Fixed(k), 4000)).collect();
        let best = fixed.iter().copied().fold(0.0, f64::max);
        let auto = confident_drafter(DraftLength::Auto, 4000);
        assert!(auto > 1.03 * best, "auto {auto:.1} tokens/s, fixed k = 1..8: {fixed:.1?}");
    }

    #[test]
    fn confident_drafts_go_on_and_doubtful_ones_stop() {
        let mut p = AutoDraft::new();
        // Costs: a plain step 10 ms, 0.5 ms per extra verify row, 0.3 ms per draft. Drafts the drafter is
        // sure of (0.95) are right, doubtful ones (0.15) wrong.
        for _ in 0..50 {
            p.record(0, 0, 0.0, 0.010);
            p.record(3, 2, 0.0009, 0.011);
            p.record_confidences(&[0.95, 0.95, 0.15], 2);
        }
        assert!(p.accept_given(0.95) > 0.9 && p.accept_given(0.15) < 0.1, "{p:?}");
        assert!(p.keep_drafting(&[0.95, 0.95]));
        assert!(!p.keep_drafting(&[0.95, 0.15]));
        // A bin without evidence starts from its middle: a drafter that says 35 % is taken at its word.
        assert!((p.accept_given(0.35) - 0.35).abs() < 1e-9);
        // What a new request starts from: the shared evidence.
        let mut fresh = AutoDraft::new();
        fresh.set_prior(&p);
        assert!(fresh.accept_given(0.95) > 0.9 && fresh.accept_given(0.15) < 0.1);
        // Until costs are measured, a round drafts what it planned.
        assert!(AutoDraft::new().keep_drafting(&[0.01]));
    }
}
