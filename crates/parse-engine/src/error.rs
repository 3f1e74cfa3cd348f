//! The engine's error type. Every fallible engine call returns [`Result`]; nothing a caller passes in (tokens,
//! positions, masks, files) can make the engine panic.

use std::path::PathBuf;

/// Errors raised by the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("io error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model file {path}: {reason}")]
    InvalidModel { path: PathBuf, reason: String },
    #[error("unsupported architecture `{0}` (supported: qwen2, llama, mistral)")]
    UnsupportedArchitecture(String),
    #[error("unsupported tensor type {dtype} for `{tensor}`")]
    UnsupportedDType { tensor: String, dtype: String },
    #[error("shape mismatch for `{tensor}`: expected {expected:?}, found {found:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("unknown session `{0}`")]
    UnknownSession(String),
    #[error("session `{0}` already exists")]
    SessionExists(String),
    #[error(
        "KV capacity exceeded: session `{session}` needs {needed} more bytes, {available} of {capacity} available"
    )]
    CapacityExceeded {
        session: String,
        needed: usize,
        available: usize,
        capacity: usize,
    },
    #[error(
        "KV share exceeded: session `{session}` would hold {would_hold} bytes of KV cache; one session may hold \
         {limit} (the worker's --kv-session-share)"
    )]
    SessionShareExceeded {
        session: String,
        would_hold: usize,
        limit: usize,
    },
    #[error("context length exceeded: {needed} tokens, the model allows {limit}")]
    ContextExceeded { needed: usize, limit: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error(transparent)]
    Backend(parse_core::Error),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A collective of the tensor-parallel group failed (a rank died or hung); the group is unusable.
    #[error("tensor-parallel group: {0}")]
    Comm(parse_comm::CommError),
}

impl From<parse_text::Error> for Error {
    fn from(e: parse_text::Error) -> Self {
        match e {
            parse_text::Error::InvalidInput(m) => Error::InvalidInput(m),
            parse_text::Error::Tokenizer(m) => Error::Tokenizer(m),
        }
    }
}

impl From<parse_core::Error> for Error {
    fn from(e: parse_core::Error) -> Self {
        match e.kind {
            parse_core::ErrorKind::InvalidInput => Error::InvalidInput(e.message),
            _ => Error::Backend(e),
        }
    }
}

impl From<Error> for parse_core::Error {
    /// Engine errors by meaning, for the PARSE loop and the services.
    fn from(e: Error) -> Self {
        use parse_core::ErrorKind as K;
        let kind = match &e {
            Error::InvalidInput(_) | Error::ContextExceeded { .. } => K::InvalidInput,
            Error::CapacityExceeded { .. } | Error::SessionShareExceeded { .. } => {
                K::ResourceExhausted
            }
            Error::UnknownSession(_) => K::NotFound,
            Error::SessionExists(_) => K::AlreadyExists,
            Error::Backend(inner) => inner.kind,
            Error::Comm(_) => K::Unavailable,
            _ => K::Internal,
        };
        parse_core::Error::new(kind, e.to_string())
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidInput(msg.into())
    }

    pub(crate) fn model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::InvalidModel {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
