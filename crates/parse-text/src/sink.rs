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
    kept: usize,
}

impl TextSink {
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Self {
        TextSink {
            tokenizer,
            decoder: StreamDecoder::new(),
            filter: StopFilter::new(stop),
            stopped: false,
            kept: 0,
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
            self.kept += 1;
            if let Some(delta) = self.decoder.push(&self.tokenizer, t)? {
                let (out, hit) = self.filter.push(&delta);
                text.push_str(&out);
                self.stopped = hit;
            }
        }
        Ok(text)
    }

    /// The tokens that make up the answer: all pushed so far, or, once a stop string is found, those up to and
    /// including the one that completed it. The loop hands tokens over in rounds and may have accepted more past a
    /// stop string in the same round; those are not the answer's, and a reply counts and lists these alone (as
    /// OpenAI-compatible servers count a stopped completion's tokens).
    pub fn kept(&self) -> usize {
        self.kept
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        // The reference tokenizer kept in the repository.
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/tokenizer/qwen2.5-tokenizer.json");
        Arc::new(Tokenizer::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
    }

    #[test]
    fn a_stop_string_keeps_the_tokens_up_to_the_one_that_completes_it() {
        let tok = tokenizer();
        let ids = tok.encode("1, 2, 3, 4, 5, 6, 7, 8").unwrap();
        // The token that completes "4, 5": the first prefix whose text holds it.
        let want = (1..=ids.len())
            .find(|&k| tok.decode(&ids[..k], true).unwrap().contains("4, 5"))
            .unwrap();
        assert!(want < ids.len());
        // Handed over in rounds of three, as the loop accepts several tokens at once.
        let mut sink = TextSink::new(tok.clone(), vec!["4, 5".into()]);
        let mut text = String::new();
        for round in ids.chunks(3) {
            text.push_str(&sink.push(round).unwrap());
            assert!(sink.kept() <= want, "kept {} of {want}", sink.kept());
        }
        text.push_str(&sink.flush());
        assert!(sink.stopped());
        assert_eq!(text, "1, 2, 3, ");
        assert_eq!(sink.kept(), want);
        // Without a stop string every token is kept.
        let mut sink = TextSink::new(tok, vec![]);
        for round in ids.chunks(3) {
            sink.push(round).unwrap();
        }
        assert_eq!((sink.kept(), sink.stopped()), (ids.len(), false));
    }
}
