//! The SLA planner end to end: `kvx profile` measures a mock engine, `kvx planner` reads a
//! real `kvx frontend`'s /metrics and, through its local connector, starts `kvx worker
//! --engine mocker` processes; under load the decode pool grows, after it the pool drains
//! back to its minimum while a stream still runs, and no request fails.

use std::time::{Duration, Instant};

use kvx_e2e::planes::{FAST_HEARTBEAT, Frontend, PlannerProc};
use kvx_e2e::serve::{Endpoint, http, metric_in};
use kvx_e2e::{kvx, kvx_ok, test_model};

fn decode_up(f: &Frontend) -> usize {
    let text = f.get("/metrics").text();
    let ups: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("kvx_worker_up{") && l.ends_with(" 1"))
        .filter_map(|l| l.split('"').nth(1).map(str::to_string))
        .collect();
    ups.iter()
        .filter(|w| {
            metric_in(&text, &format!("kvx_worker_role{{worker=\"{w}\",role=\"decode\"}}"))
                == Some(1.0)
        })
        .count()
}

/// Runs `kvx bench` closed-loop against `addr`; its JSON report.
fn bench(addr: &str, streams: &str, secs: &str, out: &std::path::Path) -> serde_json::Value {
    let model = test_model().to_string_lossy().into_owned();
    let url = format!("http://{addr}");
    let o = kvx(&[
        "bench",
        "--url",
        &url,
        "--api",
        "completions",
        "--concurrency",
        streams,
        "--duration",
        secs,
        "--input-tokens",
        "256",
        "--output-tokens",
        "64",
        "--ignore-eos",
        "--tokenizer",
        &model,
        "--quiet",
        "--json",
        &out.to_string_lossy(),
    ]);
    assert!(o.status.success(), "kvx bench failed: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    v["runs"][0].clone()
}

#[test]
fn the_planner_grows_the_decode_pool_under_load_and_drains_it_after() {
    let dir = std::env::temp_dir().join(format!("kvx-planner-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("profile.json");
    let p = profile.to_string_lossy().into_owned();
    kvx_ok(&[
        "profile",
        "--engine",
        "mocker",
        "--out",
        &p,
        "--max-isl",
        "1024",
        "--max-batch",
        "16",
        "--max-context",
        "1024",
        "--reps",
        "1",
    ]);
    let f = Frontend::start(&FAST_HEARTBEAT);
    let frontend = format!("http://{}", f.addr);
    let worker_args = format!(
        "--frontend {} --engine mocker --heartbeat-ms 200 --heartbeat-timeout-ms 1000 --shutdown-grace 20",
        f.workers
    );
    let logs = dir.join("logs").to_string_lossy().into_owned();
    // An ITL target just above one mock sequence's step: one decode worker cannot hold 16
    // streams within it.
    let mut planner = PlannerProc::start(&[
        "--frontend",
        &frontend,
        "--profile",
        &p,
        "--connector",
        "local",
        "--worker-args",
        &worker_args,
        "--worker-logs",
        &logs,
        "--planner-interval",
        "2",
        "--cooldown",
        "6",
        "--predictor",
        "constant",
        "--ttft",
        "500",
        "--itl",
        "6.2",
        "--max-decode",
        "3",
        "--max-prefill",
        "2",
    ]);
    f.wait_workers(2);
    assert_eq!(decode_up(&f), 1);

    let heavy = bench(&f.addr, "16", "14", &dir.join("heavy.json"));
    let decisions = planner.poll().to_vec();
    let most = decisions.iter().filter_map(|d| d["target"]["decode"].as_u64()).max();
    assert!(most >= Some(2), "the decode pool never grew: {decisions:#?}");
    let grew = decisions.iter().find(|d| d["target"]["decode"].as_u64() >= Some(2)).unwrap();
    assert!(grew["reason"].as_str().unwrap().contains("decode 1→"), "{grew}");
    assert_eq!(heavy["errors"], serde_json::json!({}), "{heavy}");

    // One stream while the pool shrinks back (after the cooldown): the drained workers finish
    // what they run, so its requests complete.
    let light = bench(&f.addr, "1", "16", &dir.join("light.json"));
    assert_eq!(light["errors"], serde_json::json!({}), "{light}");
    assert!(light["requests"]["completed"].as_u64() > Some(3), "{light}");
    let end = Instant::now() + Duration::from_secs(30);
    while decode_up(&f) != 1 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(decode_up(&f), 1, "decisions: {:#?}", planner.poll());
    let last = planner.poll().last().cloned().unwrap();
    assert_eq!(last["target"]["decode"], 1, "{last}");
    let m = http(&planner.metrics, "GET", "/metrics", &[], None).text();
    assert_eq!(metric_in(&m, "kvx_planner_desired_replicas{role=\"decode\"}"), Some(1.0), "{m}");
    assert!(metric_in(&m, "kvx_planner_decisions_total").unwrap() >= 10.0, "{m}");

    // Stopping the planner stops its workers.
    assert!(planner.terminate(Duration::from_secs(30)).is_some_and(|s| s.success()));
    f.wait_workers(0);
    let _ = std::fs::remove_dir_all(&dir);
}
