//! The in-process plane over mock engine shards: routing, the router feed, cancellation and
//! shards that stop.

mod common;

use std::time::Duration;

use common::{BS, End, collect_blocking, mock_shards, request, wait_until};
use kvx_ingress::{DispatchError, Dispatcher};
use kvx_planes::LocalPlane;
use kvx_proto::{FinishReason, LoadReport, RequestId};
use kvx_router::RouterConfig;
use kvx_worker::output_channel;

fn plane(n: usize, speedup: f64) -> LocalPlane {
    let cfg = RouterConfig { block_size: BS, ..RouterConfig::default() };
    LocalPlane::new(mock_shards(n, 1, speedup), cfg).expect("plane")
}

const LONG: Duration = Duration::from_secs(20);

#[test]
fn a_request_streams_every_token_and_finishes() {
    let p = plane(2, 100.0);
    let mut rx = p.submit(request(1, 3, 40, 12)).expect("submit");
    let (tokens, end) = collect_blocking(&mut rx, LONG);
    assert_eq!(tokens.len(), 12);
    assert_eq!(end, End::Finished(FinishReason::Length));
    // The shard's notes free the request in the router.
    wait_until("the router to free the request", || p.with_router(|r| r.tracker().is_empty()));
}

#[test]
fn kv_events_fill_the_index_and_a_shared_prefix_follows_its_blocks() {
    let p = plane(2, 100.0);
    let mut rx = p.submit(request(1, 5, 8 * BS as u32, 2)).expect("submit");
    collect_blocking(&mut rx, LONG);
    let first = p.workers().into_iter().find(|w| w.metrics.finished == 1).expect("one ran it").id;
    // Its eight full prompt blocks reach the index through the feed thread.
    wait_until("the index to hold the prompt's blocks", || {
        p.with_router(|r| r.index_stats().blocks >= 8)
    });
    for id in 2..6 {
        let mut rx = p.submit(request(id, 5, 8 * BS as u32 + 3, 2)).expect("submit");
        assert_eq!(p.with_router(|r| r.tracker().worker_of(RequestId(id))), Some(first));
        collect_blocking(&mut rx, LONG);
    }
}

/// A periodic load report taken while a shard was busy must not steer a request away from
/// it once it is idle: the plane decides on the shards' current loads.
#[test]
fn routing_uses_the_shards_current_load_not_a_stale_report() {
    let p = plane(2, 1.0);
    // Shard 2 (worker 2) runs a request the router did not place.
    let (tx, mut running) = output_channel();
    p.shards()[1].shard.submit(request(1, 0, 64, 2000), tx).expect("submit");
    wait_until("shard 2 to start", || p.shards()[1].shard.status().load.active_blocks > 0);
    // The last periodic report of shard 1 was taken when it was full.
    let stale = LoadReport {
        worker_id: 1,
        active_seqs: 8,
        active_blocks: 200,
        free_blocks: 56,
        total_blocks: 256,
        ..Default::default()
    };
    assert!(p.with_router(|r| r.apply_load(&stale)));
    let _out = p.submit(request(2, 9, 64, 4)).expect("routed");
    assert_eq!(p.with_router(|r| r.tracker().worker_of(RequestId(2))), Some(1));
    p.cancel(RequestId(1));
    p.shutdown(Duration::ZERO);
    while running.try_recv().is_ok() {}
}

#[test]
fn cancel_ends_a_running_request_and_returns_its_blocks() {
    let p = plane(1, 1.0);
    let mut rx = p.submit(request(1, 1, 64, 3000)).expect("submit");
    wait_until("the request to start", || p.shards()[0].shard.status().load.active_blocks > 0);
    p.cancel(RequestId(1));
    let (_, end) = collect_blocking(&mut rx, LONG);
    assert!(matches!(end, End::Finished(FinishReason::Cancelled) | End::Closed), "{end:?}");
    wait_until("the shard to return the blocks", || {
        p.shards()[0].shard.status().load.active_blocks == 0
    });
    wait_until("the router to free it", || p.with_router(|r| r.tracker().is_empty()));
}

#[test]
fn a_client_that_goes_away_cancels_its_request() {
    let p = plane(1, 1.0);
    let rx = p.submit(request(1, 2, 64, 3000)).expect("submit");
    wait_until("the request to start", || p.shards()[0].shard.status().requests == 1);
    drop(rx);
    wait_until("the shard to drop the request", || {
        let st = p.shards()[0].shard.status();
        st.requests == 0 && st.load.active_blocks == 0
    });
}

#[test]
fn stopped_shards_make_the_plane_unavailable_not_stuck() {
    let p = plane(2, 100.0);
    assert!(p.ready());
    p.shutdown(Duration::ZERO);
    assert!(!p.ready());
    assert!(p.workers().iter().all(|w| !w.alive));
    match p.submit(request(1, 0, 32, 4)) {
        Err(DispatchError::Unavailable(m)) => assert!(m.contains("no worker"), "{m}"),
        other => panic!("expected Unavailable, got {:?}", other.map(|_| ())),
    }
    assert!(p.with_router(|r| r.tracker().is_empty()), "a refused request holds nothing");
}

#[test]
fn workers_report_their_counters_and_the_router_its_metrics() {
    let p = plane(2, 100.0);
    for id in 1..=4 {
        let mut rx = p.submit(request(id, id as u32 * 11, 20, 3)).expect("submit");
        collect_blocking(&mut rx, LONG);
    }
    wait_until("both shards' counters", || {
        p.workers().iter().map(|w| w.metrics.finished).sum::<u64>() == 4
    });
    let ws = p.workers();
    assert_eq!(ws.iter().map(|w| w.id).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(ws.iter().map(|w| w.metrics.generated_tokens).sum::<u64>(), 12);
    let m = p.router_metrics();
    let decisions = m.iter().find(|(k, _)| *k == "router_decisions_total").expect("decisions");
    assert_eq!(decisions.1, 4.0);
}

#[test]
fn a_dropped_kv_event_is_repaired_from_a_snapshot() {
    let p = plane(1, 100.0);
    let mut rx = p.submit(request(1, 4, 4 * BS as u32, 1)).expect("submit");
    collect_blocking(&mut rx, LONG);
    wait_until("the index to fill", || p.with_router(|r| r.index_stats().blocks >= 4));
    // Forget the worker's blocks as if its events had been lost, with a gap recorded.
    p.with_router(|r| {
        r.remove_worker(1);
        r.add_worker(1);
        let ev = kvx_proto::KvEvent {
            worker_id: 1,
            event_id: 1_000_000,
            tier: kvx_proto::StorageTier::Device,
            data: kvx_proto::KvEventData::Cleared,
        };
        assert!(r.apply_event(&ev).needs_resync());
        assert_eq!(r.index_stats().blocks, 0);
    });
    // The feed's upkeep asks the shard for a snapshot, which restores its blocks.
    wait_until("the snapshot to restore the blocks", || {
        p.with_router(|r| r.index_stats().blocks >= 4 && r.workers_needing_resync().is_empty())
    });
}
