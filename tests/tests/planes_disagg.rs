//! Disaggregated serving across processes with the real model: `kvx frontend` with a
//! `kvx worker --role prefill` and a `kvx worker --role decode` on 127.0.0.1 (the KV moves
//! through kvx-xfer's shared memory). Tokens are those of aggregated `kvx serve`; a prefill
//! worker killed with SIGKILL while 16 requests are in flight loses none of them, and the
//! decode worker's blocks in use come back to where they were.

use std::time::{Duration, Instant};

use kvx_e2e::planes::{FAST_HEARTBEAT, Frontend, Worker};
use kvx_e2e::serve::{Endpoint, Served, http};
use serde_json::{Value, json};

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|j| 300 + (seed * 7919 + j * 104_729) % 40_000).collect()
}

fn complete(addr: &str, prompt: &[u32], max_tokens: u32) -> Value {
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 3,
    });
    let r = http(addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    json!({ "text": v["choices"][0]["text"], "logprobs": v["choices"][0]["logprobs"] })
}

fn args<'a>(parts: &[&'a [&'a str]]) -> Vec<&'a str> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// A frontend with one decode (id 100) and one prefill (id 200) model worker.
fn trio(frontend: &[&str], worker: &[&str]) -> (Frontend, Worker, Worker) {
    let f = Frontend::start(&args(&[&["--disagg-min-tokens", "0"], &FAST_HEARTBEAT, frontend]));
    let d =
        Worker::model(&f.workers, 100, &args(&[&["--role", "decode"], &FAST_HEARTBEAT, worker]));
    let p =
        Worker::model(&f.workers, 200, &args(&[&["--role", "prefill"], &FAST_HEARTBEAT, worker]));
    f.wait_workers(2);
    (f, d, p)
}

#[test]
fn prefill_and_decode_workers_give_the_tokens_of_an_aggregated_server() {
    let prompts: Vec<Vec<u32>> =
        [60, 333, 1200].iter().enumerate().map(|(i, &l)| prompt(l, i as u32)).collect();
    let agg = Served::start(&["--engine", "model", "--shards", "1"]);
    let want: Vec<Value> = prompts.iter().map(|p| complete(&agg.addr, p, 10)).collect();
    drop(agg);
    let (f, _d, _p) = trio(&[], &[]);
    for (i, (p, want)) in prompts.iter().zip(&want).enumerate() {
        assert_eq!(&complete(&f.addr, p, 10), want, "prompt {i} ({} tokens)", p.len());
    }
    assert_eq!(f.metric("kvx_router_disagg_remote_prefills_total"), Some(3.0));
}

#[test]
fn a_killed_prefill_worker_loses_no_request_and_no_block() {
    let (f, _d, mut p) =
        trio(&["--kv-transfer-timeout-ms", "2000"], &["--kv-transfer-timeout-ms", "2000"]);
    let active =
        |f: &Frontend| f.metric("kvx_worker_kv_blocks_active{worker=\"100\"}").unwrap_or(-1.0);
    // Warm up; then the count of blocks in use once the decode worker's report settles.
    complete(&f.addr, &prompt(64, 99), 2);
    let settle = Instant::now() + Duration::from_secs(10);
    let before = loop {
        let a = active(&f);
        std::thread::sleep(Duration::from_millis(1500));
        if active(&f) == a || Instant::now() > settle {
            break a;
        }
    };
    let moved = f.metric("kvx_router_kv_transfers_total").unwrap_or(0.0);
    let addr = f.addr.clone();
    let t0 = Instant::now();
    let clients: Vec<_> = (0..16u32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let v = complete(&addr, &prompt(320, i), 8);
                (v, t0.elapsed())
            })
        })
        .collect();
    // Kill the prefill worker once some KV has moved and more is queued.
    while f.metric("kvx_router_kv_transfers_total").unwrap_or(0.0) < moved + 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no transfer happened");
        std::thread::sleep(Duration::from_millis(20));
    }
    p.kill9();
    let killed = Instant::now();
    let fallbacks = std::thread::spawn({
        let addr = f.addr.clone();
        move || {
            // When the decode worker was told to compute the prompts itself.
            let metric = |name: &str| {
                let text = http(&addr, "GET", "/metrics", &[], None).text();
                text.lines()
                    .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
                    .unwrap_or(0.0)
            };
            let mut last = (0.0, Duration::ZERO);
            while killed.elapsed() < Duration::from_secs(20) {
                let n = metric("kvx_router_disagg_fallbacks_total");
                if n > last.0 {
                    last = (n, killed.elapsed());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            last
        }
    });
    for c in clients {
        let (v, took) = c.join().expect("client");
        assert!(v["text"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
        eprintln!("request done after {took:?}");
    }
    let (n, last) = fallbacks.join().expect("watcher");
    eprintln!("{n} fallbacks, the last {last:?} after the kill");
    assert!(f.metric("kvx_router_disagg_fallbacks_total").unwrap_or(0.0) >= 1.0);
    // Blocks lent to transfers that never came are quarantined, then come back.
    let end = Instant::now() + Duration::from_secs(30);
    while active(&f) != before {
        assert!(Instant::now() < end, "active blocks {} vs {before} before the run", active(&f));
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Frontend, prefill worker and decode worker on three hosts (network namespaces joined by
/// veth pairs): the KV moves over TCP, and the tokens are still those of an aggregated
/// server.
#[test]
fn across_hosts_the_kv_moves_over_tcp_and_the_tokens_stay() {
    let prompts: Vec<Vec<u32>> =
        [90, 700, 1500].iter().enumerate().map(|(i, &l)| prompt(l, 10 + i as u32)).collect();
    let agg = Served::start(&["--engine", "model", "--shards", "1"]);
    let want: Vec<Value> = prompts.iter().map(|p| complete(&agg.addr, p, 8)).collect();
    drop(agg);
    let hosts = kvx_e2e::netns::Hosts::new(3);
    let f = Frontend::start_in(
        Some(hosts.ns(0)),
        hosts.addr(0),
        &args(&[&["--disagg-min-tokens", "0"], &FAST_HEARTBEAT]),
    );
    let kv = |i: usize| format!("{}:0", hosts.addr(i));
    let (d_kv, p_kv) = (kv(2), kv(1));
    let _d = Worker::model_in(
        Some(hosts.ns(2)),
        &f.workers,
        100,
        &args(&[&["--role", "decode", "--kv-listen", &d_kv], &FAST_HEARTBEAT]),
    );
    let _p = Worker::model_in(
        Some(hosts.ns(1)),
        &f.workers,
        200,
        &args(&[&["--role", "prefill", "--kv-listen", &p_kv], &FAST_HEARTBEAT]),
    );
    f.wait_workers(2);
    for (i, (p, want)) in prompts.iter().zip(&want).enumerate() {
        assert_eq!(&complete(&f.addr, p, 8), want, "prompt {i} ({} tokens)", p.len());
    }
    assert_eq!(f.metric("kvx_router_disagg_remote_prefills_total"), Some(3.0));
    let bytes = f.metric("kvx_router_kv_transfer_bytes_total").unwrap_or(0.0);
    let secs = f.metric("kvx_router_kv_transfer_seconds_sum").unwrap_or(0.0);
    eprintln!(
        "KV over TCP across hosts: {bytes} bytes in {secs} s ({:.0} MB/s)",
        bytes / secs / 1e6
    );
    assert!(bytes > 0.0);
}

/// The text and token log-probabilities of a completion (streamed or not).
fn text_and_logprobs(events: &[Value]) -> (String, Vec<f64>, Option<String>) {
    let (mut text, mut lps, mut err) = (String::new(), Vec::new(), None);
    for ev in events {
        if let Some(e) = ev.get("error") {
            err = Some(e.to_string());
        }
        if let Some(c) = ev["choices"].get(0) {
            text.push_str(c["text"].as_str().unwrap_or_default());
            if let Some(a) = c["logprobs"]["token_logprobs"].as_array() {
                lps.extend(a.iter().filter_map(Value::as_f64));
            }
        }
    }
    (text, lps, err)
}

fn stream_completion(
    addr: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> (String, Vec<f64>, Option<String>) {
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": true,
        "stream": true,
    });
    let r = http(addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    text_and_logprobs(&r.events())
}

fn run_all(
    addr: &str,
    prompts: &[Vec<u32>],
    max_tokens: u32,
) -> Vec<(String, Vec<f64>, Option<String>)> {
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let addr = addr.to_string();
            std::thread::spawn(move || stream_completion(&addr, &p, max_tokens))
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("client")).collect()
}

/// 16 greedy streams of 256 tokens over two model workers; one is killed mid-run: every
/// stream completes with no error, and its tokens and log-probabilities are those of an
/// undisturbed run (the streams on the dead worker migrated with the tokens they had).
#[test]
fn streams_on_a_killed_worker_migrate_without_a_visible_error() {
    let prompts: Vec<Vec<u32>> = (0..16).map(|i| prompt(24, 40 + i)).collect();
    let agg = Served::start(&["--engine", "model", "--shards", "1"]);
    let want = run_all(&agg.addr, &prompts, 256);
    drop(agg);
    assert!(want.iter().all(|w| w.1.len() == 256 && w.2.is_none()));
    let f = Frontend::start(&FAST_HEARTBEAT);
    let mut a = Worker::model(&f.workers, 100, &FAST_HEARTBEAT);
    let _b = Worker::model(&f.workers, 200, &FAST_HEARTBEAT);
    f.wait_workers(2);
    let addr = f.addr.clone();
    let ps = prompts.clone();
    let clients = std::thread::spawn(move || run_all(&addr, &ps, 256));
    // Kill worker 100 once its streams are well under way.
    let generated = "kvx_worker_generated_tokens_total{worker=\"100\"}";
    let end = Instant::now() + Duration::from_secs(120);
    while f.metric(generated).unwrap_or(0.0) < 400.0 {
        assert!(Instant::now() < end, "worker 100 generated too little");
        std::thread::sleep(Duration::from_millis(20));
    }
    a.kill9();
    let got = clients.join().expect("clients");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.2, None, "stream {i} saw an error");
        assert_eq!(g.0, w.0, "stream {i}: text");
        assert_eq!(g.1, w.1, "stream {i}: log-probabilities");
    }
    let migrated = f.metric("kvx_router_plane_requests_migrated_total").unwrap_or(0.0);
    assert!(migrated >= 1.0, "no stream migrated");
    eprintln!("{migrated} streams migrated");
}
