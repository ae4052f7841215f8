//! `kvx serve` over HTTPS and with an API keys file: the official `openai` Python client over
//! TLS (streaming and not), plain-HTTP and untrusting clients refused, a new certificate
//! served after SIGHUP, keys limited to other models, and a key revoked on SIGHUP while a
//! request it started runs to its end.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_e2e::python_client;
use kvx_e2e::serve::{HttpResponse, Served, parse_response, sse_events};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde_json::{Value, json};

/// A test CA and the server certificate it signed, as PEM files in a fresh directory.
struct Pki {
    dir: PathBuf,
    ca: Certificate,
    ca_key: KeyPair,
    ca_pem: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    /// The server certificate's DER, as last issued.
    leaf: Vec<u8>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvx-serve-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test directory");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.distinguished_name.push(DnType::CommonName, format!("kvx {name} test CA"));
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = p.self_signed(&ca_key).expect("CA certificate");
        let ca_pem = dir.join("ca.pem");
        std::fs::write(&ca_pem, ca.pem()).expect("writing the CA");
        let mut pki = Pki {
            cert: dir.join("server-cert.pem"),
            key: dir.join("server-key.pem"),
            dir,
            ca,
            ca_key,
            ca_pem,
            leaf: Vec::new(),
        };
        pki.issue();
        pki
    }

    /// A new server certificate (new key) for 127.0.0.1 and localhost, put in place of the
    /// old files the way an operator would: written aside, then renamed over them.
    fn issue(&mut self) {
        let names = vec!["127.0.0.1".to_string(), "localhost".to_string()];
        let mut p = CertificateParams::new(names).expect("server params");
        p.distinguished_name.push(DnType::CommonName, "kvx test server");
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().expect("server key");
        let cert = p.signed_by(&key, &self.ca, &self.ca_key).expect("signing");
        replace(&self.key, key.serialize_pem().as_bytes());
        replace(&self.cert, cert.pem().as_bytes());
        self.leaf = cert.der().to_vec();
    }

    fn args(&self) -> Vec<String> {
        let (c, k) = (self.cert.display().to_string(), self.key.display().to_string());
        vec!["--tls-cert".into(), c, "--tls-key".into(), k]
    }

    /// A rustls client trusting this CA only.
    fn client(&self) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from(self.ca.der().to_vec())).expect("CA root");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(cfg)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, bytes).expect("writing");
    std::fs::rename(&tmp, path).expect("renaming");
}

/// `kvx serve ARGS EXTRA`.
fn serve(args: &[&str], extra: Vec<String>) -> Served {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(extra.iter().map(String::as_str));
    Served::start(&all)
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// A TLS connection to `addr` (127.0.0.1), handshake done.
fn connect(addr: &str, client: &Arc<ClientConfig>) -> std::io::Result<Tls> {
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(Duration::from_secs(120)))?;
    let name = ServerName::try_from("127.0.0.1").expect("server name");
    let conn = ClientConnection::new(client.clone(), name).map_err(std::io::Error::other)?;
    let mut s = StreamOwned::new(conn, tcp);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}

/// The certificate a new connection is served.
fn leaf(addr: &str, client: &Arc<ClientConfig>) -> Vec<u8> {
    let s = connect(addr, client).expect("TLS connection");
    s.conn.peer_certificates().and_then(|c| c.first()).expect("a server certificate").to_vec()
}

fn request(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> String {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(k) = key {
        req.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    match body {
        Some(b) => {
            let b = b.to_string();
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            ));
        }
        None => req.push_str("\r\n"),
    }
    req
}

/// One request over a new TLS connection; the whole response.
fn https(
    addr: &str,
    client: &Arc<ClientConfig>,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> HttpResponse {
    let mut s = connect(addr, client).expect("TLS connection");
    s.write_all(request(addr, method, path, key, body).as_bytes()).expect("writing");
    let mut raw = Vec::new();
    // A peer that closes without close_notify ends the read with an error; what came counts.
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

#[test]
fn the_openai_client_works_over_https_and_others_are_refused() {
    let pki = Pki::new("openai");
    let s = serve(&["--engine", "model", "--shards", "1", "--threads-per-shard", "2"], pki.args());
    assert!(s.banner.contains("curl https://"), "{}", s.banner);

    let stdout = python_client(
        "openai_tls.py",
        &[&format!("https://{}/v1", s.addr), &pki.ca_pem.display().to_string()],
    );
    assert!(stdout.contains("ok: 3 checks"), "{stdout}");

    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut plain = TcpStream::connect(&s.addr).expect("connecting");
    plain.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    plain.write_all(request(&s.addr, "GET", "/v1/models", None, None).as_bytes()).expect("write");
    let mut raw = Vec::new();
    let _ = plain.read_to_end(&mut raw);
    assert!(!raw.starts_with(b"HTTP/"), "{:?}", String::from_utf8_lossy(&raw));

    // A client trusting another CA refuses the server.
    let stranger = Pki::new("stranger");
    let e = connect(&s.addr, &stranger.client()).expect_err("a refused handshake");
    assert!(e.to_string().contains("certificate"), "{e}");

    // The client that trusts the CA, on rustls: the server's certificate is the one issued.
    assert_eq!(leaf(&s.addr, &pki.client()), pki.leaf);
    let m = https(&s.addr, &pki.client(), "GET", "/v1/models", None, None);
    assert_eq!(m.status, 200, "{}", m.text());
}

#[test]
fn a_new_certificate_is_served_after_sighup() {
    let mut pki = Pki::new("reload");
    let s = serve(&["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "1"], pki.args());
    let client = pki.client();
    let first = pki.leaf.clone();
    assert_eq!(leaf(&s.addr, &client), first);

    // New files alone change nothing; SIGHUP does, for new connections.
    pki.issue();
    assert_ne!(pki.leaf, first);
    assert_eq!(leaf(&s.addr, &client), first);
    let t0 = Instant::now();
    s.hangup();
    loop {
        if leaf(&s.addr, &client) == pki.leaf {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(1), "the new certificate is not served");
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("new certificate served {:?} after SIGHUP", t0.elapsed());
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3});
    let r = https(&s.addr, &client, "POST", "/v1/chat/completions", None, Some(&body));
    assert_eq!(r.status, 200, "{}", r.text());

    // A broken certificate file: the reload fails and the certificate in force stays.
    let second = pki.leaf.clone();
    replace(&pki.cert, b"not a certificate");
    s.hangup();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(leaf(&s.addr, &client), second);
    let r = https(&s.addr, &client, "POST", "/v1/chat/completions", None, Some(&body));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn keys_from_a_file_limit_models_and_are_revoked_on_sighup() {
    let pki = Pki::new("keys");
    let keys = pki.dir.join("api-keys");
    replace(&keys, b"# test keys\nkey-a\nkey-b   some-other-model  # team b\n\n");
    let mut extra = pki.args();
    extra.extend(["--api-keys-file".to_string(), keys.display().to_string()]);
    let s = serve(&["--engine", "mocker", "--speedup-ratio", "1", "--shards", "1"], extra);
    let client = pki.client();
    let call = |method: &str, path: &str, key: Option<&str>, body: Option<&Value>| {
        https(&s.addr, &client, method, path, key, body)
    };

    // A: every model.
    let models = call("GET", "/v1/models", Some("key-a"), None);
    assert_eq!(models.status, 200, "{}", models.text());
    let name = models.json()["data"][0]["id"].as_str().expect("model id").to_string();
    let chat = json!({"model": name, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 2});
    let r = call("POST", "/v1/chat/completions", Some("key-a"), Some(&chat));
    assert_eq!(r.status, 200, "{}", r.text());

    // B: only some-other-model, which this server does not serve: 404 and an empty list.
    for body in [chat.clone(), json!({"messages": [{"role": "user", "content": "Hi"}]})] {
        let r = call("POST", "/v1/chat/completions", Some("key-b"), Some(&body));
        assert_eq!(r.status, 404, "{}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["code"], "model_not_found", "{e}");
        assert!(e["error"]["message"].as_str().is_some_and(|m| m.contains("access")), "{e}");
    }
    let m = call("GET", "/v1/models", Some("key-b"), None);
    assert_eq!(m.status, 200);
    assert_eq!(m.json()["data"], json!([]));
    assert_eq!(call("GET", &format!("/v1/models/{name}"), Some("key-b"), None).status, 404);
    assert_eq!(call("GET", &format!("/v1/models/{name}"), Some("key-a"), None).status, 200);

    // Strangers.
    for key in [None, Some("key-c"), Some("key-ab")] {
        let r = call("POST", "/v1/chat/completions", key, Some(&chat));
        assert_eq!(r.status, 401, "{key:?}: {}", r.text());
    }

    // A long stream with A, then A is revoked.
    let stream = json!({"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": true,
                        "stream": true});
    let mut sock = connect(&s.addr, &client).expect("TLS connection");
    let req = request(&s.addr, "POST", "/v1/completions", Some("key-a"), Some(&stream));
    sock.write_all(req.as_bytes()).expect("writing");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("data: ").count() < 3 {
        let k = sock.read(&mut buf).expect("reading the stream");
        assert!(k > 0, "the stream ended early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..k]);
    }
    let before = String::from_utf8_lossy(&got).matches("data: ").count();

    replace(&keys, b"key-b some-other-model\n");
    let t0 = Instant::now();
    s.hangup();
    let revoked = loop {
        let r = call("GET", "/v1/models", Some("key-a"), None);
        if r.status == 401 {
            break t0.elapsed();
        }
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(t0.elapsed() < Duration::from_secs(1), "key-a still accepted after 1 s");
        std::thread::sleep(Duration::from_millis(5));
    };
    println!("key-a refused {revoked:?} after SIGHUP");
    assert_eq!(call("POST", "/v1/chat/completions", Some("key-b"), Some(&chat)).status, 404);

    // The stream A started runs to its end.
    let _ = sock.read_to_end(&mut got);
    let resp = parse_response(&got);
    assert_eq!(resp.status, 200);
    let events = sse_events(&resp.text());
    assert!(events.len() > before + 10, "{} events, {before} before the signal", events.len());
    assert_eq!(events.last().and_then(Value::as_str), Some("[DONE]"));
    let finish = events.iter().rev().find_map(|e| e["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"), "{:?}", events.iter().rev().take(3).collect::<Vec<_>>());

    // A reload that fails (the file is gone) keeps the keys in force.
    std::fs::remove_file(&keys).expect("removing the keys file");
    s.hangup();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(call("GET", "/v1/models", Some("key-b"), None).status, 200);
    assert_eq!(call("GET", "/v1/models", Some("key-a"), None).status, 401);
}
