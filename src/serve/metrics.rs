//! Prometheus metrics through the `metrics` facade and its Prometheus exporter (names after vLLM's; the
//! list is in docs/serve.md). The recorder is process-wide: the first server installs it, later ones (tests
//! start several) share it.

use std::sync::OnceLock;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::decode::speculative::SpecStats;
use crate::engine::StepSnapshot;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Latency buckets in seconds, from 1 ms to 2 minutes.
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 120.0,
];
/// Rows per scheduler step.
const ROWS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Install the recorder once; `None` if another recorder owns the process.
pub fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("seconds".into()), SECONDS)
                .ok()?
                .set_buckets_for_metric(Matcher::Full("tandem_step_rows".into()), ROWS)
                .ok()?
                .build_recorder();
            let h = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            Some(h)
        })
        .as_ref()
}

/// The scheduler's state after a step.
pub fn step(s: &StepSnapshot) {
    gauge!("tandem_num_requests_waiting").set(s.waiting as f64);
    gauge!("tandem_num_requests_running").set(s.active as f64);
    gauge!("tandem_kv_cache_bytes").set(s.kv_in_use as f64);
    if s.report.rows > 0 {
        histogram!("tandem_step_rows").record(s.report.rows as f64);
        counter!("tandem_steps_total").increment(1);
    }
}

/// A request ended (`outcome`: stop, length, tool_calls, cancelled, error, rejected).
pub fn request_done(endpoint: &'static str, outcome: &'static str) {
    counter!("tandem_requests_total", "endpoint" => endpoint, "outcome" => outcome).increment(1);
}

/// An error response, by status.
pub fn http_error(status: u16) {
    counter!("tandem_http_errors_total", "status" => status.to_string()).increment(1);
}

pub fn unknown_fields(n: usize) {
    if n > 0 {
        counter!("tandem_ignored_request_fields_total").increment(n as u64);
    }
}

pub fn tokens(prompt: usize, cached: usize, generated: usize) {
    counter!("tandem_prompt_tokens_total").increment(prompt as u64);
    counter!("tandem_prompt_tokens_cached_total").increment(cached as u64);
    counter!("tandem_generation_tokens_total").increment(generated as u64);
}

pub fn time_to_first_token(s: f64) {
    histogram!("tandem_time_to_first_token_seconds").record(s);
}

/// Time between two deliveries of tokens to one request (one delivery may carry several tokens).
pub fn inter_token(s: f64) {
    histogram!("tandem_inter_token_latency_seconds").record(s);
}

pub fn request_seconds(s: f64) {
    histogram!("tandem_e2e_request_latency_seconds").record(s);
}

/// A request's drafting, as vLLM's `spec_decode_*` counters.
pub fn spec(s: &SpecStats) {
    counter!("tandem_spec_decode_num_drafts_total").increment(s.draft_rounds as u64);
    counter!("tandem_spec_decode_num_draft_tokens_total").increment(s.drafted_tokens as u64);
    counter!("tandem_spec_decode_num_accepted_tokens_total").increment(s.accepted_tokens as u64);
    for (pos, &n) in s.accepted_per_position.iter().enumerate() {
        counter!("tandem_spec_decode_num_accepted_tokens_per_pos_total", "position" => pos.to_string())
            .increment(n as u64);
    }
}
