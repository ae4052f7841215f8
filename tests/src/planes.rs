//! Helpers for the worker-plane tests: a `kvx frontend` and `kvx worker` processes on
//! 127.0.0.1, each killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::serve::Endpoint;
use crate::{kvx_bin, test_model};

/// Heartbeat flags that make lost workers visible within about a second.
pub const FAST_HEARTBEAT: [&str; 4] = ["--heartbeat-ms", "200", "--heartbeat-timeout-ms", "1000"];

/// Spawns `kvx ARGS` with stdout piped into a channel of lines, in network namespace `ns`
/// when given (`ip netns exec`).
fn spawn_in(ns: Option<&str>, args: &[String]) -> (Child, Receiver<String>) {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(kvx_bin());
            c
        }
        None => Command::new(kvx_bin()),
    };
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    if let Some(home) = std::env::var_os("KVX_HOME") {
        cmd.env("KVX_HOME", home);
    }
    let mut child = cmd.spawn().expect("spawning kvx");
    let stdout = child.stdout.take().expect("stdout");
    #[allow(clippy::disallowed_methods)] // a child's stdout lines: as many as it prints
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Waits for a stdout line starting with `prefix`; returns the rest of it.
fn wait_line(child: &mut Child, rx: &Receiver<String>, prefix: &str) -> String {
    let end = Instant::now() + Duration::from_secs(120);
    while Instant::now() < end {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix(prefix) {
                    return rest.trim().to_string();
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("kvx exited ({status}) before printing {prefix:?}");
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.kill();
    panic!("kvx did not print {prefix:?}");
}

/// A `kvx frontend` on ephemeral ports.
#[derive(Debug)]
pub struct Frontend {
    child: Child,
    /// HTTP address.
    pub addr: String,
    /// The address workers join at.
    pub workers: String,
}

impl Endpoint for Frontend {
    fn addr(&self) -> &str {
        &self.addr
    }
}

impl Frontend {
    /// `kvx frontend --port 0 --worker-listen 127.0.0.1:0 --model $KVX_TEST_MODEL ARGS`.
    pub fn start(args: &[&str]) -> Frontend {
        Self::start_in(None, "127.0.0.1", args)
    }

    /// As [`Frontend::start`], in network namespace `ns` (when given), on address `ip`.
    pub fn start_in(ns: Option<&str>, ip: &str, args: &[&str]) -> Frontend {
        let model = test_model();
        let listen = format!("{ip}:0");
        let mut a: Vec<String> =
            ["frontend", "--host", ip, "--port", "0", "--worker-listen", &listen]
                .iter()
                .map(|s| s.to_string())
                .collect();
        a.push("--model".into());
        a.push(model.to_string_lossy().into_owned());
        a.extend(args.iter().map(|s| s.to_string()));
        let (mut child, rx) = spawn_in(ns, &a);
        let workers = wait_line(&mut child, &rx, "workers join at ");
        let addr = wait_line(&mut child, &rx, "listening on http://");
        Frontend { child, addr, workers }
    }

    /// Workers registered now.
    pub fn workers_up(&self) -> usize {
        self.metric("kvx_router_plane_workers").unwrap_or(0.0) as usize
    }

    /// Waits until `n` workers are registered (panics after a minute).
    pub fn wait_workers(&self, n: usize) {
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            if self.workers_up() == n {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the frontend did not reach {n} worker(s); it has {}", self.workers_up());
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvx worker` process.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    /// Where it listens for a frontend (`--listen` workers only).
    pub listen: Option<String>,
}

impl Worker {
    /// `kvx worker --frontend ADDR --engine mocker --worker-id ID ARGS`, once it has started.
    pub fn mocker(frontend: &str, worker_id: u64, args: &[&str]) -> Worker {
        let id = worker_id.to_string();
        let mut a =
            vec!["worker", "--frontend", frontend, "--engine", "mocker", "--worker-id", &id];
        a.extend_from_slice(args);
        Self::start(&a, false)
    }

    /// `kvx worker --frontend ADDR --engine model --model $KVX_TEST_MODEL --worker-id ID ARGS`.
    pub fn model(frontend: &str, worker_id: u64, args: &[&str]) -> Worker {
        Self::model_in(None, frontend, worker_id, args)
    }

    /// As [`Worker::model`], in network namespace `ns` when given.
    pub fn model_in(ns: Option<&str>, frontend: &str, worker_id: u64, args: &[&str]) -> Worker {
        let (id, model) = (worker_id.to_string(), test_model().to_string_lossy().into_owned());
        let mut a = vec!["worker", "--frontend", frontend, "--engine", "model", "--model"];
        a.extend([model.as_str(), "--worker-id", &id]);
        a.extend_from_slice(args);
        Self::start_in(ns, &a, false)
    }

    /// `kvx ARGS` (a `worker` command line), in network namespace `ns` when given; waits
    /// for its listening address when ARGS have `--listen`.
    pub fn with_args(ns: Option<&str>, args: &[&str]) -> Worker {
        Self::start_in(ns, args, args.contains(&"--listen"))
    }

    /// `kvx worker --listen 127.0.0.1:0 --engine mocker --worker-id ID ARGS`.
    pub fn mocker_listening(worker_id: u64, args: &[&str]) -> Worker {
        let id = worker_id.to_string();
        let mut a =
            vec!["worker", "--listen", "127.0.0.1:0", "--engine", "mocker", "--worker-id", &id];
        a.extend_from_slice(args);
        Self::start(&a, true)
    }

    fn start(args: &[&str], listening: bool) -> Worker {
        Self::start_in(None, args, listening)
    }

    fn start_in(ns: Option<&str>, args: &[&str], listening: bool) -> Worker {
        let a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let (mut child, rx) = spawn_in(ns, &a);
        let listen = listening.then(|| wait_line(&mut child, &rx, "listening for a frontend at "));
        wait_line(&mut child, &rx, "kvx: worker serving");
        Worker { child, listen }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL (`kill -9 PID`), then reaps the process.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) with `kill -SIGNAL PID`.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {} failed", self.pid());
    }

    /// Waits up to `timeout` for the process to exit; its status if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvx planner` process; its decisions (stdout JSON lines) are collected as they come.
#[derive(Debug)]
pub struct PlannerProc {
    child: Child,
    /// Where its own /metrics listens.
    pub metrics: String,
    rx: Receiver<String>,
    /// Decisions printed so far.
    pub decisions: Vec<serde_json::Value>,
}

impl PlannerProc {
    /// `kvx planner ARGS`, once its metrics address is printed.
    pub fn start(args: &[&str]) -> PlannerProc {
        let mut a = vec!["planner".to_string()];
        a.extend(args.iter().map(|s| s.to_string()));
        let (mut child, rx) = spawn_in(None, &a);
        let metrics = wait_line(&mut child, &rx, "planner metrics on http://");
        let metrics = metrics.trim_end_matches("/metrics").to_string();
        PlannerProc { child, metrics, rx, decisions: Vec::new() }
    }

    /// Takes the decisions printed since the last call.
    pub fn poll(&mut self) -> &[serde_json::Value] {
        while let Ok(line) = self.rx.try_recv() {
            if let Ok(v) = serde_json::from_str(&line) {
                self.decisions.push(v);
            }
        }
        &self.decisions
    }

    /// SIGTERM, then waits up to `timeout` for the exit.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for PlannerProc {
    fn drop(&mut self) {
        // SIGTERM first: the planner stops the workers it started.
        if self.terminate(Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
