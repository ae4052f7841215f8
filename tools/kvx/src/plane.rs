//! The in-process serving plane: this process's shards behind a [`Dispatcher`], with the
//! KV-aware router choosing the shard for each request.
//!
//! Shards publish [`ShardEvent`]s (KV events, first token, finished, snapshots) on one
//! bounded channel; a feed thread applies them to the router. A KV event id gap (a dropped
//! event) makes the router ask the shard for a snapshot of its cached blocks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_ingress::{DispatchError, Dispatcher, WorkerState};
use kvx_proto::hashing::seed_for;
use kvx_proto::{
    GenerateRequest, Output, RequestId, SequenceHash, StorageTier, StoredBlock, WorkerId,
    WorkerMetrics,
};
use kvx_router::{ApplyResult, RequestBlocks, Router, RouterConfig, SnapshotBlock};
use kvx_worker::{Command, ShardEvent, ShardHandle, SubmitError};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Shard `i` is worker `i + 1`.
pub(crate) fn worker_id(shard: usize) -> u64 {
    shard as u64 + 1
}

struct Shared {
    shards: Vec<ShardHandle>,
    router: Mutex<Router>,
    block_size: usize,
    start: Instant,
    stop: AtomicBool,
}

/// Local shards as one dispatcher.
pub(crate) struct LocalPlane {
    shared: Arc<Shared>,
    feed: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LocalPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPlane").field("shards", &self.shared.shards.len()).finish()
    }
}

impl LocalPlane {
    /// `events` is the receiving end of the channel the shards were spawned with.
    pub(crate) fn new(
        shards: Vec<ShardHandle>,
        cfg: RouterConfig,
        events: Receiver<ShardEvent>,
    ) -> anyhow::Result<Self> {
        let mut router =
            Router::new(cfg.clone()).map_err(|e| anyhow::anyhow!("router configuration: {e}"))?;
        for i in 0..shards.len() {
            router.add_worker(worker_id(i));
        }
        let shared = Arc::new(Shared {
            shards,
            router: Mutex::new(router),
            block_size: cfg.block_size as usize,
            start: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let feed = std::thread::Builder::new()
            .name("kvx-router-feed".into())
            .spawn(move || feed(&s, &events))?;
        Ok(LocalPlane { shared, feed: Some(feed) })
    }

    /// Stops every shard, giving running requests `grace` to finish, and waits for them.
    pub(crate) fn shutdown(&self, grace: Duration) {
        for s in &self.shared.shards {
            s.begin_shutdown(grace);
        }
        let deadline = Instant::now() + grace + Duration::from_secs(5);
        while self.shared.shards.iter().any(ShardHandle::is_alive) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn router(&self) -> std::sync::MutexGuard<'_, Router> {
        self.shared.router.lock().unwrap_or_else(|p| p.into_inner())
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
            let mut r = s.router.lock().unwrap_or_else(|p| p.into_inner());
            for e in first.into_iter().chain(events.try_iter().take(4096)) {
                match e {
                    ShardEvent::Kv(ev) => {
                        if let ApplyResult::Gap { worker, .. } = r.apply_event(&ev) {
                            resync.push(worker);
                        }
                    }
                    ShardEvent::FirstToken { id, .. } => {
                        r.mark_prefill_done(id);
                    }
                    ShardEvent::Finished { id, .. } => {
                        r.free(id);
                    }
                    ShardEvent::Snapshot { worker_id, last_event_id, blocks } => {
                        resync_from(&mut r, worker_id, last_event_id, blocks);
                    }
                }
            }
            if last_maintenance.elapsed() > Duration::from_secs(1) {
                last_maintenance = Instant::now();
                r.expire(s.start.elapsed());
                resync.extend(r.workers_needing_resync());
            }
        }
        resync.sort_unstable();
        resync.dedup();
        for w in resync {
            if let Some(sh) = s.shards.get((w as usize).wrapping_sub(1)) {
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
            let mut r = self.router();
            // In-process shards publish their load every step: each decision reads the
            // current one (a report kept from an earlier moment would make a shard whose
            // long sequences have just finished look full).
            for sh in &s.shards {
                r.apply_load(&sh.status().load);
            }
            let d = r.route(id, &blocks, now);
            r.record_decision_latency(t0.elapsed());
            d
        };
        let first = first.map_err(|e| DispatchError::Unavailable(e.to_string()))?;
        let mut req = Some(req);
        // The router's choice, then the others by current load.
        let mut order: Vec<usize> = (0..s.shards.len()).collect();
        order.sort_by_key(|&i| {
            let st = s.shards[i].status();
            (
                worker_id(i) != first.worker,
                st.requests as u64 * 1000 + u64::from(st.load.active_blocks),
            )
        });
        let mut any_alive = false;
        for i in order {
            let shard = &s.shards[i];
            if !shard.is_alive() {
                continue;
            }
            any_alive = true;
            let Some(r) = req.take() else { break };
            let (tx, rx) = unbounded_channel();
            match shard.submit(r.clone(), tx) {
                Ok(()) => {
                    if worker_id(i) != first.worker {
                        let mut router = self.router();
                        router.free(id);
                        let _ = router.add_request(id, worker_id(i), &blocks, 0, now);
                    }
                    return Ok(rx);
                }
                Err(SubmitError::Full | SubmitError::Closed) => req = Some(r),
            }
        }
        self.router().free(id);
        if any_alive {
            Err(DispatchError::Overloaded("every worker's queue is full".into()))
        } else {
            Err(DispatchError::Unavailable("no worker is running".into()))
        }
    }

    fn cancel(&self, id: RequestId) {
        for s in &self.shared.shards {
            s.cancel(id);
        }
    }

    fn ready(&self) -> bool {
        self.shared.shards.iter().any(ShardHandle::is_alive)
    }

    fn workers(&self) -> Vec<WorkerState> {
        self.shared
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let st = s.status();
                WorkerState {
                    id: worker_id(i),
                    alive: s.is_alive(),
                    metrics: WorkerMetrics {
                        load: st.load,
                        prompt_tokens: st.stats.prompt_tokens,
                        cached_tokens: st.stats.cached_tokens,
                        prefill_tokens: st.stats.prefill_tokens,
                        generated_tokens: st.stats.generated_tokens,
                        preemptions: st.stats.preemptions,
                        finished: st.stats.finished,
                        steps: st.stats.steps,
                    },
                }
            })
            .collect()
    }

    fn router_metrics(&self) -> Vec<(&'static str, f64)> {
        router_metrics(&self.router())
    }
}

/// Rebuilds a worker's part of the index from its snapshot of device blocks
/// (`(parent, block)`, parents first) taken after event `last_event_id`.
pub(crate) fn resync_from(
    r: &mut Router,
    worker: WorkerId,
    last_event_id: u64,
    blocks: Vec<(Option<SequenceHash>, StoredBlock)>,
) {
    let blocks: Vec<SnapshotBlock> = blocks
        .into_iter()
        .map(|(parent, block)| SnapshotBlock { tier: StorageTier::Device, parent, block })
        .collect();
    if let Err(e) = r.resync(worker, last_event_id, &blocks) {
        tracing::warn!(worker, error = %e, "resync failed");
    }
}

/// The router's counters as `/metrics` shows them.
pub(crate) fn router_metrics(r: &Router) -> Vec<(&'static str, f64)> {
    let m = r.metrics();
    let idx = r.index_stats();
    vec![
        ("router_decisions_total", m.decisions as f64),
        ("router_hit_rate", m.hit_rate()),
        ("router_overlap_blocks_per_decision", m.overlap_per_decision()),
        ("router_index_blocks", idx.blocks as f64),
        ("router_index_nodes", idx.nodes as f64),
        (
            "router_decision_latency_p50_us",
            m.decision_latency.quantile_upper_us(0.5).unwrap_or(0) as f64,
        ),
        (
            "router_decision_latency_p99_us",
            m.decision_latency.quantile_upper_us(0.99).unwrap_or(0) as f64,
        ),
    ]
}

impl Drop for LocalPlane {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(f) = self.feed.take() {
            let _ = f.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use kvx_engine::mocker::{MockBackend, MockConfig};
    use kvx_engine::scheduler::SchedulerConfig;
    use kvx_engine::{Engine, EngineConfig};
    use kvx_proto::{LoadReport, SamplingOptions, StopConditions};
    use kvx_worker::ShardConfig;

    use super::*;

    fn request(id: u64, len: u32, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            id: RequestId(id),
            prompt: (0..len).map(|t| 1 + (t * 7 + id as u32) % 60).collect(),
            sampling: SamplingOptions { temperature: 0.0, ..Default::default() },
            stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
            logprobs: None,
            salt: None,
        }
    }

    /// Two mocker shards (real time: a decode step takes ~6 ms) behind a plane.
    fn plane() -> LocalPlane {
        let (tx, rx) = sync_channel(1 << 12);
        let shards = (0..2)
            .map(|i| {
                let make = move || {
                    let sched = SchedulerConfig { max_model_len: 4096, ..Default::default() };
                    let mock =
                        MockConfig { n_vocab: 64, n_blocks: 256, speedup: 1.0, avoid: Vec::new() };
                    let ec = EngineConfig { sched, worker_id: worker_id(i) };
                    Ok(Engine::new(ec, Box::new(MockBackend::new(mock)), None))
                };
                let cfg = ShardConfig { index: i, core: None, inbox_capacity: 64 };
                kvx_worker::spawn(cfg, make, Some(tx.clone())).expect("shard")
            })
            .collect();
        LocalPlane::new(shards, RouterConfig::default(), rx).expect("plane")
    }

    /// A periodic load report taken while a shard was busy must not steer a request away from
    /// it once it is idle: the plane decides on the shards' current loads.
    #[test]
    fn routing_uses_the_shards_current_load_not_a_stale_report() {
        let p = plane();
        // Shard 2 (worker 2) runs a request the router did not place.
        let (tx, mut running) = unbounded_channel();
        p.shared.shards[1].submit(request(1, 64, 2000), tx).expect("submit");
        let t0 = Instant::now();
        while p.shared.shards[1].status().load.active_blocks == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "shard 2 never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The last periodic report of shard 1 was taken when it was full.
        let stale = LoadReport {
            worker_id: 1,
            active_seqs: 8,
            active_blocks: 200,
            free_blocks: 56,
            total_blocks: 256,
            ..Default::default()
        };
        assert!(p.router().apply_load(&stale));
        let _out = p.submit(request(2, 64, 4)).expect("routed");
        assert_eq!(p.router().tracker().worker_of(RequestId(2)), Some(1));
        p.cancel(RequestId(1));
        p.shutdown(Duration::ZERO);
        while running.try_recv().is_ok() {}
    }
}
