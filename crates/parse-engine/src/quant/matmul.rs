//! How a matrix multiplies a block of rows: the layout a format takes at load, the panels, row groups and AMX tiles a
//! block goes to, the activations quantized once per input, and the split of the work among threads.

use candle_core::quantized::GgmlDType;
use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};
use rayon::prelude::*;

use super::*;

/// Whether a matrix of `format` with `rows` rows takes the lanes layout at load ([`QMatrix::into_fast_cpu_format`]):
/// Q4_K and Q5_0 wherever the AVX2 or the AVX-512 VNNI kernels are active (Q4_K: the VNNI row groups, on AMX machines
/// the tiles, or the AVX2 kernel read the one layout; Q5_0: each family reads a layout of its own, [`Q5_0Tiles`]),
/// Q6_K only where the VNNI row groups are the active kernels (the AMX tiles read Q6_K in rows).
pub(super) fn lanes_wanted(format: GgmlDType, rows: usize) -> bool {
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
pub(super) type Panel<T, X> = fn(kernels::Kernels, &[T], usize, &[X], &mut [f32], usize);

/// Runs `panel` over the weight rows `wc` (whole rows of `kb` blocks) and every activation row, in tiles of
/// [`kernels::TILE_ROWS`]: `dst[r * stride + c]` for the tile's rows `r` and the weight rows `c` of `wc`.
pub(super) fn run_panels<T, X>(
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
pub(super) fn matmul_panels<T: GgmlType, X: Sync>(
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
pub(super) fn matmul_k<'a, T: GgmlType<VecDotType = BlockQ8K>>(
    mat: &Mat<T>,
    input: &'a Input<'_>,
    out: &mut [f32],
    panel: Panel<T, &'a [BlockQ8K]>,
) {
    let rows: Vec<&[BlockQ8K]> = input.q8k().chunks(mat.blocks_per_row()).collect();
    matmul_panels(mat, &rows, out, panel);
}

/// Matmul of a Q8_0 or Q5_0 matrix (Q8_0-rounded activations).
pub(super) fn matmul_32<'a, T: GgmlType>(
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
pub(super) type AmxGroups<T> = unsafe fn(&[T], usize, &kernels::amx::Acts, &mut [f32], usize);

/// The row-group function of a K-quant format ([`kernels::groups`]).
#[cfg(target_arch = "x86_64")]
pub(super) type RowGroups<T> = unsafe fn(&[T], usize, &[&[BlockQ8K]], &mut [f32], usize);

/// Work items per thread of a K-quant row-group matmul in long runs ([`long_chunks`]).
#[cfg(target_arch = "x86_64")]
pub(super) const LONG_CHUNKS_PER_THREAD: usize = 2;

#[cfg(all(test, target_arch = "x86_64"))]
thread_local! {
    /// The split a test asks of the K-quant matmuls called on its thread, in place of the CPU's.
    pub(super) static LONG_CHUNKS_IN_TEST: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
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
pub(super) fn long_chunks() -> bool {
    #[cfg(test)]
    if let Some(long) = LONG_CHUNKS_IN_TEST.with(|c| c.get()) {
        return long;
    }
    static BY_CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BY_CPU.get_or_init(long_chunks_by_cpu)
}

/// [`long_chunks`]'s default on this CPU: off on AMD CPUs before family 25, on elsewhere.
#[cfg(target_arch = "x86_64")]
pub(super) fn long_chunks_by_cpu() -> bool {
    !(kernels::amd_cpu() && kernels::cpu_family() < 25)
}

/// Matmul of a block of rows through a kernel of 16 weight rows at a time: `groups(w, rows, dst, stride)` takes
/// whole 16-row groups of a chunk's columns (`rows`: the activation rows), the panels (the same arithmetic) any
/// remaining columns. With `long`, each thread takes [`LONG_CHUNKS_PER_THREAD`] runs of rows ([`long_chunks`]);
/// otherwise L2-sized items ([`column_chunk`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn matmul_16<T: GgmlType, X: Sync>(
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
pub(super) fn matmul_k_16<'a, T: GgmlType<VecDotType = BlockQ8K>>(
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
pub(super) type Groups32<T> = unsafe fn(&[T], usize, &[kernels::Act32Row<'_>], &mut [f32], usize);

/// Q5_0 or Q8_0 matmul of a block of rows through its row-group kernel ([`matmul_16`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn matmul_32_groups<'a, T: GgmlType>(
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
pub(super) fn matmul_k_amx<'a, T: GgmlType<VecDotType = BlockQ8K>>(
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
pub(super) fn matmul_k_groups<'a, T: GgmlType<VecDotType = BlockQ8K>>(
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
    pub(super) x: &'a [f32],
    pub(super) m: usize,
    pub(super) k: usize,
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
pub(super) fn quantize_rows<T: GgmlType>(x: &[f32], k: usize, m: usize) -> Vec<T::VecDotType> {
    let kb = k / T::BLCK_SIZE;
    let mut xq = vec![T::VecDotType::zeros(); m * kb];
    for (dst, src) in xq.chunks_mut(kb).zip(x.chunks(k)) {
        T::VecDotType::from_float(src, dst);
    }
    xq
}

/// Output columns per work item: a multiple of 4 (no quad straddles two workers), enough items to balance the
/// threads, and few enough weight bytes per item to stay in L2 while every row tile passes over them.
pub(super) fn column_chunk(n: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = n / (threads * 8);
    let by_cache = (256 << 10) / row_bytes.max(1);
    (by_balance.min(by_cache).max(4) / 4 * 4).min(256)
}

/// The largest chunk-results buffer [`drive`] keeps between calls, in values (8 MB: a block of 13 rows of the
/// 151,936-wide output matrix of the default target; larger ones are allocated each time), and how many it keeps
/// (calls at once in a process; one more allocates its own).
pub(super) const KEPT_RESULTS: usize = 2 << 20;
pub(super) const KEPT_BUFFERS: usize = 2;

/// [`drive`]'s chunk-results buffers, kept for later calls.
pub(super) static RESULTS: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// Runs `work(first_column, dst)` over column chunks in parallel and lays the results out row-major in `out`.
/// `dst` holds the chunk's `cw` columns row-major (`dst[r * cw + (c - first_column)]`, `cw = dst.len() / m`), zeroed,
/// so each row of a chunk lands in `out` as one contiguous copy. With several rows, the chunks' results go to a
/// buffer kept from call to call ([`KEPT_RESULTS`]), each chunk zeroing its own part in parallel, and the rows of
/// `out` are laid out in parallel too, so that no thread waits while the caller zeroes and copies.
pub(super) fn drive(
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
