//! Model evaluation: the log-likelihood of a continuation given a context (lm-eval's
//! `loglikelihood` request, from the prompt scores an engine computes), and the perplexity of
//! a text scored in windows as llama.cpp's `llama-perplexity` scores it, with the KL
//! divergence of every scored token's distribution from a saved base's (an arithmetic
//! measured against another, as `llama-perplexity --kl-divergence` does).
//!
//! Texts are split into tokens as lm-eval splits them for a causal model, so a score here and
//! one lm-eval receives from `kvx serve` (`echo` + `logprobs`) are of the same tokens.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use kvx_kernels::model::{AttnMode, Logits, SeqChunk};
use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};
use kvx_tokenizer::Tokenizer;

pub use crate::scheduler::PROMPT_BATCH;
use crate::{Backend, Engine, EngineError};

/// Why an evaluation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A text that cannot be scored.
    #[error("request {index}: {message}")]
    Input {
        /// Its place in the input.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A saved log-probability file could not be written or read, or does not match.
    #[error("log-probability file: {0}")]
    Logprobs(String),
}

/// One continuation's score.
#[derive(Debug, Clone, PartialEq)]
pub struct Loglik {
    /// Sum of the continuation tokens' log-probabilities (each given all tokens before it).
    pub logprob: f64,
    /// Whether every continuation token was the most likely one (greedy decoding would
    /// have produced the continuation).
    pub greedy: bool,
    /// Context tokens.
    pub context_tokens: usize,
    /// Continuation tokens.
    pub continuation_tokens: usize,
}

/// The tokens of a context and of its continuation as lm-eval splits them for a causal
/// model: whitespace ending the context moves to the continuation; the whole text is
/// encoded (no special tokens added) and split after as many tokens as the context alone
/// encodes to.
pub fn encode_pair(
    tok: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>), String> {
    if context.is_empty() {
        return Err("the context is empty".into());
    }
    let trimmed = context.trim_end();
    let (context, continuation) = if trimmed.len() < context.len() {
        (trimmed, format!("{}{continuation}", &context[trimmed.len()..]))
    } else {
        (context, continuation.to_string())
    };
    let whole = tok.encode(&format!("{context}{continuation}"), true).map_err(|e| e.to_string())?;
    let n = tok.encode(context, true).map_err(|e| e.to_string())?.len();
    if n > whole.len() {
        return Err("the context encodes to more tokens than context and continuation".into());
    }
    Ok((whole[..n].to_vec(), whole[n..].to_vec()))
}

/// One input line: texts (split by [`encode_pair`]) or tokens.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum LoglikInput {
    Text { context: String, continuation: String },
    Tokens { tokens: Vec<u32>, context_tokens: usize },
}

/// Reads JSON lines, each `{"context": TEXT, "continuation": TEXT}` or `{"tokens": [IDS],
/// "context_tokens": N}`, into `(tokens, context_len)` pairs (blank lines skipped).
pub fn read_inputs(tok: &Tokenizer, jsonl: &str) -> Result<Vec<(Vec<u32>, usize)>, EvalError> {
    let mut inputs = Vec::new();
    for (i, line) in jsonl.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |message: String| EvalError::Input { index: inputs.len(), message };
        let input: LoglikInput =
            serde_json::from_str(line).map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
        inputs.push(match input {
            LoglikInput::Text { context, continuation } => {
                let (mut c, k) = encode_pair(tok, &context, &continuation)
                    .map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
                let n = c.len();
                c.extend(k);
                (c, n)
            }
            LoglikInput::Tokens { tokens, context_tokens } => (tokens, context_tokens),
        });
    }
    Ok(inputs)
}

/// Scores each `(tokens, context_len)`: the log-likelihood of `tokens[context_len..]` given
/// what precedes it, with up to `concurrency` prompts in the engine at once. The context
/// must have at least one token and the continuation too.
pub fn loglikelihoods(
    engine: &mut Engine,
    inputs: &[(Vec<u32>, usize)],
    concurrency: usize,
) -> Result<Vec<Loglik>, EvalError> {
    for (index, (tokens, ctx)) in inputs.iter().enumerate() {
        if *ctx == 0 || *ctx >= tokens.len() {
            return Err(EvalError::Input {
                index,
                message: format!(
                    "{ctx} context tokens of {}: both parts need at least one",
                    tokens.len()
                ),
            });
        }
    }
    let mut results: Vec<Option<Loglik>> = vec![None; inputs.len()];
    let mut scores: Vec<Vec<(f32, bool)>> = vec![Vec::new(); inputs.len()];
    let mut by_id: HashMap<RequestId, usize> = HashMap::new();
    let (mut next, mut done) = (0, 0);
    // Ids of their own, above any the caller's engine may have used.
    let base = 1u64 << 62;
    while done < inputs.len() {
        while next < inputs.len() && by_id.len() < concurrency.max(1) {
            let req = GenerateRequest {
                id: RequestId(base + next as u64),
                prompt: inputs[next].0.clone(),
                sampling: SamplingOptions { temperature: 0.0, ..Default::default() },
                stop: StopConditions { max_tokens: 0, ..Default::default() },
                logprobs: None,
                salt: None,
                kv: Default::default(),
                resume: Vec::new(),
                constraint: None,
                prompt_logprobs: Some(1),
                fork: None,
            };
            engine
                .add(&req)
                .map_err(|e| EvalError::Input { index: next, message: e.to_string() })?;
            by_id.insert(req.id, next);
            next += 1;
        }
        let out = engine.step()?;
        for ev in &out.events {
            let Some(&i) = by_id.get(&ev.id) else { continue };
            // Scores of tokens `prompt_start..`; a prompt computed again (preempted) sends
            // them again from where it starts.
            let s = &mut scores[i];
            if !ev.prompt.is_empty() {
                s.truncate((ev.prompt_start as usize).saturating_sub(1));
            }
            for p in &out.prompt[ev.prompt.clone()] {
                let top = out.top[p.top.clone()].first().map(|t| t.logprob);
                s.push((p.logprob, top == Some(p.logprob)));
            }
            if ev.finish.is_some() {
                by_id.remove(&ev.id);
                done += 1;
                let (tokens, ctx) = &inputs[i];
                // Score k is of token k + 1.
                let cont = scores[i].get(ctx - 1..tokens.len() - 1).ok_or(EvalError::Input {
                    index: i,
                    message: format!(
                        "the engine scored {} of {} prompt tokens",
                        scores[i].len(),
                        tokens.len() - 1
                    ),
                })?;
                results[i] = Some(Loglik {
                    logprob: cont.iter().map(|&(l, _)| f64::from(l)).sum(),
                    greedy: cont.iter().all(|&(_, g)| g),
                    context_tokens: *ctx,
                    continuation_tokens: tokens.len() - ctx,
                });
            }
        }
    }
    results
        .into_iter()
        .enumerate()
        .map(|(index, r)| {
            r.ok_or_else(|| EvalError::Input { index, message: "it did not finish".into() })
        })
        .collect()
}

/// A text's perplexity, scored as `llama-perplexity` scores it. Serialized as one JSON
/// object: `ppl`, `nll`, `tokens`, `chunks` and, against a base, the [`KlStats`] fields.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Perplexity {
    /// exp(nll / scored).
    pub ppl: f64,
    /// Summed negative log-likelihood of the scored tokens.
    pub nll: f64,
    /// Tokens scored.
    #[serde(rename = "tokens")]
    pub scored: usize,
    /// Windows of `ctx` tokens.
    pub chunks: usize,
    /// Against a saved base, how far each scored token's distribution moved.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub kl: Option<KlStats>,
}

/// The distance of one run's next-token distributions from a base run's over the same
/// scored tokens (as `llama-perplexity --kl-divergence` reports it).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KlStats {
    /// KL(base ‖ this), in nats: mean over the scored tokens.
    pub kld_mean: f64,
    /// The standard error of that mean (the tokens' standard deviation / √n).
    pub kld_se: f64,
    /// Its median.
    pub kld_median: f64,
    /// Its 99th percentile.
    pub kld_p99: f64,
    /// Its maximum.
    pub kld_max: f64,
    /// Share of tokens whose most likely next token is the base's.
    pub top1: f64,
    /// Mean of p(this) − p(base) of the text's actual next token.
    pub dp_mean: f64,
    /// Root mean square of the same.
    pub dp_rms: f64,
    /// The base's perplexity over the same tokens.
    pub ppl_base: f64,
}

impl std::fmt::Display for KlStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "against the base (perplexity {:.4}): KL divergence mean {:.6} ± {:.6}, median \
             {:.6}, p99 {:.6}, max {:.6}; top-1 agreement {:.2} %; Δp mean {:+.5}, rms {:.5}",
            self.ppl_base,
            self.kld_mean,
            self.kld_se,
            self.kld_median,
            self.kld_p99,
            self.kld_max,
            100.0 * self.top1,
            self.dp_mean,
            self.dp_rms
        )
    }
}

/// The files of a perplexity run's rows: one to save them to, one holding a base to compare
/// with, and one for each token's divergence from the base (never one file in two roles:
/// creating a file to write would erase the other).
#[derive(Debug, Default)]
pub struct RowFiles {
    save: Option<BufWriter<File>>,
    base: Option<BufReader<File>>,
    kld: Option<BufWriter<File>>,
}

/// Whether two paths name one file (as given, or once resolved).
fn same_file(a: &Path, b: &Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

impl RowFiles {
    /// Checks the three roles name three files (and that divergences have a base), then
    /// opens the base for reading and creates the files to write: the rows to `save`, each
    /// scored token's KL divergence from the base to `kld` (see [`Rows::kld`]).
    pub fn open(
        save: Option<&Path>,
        base: Option<&Path>,
        kld: Option<&Path>,
    ) -> Result<Self, EvalError> {
        let err = |what: &str, p: &Path, e: std::io::Error| {
            EvalError::Logprobs(format!("{what} {}: {e}", p.display()))
        };
        if let (Some(a), Some(b)) = (save, base)
            && same_file(a, b)
        {
            return Err(EvalError::Logprobs(format!(
                "{} is both the base and the file to save to: saving would erase the base",
                a.display()
            )));
        }
        if let Some(k) = kld {
            if base.is_none() {
                return Err(EvalError::Logprobs(format!(
                    "{}: per-token divergences need a base to compare with",
                    k.display()
                )));
            }
            if save.into_iter().chain(base).any(|p| same_file(p, k)) {
                return Err(EvalError::Logprobs(format!(
                    "{} is already the base or the file to save to: writing the divergences \
                     there would erase it",
                    k.display()
                )));
            }
        }
        let base = match base {
            Some(p) => Some(BufReader::new(File::open(p).map_err(|e| err("opening", p, e))?)),
            None => None,
        };
        let create =
            |p: &Path| File::create(p).map(BufWriter::new).map_err(|e| err("creating", p, e));
        let save = save.map(create).transpose()?;
        let kld = kld.map(create).transpose()?;
        Ok(RowFiles { save, base, kld })
    }

    /// The [`Rows`] over these files.
    pub fn rows(&mut self) -> Rows<'_> {
        Rows {
            save: self.save.as_mut().map(|w| w as &mut dyn Write),
            base: self.base.as_mut().map(|r| r as &mut dyn Read),
            kld: self.kld.as_mut().map(|w| w as &mut dyn Write),
        }
    }

    /// Flushes the saved rows and divergences.
    pub fn finish(self) -> Result<(), EvalError> {
        for (what, w) in [("the rows", self.save), ("the divergences", self.kld)] {
            if let Some(w) = w {
                w.into_inner()
                    .map_err(|e| EvalError::Logprobs(format!("writing {what}: {}", e.error())))?;
            }
        }
        Ok(())
    }
}

/// Where a perplexity run's log-probability rows go and what they are measured against:
/// `save` receives every scored token's log-softmax row (a base for later runs), `base`
/// gives the rows of an earlier run of the same text, window and model, and `kld` receives
/// each scored token's divergence from `base`.
#[derive(Default)]
pub struct Rows<'a> {
    /// Written: a header, then each scored token's `n_vocab` log-probabilities (f32, LE).
    pub save: Option<&'a mut dyn Write>,
    /// Read: a file `save` wrote.
    pub base: Option<&'a mut dyn Read>,
    /// Written (with a base): each scored token's KL divergence from the base's row, one f64
    /// (LE) per token in scoring order — the same order for every run over the same text
    /// and window, so two arithmetics' divergences pair up token by token.
    pub kld: Option<&'a mut dyn Write>,
}

impl std::fmt::Debug for Rows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rows")
            .field("save", &self.save.is_some())
            .field("base", &self.base.is_some())
            .field("kld", &self.kld.is_some())
            .finish()
    }
}

/// Magic and version of a saved log-probability file.
const ROWS_MAGIC: &[u8; 8] = b"KVXLGP01";

/// The header of a saved log-probability file: what the rows are of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowsHeader {
    n_vocab: u32,
    ctx: u32,
    chunks: u32,
    first: u32,
    /// FNV-1a of the windows' tokens.
    tokens: u64,
}

impl RowsHeader {
    fn write(&self, w: &mut dyn Write) -> std::io::Result<()> {
        w.write_all(ROWS_MAGIC)?;
        for v in [self.n_vocab, self.ctx, self.chunks, self.first] {
            w.write_all(&v.to_le_bytes())?;
        }
        w.write_all(&self.tokens.to_le_bytes())
    }

    fn read(r: &mut dyn Read) -> Result<Self, EvalError> {
        let mut b = [0u8; 32];
        r.read_exact(&mut b)
            .map_err(|e| EvalError::Logprobs(format!("reading its header: {e}")))?;
        if &b[..8] != ROWS_MAGIC {
            return Err(EvalError::Logprobs(
                "not a file of `kvx eval perplexity --save-logits`".into(),
            ));
        }
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[24..32]);
        Ok(RowsHeader {
            n_vocab: u(8),
            ctx: u(12),
            chunks: u(16),
            first: u(20),
            tokens: u64::from_le_bytes(t),
        })
    }
}

fn fnv1a(tokens: impl Iterator<Item = u32>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The perplexity of `text` as llama-perplexity computes it with `-c ctx -b batch`: the text
/// tokenized as it tokenizes (the model's BOS when it adds one, special-token text left as
/// text), then [`perplexity`]. `batch` must be [`PROMPT_BATCH`] or at least `ctx` (a window
/// that a smaller batch would split differently is refused); the windows are then computed
/// as [`perplexity`] says, and since no token's bits depend on its batch, the numbers are
/// those of llama.cpp's batches of any such size. Also returns the text's token count.
pub fn perplexity_of_text(
    backend: &mut dyn Backend,
    block_size: usize,
    tok: &Tokenizer,
    text: &str,
    (ctx, batch): (usize, usize),
    rows: Rows<'_>,
) -> Result<(Perplexity, usize), EvalError> {
    perplexity_of_text_upto(backend, block_size, tok, text, (ctx, batch, usize::MAX), rows)
}

/// [`perplexity_of_text`] over the first `max_chunks` windows at most (llama-perplexity's
/// `--chunks`).
pub fn perplexity_of_text_upto(
    backend: &mut dyn Backend,
    block_size: usize,
    tok: &Tokenizer,
    text: &str,
    (ctx, batch, max_chunks): (usize, usize, usize),
    rows: Rows<'_>,
) -> Result<(Perplexity, usize), EvalError> {
    if batch != PROMPT_BATCH && batch < ctx {
        return Err(EvalError::Input {
            index: 0,
            message: format!(
                "a batch of {batch} tokens: kvx computes prompts in batches of {PROMPT_BATCH}, \
                 so the batch must be {PROMPT_BATCH} or at least the window ({ctx})"
            ),
        });
    }
    let bos = tok.bos_id().filter(|_| tok.add_bos());
    let mut tokens: Vec<u32> = bos.into_iter().collect();
    tokens.extend(
        tok.encode(text, false)
            .map_err(|e| EvalError::Input { index: 0, message: e.to_string() })?,
    );
    let n = tokens.len();
    tokens.truncate(max_chunks.saturating_mul(ctx).min(n));
    Ok((perplexity(backend, block_size, &tokens, ctx, bos, rows)?, n))
}

/// The perplexity of `tokens` in windows of `ctx` tokens, as `llama-perplexity` computes it:
/// the text is cut into `tokens.len() / ctx` windows (the rest is dropped), each computed on
/// its own with its first token replaced by `bos` when the model starts prompts with one, in
/// llama.cpp's batches (up to [`PROMPT_BATCH`] / `ctx` windows together, or a longer window
/// in batches of [`PROMPT_BATCH`]); in each window the tokens of its second half are scored
/// (those after position `ctx / 2`, each given every token of the window before it).
/// `backend` holds `block_size`-token KV blocks; the windows overwrite its blocks from 0.
pub fn perplexity(
    backend: &mut dyn Backend,
    block_size: usize,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut rows: Rows<'_>,
) -> Result<Perplexity, EvalError> {
    let input = |message: String| EvalError::Input { index: 0, message };
    if ctx < 4 {
        return Err(input(format!("a window of {ctx} tokens")));
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        return Err(input(format!(
            "the text has {} tokens, fewer than one window of {ctx}",
            tokens.len()
        )));
    }
    let nb = ctx.div_ceil(block_size.max(1));
    let per_step = if ctx <= PROMPT_BATCH { PROMPT_BATCH / ctx } else { 1 };
    let per_step = per_step.min(backend.n_blocks() / nb).min(chunks);
    if per_step == 0 {
        return Err(input(format!(
            "a window of {ctx} tokens needs {nb} KV blocks of {block_size}; the cache holds {}",
            backend.n_blocks()
        )));
    }
    let first = ctx / 2;
    let windows: Vec<Vec<u32>> = tokens
        .chunks_exact(ctx)
        .map(|w| {
            let mut w = w.to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            w
        })
        .collect();
    let v = backend.n_vocab();
    let header = RowsHeader {
        n_vocab: v as u32,
        ctx: ctx as u32,
        chunks: chunks as u32,
        first: first as u32,
        tokens: fnv1a(windows.iter().flatten().copied()),
    };
    let io = |what: &str, e: std::io::Error| EvalError::Logprobs(format!("{what}: {e}"));
    if let Some(w) = rows.save.as_deref_mut() {
        header.write(w).map_err(|e| io("writing", e))?;
    }
    if let Some(r) = rows.base.as_deref_mut() {
        let h = RowsHeader::read(r)?;
        if h != header {
            return Err(EvalError::Logprobs(format!(
                "it holds rows of another text, window or vocabulary ({} windows of {} tokens, \
                 vocabulary {}; this run: {chunks} of {ctx}, vocabulary {v})",
                h.chunks, h.ctx, h.n_vocab
            )));
        }
    }

    let tables: Vec<Vec<u32>> =
        (0..per_step).map(|j| ((j * nb) as u32..((j + 1) * nb) as u32).collect()).collect();
    let rows_per_step = if ctx <= PROMPT_BATCH { per_step * ctx } else { PROMPT_BATCH };
    let mut logits = vec![0f32; rows_per_step * v];
    let mut sc = Scorer::new(v, rows.base.is_some());
    let mut step: Vec<SeqChunk<'_>> = Vec::with_capacity(per_step);
    for group in windows.chunks(per_step) {
        // Batches of the group: all its windows together (`ctx` ≤ the batch), or one window's
        // consecutive batches.
        let batches: Vec<(usize, usize)> = if ctx <= PROMPT_BATCH {
            vec![(0, ctx)]
        } else {
            (0..ctx).step_by(PROMPT_BATCH).map(|b| (b, (b + PROMPT_BATCH).min(ctx))).collect()
        };
        for &(b, e) in &batches {
            step.clear();
            for (j, w) in group.iter().enumerate() {
                step.push(SeqChunk {
                    tokens: &w[b..e],
                    start_pos: b,
                    block_table: &tables[j],
                    logits: Logits::All,
                    mode: if e - b >= 2 { AttnMode::Prefill } else { AttnMode::Decode },
                });
            }
            backend.forward(&step, &mut logits)?;
            for (j, w) in group.iter().enumerate() {
                for pos in (b..e).filter(|&p| p >= first && p + 1 < ctx) {
                    let r = (j * (e - b) + pos - b) * v;
                    sc.score(&logits[r..r + v], w[pos + 1] as usize, &mut rows)?;
                }
            }
        }
    }
    let scored = chunks * (ctx - 1 - first);
    Ok(Perplexity {
        ppl: (sc.nll / scored as f64).exp(),
        nll: sc.nll,
        scored,
        chunks,
        kl: rows.base.is_some().then(|| sc.kl_stats()),
    })
}

/// Per-token scoring of a perplexity run: the log-softmax of each row, its negative
/// log-likelihood, and (against a base) the row's divergence from the base's.
struct Scorer {
    nll: f64,
    lp: Vec<f32>,
    bytes: Vec<u8>,
    base: Vec<f32>,
    kld: Vec<f64>,
    top1: usize,
    dp: Vec<f64>,
    base_nll: f64,
}

impl Scorer {
    fn new(v: usize, with_base: bool) -> Self {
        Scorer {
            nll: 0.0,
            lp: vec![0.0; v],
            bytes: vec![0; v * 4],
            base: if with_base { vec![0.0; v] } else { Vec::new() },
            kld: Vec::new(),
            top1: 0,
            dp: Vec::new(),
            base_nll: 0.0,
        }
    }

    fn score(&mut self, row: &[f32], target: usize, rows: &mut Rows<'_>) -> Result<(), EvalError> {
        // As llama-perplexity: the maximum subtracted in f32, the exponentials summed in f64.
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = sum.ln();
        for (o, &l) in self.lp.iter_mut().zip(row) {
            *o = (f64::from(l - max) - lse) as f32;
        }
        let lp_t = f64::from(row[target] - max) - lse;
        self.nll -= lp_t;
        let io = |what: &str, e: std::io::Error| EvalError::Logprobs(format!("{what}: {e}"));
        if let Some(w) = rows.save.as_deref_mut() {
            for (b, l) in self.bytes.chunks_exact_mut(4).zip(&self.lp) {
                b.copy_from_slice(&l.to_le_bytes());
            }
            w.write_all(&self.bytes).map_err(|e| io("writing", e))?;
        }
        if let Some(r) = rows.base.as_deref_mut() {
            r.read_exact(&mut self.bytes).map_err(|e| io("reading a row", e))?;
            for (b, l) in self.bytes.chunks_exact(4).zip(self.base.iter_mut()) {
                *l = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            let mut kld = 0.0;
            for (&b, &c) in self.base.iter().zip(&self.lp) {
                let (b, c) = (f64::from(b), f64::from(c));
                kld += b.exp() * (b - c);
            }
            let kld = kld.max(0.0);
            self.kld.push(kld);
            if let Some(w) = rows.kld.as_deref_mut() {
                w.write_all(&kld.to_le_bytes()).map_err(|e| io("writing a divergence", e))?;
            }
            if first_max(&self.base) == first_max(&self.lp) {
                self.top1 += 1;
            }
            let lb = f64::from(self.base[target]);
            // Both rows as saved (f32), so a run compares equal to its own base.
            self.dp.push(f64::from(self.lp[target]).exp() - lb.exp());
            self.base_nll -= lb;
        }
        Ok(())
    }

    fn kl_stats(&mut self) -> KlStats {
        let n = self.kld.len().max(1) as f64;
        let mean = self.kld.iter().sum::<f64>() / n;
        let var =
            self.kld.iter().map(|k| (k - mean) * (k - mean)).sum::<f64>() / (n - 1.0).max(1.0);
        self.kld.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((q * self.kld.len() as f64).ceil() as usize).saturating_sub(1);
            self.kld.get(i.min(self.kld.len().saturating_sub(1))).copied().unwrap_or(0.0)
        };
        KlStats {
            kld_mean: mean,
            kld_se: (var / n).sqrt(),
            kld_median: at(0.5),
            kld_p99: at(0.99),
            kld_max: self.kld.last().copied().unwrap_or(0.0),
            top1: self.top1 as f64 / n,
            dp_mean: self.dp.iter().sum::<f64>() / n,
            dp_rms: (self.dp.iter().map(|d| d * d).sum::<f64>() / n).sqrt(),
            ppl_base: (self.base_nll / n).exp(),
        }
    }
}

/// Index of the first maximum.
fn first_max(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_files_refuse_one_file_in_two_roles_and_keep_the_base() {
        let dir = std::env::temp_dir().join(format!("kvx-rowfiles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let base = dir.join("base.logp");
        std::fs::write(&base, b"saved rows").expect("write");
        let again = dir.join(".").join("base.logp");
        for save in [&base, &again] {
            let err = RowFiles::open(Some(save), Some(&base), None).unwrap_err();
            assert!(err.to_string().contains("erase the base"), "{err}");
        }
        assert_eq!(std::fs::read(&base).expect("read"), b"saved rows");
        let other = dir.join("other.logp");
        let mut f = RowFiles::open(Some(&other), Some(&base), None).expect("open");
        let rows = f.rows();
        assert!(rows.save.is_some() && rows.base.is_some());
        f.finish().expect("flush");
        assert!(RowFiles::open(None, Some(&dir.join("missing")), None).is_err());
        // The divergences' file: never the base or the saved rows, and only with a base.
        // Nothing is created or truncated before the roles are checked.
        std::fs::write(&other, b"earlier rows").expect("write");
        let saved = dir.join("saved.logp");
        for kld in [&base, &again, &saved] {
            let err = RowFiles::open(Some(&saved), Some(&base), Some(kld)).unwrap_err();
            assert!(err.to_string().contains("would erase it"), "{err}");
        }
        let err = RowFiles::open(Some(&other), None, Some(&dir.join("k.f64"))).unwrap_err();
        assert!(err.to_string().contains("need a base"), "{err}");
        assert_eq!(std::fs::read(&base).expect("read"), b"saved rows");
        assert_eq!(std::fs::read(&other).expect("read"), b"earlier rows");
        assert!(!saved.exists() && !dir.join("k.f64").exists());
        let mut f = RowFiles::open(None, Some(&base), Some(&dir.join("k.f64"))).expect("open");
        assert!(f.rows().kld.is_some());
        f.finish().expect("flush");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_perplexity_serializes_to_the_fields_kvx_eval_prints() {
        let p = Perplexity { ppl: 2.0, nll: 1.0, scored: 3, chunks: 1, kl: None };
        let v = serde_json::to_value(&p).expect("json");
        assert_eq!(v, serde_json::json!({"ppl": 2.0, "nll": 1.0, "tokens": 3, "chunks": 1}));
        let kl = KlStats {
            kld_mean: 0.1,
            kld_se: 0.01,
            kld_median: 0.05,
            kld_p99: 0.5,
            kld_max: 0.9,
            top1: 0.95,
            dp_mean: 0.0,
            dp_rms: 0.02,
            ppl_base: 1.9,
        };
        let v = serde_json::to_value(Perplexity { kl: Some(kl), ..p }).expect("json");
        assert_eq!(v["kld_p99"], 0.5);
        assert_eq!(v["ppl_base"], 1.9);
        assert!(v.get("kl").is_none(), "{v}");
    }
}
