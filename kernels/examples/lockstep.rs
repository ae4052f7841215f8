//! Two shards' decode steps on two threads, as `kvx serve --shards 2` runs them (one
//! single-thread engine per core over one shared copy of the weights; here unpinned, which on
//! an otherwise idle two-core machine puts the two busy threads on the two cores), started
//! together or kept half a step apart: what a shard gains when the other reads the same
//! weights just before it (from L3) rather than half a step earlier.
//!
//! `lockstep MODEL.gguf CTX SEQS`: each shard decodes SEQS sequences of CTX cached
//! positions. `MODE=0` runs them free (started together; `OFFSET_US` delays the second's
//! start), `MODE=1` starts every step of both together, `MODE=2` starts the second shard's
//! steps half a step (its previous forward pass) after the first's, each shard spinning the
//! other half (only the forward passes are timed). Prints each shard's median forward pass.
//! `REPS` sets the steps (40).

#![allow(clippy::disallowed_methods)] // an example reads its settings from the environment

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvx_kernels::cpu;
use kvx_kernels::cpu::lanes::LaneMath;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Spins (the core stays busy, as a shard's would) for `secs`.
fn spin(secs: f64) {
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < secs {
        std::hint::spin_loop();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: lockstep MODEL.gguf CTX SEQS";
    let path = args.next().ok_or(usage)?;
    let n_tok: usize = args.next().ok_or(usage)?.parse()?;
    let n_seq: usize = args.next().ok_or(usage)?.parse()?;
    let (mode, reps, offset) =
        (env("MODE", 0u32), env("REPS", 40usize).max(1), env("OFFSET_US", 0u64));
    let k = cpu::kernels();
    let mut model = LlamaModel::load(Arc::new(GgufFile::open(&path)?))?;
    model.repack(k, LaneMath::Fast)?;
    model.free_attention = kvx_kernels::ops::attention_free_covers(k, model.cfg.head_dim);
    let model = Arc::new(model);
    let barrier = Arc::new(Barrier::new(2));
    // Set by a shard that failed: the other stops computing but still meets every barrier.
    let abort = Arc::new(AtomicBool::new(false));
    let shards: Vec<_> = (0..2usize)
        .map(|shard| {
            let (model, barrier, abort) = (model.clone(), barrier.clone(), abort.clone());
            std::thread::spawn(move || -> Result<f64, String> {
                let r =
                    run_shard(&model, shard, n_tok, n_seq, mode, reps, offset, &barrier, &abort);
                if r.is_err() {
                    abort.store(true, Ordering::Relaxed);
                }
                r
            })
        })
        .collect();
    let mut ms = Vec::new();
    for s in shards {
        ms.push(s.join().map_err(|_| "a shard panicked")??);
    }
    println!("mode {mode}: median forward pass {:.2} / {:.2} ms", ms[0], ms[1]);
    Ok(())
}

/// One shard: fills its cache, then times `reps` decode steps. Meets the barrier once before
/// the steps and (`mode >= 1`) once per step, also after a failure (its own or, seen through
/// `abort`, the other's), so that the other shard never waits for it.
#[allow(clippy::too_many_arguments)]
fn run_shard(
    model: &LlamaModel,
    shard: usize,
    n_tok: usize,
    n_seq: usize,
    mode: u32,
    reps: usize,
    offset: u64,
    barrier: &Barrier,
    abort: &AtomicBool,
) -> Result<f64, String> {
    let k = cpu::kernels();
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let bs = 16;
    let nb = (n_tok + 1).div_ceil(bs);
    let n_blocks = nb * n_seq;
    let scatter = |j: usize| ((j * 7919 + 13) % n_blocks.max(1)) as u32;
    let tables: Vec<Vec<u32>> =
        (0..n_seq).map(|i| (0..nb).map(|b| scatter(b + i * nb)).collect()).collect();
    let ids: Vec<u32> = (0..n_tok as u32).map(|i| 100 + i * 7 % 5000).collect();
    let one = [7u32];
    let decode: Vec<SeqChunk<'_>> = tables
        .iter()
        .map(|t| SeqChunk {
            tokens: &one,
            start_pos: n_tok,
            block_table: t,
            logits: Logits::Argmax,
            mode: AttnMode::Decode,
        })
        .collect();
    let mut logits = vec![0.0; model.cfg.n_vocab * n_seq];
    let mut s = Scratch::new(model, n_tok.max(n_seq), nb * bs, 1);
    let setup = || -> Result<(ThreadPool, KvCache), String> {
        let pool = ThreadPool::new(1).map_err(|e| err(&e))?;
        let kv = KvCache::new(&model.cfg, n_blocks, bs).map_err(|e| err(&e))?;
        Ok((pool, kv))
    };
    let mut state = setup();
    if let Ok((pool, kv)) = &mut state {
        for table in &tables {
            let chunk = SeqChunk {
                tokens: &ids,
                start_pos: 0,
                block_table: table,
                logits: Logits::Skip,
                mode: AttnMode::Prefill,
            };
            if let Err(e) = model.forward(k, pool, &[chunk], kv, &mut s, &mut logits) {
                state = Err(err(&e));
                break;
            }
        }
    }
    if state.is_err() {
        abort.store(true, Ordering::Relaxed);
    }
    barrier.wait();
    if shard == 1 && offset > 0 {
        std::thread::sleep(Duration::from_micros(offset));
    }
    let mut fwd = Vec::with_capacity(reps);
    let mut last = 0.010f64;
    for _ in 0..reps {
        if mode >= 1 {
            barrier.wait();
        }
        let Ok((pool, kv)) = &mut state else { continue };
        if abort.load(Ordering::Relaxed) {
            continue;
        }
        if mode == 2 && shard == 1 {
            spin(last / 2.0);
        }
        let t = Instant::now();
        if let Err(e) = model.forward(k, pool, &decode, kv, &mut s, &mut logits) {
            abort.store(true, Ordering::Relaxed);
            state = Err(err(&e));
            continue;
        }
        last = t.elapsed().as_secs_f64();
        fwd.push(last * 1e3);
        if mode == 2 && shard == 0 {
            spin(last / 2.0);
        }
    }
    state?;
    fwd.sort_by(f64::total_cmp);
    fwd.get(fwd.len() / 2).copied().ok_or_else(|| "the other shard failed".to_string())
}
