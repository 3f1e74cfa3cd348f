//! The OpenAI-compatible HTTP API of the router: `POST /v1/chat/completions`, `POST /v1/completions` (both with
//! `stream: true` as server-sent events ending in `data: [DONE]`, and `stream_options.include_usage`),
//! `GET /v1/models`, `GET /health`.
//!
//! The handlers are here; [`request`] turns OpenAI's request bodies into ours, [`sse`] writes the answer (whole or
//! streamed), [`tls`] serves HTTPS.
//!
//! A request becomes a `parse.v1.GenerateRequest` and runs through the same path as the gRPC API
//! ([`Router::run`]): one validation, one loop, the same limits. Decisions where OpenAI's API and ours differ:
//! - `temperature` left out means greedy (0), PARSE's setting, not OpenAI's 1. A request that samples and names no
//!   mode runs `token-spec` (PARSE itself decodes greedily; see `Router::build`).
//! - `max_tokens` / `max_completion_tokens` left out means [`DEFAULT_MAX_TOKENS`] (capped by the router's limit),
//!   lowered to what fits in the model's context beside the prompt; given, prompt and budget must fit together (400
//!   otherwise, as OpenAI answers).
//! - A completion's `prompt` is a string (sent raw, no chat template), an array of token ids
//!   (`GenerateRequest.prompt_tokens`), or an array holding one of these: one prompt per request.
//! - `n` must be 1; `logprobs`, tools, penalties, `logit_bias`, `echo`, `suffix`, `best_of` and a non-text
//!   `response_format` are refused with 400 rather than ignored. `user` is accepted and only logged.
//! - PARSE settings go in an extension object, `"parse": {"mode", "tau", "verdict", "exact_floor",
//!   "draft_segments", "drafter", "adaptive"}` (every field optional, unknown fields refused), and `usage.parse` carries the acceptance
//!   figures of the request beside OpenAI's token counts.
//! - `usage.prompt_tokens_details.cached_tokens` is OpenAI's: the prompt tokens the target worker took from a prompt
//!   it kept earlier (prefix caching, within the request's `cache_salt`) rather than computed.
//! - `model` must be the served model's id (`GET /v1/models`) when given, as in other OpenAI-compatible servers.
//! - A client that disconnects (mid-stream or while waiting) cancels the request on both workers.
//!
//! Errors use OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}` with the status a gRPC code
//! maps to: 400 bad input, 404 unknown model, 429 router full, 503 no worker, 504 deadline, 500 otherwise.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use parse_proto::v1::generate_stream_response::Event;
use parse_proto::v1::{
    ChatMessage, Finished, GenerateRequest, GenerateStreamResponse, Sampling, Stats,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};

use crate::Router;

/// The largest request body read (axum's default, named here so that a refusal can say it): twice the router's own
/// limit on a request's prompt text (`--max-prompt-bytes`, 1 MiB), which leaves room for JSON's escapes.
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// Output budget of a request that names none.
pub const DEFAULT_MAX_TOKENS: u32 = 1024;

/// Stop strings a request may give (the router's limit, which is OpenAI's).
const MAX_STOP: usize = crate::MAX_STOPS;

/// The HTTP application; serve it with [`serve_openai`]. With an API key (`RouterConfig::openai_api_key`) every
/// `/v1` route requires `Authorization: Bearer <key>`; `/health` and `/metrics` stay open (probes, Prometheus).
pub fn app(router: Router) -> axum::Router {
    let key = router.cfg.openai_api_key.clone();
    let v1 = axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let key = key.clone();
                async move {
                    match check_api_key(key.as_deref(), req.headers()) {
                        Ok(()) => next.run(req).await,
                        Err(r) => r,
                    }
                }
            },
        ));
    v1.route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route", "not_found_error") })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            let message = format!("method {method} is not allowed on this route");
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                &message,
                "invalid_request_error",
            )
        })
        .with_state(router)
}

/// `Authorization: Bearer <key>` against the configured key (compared in constant time); 401 in OpenAI's shape.
#[allow(clippy::result_large_err)]
fn check_api_key(key: Option<&str>, headers: &HeaderMap) -> Result<(), Response> {
    let Some(key) = key else {
        return Ok(());
    };
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if parse_proto::security::same_secret(given.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key (Authorization: Bearer <key>)",
            "authentication_error",
        ))
    }
}

/// Serves the OpenAI API on `listener` until `shutdown` resolves: HTTPS with the router's certificate when
/// `RouterConfig::openai_tls` is on (clients need no certificate of their own: the API key authenticates them),
/// plain HTTP otherwise (loopback, or TLS ended at an ingress; /metrics is scraped there too).
pub async fn serve_openai(
    router: Router,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let tls = match (router.cfg.openai_tls, router.cfg.security.identity_pem()) {
        (false, _) => None,
        (true, Some(id)) => Some(tls_acceptor(id)?),
        (true, None) => {
            anyhow::bail!("HTTPS on the OpenAI API needs the router's --tls-cert and --tls-key")
        }
    };
    let app = app(router);
    let served = match tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Some(acceptor) => {
            axum::serve(TlsListener::spawn(listener, acceptor)?, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    };
    served.map_err(|e| anyhow::anyhow!("OpenAI API: {e}"))
}

/// An error in OpenAI's shape.
fn error(status: StatusCode, message: &str, kind: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
    (status, axum::Json(body)).into_response()
}

fn http_status(code: Code) -> (StatusCode, &'static str) {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        Code::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
        Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
        Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
        Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
        Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
    }
}

fn status_error(s: &Status) -> Response {
    let (status, kind) = http_status(s.code());
    error(status, s.message(), kind)
}

fn status_json(s: &Status) -> Value {
    let (_, kind) = http_status(s.code());
    json!({"error": {"message": s.message(), "type": kind, "param": null, "code": null}})
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// A request's body, or the reason it could not be read (a body past the size limit: 413) in OpenAI's error shape.
type BodyRead = Result<Bytes, axum::extract::rejection::BytesRejection>;

fn body_refused(r: &axum::extract::rejection::BytesRejection) -> Response {
    let message = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        format!("the request body is larger than {MAX_BODY_BYTES} bytes")
    } else {
        format!("the request body could not be read: {}", r.body_text())
    };
    error(r.status(), &message, "invalid_request_error")
}

async fn chat_completions(
    State(router): State<Router>,
    headers: HeaderMap,
    body: BodyRead,
) -> Response {
    match body {
        Ok(body) => generate(router, headers, body, Kind::Chat).await,
        Err(r) => body_refused(&r),
    }
}

async fn completions(State(router): State<Router>, headers: HeaderMap, body: BodyRead) -> Response {
    match body {
        Ok(body) => generate(router, headers, body, Kind::Completion).await,
        Err(r) => body_refused(&r),
    }
}

async fn generate(router: Router, headers: HeaderMap, body: Bytes, kind: Kind) -> Response {
    let m = match router.model().await {
        Ok(m) => m,
        Err(s) => return status_error(&s),
    };
    let limit = router.cfg.max_new_tokens_limit;
    let built = match kind {
        Kind::Chat => chat_request(&body, &m.name, limit),
        Kind::Completion => completion_request(&body, &m.name, limit),
    };
    let (mut r, shape) = match built {
        Ok(x) => x,
        Err(s) => return status_error(&s),
    };
    r.request_id = request_id(&headers);
    let id = format!("{}{}", kind.id_prefix(), r.request_id);
    let created = now_s();
    let (tx, rx) = mpsc::channel::<Result<GenerateStreamResponse, Status>>(64);
    let err_tx = tx.clone();
    let runner = router.clone();
    // The loop runs in its own task; this handler (or the stream below) holding `rx` is what keeps it going: a
    // client that goes away drops it, and the router cancels the request on both workers.
    let parent: crate::TraceParent =
        Box::new(move |span| parse_proto::telemetry::set_parent_from_http(span, &headers));
    tokio::spawn(async move {
        if let Err(s) = runner.run(r, None, tx, parent).await {
            let _ = err_tx.send(Err(s)).await;
        }
    });
    if shape.stream {
        stream(rx, shape, id, created).await
    } else {
        whole(rx, kind, shape, id, created).await
    }
}

/// The served model as OpenAI's model object.
fn model_object(name: &str, max_context: impl serde::Serialize) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "parse", "max_model_len": max_context})
}

async fn models(State(router): State<Router>) -> Response {
    match router.model().await {
        Ok(m) => axum::Json(json!({
            "object": "list",
            "data": [model_object(&m.name, m.max_context)],
        }))
        .into_response(),
        Err(s) => status_error(&s),
    }
}

/// `GET /v1/models/{model}`: the served model's object, or 404 for any other name (OpenAI clients' `models.retrieve`).
async fn model(
    State(router): State<Router>,
    axum::extract::Path(asked): axum::extract::Path<String>,
) -> Response {
    match router.model().await {
        Ok(m) if m.name == asked => {
            axum::Json(model_object(&m.name, m.max_context)).into_response()
        }
        Ok(m) => status_error(&unknown_model(&asked, &m.name)),
        Err(s) => status_error(&s),
    }
}

/// Prometheus text exposition of the router's metrics (`crate::metrics`).
async fn metrics(State(router): State<Router>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        router.metrics.render(),
    )
        .into_response()
}

/// 200 while a target worker is up (a request can be served), else 503.
async fn health(State(router): State<Router>) -> Response {
    let up = router.targets.workers().iter().any(|w| w.healthy());
    if up {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no target worker is up",
            "service_unavailable",
        )
    }
}

mod request;
mod sse;
#[cfg(test)]
mod tests;
mod tls;

use request::*;
use sse::*;
use tls::*;
