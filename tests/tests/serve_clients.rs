//! Real clients against `kvx serve`: the official `openai` Python package (chat and
//! completions, streaming and not), and the real model engine under concurrent streams.

use kvx_e2e::python_client;
use kvx_e2e::serve::{Endpoint, Served, http, sse_events};
use serde_json::{Value, json};

#[test]
fn the_openai_python_client_works() {
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "100", "--shards", "2"]);
    let stdout = python_client("openai_client.py", &[&format!("http://{}/v1", s.addr)]);
    assert!(stdout.contains("ok: 6 checks"), "{stdout}");
}

#[test]
fn the_model_engine_serves_concurrent_streams() {
    let s = Served::start(&["--engine", "model", "--shards", "1", "--threads-per-shard", "2"]);
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let addr = s.addr.clone();
            let body = json!({
                "messages": [{"role": "user", "content": format!("Count to {}.", i + 3)}],
                "max_tokens": 8, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}});
            std::thread::spawn(move || {
                http(&addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()))
            })
        })
        .collect();
    for h in handles {
        let r = h.join().expect("client");
        assert_eq!(r.status, 200, "{}", r.text());
        let ev = sse_events(&r.text());
        assert_eq!(ev.last().and_then(Value::as_str), Some("[DONE]"));
        let usage = &ev[ev.len() - 2]["usage"];
        let n = usage["completion_tokens"].as_u64().expect("usage");
        assert!((1..=8).contains(&n), "{usage}");
        let reason = ev[ev.len() - 3]["choices"][0]["finish_reason"].as_str().unwrap_or("");
        assert!((reason == "length" && n == 8) || reason == "stop", "{reason} {n}");
        assert!(usage["prompt_tokens"].as_u64().is_some_and(|p| p > 10));
    }
    // Greedy decoding is deterministic across the streamed and the whole response.
    let body = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
                      "temperature": 0});
    let a = s.post("/v1/chat/completions", &body).json();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let streamed: String = s
        .post("/v1/chat/completions", &sb)
        .events()
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(a["choices"][0]["message"]["content"].as_str(), Some(streamed.as_str()));
    assert!(a["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().is_some());
}
