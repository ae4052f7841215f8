//! Overload control and deadlines through `kvx serve` (mocker engine, real sockets): requests
//! past the running bound wait in order, a full queue answers 429 with `Retry-After`, a
//! request's `timeout` ends it in the queue (408) or mid-stream (a `timeout` event) and frees
//! its blocks, and a stream whose client stops reading is cut at the byte bound with its KV
//! blocks freed, and one whose client keeps its window shut is closed after the send timeout;
//! on the model, `--max-running knee` follows the engine's batch knee.

use std::time::{Duration, Instant};

use kvx_e2e::serve::{Endpoint, Served, http, open_stream};
use serde_json::{Value, json};

/// One shard whose mocker runs at the model's own pace (a long request holds its slot).
const SLOW: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1", "--shards", "1"];

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

fn long(stream: bool) -> Value {
    json!({"prompt": "hello there", "max_tokens": 7000, "ignore_eos": true, "stream": stream})
}

#[test]
fn past_the_running_bound_requests_queue_and_a_full_queue_is_refused_with_retry_after() {
    let mut args = SLOW.to_vec();
    args.extend(["--max-running", "1", "--max-queue", "1", "--max-queue-wait", "60"]);
    let s = Served::start(&args);
    // A long stream holds the one running slot.
    let (holder, _) = open_stream(&s.addr, "/v1/completions", &[], &long(true), 2);
    // A request with a short deadline waits in the queue, then leaves it: 408 `timeout`.
    let t0 = Instant::now();
    let body = json!({"prompt": "hi", "max_tokens": 2, "timeout": 0.5});
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "timeout");
    assert!(t0.elapsed() >= Duration::from_millis(450), "{:?}", t0.elapsed());
    assert_eq!(s.metric("kvx_admission_refused_total{reason=\"deadline\"}"), Some(1.0));
    // One waits (the queue holds one)...
    let addr = s.addr.clone();
    let waiting = std::thread::spawn(move || {
        let b = json!({"prompt": "hi", "max_tokens": 2}).to_string();
        http(&addr, "POST", "/v1/completions", &[], Some(b.as_bytes()))
    });
    wait_for("a queued request", Duration::from_secs(10), || {
        s.metric("kvx_admission_queue_depth") == Some(1.0)
    });
    // ... and the next finds the queue full: 429 with Retry-After, at once.
    let t0 = Instant::now();
    let r = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(r.json()["error"]["code"], "overloaded");
    let retry: u64 = r.header("retry-after").expect("Retry-After").parse().expect("seconds");
    assert!(retry >= 1, "{retry}");
    assert_eq!(s.metric("kvx_admission_refused_total{reason=\"queue_full\"}"), Some(1.0));
    // The holder goes away: the waiting request runs.
    drop(holder);
    let r = waiting.join().expect("client");
    assert_eq!(r.status, 200, "{}", r.text());
    wait_for("the blocks back", Duration::from_secs(10), || {
        s.metric("kvx_kv_blocks_active") == Some(0.0)
    });
    assert_eq!(s.metric("kvx_admission_queue_depth"), Some(0.0));
}

#[test]
fn a_deadline_ends_a_running_request_and_frees_its_blocks() {
    let s = Served::start(SLOW);
    // Streamed: the stream ends with a `timeout` error event after about a second.
    let mut body = long(true);
    body["timeout"] = json!(1.0);
    let t0 = Instant::now();
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200);
    let ev = r.events();
    let err = ev.iter().find(|e| e.get("error").is_some()).expect("an error event");
    assert_eq!(err["error"]["code"], "timeout", "{err}");
    assert_eq!(ev.last().and_then(Value::as_str), Some("[DONE]"));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Whole: 408 after the header's deadline (the shorter of the two).
    let mut body = long(false);
    body["timeout"] = json!(30);
    let r = http(
        &s.addr,
        "POST",
        "/v1/completions",
        &[("X-Request-Timeout", "1")],
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "timeout");
    // A malformed deadline is a 400.
    let mut bad = long(false);
    bad["timeout"] = json!(-1);
    assert_eq!(s.post("/v1/completions", &bad).status, 400);
    wait_for("the blocks back", Duration::from_secs(10), || {
        s.metric("kvx_kv_blocks_active") == Some(0.0)
    });
    assert_eq!(s.metric("kvx_streams_cut_total{reason=\"deadline\"}"), Some(1.0));
    assert_eq!(s.metric("kvx_inflight_requests"), Some(0.0));
}

#[test]
fn a_stream_nobody_reads_is_cut_at_the_byte_bound_and_its_blocks_freed() {
    let s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "1000",
        "--shards",
        "1",
        "--stream-buffer-bytes",
        "8192",
    ]);
    // Fifty streams whose clients read two events and then nothing.
    let held: Vec<_> =
        (0..50).map(|_| open_stream(&s.addr, "/v1/completions", &[], &long(true), 2).0).collect();
    wait_for("every stream cut", Duration::from_secs(60), || {
        s.metric("kvx_streams_cut_total{reason=\"unread\"}") == Some(50.0)
    });
    wait_for("the blocks back", Duration::from_secs(10), || {
        s.metric("kvx_kv_blocks_active") == Some(0.0)
    });
    // Meanwhile the server serves others.
    let r = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
    drop(held);
    wait_for("nothing in flight", Duration::from_secs(10), || {
        s.metric("kvx_inflight_requests") == Some(0.0)
    });
}

#[test]
fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    // The byte bound is far away: only the shut window can end the stream. At this pace the
    // 7,000 tokens take several seconds, far more than filling the window does.
    let s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "5",
        "--shards",
        "1",
        "--stream-buffer-bytes",
        "67108864",
        "--send-timeout",
        "1",
    ]);
    let (mut held, _) = open_stream(&s.addr, "/v1/completions", &[], &long(true), 2);
    // Its receive window fills, stays shut for a second, and the kernel closes the connection:
    // the request is cancelled and its blocks freed before its 7,000 tokens are done.
    wait_for("the connection closed", Duration::from_secs(60), || {
        s.metric("kvx_client_disconnects_total") == Some(1.0)
    });
    wait_for("the blocks back", Duration::from_secs(10), || {
        s.metric("kvx_kv_blocks_active") == Some(0.0)
    });
    assert_eq!(s.metric("kvx_streams_cut_total{reason=\"unread\"}"), Some(0.0));
    let made = s.metric("kvx_worker_generated_tokens_total{worker=\"1\"}").expect("tokens");
    assert!(made < 7000.0, "the request ran to its end: {made} tokens");
    // The client, reading now, finds the connection closed before the stream's end.
    use std::io::Read;
    let mut rest = Vec::new();
    let _ = held.read_to_end(&mut rest);
    assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"), "the stream ran to its end");
}

#[test]
fn on_the_model_the_running_bound_follows_the_engine_s_batch_knee() {
    // One shard of 64 sequence slots: the bound starts at the slots. The bound may fall under
    // a wave's 16 while the waves run; its requests then queue, and the wait bound is far off
    // so that none is refused (refusals have their own test above).
    let s = Served::start(&["--shards", "1", "--max-running", "knee", "--max-queue-wait", "3600"]);
    assert_eq!(s.metric("kvx_admission_running_bound"), Some(64.0));
    // Waves of 16 requests of different lengths: decode steps of 16 sequences down to 1.
    let wave = || {
        let clients: Vec<_> = (0..16)
            .map(|i| {
                let addr = s.addr.clone();
                std::thread::spawn(move || {
                    let b = json!({"prompt": "Count to a hundred:", "max_tokens": 4 + 8 * i,
                        "ignore_eos": true, "temperature": 0});
                    http(&addr, "POST", "/v1/completions", &[], Some(b.to_string().as_bytes()))
                })
            })
            .collect();
        for c in clients {
            let r = c.join().expect("client");
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    // A step here costs a fixed part (the weights) and a part per sequence: the knee, where
    // 90% of the slots' throughput is had, lies well under the slots and over the floor (4).
    // Three waves at least; more while the fit is not trusted yet (on a loaded machine the
    // step times' noise can leave less than half their variance explained for a while).
    // The bound follows the knees once a second: whether it is under the slots within 3 s.
    let mut bound = None;
    let mut fell = || {
        let settle = Instant::now() + Duration::from_secs(3);
        loop {
            bound = s.metric("kvx_admission_running_bound");
            if bound.is_some_and(|b| b < 64.0) || Instant::now() > settle {
                return bound.is_some_and(|b| b < 64.0);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let end = Instant::now() + Duration::from_secs(90);
    let mut waves = 3;
    (0..waves).for_each(|_| wave());
    while !fell() && Instant::now() < end {
        wave();
        waves += 1;
    }
    assert!(bound.is_some_and(|b| b < 64.0), "the bound stayed after {waves} waves: {bound:?}");
    assert!(bound.is_some_and(|b| b >= 4.0), "{bound:?}");
}
