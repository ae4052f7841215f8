//! The remote plane over loopback: real worker sessions (`kvx_worker::remote::serve` over
//! mock engines) and scripted workers that speak the wire protocol frame by frame, to make
//! a worker refuse, stall, break or disappear at a chosen moment.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{BS, End, collect, mock_shards, request, wait_for};
use kvx_ingress::{DispatchError, Dispatcher};
use kvx_planes::{RemotePlane, RemotePlaneConfig};
use kvx_proto::plane::{Cancel, OutputMsg, Register, Registered, Submit, kind};
use kvx_proto::wire::{self, WireError};
use kvx_proto::{ErrorClass, FinishReason, Output, OutputDelta, RequestId, WorkerId};
use kvx_router::RouterConfig;
use kvx_worker::remote::{Link, RemoteError};
use kvx_worker::{Hosted, RemoteConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const MODEL: &str = "test-model";
const LONG: Duration = Duration::from_secs(20);

/// A plane on an ephemeral loopback port; returns it and the address workers join at.
async fn plane(heartbeat_timeout: Duration) -> (Arc<RemotePlane>, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let cfg = RemotePlaneConfig {
        model: MODEL.into(),
        heartbeat: Duration::from_millis(50),
        heartbeat_timeout,
        ..RemotePlaneConfig::default()
    };
    let router = RouterConfig { block_size: BS, ..RouterConfig::default() };
    (RemotePlane::start(cfg, router, l).expect("plane"), addr)
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
    stop: watch::Sender<bool>,
    task: JoinHandle<(Vec<Hosted>, Result<(), RemoteError>)>,
}

impl RealWorker {
    fn start(link: Link, n: usize, first: WorkerId, block_size: usize) -> RealWorker {
        let started = mock_shards(n, first, 100.0);
        let (stop, rx) = watch::channel(false);
        let task =
            tokio::spawn(kvx_worker::remote::serve(worker_cfg(block_size), started, link, rx));
        RealWorker { stop, task }
    }

    fn join(addr: &str, n: usize, first: WorkerId) -> RealWorker {
        RealWorker::start(Link::Connect(addr.to_string()), n, first, BS)
    }

    async fn stop(self) -> Result<(), RemoteError> {
        let _ = self.stop.send(true);
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
        let stream = TcpStream::connect(addr).await.expect("connect");
        let mut s = Scripted { stream, buf: Vec::new() };
        let reg = Register {
            worker_id: worker,
            model: MODEL.into(),
            block_size: BS,
            kv_blocks: 1024,
            max_num_seqs: 64,
            role: Default::default(),
            kv_peer: None,
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

    /// The next frame of kind `k`, skipping heartbeats and snapshot requests.
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
                        got == kind::HEARTBEAT || got == kind::SNAPSHOT_REQUEST,
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
async fn a_worker_of_another_block_size_or_model_is_refused() {
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
    };
    s.send(kind::REGISTER, &reg).await;
    let r: Registered = s.expect(kind::REGISTERED).await;
    assert!(!r.accepted && r.reason.contains("\"other\""), "{}", r.reason);
    assert!(p.workers().is_empty() && !p.ready());
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
async fn a_started_request_ends_with_unavailable_when_its_worker_disappears() {
    let (p, addr) = plane(Duration::from_secs(2)).await;
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
