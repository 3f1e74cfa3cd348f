//! HTTPS for the OpenAI API: the acceptor from the router's certificate, and a listener that runs each handshake
//! on a task of its own.

pub(super) fn tls_acceptor(
    (cert, key): (&[u8], &[u8]),
) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("OpenAI API TLS certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| anyhow::anyhow!("OpenAI API TLS key: {e}"))?;
    let mut cfg = tokio_rustls::rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| anyhow::anyhow!("OpenAI API TLS: {e}"))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| anyhow::anyhow!("OpenAI API TLS: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)))
}

/// Most TLS handshakes in progress at once, and how long one may take: a flood of connections that never finish
/// their handshake holds neither the accept loop nor unbounded tasks.
pub(super) const MAX_HANDSHAKES: usize = 256;
pub(super) const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A listener of finished TLS connections: a task accepts TCP connections and runs each handshake on a task of
/// its own (a slow one does not hold up the others).
pub(super) struct TlsListener {
    pub(super) rx: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        std::net::SocketAddr,
    )>,
    pub(super) local: std::net::SocketAddr,
    pub(super) task: tokio::task::AbortHandle,
}

impl TlsListener {
    pub(super) fn spawn(
        listener: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let task = tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!("OpenAI API accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "OpenAI API TLS handshake: {e}"),
                        Err(_) => tracing::debug!(%peer, "OpenAI API TLS handshake timed out"),
                    }
                });
            }
        })
        .abort_handle();
        Ok(TlsListener { rx, local, task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task is gone (only when the listener is dropped): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
