//! The frontend side of the remote planes: workers in other processes (or hosts) behind a
//! [`Dispatcher`], with the KV-aware router choosing the worker for each request.
//!
//! Worker processes connect to the frontend's worker address and register each engine they
//! host as a worker ([`kvx_proto::plane`] has the messages). Each connection has a reader task
//! (frames in, applied under one lock: outputs to their clients, KV events, notes, snapshots
//! and loads to the router) and a writer task (a bounded queue of frames out, and a heartbeat).
//!
//! A connection that closes, breaks, or stays silent past the heartbeat timeout is dead: its
//! workers leave the router, and each of their requests is placed again on another worker,
//! transparently to its client: one that had not produced a token as it was (at most
//! `max_attempts` placements), one that had *migrates* (at most `migration_limit` times) — it
//! goes with the tokens its client already has ([`GenerateRequest::resume`]), which the new
//! worker computes as generated tokens, so the stream goes on with neither a duplicated nor a
//! lost token and greedy output stays what an undisturbed run gives. Past those limits the
//! request ends with `Unavailable: worker … disappeared`. A worker that reports `Overloaded`
//! or `Unavailable` for a request before its first token gets the request placed elsewhere
//! too.
//!
//! Workers register a role. Prefill workers go into a router of their own, and requests
//! worth it run disaggregated ([`crate::disagg`]): each decode worker's KV peer (its
//! transfer agent's metadata and cache layout) is sent once to every prefill worker
//! ([`Peers`]), and the relay of a request tells its decode worker when the KV is in
//! ([`KvReady`]). Prefill workers on other hosts write over TCP; on the same host, through
//! shared memory.

mod session;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvx_ingress::{DispatchError, Dispatcher, WorkerState};
use kvx_proto::hashing::seed_for;
use kvx_proto::plane::{
    Cancel, KvPeer, KvReady, OutputMsg, Peers, Register, Registered, Submit, WorkerRole,
};
use kvx_proto::wire;
use kvx_proto::{
    ErrorClass, GenerateRequest, KvNote, KvRole, Output, RequestId, WorkerId, WorkerMetrics,
};
use kvx_router::{RequestBlocks, Router, RouterConfig};
use kvx_trust::ClusterAuth;
use kvx_worker::output_channel;
use tokio::net::TcpListener;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

use crate::PlaneError;
use crate::disagg::{self, DisaggConfig, DisaggCounters, Legs, Local};
use crate::feed::{self, router_metrics};

/// Settings of the remote planes, frontend side.
#[derive(Debug, Clone)]
pub struct RemotePlaneConfig {
    /// The served model's name; workers must register with it.
    pub model: String,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// A worker connection silent this long is dead.
    pub heartbeat_timeout: Duration,
    /// Largest frame accepted.
    pub max_frame: usize,
    /// Frames queued per connection at most (a full queue makes the router try another
    /// worker, then refuse with `Overloaded`).
    pub conn_queue: usize,
    /// Placements of one request at most before its first token (the first one and the
    /// retries).
    pub max_attempts: u32,
    /// Migrations of one request at most after its first token (0: none, the request ends
    /// with an error when its worker dies).
    pub migration_limit: u32,
    /// How worker connections prove their membership of the cluster (both directions).
    pub auth: ClusterAuth,
}

impl Default for RemotePlaneConfig {
    fn default() -> Self {
        RemotePlaneConfig {
            model: String::new(),
            heartbeat: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            max_frame: wire::MAX_FRAME,
            conn_queue: 8192,
            max_attempts: 3,
            migration_limit: 3,
            auth: ClusterAuth::Open,
        }
    }
}

/// A frame for a connection's writer.
#[derive(Debug)]
enum Down {
    Registered(Registered),
    Submit(Box<Submit>),
    Cancel(Cancel),
    Snapshot(WorkerId),
    Peers(Peers),
    KvReady(KvReady),
    /// Close the connection (a newer registration took its worker).
    Close,
}

struct Conn {
    tx: mpsc::Sender<Down>,
    workers: Vec<WorkerId>,
    peer: SocketAddr,
}

struct Worker {
    conn: u64,
    metrics: WorkerMetrics,
    role: WorkerRole,
    /// Gone from discovery or draining: out of routing, but what it runs goes on.
    retired: bool,
    /// The arithmetic its engines compute in (empty: mock engines).
    arith: String,
}

/// What a request needs to be placed again.
struct Retry {
    req: GenerateRequest,
    blocks: RequestBlocks,
}

struct Inflight {
    worker: WorkerId,
    client: UnboundedSender<Output>,
    /// How to place it again (`None`: a prefill leg, and a disaggregated request's decode
    /// leg once its worker reserved the blocks — its relay then handles what fails; before
    /// that, a decode worker that refuses it, e.g. one that began to drain as it was sent,
    /// or that disappears, has it placed again to be prefilled where it decodes).
    retry: Option<Retry>,
    attempts: u32,
    /// Tokens its client has received (what a migration resumes after).
    streamed: Vec<u32>,
    /// Whether a token came (then it can only migrate).
    started: bool,
    migrations: u32,
}

impl Inflight {
    fn new(worker: WorkerId, client: UnboundedSender<Output>, retry: Option<Retry>) -> Self {
        Inflight {
            worker,
            client,
            retry,
            attempts: 1,
            streamed: Vec::new(),
            started: false,
            migrations: 0,
        }
    }
}

/// Counters of the planes for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    placed_again: u64,
    migrated: u64,
    failed_worker_lost: u64,
    workers_lost: u64,
}

struct State {
    /// The router over the workers that decode (aggregated and decode workers).
    router: Router,
    /// The router over the prefill workers.
    prefill: Router,
    /// Decode workers' KV peers, for the prefill workers.
    peers: HashMap<WorkerId, KvPeer>,
    /// Whether a prefill worker ever joined (then `/metrics` shows disaggregation).
    seen_prefill: bool,
    workers: HashMap<WorkerId, Worker>,
    conns: HashMap<u64, Conn>,
    inflight: HashMap<RequestId, Inflight>,
    counters: Counters,
    max_attempts: u32,
    migration_limit: u32,
}

struct Shared {
    cfg: RemotePlaneConfig,
    block_size: usize,
    state: Mutex<State>,
    start: Instant,
    next_conn: AtomicU64,
    disagg: DisaggConfig,
    counters: DisaggCounters,
    /// Peers refused at the cluster handshake (each address logged once).
    refused: kvx_trust::RefusalLog,
}

/// Remote workers as one dispatcher.
pub struct RemotePlane {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RemotePlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemotePlane").field("model", &self.shared.cfg.model).finish()
    }
}

impl RemotePlane {
    /// Starts accepting workers on `listener` (inside a tokio runtime).
    pub fn start(
        cfg: RemotePlaneConfig,
        router: RouterConfig,
        listener: TcpListener,
    ) -> Result<Arc<Self>, PlaneError> {
        Self::with_disagg(cfg, router, DisaggConfig::default(), listener)
    }

    /// As [`RemotePlane::start`], running requests disaggregated as `disagg` says when
    /// prefill workers join.
    pub fn with_disagg(
        cfg: RemotePlaneConfig,
        router: RouterConfig,
        disagg: DisaggConfig,
        listener: TcpListener,
    ) -> Result<Arc<Self>, PlaneError> {
        let block_size = router.block_size;
        let prefill = Router::new(router.clone())?;
        let router = Router::new(router)?;
        let (max_attempts, migration_limit) = (cfg.max_attempts.max(1), cfg.migration_limit);
        let shared = Arc::new(Shared {
            cfg,
            block_size,
            disagg,
            counters: DisaggCounters::default(),
            state: Mutex::new(State {
                router,
                prefill,
                peers: HashMap::new(),
                seen_prefill: false,
                workers: HashMap::new(),
                conns: HashMap::new(),
                inflight: HashMap::new(),
                counters: Counters::default(),
                max_attempts,
                migration_limit,
            }),
            start: Instant::now(),
            next_conn: AtomicU64::new(1),
            refused: kvx_trust::RefusalLog::default(),
        });
        tokio::spawn(session::accept_loop(shared.clone(), listener));
        tokio::spawn(session::maintenance(shared.clone()));
        Ok(Arc::new(RemotePlane { shared }))
    }

    /// Connects to a worker process listening at `addr` (the static-list direction), and
    /// again whenever the connection is lost.
    pub fn dial(&self, addr: String) {
        let (keep, never) = watch::channel(false);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let _keep = keep;
            session::dial_loop(shared, addr, never).await;
        });
    }

    /// Follows the fleet that discovery shows (inside a tokio runtime): dials each worker
    /// process's endpoint as its first worker appears. A worker whose record is gone gets no
    /// new request (a draining worker finishes what it runs; a dead one is dropped when its
    /// connection closes or goes silent, its requests moving or migrating), and its process
    /// is dialled no more once its last worker is gone.
    pub fn follow(self: &Arc<Self>, mut fleet: mpsc::Receiver<kvx_discovery::FleetChange>) {
        use kvx_discovery::FleetChange;
        use std::collections::HashSet;
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut endpoints: HashMap<String, (HashSet<WorkerId>, watch::Sender<bool>)> =
                HashMap::new();
            let mut where_: HashMap<WorkerId, String> = HashMap::new();
            while let Some(ch) = fleet.recv().await {
                match ch {
                    FleetChange::Up(r) => {
                        if r.model != shared.cfg.model {
                            tracing::warn!(worker = r.worker_id, model = %r.model, "discovered a worker of another model; ignored");
                            continue;
                        }
                        if let Some(old) = where_.insert(r.worker_id, r.endpoint.clone())
                            && old != r.endpoint
                        {
                            drop_worker(&mut endpoints, &old, r.worker_id);
                        }
                        let e = endpoints.entry(r.endpoint.clone()).or_insert_with(|| {
                            tracing::info!(endpoint = %r.endpoint, "discovered a worker process");
                            let (tx, rx) = watch::channel(false);
                            tokio::spawn(session::dial_loop(
                                shared.clone(),
                                r.endpoint.clone(),
                                rx,
                            ));
                            (HashSet::new(), tx)
                        });
                        e.0.insert(r.worker_id);
                    }
                    FleetChange::Down(id) => {
                        shared.lock().retire(id);
                        if let Some(ep) = where_.remove(&id) {
                            drop_worker(&mut endpoints, &ep, id);
                        }
                    }
                }
            }
        });
    }
}

/// Forgets worker `id` at `endpoint`; the endpoint's connection closes with its last worker.
fn drop_worker(
    endpoints: &mut HashMap<String, (std::collections::HashSet<WorkerId>, watch::Sender<bool>)>,
    endpoint: &str,
    id: WorkerId,
) {
    let Some((ids, cancel)) = endpoints.get_mut(endpoint) else { return };
    ids.remove(&id);
    if ids.is_empty() {
        tracing::info!(%endpoint, "a worker process left discovery");
        let _ = cancel.send(true);
        endpoints.remove(endpoint);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }
}

impl State {
    /// The router that holds worker `w`.
    fn router_of(&mut self, w: WorkerId) -> &mut Router {
        match self.workers.get(&w).map(|x| x.role) {
            Some(WorkerRole::Prefill) => &mut self.prefill,
            _ => &mut self.router,
        }
    }

    /// Takes a worker out of routing (gone from discovery, or draining): what it runs goes on.
    fn retire(&mut self, w: WorkerId) {
        if self.workers.get(&w).is_some_and(|x| !x.retired) {
            tracing::info!(worker = w, "draining or gone from discovery: no new requests");
            self.router_of(w).remove_worker(w);
            if let Some(x) = self.workers.get_mut(&w) {
                x.retired = true;
            }
        }
    }

    /// Whether requests can run disaggregated (prefill and decode workers are there).
    fn disaggregates(&self) -> bool {
        let has = |r: WorkerRole| self.workers.values().any(|w| w.role == r && !w.retired);
        has(WorkerRole::Prefill) && has(WorkerRole::Decode)
    }

    /// Sends frame `d` to every connection hosting a prefill worker.
    fn to_prefill_conns(&self, d: impl Fn() -> Down) {
        for (id, c) in &self.conns {
            let hosts_prefill = c.workers.iter().any(|w| {
                self.workers.get(w).is_some_and(|x| x.conn == *id && x.role == WorkerRole::Prefill)
            });
            if hosts_prefill {
                let _ = c.tx.try_send(d());
            }
        }
    }

    /// Places `req` on a worker not in `exclude` — the router's choice first, then the others
    /// by cost — and sends it there. Returns the worker.
    fn place(
        &mut self,
        req: &GenerateRequest,
        blocks: &RequestBlocks,
        now: Duration,
        exclude: &[WorkerId],
    ) -> Result<WorkerId, DispatchError> {
        let t0 = Instant::now();
        let first = self.router.select(blocks);
        self.router.record_decision_latency(t0.elapsed());
        let first = match first {
            Ok(d) => d,
            Err(_) => return Err(DispatchError::Unavailable("no worker is connected".into())),
        };
        let mut tried_any = false;
        if !exclude.contains(&first.worker) {
            tried_any = true;
            if self.send_submit(first.worker, req) {
                let _ = self.router.add_request(
                    req.id,
                    first.worker,
                    blocks,
                    first.overlap_blocks,
                    now,
                );
                return Ok(first.worker);
            }
        }
        let mut others = self.router.potential_loads(blocks);
        others.sort_by(|a, b| a.cost.total_cmp(&b.cost));
        for p in others {
            if p.worker == first.worker || exclude.contains(&p.worker) {
                continue;
            }
            tried_any = true;
            if self.send_submit(p.worker, req) {
                let _ = self.router.add_request(req.id, p.worker, blocks, p.overlap_blocks, now);
                return Ok(p.worker);
            }
        }
        if tried_any {
            Err(DispatchError::Overloaded("every worker's queue is full".into()))
        } else {
            Err(DispatchError::Unavailable("no other worker is connected".into()))
        }
    }

    fn send_submit(&self, worker: WorkerId, req: &GenerateRequest) -> bool {
        let Some(c) = self.workers.get(&worker).and_then(|w| self.conns.get(&w.conn)) else {
            return false;
        };
        let msg = Submit { worker_id: worker, request: req.clone() };
        c.tx.try_send(Down::Submit(Box::new(msg))).is_ok()
    }

    fn send(&self, worker: WorkerId, d: Down) {
        if let Some(c) = self.workers.get(&worker).and_then(|w| self.conns.get(&w.conn)) {
            let _ = c.tx.try_send(d);
        }
    }

    /// Places a request again after its worker failed it (before its first token) or
    /// disappeared (before its first token, or after: a migration with the tokens its client
    /// has); if it cannot move, its client gets `error`.
    fn move_or_fail(
        &mut self,
        id: RequestId,
        mut f: Inflight,
        exclude: &[WorkerId],
        now: Duration,
        error: Output,
    ) {
        self.router.free(id);
        let may = if f.started {
            f.migrations < self.migration_limit
        } else {
            f.attempts < self.max_attempts
        };
        if let Some(retry) = f.retry.take()
            && may
        {
            let mut req = retry.req.clone();
            req.resume.clone_from(&f.streamed);
            if !req.resume.is_empty() {
                // The client has the prompt's scores (they come before the first token).
                req.prompt_logprobs = None;
            }
            match self.place(&req, &retry.blocks, now, exclude) {
                Ok(w) => {
                    if f.started {
                        tracing::info!(request = %id, from = f.worker, to = w, tokens = f.streamed.len(), "request migrated");
                        self.counters.migrated += 1;
                        f.migrations += 1;
                    } else {
                        tracing::info!(request = %id, from = f.worker, to = w, "request placed again");
                        self.counters.placed_again += 1;
                        f.attempts += 1;
                    }
                    f.worker = w;
                    f.retry = Some(retry);
                    self.inflight.insert(id, f);
                    return;
                }
                Err(e) => {
                    tracing::warn!(request = %id, error = %e, "request cannot be placed again")
                }
            }
        }
        if f.started {
            self.counters.failed_worker_lost += 1;
        }
        let _ = f.client.send(error);
    }

    fn on_output(&mut self, conn: u64, m: OutputMsg, now: Duration) {
        let id = m.id;
        let Some(f) = self.inflight.get_mut(&id) else { return };
        if self.workers.get(&f.worker).map(|w| w.conn) != Some(conn) {
            return; // from an earlier placement
        }
        match m.output {
            Output::Delta(d) => {
                if !f.started {
                    f.started = true;
                    self.router.mark_prefill_done(id);
                }
                if f.retry.is_some() {
                    f.streamed.extend_from_slice(&d.tokens);
                }
                if f.client.send(Output::Delta(d)).is_err() {
                    // The client went away.
                    let w = f.worker;
                    self.inflight.remove(&id);
                    self.router.free(id);
                    self.send(w, Down::Cancel(Cancel { worker_id: w, id }));
                }
            }
            Output::Kv(note) if !matches!(note, KvNote::Sent(_)) => {
                if matches!(note, KvNote::Reserved { .. }) {
                    // The relay now moves the KV into these blocks: what fails from here is
                    // its to handle.
                    f.retry = None;
                }
                let _ = f.client.send(Output::Kv(note));
            }
            // A scored prompt's scores, before its first token (a placement that starts
            // over sends them again, and they replace these).
            o @ Output::PromptLogprobs { .. } => {
                let _ = f.client.send(o);
            }
            Output::Error { class, message }
                if f.retry.is_some()
                    && !f.started
                    && matches!(class, ErrorClass::Overloaded | ErrorClass::Unavailable) =>
            {
                let Some(f) = self.inflight.remove(&id) else { return };
                let w = f.worker;
                self.move_or_fail(id, f, &[w], now, Output::Error { class, message });
            }
            end => {
                let _ = f.client.send(end);
                self.inflight.remove(&id);
                self.router.free(id);
            }
        }
    }

    /// The arithmetic of a worker in routing that `arith` (worker `w`'s) differs from, if
    /// any: workers leaving (retired), and those of the connection `w` replaces (a
    /// restarted process whose old connection is not yet seen dead), do not count; mock
    /// workers (empty) differ from none.
    fn other_arith(&self, w: WorkerId, arith: &str) -> Option<&str> {
        let replaced = self.workers.get(&w).map(|x| x.conn);
        let counts = |id: WorkerId, x: &Worker| id != w && !x.retired && Some(x.conn) != replaced;
        self.workers
            .iter()
            .find(|&(&id, x)| counts(id, x) && !x.arith.is_empty() && x.arith != arith)
            .filter(|_| !arith.is_empty())
            .map(|(_, x)| x.arith.as_str())
    }

    fn on_register(
        &mut self,
        conn: u64,
        r: Register,
        cfg: &RemotePlaneConfig,
        block_size: usize,
        now: Duration,
    ) {
        let w = r.worker_id;
        let refuse = if r.model != cfg.model {
            Some(format!("this frontend serves model {:?}, not {:?}", cfg.model, r.model))
        } else if r.block_size != block_size {
            Some(format!(
                "this frontend routes blocks of {block_size} tokens, not {}",
                r.block_size
            ))
        } else if let Some(other) = self.other_arith(w, &r.arith) {
            Some(format!(
                "this fleet's workers compute in {other}, not {}: give every worker the same \
                 --arith, kernel level and kvx build (a build with free attention computes \
                 `fast` and `split` otherwise than one without)",
                r.arith
            ))
        } else {
            None
        };
        let Some(c) = self.conns.get(&conn) else { return };
        if let Some(reason) = refuse {
            tracing::warn!(worker = w, peer = %c.peer, %reason, "worker refused");
            let _ = c.tx.try_send(Down::Registered(Registered {
                worker_id: w,
                accepted: false,
                reason,
            }));
            return;
        }
        let _ = c.tx.try_send(Down::Registered(Registered {
            worker_id: w,
            accepted: true,
            reason: String::new(),
        }));
        let _ = c.tx.try_send(Down::Snapshot(w));
        match self.workers.get(&w).map(|x| x.conn) {
            Some(old) if old == conn => return,
            Some(old) => {
                // The same id on a newer connection: the worker came back before its old
                // connection was seen to die. The old connection goes.
                tracing::warn!(worker = w, "worker registered again on a new connection");
                if let Some(o) = self.conns.get(&old) {
                    let _ = o.tx.try_send(Down::Close);
                }
                self.conn_lost(old, "replaced by a newer connection of its worker", now);
            }
            None => {}
        }
        let role = r.role;
        match role {
            WorkerRole::Prefill => self.prefill.add_worker(w),
            _ => self.router.add_worker(w),
        };
        self.seen_prefill |= role == WorkerRole::Prefill;
        self.workers.insert(
            w,
            Worker {
                conn,
                metrics: WorkerMetrics::default(),
                role,
                retired: false,
                arith: r.arith,
            },
        );
        if let Some(c) = self.conns.get_mut(&conn) {
            c.workers.push(w);
            tracing::info!(
                worker = w,
                peer = %c.peer,
                kv_blocks = r.kv_blocks,
                role = role.name(),
                "worker joined"
            );
        }
        match (role, r.kv_peer) {
            (WorkerRole::Decode, Some(p)) => {
                self.peers.insert(w, p.clone());
                self.to_prefill_conns(|| Down::Peers(Peers { peers: vec![(w, p.clone())] }));
            }
            (WorkerRole::Prefill, _) if !self.peers.is_empty() => {
                let peers = self.peers.iter().map(|(&w, p)| (w, p.clone())).collect();
                if let Some(c) = self.conns.get(&conn) {
                    let _ = c.tx.try_send(Down::Peers(Peers { peers }));
                }
            }
            _ => {}
        }
    }

    /// A connection is gone: its workers leave, their requests move or fail.
    fn conn_lost(&mut self, conn: u64, why: &str, now: Duration) {
        let Some(c) = self.conns.remove(&conn) else { return };
        let mut dead = Vec::new();
        for w in c.workers {
            if self.workers.get(&w).is_some_and(|x| x.conn == conn) {
                self.router_of(w).remove_worker(w);
                self.workers.remove(&w);
                self.peers.remove(&w);
                dead.push(w);
            }
        }
        if dead.is_empty() {
            return;
        }
        self.counters.workers_lost += dead.len() as u64;
        tracing::warn!(workers = ?dead, peer = %c.peer, reason = why, "worker(s) disappeared");
        let ids: Vec<RequestId> = self
            .inflight
            .iter()
            .filter(|(_, f)| dead.contains(&f.worker))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let Some(f) = self.inflight.remove(&id) else { continue };
            let message = format!("worker {} disappeared", f.worker);
            self.move_or_fail(
                id,
                f,
                &dead,
                now,
                Output::Error { class: ErrorClass::Unavailable, message },
            );
        }
    }

    fn owns(&self, conn: u64, w: WorkerId) -> bool {
        self.workers.get(&w).is_some_and(|x| x.conn == conn)
    }
}

impl RemotePlane {
    /// Runs `req` disaggregated when that is worth it; `None` when it is not (or cannot be).
    fn submit_disagg(
        &self,
        req: &GenerateRequest,
        blocks: &RequestBlocks,
    ) -> Option<Result<UnboundedReceiver<Output>, DispatchError>> {
        let s = &self.shared;
        let mut st = s.lock();
        // A scored prompt is computed where it decodes (every position's logits are read).
        if req.kv != KvRole::Local || req.prompt_logprobs.is_some() || !st.disaggregates() {
            return None;
        }
        let t0 = Instant::now();
        let d = st.router.select(blocks);
        st.router.record_decision_latency(t0.elapsed());
        let d = d.ok()?;
        let uncached = req.prompt.len().saturating_sub(d.overlap_blocks as usize * s.block_size);
        let queued: usize = st
            .workers
            .values()
            .filter(|w| w.role == WorkerRole::Prefill)
            .map(|w| w.metrics.load.queued_prefill_tokens as usize)
            .sum();
        let why = if uncached < s.disagg.min_tokens {
            Some(Local::Short)
        } else if queued >= s.disagg.max_prefill_queue {
            Some(Local::Busy)
        } else {
            None
        };
        if let Some(why) = why {
            s.counters.local(why);
            return None;
        }
        let mut d_req = req.clone();
        d_req.kv = KvRole::AwaitKv;
        let (tx, d_rx) = output_channel();
        if !st.send_submit(d.worker, &d_req) {
            return None;
        }
        let now = s.now();
        let _ = st.router.add_request(req.id, d.worker, blocks, d.overlap_blocks, now);
        // The decode worker will not compute the prompt: no prefill load there.
        st.router.mark_prefill_done(req.id);
        let retry = Retry { req: req.clone(), blocks: blocks.clone() };
        st.inflight.insert(req.id, Inflight::new(d.worker, tx, Some(retry)));
        drop(st);
        let (client, rx) = output_channel();
        tokio::spawn(disagg::relay(s.clone(), s.disagg, req.clone(), d.worker, d_rx, client));
        Some(Ok(rx))
    }

    /// The plane's counters of disaggregated serving.
    pub fn disagg_counters(&self) -> &DisaggCounters {
        &self.shared.counters
    }
}

impl Dispatcher for RemotePlane {
    fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let s = &self.shared;
        let seed = seed_for(req.salt.as_deref(), None);
        let blocks = RequestBlocks::from_tokens(&req.prompt, s.block_size, seed);
        if let Some(r) = self.submit_disagg(&req, &blocks) {
            return r;
        }
        let now = s.now();
        let (tx, rx) = output_channel();
        let mut st = s.lock();
        let w = st.place(&req, &blocks, now, &[])?;
        let id = req.id;
        st.inflight.insert(id, Inflight::new(w, tx, Some(Retry { req, blocks })));
        Ok(rx)
    }

    fn cancel(&self, id: RequestId) {
        let mut st = self.shared.lock();
        if let Some(f) = st.inflight.remove(&id) {
            st.router.free(id);
            st.send(f.worker, Down::Cancel(Cancel { worker_id: f.worker, id }));
        }
    }

    fn ready(&self) -> bool {
        self.shared.lock().workers.values().any(|w| !w.retired)
    }

    fn workers(&self) -> Vec<WorkerState> {
        let st = self.shared.lock();
        let mut v: Vec<WorkerState> = st
            .workers
            .iter()
            .map(|(&id, w)| WorkerState { id, alive: !w.retired, role: w.role, metrics: w.metrics })
            .collect();
        v.sort_by_key(|w| w.id);
        v
    }

    fn router_metrics(&self) -> Vec<(&'static str, f64)> {
        let st = self.shared.lock();
        let mut m = router_metrics(&st.router);
        let serving = st.workers.values().filter(|w| !w.retired).count();
        m.push(("plane_workers", serving as f64));
        m.push(("plane_requests_placed_again_total", st.counters.placed_again as f64));
        m.push(("plane_requests_migrated_total", st.counters.migrated as f64));
        m.push(("plane_requests_failed_worker_lost_total", st.counters.failed_worker_lost as f64));
        m.push(("plane_workers_lost_total", st.counters.workers_lost as f64));
        if st.seen_prefill {
            m.extend(self.shared.counters.metrics());
            let queued: u32 = st
                .workers
                .values()
                .filter(|w| w.role == WorkerRole::Prefill)
                .map(|w| w.metrics.load.queued_prefill_tokens)
                .sum();
            m.push(("disagg_prefill_queue_tokens", f64::from(queued)));
        }
        m
    }
}

impl Legs for Shared {
    fn submit_to(
        &self,
        w: WorkerId,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let (tx, rx) = output_channel();
        let mut st = self.lock();
        let id = req.id;
        if !st.send_submit(w, &req) {
            return Err(DispatchError::Overloaded(format!("worker {w} cannot take it")));
        }
        st.inflight.insert(id, Inflight::new(w, tx, None));
        Ok(rx)
    }

    fn kv_ready(&self, w: WorkerId, id: RequestId, arrived: bool) -> bool {
        let st = self.lock();
        let Some(c) = st.workers.get(&w).and_then(|x| st.conns.get(&x.conn)) else {
            return true; // gone: its requests fail on their own
        };
        c.tx.try_send(Down::KvReady(KvReady { worker_id: w, id, arrived })).is_ok()
    }

    fn cancel_on(&self, w: WorkerId, id: RequestId) {
        let mut st = self.lock();
        if st.inflight.get(&id).is_some_and(|f| f.worker == w) {
            st.inflight.remove(&id);
        }
        st.send(w, Down::Cancel(Cancel { worker_id: w, id }));
    }

    fn pick_prefill(
        &self,
        leg: RequestId,
        req: &GenerateRequest,
        exclude: &[WorkerId],
    ) -> Option<WorkerId> {
        let seed = seed_for(req.salt.as_deref(), None);
        let blocks = RequestBlocks::from_tokens(&req.prompt, self.block_size, seed);
        let now = self.now();
        let st = &mut *self.lock();
        let (workers, prefill) = (&st.workers, &mut st.prefill);
        feed::pick(prefill, leg, &blocks, exclude, |w| workers.contains_key(&w), now)
    }

    fn prefill_ended(&self, leg: RequestId) {
        let mut st = self.lock();
        st.prefill.free(leg);
        st.inflight.remove(&leg);
    }

    fn decode_ended(&self, id: RequestId) {
        let mut st = self.lock();
        st.router.free(id);
        st.inflight.remove(&id);
    }

    fn counters(&self) -> &DisaggCounters {
        &self.counters
    }
}
