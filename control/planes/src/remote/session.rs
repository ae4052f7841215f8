//! Worker sessions of the remote plane: one per worker process connection, whichever side
//! dialled. A reader task decodes frames and applies them under the plane's lock (outputs to
//! their clients, KV events, notes, snapshots and loads to the router); a writer task drains
//! a bounded queue of frames and sends a heartbeat. A session ends when the connection
//! closes, breaks, sends a malformed frame or stays silent past the heartbeat timeout; its
//! workers then leave the plane ([`State::conn_lost`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvx_proto::plane::{
    Heartbeat, KvEvents, Load, Note, NoteKind, OutputMsg, Register, Snapshot, SnapshotRequest, kind,
};
use kvx_proto::wire::{self, WireError};
use kvx_trust::PlaneStream;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use super::{Conn, Down, Shared, State};
use crate::feed::{self, MAINTENANCE_PERIOD};

pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let (_keep, never) = watch::channel(false);
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let (shared, never) = (shared.clone(), never.clone());
                tokio::spawn(async move {
                    match shared.cfg.auth.accept(stream).await {
                        Ok(stream) => connection(shared, stream, peer, never).await,
                        Err(e) => {
                            if shared.refused.first(peer.ip()) {
                                tracing::warn!(%peer, error = %e, "refused a worker connection (further refusals of this address are not logged)");
                            }
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a worker connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Dials the worker process at `addr`, and again after every loss, until `cancel` turns
/// true (a connection that is up then lives on until it closes or goes silent).
pub(super) async fn dial_loop(
    shared: Arc<Shared>,
    addr: String,
    mut cancel: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    while !*cancel.borrow() {
        let dialled = tokio::select! {
            _ = cancel.wait_for(|c| *c) => return,
            d = TcpStream::connect(&addr) => d,
        };
        match dialled {
            Ok(stream) => {
                let peer =
                    stream.peer_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                match shared.cfg.auth.connect(stream, &addr).await {
                    Ok(stream) => {
                        let began = tokio::time::Instant::now();
                        connection(shared.clone(), stream, peer, cancel.clone()).await;
                        // A connection that served resets the backoff; one that ended at
                        // once (a registration refused: another model, block size or
                        // arithmetic) keeps it growing, or the worker is redialled and
                        // refused ten times a second.
                        if began.elapsed() >= Duration::from_secs(1) {
                            backoff = Duration::from_millis(100);
                            warned = false;
                        }
                    }
                    Err(e) => {
                        if !warned {
                            tracing::warn!(worker = %addr, error = %e, "the worker is not admitted; retrying");
                            warned = true;
                        }
                    }
                }
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(worker = %addr, error = %e, "cannot reach the worker; retrying");
                    warned = true;
                }
            }
        }
        tokio::select! {
            _ = cancel.wait_for(|c| *c) => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Serves one worker connection until it dies.
async fn connection(
    shared: Arc<Shared>,
    stream: PlaneStream,
    peer: SocketAddr,
    mut cancel: watch::Receiver<bool>,
) {
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(shared.cfg.conn_queue.max(1));
    shared.lock().conns.insert(conn, Conn { tx, workers: Vec::new(), peer });
    let (rd, wr) = tokio::io::split(stream);
    let mut writer = tokio::spawn(write_loop(wr, rx, shared.cfg.heartbeat));
    let _ = &mut cancel; // ends the dialling, not this connection (see `RemotePlane::follow`)
    let why = tokio::select! {
        why = read_loop(&shared, conn, rd) => why,
        w = &mut writer => match w {
            Ok(why) => why,
            Err(e) => format!("writer: {e}"),
        },
    };
    writer.abort();
    let now = shared.now();
    shared.lock().conn_lost(conn, &why, now);
}

async fn write_loop(
    mut wr: WriteHalf<PlaneStream>,
    mut rx: mpsc::Receiver<Down>,
    heartbeat: Duration,
) -> String {
    let mut buf = Vec::with_capacity(64 << 10);
    let mut hb = tokio::time::interval(heartbeat);
    hb.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        let mut close = false;
        tokio::select! {
            d = rx.recv() => match d {
                Some(d) => close |= encode(d, &mut buf),
                None => return "the frontend closed the connection".into(),
            },
            _ = hb.tick() => {
                seq += 1;
                put(kind::HEARTBEAT, &Heartbeat { seq }, &mut buf);
            }
        }
        while buf.len() < 256 << 10 && !close {
            match rx.try_recv() {
                Ok(d) => close |= encode(d, &mut buf),
                Err(_) => break,
            }
        }
        if let Err(e) = async {
            wr.write_all(&buf).await?;
            wr.flush().await
        }
        .await
        {
            return format!("writing: {e}");
        }
        buf.clear();
        if close {
            return "replaced by a newer connection of its worker".into();
        }
    }
}

/// Encodes a frame; true for [`Down::Close`].
fn encode(d: Down, buf: &mut Vec<u8>) -> bool {
    match d {
        Down::Registered(r) => put(kind::REGISTERED, &r, buf),
        Down::Submit(s) => put(kind::SUBMIT, &*s, buf),
        Down::Cancel(c) => put(kind::CANCEL, &c, buf),
        Down::Snapshot(w) => put(kind::SNAPSHOT_REQUEST, &SnapshotRequest { worker_id: w }, buf),
        Down::Peers(p) => put(kind::PEERS, &p, buf),
        Down::KvReady(r) => put(kind::KV_READY, &r, buf),
        Down::Close => return true,
    }
    false
}

fn put<T: serde::Serialize>(k: u8, msg: &T, buf: &mut Vec<u8>) {
    if let Err(e) = wire::encode(k, msg, buf) {
        tracing::error!(kind = k, error = %e, "encoding a frame");
    }
}

/// A decoded frame from a worker.
enum Up {
    Register(Register),
    Output(OutputMsg),
    Kv(KvEvents),
    Note(Note),
    Snapshot(Snapshot),
    Load(Box<Load>),
}

fn decode(k: u8, payload: &[u8]) -> Result<Option<Up>, WireError> {
    Ok(Some(match k {
        kind::REGISTER => Up::Register(wire::decode(payload)?),
        kind::OUTPUT => Up::Output(wire::decode(payload)?),
        kind::KV_EVENTS => Up::Kv(wire::decode(payload)?),
        kind::NOTE => Up::Note(wire::decode(payload)?),
        kind::SNAPSHOT => Up::Snapshot(wire::decode(payload)?),
        kind::LOAD => Up::Load(Box::new(wire::decode(payload)?)),
        _ => return Ok(None), // heartbeats, and kinds of newer peers
    }))
}

async fn read_loop(shared: &Shared, conn: u64, mut rd: ReadHalf<PlaneStream>) -> String {
    let cfg = &shared.cfg;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut ups = Vec::new();
    loop {
        buf.reserve(64 << 10);
        match tokio::time::timeout(cfg.heartbeat_timeout, rd.read_buf(&mut buf)).await {
            Err(_) => return format!("no heartbeat for {:?}", cfg.heartbeat_timeout),
            Ok(Ok(0)) => return "connection closed".into(),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return format!("reading: {e}"),
        }
        let mut off = 0;
        loop {
            match wire::split(&buf[off..], cfg.max_frame) {
                Ok((k, payload, used)) => {
                    match decode(k, payload) {
                        Ok(Some(u)) => ups.push(u),
                        Ok(None) => {}
                        Err(e) => return format!("malformed frame of kind {k}: {e}"),
                    }
                    off += used;
                }
                Err(WireError::Incomplete) => break,
                Err(e) => return format!("bad frame: {e}"),
            }
        }
        buf.drain(..off);
        if !ups.is_empty() {
            let now = shared.now();
            let mut st = shared.lock();
            for u in ups.drain(..) {
                apply(&mut st, shared, conn, u, now);
            }
        }
    }
}

fn apply(st: &mut State, shared: &Shared, conn: u64, u: Up, now: Duration) {
    match u {
        Up::Register(r) => st.on_register(conn, r, &shared.cfg, shared.block_size, now),
        Up::Output(m) => st.on_output(conn, m, now),
        Up::Kv(k) => {
            for ev in &k.events {
                if st.owns(conn, ev.worker_id) {
                    // A gap marks the worker for a resync, which the maintenance task asks for.
                    let _ = feed::apply_kv(st.router_of(ev.worker_id), ev);
                }
            }
        }
        Up::Note(n) => {
            if st.inflight.get(&n.id).is_some_and(|f| f.worker == n.worker_id) {
                match n.note {
                    NoteKind::FirstToken => {
                        st.router_of(n.worker_id).mark_prefill_done(n.id);
                    }
                    NoteKind::Finished => {
                        st.router_of(n.worker_id).free(n.id);
                    }
                }
            }
        }
        Up::Snapshot(s) => {
            if st.owns(conn, s.worker_id) {
                feed::resync_from(
                    st.router_of(s.worker_id),
                    s.worker_id,
                    s.last_event_id,
                    s.blocks,
                    s.lower,
                );
            }
        }
        Up::Load(l) => {
            let w = l.metrics.load.worker_id;
            if st.owns(conn, w) {
                st.router_of(w).apply_load(&l.metrics.load);
                if let Some(x) = st.workers.get_mut(&w) {
                    x.metrics = l.metrics;
                }
                if l.draining {
                    st.retire(w);
                }
            }
        }
    }
}

/// Expires lost requests and asks workers that lost events for snapshots, once a second.
pub(super) async fn maintenance(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(MAINTENANCE_PERIOD);
    loop {
        tick.tick().await;
        let now = shared.now();
        let mut st = shared.lock();
        let mut resync = feed::maintain(&mut st.router, now);
        resync.extend(feed::maintain(&mut st.prefill, now));
        for w in resync {
            st.send(w, Down::Snapshot(w));
        }
    }
}
