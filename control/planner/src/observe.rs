//! What the planner observes: a frontend's `/metrics` (Prometheus text) read into cumulative
//! counters and histograms, and the difference of two reads as one interval's load and
//! latencies — requests arrived (finished, plus the change in those in flight) and finished,
//! mean prompt and output lengths, TTFT and ITL means and
//! 90th percentiles (as PromQL's `histogram_quantile` computes them), workers up by role,
//! and each worker's steps in the interval (the sums its step-time fit needs) and prefill
//! queue.

use std::collections::HashMap;

use kvx_proto::StepSums;
use serde::Serialize;

/// A cumulative histogram: `(upper bound, count at or below it)` in ascending bounds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Buckets, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
    /// Sum of the observations.
    pub sum: f64,
    /// Number of observations.
    pub count: f64,
}

impl Histogram {
    /// The histogram of what was observed between `earlier` and `self` (counters that went
    /// down, as after a restart, count from zero).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let reset = self.count < earlier.count;
        let minus = |now: f64, then: f64| if reset { now } else { (now - then).max(0.0) };
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, c)| {
                let then = earlier.buckets.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
                (le, minus(c, then))
            })
            .collect();
        Histogram {
            buckets,
            sum: minus(self.sum, earlier.sum),
            count: minus(self.count, earlier.count),
        }
    }

    /// Adds `other`'s observations (buckets with the same bound add up).
    pub fn merge(&mut self, other: &Histogram) {
        self.sum += other.sum;
        self.count += other.count;
        self.buckets.extend_from_slice(&other.buckets);
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.buckets.dedup_by(|later, first| {
            let same = later.0 == first.0;
            if same {
                first.1 += later.1;
            }
            same
        });
    }

    /// The mean, `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile, interpolated linearly inside its bucket (a quantile in the `+Inf`
    /// bucket is the highest finite bound); `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut prev = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(prev.0);
                }
                let width = c - prev.1;
                let t = if width > 0.0 { (rank - prev.1) / width } else { 1.0 };
                return Some(prev.0 + t * (le - prev.0));
            }
            prev = (le, c);
        }
        Some(prev.0)
    }
}

/// One read of a frontend's metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Requests finished (every reason).
    pub requests: f64,
    /// Requests in flight at the read.
    pub inflight: f64,
    /// Requests admission refused (overloaded: demand not served).
    pub refused: f64,
    /// Prompt tokens of the requests.
    pub input_tokens: f64,
    /// Output tokens.
    pub output_tokens: f64,
    /// Time to first token, seconds.
    pub ttft: Histogram,
    /// Inter-token latency, seconds.
    pub itl: Histogram,
    /// Workers up, by role (`agg`, `prefill`, `decode`).
    pub workers: HashMap<String, u32>,
    /// Each worker up: its role, step sums and prefill queue, by worker id.
    pub steps: HashMap<String, WorkerSteps>,
    /// The counters by frontend (the `instance` label a Prometheus server adds; "" for a
    /// frontend read directly), differenced one by one: a frontend that restarts counts
    /// from zero without the others' counts.
    per_frontend: HashMap<String, Counters>,
}

/// One frontend's counters.
#[derive(Debug, Clone, Default, PartialEq)]
struct Counters {
    requests: f64,
    refused: f64,
    input_tokens: f64,
    output_tokens: f64,
    ttft: Histogram,
    itl: Histogram,
}

impl Counters {
    /// From `earlier` to `self` (counters that went down, as after a restart, count from
    /// zero).
    fn since(&self, earlier: &Counters) -> Counters {
        let d = |now: f64, then: f64| if now < then { now } else { now - then };
        Counters {
            requests: d(self.requests, earlier.requests),
            refused: d(self.refused, earlier.refused),
            input_tokens: d(self.input_tokens, earlier.input_tokens),
            output_tokens: d(self.output_tokens, earlier.output_tokens),
            ttft: self.ttft.since(&earlier.ttft),
            itl: self.itl.since(&earlier.itl),
        }
    }

    fn add(&mut self, o: &Counters) {
        self.requests += o.requests;
        self.refused += o.refused;
        self.input_tokens += o.input_tokens;
        self.output_tokens += o.output_tokens;
        self.ttft.merge(&o.ttft);
        self.itl.merge(&o.itl);
    }
}

/// A worker's steps: cumulative in a [`Sample`], the interval's in an [`Observation`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerSteps {
    /// Its role.
    pub role: String,
    /// Sums over its steps.
    pub sums: StepSums,
    /// Prompt tokens queued at the read.
    pub queued: f64,
}

/// One interval's load and latencies.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Observation {
    /// Requests that arrived in it (those finished and those admission refused, plus the
    /// change in those in flight).
    pub requests: f64,
    /// Requests finished in it.
    pub finished: f64,
    /// Requests in flight at its end.
    pub inflight: f64,
    /// Mean prompt tokens of the requests finished (0 when none).
    pub isl: f64,
    /// Mean output tokens.
    pub osl: f64,
    /// TTFT mean and 90th percentile, milliseconds (`None` when nothing was measured).
    pub ttft_mean_ms: Option<f64>,
    /// TTFT p90, milliseconds.
    pub ttft_p90_ms: Option<f64>,
    /// ITL mean, milliseconds.
    pub itl_mean_ms: Option<f64>,
    /// ITL p90, milliseconds.
    pub itl_p90_ms: Option<f64>,
    /// Workers up at its end, by role.
    pub workers: HashMap<String, u32>,
    /// Each worker up at its end: its steps in the interval (all of them for one that was
    /// not up at the start), by worker id.
    #[serde(skip)]
    pub steps: HashMap<String, WorkerSteps>,
}

impl Sample {
    /// Reads the Prometheus text format. Unknown series are ignored; a malformed line of a
    /// series it reads is an error. Several frontends' series (a Prometheus server's
    /// federation, told apart by `instance`) are kept apart and summed; a worker that several
    /// frontends report counts once.
    pub fn parse(text: &str) -> Result<Sample, String> {
        let mut s = Sample::default();
        let mut up: HashMap<String, bool> = HashMap::new();
        let mut roles: HashMap<String, String> = HashMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = split_series(line).ok_or_else(|| format!("bad line {line:?}"))?;
            let (name, labels) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            let wanted = matches!(
                name,
                "kvx_requests_finished_total"
                    | "kvx_inflight_requests"
                    | "kvx_admission_refused_total"
                    | "kvx_input_tokens_total"
                    | "kvx_output_tokens_total"
                    | "kvx_worker_up"
                    | "kvx_worker_role"
                    | "kvx_worker_step_sums"
                    | "kvx_worker_prefill_queue_tokens"
            ) || name.starts_with("kvx_time_to_first_token_seconds")
                || name.starts_with("kvx_inter_token_latency_seconds");
            if !wanted {
                continue;
            }
            let v = parse_value(value).ok_or_else(|| format!("bad value in {line:?}"))?;
            let label = |key: &str| label(labels, key);
            let c = s.per_frontend.entry(label("instance").unwrap_or_default()).or_default();
            match name {
                "kvx_requests_finished_total" => c.requests += v,
                "kvx_inflight_requests" => s.inflight += v,
                "kvx_admission_refused_total" => c.refused += v,
                "kvx_input_tokens_total" => c.input_tokens += v,
                "kvx_output_tokens_total" => c.output_tokens += v,
                "kvx_worker_up" => {
                    if let Some(w) = label("worker") {
                        up.insert(w, v > 0.0);
                    }
                }
                "kvx_worker_role" => {
                    if let (Some(w), Some(r), true) = (label("worker"), label("role"), v > 0.0) {
                        roles.insert(w, r);
                    }
                }
                "kvx_worker_step_sums" => {
                    if let (Some(w), Some(sum)) = (label("worker"), label("sum")) {
                        s.steps.entry(w).or_default().sums.set(&sum, v);
                    }
                }
                "kvx_worker_prefill_queue_tokens" => {
                    if let Some(w) = label("worker") {
                        s.steps.entry(w).or_default().queued = v;
                    }
                }
                _ => {
                    let (h, part) = if let Some(p) =
                        name.strip_prefix("kvx_time_to_first_token_seconds")
                    {
                        (&mut c.ttft, p)
                    } else if let Some(p) = name.strip_prefix("kvx_inter_token_latency_seconds") {
                        (&mut c.itl, p)
                    } else {
                        continue;
                    };
                    match part {
                        "_sum" => h.sum += v,
                        "_count" => h.count += v,
                        "_bucket" => {
                            let le = label("le").and_then(|l| parse_value(&l));
                            let le = le.ok_or_else(|| format!("bucket without le in {line:?}"))?;
                            h.buckets.push((le, v));
                        }
                        _ => {}
                    }
                }
            }
        }
        s.per_frontend.retain(|_, c| *c != Counters::default());
        let mut total = Counters::default();
        for c in s.per_frontend.values_mut() {
            for h in [&mut c.ttft, &mut c.itl] {
                h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            total.add(c);
        }
        (s.requests, s.refused, s.input_tokens, s.output_tokens) =
            (total.requests, total.refused, total.input_tokens, total.output_tokens);
        (s.ttft, s.itl) = (total.ttft, total.itl);
        s.steps.retain(|w, _| up.get(w).copied().unwrap_or(false));
        for (w, r) in roles {
            if up.get(&w).copied().unwrap_or(false) {
                *s.workers.entry(r.clone()).or_default() += 1;
                s.steps.entry(w).or_default().role = r;
            }
        }
        Ok(s)
    }

    /// The interval from `earlier` to `self`.
    pub fn since(&self, earlier: &Sample) -> Observation {
        let mut c = Counters::default();
        for (f, now) in &self.per_frontend {
            c.add(&now.since(earlier.per_frontend.get(f).unwrap_or(&Counters::default())));
        }
        let finished = c.requests;
        let per = |t: f64| if finished > 0.0 { t / finished } else { 0.0 };
        let requests = (finished + c.refused + self.inflight - earlier.inflight).max(0.0);
        let (ttft, itl) = (c.ttft, c.itl);
        let ms = |v: Option<f64>| v.map(|s| s * 1e3);
        Observation {
            requests,
            finished,
            inflight: self.inflight,
            isl: per(c.input_tokens),
            osl: per(c.output_tokens),
            ttft_mean_ms: ms(ttft.mean()),
            ttft_p90_ms: ms(ttft.quantile(0.9)),
            itl_mean_ms: ms(itl.mean()),
            itl_p90_ms: ms(itl.quantile(0.9)),
            workers: self.workers.clone(),
            steps: self
                .steps
                .iter()
                .map(|(w, now)| {
                    let sums = match earlier.steps.get(w) {
                        Some(then) => now.sums.since(&then.sums),
                        None => now.sums,
                    };
                    (w.clone(), WorkerSteps { role: now.role.clone(), sums, queued: now.queued })
                })
                .collect(),
        }
    }
}

/// `name{labels} value [timestamp]` into the series and the value.
fn split_series(line: &str) -> Option<(&str, &str)> {
    let end = match line.find('{') {
        Some(open) => open + line[open..].find('}')? + 1,
        None => line.find(char::is_whitespace)?,
    };
    let value = line[end..].split_whitespace().next()?;
    Some((&line[..end], value))
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

/// The value of `key` in `{a="x",b="y"}` (no escapes inside values are needed for ours).
fn label(labels: &str, key: &str) -> Option<String> {
    let inner = labels.strip_prefix('{')?.strip_suffix('}')?;
    inner.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(finished: u32, input: u32, ttft: [u32; 3], ttft_sum: f64) -> String {
        format!(
            "# TYPE kvx_requests_finished_total counter\n\
             kvx_requests_finished_total{{reason=\"length\"}} {finished}\n\
             kvx_requests_finished_total{{reason=\"stop\"}} 0\n\
             kvx_input_tokens_total {input}\nkvx_output_tokens_total {}\n\
             kvx_inflight_requests {}\n\
             kvx_admission_refused_total{{reason=\"wait\"}} {}\n\
             kvx_time_to_first_token_seconds_bucket{{le=\"0.1\"}} {}\n\
             kvx_time_to_first_token_seconds_bucket{{le=\"0.5\"}} {}\n\
             kvx_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}\n\
             kvx_time_to_first_token_seconds_sum {ttft_sum}\n\
             kvx_time_to_first_token_seconds_count {}\n\
             kvx_worker_up{{worker=\"1\"}} 1\nkvx_worker_up{{worker=\"2\"}} 0\nkvx_worker_up{{worker=\"3\"}} 1\n\
             kvx_worker_role{{worker=\"1\",role=\"prefill\"}} 1\n\
             kvx_worker_role{{worker=\"2\",role=\"decode\"}} 1\n\
             kvx_worker_role{{worker=\"3\",role=\"decode\"}} 1\n\
             kvx_worker_step_sums{{worker=\"1\",sum=\"n\"}} {finished}\n\
             kvx_worker_step_sums{{worker=\"1\",sum=\"y\"}} {ttft_sum}\n\
             kvx_worker_step_sums{{worker=\"2\",sum=\"n\"}} 7\n\
             kvx_worker_prefill_queue_tokens{{worker=\"1\"}} 300\n\
             kvx_unrelated{{a=\"b\"}} 5 1700000000\n",
            finished * 10,
            finished / 10,
            finished / 5,
            ttft[0],
            ttft[1],
            ttft[2],
            ttft[2]
        )
    }

    #[test]
    fn an_interval_is_the_difference_of_two_reads() {
        let a = Sample::parse(&text(10, 1000, [5, 10, 10], 1.0)).unwrap();
        let b = Sample::parse(&text(30, 5000, [5, 28, 30], 6.0)).unwrap();
        assert_eq!(b.workers.get("decode"), Some(&1), "worker 2 is down");
        assert_eq!(b.workers.get("prefill"), Some(&1));
        let o = b.since(&a);
        // 20 finished, 4 refused, and in flight from 1 to 3: 26 arrived.
        assert_eq!((o.requests, o.finished), (26.0, 20.0));
        assert_eq!(o.isl, 200.0);
        assert_eq!(o.osl, 10.0);
        assert!((o.ttft_mean_ms.unwrap() - 250.0).abs() < 1e-9);
        // 20 new TTFTs: 0 under 0.1 s, 18 in (0.1, 0.5], 2 above. p90 = rank 18 = 0.5 s.
        assert!((o.ttft_p90_ms.unwrap() - 500.0).abs() < 1e-9);
        assert_eq!(o.itl_mean_ms, None, "no ITL series");
        assert_eq!(o.steps.len(), 2, "workers 1 and 3 are up, 2 is down");
        assert_eq!(o.steps["3"].sums.n, 0.0);
        let w1 = &o.steps["1"];
        assert_eq!(
            (w1.role.as_str(), w1.sums.n, w1.sums.y, w1.queued),
            ("prefill", 20.0, 5.0, 300.0)
        );
    }

    /// Two frontends' series as a Prometheus server federates them (extra labels, timestamps):
    /// the sum of both.
    #[test]
    fn federated_series_of_several_frontends_add_up() {
        let one = |instance: &str, f: u32, inflight: u32| {
            format!(
                "# TYPE kvx_requests_finished_total counter\n\
                 kvx_requests_finished_total{{instance=\"{instance}\",job=\"kvx\",reason=\"stop\"}} {f} 1733400000000\n\
                 kvx_inflight_requests{{instance=\"{instance}\",job=\"kvx\"}} {inflight} 1733400000000\n\
                 kvx_time_to_first_token_seconds_bucket{{instance=\"{instance}\",job=\"kvx\",le=\"0.1\"}} {f} 1733400000000\n\
                 kvx_time_to_first_token_seconds_bucket{{instance=\"{instance}\",job=\"kvx\",le=\"+Inf\"}} {f} 1733400000000\n\
                 kvx_time_to_first_token_seconds_sum{{instance=\"{instance}\",job=\"kvx\"}} 0.5 1733400000000\n\
                 kvx_time_to_first_token_seconds_count{{instance=\"{instance}\",job=\"kvx\"}} {f} 1733400000000\n"
            )
        };
        let s = Sample::parse(&(one("a:1", 10, 2) + &one("b:2", 30, 3))).unwrap();
        assert_eq!((s.requests, s.inflight), (40.0, 5.0));
        assert_eq!(s.ttft.buckets, vec![(0.1, 40.0), (f64::INFINITY, 40.0)]);
        assert_eq!((s.ttft.sum, s.ttft.count), (1.0, 40.0));
        // Frontend a restarts (10 → 4), b goes on (30 → 35): 4 + 5 finished, not 39.
        let later = Sample::parse(&(one("a:1", 4, 0) + &one("b:2", 35, 0))).unwrap();
        let o = later.since(&s);
        assert_eq!(o.finished, 9.0);
        assert!((o.ttft_mean_ms.unwrap() - 1e3 * 0.5 / 9.0).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn quantiles_follow_histogram_quantile() {
        let h = Histogram {
            buckets: vec![(0.1, 10.0), (0.2, 30.0), (f64::INFINITY, 40.0)],
            sum: 0.0,
            count: 40.0,
        };
        assert!((h.quantile(0.5).unwrap() - 0.15).abs() < 1e-12);
        assert!((h.quantile(0.25).unwrap() - 0.1).abs() < 1e-12);
        assert!((h.quantile(0.125).unwrap() - 0.05).abs() < 1e-12);
        assert_eq!(h.quantile(0.9), Some(0.2), "in +Inf: the highest finite bound");
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn restarts_count_from_zero_and_bad_lines_are_errors() {
        let a = Sample::parse(&text(50, 9000, [5, 10, 10], 9.0)).unwrap();
        let b = Sample::parse(&text(5, 500, [1, 2, 2], 0.4)).unwrap();
        let o = b.since(&a);
        assert_eq!(o.finished, 5.0);
        assert_eq!(o.isl, 100.0);
        assert!((o.ttft_mean_ms.unwrap() - 200.0).abs() < 1e-9);
        assert!(Sample::parse("kvx_input_tokens_total x\n").is_err());
        assert!(Sample::parse("kvx_time_to_first_token_seconds_bucket 3\n").is_err());
        assert!(Sample::parse("some_other_metric{unterminated 1\n").is_err());
        assert_eq!(Sample::parse("").unwrap(), Sample::default());
    }
}
