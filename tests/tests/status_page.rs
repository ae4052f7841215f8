//! The status page at `/` of `kvx serve` with two real-model workers, rendered by headless
//! Chromium: one fleet row per worker, the TTFT chart drawn from live samples, a screenshot
//! kept under `target/test-artifacts/status_page.png`; and `/status.json` behind the admin
//! key (the page then asks for it).
//!
//! Needs the Debian package `chromium`; the tests fail (they do not skip) when it is missing.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_e2e::root;
use kvx_e2e::serve::{Endpoint, Served, http};
use serde_json::{Value, json};

fn chromium() -> PathBuf {
    #[allow(clippy::disallowed_methods)] // where the test machine keeps its programs
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "no chromium on PATH: install the Debian package `chromium` (apt-get install -y chromium)"
    );
}

/// Runs headless Chromium on `url` with `extra` arguments (a fresh profile in `profile`);
/// returns stdout.
fn headless(profile: &Path, url: &str, extra: &[String]) -> String {
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--force-color-profile=srgb",
            // Enough for several of the page's one-second refreshes.
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().expect("wait for chromium") {
            assert!(status.success(), "chromium exited with {status}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        use std::io::Read;
        s.read_to_string(&mut out).expect("read chromium output");
    }
    out
}

/// `target/test-artifacts` (under `CARGO_TARGET_DIR` when set), created.
fn artifacts() -> PathBuf {
    #[allow(clippy::disallowed_methods)] // cargo's own setting, as cargo resolves it
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || root().join("target"),
        |d| {
            let d = PathBuf::from(d);
            if d.is_absolute() { d } else { root().join(d) }
        },
    );
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).expect("create target/test-artifacts");
    dir
}

/// A scratch directory for Chromium profiles, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-status-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// Every value of `attr="..."` in `html`.
fn attr_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let pat = format!("{attr}=\"");
    html.split(&pat).skip(1).filter_map(|rest| rest.split('"').next()).collect()
}

/// The distinct RGB colours of a PNG.
fn colours(png_path: &Path) -> HashSet<[u8; 3]> {
    let file = std::fs::File::open(png_path).expect("open the screenshot");
    let mut reader = png::Decoder::new(std::io::BufReader::new(file)).read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a buffer size")];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let channels = info.color_type.samples();
    assert!(channels >= 3, "a colour screenshot");
    assert!(info.width >= 1000 && info.height >= 700, "{}x{}", info.width, info.height);
    buf[..info.buffer_size()].chunks_exact(channels).map(|px| [px[0], px[1], px[2]]).collect()
}

/// KV blocks of the test model's default cache over `engines` engines: a quarter of RAM, at
/// most 4 GiB, shared by them, in blocks of 16 tokens at 23,040 bytes a token (30 layers,
/// keys and values of 3 heads of 64 halves).
fn default_kv_blocks(engines: u64) -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("MemTotal");
    let per_engine = (kib * 1024 / 4).min(4 << 30) / engines;
    per_engine / (23_040 * 16) * engines
}

#[test]
fn the_status_page_shows_the_fleet_and_live_latency() {
    // The KV cache as `kvx serve` sizes and makes resident by default (the test run gives
    // other servers a smaller one).
    let s = Served::start_with_default_kv(&[
        "--engine",
        "model",
        "--shards",
        "2",
        "--threads-per-shard",
        "1",
    ]);

    // Streamed completions, two at a time, so that both workers see some and TTFT and ITL
    // have samples.
    for round in 0..3 {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let addr = s.addr.clone();
                let body = json!({
                    "prompt": format!("Round {round}, stream {i}: count from one to ten."),
                    "max_tokens": 8, "temperature": 0, "stream": true});
                std::thread::spawn(move || {
                    http(&addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()))
                })
            })
            .collect();
        for h in handles {
            let r = h.join().expect("request thread");
            assert_eq!(r.status, 200, "{}", r.text());
            assert!(r.events().len() >= 3, "a stream: {}", r.text());
        }
    }

    // The data behind the page.
    let v: Value = s.get("/status.json").json();
    let ids: Vec<&str> = v["fleet"]
        .as_array()
        .expect("fleet")
        .iter()
        .map(|w| w["id"].as_str().expect("a worker id"))
        .collect();
    assert_eq!(ids.len(), 2, "{v}");
    assert_ne!(ids[0], ids[1]);
    assert_eq!(v["totals"]["workers_up"], 2, "{v}");
    assert_eq!(v["totals"]["kv_blocks_total"], default_kv_blocks(2), "{v}");
    assert_eq!(v["totals"]["requests_served"], 6, "{v}");
    let firsts: u64 = v["ttft"]["series"]
        .as_array()
        .expect("a TTFT series")
        .iter()
        .map(|p| p["count"].as_u64().expect("a count"))
        .sum();
    assert_eq!(firsts, 6, "one first token per stream: {v}");
    assert!(v["itl"]["series"].as_array().is_some_and(|a| !a.is_empty()), "{v}");
    assert!(v["totals"]["output_tokens"].as_u64().is_some_and(|n| n >= 6), "{v}");
    let p = &v["ttft"]["series"][0];
    assert!(p["t"].is_u64() && p["count"].is_u64() && p["p50_ms"].is_f64(), "{p}");
    assert!(p["p90_ms"].as_f64() >= p["p50_ms"].as_f64(), "{p}");

    // The page itself: static, self-contained.
    let page = s.get("/");
    assert_eq!(page.status, 200);
    assert_eq!(page.header("content-type"), Some("text/html; charset=utf-8"));
    assert!(
        page.header("content-security-policy").is_some_and(|c| c.contains("default-src 'none'"))
    );

    // Rendered by Chromium, after its fetches of /status.json.
    let url = format!("http://{}/", s.addr);
    let dir = scratch("dom");
    let dom = headless(&dir.join("profile-dom"), &url, &["--dump-dom".to_string()]);
    let rows: HashSet<&str> = attr_values(&dom, "data-worker-id").into_iter().collect();
    assert_eq!(rows, ids.iter().copied().collect(), "one row per worker:\n{dom}");
    assert_eq!(attr_values(&dom, "data-role"), ["agg", "agg"], "a role cell per row");
    let chart = dom
        .split("id=\"ttft-chart\"")
        .nth(1)
        .and_then(|rest| rest.split("</svg>").next())
        .unwrap_or_else(|| panic!("no TTFT chart in\n{dom}"));
    let points: Vec<usize> = attr_values(chart, "data-points")
        .iter()
        .map(|n| n.parse().expect("data-points is a number"))
        .collect();
    assert_eq!(points.len(), 2, "p50 and p90 series: {chart}");
    assert!(points.iter().all(|&n| n >= 1), "points plotted: {points:?}");
    assert!(chart.contains("<path"), "{chart}");
    assert!(dom.contains("class=\"state is-live\" id=\"state\""), "the page says it is live");

    // A screenshot, kept.
    let shot = artifacts().join("status_page.png");
    let _ = std::fs::remove_file(&shot);
    headless(
        &dir.join("profile-shot"),
        &url,
        &[format!("--screenshot={}", shot.display()), "--window-size=1280,900".to_string()],
    );
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 20_000, "a screenshot of the page: {size} bytes at {}", shot.display());
    let n = colours(&shot).len();
    assert!(n > 32, "a drawn page, not a blank one: {n} colours in {}", shot.display());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn status_json_asks_for_the_admin_key_and_the_page_for_it() {
    let s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "1000",
        "--shards",
        "2",
        "--admin-key",
        "k-adm",
        "--api-key",
        "k-user",
    ]);
    let get = |key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.as_deref().map(|a| ("Authorization", a)).into_iter().collect();
        http(&s.addr, "GET", "/status.json", &headers, None)
    };
    assert_eq!(get(None).status, 401);
    assert_eq!(get(Some("k-wrong")).status, 401);
    assert_eq!(get(Some("k-user")).status, 403, "an API key is not an admin key");
    let ok = get(Some("k-adm"));
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.header("content-type"), Some("application/json"));
    assert_eq!(ok.json()["fleet"].as_array().map(Vec::len), Some(2));
    assert_eq!(s.get("/").status, 200, "the page itself is open");

    // Without a key the page asks for one instead of drawing.
    let dir = scratch("auth");
    let dom =
        headless(&dir.join("profile"), &format!("http://{}/", s.addr), &["--dump-dom".to_string()]);
    assert!(dom.contains("class=\"panel auth shown\""), "the key field is shown:\n{dom}");
    assert!(dom.contains("id=\"auth-key\" type=\"password\""), "{dom}");
    assert!(dom.contains("class=\"state is-locked\" id=\"state\""), "the page says it is locked");
    assert!(attr_values(&dom, "data-worker-id").is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
