//! Helpers for tests of `kvx serve`: the server process on an ephemeral port, a minimal
//! HTTP/1.1 client on plain sockets (so tests control every byte and can hang up mid-stream),
//! SSE parsing and `/metrics` look-ups.

use std::process::Command;

use crate::{kvx_bin, test_model};

/// A `kvx serve` process on an ephemeral port of 127.0.0.1, killed when dropped.
#[derive(Debug)]
pub struct Served {
    child: std::process::Child,
    /// `127.0.0.1:PORT` (served over HTTPS when started with `--tls-cert`).
    pub addr: String,
    /// What the server printed on stdout before the address line.
    pub banner: String,
}

impl Served {
    /// Starts `kvx serve --port 0 --model $KVX_TEST_MODEL ARGS` and waits for its address.
    pub fn start(args: &[&str]) -> Served {
        Self::start_env(args, &[])
    }

    /// Like [`Served::start`] with extra environment variables.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Served {
        Self::start_cmd(args, |cmd| {
            for (k, v) in env {
                cmd.env(k, v);
            }
        })
    }

    /// Like [`Served::start`] with the KV cache `kvx serve` sizes by default (a quarter of
    /// RAM, at most 4 GiB, shared by its engines), whatever budget the test run sets for its
    /// servers (`KVX_KV_CACHE_BYTES`), and the default block size, arithmetic and sequence
    /// limit that the cache's size in blocks depends on.
    pub fn start_with_default_kv(args: &[&str]) -> Served {
        Self::start_cmd(args, |cmd| {
            for var in ["KVX_KV_CACHE_BYTES", "KVX_BLOCK_SIZE", "KVX_ARITH", "KVX_MAX_NUM_SEQS"] {
                cmd.env_remove(var);
            }
        })
    }

    /// Starts `kvx serve` as [`Served::start`] does, with `adjust` applied to the command.
    fn start_cmd(args: &[&str], adjust: impl FnOnce(&mut Command)) -> Served {
        use std::io::{BufRead, BufReader};
        let model = test_model();
        let mut cmd = Command::new(kvx_bin());
        cmd.arg("serve").arg("--port").arg("0").arg("--model").arg(&model).args(args);
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::inherit());
        if let Some(home) = std::env::var_os("KVX_HOME") {
            cmd.env("KVX_HOME", home);
        }
        adjust(&mut cmd);
        let mut child = cmd.spawn().expect("spawning kvx serve");
        let stdout = child.stdout.take().expect("stdout");
        #[allow(clippy::disallowed_methods)] // a child's stdout lines: as many as it prints
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut banner = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let addr = line
                    .strip_prefix("listening on http://")
                    .or_else(|| line.strip_prefix("listening on https://"));
                if let Some(a) = addr {
                    let _ = tx.send(Ok((a.trim().to_string(), banner.clone())));
                } else {
                    banner.push_str(&line);
                    banner.push('\n');
                }
            }
            let _ = tx.send(Err(banner));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(Ok((addr, banner))) => Served { child, addr, banner },
            other => {
                let _ = child.kill();
                panic!("kvx serve did not print its address: {other:?}");
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the server SIGTERM.
    pub fn terminate(&self) {
        let term = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(term.success(), "kill -TERM {} failed", self.pid());
    }

    /// Sends the server SIGHUP (reload the API keys file and the TLS certificate).
    pub fn hangup(&self) {
        let hup = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(hup.success(), "kill -HUP {} failed", self.pid());
    }

    /// Waits for the process to exit, up to `timeout`; its exit status if it did.
    pub fn wait_exit(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let end = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }
}

/// A server under test: the requests and metrics every kvx HTTP server answers.
pub trait Endpoint {
    /// Its HTTP address.
    fn addr(&self) -> &str;

    /// `GET path`.
    fn get(&self, path: &str) -> HttpResponse {
        http(self.addr(), "GET", path, &[], None)
    }

    /// `POST path` with a JSON body.
    fn post(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        http(self.addr(), "POST", path, &[], Some(body.to_string().as_bytes()))
    }

    /// The value of a series (its name with its labels, as printed) in `/metrics`.
    fn metric(&self, series: &str) -> Option<f64> {
        metric_in(&self.get("/metrics").text(), series)
    }
}

/// The value of a series (its name with its labels, as printed) in `/metrics` text.
pub fn metric_in(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        (name == series).then(|| v.parse().ok()).flatten()
    })
}

/// Starts a streamed `POST path` with `headers` and reads until `events` SSE messages came;
/// the socket stays open (drop it to hang up). Returns it with what was read.
pub fn open_stream(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
    events: usize,
) -> (std::net::TcpStream, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).expect("timeout");
    let b = body.to_string();
    let mut req = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    ));
    s.write_all(req.as_bytes()).expect("writing");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("data: ").count() < events {
        let k = s.read(&mut buf).expect("reading the stream");
        assert!(k > 0, "the stream ended early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..k]);
    }
    (s, String::from_utf8_lossy(&got).into_owned())
}

impl Endpoint for Served {
    fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response read off the socket.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body (chunked encoding removed).
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.text()))
    }

    /// The `data:` payloads of an SSE body, `[DONE]` as the string "[DONE]".
    pub fn events(&self) -> Vec<serde_json::Value> {
        sse_events(&self.text())
    }
}

/// The `data:` payloads of SSE text.
pub fn sse_events(text: &str) -> Vec<serde_json::Value> {
    text.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| {
            if d == "[DONE]" {
                serde_json::Value::String(d.into())
            } else {
                serde_json::from_str(d).unwrap_or_else(|e| panic!("bad SSE data ({e}): {d:?}"))
            }
        })
        .collect()
}

/// Sends one HTTP/1.1 request (`Connection: close`) and reads the whole response.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("writing");
    if let Some(b) = body {
        // The server may answer (413) and close before reading everything.
        let _ = s.write_all(b);
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

/// Parses a complete HTTP/1.1 response.
pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    HttpResponse { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&b[..eol]).split(';').next().unwrap_or("0").trim(),
            16,
        )
        .unwrap_or(0);
        b = &b[eol + 2..];
        if size == 0 || b.len() < size {
            out.extend_from_slice(&b[..size.min(b.len())]);
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or(&[]);
    }
    out
}
