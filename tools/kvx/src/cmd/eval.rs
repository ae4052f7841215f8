//! `kvx eval`: measure the model on the engine in this process (no server).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kvx_worker::EngineKind;
use kvx_worker::eval::{loglikelihoods, perplexity_of_text, read_inputs};

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
    /// Windows in the engine at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Print one JSON object (`ppl`, `nll`, `tokens`, `chunks`, `ctx`).
    #[arg(long)]
    json: bool,
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
    let prepared = prepare(&args.engine, rt, args.concurrency)?;
    let tok = prepared.tokenizer().context("the model has no tokenizer")?;
    let mut engine = prepared.engine(0)?;
    let (p, n_text) =
        perplexity_of_text(&mut engine, tok, &text, args.ctx, args.batch, args.concurrency)?;
    if args.json {
        let v = serde_json::json!({
            "ppl": p.ppl, "nll": p.nll, "tokens": p.scored, "chunks": p.chunks, "ctx": args.ctx,
        });
        println!("{v}");
    } else {
        println!(
            "perplexity {:.4} over {} tokens ({} windows of {}; {n_text} tokens in the text)",
            p.ppl, p.scored, p.chunks, args.ctx
        );
    }
    Ok(())
}

fn loglik(args: LoglikArgs, rt: &Runtime) -> Result<()> {
    let text = read(&args.file)?;
    let prepared = prepare(&args.engine, rt, args.concurrency)?;
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

/// The model's engine set-up for this process, sized for `concurrency` sequences.
fn prepare(opts: &EngineOpts, rt: &Runtime, concurrency: usize) -> Result<kvx_worker::Prepared> {
    let mut setup = opts.setup(rt, EngineKind::Model, true)?;
    setup.limits.max_num_seqs = setup.limits.max_num_seqs.min(concurrency.max(1));
    Ok(setup.prepare()?)
}
