//! The terminal summary: one block per load level (with the figures of each request class
//! when the workload has classes), then a sweep table when there are several.

use std::fmt::Write;

use super::{Report, RunReport, Stats};

fn row(out: &mut String, name: &str, s: Option<Stats>) {
    match s {
        Some(s) => {
            let _ = writeln!(
                out,
                "  {name:<18}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}",
                s.mean, s.p50, s.p90, s.p95, s.p99, s.max
            );
        }
        None => {
            let _ = writeln!(out, "  {name:<18}{:>10}", "-");
        }
    }
}

fn run_block(out: &mut String, r: &RunReport) {
    let _ = writeln!(
        out,
        "\n== {}: {} ok, {} failed in {:.2} s",
        r.level.label, r.requests.completed, r.requests.failed, r.duration_s
    );
    let _ = writeln!(
        out,
        "  {:<18}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "", "mean", "p50", "p90", "p95", "p99", "max"
    );
    row(out, "TTFT (ms)", r.latency_ms.ttft);
    row(out, "ITL (ms)", r.latency_ms.itl);
    if r.latency_ms.kv_transfer.is_some() {
        row(out, "KV xfer (ms)", r.latency_ms.kv_transfer);
    }
    row(out, "TPOT (ms)", r.latency_ms.tpot);
    row(out, "E2E (ms)", r.latency_ms.e2e);
    row(out, "input tokens", r.tokens.input_per_request);
    row(out, "output tokens", r.tokens.output_per_request);
    let t = &r.throughput;
    let _ = write!(
        out,
        "  throughput        {:.2} req/s, {:.1} output tok/s, {:.1} input tok/s",
        t.requests_per_s, t.output_tokens_per_s, t.input_tokens_per_s
    );
    if let (Some(g), Some(f)) = (t.goodput_requests_per_s, t.good_fraction) {
        let _ = write!(out, ", goodput {g:.2} req/s ({:.1}% good)", f * 100.0);
    }
    out.push('\n');
    for (name, c) in r.classes_in_order() {
        let _ = writeln!(
            out,
            "  {name:<18}{} ok, {} failed, {:.1} output tok/s",
            c.requests.completed, c.requests.failed, c.throughput.output_tokens_per_s
        );
        row(out, "  TTFT (ms)", c.latency_ms.ttft);
        row(out, "  ITL (ms)", c.latency_ms.itl);
    }
    if let Some(cached) = r.tokens.cached_total {
        let _ = writeln!(
            out,
            "  prefix cache      {cached} cached of {} prompt tokens ({:.1}%)",
            r.tokens.server_prompt_total.unwrap_or(0),
            r.tokens.cache_hit_ratio.unwrap_or(0.0) * 100.0
        );
    }
    if !r.errors.is_empty() {
        let list: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(out, "  errors            {}", list.join(", "));
    }
    let _ = write!(out, "  client            peak {} in flight", r.client.peak_in_flight);
    if let Some(lag) = r.client.schedule_lag_ms {
        let _ = write!(out, ", schedule lag p50 {:.3} ms p99 {:.3} ms", lag.p50, lag.p99);
    }
    if r.client.resent > 0 {
        let _ = write!(out, ", {} resent (connection closed unanswered)", r.client.resent);
    }
    out.push('\n');
}

/// A plain-text summary of the report for terminals.
pub fn summary_table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvx bench: {} ({:?}, model {})",
        report.target.url, report.target.api, report.target.model
    );
    let _ = writeln!(
        out,
        "workload: {} [tokenizer {}]",
        report.workload.description, report.workload.tokenizer
    );
    let bound = match (report.load.max_requests, report.load.duration_s) {
        (Some(n), Some(d)) => format!("{n} requests or {d} s per level"),
        (Some(n), None) => format!("{n} requests per level"),
        (None, Some(d)) => format!("{d} s per level"),
        (None, None) => "the whole dataset per level".to_string(),
    };
    let _ = writeln!(
        out,
        "load: {}, {bound}, warm-up {}, seed {}",
        report.load.mode, report.load.warmup_requests, report.seed
    );
    for r in &report.runs {
        run_block(&mut out, r);
    }
    if report.runs.len() > 1 {
        let _ = writeln!(
            out,
            "\n{:<14}{:>9}{:>11}{:>10}{:>10}{:>9}{:>9}{:>10}{:>8}",
            "level",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "E2E p50",
            "failed"
        );
        for r in &report.runs {
            let p = |s: Option<Stats>, f: fn(&Stats) -> f64| s.map_or(f64::NAN, |s| f(&s));
            let _ = writeln!(
                out,
                "{:<14}{:>9.2}{:>11.1}{:>10.2}{:>10.2}{:>9.2}{:>9.2}{:>10.2}{:>8}",
                r.level.label,
                r.throughput.requests_per_s,
                r.throughput.output_tokens_per_s,
                p(r.latency_ms.ttft, |s| s.p50),
                p(r.latency_ms.ttft, |s| s.p99),
                p(r.latency_ms.itl, |s| s.p50),
                p(r.latency_ms.itl, |s| s.p99),
                p(r.latency_ms.e2e, |s| s.p50),
                r.requests.failed
            );
        }
    }
    out
}
