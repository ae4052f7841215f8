//! Discovery through a real etcd (Debian's `etcd-server`, started by the tests): workers on
//! other hosts found only through etcd, dropped when their lease lapses and back when they
//! resume; an etcd that goes away for 30 s fails no request; a drained worker finishes its
//! streams and gets nothing new; two frontends over one fleet share its cache state.

use std::time::{Duration, Instant};

use kvx_e2e::etcd::EtcdServer;
use kvx_e2e::netns::Hosts;
use kvx_e2e::planes::{Frontend, Worker};
use kvx_e2e::serve::{Endpoint, http};
use kvx_e2e::test_model;
use serde_json::{Value, json};

fn discovery<'a>(url: &'a str, ns: &'a str) -> Vec<&'a str> {
    vec!["--discovery", "etcd", "--etcd-endpoints", url, "--namespace", ns, "--lease-ttl", "3"]
}

fn complete(addr: &str, prompt: &[u32], max_tokens: u32) -> Value {
    let body = json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 });
    let r = http(addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn finished(f: &Frontend, w: u64) -> f64 {
    f.metric(&format!("kvx_worker_requests_finished_total{{worker=\"{w}\"}}")).unwrap_or(0.0)
}

fn wait(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// etcd and a frontend on one host, a model worker on each of two others (network
/// namespaces on a bridge), found only through etcd.
#[test]
fn workers_on_other_hosts_are_found_dropped_and_found_again_through_etcd() {
    let hosts = Hosts::new(3);
    let etcd = EtcdServer::start_in(Some(hosts.ns(0)), hosts.addr(0));
    let d = discovery(&etcd.url, "hosts");
    let f = Frontend::start_in(Some(hosts.ns(0)), hosts.addr(0), &d);
    let model = test_model().to_string_lossy().into_owned();
    let worker = |i: usize, id: &str| {
        let listen = format!("{}:0", hosts.addr(i));
        let mut a = vec!["worker", "--listen", &listen, "--engine", "model", "--model", &model];
        a.extend(["--worker-id", id]);
        a.extend(&d);
        Worker::with_args(Some(hosts.ns(i)), &a)
    };
    let w1 = worker(1, "100");
    let _w2 = worker(2, "200");
    f.wait_workers(2);
    // Both workers answer with real tokens.
    for i in 0..12u32 {
        let p: Vec<u32> = (0..40).map(|t| 500 + i * 97 + t).collect();
        let v = complete(&f.addr, &p, 4);
        assert!(v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
        if finished(&f, 100) > 0.0 && finished(&f, 200) > 0.0 {
            break;
        }
    }
    assert!(finished(&f, 100) > 0.0 && finished(&f, 200) > 0.0, "one worker got nothing");
    // SIGSTOP: its lease lapses (TTL 3 s) and it leaves the fleet.
    w1.signal("STOP");
    let dropped =
        wait("the stopped worker dropped", Duration::from_secs(5), || f.workers_up() == 1);
    eprintln!("a stopped worker was dropped after {dropped:?} (lease TTL 3 s)");
    w1.signal("CONT");
    let back = wait("the worker back", Duration::from_secs(15), || f.workers_up() == 2);
    eprintln!("it was back {back:?} after SIGCONT");
    let before = finished(&f, 100);
    for i in 0..12u32 {
        let p: Vec<u32> = (0..40).map(|t| 3000 + i * 97 + t).collect();
        complete(&f.addr, &p, 4);
        if finished(&f, 100) > before {
            break;
        }
    }
    assert!(finished(&f, 100) > before, "the worker that came back got no request");
}

fn mocker<'a>(id: &'a str, extra: &[&'a str], d: &[&'a str]) -> Worker {
    let mut a = vec!["worker", "--listen", "127.0.0.1:0", "--engine", "mocker", "--worker-id", id];
    a.extend_from_slice(extra);
    a.extend_from_slice(d);
    Worker::with_args(None, &a)
}

#[test]
fn an_etcd_away_for_30_seconds_fails_no_request() {
    let mut etcd = EtcdServer::start();
    let url = etcd.url.clone();
    let d = discovery(&url, "outage");
    let f = Frontend::start(&d);
    let _a = mocker("10", &["--speedup-ratio", "20"], &d);
    let _b = mocker("20", &["--speedup-ratio", "20"], &d);
    f.wait_workers(2);
    let addr = f.addr.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut ok, mut i) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Distinct prompts: no prefix-cache hit pulls requests to the old workers.
                let mut p: Vec<u32> = vec![100 + i % 40_000, 100 + i / 40_000];
                p.extend((0..18).map(|t| 200 + t));
                let body = json!({ "prompt": p, "max_tokens": 4 });
                let r =
                    http(&addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()));
                assert_eq!(r.status, 200, "request {i} failed: {}", r.text());
                ok += 1;
                i += 1;
            }
            ok
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    etcd.kill();
    std::thread::sleep(Duration::from_secs(30));
    assert_eq!(f.workers_up(), 2, "the fleet stands while etcd is away");
    etcd.run();
    // A worker started now is routed to within the lease TTL.
    let _c = mocker("30", &["--speedup-ratio", "20"], &d);
    wait("the new worker", Duration::from_secs(15), || f.workers_up() == 3);
    let joined = Instant::now();
    wait("a request on the new worker", Duration::from_secs(10), || finished(&f, 30) > 0.0);
    eprintln!("the worker started after the outage served {:?} after joining", joined.elapsed());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let ok = client.join().expect("no request failed");
    eprintln!("{ok} requests, none failed, across a 30 s etcd outage");
}

#[test]
fn a_drained_worker_finishes_its_streams_and_gets_nothing_new() {
    let etcd = EtcdServer::start();
    let d = discovery(&etcd.url, "drain");
    let f = Frontend::start(&d);
    // Worker A alone, 8 streams of 300 tokens on it (a few seconds at speedup 1).
    let mut a = mocker("10", &["--shutdown-grace", "60"], &d);
    f.wait_workers(1);
    let addr = f.addr.clone();
    let streams: Vec<_> = (0..8u32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let p: Vec<u32> = (0..16).map(|t| 200 + i * 16 + t).collect();
                complete(&addr, &p, 300)
            })
        })
        .collect();
    wait("8 streams on A", Duration::from_secs(20), || {
        f.metric("kvx_worker_running_requests{worker=\"10\"}").unwrap_or(0.0) >= 8.0
    });
    let _b = mocker("20", &["--speedup-ratio", "20"], &d);
    f.wait_workers(2);
    a.signal("TERM");
    // Its key goes first: from then on, nothing new reaches it.
    let prefix = "/kvx/drain/workers/10";
    let etcd_url = etcd.url.clone();
    wait("A's key gone", Duration::from_secs(10), || !key_exists(&etcd_url, prefix));
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..4u32 {
        let p: Vec<u32> = (0..16).map(|t| 900 + i * 16 + t).collect();
        complete(&f.addr, &p, 3);
    }
    wait("the new requests on B", Duration::from_secs(10), || finished(&f, 20) == 4.0);
    for s in streams {
        let v = s.join().expect("stream");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 300, "{v}");
    }
    assert!(a.wait_exit(Duration::from_secs(30)).is_some(), "the drained worker exited");
    assert_eq!(
        f.metric("kvx_router_plane_requests_migrated_total"),
        Some(0.0),
        "finished in place"
    );
}

/// Whether `key` exists in the etcd at `url` (through its HTTP gateway).
fn key_exists(url: &str, key: &str) -> bool {
    let body = json!({ "key": kvx_e2e::etcd::b64(key.as_bytes()) }).to_string();
    let addr = url.trim_start_matches("http://");
    let r = http(addr, "POST", "/v3/kv/range", &[], Some(body.as_bytes()));
    r.json()["count"].as_str().is_some_and(|c| c != "0")
}

/// Two frontends over the same 4 mock workers, half of a shared-prefix workload's clients
/// on each, reuse the cache as well as one frontend taking every client.
#[test]
fn two_frontends_over_one_fleet_reuse_its_cache_as_one_does() {
    let etcd = EtcdServer::start();
    let d = discovery(&etcd.url, "two");
    let _workers: Vec<Worker> = ["1", "2", "3", "4"]
        .iter()
        .map(|id| mocker(id, &["--speedup-ratio", "20", "--mocker-blocks", "4096"], &d))
        .collect();
    let f1 = Frontend::start(&d);
    let f2 = Frontend::start(&d);
    f1.wait_workers(4);
    f2.wait_workers(4);
    // 8 prefixes of 512 tokens, each request one of them plus a unique 32-token suffix.
    let run = |addrs: &[&str], seed: u32| -> f64 {
        let reqs: Vec<(String, Vec<u32>)> = (0..64u32)
            .map(|i| {
                let prefix = (i * 5 + seed) % 8;
                let mut p: Vec<u32> =
                    (0..512).map(|t| 1000 + seed * 10_000 + prefix * 600 + t).collect();
                p.extend((0..32).map(|t| 30_000 + seed * 3000 + i * 32 + t));
                (addrs[i as usize % addrs.len()].to_string(), p)
            })
            .collect();
        let mut totals = (0.0, 0.0);
        for chunk in reqs.chunks(8) {
            let threads: Vec<_> = chunk
                .iter()
                .cloned()
                .map(|(a, p)| std::thread::spawn(move || complete(&a, &p, 2)))
                .collect();
            for t in threads {
                let v = t.join().expect("client");
                totals.0 +=
                    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap_or(0.0);
                totals.1 += v["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0);
            }
        }
        totals.0 / totals.1
    };
    let one = run(&[&f1.addr], 1);
    let two = run(&[&f1.addr, &f2.addr], 2);
    eprintln!("cached-token ratio: one frontend {one:.3}, two frontends {two:.3}");
    assert!(one > 0.5, "the workload reuses prefixes ({one})");
    assert!((one - two).abs() <= 0.05, "one frontend {one:.3}, two {two:.3}");
}

/// Discovery settings that cannot work are refused with a reason before anything runs.
#[test]
fn a_worker_that_frontends_could_not_dial_is_refused() {
    use kvx_e2e::kvx;
    let base = ["worker", "--engine", "mocker", "--discovery", "etcd"];
    // Dialling a frontend publishes no address a frontend could dial.
    let out = kvx(&[&base[..], &["--frontend", "127.0.0.1:9"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--listen"), "{out:?}");
    // Nor does a wildcard listener without --advertise.
    let out = kvx(&[&base[..], &["--listen", "0.0.0.0:0"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--advertise"), "{out:?}");
}
