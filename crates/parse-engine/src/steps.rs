//! Operations as sequences of forward blocks, so that a scheduler can run the steps of many sessions' operations
//! in one packed pass (continuous batching).
//!
//! An operation ([`Steps`]) is asked, step after step, what block it needs next; it gets that block's logits back
//! at its next step and ends with its output. Run alone ([`run_alone`]) it is the sequential operation the PARSE
//! loop's traits expose; in a worker's scheduler its blocks share passes with other sessions' blocks. Both paths run
//! the same code, and a packed pass gives every block bitwise the logits it gets alone, so an operation's result
//! does not depend on what else runs beside it.

use parse_core::Result as CoreResult;

use crate::engine::Block;
use crate::model::Logits;

/// What an operation needs next.
#[derive(Debug)]
pub enum Next<T> {
    /// The logits of this block (one forward pass on its session).
    Forward(Block),
    /// It has finished.
    Done(T),
}

/// A backend that runs blocks: one alone, or several in one step.
pub trait Forward {
    fn forward_blocks(&mut self, blocks: &[Block]) -> Vec<crate::Result<Logits>>;
}

/// An operation on backend `B` that runs as a sequence of forward blocks.
pub trait Steps<B>: Send {
    type Output;
    /// Advances the operation. `input` holds the result of the block it asked for last (`None` at the first
    /// call). `room` is how many rows its next block should have at most: a prefill cuts its chunks to it; blocks
    /// that cannot be cut come whole and the scheduler runs them in a step of their own.
    fn step(
        &mut self,
        backend: &mut B,
        input: Option<crate::Result<Logits>>,
        room: usize,
    ) -> CoreResult<Next<Self::Output>>;
}

/// Runs an operation to its end on its own, one block per pass.
pub fn run_alone<B: Forward, S: Steps<B>>(backend: &mut B, mut op: S) -> CoreResult<S::Output> {
    let mut input = None;
    loop {
        match op.step(backend, input.take(), usize::MAX)? {
            Next::Done(out) => return Ok(out),
            Next::Forward(block) => {
                let r = backend
                    .forward_blocks(std::slice::from_ref(&block))
                    .pop()
                    .unwrap_or_else(|| Err(crate::Error::invalid("a forward returned nothing")));
                input = Some(r);
            }
        }
    }
}
