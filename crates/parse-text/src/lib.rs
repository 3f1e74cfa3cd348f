//! Text around the models, shared by the engine, the workers, the router and parsectl: the tokenizer with its
//! special tokens and chat layout ([`tokenizer`]), text deltas that never split a character ([`StreamDecoder`]),
//! stop strings ([`StopFilter`]) and the sink that turns the PARSE loop's tokens into text ([`TextSink`]).
//!
//! No ML dependency: a router links this crate, not the engine. Building a tokenizer from a GGUF file's metadata
//! is the engine's job (it reads the file); it hands the pieces to [`Tokenizer::from_parts`].

pub mod sink;
pub mod stop;
pub mod tokenizer;

pub use sink::TextSink;
pub use stop::StopFilter;
pub use tokenizer::{
    ChatRole, ChatTemplate, Message, QWEN25_DEFAULT_SYSTEM, StreamDecoder, Tokenizer,
};

/// Errors of the text layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tokenizer could not be built, or could not encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The caller's text is not usable (an empty conversation).
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl From<Error> for parse_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidInput(m) => parse_core::Error::invalid(m),
            Error::Tokenizer(m) => parse_core::Error::internal(format!("tokenizer: {m}")),
        }
    }
}

/// The text layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
