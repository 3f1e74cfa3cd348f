//! Weight matrices in ggml block formats and the CPU matmul that uses them.
//!
//! Invariant (batch invariance): every output element `y[r][c] = dot(W[c], x[r])` is computed by the same kernel
//! call with the same arguments whatever the number of rows `m`, the row's place in the block and the thread split:
//! activations are quantized row by row, column `c` always goes through the same path (a 4-column kernel when
//! `c` lies in a full aligned quad, a one-column kernel otherwise), and no reduction crosses rows. A token's
//! logits are therefore bitwise the same in a one-token step and inside any block.
//!
//! Speed comes from reuse, not from changing the arithmetic: a worker owns a chunk of output columns and walks the
//! rows in tiles, so each 4-row slice of weights is read from memory once per tile and stays in L1 while it is
//! dotted with every activation row of the tile.

use candle_core::quantized::GgmlDType;
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, GgmlType,
};
use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels;
pub use crate::layout::Q5_0Tiles;
use crate::layout::*;

mod matmul;
pub use matmul::Input;
use matmul::*;

/// Rows of activations processed against one weight quad before moving on.
const ROW_TILE: usize = 8;

/// A weight matrix of `rows` output features by `cols` input features, stored row-major in one block format.
#[derive(Clone)]
pub struct Mat<T> {
    rows: usize,
    cols: usize,
    blocks: Vec<T>,
}

/// A weight matrix in any supported storage format.
#[derive(Clone)]
pub enum QMatrix {
    F32(Mat<f32>),
    F16(Mat<f16>),
    Q4_0(Mat<BlockQ4_0>),
    Q4_1(Mat<BlockQ4_1>),
    Q5_0(Mat<BlockQ5_0>),
    Q5_1(Mat<BlockQ5_1>),
    Q8_0(Mat<BlockQ8_0>),
    Q2K(Mat<BlockQ2K>),
    Q3K(Mat<BlockQ3K>),
    Q4K(Mat<BlockQ4K>),
    Q5K(Mat<BlockQ5K>),
    Q6K(Mat<BlockQ6K>),
    /// Q4_K in the lanes layout ([`to_lanes`]): the AVX-512 VNNI row groups read it without transposing, at
    /// every block size including the one-token step, on AMX machines the tiles of [`kernels::amx::q4k_lanes`]
    /// as their B operand, and on AVX2 machines [`kernels::q4k_lanes8`], 8 rows a vector. Only ever made by
    /// [`QMatrix::into_fast_cpu_format`].
    Q4KLanes(Mat<BlockQ4K>),
    /// Q6_K in the lanes layout ([`to_lanes`]), read by the AVX-512 VNNI row groups at every block size; made only
    /// where those are the active kernels (AMX machines keep Q6_K in rows, the layout of their tiles).
    Q6KLanes(Mat<BlockQ6K>),
    /// Q5_0 in one of its lanes layouts ([`Q5_0Tiles`]), made at load for the active kernels and read by them at
    /// every block size (including the one-token step): 16-row tiles where an AVX-512 VNNI variant is active, 8-row
    /// tiles where the AVX2 kernels are.
    Q5_0Lanes(Mat<BlockQ5_0>, Q5_0Tiles),
}

macro_rules! dispatch {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            QMatrix::F32($m) => $body,
            QMatrix::F16($m) => $body,
            QMatrix::Q4_0($m) => $body,
            QMatrix::Q4_1($m) => $body,
            QMatrix::Q5_0($m) => $body,
            QMatrix::Q5_1($m) => $body,
            QMatrix::Q8_0($m) => $body,
            QMatrix::Q2K($m) => $body,
            QMatrix::Q3K($m) => $body,
            QMatrix::Q4K($m) => $body,
            QMatrix::Q5K($m) => $body,
            QMatrix::Q6K($m) => $body,
            QMatrix::Q4KLanes($m) => $body,
            QMatrix::Q6KLanes($m) => $body,
            QMatrix::Q5_0Lanes($m, _) => $body,
        }
    };
}

/// Like `dispatch!`, for a body that returns a `Mat` of the same format.
macro_rules! dispatch_map {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            QMatrix::F32($m) => QMatrix::F32($body),
            QMatrix::F16($m) => QMatrix::F16($body),
            QMatrix::Q4_0($m) => QMatrix::Q4_0($body),
            QMatrix::Q4_1($m) => QMatrix::Q4_1($body),
            QMatrix::Q5_0($m) => QMatrix::Q5_0($body),
            QMatrix::Q5_1($m) => QMatrix::Q5_1($body),
            QMatrix::Q8_0($m) => QMatrix::Q8_0($body),
            QMatrix::Q2K($m) => QMatrix::Q2K($body),
            QMatrix::Q3K($m) => QMatrix::Q3K($body),
            QMatrix::Q4K($m) => QMatrix::Q4K($body),
            QMatrix::Q5K($m) => QMatrix::Q5K($body),
            QMatrix::Q6K($m) => QMatrix::Q6K($body),
            QMatrix::Q4KLanes($m) => QMatrix::Q4KLanes($body),
            QMatrix::Q6KLanes($m) => QMatrix::Q6KLanes($body),
            QMatrix::Q5_0Lanes($m, t) => QMatrix::Q5_0Lanes($body, *t),
        }
    };
}

/// Copies raw little-endian ggml blocks into typed storage.
#[allow(unsafe_code)]
fn blocks_from_bytes<T: GgmlType>(bytes: &[u8], n_blocks: usize) -> Vec<T> {
    debug_assert_eq!(bytes.len(), n_blocks * std::mem::size_of::<T>());
    let mut v = vec![T::zeros(); n_blocks];
    // SAFETY: the ggml block types are #[repr(C)] plain-old-data (integers and f16, every bit pattern valid); the
    // caller checked that `size_of::<T>()` equals the format's block size in bytes, so `v` spans exactly
    // `bytes.len()` bytes, and the two buffers are distinct allocations.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len());
    }
    v
}

impl Mat<BlockQ5_0> {
    /// The same matrix in one of Q5_0's lanes layouts.
    fn to_q5_0_lanes(&self, tiles: Q5_0Tiles) -> Self {
        Mat {
            rows: self.rows,
            cols: self.cols,
            blocks: q5_0_to_tiles(&self.blocks, self.blocks_per_row(), tiles),
        }
    }

    /// The row-major matrix of one stored in one of Q5_0's lanes layouts.
    fn rows_of_q5_0_lanes(&self, tiles: Q5_0Tiles) -> Self {
        Mat {
            rows: self.rows,
            cols: self.cols,
            blocks: q5_0_permute(&self.blocks, self.blocks_per_row(), tiles, false),
        }
    }
}

impl<T: GgmlType> Mat<T> {
    fn blocks_per_row(&self) -> usize {
        self.cols / T::BLCK_SIZE
    }

    /// The same matrix in the lanes layout ([`to_lanes`]).
    fn to_lanes(&self) -> Self {
        Mat {
            rows: self.rows,
            cols: self.cols,
            blocks: to_lanes(&self.blocks, self.blocks_per_row()),
        }
    }

    /// The row-major matrix of one stored in the lanes layout.
    fn rows_of_lanes(&self) -> Self {
        Mat {
            rows: self.rows,
            cols: self.cols,
            blocks: from_lanes(&self.blocks, self.blocks_per_row()),
        }
    }

    /// Row `r`'s blocks, of a matrix stored in the lanes layout.
    fn lanes_row(&self, r: usize) -> Vec<T> {
        lanes_row(&self.blocks, self.blocks_per_row(), r)
    }

    fn from_bytes(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        let n_blocks = rows * cols / T::BLCK_SIZE;
        Mat {
            rows,
            cols,
            blocks: blocks_from_bytes(bytes, n_blocks),
        }
    }

    fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Self {
        let kb = cols / T::BLCK_SIZE;
        let mut blocks = vec![T::zeros(); rows * kb];
        for (dst, src) in blocks.chunks_mut(kb).zip(data.chunks(cols)) {
            T::from_float(src, dst);
        }
        Mat { rows, cols, blocks }
    }

    /// The blocks as raw little-endian ggml bytes.
    #[allow(unsafe_code)]
    fn raw_bytes(&self) -> &[u8] {
        // SAFETY: the ggml block types (and f32, f16) are #[repr(C)] plain-old-data with no padding between
        // elements of a slice; the byte view spans exactly the blocks' storage and borrows it.
        unsafe {
            std::slice::from_raw_parts(
                self.blocks.as_ptr().cast::<u8>(),
                std::mem::size_of_val(self.blocks.as_slice()),
            )
        }
    }

    fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let kb = self.blocks_per_row();
        T::to_float(&self.blocks[r * kb..(r + 1) * kb], out);
    }

    fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, chunk) in out.chunks_mut(self.cols).enumerate() {
            self.row_to_f32(r, chunk);
        }
        out
    }

    fn select_rows(&self, range: std::ops::Range<usize>) -> Self {
        let kb = self.blocks_per_row();
        Mat {
            rows: range.len(),
            cols: self.cols,
            blocks: self.blocks[range.start * kb..range.end * kb].to_vec(),
        }
    }

    fn gather_rows(&self, ranges: &[std::ops::Range<usize>]) -> Self {
        let kb = self.blocks_per_row();
        let mut blocks = Vec::new();
        for r in ranges {
            blocks.extend_from_slice(&self.blocks[r.start * kb..r.end * kb]);
        }
        Mat {
            rows: ranges.iter().map(|r| r.len()).sum(),
            cols: self.cols,
            blocks,
        }
    }

    /// Input columns `range`, which must start and end on block boundaries.
    fn select_cols(&self, range: std::ops::Range<usize>) -> Self {
        let kb = self.blocks_per_row();
        let (b0, b1) = (range.start / T::BLCK_SIZE, range.end / T::BLCK_SIZE);
        let mut blocks = Vec::with_capacity(self.rows * (b1 - b0));
        for r in 0..self.rows {
            blocks.extend_from_slice(&self.blocks[r * kb + b0..r * kb + b1]);
        }
        Mat {
            rows: self.rows,
            cols: range.len(),
            blocks,
        }
    }

    /// `out[r * rows + c] = dot(W[c], x[r])` for `m` rows of `x`, through candle's per-element dot kernels.
    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        let kb = self.blocks_per_row();
        let xq = quantize_rows::<T>(x, k, m);
        let n_quad = n & !3;
        let w = &self.blocks;
        let xq = &xq;
        let chunk = column_chunk(n, kb * std::mem::size_of::<T>());
        drive(
            n,
            m,
            chunk,
            |c0, dst| {
                let cw = dst.len() / m;
                let c1 = c0 + cw;
                for r0 in (0..m).step_by(ROW_TILE) {
                    let r1 = (r0 + ROW_TILE).min(m);
                    let mut c = c0;
                    while c < c1 {
                        if c + 4 <= n_quad {
                            let w0 = &w[c * kb..(c + 1) * kb];
                            let w1 = &w[(c + 1) * kb..(c + 2) * kb];
                            let w2 = &w[(c + 2) * kb..(c + 3) * kb];
                            let w3 = &w[(c + 3) * kb..(c + 4) * kb];
                            for r in r0..r1 {
                                let (d0, d1, d2, d3) =
                                    T::vec_dot_4(k, w0, w1, w2, w3, &xq[r * kb..(r + 1) * kb]);
                                let base = r * cw + (c - c0);
                                dst[base] = d0;
                                dst[base + 1] = d1;
                                dst[base + 2] = d2;
                                dst[base + 3] = d3;
                            }
                            c += 4;
                        } else {
                            let wc = &w[c * kb..(c + 1) * kb];
                            for r in r0..r1 {
                                dst[r * cw + (c - c0)] =
                                    T::vec_dot(k, wc, &xq[r * kb..(r + 1) * kb]);
                            }
                            c += 1;
                        }
                    }
                }
            },
            out,
        );
    }
}

/// A matrix that cannot have the requested layout (size, block alignment, format).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

impl From<LayoutError> for Error {
    fn from(e: LayoutError) -> Self {
        Error::InvalidInput(e.0)
    }
}

fn check_layout<T: GgmlType>(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
) -> Result<(), LayoutError> {
    if std::mem::size_of::<T>() * dtype.block_size() != dtype.type_size() * T::BLCK_SIZE {
        return Err(LayoutError(format!(
            "block layout of {dtype:?} does not match this build"
        )));
    }
    if T::BLCK_SIZE != <T::VecDotType as GgmlType>::BLCK_SIZE {
        return Err(LayoutError(format!(
            "{dtype:?} has mismatched activation blocks"
        )));
    }
    if !cols.is_multiple_of(T::BLCK_SIZE) {
        return Err(LayoutError(format!(
            "row length {cols} is not a multiple of the {dtype:?} block size {}",
            T::BLCK_SIZE
        )));
    }
    if rows == 0 || cols == 0 {
        return Err(LayoutError("empty matrix".into()));
    }
    Ok(())
}

/// Bytes a `rows x cols` matrix takes in `dtype`, or None when the shape does not fit the format.
pub fn storage_bytes(dtype: GgmlDType, rows: usize, cols: usize) -> Option<usize> {
    if dtype.block_size() == 0 || !cols.is_multiple_of(dtype.block_size()) {
        return None;
    }
    rows.checked_mul(cols / dtype.block_size())?
        .checked_mul(dtype.type_size())
}

/// A matrix of random weights made directly in a block format (no f32 copy, no quantization pass), with entries of
/// about `1/sqrt(cols)` in size: models at the real shapes of large checkpoints, for benchmarks and device checks.
/// Quant fields are uniform random bytes; each block's scales are set so that the values come out centred and of
/// that size. Formats: F32, F16, Q8_0, Q5_0, Q4_K, Q6_K.
pub fn random_matrix(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> Result<QMatrix> {
    use rand::{Rng, RngCore, SeedableRng};
    let target = 1.0 / (cols as f32).sqrt();
    if matches!(dtype, GgmlDType::F32 | GgmlDType::F16) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.7 * target..1.7 * target))
            .collect();
        return QMatrix::from_f32(dtype, rows, cols, &data).map_err(|e| Error::invalid(e.0));
    }
    let bytes = storage_bytes(dtype, rows, cols)
        .ok_or_else(|| Error::invalid(format!("{rows}x{cols} does not fit {dtype:?}")))?;
    let block = dtype.type_size();
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
    };
    let mut raw = vec![0u8; bytes];
    // Rows in parallel, each from its own seed: the same matrix whatever the thread count.
    let per_row = bytes / rows;
    raw.par_chunks_mut(per_row)
        .enumerate()
        .for_each(|(r, row)| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                seed ^ (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            rng.fill_bytes(row);
            for b in row.chunks_mut(block) {
                match dtype {
                    // value = d * q, q uniform in -128..127 (sd ~74).
                    GgmlDType::Q8_0 => put(b, 0, target / 74.0),
                    // value = d * (q - 16), q uniform in 0..31 (sd ~9.2).
                    GgmlDType::Q5_0 => put(b, 0, target / 9.2),
                    // value = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit: dmin = 7.5 d centres it; sd ~170 d.
                    GgmlDType::Q4K => {
                        put(b, 0, target / 170.0);
                        put(b, 2, 7.5 * target / 170.0);
                    }
                    // value = d * scale * (q - 32), scales kept to -31..31 (sd ~18), q 6-bit (sd ~18).
                    GgmlDType::Q6K => {
                        for s in &mut b[192..208] {
                            *s = ((*s as i8) >> 2) as u8;
                        }
                        put(b, 208, target / 330.0);
                    }
                    _ => {}
                }
            }
        });
    match dtype {
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4K | GgmlDType::Q6K => {
            QMatrix::from_bytes(dtype, rows, cols, &raw).map_err(|e| Error::invalid(e.0))
        }
        other => Err(Error::invalid(format!(
            "random {other:?} matrices are not made"
        ))),
    }
}

impl QMatrix {
    /// Builds a matrix from raw ggml bytes (as stored in a GGUF file).
    pub fn from_bytes(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, LayoutError> {
        let expected = storage_bytes(dtype, rows, cols)
            .ok_or_else(|| LayoutError(format!("{rows}x{cols} does not fit {dtype:?}")))?;
        if bytes.len() != expected {
            return Err(LayoutError(format!(
                "expected {expected} bytes of {dtype:?}, got {}",
                bytes.len()
            )));
        }
        macro_rules! mk {
            ($variant:ident, $t:ty) => {{
                check_layout::<$t>(dtype, rows, cols)?;
                QMatrix::$variant(Mat::<$t>::from_bytes(rows, cols, bytes))
            }};
        }
        Ok(match dtype {
            GgmlDType::F32 => mk!(F32, f32),
            GgmlDType::F16 => mk!(F16, f16),
            GgmlDType::BF16 => {
                let data: Vec<f32> = bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect();
                QMatrix::F32(Mat {
                    rows,
                    cols,
                    blocks: data,
                })
            }
            GgmlDType::Q4_0 => mk!(Q4_0, BlockQ4_0),
            GgmlDType::Q4_1 => mk!(Q4_1, BlockQ4_1),
            GgmlDType::Q5_0 => mk!(Q5_0, BlockQ5_0),
            GgmlDType::Q5_1 => mk!(Q5_1, BlockQ5_1),
            GgmlDType::Q8_0 => mk!(Q8_0, BlockQ8_0),
            GgmlDType::Q2K => mk!(Q2K, BlockQ2K),
            GgmlDType::Q3K => mk!(Q3K, BlockQ3K),
            GgmlDType::Q4K => mk!(Q4K, BlockQ4K),
            GgmlDType::Q5K => mk!(Q5K, BlockQ5K),
            GgmlDType::Q6K => mk!(Q6K, BlockQ6K),
            other => return Err(LayoutError(format!("{other:?} weights are not supported"))),
        })
    }

    /// Quantizes a row-major f32 matrix into `dtype`.
    pub fn from_f32(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<Self, LayoutError> {
        if data.len() != rows * cols {
            return Err(LayoutError(format!(
                "expected {} values, got {}",
                rows * cols,
                data.len()
            )));
        }
        macro_rules! mk {
            ($variant:ident, $t:ty) => {{
                check_layout::<$t>(dtype, rows, cols)?;
                QMatrix::$variant(Mat::<$t>::from_f32(rows, cols, data))
            }};
        }
        Ok(match dtype {
            GgmlDType::F32 => mk!(F32, f32),
            GgmlDType::F16 => mk!(F16, f16),
            GgmlDType::Q4_0 => mk!(Q4_0, BlockQ4_0),
            GgmlDType::Q4_1 => mk!(Q4_1, BlockQ4_1),
            GgmlDType::Q5_0 => mk!(Q5_0, BlockQ5_0),
            GgmlDType::Q5_1 => mk!(Q5_1, BlockQ5_1),
            GgmlDType::Q8_0 => mk!(Q8_0, BlockQ8_0),
            GgmlDType::Q2K => mk!(Q2K, BlockQ2K),
            GgmlDType::Q3K => mk!(Q3K, BlockQ3K),
            GgmlDType::Q4K => mk!(Q4K, BlockQ4K),
            GgmlDType::Q5K => mk!(Q5K, BlockQ5K),
            GgmlDType::Q6K => mk!(Q6K, BlockQ6K),
            other => return Err(LayoutError(format!("cannot quantize to {other:?}"))),
        })
    }

    pub fn dtype(&self) -> GgmlDType {
        match self {
            QMatrix::F32(_) => GgmlDType::F32,
            QMatrix::F16(_) => GgmlDType::F16,
            QMatrix::Q4_0(_) => GgmlDType::Q4_0,
            QMatrix::Q4_1(_) => GgmlDType::Q4_1,
            QMatrix::Q5_0(_) => GgmlDType::Q5_0,
            QMatrix::Q5_1(_) => GgmlDType::Q5_1,
            QMatrix::Q8_0(_) => GgmlDType::Q8_0,
            QMatrix::Q2K(_) => GgmlDType::Q2K,
            QMatrix::Q3K(_) => GgmlDType::Q3K,
            QMatrix::Q4K(_) => GgmlDType::Q4K,
            QMatrix::Q5K(_) => GgmlDType::Q5K,
            QMatrix::Q6K(_) => GgmlDType::Q6K,
            QMatrix::Q4KLanes(_) => GgmlDType::Q4K,
            QMatrix::Q6KLanes(_) => GgmlDType::Q6K,
            QMatrix::Q5_0Lanes(..) => GgmlDType::Q5_0,
        }
    }

    /// Whether the matrix is stored in a lanes layout (made at load for this CPU's kernels; readers get rows).
    pub fn in_lanes(&self) -> bool {
        matches!(
            self,
            QMatrix::Q4KLanes(_) | QMatrix::Q6KLanes(_) | QMatrix::Q5_0Lanes(..)
        )
    }

    /// The row-major matrix of a lanes-layout one; `None` for every other.
    fn row_major(&self) -> Option<QMatrix> {
        match self {
            QMatrix::Q4KLanes(m) => Some(QMatrix::Q4K(m.rows_of_lanes())),
            QMatrix::Q6KLanes(m) => Some(QMatrix::Q6K(m.rows_of_lanes())),
            QMatrix::Q5_0Lanes(m, t) => Some(QMatrix::Q5_0(m.rows_of_q5_0_lanes(*t))),
            _ => None,
        }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        dispatch!(self, m => m.rows)
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        dispatch!(self, m => m.cols)
    }

    /// Bytes of weight storage.
    pub fn storage_bytes(&self) -> usize {
        dispatch!(self, m => m.blocks.len() * std::mem::size_of_val(&m.blocks[0]))
    }

    /// The storage as raw ggml bytes, row after row (what a GGUF file holds for this format; a copy for the lanes
    /// layout, which is not).
    pub fn raw_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.row_major() {
            Some(plain) => std::borrow::Cow::Owned(plain.raw_bytes().into_owned()),
            None => std::borrow::Cow::Borrowed(dispatch!(self, m => m.raw_bytes())),
        }
    }

    /// Dequantizes row `r` (used for embedding look-ups).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            QMatrix::Q4KLanes(m) => BlockQ4K::to_float(&m.lanes_row(r), out),
            QMatrix::Q6KLanes(m) => BlockQ6K::to_float(&m.lanes_row(r), out),
            QMatrix::Q5_0Lanes(m, t) => {
                BlockQ5_0::to_float(&q5_0_lanes_row(&m.blocks, m.blocks_per_row(), r, *t), out)
            }
            _ => dispatch!(self, m => m.row_to_f32(r, out)),
        }
    }

    /// Dequantizes the whole matrix, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        match self.row_major() {
            Some(plain) => plain.to_f32(),
            None => dispatch!(self, m => m.to_f32()),
        }
    }

    /// A copy of output rows `range` (a shard along the output dimension).
    pub fn select_rows(&self, range: std::ops::Range<usize>) -> Self {
        match self.row_major() {
            Some(plain) => plain.select_rows(range).into_fast_cpu_format(),
            None => dispatch_map!(self, m => m.select_rows(range)),
        }
    }

    /// Output rows `ranges`, concatenated (a shard of heads, possibly repeating a shared KV head).
    pub fn gather_rows(&self, ranges: &[std::ops::Range<usize>]) -> Self {
        match self.row_major() {
            Some(plain) => plain.gather_rows(ranges).into_fast_cpu_format(),
            None => dispatch_map!(self, m => m.gather_rows(ranges)),
        }
    }

    /// Items of storage along the input dimension (1 for f32/f16; a column shard must be a multiple of it).
    pub fn block_size(&self) -> usize {
        self.dtype().block_size()
    }

    /// Input columns `range` (a shard along the input dimension). A range that does not start and end on block
    /// boundaries cannot be cut out of a quantized matrix: `Err` names the block size.
    pub fn select_cols(&self, range: std::ops::Range<usize>) -> Result<Self, LayoutError> {
        let b = self.block_size();
        if range.end > self.cols() || range.start >= range.end {
            return Err(LayoutError(format!(
                "columns {range:?} of a matrix with {}",
                self.cols()
            )));
        }
        if !range.start.is_multiple_of(b) || !range.end.is_multiple_of(b) {
            return Err(LayoutError(format!(
                "columns {range:?} cut through {b}-wide {:?} blocks",
                self.dtype()
            )));
        }
        if let Some(plain) = self.row_major() {
            return Ok(plain.select_cols(range)?.into_fast_cpu_format());
        }
        Ok(dispatch_map!(self, m => m.select_cols(range.clone())))
    }

    /// The same values in f32 (exact: every format dequantizes to f32).
    pub fn dequantized(&self) -> Self {
        QMatrix::F32(Mat {
            rows: self.rows(),
            cols: self.cols(),
            blocks: self.to_f32(),
        })
    }

    /// The matrix in `dtype` where that stores fewer bits per weight than its own format and its rows divide into
    /// `dtype`'s blocks; otherwise unchanged (a re-quantization that saves no bytes only adds rounding). The values
    /// go through f32 (a transient copy: 519 MiB for the default draft's head), so the rounding is `dtype`'s own plus
    /// the stored format's (Q8_0's steps are an eighth of Q5_0's).
    pub fn requantized_to(self, dtype: GgmlDType) -> Result<Self, LayoutError> {
        let bits = |t: GgmlDType| t.type_size() as f64 * 8.0 / t.block_size() as f64;
        let own = self.dtype();
        if bits(dtype) >= bits(own) || !self.cols().is_multiple_of(dtype.block_size()) {
            return Ok(self);
        }
        QMatrix::from_f32(dtype, self.rows(), self.cols(), &self.to_f32())
    }

    /// Formats whose CPU dot kernels are slow (no SIMD path) are re-quantized to Q8_0, which has one. Q8_0 keeps
    /// 8 bits per weight, more than the 5 or 4 of the source, so the change in outputs is far below the source
    /// format's own quantization error. Returns the matrix unchanged for every other format (Q5_0, the draft's
    /// main format, has its own kernels and keeps its 22 bytes per 32 weights instead of Q8_0's 34).
    ///
    /// Where the AVX2 or AVX-512 VNNI kernels are active (with or without the AMX tiles, which read this layout
    /// through [`kernels::amx::q4k_lanes`]), a Q4_K matrix of whole 16-row groups takes the lanes layout
    /// ([`to_lanes`]; the same bytes, the same results bit for bit), and so does a Q6_K one where the VNNI kernels
    /// are active without AMX; a Q5_0 one takes its own ([`Q5_0Tiles`]), the layout of the active kernels.
    ///
    /// The storage, once in its layout, asks for 2 MB pages ([`crate::alloc::huge_pages`]).
    pub fn into_fast_cpu_format(self) -> Self {
        let fast = self.fast_cpu_layout();
        let (at, bytes) = fast.storage();
        crate::alloc::huge_pages(at, bytes);
        fast
    }

    /// Where the weights' storage starts, and its size in bytes.
    fn storage(&self) -> (*const u8, usize) {
        dispatch!(self, m => (m.blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(&m.blocks[..])))
    }

    /// [`QMatrix::into_fast_cpu_format`]'s layout.
    fn fast_cpu_layout(self) -> Self {
        match self {
            QMatrix::Q4_1(_) | QMatrix::Q5_1(_) => {
                let (rows, cols) = (self.rows(), self.cols());
                let data = self.to_f32();
                QMatrix::Q8_0(Mat::<BlockQ8_0>::from_f32(rows, cols, &data))
            }
            QMatrix::Q4K(m) if lanes_wanted(GgmlDType::Q4K, m.rows) => {
                QMatrix::Q4KLanes(m.to_lanes())
            }
            QMatrix::Q6K(m) if lanes_wanted(GgmlDType::Q6K, m.rows) => {
                QMatrix::Q6KLanes(m.to_lanes())
            }
            QMatrix::Q5_0(m) if lanes_wanted(GgmlDType::Q5_0, m.rows) => {
                let tiles = if kernels::active() >= kernels::Kernels::Vnni {
                    Q5_0Tiles::Masks16
                } else {
                    Q5_0Tiles::Words8
                };
                QMatrix::Q5_0Lanes(m.to_q5_0_lanes(tiles), tiles)
            }
            other => other,
        }
    }

    /// `out[r][c] = sum_j W[c][j] * x[r][j]` for `m` rows of `x` (`x`: m x cols, `out`: m x rows).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        self.matmul_input(&Input::new(x, m), out)
    }

    /// [`QMatrix::matmul`] of rows that other matrices read too: their quantized forms are made once per `input`.
    pub fn matmul_input(&self, input: &Input<'_>, out: &mut [f32]) -> Result<()> {
        let (n, k, m, x) = (self.rows(), self.cols(), input.m, input.x);
        if x.len() != m * k || out.len() != m * n {
            return Err(Error::invalid(format!(
                "matmul shape: x has {} values for {m}x{k}, out has {} for {m}x{n}",
                x.len(),
                out.len()
            )));
        }
        if m == 0 {
            return Ok(());
        }
        // The row groups or the panels, where both could take the block (for Q4_K in the lanes layout on an AMX
        // machine, the tiles or the row groups): timed on the first calls of a shape and row count
        // (kernels::choose), then fixed.
        let pick = match self {
            QMatrix::Q4K(_) => kernels::groups_k("Q4_K", n, k, m),
            QMatrix::Q6K(_) => kernels::groups_k("Q6_K", n, k, m),
            QMatrix::Q8_0(_) => kernels::groups_32("Q8_0", n, k, m),
            QMatrix::Q5_0(_) => kernels::groups_32("Q5_0", n, k, m),
            QMatrix::Q4KLanes(_) => kernels::amx_lanes(n, k, m),
            // Q6_K and Q5_0 in lanes: the kernel of their layout, the only one that reads it.
            QMatrix::Q6KLanes(_) | QMatrix::Q5_0Lanes(..) => kernels::choose::Pick::fixed(true),
            _ => kernels::choose::Pick::fixed(false),
        };
        let groups = pick.groups;
        #[cfg(not(target_arch = "x86_64"))]
        let _ = groups; // the row groups exist on x86-64 only
        if let QMatrix::Q4KLanes(mat) = self {
            #[cfg(target_arch = "x86_64")]
            if kernels::active() >= kernels::Kernels::Vnni {
                // Whole 16-row groups in every chunk (the matrix is whole groups and chunks are multiples of 16),
                // so the panels given for a remainder are never called on this layout.
                let groups: RowGroups<BlockQ4K> = if groups {
                    kernels::amx::q4k_lanes
                } else {
                    kernels::groups::q4k_lanes
                };
                matmul_k_groups(mat, input, out, groups, kernels::q4k_panel);
                pick.finish();
                return Ok(());
            }
            #[cfg(target_arch = "x86_64")]
            if kernels::active() >= kernels::Kernels::Avx2 {
                matmul_k_groups(mat, input, out, kernels::q4k_lanes8, kernels::q4k_panel);
                pick.finish();
                return Ok(());
            }
            // Another variant made active after loading (tests and benchmarks switch them): through the rows.
            let _ = mat;
            pick.finish();
            let plain = self.row_major().expect("a lanes-layout matrix");
            return plain.matmul_input(input, out);
        }
        if matches!(self, QMatrix::Q6KLanes(_) | QMatrix::Q5_0Lanes(..)) {
            pick.finish();
            // Whole 16-row groups, as for Q4_K above: the panels are never called on these layouts. Where another
            // variant was made active after loading (tests and benchmarks switch them) and cannot run the layout's
            // kernel, through the rows.
            #[cfg(target_arch = "x86_64")]
            {
                let active = kernels::active();
                let vnni = active >= kernels::Kernels::Vnni;
                match self {
                    QMatrix::Q6KLanes(mat) if vnni => {
                        let (groups, panel) = (kernels::groups::q6k_lanes, kernels::q6k_panel);
                        matmul_k_groups(mat, input, out, groups, panel);
                        return Ok(());
                    }
                    QMatrix::Q5_0Lanes(mat, Q5_0Tiles::Masks16) if vnni => {
                        let (groups, panel) = (kernels::groups::q5_0_lanes, kernels::q5_0_panel);
                        matmul_32_groups(mat, input, out, groups, panel);
                        return Ok(());
                    }
                    QMatrix::Q5_0Lanes(mat, Q5_0Tiles::Words8)
                        if active >= kernels::Kernels::Avx2 =>
                    {
                        let (groups, panel) = (kernels::q5_0_lanes8, kernels::q5_0_panel);
                        matmul_32_groups(mat, input, out, groups, panel);
                        return Ok(());
                    }
                    _ => {}
                }
            }
            let plain = self.row_major().expect("a lanes-layout matrix");
            return plain.matmul_input(input, out);
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q4K(mat) if kernels::use_amx(m) => matmul_k_amx(
                mat,
                input,
                out,
                kernels::amx::q4k_groups,
                kernels::q4k_panel,
            ),
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q6K(mat) if kernels::use_amx(m) => matmul_k_amx(
                mat,
                input,
                out,
                kernels::amx::q6k_groups,
                kernels::q6k_panel,
            ),
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q4K(mat) if groups => matmul_k_groups(
                mat,
                input,
                out,
                kernels::groups::q4k_groups,
                kernels::q4k_panel,
            ),
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q6K(mat) if groups => matmul_k_groups(
                mat,
                input,
                out,
                kernels::groups::q6k_groups,
                kernels::q6k_panel,
            ),
            QMatrix::Q4K(mat) => matmul_k(mat, input, out, kernels::q4k_panel),
            QMatrix::Q6K(mat) => matmul_k(mat, input, out, kernels::q6k_panel),
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q8_0(mat) if groups => matmul_32_groups(
                mat,
                input,
                out,
                kernels::groups::q8_0_groups,
                kernels::q8_0_panel,
            ),
            #[cfg(target_arch = "x86_64")]
            QMatrix::Q5_0(mat) if groups => matmul_32_groups(
                mat,
                input,
                out,
                kernels::groups::q5_0_groups,
                kernels::q5_0_panel,
            ),
            QMatrix::Q8_0(mat) => matmul_32(mat, input, out, kernels::q8_0_panel),
            QMatrix::Q5_0(mat) => matmul_32(mat, input, out, kernels::q5_0_panel),
            _ => dispatch!(self, mat => mat.matmul(x, m, out)),
        }
        pick.finish();
        Ok(())
    }
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QMatrix({:?}, {}x{})",
            self.dtype(),
            self.rows(),
            self.cols()
        )
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod shard_tests;
