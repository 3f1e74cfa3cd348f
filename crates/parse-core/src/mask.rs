//! The compact attention mask of a packed forward block.
//!
//! A block appends `n` new tokens after `c` cached ones. Row `i` (new token `i`) sees a prefix `[0, cached_i)` of the
//! cache and a few spans of new tokens. PARSE's packed verification needs no more: a draft token sees the cache and
//! the draft up to itself; a suffix copy sees the cache, a draft prefix and its own copy up to itself. The memory is
//! O(rows x spans) instead of O(rows x (cache + rows)).

use std::ops::Range;

use crate::error::{Error, Result};

/// What one new token attends to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskRow {
    /// Visible cached keys: `[0, cached)`.
    pub cached: usize,
    /// Visible new keys, as ascending, non-overlapping ranges of block indices.
    pub spans: Vec<Range<usize>>,
}

/// Per-row visibility for a block of new tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMask {
    rows: Vec<MaskRow>,
}

impl BlockMask {
    /// Plain causal attention: token `i` sees the whole cache and new tokens `0..=i`.
    pub fn causal(n_cached: usize, n_new: usize) -> Self {
        BlockMask {
            rows: (0..n_new)
                .map(|i| MaskRow {
                    cached: n_cached,
                    spans: vec![0..i + 1],
                })
                .collect(),
        }
    }

    /// A mask from explicit rows; checked against the block by [`BlockMask::validate`] at forward time.
    pub fn from_rows(rows: Vec<MaskRow>) -> Self {
        BlockMask { rows }
    }

    /// A mask from a dense row-major boolean matrix over `[cache (n_cached) | new (n_new)]`. The cached part of
    /// each row must be a prefix (the cache is shared history, never a branch).
    pub fn from_dense(n_cached: usize, n_new: usize, dense: &[bool]) -> Result<Self> {
        let width = n_cached + n_new;
        if dense.len() != n_new * width {
            return Err(Error::invalid(format!(
                "dense mask has {} entries, expected {n_new} x {width}",
                dense.len()
            )));
        }
        let mut rows = Vec::with_capacity(n_new);
        for (i, row) in dense.chunks(width).enumerate() {
            let cached = row[..n_cached].iter().take_while(|v| **v).count();
            if row[cached..n_cached].iter().any(|v| *v) {
                return Err(Error::invalid(format!(
                    "row {i}: visible cached keys must form a prefix"
                )));
            }
            let mut spans: Vec<Range<usize>> = Vec::new();
            for (j, v) in row[n_cached..].iter().enumerate() {
                if *v {
                    match spans.last_mut() {
                        Some(last) if last.end == j => last.end = j + 1,
                        _ => spans.push(j..j + 1),
                    }
                }
            }
            rows.push(MaskRow { cached, spans });
        }
        Ok(BlockMask { rows })
    }

    pub fn rows(&self) -> &[MaskRow] {
        &self.rows
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Checks the mask against a block of `n_new` tokens after `n_cached` cached ones: every row sees at least one
    /// key, only existing keys, in ascending non-overlapping spans.
    pub fn validate(&self, n_cached: usize, n_new: usize) -> Result<()> {
        if self.rows.len() != n_new {
            return Err(Error::invalid(format!(
                "mask has {} rows for a block of {n_new} tokens",
                self.rows.len()
            )));
        }
        for (i, row) in self.rows.iter().enumerate() {
            if row.cached > n_cached {
                return Err(Error::invalid(format!(
                    "mask row {i} sees {} cached keys, the cache holds {n_cached}",
                    row.cached
                )));
            }
            let mut prev_end = 0;
            let mut seen = row.cached;
            for (s, span) in row.spans.iter().enumerate() {
                if span.start >= span.end || span.end > n_new || (s > 0 && span.start < prev_end) {
                    return Err(Error::invalid(format!(
                        "mask row {i}: span {span:?} is empty, out of the block of {n_new} or not ascending"
                    )));
                }
                prev_end = span.end;
                seen += span.len();
            }
            if seen == 0 {
                return Err(Error::invalid(format!("mask row {i} sees no key")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_round_trip_and_validation() {
        // 2 cached, 3 new: row 0 causal, row 1 skips new 0, row 2 sees 1 cached and new 0 and 2.
        let d = [
            true, true, true, false, false, //
            true, true, false, true, false, //
            true, false, true, false, true,
        ];
        let m = BlockMask::from_dense(2, 3, &d).unwrap();
        assert_eq!(m.rows()[1].spans, vec![1..2]);
        assert_eq!(
            m.rows()[2],
            MaskRow {
                cached: 1,
                spans: vec![0..1, 2..3]
            }
        );
        m.validate(2, 3).unwrap();
        assert!(m.validate(1, 3).is_err());
        assert!(m.validate(2, 4).is_err());
        let hole = [false, true, true];
        assert!(BlockMask::from_dense(2, 1, &hole).is_err());
        let blind = BlockMask::from_rows(vec![MaskRow {
            cached: 0,
            spans: vec![],
        }]);
        assert!(blind.validate(0, 1).is_err());
        let backwards = BlockMask::from_rows(vec![MaskRow {
            cached: 0,
            spans: vec![1..2, 0..1],
        }]);
        assert!(backwards.validate(0, 2).is_err());
        assert_eq!(
            BlockMask::causal(4, 2).rows()[1],
            MaskRow {
                cached: 4,
                spans: vec![0..2]
            }
        );
    }
}
