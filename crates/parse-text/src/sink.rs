//! The token-to-text sink of a generation: tokens in (as the PARSE loop accepts them), text deltas out, cut at the
//! first stop string. The router and parsectl both stream through it.

use std::sync::Arc;

use crate::{Result, StopFilter, StreamDecoder, Tokenizer};

/// Turns output tokens into releasable text.
pub struct TextSink {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder,
    filter: StopFilter,
    stopped: bool,
}

impl TextSink {
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Self {
        TextSink {
            tokenizer,
            decoder: StreamDecoder::new(),
            filter: StopFilter::new(stop),
            stopped: false,
        }
    }

    /// Adds tokens; returns the text they release. Once a stop string is found ([`TextSink::stopped`]) the text is
    /// cut before it and later tokens release nothing.
    pub fn push(&mut self, tokens: &[u32]) -> Result<String> {
        let mut text = String::new();
        for &t in tokens {
            if self.stopped {
                break;
            }
            if let Some(delta) = self.decoder.push(&self.tokenizer, t)? {
                let (out, hit) = self.filter.push(&delta);
                text.push_str(&out);
                self.stopped = hit;
            }
        }
        Ok(text)
    }

    /// Whether a stop string has been found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Releases the text held back as a possible stop-string start (call once generation has ended).
    pub fn flush(&mut self) -> String {
        self.filter.flush()
    }

    /// All text so far (cut before a stop string).
    pub fn text(&self) -> &str {
        self.filter.text()
    }
}
