//! An etcd server for tests (Debian's `etcd-server`), on chosen or ephemeral ports, in a
//! network namespace when asked, with its own data directory; killed when dropped, and
//! restartable on the same data (an etcd that goes away and comes back); with TLS and
//! client certificates, or with users and passwords, when a test asks.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::certs::Issued;
use crate::serve::http;

/// A running (or stopped) etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    ns: Option<String>,
    /// `http://IP:PORT` (`https://` with TLS) clients use.
    pub url: String,
    addr: String,
    args: Vec<String>,
    dir: std::path::PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

impl EtcdServer {
    /// An etcd on 127.0.0.1.
    pub fn start() -> EtcdServer {
        Self::start_in(None, "127.0.0.1")
    }

    /// An etcd on `ip`, in network namespace `ns` when given.
    pub fn start_in(ns: Option<&str>, ip: &str) -> EtcdServer {
        Self::start_with(ns, ip, "http", &[])
    }

    /// An etcd on 127.0.0.1 serving clients over TLS with `server`'s certificate, asking
    /// each client for a certificate signed by `client_ca` (`--client-cert-auth`).
    pub fn start_tls(server: &Issued, client_ca: &Path) -> EtcdServer {
        let (cert, key, ca) = (server.cert.display(), server.key.display(), client_ca.display());
        let (cert, key, ca) = (cert.to_string(), key.to_string(), ca.to_string());
        let extra = [
            "--cert-file",
            &cert,
            "--key-file",
            &key,
            "--trusted-ca-file",
            &ca,
            "--client-cert-auth",
        ];
        Self::start_with(None, "127.0.0.1", "https", &extra)
    }

    /// A plain etcd on 127.0.0.1 with `extra` flags (`--auth-token-ttl 2`, say).
    pub fn start_plain_with(extra: &[&str]) -> EtcdServer {
        Self::start_with(None, "127.0.0.1", "http", extra)
    }

    fn start_with(ns: Option<&str>, ip: &str, scheme: &str, extra: &[&str]) -> EtcdServer {
        let (client, peer) = (free_port(), free_port());
        let dir =
            std::env::temp_dir().join(format!("kvx-e2e-etcd-{}-{client}", std::process::id()));
        let url = format!("{scheme}://{ip}:{client}");
        let peer_url = format!("http://{ip}:{peer}");
        let args = vec![
            "--data-dir".into(),
            dir.display().to_string(),
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url.clone(),
            "--listen-peer-urls".into(),
            peer_url.clone(),
            "--initial-advertise-peer-urls".into(),
            peer_url.clone(),
            "--initial-cluster".into(),
            format!("default={peer_url}"),
        ];
        let args = args.into_iter().chain(extra.iter().map(|s| s.to_string())).collect();
        let addr = format!("{ip}:{client}");
        let mut s = EtcdServer { child: None, ns: ns.map(str::to_string), url, addr, args, dir };
        s.run();
        s
    }

    /// Starts it (again, on the same data).
    pub fn run(&mut self) {
        let mut cmd = match &self.ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = cmd
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (Debian package etcd-server) on PATH");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            assert!(Instant::now() < end, "etcd did not start at {}", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Turns on authentication (a plain etcd): a `root` user, and `user` with `password`
    /// allowed to read and write everything under `/kvx/`.
    pub fn enable_auth(&self, user: &str, password: &str) {
        let call = |path: &str, body: serde_json::Value| {
            let r = http(&self.addr, "POST", path, &[], Some(body.to_string().as_bytes()));
            assert_eq!(r.status, 200, "etcd {path}: {}", r.text());
        };
        use serde_json::json;
        call("/v3/auth/role/add", json!({ "name": "root" }));
        call("/v3/auth/user/add", json!({ "name": "root", "password": "root-of-the-test" }));
        call("/v3/auth/user/grant", json!({ "user": "root", "role": "root" }));
        call("/v3/auth/role/add", json!({ "name": "kvx" }));
        let perm =
            json!({ "permType": "READWRITE", "key": b64(b"/kvx/"), "range_end": b64(b"/kvx0") });
        call("/v3/auth/role/grant", json!({ "name": "kvx", "perm": perm }));
        call("/v3/auth/user/add", json!({ "name": user, "password": password }));
        call("/v3/auth/user/grant", json!({ "user": user, "role": "kvx" }));
        call("/v3/auth/enable", json!({}));
    }

    /// Whether `key` exists, read as `user` with `password` (a plain etcd with auth).
    pub fn key_exists_as(&self, user: &str, password: &str, key: &str) -> bool {
        let body = serde_json::json!({ "name": user, "password": password }).to_string();
        let r = http(&self.addr, "POST", "/v3/auth/authenticate", &[], Some(body.as_bytes()));
        let token = r.json()["token"].as_str().unwrap_or_default().to_string();
        let body = serde_json::json!({ "key": b64(key.as_bytes()) }).to_string();
        let headers = [("Authorization", token.as_str())];
        let r = http(&self.addr, "POST", "/v3/kv/range", &headers, Some(body.as_bytes()));
        assert_eq!(r.status, 200, "etcd range: {}", r.text());
        r.json()["count"].as_str().is_some_and(|c| c != "0")
    }

    /// Kills it (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Base64 (standard, padded), as etcd's gateway has keys.
pub fn b64(b: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}
