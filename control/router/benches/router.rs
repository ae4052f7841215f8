//! Criterion benchmarks of the router at cluster scale (64 workers × 16 384 blocks ≈ 1 M):
//! event ingest into an empty index (1, 4 and 16 blocks per event, events interleaved across
//! workers), prefix matching and full selection, each beside the naive per-worker hash-set
//! index as the peer. Criterion reports means; `examples/bench.rs` prints percentiles.
//!
//! `cargo bench -p kvx-router --bench router -- <filter>`

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvx_router::{KvIndex, OverlapScores};

#[path = "support/workload.rs"]
mod workload;

use workload::{NaiveIndex, Workload, loaded};

const WORKERS: u64 = 64;
const BLOCKS_PER_WORKER: u64 = 16_384;

fn ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest");
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    for chunk in [1usize, 4, 16] {
        let wl = Workload::build(WORKERS, BLOCKS_PER_WORKER, chunk, 0, true, 42);
        g.throughput(Throughput::Elements(wl.events.len() as u64));
        g.bench_function(format!("kvx/{chunk}-block-events"), |b| {
            b.iter_batched(
                KvIndex::default,
                |mut ix| {
                    for ev in &wl.events {
                        black_box(ix.apply(ev));
                    }
                    ix
                },
                BatchSize::PerIteration,
            )
        });
        g.bench_function(format!("peer/{chunk}-block-events"), |b| {
            b.iter_batched(
                NaiveIndex::default,
                |mut ix| {
                    for ev in &wl.events {
                        ix.apply(black_box(ev));
                    }
                    ix
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

fn selection(c: &mut Criterion) {
    let mut wl = Workload::build(WORKERS, BLOCKS_PER_WORKER, 16, 0, true, 7);
    let (mut router, naive) = loaded(&mut wl, 2048, false);
    let reqs = wl.requests(4096);
    let mut g = c.benchmark_group("select");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("kvx/router-select", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            black_box(router.select(&reqs[i])).ok()
        })
    });
    let mut scores = OverlapScores::new();
    g.bench_function("kvx/find-matches", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            router.index().find_matches(black_box(reqs[i].locals()), &mut scores);
        })
    });
    let mut out = Vec::new();
    g.bench_function("peer/find-matches", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            naive.find_matches(black_box(reqs[i].seqs()), &mut out);
        })
    });
    g.finish();
}

criterion_group!(benches, ingest, selection);
criterion_main!(benches);
