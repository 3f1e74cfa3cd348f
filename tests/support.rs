//! Test support: tiny random models with the real tokenizer, and router/worker servers on 127.0.0.1:0, each on its
//! own runtime so that a test can kill one (its runtime is shut down: listener and connections close at once).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parse_draft_worker::{DraftWorker, DraftWorkerConfig};
use parse_engine::model::{Arch, ModelConfig};
use parse_engine::ops::RopeStyle;
use parse_engine::{Engine, EngineOps, Model, Tokenizer};
use parse_router::{Router, RouterConfig};
use parse_target_worker::Worker as _;
use parse_target_worker::{TargetWorker, TargetWorkerConfig};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

/// The reference Qwen2.5 tokenizer kept in the repository (`assets/tokenizer`).
pub fn tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/tokenizer/qwen2.5-tokenizer.json")
}

pub fn tokenizer() -> Tokenizer {
    let p = tokenizer_path();
    Tokenizer::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Context length of the tiny models.
pub const TINY_CONTEXT: usize = 512;

/// A tiny random qwen2-shaped model with the real vocabulary; the same seed gives the same weights.
pub fn tiny_engine(seed: u64) -> Engine {
    let cfg = ModelConfig {
        arch: Arch::Qwen2,
        vocab_size: 151_936,
        hidden_size: 64,
        intermediate_size: 128,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        rms_eps: 1e-6,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        max_context: TINY_CONTEXT,
    };
    Engine::from_parts(
        Model::random(cfg, seed).expect("random model"),
        tokenizer(),
        1 << 30,
        Path::new(if seed == TARGET_SEED {
            "tiny-target"
        } else {
            "tiny-draft"
        }),
    )
}

pub const TARGET_SEED: u64 = 1;
pub const DRAFT_SEED: u64 = 2;

/// A server on its own runtime.
pub struct Server<W> {
    pub addr: SocketAddr,
    pub worker: W,
    rt: Option<Runtime>,
}

impl<W> Server<W> {
    /// Stops the server abruptly, like a killed process: every connection drops.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }

    pub fn endpoint(&self) -> String {
        self.addr.to_string()
    }
}

impl<W> Drop for Server<W> {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A two-thread runtime (servers here; clients in the tests).
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn start<W: Clone + Send + 'static, F>(
    worker: W,
    serve: impl FnOnce(W, tokio::net::TcpListener) -> F,
) -> Server<W>
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let rt = runtime();
    let (listener, addr) = rt
        .block_on(parse_proto::serve::bind(
            "127.0.0.1:0".parse().expect("addr"),
        ))
        .expect("bind");
    let fut = serve(worker.clone(), listener);
    rt.spawn(async move {
        if let Err(e) = fut.await {
            eprintln!("server ended: {e}");
        }
    });
    Server {
        addr,
        worker,
        rt: Some(rt),
    }
}

pub fn draft_server(engine: Engine, cfg: DraftWorkerConfig) -> Server<DraftWorker> {
    let w = DraftWorker::new(engine, cfg, CancellationToken::new()).expect("draft worker");
    start(w, |w, l| {
        parse_draft_worker::serve(w, l, std::future::pending())
    })
}

pub fn target_server(
    engine: impl EngineOps + Send + 'static,
    cfg: TargetWorkerConfig,
) -> Server<TargetWorker> {
    let w = TargetWorker::new(engine, cfg, CancellationToken::new()).expect("target worker");
    start(w, |w, l| {
        parse_target_worker::serve(w, l, std::future::pending())
    })
}

/// A gRPC client straight to a worker (no router, no TLS, no cluster token).
pub async fn worker_channel(endpoint: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

/// `OpenSession` for `session` on a three-token prompt.
pub fn open_request(session: &str) -> parse_proto::v1::OpenSessionRequest {
    parse_proto::v1::OpenSessionRequest {
        session: session.into(),
        prompt: vec![1, 2, 3],
        sampling: None,
    }
}

pub fn router_server(cfg: RouterConfig) -> Server<Router> {
    let rt = runtime();
    let router = rt.block_on(async { Router::new(cfg) }).expect("router");
    serve_router(rt, router)
}

/// A router whose workers come from `discovery` (e.g. a `MemoryDiscovery` the test changes).
pub fn router_server_with(
    cfg: RouterConfig,
    discovery: &dyn parse_discovery::Discovery,
) -> Server<Router> {
    let rt = runtime();
    let router = rt.block_on(async { Router::with_discovery(cfg, discovery) });
    serve_router(rt, router)
}

fn serve_router(rt: Runtime, router: Router) -> Server<Router> {
    let (listener, addr) = rt
        .block_on(parse_proto::serve::bind(
            "127.0.0.1:0".parse().expect("addr"),
        ))
        .expect("bind");
    let r = router.clone();
    rt.spawn(async move {
        if let Err(e) = parse_router::serve(r, listener, std::future::pending()).await {
            eprintln!("router ended: {e}");
        }
    });
    Server {
        addr,
        worker: router,
        rt: Some(rt),
    }
}

/// Polls `cond` until it holds or `timeout` passes.
pub fn eventually(timeout: Duration, cond: impl FnMut() -> bool) -> bool {
    eventually_every(timeout, Duration::from_millis(20), cond)
}

/// [`eventually`], checking every `every`.
pub fn eventually_every(
    timeout: Duration,
    every: Duration,
    mut cond: impl FnMut() -> bool,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(every);
    }
    cond()
}

fn announce(etcd: &str, id: &str, ttl: Duration) -> parse_discovery::Announce {
    parse_discovery::Announce {
        etcd: vec![etcd.to_string()],
        id: Some(id.to_string()),
        advertise: None,
        lease_ttl: ttl,
    }
}

/// A target worker registered in etcd under `id`, served as the binary serves it: until it is drained (then it
/// deregisters and stops once its sessions are done). Its keep-alives run on the server's runtime, so `kill`
/// stops them as a dead process would.
pub fn registered_target(
    engine: Engine,
    etcd: &str,
    id: &str,
    ttl: Duration,
) -> Server<TargetWorker> {
    let w = TargetWorker::new(
        engine,
        TargetWorkerConfig::default(),
        CancellationToken::new(),
    )
    .expect("target worker");
    let a = announce(etcd, id, ttl);
    start(w, move |w, l| async move {
        let addr = l.local_addr()?;
        let reg = a.register(parse_discovery::Role::Target, addr, "tiny", 1, 8)?;
        if let Some(r) = &reg {
            w.follow_registration(r.ready());
        }
        let w2 = w.clone();
        let until = async move {
            w2.drain()
                .serve_until(reg, || w2.open_sessions() == 0, std::future::pending())
                .await
        };
        parse_target_worker::serve(w, l, until).await
    })
}

/// A draft worker registered in etcd under `id` (see `registered_target`).
pub fn registered_draft(
    engine: Engine,
    etcd: &str,
    id: &str,
    ttl: Duration,
) -> Server<DraftWorker> {
    let w = DraftWorker::new(
        engine,
        DraftWorkerConfig::default(),
        CancellationToken::new(),
    )
    .expect("draft worker");
    let a = announce(etcd, id, ttl);
    start(w, move |w, l| async move {
        let addr = l.local_addr()?;
        let reg = a.register(parse_discovery::Role::Draft, addr, "tiny", 1, 8)?;
        let ready = match &reg {
            Some(r) => r.ready(),
            None => tokio::sync::watch::channel(true).1,
        };
        let w2 = w.clone();
        let until = async move {
            w2.drain()
                .serve_until(reg, || w2.open_sessions() == 0, std::future::pending())
                .await
        };
        parse_draft_worker::serve_reporting(w, l, until, ready).await
    })
}

/// The router with its admin API on another port of its runtime; returns the admin address.
pub fn router_with_admin(cfg: RouterConfig, token: &str) -> (Server<Router>, String) {
    let s = router_server(cfg);
    let rt = s.rt.as_ref().expect("a live router");
    let (listener, addr) = rt
        .block_on(parse_proto::serve::bind(
            "127.0.0.1:0".parse().expect("addr"),
        ))
        .expect("bind");
    let (r, token) = (s.worker.clone(), token.to_string());
    rt.spawn(async move {
        if let Err(e) = parse_router::serve_admin(r, listener, token, std::future::pending()).await
        {
            eprintln!("admin ended: {e}");
        }
    });
    (s, addr.to_string())
}

/// An etcd server (Debian's `etcd-server`) on free loopback ports with a temporary data directory, stopped by
/// pid when dropped.
pub struct Etcd {
    child: Option<std::process::Child>,
    dir: PathBuf,
    client: u16,
    peer: u16,
}

/// A port free on loopback now.
pub fn free_port() -> u16 {
    // The port is released before its user binds it, so the OS may hand it out again meanwhile; within this process
    // (tests run side by side in one binary) no port is handed out twice. A run where two tests got the same port
    // had one test's TP follower answer the other's leader address.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A binary of the workspace's build, beside the test's own directory (target/release/deps/<test> ->
/// target/release/<name>).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .join(name);
    assert!(p.exists(), "{} is not built", p.display());
    p
}

/// The default draft checkpoint (`$PARSE_MODEL_DIR` or `~/.cache/parse/models`).
pub fn draft_checkpoint() -> PathBuf {
    let dir = match std::env::var_os("PARSE_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/parse/models")
        }
    };
    let p = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} is missing: run deploy/models/fetch.py",
        p.display()
    );
    p
}

/// A child process, killed when dropped (a failing test leaves nothing behind).
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Etcd {
    pub fn start() -> Etcd {
        let dir =
            std::env::temp_dir().join(format!("parse-etcd-{}-{}", std::process::id(), free_port()));
        let mut e = Etcd {
            child: None,
            dir,
            client: free_port(),
            peer: free_port(),
        };
        e.restart();
        e
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    /// Starts (again) on the same ports and data directory; returns once it answers.
    pub fn restart(&mut self) {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("etcd is not installed: apt-get install etcd-server (.ci/run does)");
        let client = format!("http://127.0.0.1:{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = std::process::Command::new(bin)
            .args(["--name", "parse-test", "--data-dir"])
            .arg(&self.dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("parse-test={peer}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let ok = eventually(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", self.client)).is_ok()
        });
        assert!(ok, "etcd did not come up");
    }

    /// Kills the server (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Keys under `prefix` and their values.
    pub fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let ep = self.endpoint();
        let prefix = prefix.to_string();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let mut c = etcd_client::Client::connect([ep], None)
                .await
                .expect("etcd");
            let r = c
                .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
                .await
                .expect("get");
            r.kvs()
                .iter()
                .map(|kv| {
                    (
                        kv.key_str().unwrap_or_default().to_string(),
                        kv.value_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
