//! The in-process serving plane: this process's shards behind a [`Dispatcher`], with the
//! KV-aware router choosing the shard for each request.
//!
//! Shards publish [`ShardEvent`]s (KV events, first token, finished, snapshots) on one
//! bounded channel; a feed thread applies them to the router. A KV event id gap (a dropped
//! event) makes the router ask the shard for a snapshot of its cached blocks. Each decision
//! reads every shard's current load (shards publish it every step), and a shard whose inbox
//! is full or that has stopped gives the request to the next one by load.
//!
//! With prefill shards (`kvx serve --prefill-shards P --decode-shards D`) the plane keeps
//! two routers — one over the prefill shards, one over the others — and runs each request
//! that is worth it disaggregated ([`crate::disagg`]): the relays run on the plane's own
//! small runtime, and the KV moves between the shards' regions of the process's transfer
//! agent (shared memory).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_ingress::{DispatchError, Dispatcher, WorkerState};
use kvx_proto::hashing::seed_for;
use kvx_proto::plane::WorkerRole;
use kvx_proto::{GenerateRequest, KvRole, Output, RequestId, WorkerId};
use kvx_router::{RequestBlocks, Router, RouterConfig};
use kvx_worker::kvlink::KvLink;
use kvx_worker::{Command, Hosted, ShardEvent, ShardHandle, Started, SubmitError, output_channel};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::PlaneError;
use crate::disagg::{self, DisaggConfig, DisaggCounters, Legs, Local};
use crate::feed::{self, MAINTENANCE_PERIOD};

/// Shard events applied under one lock at most.
const FEED_BATCH: usize = 4096;

struct Shared {
    shards: Vec<Hosted>,
    /// The router over the shards that decode (aggregated or decode shards).
    router: Mutex<Router>,
    /// The router over the prefill shards (disaggregated serving).
    prefill: Option<Mutex<Router>>,
    disagg: DisaggConfig,
    counters: DisaggCounters,
    block_size: usize,
    start: Instant,
    stop: AtomicBool,
}

fn lock(r: &Mutex<Router>) -> MutexGuard<'_, Router> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn router(&self) -> MutexGuard<'_, Router> {
        lock(&self.router)
    }

    fn shard(&self, w: WorkerId) -> Option<&ShardHandle> {
        self.hosted(w).map(|h| &h.shard)
    }

    fn hosted(&self, w: WorkerId) -> Option<&Hosted> {
        self.shards.iter().find(|h| h.worker_id == w)
    }

    /// The router that holds worker `w`.
    fn router_of(&self, w: WorkerId) -> MutexGuard<'_, Router> {
        match (&self.prefill, self.hosted(w).map(|h| h.role)) {
            (Some(p), Some(WorkerRole::Prefill)) => lock(p),
            _ => self.router(),
        }
    }

    fn decoders(&self) -> impl Iterator<Item = &Hosted> {
        self.shards.iter().filter(|h| h.role != WorkerRole::Prefill)
    }

    fn prefillers(&self) -> impl Iterator<Item = &Hosted> {
        self.shards.iter().filter(|h| h.role == WorkerRole::Prefill)
    }
}

/// Local shards as one dispatcher.
pub struct LocalPlane {
    shared: Arc<Shared>,
    feed: Option<JoinHandle<()>>,
    /// Runs the relays of disaggregated requests (present with prefill shards).
    relays: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for LocalPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPlane").field("shards", &self.shared.shards.len()).finish()
    }
}

impl LocalPlane {
    /// The plane over `started` shards, routed with `cfg` (whose block size must be the
    /// shards').
    pub fn new(started: Started, cfg: RouterConfig) -> Result<Self, PlaneError> {
        Self::with_disagg(started, cfg, DisaggConfig::default())
    }

    /// As [`LocalPlane::new`]; prefill shards among `started` serve disaggregated requests
    /// as `disagg` says.
    pub fn with_disagg(
        started: Started,
        cfg: RouterConfig,
        disagg: DisaggConfig,
    ) -> Result<Self, PlaneError> {
        let Started { shards, events, kv } = started;
        let mut router = Router::new(cfg.clone())?;
        let mut prefill = None;
        for h in &shards {
            if h.role == WorkerRole::Prefill {
                prefill.get_or_insert(Router::new(cfg.clone())?).add_worker(h.worker_id);
            } else {
                router.add_worker(h.worker_id);
            }
        }
        let relays = match (&prefill, &kv) {
            (Some(_), Some(link)) => {
                introduce_decoders(link, &shards)?;
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("kvx-disagg")
                    .enable_all()
                    .build()
                    .map_err(|source| PlaneError::Thread { what: "disaggregation", source })?;
                Some(rt)
            }
            _ => None,
        };
        let shared = Arc::new(Shared {
            shards,
            router: Mutex::new(router),
            prefill: prefill.filter(|_| relays.is_some()).map(Mutex::new),
            disagg,
            counters: DisaggCounters::default(),
            block_size: cfg.block_size,
            start: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let feed = std::thread::Builder::new()
            .name("kvx-router-feed".into())
            .spawn(move || feed(&s, &events))
            .map_err(|source| PlaneError::Thread { what: "router feed", source })?;
        Ok(LocalPlane { shared, feed: Some(feed), relays })
    }

    /// The shards, in worker id order.
    pub fn shards(&self) -> &[Hosted] {
        &self.shared.shards
    }

    /// Runs `f` on the router (tests and diagnostics).
    pub fn with_router<T>(&self, f: impl FnOnce(&mut Router) -> T) -> T {
        f(&mut self.shared.router())
    }

    /// Stops every shard, giving running requests `grace` to finish, and waits (up to five
    /// seconds past the grace) for their threads.
    pub fn shutdown(&self, grace: Duration) {
        for h in &self.shared.shards {
            h.shard.begin_shutdown(grace);
        }
        let deadline = Instant::now() + grace + Duration::from_secs(5);
        while self.shared.shards.iter().any(|h| h.shard.is_alive()) && Instant::now() < deadline {
            #[allow(clippy::disallowed_methods)] // called after the HTTP runtime has stopped
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Applies shard events to the router until the plane stops.
fn feed(s: &Shared, events: &Receiver<ShardEvent>) {
    let mut last_maintenance = Instant::now();
    while !s.stop.load(Ordering::Relaxed) {
        let first = match events.recv_timeout(Duration::from_millis(50)) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut resync = Vec::new();
        {
            for e in first.into_iter().chain(events.try_iter().take(FEED_BATCH)) {
                match e {
                    ShardEvent::Kv(ev) => {
                        resync.extend(feed::apply_kv(&mut s.router_of(ev.worker_id), &ev));
                    }
                    ShardEvent::FirstToken { worker_id, id } => {
                        s.router_of(worker_id).mark_prefill_done(id);
                    }
                    ShardEvent::Finished { worker_id, id } => {
                        s.router_of(worker_id).free(id);
                    }
                    ShardEvent::Snapshot { worker_id, last_event_id, blocks, lower } => {
                        let mut r = s.router_of(worker_id);
                        feed::resync_from(&mut r, worker_id, last_event_id, blocks, lower);
                    }
                }
            }
            if last_maintenance.elapsed() >= MAINTENANCE_PERIOD {
                last_maintenance = Instant::now();
                resync.extend(feed::maintain(&mut s.router(), s.start.elapsed()));
                if let Some(p) = &s.prefill {
                    resync.extend(feed::maintain(&mut lock(p), s.start.elapsed()));
                }
            }
        }
        resync.sort_unstable();
        resync.dedup();
        for w in resync {
            if let Some(sh) = s.shard(w) {
                sh.send(Command::Snapshot);
            }
        }
    }
}

impl LocalPlane {
    /// Places `req` on a decoding shard: the router's choice (made on every shard's current
    /// load), then the others by load when one is full or stopped.
    fn submit_local(
        &self,
        req: GenerateRequest,
        blocks: &RequestBlocks,
        first: Option<WorkerId>,
    ) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let s = &self.shared;
        let now = s.start.elapsed();
        let id = req.id;
        let first = match first {
            Some(w) => w,
            None => {
                let t0 = Instant::now();
                let mut r = s.router();
                // In-process shards publish their load every step: each decision reads the
                // current one (a report kept from an earlier moment would make a shard whose
                // long sequences have just finished look full).
                for h in s.decoders() {
                    r.apply_load(&h.shard.status().load);
                }
                let d = r.route(id, blocks, now);
                r.record_decision_latency(t0.elapsed());
                d.map_err(|e| DispatchError::Unavailable(e.to_string()))?.worker
            }
        };
        let mut req = Some(req);
        // The router's choice, then the others by current load.
        let mut order: Vec<&Hosted> = s.decoders().collect();
        order.sort_by_key(|h| {
            let st = h.shard.status();
            (h.worker_id != first, st.requests as u64 * 1000 + u64::from(st.load.active_blocks))
        });
        let mut any_alive = false;
        for h in order {
            if !h.shard.is_alive() {
                continue;
            }
            any_alive = true;
            let Some(r) = req.take() else { break };
            let (tx, rx) = output_channel();
            match h.shard.submit(r.clone(), tx) {
                Ok(()) => {
                    if h.worker_id != first {
                        let mut router = s.router();
                        router.free(id);
                        let _ = router.add_request(id, h.worker_id, blocks, 0, now);
                    }
                    return Ok(rx);
                }
                Err(SubmitError::Full | SubmitError::Closed) => req = Some(r),
            }
        }
        s.router().free(id);
        if any_alive {
            Err(DispatchError::Overloaded("every worker's queue is full".into()))
        } else {
            Err(DispatchError::Unavailable("no worker is running".into()))
        }
    }

    /// Whether to prefill remotely: the decoding shard the router picks, or why not.
    fn decide(
        &self,
        id: RequestId,
        blocks: &RequestBlocks,
        prompt: usize,
    ) -> (WorkerId, Option<Local>) {
        let s = &self.shared;
        let now = s.start.elapsed();
        let t0 = Instant::now();
        let d = {
            let mut r = s.router();
            for h in s.decoders() {
                r.apply_load(&h.shard.status().load);
            }
            let d = r.route(id, blocks, now);
            r.record_decision_latency(t0.elapsed());
            d
        };
        let Ok(d) = d else { return (0, Some(Local::Busy)) };
        let uncached = prompt.saturating_sub(d.overlap_blocks as usize * s.block_size);
        let queued: usize = s
            .prefillers()
            .filter(|h| h.shard.is_alive())
            .map(|h| h.shard.status().load.queued_prefill_tokens as usize)
            .sum();
        let live = s.prefillers().any(|h| h.shard.is_alive());
        let why = if uncached < s.disagg.min_tokens {
            Some(Local::Short)
        } else if !live || queued >= s.disagg.max_prefill_queue {
            Some(Local::Busy)
        } else {
            None
        };
        (d.worker, why)
    }

    /// The plane's counters of disaggregated serving.
    pub fn disagg_counters(&self) -> &DisaggCounters {
        &self.shared.counters
    }
}

/// Gives the transfer link the caches of this process's decode shards.
fn introduce_decoders(link: &KvLink, shards: &[Hosted]) -> Result<(), PlaneError> {
    let peers: Vec<_> = shards
        .iter()
        .filter(|h| h.role == WorkerRole::Decode)
        .filter_map(|h| h.kv_peer.clone().map(|p| (h.worker_id, p)))
        .collect();
    link.add_peers(&peers).map_err(|e| PlaneError::Kv(e.to_string()))
}

impl Dispatcher for LocalPlane {
    fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let s = &self.shared;
        let seed = seed_for(req.salt.as_deref(), None);
        let blocks = RequestBlocks::from_tokens(&req.prompt, s.block_size, seed);
        // A scored prompt is computed where it decodes (every position's logits are read).
        let Some(rt) = self
            .relays
            .as_ref()
            .filter(|_| req.kv == KvRole::Local && req.prompt_logprobs.is_none())
        else {
            return self.submit_local(req, &blocks, None);
        };
        let (decode, why) = self.decide(req.id, &blocks, req.prompt.len());
        if let Some(why) = why {
            s.counters.local(why);
            return self.submit_local(req, &blocks, (decode != 0).then_some(decode));
        }
        // The decode shard will not compute the prompt: no prefill load there.
        s.router().mark_prefill_done(req.id);
        let mut d_req = req.clone();
        d_req.kv = KvRole::AwaitKv;
        let d_rx = match s.submit_to(decode, d_req) {
            Ok(rx) => rx,
            Err(_) => {
                // The router placed it on `decode`; place it again among the others.
                s.router().free(req.id);
                return self.submit_local(req, &blocks, None);
            }
        };
        let (client, rx) = output_channel();
        rt.spawn(disagg::relay(s.clone(), s.disagg, req, decode, d_rx, client));
        Ok(rx)
    }

    fn cancel(&self, id: RequestId) {
        for h in &self.shared.shards {
            h.shard.cancel(id);
        }
    }

    fn ready(&self) -> bool {
        self.shared.shards.iter().any(|h| h.shard.is_alive())
    }

    fn workers(&self) -> Vec<WorkerState> {
        self.shared
            .shards
            .iter()
            .map(|h| WorkerState {
                id: h.worker_id,
                alive: h.shard.is_alive(),
                role: h.role,
                metrics: h.shard.status().metrics(),
            })
            .collect()
    }

    fn router_metrics(&self) -> Vec<(&'static str, f64)> {
        let s = &self.shared;
        let mut m = feed::router_metrics(&s.router());
        if s.prefill.is_some() {
            m.extend(s.counters.metrics());
            let queued: u32 =
                s.prefillers().map(|h| h.shard.status().load.queued_prefill_tokens).sum();
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
        let shard =
            self.shard(w).ok_or_else(|| DispatchError::Unavailable(format!("no worker {w}")))?;
        let (tx, rx) = output_channel();
        shard.submit(req, tx).map_err(|e| match e {
            SubmitError::Full => DispatchError::Overloaded(e.to_string()),
            SubmitError::Closed => DispatchError::Unavailable(e.to_string()),
        })?;
        Ok(rx)
    }

    fn kv_ready(&self, w: WorkerId, id: RequestId, arrived: bool) -> bool {
        self.shard(w).is_none_or(|s| s.try_send(Command::KvReady(id, arrived)) || !s.is_alive())
    }

    fn cancel_on(&self, w: WorkerId, id: RequestId) {
        if let Some(s) = self.shard(w) {
            s.cancel(id);
        }
    }

    fn pick_prefill(
        &self,
        leg: RequestId,
        req: &GenerateRequest,
        exclude: &[WorkerId],
    ) -> Option<WorkerId> {
        let mut r = lock(self.prefill.as_ref()?);
        for h in self.prefillers() {
            r.apply_load(&h.shard.status().load);
        }
        let seed = seed_for(req.salt.as_deref(), None);
        let blocks = RequestBlocks::from_tokens(&req.prompt, self.block_size, seed);
        let alive = |w: WorkerId| self.shard(w).is_some_and(ShardHandle::is_alive);
        feed::pick(&mut r, leg, &blocks, exclude, alive, self.start.elapsed())
    }

    fn prefill_ended(&self, leg: RequestId) {
        if let Some(p) = &self.prefill {
            lock(p).free(leg);
        }
    }

    fn decode_ended(&self, id: RequestId) {
        self.router().free(id);
    }

    fn counters(&self) -> &DisaggCounters {
        &self.counters
    }
}

impl Drop for LocalPlane {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(f) = self.feed.take() {
            let _ = f.join();
        }
    }
}
