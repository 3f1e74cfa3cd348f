//! One session's block of a packed forward pass: what the sessions, the engine and the workers' scheduler pass
//! between them, below all of them.

use parse_core::BlockMask;

/// One session's block of a batched forward ([`EngineOps::forward_batch`]): tokens at positions under a compact
/// mask over `[the session's cache | the block]`, logits wanted at the `readout` rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub session: String,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub mask: BlockMask,
    pub readout: Vec<usize>,
}

impl Block {
    /// A causal block after the `base` tokens a session holds.
    pub fn causal(session: &str, base: usize, tokens: &[u32], readout: Vec<usize>) -> Self {
        Block {
            session: session.to_string(),
            tokens: tokens.to_vec(),
            positions: (base..base + tokens.len()).map(|p| p as u32).collect(),
            mask: BlockMask::causal(base, tokens.len()),
            readout,
        }
    }

    /// Rows of the block.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}
