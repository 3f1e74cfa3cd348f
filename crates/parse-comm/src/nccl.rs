//! The NCCL backend (feature `nccl`): collectives between GPUs through the cudarc crate's `nccl` module, the one
//! candle's `nccl` feature enables. There is no separate NCCL crate; cudarc loads `libnccl` at run time.
//!
//! cudarc's communicator and CUDA stream belong to the thread that made them, so each [`NcclComm`] owns one
//! thread that holds them and runs the collectives it is sent over a channel; the handle is `Send + Sync` through
//! the channel alone (no `unsafe impl`). Buffers go host to device, through NCCL, and back: the engine's forward
//! runs on the CPU, so this backend is the GPU interconnect's path for the same collectives, not a GPU forward.
//!
//! A peer that dies can leave an NCCL call waiting for ever; the caller stops waiting after the operation timeout
//! and the communicator is broken from then on, as with TCP.

use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::safe::{Comm as RawComm, Id, ReduceOp};

use crate::{Comm, CommError, CommErrorKind, Result};

type Reply<T> = Sender<Result<T>>;

enum Job {
    AllReduce(Vec<f32>, Reply<Vec<f32>>),
    AllGather(Vec<f32>, Reply<Vec<f32>>),
    Broadcast(Vec<u8>, usize, Reply<Vec<u8>>),
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::new(CommErrorKind::PeerLost, format!("NCCL {what}: {e:?}"))
}

/// A new NCCL unique id, made on rank 0 and handed to every rank out of band (the TCP group, or discovery).
pub fn unique_id() -> Result<[u8; 128]> {
    let id = Id::new().map_err(|e| nccl_err("unique id", e))?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's NCCL communicator (see the module docs).
pub struct NcclComm {
    rank: usize,
    world: usize,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    op_timeout: Duration,
    broken: Arc<Mutex<Option<CommError>>>,
}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world` on CUDA device `device`.
    pub fn new(
        rank: usize,
        world: usize,
        device: usize,
        id: [u8; 128],
        op_timeout: Duration,
    ) -> Result<Self> {
        if rank >= world {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                format!("rank {rank} is outside a group of {world}"),
            ));
        }
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let worker = std::thread::Builder::new()
            .name(format!("nccl-{rank}"))
            .spawn(move || {
                let setup = CudaContext::new(device)
                    .map_err(|e| nccl_err("CUDA context", e))
                    .and_then(|ctx| {
                        let stream = ctx.default_stream();
                        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
                        RawComm::from_rank(stream.clone(), rank, world, id)
                            .map(|c| (stream, c))
                            .map_err(|e| nccl_err("init", e))
                    });
                let (stream, comm) = match setup {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                for job in rx {
                    match job {
                        Job::AllReduce(v, reply) => {
                            let r = (|| {
                                let src = stream.clone_htod(&v).map_err(|e| nccl_err("copy", e))?;
                                let mut dst = stream
                                    .alloc_zeros::<f32>(v.len())
                                    .map_err(|e| nccl_err("alloc", e))?;
                                comm.all_reduce(&src, &mut dst, &ReduceOp::Sum)
                                    .map_err(|e| nccl_err("all-reduce", e))?;
                                stream.clone_dtoh(&dst).map_err(|e| nccl_err("copy", e))
                            })();
                            let _ = reply.send(r);
                        }
                        Job::AllGather(v, reply) => {
                            let r = (|| {
                                let src = stream.clone_htod(&v).map_err(|e| nccl_err("copy", e))?;
                                let mut dst = stream
                                    .alloc_zeros::<f32>(v.len() * world)
                                    .map_err(|e| nccl_err("alloc", e))?;
                                comm.all_gather(&src, &mut dst)
                                    .map_err(|e| nccl_err("all-gather", e))?;
                                stream.clone_dtoh(&dst).map_err(|e| nccl_err("copy", e))
                            })();
                            let _ = reply.send(r);
                        }
                        Job::Broadcast(v, root, reply) => {
                            let r = (|| {
                                // The length first, so that the other ranks can size their buffers.
                                let mut len = stream
                                    .clone_htod(&[v.len() as u64])
                                    .map_err(|e| nccl_err("copy", e))?;
                                comm.broadcast_in_place(&mut len, root as i32)
                                    .map_err(|e| nccl_err("broadcast", e))?;
                                let n = stream.clone_dtoh(&len).map_err(|e| nccl_err("copy", e))?[0]
                                    as usize;
                                if n == 0 {
                                    return Ok(Vec::new());
                                }
                                let mut buf = if rank == root {
                                    stream.clone_htod(&v).map_err(|e| nccl_err("copy", e))?
                                } else {
                                    stream
                                        .alloc_zeros::<u8>(n)
                                        .map_err(|e| nccl_err("alloc", e))?
                                };
                                comm.broadcast_in_place(&mut buf, root as i32)
                                    .map_err(|e| nccl_err("broadcast", e))?;
                                stream.clone_dtoh(&buf).map_err(|e| nccl_err("copy", e))
                            })();
                            let _ = reply.send(r);
                        }
                    }
                }
            })
            .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?;
        ready_rx
            .recv()
            .map_err(|_| CommError::new(CommErrorKind::Rendezvous, "the NCCL thread ended"))??;
        Ok(NcclComm {
            rank,
            world,
            jobs: Some(jobs),
            worker: Some(worker),
            op_timeout,
            broken: Arc::new(Mutex::new(None)),
        })
    }

    fn run<T>(&self, job: impl FnOnce(Reply<T>) -> Job, timeout: Option<Duration>) -> Result<T> {
        if let Some(e) = self.broken.lock().ok().and_then(|b| b.clone()) {
            return Err(e);
        }
        let (tx, rx) = mpsc::channel();
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job(tx)).is_ok());
        let r = if !sent {
            Err(CommError::new(
                CommErrorKind::PeerLost,
                "the NCCL thread ended",
            ))
        } else {
            match timeout {
                Some(t) => rx.recv_timeout(t).map_err(|_| {
                    CommError::new(
                        CommErrorKind::Timeout,
                        format!("an NCCL collective did not finish within {t:?}"),
                    )
                }),
                None => rx
                    .recv()
                    .map_err(|_| CommError::new(CommErrorKind::PeerLost, "the NCCL thread ended")),
            }
            .and_then(|r| r)
        };
        r.map_err(|e| match self.broken.lock() {
            Ok(mut b) => b.get_or_insert(e).clone(),
            Err(_) => e,
        })
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// NCCL's own sum: its order is NCCL's, so an element's bits may depend on the buffer's size (the exact
    /// tensor-parallel layout does not use all-reduce).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let v = buf.to_vec();
        let out = self.run(|r| Job::AllReduce(v, r), Some(self.op_timeout))?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let v = local.to_vec();
        self.run(|r| Job::AllGather(v, r), Some(self.op_timeout))
    }

    fn broadcast(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                format!("broadcast root {root} in a group of {}", self.world),
            ));
        }
        let v = std::mem::take(buf);
        *buf = self.run(|r| Job::Broadcast(v, root, r), Some(self.op_timeout))?;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let mut one = [0f32];
        self.all_reduce_sum(&mut one)
    }

    fn broadcast_wait(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        let v = std::mem::take(buf);
        *buf = self.run(|r| Job::Broadcast(v, root, r), None)?;
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Closing the channel ends the thread once its current collective returns; a collective stuck on a dead
        // peer would never return, so the thread is left to the process's exit rather than joined.
        self.jobs = None;
        if let Some(w) = self.worker.take()
            && w.is_finished()
        {
            let _ = w.join();
        }
    }
}
