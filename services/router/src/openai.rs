//! The OpenAI-compatible HTTP API of the router: `POST /v1/chat/completions`, `POST /v1/completions` (both with
//! `stream: true` as server-sent events ending in `data: [DONE]`, and `stream_options.include_usage`),
//! `GET /v1/models`, `GET /health`.
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

fn tls_acceptor((cert, key): (&[u8], &[u8])) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("OpenAI API TLS certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| anyhow::anyhow!("OpenAI API TLS key: {e}"))?;
    let mut cfg = tokio_rustls::rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| anyhow::anyhow!("OpenAI API TLS: {e}"))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| anyhow::anyhow!("OpenAI API TLS: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)))
}

/// Most TLS handshakes in progress at once, and how long one may take: a flood of connections that never finish
/// their handshake holds neither the accept loop nor unbounded tasks.
const MAX_HANDSHAKES: usize = 256;
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A listener of finished TLS connections: a task accepts TCP connections and runs each handshake on a task of
/// its own (a slow one does not hold up the others).
struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        std::net::SocketAddr,
    )>,
    local: std::net::SocketAddr,
    task: tokio::task::AbortHandle,
}

impl TlsListener {
    fn spawn(
        listener: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let task = tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!("OpenAI API accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "OpenAI API TLS handshake: {e}"),
                        Err(_) => tracing::debug!(%peer, "OpenAI API TLS handshake timed out"),
                    }
                });
            }
        })
        .abort_handle();
        Ok(TlsListener { rx, local, task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task is gone (only when the listener is dropped): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
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

fn bad(message: impl Into<String>) -> Status {
    Status::invalid_argument(message)
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "expected a string or an array of strings")]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A completion's `prompt` as OpenAI's API takes it: a string, token ids, or an array of either (one prompt per
/// request here).
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string, an array of token ids (integers from 0), or an array of one of these"
)]
enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The one prompt of a completion request.
enum OnePrompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptIn {
    /// The one prompt of the request, or a 400 for several or for no token at all.
    fn one(self) -> Result<OnePrompt, Status> {
        let many = |n: usize| {
            bad(format!(
                "prompt must be one prompt (got {n}): one completion per request"
            ))
        };
        match self {
            PromptIn::Text(s) => Ok(OnePrompt::Text(s)),
            PromptIn::Tokens(t) if t.is_empty() => Err(bad("prompt: an empty array of token ids")),
            PromptIn::Tokens(t) => Ok(OnePrompt::Tokens(t)),
            PromptIn::Texts(mut v) if v.len() == 1 => Ok(OnePrompt::Text(v.remove(0))),
            PromptIn::Texts(v) => Err(many(v.len())),
            PromptIn::TokenLists(mut v) if v.len() == 1 => PromptIn::Tokens(v.remove(0)).one(),
            PromptIn::TokenLists(v) => Err(many(v.len())),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "expected a string or an array of content parts")]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct MessageIn {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ParseExt {
    mode: Option<String>,
    tau: Option<f32>,
    verdict: Option<String>,
    exact_floor: Option<bool>,
    draft_segments: Option<u32>,
    drafter: Option<String>,
    adaptive: Option<bool>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// `cache_salt`'s string as the workers take it: its 64-bit FNV-1a hash (the same in every router replica), never 0,
/// the value of requests that set none.
fn salt_of(s: &str) -> u64 {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

/// The fields both endpoints share.
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not OpenAI's; vLLM's and ours. 0 or -1 (vLLM's way of saying it): no cut.
    top_k: Option<i64>,
    seed: Option<u64>,
    /// Not OpenAI's; vLLM's and ours: the namespace of the workers' prefix caches (`Sampling.cache_salt`, from a
    /// hash of the string).
    cache_salt: Option<String>,
    stop: Option<OneOrMany>,
    n: Option<u32>,
    user: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logprobs: Option<Value>,
    top_logprobs: Option<u32>,
    logit_bias: Option<Value>,
    tools: Option<Value>,
    functions: Option<Value>,
    response_format: Option<Value>,
    parse: Option<ParseExt>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<MessageIn>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: PromptIn,
    #[serde(default)]
    echo: bool,
    suffix: Option<String>,
    best_of: Option<u32>,
    #[serde(flatten)]
    common: Common,
}

/// Which endpoint a request came through (the shape of the answer).
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
}

fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Status> {
    serde_json::from_slice(body).map_err(|e| bad(format!("invalid request body: {e}")))
}

fn non_zero(v: &Option<f32>) -> bool {
    v.is_some_and(|x| x != 0.0)
}

fn non_empty(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

/// OpenAI's request fields as ours, or a 400 for what the server does not do.
fn common_into(c: Common, r: &mut GenerateRequest, router_limit: usize) -> Result<(), Status> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(bad("n must be 1: one choice per request"));
    }
    if non_zero(&c.presence_penalty) || non_zero(&c.frequency_penalty) {
        return Err(bad(
            "presence_penalty and frequency_penalty are not supported",
        ));
    }
    if matches!(&c.logprobs, Some(Value::Bool(true)))
        || matches!(&c.logprobs, Some(Value::Number(n)) if n.as_u64() != Some(0))
        || c.top_logprobs.is_some_and(|n| n > 0)
    {
        return Err(bad("logprobs are not supported"));
    }
    if non_empty(&c.logit_bias) {
        return Err(bad("logit_bias is not supported"));
    }
    if non_empty(&c.tools) || non_empty(&c.functions) {
        return Err(bad("tools and functions are not supported"));
    }
    if let Some(f) = &c.response_format
        && !f.is_null()
        && f.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(bad(
            "response_format: only {\"type\": \"text\"} is supported",
        ));
    }
    let asked = c.max_completion_tokens.or(c.max_tokens);
    let max = asked.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(router_limit as u32));
    if max == 0 {
        return Err(bad("max_tokens must be at least 1"));
    }
    if max as usize > router_limit {
        // Named as the client sent it (the router would name its own field, max_new_tokens).
        return Err(bad(format!(
            "max_tokens must be at most {router_limit} on this server, got {max}"
        )));
    }
    r.max_new_tokens = max;
    // Left out, the budget is what fits beside the prompt (up to the default); asked for, it must fit.
    r.fit_context = asked.is_none();
    let temperature = c.temperature.unwrap_or(0.0);
    let top_k = match c.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k => u32::try_from(k).map_err(|_| {
            bad(format!(
                "top_k must be a count of tokens, or 0 or -1 for no cut; got {k}"
            ))
        })?,
    };
    let seed = match c.seed {
        Some(s) => s,
        // A sampled request without a seed gets a fresh one (OpenAI's behaviour: different answers each call).
        None if temperature > 0.0 => uuid::Uuid::new_v4().as_u64_pair().0,
        None => 0,
    };
    r.sampling = Some(Sampling {
        temperature,
        top_k,
        top_p: c.top_p,
        seed,
        cache_salt: c.cache_salt.as_deref().map_or(0, salt_of),
    });
    let stop = c.stop.map(OneOrMany::into_vec).unwrap_or_default();
    if stop.len() > MAX_STOP {
        return Err(bad(format!(
            "at most {MAX_STOP} stop strings, got {}",
            stop.len()
        )));
    }
    r.stop = stop;
    if let Some(p) = c.parse {
        r.mode = p.mode.unwrap_or_default();
        r.tau = p.tau;
        r.verdict = p.verdict.unwrap_or_default();
        r.exact_floor = p.exact_floor;
        r.draft_segments = p.draft_segments.unwrap_or(0);
        r.drafter = p.drafter.unwrap_or_default();
        r.adaptive = p.adaptive;
    }
    if let Some(u) = &c.user {
        tracing::debug!(user = %u, "OpenAI request");
    }
    Ok(())
}

/// What a request asked for beyond the generation itself.
struct Shape {
    kind: Kind,
    model: String,
    stream: bool,
    include_usage: bool,
}

fn unknown_model(asked: &str, served: &str) -> Status {
    Status::not_found(format!(
        "model `{asked}` does not exist: this server serves `{served}` (GET /v1/models)"
    ))
}

fn check_model(asked: &Option<String>, served: &str) -> Result<(), Status> {
    match asked {
        Some(m) if !m.is_empty() && m != served => Err(unknown_model(m, served)),
        _ => Ok(()),
    }
}

fn chat_request(
    body: &Bytes,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let req: ChatRequest = parse_body(body)?;
    check_model(&req.common.model, served)?;
    if req.messages.is_empty() {
        return Err(bad("messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        if m.tool_calls.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(bad(format!("messages[{i}]: tool calls are not supported")));
        }
        let role = match m.role.as_str() {
            // OpenAI's newer name for system instructions.
            "developer" => "system".to_string(),
            "system" | "user" | "assistant" => m.role,
            other => {
                return Err(bad(format!(
                    "messages[{i}]: role `{other}` is not supported (system, developer, user, assistant)"
                )));
            }
        };
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(bad(format!(
                            "messages[{i}]: content of type `{}` is not supported (text only)",
                            p.kind
                        )));
                    }
                    text.push_str(&p.text.unwrap_or_default());
                }
                text
            }
        };
        messages.push(ChatMessage { role, content });
    }
    let r = GenerateRequest {
        messages,
        ..Default::default()
    };
    with_common(r, req.common, Kind::Chat, served, limit)
}

fn completion_request(
    body: &Bytes,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let req: CompletionRequest = parse_body(body)?;
    check_model(&req.common.model, served)?;
    let prompt = req.prompt.one()?;
    if req.echo {
        return Err(bad("echo is not supported"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(bad("best_of must be 1"));
    }
    let r = match prompt {
        OnePrompt::Text(text) => GenerateRequest {
            prompt: text,
            raw_prompt: true,
            ..Default::default()
        },
        OnePrompt::Tokens(tokens) => GenerateRequest {
            prompt_tokens: tokens,
            ..Default::default()
        },
    };
    with_common(r, req.common, Kind::Completion, served, limit)
}

/// Adds the shared fields to an endpoint's request and notes the answer's shape.
fn with_common(
    mut r: GenerateRequest,
    common: Common,
    kind: Kind,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let shape = Shape {
        kind,
        model: served.to_string(),
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    common_into(common, &mut r, limit)?;
    Ok((r, shape))
}

fn finish_reason(f: &Finished) -> &'static str {
    // Ours: eos, stop (a stop string or the client), length.
    match f.finish_reason.as_str() {
        "length" => "length",
        _ => "stop",
    }
}

fn usage(stats: Option<&Stats>) -> Value {
    let s = stats.cloned().unwrap_or_default();
    // An end token accepted from the draft is not an output token: the share is of the output.
    let draft_share = if s.output_tokens > 0 {
        f64::from(s.draft_tokens_accepted.min(s.output_tokens)) / f64::from(s.output_tokens)
    } else {
        0.0
    };
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.output_tokens,
        "total_tokens": s.prompt_tokens + s.output_tokens,
        // As OpenAI reports prompt caching: the prompt tokens taken from a prompt the target kept earlier.
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
        "parse": {
            "mode": s.mode,
            "draft_tokens_proposed": s.draft_tokens_proposed,
            "draft_tokens_accepted": s.draft_tokens_accepted,
            "draft_share": draft_share,
            "segments_proposed": s.segments_proposed,
            "segments_accepted": s.segments_accepted,
            "target_passes": s.target_passes,
            "target_passes_per_token": s.target_passes_per_token,
            "paused_tokens": s.paused_tokens,
            "copy_rounds": s.copy_rounds,
            "token_rounds": s.token_rounds,
            "guesses": s.guesses,
            "guesses_right": s.guesses_right,
            "tokens_per_s": s.tokens_per_s,
        },
    })
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One streamed chunk carrying `text` (and the role, for a chat's first chunk).
fn chunk(
    shape: &Shape,
    id: &str,
    created: u64,
    text: Option<&str>,
    finish: Option<&str>,
    first: bool,
) -> Value {
    let choice = match shape.kind {
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
        Kind::Completion => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        }
    };
    let mut v = json!({
        "id": id, "object": shape.kind.object(true), "created": created, "model": shape.model,
        "choices": [choice],
    });
    if shape.include_usage {
        v["usage"] = Value::Null;
    }
    v
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
    let (tx, mut rx) = mpsc::channel::<Result<GenerateStreamResponse, Status>>(64);
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
        // Wait for the first event so that a request refused before generating gets its HTTP status.
        let first = match rx.recv().await {
            Some(Ok(e)) => e,
            Some(Err(s)) => return status_error(&s),
            None => return status_error(&Status::internal("generation ended without a result")),
        };
        let (out_tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
        tokio::spawn(async move {
            let mut first_chunk = true;
            let mut next = Some(Ok(first));
            loop {
                let item = match next.take() {
                    Some(i) => i,
                    None => match rx.recv().await {
                        Some(i) => i,
                        None => break,
                    },
                };
                let data = match item {
                    Ok(GenerateStreamResponse {
                        event: Some(Event::Delta(d)),
                    }) => {
                        if d.text.is_empty() && !first_chunk {
                            continue;
                        }
                        let v = chunk(&shape, &id, created, Some(&d.text), None, first_chunk);
                        first_chunk = false;
                        vec![v]
                    }
                    Ok(GenerateStreamResponse {
                        event: Some(Event::Finished(f)),
                    }) => {
                        let mut v = vec![chunk(
                            &shape,
                            &id,
                            created,
                            None,
                            Some(finish_reason(&f)),
                            first_chunk,
                        )];
                        if shape.include_usage {
                            v.push(json!({
                                "id": id, "object": shape.kind.object(true), "created": created,
                                "model": shape.model, "choices": [], "usage": usage(f.stats.as_ref()),
                            }));
                        }
                        v
                    }
                    Ok(GenerateStreamResponse { event: None }) => continue,
                    // Past the headers an error can only travel in the stream (as other OpenAI servers send it).
                    Err(s) => vec![status_json(&s)],
                };
                for v in data {
                    if out_tx
                        .send(Ok(SseEvent::default().data(v.to_string())))
                        .await
                        .is_err()
                    {
                        return; // the client went away; dropping `rx` cancels the request
                    }
                }
            }
            let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        return Sse::new(ReceiverStream::new(out_rx))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let mut text = String::new();
    let mut finished = None;
    while let Some(msg) = rx.recv().await {
        match msg {
            Ok(GenerateStreamResponse {
                event: Some(Event::Delta(d)),
            }) => text.push_str(&d.text),
            Ok(GenerateStreamResponse {
                event: Some(Event::Finished(f)),
            }) => finished = Some(f),
            Ok(_) => {}
            Err(s) => return status_error(&s),
        }
    }
    let Some(f) = finished else {
        return status_error(&Status::internal("generation ended without a result"));
    };
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": finish_reason(&f),
        }),
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(&f),
        }),
    };
    axum::Json(json!({
        "id": id, "object": kind.object(false), "created": created, "model": shape.model,
        "choices": [choice], "usage": usage(f.stats.as_ref()),
    }))
    .into_response()
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

#[cfg(test)]
mod tests;
