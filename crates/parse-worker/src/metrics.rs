//! A worker's Prometheus metrics (one registry per worker), served as text at `GET /metrics` on the worker's
//! metrics listener ([`serve_metrics`]). Names follow Prometheus conventions.
//!
//! - `parse_worker_steps_total{op}`, `parse_worker_step_duration_seconds{op}`: engine operations the scheduler ran
//!   and their time from first step to answer (shared with the operations packed beside them) (op: open, verify, extend, truncate, release, begin, draft, distribution, ...).
//! - `parse_worker_rows_total{op}`: token rows the engine computed: a verification's packed positions, a target
//!   session's prompt (`open`), extension and draft tokens. A draft's `begin` reuses what its cache holds and is
//!   counted in steps and time only.
//! - `parse_worker_prefix_rows_total{op}`: prompt rows not computed but taken from a prompt kept earlier that
//!   begins the same way (the engine's prefix cache, in the request's `cache_salt` namespace): a target session's
//!   `open` (a draft's `begin` reuses them too, uncounted, as its computed rows are). `parse_worker_prefix_bytes`:
//!   the bytes of the prompts kept for it (`--prefix-cache-mib`), after each command, beside `parse_worker_kv_bytes`.
//! - `parse_worker_open_sessions`, `parse_worker_kv_bytes`, `parse_worker_kv_capacity_bytes`: after each command.
//! - `parse_worker_kv_device_bytes`: after each command, on a backend whose KV cache allocates more than it holds
//!   (the candle backend's KV pool: free slots, and the room of each slot's capacity class); absent elsewhere.
//! - `parse_worker_refused_total`: calls answered RESOURCE_EXHAUSTED (queue full).
//! - `parse_worker_queue_depth`: engine calls waiting for the scheduler (those running excluded).
//! - `parse_worker_batch_blocks`, `parse_worker_batch_rows` (histograms): per packed forward pass, the sessions'
//!   blocks it held and their rows (continuous batching: how many requests share a step).
//! - `parse_worker_pass_seconds` (histogram): per packed forward pass, its time on the engine; its sum over the wall
//!   time is how busy the engine is. `parse_worker_planning_seconds_total`: the scheduler's time between passes
//!   spent planning steps (the tasks' sampling and bookkeeping, and short waits for callers' next calls), when the
//!   engine's threads sit idle.
//! - `parse_worker_pass_fixed_ms`, `parse_worker_pass_row_ms`: a packed pass's time as a line in its rows, fitted
//!   to recent passes (the price by which `--charge marginal` splits a pass among its requests); absent until the
//!   passes' rows spread enough to read it.
//! - `process_cpu_seconds_total`: the worker process's user and system CPU time, read at each scrape
//!   ([`parse_core::process::cpu_seconds`]). Unlike the wall time, it does not grow while a virtual machine's host
//!   runs something else (steal time), so per output token it measures what serving costs with less noise.

use crate::StepShape;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// The worker's metrics.
pub struct WorkerMetrics {
    registry: Registry,
    steps: IntCounterVec,
    step_seconds: HistogramVec,
    rows: IntCounterVec,
    prefix_rows: IntCounterVec,
    prefix_bytes: IntGauge,
    open_sessions: IntGauge,
    kv_bytes: IntGauge,
    kv_capacity: IntGauge,
    kv_device: IntGauge,
    /// `kv_device` is registered (at the first command on a backend that reports it).
    kv_device_shown: std::sync::Once,
    refused: IntCounter,
    queue_depth: IntGauge,
    batch_blocks: prometheus::Histogram,
    batch_rows: prometheus::Histogram,
    pass_seconds: prometheus::Histogram,
    planning_seconds: prometheus::Counter,
    pass_fixed_ms: prometheus::Gauge,
    pass_row_ms: prometheus::Gauge,
    /// The line's gauges are registered (at the first pass that reads it).
    line_shown: std::sync::Once,
    process_cpu: parse_core::process::ProcessCpu,
}

/// Counts a call in `parse_worker_queue_depth` until it starts running (or is dropped unrun).
pub struct Queued(IntGauge);

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerMetrics")
    }
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn register<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

impl WorkerMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let op = &["op"];
        let steps = register(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "parse_worker_steps_total",
                    "Engine commands run, by operation.",
                ),
                op,
            )
            .expect("valid metric"),
        );
        let step_seconds = register(
            &r,
            HistogramVec::new(
                HistogramOpts::new(
                    "parse_worker_step_duration_seconds",
                    "Time of an engine command on the engine, by operation.",
                )
                .buckets(prometheus::exponential_buckets(0.0005, 2.0, 18).expect("valid buckets")),
                op,
            )
            .expect("valid metric"),
        );
        let rows = register(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "parse_worker_rows_total",
                    "Token rows computed by forward passes, by operation.",
                ),
                op,
            )
            .expect("valid metric"),
        );
        let prefix_rows = register(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "parse_worker_prefix_rows_total",
                    "Prompt rows taken from a prompt kept earlier instead of computed, by operation.",
                ),
                op,
            )
            .expect("valid metric"),
        );
        let gauge =
            |name: &str, help: &str| register(&r, IntGauge::new(name, help).expect("valid metric"));
        let open_sessions = gauge("parse_worker_open_sessions", "Sessions holding a KV cache.");
        let kv_bytes = gauge(
            "parse_worker_kv_bytes",
            "Bytes of KV cache held by sessions.",
        );
        let prefix_bytes = gauge(
            "parse_worker_prefix_bytes",
            "Bytes of the prompts' KV cache kept for later requests that begin the same way (prefix caching).",
        );
        let kv_capacity = gauge(
            "parse_worker_kv_capacity_bytes",
            "Bytes of KV cache the worker may hold.",
        );
        let refused = register(
            &r,
            IntCounter::new(
                "parse_worker_refused_total",
                "Calls refused because the queue was full.",
            )
            .expect("valid metric"),
        );
        let queue_depth = gauge(
            "parse_worker_queue_depth",
            "Engine calls waiting for the scheduler.",
        );
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| {
            register(
                &r,
                prometheus::Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                    .expect("valid metric"),
            )
        };
        let batch_blocks = histogram(
            "parse_worker_batch_blocks",
            "Sessions' blocks packed into one forward pass.",
            vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0],
        );
        let batch_rows = histogram(
            "parse_worker_batch_rows",
            "Token rows of one packed forward pass.",
            prometheus::exponential_buckets(1.0, 2.0, 12).expect("valid buckets"),
        );
        let pass_seconds = histogram(
            "parse_worker_pass_seconds",
            "Time of one packed forward pass on the engine.",
            prometheus::exponential_buckets(0.002, 2.0, 14).expect("valid buckets"),
        );
        let planning_seconds = register(
            &r,
            prometheus::Counter::new(
                "parse_worker_planning_seconds_total",
                "Scheduler time between passes spent planning steps (tasks' sampling, bookkeeping, waits for next calls).",
            )
            .expect("valid metric"),
        );
        let float_gauge =
            |name: &str, help: &str| prometheus::Gauge::new(name, help).expect("valid metric");
        // Registered at the first pass that reads the line ([`WorkerMetrics::packed`]), so that no figure shows
        // before there is one.
        let pass_fixed_ms = float_gauge(
            "parse_worker_pass_fixed_ms",
            "A packed pass's fixed time (its time at no rows), by a line fitted to recent passes, in ms.",
        );
        let pass_row_ms = float_gauge(
            "parse_worker_pass_row_ms",
            "What a row adds to a packed pass's time, by a line fitted to recent passes, in ms.",
        );
        let process_cpu = parse_core::process::ProcessCpu::register(&r);
        WorkerMetrics {
            pass_fixed_ms,
            pass_row_ms,
            line_shown: std::sync::Once::new(),
            kv_device: IntGauge::new(
                "parse_worker_kv_device_bytes",
                "Bytes the KV cache takes on its device as allocated (free slots and room included).",
            )
            .expect("valid metric"),
            kv_device_shown: std::sync::Once::new(),
            registry: r,
            pass_seconds,
            planning_seconds,
            process_cpu,
            batch_blocks,
            batch_rows,
            steps,
            step_seconds,
            rows,
            prefix_rows,
            prefix_bytes,
            open_sessions,
            kv_bytes,
            kv_capacity,
            refused,
            queue_depth,
        }
    }

    /// A call waits in the queue until the guard is dropped.
    pub fn queued(&self) -> Queued {
        self.queue_depth.inc();
        Queued(self.queue_depth.clone())
    }

    /// One engine command of `op` that took `seconds`.
    pub fn step(&self, op: &str, seconds: f64) {
        self.steps.with_label_values(&[op]).inc();
        self.step_seconds.with_label_values(&[op]).observe(seconds);
    }

    /// `n` token rows computed by `op`.
    pub fn rows(&self, op: &str, n: usize) {
        self.rows.with_label_values(&[op]).inc_by(n as u64);
    }

    /// `n` prompt rows that `op` took from a kept prompt instead of computing them.
    pub fn prefix_rows(&self, op: &str, n: usize) {
        self.prefix_rows.with_label_values(&[op]).inc_by(n as u64);
    }

    /// The bytes of the prompts kept for prefix caching, after a command.
    pub fn prefix_bytes(&self, bytes: usize) {
        self.prefix_bytes.set(bytes as i64);
    }

    /// The backend's state after a command.
    pub fn state(&self, open_sessions: usize, kv_bytes: usize, kv_capacity: usize) {
        self.open_sessions.set(open_sessions as i64);
        self.kv_bytes.set(kv_bytes as i64);
        self.kv_capacity.set(kv_capacity as i64);
    }

    /// The KV cache's device bytes after a command, where the backend reports them.
    pub fn kv_device_bytes(&self, bytes: Option<usize>) {
        let Some(bytes) = bytes else { return };
        self.kv_device.set(bytes as i64);
        self.kv_device_shown.call_once(|| {
            if let Err(e) = self.registry.register(Box::new(self.kv_device.clone())) {
                tracing::error!("metrics registration: {e}");
            }
        });
    }

    /// One packed forward pass: its sessions' blocks, their rows, its time and its planning's.
    pub fn packed(&self, s: &StepShape) {
        self.batch_blocks.observe(s.blocks as f64);
        self.batch_rows.observe(s.rows as f64);
        self.pass_seconds.observe(s.pass.as_secs_f64());
        self.planning_seconds.inc_by(s.planning.as_secs_f64());
        if let Some((fixed, per_row)) = s.line {
            self.pass_fixed_ms.set(fixed);
            self.pass_row_ms.set(per_row);
            self.line_shown.call_once(|| {
                for g in [&self.pass_fixed_ms, &self.pass_row_ms] {
                    if let Err(e) = self.registry.register(Box::new(g.clone())) {
                        tracing::error!("metrics registration: {e}");
                    }
                }
            });
        }
    }

    pub fn refused(&self) {
        self.refused.inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.process_cpu.update();
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("metrics encoding: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// With an address: binds it and serves `metrics` there until SIGINT/SIGTERM (a worker's `--metrics-listen`).
pub async fn spawn_metrics(
    metrics: std::sync::Arc<WorkerMetrics>,
    listen: Option<std::net::SocketAddr>,
) -> std::io::Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
    let Some(addr) = listen else {
        return Ok(None);
    };
    let (listener, local) = parse_proto::serve::bind(addr).await?;
    tracing::info!(addr = %local, "metrics serving (http://{local}/metrics)");
    Ok(Some(tokio::spawn(serve_metrics(
        metrics,
        listener,
        parse_proto::serve::shutdown_signal(),
    ))))
}

/// Serves `GET /metrics` (and nothing else) on `listener` until `shutdown` resolves.
pub async fn serve_metrics(
    metrics: std::sync::Arc<WorkerMetrics>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::response::IntoResponse;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    m.render(),
                )
                    .into_response()
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_rows_and_state_show_in_the_exposition() {
        let m = WorkerMetrics::new();
        m.step("verify", 0.02);
        m.step("verify", 0.03);
        m.rows("verify", 17);
        m.prefix_rows("open", 40);
        m.prefix_bytes(8192);
        m.state(2, 4096, 1 << 20);
        m.kv_device_bytes(None);
        assert!(
            !m.render().contains("parse_worker_kv_device_bytes"),
            "a backend that reports no device bytes shows none"
        );
        m.kv_device_bytes(Some(1 << 21));
        m.refused();
        m.packed(&StepShape {
            blocks: 3,
            rows: 40,
            pass: std::time::Duration::from_millis(30),
            planning: std::time::Duration::from_millis(2),
            line: None,
        });
        assert!(
            !m.render().contains("parse_worker_pass_row_ms"),
            "no line, no figure"
        );
        m.packed(&StepShape {
            blocks: 1,
            rows: 0,
            pass: std::time::Duration::ZERO,
            planning: std::time::Duration::ZERO,
            line: Some((25.5, 4.25)),
        });
        let (a, b) = (m.queued(), m.queued());
        drop(a);
        let t = m.render();
        for line in [
            "parse_worker_steps_total{op=\"verify\"} 2",
            "parse_worker_rows_total{op=\"verify\"} 17",
            "parse_worker_prefix_rows_total{op=\"open\"} 40",
            "parse_worker_prefix_bytes 8192",
            "parse_worker_step_duration_seconds_count{op=\"verify\"} 2",
            "parse_worker_open_sessions 2",
            "parse_worker_kv_bytes 4096",
            "parse_worker_kv_capacity_bytes 1048576",
            "parse_worker_kv_device_bytes 2097152",
            "parse_worker_refused_total 1",
            "parse_worker_queue_depth 1",
            "parse_worker_batch_blocks_sum 4",
            "parse_worker_batch_rows_sum 40",
            "parse_worker_pass_seconds_sum 0.03",
            "parse_worker_pass_seconds_count 2",
            "parse_worker_pass_fixed_ms 25.5",
            "parse_worker_pass_row_ms 4.25",
            "parse_worker_planning_seconds_total 0.002",
        ] {
            assert!(t.lines().any(|l| l == line), "no `{line}` in\n{t}");
        }
        let cpu = |t: &str| -> f64 {
            t.lines()
                .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no process_cpu_seconds_total in\n{t}"))
        };
        assert!(cpu(&t) > 0.0);
        drop(b);
        assert!(
            m.render()
                .lines()
                .any(|l| l == "parse_worker_queue_depth 0")
        );
    }
}
