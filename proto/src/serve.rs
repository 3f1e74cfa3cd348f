//! What every server does alike: `grpc.health.v1` and server reflection beside its own services, a bound listener
//! (port 0 picks a free one), and shutdown on a signal.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tonic_reflection::server::{v1, v1alpha};

fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Server reflection (`grpc.reflection.v1`) for `parse.v1` and `grpc.health.v1`, so grpcurl works without the
/// .proto files.
pub fn reflection_service()
-> Result<v1::ServerReflectionServer<impl v1::ServerReflection>, tonic_reflection::server::Error> {
    reflection_builder().build_v1()
}

/// The same under `grpc.reflection.v1alpha`, which older clients (grpcurl before 1.9) ask for.
pub fn reflection_service_v1alpha() -> Result<
    v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
    tonic_reflection::server::Error,
> {
    reflection_builder().build_v1alpha()
}

/// Binds `addr` and returns the listener with the address it got.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}

/// Keeps the health status of `names` ("" is the server as a whole) at SERVING while `ready` holds `true`,
/// NOT_SERVING otherwise; once the sender is gone the status stays as it is.
async fn report_health(
    health: tonic_health::server::HealthReporter,
    mut ready: tokio::sync::watch::Receiver<bool>,
    names: &'static [&'static str],
) {
    loop {
        let status = if *ready.borrow_and_update() {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        for n in names {
            health.set_service_status(*n, status).await;
        }
        if ready.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Who may call a server: its TLS identity (clients must present a certificate of the same CA) and whether the
/// cluster token is required (workers; not the router's public API). Health never needs the token (probes hold
/// none); with TLS it needs a certificate like every other call.
#[derive(Clone, Default)]
pub struct Access {
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    pub auth: crate::security::RequireToken,
}

impl Access {
    /// A worker's: mutual TLS when set up, and the cluster token when there is one.
    pub fn worker(s: &crate::security::Security) -> Self {
        Access {
            tls: s.server_tls(),
            auth: s.server_auth(),
        }
    }

    /// A public API's (the router's Generation and Admin): mutual TLS when set up, no cluster token.
    pub fn public(s: &crate::security::Security) -> Self {
        Access {
            tls: s.server_tls(),
            auth: Default::default(),
        }
    }
}

/// A gRPC service as tonic's server takes it (what `FooServer::new(..)` of a generated service is).
pub trait GrpcService:
    tower_service::Service<
        http::Request<tonic::body::Body>,
        Response = http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    > + tonic::server::NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves `service` with `grpc.health.v1` (reporting it serving) and reflection on `listener` until `shutdown`
/// resolves: the one server set-up of the router and the workers.
pub async fn run<S>(
    service: S,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    access: Access,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    S: GrpcService,
    S::Future: Send + 'static,
{
    let (_ready, watch) = tokio::sync::watch::channel(true);
    run_reporting(service, listener, shutdown, watch, access).await
}

/// Like [`run`], with health following `ready`: SERVING while it holds `true`, NOT_SERVING (for the service and
/// the server as a whole) once it turns `false`. The service and reflection sit behind `access`'s token check;
/// health only behind its TLS.
pub async fn run_reporting<S>(
    service: S,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ready: tokio::sync::watch::Receiver<bool>,
    access: Access,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    S: GrpcService,
    S::Future: Send + 'static,
{
    use tonic::service::interceptor::InterceptedService;
    let (health, health_service) = tonic_health::server::health_reporter();
    let reporter = tokio::spawn(report_health(health, ready, &["", S::NAME]));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = access.tls.clone() {
        builder = builder.tls_config(tls)?;
    }
    let served = builder
        .add_service(health_service)
        .add_service(InterceptedService::new(
            reflection_service()?,
            access.auth.clone(),
        ))
        .add_service(InterceptedService::new(
            reflection_service_v1alpha()?,
            access.auth.clone(),
        ))
        .add_service(InterceptedService::new(service, access.auth))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await;
    reporter.abort();
    served?;
    Ok(())
}

/// Serves only `grpc.health.v1` (a process with no service of its own, such as a tensor-parallel follower),
/// SERVING while `ready` holds `true`.
pub async fn run_health_only(
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ready: tokio::sync::watch::Receiver<bool>,
    access: Access,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use tonic::service::interceptor::InterceptedService;
    let (health, health_service) = tonic_health::server::health_reporter();
    let reporter = tokio::spawn(report_health(health, ready, &[""]));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = access.tls.clone() {
        builder = builder.tls_config(tls)?;
    }
    let served = builder
        .add_service(health_service)
        .add_service(InterceptedService::new(reflection_service()?, access.auth))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await;
    reporter.abort();
    served?;
    Ok(())
}
