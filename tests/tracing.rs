//! One request, one trace: the router and both workers run as separate processes exporting spans over OTLP/gRPC
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`) to a test receiver (a tonic server of the OTLP trace service). The client sends a
//! W3C `traceparent`; every span of the request carries its trace id, the router's `generate` span is the client
//! span's child, its PARSE rounds are children of `generate`, and the workers' spans are children of the router's
//! spans, the draft and verification calls of the rounds in particular.

use std::collections::{HashMap, HashSet};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use parse_proto::v1::GenerateRequest;
use parse_proto::v1::generation_client::GenerationClient;
use parse_tests::{Proc, draft_checkpoint, free_port, workspace_binary};

/// A collected span: service, name, ids (hex).
#[derive(Debug, Clone)]
struct SpanRec {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
}

#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<SpanRec>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut out = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(
                        opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s),
                    ) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(SpanRec {
                        service: service.clone(),
                        name: s.name,
                        trace: hex(&s.trace_id),
                        id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn spawn(name: &str, args: &[String], otlp: u16) -> Proc {
    Proc(
        Command::new(workspace_binary(name))
            .args(args)
            .env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://127.0.0.1:{otlp}"),
            )
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_SERVICE_NAME")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn one_request_is_one_trace_across_the_router_and_both_worker_processes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let receiver = Receiver::default();
    let otlp = free_port();
    {
        let r = receiver.clone();
        rt.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(r))
                .serve(format!("127.0.0.1:{otlp}").parse().unwrap())
                .await
                .unwrap();
        });
    }
    let (tp, dp, rp) = (free_port(), free_port(), free_port());
    // The small checkpoint plays both roles (one tokenizer): the test is about spans, not answers.
    let m = draft_checkpoint().display().to_string();
    let _target = spawn(
        "parse-target-worker",
        &[
            "--model".into(),
            m.clone(),
            "--listen".into(),
            format!("127.0.0.1:{tp}"),
        ],
        otlp,
    );
    let _draft = spawn(
        "parse-draft-worker",
        &[
            "--model".into(),
            m,
            "--listen".into(),
            format!("127.0.0.1:{dp}"),
        ],
        otlp,
    );
    let _router = spawn(
        "parse-router",
        &[
            "--listen".into(),
            format!("127.0.0.1:{rp}"),
            "--target".into(),
            format!("127.0.0.1:{tp}"),
            "--draft".into(),
            format!("127.0.0.1:{dp}"),
            "--no-openai".into(),
        ],
        otlp,
    );
    // The client's own trace: its span id is the parent of the router's span.
    // A request the router served before it saw the draft worker (the target came up first) finishes with the
    // target alone and has no draft span: it is sent again under a new trace until one drafted.
    let client_span = "00f067aa0ba902b7";
    let mut client_trace = String::new();
    rt.block_on(async {
        let start = Instant::now();
        let mut attempt = 0u32;
        let reply = loop {
            attempt += 1;
            client_trace = format!("4bf92f3577b34da6a3ce929d{attempt:08x}");
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "the cluster did not come up"
            );
            let Ok(mut c) = GenerationClient::connect(format!("http://127.0.0.1:{rp}")).await
            else {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            };
            let mut req = tonic::Request::new(GenerateRequest {
                prompt: "Write a Python function that adds two numbers.".into(),
                max_new_tokens: 24,
                mode: "parse+token-spec".into(),
                // Drafting whatever the router's figures say (an attempt that fell back left some behind).
                adaptive: Some(false),
                ..Default::default()
            });
            req.metadata_mut().insert(
                "traceparent",
                format!("00-{client_trace}-{client_span}-01")
                    .parse()
                    .unwrap(),
            );
            match c.generate(req).await {
                Ok(r)
                    if r.get_ref()
                        .stats
                        .as_ref()
                        .is_some_and(|s| s.fell_back_to_target) =>
                {
                    tokio::time::sleep(Duration::from_millis(300)).await
                }
                Ok(r) => break r.into_inner(),
                // The router answers before the workers are up: UNAVAILABLE until they are.
                Err(s) if s.code() == tonic::Code::Unavailable => {
                    tokio::time::sleep(Duration::from_millis(300)).await
                }
                Err(s) => panic!("generate: {s}"),
            }
        };
        assert!(!reply.text.is_empty());
        // Spans arrive in batches every 100 ms; wait for the router's generate span (it ends last).
        let start = Instant::now();
        loop {
            let done = receiver.0.lock().unwrap().iter().any(|s| {
                s.service == "parse-router" && s.name == "generate" && s.trace == client_trace
            });
            if done {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no generate span arrived: {:#?}",
                receiver.0.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Let the workers' last batches (the releases) arrive.
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    let spans: Vec<SpanRec> = receiver
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace == client_trace)
        .cloned()
        .collect();
    let by_id: HashMap<&str, &SpanRec> = spans.iter().map(|s| (s.id.as_str(), s)).collect();
    let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        HashSet::from(["parse-router", "parse-target-worker", "parse-draft-worker"]),
        "{spans:#?}"
    );
    let generate = spans.iter().find(|s| s.name == "generate").unwrap();
    assert_eq!(
        generate.parent, client_span,
        "the router's span is the client's child"
    );
    let rounds: Vec<&SpanRec> = spans.iter().filter(|s| s.name == "round").collect();
    assert!(!rounds.is_empty(), "no round spans: {spans:#?}");
    for r in &rounds {
        assert_eq!(r.parent, generate.id, "a round is a child of generate");
    }
    let workers: Vec<&SpanRec> = spans
        .iter()
        .filter(|s| s.service != "parse-router")
        .collect();
    for w in &workers {
        let parent = by_id
            .get(w.parent.as_str())
            .unwrap_or_else(|| panic!("{w:?} has no parent in the trace"));
        assert_eq!(
            parent.service, "parse-router",
            "{w:?} is a child of a router span"
        );
    }
    for name in ["target verify", "draft draft"] {
        let of_rounds = workers
            .iter()
            .filter(|w| w.name == name)
            .filter(|w| by_id[w.parent.as_str()].name == "round")
            .count();
        assert!(of_rounds > 0, "no `{name}` span under a round: {spans:#?}");
    }
    for name in ["target open", "target release", "draft release"] {
        assert!(
            workers.iter().any(|w| w.name == name),
            "no `{name}` span: {spans:#?}"
        );
    }
}
