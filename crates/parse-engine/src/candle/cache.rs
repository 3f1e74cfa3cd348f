//! The KV cache of the candle model: per layer, one preallocated K and one V tensor of `kv_heads x capacity x
//! head_dim` on the model's device (head-major: the held tokens of a head are one strided matrix, which q·Kᵀ and
//! p·V read in place, with no copy per step). A block's keys and values are written in place after the tokens held; the
//! length moves only when the whole forward succeeded, so a failed forward leaves the cache as it was. Truncation
//! is a length change (later blocks overwrite what was dropped).
//!
//! Capacity grows by doubling (from 256 tokens, never past the model's context), so a session's device memory is at
//! most twice the most it has held (truncation keeps the room; release frees it). Byte accounting
//! ([`TensorCache::bytes`]) counts the tokens held, as the kernel model's cache does, so admission is the same under
//! both backends.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::model::ModelConfig;

/// Tokens a cache holds room for when it is first written.
const FIRST_CAPACITY: usize = 256;

/// One session's keys and values on the device. Not `Clone`: a clone of a tensor shares its storage, and the cache
/// writes into its tensors in place.
#[derive(Debug)]
pub struct TensorCache {
    /// Per layer: (K, V), each `kv_heads x capacity x head_dim`; empty until the first block.
    layers: Vec<Option<(Tensor, Tensor)>>,
    capacity: usize,
    len: usize,
    n_kv_heads: usize,
    head_dim: usize,
    max_context: usize,
    bytes_per_token: usize,
}

impl TensorCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        TensorCache {
            layers: vec![None; cfg.n_layers],
            capacity: 0,
            len: 0,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            max_context: cfg.max_context,
            bytes_per_token: cfg.kv_bytes_per_token(),
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of K and V the tokens held take (the allocation may be larger: see the module's text).
    pub fn bytes(&self) -> usize {
        self.len * self.bytes_per_token
    }

    /// Tokens the tensors have room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the cache was made for a model of this shape.
    pub fn fits(&self, cfg: &ModelConfig) -> bool {
        self.layers.len() == cfg.n_layers
            && self.n_kv_heads == cfg.n_kv_heads
            && self.head_dim == cfg.head_dim
    }

    /// Keeps the first `n` tokens (no-op when `n >= len`).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Makes room for `total` tokens, keeping the `len` held.
    pub(crate) fn reserve(&mut self, total: usize, device: &Device) -> Result<()> {
        if total <= self.capacity {
            return Ok(());
        }
        let mut cap = self.capacity.max(FIRST_CAPACITY);
        while cap < total {
            cap *= 2;
        }
        let cap = cap.min(self.max_context.max(total));
        let shape = (self.n_kv_heads, cap, self.head_dim);
        let mut grown = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let k = Tensor::zeros(shape, DType::F32, device)?;
            let v = Tensor::zeros(shape, DType::F32, device)?;
            if let (Some((ok, ov)), true) = (layer, self.len > 0) {
                k.slice_set(&ok.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                v.slice_set(&ov.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            }
            grown.push(Some((k, v)));
        }
        self.layers = grown;
        self.capacity = cap;
        Ok(())
    }

    /// Writes a block's keys and values (`rows x kv_heads x head_dim`) of layer `li` after the `len` held, and
    /// returns the layer's keys and values of the held tokens and the block (`kv_heads x (len + rows) x head_dim`
    /// views into the cache). The length itself moves only with [`TensorCache::commit`].
    pub(crate) fn write(&self, li: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let rows = k.dim(0)?;
        let k = k.transpose(0, 1)?.contiguous()?;
        let v = v.transpose(0, 1)?.contiguous()?;
        if self.len + rows > self.capacity {
            return Err(Error::invalid("KV cache written past its reserved room"));
        }
        let (kc, vc) = self.layers[li]
            .as_ref()
            .ok_or_else(|| Error::invalid("KV cache written before room was reserved"))?;
        kc.slice_set(&k, 1, self.len)?;
        vc.slice_set(&v, 1, self.len)?;
        let total = self.len + rows;
        Ok((kc.narrow(1, 0, total)?, vc.narrow(1, 0, total)?))
    }

    /// Takes in the `rows` tokens a successful forward wrote.
    pub(crate) fn commit(&mut self, rows: usize) {
        self.len += rows;
    }
}
