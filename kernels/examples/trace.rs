//! Runs a prompt (token ids) in one step and writes every traced tensor of every layer to
//! `DIR/<name>-<layer>.bin` as raw little-endian f32 (debugging aid for parity work).

use std::sync::Arc;

use kvx_kernels::cpu;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: trace MODEL.gguf DIR ID...")?;
    let dir = args.next().ok_or("dir")?;
    let ids: Vec<u32> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    std::fs::create_dir_all(&dir)?;
    let model = LlamaModel::load(Arc::new(GgufFile::open(&path)?))?;
    let k = cpu::kernels();
    let pool = ThreadPool::new(2)?;
    let bs = 16;
    let nb = ids.len().div_ceil(bs);
    let mut kv = KvCache::new(&model.cfg, nb, bs)?;
    let table: Vec<u32> = (0..nb as u32).collect();
    let mut s = Scratch::new(&model, ids.len(), nb * bs, pool.n_threads());
    let mut logits = vec![0.0; model.cfg.n_vocab];
    let mode = if ids.len() > 1 { AttnMode::Prefill } else { AttnMode::Decode };
    let chunk =
        SeqChunk { tokens: &ids, start_pos: 0, block_table: &table, logits: Logits::Full, mode };
    let mut err = None;
    model.forward_traced(
        k,
        &pool,
        &[chunk],
        &mut kv,
        &mut s,
        &mut logits,
        &mut |name, layer, data| {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            if let Err(e) = std::fs::write(format!("{dir}/{name}-{layer}.bin"), bytes) {
                err = Some(e);
            }
        },
    )?;
    if let Some(e) = err {
        return Err(e.into());
    }
    Ok(())
}
