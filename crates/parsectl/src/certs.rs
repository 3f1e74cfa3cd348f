//! `parsectl certs DIR`: a throw-away cluster CA, the certificates of the router, the workers and a client, and a
//! cluster token, for `deploy/local/up.sh --tls` and for trying the chart's TLS without cert-manager. Production
//! clusters should issue from their own CA (cert-manager, Vault): nothing here rotates or revokes.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::CliError;

#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    /// Directory to write into (created if missing; existing files are never overwritten).
    pub dir: PathBuf,
    /// More names or addresses the router's and the workers' certificates carry (the Service names clients dial,
    /// a node's IP...); `localhost`, `127.0.0.1`, `::1` and the role names `parse-router` / `parse-worker` are
    /// always in.
    #[arg(long = "host", value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// Days the certificates stay valid.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

/// The files written, relative to the directory.
pub const FILES: [&str; 10] = [
    "ca.pem",
    "ca-key.pem",
    "router.pem",
    "router-key.pem",
    "worker.pem",
    "worker-key.pem",
    "client.pem",
    "client-key.pem",
    "cluster-token",
    "README",
];

fn tls_err(e: rcgen::Error) -> CliError {
    CliError::Usage(format!("cannot make a certificate: {e}"))
}

fn validity(p: &mut CertificateParams, days: u32) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack before now: clocks of the machines in a cluster differ.
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + time::Duration::days(i64::from(days));
}

/// An I/O error that names what was done to which path (the exit code stays a failure's, not a usage error's).
fn in_path(e: std::io::Error, what: &str, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("cannot {what} {}: {e}", path.display()))
}

/// Writes `bytes` to a new file (never over an existing one), private ones readable by the owner only.
fn write_new(path: &Path, bytes: &[u8], private: bool) -> Result<(), CliError> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(if private { 0o600 } else { 0o644 });
    }
    let _ = private;
    let mut f = o.open(path).map_err(|e| {
        CliError::Usage(format!(
            "cannot write {}: {e} (certs never overwrites a file: remove the old set or pick another directory)",
            path.display()
        ))
    })?;
    f.write_all(bytes).map_err(|e| in_path(e, "write", path))?;
    Ok(())
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    cn: &str,
    sans: Vec<String>,
    days: u32,
) -> Result<(String, String), CliError> {
    let mut p = CertificateParams::new(sans).map_err(tls_err)?;
    p.distinguished_name.push(DnType::CommonName, cn);
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    // Every process is a server to some hops and a client on others (the router serves users and dials workers).
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity(&mut p, days);
    let key = KeyPair::generate().map_err(tls_err)?;
    let cert = p.signed_by(&key, issuer).map_err(tls_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

pub fn certs(a: &CertsArgs) -> Result<(), CliError> {
    if a.days == 0 {
        return Err(CliError::Usage("--days must be at least 1".into()));
    }
    std::fs::create_dir_all(&a.dir).map_err(|e| in_path(e, "create the directory", &a.dir))?;
    for f in FILES {
        if a.dir.join(f).exists() {
            return Err(CliError::Usage(format!(
                "{} exists: certs never overwrites a file (remove the old set or pick another directory)",
                a.dir.join(f).display()
            )));
        }
    }
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    ca.distinguished_name
        .push(DnType::CommonName, "PARSE cluster CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut ca, a.days);
    let ca_key = KeyPair::generate().map_err(tls_err)?;
    let ca_cert = ca.self_signed(&ca_key).map_err(tls_err)?;
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca, ca_key);

    let base = |role: &str| {
        let mut v: Vec<String> = ["localhost", "127.0.0.1", "::1", role]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for h in &a.hosts {
            if !h.is_empty() && !v.contains(h) {
                v.push(h.clone());
            }
        }
        v
    };
    let (router, router_key) = leaf(&issuer, "parse-router", base("parse-router"), a.days)?;
    let (worker, worker_key) = leaf(&issuer, "parse-worker", base("parse-worker"), a.days)?;
    let (client, client_key) = leaf(&issuer, "parse-client", vec!["parse-client".into()], a.days)?;
    let token: [u8; 32] = rand::random();
    let token: String = token.iter().map(|b| format!("{b:02x}")).collect();
    let readme = format!(
        "A throw-away PARSE cluster CA and certificates made by `parsectl certs` ({} days).\n\
         router.pem: the router (names: {}); worker.pem: every worker (names: {}; the router checks\n\
         workers under --tls-server-name parse-worker, since it dials them by address); client.pem: users and\n\
         parsectl. Each key is readable by its owner only. cluster-token: the secret workers require of the\n\
         router (--cluster-token-file). Nothing here rotates or revokes: use your own CA in production.\n",
        a.days,
        base("parse-router").join(", "),
        base("parse-worker").join(", "),
    );
    let ca_pem = ca_cert.pem();
    let files: [(&str, &[u8], bool); 10] = [
        ("ca.pem", ca_pem.as_bytes(), false),
        ("ca-key.pem", ca_key_pem.as_bytes(), true),
        ("router.pem", router.as_bytes(), false),
        ("router-key.pem", router_key.as_bytes(), true),
        ("worker.pem", worker.as_bytes(), false),
        ("worker-key.pem", worker_key.as_bytes(), true),
        ("client.pem", client.as_bytes(), false),
        ("client-key.pem", client_key.as_bytes(), true),
        ("cluster-token", token.as_bytes(), true),
        ("README", readme.as_bytes(), false),
    ];
    for (name, bytes, private) in files {
        write_new(&a.dir.join(name), bytes, private)?;
    }
    println!("{}", a.dir.display());
    Ok(())
}
