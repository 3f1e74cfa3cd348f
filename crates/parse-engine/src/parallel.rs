//! Tensor-parallel building blocks the model computes with, knowing nothing of models, engines or groups: how a
//! matrix is split ([`Split`], [`Layout`]) and the linear layer that owns its communicator ([`Linear`]). Building shards is `tp::shard`'s job, keeping the ranks' sessions in step
//! `tp::group`'s.

use std::sync::Arc;

use parse_comm::Comm;

use crate::error::{Error, Result};
use crate::quant::QMatrix;

/// How `o` and `down` are split (see `tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// Output rows, gathered inputs and outputs: bitwise TP = 1.
    #[default]
    Exact,
    /// Row-parallel with an all-reduce where the quantization blocks allow.
    Megatron,
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(Layout::Exact),
            "megatron" => Ok(Layout::Megatron),
            other => Err(Error::invalid(format!(
                "unknown tensor-parallel layout `{other}` (exact, megatron)"
            ))),
        }
    }
}

/// How one matrix of a layer is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Along the input dimension; partial outputs are summed over the group.
    Rows,
    /// Along the output dimension; the input is gathered first and the output after.
    Out,
}

/// A linear layer `out = W x`, whole or one rank's part of a split matrix; a split one owns the communicator of
/// its group.
#[derive(Clone)]
pub enum Linear {
    /// The whole matrix, or a column-parallel part whose output needs no collective.
    Local(QMatrix),
    /// Row-parallel: this rank's slice of the input dimension; the partial outputs are summed over the group.
    RowParallel { w: QMatrix, comm: Arc<dyn Comm> },
    /// Split by output rows: the input is gathered from the ranks' slices (`in_widths`), this rank's output rows
    /// are computed, and the output is gathered (`out_widths`).
    OutSplit {
        w: QMatrix,
        comm: Arc<dyn Comm>,
        in_widths: Vec<usize>,
        out_widths: Vec<usize>,
    },
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, w) = match self {
            Linear::Local(w) => ("Local", w),
            Linear::RowParallel { w, .. } => ("RowParallel", w),
            Linear::OutSplit { w, .. } => ("OutSplit", w),
        };
        f.debug_struct(kind)
            .field("rows", &w.rows())
            .field("cols", &w.cols())
            .finish()
    }
}

impl From<QMatrix> for Linear {
    fn from(w: QMatrix) -> Self {
        Linear::Local(w)
    }
}

impl Linear {
    /// This rank's weights.
    pub fn weight(&self) -> &QMatrix {
        match self {
            Linear::Local(w) | Linear::RowParallel { w, .. } | Linear::OutSplit { w, .. } => w,
        }
    }

    /// This rank's weights, to replace (a test re-quantizing a model).
    pub fn weight_mut(&mut self) -> &mut QMatrix {
        match self {
            Linear::Local(w) | Linear::RowParallel { w, .. } | Linear::OutSplit { w, .. } => w,
        }
    }

    /// `out = W x` for `n` rows of `x`; the collectives of a split layer included. A failed collective is
    /// [`Error::Comm`].
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Linear::Local(w) => w.matmul(x, n, out),
            Linear::RowParallel { w, comm } => {
                w.matmul(x, n, out)?;
                comm.all_reduce_sum(out).map_err(Error::Comm)
            }
            Linear::OutSplit {
                w,
                comm,
                in_widths,
                out_widths,
            } => {
                let full = gather(comm.as_ref(), x, n, in_widths)?;
                let mut part = vec![0f32; n * w.rows()];
                w.matmul(&full, n, &mut part)?;
                out.copy_from_slice(&gather(comm.as_ref(), &part, n, out_widths)?);
                Ok(())
            }
        }
    }
}

/// Gathers a row-major `rows x widths[rank]` block from every rank into `rows x sum(widths)`, each row the ranks'
/// pieces in rank order.
fn gather(comm: &dyn Comm, local: &[f32], rows: usize, widths: &[usize]) -> Result<Vec<f32>> {
    let w = widths[comm.rank()];
    let max = widths.iter().copied().max().unwrap_or(0);
    let total: usize = widths.iter().sum();
    let mut padded = vec![0f32; rows * max];
    for (dst, src) in padded.chunks_mut(max).zip(local.chunks(w.max(1))) {
        dst[..w].copy_from_slice(&src[..w]);
    }
    let all = comm.all_gather(&padded).map_err(Error::Comm)?;
    let mut out = Vec::with_capacity(rows * total);
    for i in 0..rows {
        for (r, &wr) in widths.iter().enumerate() {
            let at = r * rows * max + i * max;
            out.extend_from_slice(&all[at..at + wr]);
        }
    }
    Ok(out)
}
