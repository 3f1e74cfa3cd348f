//! Loading models from GGUF (weights kept in their quantized formats) and from safetensors + config.json.
//!
//! GGUF metadata is read with candle's parser; tensor bytes are read and checked here, so a truncated or corrupt
//! file is an [`Error::InvalidModel`] naming the file, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value};

use candle_core::quantized::tokenizer::TokenizerFromGguf;
use parse_text::Tokenizer;

use crate::error::{Error, Result};
use crate::model::{Arch, Layer, Model, ModelConfig, Weights};
use crate::ops::RopeStyle;
use crate::quant::{self, QMatrix};

/// Options applied while loading weights.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Re-quantize formats without fast CPU kernels (Q4_1, Q5_1) to Q8_0. On by default.
    pub fast_cpu_formats: bool,
    /// Caps the context length below the model's own (KV memory grows with it).
    pub max_context: Option<usize>,
    /// Re-quantize a GGUF model's separate output head stored in more bits per weight to this format
    /// ([`QMatrix::requantized_to`]); a safetensors model's head is read as stored. `None` (the default) reads it as
    /// stored. See [`LoadOptions::draft`].
    pub head_format: Option<GgmlDType>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            fast_cpu_formats: true,
            max_context: None,
            head_format: None,
        }
    }
}

impl LoadOptions {
    /// For a draft model: its output head in Q5_0. The default draft's head (151,936 x 896, the tied embedding
    /// stored again in Q8_0) is over a third of the bytes a one-token step reads (every weight but the embedding
    /// table, of which it reads a row); Q5_0 (the format of its embedding and most of its layers) reads about two
    /// thirds of those bytes.
    /// A draft only proposes tokens: where the target verifies them token by token (greedy `token-spec`) the output
    /// is the target's whatever the head, and in the PARSE modes the verdict decides which drafted tokens stay; the
    /// draft's greedy agreement with the target is the same with either head (`engine-bench --agreement` measures
    /// it).
    pub fn draft() -> Self {
        LoadOptions {
            head_format: Some(GgmlDType::Q5_0),
            ..LoadOptions::default()
        }
    }
}

/// An opened GGUF file: metadata plus a reader for tensor data.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    file: File,
    file_len: u64,
}

/// Walks a GGUF header (metadata and tensor table) without allocating from what it says: every string, array and
/// count must fit in the `len` bytes of the file. Versions 1 (32-bit lengths) to 3.
fn check_header(r: &mut impl std::io::Read, len: u64) -> std::result::Result<(), String> {
    struct Walk<'a, R> {
        r: &'a mut R,
        pos: u64,
        len: u64,
        wide: bool,
    }
    impl<R: std::io::Read> Walk<'_, R> {
        fn bytes<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
            let mut b = [0u8; N];
            self.r
                .read_exact(&mut b)
                .map_err(|_| format!("ends at byte {}", self.pos))?;
            self.pos += N as u64;
            Ok(b)
        }
        fn u32(&mut self) -> std::result::Result<u32, String> {
            self.bytes::<4>().map(u32::from_le_bytes)
        }
        fn count(&mut self) -> std::result::Result<u64, String> {
            if self.wide {
                self.bytes::<8>().map(u64::from_le_bytes)
            } else {
                self.u32().map(u64::from)
            }
        }
        /// Skips `n` items of `size` bytes, which must fit in what is left of the file.
        fn skip(&mut self, n: u64, size: u64) -> std::result::Result<(), String> {
            let bytes = n
                .checked_mul(size)
                .filter(|b| *b <= self.len.saturating_sub(self.pos))
                .ok_or_else(|| {
                    format!(
                        "a length of {n} items at byte {} runs past the file",
                        self.pos
                    )
                })?;
            std::io::copy(&mut self.r.take(bytes), &mut std::io::sink())
                .map_err(|e| e.to_string())?;
            self.pos += bytes;
            Ok(())
        }
        fn string(&mut self) -> std::result::Result<(), String> {
            let n = self.count()?;
            self.skip(n, 1)
        }
        fn value(&mut self, ty: u32, depth: u32) -> std::result::Result<(), String> {
            match ty {
                0 | 1 | 7 => self.skip(1, 1),
                2 | 3 => self.skip(1, 2),
                4..=6 => self.skip(1, 4),
                10..=12 => self.skip(1, 8),
                8 => self.string(),
                9 if depth < 2 => {
                    let item = self.u32()?;
                    let n = self.count()?;
                    // Every item takes at least a byte: a count beyond the file is a lie, whatever the type.
                    if n > self.len.saturating_sub(self.pos) {
                        return Err(format!(
                            "an array of {n} items at byte {} runs past the file",
                            self.pos
                        ));
                    }
                    match item {
                        0 | 1 | 7 => self.skip(n, 1),
                        2 | 3 => self.skip(n, 2),
                        4..=6 => self.skip(n, 4),
                        10..=12 => self.skip(n, 8),
                        _ => (0..n).try_for_each(|_| self.value(item, depth + 1)),
                    }
                }
                _ => Err(format!("value type {ty} at byte {}", self.pos)),
            }
        }
    }
    let mut w = Walk {
        r,
        pos: 0,
        len,
        wide: true,
    };
    if &w.bytes::<4>()? != b"GGUF" {
        return Err("no GGUF magic".into());
    }
    let version = w.u32()?;
    if !(1..=3).contains(&version) {
        return Err(format!("version {version}"));
    }
    w.wide = version >= 2;
    let tensors = w.count()?;
    let kvs = w.count()?;
    // A metadata entry takes at least 13 bytes, a tensor entry at least 21.
    if kvs
        .saturating_mul(13)
        .saturating_add(tensors.saturating_mul(21))
        > len
    {
        return Err(format!(
            "{kvs} metadata entries and {tensors} tensors do not fit in {len} bytes"
        ));
    }
    for _ in 0..kvs {
        w.string()?;
        let ty = w.u32()?;
        w.value(ty, 0)?;
    }
    for _ in 0..tensors {
        w.string()?;
        let dims = w.u32()?;
        if dims > 8 {
            return Err(format!("a tensor of {dims} dimensions"));
        }
        w.skip(u64::from(dims), if w.wide { 8 } else { 4 })?;
        w.skip(1, 4 + 8)?;
    }
    Ok(())
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        // Every count and length in the header is checked against the file's size before the parser trusts it:
        // a damaged header must be an error, not an allocation that aborts the process.
        // (Its own handle: clones share the file's position.)
        check_header(&mut BufReader::new(File::open(path).map_err(io)?), file_len)
            .map_err(|m| Error::model(path, format!("malformed GGUF header: {m}")))?;
        let mut reader = BufReader::new(file.try_clone().map_err(io)?);
        let content =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)))
                .map_err(|_| Error::model(path, "malformed GGUF header"))?
                .map_err(|e| Error::model(path, format!("not a readable GGUF file: {e}")))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            file,
            file_len,
        })
    }

    fn bad(&self, reason: impl Into<String>) -> Error {
        Error::model(&self.path, reason)
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)
            .ok_or_else(|| self.bad(format!("missing metadata `{key}`")))?
            .to_string()
            .map(|s| s.as_str())
            .map_err(|_| self.bad(format!("metadata `{key}` is not a string")))
    }

    pub fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self
            .meta(key)
            .ok_or_else(|| self.bad(format!("missing metadata `{key}`")))?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return Err(self.bad(format!("metadata `{key}` is not a non-negative integer"))),
        };
        usize::try_from(n).map_err(|_| self.bad(format!("metadata `{key}` is too large")))
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32> {
        match self.meta(key) {
            Some(Value::F32(x)) => Ok(*x),
            Some(Value::F64(x)) => Ok(*x as f32),
            Some(_) => Err(self.bad(format!("metadata `{key}` is not a float"))),
            None => Err(self.bad(format!("missing metadata `{key}`"))),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Shape (outermost first) and type of a tensor.
    pub fn tensor_shape(&self, name: &str) -> Result<(Vec<usize>, GgmlDType)> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        Ok((info.shape.dims().to_vec(), info.ggml_dtype))
    }

    fn read_bytes(&mut self, name: &str) -> Result<(Vec<usize>, GgmlDType, Vec<u8>)> {
        let (dims, dtype) = self.tensor_shape(name)?;
        let info = &self.content.tensor_infos[name];
        let elems = dims.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
        let bytes = elems
            .filter(|e| e % dtype.block_size() == 0)
            .and_then(|e| (e / dtype.block_size()).checked_mul(dtype.type_size()))
            .ok_or_else(|| {
                self.bad(format!(
                    "tensor `{name}` has an impossible shape {dims:?} for {dtype:?}"
                ))
            })?;
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(bytes as u64));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(self.bad(format!("tensor `{name}` has an impossible offset")));
        };
        if end > self.file_len {
            return Err(self.bad(format!(
                "tensor `{name}` ends at byte {end} but the file has {} bytes (truncated?)",
                self.file_len
            )));
        }
        let mut buf = vec![0u8; bytes];
        let path = self.path.clone();
        let io = |source| Error::Io { path, source };
        self.file.seek(SeekFrom::Start(start)).map_err(io.clone())?;
        self.file.read_exact(&mut buf).map_err(io)?;
        Ok((dims, dtype, buf))
    }

    /// A 2-D weight as a matrix of `dims[0]` output rows.
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<QMatrix> {
        let (dims, dtype, bytes) = self.read_bytes(name)?;
        if dims != [rows, cols] {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: vec![rows, cols],
                found: dims,
            });
        }
        QMatrix::from_bytes(dtype, rows, cols, &bytes).map_err(|e| {
            match quant::storage_bytes(dtype, rows, cols) {
                Some(_) => self.bad(format!("tensor `{name}`: {e}")),
                None => Error::UnsupportedDType {
                    tensor: name.to_string(),
                    dtype: format!("{dtype:?}"),
                },
            }
        })
    }

    /// A 1-D tensor as f32 values.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let (dims, dtype, bytes) = self.read_bytes(name)?;
        if dims != [len] {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: vec![len],
                found: dims,
            });
        }
        let m = QMatrix::from_bytes(dtype, 1, len, &bytes)
            .map_err(|e| self.bad(format!("tensor `{name}`: {e}")))?;
        Ok(m.to_f32())
    }
}

/// Reads the model configuration from GGUF metadata.
pub fn gguf_config(g: &GgufFile, opts: &LoadOptions) -> Result<ModelConfig> {
    let arch_name = g.meta_str("general.architecture")?.to_string();
    let arch = Arch::parse(&arch_name)?;
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden_size = g.meta_usize(&k("embedding_length"))?;
    let n_heads = g.meta_usize(&k("attention.head_count"))?;
    let n_kv_heads = match g.meta(&k("attention.head_count_kv")) {
        Some(_) => g.meta_usize(&k("attention.head_count_kv"))?,
        None => n_heads,
    };
    let head_dim = match g.meta(&k("attention.key_length")) {
        Some(_) => g.meta_usize(&k("attention.key_length"))?,
        None if n_heads > 0 => hidden_size / n_heads,
        None => 0,
    };
    let (embed_dims, _) = g.tensor_shape("token_embd.weight")?;
    let vocab_size = embed_dims.first().copied().unwrap_or(0);
    let ctx = g.meta_usize(&k("context_length"))?;
    if g.meta(&k("rope.scaling.type")).is_some() || g.has_tensor("rope_freqs.weight") {
        return Err(Error::model(
            &g.path,
            "rotary scaling (rope.scaling / rope_freqs) is not supported yet",
        ));
    }
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: g.meta_usize(&k("feed_forward_length"))?,
        n_layers: g.meta_usize(&k("block_count"))?,
        n_heads,
        n_kv_heads,
        head_dim,
        rms_eps: g.meta_f32(&k("attention.layer_norm_rms_epsilon"))?,
        rope_theta: g.meta_f32(&k("rope.freq_base")).unwrap_or(10000.0),
        rope_style: match arch {
            Arch::Qwen2 => RopeStyle::Neox,
            Arch::Llama => RopeStyle::Interleaved,
        },
        max_context: opts.max_context.map_or(ctx, |m| m.min(ctx)),
    };
    cfg.validate().map_err(|e| Error::model(&g.path, e.0))?;
    // The weights the metadata describes must fit in the file at a bit each at least.
    let (h, l) = (cfg.hidden_size as u128, cfg.n_layers as u128);
    let attn = h * ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim) as u128
        + (cfg.n_heads * cfg.head_dim) as u128 * h;
    let params = cfg.vocab_size as u128 * h + l * (attn + 3 * h * cfg.intermediate_size as u128);
    if params > u128::from(g.file_len) * 8 {
        return Err(Error::model(
            &g.path,
            format!(
                "the metadata describes {params} weights, more than the file's {} bytes can hold",
                g.file_len
            ),
        ));
    }
    Ok(cfg)
}

/// Loads a qwen2- or llama-architecture model from a GGUF file.
pub fn load_gguf(g: &mut GgufFile, opts: &LoadOptions) -> Result<Model> {
    crate::alloc::keep_large_buffers();
    let cfg = gguf_config(g, opts)?;
    let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let fast = |m: QMatrix| {
        if opts.fast_cpu_formats {
            m.into_fast_cpu_format()
        } else {
            m
        }
    };
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}");
        let bias = |g: &mut GgufFile, name: String, len: usize| -> Result<Option<Vec<f32>>> {
            if g.has_tensor(&name) {
                g.vector(&name, len).map(Some)
            } else {
                Ok(None)
            }
        };
        layers.push(Layer {
            attn_norm: g.vector(&p("attn_norm.weight"), d)?,
            wq: fast(g.matrix(&p("attn_q.weight"), qd, d)?),
            wk: fast(g.matrix(&p("attn_k.weight"), kvd, d)?),
            wv: fast(g.matrix(&p("attn_v.weight"), kvd, d)?),
            bq: bias(g, p("attn_q.bias"), qd)?,
            bk: bias(g, p("attn_k.bias"), kvd)?,
            bv: bias(g, p("attn_v.bias"), kvd)?,
            wo: fast(g.matrix(&p("attn_output.weight"), d, qd)?).into(),
            ffn_norm: g.vector(&p("ffn_norm.weight"), d)?,
            w_gate: fast(g.matrix(&p("ffn_gate.weight"), f, d)?),
            w_up: fast(g.matrix(&p("ffn_up.weight"), f, d)?),
            w_down: fast(g.matrix(&p("ffn_down.weight"), d, f)?).into(),
        });
    }
    let embed = fast(g.matrix("token_embd.weight", cfg.vocab_size, d)?);
    let lm_head = if g.has_tensor("output.weight") {
        // Requantized first, then laid out for this CPU: a head made Q5_0 here takes Q5_0's lanes layout as the
        // file's own Q5_0 matrices do (made fast before, the draft's head would stay in rows, the slower layout).
        let head = g.matrix("output.weight", cfg.vocab_size, d)?;
        Some(fast(match opts.head_format {
            Some(f) => head.requantized_to(f)?,
            None => head,
        }))
    } else {
        None
    };
    let norm = g.vector("output_norm.weight", d)?;
    Model::new(
        cfg,
        Weights {
            embed,
            layers,
            norm,
            lm_head,
        },
    )
}

/// Reads a Hugging Face `config.json`.
pub fn hf_config(path: &Path, opts: &LoadOptions) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::model(path, format!("config.json is not JSON: {e}")))?;
    let get = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
    let need =
        |k: &str| get(k).ok_or_else(|| Error::model(path, format!("config.json lacks `{k}`")));
    let model_type = v
        .get("model_type")
        .and_then(|x| x.as_str())
        .ok_or_else(|| Error::model(path, "config.json lacks `model_type`"))?;
    let arch = Arch::parse(model_type)?;
    if v.get("rope_scaling").is_some_and(|x| !x.is_null()) {
        return Err(Error::model(path, "rope_scaling is not supported yet"));
    }
    let hidden_size = need("hidden_size")?;
    let n_heads = need("num_attention_heads")?;
    let ctx = get("max_position_embeddings").unwrap_or(4096);
    let cfg = ModelConfig {
        arch,
        vocab_size: need("vocab_size")?,
        hidden_size,
        intermediate_size: need("intermediate_size")?,
        n_layers: need("num_hidden_layers")?,
        n_heads,
        n_kv_heads: get("num_key_value_heads").unwrap_or(n_heads),
        head_dim: get("head_dim").unwrap_or(hidden_size.checked_div(n_heads).unwrap_or(0)),
        rms_eps: v
            .get("rms_norm_eps")
            .and_then(|x| x.as_f64())
            .unwrap_or(1e-6) as f32,
        rope_theta: v
            .get("rope_theta")
            .and_then(|x| x.as_f64())
            .unwrap_or(10000.0) as f32,
        rope_style: RopeStyle::Neox,
        max_context: opts.max_context.map_or(ctx, |m| m.min(ctx)),
    };
    cfg.validate().map_err(|e| Error::model(path, e.0))?;
    Ok(cfg)
}

/// Loads a model from a directory with `config.json` and one or more `*.safetensors` files. Weights are kept in
/// f32 (bf16/f16 checkpoints are widened), which is exact and simple; GGUF is the format for quantized serving.
pub fn load_safetensors(dir: &Path, opts: &LoadOptions) -> Result<Model> {
    crate::alloc::keep_large_buffers();
    let cfg = hf_config(&dir.join("config.json"), opts)?;
    let io = |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::model(dir, "no .safetensors file"));
    }
    let mut tensors: HashMap<String, candle_core::Tensor> = HashMap::new();
    for f in &files {
        let t = candle_core::safetensors::load(f, &candle_core::Device::Cpu)
            .map_err(|e| Error::model(f, format!("not a readable safetensors file: {e}")))?;
        tensors.extend(t);
    }
    let mut take = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let t = tensors
            .remove(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        if t.dims() != shape {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: t.dims().to_vec(),
            });
        }
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let mat = |data: Vec<f32>, rows: usize, cols: usize| {
        QMatrix::from_f32(GgmlDType::F32, rows, cols, &data).map_err(Error::from)
    };
    let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let has_bias = cfg.arch == Arch::Qwen2;
        let mut bias = |name: String, len: usize| -> Result<Option<Vec<f32>>> {
            if has_bias {
                take(&name, &[len]).map(Some)
            } else {
                Ok(None)
            }
        };
        let bq = bias(p("self_attn.q_proj.bias"), qd)?;
        let bk = bias(p("self_attn.k_proj.bias"), kvd)?;
        let bv = bias(p("self_attn.v_proj.bias"), kvd)?;
        layers.push(Layer {
            attn_norm: take(&p("input_layernorm.weight"), &[d])?,
            wq: mat(take(&p("self_attn.q_proj.weight"), &[qd, d])?, qd, d)?,
            wk: mat(take(&p("self_attn.k_proj.weight"), &[kvd, d])?, kvd, d)?,
            wv: mat(take(&p("self_attn.v_proj.weight"), &[kvd, d])?, kvd, d)?,
            bq,
            bk,
            bv,
            wo: mat(take(&p("self_attn.o_proj.weight"), &[d, qd])?, d, qd)?.into(),
            ffn_norm: take(&p("post_attention_layernorm.weight"), &[d])?,
            w_gate: mat(take(&p("mlp.gate_proj.weight"), &[f, d])?, f, d)?,
            w_up: mat(take(&p("mlp.up_proj.weight"), &[f, d])?, f, d)?,
            w_down: mat(take(&p("mlp.down_proj.weight"), &[d, f])?, d, f)?.into(),
        });
    }
    let embed = mat(
        take("model.embed_tokens.weight", &[cfg.vocab_size, d])?,
        cfg.vocab_size,
        d,
    )?;
    let norm = take("model.norm.weight", &[d])?;
    let lm_head = match take("lm_head.weight", &[cfg.vocab_size, d]) {
        // Read at the checkpoint's own precision, `head_format` or not: a safetensors model is unquantized, and
        // quantizing its head alone is not what its owner chose.
        Ok(w) => Some(mat(w, cfg.vocab_size, d)?),
        Err(Error::MissingTensor(_)) => None,
        Err(e) => return Err(e),
    };
    Model::new(
        cfg,
        Weights {
            embed,
            layers,
            norm,
            lm_head,
        },
    )
}

/// The tokenizer a GGUF file carries in its metadata (vocabulary, merges, token types, pre-tokenizer, special tokens,
/// chat template).
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer> {
    let inner =
        tokenizers::Tokenizer::from_gguf(content).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let id = |k: &str| content.metadata.get(k).and_then(|v| v.to_u32().ok());
    let template = content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .map(|s| s.as_str());
    let add_bos = content
        .metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    Ok(Tokenizer::from_parts(
        inner,
        id("tokenizer.ggml.eos_token_id"),
        id("tokenizer.ggml.bos_token_id"),
        add_bos,
        template,
    ))
}
