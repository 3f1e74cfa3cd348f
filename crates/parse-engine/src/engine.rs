//! An engine: a model, its tokenizer and its sessions, loaded from a GGUF file or a safetensors directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::load::{self, GgufFile, LoadOptions};
use crate::model::{Logits, Model};
use crate::session::SessionStore;
use crate::tokenizer::Tokenizer;
use crate::tp::Op;
use parse_core::mask::BlockMask;

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
}

impl EngineConfig {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineConfig {
            model: model.into(),
            tokenizer: None,
            load: LoadOptions::default(),
            kv_capacity_bytes: DEFAULT_KV_CAPACITY,
        }
    }
}

/// A loaded model with its tokenizer and KV sessions.
pub struct Engine {
    pub(crate) model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    pub(crate) sessions: SessionStore,
    path: PathBuf,
    /// The tensor-parallel group this engine is a rank of (see `tp`).
    pub(crate) group: Option<crate::tp::Group>,
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
                None => Tokenizer::from_gguf(&g.content)?,
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
        Ok(Self::from_parts(
            model,
            tokenizer,
            cfg.kv_capacity_bytes,
            path,
        ))
    }

    pub fn from_parts(
        model: Model,
        tokenizer: Tokenizer,
        kv_capacity_bytes: usize,
        path: &Path,
    ) -> Self {
        Engine {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            sessions: SessionStore::new(kv_capacity_bytes),
            path: path.to_path_buf(),
            group: None,
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn open_session(&mut self, id: &str) -> Result<()> {
        self.leader()?;
        self.sessions.open(&self.model, id)?;
        self.send(&Op::Open(id.to_string()))
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
        if self.leader()?.is_some() {
            // Every check first: the followers are sent only a block that will run.
            self.sessions
                .check_forward(&self.model, session, tokens, positions, mask, readout)?;
            self.send(&Op::Forward {
                session: session.to_string(),
                tokens: tokens.to_vec(),
                positions: positions.to_vec(),
                mask: mask.rows().to_vec(),
            })?;
        }
        let r = self
            .sessions
            .forward(&self.model, session, tokens, positions, mask, readout);
        self.note_forward(r)
    }

    /// Causal block after what the session holds, logits at `readout`.
    pub fn forward_causal(
        &mut self,
        session: &str,
        tokens: &[u32],
        readout: &[usize],
    ) -> Result<Logits> {
        let base = self.sessions.len(session)?;
        let positions: Vec<u32> = (base..base + tokens.len()).map(|p| p as u32).collect();
        let mask = BlockMask::causal(base, tokens.len());
        self.forward(session, tokens, &positions, &mask, readout)
    }

    pub fn session_len(&self, session: &str) -> Result<usize> {
        self.sessions.len(session)
    }

    pub fn truncate(&mut self, session: &str, n: usize) -> Result<()> {
        self.leader()?;
        self.sessions.truncate(session, n)?;
        self.send(&Op::Truncate(session.to_string(), n))
    }

    pub fn release(&mut self, session: &str) -> Result<usize> {
        self.leader()?;
        let freed = self.sessions.release(session)?;
        self.send(&Op::Release(session.to_string()))?;
        Ok(freed)
    }
}
