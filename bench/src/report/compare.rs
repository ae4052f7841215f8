//! `kvx bench compare`: two reports side by side, level by level, with B/A ratios (and per
//! request class for classes both levels have).

use std::fmt::Write;

use super::{ClassReport, Report, RunReport, Stats};

type Metric = (&'static str, fn(&RunReport) -> Option<f64>);

fn pick(s: Option<Stats>, f: fn(&Stats) -> f64) -> Option<f64> {
    s.map(|s| f(&s))
}

const METRICS: &[Metric] = &[
    ("TTFT p50 (ms)", |r| pick(r.latency_ms.ttft, |s| s.p50)),
    ("TTFT p90 (ms)", |r| pick(r.latency_ms.ttft, |s| s.p90)),
    ("TTFT p99 (ms)", |r| pick(r.latency_ms.ttft, |s| s.p99)),
    ("ITL p50 (ms)", |r| pick(r.latency_ms.itl, |s| s.p50)),
    ("ITL p90 (ms)", |r| pick(r.latency_ms.itl, |s| s.p90)),
    ("ITL p99 (ms)", |r| pick(r.latency_ms.itl, |s| s.p99)),
    ("TPOT p50 (ms)", |r| pick(r.latency_ms.tpot, |s| s.p50)),
    ("E2E p50 (ms)", |r| pick(r.latency_ms.e2e, |s| s.p50)),
    ("E2E p99 (ms)", |r| pick(r.latency_ms.e2e, |s| s.p99)),
    ("output tok/s", |r| Some(r.throughput.output_tokens_per_s)),
    ("requests/s", |r| Some(r.throughput.requests_per_s)),
    ("goodput req/s", |r| r.throughput.goodput_requests_per_s),
    ("cache hit ratio", |r| r.tokens.cache_hit_ratio),
    ("failed", |r| Some(r.requests.failed as f64)),
];

type ClassMetric = (&'static str, fn(&ClassReport) -> Option<f64>);

/// Compared for each request class both levels have.
const CLASS_METRICS: &[ClassMetric] = &[
    ("TTFT p50 (ms)", |c| pick(c.latency_ms.ttft, |s| s.p50)),
    ("TTFT p99 (ms)", |c| pick(c.latency_ms.ttft, |s| s.p99)),
    ("ITL p50 (ms)", |c| pick(c.latency_ms.itl, |s| s.p50)),
    ("ITL p99 (ms)", |c| pick(c.latency_ms.itl, |s| s.p99)),
    ("ITL max (ms)", |c| pick(c.latency_ms.itl, |s| s.max)),
    ("output tok/s", |c| Some(c.throughput.output_tokens_per_s)),
];

fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"))
}

/// Levels of `a` and `b` paired in sweep order, each metric with its ratio `B / A`
/// (below 1 is better for latencies, above 1 for rates).
pub fn compare_table(a: &Report, a_name: &str, b: &Report, b_name: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "A = {a_name}: {} ({})", a.target.url, a.workload.description);
    let _ = writeln!(out, "B = {b_name}: {} ({})", b.target.url, b.workload.description);
    if a.workload.config != b.workload.config || a.seed != b.seed {
        let _ = writeln!(out, "note: the workloads or seeds differ");
    }
    if a.runs.len() != b.runs.len() {
        let _ = writeln!(
            out,
            "note: A has {} levels and B has {}; comparing the first {}",
            a.runs.len(),
            b.runs.len(),
            a.runs.len().min(b.runs.len())
        );
    }
    for (ra, rb) in a.runs.iter().zip(&b.runs) {
        let _ = writeln!(out, "\n== A {} vs B {}", ra.level.label, rb.level.label);
        let _ = writeln!(out, "  {:<22}{:>14}{:>14}{:>10}", "metric", "A", "B", "B/A");
        for (name, f) in METRICS {
            line(&mut out, name, f(ra), f(rb));
        }
        for (class, ca) in ra.classes_in_order() {
            let Some(cb) = rb.classes.get(class) else { continue };
            for (name, f) in CLASS_METRICS {
                line(&mut out, &format!("{class} {name}"), f(ca), f(cb));
            }
        }
    }
    out
}

fn line(out: &mut String, name: &str, x: Option<f64>, y: Option<f64>) {
    let ratio = match (x, y) {
        (Some(x), Some(y)) if x != 0.0 => format!("{:.3}", y / x),
        _ => "-".to_string(),
    };
    let _ = writeln!(out, "  {name:<22}{:>14}{:>14}{ratio:>10}", cell(x), cell(y));
}
