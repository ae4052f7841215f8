//! A loopback stand-in for a Kubernetes API server and the controllers behind it, for the
//! planner's Kubernetes connector: `apps/v1` Deployments and StatefulSets with the `scale`
//! subresource (GET and PUT, `autoscaling/v1` Scale objects), resourceVersions that change
//! with every write and status change and are checked on every PUT (409 Conflict on a stale
//! one, as the real server answers), bearer-token authentication (401 without it) and
//! forbidden workloads (403). A controller thread plays the ReplicaSet controller and the
//! kubelet: it starts a process per replica (`spawn`), stops the newest with SIGTERM when
//! the count falls (as pod deletion does) and starts again one that exits on its own;
//! `status.replicas` counts the processes not told to stop.
//!
//! What it does not do: admission, field managers, watches, rollouts, pod objects.

use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// Starts a replica's process: `(workload name, replica index)`.
pub type Spawn = Box<dyn Fn(&str, usize) -> Child + Send>;

#[derive(Debug)]
struct Workload {
    spec: i32,
    /// Running processes, oldest first.
    pods: Vec<Child>,
    /// Processes told to stop, not yet gone.
    stopping: Vec<Child>,
    version: u64,
    forbidden: bool,
}

#[derive(Debug, Default)]
struct Inner {
    /// By `(resource, namespace, name)`.
    workloads: BTreeMap<(String, String, String), Workload>,
    next_version: u64,
    conflicts_to_inject: u32,
    conflicts: u32,
    writes: Vec<(String, i32)>,
    refused_auth: u32,
}

impl Inner {
    fn bump(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }
}

type Shared = Arc<(Mutex<Inner>, String)>;

/// The stand-in; everything it started is stopped when it is dropped.
#[derive(Debug)]
pub struct FakeKube {
    /// `127.0.0.1:port`.
    pub addr: String,
    /// The bearer token it accepts.
    pub token: String,
    shared: Shared,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    (code, [(axum::http::header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn scale_of(resource: &str, ns: &str, name: &str, w: &Workload) -> Value {
    json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name, "namespace": ns, "resourceVersion": w.version.to_string(),
            "uid": format!("uid-{resource}-{name}"),
        },
        "spec": {"replicas": w.spec},
        "status": {"replicas": w.pods.len(), "selector": format!("app={name}")},
    })
}

async fn scale(
    State(s): State<Shared>,
    Path((ns, resource, name)): Path<(String, String, String)>,
    headers: HeaderMap,
    method: axum::http::Method,
    body: axum::body::Bytes,
) -> Response {
    let (lock, token) = &*s;
    let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    let g: &mut Inner = &mut guard;
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Bearer {token}")) {
        g.refused_auth += 1;
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized".into());
    }
    let key = (resource.clone(), ns.clone(), name.clone());
    let inject = g.conflicts_to_inject > 0;
    let fresh = g.next_version + 1;
    let Some(w) = g.workloads.get_mut(&key) else {
        let what = format!("{resource}.apps \"{name}\" not found");
        return status(StatusCode::NOT_FOUND, "NotFound", what);
    };
    if w.forbidden {
        let what = format!("cannot get resource \"{resource}/scale\" in namespace \"{ns}\"");
        return status(StatusCode::FORBIDDEN, "Forbidden", what);
    }
    if method == axum::http::Method::GET {
        return json_response(StatusCode::OK, &scale_of(&resource, &ns, &name, w));
    }
    if method != axum::http::Method::PUT {
        return status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", method.to_string());
    }
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON".into());
    };
    let conflict = || {
        let what = format!(
            "Operation cannot be fulfilled on {resource}.apps \"{name}\": the object has been \
             modified; please apply your changes to the latest version and try again"
        );
        status(StatusCode::CONFLICT, "Conflict", what)
    };
    if inject {
        // Another writer got there first.
        w.version = fresh;
        g.next_version = fresh;
        g.conflicts_to_inject -= 1;
        g.conflicts += 1;
        return conflict();
    }
    let sent = v["metadata"]["resourceVersion"].as_str().and_then(|r| r.parse::<u64>().ok());
    if sent != Some(w.version) {
        g.conflicts += 1;
        return conflict();
    }
    let Some(n) = v["spec"]["replicas"].as_i64().and_then(|n| i32::try_from(n).ok()) else {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "spec.replicas".into());
    };
    if n < 0 {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "negative replicas".into());
    }
    w.spec = n;
    w.version = fresh;
    g.next_version = fresh;
    g.writes.push((name.clone(), n));
    let Some(w) = g.workloads.get(&key) else {
        return status(StatusCode::NOT_FOUND, "NotFound", name);
    };
    json_response(StatusCode::OK, &scale_of(&resource, &ns, &name, w))
}

impl FakeKube {
    /// Serves on loopback, accepting `token`; `spawn` starts a replica.
    pub fn start(token: &str, spawn: Spawn) -> FakeKube {
        let shared: Shared = Arc::new((Mutex::new(Inner::default()), token.to_string()));
        let stop = Arc::new(AtomicBool::new(false));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding");
        listener.set_nonblocking(true).expect("non-blocking");
        let addr = listener.local_addr().expect("address").to_string();
        let app = axum::Router::new()
            .route(
                "/apis/apps/v1/namespaces/{ns}/{resource}/{name}/scale",
                axum::routing::any(scale),
            )
            .fallback(|| async { status(StatusCode::NOT_FOUND, "NotFound", "no such path".into()) })
            .with_state(shared.clone());
        let (server_stop, ctl_stop) = (stop.clone(), stop.clone());
        let server = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let rt = rt.expect("runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(listener).expect("listener");
                let done = async move {
                    while !server_stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                let _ = axum::serve(l, app).with_graceful_shutdown(done).await;
            });
        });
        let ctl_shared = shared.clone();
        let controller = std::thread::spawn(move || {
            while !ctl_stop.load(Ordering::Relaxed) {
                reconcile(&ctl_shared, &spawn);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        FakeKube { addr, token: token.into(), shared, stop, threads: vec![server, controller] }
    }

    /// Adds a workload (`deployments` or `statefulsets`) of `replicas`.
    pub fn add(&self, resource: &str, ns: &str, name: &str, replicas: i32, forbidden: bool) {
        let mut g = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        let version = g.bump();
        let w =
            Workload { spec: replicas, pods: Vec::new(), stopping: Vec::new(), version, forbidden };
        g.workloads.insert((resource.into(), ns.into(), name.into()), w);
    }

    /// The next `n` writes are refused as if another writer had changed the object.
    pub fn inject_conflicts(&self, n: u32) {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).conflicts_to_inject = n;
    }

    /// `(spec.replicas, running processes)` of a workload.
    pub fn replicas(&self, resource: &str, ns: &str, name: &str) -> Option<(i32, usize)> {
        let g = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        g.workloads.get(&(resource.into(), ns.into(), name.into())).map(|w| (w.spec, w.pods.len()))
    }

    /// Writes accepted so far: `(name, replicas)`.
    pub fn writes(&self) -> Vec<(String, i32)> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).writes.clone()
    }

    /// Writes refused with 409 so far, and requests refused for their credentials.
    pub fn refusals(&self) -> (u32, u32) {
        let g = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        (g.conflicts, g.refused_auth)
    }

    /// A kubeconfig naming this server, the token and `namespace`.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: planner\n    namespace: {namespace}\n\
             current-context: fake\nusers:\n- name: planner\n  user:\n    token: {}\n",
            self.addr, self.token
        )
    }
}

/// One pass of the controller: processes up or down to each workload's spec; those that
/// ended on their own are started again; `status.replicas` follows, with a new version.
fn reconcile(shared: &Shared, spawn: &Spawn) {
    let mut guard = shared.0.lock().unwrap_or_else(|e| e.into_inner());
    let g: &mut Inner = &mut guard;
    let mut changed = Vec::new();
    for (key, w) in g.workloads.iter_mut() {
        let before = w.pods.len();
        w.pods.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        w.stopping.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        let want = usize::try_from(w.spec).unwrap_or(0);
        while w.pods.len() < want {
            let i = w.pods.len();
            w.pods.push(spawn(&key.2, i));
        }
        while w.pods.len() > want {
            if let Some(c) = w.pods.pop() {
                let _ = Command::new("kill").arg(c.id().to_string()).status();
                w.stopping.push(c);
            }
        }
        if w.pods.len() != before {
            changed.push(key.clone());
        }
    }
    for key in changed {
        let v = g.bump();
        if let Some(w) = g.workloads.get_mut(&key) {
            w.version = v;
        }
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Every process it started, even if its controller died.
        let mut g = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        for w in g.workloads.values_mut() {
            for mut c in w.pods.drain(..).chain(w.stopping.drain(..)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
