//! Model evaluation on an engine, from the prompt scores it computes: the log-likelihood of a
//! continuation given a context (lm-eval's `loglikelihood` request), and the perplexity of a
//! text scored in windows as llama.cpp's `llama-perplexity` scores it.
//!
//! Texts are split into tokens as lm-eval splits them for a causal model, so a score here and
//! one lm-eval receives from `kvx serve` (`echo` + `logprobs`) are of the same tokens.

use std::collections::HashMap;

use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};
use kvx_tokenizer::Tokenizer;

use crate::scheduler::PROMPT_BATCH;
use crate::{Engine, EngineError};

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

/// A text's perplexity, scored as `llama-perplexity` scores it.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    /// exp(nll / scored).
    pub ppl: f64,
    /// Summed negative log-likelihood of the scored tokens.
    pub nll: f64,
    /// Tokens scored.
    pub scored: usize,
    /// Windows of `ctx` tokens.
    pub chunks: usize,
}

/// The perplexity of `text` as llama-perplexity computes it with `-c ctx -b batch`: the text
/// tokenized as it tokenizes (the model's BOS when it adds one, special-token text left as
/// text), then [`perplexity`]. `batch` must be [`PROMPT_BATCH`] or at least `ctx`: prompts
/// are computed in llama.cpp's batches of that size. Also returns the text's token count.
pub fn perplexity_of_text(
    engine: &mut Engine,
    tok: &Tokenizer,
    text: &str,
    ctx: usize,
    batch: usize,
    concurrency: usize,
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
    Ok((perplexity(engine, &tokens, ctx, bos, concurrency)?, tokens.len()))
}

/// The perplexity of `tokens` in windows of `ctx` tokens, as `llama-perplexity` computes it:
/// the text is cut into `tokens.len() / ctx` windows (the rest is dropped), each computed on
/// its own with its first token replaced by `bos` when the model starts prompts with one,
/// and in each window the tokens of its second half are scored (those after position
/// `ctx / 2`, each given every token of the window before it).
pub fn perplexity(
    engine: &mut Engine,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    concurrency: usize,
) -> Result<Perplexity, EvalError> {
    if ctx < 4 {
        return Err(EvalError::Input { index: 0, message: format!("a window of {ctx} tokens") });
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        return Err(EvalError::Input {
            index: 0,
            message: format!(
                "the text has {} tokens, fewer than one window of {ctx}",
                tokens.len()
            ),
        });
    }
    let first = ctx / 2;
    let windows: Vec<(Vec<u32>, usize)> = tokens
        .chunks_exact(ctx)
        .map(|w| {
            let mut w = w.to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            // Tokens first + 1.. are scored: the "context" is the window up to `first`.
            (w, first + 1)
        })
        .collect();
    let scores = loglikelihoods(engine, &windows, concurrency)?;
    let nll: f64 = scores.iter().map(|s| -s.logprob).sum();
    let scored = chunks * (ctx - 1 - first);
    Ok(Perplexity { ppl: (nll / scored as f64).exp(), nll, scored, chunks })
}
