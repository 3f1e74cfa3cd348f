//! One transformer block on candle tensors: RMSNorm, q/k/v projections (with Qwen2's biases), rotary embedding at
//! explicit positions, attention of each session's rows over its own cache under its own mask, output projection,
//! SwiGLU MLP.

use candle_core::quantized::{QMatMul, QTensor, ggml_file};
use candle_core::{Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::model::{self, ModelConfig};
use crate::quant::QMatrix;

use super::cache::TensorCache;

/// A weight matrix uploaded in its own format: a GGUF quantized matrix stays quantized on the device (candle's
/// quantized matmul: MMVQ kernels for a few rows, dequantize-and-GEMM for blocks on CUDA); f32 and f16 become dense
/// tensors.
pub(crate) fn upload(m: &QMatrix, device: &Device) -> Result<QTensor> {
    Ok(ggml_file::qtensor_from_ggml(
        m.dtype(),
        &m.raw_bytes(),
        vec![m.rows(), m.cols()],
        device,
    )?)
}

pub(crate) fn matmul(m: &QMatrix, device: &Device) -> Result<QMatMul> {
    Ok(QMatMul::from_qtensor(upload(m, device)?)?)
}

pub(crate) fn vector(v: &[f32], device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(v, v.len(), device)?)
}

/// One session's share of a packed pass: its rows in the pass, its cache, its mask as an additive tensor.
pub(crate) struct Rows<'a> {
    pub start: usize,
    pub rows: usize,
    pub cache: &'a TensorCache,
    /// `rows x (held + rows)`: 0 where a row may attend, -inf where not. `None` in a decode pass, whose rows are
    /// masked together ([`decode_mask`]).
    pub mask: Option<Tensor>,
}

/// The rotary angles of a pass's rows (`n x head_dim/2` cos and sin) and how the model pairs dimensions.
pub(crate) struct Rotary {
    pub cos: Tensor,
    pub sin: Tensor,
    /// Dimension `i` pairs with `i + d/2` (else `2i` with `2i + 1`).
    pub neox: bool,
}

/// One transformer block's weights on the device.
pub struct Layer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    wo: QMatMul,
    ffn_norm: Tensor,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

impl Layer {
    pub(crate) fn upload(l: &model::Layer, device: &Device) -> Result<Self> {
        let bias = |b: &Option<Vec<f32>>| b.as_deref().map(|b| vector(b, device)).transpose();
        Ok(Layer {
            attn_norm: vector(&l.attn_norm, device)?,
            wq: matmul(&l.wq, device)?,
            wk: matmul(&l.wk, device)?,
            wv: matmul(&l.wv, device)?,
            bq: bias(&l.bq)?,
            bk: bias(&l.bk)?,
            bv: bias(&l.bv)?,
            wo: matmul(l.wo.weight(), device)?,
            ffn_norm: vector(&l.ffn_norm, device)?,
            w_gate: matmul(&l.w_gate, device)?,
            w_up: matmul(&l.w_up, device)?,
            w_down: matmul(l.w_down.weight(), device)?,
        })
    }

    /// Runs the block on `x` (`n x hidden`, the rows of every session of the pass), writing each session's keys
    /// and values of layer `li` into its cache after the tokens it holds. `decode`: the pass is one row per session
    /// and attends in one batch under this mask ([`decode_mask`]); else session by session.
    pub(crate) fn forward(
        &self,
        cfg: &ModelConfig,
        li: usize,
        x: &Tensor,
        rotary: &Rotary,
        sessions: &[Rows<'_>],
        decode: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (cos, sin) = (&rotary.cos, &rotary.sin);
        let n = x.dim(0)?;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let h = candle_nn::ops::rms_norm(x, &self.attn_norm, cfg.rms_eps)?;
        let proj = |w: &QMatMul, b: &Option<Tensor>| -> Result<Tensor> {
            let y = w.forward(&h)?;
            Ok(match b {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            })
        };
        let rope = |t: Tensor, heads: usize| -> Result<Tensor> {
            let t = t.reshape((1, n, heads, hd))?;
            let t = if rotary.neox {
                candle_nn::rotary_emb::rope_thd(&t, cos, sin)?
            } else {
                // Interleaved pairs (2i, 2i+1): llama-architecture GGUF files.
                let t = t.transpose(1, 2)?.contiguous()?;
                candle_nn::rotary_emb::rope_i(&t, cos, sin)?.transpose(1, 2)?
            };
            Ok(t.reshape((n, heads, hd))?)
        };
        let q = rope(proj(&self.wq, &self.bq)?, nh)?;
        let k = rope(proj(&self.wk, &self.bk)?, nkv)?;
        let v = proj(&self.wv, &self.bv)?.reshape((n, nkv, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let group = nh / nkv;
        let attn = match decode {
            Some(mask) => {
                decode_attention(li, &q, &k, &v, sessions, mask, (nkv, group, hd), scale)?
            }
            None => Self::session_attention(li, &q, &k, &v, sessions, (nkv, group, hd), scale)?,
        };
        let x = (x + self.wo.forward(&attn)?)?;
        let h = candle_nn::ops::rms_norm(&x, &self.ffn_norm, cfg.rms_eps)?;
        let gate = self.w_gate.forward(&h)?;
        let up = self.w_up.forward(&h)?;
        let act = (gate.silu()? * up)?;
        let y = (&x + self.w_down.forward(&act)?)?;
        if y.dims() != [n, cfg.hidden_size] {
            return Err(Error::invalid(format!(
                "layer {li} returned {:?} for {n} rows",
                y.dims()
            )));
        }
        Ok(y)
    }

    /// Attention session by session: each session's rows against its own cache under its own mask (any block).
    #[allow(clippy::too_many_arguments)]
    fn session_attention(
        li: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sessions: &[Rows<'_>],
        (nkv, group, hd): (usize, usize, usize),
        scale: f64,
    ) -> Result<Tensor> {
        let nh = nkv * group;
        let mut outs = Vec::with_capacity(sessions.len());
        for s in sessions {
            let kb = k.narrow(0, s.start, s.rows)?;
            let vb = v.narrow(0, s.start, s.rows)?;
            let (keys, values) = s.cache.write(li, &kb, &vb)?;
            let total = keys.dim(1)?;
            // Heads grouped by the KV head they share: (kv_heads, group * rows, head_dim) against the KV head's
            // keys, so shared KV heads are never copied per query head.
            let qs = q
                .narrow(0, s.start, s.rows)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((nkv, group * s.rows, hd))?;
            let scores =
                (qs.matmul(&keys.t()?)? * scale)?
                    .reshape((nkv, group, s.rows, total))?
                    .broadcast_add(s.mask.as_ref().ok_or_else(|| {
                        Error::invalid("a session's block came without its mask")
                    })?)?;
            let p =
                candle_nn::ops::softmax_last_dim(&scores)?.reshape((nkv, group * s.rows, total))?;
            let o = p
                .matmul(&values)?
                .reshape((nh, s.rows, hd))?
                .transpose(0, 1)?
                .reshape((s.rows, nh * hd))?;
            outs.push(o);
        }
        Ok(Tensor::cat(&outs, 0)?)
    }
}

/// The additive mask of one session's block: `rows x (base + rows)`.
pub(crate) fn dense_mask(
    mask: &parse_core::mask::BlockMask,
    base: usize,
    device: &Device,
) -> Result<Tensor> {
    let rows = mask.rows().len();
    let total = base + rows;
    let mut m = vec![f32::NEG_INFINITY; rows * total];
    for (r, row) in mask.rows().iter().enumerate() {
        let line = &mut m[r * total..(r + 1) * total];
        line[..row.cached].fill(0.0);
        for span in &row.spans {
            line[base + span.start..base + span.end].fill(0.0);
        }
    }
    Ok(Tensor::from_vec(m, (rows, total), device)?)
}

/// Attention of a pass in which every session brings one row (decode steps): each session's key and value are
/// written into its cache, then every session's keys and values, padded to the longest, are stacked into one batch
/// and attended in one product per step (scores, mask, softmax, values) instead of one per session. On a GPU the
/// per-session products are a dozen kernel launches each per layer; this leaves the cache write and the stacking
/// copies. `mask`: `sessions x 1 x 1 x longest`, from [`decode_mask`].
#[allow(clippy::too_many_arguments)]
fn decode_attention(
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sessions: &[Rows<'_>],
    mask: &Tensor,
    (nkv, group, hd): (usize, usize, usize),
    scale: f64,
) -> Result<Tensor> {
    let b = sessions.len();
    let longest = mask.dim(3)?;
    let mut keys = Vec::with_capacity(b);
    let mut values = Vec::with_capacity(b);
    for (i, s) in sessions.iter().enumerate() {
        if s.rows != 1 || s.start != i {
            return Err(Error::invalid(
                "a decode pass has one row per session, in order",
            ));
        }
        let (kk, vv) = s
            .cache
            .write(li, &k.narrow(0, i, 1)?, &v.narrow(0, i, 1)?)?;
        let held = kk.dim(1)?;
        if held < longest {
            keys.push(kk.pad_with_zeros(1, 0, longest - held)?);
            values.push(vv.pad_with_zeros(1, 0, longest - held)?);
        } else {
            keys.push(kk);
            values.push(vv);
        }
    }
    let keys = Tensor::stack(&keys, 0)?;
    let values = Tensor::stack(&values, 0)?;
    // Query heads grouped by the KV head they share, as in the per-session path: (b, kv_heads, group, head_dim).
    let qs = q.reshape((b, nkv, group, hd))?;
    let scores = (qs.matmul(&keys.transpose(2, 3)?)? * scale)?.broadcast_add(mask)?;
    let p = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(p.matmul(&values)?.reshape((b, nkv * group * hd))?)
}

/// The additive mask of a decode pass (see [`decode_attention`]): per session, its one row's visibility over the
/// tokens it holds and itself, padded with -inf to the longest session's: `sessions x 1 x 1 x longest`.
pub(crate) fn decode_mask(
    rows: &[(&parse_core::mask::BlockMask, usize)],
    device: &Device,
) -> Result<Tensor> {
    let longest = rows.iter().map(|(_, base)| base + 1).max().unwrap_or(0);
    let mut m = vec![f32::NEG_INFINITY; rows.len() * longest];
    for (i, (mask, base)) in rows.iter().enumerate() {
        let [row] = mask.rows() else {
            return Err(Error::invalid("a decode pass has one row per session"));
        };
        let line = &mut m[i * longest..(i + 1) * longest];
        line[..row.cached].fill(0.0);
        for span in &row.spans {
            line[base + span.start..base + span.end].fill(0.0);
        }
    }
    Ok(Tensor::from_vec(m, (rows.len(), 1, 1, longest), device)?)
}
