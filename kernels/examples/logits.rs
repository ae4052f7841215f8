//! Prints the top logits of the last token of a prompt given as token ids, with ggml's
//! association and with the row-lane kernels, and how far the two sets of logits lie apart
//! (debugging aid).

#![allow(clippy::disallowed_methods)] // an example reads its settings from the environment

use std::io::Write;
use std::sync::Arc;

use kvx_kernels::cpu;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: logits MODEL.gguf ID...")?;
    let ids: Vec<u32> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    let file = Arc::new(GgufFile::open(&path)?);
    let model = LlamaModel::load(file.clone())?;
    let k = match std::env::var("KVX_SIMD") {
        Ok(name) => cpu::select(cpu::SimdLevel::from_name(&name).ok_or("bad KVX_SIMD")?)?,
        Err(_) => cpu::kernels(),
    };
    let pool = ThreadPool::new(2)?;
    let mut lanes = LlamaModel::load(file)?;
    lanes.repack(k, kvx_kernels::cpu::lanes::LaneMath::Fast)?;
    // As `--arith fast` computes: with its free attention where the level has the kernel.
    lanes.free_attention = kvx_kernels::ops::attention_free_covers(k, lanes.cfg.head_dim);
    let exact = top(&model, k, &pool, &ids)?;
    let fast = top(&lanes, k, &pool, &ids)?;
    let mut out = std::io::stdout().lock();
    for (name, l) in [("ggml-exact", &exact), ("row-lane", &fast)] {
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        let top5: Vec<String> = idx[..5].iter().map(|&i| format!("{i} {:.6}", l[i])).collect();
        writeln!(out, "{name}: {}", top5.join(", "))?;
    }
    let diff = exact.iter().zip(&fast).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    writeln!(out, "max |difference| {diff:.3e}")?;
    Ok(())
}

fn top(
    model: &LlamaModel,
    k: &cpu::Kernels,
    pool: &ThreadPool,
    ids: &[u32],
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let bs = 16;
    let nb = ids.len().div_ceil(bs);
    let mut kv = KvCache::new(&model.cfg, nb, bs)?;
    let table: Vec<u32> = (0..nb as u32).collect();
    let mut s = Scratch::new(model, ids.len(), nb * bs, pool.n_threads());
    let mut logits = vec![0.0; model.cfg.n_vocab];
    let mode = if ids.len() > 1 { AttnMode::Prefill } else { AttnMode::Decode };
    let chunk =
        SeqChunk { tokens: ids, start_pos: 0, block_table: &table, logits: Logits::Full, mode };
    model.forward(k, pool, &[chunk], &mut kv, &mut s, &mut logits)?;
    Ok(logits)
}
