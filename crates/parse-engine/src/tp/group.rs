//! The ranks of a tensor-parallel group: a [`Leader`] wraps rank 0's engine and, before it runs an operation
//! itself, checks it and broadcasts it; each [`Follower`] applies the leader's operations to its own shard, joining
//! the same collectives. Operations travel as protobuf messages (prost), so a malformed frame is a decode error,
//! never a panic or an unbounded allocation.
//!
//! A forward is sent only after it passed every check on the leader, so it runs on every rank or on none. The
//! first failed collective breaks the group for good: every later operation fails with `Error::Comm`
//! (UNAVAILABLE), and [`EngineOps::healthy`] turns false.

use std::sync::Arc;

use parse_comm::{Comm, CommError, CommErrorKind};
use parse_core::mask::{BlockMask, MaskRow};
use prost::Message;

use crate::any_model::Net;
use crate::engine::{Block, Engine, EngineOps};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::parallel::Layout;
use crate::session::SessionStore;

/// One operation the leader sends to its followers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    Open(String),
    Forward {
        session: String,
        tokens: Vec<u32>,
        positions: Vec<u32>,
        mask: Vec<MaskRow>,
    },
    /// The blocks of several sessions in one packed pass (continuous batching); every one passed the leader's
    /// checks.
    Batch(Vec<Block>),
    Truncate(String, usize),
    Release(String),
    /// A heartbeat: followers answer with a barrier.
    Ping,
    /// The leader is shutting down.
    Stop,
}

/// The wire form of an [`Op`].
mod wire {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Op {
        #[prost(oneof = "Kind", tags = "1, 2, 3, 4, 5, 6, 7")]
        pub kind: Option<Kind>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(string, tag = "1")]
        Open(String),
        #[prost(message, tag = "2")]
        Forward(Forward),
        #[prost(message, tag = "3")]
        Truncate(Truncate),
        #[prost(string, tag = "4")]
        Release(String),
        #[prost(message, tag = "5")]
        Ping(Empty),
        #[prost(message, tag = "6")]
        Stop(Empty),
        #[prost(message, tag = "7")]
        Batch(Batch),
    }

    /// Blocks of several sessions for one packed pass.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Batch {
        #[prost(message, repeated, tag = "1")]
        pub blocks: Vec<Forward>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Forward {
        #[prost(string, tag = "1")]
        pub session: String,
        #[prost(uint32, repeated, tag = "2")]
        pub tokens: Vec<u32>,
        #[prost(uint32, repeated, tag = "3")]
        pub positions: Vec<u32>,
        #[prost(message, repeated, tag = "4")]
        pub mask: Vec<Row>,
    }

    /// A mask row: cached keys, then `[start, end)` pairs of block spans.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Row {
        #[prost(uint64, tag = "1")]
        pub cached: u64,
        #[prost(uint64, repeated, tag = "2")]
        pub spans: Vec<u64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Truncate {
        #[prost(string, tag = "1")]
        pub session: String,
        #[prost(uint64, tag = "2")]
        pub len: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Empty {}
}

fn malformed() -> Error {
    Error::Comm(CommError::new(
        CommErrorKind::Protocol,
        "a malformed operation from the leader",
    ))
}

fn forward_to_wire(
    session: &str,
    tokens: &[u32],
    positions: &[u32],
    mask: &[MaskRow],
) -> wire::Forward {
    wire::Forward {
        session: session.to_string(),
        tokens: tokens.to_vec(),
        positions: positions.to_vec(),
        mask: mask
            .iter()
            .map(|r| wire::Row {
                cached: r.cached as u64,
                spans: r
                    .spans
                    .iter()
                    .flat_map(|s| [s.start as u64, s.end as u64])
                    .collect(),
            })
            .collect(),
    }
}

fn mask_from_wire(rows: Vec<wire::Row>) -> Result<Vec<MaskRow>> {
    let size = |v: u64| usize::try_from(v).map_err(|_| malformed());
    rows.into_iter()
        .map(|r| {
            if r.spans.len() % 2 != 0 {
                return Err(malformed());
            }
            Ok(MaskRow {
                cached: size(r.cached)?,
                spans: r
                    .spans
                    .chunks(2)
                    .map(|p| Ok(size(p[0])?..size(p[1])?))
                    .collect::<Result<_>>()?,
            })
        })
        .collect()
}

impl Op {
    pub(crate) fn encode(&self) -> Vec<u8> {
        use wire::Kind;
        let kind = match self {
            Op::Open(s) => Kind::Open(s.clone()),
            Op::Forward {
                session,
                tokens,
                positions,
                mask,
            } => Kind::Forward(forward_to_wire(session, tokens, positions, mask)),
            // The readout rows stay with the leader: only it reads logits.
            Op::Batch(blocks) => Kind::Batch(wire::Batch {
                blocks: blocks
                    .iter()
                    .map(|b| forward_to_wire(&b.session, &b.tokens, &b.positions, b.mask.rows()))
                    .collect(),
            }),
            Op::Truncate(s, n) => Kind::Truncate(wire::Truncate {
                session: s.clone(),
                len: *n as u64,
            }),
            Op::Release(s) => Kind::Release(s.clone()),
            Op::Ping => Kind::Ping(wire::Empty {}),
            Op::Stop => Kind::Stop(wire::Empty {}),
        };
        wire::Op { kind: Some(kind) }.encode_to_vec()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Op> {
        use wire::Kind;
        let size = |v: u64| usize::try_from(v).map_err(|_| malformed());
        let op = wire::Op::decode(b).map_err(|_| malformed())?;
        Ok(match op.kind.ok_or_else(malformed)? {
            Kind::Open(s) => Op::Open(s),
            Kind::Forward(f) => Op::Forward {
                session: f.session,
                tokens: f.tokens,
                positions: f.positions,
                mask: mask_from_wire(f.mask)?,
            },
            Kind::Batch(b) => Op::Batch(
                b.blocks
                    .into_iter()
                    .map(|f| {
                        Ok(Block {
                            session: f.session,
                            tokens: f.tokens,
                            positions: f.positions,
                            mask: BlockMask::from_rows(mask_from_wire(f.mask)?),
                            readout: Vec::new(),
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Kind::Truncate(t) => Op::Truncate(t.session, size(t.len)?),
            Kind::Release(s) => Op::Release(s),
            Kind::Ping(_) => Op::Ping,
            Kind::Stop(_) => Op::Stop,
        })
    }
}

/// A rank of a group, as [`join`] makes it.
pub enum Member {
    /// A group of one: the engine as it was.
    Alone(Engine),
    Leader(Leader),
    Follower(Follower),
}

impl Member {
    /// The leader, if this rank is one.
    pub fn leader(self) -> Option<Leader> {
        match self {
            Member::Leader(l) => Some(l),
            _ => None,
        }
    }

    /// The follower, if this rank is one.
    pub fn follower(self) -> Option<Follower> {
        match self {
            Member::Follower(f) => Some(f),
            _ => None,
        }
    }
}

/// Makes `engine` rank `comm.rank()` of a tensor-parallel group: its model becomes that rank's shard in `layout`.
/// Rank 0 comes back as the [`Leader`], which then runs every operation on all ranks; the others as
/// [`Follower`]s, which must run [`Follower::follow`]; a group of one as the engine unchanged. Followers keep no KV budget of their own: the leader's
/// checks decide.
pub fn join(mut engine: Engine, comm: Arc<dyn Comm>, layout: Layout) -> Result<Member> {
    if comm.world_size() == 1 {
        return Ok(Member::Alone(engine));
    }
    let whole = engine.model.kernels().ok_or_else(|| {
        Error::invalid(
            "tensor parallelism runs on the kernels backend; the candle backend runs whole models",
        )
    })?;
    let shard = whole.shard(comm.clone(), layout)?;
    engine.model = Arc::new(Net::Kernels(shard));
    if comm.rank() == 0 {
        Ok(Member::Leader(Leader {
            engine,
            comm,
            broken: None,
        }))
    } else {
        engine.sessions = SessionStore::new(usize::MAX);
        Ok(Member::Follower(Follower { engine, comm }))
    }
}

/// Rank 0 of a group: an engine whose every operation also runs on the followers.
pub struct Leader {
    engine: Engine,
    comm: Arc<dyn Comm>,
    /// The first collective failure; the group is unusable from then on.
    broken: Option<CommError>,
}

impl Leader {
    /// `(rank, world size)`: `(0, N)`.
    pub fn tensor_parallel(&self) -> (usize, usize) {
        (0, self.comm.world_size())
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            Some(e) => Err(Error::Comm(e.clone())),
            None => Ok(()),
        }
    }

    /// Records a collective's failure: the group is broken from then on.
    fn note<T>(&mut self, r: Result<T, CommError>) -> Result<T> {
        r.map_err(|e| {
            tracing::error!("tensor-parallel group broken: {e}");
            self.broken.get_or_insert(e.clone());
            Error::Comm(e)
        })
    }

    /// Notes a forward's failure in a collective (the model reports it as `Error::Comm`).
    fn note_forward<T>(&mut self, r: Result<T>) -> Result<T> {
        match r {
            Err(Error::Comm(e)) => self.note(Err(e)),
            other => other,
        }
    }

    fn send(&mut self, op: &Op) -> Result<()> {
        self.check()?;
        let mut buf = op.encode();
        let r = self.comm.broadcast(&mut buf, 0);
        self.note(r)
    }

    /// A heartbeat through the whole group: fails (and breaks the group) when a follower is gone or hung.
    pub fn ping(&mut self) -> Result<()> {
        self.check()?;
        let mut buf = Op::Ping.encode();
        let comm = self.comm.clone();
        let r = comm.broadcast(&mut buf, 0).and_then(|_| comm.barrier());
        self.note(r)
    }

    /// Tells the followers to leave their loop (the leader is shutting down).
    pub fn stop_followers(&mut self) -> Result<()> {
        self.send(&Op::Stop)
    }

    /// Whether the group is still whole.
    pub fn group_healthy(&self) -> bool {
        self.broken.is_none()
    }
}

impl EngineOps for Leader {
    fn engine(&self) -> &Engine {
        &self.engine
    }

    fn open_session(&mut self, id: &str) -> Result<()> {
        self.check()?;
        self.engine.open_session(id)?;
        self.send(&Op::Open(id.to_string()))
    }

    fn forward(
        &mut self,
        session: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        self.check()?;
        // Every check first: the followers are sent only a block that will run.
        self.engine.sessions.check_forward(
            &self.engine.model,
            session,
            tokens,
            positions,
            mask,
            readout,
        )?;
        self.send(&Op::Forward {
            session: session.to_string(),
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
            mask: mask.rows().to_vec(),
        })?;
        let r = self
            .engine
            .forward(session, tokens, positions, mask, readout);
        self.note_forward(r)
    }

    /// The blocks of several sessions in one packed pass on every rank: the leader checks the batch first, sends
    /// the blocks that pass (in order) to the followers, and runs the same blocks itself, so every rank packs the
    /// same rows and meets the same collectives. A block that fails its checks gets its error alone.
    fn forward_batch(&mut self, blocks: &[Block]) -> Vec<Result<Logits>> {
        // Every block gets the group's failure (a broken group fails every later call alike).
        let failed = |e: &Error| -> Vec<Result<Logits>> {
            blocks
                .iter()
                .map(|_| {
                    Err(match e {
                        Error::Comm(c) => Error::Comm(c.clone()),
                        other => Error::invalid(other.to_string()),
                    })
                })
                .collect()
        };
        if let Err(e) = self.check() {
            return failed(&e);
        }
        let checks = self.engine.sessions.check_batch(&self.engine.model, blocks);
        let runnable: Vec<Block> = blocks
            .iter()
            .zip(&checks)
            .filter(|(_, c)| c.is_ok())
            .map(|(b, _)| b.clone())
            .collect();
        let mut ran = Vec::new().into_iter();
        if !runnable.is_empty() {
            if let Err(e) = self.send(&Op::Batch(runnable.clone())) {
                return failed(&e);
            }
            let results = self
                .engine
                .sessions
                .forward_batch(&self.engine.model, &runnable);
            let noted: Vec<Result<Logits>> =
                results.into_iter().map(|r| self.note_forward(r)).collect();
            ran = noted.into_iter();
        }
        checks
            .into_iter()
            .map(|c| match c {
                Err(e) => Err(e),
                Ok(()) => ran
                    .next()
                    .unwrap_or_else(|| Err(Error::invalid("a block of the batch did not run"))),
            })
            .collect()
    }

    fn truncate(&mut self, session: &str, n: usize) -> Result<()> {
        self.check()?;
        self.engine.truncate(session, n)?;
        self.send(&Op::Truncate(session.to_string(), n))
    }

    fn release(&mut self, session: &str) -> Result<usize> {
        self.check()?;
        let freed = self.engine.release(session)?;
        self.send(&Op::Release(session.to_string()))?;
        Ok(freed)
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn healthy(&self) -> bool {
        self.group_healthy()
    }

    fn heartbeat(&mut self) -> Result<()> {
        self.ping()
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.group_healthy() {
            self.stop_followers()
        } else {
            Ok(())
        }
    }
}

/// A rank other than 0: applies the leader's operations to its shard.
pub struct Follower {
    engine: Engine,
    comm: Arc<dyn Comm>,
}

impl Follower {
    /// `(rank, world size)`.
    pub fn tensor_parallel(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    /// The follower's loop: applies the leader's operations until it says stop (`Ok`) or the group breaks (`Err`).
    pub fn follow(mut self) -> Result<()> {
        let comm = self.comm.clone();
        let e = &mut self.engine;
        loop {
            let mut buf = Vec::new();
            comm.broadcast_wait(&mut buf, 0).map_err(Error::Comm)?;
            let op = Op::decode(&buf)?;
            let r = match op {
                Op::Open(s) => e.sessions.open(&e.model, &s),
                Op::Forward {
                    session,
                    tokens,
                    positions,
                    mask,
                } => e
                    .sessions
                    .forward(
                        &e.model,
                        &session,
                        &tokens,
                        &positions,
                        &BlockMask::from_rows(mask),
                        &[],
                    )
                    .map(|_| ()),
                Op::Batch(blocks) => e
                    .sessions
                    .forward_batch(&e.model, &blocks)
                    .into_iter()
                    .try_for_each(|r| r.map(|_| ())),
                Op::Truncate(s, n) => e.sessions.truncate(&s, n),
                Op::Release(s) => e.sessions.release(&s).map(|_| ()),
                Op::Ping => comm.barrier().map_err(Error::Comm),
                Op::Stop => return Ok(()),
            };
            match r {
                Ok(()) => {}
                // The group is broken: the follower has no work left.
                Err(e @ Error::Comm(_)) => return Err(e),
                // The leader checked the operation first, so this is a divergence; the leader's next collective
                // with this rank times out and breaks the group.
                Err(e) => tracing::error!("follower could not apply the leader's operation: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_round_trip_and_garbage_is_refused() {
        let ops = [
            Op::Open("s1".into()),
            Op::Forward {
                session: "s".into(),
                tokens: vec![1, 2, 3],
                positions: vec![5, 6, 6],
                mask: vec![
                    MaskRow {
                        cached: 5,
                        spans: vec![0..1],
                    },
                    MaskRow {
                        cached: 5,
                        spans: vec![0..2],
                    },
                    MaskRow {
                        cached: 5,
                        spans: vec![0..1, 2..3],
                    },
                ],
            },
            Op::Batch(vec![
                Block {
                    session: "a".into(),
                    tokens: vec![4],
                    positions: vec![9],
                    mask: BlockMask::causal(9, 1),
                    readout: Vec::new(),
                },
                Block {
                    session: "b".into(),
                    tokens: vec![1, 2],
                    positions: vec![0, 1],
                    mask: BlockMask::causal(0, 2),
                    readout: Vec::new(),
                },
            ]),
            Op::Truncate("s".into(), 7),
            Op::Release("s".into()),
            Op::Ping,
            Op::Stop,
        ];
        for op in ops {
            let b = op.encode();
            assert_eq!(Op::decode(&b).unwrap(), op);
            assert!(Op::decode(&b[..b.len() - 1]).is_err() || b.len() == 1);
        }
        assert!(Op::decode(&[]).is_err());
        assert!(Op::decode(&[9]).is_err());
        assert!(Op::decode(&[2, 255, 255, 255, 255]).is_err());
    }
}
