//! Disaggregated serving in the in-process plane, over mock engines with a modelled KV link:
//! the decision, the two legs, and what happens when the prefill side fails.

mod common;

use std::time::Duration;

use common::{BS, End, collect_blocking, mock_roles, request, wait_until};
use kvx_ingress::Dispatcher;
use kvx_planes::{DisaggConfig, LocalPlane};
use kvx_proto::FinishReason;
use kvx_proto::plane::WorkerRole::{Decode, Prefill};
use kvx_router::RouterConfig;

const LONG: Duration = Duration::from_secs(20);

fn plane(roles: &[kvx_proto::plane::WorkerRole], disagg: DisaggConfig) -> LocalPlane {
    let cfg = RouterConfig { block_size: BS, ..RouterConfig::default() };
    LocalPlane::with_disagg(mock_roles(roles, 1, 50.0), cfg, disagg).expect("plane")
}

fn metric(p: &LocalPlane, name: &str) -> f64 {
    p.router_metrics().into_iter().find(|(k, _)| *k == name).map_or(f64::NAN, |(_, v)| v)
}

#[test]
fn long_prompts_are_prefilled_remotely_and_short_ones_locally() {
    let p = plane(&[Prefill, Decode], DisaggConfig { min_tokens: 64, ..DisaggConfig::default() });
    let mut rx = p.submit(request(1, 3, 200, 8)).expect("submit");
    let (tokens, end) = collect_blocking(&mut rx, LONG);
    assert_eq!((tokens.len(), end), (8, End::Finished(FinishReason::Length)));
    let mut rx = p.submit(request(2, 4, 20, 8)).expect("submit");
    assert_eq!(collect_blocking(&mut rx, LONG).0.len(), 8);
    assert_eq!(metric(&p, "disagg_remote_prefills_total"), 1.0);
    assert_eq!(metric(&p, "disagg_local_prefills_short_total"), 1.0);
    assert!(metric(&p, "kv_transfer_bytes_total") > 0.0);
    // The prefill shard computed the long prompt (all but its last token); the decode shard
    // only its last token and the generated ones.
    let ws = p.workers();
    assert_eq!(ws[0].metrics.prefill_tokens, 199);
    assert_eq!(ws[0].metrics.generated_tokens, 0);
    assert_eq!(ws[1].metrics.generated_tokens, 16);
    wait_until("both routers to free their requests", || p.with_router(|r| r.tracker().is_empty()));
    wait_until("the prefill shard's blocks to return", || {
        p.shards()[0].shard.status().load.active_blocks == 0
    });
}

#[test]
fn a_prompt_the_decode_shard_holds_is_not_moved() {
    let p = plane(&[Prefill, Decode], DisaggConfig { min_tokens: 0, ..DisaggConfig::default() });
    // Eight full blocks and one token: the KV of the eight blocks moves.
    let len = 8 * BS as u32 + 1;
    let mut rx = p.submit(request(1, 5, len, 2)).expect("submit");
    collect_blocking(&mut rx, LONG);
    let moved = metric(&p, "kv_transfer_bytes_total");
    assert_eq!(metric(&p, "disagg_remote_prefills_total"), 1.0);
    wait_until("the decode shard's blocks in the index", || {
        p.with_router(|r| r.index_stats().blocks >= 8)
    });
    // The same prompt again: the decode shard holds every block the prefill would send.
    let mut rx = p.submit(request(2, 5, len, 2)).expect("submit");
    assert_eq!(collect_blocking(&mut rx, LONG).0.len(), 2);
    assert_eq!(metric(&p, "disagg_local_prefills_cached_total"), 1.0);
    assert_eq!(metric(&p, "kv_transfer_bytes_total"), moved, "nothing moved again");
}

#[test]
fn a_dead_prefill_shard_leaves_the_prompt_to_the_decode_shard() {
    let p = plane(&[Prefill, Decode], DisaggConfig { min_tokens: 0, ..DisaggConfig::default() });
    p.shards()[0].shard.begin_shutdown(Duration::ZERO);
    wait_until("the prefill shard to stop", || !p.shards()[0].shard.is_alive());
    let mut rx = p.submit(request(1, 3, 100, 5)).expect("submit");
    let (tokens, end) = collect_blocking(&mut rx, LONG);
    assert_eq!((tokens.len(), end), (5, End::Finished(FinishReason::Length)));
    assert_eq!(metric(&p, "disagg_local_prefills_busy_total"), 1.0);
}

#[test]
fn a_prefill_that_times_out_is_computed_by_the_decode_shard() {
    // Two prefill shards so slow that their prefill outlasts the timeout.
    let cfg = RouterConfig { block_size: BS, ..RouterConfig::default() };
    let disagg = DisaggConfig {
        min_tokens: 0,
        prefill_timeout: Duration::from_millis(30),
        ..DisaggConfig::default()
    };
    let started = mock_roles(&[Prefill, Decode], 1, 0.05);
    let p = LocalPlane::with_disagg(started, cfg, disagg).expect("plane");
    let mut rx = p.submit(request(1, 3, 2000, 3)).expect("submit");
    let (tokens, end) = collect_blocking(&mut rx, Duration::from_secs(120));
    assert_eq!((tokens.len(), end), (3, End::Finished(FinishReason::Length)));
    assert_eq!(metric(&p, "disagg_fallbacks_total"), 1.0);
    assert_eq!(metric(&p, "disagg_remote_prefills_total"), 0.0);
    wait_until("the prefill shard to drop the cancelled leg", || {
        p.shards()[0].shard.status().requests == 0
    });
}

#[test]
fn a_client_that_goes_away_cancels_both_legs() {
    let p = plane(&[Prefill, Decode], DisaggConfig { min_tokens: 0, ..DisaggConfig::default() });
    let rx = p.submit(request(1, 3, 1500, 2000)).expect("submit");
    wait_until("the decode leg to start", || p.shards()[1].shard.status().requests == 1);
    drop(rx);
    wait_until("both shards to drop the request", || {
        p.shards().iter().all(|h| h.shard.status().requests == 0)
    });
}

#[test]
fn the_final_usage_says_how_long_the_kv_took_to_move() {
    let p = plane(&[Prefill, Decode], DisaggConfig { min_tokens: 64, ..DisaggConfig::default() });
    let usage_of = |id, len| {
        let mut rx = p.submit(request(id, id as u32, len, 3)).expect("submit");
        loop {
            match rx.blocking_recv().expect("an end") {
                kvx_proto::Output::Finished { usage, .. } => return usage,
                kvx_proto::Output::Error { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
    };
    assert!(usage_of(1, 300).kv_transfer_us > 0, "prefilled remotely");
    assert_eq!(usage_of(2, 20).kv_transfer_us, 0, "prefilled where it decoded");
}
