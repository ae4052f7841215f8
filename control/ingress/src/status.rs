//! The status page: [`Live`], a fixed-size recorder of the last five minutes of time to first
//! token, inter-token latency and output tokens, one bucket a second; [`Snapshot`], what
//! `/status.json` answers (the fleet, totals and those series); and [`PAGE`], the
//! self-contained HTML page served at `/` that draws it.
//!
//! Each second holds a log-bucketed histogram per latency (8 buckets an octave of
//! microseconds, so a percentile is within 1/16 of the true value; clamped to the second's
//! exact minimum and maximum): recording a sample is an increment under a short lock, with no
//! allocation. The ring is allocated once and reused as seconds go by.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::dispatch::WorkerState;

/// The page served at `/`.
pub const PAGE: &str = include_str!("status.html");

/// Seconds of history kept (and shown).
pub const WINDOW_SECS: u64 = 300;
/// Seconds the headline percentiles (`last_minute`) cover.
pub const RECENT_SECS: u64 = 60;

/// Sub-buckets per octave: 2^SUB_BITS.
const SUB_BITS: u32 = 3;
const SUB: usize = 1 << SUB_BITS;
/// The highest octave with its own buckets: values up to 2^(MAX_OCTAVE+1) µs (~134 s); longer
/// ones land in the last bucket (their exact maximum is still kept).
const MAX_OCTAVE: u32 = 26;
/// Buckets of one histogram: 0..SUB µs one each, then SUB per octave from 2^SUB_BITS.
const BUCKETS: usize = (MAX_OCTAVE as usize - SUB_BITS as usize + 2) * SUB;

/// The bucket of a value in microseconds.
fn bucket(us: u64) -> usize {
    if us < SUB as u64 {
        return us as usize;
    }
    let octave = 63 - us.leading_zeros();
    if octave > MAX_OCTAVE {
        return BUCKETS - 1;
    }
    let shift = octave - SUB_BITS;
    let sub = ((us >> shift) as usize) & (SUB - 1);
    (octave - SUB_BITS + 1) as usize * SUB + sub
}

/// The middle of a bucket's range, in microseconds.
fn bucket_mid(i: usize) -> f64 {
    if i < SUB {
        return i as f64;
    }
    let shift = (i / SUB) as u32 - 1;
    let lower = ((SUB + i % SUB) as u64) << shift;
    let width = 1u64 << shift;
    lower as f64 + (width - 1) as f64 / 2.0
}

/// One second's samples of one latency.
#[derive(Clone)]
struct Hist {
    counts: [u32; BUCKETS],
    n: u32,
    min_us: u64,
    max_us: u64,
}

impl std::fmt::Debug for Hist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hist").field("n", &self.n).field("min_us", &self.min_us).finish()
    }
}

impl Hist {
    const EMPTY: Hist = Hist { counts: [0; BUCKETS], n: 0, min_us: u64::MAX, max_us: 0 };

    fn record(&mut self, us: u64) {
        let b = &mut self.counts[bucket(us)];
        *b = b.saturating_add(1);
        self.n = self.n.saturating_add(1);
        self.min_us = self.min_us.min(us);
        self.max_us = self.max_us.max(us);
    }

    fn merge(&mut self, o: &Hist) {
        for (a, b) in self.counts.iter_mut().zip(o.counts.iter()) {
            *a = a.saturating_add(*b);
        }
        self.n = self.n.saturating_add(o.n);
        self.min_us = self.min_us.min(o.min_us);
        self.max_us = self.max_us.max(o.max_us);
    }

    /// The `q` quantile (nearest rank) in microseconds; `None` without samples.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total: u64 = self.counts.iter().map(|&c| u64::from(c)).sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let (lo, hi) = (self.min_us as f64, self.max_us as f64);
        // The extreme ranks are known exactly.
        if rank == 1 {
            return Some(lo);
        }
        if rank == total {
            return Some(hi);
        }
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return Some(bucket_mid(i).clamp(lo, hi));
            }
        }
        Some(hi)
    }

    fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.n,
            p50_ms: self.quantile(0.5).map(to_ms),
            p90_ms: self.quantile(0.9).map(to_ms),
        }
    }
}

/// Microseconds to milliseconds, to the microsecond.
fn to_ms(us: f64) -> f64 {
    us.round() / 1000.0
}

/// One second of the ring.
#[derive(Debug, Clone)]
struct Slot {
    /// The unix second it holds (`u64::MAX`: none yet).
    sec: u64,
    ttft: Hist,
    itl: Hist,
    tokens: u64,
}

impl Slot {
    const EMPTY: Slot = Slot { sec: u64::MAX, ttft: Hist::EMPTY, itl: Hist::EMPTY, tokens: 0 };
}

/// The last [`WINDOW_SECS`] seconds, indexed by unix second modulo the window.
#[derive(Debug)]
struct Ring {
    slots: Box<[Slot]>,
}

impl Ring {
    fn new() -> Ring {
        Ring { slots: vec![Slot::EMPTY; WINDOW_SECS as usize].into_boxed_slice() }
    }

    /// The slot of `sec`, emptied first if it held an older second.
    fn slot_mut(&mut self, sec: u64) -> &mut Slot {
        let i = (sec % WINDOW_SECS) as usize;
        let slot = &mut self.slots[i];
        if slot.sec != sec {
            *slot = Slot { sec, ..Slot::EMPTY };
        }
        slot
    }

    /// The slot of `sec` if it still holds that second.
    fn slot(&self, sec: u64) -> Option<&Slot> {
        self.slots.get((sec % WINDOW_SECS) as usize).filter(|s| s.sec == sec)
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Ttft,
    Itl,
}

/// Live latency and throughput for the status page; one per server.
#[derive(Debug)]
pub struct Live {
    ring: Mutex<Ring>,
    started: Instant,
    served: AtomicU64,
}

impl Default for Live {
    fn default() -> Self {
        Self::new()
    }
}

impl Live {
    /// An empty recorder; its fixed memory (a few hundred KiB) is allocated here.
    pub fn new() -> Live {
        Live { ring: Mutex::new(Ring::new()), started: Instant::now(), served: AtomicU64::new(0) }
    }

    /// A stream's first tokens (`tokens` of them) came `latency` after its request arrived.
    pub fn ttft(&self, latency: Duration, tokens: usize) {
        self.record_at(unix_now(), Kind::Ttft, latency, tokens);
    }

    /// A stream's next tokens (`tokens` of them) came `gap` after its previous ones.
    pub fn itl(&self, gap: Duration, tokens: usize) {
        self.record_at(unix_now(), Kind::Itl, gap, tokens);
    }

    /// A request was served to its end.
    pub fn served(&self) {
        self.served.fetch_add(1, Ordering::Relaxed);
    }

    fn record_at(&self, sec: u64, kind: Kind, d: Duration, tokens: usize) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let slot = ring.slot_mut(sec);
        match kind {
            Kind::Ttft => slot.ttft.record(us),
            Kind::Itl => slot.itl.record(us),
        }
        slot.tokens = slot.tokens.saturating_add(tokens as u64);
    }

    /// What `/status.json` answers now.
    pub fn snapshot(&self, model: &str, workers: &[WorkerState], io: Counters) -> Snapshot {
        self.snapshot_at(unix_now(), model, workers, io)
    }

    fn snapshot_at(
        &self,
        now: u64,
        model: &str,
        workers: &[WorkerState],
        io: Counters,
    ) -> Snapshot {
        let mut ttft = Series::default();
        let mut itl = Series::default();
        let mut throughput = Vec::new();
        let (mut ttft_recent, mut itl_recent) = (Hist::EMPTY, Hist::EMPTY);
        {
            let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            for sec in now.saturating_sub(WINDOW_SECS - 1)..=now {
                let Some(slot) = ring.slot(sec) else { continue };
                if slot.ttft.n > 0 {
                    ttft.series.push(Point::new(sec, &slot.ttft));
                }
                if slot.itl.n > 0 {
                    itl.series.push(Point::new(sec, &slot.itl));
                }
                if slot.tokens > 0 {
                    throughput.push(Tokens { t: sec, tokens: slot.tokens });
                }
                if sec.saturating_add(RECENT_SECS) > now {
                    ttft_recent.merge(&slot.ttft);
                    itl_recent.merge(&slot.itl);
                }
            }
        }
        ttft.last_minute = ttft_recent.summary();
        itl.last_minute = itl_recent.summary();
        let mut ws: Vec<&WorkerState> = workers.iter().collect();
        ws.sort_by_key(|w| w.id);
        let fleet: Vec<Worker> = ws.into_iter().map(Worker::from).collect();
        let totals = Totals::new(workers, io, self.served.load(Ordering::Relaxed));
        Snapshot {
            model: model.to_string(),
            uptime_s: self.started.elapsed().as_secs(),
            now,
            window_s: WINDOW_SECS,
            fleet,
            totals,
            ttft,
            itl,
            throughput,
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Ingress's own counters the snapshot reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Prompt tokens of finished requests.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Requests in ingress now.
    pub inflight: i64,
}

/// `/status.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// The served model's name.
    pub model: String,
    /// Seconds since the server started.
    pub uptime_s: u64,
    /// The unix second of the snapshot.
    pub now: u64,
    /// Seconds of history in the series.
    pub window_s: u64,
    /// Every worker, by id.
    pub fleet: Vec<Worker>,
    /// The fleet's sums.
    pub totals: Totals,
    /// Time to first token.
    pub ttft: Series,
    /// Inter-token latency.
    pub itl: Series,
    /// Output tokens streamed each second (seconds without any left out).
    pub throughput: Vec<Tokens>,
}

/// One worker's row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Worker {
    /// Its id, as a decimal string (ids are 64-bit; JavaScript numbers are not).
    pub id: String,
    /// `agg`, `prefill` or `decode`.
    pub role: &'static str,
    /// Whether it is alive.
    pub up: bool,
    /// Sequences computing.
    pub running: u32,
    /// Requests waiting for admission.
    pub waiting: u32,
    /// KV blocks in use.
    pub kv_blocks_active: u32,
    /// KV blocks.
    pub kv_blocks_total: u32,
    /// In use / all.
    pub kv_usage: f64,
    /// Cached prompt tokens / prompt tokens, since it started.
    pub prefix_hit_rate: f64,
    /// Prompt tokens admitted, not computed yet.
    pub queued_prefill_tokens: u32,
    /// Requests finished since it started.
    pub finished: u64,
    /// Tokens generated since it started.
    pub generated_tokens: u64,
}

impl From<&WorkerState> for Worker {
    fn from(w: &WorkerState) -> Worker {
        let m = &w.metrics;
        Worker {
            id: w.id.to_string(),
            role: w.role.name(),
            up: w.alive,
            running: m.load.active_seqs,
            waiting: m.load.waiting,
            kv_blocks_active: m.load.active_blocks,
            kv_blocks_total: m.load.total_blocks,
            kv_usage: ratio(u64::from(m.load.active_blocks), u64::from(m.load.total_blocks)),
            prefix_hit_rate: ratio(m.cached_tokens, m.prompt_tokens),
            queued_prefill_tokens: m.load.queued_prefill_tokens,
            finished: m.finished,
            generated_tokens: m.generated_tokens,
        }
    }
}

/// The fleet's sums and ingress's counters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Totals {
    /// Workers known.
    pub workers: usize,
    /// Workers alive.
    pub workers_up: usize,
    /// Sequences computing.
    pub running: u64,
    /// Requests waiting for admission.
    pub waiting: u64,
    /// KV blocks in use.
    pub kv_blocks_active: u64,
    /// KV blocks.
    pub kv_blocks_total: u64,
    /// In use / all.
    pub kv_usage: f64,
    /// Cached prompt tokens / prompt tokens, all workers.
    pub prefix_hit_rate: f64,
    /// Requests served to their end by this ingress.
    pub requests_served: u64,
    /// Requests in this ingress now.
    pub inflight: i64,
    /// Prompt tokens of finished requests.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
}

impl Totals {
    fn new(workers: &[WorkerState], io: Counters, requests_served: u64) -> Totals {
        let (mut running, mut waiting, mut active, mut total) = (0u64, 0u64, 0u64, 0u64);
        let (mut prompt, mut cached) = (0u64, 0u64);
        for w in workers {
            let l = &w.metrics.load;
            running += u64::from(l.active_seqs);
            waiting += u64::from(l.waiting);
            active += u64::from(l.active_blocks);
            total += u64::from(l.total_blocks);
            prompt = prompt.saturating_add(w.metrics.prompt_tokens);
            cached = cached.saturating_add(w.metrics.cached_tokens);
        }
        Totals {
            workers: workers.len(),
            workers_up: workers.iter().filter(|w| w.alive).count(),
            running,
            waiting,
            kv_blocks_active: active,
            kv_blocks_total: total,
            kv_usage: ratio(active, total),
            prefix_hit_rate: ratio(cached, prompt),
            requests_served,
            inflight: io.inflight,
            input_tokens: io.input_tokens,
            output_tokens: io.output_tokens,
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// A latency's series and its recent summary.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Series {
    /// The last [`RECENT_SECS`] seconds together.
    pub last_minute: LatencySummary,
    /// One point per second with samples, oldest first.
    pub series: Vec<Point>,
}

/// Count and percentiles of some samples.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u32,
    /// Median, milliseconds (`null` without samples).
    pub p50_ms: Option<f64>,
    /// 90th percentile, milliseconds (`null` without samples).
    pub p90_ms: Option<f64>,
}

/// One second of a latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// Unix second.
    pub t: u64,
    /// Samples.
    pub count: u32,
    /// Median, milliseconds.
    pub p50_ms: f64,
    /// 90th percentile, milliseconds.
    pub p90_ms: f64,
}

impl Point {
    fn new(t: u64, h: &Hist) -> Point {
        let s = h.summary();
        Point {
            t,
            count: s.count,
            p50_ms: s.p50_ms.unwrap_or(0.0),
            p90_ms: s.p90_ms.unwrap_or(0.0),
        }
    }
}

/// Output tokens of one second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Tokens {
    /// Unix second.
    pub t: u64,
    /// Tokens streamed in it.
    pub tokens: u64,
}

#[cfg(test)]
mod tests {
    use kvx_proto::plane::WorkerRole;
    use kvx_proto::{LoadReport, WorkerMetrics};

    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn buckets_cover_the_range_in_order() {
        let mut last = 0;
        for us in (0..5000u64).chain([1 << 20, (1 << 27) - 1, 1 << 27, u64::MAX]) {
            let b = bucket(us);
            assert!(b < BUCKETS, "{us} µs → bucket {b}");
            assert!(b >= last, "monotonic at {us}");
            last = b;
            if us < 1 << 27 {
                let mid = bucket_mid(b);
                assert!((mid - us as f64).abs() <= us as f64 / 16.0 + 0.5, "{us} vs {mid}");
            }
        }
        assert_eq!(bucket((1 << 27) - 1), BUCKETS - 1);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn percentiles_on_known_data() {
        // 1..=100 ms: p50 is 50 ms, p90 is 90 ms (nearest rank), within a bucket's error.
        let mut h = Hist::EMPTY;
        for v in 1..=100u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5).map(to_ms).unwrap_or(0.0);
        let p90 = h.quantile(0.9).map(to_ms).unwrap_or(0.0);
        assert!((p50 - 50.0).abs() <= 50.0 / 16.0, "p50 {p50}");
        assert!((p90 - 90.0).abs() <= 90.0 / 16.0, "p90 {p90}");
        assert_eq!(h.quantile(1.0), Some(100_000.0), "the maximum is exact");
        assert_eq!(h.quantile(0.0), Some(1000.0), "the minimum is exact");
        // One value, or all the same: exact.
        let mut one = Hist::EMPTY;
        for _ in 0..7 {
            one.record(12_345);
        }
        assert_eq!(one.summary().p50_ms, Some(12.345));
        assert_eq!(one.summary().p90_ms, Some(12.345));
        // Skewed: 9 fast, 1 slow → p50 fast, p90 fast (rank 9), the slow one above.
        let mut skew = Hist::EMPTY;
        for _ in 0..9 {
            skew.record(2_000);
        }
        skew.record(500_000);
        assert_eq!(skew.summary().p50_ms, Some(2.0));
        assert_eq!(skew.summary().p90_ms, Some(2.0));
        assert_eq!(skew.quantile(0.95).map(to_ms), Some(500.0));
        assert_eq!(Hist::EMPTY.summary(), LatencySummary::default());
    }

    #[test]
    fn ring_wraps_and_stays_bounded() {
        let live = Live::new();
        let t0 = 1_700_000_000u64;
        // Ten windows' worth of seconds, two samples each.
        for s in 0..10 * WINDOW_SECS {
            live.record_at(t0 + s, Kind::Ttft, ms(10 + s % 7), 1);
            live.record_at(t0 + s, Kind::Itl, ms(1), 2);
        }
        let ring = live.ring.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(ring.slots.len(), WINDOW_SECS as usize, "fixed capacity");
        drop(ring);
        let now = t0 + 10 * WINDOW_SECS - 1;
        let snap = live.snapshot_at(now, "m", &[], Counters::default());
        assert_eq!(snap.ttft.series.len(), WINDOW_SECS as usize);
        assert_eq!(snap.ttft.series.first().map(|p| p.t), Some(now - WINDOW_SECS + 1));
        assert_eq!(snap.ttft.series.last().map(|p| p.t), Some(now));
        assert!(snap.ttft.series.iter().all(|p| p.count == 1));
        assert!(snap.throughput.iter().all(|t| t.tokens == 3));
        assert_eq!(snap.ttft.last_minute.count, RECENT_SECS as u32);
        // Later, the old seconds are gone rather than shown again.
        let later = live.snapshot_at(now + 100, "m", &[], Counters::default());
        assert_eq!(later.ttft.series.len(), WINDOW_SECS as usize - 100);
        assert_eq!(later.ttft.last_minute.count, 0);
        assert_eq!(later.ttft.last_minute.p50_ms, None);
        // A second that comes round again starts empty.
        live.record_at(now + 1, Kind::Ttft, ms(40), 1);
        let again = live.snapshot_at(now + 1, "m", &[], Counters::default());
        let last = again.ttft.series.last().copied();
        assert_eq!(last.map(|p| (p.t, p.count, p.p50_ms)), Some((now + 1, 1, 40.0)));
    }

    fn worker(id: u64, alive: bool, active: u32, prompt: u64, cached: u64) -> WorkerState {
        WorkerState {
            id,
            alive,
            role: if id == 7 { WorkerRole::Prefill } else { WorkerRole::Agg },
            metrics: WorkerMetrics {
                load: LoadReport {
                    worker_id: id,
                    active_seqs: 2,
                    waiting: 1,
                    active_blocks: active,
                    total_blocks: 100,
                    ..Default::default()
                },
                prompt_tokens: prompt,
                cached_tokens: cached,
                ..Default::default()
            },
        }
    }

    #[test]
    fn snapshot_json_fields() {
        let live = Live::new();
        let now = 1_700_000_123u64;
        live.record_at(now - 2, Kind::Ttft, ms(20), 1);
        live.record_at(now - 2, Kind::Ttft, ms(40), 1);
        live.record_at(now, Kind::Itl, Duration::from_micros(5), 4);
        live.served();
        let workers = [worker(u64::MAX, true, 50, 100, 25), worker(7, false, 10, 100, 75)];
        let io = Counters { input_tokens: 200, output_tokens: 5, inflight: 1 };
        let v =
            serde_json::to_value(live.snapshot_at(now, "tiny", &workers, io)).unwrap_or_default();
        assert_eq!(v["model"], "tiny");
        assert_eq!(v["now"], now);
        assert_eq!(v["window_s"], WINDOW_SECS);
        assert!(v["uptime_s"].is_u64());
        // The fleet by id, ids as strings (exact beyond 2^53).
        assert_eq!(v["fleet"][0]["id"], "7");
        assert_eq!(v["fleet"][0]["role"], "prefill");
        assert_eq!(v["fleet"][0]["up"], false);
        assert_eq!(v["fleet"][1]["id"], u64::MAX.to_string());
        assert_eq!(v["fleet"][1]["role"], "agg");
        assert_eq!(v["fleet"][1]["running"], 2);
        assert_eq!(v["fleet"][1]["waiting"], 1);
        assert_eq!(v["fleet"][1]["kv_blocks_active"], 50);
        assert_eq!(v["fleet"][1]["kv_blocks_total"], 100);
        assert_eq!(v["fleet"][1]["kv_usage"], 0.5);
        assert_eq!(v["fleet"][1]["prefix_hit_rate"], 0.25);
        let t = &v["totals"];
        assert_eq!(t["workers"], 2);
        assert_eq!(t["workers_up"], 1);
        assert_eq!(t["running"], 4);
        assert_eq!(t["waiting"], 2);
        assert_eq!(t["kv_usage"], 0.3);
        assert_eq!(t["prefix_hit_rate"], 0.5);
        assert_eq!(t["requests_served"], 1);
        assert_eq!(t["inflight"], 1);
        assert_eq!(t["input_tokens"], 200);
        assert_eq!(t["output_tokens"], 5);
        let p = &v["ttft"]["series"][0];
        assert_eq!(p["t"], now - 2);
        assert_eq!(p["count"], 2);
        assert_eq!(p["p50_ms"], 20.0);
        assert_eq!(p["p90_ms"], 40.0);
        assert_eq!(v["ttft"]["last_minute"]["count"], 2);
        assert_eq!(v["itl"]["series"][0]["p50_ms"], 0.005);
        assert_eq!(v["itl"]["series"].as_array().map(Vec::len), Some(1));
        assert_eq!(
            v["throughput"],
            serde_json::json!([{"t": now - 2, "tokens": 2}, {"t": now, "tokens": 4}])
        );
        let empty =
            serde_json::to_value(Live::new().snapshot_at(now, "m", &[], io)).unwrap_or_default();
        assert_eq!(empty["ttft"]["last_minute"]["p50_ms"], serde_json::Value::Null);
        assert_eq!(empty["ttft"]["series"], serde_json::json!([]));
        assert_eq!(empty["totals"]["kv_usage"], 0.0);
    }

    #[test]
    fn the_page_is_self_contained() {
        assert!(PAGE.starts_with("<!doctype html>"));
        for needle in ["/status.json", "id=\"ttft-chart\"", "data-points", "data-worker-id"] {
            assert!(PAGE.contains(needle), "{needle} missing");
        }
        for external in ["http://", "https://", "//cdn", "@import", "url("] {
            assert!(!PAGE.contains(external), "external reference {external:?}");
        }
    }
}
