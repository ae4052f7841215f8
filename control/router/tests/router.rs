//! The router end to end: the documented cost example, KV preference, tier credits, load
//! reports, every selection mode's properties, request accounting, events and metrics.

use std::collections::BTreeMap;
use std::time::Duration;

use kvx_proto::{
    KvEvent, KvEventData, LoadReport, RequestId, StorageTier, StoredBlock, WorkerId, XXH3_SEED,
};
use kvx_router::{
    ApplyResult, ConfigError, LoadMetric, RequestBlocks, RouteError, Router, RouterConfig,
    RoutingMode, SnapshotBlock, TierCredits,
};
use proptest::prelude::*;

const BS: usize = 16;
const T0: Duration = Duration::ZERO;

fn router(mode: RoutingMode) -> Router {
    Router::new(RouterConfig { mode, block_size: BS, ..RouterConfig::default() }).unwrap()
}

fn with_workers(mut r: Router, ids: &[WorkerId]) -> Router {
    for &w in ids {
        assert!(r.add_worker(w));
    }
    r
}

/// A prompt of `blocks` full blocks whose content is determined by `base`.
fn prompt(base: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS as u32).map(|i| base.wrapping_mul(1_000_003).wrapping_add(i)).collect()
}

fn req(tokens: &[u32]) -> RequestBlocks {
    RequestBlocks::from_tokens(tokens, BS, XXH3_SEED)
}

/// The worker stores the first `n` blocks of `r` (in `tier`) as event `id`.
fn store(
    r: &mut Router,
    worker: WorkerId,
    id: u64,
    tier: StorageTier,
    rb: &RequestBlocks,
    n: usize,
) {
    let blocks = rb.locals()[..n]
        .iter()
        .zip(&rb.seqs()[..n])
        .map(|(&local_hash, &seq_hash)| StoredBlock { seq_hash, local_hash })
        .collect();
    let ev = KvEvent {
        worker_id: worker,
        event_id: id,
        tier,
        data: KvEventData::Stored { parent: None, blocks },
    };
    assert_eq!(r.apply_event(&ev), ApplyResult::Applied);
}

#[test]
fn documented_cost_example() {
    // Dynamo's worked example: (prefill, decode) blocks (8,10), (5,5), (2,9) cost 18, 10, 11
    // with weight 1, and the second worker wins. Built here with a 5-block request.
    let mut r = with_workers(router(RoutingMode::Kv), &[0, 1, 2]);
    r.add_worker(3);
    r.remove_worker(3);
    let q = req(&prompt(1, 5));
    // Worker 0: 3 blocks of prefill in flight (a 5-block request with 2 cached), 5 active.
    r.add_request(RequestId(100), 0, &req(&prompt(2, 5)), 2, T0).unwrap();
    // Worker 2: 3 of the request's blocks cached; 4 other blocks active, prefill done.
    store(&mut r, 2, 1, StorageTier::Device, &q, 3);
    r.add_request(RequestId(101), 2, &req(&prompt(3, 4)), 0, T0).unwrap();
    assert!(r.mark_prefill_done(RequestId(101)));
    let loads = r.potential_loads(&q);
    let terms: Vec<(f64, f64, f64)> =
        loads.iter().map(|l| (l.prefill_blocks, l.decode_blocks, l.cost)).collect();
    assert_eq!(terms, vec![(8.0, 10.0, 18.0), (5.0, 5.0, 10.0), (2.0, 9.0, 11.0)]);
    let d = r.select(&q).unwrap();
    assert_eq!((d.worker, d.overlap_blocks, d.cost), (1, 0, 10.0));
    // Weight 2 doubles the prefill terms: 26, 15, 13: the cache wins.
    let mut cfg = r.config().clone();
    cfg.overlap_weight = 2.0;
    let mut r2 = with_workers(Router::new(cfg).unwrap(), &[0, 1, 2]);
    r2.add_request(RequestId(100), 0, &req(&prompt(2, 5)), 2, T0).unwrap();
    store(&mut r2, 2, 1, StorageTier::Device, &q, 3);
    r2.add_request(RequestId(101), 2, &req(&prompt(3, 4)), 0, T0).unwrap();
    r2.mark_prefill_done(RequestId(101));
    let d = r2.select(&q).unwrap();
    assert_eq!((d.worker, d.overlap_blocks, d.cost, d.prefill_tokens), (2, 3, 13.0, 2 * 16));
}

#[test]
fn kv_mode_prefers_the_cache_until_load_outweighs_it() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1, 2, 3]);
    let p = prompt(7, 8);
    let q = req(&p);
    store(&mut r, 2, 1, StorageTier::Device, &q, 8);
    let d = r.route(RequestId(1), &q, T0).unwrap();
    assert_eq!((d.worker, d.overlap_blocks, d.prefill_tokens), (2, 8, 0));
    // The same prompt again: its blocks are already active on worker 2 and cost nothing new.
    let loads = r.potential_loads(&q);
    assert_eq!(loads[1].decode_blocks, 8.0);
    assert_eq!(r.route(RequestId(2), &q, T0).unwrap().worker, 2);
    // Heavy unrelated load on worker 2 sends the next one elsewhere.
    r.add_request(RequestId(3), 2, &req(&prompt(8, 40)), 0, T0).unwrap();
    assert_ne!(r.select(&q).unwrap().worker, 2);
    // A partial trailing block is its own block.
    let mut p2 = p.clone();
    p2.extend([1, 2, 3]);
    let q2 = req(&p2);
    assert_eq!(q2.total_blocks(BS), 9);
    assert_eq!(q2.seqs().len(), 8);
}

#[test]
fn a_cached_prefix_on_a_full_worker_loses_to_room_elsewhere() {
    let report = |worker_id, active_blocks| LoadReport {
        worker_id,
        active_blocks,
        total_blocks: 64,
        free_blocks: 64 - active_blocks,
        ..LoadReport::default()
    };
    let q = req(&prompt(5, 20));
    for penalty in [true, false] {
        let cfg = RouterConfig {
            block_size: BS,
            overlap_weight: 4.0,
            room_penalty: penalty,
            ..RouterConfig::default()
        };
        let mut r = with_workers(Router::new(cfg).unwrap(), &[1, 2]);
        // Worker 1 caches the whole prompt, but its active blocks leave room for only 10 of
        // the 20 it would take; worker 2 is idle.
        store(&mut r, 1, 1, StorageTier::Device, &q, 20);
        assert!(r.apply_load(&report(1, 54)));
        assert!(r.apply_load(&report(2, 0)));
        let loads = r.potential_loads(&q);
        // Worker 1: 4·(0 + 20) + 54 + 20 with the penalty; worker 2: 4·20 + 20.
        let want = if penalty { 154.0 } else { 74.0 };
        assert_eq!((loads[0].cost, loads[1].cost), (want, 100.0));
        assert_eq!(r.select(&q).unwrap().worker, if penalty { 2 } else { 1 });
        // With room on worker 1 the cache wins again.
        assert!(r.apply_load(&report(1, 40)));
        assert_eq!(r.select(&q).unwrap().worker, 1);
    }
}

#[test]
fn tier_credits_weigh_cached_blocks() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1, 2, 3, 4]);
    let q = req(&prompt(3, 8));
    store(&mut r, 1, 1, StorageTier::Device, &q, 8);
    store(&mut r, 2, 1, StorageTier::Host, &q, 8);
    store(&mut r, 3, 1, StorageTier::Disk, &q, 8);
    let loads = r.potential_loads(&q);
    let prefill: Vec<f64> = loads.iter().map(|l| l.prefill_blocks).collect();
    let c = TierCredits::default();
    let want = [0.0, 8.0 - 8.0 * c.host, 8.0 - 8.0 * c.disk, 8.0];
    assert!(prefill.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-9), "{prefill:?} vs {want:?}");
    assert_eq!(loads[1].overlap_by_tier, [0, 8, 0, 0]);
    assert_eq!(r.select(&q).unwrap().worker, 1);
    // With no device copy, host beats disk.
    r.remove_worker(1);
    assert_eq!(r.select(&q).unwrap().worker, 2);
    // Custom credits.
    let cfg = RouterConfig {
        tier_credit: TierCredits { device: 1.0, host: 0.0, disk: 1.0, remote: 0.0 },
        ..r.config().clone()
    };
    let mut r = with_workers(Router::new(cfg).unwrap(), &[2, 3]);
    store(&mut r, 2, 1, StorageTier::Host, &q, 8);
    store(&mut r, 3, 1, StorageTier::Disk, &q, 8);
    assert_eq!(r.select(&q).unwrap().worker, 3);
}

#[test]
fn load_reports_raise_predicted_load() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1, 2]);
    let q = req(&prompt(1, 4));
    let report = LoadReport {
        worker_id: 1,
        active_blocks: 100,
        queued_prefill_tokens: 160,
        ..Default::default()
    };
    assert!(r.apply_load(&report));
    assert!(!r.apply_load(&LoadReport { worker_id: 9, ..Default::default() }));
    let loads = r.potential_loads(&q);
    assert_eq!((loads[0].prefill_blocks, loads[0].decode_blocks), (14.0, 104.0));
    assert_eq!(r.select(&q).unwrap().worker, 2);
    let mut cfg = r.config().clone();
    cfg.use_load_reports = false;
    let mut r = with_workers(Router::new(cfg).unwrap(), &[1, 2]);
    r.apply_load(&report);
    assert_eq!(r.potential_loads(&q)[0].decode_blocks, 4.0);
    assert_eq!(r.metrics().load_reports, 1);
}

#[test]
fn ties_break_uniformly() {
    let mut r = with_workers(router(RoutingMode::Kv), &[10, 20, 30, 40]);
    let q = req(&prompt(1, 4));
    let mut hits = BTreeMap::new();
    for _ in 0..20_000 {
        *hits.entry(r.select(&q).unwrap().worker).or_insert(0i64) += 1;
    }
    assert_eq!(hits.len(), 4);
    assert!(hits.values().all(|&h| (h - 5000).abs() < 350), "{hits:?}");
}

#[test]
fn temperature_spreads_choices_over_costs() {
    let mk = |temperature| {
        let cfg = RouterConfig { temperature, block_size: BS, ..RouterConfig::default() };
        let mut r = with_workers(Router::new(cfg).unwrap(), &[1, 2, 3]);
        let q = req(&prompt(5, 8));
        store(&mut r, 1, 1, StorageTier::Device, &q, 8);
        store(&mut r, 2, 1, StorageTier::Device, &q, 4);
        let mut hits = [0u32; 3];
        for _ in 0..3000 {
            hits[r.select(&q).unwrap().worker as usize - 1] += 1;
        }
        hits
    };
    assert_eq!(mk(0.0), [3000, 0, 0]);
    let warm = mk(1.0);
    assert!(warm[0] > warm[1] && warm[1] > warm[2] && warm[2] > 0, "{warm:?}");
    let hot = mk(100.0);
    assert!(hot.iter().all(|&h| h > 900), "{hot:?}");
}

#[test]
fn round_robin_cycles_in_id_order() {
    let mut r = with_workers(router(RoutingMode::RoundRobin), &[5, 3, 9]);
    let q = req(&prompt(1, 2));
    let picks: Vec<WorkerId> = (0..7).map(|_| r.select(&q).unwrap().worker).collect();
    assert_eq!(picks, vec![3, 5, 9, 3, 5, 9, 3]);
    // Membership changes keep it cycling over the current set.
    r.add_worker(4);
    let picks: Vec<WorkerId> = (0..8).map(|_| r.select(&q).unwrap().worker).collect();
    let mut counts = BTreeMap::new();
    for p in &picks {
        *counts.entry(*p).or_insert(0) += 1;
    }
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![2, 2, 2, 2]);
}

#[test]
fn random_mode_reaches_every_worker() {
    let mut r = with_workers(router(RoutingMode::Random), &[1, 2, 3, 4, 5]);
    let q = req(&prompt(1, 2));
    let mut hits = BTreeMap::new();
    for _ in 0..10_000 {
        *hits.entry(r.select(&q).unwrap().worker).or_insert(0i64) += 1;
    }
    assert!(hits.values().all(|&h| (h - 2000).abs() < 250), "{hits:?}");
}

#[test]
fn least_loaded_by_blocks_or_requests() {
    let mut r = with_workers(router(RoutingMode::LeastLoaded), &[1, 2, 3]);
    r.add_request(RequestId(1), 1, &req(&prompt(1, 10)), 0, T0).unwrap();
    r.add_request(RequestId(2), 2, &req(&prompt(2, 2)), 0, T0).unwrap();
    r.add_request(RequestId(3), 2, &req(&prompt(3, 2)), 0, T0).unwrap();
    r.add_request(RequestId(4), 3, &req(&prompt(4, 6)), 0, T0).unwrap();
    let q = req(&prompt(9, 3));
    assert_eq!(r.select(&q).unwrap().worker, 2, "4 blocks < 6 < 10");
    let cfg = RouterConfig { least_loaded_by: LoadMetric::ActiveRequests, ..r.config().clone() };
    let mut r2 = with_workers(Router::new(cfg).unwrap(), &[1, 2, 3]);
    r2.add_request(RequestId(1), 1, &req(&prompt(1, 10)), 0, T0).unwrap();
    r2.add_request(RequestId(2), 2, &req(&prompt(2, 2)), 0, T0).unwrap();
    r2.add_request(RequestId(3), 2, &req(&prompt(3, 2)), 0, T0).unwrap();
    let picks: Vec<WorkerId> = (0..50).map(|_| r2.select(&q).unwrap().worker).collect();
    assert!(picks.iter().all(|&w| w == 3), "the idle worker");
}

#[test]
fn requests_are_accounted_and_released() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1]);
    let q = req(&prompt(1, 4));
    assert_eq!(r.route(RequestId(1), &q, T0).unwrap().worker, 1);
    assert_eq!(r.route(RequestId(1), &q, T0), Err(RouteError::DuplicateRequest(RequestId(1))));
    let l = r.load(1).unwrap();
    assert_eq!((l.active_blocks, l.prefill_tokens, l.requests), (4, 64, 1));
    r.route(RequestId(2), &q, T0).unwrap();
    assert_eq!(r.load(1).unwrap().active_blocks, 4, "shared blocks count once");
    assert!(r.mark_prefill_done(RequestId(1)));
    assert_eq!(r.load(1).unwrap().prefill_tokens, 64);
    assert_eq!(r.free(RequestId(1)), Some(1));
    assert_eq!(r.free(RequestId(1)), None);
    assert_eq!(r.free(RequestId(2)), Some(1));
    assert_eq!(r.load(1).unwrap(), Default::default());
    assert_eq!(r.load(7), None);
    assert_eq!(r.add_request(RequestId(3), 7, &q, 0, T0), Err(RouteError::UnknownWorker(7)));
    // Expiry.
    r.route(RequestId(4), &q, Duration::from_secs(10)).unwrap();
    assert_eq!(r.expire(Duration::from_secs(300)), vec![]);
    assert_eq!(r.expire(Duration::from_secs(311)), vec![RequestId(4)]);
    assert_eq!(r.metrics().expired_requests, 1);
    // Removing a worker hands back its requests.
    r.route(RequestId(5), &q, T0).unwrap();
    assert_eq!(r.remove_worker(1), Some(vec![RequestId(5)]));
    assert_eq!(r.remove_worker(1), None);
    assert_eq!(r.select(&q), Err(RouteError::NoWorkers));
    assert!(r.tracker().is_empty());
    // A bounded tracker.
    let cfg = RouterConfig { max_requests: 1, ..RouterConfig::default() };
    let mut r = with_workers(Router::new(cfg).unwrap(), &[1]);
    r.route(RequestId(1), &q, T0).unwrap();
    assert_eq!(r.route(RequestId(2), &q, T0), Err(RouteError::TooManyRequests { limit: 1 }));
}

#[test]
fn events_are_gated_by_registration_and_resynced() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1]);
    let q = req(&prompt(1, 4));
    let ev = |worker, event_id| KvEvent {
        worker_id: worker,
        event_id,
        tier: StorageTier::Device,
        data: KvEventData::Cleared,
    };
    assert_eq!(r.apply_event(&ev(2, 1)), ApplyResult::UnknownWorker { worker: 2 });
    assert_eq!(r.metrics().events_unknown_worker, 1);
    assert!(r.apply_event(&ev(1, 3)).needs_resync());
    assert_eq!(r.workers_needing_resync(), vec![1]);
    let snap: Vec<SnapshotBlock> = (0..4)
        .map(|i| SnapshotBlock {
            tier: StorageTier::Device,
            parent: (i > 0).then(|| q.seqs()[i - 1]),
            block: StoredBlock { seq_hash: q.seqs()[i], local_hash: q.locals()[i] },
        })
        .collect();
    assert_eq!(r.resync(1, 3, &snap).unwrap().stored, 4);
    assert!(r.workers_needing_resync().is_empty());
    assert_eq!(r.resync(2, 3, &snap), Err(RouteError::UnknownWorker(2)));
    assert_eq!(r.select(&q).unwrap().overlap_blocks, 4);
    assert_eq!(r.index_stats().nodes, 4);
    assert_eq!(r.apply_event(&ev(1, 4)), ApplyResult::Applied);
    assert_eq!(r.select(&q).unwrap().overlap_blocks, 0);
}

#[test]
fn salt_separates_caches() {
    let mut r = with_workers(router(RoutingMode::Kv), &[1, 2]);
    let p = prompt(4, 4);
    let plain = r.request_blocks(&p, None, None);
    let salted = r.request_blocks(&p, Some("tenant"), None);
    assert_eq!(plain, req(&p));
    assert_ne!(plain.locals(), salted.locals());
    store(&mut r, 2, 1, StorageTier::Device, &salted, 4);
    assert_eq!(r.select(&salted).unwrap().worker, 2);
    assert_eq!(r.select(&plain).unwrap().overlap_blocks, 0);
}

#[test]
fn metrics_count_hits() {
    let mut r = with_workers(router(RoutingMode::RoundRobin), &[1, 2]);
    let q = req(&prompt(1, 4));
    store(&mut r, 1, 1, StorageTier::Host, &q, 4);
    r.select(&q).unwrap();
    r.select(&q).unwrap();
    let m = r.metrics();
    assert_eq!((m.decisions, m.requested_blocks, m.cached_blocks), (2, 8, 4));
    assert_eq!(m.cached_blocks_by_tier, [0, 4, 0, 0]);
    assert_eq!(m.hit_rate(), 0.5);
    assert_eq!(m.overlap_per_decision(), 2.0);
    r.record_decision_latency(Duration::from_micros(3));
    assert_eq!(r.metrics().decision_latency.count(), 1);
}

#[test]
fn config_is_validated() {
    let bad = |f: fn(&mut RouterConfig)| {
        let mut c = RouterConfig::default();
        f(&mut c);
        Router::new(c).err()
    };
    assert_eq!(bad(|c| c.block_size = 0), Some(ConfigError::BlockSize));
    assert!(matches!(
        bad(|c| c.temperature = -1.0),
        Some(ConfigError::OutOfRange { name: "temperature", .. })
    ));
    assert!(matches!(bad(|c| c.overlap_weight = f64::NAN), Some(ConfigError::OutOfRange { .. })));
    assert!(matches!(bad(|c| c.tier_credit.host = 1.5), Some(ConfigError::OutOfRange { .. })));
    assert!(bad(|_| {}).is_none());
}

#[test]
fn same_seed_same_decisions() {
    let run = || {
        let cfg = RouterConfig { temperature: 0.7, ..RouterConfig::default() };
        let mut r = with_workers(Router::new(cfg).unwrap(), &[1, 2, 3, 4]);
        (0..200u32)
            .map(|i| {
                r.route(RequestId(i as u64), &req(&prompt(i % 7, 1 + i % 5)), T0).unwrap().worker
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}

#[derive(Debug, Clone)]
enum ReqOp {
    Route { id: u64, base: u32, blocks: u32 },
    Done { id: u64 },
    Free { id: u64 },
    Store { worker: WorkerId, base: u32, blocks: u32 },
}

fn req_op() -> impl Strategy<Value = ReqOp> {
    prop_oneof![
        4 => (0..30u64, 0..4u32, 0..6u32).prop_map(|(id, base, blocks)| ReqOp::Route { id, base, blocks }),
        2 => (0..30u64).prop_map(|id| ReqOp::Done { id }),
        3 => (0..30u64).prop_map(|id| ReqOp::Free { id }),
        1 => (1..4u64, 0..4u32, 1..6u32).prop_map(|(worker, base, blocks)| ReqOp::Store { worker, base, blocks }),
    ]
}

proptest! {
    /// KV mode at temperature 0 picks a worker of least cost; every mode's accounting stays
    /// consistent and returns to zero.
    #[test]
    fn selection_and_accounting(ops in prop::collection::vec(req_op(), 1..80), mode in 0..4u8) {
        let mode = [RoutingMode::Kv, RoutingMode::RoundRobin, RoutingMode::Random, RoutingMode::LeastLoaded][mode as usize];
        let mut r = with_workers(router(mode), &[1, 2, 3]);
        let mut event_ids = BTreeMap::new();
        for op in ops {
            match op {
                ReqOp::Route { id, base, blocks } => {
                    let q = req(&prompt(base, blocks));
                    let loads = r.potential_loads(&q);
                    match r.route(RequestId(id), &q, T0) {
                        Ok(d) => {
                            let chosen = loads.iter().find(|l| l.worker == d.worker).unwrap();
                            prop_assert_eq!(chosen.cost, d.cost);
                            prop_assert_eq!(chosen.overlap_blocks, d.overlap_blocks);
                            match mode {
                                RoutingMode::Kv => {
                                    let min = loads.iter().map(|l| l.cost).fold(f64::INFINITY, f64::min);
                                    prop_assert_eq!(d.cost, min);
                                }
                                RoutingMode::LeastLoaded => {
                                    let min = loads.iter().map(|l| l.active_blocks).min().unwrap();
                                    prop_assert_eq!(chosen.active_blocks, min);
                                }
                                _ => {}
                            }
                        }
                        Err(e) => prop_assert_eq!(e, RouteError::DuplicateRequest(RequestId(id))),
                    }
                }
                ReqOp::Done { id } => { r.mark_prefill_done(RequestId(id)); }
                ReqOp::Free { id } => { r.free(RequestId(id)); }
                ReqOp::Store { worker, base, blocks } => {
                    let q = req(&prompt(base, blocks));
                    let id = event_ids.entry(worker).or_insert(0u64);
                    *id += 1;
                    store(&mut r, worker, *id, StorageTier::Device, &q, blocks as usize);
                }
            }
            r.tracker().check_invariants().map_err(TestCaseError::fail)?;
        }
        for id in 0..30 {
            r.free(RequestId(id));
        }
        for w in 1..4 {
            prop_assert_eq!(r.load(w).unwrap(), Default::default());
        }
    }
}

#[test]
fn router_moves_between_threads() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<Router>();
    assert_send::<kvx_router::KvIndex>();
}
