//! Worker pools: members from flags or from discovery, least-outstanding-requests choice, failure marking and
//! recovery probes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use parse_discovery::Role;
use parse_proto::security::{Security, SendToken};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A connection to a worker: every call carries the cluster token (when there is one).
pub type WorkerChannel = InterceptedService<Channel, SendToken>;

/// One worker.
pub struct Worker {
    /// Its discovery id (the address for static members).
    pub id: String,
    pub addr: String,
    pub channel: WorkerChannel,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
    draining: AtomicBool,
}

impl Worker {
    /// Asked to drain by an operator: no new requests.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Whether the worker answers a `grpc.health.v1` check as serving within `timeout`.
    pub async fn answers_health(&self, timeout: Duration) -> bool {
        let mut client = HealthClient::new(self.channel.clone());
        let mut req = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        req.set_timeout(timeout);
        let check = tokio::time::timeout(timeout, client.check(req));
        matches!(check.await, Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32)
    }

    /// Marks the worker lost (a transport failure); the prober brings it back once it answers health checks.
    pub fn mark_failed(&self) {
        if self.healthy.swap(false, Ordering::Relaxed) {
            tracing::warn!(addr = %self.addr, "worker marked unavailable");
        }
    }
}

/// A worker held by one request; the outstanding count drops with it.
pub struct Lease {
    pub worker: Arc<Worker>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.worker.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Workers of one role.
pub struct Pool {
    pub role: Role,
    workers: RwLock<Vec<Arc<Worker>>>,
    connect_timeout: Duration,
    security: Security,
}

fn endpoint(
    addr: &str,
    connect_timeout: Duration,
    security: &Security,
) -> Result<Endpoint, tonic::transport::Error> {
    Ok(security
        .endpoint(addr)?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5)))
}

fn worker(
    id: &str,
    addr: &str,
    connect_timeout: Duration,
    security: &Security,
) -> Result<Worker, tonic::transport::Error> {
    Ok(Worker {
        id: id.to_string(),
        addr: addr.to_string(),
        channel: InterceptedService::new(
            endpoint(addr, connect_timeout, security)?.connect_lazy(),
            security.client_auth(),
        ),
        outstanding: AtomicUsize::new(0),
        healthy: AtomicBool::new(true),
        draining: AtomicBool::new(false),
    })
}

/// Checks that `addr` can be dialled (a flag's worker address).
pub fn check_address(addr: &str, security: &Security) -> Result<(), tonic::transport::Error> {
    endpoint(addr, Duration::from_secs(1), security).map(|_| ())
}

impl Pool {
    /// An empty pool; discovery fills it ([`Pool::sync`]).
    pub fn new(role: Role, connect_timeout: Duration, security: Security) -> Self {
        Pool {
            role,
            workers: RwLock::new(Vec::new()),
            connect_timeout,
            security,
        }
    }

    /// The current members.
    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn is_empty(&self) -> bool {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Makes the members `(id, address)` (from discovery): new ones are added, gone ones removed (requests that
    /// hold one finish with it), the rest keep their state. Returns whether anything changed.
    pub fn sync(&self, members: &[(String, String)]) -> bool {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let before = ws.len();
        ws.retain(|w| {
            let keep = members.iter().any(|(id, a)| *id == w.id && *a == w.addr);
            if !keep {
                tracing::info!(role = self.role.as_str(), id = %w.id, addr = %w.addr, "worker left");
            }
            keep
        });
        let mut changed = ws.len() != before;
        for (id, addr) in members {
            if ws.iter().any(|w| w.id == *id && w.addr == *addr) {
                continue;
            }
            match worker(id, addr, self.connect_timeout, &self.security) {
                Ok(w) => {
                    tracing::info!(role = self.role.as_str(), %id, %addr, "worker joined");
                    ws.push(Arc::new(w));
                    changed = true;
                }
                Err(e) => {
                    tracing::warn!(role = self.role.as_str(), %id, %addr, "unusable address: {e}")
                }
            }
        }
        changed
    }

    /// The healthy worker with the fewest outstanding requests, not in `exclude` (addresses this request already
    /// lost); ties go to the first listed.
    pub fn pick(&self, exclude: &[String]) -> Option<Lease> {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        let w = ws
            .iter()
            .filter(|w| w.healthy() && !w.draining() && !exclude.contains(&w.addr))
            .min_by_key(|w| w.outstanding())?;
        w.outstanding.fetch_add(1, Ordering::Relaxed);
        Some(Lease { worker: w.clone() })
    }

    /// Probes failed workers with `grpc.health.v1` every `every` and marks the serving ones healthy again.
    pub fn spawn_prober(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let pool = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                for w in pool.workers().iter().filter(|w| !w.healthy()) {
                    if w.answers_health(every).await {
                        w.healthy.store(true, Ordering::Relaxed);
                        tracing::info!(role = pool.role.as_str(), addr = %w.addr, "worker back");
                    }
                }
            }
        })
    }
}
