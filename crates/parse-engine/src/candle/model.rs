//! The candle model: embedding by row gather from the (quantized) table, the layers, and logits only at the readout
//! rows. Built from a loaded kernel model's weights, so both backends read the same file the same way and compute
//! from the same numbers.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::{Logits, Model, ModelConfig, Packed};
use crate::ops::RopeStyle;

use super::cache::{KvPool, TensorCache};
use super::layer::{self, Batch, Layer, PassKv, Rotary, Rows};

/// A model whose weights live on a candle device.
pub struct CandleModel {
    cfg: ModelConfig,
    device: Device,
    embed: Arc<QTensor>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QMatMul,
    inv_freq: Vec<f32>,
    neox: bool,
    weight_bytes: usize,
    /// The keys and values of every session of this model ([`KvPool`]).
    pool: Arc<KvPool>,
    /// Passes in which every session brings the same number of rows attend by capacity class, one product per
    /// step for all of a class's sessions ([`Batch`]); else session by session. On by default on CUDA devices,
    /// where per-session attention is bound by kernel launches.
    batched: bool,
}

impl std::fmt::Debug for CandleModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleModel")
            .field("cfg", &self.cfg)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl CandleModel {
    /// Uploads a kernel model's weights to `device` in their own formats. A tensor-parallel shard is refused: on
    /// this backend a model runs whole on one device.
    pub fn from_model(model: &Model, device: &Device) -> Result<Self> {
        if model.shard_of().is_some() {
            return Err(Error::invalid(
                "the candle backend runs whole models; tensor-parallel shards run on the kernels backend",
            ));
        }
        let cfg = model.config().clone();
        let w = model.weights();
        let embed = Arc::new(layer::upload(&w.embed, device)?);
        let lm_head = match &w.lm_head {
            Some(h) => layer::matmul(h, device)?,
            // Tied: the head reads the embedding table itself, not a copy.
            None => QMatMul::from_arc(embed.clone())?,
        };
        let layers = w
            .layers
            .iter()
            .map(|l| Layer::upload(l, device))
            .collect::<Result<Vec<_>>>()?;
        let hd = cfg.head_dim;
        let inv_freq = (0..hd / 2)
            .map(|i| 1.0 / (cfg.rope_theta as f64).powf(2.0 * i as f64 / hd as f64) as f32)
            .collect();
        Ok(CandleModel {
            pool: Arc::new(KvPool::new(&cfg, device)),
            neox: cfg.rope_style == RopeStyle::Neox,
            norm: layer::vector(&w.norm, device)?,
            weight_bytes: model.weight_bytes(),
            cfg,
            device: device.clone(),
            embed,
            layers,
            lm_head,
            inv_freq,
            batched: device.is_cuda(),
        })
    }

    /// Whether passes of several sessions with the same number of rows each (decode steps, verification blocks
    /// of one length) attend in one batch per capacity class (the default on CUDA) or session by session (the
    /// default elsewhere). The results agree to rounding either way.
    pub fn set_batched_decode(&mut self, on: bool) {
        self.batched = on;
    }

    /// The pool holding every session's keys and values.
    pub fn kv_pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weight storage (as stored in the file's formats).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// An empty cache for a session.
    pub fn new_cache(&self) -> TensorCache {
        TensorCache::new(&self.cfg, self.pool.clone())
    }

    /// Every check `forward` makes before touching the cache.
    pub fn check_block(
        &self,
        cache: &TensorCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &parse_core::mask::BlockMask,
        readout: &[usize],
    ) -> Result<()> {
        self.cfg
            .check_block(cache.len(), tokens, positions, mask, readout)?;
        if !cache.belongs_to(&self.pool) {
            return Err(Error::invalid("KV cache was made for another model"));
        }
        Ok(())
    }

    /// Runs one block on one cache (see [`Model::forward`]).
    pub fn forward(
        &self,
        cache: &mut TensorCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &parse_core::mask::BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        let mut items = [Packed {
            cache,
            tokens,
            positions,
            mask,
            readout,
        }];
        let mut out = self.forward_packed(&mut items)?;
        out.pop()
            .ok_or_else(|| Error::invalid("a packed forward returned no logits"))
    }

    /// The blocks of several sessions in one pass (see [`Model::forward_packed`]): every matmul sees all rows;
    /// each row attends only to its own session's keys and values under its own mask, in batches of sessions with
    /// the same row count and capacity class where batching is on ([`Batch`]), else session by session. Every
    /// block is checked first; on any error no cache's length changes.
    pub fn forward_packed(&self, items: &mut [Packed<'_, TensorCache>]) -> Result<Vec<Logits>> {
        for it in items.iter() {
            self.check_block(it.cache, it.tokens, it.positions, it.mask, it.readout)?;
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let dev = &self.device;
        for it in items.iter_mut() {
            let total = it.cache.len() + it.tokens.len();
            it.cache.reserve(total)?;
        }
        let tokens: Vec<u32> = items
            .iter()
            .flat_map(|it| it.tokens.iter().copied())
            .collect();
        let positions: Vec<u32> = items
            .iter()
            .flat_map(|it| it.positions.iter().copied())
            .collect();
        let n = tokens.len();
        let ids = Tensor::from_vec(tokens, n, dev)?;
        let mut x = self.embed.embedding(&ids)?.to_dtype(DType::F32)?;
        let (cos, sin) = self.rotary(&positions)?;
        let rotary = Rotary {
            cos,
            sin,
            neox: self.neox,
        };
        let mut sessions = Vec::with_capacity(items.len());
        let mut start = 0;
        for it in items.iter() {
            let rows = it.tokens.len();
            sessions.push(Rows {
                start,
                rows,
                held: it.cache.len(),
                slot: it
                    .cache
                    .slot()
                    .ok_or_else(|| Error::invalid("a session's block found no room reserved"))?,
                mask: None,
            });
            start += rows;
        }
        // No class of the pool grows, shrinks or goes away until the layers are done (see `KvPool::hold`).
        let hold = self.pool.hold();
        let kv = PassKv::take(&hold, sessions.iter().map(|s| s.slot))?;
        let batch = (self.batched && items.len() > 1)
            .then(|| {
                let masks: Vec<_> = items.iter().map(|it| it.mask).collect();
                Batch::plan(
                    &sessions,
                    &masks,
                    self.cfg.head_dim,
                    self.cfg.n_kv_heads,
                    dev,
                )
            })
            .transpose()?;
        // Sessions that attend one by one carry their own dense masks.
        let singles: Vec<usize> = match &batch {
            Some(b) => b.singles().to_vec(),
            None => (0..items.len()).collect(),
        };
        for i in singles {
            sessions[i].mask = Some(layer::dense_mask(items[i].mask, sessions[i].held, dev)?);
        }
        for (li, l) in self.layers.iter().enumerate() {
            x = l.forward(&self.cfg, li, &x, &rotary, &sessions, &kv, batch.as_ref())?;
        }
        drop((kv, hold));
        let mut readout = Vec::new();
        let mut offset = 0;
        for it in items.iter() {
            readout.extend(it.readout.iter().map(|r| (offset + r) as u32));
            offset += it.tokens.len();
        }
        let all = self.readout(&x, readout)?;
        let vocab = self.cfg.vocab_size;
        let mut out = Vec::with_capacity(items.len());
        let mut data = all.as_slice();
        for it in items.iter() {
            let (mine, rest) = data.split_at(it.readout.len() * vocab);
            out.push(Logits::from_rows(vocab, mine.to_vec())?);
            data = rest;
        }
        // Only now, with every step done, do the caches take in their blocks.
        for it in items.iter_mut() {
            it.cache.commit(it.tokens.len());
        }
        Ok(out)
    }

    /// cos and sin of every row's rotary angles, `n x head_dim/2`, computed as the kernel model computes them.
    fn rotary(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let shape = (positions.len(), half);
        Ok((
            Tensor::from_vec(cos, shape, &self.device)?,
            Tensor::from_vec(sin, shape, &self.device)?,
        ))
    }

    /// Final norm and output head at the readout rows only; the logits come back to the host.
    fn readout(&self, x: &Tensor, rows: Vec<u32>) -> Result<Vec<f32>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let r = rows.len();
        let idx = Tensor::from_vec(rows, r, &self.device)?;
        let sel = x.index_select(&idx, 0)?;
        let normed = candle_nn::ops::rms_norm(&sel, &self.norm, self.cfg.rms_eps)?;
        let logits = self.lm_head.forward(&normed)?;
        Ok(logits
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }
}
