//! `kvx eval`: measure the model on the engine in this process (no server).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kvx_worker::EngineKind;
use kvx_worker::eval::{loglikelihoods, read_inputs};

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
    }
}

fn loglik(args: LoglikArgs, rt: &Runtime) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut setup = args.engine.setup(rt, EngineKind::Model, true)?;
    setup.limits.max_num_seqs = setup.limits.max_num_seqs.min(args.concurrency.max(1));
    let prepared = setup.prepare()?;
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
