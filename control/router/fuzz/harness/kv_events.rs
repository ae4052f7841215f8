//! Fuzz harness: arbitrary bytes as a worker's KV events — event-plane frames decoded as
//! `KvEvents` (a payload that is not a frame is decoded whole) — applied in order to the
//! router's index with a small per-worker bound (so eviction runs too); after every event the
//! index's invariants hold, and lookups of the stored blocks' hashes and a worker's removal
//! keep them.

use kvx_proto::hashing::LocalBlockHash;
use kvx_proto::plane::KvEvents;
use kvx_proto::{KvEventData, wire};
use kvx_router::{IndexConfig, KvIndex, OverlapScores};

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut batches = Vec::new();
    let mut off = 0;
    while off < data.len() && batches.len() < 64 {
        match wire::split(&data[off..], 1 << 20) {
            Ok((_, payload, used)) => {
                if let Ok(b) = wire::decode::<KvEvents>(payload) {
                    batches.push(b);
                }
                off += used;
            }
            Err(_) => {
                if let Ok(b) = wire::decode::<KvEvents>(&data[off..]) {
                    batches.push(b);
                }
                break;
            }
        }
    }
    let mut index = KvIndex::new(IndexConfig { max_blocks_per_worker: 32 });
    let mut scores = OverlapScores::new();
    let mut locals: Vec<LocalBlockHash> = Vec::new();
    for ev in batches.iter().flat_map(|b| b.events.iter()).take(4096) {
        let _ = index.apply(ev);
        if let Err(e) = index.check_invariants() {
            panic!("index invariants broken after {ev:?}: {e}");
        }
        if let KvEventData::Stored { blocks, .. } = &ev.data {
            locals.clear();
            locals.extend(blocks.iter().map(|b| b.local_hash));
            index.find_matches(&locals, &mut scores);
            assert!(scores.iter().all(|o| o.blocks as usize <= locals.len()));
        }
    }
    if let Some(w) = batches.iter().flat_map(|b| b.events.iter()).map(|e| e.worker_id).next() {
        index.remove_worker(w);
        if let Err(e) = index.check_invariants() {
            panic!("index invariants broken after removing worker {w:?}: {e}");
        }
    }
}
