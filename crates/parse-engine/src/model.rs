//! The decoder-only transformer of the qwen2 and llama families, with a packed-block forward.
//!
//! `forward` takes a block of new tokens with explicit positions and a compact mask over
//! `[cached keys | block keys]`, appends the block's keys and values to the session's [`KvCache`] and returns
//! logits only at the requested readout rows (the output head is the largest matrix: rows nobody reads are never
//! multiplied by it). Layout follows the checkpoints: Config / KvCache / Layer / Model.

use crate::error::{Error, Result};
use crate::ops::{self, AttnShape, Rope, RopeStyle};
use crate::parallel::{Layout, Linear, Split};
use crate::quant::{Input, QMatrix};
use candle_core::quantized::GgmlDType;
use parse_core::mask::BlockMask;

/// Model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen2 / Qwen2.5: q/k/v biases, NEOX rotary.
    Qwen2,
    /// Llama, SmolLM2, Mistral-style: no biases.
    Llama,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "qwen2" => Ok(Arch::Qwen2),
            "llama" | "mistral" => Ok(Arch::Llama),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }
}

/// A configuration whose dimensions do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::InvalidInput(e.0)
    }
}

/// Hyper-parameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub max_context: usize,
}

impl ModelConfig {
    /// Checks the relations between dimensions that the forward relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("max_context", self.max_context),
        ];
        if let Some((name, _)) = nonzero.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError(format!("{name} is zero")));
        }
        // Ceilings far above any model served, so that a damaged file cannot size buffers (rotary tables, caches)
        // beyond memory before its tensors are read.
        let ceilings = [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1 << 18),
            ("n_layers", self.n_layers, 1 << 10),
            ("n_heads", self.n_heads, 1 << 10),
            ("n_kv_heads", self.n_kv_heads, 1 << 10),
            ("head_dim", self.head_dim, 1 << 10),
            ("max_context", self.max_context, 1 << 20),
        ];
        if let Some((name, v, max)) = ceilings.iter().find(|(_, v, max)| v > max) {
            return Err(ConfigError(format!("{name} {v} is above {max}")));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(ConfigError(format!(
                "{} attention heads do not divide into {} KV heads",
                self.n_heads, self.n_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError(format!("head_dim {} is odd", self.head_dim)));
        }
        Ok(())
    }

    /// The checks every model implementation makes on a block before it touches a cache holding `base` tokens:
    /// a non-empty block, one position per token, token ids in the vocabulary, readout rows in the block, room in
    /// the context, and a mask that fits.
    pub fn check_block(
        &self,
        base: usize,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::invalid("empty block: no tokens to process"));
        }
        if positions.len() != n {
            return Err(Error::invalid(format!(
                "{n} tokens but {} positions",
                positions.len()
            )));
        }
        if let Some(t) = tokens.iter().find(|t| **t as usize >= self.vocab_size) {
            return Err(Error::invalid(format!(
                "token id {t} is outside the vocabulary of {}",
                self.vocab_size
            )));
        }
        if let Some(r) = readout.iter().find(|r| **r >= n) {
            return Err(Error::invalid(format!(
                "readout row {r} is outside the block of {n}"
            )));
        }
        if base + n > self.max_context {
            return Err(Error::ContextExceeded {
                needed: base + n,
                limit: self.max_context,
            });
        }
        if let Some(p) = positions.iter().find(|p| **p as usize >= self.max_context) {
            return Err(Error::invalid(format!(
                "position {p} is beyond the model's context of {}",
                self.max_context
            )));
        }
        mask.validate(base, n)?;
        Ok(())
    }

    /// K and V bytes one token takes in the cache, over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}

/// What makes a model a shard: its place in the group, how it is split, and the whole model's configuration.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    pub rank: usize,
    pub world: usize,
    pub layout: Layout,
    pub o: Split,
    pub down: Split,
    /// Each rank's width of the attention output (heads x head size), of the MLP, and of the hidden state.
    pub q_widths: Vec<usize>,
    pub f_widths: Vec<usize>,
    pub d_widths: Vec<usize>,
    /// The unsharded model's configuration.
    pub full: ModelConfig,
    /// Matrices that could not take the requested layout, and why.
    pub notes: Vec<String>,
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Row-parallel or output-split on a tensor-parallel shard.
    pub wo: Linear,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    /// Row-parallel or output-split on a tensor-parallel shard.
    pub w_down: Linear,
}

/// A model's weights.
#[derive(Debug, Clone)]
pub struct Weights {
    pub embed: QMatrix,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `None`: tied to the embedding.
    pub lm_head: Option<QMatrix>,
}

/// The per-request KV cache: keys and values of every layer for the tokens processed so far.
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    kv_dim: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        KvCache {
            k: vec![Vec::new(); cfg.n_layers],
            v: vec![Vec::new(); cfg.n_layers],
            len: 0,
            kv_dim: cfg.n_kv_heads * cfg.head_dim,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of K and V held.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.len * self.kv_dim * std::mem::size_of::<f32>()
    }

    /// A cache of this one's first `n` tokens (all of them where `n >= len`), copied.
    pub fn prefix(&self, n: usize) -> KvCache {
        let n = n.min(self.len);
        let copy = |bufs: &[Vec<f32>]| -> Vec<Vec<f32>> {
            bufs.iter().map(|b| b[..n * self.kv_dim].to_vec()).collect()
        };
        KvCache {
            k: copy(&self.k),
            v: copy(&self.v),
            len: n,
            kv_dim: self.kv_dim,
        }
    }

    fn truncate_layers(&mut self, n: usize) {
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(n * self.kv_dim);
        }
    }

    /// Keeps the first `n` tokens (no-op when `n >= len`). Later blocks overwrite what was dropped.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        self.len = n;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(n * self.kv_dim);
            if buf.capacity() > 2 * buf.len() + (1 << 16) {
                buf.shrink_to(buf.len() * 5 / 4);
            }
        }
    }
}

/// One session's block in a packed forward ([`Model::forward_packed`]).
pub struct Packed<'a, C = KvCache> {
    pub cache: &'a mut C,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub mask: &'a BlockMask,
    pub readout: &'a [usize],
}

/// Logits at the readout rows of a forward block.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    vocab: usize,
    data: Vec<f32>,
}

impl Logits {
    /// Logits of `data.len() / vocab` rows laid out one after another.
    pub fn from_rows(vocab: usize, data: Vec<f32>) -> Result<Self> {
        if vocab == 0 || !data.len().is_multiple_of(vocab) {
            return Err(Error::invalid(format!(
                "{} logits are not whole rows of {vocab}",
                data.len()
            )));
        }
        Ok(Logits { vocab, data })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.data.len() / self.vocab
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Logits of readout row `i` (in the order the readout positions were given).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// A loaded model, or one rank's shard of it (see `tp`).
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) cfg: ModelConfig,
    pub(crate) w: Weights,
    rope: Rope,
    /// Set on a tensor-parallel shard (its split layers carry their communicators).
    shard: Option<ShardInfo>,
}

fn check_matrix(name: &str, m: &QMatrix, rows: usize, cols: usize) -> Result<()> {
    if m.rows() != rows || m.cols() != cols {
        return Err(Error::ShapeMismatch {
            tensor: name.to_string(),
            expected: vec![rows, cols],
            found: vec![m.rows(), m.cols()],
        });
    }
    Ok(())
}

fn check_vec(name: &str, v: &[f32], len: usize) -> Result<()> {
    if v.len() != len {
        return Err(Error::ShapeMismatch {
            tensor: name.to_string(),
            expected: vec![len],
            found: vec![v.len()],
        });
    }
    Ok(())
}

fn add_bias(x: &mut [f32], b: Option<&Vec<f32>>) {
    if let Some(b) = b {
        for row in x.chunks_mut(b.len()) {
            for (v, bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

impl Model {
    /// Assembles a model, checking every weight's shape against the configuration.
    pub fn new(cfg: ModelConfig, w: Weights) -> Result<Self> {
        cfg.validate()?;
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        if w.layers.len() != cfg.n_layers {
            return Err(Error::invalid(format!(
                "{} layers given, the configuration has {}",
                w.layers.len(),
                cfg.n_layers
            )));
        }
        check_matrix("embed", &w.embed, cfg.vocab_size, d)?;
        check_vec("norm", &w.norm, d)?;
        if let Some(h) = &w.lm_head {
            check_matrix("lm_head", h, cfg.vocab_size, d)?;
        }
        for (i, l) in w.layers.iter().enumerate() {
            let n = |s: &str| format!("layer {i} {s}");
            check_vec(&n("attn_norm"), &l.attn_norm, d)?;
            check_vec(&n("ffn_norm"), &l.ffn_norm, d)?;
            check_matrix(&n("q"), &l.wq, qd, d)?;
            check_matrix(&n("k"), &l.wk, kvd, d)?;
            check_matrix(&n("v"), &l.wv, kvd, d)?;
            check_matrix(&n("o"), l.wo.weight(), d, qd)?;
            check_matrix(&n("gate"), &l.w_gate, f, d)?;
            check_matrix(&n("up"), &l.w_up, f, d)?;
            check_matrix(&n("down"), l.w_down.weight(), d, f)?;
            for (name, b, len) in [
                ("q bias", &l.bq, qd),
                ("k bias", &l.bk, kvd),
                ("v bias", &l.bv, kvd),
            ] {
                if let Some(b) = b {
                    check_vec(&n(name), b, len)?;
                }
            }
        }
        let rope = Rope::new(hd, cfg.rope_theta, cfg.rope_style);
        Ok(Model {
            cfg,
            w,
            rope,
            shard: None,
        })
    }

    /// A shard assembled by `tp::shard` (its matrices are cut to the shard's layout, which `new`'s checks do not
    /// know).
    pub(crate) fn from_shard(cfg: ModelConfig, w: Weights, shard: ShardInfo) -> Result<Self> {
        cfg.validate()?;
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta, cfg.rope_style);
        Ok(Model {
            cfg,
            w,
            rope,
            shard: Some(shard),
        })
    }

    /// The tensor-parallel shard this model is, if it is one.
    pub fn shard_of(&self) -> Option<&ShardInfo> {
        self.shard.as_ref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn weights(&self) -> &Weights {
        &self.w
    }

    /// Bytes of weight storage.
    pub fn weight_bytes(&self) -> usize {
        let mats = |l: &Layer| {
            [
                &l.wq,
                &l.wk,
                &l.wv,
                l.wo.weight(),
                &l.w_gate,
                &l.w_up,
                l.w_down.weight(),
            ]
            .iter()
            .map(|m| m.storage_bytes())
            .sum::<usize>()
        };
        self.w.embed.storage_bytes()
            + self.w.lm_head.as_ref().map_or(0, |m| m.storage_bytes())
            + self.w.layers.iter().map(mats).sum::<usize>()
    }

    /// Runs one packed block.
    ///
    /// `tokens[i]` is placed at rotary position `positions[i]` and attends to what `mask.rows()[i]` allows. The
    /// block's keys and values are appended to `cache` (the caller truncates what it does not keep). Returns
    /// logits at the block rows listed in `readout`, in that order. On error the cache is unchanged.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
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

    /// Runs the blocks of several caches (sessions) as one pass: every matrix multiplies the rows of all of them at
    /// once (the weights are read once per step, not once per session), while each block's rows attend only to its
    /// own cache under its own mask. Returns each block's readout logits, in the order of `items`.
    ///
    /// Because the matmul kernels are batch-invariant (see `quant`) and normalization, rotary embedding and
    /// attention work row by row within a session, every block's logits and cache entries are bitwise those of
    /// [`Model::forward`] on that block alone. Every block is checked first; on any error no cache changes.
    pub fn forward_packed(&self, items: &mut [Packed<'_>]) -> Result<Vec<Logits>> {
        // The whole pass runs on a thread of the compute pool, so that each of its parallel operations (a few hundred
        // a pass: every matmul, every layer's attention) is split among the pool's threads from inside it. Called from
        // outside the pool (a worker's scheduler thread, a benchmark's main thread), each of them would otherwise be
        // handed to the pool and waited for, the caller sleeping and waking once per operation: on a 2-core AVX-512
        // VNNI EPYC the draft's one-token step took 21.3 ms that way and 18.3 ms this way (means of 6 alternating
        // runs of `engine-bench --models target,draft --blocks 1 --decode-steps 80`; the target's 49.2 and 48.2).
        // A tensor-parallel shard's pass stays on its caller's thread: it blocks in its collectives until the other
        // ranks reach them, and ranks of one process (tests) holding every pool thread that way could leave the
        // rank they wait for with none to start on.
        if self.shard_of().is_some() {
            return self.forward_packed_here(items);
        }
        rayon::scope(|_| self.forward_packed_here(items))
    }

    fn forward_packed_here(&self, items: &mut [Packed<'_>]) -> Result<Vec<Logits>> {
        for it in items.iter() {
            self.check_block(it.cache, it.tokens, it.positions, it.mask, it.readout)?;
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let d = self.cfg.hidden_size;
        let total: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut x = vec![0f32; total * d];
        let mut positions = Vec::with_capacity(total);
        for (row, &t) in x.chunks_mut(d).zip(items.iter().flat_map(|it| it.tokens)) {
            self.w.embed.row_to_f32(t as usize, row);
        }
        for it in items.iter() {
            positions.extend_from_slice(it.positions);
        }
        let bases: Vec<usize> = items.iter().map(|it| it.cache.len()).collect();
        if let Err(e) = self.layers(items, &mut x, &positions) {
            for (it, &base) in items.iter_mut().zip(&bases) {
                it.cache.truncate_layers(base);
            }
            return Err(e);
        }
        let mut rows = Vec::new();
        let mut offset = 0;
        for (it, &base) in items.iter_mut().zip(&bases) {
            it.cache.len = base + it.tokens.len();
            rows.extend(it.readout.iter().map(|r| offset + r));
            offset += it.tokens.len();
        }
        let all = self.readout(&x, &rows)?;
        let vocab = self.cfg.vocab_size;
        let mut out = Vec::with_capacity(items.len());
        let mut data = all.data.as_slice();
        for it in items.iter() {
            let (mine, rest) = data.split_at(it.readout.len() * vocab);
            out.push(Logits {
                vocab,
                data: mine.to_vec(),
            });
            data = rest;
        }
        Ok(out)
    }

    /// Every check `forward` makes before touching the cache (a tensor-parallel leader runs them before it
    /// sends a block to its followers, so that a block either runs on every rank or on none).
    pub fn check_block(
        &self,
        cache: &KvCache,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<()> {
        let cfg = &self.cfg;
        cfg.check_block(cache.len(), tokens, positions, mask, readout)?;
        if cache.k.len() != cfg.n_layers || cache.kv_dim != cfg.n_kv_heads * cfg.head_dim {
            return Err(Error::invalid("KV cache was made for another model"));
        }
        Ok(())
    }

    fn layers(&self, items: &mut [Packed<'_>], x: &mut [f32], positions: &[u32]) -> Result<()> {
        let cfg = &self.cfg;
        let n = positions.len();
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let shapes: Vec<AttnShape> = items
            .iter()
            .map(|it| AttnShape {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
                block_start: it.cache.len(),
            })
            .collect();
        let mut h = vec![0f32; n * d];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut attn = vec![0f32; n * qd];
        let mut o = vec![0f32; n * d];
        let mut gate = vec![0f32; n * f];
        let mut up = vec![0f32; n * f];
        for (li, l) in self.w.layers.iter().enumerate() {
            let _span = tracing::trace_span!("layer", li).entered();
            ops::rms_norm(x, &l.attn_norm, cfg.rms_eps, &mut h);
            {
                let input = Input::new(&h, n);
                l.wq.matmul_input(&input, &mut q)?;
                l.wk.matmul_input(&input, &mut k)?;
                l.wv.matmul_input(&input, &mut v)?;
            }
            add_bias(&mut q, l.bq.as_ref());
            add_bias(&mut k, l.bk.as_ref());
            add_bias(&mut v, l.bv.as_ref());
            self.rope.apply(&mut q, positions, cfg.n_heads);
            self.rope.apply(&mut k, positions, cfg.n_kv_heads);
            // Attention session by session: each block's rows see only their own cache.
            let mut r0 = 0;
            for (it, shape) in items.iter_mut().zip(&shapes) {
                let (base, rows) = (shape.block_start, it.tokens.len());
                let (kc, vc) = (&mut it.cache.k[li], &mut it.cache.v[li]);
                kc.truncate(base * kvd);
                vc.truncate(base * kvd);
                kc.extend_from_slice(&k[r0 * kvd..(r0 + rows) * kvd]);
                vc.extend_from_slice(&v[r0 * kvd..(r0 + rows) * kvd]);
                ops::attention(
                    &q[r0 * qd..(r0 + rows) * qd],
                    kc,
                    vc,
                    it.mask.rows(),
                    shape,
                    &mut attn[r0 * qd..(r0 + rows) * qd],
                );
                r0 += rows;
            }
            l.wo.forward(&attn, n, &mut o)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            ops::rms_norm(x, &l.ffn_norm, cfg.rms_eps, &mut h);
            {
                let input = Input::new(&h, n);
                l.w_gate.matmul_input(&input, &mut gate)?;
                l.w_up.matmul_input(&input, &mut up)?;
            }
            ops::swiglu(&mut gate, &up);
            l.w_down.forward(&gate, n, &mut o)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
        }
        Ok(())
    }

    fn readout(&self, x: &[f32], readout: &[usize]) -> Result<Logits> {
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let r = readout.len();
        let mut sel = Vec::with_capacity(r * d);
        for &i in readout {
            sel.extend_from_slice(&x[i * d..(i + 1) * d]);
        }
        let mut normed = vec![0f32; r * d];
        ops::rms_norm(&sel, &self.w.norm, cfg.rms_eps, &mut normed);
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        let mut logits = vec![0f32; r * cfg.vocab_size];
        head.matmul(&normed, r, &mut logits)?;
        Ok(Logits {
            vocab: cfg.vocab_size,
            data: logits,
        })
    }

    /// Causal forward of `tokens` appended after the cache at consecutive positions; logits at every row in
    /// `readout`.
    pub fn forward_causal(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        readout: &[usize],
    ) -> Result<Logits> {
        let base = cache.len();
        let positions: Vec<u32> = (base..base + tokens.len()).map(|p| p as u32).collect();
        let mask = BlockMask::causal(base, tokens.len());
        self.forward(cache, tokens, &positions, &mask, readout)
    }

    /// A model with random weights made directly in block formats (see [`crate::quant::random_matrix`]): `layers`
    /// for every layer matrix, `embed` for the embedding table, `head` for a separate output head (`None`: tied to
    /// the embedding). Fast enough for the real shapes of multi-billion-parameter checkpoints.
    pub fn random_in(
        cfg: ModelConfig,
        layers: GgmlDType,
        embed: GgmlDType,
        head: Option<GgmlDType>,
        seed: u64,
    ) -> Result<Self> {
        use crate::quant::random_matrix;
        use rand::{Rng, SeedableRng};
        cfg.validate()?;
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut bias =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.1..0.1)).collect() };
        let qwen = cfg.arch == Arch::Qwen2;
        let mut out = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let s = seed.wrapping_add(1000 * (i as u64 + 1));
            out.push(Layer {
                attn_norm: vec![1.0; d],
                wq: random_matrix(layers, qd, d, s)?,
                wk: random_matrix(layers, kvd, d, s + 1)?,
                wv: random_matrix(layers, kvd, d, s + 2)?,
                bq: qwen.then(|| bias(qd)),
                bk: qwen.then(|| bias(kvd)),
                bv: qwen.then(|| bias(kvd)),
                wo: random_matrix(layers, d, qd, s + 3)?.into(),
                ffn_norm: vec![1.0; d],
                w_gate: random_matrix(layers, f, d, s + 4)?,
                w_up: random_matrix(layers, f, d, s + 5)?,
                w_down: random_matrix(layers, d, f, s + 6)?.into(),
            });
        }
        let lm_head = match head {
            Some(h) => Some(random_matrix(h, cfg.vocab_size, d, seed + 7)?),
            None => None,
        };
        Model::new(
            cfg.clone(),
            Weights {
                embed: random_matrix(embed, cfg.vocab_size, d, seed + 8)?,
                layers: out,
                norm: vec![1.0; d],
                lm_head,
            },
        )
    }

    /// A model with random weights (f32), for tests and benchmarks of model logic.
    pub fn random(cfg: ModelConfig, seed: u64) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut mat = |rows: usize, cols: usize| {
            let scale = 1.0 / (cols as f32).sqrt();
            let data: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-scale..scale))
                .collect();
            QMatrix::from_f32(candle_core::quantized::GgmlDType::F32, rows, cols, &data)
                .map_err(Error::from)
        };
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut layers = Vec::new();
        for _ in 0..cfg.n_layers {
            layers.push(Layer {
                attn_norm: vec![1.0; d],
                wq: mat(qd, d)?,
                wk: mat(kvd, d)?,
                wv: mat(kvd, d)?,
                bq: None,
                bk: None,
                bv: None,
                wo: mat(d, qd)?.into(),
                ffn_norm: vec![1.0; d],
                w_gate: mat(f, d)?,
                w_up: mat(f, d)?,
                w_down: mat(d, f)?.into(),
            });
        }
        let embed = mat(cfg.vocab_size, d)?;
        let mut rng2 = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
        if cfg.arch == Arch::Qwen2 {
            for l in layers.iter_mut() {
                l.bq = Some((0..qd).map(|_| rng2.random_range(-0.1..0.1)).collect());
                l.bk = Some((0..kvd).map(|_| rng2.random_range(-0.1..0.1)).collect());
                l.bv = Some((0..kvd).map(|_| rng2.random_range(-0.1..0.1)).collect());
            }
        }
        Model::new(
            cfg,
            Weights {
                embed,
                layers,
                norm: vec![1.0; d],
                lm_head: None,
            },
        )
    }
}

#[cfg(test)]
mod tests;
