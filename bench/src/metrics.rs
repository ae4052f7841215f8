//! Per-level aggregation of request outcomes into hdrhistogram distributions and counters,
//! overall and per request class.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::client::{ErrorClass, Outcome};
use crate::report::{
    Cdfs, ClassReport, ClientStats, Counts, Latencies, Level, RequestRecord, RunReport, Slo, Stats,
    Throughput, Tokens,
};
use crate::workload::RequestClass;

/// Latencies are recorded in nanoseconds from 1 ns to one hour, 3 significant digits.
const MAX_NS: u64 = 3_600_000_000_000;
/// Per-request records kept at most (bounds memory on long runs).
pub const MAX_RECORDS: usize = 1_000_000;
/// Quantiles at which CDF points are taken.
const CDF_STEPS: u32 = 100;

fn latency_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_NS, 3).expect("constant histogram bounds are valid")
}

fn record(h: &mut Histogram<u64>, v: u64) {
    // Values outside the bounds are clamped, never dropped.
    let _ = h.record(v.clamp(1, MAX_NS));
}

/// One finished request, as the runner hands it over.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    /// What the client saw.
    pub outcome: &'a Outcome,
    /// Gaps between content chunks, nanoseconds.
    pub gaps: &'a [u64],
    /// Prompt tokens by the benchmark's tokenizer.
    pub input_tokens: u32,
    /// Generated tokens (usage, else counted).
    pub output_tokens: u32,
    /// How late it left against its schedule (open loop only).
    pub lag: Option<Duration>,
    /// Conversation index.
    pub conversation: usize,
    /// Turn index.
    pub turn: usize,
    /// Class of a mixed-workload request, whose figures are also kept apart.
    pub class: Option<RequestClass>,
}

/// Accumulates one level.
#[derive(Debug)]
pub struct Collector {
    t0: Instant,
    slo: Slo,
    keep_records: bool,
    ttft: Histogram<u64>,
    /// Servers' reported KV transfer times (nanoseconds).
    kv_transfer: Histogram<u64>,
    itl: Histogram<u64>,
    tpot: Histogram<u64>,
    e2e: Histogram<u64>,
    lag: Histogram<u64>,
    isl: Histogram<u64>,
    osl: Histogram<u64>,
    completed: u64,
    failed: u64,
    good: u64,
    errors: BTreeMap<ErrorClass, u64>,
    input_total: u64,
    output_total: u64,
    server_prompt: Option<u64>,
    cached: Option<u64>,
    cache_prompt: u64,
    cache_hit: u64,
    first_start: Option<Instant>,
    last_end: Option<Instant>,
    records: Vec<RequestRecord>,
    records_dropped: u64,
    resent: u64,
    classes: BTreeMap<RequestClass, Collector>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Collector {
    /// An empty collector for a level that starts at `t0`.
    pub fn new(t0: Instant, slo: Slo, keep_records: bool) -> Self {
        Self {
            t0,
            slo,
            keep_records,
            ttft: latency_hist(),
            kv_transfer: latency_hist(),
            itl: latency_hist(),
            tpot: latency_hist(),
            e2e: latency_hist(),
            lag: latency_hist(),
            isl: latency_hist(),
            osl: latency_hist(),
            completed: 0,
            failed: 0,
            good: 0,
            errors: BTreeMap::new(),
            input_total: 0,
            output_total: 0,
            server_prompt: None,
            cached: None,
            cache_prompt: 0,
            cache_hit: 0,
            first_start: None,
            last_end: None,
            records: Vec::new(),
            records_dropped: 0,
            resent: 0,
            classes: BTreeMap::new(),
        }
    }

    /// Adds one request.
    pub fn add(&mut self, f: &Finished<'_>) {
        if let Some(class) = f.class {
            let (t0, slo) = (self.t0, self.slo);
            let sub = self.classes.entry(class).or_insert_with(|| Collector::new(t0, slo, false));
            sub.add(&Finished { class: None, ..*f });
        }
        let o = f.outcome;
        self.resent += u64::from(o.resent);
        self.first_start = Some(self.first_start.map_or(o.start, |s| s.min(o.start)));
        self.last_end = Some(self.last_end.map_or(o.end, |e| e.max(o.end)));
        if let Some(lag) = f.lag {
            record(&mut self.lag, lag.as_nanos() as u64);
        }
        let e2e = o.end.duration_since(o.start);
        let ttft = o.first_token.map(|t| t.duration_since(o.start));
        let usage = o.usage;
        if self.keep_records {
            if self.records.len() < MAX_RECORDS {
                self.records.push(RequestRecord {
                    conversation: f.conversation.try_into().unwrap_or(u32::MAX),
                    turn: f.turn.try_into().unwrap_or(u32::MAX),
                    start_ms: ms(o.start.saturating_duration_since(self.t0)),
                    ttft_ms: ttft.map(ms),
                    e2e_ms: ms(e2e),
                    input_tokens: f.input_tokens,
                    output_tokens: f.output_tokens,
                    server_prompt_tokens: usage.and_then(|u| u.prompt_tokens),
                    cached_tokens: usage.and_then(|u| u.cached_tokens()),
                    kv_transfer_ms: usage.and_then(|u| u.kv_transfer_ms),
                    error: o.error,
                    class: f.class,
                });
            } else {
                self.records_dropped += 1;
            }
        }
        if let Some(class) = o.error {
            self.failed += 1;
            *self.errors.entry(class).or_default() += 1;
            return;
        }
        self.completed += 1;
        record(&mut self.e2e, e2e.as_nanos() as u64);
        record(&mut self.isl, u64::from(f.input_tokens));
        record(&mut self.osl, u64::from(f.output_tokens));
        self.input_total += u64::from(f.input_tokens);
        self.output_total += u64::from(f.output_tokens);
        for &g in f.gaps {
            record(&mut self.itl, g);
        }
        let mut tpot = None;
        if let Some(t) = ttft {
            record(&mut self.ttft, t.as_nanos() as u64);
            if f.output_tokens >= 2 {
                let per = e2e.saturating_sub(t).as_nanos() as u64 / u64::from(f.output_tokens - 1);
                record(&mut self.tpot, per);
                tpot = Some(per);
            }
        }
        if let Some(u) = usage {
            if let Some(p) = u.prompt_tokens {
                *self.server_prompt.get_or_insert(0) += p;
            }
            if let Some(c) = u.cached_tokens() {
                *self.cached.get_or_insert(0) += c;
                self.cache_hit += c;
                self.cache_prompt += u.prompt_tokens.unwrap_or(0);
            }
            if let Some(t) = u.kv_transfer_ms.filter(|t| t.is_finite() && *t >= 0.0) {
                record(&mut self.kv_transfer, (t * 1e6) as u64);
            }
        }
        let ttft_ok = match (self.slo.ttft_ms, ttft) {
            (None, _) => true,
            (Some(limit), Some(t)) => ms(t) <= limit,
            (Some(_), None) => false,
        };
        let itl_ok = match (self.slo.itl_ms, tpot) {
            (Some(limit), Some(ns)) => ns as f64 / 1e6 <= limit,
            _ => true,
        };
        if ttft_ok && itl_ok {
            self.good += 1;
        }
    }

    /// Turns the level into its report.
    pub fn finish(self, level: Level, peak_in_flight: u64) -> RunReport {
        let duration = match (self.first_start, self.last_end) {
            (Some(s), Some(e)) => e.duration_since(s).as_secs_f64(),
            _ => 0.0,
        };
        let all = self.summary(duration);
        // Rates of a class are over the whole level, so the classes' rates add up.
        let classes = self.classes.iter().map(|(k, c)| (k.to_string(), c.summary(duration)));
        RunReport {
            level,
            duration_s: duration,
            requests: all.requests,
            errors: self.errors.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            throughput: all.throughput,
            latency_ms: all.latency_ms,
            tokens: all.tokens,
            client: ClientStats {
                schedule_lag_ms: stats(&self.lag, 1e6),
                peak_in_flight,
                records_dropped: self.records_dropped,
                resent: self.resent,
            },
            cdf_ms: Cdfs {
                ttft: cdf(&self.ttft),
                itl: cdf(&self.itl),
                tpot: cdf(&self.tpot),
                e2e: cdf(&self.e2e),
            },
            classes: classes.collect(),
            request_records: self.records,
        }
    }

    /// Counts, rates over `duration` seconds, latencies and tokens of what was added.
    fn summary(&self, duration: f64) -> ClassReport {
        let per_s = |n: u64| if duration > 0.0 { n as f64 / duration } else { 0.0 };
        let sent = self.completed + self.failed;
        let has_slo = self.slo.ttft_ms.is_some() || self.slo.itl_ms.is_some();
        ClassReport {
            requests: Counts { sent, completed: self.completed, failed: self.failed },
            throughput: Throughput {
                requests_per_s: per_s(self.completed),
                output_tokens_per_s: per_s(self.output_total),
                input_tokens_per_s: per_s(self.input_total),
                goodput_requests_per_s: has_slo.then(|| per_s(self.good)),
                good_fraction: (has_slo && sent > 0).then(|| self.good as f64 / sent as f64),
            },
            latency_ms: Latencies {
                ttft: stats(&self.ttft, 1e6),
                itl: stats(&self.itl, 1e6),
                tpot: stats(&self.tpot, 1e6),
                e2e: stats(&self.e2e, 1e6),
                kv_transfer: stats(&self.kv_transfer, 1e6),
            },
            tokens: Tokens {
                input_total: self.input_total,
                output_total: self.output_total,
                input_per_request: stats(&self.isl, 1.0),
                output_per_request: stats(&self.osl, 1.0),
                server_prompt_total: self.server_prompt,
                cached_total: self.cached,
                cache_hit_ratio: (self.cache_prompt > 0)
                    .then(|| self.cache_hit as f64 / self.cache_prompt as f64),
            },
        }
    }
}

/// Summary of a histogram, divided by `unit` (1e6 turns nanoseconds into milliseconds).
fn stats(h: &Histogram<u64>, unit: f64) -> Option<Stats> {
    if h.is_empty() {
        return None;
    }
    let q = |x: f64| h.value_at_quantile(x) as f64 / unit;
    Some(Stats {
        count: h.len(),
        mean: h.mean() / unit,
        stddev: h.stdev() / unit,
        min: h.min() as f64 / unit,
        p50: q(0.50),
        p90: q(0.90),
        p95: q(0.95),
        p99: q(0.99),
        p999: q(0.999),
        max: h.max() as f64 / unit,
    })
}

fn cdf(h: &Histogram<u64>) -> Vec<[f64; 2]> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut pts = Vec::with_capacity(CDF_STEPS as usize + 4);
    pts.push([h.min() as f64 / 1e6, 0.0]);
    let mut qs: Vec<f64> = (1..CDF_STEPS).map(|i| f64::from(i) / f64::from(CDF_STEPS)).collect();
    qs.extend([0.995, 0.999]);
    for q in qs {
        pts.push([h.value_at_quantile(q) as f64 / 1e6, q]);
    }
    pts.push([h.max() as f64 / 1e6, 1.0]);
    pts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::{PromptTokensDetails, Usage};

    fn outcome(t0: Instant, start_ms: u64, ttft_ms: Option<u64>, e2e_ms: u64) -> Outcome {
        let start = t0 + Duration::from_millis(start_ms);
        Outcome {
            start,
            first_token: ttft_ms.map(|t| start + Duration::from_millis(t)),
            end: start + Duration::from_millis(e2e_ms),
            content_chunks: 0,
            usage: None,
            error: None,
            resent: false,
            retry_after: None,
        }
    }

    fn level() -> Level {
        Level { mode: "concurrency".into(), value: 1.0, label: "c=1".into() }
    }

    #[test]
    fn aggregates_latencies_throughput_and_goodput() {
        let t0 = Instant::now();
        let slo = Slo { ttft_ms: Some(50.0), itl_ms: Some(10.0) };
        let mut c = Collector::new(t0, slo, true);
        // 10 requests back to back, each 100 ms: ttft 10*i ms, 11 tokens -> tpot (100-ttft)/10.
        for i in 0..10u64 {
            let o = outcome(t0, i * 100, Some(10 * i), 100);
            let gaps = vec![9_000_000; 10];
            c.add(&Finished {
                outcome: &o,
                gaps: &gaps,
                input_tokens: 20,
                output_tokens: 11,
                lag: None,
                conversation: i as usize,
                turn: 0,
                class: None,
            });
        }
        let mut failed = outcome(t0, 50, None, 5);
        failed.error = Some(ErrorClass::Http(503));
        c.add(&Finished {
            outcome: &failed,
            gaps: &[],
            input_tokens: 20,
            output_tokens: 0,
            lag: None,
            conversation: 99,
            turn: 0,
            class: None,
        });
        let r = c.finish(level(), 3);
        assert_eq!(r.requests, Counts { sent: 11, completed: 10, failed: 1 });
        assert_eq!(r.errors.get("http_503"), Some(&1));
        assert!((r.duration_s - 1.0).abs() < 1e-9);
        assert!((r.throughput.requests_per_s - 10.0).abs() < 1e-6);
        assert!((r.throughput.output_tokens_per_s - 110.0).abs() < 1e-6);
        let ttft = r.latency_ms.ttft.unwrap();
        assert_eq!(ttft.count, 10);
        assert!((ttft.mean - 45.0).abs() < 0.1 && (ttft.max - 90.0).abs() < 0.1);
        assert!((ttft.p50 - 40.0).abs() < 0.1, "{}", ttft.p50);
        assert_eq!(r.latency_ms.itl.unwrap().count, 100);
        assert!((r.latency_ms.itl.unwrap().p99 - 9.0).abs() < 0.01);
        // Good: ttft <= 50 and tpot = (100 - ttft)/10 <= 10 -> ttft in {0,..,50}: 6 requests.
        assert_eq!(r.throughput.good_fraction, Some(6.0 / 11.0));
        assert!((r.throughput.goodput_requests_per_s.unwrap() - 6.0).abs() < 1e-6);
        assert_eq!(r.request_records.len(), 11);
        assert_eq!(r.client.peak_in_flight, 3);
        let cdf = &r.cdf_ms.ttft;
        assert!(cdf.windows(2).all(|w| w[0][0] <= w[1][0] && w[0][1] <= w[1][1]));
        assert_eq!(cdf.last().unwrap()[1], 1.0);
    }

    #[test]
    fn reported_kv_transfers_are_summarized_and_kept_per_request() {
        let t0 = Instant::now();
        let mut c = Collector::new(t0, Slo::default(), true);
        for (i, kv) in [None, Some(4.0), Some(12.0)].into_iter().enumerate() {
            let mut o = outcome(t0, i as u64, Some(1), 2);
            o.usage = Some(Usage { kv_transfer_ms: kv, ..Usage::default() });
            c.add(&Finished {
                outcome: &o,
                gaps: &[],
                input_tokens: 60,
                output_tokens: 1,
                lag: None,
                conversation: i,
                turn: 0,
                class: None,
            });
        }
        let r = c.finish(level(), 1);
        let kv = r.latency_ms.kv_transfer.expect("two requests reported a transfer");
        assert_eq!(kv.count, 2);
        assert!((kv.max - 12.0).abs() < 0.1, "{kv:?}");
        let per: Vec<_> = r.request_records.iter().map(|x| x.kv_transfer_ms).collect();
        assert_eq!(per, [None, Some(4.0), Some(12.0)]);
        let none = Collector::new(t0, Slo::default(), false).finish(level(), 0);
        assert!(none.latency_ms.kv_transfer.is_none());
    }

    #[test]
    fn cached_tokens_sum_only_over_reporting_requests() {
        let t0 = Instant::now();
        let mut c = Collector::new(t0, Slo::default(), false);
        for (i, cached) in [None, Some(32u64), Some(0)].into_iter().enumerate() {
            let mut o = outcome(t0, i as u64, Some(1), 2);
            o.usage = Some(Usage {
                prompt_tokens: Some(64),
                completion_tokens: Some(1),
                prompt_tokens_details: cached
                    .map(|c| PromptTokensDetails { cached_tokens: Some(c) }),
                kv_transfer_ms: None,
            });
            c.add(&Finished {
                outcome: &o,
                gaps: &[],
                input_tokens: 60,
                output_tokens: 1,
                lag: Some(Duration::from_micros(5)),
                conversation: i,
                turn: 0,
                class: None,
            });
        }
        let r = c.finish(level(), 1);
        assert_eq!(r.tokens.server_prompt_total, Some(192));
        assert_eq!(r.tokens.cached_total, Some(32));
        assert_eq!(r.tokens.cache_hit_ratio, Some(0.25));
        assert!(r.throughput.goodput_requests_per_s.is_none());
        assert!(r.request_records.is_empty());
        assert_eq!(r.client.schedule_lag_ms.unwrap().count, 3);
    }

    #[test]
    fn classes_are_aggregated_apart_and_survive_json() {
        let t0 = Instant::now();
        let mut c = Collector::new(t0, Slo::default(), true);
        // Four stream requests of 10 tokens (9 gaps of 2 ms) and one burst of 2 tokens (one
        // gap of 50 ms), over 1 s in all.
        for i in 0..5u64 {
            let burst = i == 2;
            let (class, ttft, tokens, gaps) = if burst {
                (RequestClass::Burst, 100, 2, vec![50_000_000])
            } else {
                (RequestClass::Stream, 5, 10, vec![2_000_000; 9])
            };
            let o = outcome(t0, i * 200, Some(ttft), 200);
            c.add(&Finished {
                outcome: &o,
                gaps: &gaps,
                input_tokens: if burst { 300 } else { 16 },
                output_tokens: tokens,
                lag: None,
                conversation: i as usize,
                turn: 0,
                class: Some(class),
            });
        }
        let r = c.finish(level(), 2);
        assert_eq!(r.classes.keys().collect::<Vec<_>>(), ["burst", "stream"]);
        let (s, b) = (&r.classes["stream"], &r.classes["burst"]);
        assert_eq!((s.requests.completed, b.requests.completed), (4, 1));
        assert_eq!(s.latency_ms.itl.unwrap().count, 36);
        assert_eq!(b.latency_ms.itl.unwrap().count, 1);
        assert_eq!(r.latency_ms.itl.unwrap().count, 37, "the overall figures hold both");
        assert!((b.latency_ms.itl.unwrap().max - 50.0).abs() < 0.1);
        assert!((s.latency_ms.itl.unwrap().max - 2.0).abs() < 0.01);
        assert!((s.latency_ms.ttft.unwrap().p99 - 5.0).abs() < 0.01);
        assert!((b.latency_ms.ttft.unwrap().p50 - 100.0).abs() < 0.1);
        // Rates are over the level's second, so they add up.
        assert!((s.throughput.output_tokens_per_s - 40.0).abs() < 1e-6);
        assert!((b.throughput.output_tokens_per_s - 2.0).abs() < 1e-6);
        assert!((r.throughput.output_tokens_per_s - 42.0).abs() < 1e-6);
        assert_eq!((s.tokens.input_total, b.tokens.input_total), (64, 300));
        assert_eq!(r.request_records[2].class, Some(RequestClass::Burst));

        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["classes"]["burst"]["requests"]["completed"], 1);
        assert_eq!(json["classes"]["stream"]["latency_ms"]["itl"]["count"], 36);
        assert_eq!(json["request_records"][2]["class"], "burst");
        let back: RunReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);

        // Without classes neither field is written, and a run without them reads back.
        let mut plain = Collector::new(t0, Slo::default(), true);
        let o = outcome(t0, 0, Some(1), 2);
        plain.add(&Finished {
            outcome: &o,
            gaps: &[],
            input_tokens: 1,
            output_tokens: 1,
            lag: None,
            conversation: 0,
            turn: 0,
            class: None,
        });
        let json = serde_json::to_value(plain.finish(level(), 1)).unwrap();
        assert!(json.get("classes").is_none());
        assert!(json["request_records"][0].get("class").is_none());
        let back: RunReport = serde_json::from_value(json).unwrap();
        assert!(back.classes.is_empty() && back.request_records[0].class.is_none());
    }
}
