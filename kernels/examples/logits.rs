//! Prints the top logits of the last token of a prompt given as token ids (debugging aid).

use std::io::Write;
use std::sync::Arc;

use kvx_kernels::cpu;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: logits MODEL.gguf ID...")?;
    let ids: Vec<u32> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    let model = LlamaModel::load(Arc::new(GgufFile::open(&path)?))?;
    let k = match std::env::var("KVX_SIMD") {
        Ok(name) => cpu::select(cpu::SimdLevel::from_name(&name).ok_or("bad KVX_SIMD")?)?,
        Err(_) => cpu::kernels(),
    };
    let pool = ThreadPool::new(2)?;
    let bs = 16;
    let nb = ids.len().div_ceil(bs);
    let mut kv = KvCache::new(&model.cfg, nb, bs)?;
    let table: Vec<u32> = (0..nb as u32).collect();
    let mut s = Scratch::new(&model, ids.len(), nb * bs, pool.n_threads());
    let mut logits = vec![0.0; model.cfg.n_vocab];
    let mode = if ids.len() > 1 { AttnMode::Prefill } else { AttnMode::Decode };
    let chunk = SeqChunk { tokens: &ids, start_pos: 0, block_table: &table, logits: true, mode };
    model.forward(k, &pool, &[chunk], &mut kv, &mut s, &mut logits)?;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let mut out = std::io::stdout().lock();
    for &i in &idx[..5] {
        if writeln!(out, "{i} {:.6}", logits[i]).is_err() {
            break;
        }
    }
    Ok(())
}
