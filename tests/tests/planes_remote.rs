//! The remote worker planes end to end: `kvx frontend` with `kvx worker` mock-engine processes
//! on 127.0.0.1 — requests succeed, a shared prefix stays on one worker in kv mode, a worker
//! killed with SIGKILL loses no request that had not produced a token (the others end with a
//! clear error), a silent (stopped) worker is dropped after the heartbeat timeout and comes
//! back, a worker may rejoin under its old id, and the static-list direction works.

use std::time::Duration;

use kvx_e2e::planes::{FAST_HEARTBEAT, Frontend, Worker};
use kvx_e2e::serve::{Endpoint, HttpResponse, http};
use serde_json::{Value, json};

/// Mock engines ten times faster than Dynamo's timing model.
const FAST: [&str; 2] = ["--speedup-ratio", "10"];

fn args<'a>(parts: &[&'a [&'a str]]) -> Vec<&'a str> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

fn completion(f: &Frontend, prompt: &[u32], max_tokens: u32, stream: bool) -> HttpResponse {
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    http(&f.addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()))
}

/// What a streamed completion came to.
#[derive(Debug)]
struct Streamed {
    text: String,
    finish: Option<String>,
    error: Option<String>,
    completion_tokens: Option<u64>,
}

fn streamed(r: &HttpResponse) -> Streamed {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut s =
        Streamed { text: String::new(), finish: None, error: None, completion_tokens: None };
    for ev in r.events() {
        if let Some(e) = ev.get("error") {
            s.error = Some(e["message"].as_str().unwrap_or_default().to_string());
            continue;
        }
        if let Some(c) = ev["choices"].get(0) {
            s.text.push_str(c["text"].as_str().unwrap_or_default());
            if let Some(f) = c["finish_reason"].as_str() {
                s.finish = Some(f.to_string());
            }
        }
        if let Some(n) = ev["usage"]["completion_tokens"].as_u64() {
            s.completion_tokens = Some(n);
        }
    }
    s
}

fn prompt(prefix: &[u32], suffix_seed: u32) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend((0..8).map(|i| 2000 + suffix_seed * 8 + i));
    p
}

#[test]
fn requests_succeed_and_a_shared_prefix_stays_on_one_worker() {
    let f = Frontend::start(&args(&[&FAST_HEARTBEAT, &["--router-mode", "kv"]]));
    let _w: Vec<Worker> = (0..3)
        .map(|i| Worker::mocker(&f.workers, 100 * (i + 1), &args(&[&FAST_HEARTBEAT, &FAST])))
        .collect();
    f.wait_workers(3);
    let prefix: Vec<u32> = (1000..1160).collect(); // ten blocks of 16 tokens
    for i in 0..8 {
        let r = completion(&f, &prompt(&prefix, i), 4, false);
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = r.json();
        assert!(!v["choices"][0]["text"].as_str().unwrap_or_default().is_empty(), "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        // Every request after the first finds the whole prefix cached: it went to the worker
        // that computed it (any other worker would have had to compute it itself).
        if i > 0 {
            assert!(cached >= 160, "request {i} found {cached} cached tokens: {v}");
        }
    }
    // A stream arrives as deltas with text, then the finish and usage.
    let s = streamed(&completion(&f, &prompt(&prefix, 99), 6, true));
    assert_eq!(
        (s.finish.as_deref(), s.completion_tokens, s.error),
        (Some("length"), Some(6), None)
    );
    assert!(!s.text.is_empty());
}

#[test]
fn a_killed_worker_loses_no_unstarted_request() {
    // Round-robin over two workers that run one request at a time: each gets three, runs
    // one and queues two.
    // Without migration, the started request fails (tests/planes_disagg.rs has migration).
    let f = Frontend::start(&args(&[
        &FAST_HEARTBEAT,
        &["--router-mode", "round-robin", "--migration-limit", "0"],
    ]));
    let one_at_a_time = ["--max-num-seqs", "1"];
    let mut a = Worker::mocker(&f.workers, 7000, &args(&[&FAST_HEARTBEAT, &one_at_a_time]));
    let _b = Worker::mocker(&f.workers, 8000, &args(&[&FAST_HEARTBEAT, &one_at_a_time]));
    f.wait_workers(2);
    let addr = f.addr.clone();
    let clients: Vec<_> = (0..6u32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let p: Vec<u32> = (0..24).map(|t| 100 + i * 100 + t).collect();
                let body = json!({"prompt": p, "max_tokens": 150, "stream": true,
                    "stream_options": {"include_usage": true}});
                http(&addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()))
            })
        })
        .collect();
    // Kill A once it runs one request and queues another.
    let running = "kvx_worker_running_requests{worker=\"7000\"}";
    let queued = "kvx_worker_queue_depth{worker=\"7000\"}";
    let end = std::time::Instant::now() + Duration::from_secs(60);
    while !(f.metric(running).unwrap_or(0.0) >= 1.0 && f.metric(queued).unwrap_or(0.0) >= 1.0) {
        assert!(std::time::Instant::now() < end, "worker 7000 never had a queue");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(150));
    a.kill9();
    let results: Vec<Streamed> =
        clients.into_iter().map(|c| streamed(&c.join().expect("client"))).collect();
    let failed: Vec<&Streamed> = results.iter().filter(|s| s.error.is_some()).collect();
    let done = results.iter().filter(|s| s.finish.as_deref() == Some("length")).count();
    assert!(!failed.is_empty(), "the request running on the killed worker must fail: {results:?}");
    for s in &failed {
        let msg = s.error.as_deref().unwrap_or_default();
        assert!(msg.contains("worker 7000 disappeared"), "unclear error: {msg:?}");
        assert!(!s.text.is_empty(), "a request without a token was failed: {s:?}");
    }
    assert_eq!(done + failed.len(), 6, "{results:?}");
    for s in results.iter().filter(|s| s.error.is_none()) {
        assert_eq!(s.completion_tokens, Some(150), "{s:?}");
    }
    // At least the requests queued on A moved to B.
    assert!(f.metric("kvx_router_plane_requests_placed_again_total").unwrap_or(0.0) >= 1.0);
    f.wait_workers(1);

    // A comes back under its old id and serves again.
    let _a2 = Worker::mocker(&f.workers, 7000, &args(&[&FAST_HEARTBEAT, &FAST]));
    f.wait_workers(2);
    for i in 0..4 {
        let r = completion(&f, &(0..20).map(|t| 9000 + i * 20 + t).collect::<Vec<u32>>(), 3, false);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(f.metric("kvx_worker_up{worker=\"7000\"}") == Some(1.0));
}

#[test]
fn a_silent_worker_is_dropped_and_comes_back() {
    let f = Frontend::start(&args(&[&FAST_HEARTBEAT, &["--router-mode", "round-robin"]]));
    let a = Worker::mocker(&f.workers, 500, &args(&[&FAST_HEARTBEAT, &FAST]));
    let _b = Worker::mocker(&f.workers, 600, &args(&[&FAST_HEARTBEAT, &FAST]));
    f.wait_workers(2);
    a.signal("STOP");
    // The frontend stops hearing from A and drops it; B serves everything meanwhile.
    f.wait_workers(1);
    for i in 0..4 {
        let r = completion(&f, &(0..20).map(|t| 300 + i * 20 + t).collect::<Vec<u32>>(), 3, false);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Resumed, A finds its connection gone, reconnects and registers again.
    a.signal("CONT");
    f.wait_workers(2);
}

#[test]
fn a_frontend_dials_listed_workers() {
    let w1 = Worker::mocker_listening(41, &args(&[&FAST_HEARTBEAT, &FAST]));
    let w2 = Worker::mocker_listening(42, &args(&[&FAST_HEARTBEAT, &FAST]));
    let list = format!(
        "{},{}",
        w1.listen.as_deref().unwrap_or_default(),
        w2.listen.as_deref().unwrap_or_default()
    );
    let f = Frontend::start(&args(&[&FAST_HEARTBEAT, &["--workers", &list]]));
    f.wait_workers(2);
    let r = completion(&f, &[5, 6, 7, 8], 5, false);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 5);
}

#[test]
fn a_worker_with_another_block_size_is_refused() {
    let f = Frontend::start(&FAST_HEARTBEAT);
    let mut w = Worker::mocker(&f.workers, 9, &args(&[&FAST_HEARTBEAT, &["--block-size", "32"]]));
    let status = w.wait_exit(Duration::from_secs(30)).expect("a refused worker exits");
    assert!(!status.success());
    assert_eq!(f.workers_up(), 0);
    // With no worker, requests are refused as unavailable rather than hanging.
    let r = completion(&f, &[1, 2, 3], 2, false);
    assert_eq!(r.status, 503, "{}", r.text());
}
