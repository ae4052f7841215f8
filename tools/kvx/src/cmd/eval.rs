//! `kvx eval`: measure the model on the engine in this process (no server).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kvx_kernels::model::RefRounding;
use kvx_worker::EngineKind;
use kvx_worker::eval::PROMPT_BATCH;
use kvx_worker::eval::{RowFiles, loglikelihoods, perplexity_of_text_upto, read_inputs};

use super::Runtime;
use super::engine::EngineOpts;

#[derive(Debug, Args)]
pub(crate) struct EvalArgs {
    #[command(subcommand)]
    what: EvalCommand,
}

#[derive(Debug, Subcommand)]
enum EvalCommand {
    /// Log-likelihoods of continuations given contexts (lm-eval's `loglikelihood`).
    Loglik(LoglikArgs),
    /// Perplexity of a text, in windows, scored as llama.cpp's `llama-perplexity` scores it.
    Perplexity(PerplexityArgs),
}

#[derive(Debug, Args)]
struct PerplexityArgs {
    /// The text (UTF-8).
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window (the second half of each is scored).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Tokens per batch, as llama-perplexity's `-b`: 512, or at least `--ctx` (kvx computes
    /// prompts in llama.cpp's 512-token batches).
    #[arg(long, default_value_t = 512)]
    batch: usize,
    /// Score the first N windows only (llama-perplexity's `--chunks`).
    #[arg(long, value_name = "N")]
    chunks: Option<usize>,
    /// Write every scored token's log-probabilities (its whole distribution: `n_vocab`
    /// f32 per token, ~200 KB per token for a 49k vocabulary) to FILE, as a base for
    /// `--kl-divergence` (llama-perplexity's `--kl-divergence-base`).
    #[arg(long, value_name = "FILE")]
    save_logits: Option<PathBuf>,
    /// Compare with a base FILE written by `--save-logits` over the same text and window:
    /// KL divergence of each scored token's distribution from the base's (mean, median,
    /// p99, max), top-1 agreement, and Δp of the actual next token.
    #[arg(long, value_name = "FILE")]
    kl_divergence: Option<PathBuf>,
    /// With `--kl-divergence`: write each scored token's divergence to FILE, one f64
    /// (little-endian) per token in scoring order, so that two runs over the same base
    /// compare token by token (bench/scripts/arith_table.sh pairs each arithmetic with
    /// `exact`).
    #[arg(long, value_name = "FILE", requires = "kl_divergence")]
    kld_values: Option<PathBuf>,
    /// Print one JSON object (`ppl`, `nll`, `tokens`, `chunks`, `ctx`, `arith`; with a base,
    /// `kld_mean`, `kld_se`, `kld_median`, `kld_p99`, `kld_max`, `top1`, `dp_mean`, `dp_rms`,
    /// `ppl_base`).
    #[arg(long)]
    json: bool,
    /// With `--arith reference`: roundings added to it and nothing else, to measure what a
    /// would-be arithmetic's number formats alone cost: `weights=bf16,acts=bf16,kv=f16`
    /// (any of the three: every weight as dequantized, every weight product's input, the
    /// cached keys and values; each `bf16` or `f16`), or `none`. With `--json`, named in
    /// `reference_rounding`.
    #[arg(long, value_name = "SPEC", default_value = "none")]
    reference_rounding: RefRounding,
    #[command(flatten)]
    engine: EngineOpts,
}

#[derive(Debug, Args)]
struct LoglikArgs {
    /// JSON lines, each `{"context": TEXT, "continuation": TEXT}` (split into tokens as
    /// lm-eval splits them) or `{"tokens": [IDS], "context_tokens": N}`. Prints one JSON
    /// line per input: `index`, `logprob` (the continuation's summed log-probability),
    /// `greedy`, `context_tokens`, `continuation_tokens`.
    #[arg(long)]
    file: PathBuf,
    /// Prompts in the engine at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[command(flatten)]
    engine: EngineOpts,
}

pub(crate) fn run(args: EvalArgs, rt: &Runtime) -> Result<()> {
    match args.what {
        EvalCommand::Loglik(a) => loglik(a, rt),
        EvalCommand::Perplexity(a) => perplexity(a, rt),
    }
}

fn perplexity(args: PerplexityArgs, rt: &Runtime) -> Result<()> {
    let text = read(&args.file)?;
    let prepared = prepare(&args.engine, rt, 1, args.reference_rounding)?;
    let tok = prepared.tokenizer().context("the model has no tokenizer")?;
    let mut backend = prepared.backend()?;
    let mut files = RowFiles::open(
        args.save_logits.as_deref(),
        args.kl_divergence.as_deref(),
        args.kld_values.as_deref(),
    )?;
    let bs = prepared.sched().block_size;
    let shape = (args.ctx, args.batch, args.chunks.unwrap_or(usize::MAX));
    let (p, n_text) =
        perplexity_of_text_upto(backend.as_mut(), bs, tok, &text, shape, files.rows())?;
    files.finish()?;
    let arith = prepared.setup().effective_arith().name();
    let rounding = args.reference_rounding;
    if args.json {
        let mut v = serde_json::to_value(&p)?;
        v["ctx"] = args.ctx.into();
        v["arith"] = arith.into();
        if !rounding.is_none() {
            v["reference_rounding"] = rounding.to_string().into();
        }
        println!("{v}");
    } else {
        println!(
            "perplexity {:.4} over {} tokens ({} windows of {}; {n_text} tokens in the text; \
             {arith} arithmetic{})",
            p.ppl,
            p.scored,
            p.chunks,
            args.ctx,
            if rounding.is_none() { String::new() } else { format!(", rounded: {rounding}") }
        );
        if let Some(k) = &p.kl {
            println!("{k}");
        }
    }
    Ok(())
}

fn loglik(args: LoglikArgs, rt: &Runtime) -> Result<()> {
    let text = read(&args.file)?;
    let prepared = prepare(&args.engine, rt, args.concurrency, RefRounding::default())?;
    let tok = prepared.tokenizer().context("the model has no tokenizer")?;
    let inputs = read_inputs(tok, &text)?;
    if inputs.is_empty() {
        bail!("{} has no inputs", args.file.display());
    }
    let mut engine = prepared.engine(0)?;
    let scores = loglikelihoods(&mut engine, &inputs, args.concurrency)?;
    let mut out = std::io::stdout().lock();
    for (index, s) in scores.iter().enumerate() {
        let line = serde_json::json!({
            "index": index,
            "logprob": s.logprob,
            "greedy": s.greedy,
            "context_tokens": s.context_tokens,
            "continuation_tokens": s.continuation_tokens,
        });
        writeln!(out, "{line}")?;
    }
    Ok(())
}

fn read(path: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The model's engine set-up for this process, sized for `concurrency` sequences, with
/// `rounding` added to the reference arithmetic.
fn prepare(
    opts: &EngineOpts,
    rt: &Runtime,
    concurrency: usize,
    rounding: RefRounding,
) -> Result<kvx_worker::Prepared> {
    let mut setup = opts.setup(rt, EngineKind::Model, true)?;
    setup.reference_rounding = rounding;
    setup.limits.max_num_seqs = setup.limits.max_num_seqs.min(concurrency.max(1));
    // Windows run in llama.cpp's prompt batches.
    setup.limits.max_batched_tokens = setup.limits.max_batched_tokens.max(PROMPT_BATCH);
    Ok(setup.prepare()?)
}
