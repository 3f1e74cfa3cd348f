//! Test support: tiny random models with the real tokenizer, and router/worker servers on 127.0.0.1:0, each on its
//! own runtime so that a test can kill one (its runtime is shut down: listener and connections close at once).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parse_draft_worker::{DraftWorker, DraftWorkerConfig};
use parse_engine::model::{Arch, ModelConfig};
use parse_engine::ops::RopeStyle;
use parse_engine::{Engine, Model, Tokenizer};
use parse_router::{Router, RouterConfig};
use parse_target_worker::{TargetWorker, TargetWorkerConfig};
use tokio::runtime::Runtime;

pub fn shared_dir() -> PathBuf {
    match std::env::var_os("PARSE_SHARED_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
    }
}

pub fn tokenizer() -> Tokenizer {
    let p = shared_dir().join("models/qwen2.5-tokenizer.json");
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

fn runtime() -> Runtime {
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
    let w = DraftWorker::new(engine, cfg).expect("draft worker");
    start(w, |w, l| {
        parse_draft_worker::serve(w, l, std::future::pending())
    })
}

pub fn target_server(engine: Engine, cfg: TargetWorkerConfig) -> Server<TargetWorker> {
    let w = TargetWorker::new(engine, cfg).expect("target worker");
    start(w, |w, l| {
        parse_target_worker::serve(w, l, std::future::pending())
    })
}

pub fn router_server(cfg: RouterConfig) -> Server<Router> {
    let rt = runtime();
    let router = rt.block_on(async { Router::new(cfg) }).expect("router");
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
pub fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}
