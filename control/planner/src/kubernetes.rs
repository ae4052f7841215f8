//! The Kubernetes connector: the prefill and decode pools are two Deployments (or
//! StatefulSets) whose replica counts the planner sets through the API server's `scale`
//! subresource (kube-rs; in-cluster service-account credentials or a kubeconfig).
//!
//! A thread of its own runs the client: [`Connector::apply`] hands it the counts wanted and
//! returns; the thread reads each workload's scale (every second, and at once on a new
//! target), writes `spec.replicas` where it differs — a replace carrying the
//! `resourceVersion` it read, so a write that crossed another writer's (`kubectl scale`, a
//! rollout) is refused with 409 Conflict and made again on a fresh read — and reports
//! `status.replicas` as what runs. Removing a pod sends its worker SIGTERM: the worker
//! drains (it finishes what it runs; the pod's termination grace must cover that).

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v1::Scale;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tokio::sync::watch;

use crate::connector::{Connector, ConnectorError};
use crate::plan::Replicas;

/// How often the workloads' scale is read when nothing changes.
const POLL: Duration = Duration::from_secs(1);
/// Writes refused for a stale `resourceVersion` retried at once, at most.
const CONFLICT_RETRIES: u32 = 5;
/// The longest one request to the API server may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the pools are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// `apps/v1` Deployments.
    Deployment,
    /// `apps/v1` StatefulSets.
    StatefulSet,
}

impl WorkloadKind {
    fn name(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "deployment",
            WorkloadKind::StatefulSet => "statefulset",
        }
    }
}

/// Where the pools are and how to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesTarget {
    /// The workloads' kind.
    pub kind: WorkloadKind,
    /// Their namespace (`None`: the credentials' own: the service account's, or the
    /// kubeconfig context's).
    pub namespace: Option<String>,
    /// The prefill pool's workload.
    pub prefill: String,
    /// The decode pool's workload.
    pub decode: String,
    /// A kubeconfig file (`None`: in-cluster credentials, else `$KUBECONFIG` or
    /// `~/.kube/config`).
    pub kubeconfig: Option<std::path::PathBuf>,
}

#[derive(Debug, Default)]
struct State {
    /// `status.replicas` of each pool at the last read.
    running: Option<Replicas>,
    /// The last read's or write's failure, cleared by a success.
    error: Option<String>,
}

/// Scales two workloads through the API server.
#[derive(Debug)]
pub struct KubernetesConnector {
    want: Option<watch::Sender<Option<Replicas>>>,
    state: Arc<Mutex<State>>,
    thread: Option<JoinHandle<()>>,
}

fn fail(m: impl std::fmt::Display) -> ConnectorError {
    ConnectorError::Invalid(format!("kubernetes: {m}"))
}

impl KubernetesConnector {
    /// Connects and reads both workloads' scale once, within `timeout`: an unreachable API
    /// server, missing credentials, a workload not found or not allowed is an error here.
    pub fn connect(target: KubernetesTarget, timeout: Duration) -> Result<Self, ConnectorError> {
        let (want_tx, want_rx) = watch::channel(None);
        let state = Arc::new(Mutex::new(State::default()));
        let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name("kvx-planner-k8s".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("starting its runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(run(target, want_rx, shared, ready_tx));
            })
            .map_err(|e| fail(format!("starting its thread: {e}")))?;
        let mut c = KubernetesConnector { want: Some(want_tx), state, thread: Some(thread) };
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => Ok(c),
            Ok(Err(e)) => {
                c.stop();
                Err(fail(e))
            }
            Err(_) => {
                // Not joined: its thread ends after its own request's timeout.
                c.want = None;
                c.thread = None;
                Err(fail(format!("no answer from the API server within {timeout:?}")))
            }
        }
    }

    fn stop(&mut self) {
        // Dropping the sender ends the thread's loop.
        self.want = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KubernetesConnector {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Connector for KubernetesConnector {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn apply(&mut self, target: Replicas, _decision_id: u64) -> Result<(), ConnectorError> {
        let Some(tx) = &self.want else { return Err(fail("stopped")) };
        tx.send_if_modified(|w| {
            let changed = *w != Some(target);
            *w = Some(target);
            changed
        });
        match self.state.lock() {
            Ok(s) => s.error.clone().map_or(Ok(()), |e| Err(fail(e))),
            Err(_) => Err(fail("its state is poisoned")),
        }
    }

    fn actual(&mut self) -> Result<Replicas, ConnectorError> {
        let s = self.state.lock().map_err(|_| fail("its state is poisoned"))?;
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            return Err(fail(s.error.clone().unwrap_or_else(|| "its thread ended".into())));
        }
        s.running.ok_or_else(|| fail(s.error.clone().unwrap_or_else(|| "not read yet".into())))
    }
}

/// One workload's scale, whatever its kind.
enum Workload {
    Deployment(Api<Deployment>, String),
    StatefulSet(Api<StatefulSet>, String),
}

/// A request that failed: the API server's answer, or none within [`REQUEST_TIMEOUT`].
enum Failed {
    Api(kube::Error),
    TimedOut,
}

async fn bounded<T>(
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, Failed> {
    match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
        Ok(r) => r.map_err(Failed::Api),
        Err(_) => Err(Failed::TimedOut),
    }
}

impl Workload {
    async fn get(&self) -> Result<Scale, Failed> {
        match self {
            Workload::Deployment(a, n) => bounded(a.get_scale(n)).await,
            Workload::StatefulSet(a, n) => bounded(a.get_scale(n)).await,
        }
    }

    async fn replace(&self, s: &Scale) -> Result<Scale, Failed> {
        let pp = PostParams { field_manager: Some("kvx-planner".into()), ..Default::default() };
        match self {
            Workload::Deployment(a, n) => bounded(a.replace_scale(n, &pp, s)).await,
            Workload::StatefulSet(a, n) => bounded(a.replace_scale(n, &pp, s)).await,
        }
    }
}

fn running(s: &Scale) -> u32 {
    s.status.as_ref().map_or(0, |st| u32::try_from(st.replicas).unwrap_or(0))
}

fn describe(e: &Failed, what: &str) -> String {
    match e {
        Failed::TimedOut => format!("{what}: no answer within {REQUEST_TIMEOUT:?}"),
        Failed::Api(kube::Error::Api(s)) if s.is_not_found() => format!("{what} not found"),
        Failed::Api(kube::Error::Api(s)) if s.is_forbidden() => {
            format!("{what}: forbidden (the credentials need get and update on its scale): {s}")
        }
        Failed::Api(e) => format!("{what}: {e}"),
    }
}

/// Reads one pool's scale and, when `want` differs from its spec, writes it (again on a
/// fresh read after a conflict); `status.replicas` afterwards.
async fn reconcile(w: &Workload, what: &str, want: Option<u32>) -> Result<u32, String> {
    let mut tries = 0;
    loop {
        let mut scale = w.get().await.map_err(|e| describe(&e, what))?;
        let spec = scale.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
        let Some(want) = want.filter(|&n| i64::from(n) != i64::from(spec)) else {
            return Ok(running(&scale));
        };
        let n = i32::try_from(want).map_err(|_| format!("{what}: {want} replicas"))?;
        scale.spec.get_or_insert_with(Default::default).replicas = Some(n);
        match w.replace(&scale).await {
            Ok(s) => {
                tracing::info!(workload = what, from = spec, to = n, "scaled");
                return Ok(running(&s));
            }
            Err(Failed::Api(kube::Error::Api(s)))
                if s.is_conflict() && tries < CONFLICT_RETRIES =>
            {
                tracing::debug!(workload = what, "a newer version was written first; again");
                tries += 1;
            }
            Err(e) => return Err(describe(&e, what)),
        }
    }
}

async fn client(target: &KubernetesTarget) -> Result<(Client, String), String> {
    let config = match &target.kubeconfig {
        Some(p) => {
            let kc = Kubeconfig::read_from(p).map_err(|e| format!("{}: {e}", p.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => Config::infer().await.map_err(|e| format!("finding credentials: {e}"))?,
    };
    let ns = target.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| format!("building the client: {e}"))?;
    Ok((client, ns))
}

async fn run(
    target: KubernetesTarget,
    mut want: watch::Receiver<Option<Replicas>>,
    state: Arc<Mutex<State>>,
    ready: std_mpsc::SyncSender<Result<(), String>>,
) {
    let (client, ns) = match client(&target).await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let workload = |name: &str| match target.kind {
        WorkloadKind::Deployment => {
            Workload::Deployment(Api::namespaced(client.clone(), &ns), name.to_string())
        }
        WorkloadKind::StatefulSet => {
            Workload::StatefulSet(Api::namespaced(client.clone(), &ns), name.to_string())
        }
    };
    let pools = [workload(&target.prefill), workload(&target.decode)];
    let names =
        [&target.prefill, &target.decode].map(|n| format!("{} {ns}/{n}", target.kind.name()));
    let mut ready = Some(ready);
    loop {
        let wanted = *want.borrow_and_update();
        let mut got = [0u32; 2];
        let mut error = None;
        for (i, w) in pools.iter().enumerate() {
            let n = wanted.map(|r| if i == 0 { r.prefill } else { r.decode });
            match reconcile(w, &names[i], n).await {
                Ok(v) => got[i] = v,
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        if let Ok(mut s) = state.lock() {
            if error.is_none() {
                s.running = Some(Replicas { prefill: got[0], decode: got[1] });
            }
            s.error.clone_from(&error);
        }
        if let Some(r) = ready.take() {
            match error {
                None => {
                    let _ = r.send(Ok(()));
                }
                Some(e) => {
                    let _ = r.send(Err(e));
                    return;
                }
            }
        }
        tokio::select! {
            changed = want.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}
