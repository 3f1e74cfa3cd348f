//! One transformer block on candle tensors: RMSNorm, q/k/v projections (with Qwen2's biases), rotary embedding at
//! explicit positions, attention of each session's rows over its own cache under its own mask, output projection,
//! SwiGLU MLP.

use candle_core::quantized::{QMatMul, QTensor, ggml_file};
use candle_core::{Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::model::{self, ModelConfig};
use crate::quant::QMatrix;

use super::cache::{PoolHold, Slot};

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

/// One session's share of a packed pass: its rows in the pass, where its keys and values live, its mask as an
/// additive tensor.
pub(crate) struct Rows {
    pub start: usize,
    pub rows: usize,
    /// Tokens the session held before the pass.
    pub held: usize,
    pub slot: Slot,
    /// `rows x (held + rows)`: 0 where a row may attend, -inf where not. `None` for a session of a batched
    /// group, whose rows the group's mask covers ([`Batch`]).
    pub mask: Option<Tensor>,
}

/// The pool's tensors a pass reads and writes: per capacity class it touches, per layer (K, V).
pub(crate) struct PassKv {
    classes: Vec<Option<Vec<(Tensor, Tensor)>>>,
}

impl PassKv {
    /// Takes the tensors of every class the pass's sessions hold slots in (after their room is reserved, with the
    /// pool held still for the pass).
    pub(crate) fn take(pool: &PoolHold<'_>, slots: impl Iterator<Item = Slot>) -> Result<Self> {
        let mut classes: Vec<Option<Vec<(Tensor, Tensor)>>> = Vec::new();
        for s in slots {
            if classes.len() <= s.class {
                classes.resize(s.class + 1, None);
            }
            if classes[s.class].is_none() {
                classes[s.class] = Some(pool.class_layers(s.class)?);
            }
        }
        Ok(PassKv { classes })
    }

    fn get(&self, class: usize, li: usize) -> Result<&(Tensor, Tensor)> {
        self.classes
            .get(class)
            .and_then(Option::as_ref)
            .and_then(|layers| layers.get(li))
            .ok_or_else(|| Error::invalid("a pass read a KV class it did not take"))
    }
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
    /// and values of layer `li` into its slot after the tokens it holds. `batch`: the pass's plan of groups that
    /// attend in one product per step each and sessions that attend alone ([`Batch`]); `None`: every session
    /// alone.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        cfg: &ModelConfig,
        li: usize,
        x: &Tensor,
        rotary: &Rotary,
        sessions: &[Rows],
        kv: &PassKv,
        batch: Option<&Batch>,
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
        let dims = (nkv, group, hd);
        let attn = match batch {
            Some(b) => batched_attention(li, &q, &k, &v, sessions, b, kv, dims, scale)?,
            None => {
                let all: Vec<&Rows> = sessions.iter().collect();
                Self::session_attention(li, &q, &k, &v, &all, kv, dims, scale)?
            }
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
        sessions: &[&Rows],
        kv: &PassKv,
        (nkv, group, hd): (usize, usize, usize),
        scale: f64,
    ) -> Result<Tensor> {
        let nh = nkv * group;
        let mut outs = Vec::with_capacity(sessions.len());
        for &s in sessions {
            let (kc, vc) = kv.get(s.slot.class, li)?;
            let keys = write_block(kc, s, &k.narrow(0, s.start, s.rows)?)?;
            let values = write_block(vc, s, &v.narrow(0, s.start, s.rows)?)?;
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
    for (row, line) in mask.rows().iter().zip(m.chunks_mut(total)) {
        open_row(line, row, base);
    }
    Ok(Tensor::from_vec(m, (rows, total), device)?)
}

/// Sets to 0 the keys a mask row sees in its line of an additive mask (-inf elsewhere): the first `cached` of the
/// `base` tokens held, and its spans of the block after them.
fn open_row(line: &mut [f32], row: &parse_core::mask::MaskRow, base: usize) {
    line[..row.cached].fill(0.0);
    for span in &row.spans {
        line[base + span.start..base + span.end].fill(0.0);
    }
}

/// Writes one session's block of keys or values (`rows x kv_heads x head_dim`) of one layer into its slot of the
/// class tensor `pool` after the tokens it holds, and returns the slot's held tokens and the block
/// (`kv_heads x (held + rows) x head_dim`, a view into the pool).
fn write_block(pool: &Tensor, s: &Rows, block: &Tensor) -> Result<Tensor> {
    let total = s.held + s.rows;
    if total > s.slot.capacity {
        return Err(Error::invalid("KV cache written past its reserved room"));
    }
    let slot = pool.narrow(0, s.slot.index, 1)?;
    slot.slice_set(
        &block.transpose(0, 1)?.contiguous()?.unsqueeze(0)?,
        2,
        s.held,
    )?;
    Ok(slot.squeeze(0)?.narrow(1, 0, total)?)
}

/// How a pass attends in batches: the sessions that bring the same number of rows and hold slots of the same
/// capacity class form a group, which attends in one product per step (scores, mask, softmax, values) over the
/// class's slots `0..slots`, its new keys and values written with one scatter each. A group whose slots attended
/// would be more than twice its sessions (sessions of the class not in it, free slots), and a session alone in its
/// group, attend session by session instead. Built once per pass ([`Batch::plan`]), read by every layer.
pub(crate) struct Batch {
    groups: Vec<Group>,
    /// Sessions (indices into the pass's) that attend one by one.
    singles: Vec<usize>,
    /// The pass's row of each row of the groups' outputs and then the singles' concatenated, inverted: puts them
    /// back in pass order. `None` where they are in pass order already.
    order: Option<Tensor>,
}

/// The sessions of one capacity class with the same number of rows in a batched pass.
struct Group {
    class: usize,
    capacity: usize,
    /// Rows each member brings.
    rows: usize,
    /// Sessions of the pass in this class.
    members: usize,
    /// Slots attended: `0..slots` of the class (every member's slot among them).
    slots: usize,
    /// The pass rows of the members, in member order; `None` where the group is the whole pass in order.
    pass_rows: Option<Tensor>,
    /// Per slot, the member in it, or `members` (a zero block) for a slot of no member; `None` where the members
    /// are slots `0..members` in order.
    to_slots: Option<Tensor>,
    /// Per slot, the member in it, or `members + slot` (that slot's own last rows, appended after the members'
    /// blocks) for a slot of no member: what the scatter writes there. `None` with `to_slots`.
    write_from: Option<Tensor>,
    /// Per member, its slot; `None` with `to_slots`.
    from_slots: Option<Tensor>,
    /// Where the scatter writes, `slots x kv_heads x rows x head_dim`: along the token axis, each member's rows
    /// after what it holds; a slot of no member rewrites its last `rows` tokens with what they hold.
    write: Tensor,
    /// `slots x 1 x 1 x rows x longest`: each member's rows' visibility over what it holds and its block, padded
    /// with -inf; a slot of no member sees its first token (its output is dropped; an all -inf row would give NaN).
    mask: Tensor,
    longest: usize,
}

impl Batch {
    /// Sessions (indices into the pass's) that attend one by one, and so need their own masks.
    pub(crate) fn singles(&self) -> &[usize] {
        &self.singles
    }

    /// The plan of a pass of `sessions`; `masks[i]` is session `i`'s block mask.
    pub(crate) fn plan(
        sessions: &[Rows],
        masks: &[&parse_core::mask::BlockMask],
        head_dim: usize,
        n_kv_heads: usize,
        device: &Device,
    ) -> Result<Self> {
        if masks.len() != sessions.len() {
            return Err(Error::invalid(
                "a batched pass has a mask for every session",
            ));
        }
        let mut keys: Vec<(usize, usize)> =
            sessions.iter().map(|s| (s.slot.class, s.rows)).collect();
        keys.sort_unstable();
        keys.dedup();
        let u32s = |v: Vec<u32>| -> Result<Tensor> {
            let n = v.len();
            Ok(Tensor::from_vec(v, n, device)?)
        };
        let mut groups = Vec::with_capacity(keys.len());
        let mut singles = Vec::new();
        let mut pass_rows: Vec<u32> = Vec::with_capacity(sessions.iter().map(|s| s.rows).sum());
        for &(class, r) in &keys {
            let members: Vec<usize> = (0..sessions.len())
                .filter(|&i| (sessions[i].slot.class, sessions[i].rows) == (class, r))
                .collect();
            let m = members.len();
            let capacity = sessions[members[0]].slot.capacity;
            let slots = members
                .iter()
                .map(|&i| sessions[i].slot.index + 1)
                .max()
                .unwrap_or(0);
            if m < 2 || slots > 2 * m {
                singles.extend(members);
                continue;
            }
            let in_order = slots == m
                && members
                    .iter()
                    .enumerate()
                    .all(|(j, &i)| sessions[i].slot.index == j);
            let mut at_slot = vec![None; slots];
            for (j, &i) in members.iter().enumerate() {
                at_slot[sessions[i].slot.index] = Some((j, i));
            }
            let longest = members
                .iter()
                .map(|&i| sessions[i].held + r)
                .max()
                .unwrap_or(r);
            let mut write = Vec::with_capacity(slots * n_kv_heads * r * head_dim);
            let mut mask = vec![f32::NEG_INFINITY; slots * r * longest];
            for (slot, member) in at_slot.iter().enumerate() {
                let first = match member {
                    Some((_, i)) => sessions[*i].held,
                    None => capacity - r,
                };
                for _ in 0..n_kv_heads {
                    for j in 0..r {
                        write.extend(std::iter::repeat_n((first + j) as u32, head_dim));
                    }
                }
                let lines = &mut mask[slot * r * longest..(slot + 1) * r * longest];
                match member {
                    Some((_, i)) => {
                        let base = sessions[*i].held;
                        let rows = masks[*i].rows();
                        if rows.len() != r {
                            return Err(Error::invalid("a session's mask does not match its rows"));
                        }
                        for (row, line) in rows.iter().zip(lines.chunks_mut(longest)) {
                            open_row(line, row, base);
                        }
                    }
                    None => lines.chunks_mut(longest).for_each(|line| line[0] = 0.0),
                }
            }
            let write = Tensor::from_vec(write, (slots, n_kv_heads, r, head_dim), device)?;
            let mask = Tensor::from_vec(mask, (slots, 1, 1, r, longest), device)?;
            let (to_slots, write_from, from_slots) = if in_order {
                (None, None, None)
            } else {
                let to = |none: &dyn Fn(usize) -> usize| -> Result<Tensor> {
                    let v = at_slot.iter().enumerate();
                    u32s(
                        v.map(|(s, x)| x.map_or(none(s), |(j, _)| j) as u32)
                            .collect(),
                    )
                };
                let from: Vec<u32> = members
                    .iter()
                    .map(|&i| sessions[i].slot.index as u32)
                    .collect();
                (Some(to(&|_| m)?), Some(to(&|s| m + s)?), Some(u32s(from)?))
            };
            let mine: Vec<u32> = members
                .iter()
                .flat_map(|&i| (sessions[i].start..sessions[i].start + r).map(|x| x as u32))
                .collect();
            pass_rows.extend(&mine);
            let whole =
                m == sessions.len() && mine.iter().enumerate().all(|(j, &x)| x as usize == j);
            groups.push(Group {
                class,
                capacity,
                rows: r,
                members: m,
                slots,
                pass_rows: if whole { None } else { Some(u32s(mine)?) },
                to_slots,
                write_from,
                from_slots,
                write,
                mask,
                longest,
            });
        }
        singles.sort_unstable();
        for &i in &singles {
            pass_rows.extend(
                (sessions[i].start..sessions[i].start + sessions[i].rows).map(|x| x as u32),
            );
        }
        let order = if pass_rows.iter().enumerate().all(|(j, &x)| x as usize == j) {
            None
        } else {
            let mut inverse = vec![0u32; pass_rows.len()];
            for (j, &x) in pass_rows.iter().enumerate() {
                inverse[x as usize] = j as u32;
            }
            Some(u32s(inverse)?)
        };
        Ok(Batch {
            groups,
            singles,
            order,
        })
    }
}

/// Attention of a batched pass (see [`Batch`]): per group, the members' new keys and values scattered into their
/// slots, then one product each for scores, mask, softmax and values over the class's slots `0..slots`, with no
/// copy of the keys and values held; then the sessions left to attend one by one.
#[allow(clippy::too_many_arguments)]
fn batched_attention(
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sessions: &[Rows],
    batch: &Batch,
    kv: &PassKv,
    (nkv, group, hd): (usize, usize, usize),
    scale: f64,
) -> Result<Tensor> {
    let nh = nkv * group;
    let mut outs = Vec::with_capacity(batch.groups.len() + 1);
    for g in &batch.groups {
        let (kc, vc) = kv.get(g.class, li)?;
        let (m, r) = (g.members, g.rows);
        let mine = |t: &Tensor| -> Result<Tensor> {
            Ok(match &g.pass_rows {
                Some(rows) => t.index_select(rows, 0)?,
                None => t.clone(),
            })
        };
        // Per member `kv_heads x rows x head_dim`; slots of no member get what their last rows hold.
        let to_slots = |t: Tensor, pool: &Tensor| -> Result<Tensor> {
            Ok(match &g.write_from {
                Some(ix) => {
                    let held = pool.narrow(0, 0, g.slots)?.narrow(2, g.capacity - r, r)?;
                    Tensor::cat(&[&t, &held.contiguous()?], 0)?.index_select(ix, 0)?
                }
                None => t,
            })
        };
        for (new, pool) in [(k, kc), (v, vc)] {
            let rows = mine(new)?
                .reshape((m, r, nkv, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            let rows = to_slots(rows, pool)?;
            pool.narrow(0, 0, g.slots)?
                .scatter_set(&g.write, &rows, 2)?;
        }
        let keys = kc.narrow(0, 0, g.slots)?.narrow(2, 0, g.longest)?;
        let values = vc.narrow(0, 0, g.slots)?.narrow(2, 0, g.longest)?;
        // Query heads grouped by the KV head they share, as in the per-session path: `(kv_heads, group * rows)`.
        let qs = mine(q)?
            .reshape((m, r, nh, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((m, nkv, group * r, hd))?;
        let qs = match &g.to_slots {
            Some(ix) => {
                let zero = Tensor::zeros((1, nkv, group * r, hd), qs.dtype(), qs.device())?;
                Tensor::cat(&[&qs, &zero], 0)?.index_select(ix, 0)?
            }
            None => qs,
        };
        let scores = (qs.matmul(&keys.transpose(2, 3)?)? * scale)?
            .reshape((g.slots, nkv, group, r, g.longest))?
            .broadcast_add(&g.mask)?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?.reshape((
            g.slots,
            nkv,
            group * r,
            g.longest,
        ))?;
        let o = p.matmul(&values)?;
        let o = match &g.from_slots {
            Some(ix) => o.index_select(ix, 0)?,
            None => o,
        };
        outs.push(
            o.reshape((m, nh, r, hd))?
                .transpose(1, 2)?
                .reshape((m * r, nh * hd))?,
        );
    }
    if !batch.singles.is_empty() {
        let singles: Vec<&Rows> = batch.singles.iter().map(|&i| &sessions[i]).collect();
        outs.push(Layer::session_attention(
            li,
            q,
            k,
            v,
            &singles,
            kv,
            (nkv, group, hd),
            scale,
        )?);
    }
    let o = match outs.len() {
        1 => outs.remove(0),
        _ => Tensor::cat(&outs, 0)?,
    };
    Ok(match &batch.order {
        Some(ix) => o.index_select(ix, 0)?,
        None => o,
    })
}
