//! The remote plane over loopback: real worker sessions (`kvx_worker::remote::serve` over
//! mock engines) and scripted workers that speak the wire protocol frame by frame, to make
//! a worker refuse, stall, break or disappear at a chosen moment.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{BS, End, collect, mock_shards, request, wait_for};
use kvx_ingress::{DispatchError, Dispatcher};
use kvx_planes::{DisaggConfig, RemotePlane, RemotePlaneConfig};
use kvx_proto::plane::{
    Cancel, KvReady, OutputMsg, Register, Registered, Submit, WorkerRole, kind,
};
use kvx_proto::wire::{self, WireError};
use kvx_proto::{ErrorClass, FinishReason, Output, OutputDelta, RequestId, WorkerId};
use kvx_router::RouterConfig;
use kvx_worker::remote::{Link, Phase, RemoteError};
use kvx_worker::{Hosted, RemoteConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const MODEL: &str = "test-model";
const LONG: Duration = Duration::from_secs(20);

/// A plane on an ephemeral loopback port; returns it and the address workers join at.
async fn plane(heartbeat_timeout: Duration) -> (Arc<RemotePlane>, String) {
    plane_with(heartbeat_timeout, DisaggConfig::default()).await
}

async fn plane_with(
    heartbeat_timeout: Duration,
    disagg: DisaggConfig,
) -> (Arc<RemotePlane>, String) {
    plane_cfg(heartbeat_timeout, disagg, RemotePlaneConfig::default().migration_limit).await
}

async fn plane_cfg(
    heartbeat_timeout: Duration,
    disagg: DisaggConfig,
    migration_limit: u32,
) -> (Arc<RemotePlane>, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let cfg = RemotePlaneConfig {
        model: MODEL.into(),
        heartbeat: Duration::from_millis(50),
        heartbeat_timeout,
        migration_limit,
        ..RemotePlaneConfig::default()
    };
    let router = RouterConfig { block_size: BS, ..RouterConfig::default() };
    (RemotePlane::with_disagg(cfg, router, disagg, l).expect("plane"), addr)
}

fn metric(p: &RemotePlane, name: &str) -> f64 {
    p.router_metrics().into_iter().find(|(k, _)| *k == name).map_or(f64::NAN, |(_, v)| v)
}

fn worker_cfg(block_size: usize) -> RemoteConfig {
    RemoteConfig {
        model: MODEL.into(),
        block_size,
        heartbeat: Duration::from_millis(50),
        heartbeat_timeout: Duration::from_secs(2),
        synthetic_text: true,
        ..RemoteConfig::default()
    }
}

/// A worker process: `n` mock engines numbered from `first`, served over `link`.
struct RealWorker {
    stop: watch::Sender<Phase>,
    task: JoinHandle<(Vec<Hosted>, Result<(), RemoteError>)>,
}

impl RealWorker {
    fn start(link: Link, n: usize, first: WorkerId, block_size: usize) -> RealWorker {
        let started = mock_shards(n, first, 100.0);
        let (stop, rx) = watch::channel(Phase::Serving);
        let task =
            tokio::spawn(kvx_worker::remote::serve(worker_cfg(block_size), started, link, rx));
        RealWorker { stop, task }
    }

    fn join(addr: &str, n: usize, first: WorkerId) -> RealWorker {
        RealWorker::start(Link::Connect(addr.to_string()), n, first, BS)
    }

    /// Mock engines of one role, joining the plane at `addr`.
    fn with_role(addr: &str, role: WorkerRole, first: WorkerId) -> RealWorker {
        let started = common::mock_roles(&[role], first, 100.0);
        let (stop, rx) = watch::channel(Phase::Serving);
        let link = Link::Connect(addr.to_string());
        let task = tokio::spawn(kvx_worker::remote::serve(worker_cfg(BS), started, link, rx));
        RealWorker { stop, task }
    }

    async fn stop(self) -> Result<(), RemoteError> {
        let _ = self.stop.send(Phase::Stopping);
        let (shards, r) = self.task.await.expect("worker task");
        for h in shards {
            h.shard.shutdown(Duration::ZERO);
        }
        r
    }
}

/// A worker that speaks the protocol frame by frame.
struct Scripted {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Scripted {
    /// Connects and registers `worker`.
    async fn join(addr: &str, worker: WorkerId) -> Scripted {
        Scripted::join_as(addr, worker, WorkerRole::Agg).await
    }

    /// Connects and registers `worker` in `role`.
    async fn join_as(addr: &str, worker: WorkerId, role: WorkerRole) -> Scripted {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let mut s = Scripted { stream, buf: Vec::new() };
        let reg = Register {
            worker_id: worker,
            model: MODEL.into(),
            block_size: BS,
            kv_blocks: 1024,
            max_num_seqs: 64,
            role,
            kv_peer: None,
            arith: String::new(),
        };
        s.send(kind::REGISTER, &reg).await;
        let r: Registered = s.expect(kind::REGISTERED).await;
        assert!(r.accepted, "{}", r.reason);
        s
    }

    async fn send<T: serde::Serialize>(&mut self, k: u8, msg: &T) {
        let mut out = Vec::new();
        wire::encode(k, msg, &mut out).expect("encode");
        self.stream.write_all(&out).await.expect("write");
    }

    /// The next frame of kind `k`, skipping heartbeats, snapshot requests and KV peers.
    async fn expect<T: serde::de::DeserializeOwned>(&mut self, k: u8) -> T {
        loop {
            match wire::split(&self.buf, wire::MAX_FRAME) {
                Ok((got, payload, used)) => {
                    let payload = payload.to_vec();
                    self.buf.drain(..used);
                    if got == k {
                        return wire::decode(&payload).expect("decode");
                    }
                    assert!(
                        matches!(got, kind::HEARTBEAT | kind::SNAPSHOT_REQUEST | kind::PEERS),
                        "unexpected frame kind {got} while waiting for {k}"
                    );
                }
                Err(WireError::Incomplete) => {
                    let mut chunk = [0u8; 4096];
                    let n = tokio::time::timeout(LONG, self.stream.read(&mut chunk))
                        .await
                        .expect("a frame in time")
                        .expect("read");
                    assert!(n > 0, "the frontend closed the connection");
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                Err(e) => panic!("bad frame from the frontend: {e}"),
            }
        }
    }

    async fn output(&mut self, id: RequestId, output: Output) {
        self.send(kind::OUTPUT, &OutputMsg { id, output }).await;
    }
}

fn delta(t: u32) -> Output {
    Output::Delta(OutputDelta { tokens: vec![t], text: format!(" t{t}"), ..Default::default() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_and_serve_requests() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let w = RealWorker::join(&addr, 2, 100);
    wait_for("two workers", || p.workers().len() == 2).await;
    assert!(p.ready());
    for id in 1..=4 {
        let mut rx = p.submit(request(id, id as u32, 40, 6)).expect("submit");
        let (tokens, end) = collect(&mut rx, LONG).await;
        assert_eq!((tokens.len(), end), (6, End::Finished(FinishReason::Length)));
    }
    // Loads reach the plane; the router frees every finished request.
    wait_for("the workers' counters", || {
        p.workers().iter().map(|w| w.metrics.finished).sum::<u64>() == 4
    })
    .await;
    w.stop().await.expect("clean stop");
    wait_for("the workers to leave", || p.workers().is_empty()).await;
    assert!(matches!(p.submit(request(9, 0, 8, 1)), Err(DispatchError::Unavailable(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_leaves_routing_and_its_requests_go_elsewhere() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let a = RealWorker::join(&addr, 1, 100);
    let b = RealWorker::join(&addr, 1, 200);
    wait_for("two workers", || p.workers().len() == 2).await;
    // Worker 100 drains (as on SIGTERM): its load says so and the frontend stops routing to
    // it; with nothing to run it then leaves.
    let _ = a.stop.send(Phase::Draining);
    wait_for("worker 100 out of routing", || !p.workers().iter().any(|w| w.id == 100 && w.alive))
        .await;
    for id in 1..=12 {
        let mut rx = p.submit(request(id, id as u32, 40, 3)).expect("submit");
        let (tokens, end) = collect(&mut rx, LONG).await;
        assert_eq!((tokens.len(), end), (3, End::Finished(FinishReason::Length)), "request {id}");
    }
    let placed_again = metric(&p, "plane_requests_placed_again_total");
    assert_eq!(placed_again, 0.0, "no request was sent to the draining worker");
    let finished =
        |w: u64| p.workers().iter().find(|x| x.id == w).map_or(0, |x| x.metrics.finished);
    wait_for("worker 200's counters", || finished(200) == 12).await;
    assert_eq!(finished(100), 0);
    a.stop().await.expect("stop");
    b.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_another_block_size_model_or_arithmetic_is_refused() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let w = RealWorker::start(Link::Connect(addr.clone()), 1, 7, 2 * BS);
    match w.task.await.expect("task").1 {
        Err(RemoteError::Rejected { worker: 7, reason }) => {
            assert!(reason.contains("blocks of 16 tokens, not 32"), "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let mut s =
        Scripted { stream: TcpStream::connect(&addr).await.expect("connect"), buf: Vec::new() };
    let reg = Register {
        worker_id: 8,
        model: "other".into(),
        block_size: BS,
        kv_blocks: 1,
        max_num_seqs: 1,
        role: Default::default(),
        kv_peer: None,
        arith: String::new(),
    };
    s.send(kind::REGISTER, &reg).await;
    let r: Registered = s.expect(kind::REGISTERED).await;
    assert!(!r.accepted && r.reason.contains("\"other\""), "{}", r.reason);
    assert!(p.workers().is_empty() && !p.ready());

    // One fleet computes in one arithmetic: a worker in `split` joins, one in `exact` is
    // refused while it is there, and joins once it has gone.
    let register = |worker_id, arith: &str| Register {
        worker_id,
        model: MODEL.into(),
        block_size: BS,
        kv_blocks: 64,
        max_num_seqs: 4,
        role: Default::default(),
        kv_peer: None,
        arith: arith.into(),
    };
    let connect = || async {
        Scripted { stream: TcpStream::connect(&addr).await.expect("connect"), buf: Vec::new() }
    };
    let mut split = connect().await;
    split.send(kind::REGISTER, &register(9, "split/avx512")).await;
    let r: Registered = split.expect(kind::REGISTERED).await;
    assert!(r.accepted, "{}", r.reason);
    let mut exact = connect().await;
    exact.send(kind::REGISTER, &register(10, "exact/avx512")).await;
    let r: Registered = exact.expect(kind::REGISTERED).await;
    assert!(!r.accepted && r.reason.contains("split/avx512, not exact/avx512"), "{}", r.reason);
    drop(split);
    wait_for("the split worker to leave", || p.workers().is_empty()).await;
    let mut exact = connect().await;
    exact.send(kind::REGISTER, &register(10, "exact/avx512")).await;
    let r: Registered = exact.expect(kind::REGISTERED).await;
    assert!(r.accepted, "{}", r.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstarted_request_moves_when_its_worker_disappears() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut stall = Scripted::join(&addr, 1).await;
    wait_for("the scripted worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(1, 3, 40, 5)).expect("submit");
    let s: Submit = stall.expect(kind::SUBMIT).await;
    assert_eq!((s.worker_id, s.request.id), (1, RequestId(1)));
    let w = RealWorker::join(&addr, 1, 50);
    wait_for("the real worker", || p.workers().len() == 2).await;
    drop(stall); // the worker dies before its first token
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!((tokens.len(), end), (5, End::Finished(FinishReason::Length)));
    let m = p.router_metrics();
    let get = |k: &str| m.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    assert_eq!(get("plane_requests_placed_again_total"), Some(1.0));
    assert_eq!(get("plane_workers_lost_total"), Some(1.0));
    w.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_migration_a_started_request_ends_with_unavailable_when_its_worker_disappears() {
    let (p, addr) = plane_cfg(Duration::from_secs(2), DisaggConfig::default(), 0).await;
    let mut w = Scripted::join(&addr, 1).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(1, 3, 40, 5)).expect("submit");
    let _: Submit = w.expect(kind::SUBMIT).await;
    w.output(RequestId(1), delta(42)).await;
    let mut other = Scripted::join(&addr, 2).await;
    wait_for("the second worker", || p.workers().len() == 2).await;
    drop(w); // dies after its first token: the stream cannot move without losing tokens
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!(tokens, [42]);
    match end {
        End::Error(ErrorClass::Unavailable, m) => {
            assert!(m.contains("worker 1 disappeared"), "{m}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let moved =
        tokio::time::timeout(Duration::from_millis(300), other.expect::<Submit>(kind::SUBMIT));
    assert!(moved.await.is_err(), "a started request must not be placed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_before_the_first_token_moves_the_request() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut busy = Scripted::join(&addr, 1).await;
    wait_for("the scripted worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(1, 3, 40, 4)).expect("submit");
    let _: Submit = busy.expect(kind::SUBMIT).await;
    let w = RealWorker::join(&addr, 1, 50);
    wait_for("the real worker", || p.workers().len() == 2).await;
    let full = Output::Error { class: ErrorClass::Overloaded, message: "queue full".into() };
    busy.output(RequestId(1), full).await;
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!((tokens.len(), end), (4, End::Finished(FinishReason::Length)));
    assert_eq!(p.workers().len(), 2, "a refusal does not drop the worker");
    w.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_is_dropped_after_the_heartbeat_timeout() {
    let (p, addr) = plane(Duration::from_millis(300)).await;
    let _silent = Scripted::join(&addr, 1).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    let t0 = std::time::Instant::now();
    wait_for("the silent worker to be dropped", || p.workers().is_empty()).await;
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(!p.ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_ends_the_session() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut w = Scripted::join(&addr, 1).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    // A frame of the right version whose payload is not the message it claims to be.
    let mut junk = Vec::new();
    wire::encode(kind::OUTPUT, &"not an output", &mut junk).expect("encode");
    w.stream.write_all(&junk).await.expect("write");
    wait_for("the broken worker to be dropped", || p.workers().is_empty()).await;
    let mut byte = [0u8; 1];
    let closed = loop {
        match tokio::time::timeout(LONG, w.stream.read(&mut byte)).await.expect("close in time") {
            Ok(0) | Err(_) => break true,
            Ok(_) => continue, // heartbeats sent before the frame was read
        }
    };
    assert!(closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_worker_and_frees_the_request() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut w = Scripted::join(&addr, 3).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    let _rx = p.submit(request(5, 3, 40, 4)).expect("submit");
    let _: Submit = w.expect(kind::SUBMIT).await;
    p.cancel(RequestId(5));
    let c: Cancel = w.expect(kind::CANCEL).await;
    assert_eq!((c.worker_id, c.id), (3, RequestId(5)));
    // A late output of the cancelled request goes nowhere and breaks nothing.
    w.output(RequestId(5), delta(1)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(p.workers().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_frontend_dials_a_listening_worker() {
    let (p, _) = plane(Duration::from_secs(2)).await;
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let w = RealWorker::start(Link::Listen(l), 1, 70, BS);
    p.dial(addr);
    wait_for("the dialled worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(1, 2, 20, 3)).expect("submit");
    assert_eq!(collect(&mut rx, LONG).await.1, End::Finished(FinishReason::Length));
    w.stop().await.expect("stop");
    wait_for("the worker to leave", || p.workers().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialled_worker_that_ends_every_connection_at_once_is_redialled_with_backoff() {
    // As a worker whose registration is refused looks from the dialling side: connections
    // that end at once. They are retried with a growing delay (100 ms, 200, 400, ... up to
    // 2 s), not ten times a second.
    let (p, _) = plane(Duration::from_secs(2)).await;
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            drop(s);
        }
    });
    p.dial(addr);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let n = accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!((2..=7).contains(&n), "{n} connections in 2.5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_workers_serve_a_request_together() {
    let disagg = DisaggConfig { min_tokens: 0, ..DisaggConfig::default() };
    let (p, addr) = plane_with(Duration::from_secs(2), disagg).await;
    let d = RealWorker::with_role(&addr, WorkerRole::Decode, 10);
    wait_for("the decode worker", || p.workers().len() == 1).await;
    let pw = RealWorker::with_role(&addr, WorkerRole::Prefill, 20);
    wait_for("the prefill worker", || p.workers().len() == 2).await;
    // The prefill worker learns the decode worker's KV peer when it registers.
    for id in 1..=3 {
        let mut rx = p.submit(request(id, id as u32, 300, 6)).expect("submit");
        let (tokens, end) = collect(&mut rx, LONG).await;
        assert_eq!((tokens.len(), end), (6, End::Finished(FinishReason::Length)));
    }
    assert_eq!(metric(&p, "disagg_remote_prefills_total"), 3.0);
    assert_eq!(metric(&p, "disagg_fallbacks_total"), 0.0);
    assert!(metric(&p, "kv_transfer_bytes_total") > 0.0);
    wait_for("the prefill worker's counters", || {
        p.workers().iter().any(|w| w.id == 20 && w.metrics.prefill_tokens == 3 * 299)
    })
    .await;
    pw.stop().await.expect("stop");
    d.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_disappears_leaves_the_prompt_to_the_decode_worker() {
    let disagg = DisaggConfig { min_tokens: 0, ..DisaggConfig::default() };
    let (p, addr) = plane_with(Duration::from_secs(2), disagg).await;
    let d = RealWorker::with_role(&addr, WorkerRole::Decode, 10);
    wait_for("the decode worker", || p.workers().len() == 1).await;
    let mut pw = Scripted::join_as(&addr, 20, WorkerRole::Prefill).await;
    wait_for("the prefill worker", || p.workers().len() == 2).await;
    let mut rx = p.submit(request(1, 4, 300, 5)).expect("submit");
    let s: Submit = pw.expect(kind::SUBMIT).await;
    assert_eq!(s.request.id, RequestId(1).prefill_leg());
    assert!(matches!(s.request.kv, kvx_proto::KvRole::PrefillTo(ref d) if d.worker == 10));
    drop(pw); // dies while prefilling
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!((tokens.len(), end), (5, End::Finished(FinishReason::Length)));
    assert_eq!(metric(&p, "disagg_fallbacks_total"), 1.0);
    d.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_is_told_when_the_kv_is_in() {
    let disagg = DisaggConfig { min_tokens: 0, ..DisaggConfig::default() };
    let (p, addr) = plane_with(Duration::from_secs(2), disagg).await;
    let mut dw = Scripted::join_as(&addr, 10, WorkerRole::Decode).await;
    let mut pw = Scripted::join_as(&addr, 20, WorkerRole::Prefill).await;
    wait_for("both workers", || p.workers().len() == 2).await;
    let mut rx = p.submit(request(7, 4, 100, 2)).expect("submit");
    let s: Submit = dw.expect(kind::SUBMIT).await;
    assert_eq!(s.request.kv, kvx_proto::KvRole::AwaitKv);
    let reserved =
        kvx_proto::KvNote::Reserved { first_block: 0, blocks: vec![4, 5, 6, 7, 8, 9, 10] };
    dw.output(RequestId(7), Output::Kv(reserved)).await;
    let s: Submit = pw.expect(kind::SUBMIT).await;
    let kvx_proto::KvRole::PrefillTo(dest) = s.request.kv else { panic!("a prefill leg") };
    assert_eq!((dest.worker, dest.first_block, dest.blocks.len()), (10, 0, 7));
    pw.output(RequestId(7).prefill_leg(), Output::Kv(kvx_proto::KvNote::Sending)).await;
    let sent = kvx_proto::KvTransfer { blocks: 7, bytes: 7000, prefill_ms: 1.0, transfer_ms: 0.5 };
    pw.output(RequestId(7).prefill_leg(), Output::Kv(kvx_proto::KvNote::Sent(sent))).await;
    let r: KvReady = dw.expect(kind::KV_READY).await;
    assert_eq!((r.worker_id, r.id, r.arrived), (10, RequestId(7), true));
    dw.output(RequestId(7), delta(3)).await;
    let fin = Output::Finished {
        reason: FinishReason::Length,
        usage: kvx_proto::Usage {
            prompt_tokens: 100,
            completion_tokens: 1,
            cached_tokens: 0,
            ..Default::default()
        },
    };
    dw.output(RequestId(7), fin).await;
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!((tokens, end), (vec![3], End::Finished(FinishReason::Length)));
    assert_eq!(metric(&p, "kv_transfer_bytes_total"), 7000.0);
}

/// A decode worker that refuses a disaggregated request before reserving its blocks — it
/// began to drain as the request was sent — has it placed on another decode worker, which
/// prefills it itself; the client sees only the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_refuses_at_once_has_the_request_placed_again() {
    let disagg = DisaggConfig { min_tokens: 0, ..DisaggConfig::default() };
    let (p, addr) = plane_with(Duration::from_secs(2), disagg).await;
    let mut a = Scripted::join_as(&addr, 10, WorkerRole::Decode).await;
    let mut b = Scripted::join_as(&addr, 11, WorkerRole::Decode).await;
    let _pw = Scripted::join_as(&addr, 20, WorkerRole::Prefill).await;
    wait_for("three workers", || p.workers().len() == 3).await;
    let mut rx = p.submit(request(7, 4, 100, 2)).expect("submit");
    // Whichever decode worker the router chose refuses; the other gets it.
    let (first, a_got_it) = tokio::select! {
        s = a.expect::<Submit>(kind::SUBMIT) => (s, true),
        s = b.expect::<Submit>(kind::SUBMIT) => (s, false),
    };
    let (mut refuser, mut other) = if a_got_it { (a, b) } else { (b, a) };
    assert_eq!(first.request.kv, kvx_proto::KvRole::AwaitKv);
    let draining =
        Output::Error { class: ErrorClass::Unavailable, message: "the worker is draining".into() };
    refuser.output(RequestId(7), draining).await;
    let again: Submit = other.expect(kind::SUBMIT).await;
    assert_ne!(again.worker_id, first.worker_id);
    assert_eq!(again.request.id, RequestId(7));
    assert_eq!(again.request.kv, kvx_proto::KvRole::Local, "prefilled where it decodes");
    other.output(RequestId(7), delta(3)).await;
    other.output(RequestId(7), delta(4)).await;
    let fin = Output::Finished {
        reason: FinishReason::Length,
        usage: kvx_proto::Usage { prompt_tokens: 100, completion_tokens: 2, ..Default::default() },
    };
    other.output(RequestId(7), fin).await;
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!((tokens, end), (vec![3, 4], End::Finished(FinishReason::Length)));
    assert_eq!(metric(&p, "plane_requests_placed_again_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_request_migrates_with_the_tokens_its_client_has() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut w = Scripted::join(&addr, 1).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(1, 3, 40, 5)).expect("submit");
    let first: Submit = w.expect(kind::SUBMIT).await;
    assert!(first.request.resume.is_empty());
    w.output(RequestId(1), delta(42)).await;
    w.output(RequestId(1), delta(43)).await;
    let mut other = Scripted::join(&addr, 2).await;
    wait_for("the second worker", || p.workers().len() == 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(w); // dies mid-stream
    let s: Submit = other.expect(kind::SUBMIT).await;
    assert_eq!((s.worker_id, s.request.id), (2, RequestId(1)));
    assert_eq!(s.request.resume, [42, 43], "the tokens the client has");
    assert_eq!(s.request.prompt, first.request.prompt);
    for t in [44, 45, 46] {
        other.output(RequestId(1), delta(t)).await;
    }
    let fin = Output::Finished {
        reason: FinishReason::Length,
        usage: kvx_proto::Usage { prompt_tokens: 40, completion_tokens: 5, ..Default::default() },
    };
    other.output(RequestId(1), fin).await;
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!(tokens, [42, 43, 44, 45, 46], "one stream, nothing lost or doubled");
    assert_eq!(end, End::Finished(FinishReason::Length));
    assert_eq!(metric(&p, "plane_requests_migrated_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_stream_migrates_to_a_real_worker_and_ends_at_its_length() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
    let mut w = Scripted::join(&addr, 1).await;
    wait_for("the worker", || p.workers().len() == 1).await;
    let mut rx = p.submit(request(9, 3, 40, 12)).expect("submit");
    let _: Submit = w.expect(kind::SUBMIT).await;
    for t in [7, 8, 9, 10] {
        w.output(RequestId(9), delta(t)).await;
    }
    let real = RealWorker::join(&addr, 1, 50);
    wait_for("the real worker", || p.workers().len() == 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(w);
    let (tokens, end) = collect(&mut rx, LONG).await;
    assert_eq!(&tokens[..4], [7, 8, 9, 10]);
    assert_eq!((tokens.len(), end), (12, End::Finished(FinishReason::Length)));
    real.stop().await.expect("stop");
}
