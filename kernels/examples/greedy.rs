//! Greedy decoding from token ids, printing the top-2 logits per step (debugging aid).

#![allow(clippy::disallowed_methods)] // an example reads its settings from the environment

use std::sync::Arc;

use kvx_kernels::cpu;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: greedy MODEL.gguf STEPS ID...")?;
    let steps: usize = args.next().ok_or("steps")?.parse()?;
    let ids: Vec<u32> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    let model = LlamaModel::load(Arc::new(GgufFile::open(&path)?))?;
    let k = match std::env::var("KVX_SIMD") {
        Ok(name) => cpu::select(cpu::SimdLevel::from_name(&name).ok_or("bad KVX_SIMD")?)?,
        Err(_) => cpu::kernels(),
    };
    let pool = ThreadPool::new(2)?;
    let bs = 16;
    let nb = (ids.len() + steps).div_ceil(bs);
    let mut kv = KvCache::new(&model.cfg, nb, bs)?;
    let table: Vec<u32> = (0..nb as u32).collect();
    let mut s = Scratch::new(&model, ids.len(), nb * bs, pool.n_threads());
    let mut logits = vec![0.0; model.cfg.n_vocab];
    let mode = if ids.len() > 1 { AttnMode::Prefill } else { AttnMode::Decode };
    let chunk =
        SeqChunk { tokens: &ids, start_pos: 0, block_table: &table, logits: Logits::Full, mode };
    model.forward(k, &pool, &[chunk], &mut kv, &mut s, &mut logits)?;
    for pos in ids.len()..ids.len() + steps {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        println!("{} {:.6} {} {:.6}", idx[0], logits[idx[0]], idx[1], logits[idx[1]]);
        let t = idx[0] as u32;
        let chunk = SeqChunk {
            tokens: std::slice::from_ref(&t),
            start_pos: pos,
            block_table: &table,
            logits: Logits::Full,
            mode: AttnMode::Decode,
        };
        model.forward(k, &pool, &[chunk], &mut kv, &mut s, &mut logits)?;
    }
    Ok(())
}
