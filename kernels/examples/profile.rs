//! Times the stages of one prompt step (the spans between the forward pass's trace points:
//! `Qcur` = norm + Q/K/V products + rope, `kqv_out` = attention, `ffn_inp` = output
//! projection + residual, `ffn_swiglu` = norm + gate/up products + SwiGLU, `ffn_out` = down
//! product, `(tail)` = final norm + output head) for each matrix arithmetic.
//! Usage: `profile MODEL.gguf THREADS TOKENS [SEQS]`: one prompt of TOKENS tokens, or with
//! SEQS a decode step of SEQS sequences, each one new token after TOKENS cached positions
//! (cache blocks scattered by a fixed permutation).
//! `MATH=ggml|exact|fast` runs one arithmetic only; `REPS` sets the timed steps (4);
//! `HEAD=argmax` makes decode rows greedy-only (the screened head of `kvx_kernels::greedy`);
//! `BS` sets the tokens per cache block (16); `ATTN=ggml` keeps ggml's attention under `fast`.
//! `MIX=N` adds a fresh sequence's N-token prompt chunk to the step (a decode step with a
//! prompt riding on it), and with it `MIX_ONLY=1` times that chunk alone.
//! `RATES=1` times the products alone instead (TOKENS tokens, each arithmetic): one FFN
//! matrix again and again (in L1/L2), every layer's matrices in turn (from the last-level
//! cache as far as they fit), and the same after reading 512 MiB of other memory twice (from
//! DRAM). `AMX=0` keeps the row-lane products off AMX tiles where the machine has them.

#![allow(clippy::disallowed_methods)] // an example reads its settings from the environment

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kvx_kernels::cpu;
use kvx_kernels::cpu::lanes::LaneMath;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: profile MODEL.gguf THREADS TOKENS";
    let path = args.next().ok_or(usage)?;
    let threads: usize = args.next().ok_or(usage)?.parse()?;
    let n_tok: usize = args.next().ok_or(usage)?.parse()?;
    let seqs: Option<usize> = args.next().map(|s| s.parse()).transpose()?;
    let file = Arc::new(GgufFile::open(&path)?);
    let k = if std::env::var("AMX").is_ok_and(|v| v == "0") {
        let plain = cpu::Kernels::for_level_with(cpu::SimdLevel::detect(), false);
        cpu::select_table(plain.ok_or("no kernels")?)?
    } else {
        cpu::kernels()
    };
    eprintln!("kernels: {} (AMX tiles: {})", k.level, k.uses_tiles());
    let pool = ThreadPool::new(threads)?;
    let only = std::env::var("MATH").ok();
    for math in [None, Some(LaneMath::Exact), Some(LaneMath::Fast)] {
        let tag = math.map_or("ggml", |m| if m == LaneMath::Exact { "exact" } else { "fast" });
        if only.as_deref().is_some_and(|o| o != tag) {
            continue;
        }
        let mut model = LlamaModel::load(file.clone())?;
        if let Some(math) = math {
            model.repack(k, math)?;
            // `fast` as `--arith fast` runs it (free attention; `ATTN=ggml` keeps ggml's).
            model.free_attention = math == LaneMath::Fast
                && std::env::var("ATTN").as_deref() != Ok("ggml")
                && kvx_kernels::ops::attention_free_covers(k, model.cfg.head_dim);
        }
        let name = math.map_or("ggml tiles".to_string(), |m| format!("row-lane {m:?}"));
        if std::env::var("RATES").is_ok_and(|v| v == "1") {
            rates(&model, k, &pool, n_tok, &name)?;
            continue;
        }
        profile(&model, k, &pool, n_tok, seqs, &name)?;
    }
    Ok(())
}

/// The products' rate in multiply-adds per second at `n_tok` tokens, with the weights hot,
/// cycling through the layers, and evicted to DRAM before each pass (module docs).
fn rates(
    model: &LlamaModel,
    k: &cpu::Kernels,
    pool: &ThreadPool,
    n_tok: usize,
    name: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    use kvx_kernels::ops;
    let body: Vec<_> = model
        .layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
        .collect();
    let views = body.iter().map(|m| model.view(m)).collect::<Result<Vec<_>, _>>()?;
    let hot = vec![model.view(&model.layers[0].w_up)?; views.len()];
    let cols = views.iter().map(|q| q.cols()).max().unwrap_or(0);
    let rows = views.iter().map(|q| q.rows()).max().unwrap_or(0);
    let x: Vec<f32> = (0..n_tok * cols).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
    let mut act = vec![0u32; n_tok * cols];
    let mut out = vec![0.0f32; rows * n_tok];
    // Five times the last-level cache this machine's VM gives one core in practice (~100 MB
    // of a reported 480 MiB), read twice before each pass.
    let other: Vec<u64> = (0..(512u64 << 20) / 8).collect();
    print!("{name}, {n_tok} token(s):");
    for (label, set, evict) in
        [("hot", &hot, false), ("layers", &views, false), ("evicted", &views, true)]
    {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            if evict {
                for _ in 0..2 {
                    std::hint::black_box(other.iter().fold(0u64, |a, v| a.wrapping_add(*v)));
                }
            }
            let (mut secs, mut macs) = (0.0, 0usize);
            for q in set.iter() {
                let act = bytemuck::cast_slice_mut(&mut act);
                let xq = ops::quantize_activations(
                    k,
                    q.act_ty(),
                    &x[..n_tok * q.cols()],
                    q.cols(),
                    act,
                )?;
                let t = Instant::now();
                ops::matmul(k, pool, q, xq, n_tok, &mut out[..q.rows() * n_tok])?;
                secs += t.elapsed().as_secs_f64();
                macs += q.rows() * q.cols() * n_tok;
            }
            best = best.min(secs / macs as f64);
        }
        print!("  {label} {:.0} GMAC/s", 1e-9 / best);
    }
    println!();
    Ok(())
}

fn profile(
    model: &LlamaModel,
    k: &cpu::Kernels,
    pool: &ThreadPool,
    n_tok: usize,
    seqs: Option<usize>,
    name: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let ids: Vec<u32> = (0..n_tok as u32).map(|i| 100 + i * 7 % 5000).collect();
    let bs: usize = std::env::var("BS").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let n_seq = seqs.unwrap_or(1);
    let nb = (n_tok + 1).div_ceil(bs);
    // `MIX`: a fresh sequence's prompt chunk of that many tokens in the same step, in blocks
    // of its own after the others'.
    let mix: usize = std::env::var("MIX").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mix_nb = mix.div_ceil(bs);
    let mut kv = KvCache::new(&model.cfg, nb * n_seq + mix_nb, bs)?;
    let mix_table: Vec<u32> = (0..mix_nb).map(|b| (nb * n_seq + b) as u32).collect();
    let mix_ids: Vec<u32> = (0..mix as u32).map(|i| 200 + i * 13 % 5000).collect();
    // Blocks scattered over the cache as a serving engine's free list leaves them (a fixed
    // permutation: 7919 is prime), so that decode attention reads rows as it does there.
    let n_blocks = nb * n_seq;
    let scatter = |j: usize| ((j * 7919 + 13) % n_blocks) as u32;
    let tables: Vec<Vec<u32>> =
        (0..n_seq).map(|i| (0..nb).map(|b| scatter(b + i * nb)).collect()).collect();
    let max_ctx = (nb * bs).max(mix_nb * bs);
    let mut s = Scratch::new(model, n_tok.max(n_seq) + mix, max_ctx, pool.n_threads());
    let mut logits = vec![0.0; model.cfg.n_vocab * (n_seq + 1)];
    if seqs.is_some() {
        // Fill every sequence's cache with the prompt (untimed).
        for table in &tables {
            let mode = AttnMode::Prefill;
            let chunk = SeqChunk {
                tokens: &ids,
                start_pos: 0,
                block_table: table,
                logits: Logits::Skip,
                mode,
            };
            model.forward(k, pool, &[chunk], &mut kv, &mut s, &mut logits)?;
        }
    }
    let one = [7u32];
    // `HEAD=argmax`: decode rows want only their greedy token (the screened head).
    let head = match std::env::var("HEAD").as_deref() {
        Ok("argmax") => Logits::Argmax,
        _ => Logits::Full,
    };
    let mut chunks: Vec<SeqChunk<'_>> = match seqs {
        None => vec![SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &tables[0],
            logits: Logits::Full,
            mode: AttnMode::Prefill,
        }],
        Some(_) => tables
            .iter()
            .map(|t| SeqChunk {
                tokens: &one,
                start_pos: n_tok,
                block_table: t,
                logits: head,
                mode: AttnMode::Decode,
            })
            .collect(),
    };
    if mix > 0 {
        // `MIX_ONLY=1`: the prompt chunk alone, to set beside the step with it.
        if std::env::var("MIX_ONLY").is_ok_and(|v| v == "1") {
            chunks.clear();
        }
        // As the engine runs it: a one-token chunk in the decode path.
        let mode = if mix > 1 { AttnMode::Prefill } else { AttnMode::Decode };
        chunks.push(SeqChunk {
            tokens: &mix_ids,
            start_pos: 0,
            block_table: &mix_table,
            logits: Logits::Skip,
            mode,
        });
    }
    let step: usize = chunks.iter().map(|c| c.tokens.len()).sum();
    let mut spans: BTreeMap<String, f64> = BTreeMap::new();
    let reps: usize = std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let mut total = 0.0;
    // One untimed step first (page faults, caches).
    for rep in 0..=reps {
        let start = Instant::now();
        let mut last = start;
        model.forward_traced(k, pool, &chunks, &mut kv, &mut s, &mut logits, &mut |op, _, _| {
            let now = Instant::now();
            if rep > 0 {
                *spans.entry(op.to_string()).or_default() += (now - last).as_secs_f64();
            }
            last = Instant::now();
        })?;
        if rep > 0 {
            total += start.elapsed().as_secs_f64();
            *spans.entry("(tail)".into()).or_default() += last.elapsed().as_secs_f64();
        }
    }
    let per = |v: f64| v * 1e3 / reps as f64;
    println!("{name}: {:.1} ms per step, {:.0} tok/s", per(total), (step * reps) as f64 / total);
    for (op, v) in spans.iter().filter(|(_, v)| **v > 0.0) {
        println!("  {op:>12} {:7.1} ms {:5.1} %", per(*v), 100.0 * v / total);
    }
    Ok(())
}
