//! Router benchmark with percentiles (criterion reports means): event ingest rate on one core,
//! selection latency p50/p99 with 1 M blocks across 64 workers, index memory; each against a
//! naive per-worker hash-set index in the same run, as ratios.
//!
//! Rates are given per wall second and per second on the CPU (the thread's run time from
//! `/proc/thread-self/schedstat`), since a shared machine takes the core away now and then.
//!
//! `cargo run --release -p kvx-router --example bench`

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // it measures wall time

use std::hint::black_box;
use std::time::Instant;

use kvx_proto::KvEventData;
use kvx_router::{KvIndex, OverlapScores};

#[path = "../benches/support/workload.rs"]
mod workload;

use workload::{NaiveIndex, Workload, loaded};

const WORKERS: u64 = 64;
const BLOCKS_PER_WORKER: u64 = 16_384;
const RUNS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This thread's time on the CPU, in seconds (0 where unavailable).
fn cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0.0, |ns| ns as f64 * 1e-9)
}

fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Wall and CPU seconds of `f`.
fn timed(f: impl FnOnce()) -> (f64, f64) {
    let (c, t) = (cpu_s(), Instant::now());
    f();
    (t.elapsed().as_secs_f64(), cpu_s() - c)
}

fn pct(sorted: &[u64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1000.0
}

fn latency_line(name: &str, ns: &mut [u64], cpu: f64) {
    ns.sort_unstable();
    println!(
        "{name:<26} p50 {:>6.2} µs  p90 {:>6.2}  p99 {:>6.2}  p99.9 {:>8.2}  max {:>8.2}  | mean on CPU {:>6.2} µs",
        pct(ns, 0.5),
        pct(ns, 0.9),
        pct(ns, 0.99),
        pct(ns, 0.999),
        pct(ns, 1.0),
        cpu * 1e6 / ns.len() as f64,
    );
}

/// Median rates (M/s) over `RUNS` of the index and the naive peer: fill (wall, cpu), churn
/// (wall, cpu), and the peer's fill and churn (cpu).
struct Rates {
    fill: (f64, f64),
    churn: (f64, f64),
    naive_fill: f64,
    naive_churn: f64,
}

fn ingest(wl: &Workload, first_rss: &mut Option<u64>) -> (Rates, kvx_router::IndexStats) {
    let n = wl.events.len() as f64 / 1e6;
    let m = wl.churn.len() as f64 / 1e6;
    let mut v: [Vec<f64>; 6] = Default::default();
    let mut stats = Default::default();
    for _ in 0..RUNS {
        let rss0 = rss_bytes();
        let mut ix = KvIndex::default();
        let (w, c) = timed(|| {
            wl.events.iter().for_each(|ev| {
                black_box(ix.apply(ev));
            })
        });
        v[0].push(n / w);
        v[1].push(n / c);
        if first_rss.is_none() {
            *first_rss = rss0.zip(rss_bytes()).map(|(a, b)| b.saturating_sub(a));
        }
        let (w, c) = timed(|| {
            wl.churn.iter().for_each(|ev| {
                black_box(ix.apply(ev));
            })
        });
        v[2].push(m / w);
        v[3].push(m / c);
        stats = ix.stats();
        drop(ix);
        let mut nv = NaiveIndex::default();
        let (_, c) = timed(|| wl.events.iter().for_each(|ev| nv.apply(black_box(ev))));
        v[4].push(n / c);
        let (_, c) = timed(|| wl.churn.iter().for_each(|ev| nv.apply(black_box(ev))));
        v[5].push(m / c);
    }
    let [a, b, c, d, e, f] = v.map(median);
    (Rates { fill: (a, b), churn: (c, d), naive_fill: e, naive_churn: f }, stats)
}

fn main() {
    println!(
        "kvx-router bench: {WORKERS} workers × {BLOCKS_PER_WORKER} blocks, medians of {RUNS} runs"
    );
    println!();
    println!(
        "== ingest, one thread, M events/s (wall | on CPU); churn = evict + store, full index"
    );
    let mut first_rss = None;
    for (chunk, interleave) in [(1usize, false), (1, true), (4, true), (16, true)] {
        let wl = Workload::build(WORKERS, BLOCKS_PER_WORKER, chunk, 4000, interleave, 42);
        let blocks: usize = wl
            .events
            .iter()
            .map(|e| match &e.data {
                KvEventData::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum();
        let per_event = blocks as f64 / wl.events.len() as f64;
        let (r, s) = ingest(&wl, &mut first_rss);
        let order = if interleave { "interleaved" } else { "per worker" };
        println!(
            "{chunk:>2} block(s)/event, {order:<11}: fill {:>5.2} | {:>5.2} ({:>5.2} M blocks/s on CPU), peer {:>5.2}, ratio {:.2};  churn {:>5.2} | {:>5.2}, peer {:>5.2}, ratio {:.2}",
            r.fill.0,
            r.fill.1,
            r.fill.1 * per_event,
            r.naive_fill,
            r.fill.1 / r.naive_fill,
            r.churn.0,
            r.churn.1,
            r.naive_churn,
            r.churn.1 / r.naive_churn,
        );
        if chunk == 16 {
            println!(
                "index after churn: {} nodes, {} worker-blocks, {:.1} MiB by table capacities",
                s.nodes,
                s.blocks,
                s.memory_bytes as f64 / (1 << 20) as f64
            );
        }
    }
    if let Some(b) = first_rss {
        println!(
            "RSS growth while filling the first index: {:.1} MiB",
            b as f64 / (1 << 20) as f64
        );
    }

    println!();
    println!("== selection (KV mode, 64 workers, 1 M blocks, 2048 requests in flight)");
    let mut wl = Workload::build(WORKERS, BLOCKS_PER_WORKER, 16, 0, true, 7);
    let (mut router, naive) = loaded(&mut wl, 2048, true);
    let reqs = wl.requests(20_000);
    let mean_blocks = reqs.iter().map(|r| r.seqs().len()).sum::<usize>() as f64 / reqs.len() as f64;
    println!("{} requests × {RUNS} runs, {mean_blocks:.1} blocks each on average", reqs.len());
    let mut sel = Vec::with_capacity(reqs.len() * RUNS);
    let (_, cpu) = timed(|| {
        for _ in 0..RUNS {
            for r in &reqs {
                let t = Instant::now();
                let d = router.select(black_box(r));
                sel.push(t.elapsed().as_nanos() as u64);
                black_box(d).ok();
            }
        }
    });
    latency_line("Router::select", &mut sel, cpu);
    let index = router.index();
    let mut scores = OverlapScores::new();
    let mut fm = Vec::with_capacity(reqs.len() * RUNS);
    let (_, cpu) = timed(|| {
        for _ in 0..RUNS {
            for r in &reqs {
                let t = Instant::now();
                index.find_matches(black_box(r.locals()), &mut scores);
                fm.push(t.elapsed().as_nanos() as u64);
            }
        }
    });
    latency_line("KvIndex::find_matches", &mut fm, cpu);
    let mut out = Vec::new();
    let mut nm = Vec::with_capacity(reqs.len() * RUNS);
    let (_, cpu) = timed(|| {
        for _ in 0..RUNS {
            for r in &reqs {
                let t = Instant::now();
                naive.find_matches(black_box(r.seqs()), &mut out);
                nm.push(t.elapsed().as_nanos() as u64);
            }
        }
    });
    latency_line("peer find_matches", &mut nm, cpu);
    println!(
        "find_matches speed-up over the peer: p50 {:.1}×, p99 {:.1}×",
        pct(&nm, 0.5) / pct(&fm, 0.5),
        pct(&nm, 0.99) / pct(&fm, 0.99)
    );
    let m = router.metrics();
    println!(
        "hit rate {:.3}, {:.1} cached blocks per decision over {} decisions",
        m.hit_rate(),
        m.overlap_per_decision(),
        m.decisions
    );
}
