//! Segment boundaries from a draft's text.
//!
//! A segment ends after a token whose text closes a unit: a line (any newline, so blank lines and Python
//! statements too), a sentence (`.`, `!`, `?` followed by whitespace, so `3.14` and `e.g.` inside a word do not
//! count), or a code statement (`;`, `{`, `}`). Segments shorter than `min_tokens` merge into the next; a segment
//! reaching `max_tokens` is cut there. The draft's end is always a boundary. Numbered steps ("Step 2:", "2.") begin
//! on a new line and so start a segment of their own.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Per-request segmenter settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmenterConfig {
    pub min_tokens: usize,
    pub max_tokens: usize,
    pub lines: bool,
    pub sentences: bool,
    pub statements: bool,
}

impl Default for SegmenterConfig {
    fn default() -> Self {
        SegmenterConfig {
            min_tokens: 4,
            max_tokens: 48,
            lines: true,
            sentences: true,
            statements: true,
        }
    }
}

impl SegmenterConfig {
    pub fn validate(&self) -> Result<()> {
        if self.min_tokens == 0 || self.max_tokens < self.min_tokens {
            return Err(Error::invalid(format!(
                "segmenter needs 1 <= min_tokens <= max_tokens, got {} and {}",
                self.min_tokens, self.max_tokens
            )));
        }
        Ok(())
    }

    /// Whether the text of token `i` closes a unit, given the text of the next token when there is one.
    pub fn closes_unit(&self, piece: &str, next: Option<&str>) -> bool {
        if self.lines && piece.contains('\n') {
            return true;
        }
        let trimmed = piece.trim_end();
        let followed_by_space =
            piece.len() > trimmed.len() || next.is_some_and(|n| n.starts_with(char::is_whitespace));
        if self.sentences && followed_by_space && trimmed.ends_with(['.', '!', '?']) {
            return true;
        }
        self.statements && trimmed.ends_with([';', '{', '}'])
    }
}

/// Boundaries (token counts from the draft's start, ascending, the last equal to `pieces.len()`) for a draft whose
/// tokens have the texts `pieces`. Empty for an empty draft.
pub fn boundaries<S: AsRef<str>>(pieces: &[S], cfg: &SegmenterConfig) -> Vec<usize> {
    let n = pieces.len();
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..n {
        let len = i + 1 - start;
        let next = pieces.get(i + 1).map(|p| p.as_ref());
        let unit = cfg.closes_unit(pieces[i].as_ref(), next);
        if (unit && len >= cfg.min_tokens) || len >= cfg.max_tokens {
            out.push(i + 1);
            start = i + 1;
        }
    }
    if out.last() != Some(&n) && n > 0 {
        out.push(n);
    }
    out
}

/// Boundaries closed by the text itself (a unit or the length cap): like [`boundaries`] but without the forced
/// boundary at the end of an unfinished draft.
pub fn closed_boundaries<S: AsRef<str>>(pieces: &[S], cfg: &SegmenterConfig) -> Vec<usize> {
    let mut out = boundaries(pieces, cfg);
    let n = pieces.len();
    if let Some(&last) = out.last() {
        let prev = if out.len() > 1 { out[out.len() - 2] } else { 0 };
        let natural =
            cfg.closes_unit(pieces[n - 1].as_ref(), None) && last - prev >= cfg.min_tokens;
        if last == n && !natural && last - prev < cfg.max_tokens {
            out.pop();
        }
    }
    out
}

/// Length of the first segment of `pieces`, or None when no unit closes within them (the segment is unfinished).
/// Used while decoding, one token at a time, to stop at the end of a segment.
pub fn first_segment_end<S: AsRef<str>>(pieces: &[S], cfg: &SegmenterConfig) -> Option<usize> {
    for i in 0..pieces.len() {
        let len = i + 1;
        // The next token is not known yet while decoding: a sentence end counts only with trailing whitespace.
        let next = pieces.get(i + 1).map(|p| p.as_ref());
        if (cfg.closes_unit(pieces[i].as_ref(), next) && len >= cfg.min_tokens)
            || len >= cfg.max_tokens
        {
            return Some(len);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min: usize) -> SegmenterConfig {
        SegmenterConfig {
            min_tokens: min,
            max_tokens: 12,
            ..Default::default()
        }
    }

    #[test]
    fn code_lines_and_statements() {
        let p = [
            "def", " f", "(x", "):\n", "   ", " return", " x", ";\n", "int", " a", " =", " 1", ";",
            " b", "}",
        ];
        assert_eq!(boundaries(&p, &cfg(1)), vec![4, 8, 13, 15]);
        // With min 5 the first line merges into the second.
        assert_eq!(boundaries(&p, &cfg(5)), vec![8, 13, 15]);
    }

    #[test]
    fn prose_sentences_not_decimals() {
        let p = [
            "Pi", " is", " 3", ".", "14", ".", " It", " is", " known", "!", " Really", "?",
        ];
        assert_eq!(boundaries(&p, &cfg(1)), vec![6, 10, 12]);
    }

    #[test]
    fn math_steps_and_the_cap() {
        let p = [
            "Step", " 1", ":", " 5", " +", " 3", " =", " 8", "\n", "Step", " 2", ":", " 8", " -",
            " 2", " =", " 6",
        ];
        assert_eq!(boundaries(&p, &cfg(1)), vec![9, 17]);
        let long: Vec<String> = (0..30).map(|i| format!(" w{i}")).collect();
        assert_eq!(boundaries(&long, &cfg(1)), vec![12, 24, 30]);
        assert!(boundaries::<&str>(&[], &cfg(1)).is_empty());
        assert_eq!(first_segment_end(&p, &cfg(1)), Some(9));
        assert_eq!(first_segment_end(&p[..5], &cfg(1)), None);
        assert!(
            SegmenterConfig {
                min_tokens: 0,
                ..cfg(1)
            }
            .validate()
            .is_err()
        );
        assert_eq!(closed_boundaries(&p, &cfg(1)), vec![9]);
        assert_eq!(closed_boundaries(&p[..9], &cfg(1)), vec![9]);
    }
}
