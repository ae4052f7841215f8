//! Discovery through an etcd that asks who is calling: over TLS with client certificates
//! (`--client-cert-auth`), and with a user and password (tokens that expire, and that etcd
//! forgets when it restarts). The fleet forms and serves with the right credentials; the
//! wrong ones stop a worker or frontend at start, with a message naming etcd and the cause.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_e2e::certs::Ca;
use kvx_e2e::etcd::EtcdServer;
use kvx_e2e::planes::{Frontend, Worker};
use kvx_e2e::serve::http;
use kvx_e2e::{kvx_bin, test_model};
use serde_json::json;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn served(f: &Frontend) {
    let body = json!({ "prompt": [300, 301, 302, 303], "max_tokens": 3 }).to_string();
    let r = http(&f.addr, "POST", "/v1/completions", &[], Some(body.as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
}

fn mocker(id: &str, d: &[String]) -> Worker {
    let mut a = vec!["worker", "--listen", "127.0.0.1:0", "--engine", "mocker", "--worker-id", id];
    a.extend(d.iter().map(String::as_str));
    Worker::with_args(None, &a)
}

fn frontend(d: &[String]) -> Frontend {
    Frontend::start(&d.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Runs `kvx ARGS`, which must fail within 60 s; its stderr.
fn fails_at_start(args: &[String]) -> String {
    let mut cmd = Command::new(kvx_bin());
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    if let Some(home) = std::env::var_os("KVX_HOME") {
        cmd.env("KVX_HOME", home);
    }
    let mut child = cmd.spawn().expect("spawning kvx");
    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for kvx") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().expect("kvx output");
            panic!("kvx {args:?} still runs after 60 s: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().expect("kvx output");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!status.success(), "kvx {args:?} succeeded: {err}");
    eprintln!("refused as expected: {}", err.trim());
    err
}

fn worker_args(d: &[String]) -> Vec<String> {
    let mut a: Vec<String> = ["worker", "--listen", "127.0.0.1:0", "--engine", "mocker"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(d.iter().cloned());
    a
}

fn wait(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// etcd over TLS asking for client certificates: a frontend and a worker with a certificate
/// from etcd's CA find each other and serve; without one, with one from another CA, or
/// trusting another CA for etcd's own certificate, they stop at start and say why.
#[test]
fn a_fleet_forms_over_tls_with_client_certificates_and_strangers_are_refused_at_start() {
    let dir = scratch("etcd-tls");
    let ca = Ca::new(&dir, "etcd");
    let server = ca.issue("etcd-server", &["127.0.0.1", "localhost"]);
    let client = ca.issue("kvx-client", &["127.0.0.1", "localhost"]);
    let other = Ca::new(&dir, "other");
    let stranger = other.issue("stranger", &["127.0.0.1", "localhost"]);
    let etcd = EtcdServer::start_tls(&server, &ca.ca_pem);
    assert!(etcd.url.starts_with("https://"), "{}", etcd.url);

    let base: Vec<String> = ["--discovery", "etcd", "--etcd-endpoints", &etcd.url]
        .iter()
        .map(|s| s.to_string())
        .chain(["--namespace", "tls", "--lease-ttl", "3"].map(String::from))
        .collect();
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().cloned().chain(extra.iter().map(|s| s.to_string())).collect()
    };
    let (ca_pem, other_pem) = (path(&ca.ca_pem), path(&other.ca_pem));
    let (cert, key) = (path(&client.cert), path(&client.key));
    let good = with(&["--etcd-ca", &ca_pem, "--etcd-cert", &cert, "--etcd-key", &key]);

    let f = frontend(&good);
    let _w = mocker("10", &good);
    f.wait_workers(1);
    served(&f);

    // No client certificate.
    let err = fails_at_start(&worker_args(&with(&["--etcd-ca", &ca_pem])));
    assert!(err.contains("etcd") && err.contains("client certificate"), "{err}");
    assert!(err.contains("--etcd-cert"), "says what to give: {err}");
    // A frontend without one stops too.
    let model = path(&test_model());
    let mut fa: Vec<String> =
        ["frontend", "--port", "0", "--worker-listen", "127.0.0.1:0", "--model", &model]
            .iter()
            .map(|s| s.to_string())
            .collect();
    fa.extend(with(&["--etcd-ca", &ca_pem]));
    let err = fails_at_start(&fa);
    assert!(err.contains("etcd") && err.contains("client certificate"), "{err}");
    // A client certificate from a CA etcd does not trust.
    let (s_cert, s_key) = (path(&stranger.cert), path(&stranger.key));
    let err = fails_at_start(&worker_args(&with(&[
        "--etcd-ca",
        &ca_pem,
        "--etcd-cert",
        &s_cert,
        "--etcd-key",
        &s_key,
    ])));
    assert!(err.contains("etcd refused the client certificate"), "{err}");
    // A CA that did not sign etcd's certificate.
    let err = fails_at_start(&worker_args(&with(&[
        "--etcd-ca",
        &other_pem,
        "--etcd-cert",
        &cert,
        "--etcd-key",
        &key,
    ])));
    assert!(err.contains("etcd's server certificate is not trusted"), "{err}");
    // https:// without a CA at all.
    let err = fails_at_start(&worker_args(&base));
    assert!(err.contains("--etcd-ca"), "{err}");

    // The fleet that formed is untouched by the refused ones.
    assert_eq!(f.workers_up(), 1);
    served(&f);
    let _ = std::fs::remove_dir_all(&dir);
}

/// etcd with authentication on (simple tokens that expire after 2 s idle): a frontend and
/// workers with a user and password form a fleet; a worker whose token expired still takes
/// its records out when it stops; after an etcd restart (every token forgotten) the
/// frontend authenticates again and sees a new worker. A wrong password stops a worker at
/// start, naming the authentication failure.
#[test]
fn a_fleet_forms_with_a_user_and_password_and_survives_token_expiry() {
    let dir = scratch("etcd-auth");
    let mut etcd =
        EtcdServer::start_plain_with(&["--auth-token", "simple", "--auth-token-ttl", "2"]);
    let (user, password) = ("kvx-fleet", "correct horse battery");
    etcd.enable_auth(user, password);
    let pw = dir.join("etcd-password");
    std::fs::write(&pw, format!("{password}\n")).expect("password file");
    let bad = dir.join("wrong-password");
    std::fs::write(&bad, "Tr0ub4dor&3\n").expect("password file");

    let url = etcd.url.clone();
    let d = |ttl: &str, pw: &Path| -> Vec<String> {
        let pw = path(pw);
        ["--discovery", "etcd", "--etcd-endpoints", &url, "--namespace", "auth"]
            .iter()
            .map(|s| s.to_string())
            .chain(
                ["--lease-ttl", ttl, "--etcd-user", user, "--etcd-password-file", &pw]
                    .map(String::from),
            )
            .collect()
    };
    let f = frontend(&d("3", &pw));
    // A long lease: its records go at once only if it can still revoke the lease.
    let mut w1 = mocker("10", &d("60", &pw));
    f.wait_workers(1);
    served(&f);
    let key = "/kvx/auth/workers/10";
    assert!(etcd.key_exists_as(user, password, key));

    // Every token goes stale (2 s TTL, and keep-alives do not use it).
    std::thread::sleep(Duration::from_secs(4));
    let _w2 = mocker("20", &d("3", &pw));
    f.wait_workers(2);
    w1.signal("TERM");
    let gone = wait("worker 10's key gone", Duration::from_secs(10), || {
        !etcd.key_exists_as(user, password, key)
    });
    eprintln!("a worker with a stale token withdrew its records in {gone:?} (lease TTL 60 s)");
    assert!(w1.wait_exit(Duration::from_secs(30)).is_some(), "worker 10 exited");
    f.wait_workers(1);

    // etcd restarts: it forgets every token; the frontend's watch breaks and is set up
    // again with a fresh token, and a worker started now is seen.
    etcd.kill();
    etcd.run();
    let _w3 = mocker("30", &d("3", &pw));
    let seen = wait("worker 30 seen", Duration::from_secs(20), || f.workers_up() == 2);
    eprintln!("after an etcd restart a new worker was seen in {seen:?}");
    served(&f);

    // A wrong password, and no user at all.
    let err = fails_at_start(&worker_args(&d("3", &bad)));
    assert!(err.contains("etcd") && err.contains("authentication failed"), "{err}");
    let no_user: Vec<String> = ["--discovery", "etcd", "--etcd-endpoints", &etcd.url]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let err = fails_at_start(&worker_args(&no_user));
    assert!(err.contains("etcd requires a user"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
