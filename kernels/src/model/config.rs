//! Hyper-parameters of a llama-family model, read from GGUF metadata.

use kvx_gguf::GgufFile;

use super::ModelError;

/// How rotary embedding pairs dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKind {
    /// Adjacent pairs `(2i, 2i+1)` (llama, mistral).
    Norm,
    /// Halves `(i, i + n/2)` (qwen2, phi3, ...).
    Neox,
}

/// The shape and constants of a llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`.
    pub arch: String,
    /// Vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub n_ff: usize,
    /// Dimensions of each head that rope rotates.
    pub rope_dims: usize,
    /// Rope base frequency.
    pub rope_base: f32,
    /// Pairing of rope dimensions.
    pub rope_kind: RopeKind,
    /// RMS-norm epsilon.
    pub norm_eps: f32,
    /// Context length the model was trained for.
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads the configuration of a supported architecture.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch = f.get_str("general.architecture")?.to_string();
        let rope_kind = match arch.as_str() {
            "llama" | "mistral" | "granite" => RopeKind::Norm,
            "qwen2" => RopeKind::Neox,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "architecture {other:?} (supported: llama, mistral, qwen2)"
                )));
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(f.get_u64(&key(k))? as usize) };
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_head_kv = match f.get(&key("attention.head_count_kv")) {
            Some(_) => u("attention.head_count_kv")?,
            None => n_head,
        };
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::Config(format!(
                "head counts {n_head}/{n_head_kv} are not a valid GQA grouping"
            )));
        }
        let head_dim = match f.get(&key("attention.key_length")) {
            Some(_) => u("attention.key_length")?,
            None => n_embd / n_head,
        };
        if f.get(&key("attention.value_length")).is_some()
            && u("attention.value_length")? != head_dim
        {
            return Err(ModelError::Unsupported("key and value head sizes differ".into()));
        }
        let rope_dims = match f.get(&key("rope.dimension_count")) {
            Some(_) => u("rope.dimension_count")?,
            None => head_dim,
        };
        let rope_base = match f.get(&key("rope.freq_base")) {
            Some(_) => f.get_f32(&key("rope.freq_base"))?,
            None => 10_000.0,
        };
        let scaling = f.get_str(&key("rope.scaling.type")).unwrap_or("none");
        let factor = f.get_f32(&key("rope.scaling.factor")).unwrap_or(1.0);
        if scaling != "none" || (factor != 1.0 && factor != 0.0) {
            return Err(ModelError::Unsupported(format!(
                "rope scaling {scaling:?} (factor {factor})"
            )));
        }
        let cfg = LlamaConfig {
            n_vocab: 0,
            n_embd,
            n_layer: u("block_count")?,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: u("feed_forward_length")?,
            rope_dims,
            rope_base,
            rope_kind,
            norm_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: u("context_length")?,
            arch,
        };
        if cfg.rope_dims > cfg.head_dim || !cfg.rope_dims.is_multiple_of(2) || cfg.head_dim == 0 {
            return Err(ModelError::Config(format!(
                "rope dims {} do not fit head size {}",
                cfg.rope_dims, cfg.head_dim
            )));
        }
        Ok(cfg)
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Bytes of KV cache per token (keys and values of every layer, f16).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.kv_dim() * 2
    }
}
