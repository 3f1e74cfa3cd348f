//! The TCP ring backend.
//!
//! Rank `r` listens on `addrs[r]`, connects to rank `r + 1` and accepts rank `r - 1` (mod the world size); the
//! connections stay open for the communicator's life. All-gather and broadcast pass buffers around the ring;
//! all-reduce is an all-gather followed by a sum in rank order (deterministic, see `all_reduce_sum`). A frame is a little-endian `u64` length and its bytes. Each
//! rank has a writer thread for its outgoing connection, so that in every ring step all ranks send and receive at
//! the same time (sending first and then receiving would deadlock once a message outgrows the socket buffers).

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use parse_core::retry::{self, BlockingRetryable};
use sha2::Sha256;

use crate::{Comm, CommError, CommErrorKind, Result};

const MAGIC: &[u8; 8] = b"PARSETP2";
/// The largest frame a peer may announce (a corrupt length must not allocate without bound).
const MAX_FRAME: u64 = 1 << 32;

/// How to form a TCP group.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    pub rank: usize,
    /// Every rank's listen address, in rank order.
    pub addrs: Vec<String>,
    /// How long to wait for the neighbours to come up.
    pub rendezvous_timeout: Duration,
    /// How long one receive may wait inside a collective before the peer counts as hung.
    pub op_timeout: Duration,
    /// The group's shared secret (the cluster token): each side of every ring connection proves it holds it
    /// (HMAC-SHA256 over a fresh nonce). None: the handshake runs with an empty key and proves nothing.
    pub secret: Option<Vec<u8>>,
}

impl TcpConfig {
    pub fn new(rank: usize, addrs: Vec<String>) -> Self {
        TcpConfig {
            rank,
            addrs,
            rendezvous_timeout: Duration::from_secs(120),
            op_timeout: Duration::from_secs(10),
            secret: None,
        }
    }
}

struct Ring {
    /// From the previous rank.
    prev: TcpStream,
    /// Frames to the next rank, written by the writer thread.
    send: Sender<Vec<u8>>,
}

/// A ring of TCP connections (see the module docs).
pub struct TcpComm {
    rank: usize,
    world: usize,
    ring: Mutex<Ring>,
    /// Set on the first failure: the ring is out of step from then on.
    broken: Arc<Mutex<Option<CommError>>>,
    /// Clones of both sockets, to shut them down on drop (and in `kill`).
    sockets: Vec<TcpStream>,
    writer: Option<JoinHandle<()>>,
    op_timeout: Duration,
}

fn io_error(peer: usize, what: &str, e: &std::io::Error) -> CommError {
    match e.kind() {
        IoKind::WouldBlock | IoKind::TimedOut => CommError::new(
            CommErrorKind::Timeout,
            format!("tensor-parallel rank {peer} did not answer in time ({what})"),
        ),
        _ => CommError::new(
            CommErrorKind::PeerLost,
            format!("tensor-parallel rank {peer} is gone ({what}: {e})"),
        ),
    }
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            CommError::new(
                CommErrorKind::Rendezvous,
                format!("cannot resolve `{addr}`"),
            )
        })
}

/// Reads one frame (a little-endian `u64` length, then that many bytes) from `peer`. A length above `max` is a
/// protocol error before anything is allocated; the buffer grows as bytes arrive, so a peer that announces much
/// and sends little costs little.
fn read_frame(r: &mut impl Read, peer: usize, max: u64) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)
        .map_err(|e| io_error(peer, "receive", &e))?;
    let len = u64::from_le_bytes(len);
    if len > max {
        return Err(CommError::new(
            CommErrorKind::Protocol,
            format!("a frame of {len} bytes"),
        ));
    }
    let mut buf = Vec::with_capacity(len.min(1 << 20) as usize);
    let got = r
        .take(len)
        .read_to_end(&mut buf)
        .map_err(|e| io_error(peer, "receive", &e))?;
    if (got as u64) < len {
        return Err(io_error(
            peer,
            "receive",
            &std::io::Error::from(IoKind::UnexpectedEof),
        ));
    }
    Ok(buf)
}

/// The two ends of one ring connection, as this rank sees them.
#[derive(Clone, Copy)]
struct Peer {
    world: usize,
    me: usize,
    other: usize,
}

const NONCE: usize = 32;
const TAG: usize = 32;
/// MAGIC, world, rank, nonce.
const HELLO: usize = 8 + 4 + 4 + NONCE;

/// HMAC-SHA256 under the group's secret of who speaks (`role`, world size, rank) and the other side's nonce: what
/// each side of a ring connection proves. A fresh nonce per connection keeps a recorded handshake from replaying.
fn tag(secret: &[u8], role: &[u8], world: usize, rank: usize, nonce: &[u8]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(role);
    mac.update(&(world as u32).to_le_bytes());
    mac.update(&(rank as u32).to_le_bytes());
    mac.update(nonce);
    mac
}

fn refused(peer: usize, why: &str) -> CommError {
    CommError::new(
        CommErrorKind::Rendezvous,
        format!("tensor-parallel rank {peer}: {why}"),
    )
}

/// Dials the next rank (it may not be listening yet) and proves this rank to it; it must prove itself back.
fn connect_next(addr: SocketAddr, p: Peer, secret: &[u8], deadline: Instant) -> Result<TcpStream> {
    let delays = retry::backoff(
        Duration::from_millis(50),
        Duration::from_millis(500),
        Some(deadline.saturating_duration_since(Instant::now())),
    );
    let mut s = (|| TcpStream::connect_timeout(&addr, Duration::from_secs(1)))
        .retry(delays)
        .sleep(std::thread::sleep)
        .notify(|e, _| tracing::debug!("rank {} at {addr} not up yet: {e}", p.other))
        .call()
        .map_err(|e| refused(p.other, &format!("at {addr} did not come up: {e}")))?;
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    s.set_read_timeout(Some(wait))
        .map_err(|e| io_error(p.other, "handshake", &e))?;
    let nonce: [u8; NONCE] = rand::random();
    let mut hello = MAGIC.to_vec();
    hello.extend((p.world as u32).to_le_bytes());
    hello.extend((p.me as u32).to_le_bytes());
    hello.extend(nonce);
    s.write_all(&hello)
        .map_err(|e| io_error(p.other, "handshake", &e))?;
    let mut answer = [0u8; NONCE + TAG];
    s.read_exact(&mut answer).map_err(|_| {
        refused(
            p.other,
            &format!(
                "at {addr} refused the handshake (not a rank {} of this group of {}?)",
                p.other, p.world
            ),
        )
    })?;
    let (their_nonce, their_tag) = answer.split_at(NONCE);
    tag(secret, b"accept", p.world, p.other, &nonce)
        .verify_slice(their_tag)
        .map_err(|_| {
            refused(
                p.other,
                &format!("at {addr} could not prove it holds the cluster token"),
            )
        })?;
    let mine = tag(secret, b"connect", p.world, p.me, their_nonce)
        .finalize()
        .into_bytes();
    s.write_all(&mine)
        .map_err(|e| io_error(p.other, "handshake", &e))?;
    let mut ok = [0u8; 1];
    match s.read_exact(&mut ok) {
        Ok(()) if ok[0] == 1 => Ok(s),
        _ => Err(refused(
            p.other,
            &format!("at {addr} did not accept this rank's proof (a different cluster token?)"),
        )),
    }
}

/// Checks one connection that claims to be the previous rank: its hello, this rank's proof, then its proof.
fn handshake_prev(s: &mut TcpStream, p: Peer, secret: &[u8]) -> std::result::Result<(), String> {
    let mut hello = [0u8; HELLO];
    s.read_exact(&mut hello)
        .map_err(|e| format!("no hello: {e}"))?;
    let their_world = u32::from_le_bytes(hello[8..12].try_into().unwrap_or_default()) as usize;
    let their_rank = u32::from_le_bytes(hello[12..16].try_into().unwrap_or_default()) as usize;
    if &hello[..8] != MAGIC || their_world != p.world || their_rank != p.other {
        return Err(format!(
            "expected rank {} of {}, a peer introduced itself as rank {their_rank} of {their_world}",
            p.other, p.world
        ));
    }
    let nonce: [u8; NONCE] = rand::random();
    let mut answer = nonce.to_vec();
    answer.extend(
        tag(secret, b"accept", p.world, p.me, &hello[16..])
            .finalize()
            .into_bytes(),
    );
    s.write_all(&answer).map_err(|e| format!("answer: {e}"))?;
    let mut proof = [0u8; TAG];
    s.read_exact(&mut proof)
        .map_err(|e| format!("no proof: {e}"))?;
    tag(secret, b"connect", p.world, p.other, &nonce)
        .verify_slice(&proof)
        .map_err(|_| "its proof does not match the cluster token".to_string())?;
    s.write_all(&[1]).map_err(|e| format!("ack: {e}"))
}

/// Takes the previous rank's connection. Connections that fail the handshake (strangers, another group, a wrong
/// token) are dropped and the wait goes on, so that junk on the port cannot break the rendezvous.
fn accept_prev(
    listener: TcpListener,
    p: Peer,
    secret: &[u8],
    deadline: Instant,
    give_up: &std::sync::atomic::AtomicBool,
) -> Result<TcpStream> {
    let mut last = String::from("no connection");
    loop {
        if give_up.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(refused(p.other, "rendezvous abandoned"));
        }
        match listener.accept() {
            Ok((mut s, from)) => {
                let wait = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(100), Duration::from_secs(5));
                let checked = s
                    .set_nonblocking(false)
                    .and_then(|_| s.set_read_timeout(Some(wait)))
                    .map_err(|e| e.to_string())
                    .and_then(|_| handshake_prev(&mut s, p, secret));
                match checked {
                    Ok(()) => return Ok(s),
                    Err(why) => {
                        tracing::warn!(%from, "refused a connection on the tensor-parallel port: {why}");
                        last = why;
                    }
                }
            }
            Err(e) if e.kind() == IoKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                let why = if e.kind() == IoKind::WouldBlock {
                    last
                } else {
                    e.to_string()
                };
                return Err(refused(
                    p.other,
                    &format!("did not connect in time ({why})"),
                ));
            }
        }
    }
}

impl TcpComm {
    /// Binds this rank's address and forms the ring.
    pub fn connect(cfg: &TcpConfig) -> Result<Self> {
        let addr = cfg.addrs.get(cfg.rank).ok_or_else(|| {
            CommError::new(
                CommErrorKind::Invalid,
                format!(
                    "rank {} is outside a group of {} addresses",
                    cfg.rank,
                    cfg.addrs.len()
                ),
            )
        })?;
        let listener = TcpListener::bind(resolve(addr)?).map_err(|e| {
            CommError::new(
                CommErrorKind::Rendezvous,
                format!("cannot listen on {addr}: {e}"),
            )
        })?;
        Self::with_listener(cfg, listener)
    }

    /// Forms the ring on an already bound listener (tests bind port 0 first).
    pub fn with_listener(cfg: &TcpConfig, listener: TcpListener) -> Result<Self> {
        let world = cfg.addrs.len();
        let rank = cfg.rank;
        if world == 0 || rank >= world {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                format!("rank {rank} is outside a group of {world}"),
            ));
        }
        if world == 1 {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                "a TCP group needs at least 2 ranks (use the local backend for 1)",
            ));
        }
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        let (next_rank, prev_rank) = ((rank + 1) % world, (rank + world - 1) % world);
        let next_addr = resolve(&cfg.addrs[next_rank])?;
        let secret: Arc<[u8]> = cfg.secret.clone().unwrap_or_default().into();
        // The previous rank's connection is taken on a thread of its own: every rank dials first, and each
        // handshake needs an answer from the other side.
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::new(CommErrorKind::Rendezvous, format!("listener: {e}")))?;
        let give_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let acceptor = {
            let (secret, give_up) = (secret.clone(), give_up.clone());
            let peer = Peer {
                world,
                me: rank,
                other: prev_rank,
            };
            std::thread::Builder::new()
                .name(format!("tp-accept-{rank}"))
                .spawn(move || accept_prev(listener, peer, &secret, deadline, &give_up))
                .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?
        };
        let peer = Peer {
            world,
            me: rank,
            other: next_rank,
        };
        let next = connect_next(next_addr, peer, &secret, deadline);
        if next.is_err() {
            give_up.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let prev = acceptor.join().unwrap_or_else(|_| {
            Err(CommError::new(
                CommErrorKind::Rendezvous,
                "the accepting thread panicked",
            ))
        });
        let (mut next, prev) = (next?, prev?);
        for s in [&prev, &next] {
            s.set_nodelay(true)
                .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?;
        }
        prev.set_read_timeout(Some(cfg.op_timeout))
            .map_err(|e| io_error(prev_rank, "setup", &e))?;
        next.set_write_timeout(Some(cfg.op_timeout))
            .map_err(|e| io_error(next_rank, "setup", &e))?;
        let sockets = vec![
            prev.try_clone()
                .map_err(|e| io_error(prev_rank, "setup", &e))?,
            next.try_clone()
                .map_err(|e| io_error(next_rank, "setup", &e))?,
        ];
        let broken = Arc::new(Mutex::new(None));
        let (send, rx) = mpsc::channel::<Vec<u8>>();
        let writer_broken = broken.clone();
        let writer = std::thread::Builder::new()
            .name(format!("tp-send-{rank}"))
            .spawn(move || {
                for frame in rx {
                    let r = next
                        .write_all(&(frame.len() as u64).to_le_bytes())
                        .and_then(|_| next.write_all(&frame));
                    if let Err(e) = r {
                        let err = io_error(next_rank, "send", &e);
                        if let Ok(mut b) = writer_broken.lock() {
                            b.get_or_insert(err);
                        }
                        return;
                    }
                }
            })
            .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?;
        tracing::info!(rank, world, "tensor-parallel ring formed");
        Ok(TcpComm {
            rank,
            world,
            ring: Mutex::new(Ring { prev, send }),
            broken,
            sockets,
            writer: Some(writer),
            op_timeout: cfg.op_timeout,
        })
    }

    /// Closes both connections as a crashed process would (tests use it to play a dead rank).
    pub fn kill(&self) {
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// The error that broke the ring, if one did.
    pub fn broken(&self) -> Option<CommError> {
        self.broken.lock().ok().and_then(|b| b.clone())
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Records the first failure and returns it (a failed send may have been recorded by the writer first).
    fn fail(&self, e: CommError) -> CommError {
        match self.broken.lock() {
            Ok(mut b) => b.get_or_insert(e).clone(),
            Err(_) => e,
        }
    }

    /// Runs one collective on the ring, marking the communicator broken on failure.
    fn with_ring<T>(&self, f: impl FnOnce(&mut RingOps<'_>) -> Result<T>) -> Result<T> {
        if let Some(e) = self.broken() {
            return Err(e);
        }
        let mut ring = self.ring.lock().map_err(|_| {
            CommError::new(CommErrorKind::Protocol, "a collective panicked earlier")
        })?;
        let mut ops = RingOps {
            ring: &mut ring,
            prev_rank: self.prev_rank(),
            broken: &self.broken,
        };
        let r = f(&mut ops);
        r.map_err(|e| self.fail(e))
    }
}

struct RingOps<'a> {
    ring: &'a mut Ring,
    prev_rank: usize,
    broken: &'a Mutex<Option<CommError>>,
}

impl RingOps<'_> {
    fn send(&mut self, bytes: Vec<u8>) -> Result<()> {
        if self.ring.send.send(bytes).is_err() {
            let e = self.broken.lock().ok().and_then(|b| b.clone());
            return Err(e.unwrap_or_else(|| {
                CommError::new(CommErrorKind::PeerLost, "the sending connection is closed")
            }));
        }
        Ok(())
    }

    fn recv(&mut self) -> Result<Vec<u8>> {
        read_frame(&mut self.ring.prev, self.prev_rank, MAX_FRAME)
    }

    fn send_f32(&mut self, v: &[f32]) -> Result<()> {
        self.send(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn recv_f32(&mut self, expect: usize) -> Result<Vec<f32>> {
        let b = self.recv()?;
        if b.len() != expect * 4 {
            return Err(CommError::new(
                CommErrorKind::Protocol,
                format!("expected {expect} floats, got {} bytes", b.len()),
            ));
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// An all-gather, then every rank adds the ranks' values in rank order: each element's sum is
    /// `((v0 + v1) + v2) + ...` whatever the buffer's length, so a token's result does not depend on how many
    /// tokens share the block (the engine's batch invariance), and every rank gets the same bits. It moves
    /// `world - 1` buffers per rank where a ring all-reduce moves about two; at the sizes of a decode step the
    /// round trips dominate, and there are fewer of them.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let len = buf.len();
        let all = self.all_gather(buf)?;
        buf.copy_from_slice(&all[..len]);
        for r in 1..self.world {
            for (a, b) in buf.iter_mut().zip(&all[r * len..(r + 1) * len]) {
                *a += b;
            }
        }
        Ok(())
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let (n, r, len) = (self.world, self.rank, local.len());
        let mut out = vec![0f32; n * len];
        out[r * len..(r + 1) * len].copy_from_slice(local);
        self.with_ring(|ops| {
            for s in 0..n - 1 {
                let o = (r + n - s) % n;
                ops.send_f32(&out[o * len..(o + 1) * len])?;
                let i = (r + 2 * n - s - 1) % n;
                let got = ops.recv_f32(len)?;
                out[i * len..(i + 1) * len].copy_from_slice(&got);
            }
            Ok(())
        })?;
        Ok(out)
    }

    fn broadcast(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(CommError::new(
                CommErrorKind::Invalid,
                format!("broadcast root {root} in a group of {}", self.world),
            ));
        }
        let last = (root + self.world - 1) % self.world;
        let rank = self.rank;
        self.with_ring(|ops| {
            if rank != root {
                *buf = ops.recv()?;
            }
            if rank != last {
                ops.send(buf.clone())?;
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        let mut one = [0f32];
        self.all_reduce_sum(&mut one)
    }

    /// Waits for `root`'s next broadcast without the operation timeout (a follower idles here between steps);
    /// a peer that goes away still ends the wait at once.
    fn broadcast_wait(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        {
            let ring = self.ring.lock().map_err(|_| {
                CommError::new(CommErrorKind::Protocol, "a collective panicked earlier")
            })?;
            let _ = ring.prev.set_read_timeout(None);
        }
        let r = self.broadcast(buf, root);
        if let Ok(ring) = self.ring.lock() {
            let _ = ring.prev.set_read_timeout(Some(self.op_timeout));
        }
        r
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        if let Ok(mut ring) = self.ring.lock() {
            // Closing the channel lets the writer deliver what is queued (the peers may still be reading this
            // rank's last frames) and end; a hung peer ends it by the write timeout.
            let (dead, _) = mpsc::channel();
            ring.send = dead;
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.kill();
    }
}

/// A whole group of `n` ranks in this process on 127.0.0.1 (tests and benchmarks), in rank order.
pub fn loopback_group(n: usize, op_timeout: Duration) -> Result<Vec<TcpComm>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?;
    let addrs = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| CommError::new(CommErrorKind::Rendezvous, e.to_string()))?;
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let mut cfg = TcpConfig::new(r, addrs.clone());
            cfg.op_timeout = op_timeout;
            cfg.rendezvous_timeout = Duration::from_secs(30);
            std::thread::spawn(move || TcpComm::with_listener(&cfg, l))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join().unwrap_or_else(|_| {
                Err(CommError::new(CommErrorKind::Rendezvous, "a rank panicked"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` listeners on loopback ports and their addresses.
    fn bound(n: usize) -> (Vec<TcpListener>, Vec<String>) {
        let listeners: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        (listeners, addrs)
    }

    /// A group of `n` on loopback; rank `r`'s closure runs on its own thread.
    fn group<T: Send + 'static>(
        n: usize,
        f: impl Fn(TcpComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let (listeners, addrs) = bound(n);
        let f = Arc::new(f);
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (f, addrs) = (f.clone(), addrs.clone());
                std::thread::spawn(move || {
                    let mut cfg = TcpConfig::new(r, addrs);
                    cfg.op_timeout = Duration::from_secs(5);
                    f(TcpComm::with_listener(&cfg, l).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_agree_on_every_rank() {
        for n in [2, 3, 4] {
            let out = group(n, |c| {
                let r = c.rank() as f32;
                // Lengths below, at and above the world size, and one large enough to outgrow socket buffers.
                let mut sums = Vec::new();
                for len in [1usize, 3, 7, 1 << 20] {
                    let mut v: Vec<f32> = (0..len).map(|i| r * 1000.0 + i as f32).collect();
                    c.all_reduce_sum(&mut v).unwrap();
                    sums.push(v);
                }
                let gathered = c.all_gather(&[r, r + 0.5]).unwrap();
                let mut b = if c.rank() == 1 {
                    b"hello".to_vec()
                } else {
                    vec![]
                };
                c.broadcast(&mut b, 1).unwrap();
                c.barrier().unwrap();
                (sums, gathered, b)
            });
            let ranks: f32 = (0..n).map(|r| r as f32 * 1000.0).sum();
            for (sums, gathered, b) in &out {
                for v in sums {
                    for (i, x) in v.iter().enumerate() {
                        assert_eq!(*x, ranks + (n * i) as f32, "n={n} i={i}");
                    }
                }
                let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, r as f32 + 0.5]).collect();
                assert_eq!(gathered, &want);
                assert_eq!(b, b"hello");
            }
            // Bitwise the same sums everywhere.
            assert!(out.windows(2).all(|w| w[0].0 == w[1].0));
        }
    }

    #[test]
    fn a_dead_peer_fails_the_collective_at_once_and_for_good() {
        let out = group(3, |c| {
            if c.rank() == 2 {
                c.kill();
                return None;
            }
            let t = Instant::now();
            let mut v = vec![1.0f32; 1000];
            let e = c.all_reduce_sum(&mut v).unwrap_err();
            let again = c.barrier().unwrap_err();
            Some((e.kind, again.kind, t.elapsed()))
        });
        for (kind, again, took) in out.into_iter().flatten() {
            // Rank 0 reads from the dead rank 2 (PeerLost); rank 1 waits on rank 0, which stops sending: it sees
            // the loss as a timeout or, once rank 0 drops, as PeerLost. Neither hangs.
            assert!(
                matches!(kind, CommErrorKind::PeerLost | CommErrorKind::Timeout),
                "{kind:?}"
            );
            assert_eq!(kind, again);
            assert!(took < Duration::from_secs(8), "{took:?}");
        }
    }

    #[test]
    fn a_wrong_group_is_refused_at_rendezvous() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut cfg = TcpConfig::new(
            0,
            vec![l.local_addr().unwrap().to_string(), "127.0.0.1:1".into()],
        );
        cfg.rendezvous_timeout = Duration::from_millis(300);
        let e = TcpComm::with_listener(&cfg, l).err().unwrap();
        assert_eq!(e.kind, CommErrorKind::Rendezvous);
        let one = TcpConfig::new(0, vec!["127.0.0.1:0".into()]);
        assert_eq!(
            TcpComm::connect(&one).err().unwrap().kind,
            CommErrorKind::Invalid
        );
    }

    /// Forms a group of `secrets.len()` on loopback, rank `r` holding `secrets[r]`; `before` runs on the bound
    /// addresses before any rank starts.
    fn form(
        secrets: Vec<Option<&'static [u8]>>,
        timeout: Duration,
        before: impl FnOnce(&[String]),
    ) -> Vec<Result<TcpComm>> {
        let (listeners, addrs) = bound(secrets.len());
        before(&addrs);
        let handles: Vec<_> = listeners
            .into_iter()
            .zip(secrets)
            .enumerate()
            .map(|(r, (l, secret))| {
                let mut cfg = TcpConfig::new(r, addrs.clone());
                cfg.rendezvous_timeout = timeout;
                cfg.secret = secret.map(<[u8]>::to_vec);
                std::thread::spawn(move || TcpComm::with_listener(&cfg, l))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn the_ring_forms_among_holders_of_the_secret_despite_junk_on_its_ports() {
        let k: &'static [u8] = b"cluster-token";
        let mut junk = Vec::new();
        let out = form(
            vec![Some(k), Some(k), Some(k)],
            Duration::from_secs(20),
            |addrs| {
                // A stranger that writes garbage, and one that connects and says nothing, before the ranks start.
                let mut a = TcpStream::connect(&addrs[0]).unwrap();
                a.write_all(
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678901234567890123456789",
                )
                .unwrap();
                junk.push(a);
                junk.push(TcpStream::connect(&addrs[1]).unwrap());
            },
        );
        let comms: Vec<TcpComm> = out.into_iter().map(|r| r.unwrap()).collect();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || c.all_gather(&[c.rank() as f32]).unwrap()))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![0.0, 1.0, 2.0]);
        }
    }

    #[test]
    fn a_rank_without_the_secret_is_refused() {
        let k: &'static [u8] = b"cluster-token";
        for odd in [Some(&b"another-token"[..]), None] {
            let out = form(vec![Some(k), odd], Duration::from_secs(3), |_| {});
            for r in out {
                let e = r.err().expect("a group with a wrong secret must not form");
                assert_eq!(e.kind, CommErrorKind::Rendezvous, "{}", e.message);
            }
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1024))]

            /// Any byte stream from a peer: frames as they were framed, or a typed error; never a panic, never an
            /// allocation the stream did not pay for.
            #[test]
            fn any_byte_stream_decodes_to_frames_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
                let mut r = std::io::Cursor::new(bytes.clone());
                let mut consumed = 0usize;
                loop {
                    match read_frame(&mut r, 1, 1 << 16) {
                        Ok(f) => {
                            consumed += 8 + f.len();
                            prop_assert!(consumed <= bytes.len());
                        }
                        Err(e) => {
                            prop_assert!(matches!(e.kind, CommErrorKind::PeerLost | CommErrorKind::Protocol));
                            break;
                        }
                    }
                }
            }

            #[test]
            fn framed_payloads_round_trip(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
                let mut wire = Vec::new();
                for f in &frames {
                    wire.extend((f.len() as u64).to_le_bytes());
                    wire.extend(f);
                }
                let mut r = std::io::Cursor::new(wire);
                for f in &frames {
                    prop_assert_eq!(&read_frame(&mut r, 1, 1 << 16).unwrap(), f);
                }
            }
        }
    }
}
