//! What the draft and target workers share above the shell: the accessors their callers use, the unary calls they
//! answer alike (`GetModelInfo`, `Drain`), and serving the gRPC service on a listener.

use std::future::Future;
use std::sync::Arc;

use parse_proto::v1::{DrainResponse, GetModelInfoResponse};

use crate::{Backend, Shell, WorkerMetrics};

/// A worker: a gRPC service over a [`Shell`]. The draft and target workers implement [`Worker::shell`]; the rest
/// is theirs alike.
pub trait Worker {
    type Backend: Backend;

    fn shell(&self) -> &Shell<Self::Backend>;

    /// The worker's drain (started by `Drain`).
    fn drain(&self) -> &parse_discovery::Drain {
        &self.shell().drain
    }

    /// Sessions holding state: a draft's, or a KV cache (tests and admin).
    fn open_sessions(&self) -> usize {
        self.shell().open_sessions()
    }

    /// The worker's Prometheus metrics (served by [`crate::spawn_metrics`]).
    fn metrics(&self) -> Arc<WorkerMetrics> {
        self.shell().metrics().clone()
    }

    /// Releases sessions idle for longer than the TTL; returns how many.
    fn expire_idle(&self) -> impl Future<Output = usize> + Send
    where
        Self: Sync,
    {
        self.shell().expire_idle()
    }

    /// What the process serves until: a signal, or a drain that has finished the open sessions; `registration` is
    /// withdrawn from discovery either way.
    fn until_drained(
        &self,
        registration: Option<parse_discovery::Registration>,
    ) -> impl Future<Output = ()> + Send + 'static
    where
        Self: Clone + Send + Sync + 'static,
    {
        let w = self.clone();
        async move {
            w.drain()
                .serve_until(
                    registration,
                    || w.open_sessions() == 0,
                    parse_proto::serve::shutdown_signal(),
                )
                .await
        }
    }

    /// `GetModelInfo`'s answer.
    fn model_info(&self) -> GetModelInfoResponse {
        self.shell().info().clone()
    }

    /// `Drain`'s answer: the drain starts (once), and the sessions still open are reported.
    fn start_drain(&self) -> DrainResponse {
        if self.shell().drain.start() {
            tracing::info!("drain requested");
        }
        DrainResponse {
            open_sessions: self.open_sessions() as u32,
        }
    }
}

/// Serves `service` (a worker's gRPC service over `shell`) on `listener` until `shutdown` resolves, reporting
/// healthy only while `ready` holds true, with the shell's reaper releasing idle sessions meanwhile.
pub async fn serve<B, S>(
    shell: &Shell<B>,
    service: S,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: tokio::sync::watch::Receiver<bool>,
    security: &parse_proto::security::Security,
) -> anyhow::Result<()>
where
    B: Backend,
    S: parse_proto::serve::GrpcService,
    S::Future: Send + 'static,
{
    let reaper = shell.spawn_reaper();
    let access = parse_proto::serve::Access::worker(security);
    let result =
        parse_proto::serve::run_reporting(service, listener, shutdown, ready, access).await;
    reaper.abort();
    result.map_err(|e| anyhow::anyhow!(e))
}
