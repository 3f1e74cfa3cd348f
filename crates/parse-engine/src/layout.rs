//! The weight layouts the kernels read, below both the kernels and the matrices that hold them: the lanes layout of
//! K-quant weights (16 rows' words side by side), Q5_0's two lanes layouts, and the conversions back to rows. The
//! same bytes permuted: a matrix in a lanes layout computes the same bits as in rows (tested in `quant`).

use candle_core::quantized::k_quants::{BlockQ5_0, GgmlType};

/// The lanes layout of K-quant weights (`w`: whole rows of `kb` super-blocks, a multiple of 16 rows): the same
/// bytes, permuted so that tile `(g, b)` (super-blocks `(g * kb + b) * 16..+16`) holds super-block `b` of rows
/// `16g..16g + 16` word by word, word `i` of row `16g + n` at byte `64 i + 4 n` of the tile (Q6_K: `64 s + 4 n`, `s`
/// the word's slot by [`Q6K_RUN_SLOTS`]), and a block's last two
/// bytes where its size is not a multiple of 4 (Q6_K's `d`: 210 bytes) at `64 w + 2 n` after its `w` whole words.
/// One 64-byte load is then a word of all 16 rows, one row per 32-bit lane, which the row groups
/// ([`crate::kernels::groups`]) would otherwise gather from 16 rows and transpose at every step. See
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
pub(crate) const Q6K_BLOCK: usize = 210;

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
pub(crate) fn lane_runs(block: usize, n: usize) -> impl Iterator<Item = (usize, usize, usize)> {
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
pub(crate) fn block_bytes<T: GgmlType>(w: &[T]) -> &[u8] {
    // SAFETY: the ggml block types are #[repr(C)] plain-old-data; the view spans exactly the slice's storage.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), std::mem::size_of_val(w)) }
}

/// The blocks of `w` as bytes to write (a copy's, to permute into).
#[allow(unsafe_code)]
pub(crate) fn block_bytes_mut<T: GgmlType>(w: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `block_bytes`; every bit pattern is a valid block, so any bytes written leave valid blocks.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(w)) }
}

pub(crate) fn permute_lanes<T: GgmlType>(w: &[T], kb: usize, to_lanes: bool) -> Vec<T> {
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
pub(crate) fn lanes_row<T: GgmlType>(w: &[T], kb: usize, r: usize) -> Vec<T> {
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
pub(crate) const Q5_0_BLOCK: usize = 22;

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

pub(crate) fn q5_0_permute(
    w: &[BlockQ5_0],
    kb: usize,
    tiles: Q5_0Tiles,
    to_lanes: bool,
) -> Vec<BlockQ5_0> {
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
pub(crate) fn q5_0_lanes_row(
    w: &[BlockQ5_0],
    kb: usize,
    r: usize,
    tiles: Q5_0Tiles,
) -> Vec<BlockQ5_0> {
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
