//! `/metrics`: Prometheus (OpenMetrics text) with the `kvx_` prefix — requests by endpoint
//! and status, TTFT / inter-token / end-to-end histograms, token counters, and per-worker and
//! total queue depth, running requests, KV usage and prefix-cache hit rate, read from the
//! workers at scrape time; each worker's role (`kvx_worker_role`) and the load of each role
//! of disaggregated serving (`kvx_role_*`); the KV tiers of each worker (`kvx_worker_kv_*`,
//! [`crate::tier_metrics`]); requests refused by their API key's limits, by limit
//! (`kvx_rate_limited_total{reason}`, never naming a key); the admission queue: its depth, the
//! wait a newcomer would face and the requests it refused, by reason
//! (`kvx_admission_refused_total{reason}`: `queue_full`, `wait`, `deadline`); streams cut for
//! their deadline or for leaving too much unread (`kvx_streams_cut_total{reason}`).

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use kvx_proto::plane::WorkerRole;

use crate::dispatch::WorkerState;
use crate::tier_metrics::TierFamilies;

type Labels2 = [(&'static str, &'static str); 2];
type Labels1 = [(&'static str, &'static str); 1];
type WorkerLabel = [(&'static str, String); 1];
type RoleLabel = [(&'static str, String); 2];
type GaugeF = Gauge<f64, AtomicU64>;

/// Ingress metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels2, Counter>,
    finished: Family<Labels1, Counter>,
    rate_limited: Family<Labels1, Counter>,
    admission_refused: Family<Labels1, Counter>,
    streams_cut: Family<Labels1, Counter>,
    /// Engine requests waiting in the admission queue.
    pub admission_queued: Gauge,
    /// The wait a request arriving now would face, seconds.
    pub admission_wait: GaugeF,
    /// Engine requests running at once at most (0: no bound).
    pub admission_bound: Gauge,
    /// Time to first token.
    pub ttft: Histogram,
    /// Gap between consecutive tokens of a stream.
    pub itl: Histogram,
    /// Request arrival to last byte.
    pub e2e: Histogram,
    /// Prompt tokens of completed requests.
    pub input_tokens: Counter,
    /// Generated tokens.
    pub output_tokens: Counter,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: Counter,
    /// Clients that went away before their response ended.
    pub disconnects: Counter,
    /// Requests in ingress now.
    pub inflight: Gauge,
    worker_up: Family<WorkerLabel, Gauge>,
    worker_running: Family<WorkerLabel, Gauge>,
    worker_waiting: Family<WorkerLabel, Gauge>,
    worker_kv_active: Family<WorkerLabel, Gauge>,
    worker_kv_total: Family<WorkerLabel, Gauge>,
    worker_kv_usage: Family<WorkerLabel, GaugeF>,
    worker_hit_rate: Family<WorkerLabel, GaugeF>,
    worker_finished: Family<WorkerLabel, Counter>,
    worker_generated: Family<WorkerLabel, Counter>,
    worker_prefilled: Family<WorkerLabel, Counter>,
    worker_preemptions: Family<WorkerLabel, Counter>,
    worker_steps: Family<WorkerLabel, Counter>,
    worker_prefill_queue: Family<WorkerLabel, Gauge>,
    worker_role: Family<RoleLabel, Gauge>,
    worker_step: Family<RoleLabel, GaugeF>,
    role_running: Family<Labels1, Gauge>,
    role_waiting: Family<Labels1, Gauge>,
    role_kv_active: Family<Labels1, Gauge>,
    role_prefill_queue: Family<Labels1, Gauge>,
    running: Gauge,
    waiting: Gauge,
    kv_active: Gauge,
    kv_total: Gauge,
    kv_usage: GaugeF,
    hit_rate: GaugeF,
    workers_up: Gauge,
    tiers: TierFamilies,
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("kvx");
        let requests = Family::<Labels2, Counter>::default();
        r.register("requests", "Requests by endpoint and HTTP status", requests.clone());
        // Every series a dashboard or alert rates exists from the start, at 0: `rate()` sees
        // the first error instead of a series that appears already at 1.
        for endpoint in ["chat", "completions"] {
            for status in ["200", "400", "404", "429", "500", "503"] {
                let _ = requests.get_or_create(&[("endpoint", endpoint), ("status", status)]);
            }
        }
        let finished = Family::<Labels1, Counter>::default();
        r.register("requests_finished", "Generations by finish reason", finished.clone());
        let rate_limited = Family::<Labels1, Counter>::default();
        r.register(
            "rate_limited",
            "Requests refused by their API key's limit, by limit (concurrency, rpm, tpm)",
            rate_limited.clone(),
        );
        for reason in ["concurrency", "rpm", "tpm"] {
            let _ = rate_limited.get_or_create(&[("reason", reason)]);
        }
        let admission_refused = Family::<Labels1, Counter>::default();
        r.register(
            "admission_refused",
            "Requests refused by the admission queue, by reason (queue_full, wait, deadline)",
            admission_refused.clone(),
        );
        for reason in ["queue_full", "wait", "deadline"] {
            let _ = admission_refused.get_or_create(&[("reason", reason)]);
        }
        let streams_cut = Family::<Labels1, Counter>::default();
        r.register(
            "streams_cut",
            "Streams cancelled by the server, by reason (unread, deadline)",
            streams_cut.clone(),
        );
        for reason in ["unread", "deadline"] {
            let _ = streams_cut.get_or_create(&[("reason", reason)]);
        }
        let admission_queued = Gauge::default();
        r.register(
            "admission_queue_depth",
            "Engine requests waiting in the admission queue",
            admission_queued.clone(),
        );
        let admission_wait = GaugeF::default();
        r.register(
            "admission_estimated_wait_seconds",
            "The wait a request arriving now would face before it starts",
            admission_wait.clone(),
        );
        let admission_bound = Gauge::default();
        r.register(
            "admission_running_bound",
            "Engine requests running at once at most (0: no bound; with --max-running knee, the engines' batch knees)",
            admission_bound.clone(),
        );
        // Eight buckets an octave (9% wide) for the latencies users set targets on, so that
        // `histogram_quantile` lands within 9% of the true quantile wherever it falls.
        let ttft = Histogram::new(fine_buckets(0.001, 16, 8));
        r.register("time_to_first_token_seconds", "Time to first token", ttft.clone());
        let itl = Histogram::new(fine_buckets(0.0001, 16, 8));
        r.register("inter_token_latency_seconds", "Time between streamed tokens", itl.clone());
        let e2e = Histogram::new(fine_buckets(0.001, 18, 4));
        r.register("request_duration_seconds", "End-to-end request latency", e2e.clone());
        let input_tokens = Counter::default();
        r.register("input_tokens", "Prompt tokens of finished requests", input_tokens.clone());
        let output_tokens = Counter::default();
        r.register("output_tokens", "Generated tokens", output_tokens.clone());
        let cached_tokens = Counter::default();
        r.register("cached_tokens", "Prompt tokens from the prefix cache", cached_tokens.clone());
        let disconnects = Counter::default();
        r.register(
            "client_disconnects",
            "Clients gone before the response ended",
            disconnects.clone(),
        );
        let inflight = Gauge::default();
        r.register("inflight_requests", "Requests being served by ingress", inflight.clone());
        macro_rules! fam {
            ($name:literal, $help:literal, $t:ty) => {{
                let f = Family::<WorkerLabel, $t>::default();
                r.register($name, $help, f.clone());
                f
            }};
        }
        macro_rules! role {
            ($name:literal, $help:literal) => {{
                let f = Family::<Labels1, Gauge>::default();
                r.register($name, $help, f.clone());
                f
            }};
        }
        macro_rules! one {
            ($name:literal, $help:literal, $t:ty) => {{
                let g = <$t>::default();
                r.register($name, $help, g.clone());
                g
            }};
        }
        Metrics {
            worker_up: fam!("worker_up", "Whether the worker is running", Gauge),
            worker_running: fam!("worker_running_requests", "Sequences computing", Gauge),
            worker_waiting: fam!("worker_queue_depth", "Requests waiting for admission", Gauge),
            worker_kv_active: fam!("worker_kv_blocks_active", "KV blocks in use", Gauge),
            worker_kv_total: fam!("worker_kv_blocks", "KV blocks", Gauge),
            worker_kv_usage: fam!("worker_kv_usage_ratio", "KV blocks in use / all", GaugeF),
            worker_hit_rate: fam!(
                "worker_prefix_cache_hit_rate",
                "Cached prompt tokens / prompt tokens",
                GaugeF
            ),
            worker_finished: fam!("worker_requests_finished", "Requests finished", Counter),
            worker_generated: fam!("worker_generated_tokens", "Tokens generated", Counter),
            worker_prefilled: fam!(
                "worker_prefill_tokens",
                "Prompt (and recomputed) tokens computed",
                Counter
            ),
            worker_preemptions: fam!("worker_preemptions", "Sequences preempted", Counter),
            worker_steps: fam!("worker_steps", "Engine steps run", Counter),
            worker_prefill_queue: fam!(
                "worker_prefill_queue_tokens",
                "Prompt tokens admitted or waiting, not computed yet",
                Gauge
            ),
            worker_role: {
                let f = Family::<RoleLabel, Gauge>::default();
                r.register(
                    "worker_role",
                    "1 for the worker's role (agg, prefill, decode)",
                    f.clone(),
                );
                f
            },
            worker_step: {
                let f = Family::<RoleLabel, GaugeF>::default();
                r.register(
                    "worker_step_sums",
                    "Sums over the worker's steps (sum=n: steps; x1: prompt tokens; x2: context \
                     of the decoded tokens; y: seconds; x1x1, x1x2, x2x2, x1y, x2y, yy: products; \
                     qy: queued prompt tokens x seconds): a least-squares fit of step time",
                    f.clone(),
                );
                f
            },
            role_running: role!("role_running_requests", "Sequences computing, by role"),
            role_waiting: role!("role_queue_depth", "Requests waiting for admission, by role"),
            role_kv_active: role!("role_kv_blocks_active", "KV blocks in use, by role"),
            role_prefill_queue: role!(
                "role_prefill_queue_tokens",
                "Prompt tokens not computed yet, by role"
            ),
            running: one!("running_requests", "Sequences computing, all workers", Gauge),
            waiting: one!("queue_depth", "Requests waiting for admission, all workers", Gauge),
            kv_active: one!("kv_blocks_active", "KV blocks in use, all workers", Gauge),
            kv_total: one!("kv_blocks", "KV blocks, all workers", Gauge),
            kv_usage: one!("kv_usage_ratio", "KV blocks in use / all, all workers", GaugeF),
            hit_rate: one!(
                "prefix_cache_hit_rate",
                "Cached prompt tokens / prompt tokens, all workers",
                GaugeF
            ),
            workers_up: one!("workers_up", "Workers running", Gauge),
            tiers: TierFamilies::register(&mut r),
            registry: r,
            requests,
            finished,
            rate_limited,
            admission_refused,
            streams_cut,
            admission_queued,
            admission_wait,
            admission_bound,
            ttft,
            itl,
            e2e,
            input_tokens,
            output_tokens,
            cached_tokens,
            disconnects,
            inflight,
            scrape: Mutex::new(()),
        }
    }

    /// Counts a response.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.requests
            .get_or_create(&[("endpoint", endpoint), ("status", status_label(status))])
            .inc();
    }

    /// Counts a finished generation.
    pub fn finished(&self, reason: &'static str) {
        self.finished.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts a request refused by its key's limit (`concurrency`, `rpm` or `tpm`).
    pub fn rate_limited(&self, reason: &'static str) {
        self.rate_limited.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts a request the admission queue refused (`queue_full`, `wait` or `deadline`).
    pub fn admission_refused(&self, reason: &'static str) {
        self.admission_refused.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts a stream the server cut (`unread` or `deadline`).
    pub fn stream_cut(&self, reason: &'static str) {
        self.streams_cut.get_or_create(&[("reason", reason)]).inc();
    }

    /// Renders the text exposition, reading worker state and router counters first.
    pub fn render(&self, workers: &[WorkerState], router: &[(&'static str, f64)]) -> String {
        let _g = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let (mut run, mut wait, mut act, mut tot, mut up) = (0i64, 0i64, 0i64, 0i64, 0i64);
        let (mut prompt, mut cached) = (0u64, 0u64);
        // Only the workers there now have series: one that left (a restart comes back under a
        // new id) must not keep its last values, nor a `kvx_worker_up 0` that never clears.
        for f in [
            &self.worker_up,
            &self.worker_running,
            &self.worker_waiting,
            &self.worker_kv_active,
            &self.worker_kv_total,
            &self.worker_prefill_queue,
        ] {
            f.clear();
        }
        self.worker_kv_usage.clear();
        self.worker_hit_rate.clear();
        for f in [
            &self.worker_finished,
            &self.worker_generated,
            &self.worker_prefilled,
            &self.worker_preemptions,
            &self.worker_steps,
        ] {
            f.clear();
        }
        self.worker_role.clear();
        self.worker_step.clear();
        self.tiers.clear();
        for f in
            [&self.role_running, &self.role_waiting, &self.role_kv_active, &self.role_prefill_queue]
        {
            f.clear();
        }
        // Per role: running, waiting, active blocks, queued prompt tokens.
        let mut by_role = [[0i64; 4]; 3];
        for w in workers {
            let l = [("worker", w.id.to_string())];
            let m = &w.metrics;
            let ri = match w.role {
                WorkerRole::Agg => 0,
                WorkerRole::Prefill => 1,
                WorkerRole::Decode => 2,
            };
            let r = &mut by_role[ri];
            r[0] += i64::from(m.load.active_seqs);
            r[1] += i64::from(m.load.waiting);
            r[2] += i64::from(m.load.active_blocks);
            r[3] += i64::from(m.load.queued_prefill_tokens);
            self.worker_role
                .get_or_create(&[("worker", w.id.to_string()), ("role", w.role.name().into())])
                .set(1);
            self.worker_prefill_queue
                .get_or_create(&l)
                .set(i64::from(m.load.queued_prefill_tokens));
            self.worker_up.get_or_create(&l).set(i64::from(w.alive));
            self.worker_running.get_or_create(&l).set(i64::from(m.load.active_seqs));
            self.worker_waiting.get_or_create(&l).set(i64::from(m.load.waiting));
            self.worker_kv_active.get_or_create(&l).set(i64::from(m.load.active_blocks));
            self.worker_kv_total.get_or_create(&l).set(i64::from(m.load.total_blocks));
            self.worker_kv_usage.get_or_create(&l).set(f64::from(m.load.kv_usage()));
            self.worker_hit_rate.get_or_create(&l).set(m.prefix_hit_rate());
            self.tiers.set(w.id, &m.tiers);
            for (name, v) in kvx_proto::StepSums::NAMES.iter().zip(m.step.values()) {
                self.worker_step
                    .get_or_create(&[("worker", w.id.to_string()), ("sum", (*name).into())])
                    .set(v);
            }
            // The worker's own totals since it started (a restarted worker starts again at 0).
            for (f, v) in [
                (&self.worker_finished, m.finished),
                (&self.worker_generated, m.generated_tokens),
                (&self.worker_prefilled, m.prefill_tokens),
                (&self.worker_preemptions, m.preemptions),
                (&self.worker_steps, m.steps),
            ] {
                f.get_or_create(&l).inner().store(v, std::sync::atomic::Ordering::Relaxed);
            }
            run += i64::from(m.load.active_seqs);
            wait += i64::from(m.load.waiting);
            act += i64::from(m.load.active_blocks);
            tot += i64::from(m.load.total_blocks);
            up += i64::from(w.alive);
            prompt += m.prompt_tokens;
            cached += m.cached_tokens;
        }
        self.running.set(run);
        self.waiting.set(wait);
        self.kv_active.set(act);
        self.kv_total.set(tot);
        self.kv_usage.set(if tot > 0 { act as f64 / tot as f64 } else { 0.0 });
        self.hit_rate.set(if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 });
        self.workers_up.set(up);
        for (ri, role) in
            [WorkerRole::Agg, WorkerRole::Prefill, WorkerRole::Decode].iter().enumerate()
        {
            if !workers.iter().any(|w| w.role == *role) {
                continue;
            }
            let l = [("role", role.name())];
            let v = by_role[ri];
            self.role_running.get_or_create(&l).set(v[0]);
            self.role_waiting.get_or_create(&l).set(v[1]);
            self.role_kv_active.get_or_create(&l).set(v[2]);
            self.role_prefill_queue.get_or_create(&l).set(v[3]);
        }
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        for (name, v) in router {
            let name: String = name
                .strip_prefix("router_")
                .unwrap_or(name)
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' })
                .collect();
            // Names ending in `_total` only ever grow: typed counters so that `rate()` is right.
            match name.strip_suffix("_total") {
                Some(stem) => out.push_str(&format!(
                    "# TYPE kvx_router_{stem} counter\nkvx_router_{stem}_total {v}\n"
                )),
                None => out
                    .push_str(&format!("# TYPE kvx_router_{name} gauge\nkvx_router_{name} {v}\n")),
            }
        }
        let _ = encode_eof(&mut out);
        out
    }
}

fn status_label(s: u16) -> &'static str {
    match s {
        200 => "200",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        405 => "405",
        408 => "408",
        413 => "413",
        429 => "429",
        500 => "500",
        503 => "503",
        504 => "504",
        _ => "other",
    }
}

/// Bucket bounds from `start` seconds over `octaves` doublings, `per_octave` to each, rounded
/// to three significant digits (readable `le` labels; still strictly increasing).
fn fine_buckets(start: f64, octaves: u32, per_octave: u32) -> impl Iterator<Item = f64> {
    (0..=octaves * per_octave).map(move |i| {
        let v = start * 2f64.powf(f64::from(i) / f64::from(per_octave));
        let scale = 10f64.powi(2 - v.log10().floor() as i32);
        (v * scale).round() / scale
    })
}

#[cfg(test)]
mod tests {
    use kvx_proto::{LoadReport, WorkerMetrics};

    use super::*;

    #[test]
    fn latency_buckets_are_fine_and_increasing() {
        let b: Vec<f64> = fine_buckets(0.001, 16, 8).collect();
        assert_eq!(b.len(), 129);
        assert_eq!((b[0], b[8], b[128]), (0.001, 0.002, 65.5));
        for w in b.windows(2) {
            assert!(w[1] > w[0] && w[1] / w[0] < 1.1, "{w:?}");
        }
    }

    #[test]
    fn exposition_has_per_worker_and_total_series() {
        let m = Metrics::new();
        m.request("chat", 200);
        m.request("chat", 429);
        m.ttft.observe(0.01);
        m.rate_limited("rpm");
        let w = |id, active, prompt, cached| WorkerState {
            id,
            alive: true,
            role: if id == 0 { WorkerRole::Prefill } else { WorkerRole::Decode },
            metrics: WorkerMetrics {
                load: LoadReport {
                    worker_id: id,
                    active_seqs: 1,
                    active_blocks: active,
                    total_blocks: 10,
                    ..Default::default()
                },
                prompt_tokens: prompt,
                cached_tokens: cached,
                generated_tokens: 3 * prompt,
                finished: id + 7,
                step: kvx_proto::StepSums { n: 3.0, y: 0.25, ..Default::default() },
                ..Default::default()
            },
        };
        let text = m.render(
            &[w(0, 2, 100, 50), w(1, 4, 100, 0)],
            &[("decisions", 3.0), ("kv_transfers_total", 2.0)],
        );
        for line in [
            "kvx_requests_total{endpoint=\"chat\",status=\"200\"} 1",
            "kvx_requests_total{endpoint=\"chat\",status=\"429\"} 1",
            "kvx_worker_kv_blocks_active{worker=\"1\"} 4",
            "kvx_kv_blocks_active 6",
            "kvx_kv_usage_ratio 0.3",
            "kvx_running_requests 2",
            "kvx_prefix_cache_hit_rate 0.25",
            "kvx_worker_prefix_cache_hit_rate{worker=\"0\"} 0.5",
            "kvx_worker_generated_tokens_total{worker=\"1\"} 300",
            "kvx_worker_requests_finished_total{worker=\"1\"} 8",
            "kvx_worker_steps_total{worker=\"0\"} 0",
            "kvx_router_decisions 3",
            "# TYPE kvx_router_kv_transfers counter",
            "kvx_router_kv_transfers_total 2",
            "kvx_worker_role{worker=\"0\",role=\"prefill\"} 1",
            "kvx_role_kv_blocks_active{role=\"decode\"} 4",
            "kvx_role_running_requests{role=\"prefill\"} 1",
            "kvx_time_to_first_token_seconds_count 1",
            "kvx_rate_limited_total{reason=\"rpm\"} 1",
            "kvx_rate_limited_total{reason=\"tpm\"} 0",
            "kvx_worker_step_sums{worker=\"1\",sum=\"n\"} 3.0",
            "kvx_worker_step_sums{worker=\"1\",sum=\"y\"} 0.25",
            "kvx_worker_step_sums{worker=\"0\",sum=\"qy\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        // Worker 1 gone: its series go with it.
        let text = m.render(&[w(0, 2, 100, 50)], &[]);
        assert!(text.contains("kvx_worker_up{worker=\"0\"} 1"), "{text}");
        assert!(!text.contains("worker=\"1\""), "{text}");
        assert!(!text.contains("role=\"decode\""), "{text}");
    }
}
