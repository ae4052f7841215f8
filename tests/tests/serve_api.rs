//! `kvx serve` over real sockets with the mocker engine (the model's tokenizer and chat
//! template, a timing model instead of kernels): response shapes, streaming, errors with their
//! statuses, authentication, usage under 64 concurrent streams, and SIGTERM.

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvx_e2e::serve::{Endpoint, HttpResponse, Served, http, sse_events};
use kvx_e2e::{kvx_ok, test_model};
use serde_json::{Value, json};

const FAST: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "2"];

fn model_name(s: &Served) -> String {
    s.get("/v1/models").json()["data"][0]["id"].as_str().expect("model id").to_string()
}

fn assert_error(r: &HttpResponse, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v
}

#[test]
fn health_ready_models_and_metrics() {
    let s = Served::start(FAST);
    assert!(s.banner.contains("curl http://"), "no curl line in {:?}", s.banner);
    assert_eq!(s.get("/health").status, 200);
    assert_eq!(s.get("/ready").status, 200);
    let m = s.get("/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(m["data"][0]["id"], "smollm2-135m-instruct-q4_1");
    let metrics = s.get("/metrics");
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    for name in [
        "kvx_time_to_first_token_seconds",
        "kvx_inter_token_latency_seconds",
        "kvx_request_duration_seconds",
        "kvx_queue_depth",
        "kvx_running_requests",
        "kvx_kv_usage_ratio",
        "kvx_prefix_cache_hit_rate",
        "kvx_worker_kv_usage_ratio",
        "kvx_worker_prefix_cache_hit_rate",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
    }
    assert_eq!(s.metric("kvx_workers_up"), Some(2.0));
    assert_eq!(s.get("/v1/nothing").status, 404);
}

#[test]
fn chat_and_completions_in_openai_shape() {
    let s = Served::start(FAST);
    let name = model_name(&s);
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": name, "max_tokens": 7, "temperature": 0.5, "seed": 3,
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "some_unknown_field": {"x": 1}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|i| i.starts_with("chatcmpl-")), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], name.as_str());
    assert!(v["created"].as_u64().is_some());
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    let p = v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(p > 5);
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(p + 7));
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // The same conversation again is served from the prefix cache.
    let again = s.post(
        "/v1/chat/completions",
        &json!({"model": name, "max_tokens": 2,
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(again.json()["usage"]["prompt_tokens"].as_u64(), Some(p));

    let r = s.post(
        "/v1/completions",
        &json!({"model": name, "prompt": "Once upon a time", "max_completion_tokens": 4,
                "logprobs": 2, "stop": ["\u{1}"], "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                "presence_penalty": 0.5, "frequency_penalty": 0.5, "user": "u1"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|i| i.starts_with("cmpl-")));
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].is_string());
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(4), "{v}");
    assert_eq!(lp["token_logprobs"].as_array().map(Vec::len), Some(4));
    assert_eq!(lp["top_logprobs"][0].as_object().map(|m| m.len()), Some(2), "{v}");
    assert_eq!(lp["text_offset"][0], 0);

    // Token-id prompts and lists of prompts.
    let r = s.post("/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
    let r = s.post("/v1/completions", &json!({"prompt": ["a", "b c"], "max_tokens": 2}));
    let v = r.json();
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // Chat logprobs.
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                "logprobs": true, "top_logprobs": 3}),
    );
    let v = r.json();
    let c = &v["choices"][0]["logprobs"]["content"];
    assert_eq!(c.as_array().map(Vec::len), Some(3), "{v}");
    assert!(c[0]["token"].is_string() && c[0]["logprob"].is_f64() && c[0]["bytes"].is_array());
    assert_eq!(c[0]["top_logprobs"].as_array().map(Vec::len), Some(3));
}

#[test]
fn streams_end_with_usage_and_done() {
    let s = Served::start(FAST);
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let ev = r.events();
    assert_eq!(ev.last().and_then(Value::as_str), Some("[DONE]"));
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(ev.iter().all(|e| e.is_string() || e["object"] == "chat.completion.chunk"));
    let usage = &ev[ev.len() - 2];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    let fin = &ev[ev.len() - 3];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    let text: String = ev
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect::<Vec<_>>()
        .concat();
    assert!(!text.is_empty());

    // Completions stream without usage: no usage chunk.
    let r = s.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 5, "stream": true}));
    let ev = r.events();
    assert_eq!(ev.last().and_then(Value::as_str), Some("[DONE]"));
    assert!(ev.iter().all(|e| e.get("usage").is_none_or(Value::is_null)));
    assert_eq!(ev[ev.len() - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(ev[0]["object"], "text_completion");
}

#[test]
fn errors_have_their_statuses_and_openai_json() {
    let s = Served::start(&[FAST, &["--max-body-bytes", "4096"]].concat());
    let post = |path: &str, body: &str| http(&s.addr, "POST", path, &[], Some(body.as_bytes()));
    // Malformed JSON and wrong types.
    assert_error(&post("/v1/chat/completions", "{\"messages\": [}"), 400);
    assert_error(&post("/v1/chat/completions", "{\"messages\": \"hi\"}"), 400);
    assert_error(
        &post("/v1/chat/completions", "{\"messages\": [], \"temperature\": \"hot\"}"),
        400,
    );
    assert_error(&post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": -3}"), 400);
    assert_error(&post("/v1/completions", "{\"prompt\": \"x\", \"n\": 17}"), 400);
    assert_error(&post("/v1/completions", "{\"prompt\": \"x\", \"temperature\": -1}"), 400);
    assert_error(&post("/v1/completions", "{\"prompt\": []}"), 400);
    // Prompt + max_tokens beyond the context: both numbers in the message.
    let e = assert_error(
        &post("/v1/completions", "{\"prompt\": \"hello there\", \"max_tokens\": 100000}"),
        400,
    );
    let msg = e["error"]["message"].as_str().expect("message");
    assert!(msg.contains("8192") && msg.contains("100000"), "{msg}");
    // Unknown model.
    let e = assert_error(
        &post(
            "/v1/chat/completions",
            "{\"model\": \"gpt-9\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
        ),
        404,
    );
    assert_eq!(e["error"]["code"], "model_not_found");
    // Body over the limit, announced and not.
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(10_000));
    assert_error(&post("/v1/completions", &big), 413);
    // Wrong method.
    assert_eq!(http(&s.addr, "GET", "/v1/completions", &[], None).status, 405);
    // The statuses are counted.
    assert!(s.metric("kvx_requests_total{endpoint=\"completions\",status=\"413\"}") >= Some(1.0));
    assert!(s.metric("kvx_requests_total{endpoint=\"chat\",status=\"404\"}") >= Some(1.0));
}

#[test]
fn api_keys_are_required_when_configured() {
    let s = Served::start_env(
        &[FAST, &["--api-key", "k1"]].concat(),
        &[("KVX_API_KEYS", "ignored-because-flag-wins")],
    );
    let body = br#"{"prompt": "x", "max_tokens": 1}"#;
    let e = assert_error(&http(&s.addr, "POST", "/v1/completions", &[], Some(body)), 401);
    assert_eq!(e["error"]["code"], "invalid_api_key");
    let bad = [("Authorization", "Bearer nope")];
    assert_error(&http(&s.addr, "POST", "/v1/completions", &bad, Some(body)), 401);
    let good = [("Authorization", "Bearer k1")];
    assert_eq!(http(&s.addr, "POST", "/v1/completions", &good, Some(body)).status, 200);
    assert_eq!(http(&s.addr, "GET", "/v1/models", &[], None).status, 401);
    // Health and metrics stay open.
    assert_eq!(s.get("/health").status, 200);
    assert_eq!(s.get("/metrics").status, 200);

    // Keys from the environment, comma separated.
    let s = Served::start_env(FAST, &[("KVX_API_KEYS", "a,b")]);
    for (key, status) in [("Bearer a", 200), ("Bearer b", 200), ("Bearer c", 401)] {
        let h = [("Authorization", key)];
        assert_eq!(http(&s.addr, "POST", "/v1/completions", &h, Some(body)).status, status);
    }
}

/// Opens a streaming request and returns the socket after `n` SSE events arrived.
fn open_stream(addr: &str, body: &Value, n: usize) -> (TcpStream, String) {
    kvx_e2e::serve::open_stream(addr, "/v1/completions", &[], body, n)
}

fn wait_for(s: &Served, series: &str, want: f64, timeout: Duration) -> Option<f64> {
    let end = Instant::now() + timeout;
    loop {
        let v = s.metric(series);
        if v == Some(want) || Instant::now() > end {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_disconnect_cancels_the_request_and_frees_its_blocks() {
    // Real-time mocker: a decode step takes several milliseconds, so the request is running.
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "1", "--shards", "1"]);
    let body = json!({"prompt": "word ".repeat(100), "max_tokens": 4000, "ignore_eos": true,
                      "stream": true});
    let (sock, _) = open_stream(&s.addr, &body, 3);
    assert_eq!(s.metric("kvx_running_requests"), Some(1.0));
    assert!(s.metric("kvx_kv_blocks_active").is_some_and(|b| b > 0.0));
    drop(sock);
    let t = Duration::from_secs(10);
    assert_eq!(wait_for(&s, "kvx_running_requests", 0.0, t), Some(0.0));
    assert_eq!(wait_for(&s, "kvx_kv_blocks_active", 0.0, t), Some(0.0));
    assert_eq!(wait_for(&s, "kvx_client_disconnects_total", 1.0, t), Some(1.0));
    assert_eq!(s.metric("kvx_inflight_requests"), Some(0.0));
}

#[test]
fn a_full_server_answers_429_with_retry_after() {
    let s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "1",
        "--shards",
        "1",
        "--max-inflight",
        "1",
    ]);
    let body = json!({"prompt": "x", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let (_sock, _) = open_stream(&s.addr, &body, 2);
    let r = s.post("/v1/completions", &json!({"prompt": "y", "max_tokens": 2}));
    assert_error(&r, 429);
    assert!(r.header("retry-after").is_some_and(|v| v.parse::<u32>().is_ok()), "{:?}", r.headers);
}

#[test]
fn sixty_four_concurrent_streams_complete_with_correct_usage() {
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "50", "--shards", "2"]);
    let model = test_model();
    let prompts: Vec<String> =
        (0..64).map(|i| format!("Request number {i}: tell me about {}", i * 7)).collect();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let addr = s.addr.clone();
            let body = json!({"prompt": p, "max_tokens": 20 + i, "ignore_eos": true,
                              "stream": true, "stream_options": {"include_usage": true}});
            std::thread::spawn(move || {
                http(&addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()))
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let r = h.join().expect("client thread");
        assert_eq!(r.status, 200);
        let ev = sse_events(&r.text());
        assert_eq!(ev.last().and_then(Value::as_str), Some("[DONE]"), "stream {i}");
        let usage = &ev[ev.len() - 2]["usage"];
        let ids: Vec<u32> = serde_json::from_str(&kvx_ok(&[
            "tokenize",
            "--model",
            model.to_str().expect("path"),
            "--text",
            &prompts[i],
        ]))
        .expect("ids");
        assert_eq!(usage["prompt_tokens"].as_u64(), Some(ids.len() as u64), "stream {i}");
        assert_eq!(usage["completion_tokens"].as_u64(), Some(20 + i as u64), "stream {i}");
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(ids.len() as u64 + 20 + i as u64),
            "stream {i}"
        );
        assert_eq!(ev[ev.len() - 3]["choices"][0]["finish_reason"], "length");
    }
    let out = s.metric("kvx_output_tokens_total").expect("output tokens");
    assert_eq!(out, (0..64).map(|i| 20.0 + i as f64).sum::<f64>());
    assert_eq!(s.metric("kvx_requests_total{endpoint=\"completions\",status=\"200\"}"), Some(64.0));
    assert_eq!(wait_for(&s, "kvx_running_requests", 0.0, Duration::from_secs(5)), Some(0.0));
}

#[test]
fn sigterm_lets_running_requests_finish_then_exits() {
    let mut s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "1",
        "--shards",
        "1",
        "--shutdown-grace",
        "30",
    ]);
    // About 100 decode steps of several milliseconds: well inside the grace period.
    let body = json!({"prompt": "x", "max_tokens": 100, "ignore_eos": true, "stream": true});
    let (mut sock, head) = open_stream(&s.addr, &body, 2);
    s.terminate();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest);
    let all = head + &String::from_utf8_lossy(&rest);
    assert!(all.contains("\"finish_reason\":\"length\""), "{all}");
    assert!(all.contains("data: [DONE]"));
    let status = s.wait_exit(Duration::from_secs(20)).expect("exited after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn sigterm_cancels_what_outlives_the_grace_period() {
    let mut s = Served::start(&[
        "--engine",
        "mocker",
        "--speedup-ratio",
        "1",
        "--shards",
        "1",
        "--shutdown-grace",
        "1",
    ]);
    let body = json!({"prompt": "x", "max_tokens": 5000, "ignore_eos": true, "stream": true});
    let (mut sock, _) = open_stream(&s.addr, &body, 2);
    let t0 = Instant::now();
    s.terminate();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest);
    let status = s.wait_exit(Duration::from_secs(20)).expect("exited after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(t0.elapsed() < Duration::from_secs(15));
    let rest = String::from_utf8_lossy(&rest);
    assert!(!rest.contains("\"finish_reason\":\"length\""), "finished instead of cancelled");
}

/// Reads from `sock` until the server closes it or `limit` passes; returns what arrived and
/// whether it closed.
fn read_until_closed(sock: &mut TcpStream, limit: Duration) -> (String, bool) {
    sock.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    let end = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        match sock.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), true),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), false)
}

#[test]
fn slow_clients_lose_their_connections_after_the_read_timeouts() {
    use std::io::Write;
    let mut args = FAST.to_vec();
    args.extend(["--header-read-timeout", "1", "--body-read-timeout", "1"]);
    let s = Served::start(&args);
    let connect = || TcpStream::connect(&s.addr).expect("connect");
    // Headers that never end (slowloris), and a connection that sends nothing: both closed
    // after the header timeout, with nothing served.
    let mut slow = connect();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\nContent-Type: applic")
        .expect("write");
    let mut silent = connect();
    let t0 = Instant::now();
    let (got, closed) = read_until_closed(&mut slow, Duration::from_secs(10));
    assert!(closed, "a slow-header connection stayed open {:?}", t0.elapsed());
    assert!(t0.elapsed() >= Duration::from_millis(800), "closed after {:?}", t0.elapsed());
    assert!(!got.contains("200 OK"), "{got}");
    let (_, closed) = read_until_closed(&mut silent, Duration::from_secs(5));
    assert!(closed, "a silent connection stayed open");
    // A body that stops half-way: 408, and the connection is not kept.
    let mut half = connect();
    half.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: kvx\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\": \"hel",
    )
    .expect("write");
    let (got, closed) = read_until_closed(&mut half, Duration::from_secs(10));
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(closed, "the connection of a timed-out body stayed open");
    assert!(got.contains("request_timeout"), "{got}");
    // Meanwhile and after, normal requests are served.
    let r = s.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
    // A keep-alive connection that is idle between requests is closed too, not held.
    let mut idle = connect();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: kvx\r\n\r\n").expect("write");
    let (got, closed) = read_until_closed(&mut idle, Duration::from_secs(10));
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(closed, "an idle keep-alive connection stayed open");
    assert_eq!(s.metric("kvx_inflight_requests"), Some(0.0));
}
