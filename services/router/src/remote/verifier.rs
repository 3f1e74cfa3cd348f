//! The router's side of a target group: [`RemoteVerifier`] holds a request's session on a target worker, verifies and
//! extends over gRPC, and moves the session to another worker (re-prefilling the accepted context) when one is lost.

use super::*;

/// The target side of one request.
pub struct RemoteVerifier {
    pool: Arc<Pool>,
    ctx: CallCtx,
    lease: Option<Lease>,
    lost: Vec<String>,
    /// What the session's cache holds, to rebuild it on another worker.
    cache: Vec<u32>,
    sampling: SamplingParams,
    opened: bool,
    pub failovers: usize,
    /// Ids of the workers this request was given, in order.
    pub used: Vec<String>,
    charged: Charged,
}

impl RemoteVerifier {
    pub fn new(pool: Arc<Pool>, ctx: CallCtx) -> Self {
        RemoteVerifier {
            pool,
            ctx,
            lease: None,
            lost: Vec::new(),
            cache: Vec::new(),
            sampling: SamplingParams::default(),
            opened: false,
            failovers: 0,
            used: Vec::new(),
            charged: Charged::default(),
        }
    }

    fn client(&mut self) -> Result<VerifierClient<WorkerChannel>> {
        if self.lease.is_none() {
            self.lease = self.pool.pick(&self.lost);
            if let Some(l) = &self.lease {
                self.used.push(l.worker.id.clone());
            }
        }
        let l = self
            .lease
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Unavailable, "no target worker available"))?;
        Ok(VerifierClient::new(l.worker.channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20))
    }

    /// Opens the session on the current worker with the mirrored cache.
    fn reopen(&mut self, session: &str) -> Result<()> {
        let mut client = self.client()?;
        let mut prompt = self.cache.clone();
        // `OpenSession` caches all but the last token; the last one here is a placeholder.
        prompt.push(0);
        let rows = prompt.len();
        let req = self.ctx.request_over(
            OpenSessionRequest {
                session: session.to_string(),
                prompt,
                sampling: Some((&self.sampling).into()),
            },
            rows,
        );
        let r = self
            .ctx
            .call(client.open_session(req))
            .map_err(|s| core_from_status(&s))?;
        self.charged.saw(r.into_inner().charged_ms);
        Ok(())
    }

    /// Runs `call` on the current worker. When that worker is lost or full, moves the session to another
    /// (re-prefilling the accepted context) and retries; when it no longer knows the session (restarted on the
    /// same address, or expired it), opens it there again and retries.
    fn with_failover<T>(
        &mut self,
        session: &str,
        mut call: impl FnMut(
            &CallCtx,
            &mut VerifierClient<WorkerChannel>,
        ) -> std::result::Result<T, tonic::Status>,
    ) -> Result<T> {
        let mut reopened_in_place = 0;
        loop {
            self.ctx.check()?;
            let mut client = self.client()?;
            match call(&self.ctx, &mut client) {
                Ok(v) => return Ok(v),
                Err(s) => {
                    let e = core_from_status(&s);
                    if !is_recoverable(&self.ctx, &e) {
                        return Err(e);
                    }
                    if e.kind == ErrorKind::NotFound && self.opened && reopened_in_place < 2 {
                        // Same worker, new process (or an expired session): the mirrored cache rebuilds it.
                        reopened_in_place += 1;
                        tracing::warn!(
                            "target worker lost the session; opening it again: {}",
                            e.message
                        );
                        self.failovers += 1;
                        self.charged.left();
                        self.reopen_elsewhere(session)?;
                        continue;
                    }
                    self.leave_worker(session, &e);
                    self.failovers += 1;
                    if self.opened {
                        self.reopen_elsewhere(session)?;
                    } else if self.pool.pick(&self.lost).is_none() {
                        // Nothing else to try: the worker's own answer (RESOURCE_EXHAUSTED tells the client to
                        // come back later).
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Leaves the current worker for this request: a lost one is marked failed for every request, a full one is
    /// only skipped by this one.
    fn leave_worker(&mut self, session: &str, e: &Error) {
        if let Some(l) = self.lease.take() {
            leave(&self.ctx, l, session, Side::Target, e, &mut self.lost);
        }
        self.charged.left();
    }

    /// Re-prefills the accepted context on the current worker (or, when there is none, the next one picked),
    /// moving on while workers are lost or full. With none left: the last worker's error, RESOURCE_EXHAUSTED when
    /// they were full (a client may retry later), UNAVAILABLE when none is there.
    fn reopen_elsewhere(&mut self, session: &str) -> Result<()> {
        let mut tries = 0;
        loop {
            match self.reopen(session) {
                Ok(()) => return Ok(()),
                Err(e)
                    if is_recoverable(&self.ctx, &e)
                        && e.kind != ErrorKind::NotFound
                        && tries < 8 =>
                {
                    tries += 1;
                    self.leave_worker(session, &e);
                    if self.pool.pick(&self.lost).is_none() {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Verifier for RemoteVerifier {
    fn open(&mut self, session: &str, prompt: &[u32], sampling: &SamplingParams) -> Result<usize> {
        if prompt.is_empty() {
            return Err(Error::invalid("empty prompt"));
        }
        self.sampling = sampling.clone();
        let wire_sampling = Some(sampling.into());
        let r = self.with_failover(session, |ctx, c| {
            let req = ctx.request_over(
                OpenSessionRequest {
                    session: session.to_string(),
                    prompt: prompt.to_vec(),
                    sampling: wire_sampling,
                },
                prompt.len(),
            );
            ctx.call(c.open_session(req))
        })?;
        let r = r.into_inner();
        self.charged.saw(r.charged_ms);
        self.cache = prompt[..prompt.len() - 1].to_vec();
        self.opened = true;
        // A worker's count, bounded by what it could have reused.
        Ok((r.cached_tokens as usize).min(self.cache.len()))
    }

    fn verify(&mut self, session: &str, plan: &VerifyPlan) -> Result<VerifyOutput> {
        let wire = verify_request(session, plan);
        let r = self.with_failover(session, |ctx, c| {
            ctx.call(c.verify(ctx.request(wire.clone())))
        })?;
        self.cache.extend(&plan.tokens);
        let r = r.into_inner();
        self.charged.saw(r.charged_ms);
        verify_output_from(r)
    }

    fn extend(
        &mut self,
        session: &str,
        pending: u32,
        max: usize,
        segment: Option<&SegmenterConfig>,
    ) -> Result<ExtendOutput> {
        let req = ExtendRequest {
            session: session.to_string(),
            pending,
            max_tokens: max.clamp(1, u32::MAX as usize) as u32,
            segment: segment.map(Into::into),
        };
        let r = self
            .with_failover(session, |ctx, c| {
                ctx.call(c.extend(ctx.request(req.clone())))
            })?
            .into_inner();
        self.charged.saw(r.charged_ms);
        if r.tokens.is_empty() {
            return Err(Error::internal("the target worker extended by no token"));
        }
        self.cache.push(pending);
        self.cache.extend(&r.tokens[..r.tokens.len() - 1]);
        Ok(ExtendOutput {
            tokens: r.tokens,
            pieces: r.pieces,
        })
    }

    fn truncate(&mut self, session: &str, len: usize) -> Result<()> {
        self.with_failover(session, |ctx, c| {
            ctx.call(c.truncate(ctx.request(TruncateRequest {
                session: session.to_string(),
                len: len as u32,
            })))
        })?;
        self.cache.truncate(len);
        Ok(())
    }

    fn release(&mut self, session: &str) -> Result<()> {
        if let Some(l) = self.lease.take() {
            release_at_end(&self.ctx, &l, session, Side::Target);
        }
        self.opened = false;
        Ok(())
    }

    fn charged_ms(&self) -> Option<f64> {
        Some(self.charged.total())
    }
}
