//! Prompt lookup's match rule, below the loop and the drafters that use it: which suffixes are looked up
//! ([`NgramConfig`]), the token that followed the latest earlier match ([`lookup`]), and which drafter a request
//! asks for ([`DrafterKind`]). The loop guesses and copies with it; [`crate::ngram::NgramDrafter`] drafts with it.

use crate::error::{Error, Result};

/// Where a request's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrafterKind {
    /// The draft model (a draft worker, or the in-process draft engine).
    #[default]
    Model,
    /// Prompt lookup ([`NgramDrafter`]): no model, no draft worker.
    Ngram,
    /// Copies from long prompt-lookup matches first and the draft model for the rest
    /// ([`CopyFirst`](crate::copy_first::CopyFirst)): a draft worker, asked less.
    ModelNgram,
}

impl DrafterKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            DrafterKind::Model => "model",
            DrafterKind::Ngram => "ngram",
            DrafterKind::ModelNgram => "model+ngram",
        }
    }

    /// Whether drafts need the draft model (a draft worker).
    pub fn uses_model(&self) -> bool {
        *self != DrafterKind::Ngram
    }
}

impl std::str::FromStr for DrafterKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "model" => Ok(DrafterKind::Model),
            "ngram" => Ok(DrafterKind::Ngram),
            "model+ngram" => Ok(DrafterKind::ModelNgram),
            other => Err(Error::invalid(format!(
                "unknown drafter `{other}` (model, ngram, model+ngram)"
            ))),
        }
    }
}

/// Which suffixes are looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// The shortest suffix that may match; shorter matches are too common to be worth a verification.
    pub min_n: usize,
    /// The longest suffix tried first.
    pub max_n: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig { min_n: 2, max_n: 4 }
    }
}

impl NgramConfig {
    pub fn validate(&self) -> Result<()> {
        if self.min_n == 0 || self.min_n > self.max_n || self.max_n > 16 {
            return Err(Error::invalid(format!(
                "n-gram sizes must satisfy 1 <= min ({}) <= max ({}) <= 16",
                self.min_n, self.max_n
            )));
        }
        Ok(())
    }
}

/// The token that followed the latest earlier occurrence of `context`'s longest matching suffix (sizes `max_n`
/// down to `min_n`), if any.
pub fn lookup(context: &[u32], cfg: &NgramConfig) -> Option<u32> {
    lookup_match(context, cfg).map(|(t, _)| t)
}

/// [`lookup`]'s token and the size of the suffix that matched.
pub fn lookup_match(context: &[u32], cfg: &NgramConfig) -> Option<(u32, usize)> {
    let len = context.len();
    for n in (cfg.min_n..=cfg.max_n).rev() {
        if len <= n {
            continue;
        }
        let suffix = &context[len - n..];
        // Starts strictly before the suffix's own, so a token follows every match.
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            return Some((context[i + n], n));
        }
    }
    None
}
