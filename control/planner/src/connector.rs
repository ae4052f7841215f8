//! Where the planner's decisions go. A [`Connector`] is told the replica counts to reach and
//! says what runs; changes happen in the background (the planner holds a pool while its
//! count differs from the target).
//!
//! * [`LocalConnector`] supervises `kvx worker` processes on this host: starts them with
//!   their role, stops one by SIGTERM (the worker leaves its frontend, finishes what it runs
//!   and exits: a drain), and starts a worker again when one exits on its own.
//! * [`VirtualConnector`] writes `{prefill, decode, decision_id}` for an outside system and
//!   reports a decision's counts once that system writes `{"scaled_decision_id": N}` back.
//! * [`crate::kubernetes::KubernetesConnector`] sets the replicas of two Deployments (or
//!   StatefulSets) through the API server.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::plan::Replicas;

/// Why a connector failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    /// A process or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The outside system wrote something unreadable.
    #[error("{0}")]
    Invalid(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ConnectorError {
    let what = what.into();
    move |source| ConnectorError::Io { what, source }
}

/// Applies replica counts.
pub trait Connector: Send {
    /// The connector's name (`local`, `virtual`).
    fn name(&self) -> &'static str;
    /// Asks for `target`; returns without waiting for the change.
    fn apply(&mut self, target: Replicas, decision_id: u64) -> Result<(), ConnectorError>;
    /// What runs now (a local worker counts from its start until its drain begins).
    fn actual(&mut self) -> Result<Replicas, ConnectorError>;
}

/// The two pools, by index.
const ROLES: [&str; 2] = ["prefill", "decode"];

fn count(r: Replicas, i: usize) -> u32 {
    if i == 0 { r.prefill } else { r.decode }
}

/// One supervised worker.
#[derive(Debug)]
struct Worker {
    child: Child,
    started: Instant,
}

/// `kvx worker` processes of both roles on this host.
#[derive(Debug)]
pub struct LocalConnector {
    program: PathBuf,
    /// Arguments of every worker; `--role ROLE` is added.
    args: Vec<String>,
    /// Where each worker's output goes (`worker-ROLE-N.log`); `None`: discarded.
    log_dir: Option<PathBuf>,
    running: [Vec<Worker>; 2],
    draining: Vec<Worker>,
    target: Replicas,
    started: u64,
    restarts: u64,
    /// Workers of a role that exited soon after their start, in a row, and when the next
    /// may start: a worker that cannot start is retried with a doubling delay.
    quick_exits: [u32; 2],
    not_before: [Option<Instant>; 2],
}

/// A worker that exits within this long of its start counts as one that cannot start.
const QUICK_EXIT: Duration = Duration::from_secs(10);
/// The longest delay between starts of a worker that cannot start.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

impl LocalConnector {
    /// Workers of `kvx` (`program`) run `kvx worker WORKER_ARGS... --role ROLE`, the
    /// arguments split on spaces; their logs go to `log_dir` (created). Refused: arguments
    /// that set the role themselves (the planner gives each worker its role).
    pub fn kvx_workers(
        program: impl Into<PathBuf>,
        worker_args: &str,
        log_dir: Option<PathBuf>,
    ) -> Result<Self, ConnectorError> {
        if worker_args.split_whitespace().any(|a| a == "--role" || a.starts_with("--role=")) {
            return Err(ConnectorError::Invalid(
                "--worker-args must not set --role: the planner gives each worker its role".into(),
            ));
        }
        if let Some(d) = &log_dir {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
        }
        let mut argv = vec!["worker".to_string()];
        argv.extend(worker_args.split_whitespace().map(str::to_string));
        Ok(Self::new(program, argv, log_dir))
    }

    /// Workers run `program args... --role ROLE`.
    pub fn new(program: impl Into<PathBuf>, args: Vec<String>, log_dir: Option<PathBuf>) -> Self {
        LocalConnector {
            program: program.into(),
            args,
            log_dir,
            running: [Vec::new(), Vec::new()],
            draining: Vec::new(),
            target: Replicas::default(),
            started: 0,
            restarts: 0,
            quick_exits: [0; 2],
            not_before: [None; 2],
        }
    }

    /// Workers restarted after they exited on their own.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Workers still draining.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    fn spawn(&mut self, role: usize) -> Result<(), ConnectorError> {
        self.started += 1;
        let (out, err) = match &self.log_dir {
            Some(dir) => {
                let path = dir.join(format!("worker-{}-{}.log", ROLES[role], self.started));
                let f = std::fs::File::create(&path)
                    .map_err(io(format!("creating {}", path.display())))?;
                let g = f.try_clone().map_err(io("duplicating a log file"))?;
                (Stdio::from(f), Stdio::from(g))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let child = Command::new(&self.program)
            .args(&self.args)
            .args(["--role", ROLES[role]])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io(format!("starting {}", self.program.display())))?;
        tracing::info!(role = ROLES[role], pid = child.id(), "worker started");
        self.running[role].push(Worker { child, started: Instant::now() });
        Ok(())
    }

    /// Starts or drains workers until each pool has its target.
    fn reconcile(&mut self) -> Result<(), ConnectorError> {
        for (role, name) in ROLES.iter().enumerate() {
            let want = count(self.target, role) as usize;
            let waiting = self.not_before[role].is_some_and(|t| Instant::now() < t);
            while self.running[role].len() < want && !waiting {
                self.spawn(role)?;
            }
            while self.running[role].len() > want {
                // The newest leaves first (the oldest have the warmest caches).
                let Some(w) = self.running[role].pop() else { break };
                terminate(&w.child);
                tracing::info!(role = name, pid = w.child.id(), "worker draining");
                self.draining.push(w);
            }
        }
        Ok(())
    }

    /// Takes the exits: drained workers are gone; a running one that exited is restarted.
    fn reap(&mut self) -> Result<(), ConnectorError> {
        self.draining.retain_mut(|w| !matches!(w.child.try_wait(), Ok(Some(_))));
        for (role, name) in ROLES.iter().enumerate() {
            let before = self.running[role].len();
            let mut quick = false;
            self.running[role].retain_mut(|w| match w.child.try_wait() {
                Ok(Some(status)) => {
                    let after = w.started.elapsed();
                    quick |= after < QUICK_EXIT;
                    tracing::warn!(
                        role = name,
                        pid = w.child.id(),
                        %status,
                        after_s = after.as_secs_f64(),
                        "worker exited; starting another"
                    );
                    false
                }
                _ => true,
            });
            let exited = before - self.running[role].len();
            self.restarts += exited as u64;
            if exited > 0 && quick {
                self.quick_exits[role] = self.quick_exits[role].saturating_add(1);
                let delay =
                    Duration::from_secs(1 << self.quick_exits[role].min(6)).min(MAX_BACKOFF);
                self.not_before[role] = Some(Instant::now() + delay);
            } else if exited > 0 {
                self.quick_exits[role] = 0;
                self.not_before[role] = None;
            }
        }
        self.reconcile()
    }

    /// Stops every worker: SIGTERM, then SIGKILL for those still running after `grace`.
    pub fn shutdown(&mut self, grace: Duration) {
        self.target = Replicas::default();
        let mut all: Vec<Worker> = self.running.iter_mut().flat_map(std::mem::take).collect();
        all.append(&mut self.draining);
        for w in &all {
            terminate(&w.child);
        }
        let until = Instant::now() + grace;
        for w in &mut all {
            while matches!(w.child.try_wait(), Ok(None)) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(w.child.try_wait(), Ok(None)) {
                let _ = w.child.kill();
            }
            let _ = w.child.wait();
        }
    }
}

/// SIGTERM to a child (a worker drains on it).
fn terminate(child: &Child) {
    let pid = rustix::process::Pid::from_child(child);
    if let Err(e) = rustix::process::kill_process(pid, rustix::process::Signal::TERM) {
        tracing::warn!(pid = child.id(), error = %e, "SIGTERM failed");
    }
}

impl Drop for LocalConnector {
    fn drop(&mut self) {
        self.shutdown(Duration::from_secs(5));
    }
}

impl Connector for LocalConnector {
    fn name(&self) -> &'static str {
        "local"
    }

    fn apply(&mut self, target: Replicas, _decision_id: u64) -> Result<(), ConnectorError> {
        self.target = target;
        self.reap()
    }

    fn actual(&mut self) -> Result<Replicas, ConnectorError> {
        self.reap()?;
        Ok(Replicas { prefill: self.running[0].len() as u32, decode: self.running[1].len() as u32 })
    }
}

/// What the virtual connector writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtualDecision {
    /// Prefill workers wanted.
    pub prefill: u32,
    /// Decode workers wanted.
    pub decode: u32,
    /// The decision's number.
    pub decision_id: u64,
}

/// What the outside system writes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtualAck {
    /// The last decision carried out.
    pub scaled_decision_id: u64,
}

/// Decisions written to a file for an outside system, acknowledged through another.
#[derive(Debug)]
pub struct VirtualConnector {
    decision: PathBuf,
    ack: PathBuf,
    /// Decisions written, newest last (those not yet acknowledged).
    sent: Vec<VirtualDecision>,
    /// The counts of the last acknowledged decision.
    done: Replicas,
    /// Added to the planner's decision ids.
    base: u64,
}

impl VirtualConnector {
    /// Writes decisions to `decision`, reads acknowledgements from `ack`; `initial` is what
    /// runs before the first acknowledgement. Decision ids continue above an
    /// acknowledgement already in `ack` (from an earlier run), so it acknowledges none of
    /// this run's decisions.
    pub fn new(decision: &Path, ack: &Path, initial: Replicas) -> Self {
        let base = std::fs::read_to_string(ack)
            .ok()
            .and_then(|t| serde_json::from_str::<VirtualAck>(&t).ok())
            .map_or(0, |a| a.scaled_decision_id);
        VirtualConnector {
            decision: decision.into(),
            ack: ack.into(),
            sent: Vec::new(),
            done: initial,
            base,
        }
    }
}

impl Connector for VirtualConnector {
    fn name(&self) -> &'static str {
        "virtual"
    }

    fn apply(&mut self, target: Replicas, decision_id: u64) -> Result<(), ConnectorError> {
        if self
            .sent
            .last()
            .is_some_and(|d| (d.prefill, d.decode) == (target.prefill, target.decode))
        {
            return Ok(());
        }
        let decision_id = self.base.saturating_add(decision_id);
        let d = VirtualDecision { prefill: target.prefill, decode: target.decode, decision_id };
        let text = serde_json::to_string(&d).map_err(|e| ConnectorError::Invalid(e.to_string()))?;
        let tmp = self.decision.with_extension("tmp");
        std::fs::write(&tmp, text + "\n").map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &self.decision)
            .map_err(io(format!("renaming to {}", self.decision.display())))?;
        self.sent.push(d);
        Ok(())
    }

    fn actual(&mut self) -> Result<Replicas, ConnectorError> {
        let text = match std::fs::read_to_string(&self.ack) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(self.done),
            Err(e) => return Err(io(format!("reading {}", self.ack.display()))(e)),
        };
        let ack: VirtualAck = serde_json::from_str(&text)
            .map_err(|e| ConnectorError::Invalid(format!("{}: {e}", self.ack.display())))?;
        if let Some(i) = self.sent.iter().rposition(|d| d.decision_id <= ack.scaled_decision_id) {
            let d = self.sent[i];
            self.done = Replicas { prefill: d.prefill, decode: d.decode };
            self.sent.drain(..=i);
        }
        Ok(self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvx-connector-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn virtual_decisions_count_once_acknowledged() {
        let d = dir("virtual");
        let (dec, ack) = (d.join("decision.json"), d.join("ack.json"));
        let mut c = VirtualConnector::new(&dec, &ack, Replicas { prefill: 1, decode: 1 });
        c.apply(Replicas { prefill: 2, decode: 3 }, 7).unwrap();
        let written: VirtualDecision =
            serde_json::from_str(&std::fs::read_to_string(&dec).unwrap()).unwrap();
        assert_eq!(written, VirtualDecision { prefill: 2, decode: 3, decision_id: 7 });
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 1, decode: 1 }, "no ack yet");
        c.apply(Replicas { prefill: 2, decode: 4 }, 8).unwrap();
        std::fs::write(&ack, r#"{"scaled_decision_id": 7}"#).unwrap();
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 2, decode: 3 });
        std::fs::write(&ack, r#"{"scaled_decision_id": 8}"#).unwrap();
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 2, decode: 4 });
        std::fs::write(&ack, "not json").unwrap();
        assert!(matches!(c.actual(), Err(ConnectorError::Invalid(_))));
        // A new run over the same files: the old acknowledgement (8) covers none of its
        // decisions.
        std::fs::write(&ack, r#"{"scaled_decision_id": 8}"#).unwrap();
        let mut c = VirtualConnector::new(&dec, &ack, Replicas { prefill: 1, decode: 1 });
        c.apply(Replicas { prefill: 5, decode: 5 }, 1).unwrap();
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 1, decode: 1 });
        let written: VirtualDecision =
            serde_json::from_str(&std::fs::read_to_string(&dec).unwrap()).unwrap();
        assert_eq!(written.decision_id, 9);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn kvx_workers_get_their_role_from_the_planner_only() {
        let d = dir("kvx-workers");
        let logs = d.join("logs");
        let c = LocalConnector::kvx_workers(
            "kvx",
            "--frontend 127.0.0.1:7100  --engine mocker",
            Some(logs.clone()),
        )
        .unwrap();
        assert_eq!(c.args, ["worker", "--frontend", "127.0.0.1:7100", "--engine", "mocker"]);
        assert!(logs.is_dir());
        for bad in ["--role decode", "--engine mocker --role=prefill"] {
            assert!(matches!(
                LocalConnector::kvx_workers("kvx", bad, None),
                Err(ConnectorError::Invalid(_))
            ));
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn local_workers_are_started_drained_and_restarted() {
        let d = dir("local");
        // A stand-in worker: prints its role, exits 0 on SIGTERM, lives 30 s otherwise.
        let script = d.join("worker.sh");
        std::fs::write(
            &script,
            "#!/bin/sh\necho \"$@\"\nsleep 30 &\ntrap 'kill $!; exit 0' TERM\nwait\n",
        )
        .unwrap();
        let mut c =
            LocalConnector::new("/bin/sh", vec![script.display().to_string()], Some(d.clone()));
        c.apply(Replicas { prefill: 1, decode: 2 }, 1).unwrap();
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 1, decode: 2 });
        c.apply(Replicas { prefill: 1, decode: 1 }, 2).unwrap();
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 1, decode: 1 });
        assert!(c.draining() <= 1);
        let t = Instant::now();
        while c.draining() > 0 && t.elapsed() < Duration::from_secs(10) {
            c.actual().unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(c.draining(), 0, "the drained worker exited on SIGTERM");
        // A worker that dies is replaced; one that dies this soon after its start, after a
        // delay (2 s the first time).
        let pid = c.running[0][0].child.id();
        std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
        let t = Instant::now();
        while c.restarts() == 0 && t.elapsed() < Duration::from_secs(10) {
            c.actual().unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(c.restarts(), 1);
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 0, decode: 1 }, "not at once");
        let t = Instant::now();
        while c.actual().unwrap().prefill == 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(t.elapsed() >= Duration::from_millis(1500), "restarted after {:?}", t.elapsed());
        assert_eq!(c.actual().unwrap(), Replicas { prefill: 1, decode: 1 });
        assert_ne!(c.running[0][0].child.id(), pid);
        let log = std::fs::read_to_string(d.join("worker-prefill-1.log")).unwrap();
        assert!(log.contains("--role prefill"), "{log}");
        c.shutdown(Duration::from_secs(5));
        assert_eq!(c.actual().unwrap(), Replicas::default());
        let _ = std::fs::remove_dir_all(&d);
    }
}
