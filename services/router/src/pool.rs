//! Worker pools: static addresses, least-outstanding-requests choice, failure marking and recovery probes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// One worker.
pub struct Worker {
    pub addr: String,
    pub channel: Channel,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
}

impl Worker {
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
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
    pub role: &'static str,
    workers: Vec<Arc<Worker>>,
}

fn endpoint(addr: &str, connect_timeout: Duration) -> Result<Endpoint, tonic::transport::Error> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5)))
}

impl Pool {
    pub fn new(
        role: &'static str,
        addrs: &[String],
        connect_timeout: Duration,
    ) -> Result<Self, tonic::transport::Error> {
        let mut workers = Vec::new();
        for a in addrs {
            workers.push(Arc::new(Worker {
                addr: a.clone(),
                channel: endpoint(a, connect_timeout)?.connect_lazy(),
                outstanding: AtomicUsize::new(0),
                healthy: AtomicBool::new(true),
            }));
        }
        Ok(Pool { role, workers })
    }

    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The healthy worker with the fewest outstanding requests, not in `exclude` (addresses this request already
    /// lost); ties go to the first listed.
    pub fn pick(&self, exclude: &[String]) -> Option<Lease> {
        let w = self
            .workers
            .iter()
            .filter(|w| w.healthy() && !exclude.contains(&w.addr))
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
                for w in pool.workers.iter().filter(|w| !w.healthy()) {
                    let mut client = HealthClient::new(w.channel.clone());
                    let mut req = tonic::Request::new(HealthCheckRequest {
                        service: String::new(),
                    });
                    req.set_timeout(every);
                    if let Ok(r) = client.check(req).await
                        && r.into_inner().status == ServingStatus::Serving as i32
                    {
                        w.healthy.store(true, Ordering::Relaxed);
                        tracing::info!(role = pool.role, addr = %w.addr, "worker back");
                    }
                }
            }
        })
    }
}
