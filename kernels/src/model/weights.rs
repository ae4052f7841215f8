//! The tensors of a llama-family model, located and shape-checked once at load.

use std::ops::Range;
use std::sync::Arc;

use kvx_gguf::{GgmlType, GgufFile};

use super::{Arith, LlamaConfig, ModelError};
use crate::cpu::Kernels;
use crate::cpu::lanes::{LANE_ROWS, LaneArena, LaneMath, LaneMatrix};
use crate::greedy::HeadScreen;
use crate::ops::QMatrix;

/// A weight matrix inside the model file: validated at load, viewed as a [`QMatrix`] at use.
#[derive(Debug, Clone)]
pub struct MatRef {
    /// Tensor name.
    pub name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    range: Range<usize>,
    /// The row-lane copy, once [`LlamaModel::repack`] made one.
    lanes: Option<LaneMatrix>,
}

impl MatRef {
    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Whether [`LlamaModel::repack`] gave this matrix a row-lane copy.
    pub fn is_repacked(&self) -> bool {
        self.lanes.is_some()
    }
}

/// One transformer block.
#[derive(Debug)]
pub struct LayerWeights {
    /// Pre-attention RMS-norm weight.
    pub attn_norm: Vec<f32>,
    /// Query projection.
    pub wq: MatRef,
    /// Key projection.
    pub wk: MatRef,
    /// Value projection.
    pub wv: MatRef,
    /// Optional biases of the three projections (qwen2).
    pub bq: Option<Vec<f32>>,
    /// Key bias.
    pub bk: Option<Vec<f32>>,
    /// Value bias.
    pub bv: Option<Vec<f32>>,
    /// Attention output projection.
    pub wo: MatRef,
    /// Pre-FFN RMS-norm weight.
    pub ffn_norm: Vec<f32>,
    /// Gate projection.
    pub w_gate: MatRef,
    /// Up projection.
    pub w_up: MatRef,
    /// Down projection.
    pub w_down: MatRef,
}

/// A loaded model: the file (memory-mapped, shared read-only) and where each tensor is.
#[derive(Debug)]
pub struct LlamaModel {
    file: Arc<GgufFile>,
    /// Hyper-parameters.
    pub cfg: LlamaConfig,
    /// Token embedding (`n_vocab` rows of `n_embd`).
    pub tok_embd: MatRef,
    /// Final RMS-norm weight.
    pub output_norm: Vec<f32>,
    /// Output projection (the embedding itself when tied).
    pub output: MatRef,
    /// Whether `output` is the tied embedding.
    pub tied_embeddings: bool,
    /// Rope frequency factors (llama 3 style long-context scaling), if present.
    pub rope_freqs: Option<Vec<f32>>,
    /// The blocks.
    pub layers: Vec<LayerWeights>,
    /// The output head's fast screen for greedy rows ([`crate::greedy`]), once
    /// [`LlamaModel::repack`] gave the head an exact row-lane copy.
    head_screen: Option<HeadScreen>,
    /// Whether the K and V products of the first half of the layers
    /// ([`LlamaModel::splits_kv`]) take their input in two quantized parts (the input, then
    /// what its quantization left out), nearly the f32 input's product at twice those
    /// products' cost (the Q product takes the input's quantization alone): set by
    /// [`Arith::Split`](super::Arith::Split) before any [`Scratch`](super::Scratch) is made
    /// for the model, only where [`LlamaModel::can_split_kv`].
    pub split_kv: bool,
    /// Whether attention runs in the free association ([`crate::ops::attention_group`]:
    /// f32 queries and probabilities) rather than ggml's: set for the non-exact arithmetics
    /// ([`Arith::free_attention`](super::Arith::free_attention)) where
    /// [`crate::ops::attention_free_covers`] the model's heads.
    pub free_attention: bool,
}

impl LlamaModel {
    /// Locates and checks every tensor of `file`. Weights stay in the file's memory.
    pub fn load(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        let mut cfg = LlamaConfig::from_gguf(&file)?;
        let f = &*file;
        let tok_embd = mat(f, "token_embd.weight", None, Some(cfg.n_embd))?;
        cfg.n_vocab = tok_embd.rows;
        let (output, tied_embeddings) = match f.tensor("output.weight") {
            Some(_) => (mat(f, "output.weight", Some(cfg.n_vocab), Some(cfg.n_embd))?, false),
            None => (tok_embd.clone(), true),
        };
        let output_norm = vector(f, "output_norm.weight", cfg.n_embd)?;
        let rope_freqs = match f.tensor("rope_freqs.weight") {
            Some(_) => Some(vector(f, "rope_freqs.weight", cfg.rope_dims / 2)?),
            None => None,
        };
        let (q, kv, d, ff) = (cfg.q_dim(), cfg.kv_dim(), cfg.n_embd, cfg.n_ff);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |s: &str, len| -> Result<Option<Vec<f32>>, ModelError> {
                match f.tensor(&n(s)) {
                    Some(_) => Ok(Some(vector(f, &n(s), len)?)),
                    None => Ok(None),
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(f, &n("attn_norm.weight"), d)?,
                wq: mat(f, &n("attn_q.weight"), Some(q), Some(d))?,
                wk: mat(f, &n("attn_k.weight"), Some(kv), Some(d))?,
                wv: mat(f, &n("attn_v.weight"), Some(kv), Some(d))?,
                bq: bias("attn_q.bias", q)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                wo: mat(f, &n("attn_output.weight"), Some(d), Some(q))?,
                ffn_norm: vector(f, &n("ffn_norm.weight"), d)?,
                w_gate: mat(f, &n("ffn_gate.weight"), Some(ff), Some(d))?,
                w_up: mat(f, &n("ffn_up.weight"), Some(ff), Some(d))?,
                w_down: mat(f, &n("ffn_down.weight"), Some(d), Some(ff))?,
            });
        }
        let model = LlamaModel {
            file,
            cfg,
            tok_embd,
            output_norm,
            output,
            tied_embeddings,
            rope_freqs,
            layers,
            head_screen: None,
            split_kv: false,
            free_attention: false,
        };
        // Every matrix must be viewable: this checks types, sizes and alignment once.
        model.view(&model.tok_embd)?;
        model.view(&model.output)?;
        for l in &model.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                model.view(m)?;
            }
        }
        Ok(model)
    }

    /// Copies every matrix the row-lane kernel of `k` handles into its layout
    /// ([`crate::cpu::lanes`]), so that products with it use that kernel in `math`; returns
    /// the bytes copied (0 where `k` has no such kernel). The token embedding itself stays
    /// in the file (only its rows are read); a tied output head gets its own copy. The file
    /// pages of each copied matrix are released from resident memory once it is copied, so
    /// the copies replace the mapped weights in the resident set instead of adding to them.
    pub fn repack(&mut self, k: &Kernels, math: LaneMath) -> Result<usize, ModelError> {
        if k.lanes.is_none() {
            return Ok(0);
        }
        let file = self.file.clone();
        // The matrices to copy, in the order a step reads them (the output head last), into
        // one arena (`LaneArena`: huge pages for the weight streams).
        let mut todo: Vec<&mut MatRef> = self
            .layers
            .iter_mut()
            .flat_map(|l| {
                [
                    &mut l.wq,
                    &mut l.wk,
                    &mut l.wv,
                    &mut l.wo,
                    &mut l.w_gate,
                    &mut l.w_up,
                    &mut l.w_down,
                ]
            })
            .chain(std::iter::once(&mut self.output))
            .filter(|m| {
                m.lanes.is_none() && LaneMatrix::supports(m.ty) && m.rows.is_multiple_of(LANE_ROWS)
            })
            .collect();
        let src = |m: &MatRef| {
            file.bytes().get(m.range.clone()).ok_or_else(|| {
                ModelError::Config(format!("tensor {} lies outside the file", m.name))
            })
        };
        let mut lines = 0;
        for m in &todo {
            lines += LaneMatrix::lines_for(m.ty, m.rows, m.cols, src(m)?.len())
                .map_err(|e| ModelError::Config(format!("tensor {}: {e}", m.name)))?;
        }
        let mut arena = LaneArena::with_lines(lines);
        for m in &todo {
            arena
                .push(math, m.ty, m.rows, m.cols, src(m)?)
                .map_err(|e| ModelError::Config(format!("tensor {}: {e}", m.name)))?;
            // Products read the copy from now on: the file's pages of this matrix need not
            // stay resident (token embedding rows, if tied, fault back in as they are read).
            file.release(m.range.clone());
        }
        let mut bytes = 0;
        for (m, l) in todo.iter_mut().zip(arena.finish()) {
            bytes += l.bytes();
            m.lanes = Some(l);
        }
        if math == LaneMath::Exact {
            self.head_screen = self.output.lanes.as_ref().and_then(HeadScreen::new);
        }
        Ok(bytes)
    }

    /// The output head's screen for rows that want only their greedy token (see
    /// [`crate::greedy`]), where the head has an exact row-lane copy.
    pub fn head_screen(&self) -> Option<&HeadScreen> {
        self.head_screen.as_ref()
    }

    /// The model file.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// Whether layer `layer`'s K and V products take their input in two parts: with
    /// [`Self::split_kv`], the first half of the layers (rounded up). Half the layers buy
    /// ~45 % of what splitting every layer's input buys against [`Arith::Exact`]'s distance
    /// to the reference, wherever the half lies (first, second, even or odd layers), for
    /// half the doubled products: enough to stay nearer the reference than `Exact`
    /// (kernels/PERF.md, "`split` now splits the first half of the layers").
    pub fn splits_kv(&self, layer: usize) -> bool {
        self.split_kv && layer < self.layers.len().div_ceil(2)
    }

    /// Bytes of weights (all tensors).
    pub fn weight_bytes(&self) -> u64 {
        self.file.tensors().iter().map(|t| t.size_bytes()).sum()
    }

    /// Whether every layer's Q, K and V products share one activation type (one quantization
    /// of the input serves all three) that can be dequantized, as [`LlamaModel::split_kv`]
    /// needs.
    pub fn can_split_kv(&self) -> bool {
        self.layers.iter().all(|l| {
            match [&l.wq, &l.wk, &l.wv].map(|m| crate::quant::vec_dot_type(m.ty())) {
                [Some(a), Some(b), Some(c)] if a == b && b == c => {
                    let cols = crate::quant::QK_K;
                    let Some(bytes) = a.row_size(cols as u64) else { return false };
                    let row = vec![0u32; (bytes as usize).div_ceil(4)];
                    let row = &bytemuck::cast_slice::<u32, u8>(&row)[..bytes as usize];
                    crate::quant::dequantize_row(a, row, &mut [0.0; crate::quant::QK_K]).is_ok()
                }
                _ => false,
            }
        })
    }

    /// The default arithmetic for this model on `k`: the fastest one measured no farther
    /// from [`Arith::Reference`] than [`Arith::Exact`] (KL divergence shown no larger —
    /// token by token against `Exact`'s, the mean difference plus its standard error ≤ 0 —
    /// and perplexity within 0.2 %: kernels/PERF.md's tables; [`Arith::Fast`] is within a
    /// standard error of `Exact`, either side). That is [`Arith::Split`] where the CPU's
    /// `Fast` row-lane products pay ([`Kernels::fast_lanes_pay`]), every layer's matrices
    /// repack into row lanes and the K/V products can split ([`Self::can_split_kv`]);
    /// [`Arith::Exact`] everywhere else, where `split` would cost more than it saves.
    pub fn preferred_arith(&self, k: &Kernels) -> Arith {
        let lanes = self.layers.iter().all(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .all(|m| LaneMatrix::supports(m.ty) && m.rows.is_multiple_of(LANE_ROWS))
        });
        if k.fast_lanes_pay() && lanes && self.can_split_kv() { Arith::Split } else { Arith::Exact }
    }

    /// A kernel view of `m`.
    pub fn view<'a>(&'a self, m: &'a MatRef) -> Result<QMatrix<'a>, ModelError> {
        let data = self.file.bytes().get(m.range.clone()).ok_or_else(|| {
            ModelError::Config(format!("tensor {} lies outside the file", m.name))
        })?;
        let q = QMatrix::new(m.ty, m.rows, m.cols, data);
        let q = match (q, &m.lanes) {
            (Ok(q), Some(l)) => q.with_lanes(l),
            (q, _) => q,
        };
        q.map_err(|e| ModelError::Config(format!("tensor {}: {e}", m.name)))
    }
}

fn info<'f>(f: &'f GgufFile, name: &str) -> Result<&'f kvx_gguf::TensorInfo, ModelError> {
    f.tensor(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

fn mat(
    f: &GgufFile,
    name: &str,
    rows: Option<usize>,
    cols: Option<usize>,
) -> Result<MatRef, ModelError> {
    let t = info(f, name)?;
    if t.dims.len() != 2 {
        return Err(ModelError::Config(format!("{name}: expected 2 dims, found {:?}", t.dims)));
    }
    let (c, r) = (t.dims[0] as usize, t.dims[1] as usize);
    if rows.is_some_and(|x| x != r) || cols.is_some_and(|x| x != c) {
        return Err(ModelError::Config(format!(
            "{name}: shape [{c}, {r}] does not match the configuration (expected [{}, {}])",
            cols.map_or("?".into(), |v| v.to_string()),
            rows.map_or("?".into(), |v| v.to_string())
        )));
    }
    let data = f.tensor_data(t);
    let start = data.as_ptr() as usize - f.bytes().as_ptr() as usize;
    Ok(MatRef {
        name: name.to_string(),
        ty: t.ggml_type,
        rows: r,
        cols: c,
        range: start..start + data.len(),
        lanes: None,
    })
}

fn vector(f: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = info(f, name)?;
    if t.n_elements() != len as u64 {
        return Err(ModelError::Config(format!(
            "{name}: {} elements, expected {len}",
            t.n_elements()
        )));
    }
    let mut out = vec![0.0; len];
    crate::quant::dequantize_row(t.ggml_type, f.tensor_data(t), &mut out)
        .map_err(|e| ModelError::Config(format!("{name}: {e}")))?;
    Ok(out)
}
