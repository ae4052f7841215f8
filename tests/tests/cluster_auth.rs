//! Who may join a cluster: `kvx frontend` and `kvx worker` processes with a shared token or
//! mutual TLS admit each other and nobody else, in both directions (workers that dial the
//! frontend, a frontend that dials `--listen` workers); a raw TCP client speaking the plane's
//! frames without the handshake gets a closed connection and not a byte. With mutual TLS a
//! disaggregated frontend + prefill + decode trio serves (its KV moving through
//! kvx-xfer agents that admit only peers holding their key).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvx_e2e::certs::Ca;
use kvx_e2e::planes::{FAST_HEARTBEAT, Frontend, Worker};
use kvx_e2e::serve::{Endpoint, http};
use serde_json::{Value, json};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvx-cluster-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn token_file(dir: &Path, name: &str, token: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, token).expect("token file");
    p.to_string_lossy().into_owned()
}

fn args<'a>(parts: &[&'a [&'a str]]) -> Vec<&'a str> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// A plane frame: `len u32 LE | version 1 | kind | JSON`.
fn frame(kind: u8, body: &Value) -> Vec<u8> {
    let j = body.to_string();
    let mut f = ((j.len() + 2) as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&[1, kind]);
    f.extend_from_slice(j.as_bytes());
    f
}

/// Connects to `addr`, writes `bytes`, and returns what comes back before the peer closes
/// (panics if it stays open past 8 s: the handshake timeout is 5 s).
fn raw_exchange(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    let _ = s.write_all(bytes);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the connection stayed open ({e}) after sending {got:?}"),
        }
    }
}

fn chat(addr: &str) -> Value {
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let r = http(addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Waits `d` and checks the frontend still has `n` workers.
fn still(f: &Frontend, n: usize, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        assert_eq!(f.workers_up(), n, "a worker without the credential joined");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_shared_token_admits_members_and_refuses_everyone_else_both_ways() {
    let d = dir("token");
    let good = token_file(&d, "token", "7c2f0a9e1b5d4c3a8f6e2d1c0b9a8f7e\n");
    let bad = token_file(&d, "wrong", "7c2f0a9e1b5d4c3a8f6e2d1c0b9a8f7f\n");
    let tok = ["--cluster-token-file", good.as_str()];

    // Workers that dial the frontend.
    let f = Frontend::start(&args(&[&tok, &FAST_HEARTBEAT]));
    let _w1 = Worker::mocker(&f.workers, 1, &args(&[&tok, &FAST_HEARTBEAT]));
    f.wait_workers(1);
    let v = chat(&f.addr);
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let _no = Worker::mocker(&f.workers, 2, &FAST_HEARTBEAT);
    let _wrong =
        Worker::mocker(&f.workers, 3, &args(&[&["--cluster-token-file", &bad], &FAST_HEARTBEAT]));
    still(&f, 1, Duration::from_secs(3));
    // A raw client registering a worker with the plane's own frames: closed, not a byte.
    let reg = frame(
        1,
        &json!({"worker_id": 4, "model": "x", "block_size": 16, "kv_blocks": 64, "max_num_seqs": 8}),
    );
    assert_eq!(raw_exchange(&f.workers, &reg), Vec::<u8>::new());
    assert_eq!(f.workers_up(), 1);

    // A frontend that dials `--listen` workers.
    let lw = Worker::mocker_listening(10, &args(&[&tok, &FAST_HEARTBEAT]));
    let listen = lw.listen.clone().expect("listen address");
    let open = Frontend::start(&args(&[&["--workers", &listen], &FAST_HEARTBEAT]));
    still(&open, 0, Duration::from_secs(3));
    let keyed = Frontend::start(&args(&[&["--workers", &listen], &tok, &FAST_HEARTBEAT]));
    keyed.wait_workers(1);
    chat(&keyed.addr);
    // A raw client submitting a request to the worker: closed, not a byte.
    let submit = frame(3, &json!({"worker_id": 10, "request": {"id": 1}}));
    assert_eq!(raw_exchange(&listen, &submit), Vec::<u8>::new());
    // Junk shorter than the hello is dropped at the handshake timeout.
    assert_eq!(raw_exchange(&listen, b"GET / HTTP/1.0\r\n\r\n"), Vec::<u8>::new());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn mutual_tls_serves_a_disaggregated_trio_and_refuses_foreign_certificates() {
    let d = dir("mtls");
    let ca = Ca::new(&d, "cluster");
    let member = ca.issue("member", &["127.0.0.1", "localhost"]);
    let other = Ca::new(&d, "other");
    let stranger = other.issue("stranger", &["127.0.0.1", "localhost"]);
    let (ca_pem, cert, key) = (
        ca.ca_pem.to_string_lossy().into_owned(),
        member.cert.to_string_lossy().into_owned(),
        member.key.to_string_lossy().into_owned(),
    );
    let tls = ["--cluster-ca", ca_pem.as_str(), "--cluster-cert", &cert, "--cluster-key", &key];
    let f = Frontend::start(&args(&[&tls, &FAST_HEARTBEAT, &["--disagg-min-tokens", "0"]]));
    let _dw =
        Worker::model(&f.workers, 100, &args(&[&["--role", "decode"], &tls, &FAST_HEARTBEAT]));
    let _pw =
        Worker::model(&f.workers, 200, &args(&[&["--role", "prefill"], &tls, &FAST_HEARTBEAT]));
    f.wait_workers(2);
    let prompt: Vec<u32> = (0..300u32).map(|j| 300 + (j * 104_729) % 40_000).collect();
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    for _ in 0..3 {
        let r = http(&f.addr, "POST", "/v1/completions", &[], Some(body.to_string().as_bytes()));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(f.metric("kvx_router_disagg_remote_prefills_total"), Some(3.0));

    // A certificate from another CA, and no certificate at all: never registered.
    let (sc, sk, oc) = (
        stranger.cert.to_string_lossy().into_owned(),
        stranger.key.to_string_lossy().into_owned(),
        other.ca_pem.to_string_lossy().into_owned(),
    );
    let foreign = ["--cluster-ca", oc.as_str(), "--cluster-cert", &sc, "--cluster-key", &sk];
    let _f1 = Worker::mocker(&f.workers, 5, &args(&[&foreign, &FAST_HEARTBEAT]));
    let _f2 = Worker::mocker(&f.workers, 6, &FAST_HEARTBEAT);
    still(&f, 2, Duration::from_secs(3));
    let reg = frame(
        1,
        &json!({"worker_id": 7, "model": "x", "block_size": 16, "kv_blocks": 64, "max_num_seqs": 8}),
    );
    // Nothing, or a TLS alert record (type 21): never a frame of the plane.
    let got = raw_exchange(&f.workers, &reg);
    assert!(got.is_empty() || got[0] == 21, "the frontend answered {got:?}");
    let _ = std::fs::remove_dir_all(&d);
}
