//! Renders the HTML report of a real sweep in headless Chromium and checks that the charts are
//! drawn: the SVG elements in the rendered DOM and the series colours in a screenshot.
//!
//! Needs the Debian package `chromium`; the test fails (it does not skip) when it is missing.

#![allow(clippy::disallowed_methods)] // the model and tools come from `cargo xtask test`'s environment

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_bench::{BenchConfig, EndpointConfig, LengthDist, LoadConfig, WorkloadConfig};
use support::openai_fixture::{Fixture, FixtureConfig};

fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
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

/// Runs headless Chromium on `page` with `extra` arguments; returns stdout.
fn headless(profile: &Path, page: &Path, extra: &[String]) -> String {
    let mut cmd = Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1400,1800",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(format!("file://{}", page.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start chromium");
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

fn color_pixels(png_path: &Path, rgb: [u8; 3]) -> usize {
    let decoder =
        png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png_path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    assert!(channels >= 3, "colour screenshot");
    buf[..info.buffer_size()]
        .chunks_exact(channels)
        .filter(|px| (0..3).all(|i| (px[i] as i32 - rgb[i] as i32).abs() <= 24))
        .count()
}

#[test]
fn html_report_renders_its_charts_in_headless_chromium() {
    let fixture = Fixture::start(FixtureConfig {
        ttft: Duration::from_micros(500),
        itl: Duration::from_micros(300),
        ..Default::default()
    });
    let cfg = BenchConfig {
        endpoint: EndpointConfig { url: fixture.url(), ..Default::default() },
        workload: WorkloadConfig::Synthetic {
            input: "uniform:16,64".parse().unwrap(),
            output: LengthDist::fixed(8),
            prompts: 20,
        },
        load: LoadConfig::Closed { concurrency: vec![1, 2, 4] },
        max_requests: Some(30),
        ..Default::default()
    };
    let report = kvx_bench::run(&cfg).unwrap();
    let dir = std::env::temp_dir().join(format!("kvx-bench-html-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("report.html");
    report.write_html(&page).unwrap();

    // The DOM as Chromium parsed it: five charts, every series a polyline with points.
    let dom = headless(&dir.join("profile-dom"), &page, &["--dump-dom".to_string()]);
    assert_eq!(dom.matches("<svg").count(), 5, "five charts");
    let polylines: Vec<&str> = dom.split("<polyline").skip(1).collect();
    assert_eq!(polylines.len(), 3 * 3 + 2 * 3, "3 CDFs x 3 levels + 2 sweep charts x 3 series");
    for p in &polylines {
        let points = p.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
        assert!(points.split(' ').count() >= 3, "a drawn line: {points}");
    }
    assert!(dom.contains("id=\"kvx-bench-report\""), "the data travels with the page");

    // The pixels: each level's colour is on screen.
    let shot = dir.join("report.png");
    headless(&dir.join("profile-shot"), &page, &[format!("--screenshot={}", shot.display())]);
    for (name, rgb) in
        [("blue", [0x1f, 0x77, 0xb4]), ("red", [0xd6, 0x27, 0x28]), ("green", [0x2c, 0xa0, 0x2c])]
    {
        let n = color_pixels(&shot, rgb);
        assert!(n > 300, "{name} series drawn: {n} pixels");
    }
    std::fs::copy(&shot, std::env::temp_dir().join("kvx-bench-report-latest.png")).unwrap();
}
