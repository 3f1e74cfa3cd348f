//! The router's operator API (`parse.v1.Admin`) on its own port, behind a bearer token: workers, drain, stats,
//! policy. Also the live policy (defaults for requests that do not say); the statistics come from the router's
//! Prometheus registry.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use parse_core::{AcceptPolicy, DraftWindow, Mode, Verdict};
use parse_discovery::Role;
use parse_proto::v1::admin_server::{Admin, AdminServer};
use parse_proto::v1::drafter_client::DrafterClient;
use parse_proto::v1::verifier_client::VerifierClient;
use parse_proto::v1::{
    DrainRequest, DrainWorkerRequest, DrainWorkerResponse, GetPolicyRequest, GetStatsRequest,
    GetStatsResponse, ListWorkersRequest, ListWorkersResponse, Policy, SetPolicyRequest,
    WorkerState,
};
use tonic::{Request, Response, Status};

use crate::Router;
use crate::pool::Worker;

/// Defaults for requests that do not say, changed at run time by `SetPolicy`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LivePolicy {
    pub mode: Mode,
    pub accept: AcceptPolicy,
    /// Segments in a request's first draft.
    pub draft_segments: usize,
    /// Tokens one draft may hold.
    pub max_draft_tokens: usize,
}

impl LivePolicy {
    pub fn new(mode: Mode, accept: AcceptPolicy) -> Self {
        let w = DraftWindow::default();
        LivePolicy {
            mode,
            accept,
            draft_segments: w.initial_segments,
            max_draft_tokens: w.max_tokens,
        }
    }

    /// The draft window a request starts with.
    pub fn window(&self) -> DraftWindow {
        let d = DraftWindow::default();
        DraftWindow {
            initial_segments: self.draft_segments,
            max_segments: d.max_segments.max(self.draft_segments),
            max_tokens: self.max_draft_tokens,
            ..d
        }
    }

    fn to_proto(self) -> Policy {
        Policy {
            default_mode: self.mode.as_str().to_string(),
            tau: self.accept.tau,
            verdict: self.accept.verdict.as_str().to_string(),
            draft_segments: self.draft_segments as u32,
            max_draft_tokens: self.max_draft_tokens as u32,
        }
    }

    /// This policy with the fields `r` sets; refuses bad values.
    fn with(self, r: &SetPolicyRequest) -> Result<Self, Status> {
        let bad = |e: parse_core::Error| Status::invalid_argument(e.message);
        let mut p = self;
        if let Some(m) = &r.default_mode {
            p.mode = m.parse().map_err(bad)?;
        }
        if let Some(v) = &r.verdict {
            // A new verdict brings its own default tau unless the same call sets one (tau means something else).
            let v = v.parse::<Verdict>().map_err(bad)?;
            if v != p.accept.verdict {
                p.accept.verdict = v;
                p.accept.tau = v.default_tau();
            }
        }
        if let Some(t) = r.tau {
            p.accept.tau = t;
        }
        if let Some(n) = r.draft_segments {
            if !(1..=64).contains(&n) {
                return Err(Status::invalid_argument("draft_segments must be 1..=64"));
            }
            p.draft_segments = n as usize;
        }
        if let Some(n) = r.max_draft_tokens {
            if !(1..=1024).contains(&n) {
                return Err(Status::invalid_argument(
                    "max_draft_tokens must be 1..=1024",
                ));
            }
            p.max_draft_tokens = n as usize;
        }
        p.accept.validate().map_err(bad)?;
        Ok(p)
    }
}

/// Shared admin state of a router.
#[derive(Debug)]
pub struct AdminState {
    pub policy: RwLock<LivePolicy>,
}

fn state_of(role: Role, w: &Worker) -> WorkerState {
    WorkerState {
        id: w.id.clone(),
        role: role.as_str().to_string(),
        address: w.addr.clone(),
        healthy: w.healthy(),
        draining: w.draining(),
        outstanding: w.outstanding() as u32,
    }
}

/// The `Admin` service of a router.
#[derive(Clone)]
pub struct AdminService {
    router: Router,
    /// `Bearer <token>`.
    want: Arc<Vec<u8>>,
}

impl AdminService {
    /// Every call carries `authorization: Bearer <token>`, or gets UNAUTHENTICATED.
    fn authorize<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match req.metadata().get("authorization") {
            Some(v) if parse_proto::security::same_secret(v.as_bytes(), &self.want) => Ok(()),
            Some(_) => Err(Status::unauthenticated("wrong admin token")),
            None => Err(Status::unauthenticated(
                "the admin API needs `authorization: Bearer <token>`",
            )),
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn list_workers(
        &self,
        request: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        self.authorize(&request)?;
        let mut workers = Vec::new();
        for (role, pool) in [
            (Role::Draft, &self.router.drafts),
            (Role::Target, &self.router.targets),
        ] {
            workers.extend(pool.workers().iter().map(|w| state_of(role, w)));
        }
        Ok(Response::new(ListWorkersResponse { workers }))
    }

    async fn drain_worker(
        &self,
        request: Request<DrainWorkerRequest>,
    ) -> Result<Response<DrainWorkerResponse>, Status> {
        self.authorize(&request)?;
        let id = request.into_inner().id;
        let found = [
            (Role::Draft, &self.router.drafts),
            (Role::Target, &self.router.targets),
        ]
        .into_iter()
        .find_map(|(role, pool)| {
            pool.workers()
                .into_iter()
                .find(|w| w.id == id)
                .map(|w| (role, w))
        });
        let Some((role, w)) = found else {
            return Err(Status::not_found(format!("no worker `{id}`")));
        };
        // This router stops sending it work at once; other routers when its registration goes.
        w.set_draining();
        let mut req = Request::new(DrainRequest {});
        req.set_timeout(Duration::from_secs(5));
        let open = if role == Role::Draft {
            DrafterClient::new(w.channel.clone()).drain(req).await
        } else {
            VerifierClient::new(w.channel.clone()).drain(req).await
        }
        .map_err(|s| {
            Status::unavailable(format!(
                "worker `{id}` did not take the drain: {}",
                s.message()
            ))
        })?
        .into_inner()
        .open_sessions;
        tracing::info!(%id, role = role.as_str(), open, "draining");
        Ok(Response::new(DrainWorkerResponse {
            worker: Some(state_of(role, &w)),
            open_sessions: open,
        }))
    }

    async fn get_stats(
        &self,
        request: Request<GetStatsRequest>,
    ) -> Result<Response<GetStatsResponse>, Status> {
        self.authorize(&request)?;
        // The same registry `GET /metrics` serves.
        Ok(Response::new(self.router.metrics.stats()))
    }

    async fn get_policy(
        &self,
        request: Request<GetPolicyRequest>,
    ) -> Result<Response<Policy>, Status> {
        self.authorize(&request)?;
        let p = *self
            .router
            .admin
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner());
        Ok(Response::new(p.to_proto()))
    }

    async fn set_policy(
        &self,
        request: Request<SetPolicyRequest>,
    ) -> Result<Response<Policy>, Status> {
        self.authorize(&request)?;
        let r = request.into_inner();
        let mut g = self
            .router
            .admin
            .policy
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let next = g.with(&r)?;
        *g = next;
        tracing::info!(policy = ?next, "policy changed");
        Ok(Response::new(next.to_proto()))
    }
}

/// Serves the admin API on `listener` until `shutdown`; every call must carry `authorization: Bearer <token>`.
pub async fn serve_admin(
    router: Router,
    listener: tokio::net::TcpListener,
    token: String,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if token.is_empty() {
        anyhow::bail!("the admin API needs a token");
    }
    let access = parse_proto::serve::Access::public(&router.cfg.security);
    let svc = AdminServer::new(AdminService {
        router,
        want: Arc::new(format!("Bearer {token}").into_bytes()),
    });
    parse_proto::serve::run(svc, listener, shutdown, access)
        .await
        .map_err(|e| anyhow::anyhow!(e))
}

/// The admin state a router starts with.
pub fn initial_state(mode: Mode, accept: AcceptPolicy) -> Arc<AdminState> {
    Arc::new(AdminState {
        policy: RwLock::new(LivePolicy::new(mode, accept)),
    })
}
