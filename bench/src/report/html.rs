//! The HTML report: one self-contained page (inline CSS, inline SVG charts, the JSON report
//! embedded), readable offline in any browser.

use std::fmt::Write;

use super::{Report, RunReport, Stats};

const PALETTE: &[&str] =
    &["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

const W: f64 = 640.0;
const H: f64 = 360.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 52.0;
const BOTTOM: f64 = 48.0;

/// Escapes text for HTML content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A plotted series.
struct Series {
    name: String,
    color: &'static str,
    points: Vec<(f64, f64)>,
    dashed: bool,
}

/// Round tick step covering `range` in about five steps.
fn tick_step(range: f64) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm < 1.5 {
        1.0
    } else if norm < 3.5 {
        2.0
    } else if norm < 7.5 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{v:.0}")
    } else {
        let digits = (-step.log10().floor()) as usize;
        format!("{v:.digits$}")
    }
}

/// An SVG line chart. Points outside `x_max` are clipped to the right edge.
fn chart(
    id: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_max: Option<f64>,
    y_max: Option<f64>,
) -> String {
    let mut svg = String::new();
    let pts = series.iter().flat_map(|s| s.points.iter().copied());
    let (mut xmax, mut ymax) = (0.0f64, 0.0f64);
    for (x, y) in pts {
        if x.is_finite() {
            xmax = xmax.max(x);
        }
        if y.is_finite() {
            ymax = ymax.max(y);
        }
    }
    let xmax = x_max.unwrap_or(xmax * 1.05).max(1e-9);
    let ymax = y_max.unwrap_or(ymax * 1.1).max(1e-9);
    let (xstep, ystep) = (tick_step(xmax), tick_step(ymax));
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x.clamp(0.0, xmax) / xmax) * pw;
    let sy = |y: f64| TOP + ph - (y.clamp(0.0, ymax) / ymax) * ph;
    let _ = write!(
        svg,
        r#"<figure class="chart" id="{id}"><svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{t}">"#,
        t = esc(title)
    );
    let _ = write!(svg, r#"<text class="title" x="{LEFT}" y="20">{}</text>"#, esc(title));
    // Grid and ticks.
    let mut v = 0.0;
    while v <= ymax + ystep * 1e-6 {
        let y = sy(v);
        let _ = write!(
            svg,
            r#"<line class="grid" x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            fmt_tick(v, ystep)
        );
        v += ystep;
    }
    let mut v = 0.0;
    while v <= xmax + xstep * 1e-6 {
        let x = sx(v);
        let _ = write!(
            svg,
            r#"<line class="grid" x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}"/><text class="tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + ph,
            TOP + ph + 16.0,
            fmt_tick(v, xstep)
        );
        v += xstep;
    }
    let _ = write!(
        svg,
        r#"<line class="axis" x1="{LEFT}" y1="{b:.1}" x2="{r:.1}" y2="{b:.1}"/><line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b:.1}"/>"#,
        b = TOP + ph,
        r = LEFT + pw
    );
    let _ = write!(
        svg,
        r#"<text class="label" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text class="label" transform="translate(14 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 8.0,
        esc(x_label),
        TOP + ph / 2.0,
        esc(y_label)
    );
    // Series.
    for s in series {
        if s.points.is_empty() {
            continue;
        }
        let mut d = String::new();
        for (i, &(x, y)) in s.points.iter().enumerate() {
            if !(x.is_finite() && y.is_finite()) {
                continue;
            }
            let _ = write!(d, "{}{:.1},{:.1}", if i > 0 { " " } else { "" }, sx(x), sy(y));
        }
        let dash = if s.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        let _ = write!(
            svg,
            r#"<polyline class="series" data-series="{n}" points="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
            n = esc(&s.name),
            c = s.color
        );
        if s.points.len() <= 32 {
            for &(x, y) in &s.points {
                if x.is_finite() && y.is_finite() {
                    let _ = write!(
                        svg,
                        r#"<circle class="point" cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#,
                        sx(x),
                        sy(y),
                        s.color
                    );
                }
            }
        }
    }
    // Legend.
    for (i, s) in series.iter().enumerate() {
        let x = LEFT + (i % 4) as f64 * 140.0;
        let y = 34.0 + (i / 4) as f64 * 14.0;
        let dash = if s.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        let _ = write!(
            svg,
            r#"<g class="legend"><line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{c}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}">{}</text></g>"#,
            x + 18.0,
            x + 22.0,
            y + 4.0,
            esc(&s.name),
            c = s.color
        );
    }
    svg.push_str("</svg></figure>\n");
    svg
}

fn cdf_chart(
    report: &Report,
    id: &str,
    title: &str,
    pick: fn(&RunReport) -> &Vec<[f64; 2]>,
) -> String {
    let series: Vec<Series> = report
        .runs
        .iter()
        .enumerate()
        .map(|(i, r)| Series {
            name: r.level.label.clone(),
            color: PALETTE[i % PALETTE.len()],
            points: pick(r).iter().map(|p| (p[0], p[1])).collect(),
            dashed: false,
        })
        .collect();
    // Clip the far tail so the body of the distribution stays readable.
    let x_max = series
        .iter()
        .filter_map(|s| s.points.iter().find(|p| p.1 >= 0.999).map(|p| p.0))
        .fold(0.0f64, f64::max);
    let x_max = (x_max > 0.0).then_some(x_max * 1.05);
    chart(id, title, "milliseconds", "fraction of samples", &series, x_max, Some(1.0))
}

fn sweep_chart(
    report: &Report,
    id: &str,
    what: &str,
    pick: fn(&RunReport) -> Option<Stats>,
) -> String {
    let mk = |name: &str, color, dashed, f: fn(&Stats) -> f64| Series {
        name: format!("{what} {name}"),
        color,
        dashed,
        points: report
            .runs
            .iter()
            .filter_map(|r| pick(r).map(|s| (r.throughput.output_tokens_per_s, f(&s))))
            .collect(),
    };
    let series = vec![
        mk("p50", PALETTE[0], false, |s| s.p50),
        mk("p90", PALETTE[2], false, |s| s.p90),
        mk("p99", PALETTE[1], true, |s| s.p99),
    ];
    chart(
        id,
        &format!("{what} vs throughput across the sweep"),
        "output tokens/s",
        &format!("{what} (ms)"),
        &series,
        None,
        None,
    )
}

fn stat_cells(s: Option<Stats>) -> String {
    match s {
        Some(s) => format!(
            "<td>{:.2}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td>",
            s.mean, s.p50, s.p90, s.p99, s.max
        ),
        None => "<td>-</td><td>-</td><td>-</td><td>-</td><td>-</td>".to_string(),
    }
}

fn run_table(r: &RunReport) -> String {
    let mut t = String::new();
    let _ = write!(
        t,
        "<section class=\"run\"><h3>{}</h3><p>{} ok, {} failed in {:.2} s &middot; {:.2} req/s &middot; {:.1} output tok/s",
        esc(&r.level.label),
        r.requests.completed,
        r.requests.failed,
        r.duration_s,
        r.throughput.requests_per_s,
        r.throughput.output_tokens_per_s
    );
    if let Some(g) = r.throughput.goodput_requests_per_s {
        let _ = write!(t, " &middot; goodput {g:.2} req/s");
    }
    if let Some(c) = r.tokens.cache_hit_ratio {
        let _ = write!(t, " &middot; cache hits {:.1}%", c * 100.0);
    }
    if !r.errors.is_empty() {
        let list: Vec<String> = r.errors.iter().map(|(k, v)| format!("{} {v}", esc(k))).collect();
        let _ = write!(t, " &middot; errors: {}", list.join(", "));
    }
    t.push_str("</p><table><thead><tr><th></th><th>mean</th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr></thead><tbody>");
    for (name, s) in [
        ("TTFT (ms)", r.latency_ms.ttft),
        ("ITL (ms)", r.latency_ms.itl),
        ("TPOT (ms)", r.latency_ms.tpot),
        ("E2E (ms)", r.latency_ms.e2e),
        ("input tokens", r.tokens.input_per_request),
        ("output tokens", r.tokens.output_per_request),
    ] {
        let _ = write!(t, "<tr><th>{name}</th>{}</tr>", stat_cells(s));
    }
    t.push_str("</tbody></table>");
    if !r.classes.is_empty() {
        t.push_str("<table class=\"classes\"><thead><tr><th>class</th><th>ok</th><th>failed</th><th>TTFT p50 (ms)</th><th>TTFT p90 (ms)</th><th>TTFT p99 (ms)</th><th>ITL p50 (ms)</th><th>ITL p90 (ms)</th><th>ITL p99 (ms)</th><th>ITL max (ms)</th><th>output tok/s</th></tr></thead><tbody>");
        for (name, c) in r.classes_in_order() {
            let ms = |s: Option<Stats>, f: fn(&Stats) -> f64| {
                s.map_or_else(|| "<td>-</td>".to_string(), |s| format!("<td>{:.2}</td>", f(&s)))
            };
            let (ttft, itl) = (c.latency_ms.ttft, c.latency_ms.itl);
            let _ = write!(
                t,
                "<tr><th>{}</th><td>{}</td><td>{}</td>{}{}{}{}{}{}{}<td>{:.1}</td></tr>",
                esc(name),
                c.requests.completed,
                c.requests.failed,
                ms(ttft, |s| s.p50),
                ms(ttft, |s| s.p90),
                ms(ttft, |s| s.p99),
                ms(itl, |s| s.p50),
                ms(itl, |s| s.p90),
                ms(itl, |s| s.p99),
                ms(itl, |s| s.max),
                c.throughput.output_tokens_per_s
            );
        }
        t.push_str("</tbody></table>");
    }
    t.push_str("</section>\n");
    t
}

/// Renders the report as one HTML page with no external resources.
pub fn render_html(report: &Report) -> String {
    let mut h = String::new();
    let title = format!("kvx bench: {}", report.target.model);
    let _ = write!(
        h,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{t}</title>
<style>
body {{ font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} h2 {{ font-size: 16px; margin: 24px 0 8px; }} h3 {{ font-size: 14px; margin: 16px 0 4px; }}
.meta {{ color: #555; margin: 2px 0; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
figure.chart {{ margin: 0; border: 1px solid #ddd; border-radius: 4px; background: #fff; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #333; }} svg text.title {{ font-size: 13px; font-weight: 600; }}
svg .grid {{ stroke: #eee; }} svg .axis {{ stroke: #888; }}
table {{ border-collapse: collapse; margin: 4px 0 12px; }} th, td {{ padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }}
th:first-child {{ text-align: left; }}
</style></head><body>
<h1>{t}</h1>
<p class="meta">{url} &middot; {api:?} API &middot; {stream}</p>
<p class="meta">workload: {wl} &middot; tokenizer {tok}</p>
<p class="meta">load: {mode} &middot; warm-up {warm} &middot; seed {seed} &middot; kvx-bench {ver}</p>
"#,
        t = esc(&title),
        url = esc(&report.target.url),
        api = report.target.api,
        stream = if report.target.stream { "streaming" } else { "not streaming" },
        wl = esc(&report.workload.description),
        tok = esc(&report.workload.tokenizer),
        mode = esc(&report.load.mode),
        warm = report.load.warmup_requests,
        seed = report.seed,
        ver = esc(&report.version),
    );
    h.push_str("<h2>Latency distributions</h2><div class=\"charts\">\n");
    h.push_str(&cdf_chart(report, "cdf-ttft", "Time to first token (CDF)", |r| &r.cdf_ms.ttft));
    h.push_str(&cdf_chart(report, "cdf-itl", "Inter-token latency (CDF)", |r| &r.cdf_ms.itl));
    h.push_str(&cdf_chart(report, "cdf-e2e", "End-to-end latency (CDF)", |r| &r.cdf_ms.e2e));
    h.push_str("</div>\n<h2>Throughput vs latency</h2><div class=\"charts\">\n");
    h.push_str(&sweep_chart(report, "sweep-ttft", "TTFT", |r| r.latency_ms.ttft));
    h.push_str(&sweep_chart(report, "sweep-itl", "ITL", |r| r.latency_ms.itl));
    h.push_str("</div>\n<h2>Levels</h2>\n");
    for r in &report.runs {
        h.push_str(&run_table(r));
    }
    // The data behind the page travels with it. `</` is escaped so it cannot end the script.
    let json = serde_json::to_string(report).unwrap_or_default().replace("</", "<\\/");
    let _ = write!(
        h,
        "<script type=\"application/json\" id=\"kvx-bench-report\">{json}</script>\n</body></html>\n"
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(100.0), 20.0);
        assert_eq!(tick_step(1.0), 0.2);
        assert_eq!(tick_step(9.0), 2.0);
        assert_eq!(tick_step(0.0), 1.0);
        assert_eq!(fmt_tick(0.4, 0.2), "0.4");
    }

    #[test]
    fn chart_draws_one_polyline_per_series_and_escapes_names() {
        let s = vec![
            Series {
                name: "a<b".into(),
                color: "#000",
                points: vec![(0.0, 0.0), (2.0, 1.0)],
                dashed: false,
            },
            Series {
                name: "c".into(),
                color: "#111",
                points: vec![(1.0, 0.5), (3.0, 0.9)],
                dashed: true,
            },
            Series { name: "empty".into(), color: "#222", points: vec![], dashed: false },
        ];
        let svg = chart("x", "T & t", "x", "y", &s, None, Some(1.0));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.contains("a&lt;b") && svg.contains("T &amp; t"));
        assert!(!svg.contains("NaN"));
    }
}
