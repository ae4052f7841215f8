//! The in-process serving plane: this process's shards behind a [`Dispatcher`], with the
//! KV-aware router choosing the shard for each request.
//!
//! Shards publish [`ShardEvent`]s (KV events, first token, finished, snapshots) on one
//! bounded channel; a feed thread applies them to the router. A KV event id gap (a dropped
//! event) makes the router ask the shard for a snapshot of its cached blocks. Each decision
//! reads every shard's current load (shards publish it every step), and a shard whose inbox
//! is full or that has stopped gives the request to the next one by load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_ingress::{DispatchError, Dispatcher, WorkerState};
use kvx_proto::hashing::seed_for;
use kvx_proto::{GenerateRequest, Output, RequestId, WorkerId};
use kvx_router::{RequestBlocks, Router, RouterConfig};
use kvx_worker::{Command, Hosted, ShardEvent, ShardHandle, Started, SubmitError, output_channel};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::PlaneError;
use crate::feed::{self, MAINTENANCE_PERIOD};

/// Shard events applied under one lock at most.
const FEED_BATCH: usize = 4096;

struct Shared {
    shards: Vec<Hosted>,
    router: Mutex<Router>,
    block_size: usize,
    start: Instant,
    stop: AtomicBool,
}

impl Shared {
    fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn shard(&self, w: WorkerId) -> Option<&ShardHandle> {
        self.shards.iter().find(|h| h.worker_id == w).map(|h| &h.shard)
    }
}

/// Local shards as one dispatcher.
pub struct LocalPlane {
    shared: Arc<Shared>,
    feed: Option<JoinHandle<()>>,
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
        let Started { shards, events } = started;
        let mut router = Router::new(cfg.clone())?;
        for h in &shards {
            router.add_worker(h.worker_id);
        }
        let shared = Arc::new(Shared {
            shards,
            router: Mutex::new(router),
            block_size: cfg.block_size,
            start: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let feed = std::thread::Builder::new()
            .name("kvx-router-feed".into())
            .spawn(move || feed(&s, &events))
            .map_err(|source| PlaneError::Thread { what: "router feed", source })?;
        Ok(LocalPlane { shared, feed: Some(feed) })
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
            let mut r = s.router();
            for e in first.into_iter().chain(events.try_iter().take(FEED_BATCH)) {
                match e {
                    ShardEvent::Kv(ev) => resync.extend(feed::apply_kv(&mut r, &ev)),
                    ShardEvent::FirstToken { id, .. } => {
                        r.mark_prefill_done(id);
                    }
                    ShardEvent::Finished { id, .. } => {
                        r.free(id);
                    }
                    ShardEvent::Snapshot { worker_id, last_event_id, blocks } => {
                        feed::resync_from(&mut r, worker_id, last_event_id, blocks);
                    }
                }
            }
            if last_maintenance.elapsed() >= MAINTENANCE_PERIOD {
                last_maintenance = Instant::now();
                resync.extend(feed::maintain(&mut r, s.start.elapsed()));
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

impl Dispatcher for LocalPlane {
    fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let s = &self.shared;
        let seed = seed_for(req.salt.as_deref(), None);
        let blocks = RequestBlocks::from_tokens(&req.prompt, s.block_size, seed);
        let now = s.start.elapsed();
        let id = req.id;
        let t0 = Instant::now();
        let first = {
            let mut r = s.router();
            // In-process shards publish their load every step: each decision reads the
            // current one (a report kept from an earlier moment would make a shard whose
            // long sequences have just finished look full).
            for h in &s.shards {
                r.apply_load(&h.shard.status().load);
            }
            let d = r.route(id, &blocks, now);
            r.record_decision_latency(t0.elapsed());
            d
        };
        let first = first.map_err(|e| DispatchError::Unavailable(e.to_string()))?;
        let mut req = Some(req);
        // The router's choice, then the others by current load.
        let mut order: Vec<&Hosted> = s.shards.iter().collect();
        order.sort_by_key(|h| {
            let st = h.shard.status();
            (
                h.worker_id != first.worker,
                st.requests as u64 * 1000 + u64::from(st.load.active_blocks),
            )
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
                    if h.worker_id != first.worker {
                        let mut router = s.router();
                        router.free(id);
                        let _ = router.add_request(id, h.worker_id, &blocks, 0, now);
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
                metrics: h.shard.status().metrics(),
            })
            .collect()
    }

    fn router_metrics(&self) -> Vec<(&'static str, f64)> {
        feed::router_metrics(&self.shared.router())
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
