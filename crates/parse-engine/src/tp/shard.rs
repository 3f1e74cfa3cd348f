//! Sharding: one rank's part of a model for a group, in a [`Layout`] (see `tp` for the layouts and why quantized
//! blocks are never split).

use std::sync::Arc;

use parse_comm::{Comm, split_range};

use crate::error::{Error, Result};
use crate::model::{Layer, Model, ModelConfig, ShardInfo, Weights};
use crate::parallel::{Layout, Linear, Split};

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Every rank's range of `total` rows in units of 4 (1 when `total` is not a multiple of 4).
fn row_ranges(total: usize, world: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let unit = if total.is_multiple_of(4) { 4 } else { 1 };
    (0..world)
        .map(|r| split_range(total, unit, r, world))
        .collect()
}

impl Model {
    /// This rank's shard of the model for the group `comm`, in `layout` (see the module docs). World size 1
    /// gives the model back unchanged.
    pub fn shard(&self, comm: Arc<dyn Comm>, layout: Layout) -> Result<Model> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let cfg = self.cfg.clone();
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!("rank {rank} of a group of {world}")));
        }
        if world == 1 {
            return Ok(self.clone());
        }
        if self.shard_of().is_some() {
            return Err(Error::invalid("the model is already a shard"));
        }
        if !cfg.n_heads.is_multiple_of(world) {
            return Err(Error::invalid(format!(
                "{} attention heads do not divide over {world} tensor-parallel ranks; use a world size that \
                 divides {}",
                cfg.n_heads, cfg.n_heads
            )));
        }
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let m = cfg.n_heads / world;
        let q0 = rank * m;
        let group = cfg.n_heads / cfg.n_kv_heads;
        // Runs of `local_group` consecutive query heads share one KV head; gcd keeps every run inside one group.
        let local_group = gcd(m, group);
        let kv_heads: Vec<usize> = (0..m / local_group)
            .map(|j| (q0 + j * local_group) / group)
            .collect();
        let kv_rows: Vec<std::ops::Range<usize>> =
            kv_heads.iter().map(|h| h * hd..(h + 1) * hd).collect();
        let q_ranges: Vec<_> = (0..world).map(|r| r * m * hd..(r + 1) * m * hd).collect();
        let q_rows = q_ranges[rank].clone();
        let d_ranges = row_ranges(d, world).ok_or_else(|| {
            Error::invalid(format!(
                "a hidden size of {d} does not split over {world} ranks"
            ))
        })?;
        let mut notes = Vec::new();
        let blocks_ok = |pick: fn(&Layer) -> usize, ranges: &[std::ops::Range<usize>]| {
            self.w.layers.iter().all(|l| {
                let b = pick(l);
                ranges
                    .iter()
                    .all(|r| r.start.is_multiple_of(b) && r.end.is_multiple_of(b))
            })
        };
        // o: row-parallel when every layer's blocks allow the head split.
        let o = match layout {
            Layout::Exact => Split::Out,
            Layout::Megatron if blocks_ok(|l| l.wo.weight().block_size(), &q_ranges) => Split::Rows,
            Layout::Megatron => {
                notes.push(format!(
                    "o split by output rows: {} columns per rank cut through its quantization blocks",
                    m * hd
                ));
                Split::Out
            }
        };
        // down: row-parallel on whole blocks of the widest block size any layer uses.
        let block = self
            .w
            .layers
            .iter()
            .map(|l| l.w_down.weight().block_size())
            .max()
            .unwrap_or(1);
        let block_ranges: Option<Vec<_>> = (0..world)
            .map(|r| split_range(f, block, r, world))
            .collect();
        let (down, f_ranges) = match (layout, block_ranges) {
            (Layout::Megatron, Some(rs)) if blocks_ok(|l| l.w_down.weight().block_size(), &rs) => {
                (Split::Rows, rs)
            }
            (Layout::Megatron, _) => {
                notes.push(format!(
                    "down split by output rows: an MLP of {f} is fewer than {world} whole {block}-wide blocks"
                ));
                (Split::Out, row_ranges(f, world).unwrap_or_default())
            }
            (Layout::Exact, _) => (Split::Out, row_ranges(f, world).unwrap_or_default()),
        };
        if f_ranges.len() != world {
            return Err(Error::invalid(format!(
                "an MLP of width {f} does not split over {world} ranks"
            )));
        }
        let f_rows = f_ranges[rank].clone();
        let d_rows = d_ranges[rank].clone();
        let gather = |b: &Option<Vec<f32>>, ranges: &[std::ops::Range<usize>]| {
            b.as_ref()
                .map(|b| ranges.iter().flat_map(|r| b[r.clone()].to_vec()).collect())
        };
        let q_widths: Vec<usize> = q_ranges.iter().map(|r| r.len()).collect();
        let f_widths: Vec<usize> = f_ranges.iter().map(|r| r.len()).collect();
        let d_widths: Vec<usize> = d_ranges.iter().map(|r| r.len()).collect();
        // A split matrix as a linear layer that owns the group's communicator: row-parallel over this rank's
        // input columns `cols`, or this rank's output rows with the input gathered from `in_widths`.
        let split = |w: &Linear,
                     how: Split,
                     cols: std::ops::Range<usize>,
                     in_widths: &[usize]|
         -> Result<Linear> {
            Ok(match how {
                Split::Rows => Linear::RowParallel {
                    w: w.weight().select_cols(cols)?,
                    comm: comm.clone(),
                },
                Split::Out => Linear::OutSplit {
                    w: w.weight().select_rows(d_rows.clone()),
                    comm: comm.clone(),
                    in_widths: in_widths.to_vec(),
                    out_widths: d_widths.clone(),
                },
            })
        };
        let mut layers = Vec::with_capacity(self.w.layers.len());
        for l in &self.w.layers {
            layers.push(Layer {
                attn_norm: l.attn_norm.clone(),
                wq: l.wq.select_rows(q_rows.clone()),
                wk: l.wk.gather_rows(&kv_rows),
                wv: l.wv.gather_rows(&kv_rows),
                bq: gather(&l.bq, std::slice::from_ref(&q_rows)),
                bk: gather(&l.bk, &kv_rows),
                bv: gather(&l.bv, &kv_rows),
                wo: split(&l.wo, o, q_rows.clone(), &q_widths)?,
                ffn_norm: l.ffn_norm.clone(),
                w_gate: l.w_gate.select_rows(f_rows.clone()),
                w_up: l.w_up.select_rows(f_rows.clone()),
                w_down: split(&l.w_down, down, f_rows.clone(), &f_widths)?,
            });
        }
        for n in &notes {
            tracing::warn!(rank, "{n}");
        }
        tracing::info!(
            rank,
            world,
            ?layout,
            ?o,
            ?down,
            q_heads = m,
            kv_heads = kv_heads.len(),
            mlp = f_rows.len(),
            "tensor-parallel shard"
        );
        let local = ModelConfig {
            n_heads: m,
            n_kv_heads: kv_heads.len(),
            intermediate_size: f_rows.len(),
            ..cfg.clone()
        };
        let info = ShardInfo {
            rank,
            world,
            layout,
            o,
            down,
            q_widths,
            f_widths,
            d_widths,
            full: cfg,
            notes,
        };
        Model::from_shard(
            local,
            Weights {
                embed: self.w.embed.clone(),
                layers,
                norm: self.w.norm.clone(),
                lm_head: self.w.lm_head.clone(),
            },
            info,
        )
    }
}
