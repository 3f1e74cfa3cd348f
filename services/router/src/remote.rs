//! gRPC-backed [`Drafter`] and [`Verifier`] for the one PARSE loop, with failover.
//!
//! The loop is synchronous and runs on a blocking thread; each call here blocks on the runtime's handle.
//!
//! - Draft worker lost: the current draft ends early (the loop verifies what it got), the next draft starts on
//!   another worker; with none left the drafter returns empty drafts, so the loop finishes with the target alone
//!   (`fell_back_to_target`).
//! - Target worker lost: the verifier keeps a mirror of the session's cache (prompt, verified blocks, truncations,
//!   extensions), re-prefills it on another worker and retries the call.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parse_core::driver::{DraftChunk, DraftHints, Drafter, ExtendOutput, Verifier};
use parse_core::policy::VerifyOutput;
use parse_core::retry::{self, Retryable};
use parse_core::{Error, ErrorKind, Result, SamplingParams, SegmenterConfig, VerifyPlan};
use parse_proto::v1::drafter_client::DrafterClient;
use parse_proto::v1::verifier_client::VerifierClient;
use parse_proto::v1::{
    DistributionRequest, DraftRequest, DraftResponse, ExtendRequest, OpenSessionRequest,
    ReleaseRequest, TruncateRequest,
};
use parse_proto::{core_from_status, dist_from, verify_output_from, verify_request};
use parse_text::Tokenizer;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;

use crate::pool::{Lease, Pool, WorkerChannel};

mod verifier;
pub use verifier::RemoteVerifier;

/// Limits and cancellation shared by both sides of one request.
#[derive(Clone)]
pub struct CallCtx {
    pub handle: Handle,
    /// The request's token (a child of the router's): cancelled when the client goes away or the router shuts
    /// down. A cancelled request drops its in-flight worker calls, which cancels them on the workers.
    pub cancel: CancellationToken,
    pub deadline: Option<Instant>,
    /// The longest one worker call may take (within the deadline, if any).
    pub call_timeout: Duration,
}

impl CallCtx {
    /// Runs a worker call on the runtime until it answers or the request is cancelled (CANCELLED, and the call's
    /// future is dropped: the worker sees the RPC cancelled).
    fn call<T>(
        &self,
        f: impl std::future::Future<Output = std::result::Result<T, tonic::Status>>,
    ) -> std::result::Result<T, tonic::Status> {
        self.handle
            .block_on(async {
                tokio::select! {
                    r = f => r,
                    _ = self.cancel.cancelled() => {
                        Err(tonic::Status::cancelled("the client cancelled the request"))
                    }
                }
            })
            .map_err(|s| self.timed_out(s))
    }

    /// tonic ends a call past its limit as CANCELLED "Timeout expired"; this request did not cancel it: a worker
    /// that did not answer in time, DEADLINE_EXCEEDED with the limits it met (504 on the OpenAI API, not a 500).
    fn timed_out(&self, s: tonic::Status) -> tonic::Status {
        if s.code() == tonic::Code::Cancelled
            && s.message() == "Timeout expired"
            && !self.cancel.is_cancelled()
        {
            let limit = self.call_timeout.as_secs_f64();
            tonic::Status::deadline_exceeded(format!(
                "a worker did not answer within the request's deadline or the router's per-call limit ({limit:.0} s, \
                 --worker-call-timeout-s; more for calls that prefill over {CALL_LIMIT_ROWS} tokens)"
            ))
        } else {
            s
        }
    }

    fn check(&self) -> Result<()> {
        if self.cancel.is_cancelled() {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "the client cancelled the request",
            ));
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::new(ErrorKind::DeadlineExceeded, "deadline exceeded"));
        }
        Ok(())
    }

    /// A worker call's request: the deadline, and the current span's trace context (the PARSE round it belongs
    /// to) so that the worker's span joins the request's trace.
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        self.request_over(msg, 0)
    }

    /// A worker call's request that may prefill up to `rows` context tokens (a prompt, a drafter's catching up):
    /// its limit grows with them ([`call_limit`]), the request's own deadline still bounding it.
    fn request_over<T>(&self, msg: T, rows: usize) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        parse_proto::telemetry::inject(r.metadata_mut());
        let limit = call_limit(self.call_timeout, rows);
        let left = self
            .deadline
            .map_or(limit, |d| d.saturating_duration_since(Instant::now()));
        r.set_timeout(left.min(limit));
        r
    }
}

/// Context tokens a call may prefill within the router's per-call limit (`--worker-call-timeout-s`).
pub const CALL_LIMIT_ROWS: usize = 8192;

/// The limit of a call that may prefill `rows` context tokens: `base` up to [`CALL_LIMIT_ROWS`], beyond them `base`
/// times the square of `rows / CALL_LIMIT_ROWS`, as attention's share of a prefill grows with the square of its rows
/// (one request's prompt of 4,000 tokens took 33 s, of 8,000 96 s, of 16,000 7.7 minutes on a 2-core Zen 4 EPYC; one of
/// 32,761 met the default 300 s as a worker taken for wedged). The limit finds a wedged worker; a slow prefill of a
/// long prompt is not one.
pub fn call_limit(base: Duration, rows: usize) -> Duration {
    let r = rows as f64 / CALL_LIMIT_ROWS as f64;
    base.mul_f64(r.max(1.0).powi(2))
}

/// How long a session release may take; past it the worker's session TTL frees the session.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the router keeps trying to free a session on a worker a request left: the sum of the delays between its
/// attempts.
const ORPHAN_RELEASE_FOR: Duration = Duration::from_secs(120);

#[derive(Clone, Copy)]
enum Side {
    Draft,
    Target,
}

impl Side {
    fn role(self) -> &'static str {
        match self {
            Side::Draft => "draft",
            Side::Target => "target",
        }
    }
}

/// How long a worker whose call ran past its limit has to answer a health check to count as slow rather than lost.
const SLOW_OR_LOST_PROBE: Duration = Duration::from_secs(2);

/// Leaves a worker for the rest of a request after `e`: a lost one is marked failed for every request, a full one
/// only skipped by this one; either way the request's session there is freed in the background. A worker whose
/// call ran past its limit but that answers a health check at once is slow (a long prefill, a queue behind other
/// requests), not lost: only this request leaves it. Marked failed, it turned every request arriving before the
/// prober's next round away with "no target worker available".
fn leave(ctx: &CallCtx, l: Lease, session: &str, side: Side, e: &Error, lost: &mut Vec<String>) {
    release_orphan(&ctx.handle, &l, session, side);
    let role = side.role();
    let slow = || {
        e.kind == ErrorKind::DeadlineExceeded
            && ctx
                .handle
                .block_on(l.worker.answers_health(SLOW_OR_LOST_PROBE))
    };
    if is_lost(ctx, e) && slow() {
        tracing::warn!(addr = %l.worker.addr, "{role} worker too slow for this request, still serving: {}", e.message);
    } else if is_lost(ctx, e) {
        tracing::warn!(addr = %l.worker.addr, "{role} worker lost: {}", e.message);
        l.worker.mark_failed();
    } else {
        tracing::info!(addr = %l.worker.addr, "{role} worker skipped for this request: {}", e.message);
    }
    lost.push(l.worker.addr.clone());
}

/// One `Release` of `session` on `channel`'s worker, within `timeout`.
async fn release_once(
    channel: &WorkerChannel,
    session: &str,
    side: Side,
    timeout: Duration,
) -> std::result::Result<(), tonic::Status> {
    let mut req = tonic::Request::new(ReleaseRequest {
        session: session.to_string(),
    });
    parse_proto::telemetry::inject(req.metadata_mut());
    req.set_timeout(timeout);
    match side {
        Side::Draft => DrafterClient::new(channel.clone())
            .release(req)
            .await
            .map(drop),
        Side::Target => VerifierClient::new(channel.clone())
            .release(req)
            .await
            .map(drop),
    }
}

/// Whether a failed release is worth sending again: the worker did not answer (wedged, unreachable, its connection
/// dropped) or was full. Any other answer (NOT_FOUND from a restarted worker among them) ends the session's life.
fn release_again(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Unknown
            | tonic::Code::ResourceExhausted
    )
}

/// Frees `session` on a worker this request left (lost, wedged or full), in the background: a worker that comes
/// back (a stopped process continued, a partition healed) drops the session at once rather than after its TTL, and
/// one that restarted answers NOT_FOUND, which ends it too. After [`ORPHAN_RELEASE_FOR`] the worker's TTL is left
/// to do it.
fn release_orphan(handle: &Handle, lease: &Lease, session: &str, side: Side) {
    let channel = lease.worker.channel.clone();
    let session = session.to_string();
    handle.spawn(async move {
        // A worker that comes back is freed within a few seconds (at most twice the cap, jitter included).
        let delays = retry::backoff(
            Duration::from_secs(1),
            Duration::from_secs(5),
            Some(ORPHAN_RELEASE_FOR),
        );
        let _ = (|| release_once(&channel, &session, side, Duration::from_secs(5)))
            .retry(delays)
            .sleep(tokio::time::sleep)
            .when(release_again)
            .await;
    });
}

/// Frees a finished request's `session` on its worker: once, within [`RELEASE_TIMEOUT`] (the request's own
/// deadline does not bound the cleanup, and a wedged worker must not hold the request's end longer), and, when the
/// worker did not answer, again in the background as for a worker the request left ([`release_orphan`]): a worker
/// stopped just as the request finished frees the session when it runs again, not after its TTL.
fn release_at_end(ctx: &CallCtx, lease: &Lease, session: &str, side: Side) {
    let r = ctx.handle.block_on(release_once(
        &lease.worker.channel,
        session,
        side,
        RELEASE_TIMEOUT,
    ));
    if let Err(s) = r {
        let role = side.role();
        tracing::warn!(addr = %lease.worker.addr, "{role} release failed: {}", s.message());
        if release_again(&s) {
            release_orphan(&ctx.handle, lease, session, side);
        }
    }
}

/// Whether a worker call failed because the worker (or the connection to it) is gone. A dropped HTTP/2
/// connection surfaces as CANCELLED, which means "lost" unless this request itself was cancelled; a call that ran
/// past the router's per-call limit while the request's own deadline had not passed means a wedged worker (a
/// stopped process, a partition the connection has not noticed yet).
fn is_lost(ctx: &CallCtx, e: &Error) -> bool {
    match e.kind {
        ErrorKind::Unavailable => true,
        ErrorKind::Cancelled => !ctx.cancel.is_cancelled(),
        ErrorKind::DeadlineExceeded => ctx.deadline.is_none_or(|d| Instant::now() < d),
        _ => false,
    }
}

/// Whether a worker's answer leaves the request something to try elsewhere: the worker is lost, full
/// (RESOURCE_EXHAUSTED: its sessions, streams or KV are taken; another worker may have room), or no longer knows
/// the session (NOT_FOUND: it restarted on the same address, or expired the session). Invalid input is not: it
/// would be refused everywhere.
fn is_recoverable(ctx: &CallCtx, e: &Error) -> bool {
    is_lost(ctx, e) || matches!(e.kind, ErrorKind::ResourceExhausted | ErrorKind::NotFound)
}

/// A Draft stream the loop reads: the call's own, or one opened ahead by `prefetch` and read into a buffer by a
/// task on the runtime (dropping it aborts the task, which cancels the worker's producer).
enum DraftStream {
    Direct(Box<Streaming<DraftResponse>>),
    Ahead(
        mpsc::UnboundedReceiver<std::result::Result<DraftResponse, tonic::Status>>,
        AbortHandle,
    ),
}

impl DraftStream {
    async fn message(&mut self) -> std::result::Result<Option<DraftResponse>, tonic::Status> {
        match self {
            DraftStream::Direct(s) => s.message().await,
            DraftStream::Ahead(rx, _) => rx.recv().await.transpose(),
        }
    }
}

impl Drop for DraftStream {
    fn drop(&mut self) {
        if let DraftStream::Ahead(_, task) = self {
            task.abort();
        }
    }
}

/// Worker time charged to one side of a request ([`Verifier::charged_ms`]): each worker reports what it has charged
/// the session in all, so a reply lost on the way (a prefetch thrown away) is made up by the next one; a request
/// that moves to another worker keeps what the last one charged.
#[derive(Debug, Default)]
struct Charged {
    left_behind: f64,
    current: f64,
}

impl Charged {
    /// A reply from the current worker: it has charged the session `ms` in all.
    fn saw(&mut self, ms: f64) {
        if ms.is_finite() && ms > self.current {
            self.current = ms;
        }
    }

    /// The request leaves its worker (or the worker lost its session): what it charged there is kept.
    fn left(&mut self) {
        self.left_behind += std::mem::take(&mut self.current);
    }

    fn total(&self) -> f64 {
        self.left_behind + self.current
    }
}

/// Whether a request's draft worker works beside the target: processes the prompt beside the target's prefill
/// ([`DraftHints::warm`]), and drafts the next token-level round while the target verifies this one, guessing the
/// target's next token ([`DraftHints::prefetch_guessing`]). Both use the draft worker's compute while the target
/// computes, which pays where the two do not share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillBeside {
    Always,
    Never,
    /// Where the draft worker's host is none of these (the target workers' hosts).
    OffHosts(Vec<String>),
}

/// The host of a worker address (`host:port`, `[v6]:port`, with or without a scheme).
pub fn host_of(addr: &str) -> &str {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.split('/').next().unwrap_or(rest);
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => rest,
    }
}

/// A prefill started beside the target's ([`DraftHints::warm`]).
struct Warming {
    context: Vec<u32>,
    sampling: SamplingParams,
    task: tokio::task::JoinHandle<std::result::Result<f64, tonic::Status>>,
}

impl Drop for Warming {
    fn drop(&mut self) {
        // A request that ends (or is cancelled) before its first draft stops the call; the worker sees it cancelled.
        self.task.abort();
    }
}

/// A draft opened ahead of its `begin`.
struct Prefetch {
    context: Vec<u32>,
    sampling: SamplingParams,
    stream: DraftStream,
    /// Opened by `prefetch_guessing`: a `begin` may also continue `context` and the stream's first token.
    guessing: bool,
}

/// The draft side of one request.
pub struct RemoteDrafter {
    pool: Arc<Pool>,
    ctx: CallCtx,
    tokenizer: Arc<Tokenizer>,
    lease: Option<Lease>,
    lost: Vec<String>,
    stream: Option<DraftStream>,
    prefetch: Option<Prefetch>,
    context: Vec<u32>,
    sampling: SamplingParams,
    /// Tokens received since `begin`, and how many of them came before the current worker stream began (the
    /// worker numbers its draft distributions from its own begin).
    received: usize,
    stream_base: usize,
    /// Whether the prompt was sent to a worker yet.
    prefilled: bool,
    /// The prompt's prefill started by `warm` (its context, sampling, and the task that runs the call, which
    /// answers the worker's charge), until the first `begin` waits for it.
    warming: Option<Warming>,
    /// Tokens one Draft stream may produce.
    max_tokens: u32,
    done: bool,
    pub failovers: usize,
    pub fell_back: bool,
    /// Drafts that were already under way when the loop asked for them (opened during the previous verification),
    /// and prefetches thrown away because the verification cut the draft short.
    pub prefetch_hits: usize,
    pub prefetch_misses: usize,
    /// Whether `prefetch` opens streams at all.
    pub draft_ahead: bool,
    /// Whether `warm` starts the prompt's prefill beside the target's, and `prefetch_guessing` drafts at all.
    pub prefill_beside: PrefillBeside,
    /// Ids of the workers this request was given, in order.
    pub used: Vec<String>,
    charged: Charged,
}

impl RemoteDrafter {
    pub fn new(pool: Arc<Pool>, ctx: CallCtx, tokenizer: Arc<Tokenizer>, max_tokens: u32) -> Self {
        RemoteDrafter {
            pool,
            ctx,
            tokenizer,
            lease: None,
            lost: Vec::new(),
            stream: None,
            prefetch: None,
            context: Vec::new(),
            sampling: SamplingParams::default(),
            received: 0,
            stream_base: 0,
            prefilled: false,
            warming: None,
            max_tokens: max_tokens.max(1),
            done: false,
            failovers: 0,
            fell_back: false,
            prefetch_hits: 0,
            prefetch_misses: 0,
            draft_ahead: true,
            prefill_beside: PrefillBeside::Never,
            used: Vec::new(),
            charged: Charged::default(),
        }
    }

    fn client(&self) -> Option<DrafterClient<WorkerChannel>> {
        self.lease.as_ref().map(|l| {
            DrafterClient::new(l.worker.channel.clone())
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20)
        })
    }

    /// Drops the current worker after a failure the request can go on from ([`is_recoverable`]); the next draft
    /// goes elsewhere. Only a lost worker is marked failed for every request (a full one is skipped by this one).
    fn lose_worker(&mut self, session: &str, e: &Error) {
        if let Some(l) = self.lease.take() {
            leave(&self.ctx, l, session, Side::Draft, e, &mut self.lost);
            self.failovers += 1;
        }
        self.charged.left();
        self.stream = None;
        self.prefetch = None;
        self.warming = None;
    }

    /// Whether the leased draft worker works beside the target ([`PrefillBeside`]).
    fn beside_target(&self) -> bool {
        match &self.prefill_beside {
            PrefillBeside::Always => true,
            PrefillBeside::Never => false,
            PrefillBeside::OffHosts(hosts) => self
                .lease
                .as_ref()
                .is_some_and(|l| hosts.iter().all(|h| h != host_of(&l.worker.addr))),
        }
    }

    /// A begin's use of a draft opened by `prefetch_guessing` from one token less than `context`: the stream's first
    /// token is read (it was drafted during the verification, so it is most likely there) and, where it is that
    /// last token, the stream goes on as this begin's draft. Only a greedy draft, whose tokens after the guess are
    /// what a draft from `context` would write, and only a first message of one token (the worker sends one per
    /// step), so that nothing read is left over.
    fn take_guessed(&mut self, p: Prefetch, context: &[u32], sampling: &SamplingParams) -> bool {
        let Some((last, before)) = context.split_last() else {
            return false;
        };
        if !p.guessing || !sampling.is_greedy() || p.sampling != *sampling || p.context != before {
            return false;
        }
        let mut stream = p.stream;
        match self.ctx.call(stream.message()) {
            Ok(Some(m)) if m.tokens == [*last] => {
                self.charged.saw(m.charged_ms);
                // The draft ended at the guessed token: nothing follows it.
                self.done = m.done;
                self.stream = (!m.done).then_some(stream);
                true
            }
            // Another token, no token, or an error: dropped, and this begin's first Draft call rewinds the worker's
            // cache (an error that stays shows there).
            _ => false,
        }
    }

    /// Opens a Draft stream from `context` for `tokens` tokens now, read into a buffer on the runtime until a begin
    /// takes it ([`DraftHints::prefetch`]; with `guessing`, [`DraftHints::prefetch_guessing`]).
    fn draft_ahead_from(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
        guessing: bool,
    ) -> Result<()> {
        self.ctx.check()?;
        if !self.draft_ahead {
            return Ok(());
        }
        // The current stream drafts past the loop's cut; the worker serves one stream per session, and this one
        // replaces it.
        self.stream = None;
        self.prefetch = None;
        let Some(mut client) = self.client() else {
            return Ok(());
        };
        let req = self.ctx.request_over(
            DraftRequest {
                session: session.to_string(),
                context: context.to_vec(),
                sampling: Some(sampling.into()),
                max_tokens: (tokens as u32).clamp(1, self.max_tokens),
            },
            context.len(),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let task = self.ctx.handle.spawn(async move {
            let mut stream = match client.draft(req).await {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    let _ = tx.send(Err(s));
                    return;
                }
            };
            loop {
                match stream.message().await {
                    Ok(Some(m)) => {
                        if tx.send(Ok(m)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(s) => {
                        let _ = tx.send(Err(s));
                        return;
                    }
                }
            }
        });
        self.prefetch = Some(Prefetch {
            context: context.to_vec(),
            sampling: sampling.clone(),
            stream: DraftStream::Ahead(rx, task.abort_handle()),
            guessing,
        });
        Ok(())
    }

    fn ensure_worker(&mut self) {
        if self.lease.is_none() && !self.fell_back {
            self.lease = self.pool.pick(&self.lost);
            match &self.lease {
                Some(l) => self.used.push(l.worker.id.clone()),
                None => {
                    tracing::warn!("no draft worker left: finishing with the target alone");
                    self.fell_back = true;
                }
            }
        }
    }
}

impl Drafter for RemoteDrafter {
    fn begin(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<()> {
        self.ctx.check()?;
        // Dropping the previous stream cancels its producer on the worker.
        self.stream = None;
        self.context = context.to_vec();
        self.sampling = sampling.clone();
        self.done = false;
        self.received = 0;
        self.stream_base = 0;
        if let Some(p) = self.prefetch.take() {
            if p.context == context && p.sampling == *sampling {
                // The draft the worker began during the verification: its tokens continue exactly this context.
                self.stream = Some(p.stream);
                self.prefetch_hits += 1;
            } else if self.take_guessed(p, context, sampling) {
                // Begun from the context before the target's last token, which the draft guessed.
                self.prefetch_hits += 1;
            } else {
                // Dropped: the worker's producer is cancelled, and this begin's Draft call rewinds its cache.
                self.prefetch_misses += 1;
            }
        }
        if let Some(mut w) = self.warming.take() {
            // The prompt's prefill began beside the target's: wait for what is left of it.
            let ended = self.ctx.call(async {
                (&mut w.task).await.unwrap_or_else(|e| {
                    Err(tonic::Status::internal(format!(
                        "the draft prefill's task ended: {e}"
                    )))
                })
            });
            match ended {
                Ok(ms) => {
                    self.charged.saw(ms);
                    // The worker has this context; a longer one (the target wrote before the first draft) is
                    // extended by the usual prefill call below.
                    self.prefilled = w.context == context && w.sampling == *sampling;
                }
                Err(s) => {
                    let e = core_from_status(&s);
                    if !is_recoverable(&self.ctx, &e) {
                        return Err(e);
                    }
                    self.lose_worker(session, &e);
                }
            }
        }
        if !self.prefilled {
            // The first begin processes the prompt now (a stream of no tokens), so that the loop counts it as
            // prefill, as in process; later begins extend the worker's cache inside the first `next`.
            self.prefilled = true;
            self.ensure_worker();
            if let Some(mut client) = self.client() {
                let req = self.ctx.request_over(
                    DraftRequest {
                        session: session.to_string(),
                        context: self.context.clone(),
                        sampling: Some((&self.sampling).into()),
                        max_tokens: 0,
                    },
                    self.context.len(),
                );
                let charged = &mut self.charged;
                let drained = self.ctx.call(async {
                    let mut s = client.draft(req).await?.into_inner();
                    while let Some(m) = s.message().await? {
                        charged.saw(m.charged_ms);
                    }
                    Ok::<(), tonic::Status>(())
                });
                if let Err(s) = drained {
                    let e = core_from_status(&s);
                    if !is_recoverable(&self.ctx, &e) {
                        return Err(e);
                    }
                    self.lose_worker(session, &e);
                }
            }
        }
        Ok(())
    }

    fn next(&mut self, session: &str, max: usize) -> Result<DraftChunk> {
        self.ctx.check()?;
        let mut chunk = DraftChunk::default();
        // A stream that ends without a token while this call still wants some means the worker has nothing more.
        let mut fresh_stream_empty = false;
        while chunk.tokens.len() < max && !self.done && !fresh_stream_empty {
            self.ensure_worker();
            let Some(mut client) = self.client() else {
                // No draft worker: an empty, finished draft makes the loop go on with the target.
                self.done = true;
                break;
            };
            let fresh = self.stream.is_none();
            if fresh {
                // Ask for what this call still wants: a worker drafting ahead of the loop would spend CPU on
                // tokens a rejection throws away. The worker keeps its cache, so a continuation costs one round
                // trip.
                let want = (max - chunk.tokens.len()) as u32;
                let mut context = self.context.clone();
                context.extend(&chunk.tokens);
                let rows = context.len();
                let req = self.ctx.request_over(
                    DraftRequest {
                        session: session.to_string(),
                        context,
                        sampling: Some((&self.sampling).into()),
                        max_tokens: want.min(self.max_tokens),
                    },
                    rows,
                );
                match self.ctx.call(client.draft(req)) {
                    Ok(r) => {
                        self.stream = Some(DraftStream::Direct(Box::new(r.into_inner())));
                        self.stream_base = self.received + chunk.tokens.len();
                    }
                    Err(s) => {
                        let e = core_from_status(&s);
                        if is_recoverable(&self.ctx, &e) {
                            // The loop verifies what it has; the next draft goes to another worker.
                            self.lose_worker(session, &e);
                            self.done = true;
                            break;
                        }
                        return Err(e);
                    }
                }
            }
            let Some(stream) = self.stream.as_mut() else {
                break;
            };
            match self.ctx.call(stream.message()) {
                Ok(Some(m)) => {
                    self.charged.saw(m.charged_ms);
                    chunk.tokens.extend(m.tokens);
                    chunk.pieces.extend(m.pieces);
                    chunk.probs.extend(m.probs);
                    if m.done {
                        self.done = true;
                    }
                }
                // The stream delivered what it was asked for; a continuation follows if this call wants more.
                Ok(None) => {
                    self.stream = None;
                    fresh_stream_empty = fresh;
                }
                Err(s) => {
                    let e = core_from_status(&s);
                    if is_recoverable(&self.ctx, &e) {
                        self.lose_worker(session, &e);
                        self.done = true;
                        break;
                    }
                    return Err(e);
                }
            }
        }
        self.context.extend(&chunk.tokens);
        self.received += chunk.tokens.len();
        chunk.done = self.done;
        Ok(chunk)
    }

    fn distribution(&mut self, session: &str, index: usize) -> Result<Vec<(u32, f32)>> {
        self.ctx.check()?;
        let mut client = self
            .client()
            .ok_or_else(|| Error::new(ErrorKind::Unavailable, "the draft worker was lost"))?;
        // The loop reads a sampled draft with one `next` call, so one worker stream holds every index it asks for.
        let local = index.checked_sub(self.stream_base).ok_or_else(|| {
            Error::internal(format!(
                "draft token {index} came from an earlier stream than the current one"
            ))
        })?;
        let req = self.ctx.request(DistributionRequest {
            session: session.to_string(),
            index: local as u32,
        });
        let r = self
            .ctx
            .call(client.distribution(req))
            .map_err(|s| core_from_status(&s))?
            .into_inner();
        dist_from(r.tokens, r.probs)
    }

    fn pieces(&mut self, tokens: &[u32]) -> Result<Vec<String>> {
        Ok(self.tokenizer.pieces(tokens)?)
    }

    fn release(&mut self, session: &str) -> Result<()> {
        self.stream = None;
        self.prefetch = None;
        self.warming = None;
        if let Some(l) = self.lease.take() {
            release_at_end(&self.ctx, &l, session, Side::Draft);
        }
        Ok(())
    }
}

impl DraftHints for RemoteDrafter {
    fn prefetch(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        self.draft_ahead_from(session, context, sampling, tokens, false)
    }
    fn prefetch_guessing(
        &mut self,
        session: &str,
        context: &[u32],
        sampling: &SamplingParams,
        tokens: usize,
    ) -> Result<()> {
        if !self.beside_target() {
            return self.ctx.check();
        }
        // One token more: the guess of the target's, which the next begin's context ends with on a hit.
        self.draft_ahead_from(session, context, sampling, tokens + 1, true)
    }
    fn warm(&mut self, session: &str, context: &[u32], sampling: &SamplingParams) -> Result<bool> {
        self.ctx.check()?;
        if self.prefilled || self.warming.is_some() || self.prefill_beside == PrefillBeside::Never {
            return Ok(false);
        }
        if let PrefillBeside::OffHosts(hosts) = &self.prefill_beside
            && self
                .pool
                .workers()
                .iter()
                .all(|w| hosts.iter().any(|h| h == host_of(&w.addr)))
        {
            // Every draft worker shares a host with a target worker: no worker is leased before the first draft.
            return Ok(false);
        }
        self.ensure_worker();
        if !self.beside_target() {
            return Ok(false);
        }
        let Some(mut client) = self.client() else {
            return Ok(false);
        };
        // The first begin's prefill call, made now on the runtime; that begin waits for it (see `begin`).
        let req = self.ctx.request_over(
            DraftRequest {
                session: session.to_string(),
                context: context.to_vec(),
                sampling: Some(sampling.into()),
                max_tokens: 0,
            },
            context.len(),
        );
        let cancel = self.ctx.cancel.clone();
        let task = self.ctx.handle.spawn(async move {
            let drain = async {
                let mut charged = 0f64;
                let mut s = client.draft(req).await?.into_inner();
                while let Some(m) = s.message().await? {
                    charged = charged.max(m.charged_ms);
                }
                Ok(charged)
            };
            tokio::select! {
                r = drain => r,
                _ = cancel.cancelled() => Err(tonic::Status::cancelled("the client cancelled the request")),
            }
        });
        self.warming = Some(Warming {
            context: context.to_vec(),
            sampling: sampling.clone(),
            task,
        });
        Ok(true)
    }
    fn charged_ms(&self) -> Option<f64> {
        Some(self.charged.total())
    }
}

#[cfg(test)]
mod tests;
