//! Errors of the PARSE loop and of the backends it drives. Backends (in-process engines, gRPC clients) map their
//! own failures into an [`ErrorKind`] by meaning, so the loop can decide what to retry and services can map kinds to
//! status codes in one place.

/// What went wrong, by meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or exceeds a limit.
    InvalidInput,
    /// A worker is out of capacity.
    ResourceExhausted,
    /// A session (or another named thing) the call refers to does not exist.
    NotFound,
    /// A session to be created exists already.
    AlreadyExists,
    /// A worker could not be reached or was lost.
    Unavailable,
    /// The request was cancelled.
    Cancelled,
    /// The request ran out of time.
    DeadlineExceeded,
    /// A bug or an unexpected state; details are logged where it happened.
    Internal,
}

/// The loop's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

/// The loop's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
