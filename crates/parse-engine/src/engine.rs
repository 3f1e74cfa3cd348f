//! An engine: a model, its tokenizer and its sessions, loaded from a GGUF file or a safetensors directory.
//!
//! [`EngineOps`] is what the PARSE backends and the workers drive: an [`Engine`] alone, or a tensor-parallel leader
//! (`tp::Leader`) that wraps one. The engine knows nothing of groups.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::any_model::Net;
use crate::candle::Compute;
use crate::error::{Error, Result};
use crate::load::{self, GgufFile, LoadOptions};
use crate::model::{Logits, Model, ModelConfig};
use crate::session::SessionStore;
use parse_core::mask::BlockMask;
use parse_text::Tokenizer;

/// Default KV capacity of an engine: 4 GiB.
pub const DEFAULT_KV_CAPACITY: usize = 4 << 30;

/// How to load an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// A `.gguf` file, or a directory with `config.json`, `*.safetensors` and `tokenizer.json`.
    pub model: PathBuf,
    /// A `tokenizer.json` used instead of the one the model brings.
    pub tokenizer: Option<PathBuf>,
    pub load: LoadOptions,
    pub kv_capacity_bytes: usize,
    /// The most of `kv_capacity_bytes` one session may hold (0 < share <= 1; see
    /// [`SessionStore::set_session_share`]).
    pub kv_session_share: f64,
    /// Bytes of prompts' caches kept for later requests that begin the same way (automatic prefix caching; see
    /// [`SessionStore::set_prefix_budget`]); 0 keeps none.
    pub prefix_cache_bytes: usize,
    /// Which model implementation computes, and on which device (`--backend`, `--device`).
    pub compute: Compute,
}

impl EngineConfig {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineConfig {
            model: model.into(),
            tokenizer: None,
            load: LoadOptions::default(),
            kv_capacity_bytes: DEFAULT_KV_CAPACITY,
            kv_session_share: 1.0,
            prefix_cache_bytes: crate::session::DEFAULT_PREFIX_BUDGET,
            compute: Compute::default(),
        }
    }
}

pub use crate::block::Block;

/// A loaded model with its tokenizer and KV sessions.
pub struct Engine {
    pub(crate) model: Arc<Net>,
    tokenizer: Arc<Tokenizer>,
    pub(crate) sessions: SessionStore,
    path: PathBuf,
}

impl Engine {
    pub fn load(cfg: &EngineConfig) -> Result<Self> {
        let path = &cfg.model;
        let _span = tracing::info_span!("load", path = %path.display()).entered();
        let (model, tokenizer) = if path.is_dir() {
            let model = load::load_safetensors(path, &cfg.load)?;
            let tok_path = cfg
                .tokenizer
                .clone()
                .unwrap_or_else(|| path.join("tokenizer.json"));
            (model, Tokenizer::from_file(&tok_path)?)
        } else {
            let mut g = GgufFile::open(path)?;
            let model = load::load_gguf(&mut g, &cfg.load)?;
            let tokenizer = match &cfg.tokenizer {
                Some(t) => Tokenizer::from_file(t)?,
                None => load::tokenizer_from_gguf(&g.content)?,
            };
            (model, tokenizer)
        };
        if tokenizer.vocab_size() > model.config().vocab_size {
            return Err(Error::model(
                path,
                format!(
                    "tokenizer has {} tokens but the model's vocabulary is {}",
                    tokenizer.vocab_size(),
                    model.config().vocab_size
                ),
            ));
        }
        let net = {
            let _span = tracing::info_span!("place", compute = %cfg.compute).entered();
            Net::place(model, cfg.compute)?
        };
        let mut engine = Self::from_net(net, tokenizer, cfg.kv_capacity_bytes, path);
        engine.set_kv_session_share(cfg.kv_session_share)?;
        engine.sessions.set_prefix_budget(cfg.prefix_cache_bytes);
        Ok(engine)
    }

    /// An engine on the kernel model.
    pub fn from_parts(
        model: Model,
        tokenizer: Tokenizer,
        kv_capacity_bytes: usize,
        path: &Path,
    ) -> Self {
        Self::from_net(Net::Kernels(model), tokenizer, kv_capacity_bytes, path)
    }

    /// An engine on any model implementation.
    pub fn from_net(net: Net, tokenizer: Tokenizer, kv_capacity_bytes: usize, path: &Path) -> Self {
        Engine {
            model: Arc::new(net),
            tokenizer: Arc::new(tokenizer),
            sessions: SessionStore::new(kv_capacity_bytes),
            path: path.to_path_buf(),
        }
    }

    /// The model, on whichever implementation runs it.
    pub fn model(&self) -> &Arc<Net> {
        &self.model
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Caps what one session may hold at `share` of the KV capacity (see [`SessionStore::set_session_share`]).
    pub fn set_kv_session_share(&mut self, share: f64) -> Result<()> {
        self.sessions.set_session_share(share)
    }

    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    /// See [`Net::kv_device_bytes`].
    pub fn kv_device_bytes(&self) -> Option<usize> {
        self.model.kv_device_bytes()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn open_session(&mut self, id: &str) -> Result<()> {
        self.sessions.open(&self.model, id)
    }

    /// See [`SessionStore::set_prefix_budget`].
    pub fn set_prefix_budget(&mut self, bytes: usize) {
        self.sessions.set_prefix_budget(bytes)
    }

    /// `forward(session, tokens, positions, mask, readout)`: see [`Model::forward`].
    pub fn forward(
        &mut self,
        session: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        self.sessions
            .forward(&self.model, session, tokens, positions, mask, readout)
    }

    /// Causal block after what the session holds, logits at `readout`.
    pub fn forward_causal(
        &mut self,
        session: &str,
        tokens: &[u32],
        readout: &[usize],
    ) -> Result<Logits> {
        EngineOps::forward_causal(self, session, tokens, readout)
    }

    pub fn session_len(&self, session: &str) -> Result<usize> {
        self.sessions.len(session)
    }

    pub fn truncate(&mut self, session: &str, n: usize) -> Result<()> {
        self.sessions.truncate(session, n)
    }

    pub fn release(&mut self, session: &str) -> Result<usize> {
        self.sessions.release(session)
    }
}

/// The session operations of an engine, run in this process alone ([`Engine`]) or on every rank of a
/// tensor-parallel group (`tp::Leader`). What reads the model, tokenizer or caches goes through [`EngineOps::engine`].
pub trait EngineOps {
    /// The engine (rank 0's, in a group): model, tokenizer, sessions.
    fn engine(&self) -> &Engine;
    fn open_session(&mut self, id: &str) -> Result<()>;
    /// `forward(session, tokens, positions, mask, readout)`: see `Model::forward`.
    fn forward(
        &mut self,
        session: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits>;
    fn truncate(&mut self, session: &str, n: usize) -> Result<()>;
    /// Frees a session; returns the bytes it held.
    fn release(&mut self, session: &str) -> Result<usize>;

    /// Fills an empty session with the keys and values of the first tokens of `tokens` that a prompt kept for
    /// later requests in namespace `salt` shares, where it can ([`SessionStore::reuse_prefix`]); returns how many
    /// it holds. The default, which a tensor-parallel leader keeps (its ranks' caches are not copied), reuses none.
    fn reuse_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<usize> {
        let _ = (session, salt, tokens);
        Ok(0)
    }
    /// Keeps a copy of a session's cache, which holds `tokens`, for later requests in namespace `salt` that begin
    /// the same way ([`SessionStore::keep_prefix`]); the default keeps none.
    fn keep_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<()> {
        let _ = (session, salt, tokens);
        Ok(())
    }

    /// Runs the blocks of several sessions in one step; one result per block, in order. An engine packs them into
    /// one pass (bitwise the same logits as one at a time); the default, which a tensor-parallel leader keeps, runs
    /// them one after another.
    fn forward_batch(&mut self, blocks: &[Block]) -> Vec<Result<Logits>> {
        blocks
            .iter()
            .map(|b| self.forward(&b.session, &b.tokens, &b.positions, &b.mask, &b.readout))
            .collect()
    }

    /// Ranks that compute each step (1 alone).
    fn world_size(&self) -> usize {
        1
    }
    /// Whether every rank is still there (always, alone).
    fn healthy(&self) -> bool {
        true
    }
    /// Checks the other ranks (no-op alone); an error means the group is broken.
    fn heartbeat(&mut self) -> Result<()> {
        Ok(())
    }
    /// Tells the other ranks that this one is stopping (no-op alone).
    fn shutdown(&mut self) -> Result<()> {
        Ok(())
    }

    /// Causal block after what the session holds, logits at `readout`.
    fn forward_causal(
        &mut self,
        session: &str,
        tokens: &[u32],
        readout: &[usize],
    ) -> Result<Logits> {
        let base = self.engine().session_len(session)?;
        let positions: Vec<u32> = (base..base + tokens.len()).map(|p| p as u32).collect();
        let mask = BlockMask::causal(base, tokens.len());
        self.forward(session, tokens, &positions, &mask, readout)
    }
}

impl EngineOps for Engine {
    fn engine(&self) -> &Engine {
        self
    }
    fn open_session(&mut self, id: &str) -> Result<()> {
        Engine::open_session(self, id)
    }
    fn forward(
        &mut self,
        session: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        Engine::forward(self, session, tokens, positions, mask, readout)
    }
    fn truncate(&mut self, session: &str, n: usize) -> Result<()> {
        Engine::truncate(self, session, n)
    }
    fn release(&mut self, session: &str) -> Result<usize> {
        Engine::release(self, session)
    }
    fn reuse_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<usize> {
        self.sessions
            .reuse_prefix(&self.model, session, salt, tokens)
    }
    fn keep_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<()> {
        self.sessions.keep_prefix(session, salt, tokens)
    }
    fn forward_batch(&mut self, blocks: &[Block]) -> Vec<Result<Logits>> {
        self.sessions.forward_batch(&self.model, blocks)
    }
}

/// `&mut E` and `Box<E>` drive the engine they point to.
macro_rules! delegate_ops {
    ($($ty:ty),*) => {$(
        impl<T: EngineOps + ?Sized> EngineOps for $ty {
            fn engine(&self) -> &Engine {
                (**self).engine()
            }
            fn open_session(&mut self, id: &str) -> Result<()> {
                (**self).open_session(id)
            }
            fn forward(
                &mut self,
                session: &str,
                tokens: &[u32],
                positions: &[u32],
                mask: &BlockMask,
                readout: &[usize],
            ) -> Result<Logits> {
                (**self).forward(session, tokens, positions, mask, readout)
            }
            fn truncate(&mut self, session: &str, n: usize) -> Result<()> {
                (**self).truncate(session, n)
            }
            fn release(&mut self, session: &str) -> Result<usize> {
                (**self).release(session)
            }
            fn reuse_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<usize> {
                (**self).reuse_prefix(session, salt, tokens)
            }
            fn keep_prefix(&mut self, session: &str, salt: u64, tokens: &[u32]) -> Result<()> {
                (**self).keep_prefix(session, salt, tokens)
            }
            fn forward_batch(&mut self, blocks: &[Block]) -> Vec<Result<Logits>> {
                (**self).forward_batch(blocks)
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn healthy(&self) -> bool {
                (**self).healthy()
            }
            fn heartbeat(&mut self) -> Result<()> {
                (**self).heartbeat()
            }
            fn shutdown(&mut self) -> Result<()> {
                (**self).shutdown()
            }
        }
    )*};
}

delegate_ops!(&mut T, Box<T>);
