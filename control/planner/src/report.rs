//! A profile as an HTML page (`kvx profile --html`): TTFT and prefill tokens/s over prompt
//! length, ITL and decode tokens/s over batch size (a curve per context length), as inline
//! SVG charts, with the worker shape the profile was measured on.

use std::fmt::Write as _;

use kvx_proto::profile::Profile;

/// One curve: a name, a colour and its points.
struct Series {
    name: String,
    color: &'static str,
    points: Vec<(f64, f64)>,
}

const COLORS: [&str; 8] =
    ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// Escapes text for HTML.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// An SVG line chart of `series` (linear axes from 0).
fn chart(title: &str, xlabel: &str, ylabel: &str, series: &[Series]) -> String {
    let (w, h, l, t, b, r) = (640.0, 300.0, 64.0, 28.0, 40.0, 16.0);
    let max = |f: fn(&(f64, f64)) -> f64| {
        series.iter().flat_map(|s| s.points.iter().map(f)).fold(0.0f64, f64::max).max(1e-9) * 1.05
    };
    let (xmax, ymax) = (max(|p| p.0), max(|p| p.1));
    let x = |v: f64| l + v / xmax * (w - l - r);
    let y = |v: f64| t + (h - t - b) * (1.0 - v / ymax);
    let mut s = format!(
        "<h2>{}</h2><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">",
        esc(title)
    );
    let _ = write!(
        s,
        "<rect x=\"{l}\" y=\"{t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
        w - l - r,
        h - t - b
    );
    for k in 0..=4 {
        let f = f64::from(k) / 4.0;
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"11\">{}</text><text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\" font-size=\"11\">{}</text>",
            l - 6.0,
            y(ymax * f) + 4.0,
            tick(ymax * f),
            x(xmax * f),
            h - b + 16.0,
            tick(xmax * f)
        );
    }
    for (i, se) in series.iter().enumerate() {
        let pts: Vec<String> =
            se.points.iter().map(|&(a, v)| format!("{:.1},{:.1}", x(a), y(v))).collect();
        let _ = write!(
            s,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>",
            pts.join(" "),
            se.color
        );
        for &(a, v) in &se.points {
            let _ = write!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{}\"/>",
                x(a),
                y(v),
                se.color
            );
        }
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{}\" font-size=\"12\">{}</text>",
            l + 10.0 + 110.0 * (i % 5) as f64,
            t - 10.0 + 14.0 * (i / 5) as f64 - if series.len() > 5 { 7.0 } else { 0.0 },
            se.color,
            esc(&se.name)
        );
    }
    let _ = write!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"12\">{}</text><text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\" font-size=\"12\">{}</text></svg>",
        (l + w - r) / 2.0,
        h - 6.0,
        esc(xlabel),
        h / 2.0,
        h / 2.0,
        esc(ylabel)
    );
    s
}

/// An axis label: whole numbers past 10, one decimal below.
fn tick(v: f64) -> String {
    if v >= 10.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

/// The profile as a page.
pub fn profile_html(p: &Profile) -> String {
    let sh = &p.shape;
    let prefill = |f: fn(&kvx_proto::profile::PrefillPoint) -> f64, name: &str| Series {
        name: name.into(),
        color: COLORS[0],
        points: p.prefill.iter().map(|q| (f64::from(q.isl), f(q))).collect(),
    };
    let decode = |f: fn(&kvx_proto::profile::DecodePoint) -> f64| -> Vec<Series> {
        p.contexts()
            .iter()
            .enumerate()
            .map(|(i, &c)| Series {
                name: format!("context {c}"),
                color: COLORS[i % COLORS.len()],
                points: p
                    .decode
                    .iter()
                    .filter(|q| q.context == c)
                    .map(|q| (f64::from(q.batch), f(q)))
                    .collect(),
            })
            .collect()
    };
    let mut s = String::from(
        "<!doctype html><meta charset=utf-8><title>kvx profile</title><style>body{font-family:sans-serif;margin:2em}td{border-top:1px solid #ddd;padding:2px 8px;font-size:13px}</style><h1>kvx profile</h1>",
    );
    let _ = write!(
        s,
        "<table><tr><td>engine</td><td>{}</td></tr><tr><td>role</td><td>{}</td></tr><tr><td>model</td><td>{}</td></tr><tr><td>shards × threads</td><td>{} × {}</td></tr><tr><td>SIMD</td><td>{}</td></tr><tr><td>KV</td><td>{} blocks of {} tokens</td></tr><tr><td>batched tokens per step</td><td>{}</td></tr><tr><td>CPU</td><td>{}</td></tr><tr><td>runs per point (median)</td><td>{}</td></tr></table>",
        esc(&sh.engine),
        esc(&sh.role),
        esc(&sh.model),
        sh.shards,
        sh.threads_per_shard,
        esc(&sh.simd),
        sh.kv_blocks,
        sh.block_size,
        sh.max_batched_tokens,
        esc(&sh.cpu),
        p.reps
    );
    s += &chart(
        "Prefill: time to first token",
        "prompt tokens",
        "TTFT ms",
        &[prefill(|q| q.ttft_ms, "TTFT")],
    );
    s += &chart(
        "Prefill: prompt tokens per second",
        "prompt tokens",
        "tokens/s",
        &[prefill(|q| q.tok_s, "prefill tokens/s")],
    );
    s += &chart(
        "Decode: inter-token latency",
        "sequences in the batch",
        "ITL ms",
        &decode(|q| q.itl_ms),
    );
    s += &chart(
        "Decode: output tokens per second",
        "sequences in the batch",
        "tokens/s",
        &decode(|q| q.tok_s),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_proto::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, WorkerShape};

    #[test]
    fn a_profile_page_has_its_four_charts_and_every_point() {
        let shape = WorkerShape {
            engine: "mocker".into(),
            role: "agg".into(),
            shards: 1,
            threads_per_shard: 1,
            simd: "none".into(),
            arith: String::new(),
            model: "<m & n>".into(),
            block_size: 16,
            kv_blocks: 64,
            max_batched_tokens: 512,
            kv_bytes_per_token: 0,
            cpu: "test".into(),
        };
        let prefill = (1..=3)
            .map(|i| PrefillPoint { isl: 100 * i, ttft_ms: 10.0 * f64::from(i), tok_s: 1e4 })
            .collect();
        let mut decode = Vec::new();
        for context in [64, 256] {
            for batch in [1, 4] {
                decode.push(DecodePoint { batch, context, itl_ms: 5.0, tok_s: 200.0 });
            }
        }
        let p =
            Profile { version: PROFILE_VERSION, shape, reps: 3, temperature: 0.0, prefill, decode };
        let html = profile_html(&p);
        assert_eq!(html.matches("<svg").count(), 4);
        // 3 prefill points twice, 4 decode points twice.
        assert_eq!(html.matches("<circle").count(), 3 * 2 + 4 * 2);
        assert!(html.contains("context 64") && html.contains("context 256"));
        assert!(html.contains("&lt;m &amp; n&gt;") && !html.contains("<m & n>"));
    }
}
