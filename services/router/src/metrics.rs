//! The router's Prometheus metrics, one registry per router, served as text at `GET /metrics` on the OpenAI HTTP
//! port. Names and units follow Prometheus conventions (`parse_..._total`, `_seconds`).
//!
//! Per request (labels: `mode`, and `outcome` = ok | error on the request counter): requests, latency, time to
//! first token, time per output token (after the first), output tokens, draft tokens proposed and accepted, segments
//! proposed and accepted, target forward passes, failovers (by role) and fallbacks to the target alone; a gauge of
//! requests in flight; requests rejected before generating, by reason. Target passes per output token is `parse_target_passes_total / parse_output_tokens_total`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// What one finished request adds to the metrics.
#[derive(Debug, Default, Clone)]
pub struct RequestRecord<'a> {
    pub mode: &'a str,
    pub ok: bool,
    pub latency_s: f64,
    /// Seconds to the first output text (none: no output).
    pub ttft_s: Option<f64>,
    pub output_tokens: u64,
    pub draft_tokens_proposed: u64,
    pub draft_tokens_accepted: u64,
    pub segments_proposed: u64,
    pub segments_accepted: u64,
    pub target_passes: u64,
    pub draft_failovers: u64,
    pub target_failovers: u64,
    pub fell_back: bool,
}

/// Counts a request in `parse_requests_in_flight` while it lives.
pub struct InFlight(IntGauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The router's metrics.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    ttft: HistogramVec,
    tpot: HistogramVec,
    in_flight: IntGauge,
    output_tokens: IntCounterVec,
    draft_proposed: IntCounterVec,
    draft_accepted: IntCounterVec,
    segments_proposed: IntCounterVec,
    segments_accepted: IntCounterVec,
    target_passes: IntCounterVec,
    failovers: IntCounterVec,
    fallbacks: IntCounter,
    rejected: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn histogram(r: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &["mode"])
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

/// Seconds from 1 ms to about 9 minutes, doubling.
fn seconds_buckets() -> Vec<f64> {
    prometheus::exponential_buckets(0.001, 2.0, 20).expect("valid buckets")
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let requests = counter(
            &r,
            "parse_requests_total",
            "Generation requests finished, by mode and outcome (ok, error).",
            &["mode", "outcome"],
        );
        let latency = histogram(
            &r,
            "parse_request_duration_seconds",
            "Time from a request's arrival to its last output.",
            seconds_buckets(),
        );
        let ttft = histogram(
            &r,
            "parse_time_to_first_token_seconds",
            "Time from a request's arrival to its first output text.",
            seconds_buckets(),
        );
        let tpot = histogram(
            &r,
            "parse_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            prometheus::exponential_buckets(0.0005, 2.0, 16).expect("valid buckets"),
        );
        let in_flight = IntGauge::new("parse_requests_in_flight", "Requests running now.")
            .expect("valid metric");
        r.register(Box::new(in_flight.clone()))
            .expect("unique metric");
        let by_mode = |name: &str, help: &str| counter(&r, name, help, &["mode"]);
        let output_tokens = by_mode("parse_output_tokens_total", "Output tokens.");
        let draft_proposed = by_mode(
            "parse_draft_tokens_proposed_total",
            "Draft tokens sent to verification.",
        );
        let draft_accepted = by_mode(
            "parse_draft_tokens_accepted_total",
            "Draft tokens kept by verification.",
        );
        let segments_proposed = by_mode(
            "parse_segments_proposed_total",
            "Draft segments sent to verification.",
        );
        let segments_accepted = by_mode(
            "parse_segments_accepted_total",
            "Draft segments kept whole by verification.",
        );
        let target_passes = by_mode(
            "parse_target_passes_total",
            "Target forward passes (verifications and extensions).",
        );
        let failovers = counter(
            &r,
            "parse_failovers_total",
            "Workers lost during a request and replaced, by role.",
            &["role"],
        );
        let fallbacks = IntCounter::new(
            "parse_fallbacks_total",
            "Requests that lost every draft worker and finished with the target alone.",
        )
        .expect("valid metric");
        r.register(Box::new(fallbacks.clone()))
            .expect("unique metric");
        let rejected = counter(
            &r,
            "parse_requests_rejected_total",
            "Requests refused before generating, by reason: busy (the router was full: RESOURCE_EXHAUSTED, HTTP \
             429), invalid (bad input: INVALID_ARGUMENT, HTTP 400), unavailable (no worker to ask).",
            &["reason"],
        );
        Metrics {
            registry: r,
            requests,
            latency,
            ttft,
            tpot,
            in_flight,
            output_tokens,
            draft_proposed,
            draft_accepted,
            segments_proposed,
            segments_accepted,
            target_passes,
            failovers,
            fallbacks,
            rejected,
        }
    }

    pub fn record(&self, r: &RequestRecord) {
        let m = [r.mode];
        let outcome = if r.ok { "ok" } else { "error" };
        self.requests.with_label_values(&[r.mode, outcome]).inc();
        self.latency.with_label_values(&m).observe(r.latency_s);
        if let Some(t) = r.ttft_s {
            self.ttft.with_label_values(&m).observe(t);
            if r.output_tokens > 1 {
                let per = (r.latency_s - t).max(0.0) / (r.output_tokens - 1) as f64;
                self.tpot.with_label_values(&m).observe(per);
            }
        }
        self.output_tokens
            .with_label_values(&m)
            .inc_by(r.output_tokens);
        self.draft_proposed
            .with_label_values(&m)
            .inc_by(r.draft_tokens_proposed);
        self.draft_accepted
            .with_label_values(&m)
            .inc_by(r.draft_tokens_accepted);
        self.segments_proposed
            .with_label_values(&m)
            .inc_by(r.segments_proposed);
        self.segments_accepted
            .with_label_values(&m)
            .inc_by(r.segments_accepted);
        self.target_passes
            .with_label_values(&m)
            .inc_by(r.target_passes);
        self.failovers
            .with_label_values(&["draft"])
            .inc_by(r.draft_failovers);
        self.failovers
            .with_label_values(&["target"])
            .inc_by(r.target_failovers);
        if r.fell_back {
            self.fallbacks.inc();
        }
    }

    /// A request is running until the guard is dropped.
    pub fn running(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }

    /// A request refused before generating (`reason`: busy, invalid, unavailable).
    pub fn rejected(&self, reason: &str) {
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into memory fails only on a metric that breaks the format, which `new` cannot build.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("metrics encoding: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
    }

    #[test]
    fn a_request_moves_its_counters_by_its_figures() {
        let m = Metrics::new();
        m.record(&RequestRecord {
            mode: "parse",
            ok: true,
            latency_s: 2.0,
            ttft_s: Some(0.5),
            output_tokens: 31,
            draft_tokens_proposed: 40,
            draft_tokens_accepted: 28,
            segments_proposed: 6,
            segments_accepted: 4,
            target_passes: 5,
            draft_failovers: 1,
            ..Default::default()
        });
        m.record(&RequestRecord {
            mode: "target",
            ok: false,
            latency_s: 0.1,
            ..Default::default()
        });
        m.rejected("busy");
        let t = m.render();
        assert_eq!(
            value(&t, "parse_requests_total{mode=\"parse\",outcome=\"ok\"}"),
            1.0
        );
        assert_eq!(
            value(
                &t,
                "parse_requests_total{mode=\"target\",outcome=\"error\"}"
            ),
            1.0
        );
        assert_eq!(value(&t, "parse_output_tokens_total{mode=\"parse\"}"), 31.0);
        assert_eq!(
            value(&t, "parse_draft_tokens_accepted_total{mode=\"parse\"}"),
            28.0
        );
        assert_eq!(value(&t, "parse_target_passes_total{mode=\"parse\"}"), 5.0);
        assert_eq!(value(&t, "parse_failovers_total{role=\"draft\"}"), 1.0);
        assert_eq!(
            value(&t, "parse_requests_rejected_total{reason=\"busy\"}"),
            1.0
        );
        assert_eq!(
            value(
                &t,
                "parse_time_to_first_token_seconds_count{mode=\"parse\"}"
            ),
            1.0
        );
        // (2.0 - 0.5) / 30 tokens after the first.
        assert_eq!(
            value(
                &t,
                "parse_time_per_output_token_seconds_sum{mode=\"parse\"}"
            ),
            0.05
        );
        assert!(t.contains("# TYPE parse_request_duration_seconds histogram"));
    }
}
