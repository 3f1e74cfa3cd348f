//! The router's Prometheus metrics, one registry per router, served as text at `GET /metrics` on the OpenAI HTTP
//! port. Names and units follow Prometheus conventions (`parse_..._total`, `_seconds`).
//!
//! Per request (labels: `mode`, and `outcome` = ok | error | cancelled on the request counter; cancelled: the client
//! went away before the end, as a client that stops reading at its answer's end does, which is not the server's
//! failure): requests, latency, time to
//! first token, time per output token (after the first), output tokens, draft tokens proposed and accepted, segments
//! proposed and accepted, target forward passes, tokens written while speculation was paused, entries into
//! speculation declined (it would not have paid for the draft catching up), failovers (by role) and fallbacks to the
//! target alone; a gauge of
//! requests in flight; requests rejected before generating, by reason. Target passes per output token is `parse_target_passes_total / parse_output_tokens_total`.
//!
//! Per position of a verified draft (label `position`: 0 to 31, then `32+` for every deeper position):
//! `parse_draft_position_proposed_total` and `parse_draft_position_accepted_total`; their ratio is the chance the
//! draft's i-th token survives verification.
//!
//! Per worker (labels `role`, `worker`; a request counts for every worker that served it, a failover's both):
//! `parse_worker_requests_total{outcome}`, `parse_worker_output_tokens_total`,
//! `parse_worker_draft_tokens_proposed_total`, `parse_worker_draft_tokens_accepted_total`,
//! `parse_worker_target_passes_total`, `parse_worker_request_duration_seconds`. The admin API's statistics are read
//! from this registry ([`Metrics::stats`]); its latency percentiles are estimated from the duration histogram's
//! buckets the way Prometheus' `histogram_quantile` does (linear within a bucket; the buckets grow by a factor of
//! the square root of 2).
//!
//! The router process's CPU time: `process_cpu_seconds_total` ([`parse_core::process::ProcessCpu`]).
//!
//! Queue depth: the router queues nothing (beyond `max_in_flight` it refuses at once, counted as `busy`
//! rejections); the queues are the workers', `parse_worker_queue_depth` on their own `/metrics`.

use std::collections::BTreeMap;

use parse_core::pace::{CostFigure, level_label};

use parse_proto::v1::{Counters, GetStatsResponse, WorkerCounters};
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

/// Draft positions with a series of their own; deeper ones share the label `32+`.
pub const POSITIONS: usize = 32;

/// What one finished request adds to the metrics.
#[derive(Debug, Default, Clone)]
pub struct RequestRecord<'a> {
    pub mode: &'a str,
    pub ok: bool,
    /// Not ok because the client went away before the end (outcome `cancelled`, not `error`).
    pub cancelled: bool,
    pub latency_s: f64,
    /// Seconds to the first output text (none: no output).
    pub ttft_s: Option<f64>,
    pub output_tokens: u64,
    pub draft_tokens_proposed: u64,
    pub draft_tokens_accepted: u64,
    pub segments_proposed: u64,
    pub segments_accepted: u64,
    pub target_passes: u64,
    /// Tokens the target wrote alone while speculation was paused.
    pub paused_tokens: u64,
    /// Times speculation paid per token but not for the draft's catching up first, so the target went on alone.
    pub entries_declined: u64,
    /// PARSE rounds of copies made while the draft model rested (`model+ngram`).
    pub copy_rounds: u64,
    /// Token-level rounds made in place of PARSE rounds where those measured faster (`parse+token-spec`).
    pub token_rounds: u64,
    /// One-token guesses verified where prompt lookup had nothing longer (`DraftHints::guess_lookup`), and those kept.
    pub guesses: u64,
    pub guesses_right: u64,
    /// Drafts begun ahead during a verification (`DraftHints::prefetch`, `prefetch_guessing`) that the next round took,
    /// and those it threw away.
    pub draft_ahead_hits: u64,
    pub draft_ahead_misses: u64,
    pub draft_failovers: u64,
    pub target_failovers: u64,
    pub fell_back: bool,
    /// Verified drafts that reached each position, and those whose token there was kept.
    pub proposed_by_position: &'a [usize],
    pub accepted_by_position: &'a [usize],
    /// `(role, worker id)` of every worker that served the request.
    pub workers: &'a [(&'a str, String)],
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
    pace_costs: GaugeVec,
    output_tokens: IntCounterVec,
    draft_proposed: IntCounterVec,
    draft_accepted: IntCounterVec,
    segments_proposed: IntCounterVec,
    segments_accepted: IntCounterVec,
    target_passes: IntCounterVec,
    paused_tokens: IntCounterVec,
    entries_declined: IntCounterVec,
    copy_rounds: IntCounterVec,
    token_rounds: IntCounterVec,
    guesses: IntCounterVec,
    draft_ahead: IntCounterVec,
    failovers: IntCounterVec,
    fallbacks: IntCounter,
    rejected: IntCounterVec,
    position_proposed: IntCounterVec,
    position_accepted: IntCounterVec,
    worker_requests: IntCounterVec,
    worker_output_tokens: IntCounterVec,
    worker_proposed: IntCounterVec,
    worker_accepted: IntCounterVec,
    worker_passes: IntCounterVec,
    worker_latency: HistogramVec,
    process_cpu: parse_core::process::ProcessCpu,
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

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    labels: &[&str],
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

/// Seconds from 1 ms to about 17 minutes, each bucket sqrt(2) times the last (percentiles read from them are
/// within that factor before interpolation).
fn seconds_buckets() -> Vec<f64> {
    prometheus::exponential_buckets(0.001, std::f64::consts::SQRT_2, 41).expect("valid buckets")
}

/// The `position` label of a draft position.
fn position_label(i: usize) -> String {
    if i < POSITIONS {
        i.to_string()
    } else {
        format!("{POSITIONS}+")
    }
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
            "Generation requests finished, by mode and outcome (ok, error, cancelled: the client went away).",
            &["mode", "outcome"],
        );
        let latency = histogram(
            &r,
            "parse_request_duration_seconds",
            "Time from a request's arrival to its last output.",
            seconds_buckets(),
            &["mode"],
        );
        let ttft = histogram(
            &r,
            "parse_time_to_first_token_seconds",
            "Time from a request's arrival to its first output text.",
            seconds_buckets(),
            &["mode"],
        );
        let tpot = histogram(
            &r,
            "parse_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            prometheus::exponential_buckets(0.0005, 2.0, 16).expect("valid buckets"),
            &["mode"],
        );
        let in_flight = IntGauge::new("parse_requests_in_flight", "Requests running now.")
            .expect("valid metric");
        r.register(Box::new(in_flight.clone()))
            .expect("unique metric");
        let pace_costs = GaugeVec::new(
            Opts::new(
                "parse_pace_ms_per_token",
                "What the router judges speculation by: milliseconds per output token of the target writing alone \
                 (path=\"alone\") and of each kind of speculation (mode/drafter), per load (requests at once per \
                 target worker), moving averages; at one request wall time, at more the workers' passes' time charged to the \
                 requests by rows.",
            ),
            &["path", "load"],
        )
        .expect("valid metric");
        r.register(Box::new(pace_costs.clone()))
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
        let paused_tokens = by_mode(
            "parse_paused_tokens_total",
            "Output tokens the target wrote alone because token-level speculation was not paying.",
        );
        let entries_declined = by_mode(
            "parse_entries_declined_total",
            "Times speculation paid per output token at the load of the moment but not for the draft's catching up on \
             the context first, so the target went on writing alone.",
        );
        let copy_rounds = by_mode(
            "parse_copy_rounds_total",
            "PARSE rounds of prompt-lookup copies made while the draft model rested (drafter model+ngram).",
        );
        let token_rounds = by_mode(
            "parse_token_rounds_total",
            "Token-level rounds made in place of PARSE rounds, where those measured faster per output token at the \
             load of the moment (mode parse+token-spec).",
        );
        let guesses = counter(
            &r,
            "parse_guesses_total",
            "One-token guesses the target verified where prompt lookup had nothing of two tokens or more (drafter \
             ngram), by mode and outcome: kept or missed.",
            &["mode", "outcome"],
        );
        let draft_ahead = counter(
            &r,
            "parse_draft_ahead_total",
            "Drafts a draft worker began during a verification, by mode and outcome: hit (the next round took it), \
             miss (the verification cut the draft short or the target's token was not the one guessed: thrown away).",
            &["mode", "outcome"],
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
        let position_proposed = counter(
            &r,
            "parse_draft_position_proposed_total",
            "Verified drafts that reached a position (0-based; 32+ pools the deeper ones), by mode.",
            &["mode", "position"],
        );
        let position_accepted = counter(
            &r,
            "parse_draft_position_accepted_total",
            "Verified drafts whose token at a position was kept, by mode.",
            &["mode", "position"],
        );
        let rw = &["role", "worker"];
        let worker_requests = counter(
            &r,
            "parse_worker_requests_total",
            "Requests a worker served, by role, worker id and outcome (ok, error, cancelled: the client went away).",
            &["role", "worker", "outcome"],
        );
        let worker_output_tokens = counter(
            &r,
            "parse_worker_output_tokens_total",
            "Output tokens of the requests a worker served.",
            rw,
        );
        let worker_proposed = counter(
            &r,
            "parse_worker_draft_tokens_proposed_total",
            "Draft tokens sent to verification in the requests a worker served.",
            rw,
        );
        let worker_accepted = counter(
            &r,
            "parse_worker_draft_tokens_accepted_total",
            "Draft tokens kept in the requests a worker served.",
            rw,
        );
        let worker_passes = counter(
            &r,
            "parse_worker_target_passes_total",
            "Target forward passes of the requests a worker served.",
            rw,
        );
        let worker_latency = histogram(
            &r,
            "parse_worker_request_duration_seconds",
            "Time of the requests a worker served, from arrival to last output.",
            seconds_buckets(),
            rw,
        );
        let process_cpu = parse_core::process::ProcessCpu::register(&r);
        Metrics {
            registry: r,
            process_cpu,
            requests,
            latency,
            ttft,
            tpot,
            in_flight,
            pace_costs,
            output_tokens,
            draft_proposed,
            draft_accepted,
            segments_proposed,
            segments_accepted,
            target_passes,
            paused_tokens,
            entries_declined,
            copy_rounds,
            token_rounds,
            guesses,
            draft_ahead,
            failovers,
            fallbacks,
            rejected,
            position_proposed,
            position_accepted,
            worker_requests,
            worker_output_tokens,
            worker_proposed,
            worker_accepted,
            worker_passes,
            worker_latency,
        }
    }

    pub fn record(&self, r: &RequestRecord) {
        let m = [r.mode];
        let outcome = match (r.ok, r.cancelled) {
            (true, _) => "ok",
            (false, true) => "cancelled",
            (false, false) => "error",
        };
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
        self.paused_tokens
            .with_label_values(&m)
            .inc_by(r.paused_tokens);
        self.entries_declined
            .with_label_values(&m)
            .inc_by(r.entries_declined);
        self.copy_rounds.with_label_values(&m).inc_by(r.copy_rounds);
        self.token_rounds
            .with_label_values(&m)
            .inc_by(r.token_rounds);
        let missed = r.guesses.saturating_sub(r.guesses_right);
        for (outcome, n) in [("kept", r.guesses_right), ("missed", missed)] {
            if n > 0 {
                self.guesses.with_label_values(&[r.mode, outcome]).inc_by(n);
            }
        }
        for (outcome, n) in [("hit", r.draft_ahead_hits), ("miss", r.draft_ahead_misses)] {
            if n > 0 {
                self.draft_ahead
                    .with_label_values(&[r.mode, outcome])
                    .inc_by(n);
            }
        }
        self.failovers
            .with_label_values(&["draft"])
            .inc_by(r.draft_failovers);
        self.failovers
            .with_label_values(&["target"])
            .inc_by(r.target_failovers);
        if r.fell_back {
            self.fallbacks.inc();
        }
        for (series, counts) in [
            (&self.position_proposed, r.proposed_by_position),
            (&self.position_accepted, r.accepted_by_position),
        ] {
            for (i, &n) in counts.iter().enumerate() {
                if n > 0 {
                    series
                        .with_label_values(&[r.mode, &position_label(i)])
                        .inc_by(n as u64);
                }
            }
        }
        for (role, id) in r.workers {
            let w = [*role, id.as_str()];
            self.worker_requests
                .with_label_values(&[*role, id.as_str(), outcome])
                .inc();
            self.worker_output_tokens
                .with_label_values(&w)
                .inc_by(r.output_tokens);
            self.worker_proposed
                .with_label_values(&w)
                .inc_by(r.draft_tokens_proposed);
            self.worker_accepted
                .with_label_values(&w)
                .inc_by(r.draft_tokens_accepted);
            self.worker_passes
                .with_label_values(&w)
                .inc_by(r.target_passes);
            self.worker_latency
                .with_label_values(&w)
                .observe(r.latency_s);
        }
    }

    /// A request is running until the guard is dropped (the router drops it when the request's loop ends, before
    /// its sessions are released).
    pub fn running(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }

    /// Requests running now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.get().max(0) as usize
    }

    /// Shows the pace figures (`parse_pace_ms_per_token`).
    pub fn pace_costs(&self, figures: &[CostFigure]) {
        for f in figures {
            self.pace_costs
                .with_label_values(&[f.path.as_str(), &level_label(f.level)])
                .set(f.ms_per_token);
        }
    }

    /// A request refused before generating (`reason`: busy, invalid, unavailable).
    pub fn rejected(&self, reason: &str) {
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// The admin API's statistics, read from this registry: overall (every mode) and per worker.
    pub fn stats(&self) -> GetStatsResponse {
        let mut overall = Tally::default();
        let mut workers: BTreeMap<(String, String), Tally> = BTreeMap::new();
        for family in self.registry.gather() {
            let name = family.name().to_string();
            for m in family.get_metric() {
                let label = |k: &str| {
                    m.get_label()
                        .iter()
                        .find(|l| l.name() == k)
                        .map_or(String::new(), |l| l.value().to_string())
                };
                let counter = m.get_counter().get_value() as u64;
                let per_worker = name.starts_with("parse_worker_");
                let t = if per_worker {
                    workers.entry((label("role"), label("worker"))).or_default()
                } else {
                    &mut overall
                };
                match name.trim_start_matches("parse_worker_") {
                    "requests_total" | "parse_requests_total" => {
                        t.requests(counter, &label("outcome"))
                    }
                    "output_tokens_total" | "parse_output_tokens_total" => {
                        t.output_tokens += counter
                    }
                    "draft_tokens_proposed_total" | "parse_draft_tokens_proposed_total" => {
                        t.proposed += counter
                    }
                    "draft_tokens_accepted_total" | "parse_draft_tokens_accepted_total" => {
                        t.accepted += counter
                    }
                    "target_passes_total" | "parse_target_passes_total" => t.passes += counter,
                    "request_duration_seconds" | "parse_request_duration_seconds" => {
                        let h = m.get_histogram();
                        t.latency.add(
                            h.get_sample_count(),
                            h.get_bucket()
                                .iter()
                                .map(|b| (b.upper_bound(), b.cumulative_count())),
                        )
                    }
                    _ => {}
                }
            }
        }
        GetStatsResponse {
            overall: Some(overall.counters()),
            workers: workers
                .into_iter()
                .map(|((role, id), t)| WorkerCounters {
                    id,
                    role,
                    counters: Some(t.counters()),
                })
                .collect(),
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.process_cpu.update();
        let mut buf = Vec::new();
        // Encoding into memory fails only on a metric that breaks the format, which `new` cannot build.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("metrics encoding: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// A histogram's cumulative bucket counts, merged over series with the same bounds.
#[derive(Debug, Default)]
struct Buckets {
    count: u64,
    /// `(upper bound, cumulative count)`, the finite bounds in order.
    cumulative: Vec<(f64, u64)>,
}

impl Buckets {
    fn add(&mut self, count: u64, buckets: impl Iterator<Item = (f64, u64)>) {
        self.count += count;
        for (i, (bound, n)) in buckets.enumerate() {
            match self.cumulative.get_mut(i) {
                Some(c) => c.1 += n,
                None => self.cumulative.push((bound, n)),
            }
        }
    }

    /// The `q` quantile as Prometheus' `histogram_quantile` estimates it: linear within the bucket that holds it,
    /// the largest finite bound when it lies beyond; 0 with no samples.
    fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = q * self.count as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(upper, n) in &self.cumulative {
            if n as f64 >= rank && n > below {
                return lower + (upper - lower) * (rank - below as f64) / (n - below) as f64;
            }
            (lower, below) = (upper, n);
        }
        lower
    }
}

/// Sums for one row of the admin statistics.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    failed: u64,
    output_tokens: u64,
    proposed: u64,
    accepted: u64,
    passes: u64,
    latency: Buckets,
}

impl Tally {
    fn requests(&mut self, n: u64, outcome: &str) {
        self.requests += n;
        // A request its client left is not a failure of the cluster's.
        if outcome == "error" {
            self.failed += n;
        }
    }

    fn counters(&self) -> Counters {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let ms = |q: f64| self.latency.quantile(q) * 1e3;
        Counters {
            requests: self.requests,
            failed: self.failed,
            output_tokens: self.output_tokens,
            draft_tokens_proposed: self.proposed,
            draft_tokens_accepted: self.accepted,
            target_passes: self.passes,
            acceptance: ratio(self.accepted, self.proposed),
            target_passes_per_token: ratio(self.passes, self.output_tokens),
            latency_p50_ms: ms(0.5),
            latency_p90_ms: ms(0.9),
            latency_p99_ms: ms(0.99),
        }
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
            paused_tokens: 7,
            entries_declined: 2,
            copy_rounds: 3,
            token_rounds: 4,
            guesses: 9,
            guesses_right: 2,
            draft_ahead_hits: 5,
            draft_ahead_misses: 2,
            draft_failovers: 1,
            ..Default::default()
        });
        m.record(&RequestRecord {
            mode: "target",
            ok: false,
            latency_s: 0.1,
            ..Default::default()
        });
        m.record(&RequestRecord {
            mode: "target",
            ok: false,
            cancelled: true,
            latency_s: 0.2,
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
        assert_eq!(
            value(
                &t,
                "parse_requests_total{mode=\"target\",outcome=\"cancelled\"}"
            ),
            1.0
        );
        assert_eq!(value(&t, "parse_output_tokens_total{mode=\"parse\"}"), 31.0);
        assert!(value(&t, "process_cpu_seconds_total ") > 0.0);
        assert_eq!(
            value(&t, "parse_draft_tokens_accepted_total{mode=\"parse\"}"),
            28.0
        );
        assert_eq!(value(&t, "parse_target_passes_total{mode=\"parse\"}"), 5.0);
        assert_eq!(value(&t, "parse_paused_tokens_total{mode=\"parse\"}"), 7.0);
        assert_eq!(
            value(&t, "parse_entries_declined_total{mode=\"parse\"}"),
            2.0
        );
        assert_eq!(value(&t, "parse_copy_rounds_total{mode=\"parse\"}"), 3.0);
        assert_eq!(value(&t, "parse_token_rounds_total{mode=\"parse\"}"), 4.0);
        assert_eq!(
            value(&t, "parse_guesses_total{mode=\"parse\",outcome=\"kept\"}"),
            2.0
        );
        assert_eq!(
            value(&t, "parse_guesses_total{mode=\"parse\",outcome=\"missed\"}"),
            7.0
        );
        assert_eq!(
            value(
                &t,
                "parse_draft_ahead_total{mode=\"parse\",outcome=\"hit\"}"
            ),
            5.0
        );
        assert_eq!(
            value(
                &t,
                "parse_draft_ahead_total{mode=\"parse\",outcome=\"miss\"}"
            ),
            2.0
        );
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

    #[test]
    fn pace_figures_show_by_path_and_load() {
        let m = Metrics::new();
        let costs = parse_core::pace::Costs::default();
        costs.record_alone(None, 3, 160.0, 2);
        costs.record_spec("parse+token-spec/model", 3, 300.0, 2, None);
        m.pace_costs(&costs.snapshot());
        let t = m.render();
        assert_eq!(
            value(&t, "parse_pace_ms_per_token{load=\"5-8\",path=\"alone\"}"),
            80.0
        );
        assert_eq!(
            value(
                &t,
                "parse_pace_ms_per_token{load=\"5-8\",path=\"parse+token-spec/model\"}"
            ),
            150.0
        );
    }

    #[test]
    fn draft_positions_count_with_deep_ones_pooled() {
        let m = Metrics::new();
        // Two rounds: a 40-token draft with 3 kept, a 2-token draft with both kept.
        let mut proposed = vec![1; 40];
        proposed[0] = 2;
        proposed[1] = 2;
        m.record(&RequestRecord {
            mode: "parse",
            ok: true,
            proposed_by_position: &proposed,
            accepted_by_position: &[2, 2, 1],
            ..Default::default()
        });
        let t = m.render();
        let p = |kind: &str, pos: &str| {
            value(
                &t,
                &format!("parse_draft_position_{kind}_total{{mode=\"parse\",position=\"{pos}\"}}"),
            )
        };
        assert_eq!((p("proposed", "0"), p("accepted", "0")), (2.0, 2.0));
        assert_eq!((p("proposed", "2"), p("accepted", "2")), (1.0, 1.0));
        assert_eq!(p("proposed", "31"), 1.0);
        // Positions 32..39 pool into one series; positions never kept have none.
        assert_eq!(p("proposed", "32+"), 8.0);
        assert!(!t.contains("parse_draft_position_accepted_total{mode=\"parse\",position=\"3\"}"));
    }

    #[test]
    fn admin_stats_read_the_registry_overall_and_per_worker() {
        let m = Metrics::new();
        let both = [("draft", "d1".to_string()), ("target", "t1".to_string())];
        let target = [("target", "t1".to_string())];
        // 100 parse requests of 10 ms .. 1 s, one failed target-only request and one its client left (not failed).
        for i in 1..=100 {
            m.record(&RequestRecord {
                mode: "parse",
                ok: true,
                latency_s: i as f64 / 100.0,
                output_tokens: 10,
                draft_tokens_proposed: 8,
                draft_tokens_accepted: 6,
                target_passes: 2,
                workers: &both,
                ..Default::default()
            });
        }
        m.record(&RequestRecord {
            mode: "target",
            ok: false,
            latency_s: 0.5,
            workers: &target,
            ..Default::default()
        });
        m.record(&RequestRecord {
            mode: "target",
            ok: false,
            cancelled: true,
            latency_s: 0.5,
            workers: &target,
            ..Default::default()
        });
        let s = m.stats();
        let o = s.overall.unwrap();
        assert_eq!(
            (
                o.requests,
                o.failed,
                o.output_tokens,
                o.draft_tokens_proposed
            ),
            (102, 1, 1000, 800)
        );
        assert_eq!((o.draft_tokens_accepted, o.target_passes), (600, 200));
        assert_eq!((o.acceptance, o.target_passes_per_token), (0.75, 0.2));
        // The true median is 0.5 s and p90 0.9 s: the estimates lie within a bucket's factor of sqrt(2).
        for (got, want) in [(o.latency_p50_ms, 500.0), (o.latency_p90_ms, 900.0)] {
            assert!(
                got > want / std::f64::consts::SQRT_2 && got < want * std::f64::consts::SQRT_2,
                "{got} ms for {want} ms"
            );
        }
        assert!(o.latency_p99_ms >= o.latency_p90_ms);
        let per: Vec<_> = s
            .workers
            .iter()
            .map(|w| {
                let c = w.counters.unwrap();
                (
                    w.role.as_str(),
                    w.id.as_str(),
                    c.requests,
                    c.failed,
                    c.output_tokens,
                )
            })
            .collect();
        assert_eq!(
            per,
            [
                ("draft", "d1", 100, 0, 1000),
                ("target", "t1", 102, 1, 1000)
            ]
        );
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket_like_histogram_quantile() {
        let mut b = Buckets::default();
        assert_eq!(b.quantile(0.5), 0.0);
        // 4 samples in (0, 1], 4 in (1, 2], none beyond.
        b.add(8, [(1.0, 4), (2.0, 8), (4.0, 8)].into_iter());
        assert_eq!(b.quantile(0.25), 0.5);
        assert_eq!(b.quantile(0.5), 1.0);
        assert_eq!(b.quantile(0.75), 1.5);
        // Merging a second series with the same bounds adds counts; samples past the last bound read as it.
        b.add(2, [(1.0, 0), (2.0, 0), (4.0, 0)].into_iter());
        assert_eq!(b.quantile(0.99), 4.0);
    }
}
