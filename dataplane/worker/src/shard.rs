//! A shard: one OS thread (pinned to a core when asked) that owns an engine and serves its
//! inbox. Requests arrive as commands; outputs leave through each request's own channel;
//! KV events and load snapshots are published at step boundaries.
//!
//! The inbox is bounded (a full inbox is backpressure the caller turns into "overloaded").
//! A request whose output channel is closed (the client went away) is cancelled at the next
//! step boundary, which returns its blocks.
//!
//! With KV tiers (host memory, disk) the shard also drives its [`Tiers`]: each block the
//! engine registers is pinned and offered to them (copied down beside the steps), a request
//! admitted with a prompt that continues below the pool waits while those blocks load
//! instead of computing them ([`LowerTiers`], the engine's view of the tiers), and the
//! tiers' events join the engine's in one numbered stream.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvx_engine::block_pool::BlockEvent;
use kvx_engine::{Admission, Engine, EngineError, EngineStats, LowerTiers};
use kvx_proto::{
    ErrorClass, GenerateRequest, KvDest, KvEvent, KvEventData, KvNote, KvRole, LoadReport,
    LocalBlockHash, Output, OutputDelta, RequestId, SequenceHash, StorageTier, StoredBlock,
    WorkerId, WorkerMetrics,
};

use crate::kvlink::{KvLink, Pending};
use kvx_kernels::par::CoreLease;
use kvx_kvbm::{Action, TierEvent, Tiers};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// Where a request's outputs go.
pub type OutputSender = UnboundedSender<Output>;

/// A request's output stream. Unbounded by type, bounded by construction: a request sends
/// one delta per generated token (at most its `max_tokens`, which the engine checks against
/// the context at admission) and one end, and nothing after that.
#[allow(clippy::disallowed_methods)] // the one unbounded channel; see above
pub fn output_channel() -> (OutputSender, UnboundedReceiver<Output>) {
    tokio::sync::mpsc::unbounded_channel()
}

/// What a shard tells the router side, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum ShardEvent {
    /// A KV event of the shard's block pool.
    Kv(KvEvent),
    /// A request produced its first token (its prefill is done).
    FirstToken {
        /// The shard's worker id.
        worker_id: WorkerId,
        /// The request.
        id: RequestId,
    },
    /// A request ended (finished, failed or cancelled).
    Finished {
        /// The shard's worker id.
        worker_id: WorkerId,
        /// The request.
        id: RequestId,
    },
    /// Every cached block, answering [`Command::Snapshot`]: `(parent, block)`, parents first;
    /// `last_event_id` is the id of the last KV event sent before it.
    Snapshot {
        /// The worker.
        worker_id: WorkerId,
        /// Events up to this id are reflected in the snapshot.
        last_event_id: u64,
        /// The blocks.
        blocks: Vec<(Option<kvx_proto::SequenceHash>, StoredBlock)>,
        /// Blocks of the tiers below the pool, `(tier, parent, block)`.
        lower: Vec<(StorageTier, Option<kvx_proto::SequenceHash>, StoredBlock)>,
    },
}

/// A message to a shard.
#[derive(Debug)]
pub enum Command {
    /// Start a request.
    Add(Box<GenerateRequest>, OutputSender),
    /// Cancel a request.
    Cancel(RequestId),
    /// Send a [`ShardEvent::Snapshot`] of the cached blocks (after lost events).
    Snapshot,
    /// A reserved request's KV arrived (`true`) or will not come (`false`: compute it here).
    KvReady(RequestId, bool),
    /// Stop accepting work; finish what runs until the deadline, then cancel it.
    Shutdown(Duration),
}

/// Shard settings.
#[derive(Debug)]
pub struct ShardConfig {
    /// Index among the process's shards (thread names, logs).
    pub index: usize,
    /// Core to pin the shard thread to.
    pub core: Option<usize>,
    /// Commands queued at most.
    pub inbox_capacity: usize,
    /// Where prefilled requests' KV goes (prefill shards of disaggregated serving).
    pub kv: Option<Arc<KvLink>>,
    /// The KV tiers below the engine's pool.
    pub tiers: Option<Tiers>,
    /// The lease of the shard's core, lent to other shards' kernel pools while the shard has
    /// nothing to do ([`kvx_kernels::par::CoreLease`]).
    pub lease: Option<CoreLease>,
}

/// Why a request could not be handed to a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The inbox is full.
    #[error("the worker's queue is full")]
    Full,
    /// The shard has stopped.
    #[error("the worker has stopped")]
    Closed,
}

/// What a shard publishes at step boundaries.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShardStatus {
    /// Load.
    pub load: LoadReport,
    /// Engine counters.
    pub stats: EngineStats,
    /// Requests in the shard (queued or running).
    pub requests: usize,
    /// The KV tiers below the pool.
    pub tiers: kvx_proto::TierMetrics,
}

impl ShardStatus {
    /// The status as the planes report it.
    pub fn metrics(&self) -> WorkerMetrics {
        WorkerMetrics {
            load: self.load,
            prompt_tokens: self.stats.prompt_tokens,
            cached_tokens: self.stats.cached_tokens,
            prefill_tokens: self.stats.prefill_tokens,
            generated_tokens: self.stats.generated_tokens,
            preemptions: self.stats.preemptions,
            finished: self.stats.finished,
            steps: self.stats.steps,
            tiers: self.tiers,
            step: self.stats.step,
        }
    }
}

/// The owner's side of a shard.
#[derive(Debug)]
pub struct ShardHandle {
    index: usize,
    tx: SyncSender<Command>,
    status: Arc<Mutex<ShardStatus>>,
    thread: Option<JoinHandle<()>>,
}

impl ShardHandle {
    /// Index of the shard.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Hands a request to the shard without blocking.
    pub fn submit(&self, req: GenerateRequest, sink: OutputSender) -> Result<(), SubmitError> {
        self.tx.try_send(Command::Add(Box::new(req), sink)).map_err(|e| match e {
            TrySendError::Full(_) => SubmitError::Full,
            TrySendError::Disconnected(_) => SubmitError::Closed,
        })
    }

    /// Asks the shard to cancel a request (best effort when the inbox is full: a closed
    /// output channel cancels the request anyway).
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.try_send(Command::Cancel(id));
    }

    /// Sends a command without blocking (dropped when the inbox is full).
    pub fn send(&self, cmd: Command) {
        let _ = self.tx.try_send(cmd);
    }

    /// Sends a command without blocking; false when the inbox is full (or the shard gone).
    pub fn try_send(&self, cmd: Command) -> bool {
        self.tx.try_send(cmd).is_ok()
    }

    /// The latest status.
    pub fn status(&self) -> ShardStatus {
        *self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the shard thread is still running.
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Asks the shard to stop (as [`ShardHandle::shutdown`]) without waiting.
    pub fn begin_shutdown(&self, grace: Duration) {
        let _ = self.tx.send(Command::Shutdown(grace));
    }

    /// Stops the shard: running requests get until `grace` to finish, then are cancelled.
    /// Waits for the thread.
    pub fn shutdown(mut self, grace: Duration) {
        let _ = self.tx.send(Command::Shutdown(grace));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ShardHandle {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.try_send(Command::Shutdown(Duration::ZERO));
            let _ = t.join();
        }
    }
}

/// Pins the calling thread to `core` (ignored where the OS refuses).
pub fn pin_current(core: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: core })
}

/// Starts a shard. `make_engine` runs on the shard thread (after pinning), so the engine's
/// memory is first touched there. `events` receives the shard's [`ShardEvent`]s (KV events
/// are dropped when it is full: the router sees the id gap and asks for a snapshot).
pub fn spawn(
    cfg: ShardConfig,
    make_engine: impl FnOnce() -> Result<Engine, EngineError> + Send + 'static,
    events: Option<SyncSender<ShardEvent>>,
) -> Result<ShardHandle, EngineError> {
    let (tx, rx) = mpsc::sync_channel(cfg.inbox_capacity.max(1));
    let status = Arc::new(Mutex::new(ShardStatus::default()));
    let st = status.clone();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let core = cfg.core;
    let kv = cfg.kv.clone();
    let tiers = cfg.tiers;
    let lease = cfg.lease;
    let thread = std::thread::Builder::new()
        .name(format!("kvx-shard-{}", cfg.index))
        .spawn(move || {
            if let Some(c) = core {
                pin_current(c);
            }
            match make_engine() {
                Ok(engine) => run(engine, rx, st, events, kv, tiers, lease, ready_tx),
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| EngineError::Internal(format!("spawning a shard thread: {e}")))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(ShardHandle { index: cfg.index, tx, status, thread: Some(thread) }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(EngineError::Internal("the shard thread died while starting".into()))
        }
    }
}

struct Loop {
    engine: Engine,
    sinks: HashMap<RequestId, OutputSender>,
    status: Arc<Mutex<ShardStatus>>,
    events: Option<SyncSender<ShardEvent>>,
    next_event: u64,
    worker_id: WorkerId,
    draining: Option<Instant>,
    kv: Option<Arc<KvLink>>,
    /// Where prefill-only requests' KV goes.
    dests: HashMap<RequestId, KvDest>,
    /// Transfers in flight, by request.
    pending: Vec<(RequestId, Pending)>,
    /// Requests prefilled in the last step.
    prefilled: Vec<RequestId>,
    /// The KV tiers below the pool.
    tiers: Option<Tiers>,
    /// Requests loading their prompt's prefix from the tiers.
    loading: HashMap<RequestId, Loading>,
    /// What the tiers asked for (reused).
    actions: Vec<Action>,
}

/// The shard's loop; `ready` is told once the first status (the empty engine's load, under
/// the engine's worker id) is published.
#[allow(clippy::too_many_arguments)]
fn run(
    engine: Engine,
    rx: Receiver<Command>,
    status: Arc<Mutex<ShardStatus>>,
    events: Option<SyncSender<ShardEvent>>,
    kv: Option<Arc<KvLink>>,
    tiers: Option<Tiers>,
    lease: Option<CoreLease>,
    ready: mpsc::SyncSender<Result<(), EngineError>>,
) {
    let worker_id = engine.config().worker_id;
    let mut l = Loop {
        engine,
        sinks: HashMap::new(),
        status,
        events,
        next_event: 1,
        worker_id,
        draining: None,
        kv,
        dests: HashMap::new(),
        pending: Vec::new(),
        prefilled: Vec::new(),
        tiers,
        loading: HashMap::new(),
        actions: Vec::new(),
    };
    // Blocks a disk tier kept from an earlier run are announced before anything else.
    l.publish_events();
    l.publish_status();
    let _ = ready.send(Ok(()));
    let mut inbox_open = true;
    loop {
        // Take every pending command without blocking while there is work.
        loop {
            let cmd = if l.engine.has_work() || !inbox_open {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        inbox_open = false;
                        break;
                    }
                }
            } else {
                // Transfers in flight are polled often; otherwise wake for the status.
                let wait = if l.pending.is_empty() && !l.tiers_busy() {
                    Duration::from_millis(100)
                } else {
                    Duration::from_micros(500)
                };
                // Nothing to compute: other shards' steps may use this core until this shard
                // has a step to run. What it does in between (commands — an admission may
                // compile a grammar —, polls, the status) shares the core with their guest.
                if let Some(lease) = &lease {
                    lease.lend();
                }
                match rx.recv_timeout(wait) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => {
                        l.engine.release_expired();
                        l.poll_transfers();
                        l.poll_tiers();
                        l.publish_status();
                        if l.pending.is_empty() && !l.tiers_busy() {
                            continue;
                        }
                        break;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        inbox_open = false;
                        break;
                    }
                }
            };
            match cmd {
                Command::Add(req, sink) => l.add(*req, sink),
                Command::Cancel(id) => l.cancel(id),
                Command::Snapshot => l.send_snapshot(),
                Command::KvReady(id, arrived) => {
                    if arrived {
                        l.engine.kv_arrived(id);
                    } else {
                        l.engine.kv_failed(id);
                    }
                }
                Command::Shutdown(grace) => {
                    l.draining = Some(Instant::now() + grace);
                    inbox_open = false;
                }
            }
        }
        if let Some(deadline) = l.draining {
            if Instant::now() >= deadline {
                let ids: Vec<RequestId> = l.sinks.keys().copied().collect();
                for id in ids {
                    l.cancel_engine(id);
                }
            }
            if !l.engine.has_work() && l.sinks.is_empty() && l.pending.is_empty() && !l.tiers_busy()
            {
                l.publish_status();
                return;
            }
        }
        if !inbox_open && l.draining.is_none() {
            // The handle is gone: cancel everything and stop.
            l.draining = Some(Instant::now());
            continue;
        }
        if l.engine.has_work() {
            if let Some(lease) = &lease {
                lease.reclaim();
            }
            l.step();
        }
        l.poll_transfers();
        l.poll_tiers();
        l.publish_status();
    }
}

impl Loop {
    fn add(&mut self, req: GenerateRequest, sink: OutputSender) {
        if self.draining.is_some() {
            let _ = sink.send(Output::Error {
                class: ErrorClass::Unavailable,
                message: "the worker is shutting down".into(),
            });
            return;
        }
        match self.engine.add(&req) {
            Ok(admission) => {
                let note = match admission {
                    Admission::Queued => None,
                    Admission::Reserved { first_block, blocks } => {
                        Some(KvNote::Reserved { first_block, blocks })
                    }
                    Admission::NotReserved => Some(KvNote::Local),
                };
                if let Some(note) = note {
                    let _ = sink.send(Output::Kv(note));
                }
                if let KvRole::PrefillTo(d) = req.kv {
                    self.dests.insert(req.id, d);
                }
                self.sinks.insert(req.id, sink);
            }
            Err(e) => {
                let _ = sink.send(Output::Error { class: e.class(), message: e.to_string() });
            }
        }
    }

    /// Whether the tiers have copies in flight.
    fn tiers_busy(&self) -> bool {
        self.tiers.as_ref().is_some_and(Tiers::busy)
    }

    /// Takes what the tiers finished, does what they ask and publishes their events.
    fn poll_tiers(&mut self) {
        let Some(t) = self.tiers.as_mut() else { return };
        t.poll(&mut self.actions);
        self.apply_actions();
        self.publish_events();
    }

    fn apply_actions(&mut self) {
        let bs = self.engine.config().sched.block_size;
        for a in self.actions.drain(..) {
            match a {
                Action::Unpin(b) => self.engine.unpin_block(b),
                Action::Loaded { id, blocks } => {
                    let Some(l) = self.loading.remove(&id) else { continue };
                    self.engine.onboarded(id, (l.first + blocks) * bs);
                    if l.cancelled {
                        self.engine.cancel(id);
                    }
                }
            }
        }
    }

    fn step(&mut self) {
        let stepped = match self.tiers.as_mut() {
            Some(tiers) => {
                let mut hook =
                    TierHook { tiers, loading: &mut self.loading, actions: &mut self.actions };
                self.engine.step_with(Some(&mut hook))
            }
            None => self.engine.step(),
        };
        let out = match stepped {
            Ok(o) => o,
            Err(e) => {
                tracing::error!(error = %e, "engine step failed; failing its requests");
                let msg = e.to_string();
                let mut ids: Vec<RequestId> = self
                    .engine
                    .scheduler()
                    .running()
                    .iter()
                    .filter_map(|&s| self.engine.scheduler().seq(s).map(|q| q.id))
                    .collect();
                for (id, sink) in self.sinks.drain() {
                    let _ = sink
                        .send(Output::Error { class: ErrorClass::Internal, message: msg.clone() });
                    ids.push(id);
                }
                ids.sort_unstable();
                ids.dedup();
                for id in ids {
                    if !self.pending.iter().any(|(p, _)| *p == id) {
                        self.cancel_engine(id);
                    }
                }
                return;
            }
        };
        let mut gone = Vec::new();
        for ev in &out.events {
            if ev.prefilled {
                self.prefilled.push(ev.id);
                continue;
            }
            let Some(sink) = self.sinks.get(&ev.id) else { continue };
            let mut ok = true;
            if !ev.prompt.is_empty() {
                let logprobs = out.prompt[ev.prompt.clone()]
                    .iter()
                    .map(|p| kvx_proto::Logprob {
                        logprob: p.logprob,
                        top: out.top[p.top.clone()].to_vec(),
                    })
                    .collect();
                ok = sink.send(Output::PromptLogprobs { start: ev.prompt_start, logprobs }).is_ok();
            }
            if ev.token.is_some() && ev.usage.completion_tokens == 1 {
                notify(
                    &self.events,
                    ShardEvent::FirstToken { worker_id: self.worker_id, id: ev.id },
                );
            }
            if let Some(t) = ev.token {
                let logprobs = if ev.top.is_empty() {
                    Vec::new()
                } else {
                    vec![kvx_proto::Logprob {
                        logprob: ev.logprob,
                        top: out.top[ev.top.clone()].to_vec(),
                    }]
                };
                let delta =
                    OutputDelta { tokens: vec![t], text: out.text_of(ev).to_string(), logprobs };
                ok = sink.send(Output::Delta(delta)).is_ok();
            }
            if let Some(reason) = ev.finish {
                let _ = sink.send(Output::Finished { reason, usage: ev.usage });
                self.sinks.remove(&ev.id);
                notify(&self.events, ShardEvent::Finished { worker_id: self.worker_id, id: ev.id });
            } else if !ok {
                gone.push(ev.id);
            }
        }
        // Requests whose client went away (seen on send, or on a request that produced no
        // token this step) are cancelled now; their blocks return before the next step.
        // A request whose KV is being sent ends when the transfer does.
        gone.extend(self.sinks.iter().filter(|(_, s)| s.is_closed()).map(|(id, _)| *id));
        for id in gone {
            let sending = self.sending(id);
            self.sinks.remove(&id);
            if !sending {
                self.dests.remove(&id);
                self.cancel_engine(id);
                self.notify(ShardEvent::Finished { worker_id: self.worker_id, id });
            }
        }
        while let Some(id) = self.prefilled.pop() {
            self.start_transfer(id);
        }
        self.apply_actions();
        self.publish_events();
    }

    /// Whether a request's KV is being sent.
    fn sending(&self, id: RequestId) -> bool {
        self.pending.iter().any(|(p, _)| *p == id)
    }

    /// Cancels a request (the next step reports it), unless its KV is being sent: its
    /// blocks are read until the transfer ends, then it is released and nobody is told.
    fn cancel(&mut self, id: RequestId) {
        if self.sending(id) {
            self.sinks.remove(&id);
            return;
        }
        self.dests.remove(&id);
        self.cancel_engine(id);
    }

    /// Cancels a request in the engine, or, while tiers load its blocks, once they are done.
    fn cancel_engine(&mut self, id: RequestId) {
        match self.loading.get_mut(&id) {
            Some(l) => l.cancelled = true,
            None => {
                self.engine.cancel(id);
            }
        }
    }

    /// Starts sending a prefilled request's KV to the blocks its decode worker reserved.
    fn start_transfer(&mut self, id: RequestId) {
        let started = (|| {
            let dest = self.dests.remove(&id).ok_or("no destination for its KV")?;
            let kv = self.kv.clone().ok_or("this worker has no KV transfer link")?;
            let blocks = self.engine.blocks_of(id).ok_or("its blocks are gone")?;
            let src = blocks
                .get(dest.first_block..dest.first_block + dest.blocks.len())
                .ok_or("the decode worker reserved more blocks than the prompt has")?;
            let prefill_ms = self.engine.age(id).map_or(0.0, |d| d.as_secs_f32() * 1e3);
            kv.start(self.worker_id, src, &dest, prefill_ms).map_err(|e| {
                tracing::warn!(request = %id, error = %e, "KV transfer refused");
                "the KV transfer could not start"
            })
        })();
        match started {
            Ok(p) => {
                if let Some(sink) = self.sinks.get(&id) {
                    let _ = sink.send(Output::Kv(KvNote::Sending));
                }
                self.pending.push((id, p));
            }
            Err(why) => self.end_transfer(id, Err(why.to_string())),
        }
    }

    /// Ends the transfers that are done.
    fn poll_transfers(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            match self.pending[i].1.poll() {
                Some(r) => {
                    let (id, _) = self.pending.swap_remove(i);
                    self.end_transfer(id, r);
                }
                None => i += 1,
            }
        }
    }

    /// A prefill-only request is over: its blocks go back (to the prefix cache) and its
    /// stream ends with what the transfer did.
    fn end_transfer(&mut self, id: RequestId, r: Result<kvx_proto::KvTransfer, String>) {
        self.engine.release(id);
        if let Some(sink) = self.sinks.remove(&id) {
            let out = match r {
                Ok(t) => Output::Kv(KvNote::Sent(t)),
                Err(message) => Output::Error { class: ErrorClass::Unavailable, message },
            };
            let _ = sink.send(out);
        }
        self.notify(ShardEvent::Finished { worker_id: self.worker_id, id });
    }

    fn publish_events(&mut self) {
        let worker_id = self.worker_id;
        let next = &mut self.next_event;
        let tx = self.events.clone();
        let mut send = |tier: StorageTier, data: KvEventData| {
            let ev = KvEvent { worker_id, event_id: *next, tier, data };
            *next += 1;
            // A full queue drops the event; the consumer sees the id gap and resyncs.
            if let Some(tx) = &tx {
                let _ = tx.try_send(ShardEvent::Kv(ev));
            }
        };
        let (engine, tiers) = (&mut self.engine, &mut self.tiers);
        let mut offered: Vec<(u32, SequenceHash)> = Vec::new();
        engine.drain_block_events(|e| match e {
            BlockEvent::Stored { block, seq_hash, local_hash, parent } => {
                if let Some(t) = tiers.as_mut()
                    && t.offer(block, seq_hash, local_hash, parent)
                {
                    offered.push((block, seq_hash));
                }
                let blocks = vec![StoredBlock { seq_hash, local_hash }];
                send(StorageTier::Device, KvEventData::Stored { parent, blocks });
            }
            BlockEvent::Removed { seq_hash } => {
                send(StorageTier::Device, KvEventData::Removed { seq_hashes: vec![seq_hash] });
            }
        });
        let Some(t) = tiers.as_mut() else { return };
        // Offered blocks stay as they are until their copy is done (a block no longer
        // registered under its hash is not copied).
        for (b, h) in offered {
            if engine.block_hash(b) != Some(h) || !engine.pin_block(b) {
                t.withdraw(b);
            }
        }
        t.flush(&mut self.actions);
        t.drain_events(|e| match e {
            TierEvent::Stored { tier, parent, block } => {
                send(tier, KvEventData::Stored { parent, blocks: vec![block] });
            }
            TierEvent::Removed { tier, seq_hash } => {
                send(tier, KvEventData::Removed { seq_hashes: vec![seq_hash] });
            }
        });
        self.apply_actions();
    }

    /// Lifecycle notes must not be lost (the router's load accounting depends on them), so
    /// they block when the queue is full.
    fn notify(&self, e: ShardEvent) {
        notify(&self.events, e);
    }

    fn send_snapshot(&mut self) {
        self.publish_events();
        let blocks = self
            .engine
            .scheduler()
            .pool()
            .snapshot()
            .into_iter()
            .map(|(parent, seq_hash, local_hash)| (parent, StoredBlock { seq_hash, local_hash }))
            .collect();
        let lower = self.tiers.as_ref().map(Tiers::snapshot).unwrap_or_default();
        self.notify(ShardEvent::Snapshot {
            worker_id: self.worker_id,
            last_event_id: self.next_event - 1,
            blocks,
            lower,
        });
    }

    fn publish_status(&self) {
        let s = ShardStatus {
            load: self.engine.load(),
            stats: self.engine.stats(),
            requests: self.sinks.len(),
            tiers: self.tiers.as_ref().map(Tiers::metrics).unwrap_or_default(),
        };
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }
}

/// The tiers as the engine's admission sees them: probes find a prompt's blocks below the
/// pool, loads start at once (they overlap the step's forward pass) and are remembered with
/// the first block they fill, for [`Action::Loaded`].
struct TierHook<'a> {
    tiers: &'a mut Tiers,
    loading: &'a mut HashMap<RequestId, Loading>,
    actions: &'a mut Vec<Action>,
}

/// A request loading its prompt's prefix from the tiers.
#[derive(Debug, Clone, Copy)]
struct Loading {
    /// Its first block being loaded.
    first: usize,
    /// It was cancelled meanwhile: it ends once the load does (until then the mover may
    /// write into its blocks).
    cancelled: bool,
}

impl LowerTiers for TierHook<'_> {
    fn probe(&mut self, below: &[(LocalBlockHash, SequenceHash)]) -> usize {
        self.tiers.probe(below.iter().map(|b| b.1))
    }

    fn admitted(
        &mut self,
        id: RequestId,
        in_pool: &[(LocalBlockHash, SequenceHash)],
        below: &[(LocalBlockHash, SequenceHash)],
        first: usize,
        into: &[u32],
    ) {
        self.tiers.admitted(in_pool.iter().map(|b| b.1), below.iter().map(|b| b.1));
        if !into.is_empty() {
            self.loading.insert(id, Loading { first, cancelled: false });
            self.tiers.load(id, below.iter().map(|b| b.1), into, self.actions);
        }
    }
}

/// Sends a lifecycle note, blocking when the queue is full (notes must not be lost).
fn notify(events: &Option<SyncSender<ShardEvent>>, e: ShardEvent) {
    if let Some(tx) = events {
        let _ = tx.send(e);
    }
}
