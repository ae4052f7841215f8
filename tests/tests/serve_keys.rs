//! `kvx serve` with per-key limits and admin keys, over real sockets (long streams on the
//! real-time mocker, the rest on the model's kernels): a key's concurrency bound (429 with
//! Retry-After while another key is served, admitted again when a stream ends or its client
//! hangs up, raised by editing the file and SIGHUP), requests and tokens per minute,
//! `/metrics` behind the admin keys while the probes stay open, and refusals counted by
//! limit without naming a key.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvx_e2e::serve::{HttpResponse, Served, http, metric_in, open_stream, sse_events};
use serde_json::{Value, json};

/// A keys file in a fresh directory, removed when dropped.
struct KeysFile {
    dir: PathBuf,
    path: PathBuf,
}

impl KeysFile {
    fn new(name: &str, text: &str) -> KeysFile {
        let dir =
            std::env::temp_dir().join(format!("kvx-serve-keys-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test directory");
        let f = KeysFile { path: dir.join("api-keys"), dir };
        f.write(text);
        f
    }

    /// New contents, put in place the way an operator would: written aside, then renamed.
    fn write(&self, text: &str) {
        let tmp = self.path.with_extension("new");
        std::fs::write(&tmp, text).expect("writing the keys file");
        std::fs::rename(&tmp, &self.path).expect("renaming the keys file");
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for KeysFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Real-time mocker: a 4000-token stream runs far longer than a test needs it to.
const MOCKER: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1", "--shards", "1"];
/// The model's kernels.
const MODEL: &[&str] = &["--engine", "model", "--shards", "1", "--threads-per-shard", "2"];

/// `kvx serve ENGINE --api-keys-file KEYS EXTRA`.
fn serve(keys: &KeysFile, engine: &[&str], extra: &[&str]) -> Served {
    let file = keys.path().display().to_string();
    let mut args = engine.to_vec();
    args.extend(["--api-keys-file", &file]);
    args.extend_from_slice(extra);
    Served::start(&args)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn call(
    s: &Served,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> HttpResponse {
    let auth = key.map(bearer);
    let headers: Vec<(&str, &str)> =
        auth.as_deref().map(|a| vec![("Authorization", a)]).unwrap_or_default();
    let body = body.map(Value::to_string);
    http(&s.addr, method, path, &headers, body.as_deref().map(str::as_bytes))
}

/// A short completion with `key`.
fn short(s: &Served, key: &str) -> HttpResponse {
    call(s, "POST", "/v1/completions", Some(key), Some(&json!({"prompt": "Hi", "max_tokens": 2})))
}

/// A long stream with `key`, held open after its first events.
fn long_stream(s: &Served, key: &str) -> std::net::TcpStream {
    let body = json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true,
                      "stream": true});
    let auth = bearer(key);
    open_stream(&s.addr, "/v1/completions", &[("Authorization", &auth)], &body, 3).0
}

/// A 429 of a key's limit: its code, a `Retry-After` of at least one second (returned), and
/// a message naming the limit.
fn assert_limited(r: &HttpResponse, limit: &str) -> u32 {
    assert_eq!(r.status, 429, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");
    assert_eq!(e["error"]["type"], "rate_limit_error", "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&format!("{limit}=")), "{msg}");
    let after = r.header("retry-after").and_then(|v| v.parse::<u32>().ok());
    let after = after.unwrap_or_else(|| panic!("no Retry-After in {:?}", r.headers));
    assert!(after >= 1, "Retry-After {after}");
    after
}

/// Polls with short requests of `key` until one is served (each refusal must be the
/// concurrency limit's), failing after `within`.
fn admitted_again(s: &Served, key: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let r = short(s, key);
        if r.status == 200 {
            return t0.elapsed();
        }
        assert_limited(&r, "concurrency");
        assert!(t0.elapsed() < within, "{key} not admitted again within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn metric(s: &Served, key: &str, series: &str) -> Option<f64> {
    let r = call(s, "GET", "/metrics", Some(key), None);
    assert_eq!(r.status, 200, "{}", r.text());
    metric_in(&r.text(), series)
}

#[test]
fn a_keys_concurrency_is_bounded_released_and_raised_on_sighup() {
    let keys = KeysFile::new("concurrency", "k-two  *  concurrency=2\nk-other\n");
    let s = serve(&keys, MOCKER, &[]);

    // Two long streams with k-two: a third request is refused, while k-other is served.
    let a = long_stream(&s, "k-two");
    let b = long_stream(&s, "k-two");
    let after = assert_limited(&short(&s, "k-two"), "concurrency");
    assert_eq!(after, 1);
    let stream = json!({"prompt": "Hi", "max_tokens": 2, "stream": true});
    let r = call(&s, "POST", "/v1/completions", Some("k-two"), Some(&stream));
    assert_limited(&r, "concurrency");
    let r = short(&s, "k-other");
    assert_eq!(r.status, 200, "{}", r.text());

    // A client that hangs up frees its place.
    drop(b);
    let took = admitted_again(&s, "k-two", Duration::from_secs(10));
    println!("k-two admitted again {took:?} after a client hung up");

    // A stream that ends frees its place before its client reads the end: with `a` still
    // running, one more stream runs to its end, and the next request is admitted at once
    // (and so is the one after a whole response).
    let r = call(&s, "POST", "/v1/completions", Some("k-two"), Some(&stream));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(sse_events(&r.text()).last().and_then(Value::as_str), Some("[DONE]"));
    for _ in 0..3 {
        let r = short(&s, "k-two");
        assert_eq!(r.status, 200, "{}", r.text());
    }

    // Refusals are counted by limit, and /metrics names no key.
    let m = call(&s, "GET", "/metrics", Some("k-other"), None).text();
    let refused = metric_in(&m, "kvx_rate_limited_total{reason=\"concurrency\"}");
    assert!(refused.is_some_and(|n| n >= 2.0), "{refused:?}");
    assert_eq!(metric_in(&m, "kvx_rate_limited_total{reason=\"rpm\"}"), Some(0.0));
    assert!(!m.contains("k-two") && !m.contains("k-other"), "a key in /metrics");

    // Full again; raising the limit in the file and SIGHUP lets the third request in, the
    // running streams still counted.
    let b = long_stream(&s, "k-two");
    assert_limited(&short(&s, "k-two"), "concurrency");
    keys.write("k-two  *  concurrency=3\nk-other\n");
    s.hangup();
    let took = admitted_again(&s, "k-two", Duration::from_secs(10));
    println!("k-two admitted with concurrency=3 {took:?} after SIGHUP");
    let c = long_stream(&s, "k-two");
    assert_limited(&short(&s, "k-two"), "concurrency");
    drop((a, b, c));
}

#[test]
fn request_and_token_rates_and_admin_keys() {
    let keys = KeysFile::new(
        "rates",
        "k-rpm   *  rpm=2\n\
         k-tpm   *  tpm=50\n\
         k-ops   *  admin   # an admin key that is also an API key\n\
         k-user\n",
    );
    let s = serve(&keys, MODEL, &["--admin-key", "k-adm"]);
    let chat = |key: &str| {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3});
        call(&s, "POST", "/v1/chat/completions", Some(key), Some(&body))
    };

    // rpm=2: the third request within the minute waits for the bucket (30 s a request).
    let t0 = Instant::now();
    for _ in 0..2 {
        let r = chat("k-rpm");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let after = assert_limited(&chat("k-rpm"), "rpm");
    let elapsed = t0.elapsed().as_secs_f64();
    assert!(after <= 30 && f64::from(after) >= 29.0 - elapsed, "Retry-After {after}");
    // Other keys are not slowed.
    for _ in 0..3 {
        assert_eq!(chat("k-user").status, 200);
    }

    // tpm=50: a 100-token prompt needs the whole bucket and leaves it in debt.
    let long = json!({"prompt": "word ".repeat(100), "max_tokens": 2});
    let r = call(&s, "POST", "/v1/completions", Some("k-tpm"), Some(&long));
    assert_eq!(r.status, 200, "{}", r.text());
    let after = assert_limited(&chat("k-tpm"), "tpm");
    assert!((60..=120).contains(&after), "Retry-After {after}");

    // /metrics: admin keys only (from the flag or an `admin` line); the probes stay open.
    for (key, status) in [
        (None, 401),
        (Some("k-wrong"), 401),
        (Some("k-user"), 403),
        (Some("k-rpm"), 403),
        (Some("k-ops"), 200),
        (Some("k-adm"), 200),
    ] {
        let r = call(&s, "GET", "/metrics", key, None);
        assert_eq!(r.status, status, "{key:?}: {}", r.text());
        if status != 200 {
            assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
        }
    }
    for path in ["/health", "/live", "/ready"] {
        let r = call(&s, "GET", path, None, None);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    // The flag's admin key grants no model; an `admin` line is also an API key.
    assert_eq!(chat("k-adm").status, 404);
    assert_eq!(call(&s, "GET", "/v1/models", Some("k-adm"), None).json()["data"], json!([]));
    assert_eq!(chat("k-ops").status, 200);

    let m = call(&s, "GET", "/metrics", Some("k-adm"), None).text();
    assert_eq!(metric_in(&m, "kvx_rate_limited_total{reason=\"rpm\"}"), Some(1.0));
    assert_eq!(metric_in(&m, "kvx_rate_limited_total{reason=\"tpm\"}"), Some(1.0));
    assert_eq!(metric_in(&m, "kvx_rate_limited_total{reason=\"concurrency\"}"), Some(0.0));
    for key in ["k-rpm", "k-tpm", "k-ops", "k-user", "k-adm"] {
        assert!(!m.contains(key), "{key} in /metrics");
    }
    assert_eq!(
        metric(&s, "k-ops", "kvx_requests_total{endpoint=\"chat\",status=\"429\"}"),
        Some(2.0)
    );

    // The file's admin line removed: the flag's key still guards /metrics, k-ops is now a
    // plain API key.
    keys.write("k-rpm * rpm=2\nk-ops\nk-user\n");
    s.hangup();
    let t0 = Instant::now();
    while call(&s, "GET", "/metrics", Some("k-ops"), None).status != 403 {
        assert!(t0.elapsed() < Duration::from_secs(10), "k-ops still an admin key");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(call(&s, "GET", "/metrics", Some("k-adm"), None).status, 200);
    // rpm kept across the reload: k-rpm is still waiting.
    assert_limited(&chat("k-rpm"), "rpm");
}
