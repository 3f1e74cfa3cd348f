//! Worker discovery: workers register themselves, routers follow the members of each role.
//!
//! Keys are `/parse/v1/workers/{role}/{id}` holding a JSON [`WorkerInfo`]. With etcd ([`EtcdDiscovery`]) a worker's
//! key is attached to a lease (TTL configurable) that the worker keeps alive; a worker that dies stops the
//! keep-alives and its key disappears when the lease expires. A worker that loses its lease (etcd down or
//! partitioned) reports not-ready through its [`Registration`] and registers again as soon as etcd answers. A
//! follower of a role ([`Discovery::watch`]) reads the prefix, then applies the watch's events as they come (well
//! within a second), and keeps the last known members through an etcd outage, re-reading the prefix when etcd is
//! back. [`StaticDiscovery`] serves fixed lists (flags) through the same interface.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use parse_core::retry::{self, Pauses, Retryable};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// How this process signs in to etcd: set once, from its flags, before any connection ([`configure_etcd`]). One
/// process talks to one etcd cluster, so this is process-wide rather than threaded through every call.
static ETCD_AUTH: std::sync::OnceLock<EtcdAuth> = std::sync::OnceLock::new();

/// TLS and user/password for etcd.
#[derive(Clone, Default)]
pub struct EtcdAuth {
    tls: Option<etcd_client::TlsOptions>,
    user: Option<(String, String)>,
}

/// etcd's TLS and authentication, shared by the router and the workers.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EtcdAuthArgs {
    /// CA (PEM) etcd's server certificate must chain to; turns TLS to etcd on (endpoints become https).
    #[arg(long, env = parse_core::env::ETCD_CA)]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for etcd's client-certificate authentication (with --etcd-key).
    #[arg(long, env = parse_core::env::ETCD_CERT, requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<std::path::PathBuf>,
    #[arg(long, env = parse_core::env::ETCD_KEY, requires_all = ["etcd_cert", "etcd_ca"])]
    pub etcd_key: Option<std::path::PathBuf>,
    /// etcd user (etcd's own authentication; with --etcd-password).
    #[arg(long, env = parse_core::env::ETCD_USER, requires = "etcd_password")]
    pub etcd_user: Option<String>,
    #[arg(
        long,
        env = parse_core::env::ETCD_PASSWORD,
        hide_env_values = true,
        requires = "etcd_user"
    )]
    pub etcd_password: Option<String>,
}

impl EtcdAuthArgs {
    pub fn load(&self) -> Result<EtcdAuth, DiscoveryError> {
        let read = |p: &std::path::Path| {
            std::fs::read(p)
                .map_err(|e| DiscoveryError::Etcd(format!("cannot read {}: {e}", p.display())))
        };
        let tls = match &self.etcd_ca {
            None => None,
            Some(ca) => {
                let mut t = etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
                if let (Some(c), Some(k)) = (&self.etcd_cert, &self.etcd_key) {
                    t = t.identity(etcd_client::Identity::from_pem(read(c)?, read(k)?));
                }
                Some(t)
            }
        };
        let user = match (&self.etcd_user, &self.etcd_password) {
            (Some(u), Some(p)) => Some((u.clone(), p.clone())),
            _ => None,
        };
        Ok(EtcdAuth { tls, user })
    }

    /// Loads and installs it for this process ([`configure_etcd`]).
    pub fn install(&self) -> Result<(), DiscoveryError> {
        configure_etcd(self.load()?)
    }
}

/// Sets how this process signs in to etcd; once, before the first connection.
pub fn configure_etcd(auth: EtcdAuth) -> Result<(), DiscoveryError> {
    ETCD_AUTH
        .set(auth)
        .map_err(|_| DiscoveryError::Etcd("authentication is already configured".into()))
}

/// Every key lives under this prefix.
pub const PREFIX: &str = "/parse/v1/workers/";

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Draft,
    Target,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Draft => "draft",
            Role::Target => "target",
        }
    }

    /// The key prefix of this role's workers.
    pub fn prefix(&self) -> String {
        format!("{PREFIX}{}/", self.as_str())
    }
}

/// What a worker publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub id: String,
    pub role: Role,
    /// Where its gRPC service answers (host:port).
    pub address: String,
    /// The model it serves (file name).
    pub model: String,
    /// Ranks of its tensor-parallel group (1 when alone).
    pub tp: u32,
    /// Requests it takes at once.
    pub capacity: u32,
    pub version: String,
}

impl WorkerInfo {
    pub fn key(&self) -> String {
        format!("{}{}", self.role.prefix(), self.id)
    }

    /// Checks the fields a router relies on.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        let bad = |m: &str| Err(DiscoveryError::Invalid(m.to_string()));
        if self.id.is_empty() || self.id.contains('/') || self.id.len() > 128 {
            return bad("a worker id must be 1 to 128 characters without `/`");
        }
        if self.address.is_empty() {
            return bad("a worker needs an address");
        }
        Ok(())
    }
}

/// The members of one role, by id.
pub type Members = BTreeMap<String, WorkerInfo>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum DiscoveryError {
    #[error("invalid worker registration: {0}")]
    Invalid(String),
    #[error("etcd: {0}")]
    Etcd(String),
}

/// A worker's registration, kept up in the background.
pub struct Registration {
    ready: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Registration {
    /// True while the registration holds (for etcd: the key exists under a live lease).
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.clone()
    }

    /// Removes the registration now (for etcd: revokes the lease, which deletes the key) and stops.
    pub async fn deregister(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Without a deregistration the key stays until its lease expires, as when the process dies.
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Registration and membership of workers. Both calls spawn their background work on the current tokio runtime.
pub trait Discovery: Send + Sync {
    /// Registers `info` and keeps it registered until the handle is deregistered or dropped.
    fn register(&self, info: WorkerInfo) -> Result<Registration, DiscoveryError>;
    /// The members of `role`, kept current.
    fn watch(&self, role: Role) -> watch::Receiver<Members>;
}

/// Fixed members (from flags); registering is a no-op that is always ready.
#[derive(Debug, Clone, Default)]
pub struct StaticDiscovery {
    members: BTreeMap<Role, Members>,
}

impl StaticDiscovery {
    /// Members named by address (the id is the address).
    pub fn new(drafts: &[String], targets: &[String]) -> Self {
        let mk = |role: Role, addrs: &[String]| -> Members {
            addrs
                .iter()
                .map(|a| {
                    (
                        a.clone(),
                        WorkerInfo {
                            id: a.clone(),
                            role,
                            address: a.clone(),
                            model: String::new(),
                            tp: 1,
                            capacity: 0,
                            version: String::new(),
                        },
                    )
                })
                .collect()
        };
        let mut members = BTreeMap::new();
        members.insert(Role::Draft, mk(Role::Draft, drafts));
        members.insert(Role::Target, mk(Role::Target, targets));
        StaticDiscovery { members }
    }
}

impl Discovery for StaticDiscovery {
    fn register(&self, info: WorkerInfo) -> Result<Registration, DiscoveryError> {
        info.validate()?;
        let (_tx, ready) = watch::channel(true);
        Ok(Registration {
            ready,
            stop: None,
            task: None,
        })
    }

    fn watch(&self, role: Role) -> watch::Receiver<Members> {
        watch::channel(self.members.get(&role).cloned().unwrap_or_default()).1
    }
}

/// Members held in memory, for tests of membership without etcd: a registration appears at once and disappears on
/// [`Registration::deregister`] (dropping the handle leaves it, as a crashed worker's key stays until its lease
/// expires); [`MemoryDiscovery::remove`] takes a member away as a lease expiry would.
#[derive(Debug, Clone)]
pub struct MemoryDiscovery {
    draft: std::sync::Arc<watch::Sender<Members>>,
    target: std::sync::Arc<watch::Sender<Members>>,
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        MemoryDiscovery {
            draft: std::sync::Arc::new(watch::channel(Members::new()).0),
            target: std::sync::Arc::new(watch::channel(Members::new()).0),
        }
    }
}

impl MemoryDiscovery {
    pub fn new() -> Self {
        Self::default()
    }

    fn role(&self, role: Role) -> &watch::Sender<Members> {
        match role {
            Role::Draft => &self.draft,
            Role::Target => &self.target,
        }
    }

    /// Adds (or replaces) a member.
    pub fn insert(&self, info: WorkerInfo) {
        self.role(info.role).send_modify(|m| {
            m.insert(info.id.clone(), info);
        });
    }

    /// Removes a member; returns whether it was there.
    pub fn remove(&self, role: Role, id: &str) -> bool {
        self.role(role).send_if_modified(|m| m.remove(id).is_some())
    }
}

impl Discovery for MemoryDiscovery {
    fn register(&self, info: WorkerInfo) -> Result<Registration, DiscoveryError> {
        info.validate()?;
        let (role, id) = (info.role, info.id.clone());
        self.insert(info);
        let (stop, stopped) = oneshot::channel::<()>();
        let me = self.clone();
        let task = tokio::spawn(async move {
            if stopped.await.is_ok() {
                me.remove(role, &id);
            }
        });
        Ok(Registration {
            ready: watch::channel(true).1,
            stop: Some(stop),
            task: Some(task),
        })
    }

    fn watch(&self, role: Role) -> watch::Receiver<Members> {
        self.role(role).subscribe()
    }
}

/// etcd-backed discovery (see the module docs).
#[derive(Debug, Clone)]
pub struct EtcdDiscovery {
    endpoints: Vec<String>,
    /// Lease time to live of registrations.
    pub ttl: Duration,
}

/// How long one etcd call may take before etcd counts as unreachable.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The first pause before trying etcd again ([`parse_core::retry`]: the pauses double, each jittered).
const RETRY: Duration = Duration::from_millis(300);
/// The longest pause between two tries before jitter (which adds up to as much again).
const RETRY_CAP: Duration = Duration::from_secs(2);

async fn timed<T, E: std::fmt::Display>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {CALL_TIMEOUT:?}")),
    }
}

impl EtcdDiscovery {
    /// `endpoints`: etcd client URLs or host:port. `ttl`: lease time to live (at least 1 s; keep-alives go every
    /// third of it).
    pub fn new(endpoints: Vec<String>, ttl: Duration) -> Result<Self, DiscoveryError> {
        if endpoints.is_empty() {
            return Err(DiscoveryError::Invalid("no etcd endpoint".into()));
        }
        Ok(EtcdDiscovery {
            endpoints,
            ttl: ttl.max(Duration::from_secs(1)),
        })
    }

    async fn connect(endpoints: &[String]) -> Result<Client, String> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            // Detects a dead connection under a long-lived watch stream.
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some(a) = ETCD_AUTH.get() {
            if let Some((user, password)) = &a.user {
                opts = opts.with_user(user.clone(), password.clone());
            }
            if let Some(tls) = &a.tls {
                opts = opts.with_tls(tls.clone());
            }
        }
        timed("connect", Client::connect(endpoints, Some(opts))).await
    }

    /// One registration for as long as it holds: grant, put, keep alive. Returns why it stopped holding, or
    /// `Ok` when asked to stop (after revoking the lease).
    async fn hold(
        endpoints: &[String],
        info: &WorkerInfo,
        ttl: Duration,
        ready: &watch::Sender<bool>,
        stop: &mut oneshot::Receiver<()>,
    ) -> Result<(), String> {
        let mut c = Self::connect(endpoints).await?;
        let lease = timed("lease grant", c.lease_grant(ttl.as_secs() as i64, None))
            .await?
            .id();
        let value = serde_json::to_string(info).map_err(|e| e.to_string())?;
        timed(
            "put",
            c.put(info.key(), value, Some(PutOptions::new().with_lease(lease))),
        )
        .await?;
        let (mut keeper, mut stream) = timed("keep-alive", c.lease_keep_alive(lease)).await?;
        tracing::info!(key = %info.key(), lease, "registered");
        ready.send_replace(true);
        let every = ttl / 3;
        loop {
            tokio::select! {
                _ = &mut *stop => {
                    let _ = timed("lease revoke", c.lease_revoke(lease)).await;
                    tracing::info!(key = %info.key(), "deregistered");
                    return Ok(());
                }
                _ = tokio::time::sleep(every) => {}
            }
            timed("keep-alive", keeper.keep_alive()).await?;
            let resp = timed("keep-alive", stream.message())
                .await?
                .ok_or("the keep-alive stream ended")?;
            if resp.ttl() <= 0 {
                return Err("the lease expired".into());
            }
        }
    }

    /// Reads the role's prefix, publishes it, then applies watch events until the stream fails.
    async fn follow(
        endpoints: &[String],
        role: Role,
        members: &watch::Sender<Members>,
    ) -> Result<(), String> {
        let mut c = Self::connect(endpoints).await?;
        let prefix = role.prefix();
        let resp = timed(
            "get",
            c.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut now = Members::new();
        for kv in resp.kvs() {
            if let Ok(info) = serde_json::from_slice::<WorkerInfo>(kv.value()) {
                now.insert(info.id.clone(), info);
            }
        }
        members.send_if_modified(|m| {
            let changed = *m != now;
            *m = now;
            changed
        });
        let mut stream = timed(
            "watch",
            c.watch(
                prefix.clone(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            ),
        )
        .await?;
        loop {
            let Some(resp) = stream.message().await.map_err(|e| e.to_string())? else {
                return Err("the watch stream ended".into());
            };
            if resp.canceled() {
                return Err(format!("watch cancelled: {}", resp.cancel_reason()));
            }
            members.send_if_modified(|m| {
                let mut changed = false;
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let id = kv
                        .key_str()
                        .ok()
                        .and_then(|k| k.strip_prefix(prefix.as_str()))
                        .unwrap_or_default()
                        .to_string();
                    match ev.event_type() {
                        EventType::Put => match serde_json::from_slice::<WorkerInfo>(kv.value()) {
                            Ok(info) if info.id == id => {
                                changed |= m.get(&id) != Some(&info);
                                m.insert(id, info);
                            }
                            _ => tracing::warn!(key = %id, "ignoring a malformed worker record"),
                        },
                        EventType::Delete => changed |= m.remove(&id).is_some(),
                    }
                }
                changed
            });
        }
    }
}

impl Discovery for EtcdDiscovery {
    fn register(&self, info: WorkerInfo) -> Result<Registration, DiscoveryError> {
        info.validate()?;
        let (ready_tx, ready) = watch::channel(false);
        let (stop_tx, mut stop) = oneshot::channel();
        let (endpoints, ttl) = (self.endpoints.clone(), self.ttl);
        let task = tokio::spawn(async move {
            let mut pauses = Pauses::new(RETRY, RETRY_CAP);
            loop {
                let began = std::time::Instant::now();
                match Self::hold(&endpoints, &info, ttl, &ready_tx, &mut stop).await {
                    Ok(()) => return,
                    Err(e) => {
                        if ready_tx.send_replace(false) {
                            tracing::warn!(key = %info.key(), "registration lost: {e}; registering again");
                        } else {
                            tracing::debug!(key = %info.key(), "cannot register yet: {e}");
                        }
                    }
                }
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(pauses.after(began)) => {}
                }
            }
        });
        Ok(Registration {
            ready,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    fn watch(&self, role: Role) -> watch::Receiver<Members> {
        let (tx, rx) = watch::channel(Members::new());
        let endpoints = self.endpoints.clone();
        tokio::spawn(async move {
            let mut pauses = Pauses::new(RETRY, RETRY_CAP);
            loop {
                let began = std::time::Instant::now();
                if let Err(e) = Self::follow(&endpoints, role, &tx).await {
                    tracing::warn!(
                        role = role.as_str(),
                        "following etcd: {e}; keeping the last known members"
                    );
                }
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(pauses.after(began)).await;
            }
        });
        rx
    }
}

/// Where the ranks of tensor-parallel groups meet: `/parse/v1/groups/{group}/{rank}`.
pub const GROUPS: &str = "/parse/v1/groups/";

#[derive(Debug, Serialize, Deserialize)]
struct RankRecord {
    address: String,
    world: usize,
}

/// Rendezvous of a tensor-parallel group through etcd: rank `rank` publishes the address of its group connection
/// under `/parse/v1/groups/{group}/{rank}` (on a lease kept alive meanwhile, which lapses `ttl` after the
/// rendezvous), then waits until every rank of `world` has; returns the addresses in rank order. A rank that
/// announces another world size is an error; so is waiting longer than `timeout`.
pub async fn rendezvous(
    endpoints: &[String],
    group: &str,
    rank: usize,
    world: usize,
    address: &str,
    ttl: Duration,
    timeout: Duration,
) -> Result<Vec<String>, DiscoveryError> {
    let etcd = |e: String| DiscoveryError::Etcd(e);
    if group.is_empty() || group.contains('/') {
        return Err(DiscoveryError::Invalid(
            "a group name must be non-empty, without `/`".into(),
        ));
    }
    if rank >= world {
        return Err(DiscoveryError::Invalid(format!(
            "rank {rank} is outside a group of {world}"
        )));
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let prefix = format!("{GROUPS}{group}/");
    let mut c = (|| EtcdDiscovery::connect(endpoints))
        .retry(retry::backoff(RETRY, RETRY_CAP, Some(timeout)))
        .sleep(tokio::time::sleep)
        .notify(|e, _| tracing::debug!("rendezvous: etcd not reachable yet: {e}"))
        .await
        .map_err(etcd)?;
    let lease = timed(
        "lease grant",
        c.lease_grant(ttl.as_secs().max(2) as i64, None),
    )
    .await
    .map_err(etcd)?
    .id();
    let value = serde_json::to_string(&RankRecord {
        address: address.to_string(),
        world,
    })
    .map_err(|e| DiscoveryError::Invalid(e.to_string()))?;
    timed(
        "put",
        c.put(
            format!("{prefix}{rank}"),
            value,
            Some(PutOptions::new().with_lease(lease)),
        ),
    )
    .await
    .map_err(etcd)?;
    let (mut keeper, _stream) = timed("keep-alive", c.lease_keep_alive(lease))
        .await
        .map_err(etcd)?;
    loop {
        let resp = timed(
            "get",
            c.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(etcd)?;
        let mut addrs = vec![None; world];
        for kv in resp.kvs() {
            let r = kv
                .key_str()
                .ok()
                .and_then(|k| k.strip_prefix(prefix.as_str()))
                .and_then(|r| r.parse::<usize>().ok());
            let rec = serde_json::from_slice::<RankRecord>(kv.value()).ok();
            if let (Some(r), Some(rec)) = (r, rec) {
                if rec.world != world {
                    return Err(DiscoveryError::Invalid(format!(
                        "rank {r} of group `{group}` announced a world of {}, this rank {world}",
                        rec.world
                    )));
                }
                if r < world {
                    addrs[r] = Some(rec.address);
                }
            }
        }
        if addrs.iter().all(Option::is_some) {
            tracing::info!(group, rank, world, "tensor-parallel rendezvous complete");
            return Ok(addrs.into_iter().flatten().collect());
        }
        if tokio::time::Instant::now() >= deadline {
            let missing: Vec<usize> = (0..world).filter(|r| addrs[*r].is_none()).collect();
            return Err(DiscoveryError::Etcd(format!(
                "group `{group}`: ranks {missing:?} did not show up within {timeout:?}"
            )));
        }
        let _ = timed("keep-alive", keeper.keep_alive()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A worker's drain: once started, the worker takes no new sessions, finishes its open ones, deregisters and
/// stops serving.
#[derive(Clone)]
pub struct Drain {
    tx: std::sync::Arc<watch::Sender<bool>>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            tx: std::sync::Arc::new(watch::channel(false).0),
        }
    }
}

impl Drain {
    /// Starts the drain; returns false if it had started already.
    pub fn start(&self) -> bool {
        !self.tx.send_replace(true)
    }

    pub fn is_draining(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves when the worker should stop serving: at `shutdown` (after deregistering), or once a drain has
    /// started (deregistering at once, so that routers stop sending work) and `idle()` holds.
    pub async fn serve_until(
        &self,
        registration: Option<Registration>,
        idle: impl Fn() -> bool,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut rx = self.tx.subscribe();
        tokio::select! {
            _ = shutdown => {
                if let Some(r) = registration {
                    r.deregister().await;
                }
            }
            _ = async { rx.wait_for(|d| *d).await.is_ok() } => {
                tracing::info!("draining: deregistering, then waiting for the open sessions");
                if let Some(r) = registration {
                    r.deregister().await;
                }
                while !idle() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tracing::info!("drained: stopping");
            }
        }
    }
}

/// A worker's discovery settings (its flags).
#[derive(Debug, Clone, Default)]
pub struct Announce {
    /// etcd endpoints; empty: no discovery.
    pub etcd: Vec<String>,
    /// Defaults to `{role}-{address}`.
    pub id: Option<String>,
    /// The address routers should dial; defaults to the listen address (which must then not be a wildcard).
    pub advertise: Option<String>,
    pub lease_ttl: Duration,
}

/// A worker's discovery flags (flattened into each worker's command line).
#[derive(Debug, Clone, clap::Args)]
pub struct AnnounceArgs {
    /// etcd endpoints (comma-separated): register this worker under /parse/v1/workers/ with a lease.
    #[arg(long, env = parse_core::env::ETCD, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// This worker's id in discovery (default: role-address).
    #[arg(long, env = parse_core::env::WORKER_ID)]
    pub worker_id: Option<String>,
    /// The address routers dial (default: --listen).
    #[arg(long, env = parse_core::env::ADVERTISE)]
    pub advertise: Option<String>,
    /// Lease time to live in seconds: a worker that dies disappears from discovery after this long.
    #[arg(long, default_value_t = 5)]
    pub lease_ttl_s: u64,
    #[command(flatten)]
    pub etcd_auth: EtcdAuthArgs,
}

impl AnnounceArgs {
    pub fn announce(&self) -> Announce {
        Announce {
            etcd: self.etcd.clone(),
            id: self.worker_id.clone(),
            advertise: self.advertise.clone(),
            lease_ttl: Duration::from_secs(self.lease_ttl_s),
        }
    }
}

/// The name a worker publishes for its model: the file name of its path.
pub fn model_name(p: &std::path::Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

impl Announce {
    /// Registers the worker in etcd when endpoints are set (inside a tokio runtime).
    pub fn register(
        &self,
        role: Role,
        listen: std::net::SocketAddr,
        model: &str,
        tp: u32,
        capacity: u32,
    ) -> Result<Option<Registration>, DiscoveryError> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let address = match &self.advertise {
            Some(a) => a.clone(),
            None if listen.ip().is_unspecified() => {
                return Err(DiscoveryError::Invalid(format!(
                    "listening on {listen}: give --advertise HOST:PORT, the address routers should dial"
                )));
            }
            None => listen.to_string(),
        };
        let info = WorkerInfo {
            id: self
                .id
                .clone()
                .unwrap_or_else(|| format!("{}-{}", role.as_str(), address.replace('/', "_"))),
            role,
            address,
            model: model.to_string(),
            tp,
            capacity,
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let d = EtcdDiscovery::new(self.etcd.clone(), self.lease_ttl)?;
        d.register(info).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_records_and_validation() {
        let w = WorkerInfo {
            id: "t-1".into(),
            role: Role::Target,
            address: "10.0.0.2:50071".into(),
            model: "m.gguf".into(),
            tp: 2,
            capacity: 256,
            version: "0.1.0".into(),
        };
        assert_eq!(w.key(), "/parse/v1/workers/target/t-1");
        let json = serde_json::to_string(&w).unwrap();
        assert!(json.contains(r#""role":"target""#), "{json}");
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).unwrap(), w);
        for bad in ["", "a/b"] {
            let mut b = w.clone();
            b.id = bad.into();
            assert!(b.validate().is_err());
        }
        assert!(EtcdDiscovery::new(vec![], Duration::from_secs(5)).is_err());
    }

    #[tokio::test]
    async fn memory_members_change_as_workers_come_and_go() {
        let d = MemoryDiscovery::new();
        let mut rx = d.watch(Role::Target);
        assert!(rx.borrow_and_update().is_empty());
        let info = |id: &str| WorkerInfo {
            id: id.into(),
            role: Role::Target,
            address: format!("{id}:1"),
            model: "m".into(),
            tp: 1,
            capacity: 1,
            version: String::new(),
        };
        let a = d.register(info("a")).unwrap();
        d.insert(info("b"));
        rx.changed().await.unwrap();
        assert_eq!(
            rx.borrow_and_update().keys().collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(d.watch(Role::Draft).borrow().is_empty());
        a.deregister().await;
        assert_eq!(
            d.watch(Role::Target).borrow().keys().collect::<Vec<_>>(),
            ["b"]
        );
        assert!(d.remove(Role::Target, "b"));
        assert!(!d.remove(Role::Target, "b"));
        assert!(d.watch(Role::Target).borrow().is_empty());
        assert!(d.register(info("")).is_err());
    }

    #[tokio::test]
    async fn static_members_are_the_flags() {
        let d = StaticDiscovery::new(&["a:1".into()], &["b:2".into(), "c:3".into()]);
        assert_eq!(d.watch(Role::Draft).borrow().len(), 1);
        let t = d.watch(Role::Target).borrow().clone();
        assert_eq!(t.keys().collect::<Vec<_>>(), ["b:2", "c:3"]);
        assert!(*d.register(t["b:2"].clone()).unwrap().ready().borrow());
    }
}
