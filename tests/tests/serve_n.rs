//! `n` choices per prompt and `echo` on `kvx serve`: response shapes on the mocker (indexes in
//! whole responses and in SSE chunks, usage counting the prompt once, list prompts × n, the
//! bounds, `echo` alone, with `logprobs` and with `max_tokens: 0`, a key's concurrency counting every choice,
//! and a client that hangs up cancelling every choice), and on the model's kernels eight
//! seeded choices of a 1,000-token prompt whose prefill is computed once (engine counters).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use kvx_e2e::serve::{Endpoint, HttpResponse, Served, http, open_stream, sse_events};
use serde_json::{Value, json};

const FAST: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "1"];
/// Real-time mocker: a long stream outlives what a test needs of it.
const SLOW: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1", "--shards", "1"];
/// The model's kernels.
const MODEL: &[&str] = &["--engine", "model", "--shards", "1", "--threads-per-shard", "2"];

fn ok(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn bad_request(r: &HttpResponse, param: &str) -> String {
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["param"], param, "{v}");
    v["error"]["message"].as_str().unwrap_or_default().to_string()
}

/// Per index, the text of a streamed completion's (or chat's) chunks and its finish reason;
/// also the usage chunk, if any. Checks the stream ends with `[DONE]`.
fn streamed(events: &[Value]) -> (BTreeMap<u64, (String, String)>, Option<Value>) {
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{events:?}");
    let mut by_index: BTreeMap<u64, (String, String)> = BTreeMap::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        assert!(e.get("error").is_none(), "{e}");
        if e["usage"].is_object() {
            usage = Some(e["usage"].clone());
            continue;
        }
        let choices = e["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 1, "{e}");
        let c = &choices[0];
        let i = c["index"].as_u64().expect("index");
        let entry = by_index.entry(i).or_default();
        let text = c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).unwrap_or("");
        entry.0.push_str(text);
        if let Some(f) = c["finish_reason"].as_str() {
            assert!(entry.1.is_empty(), "two finishes for {i}");
            entry.1 = f.to_string();
        }
    }
    (by_index, usage)
}

#[test]
fn n_choices_in_whole_and_streamed_responses() {
    let s = Served::start(FAST);
    // One choice, for the prompt's size.
    let one =
        ok(&s.post("/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 5})));
    let prompt_tokens = one["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");

    let v = ok(&s.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "n": 3, "temperature": 0.8}),
    ));
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["finish_reason"], "length", "{v}");
        assert!(c["text"].is_string());
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "the prompt counts once: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 15, "{v}");
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 15, "{v}");

    // Chat, streamed with usage: every index has its role, text and finish.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                      "n": 3, "seed": 7, "stream": true,
                      "stream_options": {"include_usage": true}});
    let one_chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let chat_prompt = ok(&s.post("/v1/chat/completions", &one_chat))["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    let r = s.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.events();
    let roles: HashSet<u64> = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["role"] == "assistant")
        .filter_map(|e| e["choices"][0]["index"].as_u64())
        .collect();
    assert_eq!(roles, HashSet::from([0, 1, 2]));
    let (by_index, usage) = streamed(&events);
    assert_eq!(by_index.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(by_index.values().all(|(_, f)| f == "length"), "{by_index:?}");
    let usage = usage.expect("usage chunk");
    assert_eq!(usage["prompt_tokens"], chat_prompt, "{usage}");
    assert_eq!(usage["completion_tokens"], 12, "{usage}");

    // Whole chat response: indexes in order.
    let mut whole = chat.clone();
    whole["stream"] = json!(false);
    let v = ok(&s.post("/v1/chat/completions", &whole));
    let idx: Vec<u64> =
        v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, vec![0, 1, 2], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], chat_prompt, "{v}");

    // Greedy with n > 1 is allowed.
    let v = ok(&s.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 3, "n": 2, "temperature": 0}),
    ));
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);

    // The bounds.
    for n in [0, 17, 1000] {
        let m = bad_request(&s.post("/v1/completions", &json!({"prompt": "Hi", "n": n})), "n");
        assert!(m.contains("16"), "{m}");
        bad_request(
            &s.post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "Hi"}], "n": n}),
            ),
            "n",
        );
    }
    let v = ok(&s.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1, "n": 16})));
    assert_eq!(v["choices"].as_array().unwrap().len(), 16);
}

#[test]
fn list_prompts_times_n_and_echo() {
    let s = Served::start(FAST);
    let prompts = ["The sky is", "Two plus two is"];
    let body = json!({"prompt": prompts, "max_tokens": 3, "n": 2, "echo": true});
    let v = ok(&s.post("/v1/completions", &body));
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4, "{v}");
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], k, "{v}");
        let text = c["text"].as_str().expect("text");
        assert!(text.starts_with(prompts[k / 2]), "choice {k} = {text:?}");
        assert!(text.len() > prompts[k / 2].len(), "choice {k} generated nothing: {text:?}");
    }
    // Each prompt once.
    let p: u64 = prompts
        .iter()
        .map(|p| {
            ok(&s.post("/v1/completions", &json!({"prompt": p, "max_tokens": 1})))["usage"]
                ["prompt_tokens"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], p, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");

    // Streamed: each index's first text chunk is its prompt.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let events = s.post("/v1/completions", &sb).events();
    for k in 0..4u64 {
        let first = events
            .iter()
            .find(|e| e["choices"][0]["index"] == k && e["choices"][0]["text"].is_string())
            .unwrap_or_else(|| panic!("no chunk for {k}: {events:?}"));
        assert_eq!(first["choices"][0]["text"], prompts[k as usize / 2], "{first}");
    }
    let (by_index, _) = streamed(&events);
    assert_eq!(by_index.len(), 4);
    for (k, (text, finish)) in &by_index {
        assert!(text.starts_with(prompts[*k as usize / 2]), "{k}: {text:?}");
        assert_eq!(finish, "length");
    }

    // Token ids are echoed as their text.
    let ids = s.post("/tokenize", &json!({"prompt": "Hello world", "add_special_tokens": false}));
    let ids = ok(&ids)["tokens"].clone();
    let v = ok(&s.post("/v1/completions", &json!({"prompt": ids, "max_tokens": 2, "echo": true})));
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert!(text.starts_with("Hello world"), "{text:?}");

    // echo with logprobs: the prompt's tokens with their scores (the first has none), then
    // the generated token's (the model's scores are checked in prompt_logprobs.rs).
    let body = json!({"prompt": ids, "echo": true, "logprobs": 1, "max_tokens": 1, "n": 2});
    let v = ok(&s.post("/v1/completions", &body));
    let n_ids = ids.as_array().map_or(0, Vec::len);
    for c in v["choices"].as_array().expect("choices") {
        let lp = &c["logprobs"]["token_logprobs"];
        assert_eq!(lp.as_array().map(Vec::len), Some(n_ids + 1), "{v}");
        assert!(lp[0].is_null() && lp[1].is_f64(), "{v}");
    }

    // echo with max_tokens 0: the prompt alone, ended by length, nothing generated.
    let body = json!({"prompt": prompts, "max_tokens": 0, "echo": true, "n": 2});
    let v = ok(&s.post("/v1/completions", &body));
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4, "{v}");
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], k);
        assert_eq!(c["text"], prompts[k / 2], "{v}");
        assert_eq!(c["finish_reason"], "length", "{v}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], p, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let (by_index, usage) = streamed(&s.post("/v1/completions", &sb).events());
    assert_eq!(by_index.len(), 4);
    for (k, (text, finish)) in &by_index {
        assert_eq!(text, prompts[*k as usize / 2]);
        assert_eq!(finish, "length");
    }
    assert_eq!(usage.expect("usage")["completion_tokens"], 0);
    // Without echo, max_tokens 0 stays refused.
    bad_request(
        &s.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 0})),
        "max_tokens",
    );
}

fn running(s: &Served) -> f64 {
    s.metric("kvx_running_requests").unwrap_or(0.0) + s.metric("kvx_queue_depth").unwrap_or(0.0)
}

#[test]
fn a_keys_concurrency_counts_every_choice_and_a_hang_up_cancels_them_all() {
    let dir = std::env::temp_dir().join(format!("kvx-serve-n-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    let keys = dir.join("api-keys");
    std::fs::write(&keys, "k-three * concurrency=3\n").expect("keys file");
    let file = keys.display().to_string();
    let mut args = SLOW.to_vec();
    args.extend(["--api-keys-file", &file]);
    let s = Served::start(&args);
    let auth = [("Authorization", "Bearer k-three")];
    let short = json!({"prompt": "Hi", "max_tokens": 2});
    let post =
        |b: &Value| http(&s.addr, "POST", "/v1/completions", &auth, Some(b.to_string().as_bytes()));

    // A stream of three choices fills the key's three places.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true,
                      "stream": true, "n": 3});
    let (stream, _) = open_stream(&s.addr, "/v1/completions", &auth, &long, 4);
    let r = post(&short);
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.text().contains("concurrency"), "{}", r.text());
    let t0 = Instant::now();
    while running(&s) < 3.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "three choices never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(running(&s), 3.0);

    // Hanging up cancels all three engine requests and frees the key.
    drop(stream);
    let t0 = Instant::now();
    while running(&s) > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "choices still run: {}", running(&s));
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    loop {
        let r = post(&short);
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(t0.elapsed() < Duration::from_secs(10), "the key was not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A request of more choices than the limit runs alone.
    let v = ok(&post(&json!({"prompt": "Hi", "max_tokens": 2, "n": 4})));
    assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvx_worker_prefill_tokens_total`, summed over workers, once it has settled.
fn prefill_tokens(s: &Served) -> f64 {
    let read = || -> f64 {
        s.get("/metrics")
            .text()
            .lines()
            .filter(|l| l.starts_with("kvx_worker_prefill_tokens_total"))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    };
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}

#[test]
fn eight_seeded_choices_compute_the_prompt_once() {
    let s = Served::start(MODEL);
    let text = "The old lighthouse keeper walked along the rocky shore every morning, \
                counting the boats that came back from the sea. "
        .repeat(48);
    let tok = ok(&s.post("/tokenize", &json!({"prompt": text})));
    let mut a: Vec<u64> =
        tok["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    // An open question at the end, so that sampled continuations differ.
    let q = "\n\nEnough about the sea. Tell me about your favourite food and why you like it:";
    let q = ok(&s.post("/tokenize", &json!({"prompt": q, "add_special_tokens": false})));
    let q: Vec<u64> = q["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert!(a.len() + q.len() >= 1000, "{} tokens", a.len());
    // 1,000 tokens: 62 full blocks of 16 and 8 more.
    a.truncate(1000 - q.len());
    a.extend(q);
    // A second prompt of the same length that shares no KV block with the first.
    let mut b = a.clone();
    b[1] = if b[1] > 100 { b[1] - 1 } else { b[1] + 1 };

    let p0 = prefill_tokens(&s);
    let one = ok(&s.post(
        "/v1/completions",
        &json!({"prompt": a, "max_tokens": 16, "temperature": 0.9, "seed": 1,
                "ignore_eos": true}),
    ));
    let p1 = prefill_tokens(&s);
    let eight = ok(&s.post(
        "/v1/completions",
        &json!({"prompt": b, "max_tokens": 16, "temperature": 0.9, "seed": 1, "n": 8,
                "ignore_eos": true}),
    ));
    let p8 = prefill_tokens(&s);
    let (d1, d8) = (p1 - p0, p8 - p1);
    println!(
        "prompt {} tokens: prefill counter +{d1} for n=1, +{d8} for n=8 (usage {} / {})",
        a.len(),
        one["usage"],
        eight["usage"]
    );
    let choices = eight["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 8);
    let texts: HashSet<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert!(texts.len() >= 7, "{} distinct texts: {texts:?}", texts.len());
    assert_eq!(eight["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(eight["usage"]["prompt_tokens"], a.len() as u64);
    assert_eq!(eight["usage"]["completion_tokens"], 8 * 16);
    assert!(d1 >= a.len() as f64, "the n=1 prompt was computed: +{d1}");
    // The followers start from the first choice's computed prompt: not a token more.
    assert_eq!(d8, a.len() as f64, "the n=8 prompt was computed more than once: +{d8}");
}

#[test]
fn sse_helper_reads_indexes() {
    // The parser above on a hand-written stream (so a failure points at the server).
    let text = "data: {\"choices\":[{\"index\":1,\"text\":\"a\",\"finish_reason\":null}]}\n\n\
                data: {\"choices\":[{\"index\":1,\"text\":\"\",\"finish_reason\":\"stop\"}]}\n\n\
                data: [DONE]\n\n";
    let (m, u) = streamed(&sse_events(text));
    assert_eq!(m[&1], ("a".to_string(), "stop".to_string()));
    assert!(u.is_none());
}
