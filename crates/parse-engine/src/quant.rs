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
    BlockQ8_0, BlockQ8K, GgmlType,
};
use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels;

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

/// The lanes layout of K-quant weights (`w`: whole rows of `kb` super-blocks, a multiple of 16 rows): the same
/// bytes, permuted so that tile `(g, b)` (super-blocks `(g * kb + b) * 16..+16`) holds super-block `b` of rows
/// `16g..16g + 16` word by word, word `i` of row `16g + n` at byte `64 i + 4 n` of the tile (Q6_K: `64 s + 4 n`, `s`
/// the word's slot by [`Q6K_RUN_SLOTS`]), and a block's last two
/// bytes where its size is not a multiple of 4 (Q6_K's `d`: 210 bytes) at `64 w + 2 n` after its `w` whole words.
/// One 64-byte load is then a word of all 16 rows, one row per 32-bit lane, which the row groups
/// ([`kernels::groups`]) would otherwise gather from 16 rows and transpose at every step. See
/// docs/decisions/kernel-choice.md.
pub(crate) fn to_lanes<T: GgmlType>(w: &[T], kb: usize) -> Vec<T> {
    permute_lanes(w, kb, true)
}

/// The row-major layout back from [`to_lanes`]'s.
pub(crate) fn from_lanes<T: GgmlType>(w: &[T], kb: usize) -> Vec<T> {
    permute_lanes(w, kb, false)
}

/// Bytes of a Q6_K super-block (ggml's `block_q6_K`: 128 bytes of low nibbles, 64 of high bits, 16 group scales,
/// `d`).
const Q6K_BLOCK: usize = 210;

/// The slot of each run of four words of a Q6_K super-block (run `r`: bytes `16r..16r + 16`) in a lanes-layout tile:
/// the order in which the row groups read them ([`kernels::groups::q6k_lanes`]: the group scales, then for each half
/// and word run its low nibbles, the other low nibbles of its part and its high bits), so that a tile is read front to
/// back, which the hardware prefetchers follow; in the block's own order the kernel would jump a kilobyte back and
/// forth inside each tile, and memory would stream at less than half the rate (`benches/probes/tile-order.c`
/// measures the two orders).
pub(crate) const Q6K_RUN_SLOTS: [usize; 13] = [1, 4, 2, 5, 7, 10, 8, 11, 3, 6, 9, 12, 0];

/// Where the bytes of row `n`'s super-block (of `block` bytes) go in a lanes-layout tile: `(offset in the block,
/// offset in the tile, length)` for each of its words and its 2-byte tail, if any. Word `i` goes to slot `i` of the
/// tile, except in Q6_K tiles, whose runs of four words take [`Q6K_RUN_SLOTS`]' order.
fn lane_runs(block: usize, n: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    debug_assert!(
        block.is_multiple_of(4) || block % 4 == 2,
        "whole words or a 2-byte tail"
    );
    let words = block / 4;
    let slot = move |i: usize| {
        if block == Q6K_BLOCK {
            4 * Q6K_RUN_SLOTS[i / 4] + i % 4
        } else {
            i
        }
    };
    let tail = (!block.is_multiple_of(4)).then_some((4 * words, 64 * words + 2 * n, 2));
    (0..words)
        .map(move |i| (4 * i, 64 * slot(i) + 4 * n, 4))
        .chain(tail)
}

/// The blocks of `w` as bytes.
#[allow(unsafe_code)]
fn block_bytes<T: GgmlType>(w: &[T]) -> &[u8] {
    // SAFETY: the ggml block types are #[repr(C)] plain-old-data; the view spans exactly the slice's storage.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), std::mem::size_of_val(w)) }
}

/// The blocks of `w` as bytes to write (a copy's, to permute into).
#[allow(unsafe_code)]
fn block_bytes_mut<T: GgmlType>(w: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `block_bytes`; every bit pattern is a valid block, so any bytes written leave valid blocks.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(w)) }
}

fn permute_lanes<T: GgmlType>(w: &[T], kb: usize, to_lanes: bool) -> Vec<T> {
    assert!(
        kb > 0 && w.len().is_multiple_of(16 * kb),
        "whole groups of 16 rows"
    );
    let block = std::mem::size_of::<T>();
    let mut out = w.to_vec();
    let (src, dst) = (block_bytes(w), block_bytes_mut(&mut out));
    let row_bytes = kb * block;
    for g in 0..w.len() / (16 * kb) {
        for b in 0..kb {
            let tile = (g * kb + b) * 16 * block;
            for n in 0..16 {
                let row = (g * 16 + n) * row_bytes + b * block;
                for (at, lane, len) in lane_runs(block, n) {
                    let (rows, lanes) = (row + at, tile + lane);
                    let (from, to) = if to_lanes {
                        (rows, lanes)
                    } else {
                        (lanes, rows)
                    };
                    dst[to..to + len].copy_from_slice(&src[from..from + len]);
                }
            }
        }
    }
    out
}

/// Row `r`'s super-blocks out of a lanes-layout matrix of `kb` super-blocks per row.
fn lanes_row<T: GgmlType>(w: &[T], kb: usize, r: usize) -> Vec<T> {
    let block = std::mem::size_of::<T>();
    let mut out = vec![T::zeros(); kb];
    let (src, dst) = (block_bytes(w), block_bytes_mut(&mut out));
    let (g, n) = (r / 16, r % 16);
    for b in 0..kb {
        let tile = (g * kb + b) * 16 * block;
        for (at, lane, len) in lane_runs(block, n) {
            dst[b * block + at..][..len].copy_from_slice(&src[tile + lane..][..len]);
        }
    }
    out
}

/// Bytes of a Q5_0 block (ggml's `block_q5_0`: `d` as f16, the 32 fifth bits `qh`, 16 bytes of nibbles `qs`).
const Q5_0_BLOCK: usize = 22;

/// Q5_0's two lanes layouts, one per family of kernels that reads it. Both hold block `b` of a group of rows as one
/// tile (tile `(g, b)`: blocks `(g * kb + b) * rows..+rows`), the same bits permuted, the same size:
/// - [`Q5_0Tiles::Masks16`], for the AVX-512 VNNI row groups: 16 rows, 352 bytes,
///   - bytes `0..32`: the 16 rows' `d`, row `n` at `2n`, one 256-bit load for the 16 scales;
///   - bytes `32..96`: eight 64-bit masks, mask `k` at `32 + 8k` with bit `4n + t` the fifth bit of value `4k + t`
///     of row `n` (bit `4k + t` of its `qh`), one mask register per vector of weights below;
///   - bytes `96..352`: four vectors, vector `i` at `96 + 64i` with bytes `4n..4n + 4` row `n`'s nibble bytes
///     `4i..4i + 4`, whose low nibbles are values `4i..4i + 4` and high nibbles values `16 + 4i..`.
///
///   One masked add then makes a vector of 4 consecutive unsigned weights of 16 rows, the operand of `vpdpbusd`,
///   from one load, one mask and a shift (`kernels::groups::q5_0_lanes`).
/// - [`Q5_0Tiles::Words8`], for the AVX2 kernels (`kernels::q5_0_lanes8`), which have no mask registers: 8 rows,
///   176 bytes,
///   - bytes `0..16`: the 8 rows' `d`, row `n` at `2n`;
///   - bytes `16..48`: a 32-bit word per row, row `n`'s at `16 + 4n`, whose byte `t` holds at bit `k` the fifth bit
///     of value `4k + t` (bit `4k + t` of its `qh`): one shift puts the fifth bits of values `4k..4k + 4` of all 8
///     rows at bit 4 of their bytes;
///   - bytes `48..176`: four vectors, vector `i` at `48 + 32i` with bytes `4n..4n + 4` row `n`'s nibble bytes
///     `4i..4i + 4`.
///
/// Where the rows' blocks are otherwise gathered, transposed and their fifth bits spread by shuffles at every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q5_0Tiles {
    Masks16,
    Words8,
}

impl Q5_0Tiles {
    /// Weight rows per tile.
    pub const fn rows(self) -> usize {
        match self {
            Q5_0Tiles::Masks16 => 16,
            Q5_0Tiles::Words8 => 8,
        }
    }

    /// One tile from its rows' blocks (`rows[n]`: row `n`'s 22 bytes).
    fn pack(self, rows: &[&[u8]], tile: &mut [u8]) {
        let qh = |r: &[u8]| u32::from_le_bytes([r[2], r[3], r[4], r[5]]);
        let (fifths, nibbles) = match self {
            Q5_0Tiles::Masks16 => (32, 96),
            Q5_0Tiles::Words8 => (16, 48),
        };
        let vector = 4 * rows.len();
        for (n, r) in rows.iter().enumerate() {
            tile[2 * n..2 * n + 2].copy_from_slice(&r[..2]);
            for i in 0..4 {
                tile[nibbles + vector * i + 4 * n..][..4].copy_from_slice(&r[6 + 4 * i..][..4]);
            }
            if self == Q5_0Tiles::Words8 {
                let mut word = 0u32;
                for (k, t) in (0..8).flat_map(|k| (0..4).map(move |t| (k, t))) {
                    word |= ((qh(r) >> (4 * k + t)) & 1) << (8 * t + k);
                }
                tile[fifths + 4 * n..][..4].copy_from_slice(&word.to_le_bytes());
            }
        }
        if self == Q5_0Tiles::Masks16 {
            for k in 0..8 {
                let mut mask = 0u64;
                for (n, r) in rows.iter().enumerate() {
                    mask |= (((qh(r) >> (4 * k)) & 0xF) as u64) << (4 * n);
                }
                tile[fifths + 8 * k..][..8].copy_from_slice(&mask.to_le_bytes());
            }
        }
    }

    /// Row `n`'s 22 bytes out of a tile.
    fn unpack(self, tile: &[u8], n: usize, block: &mut [u8]) {
        block[..2].copy_from_slice(&tile[2 * n..2 * n + 2]);
        let mut qh = 0u32;
        let nibbles = match self {
            Q5_0Tiles::Masks16 => {
                for k in 0..8 {
                    let mask =
                        u64::from_le_bytes(tile[32 + 8 * k..][..8].try_into().expect("8 bytes"));
                    qh |= (((mask >> (4 * n)) & 0xF) as u32) << (4 * k);
                }
                96
            }
            Q5_0Tiles::Words8 => {
                let word = u32::from_le_bytes(tile[16 + 4 * n..][..4].try_into().expect("4 bytes"));
                for (k, t) in (0..8).flat_map(|k| (0..4).map(move |t| (k, t))) {
                    qh |= ((word >> (8 * t + k)) & 1) << (4 * k + t);
                }
                48
            }
        };
        block[2..6].copy_from_slice(&qh.to_le_bytes());
        for i in 0..4 {
            block[6 + 4 * i..][..4]
                .copy_from_slice(&tile[nibbles + 4 * self.rows() * i + 4 * n..][..4]);
        }
    }
}

/// Q5_0 weights (`w`: whole rows of `kb` blocks, a multiple of `tiles.rows()` rows) in one of Q5_0's lanes layouts.
pub(crate) fn q5_0_to_tiles(w: &[BlockQ5_0], kb: usize, tiles: Q5_0Tiles) -> Vec<BlockQ5_0> {
    q5_0_permute(w, kb, tiles, true)
}

fn q5_0_permute(w: &[BlockQ5_0], kb: usize, tiles: Q5_0Tiles, to_lanes: bool) -> Vec<BlockQ5_0> {
    let rows = tiles.rows();
    assert!(
        kb > 0 && w.len().is_multiple_of(rows * kb),
        "whole groups of {rows} rows"
    );
    debug_assert_eq!(std::mem::size_of::<BlockQ5_0>(), Q5_0_BLOCK);
    let mut out = w.to_vec();
    let (src, dst) = (block_bytes(w), block_bytes_mut(&mut out));
    let (row_bytes, tile_bytes) = (kb * Q5_0_BLOCK, rows * Q5_0_BLOCK);
    for g in 0..w.len() / (rows * kb) {
        for b in 0..kb {
            let tile = (g * kb + b) * tile_bytes;
            let at = |n: usize| (g * rows + n) * row_bytes + b * Q5_0_BLOCK;
            if to_lanes {
                let blocks: Vec<&[u8]> =
                    (0..rows).map(|n| &src[at(n)..at(n) + Q5_0_BLOCK]).collect();
                tiles.pack(&blocks, &mut dst[tile..tile + tile_bytes]);
            } else {
                for n in 0..rows {
                    tiles.unpack(
                        &src[tile..tile + tile_bytes],
                        n,
                        &mut dst[at(n)..at(n) + Q5_0_BLOCK],
                    );
                }
            }
        }
    }
    out
}

/// Row `r`'s blocks out of a Q5_0 matrix of `kb` blocks per row in one of Q5_0's lanes layouts.
fn q5_0_lanes_row(w: &[BlockQ5_0], kb: usize, r: usize, tiles: Q5_0Tiles) -> Vec<BlockQ5_0> {
    let mut out = vec![BlockQ5_0::zeros(); kb];
    let (src, dst) = (block_bytes(w), block_bytes_mut(&mut out));
    let rows = tiles.rows();
    let (g, n) = (r / rows, r % rows);
    for b in 0..kb {
        let tile = (g * kb + b) * rows * Q5_0_BLOCK;
        tiles.unpack(
            &src[tile..tile + rows * Q5_0_BLOCK],
            n,
            &mut dst[b * Q5_0_BLOCK..(b + 1) * Q5_0_BLOCK],
        );
    }
    out
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

/// Whether a matrix of `format` with `rows` rows takes the lanes layout at load ([`QMatrix::into_fast_cpu_format`]):
/// Q4_K and Q5_0 wherever the AVX2 or the AVX-512 VNNI kernels are active (Q4_K: the VNNI row groups, on AMX machines
/// the tiles, or the AVX2 kernel read the one layout; Q5_0: each family reads a layout of its own, [`Q5_0Tiles`]),
/// Q6_K only where the VNNI row groups are the active kernels (the AMX tiles read Q6_K in rows).
fn lanes_wanted(format: GgmlDType, rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let whole_groups = rows > 0 && rows.is_multiple_of(16);
        let simd = kernels::active() >= kernels::Kernels::Avx2;
        match format {
            GgmlDType::Q4K | GgmlDType::Q5_0 => whole_groups && simd,
            GgmlDType::Q6K => whole_groups && kernels::active() == kernels::Kernels::Vnni,
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, rows);
        false
    }
}

/// Signature of a panel of [`crate::kernels`] over activation rows of type `X`.
type Panel<T, X> = fn(kernels::Kernels, &[T], usize, &[X], &mut [f32], usize);

/// Runs `panel` over the weight rows `wc` (whole rows of `kb` blocks) and every activation row, in tiles of
/// [`kernels::TILE_ROWS`]: `dst[r * stride + c]` for the tile's rows `r` and the weight rows `c` of `wc`.
fn run_panels<T, X>(
    panel: Panel<T, X>,
    kern: kernels::Kernels,
    wc: &[T],
    kb: usize,
    rows: &[X],
    dst: &mut [f32],
    stride: usize,
) {
    for r0 in (0..rows.len()).step_by(kernels::TILE_ROWS) {
        let r1 = (r0 + kernels::TILE_ROWS).min(rows.len());
        panel(kern, wc, kb, &rows[r0..r1], &mut dst[r0 * stride..], stride);
    }
}

/// Matmul of a matrix through the register-tiled panels of [`crate::kernels`], given its activation rows.
fn matmul_panels<T: GgmlType, X: Sync>(
    mat: &Mat<T>,
    rows: &[X],
    out: &mut [f32],
    panel: Panel<T, X>,
) {
    let (n, m) = (mat.rows, rows.len());
    let kb = mat.blocks_per_row();
    let kern = kernels::active();
    let w = &mat.blocks;
    let chunk = column_chunk(n, kb * std::mem::size_of::<T>());
    drive(
        n,
        m,
        chunk,
        |c0, dst| {
            let cw = dst.len() / m;
            run_panels(panel, kern, &w[c0 * kb..(c0 + cw) * kb], kb, rows, dst, cw);
        },
        out,
    );
}

/// Matmul of a K-quant matrix (Q8_K activations).
fn matmul_k<'a, T: GgmlType<VecDotType = BlockQ8K>>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    panel: Panel<T, &'a [BlockQ8K]>,
) {
    let rows: Vec<&[BlockQ8K]> = input.q8k().chunks(mat.blocks_per_row()).collect();
    matmul_panels(mat, &rows, out, panel);
}

/// Matmul of a Q8_0 or Q5_0 matrix (Q8_0-rounded activations).
fn matmul_32<'a, T: GgmlType>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    panel: Panel<T, kernels::Act32Row<'a>>,
) {
    let xq = input.act32();
    let rows: Vec<kernels::Act32Row<'_>> = (0..input.m).map(|r| xq.row(r)).collect();
    matmul_panels(mat, &rows, out, panel);
}

/// The AMX tile function of a K-quant format.
#[cfg(target_arch = "x86_64")]
type AmxGroups<T> = unsafe fn(&[T], usize, &kernels::amx::Acts, &mut [f32], usize);

/// The row-group function of a K-quant format ([`kernels::groups`]).
#[cfg(target_arch = "x86_64")]
type RowGroups<T> = unsafe fn(&[T], usize, &[&[BlockQ8K]], &mut [f32], usize);

/// Work items per thread of a K-quant row-group matmul in long runs ([`long_chunks`]).
#[cfg(target_arch = "x86_64")]
const LONG_CHUNKS_PER_THREAD: usize = 2;

#[cfg(all(test, target_arch = "x86_64"))]
thread_local! {
    /// The split a test asks of the K-quant matmuls called on its thread, in place of the CPU's.
    static LONG_CHUNKS_IN_TEST: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether the K-quant row-group matmuls (Q4_K and Q6_K through the row groups or the AMX tiles) split a matrix into
/// `LONG_CHUNKS_PER_THREAD` runs of rows per thread (on) or into L2-sized items (`column_chunk`, off), as the CPU
/// decides ([`long_chunks_by_cpu`]). The same bits either way: each output value is one kernel call's. The row groups
/// read each weight once for every activation row, so no item need fit L2; and each item's first group starts
/// unprefetched (a kernel prefetches only its own next group), so long runs keep the weights streaming. AMD CPUs
/// before family 25 (Zen, Zen+, Zen 2) lose with long runs at blocks of several rows and keep the L2-sized items.
/// The draft's Q5_0 row groups keep L2-sized items everywhere: its matrices are small, and two items a thread
/// balance worse. See docs/decisions/kernel-choice.md.
#[cfg(target_arch = "x86_64")]
fn long_chunks() -> bool {
    #[cfg(test)]
    if let Some(long) = LONG_CHUNKS_IN_TEST.with(|c| c.get()) {
        return long;
    }
    static BY_CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BY_CPU.get_or_init(long_chunks_by_cpu)
}

/// [`long_chunks`]'s default on this CPU: off on AMD CPUs before family 25, on elsewhere.
#[cfg(target_arch = "x86_64")]
fn long_chunks_by_cpu() -> bool {
    !(kernels::amd_cpu() && kernels::cpu_family() < 25)
}

/// Matmul of a block of rows through a kernel of 16 weight rows at a time: `groups(w, rows, dst, stride)` takes
/// whole 16-row groups of a chunk's columns (`rows`: the activation rows), the panels (the same arithmetic) any
/// remaining columns. With `long`, each thread takes [`LONG_CHUNKS_PER_THREAD`] runs of rows ([`long_chunks`]);
/// otherwise L2-sized items ([`column_chunk`]).
#[cfg(target_arch = "x86_64")]
fn matmul_16<T: GgmlType, X: Sync>(
    mat: &Mat<T>,
    long: bool,
    rows: &[X],
    out: &mut [f32],
    kern: kernels::Kernels,
    groups: impl Fn(&[T], &[X], &mut [f32], usize) + Sync,
    panel: Panel<T, X>,
) {
    let (n, m) = (mat.rows, rows.len());
    let kb = mat.blocks_per_row();
    let w = &mat.blocks;
    let chunk = if long {
        let threads = rayon::current_num_threads().max(1);
        (n / (threads * LONG_CHUNKS_PER_THREAD)).div_ceil(16).max(1) * 16
    } else {
        (column_chunk(n, kb * std::mem::size_of::<T>()) / 16 * 16).max(16)
    };
    drive(
        n,
        m,
        chunk,
        |c0, dst| {
            let cw = dst.len() / m;
            let full = cw / 16 * 16;
            if full > 0 {
                groups(&w[c0 * kb..(c0 + full) * kb], rows, dst, cw);
            }
            if full < cw {
                let wc = &w[(c0 + full) * kb..(c0 + cw) * kb];
                run_panels(panel, kern, wc, kb, rows, &mut dst[full..], cw);
            }
        },
        out,
    );
}

/// [`matmul_16`] of a K-quant matrix (Q8_K activation rows).
#[cfg(target_arch = "x86_64")]
fn matmul_k_16<'a, T: GgmlType<VecDotType = BlockQ8K>>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    kern: kernels::Kernels,
    groups: impl Fn(&[T], &[&[BlockQ8K]], &mut [f32], usize) + Sync,
    panel: Panel<T, &'a [BlockQ8K]>,
) {
    let rows: Vec<&[BlockQ8K]> = input.q8k().chunks(mat.blocks_per_row()).collect();
    matmul_16(mat, long_chunks(), &rows, out, kern, groups, panel);
}

/// The row-group function of a 32-wide format ([`kernels::groups`]).
#[cfg(target_arch = "x86_64")]
type Groups32<T> = unsafe fn(&[T], usize, &[kernels::Act32Row<'_>], &mut [f32], usize);

/// Q5_0 or Q8_0 matmul of a block of rows through its row-group kernel ([`matmul_16`]).
#[cfg(target_arch = "x86_64")]
fn matmul_32_groups<'a, T: GgmlType>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    groups: Groups32<T>,
    panel: Panel<T, kernels::Act32Row<'a>>,
) {
    let kb = mat.blocks_per_row();
    let xq = input.act32();
    let rows: Vec<kernels::Act32Row<'_>> = (0..input.m).map(|r| xq.row(r)).collect();
    let lanes = |w: &[T], rows: &[kernels::Act32Row<'_>], dst: &mut [f32], stride: usize| {
        #[allow(unsafe_code)]
        // SAFETY: callers pass a row-group kernel only where a variant that runs it is active: the VNNI ones with
        // an AVX-512 VNNI variant (`groups_32`, or the layout's check), the AVX2 one with AVX2 or above (each check
        // includes AVX2, FMA and F16C); `w` is whole 16-row groups; every activation row has kb blocks.
        unsafe {
            groups(w, kb, rows, dst, stride)
        }
    };
    matmul_16(mat, false, &rows, out, kernels::active(), lanes, panel);
}

/// K-quant matmul of a block of rows through AMX tiles ([`matmul_k_16`]).
#[cfg(target_arch = "x86_64")]
fn matmul_k_amx<'a, T: GgmlType<VecDotType = BlockQ8K>>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    groups: AmxGroups<T>,
    panel: Panel<T, &'a [BlockQ8K]>,
) {
    let kb = mat.blocks_per_row();
    let acts = input.amx_acts();
    let tiles = |w: &[T], _: &[&[BlockQ8K]], dst: &mut [f32], stride: usize| {
        #[allow(unsafe_code)]
        // SAFETY: the active variant is Amx, which is only handed out when the CPU and the OS allow it.
        unsafe {
            groups(w, kb, acts, dst, stride)
        }
    };
    matmul_k_16(mat, input, out, kernels::Kernels::Amx, tiles, panel);
}

/// K-quant matmul of a block of rows through the row-group kernels ([`matmul_k_16`]).
#[cfg(target_arch = "x86_64")]
fn matmul_k_groups<'a, T: GgmlType<VecDotType = BlockQ8K>>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    groups: RowGroups<T>,
    panel: Panel<T, &'a [BlockQ8K]>,
) {
    let kb = mat.blocks_per_row();
    let lanes = |w: &[T], rows: &[&[BlockQ8K]], dst: &mut [f32], stride: usize| {
        #[allow(unsafe_code)]
        // SAFETY: callers pass a row-group kernel only where an AVX-512 VNNI variant is active, the AVX2 one
        // (`q4k_lanes8`) where AVX2 or above is (F16C is in the build's baseline), and the AMX tiles' only where
        // the AMX variant is (`kernels::amx_lanes`), which is handed out only where the CPU and the OS allow it;
        // `w` is whole 16-row groups; every activation row has kb blocks.
        unsafe {
            groups(w, kb, rows, dst, stride)
        }
    };
    matmul_k_16(mat, input, out, kernels::active(), lanes, panel);
}

/// The input rows of one or more matmuls, quantized on first use for each activation format and shared by every
/// matrix that reads them (the query, key and value projections read the same rows; so do gate and up).
pub struct Input<'a> {
    x: &'a [f32],
    m: usize,
    k: usize,
    q8k: std::sync::OnceLock<Vec<BlockQ8K>>,
    #[cfg(target_arch = "x86_64")]
    amx: std::sync::OnceLock<kernels::amx::Acts>,
    act32: std::sync::OnceLock<kernels::Act32>,
}

impl<'a> Input<'a> {
    /// `m` rows of `x.len() / m` values (`m > 0`).
    pub fn new(x: &'a [f32], m: usize) -> Self {
        Input {
            x,
            m,
            k: x.len() / m.max(1),
            q8k: Default::default(),
            #[cfg(target_arch = "x86_64")]
            amx: Default::default(),
            act32: Default::default(),
        }
    }

    /// Q8_K rows (the partner of every K-quant format). The quantization may share its blocks among the threads
    /// ([`kernels::quantize_q8k`]), and a thread waiting for its share can pick up other parallel work meanwhile; none
    /// of that work reads this cell (an `Input` serves one forward's matmuls one after another, on one thread), so
    /// the cell's initialization is never entered twice.
    fn q8k(&self) -> &[BlockQ8K] {
        self.q8k.get_or_init(|| {
            let mut xq = vec![BlockQ8K::zeros(); self.x.len() / 256];
            kernels::quantize_q8k(self.x, &mut xq);
            xq
        })
    }

    #[cfg(target_arch = "x86_64")]
    fn amx_acts(&self) -> &kernels::amx::Acts {
        self.amx
            .get_or_init(|| kernels::amx::Acts::new(self.q8k(), self.k / 256, self.m))
    }

    fn act32(&self) -> &kernels::Act32 {
        self.act32
            .get_or_init(|| kernels::Act32::quantize(self.x, self.k, self.m))
    }
}

/// Activations quantized row by row to the weight format's dot partner.
fn quantize_rows<T: GgmlType>(x: &[f32], k: usize, m: usize) -> Vec<T::VecDotType> {
    let kb = k / T::BLCK_SIZE;
    let mut xq = vec![T::VecDotType::zeros(); m * kb];
    for (dst, src) in xq.chunks_mut(kb).zip(x.chunks(k)) {
        T::VecDotType::from_float(src, dst);
    }
    xq
}

/// Output columns per work item: a multiple of 4 (no quad straddles two workers), enough items to balance the
/// threads, and few enough weight bytes per item to stay in L2 while every row tile passes over them.
fn column_chunk(n: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = n / (threads * 8);
    let by_cache = (256 << 10) / row_bytes.max(1);
    (by_balance.min(by_cache).max(4) / 4 * 4).min(256)
}

/// The largest chunk-results buffer [`drive`] keeps between calls, in values (8 MB: a block of 13 rows of the
/// 151,936-wide output matrix of the default target; larger ones are allocated each time), and how many it keeps
/// (calls at once in a process; one more allocates its own).
const KEPT_RESULTS: usize = 2 << 20;
const KEPT_BUFFERS: usize = 2;

/// [`drive`]'s chunk-results buffers, kept for later calls.
static RESULTS: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// Runs `work(first_column, dst)` over column chunks in parallel and lays the results out row-major in `out`.
/// `dst` holds the chunk's `cw` columns row-major (`dst[r * cw + (c - first_column)]`, `cw = dst.len() / m`), zeroed,
/// so each row of a chunk lands in `out` as one contiguous copy. With several rows, the chunks' results go to a
/// buffer kept from call to call ([`KEPT_RESULTS`]), each chunk zeroing its own part in parallel, and the rows of
/// `out` are laid out in parallel too, so that no thread waits while the caller zeroes and copies.
fn drive(
    n: usize,
    m: usize,
    chunk: usize,
    work: impl Fn(usize, &mut [f32]) + Sync,
    out: &mut [f32],
) {
    if m == 1 {
        out[..n]
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, dst)| work(i * chunk, dst));
        return;
    }
    let (mut t, reused) = if n * m > KEPT_RESULTS {
        // Too large to keep: zeroed at allocation (so its chunks need not zero it again), and dropped after.
        (vec![0f32; n * m], false)
    } else {
        let mut t = RESULTS
            .lock()
            .ok()
            .and_then(|mut r| r.pop())
            .unwrap_or_default();
        if t.len() < n * m {
            // Grown (the values past the old length zeroed once); every chunk zeroes its part before its work.
            t.resize(n * m, 0.0);
        }
        (t, true)
    };
    t[..n * m]
        .par_chunks_mut(chunk * m)
        .enumerate()
        .for_each(|(i, dst)| {
            if reused {
                dst.fill(0.0);
            }
            work(i * chunk, dst)
        });
    let results = &t[..n * m];
    out[..n * m]
        .par_chunks_mut(n)
        .enumerate()
        .for_each(|(r, row)| {
            for (i, buf) in results.chunks(chunk * m).enumerate() {
                let (c0, cw) = (i * chunk, buf.len() / m);
                row[c0..c0 + cw].copy_from_slice(&buf[r * cw..(r + 1) * cw]);
            }
        });
    if t.len() <= KEPT_RESULTS
        && let Ok(mut r) = RESULTS.lock()
        && r.len() < KEPT_BUFFERS
    {
        r.push(t);
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
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn reference(w: &[f32], x: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                out[r * n + c] = (0..k).map(|j| w[c * k + j] * x[r * k + j]).sum();
            }
        }
        out
    }

    /// A head re-quantized for a draft: to fewer bits it changes format (and stays close to the values); to as many
    /// or more bits, or where the rows do not divide into the format's blocks, it is left as it is.
    #[test]
    fn requantizing_saves_bytes_or_leaves_the_matrix_alone() {
        let (rows, cols) = (16, 256);
        let w = random(rows * cols, 11);
        let q8 = QMatrix::from_f32(GgmlDType::Q8_0, rows, cols, &w).unwrap();
        let q5 = q8.clone().requantized_to(GgmlDType::Q5_0).unwrap();
        assert_eq!(q5.dtype(), GgmlDType::Q5_0);
        assert!(q5.storage_bytes() < q8.storage_bytes());
        let err = q5
            .to_f32()
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // Q5_0 steps of (max |w| of a block, here <= 1) / 16, off by up to one step at the clipped end of its range
        // (-16..=15); the Q8_0 rounding before adds at most a 254th.
        assert!(err <= 1.0 / 16.0 + 1.0 / 254.0, "max error {err}");
        let q4k = QMatrix::from_f32(GgmlDType::Q4K, rows, cols, &w).unwrap();
        let same = q4k.clone().requantized_to(GgmlDType::Q5_0).unwrap();
        assert_eq!(same.dtype(), GgmlDType::Q4K);
        assert_eq!(same.to_f32(), q4k.to_f32());
        let f32_odd = QMatrix::from_f32(GgmlDType::F32, 2, 40, &w[..80]).unwrap();
        let kept = f32_odd.requantized_to(GgmlDType::Q5_0).unwrap();
        assert_eq!(kept.dtype(), GgmlDType::F32);
    }

    #[test]
    fn random_matrices_are_centred_and_sized_like_their_fan_in() {
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let (rows, cols) = (64, 512);
            let m = random_matrix(dtype, rows, cols, 5).unwrap();
            assert_eq!((m.dtype(), m.rows(), m.cols()), (dtype, rows, cols));
            let v = m.to_f32();
            let n = v.len() as f32;
            let mean = v.iter().sum::<f32>() / n;
            let sd = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n).sqrt();
            let target = 1.0 / (cols as f32).sqrt();
            assert!(v.iter().all(|x| x.is_finite()), "{dtype:?}");
            assert!(mean.abs() < 0.2 * target, "{dtype:?}: mean {mean}");
            assert!(
                sd > 0.6 * target && sd < 1.6 * target,
                "{dtype:?}: sd {sd} for {target}"
            );
            // The same seed gives the same matrix.
            assert_eq!(random_matrix(dtype, rows, cols, 5).unwrap().to_f32(), v);
        }
        assert!(random_matrix(GgmlDType::Q4K, 4, 100, 1).is_err());
        assert!(random_matrix(GgmlDType::Q2K, 4, 256, 1).is_err());
    }

    #[test]
    fn every_format_matches_its_dequantized_reference() {
        let (n, k, m) = (37, 512, 5);
        let w = random(n * k, 1);
        let x = random(m * k, 2);
        // Tolerances are relative to the RMS of the exact product: the activations are quantized too (to Q8_0 or
        // Q8_K), so even Q8_0 weights give ~1% error.
        // A wrong block layout gives errors above 1.
        for (dtype, tol) in [
            (GgmlDType::F32, 1e-5),
            (GgmlDType::F16, 0.01),
            (GgmlDType::Q4_0, 0.3),
            (GgmlDType::Q4_1, 0.3),
            (GgmlDType::Q5_0, 0.15),
            (GgmlDType::Q5_1, 0.15),
            (GgmlDType::Q8_0, 0.03),
            (GgmlDType::Q2K, 1.0),
            (GgmlDType::Q3K, 0.5),
            (GgmlDType::Q4K, 0.3),
            (GgmlDType::Q5K, 0.15),
            (GgmlDType::Q6K, 0.08),
        ] {
            let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            assert_eq!(q.dtype(), dtype);
            let exact = reference(&w, &x, n, k, m);
            let rms = (exact.iter().map(|v| v * v).sum::<f32>() / exact.len() as f32).sqrt();
            let mut got = vec![0f32; m * n];
            q.matmul(&x, m, &mut got).unwrap();
            let max_err = exact
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
                / rms;
            assert!(max_err < tol, "{dtype:?}: relative error {max_err}");
            // The kernel must also agree with the dequantized weights (only activation rounding differs).
            let deq = reference(&q.to_f32(), &x, n, k, m);
            let deq_err = deq
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
                / rms;
            assert!(deq_err < 0.03, "{dtype:?}: kernel vs dequantized {deq_err}");
        }
    }

    #[test]
    fn rows_are_bitwise_independent_of_the_block() {
        let (n, k) = (70, 256);
        let w = random(n * k, 3);
        let x = random(19 * k, 4);
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
            GgmlDType::F32,
        ] {
            let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            let mut all = vec![0f32; 19 * n];
            q.matmul(&x, 19, &mut all).unwrap();
            for r in 0..19 {
                let mut one = vec![0f32; n];
                q.matmul(&x[r * k..(r + 1) * k], 1, &mut one).unwrap();
                assert_eq!(
                    one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    all[r * n..(r + 1) * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{dtype:?} row {r}"
                );
            }
        }
    }

    /// The calls that time the row groups against the panels (kernels::choose) give the bits the chosen kernel
    /// gives afterwards: a block's output is the same on every call, trial or not. (On a CPU without AVX-512 VNNI
    /// every call takes the panels and this holds trivially.)
    #[test]
    fn timed_trials_of_the_kernels_give_the_same_bits_as_the_choice() {
        let (n, k, m) = (48, 512, 9);
        let w = random(n * k, 5);
        let x = random(m * k, 6);
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
        ] {
            let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            let bits = |q: &QMatrix| {
                let mut out = vec![0f32; m * n];
                q.matmul(&x, m, &mut out).unwrap();
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let first = bits(&q);
            for call in 1..3 * crate::kernels::choose::TRIALS {
                assert_eq!(bits(&q), first, "{dtype:?} call {call}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(QMatrix::from_f32(GgmlDType::Q4K, 2, 100, &[0.0; 200]).is_err());
        assert!(QMatrix::from_bytes(GgmlDType::Q8_0, 2, 32, &[0u8; 10]).is_err());
        let q = QMatrix::from_f32(GgmlDType::F32, 2, 4, &[0.0; 8]).unwrap();
        let mut out = vec![0f32; 2];
        assert!(q.matmul(&[0.0; 3], 1, &mut out).is_err());
    }
}

#[cfg(test)]
mod shard_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// A Q4_K, Q6_K or Q5_0 matrix in the lanes layout reads, shards and multiplies exactly as the same matrix in
    /// rows.
    #[test]
    fn the_lanes_layout_reads_and_multiplies_as_the_rows_do() {
        let (n, k) = (48, 3 * 256);
        let w = random(n * k, 21);
        for (dtype, tiles) in [
            (GgmlDType::Q4K, None),
            (GgmlDType::Q6K, None),
            (GgmlDType::Q5_0, Some(Q5_0Tiles::Masks16)),
            (GgmlDType::Q5_0, Some(Q5_0Tiles::Words8)),
        ] {
            let rows = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            let lanes = match &rows {
                QMatrix::Q4K(mat) => {
                    let kb = mat.blocks_per_row();
                    assert_eq!(
                        from_lanes(&to_lanes(&mat.blocks, kb), kb).len(),
                        mat.blocks.len()
                    );
                    QMatrix::Q4KLanes(mat.to_lanes())
                }
                QMatrix::Q6K(mat) => {
                    // 210-byte blocks: 52 words and a 2-byte tail per row; a permutation of every byte, the
                    // runs of four words in the kernel's order.
                    let mut slots = Q6K_RUN_SLOTS;
                    slots.sort_unstable();
                    assert_eq!(slots, std::array::from_fn(|i| i), "a slot for every run");
                    let kb = mat.blocks_per_row();
                    let there = to_lanes(&mat.blocks, kb);
                    assert_ne!(block_bytes(&there), block_bytes(&mat.blocks));
                    let mut sorted = (
                        block_bytes(&there).to_vec(),
                        block_bytes(&mat.blocks).to_vec(),
                    );
                    sorted.0.sort_unstable();
                    sorted.1.sort_unstable();
                    assert_eq!(sorted.0, sorted.1);
                    QMatrix::Q6KLanes(mat.to_lanes())
                }
                QMatrix::Q5_0(mat) => {
                    // A permutation of bits (the fifth bits regrouped into masks or words), undone exactly.
                    let (kb, tiles) = (mat.blocks_per_row(), tiles.unwrap());
                    let there = q5_0_to_tiles(&mat.blocks, kb, tiles);
                    assert_ne!(block_bytes(&there), block_bytes(&mat.blocks));
                    let ones = |b: &[u8]| b.iter().map(|v| v.count_ones()).sum::<u32>();
                    assert_eq!(ones(block_bytes(&there)), ones(block_bytes(&mat.blocks)));
                    assert_eq!(
                        block_bytes(&q5_0_permute(&there, kb, tiles, false)),
                        block_bytes(&mat.blocks)
                    );
                    QMatrix::Q5_0Lanes(mat.to_q5_0_lanes(tiles), tiles)
                }
                _ => unreachable!("made as {dtype:?}"),
            };
            assert_eq!(lanes.dtype(), dtype);
            assert_eq!(
                lanes.raw_bytes(),
                rows.raw_bytes(),
                "{dtype:?}: the layout is a permutation, undone for readers"
            );
            assert_eq!(lanes.to_f32(), rows.to_f32());
            for r in [0, 15, 16, 47] {
                let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
                lanes.row_to_f32(r, &mut a);
                rows.row_to_f32(r, &mut b);
                assert_eq!(a, b, "{dtype:?} row {r}");
            }
            // Every block size, on whichever kernels this CPU runs (the layout's kernel where the active variant
            // runs it, the rows otherwise): the same bits as the rows.
            for m in [1, 2, 3, 8, 9, 17, 40] {
                let x = random(m * k, 22 + m as u64);
                let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                lanes.matmul(&x, m, &mut a).unwrap();
                rows.matmul(&x, m, &mut b).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{dtype:?}, {m} rows");
            }
            // Shards come out in the rows' values.
            assert_eq!(
                lanes.select_rows(16..32).to_f32(),
                rows.select_rows(16..32).to_f32()
            );
            assert_eq!(
                lanes.gather_rows(&[0..16, 32..48]).to_f32(),
                rows.gather_rows(&[0..16, 32..48]).to_f32()
            );
            assert_eq!(
                lanes.select_cols(256..768).unwrap().to_f32(),
                rows.select_cols(256..768).unwrap().to_f32()
            );
        }
    }

    /// The K-quant row-group matmuls give the same bits in long runs of rows a thread and in L2-sized items
    /// ([`long_chunks`]), in the lanes layout and in rows (a row count that leaves a remainder for the panels).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn long_runs_of_rows_compute_what_short_items_do() {
        let k = 2 * 256;
        for (dtype, n, lanes) in [
            (GgmlDType::Q4K, 16 * 37, true),
            (GgmlDType::Q6K, 16 * 37, true),
            (GgmlDType::Q4K, 600, false),
        ] {
            let w = random(n * k, 31);
            let mat = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            let mat = match (mat, lanes) {
                (QMatrix::Q4K(m), true) => QMatrix::Q4KLanes(m.to_lanes()),
                (QMatrix::Q6K(m), true) => QMatrix::Q6KLanes(m.to_lanes()),
                (m, _) => m,
            };
            for m in [1, 3, 8, 20] {
                let x = random(m * k, 32 + m as u64);
                let outs = [true, false, true].map(|long| {
                    LONG_CHUNKS_IN_TEST.with(|c| c.set(Some(long)));
                    let mut out = vec![0f32; m * n];
                    mat.matmul(&x, m, &mut out).unwrap();
                    out.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
                });
                LONG_CHUNKS_IN_TEST.with(|c| c.set(None));
                assert!(
                    outs[0].iter().any(|&b| b != 0),
                    "{dtype:?}, {m} rows: computed"
                );
                assert_eq!(
                    outs[0], outs[1],
                    "{dtype:?}, {m} rows: long runs against short items"
                );
                assert_eq!(outs[0], outs[2], "{dtype:?}, {m} rows: long runs again");
            }
        }
    }

    /// [`drive`] lays every row of every chunk where it belongs, and what a chunk's work leaves unwritten is zero,
    /// in a buffer kept from an earlier call (dirty) as in a fresh one, and beyond the size it keeps.
    #[test]
    fn drive_lays_out_every_row_and_zeroes_what_the_work_leaves() {
        for (n, m, chunk) in [(1000, 3, 64), (37, 8, 5), (KEPT_RESULTS / 4 + 7, 5, 4096)] {
            for call in 0..2 {
                let mut out = vec![f32::NAN; n * m];
                let work = |c0: usize, dst: &mut [f32]| {
                    let cw = dst.len() / m;
                    for r in 0..m {
                        for j in (0..cw).filter(|j| !(c0 + j).is_multiple_of(3)) {
                            dst[r * cw + j] = (r * n + c0 + j) as f32;
                        }
                    }
                };
                drive(n, m, chunk, work, &mut out);
                for (i, v) in out.iter().enumerate() {
                    let want = if (i % n).is_multiple_of(3) {
                        0.0
                    } else {
                        i as f32
                    };
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{n} x {m} by {chunk} (call {call}): value {i}"
                    );
                }
            }
        }
        assert!(RESULTS.lock().unwrap().len() <= KEPT_BUFFERS);
    }

    /// The split follows the CPU (AMD before family 25: L2-sized items, others: long runs). The split leaves the
    /// bits as they are ([`long_runs_of_rows_compute_what_short_items_do`]).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn long_runs_follow_the_cpu() {
        assert_eq!(long_chunks(), long_chunks_by_cpu());
    }

    /// Cutting a matrix by rows or by whole blocks of columns computes the same products (rows: bitwise; columns:
    /// the partial products add up to the whole within rounding).
    #[test]
    fn row_and_column_shards_compute_the_whole_product() {
        let (n, k, m) = (24, 1024, 5);
        let w = random(n * k, 3);
        let x = random(m * k, 4);
        for dtype in [
            GgmlDType::F32,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let q = QMatrix::from_f32(dtype, n, k, &w).unwrap();
            let mut whole = vec![0f32; m * n];
            q.matmul(&x, m, &mut whole).unwrap();
            // Rows 8..16.
            let part = q.select_rows(8..16);
            let mut out = vec![0f32; m * 8];
            part.matmul(&x, m, &mut out).unwrap();
            for r in 0..m {
                assert_eq!(
                    &out[r * 8..(r + 1) * 8],
                    &whole[r * n + 8..r * n + 16],
                    "{dtype:?}"
                );
            }
            // Columns 0..512 and 512..1024.
            let mut sum = vec![0f32; m * n];
            for cols in [0..512, 512..1024] {
                let part = q.select_cols(cols.clone()).unwrap();
                let xs: Vec<f32> = (0..m)
                    .flat_map(|r| x[r * k + cols.start..r * k + cols.end].to_vec())
                    .collect();
                let mut out = vec![0f32; m * n];
                part.matmul(&xs, m, &mut out).unwrap();
                for (s, o) in sum.iter_mut().zip(out) {
                    *s += o;
                }
            }
            let diff = sum
                .iter()
                .zip(&whole)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-3, "{dtype:?}: column shards differ by {diff}");
        }
        let q = QMatrix::from_f32(GgmlDType::Q4K, n, k, &w).unwrap();
        assert!(q.select_cols(0..300).is_err());
    }
}
