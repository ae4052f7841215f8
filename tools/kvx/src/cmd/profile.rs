//! `kvx profile`: flags and wiring of the pre-deployment sweep (`kvx_worker::profile`): one
//! engine in this process, its TTFT over prompt lengths and ITL over batch × context, written
//! as the JSON profile `kvx planner` reads.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvx_worker::profile::{Sweep, measure, shape_of};
use kvx_worker::{EngineKind, MockerSetup};

use super::Runtime;
use super::engine::EngineOpts;
use super::worker::{RoleArg, WorkerEngine};

#[derive(Debug, Args)]
pub(crate) struct ProfileArgs {
    /// What computes tokens.
    #[arg(long, value_enum, default_value = "model")]
    engine: WorkerEngine,
    /// The role the profile is for (recorded; the sweep is the same).
    #[arg(long, value_enum, default_value = "agg")]
    role: RoleArg,
    /// Where the profile goes (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Also draw it here: an HTML page of SVG charts.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Longest prompt of the prefill curve (16 lengths from 32 up to it).
    #[arg(long, default_value_t = 4096)]
    max_isl: u32,
    /// Largest batch of the decode grid (6 sizes from 1).
    #[arg(long, default_value_t = 32)]
    max_batch: u32,
    /// Longest context of the decode grid (6 lengths from 64).
    #[arg(long, default_value_t = 2048)]
    max_context: u32,
    /// Runs per point (the median is kept).
    #[arg(long, default_value_t = 3)]
    reps: u32,
    /// Sampling temperature of the decode batches (1: the API's default; 0: greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Kernel threads of the engine measured.
    #[arg(long, default_value_t = 1)]
    threads_per_shard: usize,
    /// Mocker: simulated step times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Mocker: KV blocks.
    #[arg(long, default_value_t = 16384)]
    mocker_blocks: usize,
    #[command(flatten)]
    opts: EngineOpts,
}

pub(crate) fn run(args: ProfileArgs, rt: &Runtime) -> Result<()> {
    let mocker = args.engine == WorkerEngine::Mocker;
    let kind = if mocker { EngineKind::Mocker } else { EngineKind::Model };
    let mut setup = args.opts.setup(rt, kind, !mocker)?;
    setup.engines = 1;
    setup.threads_per_engine = args.threads_per_shard.max(1);
    let mut sweep = Sweep::standard(args.max_isl, args.max_batch, args.max_context, args.reps);
    if !(0.0..=2.0).contains(&args.temperature) {
        bail!("--temperature {}: between 0 and 2", args.temperature);
    }
    sweep.temperature = args.temperature;
    setup.limits.max_num_seqs = setup.limits.max_num_seqs.max(args.max_batch as usize);
    let longest = args.max_isl.max(args.max_context) as usize + 64;
    let vocab = 64;
    setup.mocker = MockerSetup {
        speedup: args.speedup_ratio,
        blocks: Some(args.mocker_blocks),
        vocab: Some(vocab),
        max_model_len: Some(longest),
    };
    let prepared = setup.prepare()?;
    let vocab = match prepared.model() {
        Some(m) => m.cfg.n_vocab as u32,
        None => vocab as u32,
    };
    let capacity = (prepared.kv_blocks() * prepared.block_size()) as u64;
    let limit = prepared.context_limit();
    if args.max_isl as usize + 1 > limit || args.max_context as usize + 16 > limit {
        bail!(
            "--max-isl {} / --max-context {}: this engine takes {limit} tokens",
            args.max_isl,
            args.max_context
        );
    }
    let shape = shape_of(&prepared, &format!("{:?}", args.role).to_lowercase());
    let mut make = || prepared.engine(0).map_err(|e| e.to_string());
    let profile =
        measure(&mut make, vocab, capacity, shape, &sweep, &mut |line| eprintln!("{line}"))?;
    profile.write(&args.out).with_context(|| format!("writing {}", args.out.display()))?;
    if let Some(html) = &args.html {
        std::fs::write(html, kvx_planner::report::profile_html(&profile))
            .with_context(|| format!("writing {}", html.display()))?;
    }
    println!(
        "wrote {} ({} prefill points, {} decode points)",
        args.out.display(),
        profile.prefill.len(),
        profile.decode.len()
    );
    Ok(())
}
