//! `kvx bench engine`: prompt processing and token generation speed of the engine itself,
//! measured like llama.cpp's `llama-bench` (pp: one batch of N prompt tokens; tg: N tokens
//! generated one at a time), repeated, with the median reported. As llama-bench keeps one
//! context and warms it up, one engine serves every run, without a prefix cache (its freed
//! blocks are the next run's), and an untimed run of each test goes first: no timed run
//! pays the first writes of a fresh KV cache (on huge pages, ~0.3 GB/s on some VMs).

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};
use kvx_worker::EngineKind;

use super::Runtime;
use super::engine::EngineOpts;

#[derive(Debug, Args)]
pub(crate) struct EngineBenchArgs {
    /// Prompt tokens per prompt-processing test (0 skips it).
    #[arg(long, default_value_t = 512)]
    pp: usize,
    /// Tokens per generation test (0 skips it).
    #[arg(long, default_value_t = 128)]
    tg: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineOpts,
}

pub(crate) fn run(args: EngineBenchArgs, rt: &Runtime) -> Result<()> {
    let mut setup = args.engine.setup(rt, EngineKind::Model, true)?;
    setup.limits.max_batched_tokens = setup.limits.max_batched_tokens.max(args.pp.max(1));
    setup.limits.max_num_seqs = 1;
    // Nothing cached between runs, as in a llama.cpp context cleared between them.
    setup.limits.prefix_caching = false;
    let prepared = setup.prepare()?;
    let threads = setup.threads_per_engine;
    let kernels = setup.kernels;
    let n_vocab = prepared.model().context("model engines load a model")?.cfg.n_vocab as u32;
    // Random-looking prompt tokens, as llama-bench uses.
    let token = |i: usize| 100 + ((i as u64 * 2_654_435_761) % u64::from(n_vocab - 200)) as u32;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut id = 0u64;
    let mut engine = prepared.engine(0)?;
    let mut run_one = |prompt: Vec<u32>, max_tokens: u32| -> Result<(f64, f64)> {
        id += 1;
        let req = GenerateRequest::new(
            RequestId(id),
            prompt,
            SamplingOptions { temperature: 0.0, ..Default::default() },
            StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
        );
        engine.add(&req)?;
        let start = Instant::now();
        let mut first = None;
        loop {
            let out = engine.step()?;
            if first.is_none() && out.events.iter().any(|e| e.token.is_some()) {
                first = Some(start.elapsed().as_secs_f64());
            }
            if out.events.iter().any(|e| e.finish.is_some()) {
                break;
            }
        }
        Ok((first.unwrap_or(0.0), start.elapsed().as_secs_f64()))
    };
    // Run 0 is the untimed warm-up.
    for r in 0..=args.reps.max(1) {
        if args.pp > 0 {
            let (ttft, _) = run_one((0..args.pp).map(token).collect(), 1)?;
            if r > 0 {
                pp.push(args.pp as f64 / ttft);
            }
        }
        if args.tg > 0 {
            // One prompt token, then `tg` single-token steps (the first sampled token comes
            // from the prompt step, as in llama-bench's tg the first decode starts at once).
            let (first, total) = run_one(vec![token(0)], args.tg as u32 + 1)?;
            if r > 0 {
                tg.push(args.tg as f64 / (total - first));
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        if v.is_empty() { 0.0 } else { v[v.len() / 2] }
    };
    let (pp_med, tg_med) = (med(&mut pp), med(&mut tg));
    let math = prepared.setup().effective_arith().name();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": setup.model.as_ref().map(|p| p.display().to_string()),
                "threads": threads,
                "kernels": kernels.label(),
                "arithmetic": math,
                "pp": args.pp, "pp_tok_s": pp_med, "pp_runs": pp,
                "tg": args.tg, "tg_tok_s": tg_med, "tg_runs": tg,
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
