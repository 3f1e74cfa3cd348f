//! The KV cache of the candle model: one pool per model, shared by all its sessions.
//!
//! The pool keeps sessions in capacity classes of 256, 512, 1024, ... tokens (the last class is the model's
//! context). Per class and layer it holds one K and one V tensor of `slots x kv_heads x capacity x head_dim` on the
//! model's device, and a session holds a slot of one class. The layout is head-major: the held tokens of a head are
//! one strided matrix, which q·Kᵀ and p·V read in place. The sessions of a class are one batch of such matrices,
//! so a pass attends for all of a class's sessions with one product per step
//! ([`super::layer`]'s batched attention), and writes their new rows with one scatter. There are no per-session
//! copies or kernel launches left in such a pass, which is what batching on a GPU needs.
//!
//! A block's keys and values are written in place after the tokens held; the length moves only when the whole
//! forward succeeded, so a failed forward leaves the cache as it was. Truncation is a length change (later blocks
//! overwrite what was dropped). A session that outgrows its class moves to the smallest class with room: its held
//! tokens are copied over, and its old slot is freed.
//!
//! Device memory:
//! - A session's slot holds at most twice the tokens it has held (one class up), as the per-session tensors this
//!   pool replaced did.
//! - A class grows by doubling its slots when they are all in use, and halves them when its upper half is free and
//!   at most a quarter is in use, so its tensors hold at most twice the slots of its busiest moment, and shrink as
//!   its sessions go (sessions keep their slots: a session in the upper half holds the class at that size).
//! - A class whose last session is released gives its memory back.
//!
//! Byte accounting ([`TensorCache::bytes`]) counts the tokens held, as the kernel model's cache does, so admission
//! is the same under both backends.

use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};
use crate::model::ModelConfig;

/// Tokens of the smallest capacity class.
const FIRST_CAPACITY: usize = 256;

/// Where a session's keys and values live: a slot of a capacity class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub class: usize,
    pub index: usize,
    /// Tokens the slot has room for (the class's capacity).
    pub capacity: usize,
}

/// One capacity class: per layer (K, V), each `slots x kv_heads x capacity x head_dim`.
#[derive(Debug, Default)]
struct Class {
    layers: Vec<(Tensor, Tensor)>,
    used: Vec<bool>,
}

impl Class {
    fn slots(&self) -> usize {
        self.used.len()
    }

    fn in_use(&self) -> usize {
        self.used.iter().filter(|&&u| u).count()
    }
}

/// The keys and values of every session of one model (see the module's text).
#[derive(Debug)]
pub struct KvPool {
    classes: Mutex<Vec<Class>>,
    device: Device,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    max_context: usize,
}

impl KvPool {
    pub(crate) fn new(cfg: &ModelConfig, device: &Device) -> Self {
        KvPool {
            classes: Mutex::new(Vec::new()),
            device: device.clone(),
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            max_context: cfg.max_context,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Class>> {
        // The pool's state is consistent between calls (every change is made whole or not at all), so a panic
        // elsewhere while it was held leaves nothing half done.
        self.classes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The capacity of class `c`: 256 tokens doubled `c` times, never past the context.
    fn capacity(&self, c: usize) -> usize {
        FIRST_CAPACITY
            .checked_shl(c as u32)
            .unwrap_or(usize::MAX)
            .min(self.max_context.max(1))
    }

    /// The smallest class with room for `total` tokens.
    fn class_for(&self, total: usize) -> usize {
        let mut c = 0;
        while self.capacity(c) < total && self.capacity(c) < self.max_context {
            c += 1;
        }
        c
    }

    /// Device bytes the pool's tensors take now (every class, free slots included).
    pub fn device_bytes(&self) -> usize {
        let per_token = self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4;
        self.lock()
            .iter()
            .enumerate()
            .map(|(c, class)| class.slots() * self.capacity(c) * per_token)
            .sum()
    }

    /// Slots in use, over every class.
    pub fn sessions(&self) -> usize {
        self.lock().iter().map(Class::in_use).sum()
    }

    /// Takes a free slot of class `c`, doubling the class's slots when none is free (the slots in use are copied
    /// over; a failed allocation leaves the class as it was).
    fn take(&self, c: usize) -> Result<Slot> {
        let capacity = self.capacity(c);
        let mut classes = self.lock();
        if classes.len() <= c {
            classes.resize_with(c + 1, Class::default);
        }
        let class = &mut classes[c];
        if let Some(index) = class.used.iter().position(|u| !u) {
            class.used[index] = true;
            return Ok(Slot {
                class: c,
                index,
                capacity,
            });
        }
        let old = class.slots();
        let slots = (old * 2).max(1);
        let shape = (slots, self.n_kv_heads, capacity, self.head_dim);
        let mut grown = Vec::with_capacity(self.n_layers);
        for li in 0..self.n_layers {
            let k = Tensor::zeros(shape, DType::F32, &self.device)?;
            let v = Tensor::zeros(shape, DType::F32, &self.device)?;
            if let Some((ok, ov)) = class.layers.get(li) {
                k.slice_set(ok, 0, 0)?;
                v.slice_set(ov, 0, 0)?;
            }
            grown.push((k, v));
        }
        class.layers = grown;
        class.used.resize(slots, false);
        class.used[old] = true;
        Ok(Slot {
            class: c,
            index: old,
            capacity,
        })
    }

    /// Frees a slot. A class left with no session gives its tensors back; one whose upper half of slots is free
    /// and at most a quarter in use halves its tensors (again while that holds), so a class shrinks as its sessions
    /// go, not only when the last one does. Halving copies the lower half; if that copy fails the class stays as
    /// it was.
    fn free(&self, slot: Slot) {
        let mut classes = self.lock();
        let Some(class) = classes.get_mut(slot.class) else {
            return;
        };
        if let Some(u) = class.used.get_mut(slot.index) {
            *u = false;
        }
        if class.in_use() == 0 {
            *class = Class::default();
            return;
        }
        loop {
            let slots = class.slots();
            let half = slots / 2;
            if half == 0 || class.in_use() * 4 > slots || class.used[half..].iter().any(|&u| u) {
                return;
            }
            let lower = |t: &Tensor| t.narrow(0, 0, half).and_then(|t| t.copy());
            let shrunk: candle_core::Result<Vec<(Tensor, Tensor)>> = class
                .layers
                .iter()
                .map(|(k, v)| Ok((lower(k)?, lower(v)?)))
                .collect();
            match shrunk {
                Ok(layers) => {
                    class.layers = layers;
                    class.used.truncate(half);
                }
                Err(e) => {
                    tracing::warn!("KV pool: a class kept its slots, halving failed: {e}");
                    return;
                }
            }
        }
    }

    /// Holds the pool still for a pass: while the returned guard lives, no class grows, shrinks or is given back
    /// (a session's room is reserved before, and a session dropped on another thread waits), so the tensors the
    /// pass reads and writes stay the pool's. Passes of one model take turns.
    pub(crate) fn hold(&self) -> PoolHold<'_> {
        PoolHold {
            classes: self.lock(),
            n_layers: self.n_layers,
        }
    }

    /// Copies the first `len` tokens of every layer from slot `from` to slot `to` (of another class).
    fn copy(&self, from: Slot, to: Slot, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let classes = self.lock();
        let (src, dst) = match (classes.get(from.class), classes.get(to.class)) {
            (Some(s), Some(d)) => (s, d),
            _ => {
                return Err(Error::invalid(
                    "KV pool copy between classes it does not hold",
                ));
            }
        };
        for ((sk, sv), (dk, dv)) in src.layers.iter().zip(&dst.layers) {
            for (s, d) in [(sk, dk), (sv, dv)] {
                let held = s
                    .narrow(0, from.index, 1)?
                    .narrow(2, 0, len)?
                    .contiguous()?;
                d.narrow(0, to.index, 1)?.slice_set(&held, 2, 0)?;
            }
        }
        Ok(())
    }
}

/// The pool held still for a pass ([`KvPool::hold`]).
pub(crate) struct PoolHold<'a> {
    classes: MutexGuard<'a, Vec<Class>>,
    n_layers: usize,
}

impl PoolHold<'_> {
    /// Per layer, the (K, V) tensors of class `c`: handles onto the pool's storage, so writes through them land in
    /// the pool.
    pub(crate) fn class_layers(&self, c: usize) -> Result<Vec<(Tensor, Tensor)>> {
        self.classes
            .get(c)
            .filter(|class| class.layers.len() == self.n_layers)
            .map(|class| class.layers.clone())
            .ok_or_else(|| {
                Error::invalid("KV pool class read before any session took a slot in it")
            })
    }
}

/// One session's keys and values: a slot of its model's [`KvPool`]. Not `Clone`: the slot is the session's own
/// and is freed when the cache is dropped.
#[derive(Debug)]
pub struct TensorCache {
    pool: Arc<KvPool>,
    slot: Option<Slot>,
    len: usize,
    bytes_per_token: usize,
}

impl Drop for TensorCache {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.free(slot);
        }
    }
}

impl TensorCache {
    pub(crate) fn new(cfg: &ModelConfig, pool: Arc<KvPool>) -> Self {
        TensorCache {
            pool,
            slot: None,
            len: 0,
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

    /// Tokens the session's slot has room for.
    pub fn capacity(&self) -> usize {
        self.slot.map_or(0, |s| s.capacity)
    }

    /// Whether the cache belongs to this pool (was made by the model that owns it).
    pub(crate) fn belongs_to(&self, pool: &Arc<KvPool>) -> bool {
        Arc::ptr_eq(&self.pool, pool)
    }

    pub(crate) fn slot(&self) -> Option<Slot> {
        self.slot
    }

    /// Keeps the first `n` tokens (no-op when `n >= len`).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Makes room for `total` tokens, keeping the `len` held: a slot of the smallest class with room, the held
    /// tokens copied over from the old one. On error the cache keeps its old slot.
    pub(crate) fn reserve(&mut self, total: usize) -> Result<()> {
        if total <= self.capacity() {
            return Ok(());
        }
        let c = self.pool.class_for(total);
        let to = self.pool.take(c)?;
        if to.capacity < total {
            self.pool.free(to);
            return Err(Error::invalid(format!(
                "KV cache asked for {total} tokens, past the context of {}",
                self.pool.max_context
            )));
        }
        if let Some(from) = self.slot {
            if let Err(e) = self.pool.copy(from, to, self.len) {
                self.pool.free(to);
                return Err(e);
            }
            self.pool.free(from);
        }
        self.slot = Some(to);
        Ok(())
    }

    /// Takes in the `rows` tokens a successful forward wrote.
    pub(crate) fn commit(&mut self, rows: usize) {
        self.len += rows;
    }
}
