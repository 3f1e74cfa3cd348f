//! Who may talk to whom on the cluster's gRPC hops.
//!
//! Two mechanisms, each optional, both on in the Helm chart:
//!
//! - **Mutual TLS** (`--tls-cert`, `--tls-key`, `--tls-ca`): every server presents its certificate and accepts only
//!   clients whose certificate the cluster CA signed; every client checks the server's certificate against the same
//!   CA, under the name `--tls-server-name` when set (workers discovered through etcd are dialled by pod address, so
//!   their certificates name a role, `parse-worker`, not an address) or the host it dials otherwise.
//! - **The cluster token** (`--cluster-token` or `--cluster-token-file`): a shared secret the router sends on every
//!   worker call (`x-parse-cluster-token`). A worker that has one refuses every call without it — sessions, forward
//!   passes, `Drain`, reflection — with UNAUTHENTICATED; only `grpc.health.v1` stays open, for probes. The
//!   tensor-parallel ring authenticates its peers with it too. It is what makes a worker the router's alone when
//!   other clients hold certificates of the same CA (users of the router's own API).
//!
//! Without either, every hop is plain text and open: fine on loopback, never the chart's default.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};
use tonic::{Request, Status};

/// The metadata key the cluster token travels in.
pub const TOKEN_HEADER: &str = "x-parse-cluster-token";

/// How long a peer may take over the TLS handshake before its connection is dropped (a connection that sends
/// nothing must not hold a server task).
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A security set-up that could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SecurityError(pub String);

struct TlsMaterial {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

/// One process's credentials: its TLS identity with the CA it trusts, and the cluster token. Cheap to clone.
#[derive(Clone, Default)]
pub struct Security {
    tls: Option<Arc<TlsMaterial>>,
    token: Option<Arc<str>>,
    server_name: Option<String>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// The command-line (and environment) form of [`Security`], shared by every binary.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SecurityArgs {
    /// This process's certificate (PEM; with --tls-key and --tls-ca it turns mutual TLS on for every hop it
    /// serves and dials).
    #[arg(long, env = parse_core::env::TLS_CERT, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = parse_core::env::TLS_KEY, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): servers accept only clients it signed, clients only servers it signed.
    #[arg(long, env = parse_core::env::TLS_CA, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// The name servers this process dials must carry in their certificate [default: the host dialled].
    #[arg(long, env = parse_core::env::TLS_SERVER_NAME)]
    pub tls_server_name: Option<String>,
    /// The cluster's shared secret: workers refuse calls without it (health excepted), the router sends it, the
    /// tensor-parallel ring authenticates its peers with it.
    #[arg(long, env = parse_core::env::CLUSTER_TOKEN, hide_env_values = true)]
    pub cluster_token: Option<String>,
    /// A file holding the cluster token (surrounding whitespace ignored).
    #[arg(
        long,
        env = parse_core::env::CLUSTER_TOKEN_FILE,
        conflicts_with = "cluster_token"
    )]
    pub cluster_token_file: Option<PathBuf>,
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path)
        .map_err(|e| SecurityError(format!("cannot read the {what} {}: {e}", path.display())))
}

impl SecurityArgs {
    /// Reads the files named.
    pub fn load(&self) -> Result<Security, SecurityError> {
        let mut s = Security::default();
        if let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            s = Security::from_pem(
                read(cert, "TLS certificate")?,
                read(key, "TLS key")?,
                read(ca, "TLS CA")?,
            )?;
        }
        let token = match (&self.cluster_token, &self.cluster_token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(p)) => Some(
                String::from_utf8(read(p, "cluster token file")?)
                    .map_err(|_| SecurityError(format!("{} is not UTF-8", p.display())))?
                    .trim()
                    .to_string(),
            ),
            (None, None) => None,
        };
        if let Some(t) = token {
            s = s.with_token(&t)?;
        }
        if let Some(n) = self.tls_server_name.as_deref().filter(|n| !n.is_empty()) {
            s = s.with_server_name(n);
        }
        Ok(s)
    }
}

fn pem_has(pem: &[u8], label: &str) -> bool {
    let needle = format!("-----BEGIN {label}");
    pem.windows(needle.len()).any(|w| w == needle.as_bytes())
}

impl Security {
    /// Mutual TLS with this certificate chain and key (PEM), trusting `ca` (PEM).
    pub fn from_pem(cert: Vec<u8>, key: Vec<u8>, ca: Vec<u8>) -> Result<Self, SecurityError> {
        if !pem_has(&cert, "CERTIFICATE") {
            return Err(SecurityError(
                "the TLS certificate holds no PEM certificate".into(),
            ));
        }
        if !String::from_utf8_lossy(&key).contains("PRIVATE KEY-----") {
            return Err(SecurityError("the TLS key holds no PEM private key".into()));
        }
        if !pem_has(&ca, "CERTIFICATE") {
            return Err(SecurityError("the TLS CA holds no PEM certificate".into()));
        }
        Ok(Security {
            tls: Some(Arc::new(TlsMaterial { cert, key, ca })),
            token: None,
            server_name: None,
        })
    }

    /// Adds the cluster token (it must be a valid header value; an empty one is refused).
    pub fn with_token(mut self, token: &str) -> Result<Self, SecurityError> {
        if token.is_empty() {
            return Err(SecurityError("the cluster token is empty".into()));
        }
        if MetadataValue::try_from(token).is_err() {
            return Err(SecurityError(
                "the cluster token must be printable ASCII".into(),
            ));
        }
        self.token = Some(token.into());
        Ok(self)
    }

    /// Checks servers this process dials under `name` instead of the host dialled.
    pub fn with_server_name(mut self, name: &str) -> Self {
        self.server_name = Some(name.to_string());
        self
    }

    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The cluster token, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// This process's certificate chain and key (PEM), for servers outside tonic (the OpenAI HTTP API).
    pub fn identity_pem(&self) -> Option<(&[u8], &[u8])> {
        self.tls
            .as_ref()
            .map(|m| (m.cert.as_slice(), m.key.as_slice()))
    }

    /// The server side of mutual TLS: this identity, clients must present a certificate the CA signed.
    pub fn server_tls(&self) -> Option<ServerTlsConfig> {
        self.tls.as_ref().map(|m| {
            ServerTlsConfig::new()
                .identity(Identity::from_pem(&m.cert, &m.key))
                .client_ca_root(Certificate::from_pem(&m.ca))
                .timeout(TLS_HANDSHAKE_TIMEOUT)
        })
    }

    /// An endpoint for `addr` (`host:port` or a URI): `https` with this identity and CA when TLS is on.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, tonic::transport::Error> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("{scheme}://{addr}")
        };
        let ep = Endpoint::from_shared(uri)?;
        match &self.tls {
            None => Ok(ep),
            Some(m) => {
                let mut cfg = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&m.ca))
                    .identity(Identity::from_pem(&m.cert, &m.key));
                if let Some(n) = &self.server_name {
                    cfg = cfg.domain_name(n.clone());
                }
                ep.tls_config(cfg)
            }
        }
    }

    /// The client side of the cluster token: adds it to every call (nothing without one).
    pub fn client_auth(&self) -> SendToken {
        SendToken(
            self.token
                .as_ref()
                .and_then(|t| MetadataValue::try_from(&**t).ok()),
        )
    }

    /// The server side of the cluster token: refuses calls without it (nothing without one).
    pub fn server_auth(&self) -> RequireToken {
        RequireToken(self.token.clone())
    }
}

/// An error with its causes, `a: b: c` (a transport error's own text is only "transport error"; the cause says
/// which certificate was refused, or why the connection failed).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !out.ends_with(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        cur = c.source();
    }
    out
}

/// Adds the cluster token to a call ([`Security::client_auth`]).
#[derive(Clone, Default)]
pub struct SendToken(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for SendToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert(TOKEN_HEADER, t.clone());
        }
        Ok(req)
    }
}

/// Refuses calls that do not carry the cluster token ([`Security::server_auth`]).
#[derive(Clone, Default)]
pub struct RequireToken(Option<Arc<str>>);

/// Equality that takes the same time wherever the first difference is (for secrets: tokens, API keys).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Interceptor for RequireToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.0 else {
            return Ok(req);
        };
        match req.metadata().get(TOKEN_HEADER) {
            Some(got) if same_secret(got.as_bytes(), want.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong cluster token")),
            None => Err(Status::unauthenticated(
                "this worker serves only its cluster's router (no cluster token)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_required_and_compared_whole() {
        let s = Security::default().with_token("s3cret").unwrap();
        let mut check = s.server_auth();
        assert_eq!(
            check.call(Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        for wrong in ["s3cre", "s3cret!", "S3cret", ""] {
            let mut r = Request::new(());
            r.metadata_mut()
                .insert(TOKEN_HEADER, MetadataValue::try_from(wrong).unwrap());
            assert_eq!(
                check.call(r).unwrap_err().code(),
                tonic::Code::Unauthenticated,
                "{wrong:?}"
            );
        }
        let sent = s.client_auth().call(Request::new(())).unwrap();
        assert!(check.call(sent).is_ok());
        // No token configured: nothing is checked, nothing is sent.
        assert!(
            Security::default()
                .server_auth()
                .call(Request::new(()))
                .is_ok()
        );
        let r = Security::default()
            .client_auth()
            .call(Request::new(()))
            .unwrap();
        assert!(r.metadata().get(TOKEN_HEADER).is_none());
    }

    #[test]
    fn bad_material_is_refused_with_a_message() {
        assert!(Security::default().with_token("").is_err());
        assert!(Security::default().with_token("line\nbreak").is_err());
        let e = Security::from_pem(b"junk".to_vec(), b"junk".to_vec(), b"junk".to_vec());
        assert!(e.unwrap_err().0.contains("certificate"));
        let args = SecurityArgs {
            tls_cert: Some("/nonexistent/cert.pem".into()),
            tls_key: Some("/nonexistent/key.pem".into()),
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        };
        assert!(args.load().unwrap_err().0.contains("/nonexistent/cert.pem"));
    }
}
