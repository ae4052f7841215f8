//! `kvx bench engine`: prompt processing and token generation speed of the engine itself,
//! measured like llama.cpp's `llama-bench` (`kvx_worker::profile::bench_engine`: pp, one
//! batch of N prompt tokens; tg, N tokens generated one at a time; a warm-up first),
//! repeated, with the median reported.

use anyhow::{Context, Result};
use clap::Args;
use kvx_worker::EngineKind;

use super::Runtime;
use super::engine::EngineOpts;

#[derive(Debug, Args)]
pub(crate) struct EngineBenchArgs {
    /// Prompt tokens per prompt-processing test (0 skips it).
    #[arg(long, default_value_t = 512)]
    pp: u32,
    /// Tokens per generation test (0 skips it).
    #[arg(long, default_value_t = 128)]
    tg: u32,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineOpts,
}

pub(crate) fn run(args: EngineBenchArgs, rt: &Runtime) -> Result<()> {
    let mut setup = args.engine.setup(rt, EngineKind::Model, true)?;
    setup.limits.max_batched_tokens = setup.limits.max_batched_tokens.max(args.pp.max(1) as usize);
    setup.limits.max_num_seqs = 1;
    // Nothing cached between runs, as in a llama.cpp context cleared between them.
    setup.limits.prefix_caching = false;
    let prepared = setup.prepare()?;
    let threads = setup.threads_per_engine;
    let kernels = setup.kernels;
    let n_vocab = prepared.model().context("model engines load a model")?.cfg.n_vocab as u32;
    let mut engine = prepared.engine(0)?;
    let b = kvx_worker::profile::bench_engine(&mut engine, n_vocab, args.pp, args.tg, args.reps)?;
    let (pp_med, tg_med) = (b.pp_median(), b.tg_median());
    let math = prepared.setup().effective_arith().name();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": setup.model.as_ref().map(|p| p.display().to_string()),
                "threads": threads,
                "kernels": kernels.label(),
                "arithmetic": math,
                "pp": args.pp, "pp_tok_s": pp_med, "pp_runs": b.pp_runs,
                "tg": args.tg, "tg_tok_s": tg_med, "tg_runs": b.tg_runs,
            })
        );
    } else {
        println!(
            "| test | threads | kernels | arithmetic | tok/s (median of {}) |",
            args.reps.max(1)
        );
        println!("|---|---|---|---|---|");
        if args.pp > 0 {
            println!("| pp{} | {threads} | {} | {math} | {pp_med:.1} |", args.pp, kernels.label());
        }
        if args.tg > 0 {
            println!("| tg{} | {threads} | {} | {math} | {tg_med:.1} |", args.tg, kernels.label());
        }
    }
    Ok(())
}
