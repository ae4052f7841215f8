//! The worker side of the remote planes: this process's shards joined to frontends over TCP
//! (see [`kvx_proto::plane`] for the messages), one connection per frontend.
//!
//! [`serve`] dials its frontend, or listens for any number of frontends (a static worker
//! list, or etcd discovery), registers every hosted shard as its own worker id on each
//! connection and then, until its [`Phase`] says stop:
//!
//! * runs the requests each frontend submits on their shard and streams each one's outputs
//!   back to it (one small forwarding task per request; each socket's outgoing queue is
//!   bounded, so a slow frontend slows its forwarders rather than growing memory);
//! * relays the shards' [`ShardEvent`]s to every session: KV events in batches (dropped when a
//!   session's queue is full: its frontend sees the event-id gap and asks for a snapshot),
//!   first-token and finished notes, snapshots;
//! * sends each shard's load when it changes (at most every `load_interval`) and a heartbeat
//!   every `heartbeat`, and declares a frontend dead after `heartbeat_timeout` of silence.
//!
//! When a connection is lost, the requests it carried are cancelled (their forwarders drop
//! their output channels, which the shards notice at their next step); a dialling worker
//! reconnects with exponential backoff and registers again, and the frontend then asks each
//! shard for a snapshot of its cached blocks. Draining refuses new requests (their frontend
//! places them elsewhere) and ends once nothing runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvx_proto::plane::{
    Cancel, Heartbeat, KvEvents, KvPeer, KvReady, Load, Note, NoteKind, OutputMsg, Peers, Register,
    Registered, Snapshot, SnapshotRequest, Submit, WorkerRole, kind,
};
use kvx_proto::wire::{self, WireError};
use kvx_proto::{ErrorClass, KvEvent, KvNote, Output, RequestId, WorkerId, WorkerMetrics};
use kvx_trust::{ClusterAuth, HandshakeError, PlaneStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

use crate::kvlink::KvLink;
use crate::setup::Started;
use crate::shard::{Command, ShardEvent, ShardHandle, SubmitError};

/// How the worker meets its frontend.
#[derive(Debug)]
pub enum Link {
    /// Dial the frontend's worker address (`host:port`), again after every loss.
    Connect(String),
    /// Wait for the frontend to dial this listener (a static worker list), again after
    /// every loss.
    Listen(tokio::net::TcpListener),
}

/// Why a connection to the frontend did not open.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    #[error("cannot reach the frontend: {0}")]
    Io(#[from] std::io::Error),
    #[error("the cluster handshake failed: {0}")]
    Handshake(#[from] HandshakeError),
}

impl Link {
    /// The next connection, once its peer proved membership of the cluster.
    async fn open(&self, auth: &ClusterAuth) -> Result<PlaneStream, OpenError> {
        Ok(match self {
            Link::Connect(addr) => auth.connect(TcpStream::connect(addr).await?, addr).await?,
            Link::Listen(l) => auth.accept(l.accept().await?.0).await?,
        })
    }

    fn describe(&self) -> String {
        match self {
            Link::Connect(addr) => addr.clone(),
            Link::Listen(l) => {
                l.local_addr().map_or_else(|_| "a listener".into(), |a| format!("listener {a}"))
            }
        }
    }
}

/// Settings of the remote planes, worker side.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// The served model's name, as the frontend knows it.
    pub model: String,
    /// The arithmetic the model engines compute in and their kernel level
    /// (`split-kv-half/avx512/free-attention`; empty for mock engines).
    pub arith: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// A frontend silent this long is dead.
    pub heartbeat_timeout: Duration,
    /// Load reports per shard at most this often (and at least every second).
    pub load_interval: Duration,
    /// First reconnection delay (doubled up to `reconnect_max`).
    pub reconnect_min: Duration,
    /// Longest reconnection delay.
    pub reconnect_max: Duration,
    /// Largest frame accepted.
    pub max_frame: usize,
    /// Outputs queued for the socket at most.
    pub output_queue: usize,
    /// Shard events queued for the socket at most.
    pub event_queue: usize,
    /// Give token deltas without text a synthetic text (` t<id>` per token): for
    /// tokenizer-free mock engines, whose clients still want to see something arrive.
    pub synthetic_text: bool,
    /// How frontend connections prove their membership of the cluster (both directions).
    pub auth: ClusterAuth,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            model: String::new(),
            arith: String::new(),
            block_size: 16,
            heartbeat: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            load_interval: Duration::from_millis(100),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(2),
            max_frame: wire::MAX_FRAME,
            output_queue: 4096,
            event_queue: 1 << 16,
            synthetic_text: false,
            auth: ClusterAuth::Open,
        }
    }
}

/// A shard served to the frontend.
#[derive(Debug)]
pub struct Hosted {
    /// Its worker id (the engine's).
    pub worker_id: WorkerId,
    /// KV blocks of its pool.
    pub kv_blocks: usize,
    /// Requests it runs at once at most.
    pub max_num_seqs: usize,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
    /// Where peers write its KV (prefill and decode engines).
    pub kv_peer: Option<KvPeer>,
    /// The shard.
    pub shard: ShardHandle,
}

/// Why the worker stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// Nothing to serve.
    #[error("no shard to serve")]
    NoShards,
    /// The frontend refused a shard (another model or block size, or a taken id).
    #[error("the frontend refused worker {worker}: {reason}")]
    Rejected {
        /// The worker.
        worker: WorkerId,
        /// The frontend's reason.
        reason: String,
    },
    /// The events thread could not start.
    #[error("starting the events thread: {0}")]
    Thread(std::io::Error),
}

struct Ctx {
    cfg: RemoteConfig,
    shards: Vec<Hosted>,
    by_id: HashMap<WorkerId, usize>,
    kv: Option<Arc<KvLink>>,
    /// Requests being forwarded (all sessions).
    inflight: AtomicUsize,
    /// Sessions that want shard events.
    subscribers: std::sync::Mutex<Vec<(u64, mpsc::Sender<ShardEvent>)>>,
    next_session: AtomicU64,
    phase: watch::Receiver<Phase>,
    /// Peers refused at the cluster handshake (each address logged once).
    refused: kvx_trust::RefusalLog,
}

impl Ctx {
    fn shard(&self, w: WorkerId) -> Option<&ShardHandle> {
        self.by_id.get(&w).map(|&i| &self.shards[i].shard)
    }

    /// A session's own stream of shard events.
    fn subscribe(&self) -> (u64, mpsc::Receiver<ShardEvent>) {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.cfg.event_queue.max(1));
        self.subs().push((id, tx));
        (id, rx)
    }

    fn unsubscribe(&self, id: u64) {
        self.subs().retain(|(s, _)| *s != id);
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, Vec<(u64, mpsc::Sender<ShardEvent>)>> {
        self.subscribers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn draining(&self) -> bool {
        *self.phase.borrow() != Phase::Serving
    }
}

/// What a worker process is doing, as its owner says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Taking and running requests.
    Serving,
    /// Running what it has, taking nothing new (refused requests are placed elsewhere by
    /// their frontend); [`serve`] returns when nothing runs.
    Draining,
    /// Stopping now: sessions end (their frontends migrate what still runs).
    Stopping,
}

/// How a session ended.
enum End {
    Shutdown,
    ShardsStopped,
    Lost(String),
    /// A connection whose peer did not prove its membership of the cluster.
    Refused(String),
    Rejected {
        worker: WorkerId,
        reason: String,
    },
}

/// Serves the `started` shards to the frontends met through `link` until `phase` says
/// stop (or drain, once nothing runs), or every shard stops. With [`Link::Listen`] any
/// number of frontends may connect at once: each gets every shard registered, its own copy
/// of the KV events (so each keeps its own index), and the outputs of the requests it sent.
/// Returns the shards so the caller can shut them down.
pub async fn serve(
    cfg: RemoteConfig,
    started: Started,
    link: Link,
    phase: watch::Receiver<Phase>,
) -> (Vec<Hosted>, Result<(), RemoteError>) {
    let Started { shards, events, kv } = started;
    if shards.is_empty() {
        return (shards, Err(RemoteError::NoShards));
    }
    let (ev_tx, ev_rx) = mpsc::channel(cfg.event_queue.max(1));
    if let Err(e) = std::thread::Builder::new()
        .name("kvx-plane-events".into())
        .spawn(move || pump(events, ev_tx))
    {
        return (shards, Err(RemoteError::Thread(e)));
    }
    let by_id = shards.iter().enumerate().map(|(i, h)| (h.worker_id, i)).collect();
    let ctx = Arc::new(Ctx {
        cfg,
        shards,
        by_id,
        kv,
        inflight: AtomicUsize::new(0),
        subscribers: std::sync::Mutex::new(Vec::new()),
        next_session: AtomicU64::new(1),
        phase,
        refused: kvx_trust::RefusalLog::default(),
    });
    let hub = tokio::spawn(fan_out(ctx.clone(), ev_rx));
    let (end_tx, end_rx) = watch::channel(false);
    let result = match &link {
        Link::Connect(_) => dial(&ctx, &link, end_rx, &hub).await,
        Link::Listen(l) => listen(&ctx, l, end_rx).await,
    };
    let _ = end_tx.send(true);
    hub.abort();
    let shards = match Arc::try_unwrap(ctx) {
        Ok(ctx) => ctx.shards,
        Err(ctx) => {
            // Forwarding tasks still hold the context; they end once their channels close.
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut ctx = ctx;
            loop {
                match Arc::try_unwrap(ctx) {
                    Ok(c) => break c.shards,
                    Err(c) if Instant::now() < deadline => {
                        ctx = c;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(_) => break Vec::new(),
                }
            }
        }
    };
    (shards, result)
}

/// Copies every shard event to every session (KV events to a full session are dropped:
/// its frontend sees the id gap and asks for a snapshot). Ends when the shards stop.
async fn fan_out(ctx: Arc<Ctx>, mut ev_rx: mpsc::Receiver<ShardEvent>) {
    while let Some(e) = ev_rx.recv().await {
        let subs: Vec<mpsc::Sender<ShardEvent>> =
            ctx.subs().iter().map(|(_, t)| t.clone()).collect();
        for tx in subs {
            let _ = tx.try_send(e.clone());
        }
    }
    ctx.subs().clear();
}

/// When the worker should stop: told to, or draining with nothing left to run.
async fn should_end(ctx: &Ctx, end: &mut watch::Receiver<bool>) {
    let mut phase = ctx.phase.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        let p = *phase.borrow();
        if *end.borrow()
            || p == Phase::Stopping
            || (p == Phase::Draining && ctx.inflight.load(Ordering::SeqCst) == 0)
        {
            return;
        }
        tokio::select! {
            _ = phase.changed() => {}
            _ = end.changed() => {}
            _ = tick.tick() => {}
        }
    }
}

/// One frontend at a time, dialled again after every loss.
async fn dial(
    ctx: &Arc<Ctx>,
    link: &Link,
    mut end: watch::Receiver<bool>,
    hub: &tokio::task::JoinHandle<()>,
) -> Result<(), RemoteError> {
    let cfg = &ctx.cfg;
    let mut backoff = cfg.reconnect_min;
    let mut warned = false;
    loop {
        let conn = tokio::select! {
            _ = should_end(ctx, &mut end) => return Ok(()),
            c = link.open(&cfg.auth) => c,
        };
        match conn {
            Ok(stream) => {
                backoff = cfg.reconnect_min;
                warned = false;
                tracing::info!(frontend = %link.describe(), workers = ctx.shards.len(), "connected");
                match session(ctx.clone(), stream, end.clone()).await {
                    End::Shutdown => return Ok(()),
                    End::ShardsStopped => {
                        tracing::warn!("every shard has stopped");
                        return Ok(());
                    }
                    End::Rejected { worker, reason } => {
                        return Err(RemoteError::Rejected { worker, reason });
                    }
                    End::Lost(why) | End::Refused(why) => {
                        tracing::warn!(frontend = %link.describe(), reason = %why, "connection lost");
                    }
                }
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(frontend = %link.describe(), error = %e, "no connection to the frontend; retrying");
                    warned = true;
                }
            }
        }
        if hub.is_finished() {
            return Ok(());
        }
        // Wait out the backoff (the frontend asks for snapshots when the shards register
        // again).
        tokio::select! {
            _ = should_end(ctx, &mut end) => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(cfg.reconnect_max);
    }
}

/// Every frontend that connects, at once.
async fn listen(
    ctx: &Arc<Ctx>,
    l: &tokio::net::TcpListener,
    mut end: watch::Receiver<bool>,
) -> Result<(), RemoteError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut sessions = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = should_end(ctx, &mut end) => break,
            a = l.accept() => match a {
                Ok((stream, peer)) => {
                    let (ctx, stop) = (ctx.clone(), stop_rx.clone());
                    sessions.spawn(async move {
                        let stream = match ctx.cfg.auth.accept(stream).await {
                            Ok(s) => s,
                            Err(e) => return (peer, End::Refused(e.to_string())),
                        };
                        tracing::info!(frontend = %peer, workers = ctx.shards.len(), "frontend connected");
                        let end = session(ctx, stream, stop).await;
                        (peer, end)
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a frontend");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(done) = sessions.join_next() => match done {
                Ok((peer, End::Lost(why))) => tracing::warn!(frontend = %peer, reason = %why, "connection lost"),
                Ok((peer, End::Refused(why))) => {
                    if ctx.refused.first(peer.ip()) {
                        tracing::warn!(peer = %peer, reason = %why, "refused a connection (further refusals of this address are not logged)");
                    }
                }
                Ok((peer, End::Rejected { worker, reason })) => {
                    tracing::warn!(frontend = %peer, worker, %reason, "a frontend refused this worker");
                }
                Ok((_, End::ShardsStopped)) => {
                    tracing::warn!("every shard has stopped");
                    break;
                }
                Ok((_, End::Shutdown)) | Err(_) => {}
            },
        }
    }
    let _ = stop_tx.send(true);
    while sessions.join_next().await.is_some() {}
    Ok(())
}

/// Relays shard events into the async side: KV events are dropped when the queue is full,
/// notes and snapshots wait (they must not be lost).
fn pump(events: std::sync::mpsc::Receiver<ShardEvent>, tx: mpsc::Sender<ShardEvent>) {
    while let Ok(e) = events.recv() {
        let ok = match e {
            ShardEvent::Kv(_) => {
                !matches!(tx.try_send(e), Err(mpsc::error::TrySendError::Closed(_)))
            }
            other => tx.blocking_send(other).is_ok(),
        };
        if !ok {
            return;
        }
    }
}

/// A message for the socket from a request's forwarding task.
struct Up(RequestId, Output);

/// Frames are written once this many bytes are buffered, or when nothing else is waiting.
const WRITE_BATCH: usize = 256 << 10;
/// KV events per frame at most.
const KV_BATCH: usize = 512;

async fn session(ctx: Arc<Ctx>, stream: PlaneStream, mut stop: watch::Receiver<bool>) -> End {
    let (sub, mut ev_rx) = ctx.subscribe();
    let end = session_loop(&ctx, stream, &mut ev_rx, &mut stop).await;
    ctx.unsubscribe(sub);
    end
}

async fn session_loop(
    ctx: &Arc<Ctx>,
    stream: PlaneStream,
    ev_rx: &mut mpsc::Receiver<ShardEvent>,
    stop: &mut watch::Receiver<bool>,
) -> End {
    let cfg = &ctx.cfg;
    let (rd, mut wr) = tokio::io::split(stream);
    let (up_tx, mut up_rx) = mpsc::channel::<Up>(cfg.output_queue.max(1));
    let epoch = Instant::now();
    let last_rx = Arc::new(AtomicU64::new(0));
    let mut reader = tokio::spawn(read_loop(ctx.clone(), rd, up_tx, last_rx.clone(), epoch));

    let mut buf = Vec::with_capacity(64 << 10);
    for h in &ctx.shards {
        let reg = Register {
            worker_id: h.worker_id,
            model: cfg.model.clone(),
            block_size: cfg.block_size,
            kv_blocks: h.kv_blocks,
            max_num_seqs: h.max_num_seqs,
            role: h.role,
            kv_peer: h.kv_peer.clone(),
            arith: cfg.arith.clone(),
        };
        put(kind::REGISTER, &reg, &mut buf);
    }
    let mut hb = tokio::time::interval(cfg.heartbeat);
    hb.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut load_tick = tokio::time::interval(cfg.load_interval);
    load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent_loads: Vec<Option<(WorkerMetrics, bool, Instant)>> = vec![None; ctx.shards.len()];
    let mut kv: Vec<KvEvent> = Vec::new();
    let mut hb_seq = 0u64;
    let end = loop {
        if !buf.is_empty() {
            if let Err(e) = async {
                wr.write_all(&buf).await?;
                wr.flush().await
            }
            .await
            {
                break End::Lost(format!("writing: {e}"));
            }
            buf.clear();
        }
        tokio::select! {
            r = &mut reader => break r.unwrap_or_else(|e| End::Lost(format!("reader: {e}"))),
            _ = stop.wait_for(|s| *s) => break End::Shutdown,
            _ = should_stop(ctx) => break End::Shutdown,
            Some(Up(id, output)) = up_rx.recv() => put(kind::OUTPUT, &OutputMsg { id, output }, &mut buf),
            e = ev_rx.recv() => match e {
                Some(e) => event(e, &mut kv, &mut buf),
                None => break End::ShardsStopped,
            },
            _ = hb.tick() => {
                let silent = epoch.elapsed().saturating_sub(Duration::from_millis(last_rx.load(Ordering::Relaxed)));
                if silent > cfg.heartbeat_timeout {
                    break End::Lost(format!("no word from the frontend for {silent:?}"));
                }
                hb_seq += 1;
                put(kind::HEARTBEAT, &Heartbeat { seq: hb_seq }, &mut buf);
            }
            _ = load_tick.tick() => loads(ctx, &mut sent_loads, &mut buf),
        }
        // Take what is already waiting, up to a batch.
        while buf.len() < WRITE_BATCH {
            match up_rx.try_recv() {
                Ok(Up(id, output)) => put(kind::OUTPUT, &OutputMsg { id, output }, &mut buf),
                Err(_) => break,
            }
        }
        while buf.len() < WRITE_BATCH {
            match ev_rx.try_recv() {
                Ok(e) => event(e, &mut kv, &mut buf),
                Err(_) => break,
            }
        }
        flush_kv(&mut kv, &mut buf);
    };
    reader.abort();
    end
}

/// Completes when the owner says stop, or the worker drains with nothing left to run (its
/// session ends and the frontend drops it).
async fn should_stop(ctx: &Ctx) {
    let mut phase = ctx.phase.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        let p = *phase.borrow();
        if p == Phase::Stopping
            || (p == Phase::Draining && ctx.inflight.load(Ordering::SeqCst) == 0)
        {
            return;
        }
        tokio::select! {
            r = phase.changed() => if r.is_err() { return },
            _ = tick.tick() => {}
        }
    }
}

fn put<T: serde::Serialize>(k: u8, msg: &T, buf: &mut Vec<u8>) {
    if let Err(e) = wire::encode(k, msg, buf) {
        tracing::error!(kind = k, error = %e, "encoding a frame");
    }
}

fn flush_kv(kv: &mut Vec<KvEvent>, buf: &mut Vec<u8>) {
    if !kv.is_empty() {
        put(kind::KV_EVENTS, &KvEvents { events: std::mem::take(kv) }, buf);
    }
}

fn event(e: ShardEvent, kv: &mut Vec<KvEvent>, buf: &mut Vec<u8>) {
    match e {
        ShardEvent::Kv(ev) => {
            kv.push(ev);
            if kv.len() >= KV_BATCH {
                flush_kv(kv, buf);
            }
        }
        ShardEvent::FirstToken { worker_id, id } => {
            flush_kv(kv, buf);
            put(kind::NOTE, &Note { worker_id, id, note: NoteKind::FirstToken }, buf);
        }
        ShardEvent::Finished { worker_id, id } => {
            flush_kv(kv, buf);
            put(kind::NOTE, &Note { worker_id, id, note: NoteKind::Finished }, buf);
        }
        ShardEvent::Snapshot { worker_id, last_event_id, blocks, lower } => {
            flush_kv(kv, buf);
            put(kind::SNAPSHOT, &Snapshot { worker_id, last_event_id, blocks, lower }, buf);
        }
    }
}

/// Each shard's load when it changed, the worker began draining, or a second passed.
fn loads(ctx: &Ctx, sent: &mut [Option<(WorkerMetrics, bool, Instant)>], buf: &mut Vec<u8>) {
    let now = Instant::now();
    let draining = ctx.draining();
    for (h, last) in ctx.shards.iter().zip(sent.iter_mut()) {
        let m = h.shard.status().metrics();
        let due = match last {
            Some((prev, was, at)) => {
                *prev != m || *was != draining || now.duration_since(*at) >= Duration::from_secs(1)
            }
            None => true,
        };
        if due {
            put(kind::LOAD, &Load { metrics: m, draining }, buf);
            *last = Some((m, draining, now));
        }
    }
}

async fn read_loop(
    ctx: Arc<Ctx>,
    mut rd: ReadHalf<PlaneStream>,
    up: mpsc::Sender<Up>,
    last_rx: Arc<AtomicU64>,
    epoch: Instant,
) -> End {
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    loop {
        buf.reserve(64 << 10);
        match rd.read_buf(&mut buf).await {
            Ok(0) => return End::Lost("closed by the frontend".into()),
            Ok(_) => {}
            Err(e) => return End::Lost(format!("reading: {e}")),
        }
        last_rx.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut off = 0;
        loop {
            match wire::split(&buf[off..], ctx.cfg.max_frame) {
                Ok((k, payload, used)) => {
                    if let Err(end) = handle(&ctx, k, payload, &up).await {
                        return end;
                    }
                    off += used;
                }
                Err(WireError::Incomplete) => break,
                Err(e) => return End::Lost(format!("bad frame from the frontend: {e}")),
            }
        }
        buf.drain(..off);
    }
}

fn bad(k: u8, e: WireError) -> End {
    End::Lost(format!("malformed frame of kind {k} from the frontend: {e}"))
}

async fn handle(ctx: &Arc<Ctx>, k: u8, payload: &[u8], up: &mpsc::Sender<Up>) -> Result<(), End> {
    match k {
        kind::SUBMIT => {
            let s: Submit = wire::decode(payload).map_err(|e| bad(k, e))?;
            let id = s.request.id;
            let refused = match ctx.shard(s.worker_id) {
                None => Some((ErrorClass::Unavailable, format!("no worker {} here", s.worker_id))),
                Some(_) if ctx.draining() => {
                    Some((ErrorClass::Unavailable, "the worker is draining".to_string()))
                }
                Some(shard) => {
                    let (tx, rx) = crate::shard::output_channel();
                    match shard.submit(s.request, tx) {
                        Ok(()) => {
                            ctx.inflight.fetch_add(1, Ordering::SeqCst);
                            let (c, up) = (ctx.clone(), up.clone());
                            tokio::spawn(async move {
                                forward(id, rx, up, c.cfg.synthetic_text).await;
                                c.inflight.fetch_sub(1, Ordering::SeqCst);
                            });
                            None
                        }
                        Err(SubmitError::Full) => {
                            Some((ErrorClass::Overloaded, SubmitError::Full.to_string()))
                        }
                        Err(SubmitError::Closed) => {
                            Some((ErrorClass::Unavailable, SubmitError::Closed.to_string()))
                        }
                    }
                }
            };
            if let Some((class, message)) = refused {
                let _ = up.send(Up(id, Output::Error { class, message })).await;
            }
        }
        kind::CANCEL => {
            let c: Cancel = wire::decode(payload).map_err(|e| bad(k, e))?;
            if let Some(shard) = ctx.shard(c.worker_id) {
                shard.cancel(c.id);
            }
        }
        kind::SNAPSHOT_REQUEST => {
            let r: SnapshotRequest = wire::decode(payload).map_err(|e| bad(k, e))?;
            if let Some(shard) = ctx.shard(r.worker_id) {
                shard.send(Command::Snapshot);
            }
        }
        kind::REGISTERED => {
            let r: Registered = wire::decode(payload).map_err(|e| bad(k, e))?;
            if !r.accepted {
                return Err(End::Rejected { worker: r.worker_id, reason: r.reason });
            }
            tracing::debug!(worker = r.worker_id, "registered");
        }
        kind::PEERS => {
            let p: Peers = wire::decode(payload).map_err(|e| bad(k, e))?;
            match &ctx.kv {
                Some(kv) => {
                    if let Err(e) = kv.add_peers(&p.peers) {
                        tracing::warn!(error = %e, "the frontend's KV peers cannot be used");
                    }
                }
                None => tracing::debug!("KV peers for a worker without prefill engines"),
            }
        }
        kind::KV_READY => {
            let r: KvReady = wire::decode(payload).map_err(|e| bad(k, e))?;
            if let Some(shard) = ctx.shard(r.worker_id) {
                shard.send(Command::KvReady(r.id, r.arrived));
            }
        }
        kind::HEARTBEAT => {}
        other => tracing::debug!(kind = other, "skipping a frame of an unknown kind"),
    }
    Ok(())
}

/// Streams one request's outputs to the socket until its last one (or until the session
/// ends, which drops the receiver and so cancels the request in its shard).
async fn forward(
    id: RequestId,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Output>,
    up: mpsc::Sender<Up>,
    synthetic_text: bool,
) {
    loop {
        let out = tokio::select! {
            o = rx.recv() => o,
            _ = up.closed() => return,
        };
        let Some(mut out) = out else {
            let out = Output::Error {
                class: ErrorClass::Internal,
                message: "the engine stopped without finishing the request".into(),
            };
            let _ = up.send(Up(id, out)).await;
            return;
        };
        let last = matches!(
            out,
            Output::Finished { .. } | Output::Error { .. } | Output::Kv(KvNote::Sent(_))
        );
        if synthetic_text && let Output::Delta(d) = &mut out {
            synthesize_text(d);
        }
        if up.send(Up(id, out)).await.is_err() || last {
            return;
        }
    }
}

/// ` t<id>` per token for a delta that has tokens but no text.
fn synthesize_text(d: &mut kvx_proto::OutputDelta) {
    if d.text.is_empty() {
        use std::fmt::Write;
        for t in &d.tokens {
            let _ = write!(d.text, " t{t}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_text_fills_only_empty_deltas() {
        let mut d = kvx_proto::OutputDelta { tokens: vec![3, 14], ..Default::default() };
        synthesize_text(&mut d);
        assert_eq!(d.text, " t3 t14");
        let mut d =
            kvx_proto::OutputDelta { tokens: vec![3], text: "x".into(), ..Default::default() };
        synthesize_text(&mut d);
        assert_eq!(d.text, "x");
    }
}
