//! The reference arithmetic: the model's own math on its quantized weights, with nothing
//! else rounded. Weights are dequantized to f32 (exactly what the quantized blocks encode);
//! activations stay f32 between operations (no quantization for the products); every dot
//! product, norm, rotation, softmax and weighted sum is computed in f64 (f32 × f32 products
//! are exact in f64) and rounded once to f32; keys and values are cached as f32.
//!
//! This is the base that kvx's fast arithmetics are measured against (`kvx eval perplexity
//! --arith reference --save-logits`, then `--kl-divergence` with another arithmetic): slow
//! (portable scalar code, weights dequantized row by row on every step), and written for
//! clarity. No sum crosses tokens, so a token's bits never depend on its batch.
//!
//! [`RefRounding`] adds chosen roundings to it (weights, the weight products' inputs, the
//! cached keys and values, each to bf16 or f16, round to nearest even) and nothing else, so
//! that what a would-be arithmetic's number formats alone cost in distance is measured
//! before any kernel for it is written (kernels/PERF.md).

use std::sync::Mutex;

use super::forward::check_chunk;
use super::{LlamaConfig, LlamaModel, Logits, ModelError, RopeKind, SeqChunk};
use crate::cpu::disjoint::DisjointOut;
use crate::ops::QMatrix;
use crate::par::{ThreadPool, split_range};

/// A number format that [`RefRounding`] rounds values to (to nearest, ties to even).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundTo {
    /// bfloat16: 8 significant bits, f32's range.
    Bf16,
    /// IEEE half: 11 significant bits.
    F16,
}

impl RoundTo {
    fn round(self, x: f32) -> f32 {
        match self {
            RoundTo::Bf16 => half::bf16::from_f32(x).to_f32(),
            RoundTo::F16 => half::f16::from_f32(x).to_f32(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            RoundTo::Bf16 => "bf16",
            RoundTo::F16 => "f16",
        }
    }
}

/// Roundings added to the reference arithmetic (module docs); the default adds none, and
/// then every bit is the reference's. Written and parsed as `weights=bf16,acts=bf16,kv=f16`
/// (any of the three, each `bf16` or `f16`), or `none`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefRounding {
    /// Every weight row, as it is dequantized for a product (the output head's included).
    pub weights: Option<RoundTo>,
    /// Every weight product's input (each token's activations), before the product;
    /// attention's own products (queries, scores, probabilities) are not rounded.
    pub acts: Option<RoundTo>,
    /// Keys and values, as they are written to the cache.
    pub kv: Option<RoundTo>,
}

impl RefRounding {
    /// Whether it adds no rounding.
    pub fn is_none(&self) -> bool {
        *self == RefRounding::default()
    }
}

impl std::fmt::Display for RefRounding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [("weights", self.weights), ("acts", self.acts), ("kv", self.kv)]
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={}", v.name())))
            .collect();
        if parts.is_empty() { f.write_str("none") } else { f.write_str(&parts.join(",")) }
    }
}

/// A [`RefRounding`] that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("reference rounding {spec:?}: {why}")]
pub struct RefRoundingError {
    spec: String,
    why: String,
}

impl std::str::FromStr for RefRounding {
    type Err = RefRoundingError;

    fn from_str(s: &str) -> Result<Self, RefRoundingError> {
        let bad = |why: String| RefRoundingError { spec: s.to_string(), why };
        let mut r = RefRounding::default();
        if s.trim() == "none" {
            return Ok(r);
        }
        for part in s.split(',').map(str::trim) {
            if part == "none" {
                return Err(bad("`none` stands alone".into()));
            }
            let Some((key, fmt)) = part.split_once('=') else {
                return Err(bad(format!("{part:?} is not `what=format`")));
            };
            let fmt = match fmt.trim() {
                "bf16" => RoundTo::Bf16,
                "f16" => RoundTo::F16,
                other => return Err(bad(format!("unknown format {other:?} (bf16 or f16)"))),
            };
            let slot = match key.trim() {
                "weights" => &mut r.weights,
                "acts" => &mut r.acts,
                "kv" => &mut r.kv,
                other => return Err(bad(format!("unknown part {other:?} (weights, acts or kv)"))),
            };
            if slot.replace(fmt).is_some() {
                return Err(bad(format!("{:?} given twice", key.trim())));
            }
        }
        Ok(r)
    }
}

/// Rounds every value of `v` to `to`, if any.
fn round_all(v: &mut [f32], to: Option<RoundTo>) {
    if let Some(to) = to {
        for x in v {
            *x = to.round(*x);
        }
    }
}

/// A paged f32 KV cache: per block and layer, `block_size` key rows then `block_size` value
/// rows of `kv_dim` f32 each.
pub struct RefKv {
    n_blocks: usize,
    block_size: usize,
    n_layer: usize,
    kv_dim: usize,
    data: Vec<f32>,
}

impl std::fmt::Debug for RefKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefKv")
            .field("n_blocks", &self.n_blocks)
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl RefKv {
    /// `n_blocks` blocks of `block_size` positions for `cfg`'s layers.
    pub fn new(cfg: &LlamaConfig, n_blocks: usize, block_size: usize) -> Result<Self, ModelError> {
        let len = [n_blocks, cfg.n_layer, 2, block_size, cfg.kv_dim()]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ModelError::Config(format!("a KV cache of {n_blocks} blocks of {block_size}"))
            })?;
        Ok(RefKv {
            n_blocks,
            block_size,
            n_layer: cfg.n_layer,
            kv_dim: cfg.kv_dim(),
            data: vec![0.0; len],
        })
    }

    /// Blocks in the cache.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes the cache holds.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn per_block(&self) -> usize {
        self.n_layer * 2 * self.block_size * self.kv_dim
    }

    /// Offset of the key (`kind` 0) or value (1) row of `layer` at `pos` of a sequence
    /// whose blocks are `table`.
    fn row(&self, layer: usize, kind: usize, table: &[u32], pos: usize) -> usize {
        let block = table[pos / self.block_size] as usize;
        let slot = pos % self.block_size;
        block * self.per_block() + ((layer * 2 + kind) * self.block_size + slot) * self.kv_dim
    }

    /// Copies block `src`'s keys and values onto block `dst`.
    pub fn copy_block(&mut self, src: usize, dst: usize) -> Result<(), ModelError> {
        if src >= self.n_blocks || dst >= self.n_blocks {
            return Err(ModelError::Batch(format!("block {src} or {dst} out of range")));
        }
        let n = self.per_block();
        self.data.copy_within(src * n..(src + 1) * n, dst * n);
        Ok(())
    }
}

/// Per-thread working memory.
struct RefThread {
    /// One dequantized weight row.
    row: Vec<f32>,
    /// One head's scores over the context.
    scores: Vec<f64>,
    /// One head's weighted value sum.
    acc: Vec<f64>,
}

/// Working memory of [`LlamaModel::forward_reference`], sized once for a maximum step.
pub struct RefScratch {
    max_tokens: usize,
    max_ctx: usize,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out_x: Vec<f32>,
    /// A product's outputs row-major by weight row, before they are turned token-major.
    tmp: Vec<f32>,
    tok: Vec<(u32, u32)>,
    out_rows: Vec<u32>,
    per_thread: Vec<Mutex<RefThread>>,
}

impl std::fmt::Debug for RefScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefScratch")
            .field("max_tokens", &self.max_tokens)
            .field("max_ctx", &self.max_ctx)
            .finish()
    }
}

impl RefScratch {
    /// Buffers for steps of up to `max_tokens` tokens over contexts of up to `max_ctx`
    /// positions, on `n_threads` threads.
    pub fn new(model: &LlamaModel, max_tokens: usize, max_ctx: usize, n_threads: usize) -> Self {
        let c = &model.cfg;
        let t = max_tokens.max(1);
        let widest = c.n_embd.max(c.q_dim()).max(c.n_ff);
        let most_rows = c.n_vocab.max(c.n_ff).max(c.q_dim()).max(c.n_embd);
        RefScratch {
            max_tokens: t,
            max_ctx,
            x: vec![0.0; t * c.n_embd],
            xn: vec![0.0; t * c.n_embd],
            q: vec![0.0; t * c.q_dim()],
            k: vec![0.0; t * c.kv_dim()],
            v: vec![0.0; t * c.kv_dim()],
            attn: vec![0.0; t * c.q_dim()],
            gate: vec![0.0; t * c.n_ff],
            up: vec![0.0; t * c.n_ff],
            out_x: vec![0.0; t * c.n_embd],
            tmp: vec![0.0; t * most_rows],
            tok: Vec::with_capacity(t),
            out_rows: Vec::with_capacity(t),
            per_thread: (0..n_threads.max(1))
                .map(|_| {
                    Mutex::new(RefThread {
                        row: vec![0.0; widest],
                        scores: vec![0.0; max_ctx.max(1)],
                        acc: vec![0.0; c.head_dim],
                    })
                })
                .collect(),
        }
    }
}

/// The f64 sum of the exact products of `a` and `b`, in 8 interleaved partial sums.
fn dot64(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += f64::from(x[l]) * f64::from(y[l]);
        }
    }
    for (x, y) in ra.iter().zip(rb) {
        acc[0] += f64::from(*x) * f64::from(*y);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// RMS norm in f64: `x / sqrt(mean(x²) + eps) · w`, rounded once.
fn rmsnorm64(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = 1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = (f64::from(v) * scale * f64::from(w)) as f32;
    }
}

/// Rotary embedding of one head in f64.
fn rope64(x: &mut [f32], pos: u32, cfg: &LlamaConfig, freq_factors: Option<&[f32]>) {
    let n = cfg.rope_dims;
    let base = f64::from(cfg.rope_base);
    for i in 0..n / 2 {
        let ff = freq_factors.and_then(|f| f.get(i)).map_or(1.0, |&f| f64::from(f));
        let theta = f64::from(pos) * base.powf(-2.0 * i as f64 / n as f64) / ff;
        let (s, c) = theta.sin_cos();
        let (a, b) = match cfg.rope_kind {
            RopeKind::Norm => (2 * i, 2 * i + 1),
            RopeKind::Neox => (i, i + n / 2),
        };
        let (x0, x1) = (f64::from(x[a]), f64::from(x[b]));
        x[a] = (x0 * c - x1 * s) as f32;
        x[b] = (x0 * s + x1 * c) as f32;
    }
}

/// `out[t · rows + r] = Σ_c w[r][c] · x[t · cols + c]` over `n` tokens, each weight row
/// dequantized once per call, each sum in f64. `round`'s roundings of weights and inputs
/// come first: the input in place (every input buffer feeds products only, and rounding
/// it again is a no-op), each weight row as it is dequantized.
#[allow(clippy::too_many_arguments)]
fn matmul64(
    pool: &ThreadPool,
    per_thread: &[Mutex<RefThread>],
    w: &QMatrix<'_>,
    round: RefRounding,
    x: &mut [f32],
    n: usize,
    tmp: &mut [f32],
    out: &mut [f32],
) -> Result<(), ModelError> {
    let (rows, cols) = (w.rows(), w.cols());
    if x.len() < n * cols || out.len() < n * rows || tmp.len() < n * rows {
        return Err(ModelError::Batch("reference product buffers too small".into()));
    }
    round_all(&mut x[..n * cols], round.acts);
    let x = &x[..n * cols];
    let failed = std::sync::atomic::AtomicBool::new(false);
    {
        let t = DisjointOut::new(&mut tmp[..n * rows]);
        pool.run(&|i, nt| {
            let r = split_range(rows, i, nt, 1);
            let Some(Ok(mut th)) = per_thread.get(i).map(Mutex::lock) else {
                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            };
            let row = &mut th.row[..cols];
            let o = t.range(r.start * n, r.len() * n);
            for (j, wr) in r.enumerate() {
                if w.dequantize_row(wr, row).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                round_all(row, round.weights);
                for (tok, o) in o[j * n..(j + 1) * n].iter_mut().enumerate() {
                    *o = dot64(row, &x[tok * cols..(tok + 1) * cols]) as f32;
                }
            }
        });
    }
    if failed.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ModelError::Batch("a weight row could not be dequantized".into()));
    }
    for r in 0..rows {
        for tok in 0..n {
            out[tok * rows + r] = tmp[r * n + tok];
        }
    }
    Ok(())
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            for (v, &b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    }
}

impl LlamaModel {
    /// One step in the reference arithmetic (module docs), over an f32 cache: the rows of
    /// every chunk that wants them ([`Logits`]: `Argmax` rows are full rows here) go to the
    /// front of `logits`, in chunk order; returns how many rows were written. `round` adds
    /// its roundings ([`RefRounding`]; the default adds none).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_reference(
        &self,
        pool: &ThreadPool,
        chunks: &[SeqChunk<'_>],
        kv: &mut RefKv,
        s: &mut RefScratch,
        round: RefRounding,
        logits: &mut [f32],
    ) -> Result<usize, ModelError> {
        let c = &self.cfg;
        let (d, qd, kvd, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);
        s.tok.clear();
        s.out_rows.clear();
        for (ci, ch) in chunks.iter().enumerate() {
            check_chunk(ch, s.max_ctx, kv.n_blocks(), kv.block_size(), c.n_vocab)?;
            if s.tok.len() + ch.tokens.len() > s.max_tokens {
                return Err(ModelError::Batch(format!("step exceeds {} tokens", s.max_tokens)));
            }
            for i in 0..ch.tokens.len() {
                s.tok.push((ci as u32, (ch.start_pos + i) as u32));
                let last = i + 1 == ch.tokens.len();
                if ch.logits == Logits::All || (last && ch.logits.wanted()) {
                    s.out_rows.push((s.tok.len() - 1) as u32);
                }
            }
        }
        let n = s.tok.len();
        let m = s.out_rows.len();
        if logits.len() < m * c.n_vocab {
            return Err(ModelError::Batch("logits buffer too small".into()));
        }
        if n == 0 {
            return Ok(0);
        }

        let embd = self.view(&self.tok_embd)?;
        let mut t = 0;
        for ch in chunks {
            for &tok in ch.tokens {
                embd.dequantize_row(tok as usize, &mut s.x[t * d..(t + 1) * d])?;
                t += 1;
            }
        }

        let group = c.n_head / c.n_head_kv;
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            for t in 0..n {
                rmsnorm64(&s.x[t * d..(t + 1) * d], &l.attn_norm, c.norm_eps, &mut s.xn[t * d..]);
            }
            let xn = &mut s.xn[..n * d];
            let pt = &s.per_thread;
            matmul64(pool, pt, &self.view(&l.wq)?, round, xn, n, &mut s.tmp, &mut s.q)?;
            matmul64(pool, pt, &self.view(&l.wk)?, round, xn, n, &mut s.tmp, &mut s.k)?;
            matmul64(pool, pt, &self.view(&l.wv)?, round, xn, n, &mut s.tmp, &mut s.v)?;
            add_bias(&mut s.q[..n * qd], l.bq.as_deref());
            add_bias(&mut s.k[..n * kvd], l.bk.as_deref());
            add_bias(&mut s.v[..n * kvd], l.bv.as_deref());
            for (t, &(ci, pos)) in s.tok.iter().enumerate() {
                let ff = self.rope_freqs.as_deref();
                for h in 0..c.n_head {
                    rope64(&mut s.q[t * qd + h * hd..t * qd + (h + 1) * hd], pos, c, ff);
                }
                for h in 0..c.n_head_kv {
                    rope64(&mut s.k[t * kvd + h * hd..t * kvd + (h + 1) * hd], pos, c, ff);
                }
                let table = chunks[ci as usize].block_table;
                let (ko, vo) =
                    (kv.row(li, 0, table, pos as usize), kv.row(li, 1, table, pos as usize));
                kv.data[ko..ko + kvd].copy_from_slice(&s.k[t * kvd..(t + 1) * kvd]);
                kv.data[vo..vo + kvd].copy_from_slice(&s.v[t * kvd..(t + 1) * kvd]);
                round_all(&mut kv.data[ko..ko + kvd], round.kv);
                round_all(&mut kv.data[vo..vo + kvd], round.kv);
            }

            // Attention, parallel over (token, query head) units: unit `u` writes
            // `attn[u · hd..(u + 1) · hd]`, so each thread's units are one range.
            let units = n * c.n_head;
            let failed = std::sync::atomic::AtomicBool::new(false);
            {
                let out = DisjointOut::new(&mut s.attn[..n * qd]);
                let (kvr, tok, q) = (&*kv, &s.tok, &s.q);
                pool.run(&|i, nt| {
                    let mine = split_range(units, i, nt, 1);
                    let Some(Ok(mut th)) = s.per_thread.get(i).map(Mutex::lock) else {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        return;
                    };
                    let th = &mut *th;
                    let o = out.range(mine.start * hd, mine.len() * hd);
                    for (j, u) in mine.enumerate() {
                        let (t, h) = (u / c.n_head, u % c.n_head);
                        let (ci, pos) = tok[t];
                        let table = chunks[ci as usize].block_table;
                        let qh = &q[t * qd + h * hd..t * qd + (h + 1) * hd];
                        let off = (h / group) * hd;
                        let n_pos = pos as usize + 1;
                        let scores = &mut th.scores[..n_pos];
                        let mut max = f64::NEG_INFINITY;
                        for (p, sc) in scores.iter_mut().enumerate() {
                            let kr = kvr.row(li, 0, table, p) + off;
                            *sc = dot64(qh, &kvr.data[kr..kr + hd]) * scale;
                            max = max.max(*sc);
                        }
                        let mut sum = 0.0;
                        for sc in scores.iter_mut() {
                            *sc = (*sc - max).exp();
                            sum += *sc;
                        }
                        th.acc.fill(0.0);
                        for (p, &w) in scores.iter().enumerate() {
                            let vr = kvr.row(li, 1, table, p) + off;
                            for (a, &v) in th.acc.iter_mut().zip(&kvr.data[vr..vr + hd]) {
                                *a += w * f64::from(v);
                            }
                        }
                        for (o, &a) in o[j * hd..(j + 1) * hd].iter_mut().zip(&th.acc) {
                            *o = (a / sum) as f32;
                        }
                    }
                });
            }
            if failed.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(ModelError::Batch("reference attention failed".into()));
            }

            let wo = self.view(&l.wo)?;
            matmul64(pool, pt, &wo, round, &mut s.attn[..n * qd], n, &mut s.tmp, &mut s.xn)?;
            for (x, o) in s.x[..n * d].iter_mut().zip(&s.xn[..n * d]) {
                *x += o;
            }
            for t in 0..n {
                rmsnorm64(&s.x[t * d..(t + 1) * d], &l.ffn_norm, c.norm_eps, &mut s.xn[t * d..]);
            }
            let xn = &mut s.xn[..n * d];
            matmul64(pool, pt, &self.view(&l.w_gate)?, round, xn, n, &mut s.tmp, &mut s.gate)?;
            matmul64(pool, pt, &self.view(&l.w_up)?, round, xn, n, &mut s.tmp, &mut s.up)?;
            for (u, &g) in s.up[..n * ff].iter_mut().zip(&s.gate[..n * ff]) {
                let g = f64::from(g);
                *u = (g / (1.0 + (-g).exp()) * f64::from(*u)) as f32;
            }
            let wd = self.view(&l.w_down)?;
            matmul64(pool, pt, &wd, round, &mut s.up[..n * ff], n, &mut s.tmp, &mut s.xn)?;
            for (x, o) in s.x[..n * d].iter_mut().zip(&s.xn[..n * d]) {
                *x += o;
            }
        }

        if m == 0 {
            return Ok(0);
        }
        for (j, &row) in s.out_rows.iter().enumerate() {
            let row = row as usize;
            rmsnorm64(
                &s.x[row * d..(row + 1) * d],
                &self.output_norm,
                c.norm_eps,
                &mut s.out_x[j * d..(j + 1) * d],
            );
        }
        let head = self.view(&self.output)?;
        let out = &mut logits[..m * c.n_vocab];
        let pt = &s.per_thread;
        matmul64(pool, pt, &head, round, &mut s.out_x[..m * d], m, &mut s.tmp, out)?;
        Ok(m)
    }
}
