//! Collectives of a tensor-parallel group: every rank runs the same model code on its shard and joins the partial
//! results through a [`Comm`].
//!
//! Backends:
//! - [`LocalComm`]: world size 1, every collective is the identity.
//! - [`TcpComm`]: processes on one or several hosts, over persistent TCP connections arranged in a ring (each rank
//!   sends to the next and receives from the previous); all-reduce sums in rank order after a ring all-gather, so
//!   every rank ends with the same bits and an element's sum does not depend on the buffer's length.
//! - `NcclComm` (feature `nccl`): GPUs through NCCL, which the cudarc crate's `nccl` module provides (the one
//!   candle's `nccl` feature enables; there is no separate NCCL crate).
//!
//! Failure model: a peer that exits closes its sockets and the next collective on every other rank fails at once
//! with [`CommErrorKind::PeerLost`]; a peer that hangs makes it fail after the operation timeout. Either way the
//! communicator is then broken for good (the ring is out of step) and every later call returns the same error: the
//! group must be restarted.

#[cfg(feature = "nccl")]
mod nccl;
mod tcp;

#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, unique_id as nccl_unique_id};
pub use tcp::{TcpComm, TcpConfig, loopback_group};

/// What went wrong in a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommErrorKind {
    /// A peer closed its connection (exited, killed, or the network failed).
    PeerLost,
    /// A peer did not answer within the operation timeout.
    Timeout,
    /// The group could not be formed (bad addresses, peers not reachable in time, mismatched world sizes).
    Rendezvous,
    /// Peers disagree on a message (a bug or a mismatched binary).
    Protocol,
    /// The call itself is wrong (a bad rank or root).
    Invalid,
}

/// An error of a collective.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CommError {
    pub kind: CommErrorKind,
    pub message: String,
}

impl CommError {
    pub fn new(kind: CommErrorKind, message: impl Into<String>) -> Self {
        CommError {
            kind,
            message: message.into(),
        }
    }
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// The collectives a tensor-parallel model needs. Every rank of a group must make the same calls in the same
/// order; calls on one communicator are serialized.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over the ranks, in place; every rank gets the same bits, and an element's result does not
    /// depend on the buffer's length.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `local` (all the same length), concatenated in rank order.
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;
    /// `root`'s bytes, on every rank (`buf` is overwritten on the others).
    fn broadcast(&self, buf: &mut Vec<u8>, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Like `broadcast`, for a rank idling until `root` has something to say: no operation timeout (a peer that
    /// goes away still ends the wait).
    fn broadcast_wait(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        self.broadcast(buf, root)
    }
}

/// A group of one.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalComm;

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
    fn broadcast(&self, _buf: &mut Vec<u8>, root: usize) -> Result<()> {
        if root != 0 {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                format!("broadcast root {root} in a group of 1"),
            ));
        }
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// The contiguous range of `total` items that `rank` of `world` holds when they are split in units of `unit`
/// items as evenly as possible (the first `units % world` ranks take one unit more). `None` when there are fewer
/// units than ranks or `total` is not a whole number of units.
pub fn split_range(
    total: usize,
    unit: usize,
    rank: usize,
    world: usize,
) -> Option<std::ops::Range<usize>> {
    if unit == 0 || world == 0 || rank >= world || !total.is_multiple_of(unit) {
        return None;
    }
    let units = total / unit;
    if units < world {
        return None;
    }
    let (base, extra) = (units / world, units % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    Some(start * unit..(start + len) * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_range_covers_everything_once_in_whole_units() {
        for (total, unit, world) in [(8960, 256, 2), (8960, 256, 3), (96, 32, 3), (1536, 128, 4)] {
            let mut next = 0;
            for r in 0..world {
                let range = split_range(total, unit, r, world).unwrap();
                assert_eq!(range.start, next);
                assert_eq!(range.start % unit, 0);
                assert_eq!(range.len() % unit, 0);
                next = range.end;
            }
            assert_eq!(next, total);
        }
        // 35 super-blocks over 2 ranks: 18 and 17.
        assert_eq!(split_range(8960, 256, 0, 2), Some(0..4608));
        assert_eq!(split_range(8960, 256, 1, 2), Some(4608..8960));
        assert_eq!(split_range(100, 32, 0, 2), None);
        assert_eq!(split_range(64, 32, 0, 3), None);
    }

    #[test]
    fn local_comm_is_the_identity() {
        let c = LocalComm;
        let mut v = vec![1.0, 2.0];
        c.all_reduce_sum(&mut v).unwrap();
        assert_eq!(v, [1.0, 2.0]);
        assert_eq!(c.all_gather(&v).unwrap(), v);
        assert_eq!(
            c.broadcast(&mut vec![], 1).unwrap_err().kind,
            CommErrorKind::Invalid
        );
    }
}
