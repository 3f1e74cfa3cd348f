//! The model an engine runs, whichever implementation computes it: the CPU kernel model ([`Model`]) or the model
//! on candle tensors ([`CandleModel`], CPU or CUDA), with the session cache each keeps. Sessions, backends and
//! workers see one contract; which one runs is the worker's `--backend` / `--device`.

use crate::candle::{Backend, CandleModel, Compute, DeviceSpec, TensorCache};
use crate::error::{Error, Result};
use crate::model::{KvCache, Logits, Model, ModelConfig, Packed, ShardInfo};
use parse_core::mask::BlockMask;

/// A loaded model on one of the engine's implementations.
// One per engine, behind an `Arc`: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Net {
    Kernels(Model),
    Candle {
        model: CandleModel,
        device: DeviceSpec,
    },
}

/// One session's KV cache, of the kind its engine's model keeps.
#[derive(Debug)]
pub enum SessionCache {
    Kernels(KvCache),
    Candle(TensorCache),
}

impl SessionCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        match self {
            SessionCache::Kernels(c) => c.len(),
            SessionCache::Candle(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of K and V the tokens held take.
    pub fn bytes(&self) -> usize {
        match self {
            SessionCache::Kernels(c) => c.bytes(),
            SessionCache::Candle(c) => c.bytes(),
        }
    }

    fn as_kernels(&mut self) -> Option<&mut KvCache> {
        match self {
            SessionCache::Kernels(c) => Some(c),
            SessionCache::Candle(_) => None,
        }
    }

    fn as_candle(&mut self) -> Option<&mut TensorCache> {
        match self {
            SessionCache::Candle(c) => Some(c),
            SessionCache::Kernels(_) => None,
        }
    }

    /// A copy of the first `n` tokens, where the cache's kind can be copied: the kernels' caches can; the candle
    /// backend's live in its device pool's slots and are not copied (`None`).
    pub fn prefix(&self, n: usize) -> Option<SessionCache> {
        match self {
            SessionCache::Kernels(c) => Some(SessionCache::Kernels(c.prefix(n))),
            SessionCache::Candle(_) => None,
        }
    }

    /// Keeps the first `n` tokens (no-op when `n >= len`).
    pub fn truncate(&mut self, n: usize) {
        match self {
            SessionCache::Kernels(c) => c.truncate(n),
            SessionCache::Candle(c) => c.truncate(n),
        }
    }
}

fn other_backend() -> Error {
    Error::invalid("KV cache was made for another backend")
}

/// The packed blocks with their caches as the kind `pick` takes, or the other-backend error.
fn caches_as<'s, C>(
    items: &'s mut [Packed<'_, SessionCache>],
    pick: fn(&mut SessionCache) -> Option<&mut C>,
) -> Result<Vec<Packed<'s, C>>> {
    items
        .iter_mut()
        .map(|it| {
            Ok(Packed {
                cache: pick(&mut *it.cache).ok_or_else(other_backend)?,
                tokens: it.tokens,
                positions: it.positions,
                mask: it.mask,
                readout: it.readout,
            })
        })
        .collect()
}

impl From<Model> for Net {
    fn from(m: Model) -> Self {
        Net::Kernels(m)
    }
}

impl Net {
    /// Puts a loaded kernel model where `compute` says: kept as it is for the kernels backend, uploaded to the
    /// device for candle (the host copy is then dropped).
    pub fn place(model: Model, compute: Compute) -> Result<Self> {
        match compute.backend {
            Backend::Kernels => {
                if compute.device != DeviceSpec::Cpu {
                    return Err(Error::invalid(format!(
                        "the kernels backend computes on the CPU, not {}",
                        compute.device
                    )));
                }
                Ok(Net::Kernels(model))
            }
            Backend::Candle => {
                let device = compute.device.open()?;
                Ok(Net::Candle {
                    model: CandleModel::from_model(&model, &device)?,
                    device: compute.device,
                })
            }
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Net::Kernels(m) => m.config(),
            Net::Candle { model, .. } => model.config(),
        }
    }

    /// Which implementation computes, and where.
    pub fn compute(&self) -> Compute {
        match self {
            Net::Kernels(_) => Compute::default(),
            Net::Candle { device, .. } => Compute {
                backend: Backend::Candle,
                device: *device,
            },
        }
    }

    /// The kernel model, when that is what runs.
    pub fn kernels(&self) -> Option<&Model> {
        match self {
            Net::Kernels(m) => Some(m),
            Net::Candle { .. } => None,
        }
    }

    /// The tensor-parallel shard this model is, if it is one (kernel models only).
    pub fn shard_of(&self) -> Option<&ShardInfo> {
        self.kernels().and_then(Model::shard_of)
    }

    /// Bytes of weight storage.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Net::Kernels(m) => m.weight_bytes(),
            Net::Candle { model, .. } => model.weight_bytes(),
        }
    }

    /// Device bytes the sessions' keys and values take as allocated, where that differs from the bytes they hold:
    /// the candle backend's KV pool, free slots and room included. `None` for the kernel model, whose caches
    /// allocate what they hold.
    pub fn kv_device_bytes(&self) -> Option<usize> {
        match self {
            Net::Kernels(_) => None,
            Net::Candle { model, .. } => Some(model.kv_pool().device_bytes()),
        }
    }

    /// An empty session cache.
    pub fn new_cache(&self) -> SessionCache {
        match self {
            Net::Kernels(m) => SessionCache::Kernels(KvCache::new(m.config())),
            Net::Candle { model, .. } => SessionCache::Candle(model.new_cache()),
        }
    }

    /// Every check `forward` makes before touching the cache.
    pub fn check_block(
        &self,
        cache: &SessionCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<()> {
        match (self, cache) {
            (Net::Kernels(m), SessionCache::Kernels(c)) => {
                m.check_block(c, tokens, positions, mask, readout)
            }
            (Net::Candle { model, .. }, SessionCache::Candle(c)) => {
                model.check_block(c, tokens, positions, mask, readout)
            }
            _ => Err(other_backend()),
        }
    }

    /// One block on one cache (see [`Model::forward`]).
    pub fn forward(
        &self,
        cache: &mut SessionCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        match (self, cache) {
            (Net::Kernels(m), SessionCache::Kernels(c)) => {
                m.forward(c, tokens, positions, mask, readout)
            }
            (Net::Candle { model, .. }, SessionCache::Candle(c)) => {
                model.forward(c, tokens, positions, mask, readout)
            }
            _ => Err(other_backend()),
        }
    }

    /// The blocks of several sessions in one pass (see [`Model::forward_packed`]).
    pub fn forward_packed(&self, items: &mut [Packed<'_, SessionCache>]) -> Result<Vec<Logits>> {
        match self {
            Net::Kernels(m) => m.forward_packed(&mut caches_as(items, SessionCache::as_kernels)?),
            Net::Candle { model, .. } => {
                model.forward_packed(&mut caches_as(items, SessionCache::as_candle)?)
            }
        }
    }
}
