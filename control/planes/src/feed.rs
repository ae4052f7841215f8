//! The router feed: what both planes do with what workers report. KV events go into the
//! index (an event id gap marks the worker for a resync), snapshots rebuild a worker's part
//! of the index, loads correct the router's predictions, and once a second requests older
//! than the router's TTL expire and workers that lost events are asked for snapshots.

use std::time::Duration;

use kvx_proto::{KvEvent, RequestId, SequenceHash, StorageTier, StoredBlock, WorkerId};
use kvx_router::{ApplyResult, RequestBlocks, Router, SnapshotBlock};

/// How often the planes expire requests and ask for snapshots.
pub const MAINTENANCE_PERIOD: Duration = Duration::from_secs(1);

/// Applies a KV event; returns the worker to resync when the event reveals a gap.
pub fn apply_kv(r: &mut Router, ev: &KvEvent) -> Option<WorkerId> {
    match r.apply_event(ev) {
        ApplyResult::Gap { worker, .. } => Some(worker),
        _ => None,
    }
}

/// Rebuilds a worker's part of the index from its snapshot taken after event
/// `last_event_id`: the blocks of its pool (`(parent, block)`, parents first) and those of
/// its lower tiers (`(tier, parent, block)`).
pub fn resync_from(
    r: &mut Router,
    worker: WorkerId,
    last_event_id: u64,
    blocks: Vec<(Option<SequenceHash>, StoredBlock)>,
    lower: Vec<(StorageTier, Option<SequenceHash>, StoredBlock)>,
) {
    let blocks: Vec<SnapshotBlock> = blocks
        .into_iter()
        .map(|(parent, block)| (StorageTier::Device, parent, block))
        .chain(lower)
        .map(|(tier, parent, block)| SnapshotBlock { tier, parent, block })
        .collect();
    if let Err(e) = r.resync(worker, last_event_id, &blocks) {
        tracing::warn!(worker, error = %e, "resync failed");
    }
}

/// The periodic upkeep at `now`: expires requests past the TTL; returns the workers to ask
/// for a snapshot (sorted, each once).
pub fn maintain(r: &mut Router, now: Duration) -> Vec<WorkerId> {
    let expired = r.expire(now);
    if !expired.is_empty() {
        tracing::debug!(requests = expired.len(), "requests expired from the router");
    }
    let mut w = r.workers_needing_resync();
    w.sort_unstable();
    w.dedup();
    w
}

/// Picks the lowest-cost worker for `req` that is not in `exclude` and is `alive`, and
/// tracks request `id` on it.
pub fn pick(
    r: &mut Router,
    id: RequestId,
    req: &RequestBlocks,
    exclude: &[WorkerId],
    alive: impl Fn(WorkerId) -> bool,
    now: Duration,
) -> Option<WorkerId> {
    let mut loads = r.potential_loads(req);
    loads.sort_by(|a, b| a.cost.total_cmp(&b.cost));
    let p = loads.into_iter().find(|p| !exclude.contains(&p.worker) && alive(p.worker))?;
    r.free(id);
    let _ = r.add_request(id, p.worker, req, p.overlap_blocks, now);
    Some(p.worker)
}

/// The router's counters as `/metrics` shows them.
pub fn router_metrics(r: &Router) -> Vec<(&'static str, f64)> {
    let m = r.metrics();
    let idx = r.index_stats();
    vec![
        ("router_decisions_total", m.decisions as f64),
        ("router_hit_rate", m.hit_rate()),
        ("router_overlap_blocks_per_decision", m.overlap_per_decision()),
        ("router_index_blocks", idx.blocks as f64),
        ("router_index_nodes", idx.nodes as f64),
        (
            "router_decision_latency_p50_us",
            m.decision_latency.quantile_upper_us(0.5).unwrap_or(0) as f64,
        ),
        (
            "router_decision_latency_p99_us",
            m.decision_latency.quantile_upper_us(0.99).unwrap_or(0) as f64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use kvx_proto::{KvEventData, LocalBlockHash};
    use kvx_router::RouterConfig;

    use super::*;

    fn block(h: u64) -> StoredBlock {
        StoredBlock { seq_hash: SequenceHash(h), local_hash: LocalBlockHash(h) }
    }

    fn stored(worker: WorkerId, event_id: u64, seq: u64) -> KvEvent {
        KvEvent {
            worker_id: worker,
            event_id,
            tier: StorageTier::Device,
            data: KvEventData::Stored { parent: None, blocks: vec![block(seq)] },
        }
    }

    #[test]
    fn a_gap_in_event_ids_asks_for_a_resync_and_a_snapshot_clears_it() {
        let mut r = Router::new(RouterConfig::default()).expect("router");
        r.add_worker(7);
        assert_eq!(apply_kv(&mut r, &stored(7, 1, 11)), None);
        assert_eq!(apply_kv(&mut r, &stored(7, 3, 12)), Some(7));
        assert_eq!(maintain(&mut r, Duration::ZERO), vec![7]);
        resync_from(
            &mut r,
            7,
            3,
            vec![(None, block(11))],
            vec![(StorageTier::Disk, None, block(9))],
        );
        assert!(maintain(&mut r, Duration::ZERO).is_empty());
        assert_eq!(apply_kv(&mut r, &stored(7, 4, 13)), None);
    }
}
