//! The llama-family forward pass over a batch of sequence chunks and a paged KV cache.
//!
//! One call runs every chunk of a scheduler step together: each weight matrix is read once
//! for all tokens of the step, prefill chunks and single decode tokens alike. Arithmetic
//! follows ggml's CPU backend (activation quantization per weight type, f16 KV cache,
//! f16-rounded queries and attention probabilities) so tokens track llama.cpp, unless the
//! model was set up for a non-exact arithmetic (`split_kv`, `free_attention`).

use std::sync::Mutex;

use super::{KvCache, LlamaModel, ModelError, RopeKind};
use crate::KernelError;
use crate::cpu::Kernels;
use crate::cpu::disjoint::{DisjointBytes, DisjointOut};
use crate::ops::{
    self, ATTN_TILE, AttnMode, AttnScratch, QMatrix, activation_bytes, attention_group, matmul,
    matmul_many, quantize_activations,
};
use crate::par::{ThreadPool, split_range};

/// The tokens one sequence contributes to a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// New tokens, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in the cache.
    pub start_pos: usize,
    /// Blocks holding positions `0..start_pos + tokens.len()`, in order.
    pub block_table: &'a [u32],
    /// What the chunk's last token (or, with [`Logits::All`], each token) produces from the
    /// output head.
    pub logits: Logits,
    /// Which of ggml's attention code paths the chunk's tokens follow (see [`AttnMode`]).
    pub mode: AttnMode,
}

/// What a chunk's last token produces from the output head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Nothing (a prompt chunk that does not end the prompt).
    Skip,
    /// The logits, bit for bit.
    Full,
    /// A row whose first maximum is the full logits' first maximum, all that a greedy
    /// request without log-probabilities or penalties reads: when every row of a step is
    /// of this kind the head is screened by fast products and settled exactly
    /// ([`crate::greedy`]); the row's other values are then within rounding of the logits.
    Argmax,
    /// The logits of every token of the chunk, bit for bit (a scored prompt): one row per
    /// token, in order.
    All,
}

impl Logits {
    /// Whether the chunk produces a row at all.
    pub fn wanted(self) -> bool {
        self != Logits::Skip
    }
}

/// Working memory of the forward pass, sized once for a maximum step.
pub struct Scratch {
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
    act: Vec<u32>,
    rope: Vec<f32>,
    /// Per token: (chunk index, position).
    tok: Vec<(u32, u32)>,
    /// Token rows that produce logits.
    out_rows: Vec<u32>,
    out_x: Vec<f32>,
    per_thread: Vec<Mutex<AttnScratch>>,
    /// Attention: where each thread's (token, head) pairs start, and the end.
    attn_bounds: Vec<usize>,
    /// The split K/V products' buffers ([`LlamaModel::split_kv`]); empty without.
    split: SplitScratch,
}

/// Buffers of the split K/V products: the input's residual after its quantization, both
/// parts quantized (the residual's rows, then the input's), and the products of both (K, then
/// V, each `2n` rows).
#[derive(Default)]
struct SplitScratch {
    resid: Vec<f32>,
    act: Vec<u32>,
    out: Vec<f32>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("max_tokens", &self.max_tokens)
            .field("max_ctx", &self.max_ctx)
            .finish()
    }
}

impl Scratch {
    /// Buffers for steps of up to `max_tokens` tokens over contexts of up to `max_ctx`
    /// positions, run on `n_threads` threads.
    pub fn new(model: &LlamaModel, max_tokens: usize, max_ctx: usize, n_threads: usize) -> Self {
        let c = &model.cfg;
        let t = max_tokens.max(1);
        let widest = c.n_embd.max(c.q_dim()).max(c.n_ff);
        let act_types = model.layers.iter().flat_map(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].map(|m| m.ty())
        });
        let act_bytes = act_types
            .chain([model.output.ty()])
            .filter_map(crate::quant::vec_dot_type)
            .filter_map(|a| activation_bytes(a, widest, t))
            .max()
            .unwrap_or(0);
        Scratch {
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
            act: vec![0; act_bytes.div_ceil(4)],
            rope: vec![0.0; t * c.rope_dims],
            tok: Vec::with_capacity(t),
            out_rows: Vec::with_capacity(t),
            out_x: vec![0.0; t * c.n_embd],
            per_thread: (0..n_threads.max(1))
                .map(|_| Mutex::new(AttnScratch::new(c.head_dim, max_ctx)))
                .collect(),
            attn_bounds: Vec::with_capacity(n_threads.max(1) + 1),
            split: if model.split_kv {
                let qkv_act = model
                    .layers
                    .iter()
                    .filter_map(|l| crate::quant::vec_dot_type(l.wq.ty()))
                    .filter_map(|a| activation_bytes(a, c.n_embd, 2 * t))
                    .max()
                    .unwrap_or(0);
                SplitScratch {
                    resid: vec![0.0; t * c.n_embd],
                    act: vec![0; qkv_act.div_ceil(4)],
                    out: vec![0.0; 2 * t * 2 * c.kv_dim()],
                }
            } else {
                SplitScratch::default()
            },
        }
    }

    /// The largest step this scratch serves.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The longest context this scratch serves.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }
}

impl LlamaModel {
    /// Runs one step. Writes the rows of every chunk that wants them ([`Logits`]; in chunk
    /// order, `n_vocab` each) to the front of `logits` and returns how many rows were written.
    /// In the last layer only the tokens that produce rows go past the cache writes.
    pub fn forward(
        &self,
        k: &Kernels,
        pool: &ThreadPool,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvCache,
        s: &mut Scratch,
        logits: &mut [f32],
    ) -> Result<usize, ModelError> {
        self.run(k, pool, chunks, kv, s, logits, true, &mut |_, _, _| {})
    }

    /// [`LlamaModel::forward`] that shows intermediate tensors to `trace(name, layer, data)`,
    /// named as llama.cpp names them (`attn_norm`, `Qcur`, `Kcur`, `Vcur`, `kqv_out`,
    /// `ffn_inp`, `ffn_out`, `l_out`), each `tokens × width` row-major; every token goes
    /// through every layer.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_traced(
        &self,
        k: &Kernels,
        pool: &ThreadPool,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvCache,
        s: &mut Scratch,
        logits: &mut [f32],
        trace: &mut dyn FnMut(&str, usize, &[f32]),
    ) -> Result<usize, ModelError> {
        self.run(k, pool, chunks, kv, s, logits, false, trace)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        k: &Kernels,
        pool: &ThreadPool,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvCache,
        s: &mut Scratch,
        logits: &mut [f32],
        prune_last: bool,
        trace: &mut dyn FnMut(&str, usize, &[f32]),
    ) -> Result<usize, ModelError> {
        let c = &self.cfg;
        let (d, qd, kvd, ff, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff, c.head_dim);

        // Validate the whole step before touching anything.
        s.tok.clear();
        s.out_rows.clear();
        let mut argmax_only = true;
        for (ci, ch) in chunks.iter().enumerate() {
            check_chunk(ch, s.max_ctx, kv.n_blocks(), kv.block_size(), c.n_vocab)?;
            if s.tok.len() + ch.tokens.len() > s.max_tokens {
                return Err(ModelError::Batch(format!("step exceeds {} tokens", s.max_tokens)));
            }
            for i in 0..ch.tokens.len() {
                s.tok.push((ci as u32, (ch.start_pos + i) as u32));
                if ch.logits == Logits::All {
                    s.out_rows.push((s.tok.len() - 1) as u32);
                }
            }
            if ch.logits == Logits::All {
                argmax_only = false;
            } else if ch.logits.wanted() {
                s.out_rows.push((s.tok.len() - 1) as u32);
                argmax_only &= ch.logits == Logits::Argmax;
            }
        }
        let mut n = s.tok.len();
        if logits.len() < s.out_rows.len() * c.n_vocab {
            return Err(ModelError::Batch("logits buffer too small".into()));
        }
        if n == 0 {
            return Ok(0);
        }

        // Embeddings.
        let embd = self.view(&self.tok_embd)?;
        let mut t = 0;
        for ch in chunks {
            for &tok in ch.tokens {
                embd.dequantize_row(tok as usize, &mut s.x[t * d..(t + 1) * d])?;
                t += 1;
            }
        }

        // Rope tables per token.
        let rd = c.rope_dims;
        for (t, &(_, pos)) in s.tok.iter().enumerate() {
            ops::rope_cache(
                pos,
                rd,
                c.rope_base,
                self.rope_freqs.as_deref(),
                &mut s.rope[t * rd..(t + 1) * rd],
            );
        }

        // Attention work per (token, head) pair grows with the position: split the pairs
        // into runs of equal cost (a causal prompt's later half costs three times its first).
        // Attention units: one token's query heads of one KV head (computed together, each
        // key and value loaded once for them), or single heads when the group is too large.
        let group = c.n_head / c.n_head_kv;
        let per = if group <= ops::MAX_ATTN_GROUP { group } else { 1 };
        let units = c.n_head / per;
        balance_pairs(&s.tok, units, pool.n_threads(), &mut s.attn_bounds);

        let act = bytemuck::cast_slice_mut::<u32, u8>(&mut s.act);
        let scale = 1.0 / (hd as f32).sqrt();

        for (li, l) in self.layers.iter().enumerate() {
            // Attention block.
            {
                let (x, xo) = (&s.x[..n * d], DisjointOut::new(&mut s.xn[..n * d]));
                par_tokens(pool, n, &|r| {
                    let (a, len) = (r.start * d, r.len() * d);
                    (k.rmsnorm_rows)(&x[a..a + len], &l.attn_norm, c.norm_eps, xo.range(a, len));
                });
            }
            trace("attn_norm", li, &s.xn[..n * d]);
            let wq = self.view(&l.wq)?;
            let wk = self.view(&l.wk)?;
            let wv = self.view(&l.wv)?;
            // Q, K and V reuse one quantization of the input when their types agree.
            let mut len = quantize_par(k, pool, wq.act_ty(), &s.xn[..n * d], d, act)?;
            if wk.act_ty() == wq.act_ty() && wv.act_ty() == wq.act_ty() {
                let ws = [&wq, &wk, &wv];
                let outs = [&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]];
                if self.splits_kv(li) {
                    let x = &s.xn[..n * d];
                    split_kv(k, pool, ws, x, &act[..len], &mut s.split, n, outs)?;
                } else {
                    matmul_many(k, pool, ws, &act[..len], n, outs)?;
                }
            } else {
                matmul(k, pool, &wq, &act[..len], n, &mut s.q[..n * qd])?;
                if wk.act_ty() != wq.act_ty() {
                    len = quantize_activations(k, wk.act_ty(), &s.xn[..n * d], d, act)?.len();
                }
                matmul(k, pool, &wk, &act[..len], n, &mut s.k[..n * kvd])?;
                if wv.act_ty() != wk.act_ty() {
                    len = quantize_activations(k, wv.act_ty(), &s.xn[..n * d], d, act)?.len();
                }
                matmul(k, pool, &wv, &act[..len], n, &mut s.v[..n * kvd])?;
            }
            add_bias(&mut s.q[..n * qd], l.bq.as_deref());
            add_bias(&mut s.k[..n * kvd], l.bk.as_deref());
            add_bias(&mut s.v[..n * kvd], l.bv.as_deref());

            {
                let rope = match c.rope_kind {
                    RopeKind::Norm => k.rope_norm,
                    RopeKind::Neox => k.rope_neox,
                };
                let rc = &s.rope;
                let (qo, ko) =
                    (DisjointOut::new(&mut s.q[..n * qd]), DisjointOut::new(&mut s.k[..n * kvd]));
                par_tokens(pool, n, &|r| {
                    for t in r {
                        let cache = &rc[t * rd..(t + 1) * rd];
                        for h in 0..c.n_head {
                            rope(qo.range(t * qd + h * hd, hd), cache, rd);
                        }
                        for h in 0..c.n_head_kv {
                            rope(ko.range(t * kvd + h * hd, hd), cache, rd);
                        }
                    }
                });
            }
            trace("Qcur", li, &s.q[..n * qd]);
            trace("Kcur", li, &s.k[..n * kvd]);
            trace("Vcur", li, &s.v[..n * kvd]);
            for (t, &(ci, pos)) in s.tok.iter().enumerate() {
                let ch = &chunks[ci as usize];
                let pos = pos as usize;
                let block = ch.block_table[pos / kv.block_size()] as usize;
                let slot = pos % kv.block_size();
                kv.write(
                    li,
                    block,
                    slot,
                    &s.k[t * kvd..(t + 1) * kvd],
                    &s.v[t * kvd..(t + 1) * kvd],
                    k.f32_to_f16,
                );
            }
            if prune_last && li + 1 == self.layers.len() && s.out_rows.len() < n {
                // Past the last cache writes only the rows that produce logits matter: move
                // their queries, residuals and token entries to the front (rows are computed
                // independently, so their bits do not change).
                if s.out_rows.is_empty() {
                    return Ok(0);
                }
                for (j, &row) in s.out_rows.iter().enumerate() {
                    let row = row as usize;
                    if row != j {
                        s.q.copy_within(row * qd..(row + 1) * qd, j * qd);
                        s.x.copy_within(row * d..(row + 1) * d, j * d);
                        s.tok[j] = s.tok[row];
                    }
                }
                n = s.out_rows.len();
                s.tok.truncate(n);
                for (j, r) in s.out_rows.iter_mut().enumerate() {
                    *r = j as u32;
                }
                balance_pairs(&s.tok, units, pool.n_threads(), &mut s.attn_bounds);
            }

            // Attention, parallel over (token, head group) units.
            // Each unit — hence its output range — belongs to one thread.
            let out = DisjointOut::new(&mut s.attn[..n * qd]);
            let kvc = &*kv;
            let (tok, q, per_thread, bounds) = (&s.tok, &s.q, &s.per_thread, &s.attn_bounds);
            let failed = std::sync::atomic::AtomicBool::new(false);
            let free = self.free_attention;
            let job = |i: usize, nt: usize| {
                let Ok(mut sc) = per_thread[i].lock() else {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    return;
                };
                let sc = &mut *sc;
                let mine = match (bounds.get(i), bounds.get(i + 1)) {
                    (Some(&a), Some(&b)) if bounds.len() == nt + 1 => a..b,
                    _ => split_range(n * units, i, nt, 1),
                };
                let end = mine.end;
                let mut unit = mine.start;
                while unit < end {
                    // A prompt's consecutive tokens in the free association: every head group
                    // of a tile of them at once, each key row converted once for the tile
                    // (each token's bits are those it gets alone).
                    if free && unit % units == 0 {
                        let t = unit / units;
                        let (ci, pos) = tok[t];
                        let ch = &chunks[ci as usize];
                        let tn = (1..ATTN_TILE)
                            .take_while(|&j| {
                                (t + j + 1) * units <= end
                                    && tok.get(t + j) == Some(&(ci, pos + j as u32))
                            })
                            .count()
                            + 1;
                        if ch.mode == AttnMode::Prefill && tn > 1 {
                            for hg in 0..units {
                                let h = hg * per;
                                let (keys, values) = kvc.heads(li, h / group, ch.block_table);
                                let qs = |j: usize| {
                                    let a = (t + j.min(tn - 1)) * qd + h * hd;
                                    &q[a..a + per * hd]
                                };
                                let tile = ops::AttnTileJob {
                                    q: std::array::from_fn(qs),
                                    tokens: tn,
                                    heads: per,
                                    keys: &keys,
                                    values: &values,
                                    n0: pos as usize + 1,
                                    scale,
                                    softmax: k.softmax,
                                };
                                let mut outs: [&mut [f32]; ATTN_TILE] = std::array::from_fn(|j| {
                                    if j < tn {
                                        out.range((t + j) * qd + h * hd, per * hd)
                                    } else {
                                        &mut []
                                    }
                                });
                                if ops::attention_tile_free(k, &tile, sc, &mut outs[..tn]) {
                                    continue;
                                }
                                for (j, o) in outs.iter_mut().take(tn).enumerate() {
                                    let n_pos = pos as usize + 1 + j;
                                    if attention_group(
                                        k, free, ch.mode, tile.q[j], per, &keys, &values, n_pos,
                                        scale, None, sc, o,
                                    )
                                    .is_err()
                                    {
                                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                                    }
                                }
                            }
                            unit += tn * units;
                            continue;
                        }
                    }
                    // A decode token reads its sequence's rows once, from blocks scattered
                    // over memory: the kernel fetches the next unit's rows while this one
                    // computes (a prompt's tokens re-read rows that are already cached).
                    let next = if unit + 1 < end {
                        let (t, h) = ((unit + 1) / units, ((unit + 1) % units) * per);
                        let (ci, pos) = tok[t];
                        let ch = &chunks[ci as usize];
                        let (keys, values) = kvc.heads(li, h / group, ch.block_table);
                        let n_pos = pos as usize + 1;
                        (ch.tokens.len() == 1).then_some(ops::NextRows { keys, values, n_pos })
                    } else {
                        None
                    };
                    let (t, h) = (unit / units, (unit % units) * per);
                    let (ci, pos) = tok[t];
                    let (keys, values) = kvc.heads(li, h / group, chunks[ci as usize].block_table);
                    let o = out.range(t * qd + h * hd, per * hd);
                    let qh = &q[t * qd + h * hd..t * qd + (h + per) * hd];
                    let mode = chunks[ci as usize].mode;
                    let n_pos = pos as usize + 1;
                    let next = next.as_ref();
                    if attention_group(
                        k, free, mode, qh, per, &keys, &values, n_pos, scale, next, sc, o,
                    )
                    .is_err()
                    {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    unit += 1;
                }
            };
            pool.run(&job);
            if failed.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(ModelError::Batch("attention failed (inconsistent cache view)".into()));
            }

            trace("kqv_out", li, &s.attn[..n * qd]);
            let wo = self.view(&l.wo)?;
            let len = quantize_par(k, pool, wo.act_ty(), &s.attn[..n * qd], qd, act)?;
            matmul(k, pool, &wo, &act[..len], n, &mut s.xn[..n * d])?;
            // The residual, then (row by row, after it) the feed-forward norm into `xn`.
            {
                let (xo, no) =
                    (DisjointOut::new(&mut s.x[..n * d]), DisjointOut::new(&mut s.xn[..n * d]));
                par_tokens(pool, n, &|r| {
                    let (x, o) =
                        (xo.range(r.start * d, r.len() * d), no.range(r.start * d, r.len() * d));
                    for (x, o) in x.iter_mut().zip(o.iter()) {
                        *x += o;
                    }
                    (k.rmsnorm_rows)(x, &l.ffn_norm, c.norm_eps, o);
                });
            }

            trace("ffn_inp", li, &s.x[..n * d]);
            let wg = self.view(&l.w_gate)?;
            let wu = self.view(&l.w_up)?;
            let mut len = quantize_par(k, pool, wg.act_ty(), &s.xn[..n * d], d, act)?;
            if wu.act_ty() == wg.act_ty() {
                let outs = [&mut s.gate[..n * ff], &mut s.up[..n * ff]];
                matmul_many(k, pool, [&wg, &wu], &act[..len], n, outs)?;
            } else {
                matmul(k, pool, &wg, &act[..len], n, &mut s.gate[..n * ff])?;
                len = quantize_activations(k, wu.act_ty(), &s.xn[..n * d], d, act)?.len();
                matmul(k, pool, &wu, &act[..len], n, &mut s.up[..n * ff])?;
            }
            {
                let (gate, uo) = (&s.gate[..n * ff], DisjointOut::new(&mut s.up[..n * ff]));
                par_tokens(pool, n, &|r| {
                    for t in r {
                        // The product overwrites `up`.
                        swiglu_in_place(k, &gate[t * ff..(t + 1) * ff], uo.range(t * ff, ff));
                    }
                });
            }
            trace("ffn_swiglu", li, &s.up[..n * ff]);
            let wd = self.view(&l.w_down)?;
            let len = quantize_par(k, pool, wd.act_ty(), &s.up[..n * ff], ff, act)?;
            matmul(k, pool, &wd, &act[..len], n, &mut s.xn[..n * d])?;
            trace("ffn_out", li, &s.xn[..n * d]);
            {
                let (xo, o) = (DisjointOut::new(&mut s.x[..n * d]), &s.xn[..n * d]);
                par_tokens(pool, n, &|r| {
                    let x = xo.range(r.start * d, r.len() * d);
                    for (x, o) in x.iter_mut().zip(&o[r.start * d..r.end * d]) {
                        *x += o;
                    }
                });
            }
            trace("l_out", li, &s.x[..n * d]);
        }

        // Output head for the rows that want logits.
        let m = s.out_rows.len();
        if m == 0 {
            return Ok(0);
        }
        for (j, &row) in s.out_rows.iter().enumerate() {
            let row = row as usize;
            (k.rmsnorm)(
                &s.x[row * d..(row + 1) * d],
                &self.output_norm,
                c.norm_eps,
                &mut s.out_x[j * d..(j + 1) * d],
            );
        }
        let wout = self.view(&self.output)?;
        let xq = quantize_activations(k, wout.act_ty(), &s.out_x[..m * d], d, act)?;
        let logits = &mut logits[..m * c.n_vocab];
        match self.head_screen().filter(|_| argmax_only && wout.uses_lanes(k)) {
            Some(screen) => {
                // Greedy rows only: fast products, then each row's possible maxima exactly.
                let fast = wout.with_lanes(screen.fast())?;
                matmul(k, pool, &fast, xq, m, logits)?;
                let (v, row) = (c.n_vocab, xq.len() / m);
                let out = DisjointOut::new(logits);
                let failed = std::sync::atomic::AtomicBool::new(false);
                let settle = |rows: std::ops::Range<usize>| {
                    for j in rows {
                        let l = out.range(j * v, v);
                        let a = &xq[j * row..(j + 1) * row];
                        if crate::greedy::settle_argmax(k, &wout, screen, a, l).is_err() {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                };
                if m > 1 && pool.n_threads() > 1 {
                    pool.run(&|i, nt| settle(split_range(m, i, nt, 1)));
                } else {
                    settle(0..m);
                }
                if failed.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(ModelError::Batch("greedy rows could not be settled".into()));
                }
            }
            None => matmul(k, pool, &wout, xq, m, logits)?,
        }
        Ok(m)
    }
}

/// Checks one chunk of a step against the engine's sizes: tokens present and in the
/// vocabulary, positions within `max_ctx`, a block table that covers them with valid ids.
pub(super) fn check_chunk(
    ch: &SeqChunk<'_>,
    max_ctx: usize,
    n_blocks: usize,
    block_size: usize,
    n_vocab: usize,
) -> Result<(), ModelError> {
    let end = ch.start_pos + ch.tokens.len();
    if ch.tokens.is_empty() {
        return Err(ModelError::Batch("a chunk has no tokens".into()));
    }
    if end > max_ctx {
        return Err(ModelError::Batch(format!(
            "position {end} exceeds the context of {max_ctx} this engine was sized for"
        )));
    }
    if ch.block_table.len() * block_size < end {
        return Err(ModelError::Batch("block table shorter than the sequence".into()));
    }
    if let Some(&b) = ch.block_table.iter().find(|&&b| b as usize >= n_blocks) {
        return Err(ModelError::Batch(format!("block id {b} out of range")));
    }
    if let Some(&t) = ch.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ModelError::Batch(format!(
            "token id {t} is outside the vocabulary of {n_vocab}"
        )));
    }
    Ok(())
}

/// Steps of at least this many tokens run their per-token work (norms, rope, activation
/// quantization, SwiGLU, residuals) on all of the pool's threads; smaller steps do it on the
/// caller, where a dispatch would cost more than it saves.
const PAR_TOKENS: usize = 16;

/// Calls `f` with the tokens `0..n`, split into one contiguous run per thread when the step
/// is large. `f` must write only the rows of the tokens it is given.
fn par_tokens(pool: &ThreadPool, n: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    if n < PAR_TOKENS || pool.n_threads() == 1 {
        f(0..n);
    } else {
        pool.run(&|i, nt| f(split_range(n, i, nt, 1)));
    }
}

/// The split K/V products ([`LlamaModel::split_kv`]): `x` times Q from its quantization
/// `act` (a row of activation blocks per token), as without the split; times K and V as
/// `act` times them plus what that quantization left out (`x` less `act` dequantized),
/// quantized in turn, times them. The two parts go through K and V as one batch of `2n`
/// tokens — the residual's rows first (quantized in place, where the buffer is aligned),
/// then a copy of the input's — so each weight is read once for both (a token's products
/// do not depend on its batch), and each K and V output is the input's product plus the
/// residual's. The model refuses the flag where the three matrices' activation types
/// differ or do not dequantize ([`LlamaModel::can_split_kv`]).
#[allow(clippy::too_many_arguments)]
fn split_kv(
    k: &Kernels,
    pool: &ThreadPool,
    ws: [&QMatrix<'_>; 3],
    x: &[f32],
    act: &[u8],
    sp: &mut SplitScratch,
    n: usize,
    outs: [&mut [f32]; 3],
) -> Result<(), ModelError> {
    let ty = ws[0].act_ty();
    let cols = x.len().checked_div(n).unwrap_or(0);
    if n == 0 {
        return Ok(());
    }
    let row = activation_bytes(ty, cols, 1)
        .ok_or_else(|| ModelError::Batch("split K/V: rows are not whole blocks".into()))?;
    let [q_out, k_out, v_out] = outs;
    let (kw, vw) = (k_out.len(), v_out.len());
    let act2 = bytemuck::cast_slice_mut::<u32, u8>(&mut sp.act);
    if act.len() < n * row
        || act2.len() < 2 * n * row
        || sp.resid.len() < x.len()
        || sp.out.len() < 2 * (kw + vw)
    {
        return Err(ModelError::Batch(
            "split K/V buffers too small (a scratch made before `split_kv` was set)".into(),
        ));
    }
    matmul(k, pool, ws[0], &act[..n * row], n, q_out)?;
    {
        let ro = DisjointOut::new(&mut sp.resid[..x.len()]);
        let failed = std::sync::atomic::AtomicBool::new(false);
        par_tokens(pool, n, &|range| {
            for t in range {
                let r = ro.range(t * cols, cols);
                if crate::quant::dequantize_row(ty, &act[t * row..(t + 1) * row], r).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                for (r, x) in r.iter_mut().zip(&x[t * cols..(t + 1) * cols]) {
                    *r = x - *r;
                }
            }
        });
        if failed.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(ModelError::Kernel(KernelError::Shape(
                "split K/V: activation rows could not be dequantized",
            )));
        }
    }
    let (resid, input) = act2[..2 * n * row].split_at_mut(n * row);
    quantize_par(k, pool, ty, &sp.resid[..x.len()], cols, resid)?;
    input.copy_from_slice(&act[..n * row]);
    let (b, c) = sp.out[..2 * (kw + vw)].split_at_mut(2 * kw);
    matmul_many(k, pool, [ws[1], ws[2]], &act2[..2 * n * row], 2 * n, [&mut *b, &mut *c])?;
    for (o, p) in [k_out, v_out].into_iter().zip([&*b, &*c]) {
        let (of_resid, of_input) = p.split_at(o.len());
        for ((o, i), r) in o.iter_mut().zip(of_input).zip(of_resid) {
            *o = i + r;
        }
    }
    Ok(())
}

/// [`quantize_activations`] with the rows split over the pool (each thread's rows in one
/// call; a block's bits do not depend on its neighbours);
/// returns the bytes used at the front of `out`.
fn quantize_par(
    k: &Kernels,
    pool: &ThreadPool,
    ty: crate::gguf::GgmlType,
    x: &[f32],
    cols: usize,
    out: &mut [u8],
) -> Result<usize, KernelError> {
    let n = x.len().checked_div(cols).unwrap_or(0);
    let row = activation_bytes(ty, cols, 1);
    match row {
        Some(row)
            if n >= PAR_TOKENS
                && pool.n_threads() > 1
                && row.is_multiple_of(4)
                && x.len() == n * cols
                && out.len() >= n * row =>
        {
            let ob = DisjointBytes::new(&mut out[..n * row]);
            let failed = std::sync::atomic::AtomicBool::new(false);
            par_tokens(pool, n, &|r| {
                // A thread's rows in one call.
                let src = &x[r.start * cols..r.end * cols];
                let dst = ob.range(r.start * row, r.len() * row);
                if quantize_activations(k, ty, src, cols, dst).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            });
            if failed.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(KernelError::Shape("activation rows could not be quantized"));
            }
            Ok(n * row)
        }
        _ => Ok(quantize_activations(k, ty, x, cols, out)?.len()),
    }
}

/// Cost of one (token, head) attention pair beyond its positions (the per-head set-up).
const PAIR_OVERHEAD: usize = 32;

/// Splits the `tok.len() × n_head` (token, head) pairs, in order, into `n` runs of about
/// equal attention cost; `bounds` gets the `n + 1` run boundaries.
fn balance_pairs(tok: &[(u32, u32)], n_head: usize, n: usize, bounds: &mut Vec<usize>) {
    bounds.clear();
    let cost = |pos: u32| pos as usize + 1 + PAIR_OVERHEAD;
    let total: usize = tok.iter().map(|&(_, pos)| cost(pos) * n_head).sum();
    bounds.push(0);
    let mut cum = 0;
    let mut pair = 0;
    for &(_, pos) in tok {
        for _ in 0..n_head {
            // Thread k starts at the first pair whose preceding cost reaches k/n of the total.
            while bounds.len() < n && cum * n >= total * bounds.len() {
                bounds.push(pair);
            }
            cum += cost(pos);
            pair += 1;
        }
    }
    while bounds.len() <= n {
        bounds.push(pair);
    }
}

fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in rows.chunks_exact_mut(b.len()) {
            for (x, b) in row.iter_mut().zip(b) {
                *x += b;
            }
        }
    }
}

/// `up = silu(gate) * up` without a third buffer.
fn swiglu_in_place(k: &Kernels, gate: &[f32], up: &mut [f32]) {
    // The kernel reads `up` before writing each element, so a copy of `up` is not needed
    // element-wise; use a small stack buffer per chunk to keep the kernel signature.
    let mut buf = [0.0f32; 256];
    for (g, u) in gate.chunks(256).zip(up.chunks_mut(256)) {
        let b = &mut buf[..u.len()];
        b.copy_from_slice(u);
        (k.swiglu)(g, b, u);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::lanes::{LaneMath, LaneMatrix};
    use crate::gguf::GgmlType;
    use crate::quant::BlockQ8_0;

    #[test]
    fn the_split_products_are_the_inputs_product_plus_the_residuals_for_any_row_size() {
        // `Q8_0` activations of 9 blocks are 306 bytes a row: a second part placed after an
        // odd number of them would start unaligned (and a single-token step would fail).
        let k = crate::cpu::kernels();
        let pool = ThreadPool::new(2).expect("pool");
        let (ty, cols, widths) = (GgmlType::Q8_0, 288, [32usize, 16, 16]);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mats: Vec<Vec<BlockQ8_0>> = widths
            .iter()
            .map(|&rows| {
                (0..rows * cols / 32)
                    .map(|i| BlockQ8_0 {
                        d: half::f16::from_f32(0.001 * (1 + i % 7) as f32),
                        qs: std::array::from_fn(|_| rnd() as i8),
                    })
                    .collect()
            })
            .collect();
        let bytes: Vec<&[u8]> = mats.iter().map(|m| bytemuck::cast_slice(m)).collect();
        let lanes: Vec<LaneMatrix> = (0..3)
            .map(|i| LaneMatrix::repack(LaneMath::Fast, ty, widths[i], cols, bytes[i]).unwrap())
            .collect();
        let plain: Vec<QMatrix<'_>> =
            (0..3).map(|i| QMatrix::new(ty, widths[i], cols, bytes[i]).unwrap()).collect();
        let laned: Vec<QMatrix<'_>> =
            (0..3).map(|i| plain[i].with_lanes(&lanes[i]).unwrap()).collect();
        let row = activation_bytes(ty, cols, 1).expect("row");
        assert_eq!(row % 4, 2);
        for ws in [&plain, &laned] {
            let ws = [&ws[0], &ws[1], &ws[2]];
            for n in [1usize, 2, 3, 17] {
                let x: Vec<f32> =
                    (0..n * cols).map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0).collect();
                let mut act = vec![0u32; (n * row).div_ceil(4)];
                let act = bytemuck::cast_slice_mut::<u32, u8>(&mut act);
                quantize_activations(k, ty, &x, cols, act).unwrap();
                let mut sp = SplitScratch {
                    resid: vec![0.0; n * cols],
                    act: vec![0; (2 * n * row).div_ceil(4)],
                    out: vec![0.0; 2 * n * 32],
                };
                let mut got: Vec<Vec<f32>> = widths.iter().map(|w| vec![0.0; n * w]).collect();
                let [q, kk, v] = &mut got[..] else { unreachable!() };
                split_kv(k, &pool, ws, &x, &act[..n * row], &mut sp, n, [q, kk, v]).unwrap();
                // The twin: Q the input's product; K and V each part through the matrix on
                // its own, then added.
                let mut resid = x.clone();
                let mut deq = vec![0.0; cols];
                for (t, r) in resid.chunks_exact_mut(cols).enumerate() {
                    crate::quant::dequantize_row(ty, &act[t * row..(t + 1) * row], &mut deq)
                        .unwrap();
                    r.iter_mut().zip(&deq).for_each(|(r, d)| *r -= d);
                }
                let mut ract = vec![0u32; (n * row).div_ceil(4)];
                let ract = bytemuck::cast_slice_mut::<u32, u8>(&mut ract);
                quantize_activations(k, ty, &resid, cols, ract).unwrap();
                for (i, w) in ws.iter().enumerate() {
                    let (mut a, mut r) = (vec![0.0; n * widths[i]], vec![0.0; n * widths[i]]);
                    matmul(k, &pool, w, &act[..n * row], n, &mut a).unwrap();
                    matmul(k, &pool, w, &ract[..n * row], n, &mut r).unwrap();
                    let want: Vec<u32> = if i == 0 {
                        a.iter().map(|a| a.to_bits()).collect()
                    } else {
                        a.iter().zip(&r).map(|(a, r)| (a + r).to_bits()).collect()
                    };
                    let have: Vec<u32> = got[i].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(have, want, "matrix {i}, {n} tokens");
                }
            }
        }
    }

    #[test]
    fn balanced_pairs_cover_everything_in_runs_of_similar_cost() {
        let prompt: Vec<(u32, u32)> = (0..512).map(|p| (0, p)).collect();
        let decode: Vec<(u32, u32)> = (0..16).map(|c| (c, 100 + 7 * c)).collect();
        for tok in [&prompt[..], &decode[..], &prompt[..1]] {
            for n in 1..5 {
                let mut b = Vec::new();
                balance_pairs(tok, 9, n, &mut b);
                assert_eq!(b.len(), n + 1);
                assert_eq!((b[0], b[n]), (0, tok.len() * 9));
                assert!(b.windows(2).all(|w| w[0] <= w[1]));
                let cost = |r: std::ops::Range<usize>| -> usize {
                    r.map(|pair| tok[pair / 9].1 as usize + 1 + PAIR_OVERHEAD).sum()
                };
                let total = cost(0..tok.len() * 9);
                let biggest = (0..tok.len() * 9).map(|p| cost(p..p + 1)).max().unwrap_or(0);
                for w in b.windows(2) {
                    // Each run is within one pair of its fair share.
                    assert!(cost(w[0]..w[1]) <= total / n + biggest, "{n} threads: {b:?}");
                }
            }
        }
    }
}
