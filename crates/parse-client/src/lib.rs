//! Async client for the PARSE Generation API (`parse.v1.Generation`, served by `parse-router`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), parse_client::ClientError> {
//! use parse_client::{Client, Event, request};
//! use tokio_stream::StreamExt;
//!
//! let mut client = Client::connect("127.0.0.1:50051").await?;
//!
//! // The whole answer at once.
//! let mut req = request("Write a haiku about the sea.", 64);
//! req.mode = "parse".into();
//! let reply = client.generate(req.clone()).await?;
//! println!("{} ({} tokens)", reply.text, reply.token_ids.len());
//!
//! // Or as it is accepted.
//! let mut stream = client.generate_stream(req).await?;
//! while let Some(event) = stream.next().await {
//!     match event? {
//!         Event::Delta(d) => print!("{}", d.text),
//!         Event::Finished(f) => println!("\n[{}]", f.finish_reason),
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Errors are typed by the gRPC status the router returned ([`ClientError`]): bad input, overload, lost workers
//! and deadlines are told apart, so callers can retry only what is worth retrying.

use std::pin::Pin;
use std::time::Duration;

use parse_proto::v1::generate_stream_response::Event as WireEvent;
use parse_proto::v1::generation_client::GenerationClient;
pub use parse_proto::v1::{
    ChatMessage, Finished, GenerateRequest, GenerateResponse, Sampling, Segmenter, Stats,
    TextDelta, TokenSource,
};
use tokio_stream::{Stream, StreamExt};
use tonic::Code;
use tonic::transport::Channel;

/// What went wrong, by the meaning of the router's status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    #[error("the cluster is overloaded: {0}")]
    ResourceExhausted(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("server error ({code:?}): {message}")]
    Server { code: Code, message: String },
}

impl ClientError {
    /// Whether trying again later may succeed (overload, lost workers).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::ResourceExhausted(_)
                | ClientError::Unavailable(_)
                | ClientError::Connect { .. }
        )
    }
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        // A transport failure's status says only "transport error"; its causes say what happened (a TLS port
        // spoken to in plain text, a refused certificate).
        let m = match std::error::Error::source(&s) {
            Some(cause) => {
                let chain = parse_proto::security::error_chain(cause);
                match chain.strip_prefix(s.message()) {
                    Some(rest) => format!("{}{rest}", s.message()),
                    None => format!("{}: {chain}", s.message()),
                }
            }
            None => s.message().to_string(),
        };
        match s.code() {
            Code::InvalidArgument | Code::OutOfRange => ClientError::InvalidArgument(m),
            Code::ResourceExhausted => ClientError::ResourceExhausted(m),
            Code::Unavailable => ClientError::Unavailable(m),
            Code::DeadlineExceeded => ClientError::DeadlineExceeded(m),
            Code::Cancelled => ClientError::Cancelled(m),
            code => ClientError::Server { code, message: m },
        }
    }
}

/// Connection settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub connect_timeout: Duration,
    /// Deadline of each call (sent as `grpc-timeout`; the router stops the request when it passes).
    pub request_timeout: Option<Duration>,
    /// Mutual TLS to a router that runs it (`Security::from_pem` with this client's certificate and the cluster
    /// CA); plain text by default.
    pub security: parse_proto::security::Security,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            request_timeout: None,
            security: Default::default(),
        }
    }
}

/// One streamed event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Delta(TextDelta),
    Finished(Finished),
}

/// The stream of [`Client::generate_stream`].
pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, ClientError>> + Send>>;

/// A request with a user prompt and defaults for everything else (the router's default mode and policy, greedy).
pub fn request(prompt: &str, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_string(),
        max_new_tokens,
        ..Default::default()
    }
}

/// A Generation API client. Cheap to clone (the connection is shared).
#[derive(Clone)]
pub struct Client {
    inner: GenerationClient<Channel>,
    opts: ClientOptions,
}

impl Client {
    /// Connects to a router at `host:port` (or a full `http://` URI).
    pub async fn connect(addr: &str) -> Result<Self, ClientError> {
        Self::connect_with(addr, ClientOptions::default()).await
    }

    pub async fn connect_with(addr: &str, opts: ClientOptions) -> Result<Self, ClientError> {
        let err = |message: String| ClientError::Connect {
            addr: addr.to_string(),
            message,
        };
        let channel = opts
            .security
            .endpoint(addr)
            .map_err(|e| err(parse_proto::security::error_chain(&e)))?
            .connect_timeout(opts.connect_timeout)
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| err(parse_proto::security::error_chain(&e)))?;
        Ok(Client {
            inner: GenerationClient::new(channel),
            opts,
        })
    }

    fn wrap<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(t) = self.opts.request_timeout {
            r.set_timeout(t);
        }
        r
    }

    /// Generates the whole answer.
    pub async fn generate(
        &mut self,
        req: GenerateRequest,
    ) -> Result<GenerateResponse, ClientError> {
        let r = self.wrap(req);
        Ok(self.inner.generate(r).await?.into_inner())
    }

    /// Streams text deltas as they are accepted, then a [`Event::Finished`]. Dropping the stream cancels the request
    /// on the cluster.
    pub async fn generate_stream(
        &mut self,
        req: GenerateRequest,
    ) -> Result<EventStream, ClientError> {
        let r = self.wrap(req);
        let stream = self.inner.generate_stream(r).await?.into_inner();
        Ok(Box::pin(stream.filter_map(|m| match m {
            Ok(m) => match m.event {
                Some(WireEvent::Delta(d)) => Some(Ok(Event::Delta(d))),
                Some(WireEvent::Finished(f)) => Some(Ok(Event::Finished(f))),
                None => None,
            },
            Err(s) => Some(Err(ClientError::from(s))),
        })))
    }
}
