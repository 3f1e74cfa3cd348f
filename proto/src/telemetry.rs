//! Logs and traces of every service. [`init`] installs the `tracing` subscriber: a `fmt` layer (filter from
//! `RUST_LOG`, `info` by default) and, only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, an OpenTelemetry layer that exports spans over OTLP/gRPC with a
//! batch processor (`OTEL_BSP_*` tune it), under `OTEL_SERVICE_NAME` (default: the binary's name). Off, no span is
//! exported and the propagation helpers below do nothing.
//!
//! One request is one trace: W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata from the
//! router to both workers ([`inject`] when a call is built, [`set_parent`] in a handler) and is accepted from
//! clients (gRPC metadata, or HTTP headers on the OpenAI API: [`set_parent_from_http`]).

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Flushes and stops the exporter when dropped (keep it alive until the end of `main`).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("OpenTelemetry: flushing spans at exit: {e}");
        }
    }
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// Installs the subscriber (call once, inside the tokio runtime: the OTLP exporter's channel lives on it).
pub fn init(service: &str) -> Result<Telemetry, Box<dyn std::error::Error + Send + Sync>> {
    // Each layer has its own filter: `RUST_LOG` quiets the logs without dropping the exported spans, which
    // `PARSE_TRACE_FILTER` selects (default `info`: the request, round and worker-call spans).
    let logs = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_filter(logs);
    let exporting =
        env_set("OTEL_EXPORTER_OTLP_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    if !exporting {
        tracing_subscriber::registry().with(fmt).try_init()?;
        return Ok(Telemetry { provider: None });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !env_set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(service.to_string());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let tracer = provider.tracer(service.to_string());
    let spans = tracing_subscriber::EnvFilter::try_from_env(parse_core::env::TRACE_FILTER)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(fmt)
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(spans),
        )
        .try_init()?;
    tracing::info!(service, "exporting spans over OTLP");
    Ok(Telemetry {
        provider: Some(provider),
    })
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes the current span's trace context into an outgoing call's metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata))
    });
}

/// Makes `span` a child of the trace context an incoming call carries (none: the span starts a trace).
pub fn set_parent(span: &tracing::Span, metadata: &MetadataMap) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    // Without the OpenTelemetry layer (telemetry off) there is nothing to attach to.
    let _ = span.set_parent(cx);
}

/// The span of a worker's handling of call `op` (named `<worker> <op>` in traces), a child of the trace context
/// the call carries; `rows` and `tokens` are recorded by the handler.
pub fn call_span<T>(
    worker: &'static str,
    op: &'static str,
    req: &tonic::Request<T>,
) -> tracing::Span {
    let span = tracing::info_span!(
        "call",
        otel.name = %format_args!("{worker} {op}"),
        otel.kind = "server",
        op,
        rows = tracing::field::Empty,
        tokens = tracing::field::Empty,
    );
    set_parent(&span, req.metadata());
    span
}

/// [`set_parent`] for HTTP headers.
pub fn set_parent_from_http(span: &tracing::Span, headers: &http::HeaderMap) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(cx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_context_round_trips_through_metadata() {
        // The propagator alone (no exporter): a traceparent written by inject is read back by extract.
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let mut headers = std::collections::HashMap::new();
        headers.insert(
            "traceparent".to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        );
        let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&headers));
        let mut md = MetadataMap::new();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(&mut md))
        });
        assert_eq!(
            md.get("traceparent").and_then(|v| v.to_str().ok()),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let back =
            opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(&md)));
        use opentelemetry::trace::TraceContextExt;
        assert_eq!(
            back.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }
}
