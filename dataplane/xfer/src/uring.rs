//! The io_uring engines: `tcp_threads` threads per agent (default 1), each with its own ring,
//! driving TCP connections (both as initiator and as target); the first also does O_DIRECT
//! file I/O on registered buffers and fixed files and accepts connections, handing every
//! other one to the next engine in turn. An initiator opens one connection per engine to each
//! remote and posts transfers to the engines in turn, so that on two cores both ends of a
//! stream run in parallel (the kernel copies a connection's bytes in the thread driving it).
//!
//! A connection opens with the handshake of [`crate::auth`]: [`connect`] runs the initiator's
//! half, blocking, before it hands the socket to an engine; an accepted connection serves
//! Hello, Auth and GetMeta only until the initiator's proof checked out (any other frame
//! closes it), and one that has not authenticated within the connect timeout is closed. A
//! connection this agent dialled accepts replies only (WriteAck, ReadData).
//!
//! TCP framing is in [`crate::wire`]. Per connection at most one receive and one send are in
//! flight, which keeps the byte stream ordered while many transfers are pipelined on it:
//! sends are batched (up to [`TX_BATCH`] frames and 1024 iovecs in one `sendmsg`), payloads
//! are received straight into region memory with one `recvmsg` per frame, and headers and
//! descriptor lists go through a small per-connection staging buffer. Every queue here is
//! bounded; when the target's reply queue is full it stops reading (back-pressure), never
//! buffers without bound.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, squeue, types};

use crate::agent::{BUF_CHUNK, ConnRef, MemSeg, Prepped, Shared, ZeroCopy};
use crate::auth::{Dial, Handshake, PROOF_LEN};
use crate::desc::{Desc, MAX_DESCS, Op};
use crate::error::{Result, XferError, peer_errno};
use crate::meta::AgentMetadata;
use crate::region::RegionKind;
use crate::slots::NotifBuf;
use crate::wire::{self, DESC_LEN, FrameKind, HEADER_LEN, Header, MAX_NOTIF, status};

/// Frames coalesced into one `sendmsg`.
pub(crate) const TX_BATCH: usize = 64;
/// iovecs per socket call (kernel UIO_MAXIOV).
const IOV_CAP: usize = 1024;
/// Staging buffer: a header plus the largest descriptor list and notification.
const RX_CAP: usize = 32 << 10;
/// Largest opportunistic staging read when a header is expected (bounds payload double-copy).
const RX_SMALL: usize = 4096;
/// Replies a target may have queued per connection before it stops reading.
const TXQ_TARGET: usize = 256;
/// Pending READ replies per target connection.
const READ_POOL: usize = 8;
/// Fixed-buffer and fixed-file table sizes.
const MAX_BUFS: u32 = 4096;
const MAX_FILES: u32 = 1024;
/// Largest metadata blob accepted.
const MAX_META: u64 = 16 << 20;

const TAG_WAKE: u64 = 1;
const TAG_ACCEPT: u64 = 2;
const TAG_RX: u64 = 3;
const TAG_TX: u64 = 4;
const TAG_FILE: u64 = 5;

fn ud(tag: u64, a: u32, b: u32) -> u64 {
    tag << 56 | (u64::from(a) & 0xff_ffff) << 32 | u64::from(b)
}

/// Work for the engine. `Xfer` carries its notification inline on purpose: boxing it would
/// allocate per post; the channel is bounded, so the size costs a fixed amount of memory.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum UJob {
    Xfer { idx: u32, seq: u32, op: Op, prep: Prepped, notif: NotifBuf },
    AddConn { fd: OwnedFd, remote: u32, peer: Arc<str>, reply: SyncSender<Result<ConnRef>> },
    RegMem { ptr: *mut u8, len: u64, reply: SyncSender<Result<u32>> },
    RegFile { fd: RawFd, reply: SyncSender<Result<u32>> },
}

// SAFETY: the only non-Send field is `RegMem::ptr`, the base of a mapping owned by the agent
// that outlives the engine; it is only registered with the kernel, never dereferenced here.
unsafe impl Send for UJob {}

/// Per-slot engine state of a transfer this agent initiated.
#[derive(Debug)]
struct XState {
    active: bool,
    seq: u32,
    op: Op,
    prep: Option<Prepped>,
    notif: NotifBuf,
    started: Instant,
    conn: u32,
    next: usize,
    outstanding: u32,
    err: Option<XferError>,
}

#[derive(Debug, Clone, Copy)]
enum Rx {
    Header,
    Meta(Header),
    /// Receiving a payload into `rx_iov[pos..n]` (first entry advanced by `off`).
    Payload(Header),
    Drain {
        h: Header,
        remaining: u64,
        status: u16,
    },
    /// A received WRITE waits for room in the notification queue before it is acked.
    Notify(Header),
}

#[derive(Debug, Clone, Copy)]
enum Tx {
    Req { slot: u32 },
    WriteAck { xfer: u64, status: u16 },
    ReadData { xfer: u64, status: u16, pool: usize },
    HelloAck,
    Meta,
}

struct IoList {
    iov: Box<[libc::iovec]>,
    n: usize,
    pos: usize,
    msg: Box<libc::msghdr>,
}

impl std::fmt::Debug for IoList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoList(n={}, pos={})", self.n, self.pos)
    }
}

impl IoList {
    fn new() -> Self {
        IoList {
            iov: vec![libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; IOV_CAP].into(),
            n: 0,
            pos: 0,
            // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
            msg: Box::new(unsafe { std::mem::zeroed() }),
        }
    }
    fn clear(&mut self) {
        self.n = 0;
        self.pos = 0;
    }
    fn push(&mut self, p: *const u8, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        if self.n == IOV_CAP {
            return false;
        }
        self.iov[self.n] = libc::iovec { iov_base: p.cast_mut().cast(), iov_len: len };
        self.n += 1;
        true
    }
    fn remaining(&self) -> u64 {
        self.iov[self.pos..self.n].iter().map(|v| v.iov_len as u64).sum()
    }
    /// Consume `k` bytes from the front.
    fn advance(&mut self, mut k: usize) {
        while k > 0 && self.pos < self.n {
            let v = &mut self.iov[self.pos];
            if k >= v.iov_len {
                k -= v.iov_len;
                self.pos += 1;
            } else {
                // SAFETY: `k < iov_len`, so the advanced base stays inside the same buffer.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(k) }.cast();
                v.iov_len -= k;
                k = 0;
            }
        }
    }
    /// Copy from `src` into the front of the list; returns bytes copied.
    fn fill_from(&mut self, src: &[u8]) -> usize {
        let mut done = 0;
        while done < src.len() && self.pos < self.n {
            let v = self.iov[self.pos];
            let k = v.iov_len.min(src.len() - done);
            // SAFETY: `iov_base..+iov_len` is a validated region segment distinct from the
            // staging buffer `src`; `k` stays within both.
            unsafe { std::ptr::copy_nonoverlapping(src[done..].as_ptr(), v.iov_base.cast(), k) };
            self.advance(k);
            done += k;
        }
        done
    }
    fn msg_ptr(&mut self) -> *mut libc::msghdr {
        self.msg.msg_iov = self.iov[self.pos..].as_mut_ptr();
        self.msg.msg_iovlen = self.n - self.pos;
        &raw mut *self.msg
    }
}

#[derive(Debug)]
struct ReadEntry {
    segs: Vec<MemSeg>,
    notif: NotifBuf,
    used: bool,
    /// Sent, but its notification waits for room in the queue; the entry stays taken, which
    /// back-pressures the initiator once all entries are.
    notif_pending: bool,
}

#[derive(Debug)]
struct Conn {
    fd: OwnedFd,
    seq: u32,
    /// The remote this agent dialled (authenticated in [`connect`]); `None` when accepted.
    remote: Option<u32>,
    peer: Arc<str>,
    /// An accepted connection's handshake; requests are served only once it is open.
    hs: Handshake,
    /// When the connection was added (an accepted one must authenticate in time).
    opened: Instant,
    dead: bool,
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    rx_state: Rx,
    rx_busy: bool,
    rx_list: IoList,
    rx_notif: NotifBuf,
    txq: VecDeque<Tx>,
    tx_busy: bool,
    tx_batch: Vec<Tx>,
    tx_hdrs: Box<[[u8; HEADER_LEN]]>,
    tx_list: IoList,
    /// Send with SENDMSG_ZC (see [`ZeroCopy`]); cleared when the kernel reports it copied.
    zc: bool,
    /// Zero-copy notifications still owed for the batch in flight; the batch (and the memory
    /// it points at) is not released before they arrive.
    zc_notifs: u32,
    reads: Vec<ReadEntry>,
    meta_blob: Vec<u8>,
    /// The HelloAck's notification area (server nonce, proof, name).
    hello_blob: Vec<u8>,
}

impl Conn {
    fn new(
        fd: OwnedFd,
        seq: u32,
        remote: Option<u32>,
        peer: Arc<str>,
        txq_cap: usize,
        zc: bool,
    ) -> Box<Conn> {
        Box::new(Conn {
            fd,
            seq,
            remote,
            peer,
            hs: Handshake::Fresh,
            opened: Instant::now(),
            dead: false,
            rx: vec![0u8; RX_CAP].into(),
            rx_start: 0,
            rx_end: 0,
            rx_state: Rx::Header,
            rx_busy: false,
            rx_list: IoList::new(),
            rx_notif: NotifBuf::EMPTY,
            txq: VecDeque::with_capacity(txq_cap),
            tx_busy: false,
            tx_batch: Vec::with_capacity(TX_BATCH),
            tx_hdrs: vec![[0u8; HEADER_LEN]; TX_BATCH].into(),
            tx_list: IoList::new(),
            zc,
            zc_notifs: 0,
            reads: Vec::new(),
            meta_blob: Vec::new(),
            hello_blob: Vec::new(),
        })
    }
    fn avail(&self) -> usize {
        self.rx_end - self.rx_start
    }
}

struct Engine {
    sh: Arc<Shared>,
    /// This engine's index; engine 0 owns the listener and the file work.
    id: usize,
    /// Connections accepted so far (engine 0), for spreading them over the engines.
    accepted: usize,
    ring: IoUring,
    rx: Receiver<UJob>,
    listener: Option<TcpListener>,
    conns: Vec<Option<Box<Conn>>>,
    conn_gen: u32,
    xs: Vec<XState>,
    file_q: VecDeque<u32>,
    notif_wait: VecDeque<u32>,
    inflight: usize,
    bufs_next: u32,
    bufs_ok: bool,
    files_next: u32,
    wake_buf: Box<u64>,
    cqes: Vec<(u64, i32, u32)>,
    txq_cap: usize,
}

/// Start engine `id`'s thread. The ring is created inside it (single issuer). Engine 0 binds
/// the agent's TCP listener.
pub(crate) fn start(sh: Arc<Shared>, id: usize) -> Result<(SyncSender<UJob>, JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(sh.slots.capacity() + 64);
    let listener = match sh.cfg.tcp_listen {
        Some(a) if id == 0 => {
            let l = TcpListener::bind(a).map_err(|e| XferError::io("bind tcp", &e))?;
            *sh.tcp_addr.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(l.local_addr().map_err(|e| XferError::io("local_addr", &e))?);
            Some(l)
        }
        _ => None,
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let th = std::thread::Builder::new()
        .name(format!("xfer-uring-{}-{id}", sh.name))
        .spawn(move || match Engine::new(sh, id, rx, listener) {
            Ok(mut e) => {
                let _ = ready_tx.send(Ok(()));
                e.run();
            }
            Err(err) => {
                let _ = ready_tx.send(Err(err));
            }
        })
        .map_err(|e| XferError::io("spawn", &e))?;
    ready_rx.recv().map_err(|_| XferError::Shutdown)??;
    Ok((tx, th))
}

impl Engine {
    fn new(
        sh: Arc<Shared>,
        id: usize,
        rx: Receiver<UJob>,
        listener: Option<TcpListener>,
    ) -> Result<Engine> {
        let entries = sh.cfg.ring_entries.clamp(16, 4096);
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_cqsize(entries * 4)
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(entries * 4).build(entries))
            .map_err(|e| XferError::io("io_uring_setup", &e))?;
        let bufs_ok = ring.submitter().register_buffers_sparse(MAX_BUFS).is_ok();
        ring.submitter()
            .register_files_sparse(MAX_FILES)
            .map_err(|e| XferError::io("io_uring register files", &e))?;
        let cap = sh.slots.capacity();
        let xs = (0..cap)
            .map(|_| XState {
                active: false,
                seq: 0,
                op: Op::Write,
                prep: None,
                notif: NotifBuf::EMPTY,
                started: Instant::now(),
                conn: u32::MAX,
                next: 0,
                outstanding: 0,
                err: None,
            })
            .collect();
        Ok(Engine {
            txq_cap: cap + TXQ_TARGET,
            sh,
            id,
            accepted: 0,
            ring,
            rx,
            listener,
            conns: Vec::new(),
            conn_gen: 1,
            xs,
            file_q: VecDeque::with_capacity(cap),
            notif_wait: VecDeque::with_capacity(cap),
            inflight: 0,
            bufs_next: 0,
            bufs_ok,
            files_next: 0,
            wake_buf: Box::new(0),
            cqes: Vec::with_capacity(entries as usize * 4),
        })
    }

    fn push(&mut self, e: squeue::Entry) {
        // SAFETY: every entry built by this engine points at memory that outlives the op:
        // boxed connection state, region mappings owned by the agent, or `wake_buf`.
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            let _ = self.ring.submit();
        }
        self.inflight += 1;
    }

    fn run(&mut self) {
        self.arm_wake();
        self.arm_accept();
        let mut last_tick = Instant::now();
        loop {
            // Drain jobs.
            loop {
                match self.rx.try_recv() {
                    Ok(j) => self.job(j),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                }
            }
            self.take_handoff();
            self.pump_files();
            if self.sh.shutdown.load(Ordering::SeqCst) {
                self.shutdown();
                return;
            }
            // Sleep until a completion, a wake or the tick.
            self.sh.uring_sleeping[self.id].store(true, Ordering::SeqCst);
            let has_job = match self.rx.try_recv() {
                Ok(j) => {
                    self.sh.uring_sleeping[self.id].store(false, Ordering::SeqCst);
                    self.job(j);
                    true
                }
                Err(_) => false,
            };
            if !has_job {
                let ts = types::Timespec::from(Duration::from_millis(100));
                let args = types::SubmitArgs::new().timespec(&ts);
                let _ = self.ring.submitter().submit_with_args(1, &args);
                self.sh.uring_sleeping[self.id].store(false, Ordering::SeqCst);
            } else {
                let _ = self.ring.submit();
            }
            self.reap();
            if last_tick.elapsed() >= Duration::from_millis(50) {
                last_tick = Instant::now();
                self.tick();
            }
        }
    }

    fn reap(&mut self) {
        loop {
            self.cqes.clear();
            for c in self.ring.completion() {
                self.cqes.push((c.user_data(), c.result(), c.flags()));
            }
            if self.cqes.is_empty() {
                return;
            }
            let n = self.cqes.len();
            for i in 0..n {
                let (u, res, flags) = self.cqes[i];
                if io_uring::cqueue::more(flags) {
                    // A zero-copy send: its notification CQE is still to come.
                    self.inflight += 1;
                }
                self.inflight = self.inflight.saturating_sub(1);
                self.completion(u, res, flags);
            }
            let _ = self.ring.submit();
        }
    }

    /// Serve the connections engine 0 accepted for this engine.
    fn take_handoff(&mut self) {
        if self.id == 0 {
            return;
        }
        let fds: Vec<OwnedFd> = match self.sh.handoff[self.id].try_lock() {
            Ok(mut v) if !v.is_empty() => v.drain(..).collect(),
            _ => return,
        };
        for fd in fds {
            let _ = self.add_conn(fd, None, Arc::from("?"));
        }
    }

    fn arm_wake(&mut self) {
        let p = (&raw mut *self.wake_buf).cast::<u8>();
        let e = opcode::Read::new(types::Fd(self.sh.uring_wake[self.id].as_raw_fd()), p, 8)
            .build()
            .user_data(ud(TAG_WAKE, 0, 0));
        self.push(e);
    }

    fn arm_accept(&mut self) {
        if let Some(l) = &self.listener {
            let e = opcode::Accept::new(
                types::Fd(l.as_raw_fd()),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ud(TAG_ACCEPT, 0, 0));
            self.push(e);
        }
    }

    /// Fail everything, cancel every op and wait (bounded) until the kernel has let go of
    /// the buffers the ops point at; only then may the engine's state be dropped.
    fn shutdown(&mut self) {
        for i in 0..self.conns.len() {
            self.fail_conn(i as u32, XferError::Shutdown);
        }
        for i in 0..self.xs.len() {
            if self.xs[i].active {
                self.finish(i as u32, Err(XferError::Shutdown));
            }
        }
        self.listener = None;
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(0);
        self.push(cancel);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.inflight > 0 && Instant::now() < deadline {
            let ts = types::Timespec::from(Duration::from_millis(10));
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            self.cqes.clear();
            for c in self.ring.completion() {
                self.cqes.push((c.user_data(), c.result(), c.flags()));
            }
            let more = self.cqes.iter().filter(|c| io_uring::cqueue::more(c.2)).count();
            self.inflight = (self.inflight + more).saturating_sub(self.cqes.len());
        }
        if self.inflight > 0 {
            // The kernel still holds buffers: leak the connection state rather than free
            // memory it may write to.
            for c in self.conns.drain(..) {
                std::mem::forget(c);
            }
        }
    }

    // ---------------------------------------------------------------- jobs

    fn job(&mut self, j: UJob) {
        match j {
            UJob::Xfer { idx, seq, op, prep, notif } => self.start_xfer(idx, seq, op, prep, notif),
            UJob::AddConn { fd, remote, peer, reply } => {
                let r = self.add_conn(fd, Some(remote), peer);
                let _ = reply.send(r);
            }
            UJob::RegMem { ptr, len, reply } => {
                let _ = reply.send(Ok(self.reg_mem(ptr, len)));
            }
            UJob::RegFile { fd, reply } => {
                let r = if self.files_next >= MAX_FILES {
                    Err(XferError::Full("fixed file table"))
                } else {
                    self.ring
                        .submitter()
                        .register_files_update(self.files_next, &[fd])
                        .map(|_| {
                            self.files_next += 1;
                            self.files_next - 1
                        })
                        .map_err(|e| XferError::io("io_uring register file", &e))
                };
                let _ = reply.send(r);
            }
        }
    }

    /// Register a memory region as fixed buffers (1 GiB chunks). Returns the first index, or
    /// `u32::MAX` when registration is unavailable (file I/O then uses plain reads/writes).
    fn reg_mem(&mut self, ptr: *mut u8, len: u64) -> u32 {
        let chunks = len.div_ceil(BUF_CHUNK) as u32;
        if !self.bufs_ok || self.bufs_next + chunks > MAX_BUFS {
            return u32::MAX;
        }
        let iovs: Vec<libc::iovec> = (0..u64::from(chunks))
            .map(|c| libc::iovec {
                // SAFETY: `c * BUF_CHUNK < len`, inside the mapping.
                iov_base: unsafe { ptr.add((c * BUF_CHUNK) as usize) }.cast(),
                iov_len: (len - c * BUF_CHUNK).min(BUF_CHUNK) as usize,
            })
            .collect();
        // SAFETY: the iovecs cover a mapping owned by the agent, which outlives the ring (the
        // engine thread, holding the ring, is joined before the agent's tables drop).
        match unsafe { self.ring.submitter().register_buffers_update(self.bufs_next, &iovs, None) }
        {
            Ok(()) => {
                self.bufs_next += chunks;
                self.bufs_next - chunks
            }
            Err(_) => u32::MAX,
        }
    }

    fn add_conn(&mut self, fd: OwnedFd, remote: Option<u32>, peer: Arc<str>) -> Result<ConnRef> {
        let idx = match self.conns.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.conns.len() < 4096 => {
                self.conns.push(None);
                self.conns.len() - 1
            }
            None => return Err(XferError::Full("connection table")),
        };
        self.conn_gen = self.conn_gen.wrapping_add(1);
        let seq = self.conn_gen;
        let zc = self.sh.cfg.tcp_zero_copy != ZeroCopy::Never;
        self.conns[idx] = Some(Conn::new(fd, seq, remote, peer, self.txq_cap, zc));
        self.kick_rx(idx as u32);
        Ok(ConnRef { idx: idx as u32, seq })
    }

    fn start_xfer(&mut self, idx: u32, seq: u32, op: Op, prep: Prepped, notif: NotifBuf) {
        if !self.sh.slots.start(idx, seq) {
            return;
        }
        let backend = prep.inner.backend;
        let conn = if backend == crate::agent::Backend::Tcp {
            let c = self.sh.remote(prep.inner.remote).ok().and_then(|r| {
                r.tcp.lock().unwrap_or_else(|p| p.into_inner()).get(self.id).copied()
            });
            match c {
                Some(c) if self.conn_ok(c) => c.idx,
                _ => {
                    let e = self
                        .sh
                        .remote(prep.inner.remote)
                        .map(|r| r.gone())
                        .unwrap_or(XferError::UnknownRemote);
                    self.sh.slots.complete(idx, seq, Err(e));
                    return;
                }
            }
        } else {
            u32::MAX
        };
        let x = &mut self.xs[idx as usize];
        *x = XState {
            active: true,
            seq,
            op,
            prep: Some(prep),
            notif,
            started: Instant::now(),
            conn,
            next: 0,
            outstanding: 0,
            err: None,
        };
        if conn == u32::MAX {
            self.file_q.push_back(idx);
        } else if let Some(c) = self.conns[conn as usize].as_mut() {
            c.txq.push_back(Tx::Req { slot: idx });
            self.kick_tx(conn);
        }
    }

    fn conn_ok(&self, c: ConnRef) -> bool {
        matches!(self.conns.get(c.idx as usize), Some(Some(k)) if k.seq == c.seq && !k.dead)
    }

    fn finish(&mut self, idx: u32, res: Result<()>) {
        let x = &mut self.xs[idx as usize];
        if !x.active {
            return;
        }
        x.active = false;
        x.prep = None;
        let seq = x.seq;
        self.sh.slots.complete(idx, seq, res);
    }

    // ---------------------------------------------------------------- files

    fn pump_files(&mut self) {
        let limit = self.sh.cfg.ring_entries as usize;
        while let Some(&slot) = self.file_q.front() {
            let x = &self.xs[slot as usize];
            let Some(p) = x.prep.clone() else {
                self.file_q.pop_front();
                continue;
            };
            // A transfer cancelled while it waited here (none of its ops submitted yet) ends
            // `Cancelled` unsubmitted, as one waiting in a connection's send queue does.
            if x.next == 0 && self.sh.slots.cancel_requested(slot, x.seq) {
                self.file_q.pop_front();
                self.finish(slot, Err(XferError::Cancelled));
                continue;
            }
            let n = p.inner.local.len();
            while self.xs[slot as usize].next < n {
                if self.inflight >= limit {
                    return;
                }
                let x = &mut self.xs[slot as usize];
                let i = x.next;
                let (m, f) = (p.inner.local[i], p.inner.remote_file[i]);
                let u = ud(TAG_FILE, slot, (x.seq & 0xffff) << 16 | i as u32 & 0xffff);
                let len = m.len as u32;
                let e = match (x.op, m.buf_index) {
                    (Op::Read, u16::MAX) => {
                        opcode::Read::new(types::Fixed(f.fixed), m.ptr, len).offset(f.off).build()
                    }
                    (Op::Read, b) => opcode::ReadFixed::new(types::Fixed(f.fixed), m.ptr, len, b)
                        .offset(f.off)
                        .build(),
                    (Op::Write, u16::MAX) => {
                        opcode::Write::new(types::Fixed(f.fixed), m.ptr, len).offset(f.off).build()
                    }
                    (Op::Write, b) => opcode::WriteFixed::new(types::Fixed(f.fixed), m.ptr, len, b)
                        .offset(f.off)
                        .build(),
                };
                x.next += 1;
                x.outstanding += 1;
                self.push(e.user_data(u));
            }
            self.file_q.pop_front();
        }
    }

    fn file_done(&mut self, slot: u32, tag: u32, res: i32) {
        let Some(x) = self.xs.get_mut(slot as usize) else { return };
        if !x.active || (x.seq & 0xffff) != tag >> 16 {
            return;
        }
        let i = (tag & 0xffff) as usize;
        let want = x.prep.as_ref().and_then(|p| p.inner.local.get(i)).map(|m| m.len).unwrap_or(0);
        x.outstanding = x.outstanding.saturating_sub(1);
        if res < 0 {
            x.err.get_or_insert(XferError::errno("direct file I/O", -res));
        } else if res as usize != want {
            x.err.get_or_insert(XferError::Io {
                op: "direct file I/O",
                msg: format!("short transfer: {res} of {want} bytes"),
                errno: 0,
            });
        }
        let n = x.prep.as_ref().map_or(0, |p| p.inner.local.len());
        if x.next >= n && x.outstanding == 0 {
            let res = match x.err.take() {
                Some(e) => Err(e),
                None => match self.file_notif(slot) {
                    Err(XferError::Full(_)) => {
                        // Our own queue is full: finish once the application drains it.
                        self.notif_wait.push_back(slot);
                        return;
                    }
                    r => r.and_then(|()| self.file_remote_alive(slot)),
                },
            };
            self.finish(slot, res);
        }
    }

    /// A same-host peer that died meanwhile turns the transfer into `RemoteGone`, as on the
    /// other backends (its file bytes may have moved, but nobody is there to use them).
    fn file_remote_alive(&self, slot: u32) -> Result<()> {
        let Some(p) = &self.xs[slot as usize].prep else { return Ok(()) };
        let rem = self.sh.remote(p.inner.remote)?;
        if rem.alive.load(Ordering::Acquire) { Ok(()) } else { Err(rem.gone()) }
    }

    fn file_notif(&mut self, slot: u32) -> Result<()> {
        let x = &self.xs[slot as usize];
        if x.notif.len == 0 {
            return Ok(());
        }
        let Some(p) = &x.prep else { return Ok(()) };
        let rem = self.sh.remote(p.inner.remote)?;
        if rem.is_self {
            if self.sh.notifs.push(&self.sh.name, x.notif.bytes()) {
                Ok(())
            } else {
                Err(XferError::Full("notification queue"))
            }
        } else if let Some(peer) = &rem.local {
            peer.send_notif(&rem.name, self.sh.instance, x.notif.bytes()).inspect_err(|e| {
                if e.is_remote_gone() {
                    rem.alive.store(false, Ordering::Release);
                }
            })
        } else {
            Ok(())
        }
    }

    // ---------------------------------------------------------------- completions

    fn completion(&mut self, u: u64, res: i32, flags: u32) {
        let tag = u >> 56;
        let a = ((u >> 32) & 0xff_ffff) as u32;
        let b = u as u32;
        match tag {
            TAG_WAKE => self.arm_wake(),
            TAG_ACCEPT => {
                if res >= 0 {
                    // SAFETY: a successful accept returns a fresh fd we now own.
                    let fd = unsafe { OwnedFd::from_raw_fd(res) };
                    let _ = set_nodelay(fd.as_raw_fd());
                    // Spread accepted connections over the engines in turn.
                    let to = self.accepted % self.sh.handoff.len().max(1);
                    self.accepted = self.accepted.wrapping_add(1);
                    if to == self.id {
                        let _ = self.add_conn(fd, None, Arc::from("?"));
                    } else {
                        self.sh.handoff[to].lock().unwrap_or_else(|p| p.into_inner()).push(fd);
                        crate::agent::wake(&self.sh.uring_wake[to]);
                    }
                }
                if !self.sh.shutdown.load(Ordering::SeqCst) {
                    self.arm_accept();
                }
            }
            TAG_RX => self.rx_done(a, b, res),
            TAG_TX => self.tx_done(a, b, res, flags),
            TAG_FILE => self.file_done(a, b, res),
            _ => {}
        }
    }

    fn maybe_free(&mut self, ci: u32) {
        if let Some(Some(c)) = self.conns.get(ci as usize)
            && c.dead
            && !c.rx_busy
            && !c.tx_busy
        {
            self.conns[ci as usize] = None;
        }
    }

    fn fail_conn(&mut self, ci: u32, err: XferError) {
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
        if c.dead {
            return;
        }
        c.dead = true;
        // SAFETY: shutdown on a socket we own; wakes our in-flight recv/send with EOF/EPIPE.
        unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(r) = c.remote
            && let Ok(rem) = self.sh.remote(r)
        {
            rem.alive.store(false, Ordering::Release);
        }
        for i in 0..self.xs.len() {
            if self.xs[i].active && self.xs[i].conn == ci {
                self.finish(i as u32, Err(err.clone()));
            }
        }
        self.maybe_free(ci);
    }

    fn conn_error(&self, ci: u32, errno: i32) -> XferError {
        let name = match self.conns.get(ci as usize) {
            Some(Some(c)) => c.peer.clone(),
            _ => Arc::from("?"),
        };
        peer_errno(&name, "socket", errno)
    }

    fn tick(&mut self) {
        let timeout = self.sh.cfg.xfer_timeout;
        let mut expired = Vec::new();
        for x in self.xs.iter() {
            if x.active && x.conn != u32::MAX && x.started.elapsed() > timeout {
                expired.push(x.conn);
            }
        }
        for ci in expired {
            self.fail_conn(ci, XferError::Timeout);
        }
        // Close accepted connections that have not authenticated in time.
        let deadline = self.sh.cfg.connect_timeout;
        for ci in 0..self.conns.len() {
            if matches!(&self.conns[ci], Some(c) if c.remote.is_none() && !c.dead
                && !c.hs.is_open() && c.opened.elapsed() > deadline)
            {
                self.fail_conn(ci as u32, XferError::Timeout);
            }
        }
        // Finish file transfers whose notification found our own queue full.
        for _ in 0..self.notif_wait.len() {
            let Some(slot) = self.notif_wait.pop_front() else { break };
            match self.file_notif(slot) {
                Err(XferError::Full(_)) => self.notif_wait.push_back(slot),
                r => {
                    let r = r.and_then(|()| self.file_remote_alive(slot));
                    self.finish(slot, r);
                }
            }
        }
        // Deliver READ notifications that found the queue full.
        for c in self.conns.iter_mut().flatten() {
            for ent in c.reads.iter_mut().filter(|e| e.notif_pending) {
                if self.sh.notifs.push(&c.peer, ent.notif.bytes()) {
                    ent.notif_pending = false;
                    ent.used = false;
                }
            }
        }
        // Retry connections stalled on a full notification queue or reply queue.
        for ci in 0..self.conns.len() as u32 {
            if matches!(self.conns[ci as usize].as_ref(), Some(c) if !c.dead && !c.rx_busy) {
                self.process_rx(ci);
            }
        }
    }

    // ---------------------------------------------------------------- receive path

    fn rx_done(&mut self, ci: u32, seq: u32, res: i32) {
        let c = match self.conns.get_mut(ci as usize) {
            Some(Some(c)) if c.seq == seq => c,
            _ => return,
        };
        c.rx_busy = false;
        if c.dead {
            self.maybe_free(ci);
            return;
        }
        if res <= 0 {
            let e = if res == 0 {
                XferError::RemoteGone(c.peer.to_string())
            } else {
                self.conn_error(ci, -res)
            };
            self.fail_conn(ci, e);
            return;
        }
        let n = res as usize;
        match c.rx_state {
            Rx::Payload(_) => c.rx_list.advance(n),
            Rx::Drain { ref mut remaining, .. } => {
                *remaining -= (n as u64).min(*remaining);
            }
            _ => c.rx_end += n,
        }
        self.process_rx(ci);
    }

    /// Parse what is staged, act on complete frames, then arm the next receive.
    fn process_rx(&mut self, ci: u32) {
        loop {
            let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
            if c.dead || c.rx_busy {
                return;
            }
            match c.rx_state {
                Rx::Header => {
                    if c.avail() < HEADER_LEN {
                        break;
                    }
                    let mut hb = [0u8; HEADER_LEN];
                    hb.copy_from_slice(&c.rx[c.rx_start..c.rx_start + HEADER_LEN]);
                    match Header::decode(&hb) {
                        Ok(h) => {
                            c.rx_start += HEADER_LEN;
                            c.rx_state = Rx::Meta(h);
                        }
                        Err(e) => {
                            self.fail_conn(ci, e);
                            return;
                        }
                    }
                }
                Rx::Meta(h) => {
                    if c.avail() < h.meta_len() {
                        break;
                    }
                    match self.on_frame(ci, h) {
                        Ok(true) => {}
                        Ok(false) => return, // stalled: retried on tick or when a send completes
                        Err(e) => {
                            self.fail_conn(ci, e);
                            return;
                        }
                    }
                }
                Rx::Payload(h) => {
                    let (s, e) = (c.rx_start, c.rx_end);
                    let k = c.rx_list.fill_from(&c.rx[s..e]);
                    c.rx_start += k;
                    if c.rx_list.remaining() > 0 {
                        break;
                    }
                    self.payload_done(ci, h);
                }
                Rx::Drain { h, remaining, status } => {
                    let k = (c.avail() as u64).min(remaining);
                    c.rx_start += k as usize;
                    let remaining = remaining - k;
                    if remaining > 0 {
                        c.rx_state = Rx::Drain { h, remaining, status };
                        break;
                    }
                    c.rx_state = Rx::Header;
                    if h.kind == FrameKind::WriteReq {
                        c.txq.push_back(Tx::WriteAck { xfer: h.xfer, status });
                        self.kick_tx(ci);
                    }
                }
                Rx::Notify(h) => {
                    let bytes = c.rx_notif;
                    if !self.sh.notifs.push(&c.peer, bytes.bytes()) {
                        return; // retried on tick
                    }
                    c.rx_state = Rx::Header;
                    c.txq.push_back(Tx::WriteAck { xfer: h.xfer, status: status::OK });
                    self.kick_tx(ci);
                }
            }
        }
        self.kick_rx(ci);
    }

    /// Handle a frame whose header and descriptors/notification are staged. Returns
    /// `Ok(false)` when it must wait for room (the frame stays staged).
    fn on_frame(&mut self, ci: u32, h: Header) -> Result<bool> {
        let sh = self.sh.clone();
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return Ok(false) };
        let meta_start = c.rx_start;
        let notif_start = meta_start + h.ndesc as usize * DESC_LEN;
        let notif_end = notif_start + usize::from(h.notif);
        let target_room = c.txq.len() < TXQ_TARGET;
        // Who may send what: on a connection this agent dialled, replies only; on an accepted
        // one, the handshake and GetMeta until the initiator authenticated, then requests.
        let allowed = match (c.remote, h.kind) {
            (Some(_), FrameKind::WriteAck | FrameKind::ReadData) => true,
            (Some(_), _) => false,
            (None, FrameKind::Hello | FrameKind::Auth | FrameKind::GetMeta) => true,
            (None, FrameKind::WriteReq | FrameKind::ReadReq) => c.hs.is_open(),
            (None, _) => false,
        };
        if !allowed {
            return Err(XferError::Protocol("frame not allowed on this connection yet"));
        }
        match h.kind {
            FrameKind::Hello => {
                if !target_room {
                    return Ok(false);
                }
                if h.payload != 0 || h.ndesc != 0 {
                    return Err(XferError::Protocol("malformed Hello"));
                }
                let name = c.hs.hello(
                    &sh.key,
                    &c.rx[notif_start..notif_end],
                    &sh.name,
                    &mut c.hello_blob,
                )?;
                c.peer = Arc::from(String::from_utf8_lossy(name).as_ref());
                c.rx_start = notif_end;
                c.rx_state = Rx::Header;
                c.txq.push_back(Tx::HelloAck);
                self.kick_tx(ci);
            }
            FrameKind::Auth => {
                if h.payload != 0 || h.ndesc != 0 {
                    return Err(XferError::Protocol("malformed Auth"));
                }
                c.hs.auth(&sh.key, &c.rx[notif_start..notif_end])?;
                c.rx_start = notif_end;
                c.rx_state = Rx::Header;
            }
            FrameKind::GetMeta => {
                if !target_room {
                    return Ok(false);
                }
                c.rx_start = notif_end;
                c.rx_state = Rx::Header;
                c.txq.push_back(Tx::Meta);
                self.kick_tx(ci);
            }
            FrameKind::WriteReq => {
                if !target_room {
                    return Ok(false);
                }
                c.rx_notif = NotifBuf::new(&c.rx[notif_start..notif_end])?;
                c.rx_list.clear();
                let st = validate(&sh, &c.rx[meta_start..notif_start], h.payload, |p, l| {
                    c.rx_list.push(p, l)
                });
                c.rx_start = notif_end;
                c.rx_state = if st == status::OK {
                    Rx::Payload(h)
                } else {
                    Rx::Drain { h, remaining: h.payload, status: st }
                };
            }
            FrameKind::ReadReq => {
                if !target_room {
                    return Ok(false);
                }
                if c.reads.len() < READ_POOL {
                    c.reads.push(ReadEntry {
                        segs: Vec::with_capacity(MAX_DESCS),
                        notif: NotifBuf::EMPTY,
                        used: false,
                        notif_pending: false,
                    });
                }
                let Some(pool) = c.reads.iter().position(|r| !r.used) else { return Ok(false) };
                let notif = NotifBuf::new(&c.rx[notif_start..notif_end])?;
                let ent = &mut c.reads[pool];
                ent.segs.clear();
                let total: u64 = (0..h.ndesc as usize)
                    .map(|i| wire::decode_desc(&c.rx[meta_start + i * DESC_LEN..]).len)
                    .fold(0u64, u64::saturating_add);
                let st = validate(&sh, &c.rx[meta_start..notif_start], total, |p, l| {
                    ent.segs.push(MemSeg { ptr: p.cast_mut(), len: l, buf_index: u16::MAX });
                    true
                });
                ent.used = true;
                ent.notif = notif;
                c.rx_start = notif_end;
                c.rx_state = Rx::Header;
                c.txq.push_back(Tx::ReadData { xfer: h.xfer, status: st, pool });
                self.kick_tx(ci);
            }
            FrameKind::WriteAck => {
                c.rx_start = notif_end;
                c.rx_state = Rx::Header;
                let res =
                    if h.status == status::OK { Ok(()) } else { Err(wire::status_error(h.status)) };
                if let Some(slot) = self.own_xfer(ci, h.xfer) {
                    self.finish(slot, res);
                }
            }
            FrameKind::ReadData => {
                c.rx_start = notif_end;
                let Some(slot) = self.own_xfer(ci, h.xfer) else {
                    return Err(XferError::Protocol("reply to an unknown transfer"));
                };
                let Some(c) = self.conns[ci as usize].as_mut() else { return Ok(false) };
                if h.status != status::OK {
                    c.rx_state = Rx::Header;
                    self.finish(slot, Err(wire::status_error(h.status)));
                    return Ok(true);
                }
                let Some(p) = &self.xs[slot as usize].prep else {
                    return Err(XferError::Protocol("reply to an unknown transfer"));
                };
                if h.payload != p.inner.total {
                    return Err(XferError::Protocol("read reply length differs from request"));
                }
                c.rx_list.clear();
                for m in p.inner.local.iter() {
                    c.rx_list.push(m.ptr, m.len);
                }
                c.rx_state = Rx::Payload(h);
            }
            _ => return Err(XferError::Protocol("unexpected frame kind")),
        }
        Ok(true)
    }

    /// The slot of a transfer this connection carries, if `xfer` names a live one.
    fn own_xfer(&self, ci: u32, xfer: u64) -> Option<u32> {
        let slot = (xfer >> 32) as u32;
        let seq = xfer as u32;
        let x = self.xs.get(slot as usize)?;
        (x.active && x.seq == seq && x.conn == ci).then_some(slot)
    }

    fn payload_done(&mut self, ci: u32, h: Header) {
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
        match h.kind {
            FrameKind::WriteReq => {
                if c.rx_notif.len > 0 {
                    c.rx_state = Rx::Notify(h);
                } else {
                    c.rx_state = Rx::Header;
                    c.txq.push_back(Tx::WriteAck { xfer: h.xfer, status: status::OK });
                    self.kick_tx(ci);
                }
            }
            FrameKind::ReadData => {
                c.rx_state = Rx::Header;
                if let Some(slot) = self.own_xfer(ci, h.xfer) {
                    self.finish(slot, Ok(()));
                }
            }
            _ => c.rx_state = Rx::Header,
        }
    }

    fn kick_rx(&mut self, ci: u32) {
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
        if c.dead || c.rx_busy {
            return;
        }
        let fd = types::Fd(c.fd.as_raw_fd());
        let u = ud(TAG_RX, ci, c.seq);
        let e = match c.rx_state {
            Rx::Header | Rx::Meta(_) => {
                let need = match c.rx_state {
                    Rx::Meta(h) => h.meta_len() - c.avail(),
                    _ => HEADER_LEN - c.avail(),
                };
                if c.rx_start == c.rx_end {
                    c.rx_start = 0;
                    c.rx_end = 0;
                }
                if RX_CAP - c.rx_end < need.max(RX_SMALL.min(RX_CAP / 2)) {
                    c.rx.copy_within(c.rx_start..c.rx_end, 0);
                    c.rx_end -= c.rx_start;
                    c.rx_start = 0;
                }
                let (len, flags) = match c.rx_state {
                    Rx::Meta(_) => (need, libc::MSG_WAITALL),
                    _ => (RX_SMALL.min(RX_CAP - c.rx_end), 0),
                };
                // SAFETY: `rx_end + len <= RX_CAP` (compacted above); the buffer is boxed
                // and lives until the connection is freed, which waits for this op.
                let p = unsafe { c.rx.as_mut_ptr().add(c.rx_end) };
                opcode::Recv::new(fd, p, len as u32).flags(flags).build()
            }
            Rx::Payload(_) => {
                let m = c.rx_list.msg_ptr();
                opcode::RecvMsg::new(fd, m).flags(libc::MSG_WAITALL as u32).build()
            }
            Rx::Drain { remaining, .. } => {
                c.rx_start = 0;
                c.rx_end = 0;
                let len = (remaining as usize).min(RX_CAP);
                opcode::Recv::new(fd, c.rx.as_mut_ptr(), len as u32).build()
            }
            Rx::Notify(_) => return,
        };
        c.rx_busy = true;
        self.push(e.user_data(u));
    }

    // ---------------------------------------------------------------- send path

    fn kick_tx(&mut self, ci: u32) {
        let sh = self.sh.clone();
        // Transfers cancelled while they waited in the queue end here, unsent.
        loop {
            let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
            if c.dead || c.tx_busy {
                return;
            }
            let Some(&Tx::Req { slot }) = c.txq.front() else { break };
            if !sh.slots.cancel_requested(slot, self.xs[slot as usize].seq) {
                break;
            }
            c.txq.pop_front();
            self.finish(slot, Err(XferError::Cancelled));
        }
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
        if c.txq.is_empty() {
            return;
        }
        c.tx_batch.clear();
        c.tx_list.clear();
        while let Some(&t) = c.txq.front() {
            if c.tx_batch.len() == TX_BATCH {
                break;
            }
            let need = match t {
                Tx::Req { slot } => {
                    let x = &self.xs[slot as usize];
                    if !c.tx_batch.is_empty() && sh.slots.cancel_requested(slot, x.seq) {
                        break; // purged at the front of the next batch
                    }
                    let p = x.prep.as_ref().map_or(0, |p| p.inner.local.len());
                    3 + if x.op == Op::Write { p } else { 0 }
                }
                Tx::ReadData { pool, .. } => 1 + c.reads[pool].segs.len(),
                _ => 2,
            };
            if c.tx_list.n + need > IOV_CAP {
                break;
            }
            c.txq.pop_front();
            let hi = c.tx_batch.len();
            c.tx_batch.push(t);
            let hp = c.tx_hdrs[hi].as_ptr();
            match t {
                Tx::Req { slot } => {
                    let x = &self.xs[slot as usize];
                    let Some(p) = x.prep.as_ref() else {
                        c.tx_batch.pop();
                        continue;
                    };
                    let mut h = Header::new(if x.op == Op::Write {
                        FrameKind::WriteReq
                    } else {
                        FrameKind::ReadReq
                    });
                    h.ndesc = p.inner.ndesc;
                    h.notif = x.notif.len;
                    h.xfer = u64::from(slot) << 32 | u64::from(x.seq);
                    h.payload = if x.op == Op::Write { p.inner.total } else { 0 };
                    h.encode(&mut c.tx_hdrs[hi]);
                    c.tx_list.push(hp, HEADER_LEN);
                    c.tx_list.push(p.inner.wire.as_ptr(), p.inner.wire.len());
                    c.tx_list.push(x.notif.buf.as_ptr(), usize::from(x.notif.len));
                    if x.op == Op::Write {
                        for m in p.inner.local.iter() {
                            c.tx_list.push(m.ptr, m.len);
                        }
                    }
                }
                Tx::WriteAck { xfer, status } => {
                    let mut h = Header::new(FrameKind::WriteAck);
                    h.xfer = xfer;
                    h.status = status;
                    h.encode(&mut c.tx_hdrs[hi]);
                    c.tx_list.push(hp, HEADER_LEN);
                }
                Tx::ReadData { xfer, status, pool } => {
                    let ent = &c.reads[pool];
                    let mut h = Header::new(FrameKind::ReadData);
                    h.xfer = xfer;
                    h.status = status;
                    if status == status::OK {
                        h.payload = ent.segs.iter().map(|s| s.len as u64).sum();
                    }
                    h.encode(&mut c.tx_hdrs[hi]);
                    c.tx_list.push(hp, HEADER_LEN);
                    if status == status::OK {
                        for s in &ent.segs {
                            c.tx_list.push(s.ptr, s.len);
                        }
                    }
                }
                Tx::HelloAck => {
                    // The blob was built when the Hello arrived; one Hello per connection.
                    let mut h = Header::new(FrameKind::HelloAck);
                    h.xfer = sh.instance;
                    h.notif = c.hello_blob.len() as u16;
                    h.encode(&mut c.tx_hdrs[hi]);
                    c.tx_list.push(hp, HEADER_LEN);
                    c.tx_list.push(c.hello_blob.as_ptr(), c.hello_blob.len());
                }
                Tx::Meta => {
                    // Served without authentication: never with the key.
                    c.meta_blob = sh.metadata().without_key().encode();
                    let mut h = Header::new(FrameKind::Meta);
                    h.payload = c.meta_blob.len() as u64;
                    h.encode(&mut c.tx_hdrs[hi]);
                    c.tx_list.push(hp, HEADER_LEN);
                    c.tx_list.push(c.meta_blob.as_ptr(), c.meta_blob.len());
                }
            }
        }
        if c.tx_batch.is_empty() {
            return;
        }
        let m = c.tx_list.msg_ptr();
        let u = ud(TAG_TX, ci, c.seq);
        c.tx_busy = true;
        let e = send_op(c.fd.as_raw_fd(), m, c.zc);
        let k = &self.sh.counters;
        k.tcp_sends.fetch_add(1, Ordering::Relaxed);
        if c.zc {
            k.tcp_zc_sends.fetch_add(1, Ordering::Relaxed);
        }
        self.push(e.user_data(u));
    }

    fn tx_done(&mut self, ci: u32, seq: u32, res: i32, flags: u32) {
        let auto = self.sh.cfg.tcp_zero_copy == ZeroCopy::Auto;
        let c = match self.conns.get_mut(ci as usize) {
            Some(Some(c)) if c.seq == seq => c,
            _ => return,
        };
        if io_uring::cqueue::notif(flags) {
            // The kernel let go of a zero-copy send's pages. Where it had to copy anyway
            // (loopback, veth) zero-copy only costs: fall back to plain sends for good.
            c.zc_notifs = c.zc_notifs.saturating_sub(1);
            if res & NOTIF_USAGE_ZC_COPIED != 0 {
                self.sh.counters.tcp_zc_copied.fetch_add(1, Ordering::Relaxed);
                if auto {
                    c.zc = false;
                }
            }
            if c.zc_notifs > 0 {
                return;
            }
            if c.dead {
                c.tx_busy = false;
                self.maybe_free(ci);
                return;
            }
            if c.tx_list.remaining() > 0 || !c.tx_busy {
                return; // a resubmitted remainder is still in flight
            }
            // Fall through: the batch's bytes were all sent earlier; release it now.
        } else {
            if io_uring::cqueue::more(flags) {
                c.zc_notifs += 1;
            }
            if c.dead {
                if c.zc_notifs == 0 {
                    c.tx_busy = false;
                }
                self.maybe_free(ci);
                return;
            }
            if res < 0 {
                let e = self.conn_error(ci, -res);
                let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
                if c.zc_notifs == 0 {
                    c.tx_busy = false;
                }
                self.fail_conn(ci, e);
                return;
            }
            c.tx_list.advance(res as usize);
            if c.tx_list.remaining() > 0 {
                // Partial send (interrupted): resubmit the rest of the same batch.
                let m = c.tx_list.msg_ptr();
                let e = send_op(c.fd.as_raw_fd(), m, c.zc).user_data(ud(TAG_TX, ci, seq));
                self.push(e);
                return;
            }
            if c.zc_notifs > 0 {
                return; // released when the notification arrives
            }
        }
        let Some(Some(c)) = self.conns.get_mut(ci as usize) else { return };
        c.tx_busy = false;
        if c.dead {
            self.maybe_free(ci);
            return;
        }
        let mut unstall = false;
        for k in 0..c.tx_batch.len() {
            if let Tx::ReadData { pool, .. } = c.tx_batch[k] {
                let ent = &mut c.reads[pool];
                if ent.notif.len > 0 && !self.sh.notifs.push(&c.peer, ent.notif.bytes()) {
                    ent.notif_pending = true; // retried on tick
                } else {
                    ent.used = false;
                }
                unstall = true;
            }
        }
        c.tx_batch.clear();
        let stalled = matches!(c.rx_state, Rx::Meta(_)) || unstall;
        self.kick_tx(ci);
        if stalled {
            self.process_rx(ci);
        }
    }
}

/// Validate wire descriptors against local memory regions; on success `push` receives each
/// segment's pointer and length. Returns a wire status code.
fn validate(
    sh: &Shared,
    descs: &[u8],
    payload: u64,
    mut push: impl FnMut(*const u8, usize) -> bool,
) -> u16 {
    let mut total = 0u64;
    for d in descs.chunks_exact(DESC_LEN) {
        let d: Desc = wire::decode_desc(d);
        let Some(r) = sh.regions.get(d.region.0) else { return status::UNKNOWN_REGION };
        if r.kind() != RegionKind::Mem {
            return status::UNSUPPORTED;
        }
        if d.check_bounds(r.len).is_err() {
            return status::OUT_OF_BOUNDS;
        }
        let Some(base) = r.mem_ptr() else { return status::UNSUPPORTED };
        // SAFETY: bounds checked just above against this mapping.
        let p = unsafe { base.add(d.offset as usize) };
        if !push(p, d.len as usize) {
            return status::PROTOCOL;
        }
        total += d.len;
    }
    if total != payload { status::PROTOCOL } else { status::OK }
}

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel had to copy.
const SEND_ZC_REPORT_USAGE: u16 = 8;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, set in a notification's result when it copied.
const NOTIF_USAGE_ZC_COPIED: i32 = i32::MIN;

/// The send op for a connection's batch: plain `sendmsg`, or `sendmsg_zc` asking the kernel
/// to report whether it really avoided the copy.
fn send_op(fd: RawFd, m: *const libc::msghdr, zc: bool) -> squeue::Entry {
    let flags = (libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32;
    if zc {
        opcode::SendMsgZc::new(types::Fd(fd), m).ioprio(SEND_ZC_REPORT_USAGE).flags(flags).build()
    } else {
        opcode::SendMsg::new(types::Fd(fd), m).flags(flags).build()
    }
}

fn set_nodelay(fd: RawFd) -> std::io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a live c_int.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// A whole frame read by a blocking helper: header, descriptors + notification, payload.
type Frame = (Header, Vec<u8>, Vec<u8>);

fn read_frame(s: &mut TcpStream, max_payload: u64) -> std::io::Result<Result<Frame>> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb)?;
    let h = match Header::decode(&hb) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    let mut meta = vec![0u8; h.meta_len()];
    s.read_exact(&mut meta)?;
    if h.payload > max_payload {
        return Ok(Err(XferError::Protocol("payload too large")));
    }
    let mut payload = vec![0u8; h.payload as usize];
    s.read_exact(&mut payload)?;
    Ok(Ok((h, meta, payload)))
}

/// Connect to a remote agent's TCP endpoint and authenticate both ways (blocking; every read
/// bounded by `timeout`): Hello, check the HelloAck's proof against the key in `md`, Auth.
pub(crate) fn connect(
    sh: &Shared,
    addr: SocketAddr,
    md: &AgentMetadata,
    timeout: Duration,
) -> Result<OwnedFd> {
    let peer = md.name.as_str();
    let gone = |_| XferError::RemoteGone(peer.to_owned());
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(gone)?;
    s.set_nodelay(true).map_err(|e| XferError::io("setsockopt", &e))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| XferError::io("setsockopt", &e))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| XferError::io("setsockopt", &e))?;
    let dial = Dial::new()?;
    let hello = dial.hello(&sh.name);
    let mut h = Header::new(FrameKind::Hello);
    h.xfer = sh.instance;
    h.notif = hello.len() as u16;
    let mut frame = [0u8; HEADER_LEN + MAX_NOTIF];
    let mut hb = [0u8; HEADER_LEN];
    h.encode(&mut hb);
    frame[..HEADER_LEN].copy_from_slice(&hb);
    frame[HEADER_LEN..HEADER_LEN + hello.len()].copy_from_slice(&hello);
    s.write_all(&frame[..HEADER_LEN + hello.len()]).map_err(gone)?;
    let (ack, notif, _) = read_frame(&mut s, 0).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => XferError::Timeout,
        _ => XferError::RemoteGone(peer.to_owned()),
    })??;
    if ack.kind != FrameKind::HelloAck || ack.ndesc != 0 {
        return Err(XferError::Protocol("expected HelloAck"));
    }
    if ack.xfer != md.instance {
        return Err(XferError::RemoteGone(peer.to_owned())); // another instance answers there
    }
    let proof_i = dial.check_ack(&md.key, &notif, peer)?;
    let mut a = Header::new(FrameKind::Auth);
    a.notif = PROOF_LEN as u16;
    a.encode(&mut hb);
    frame[..HEADER_LEN].copy_from_slice(&hb);
    frame[HEADER_LEN..HEADER_LEN + PROOF_LEN].copy_from_slice(&proof_i);
    s.write_all(&frame[..HEADER_LEN + PROOF_LEN]).map_err(gone)?;
    s.set_write_timeout(None).map_err(|e| XferError::io("setsockopt", &e))?;
    s.set_read_timeout(None).map_err(|e| XferError::io("setsockopt", &e))?;
    // SAFETY: into_raw_fd hands over sole ownership of the socket.
    Ok(unsafe { OwnedFd::from_raw_fd(s.into_raw_fd()) })
}

/// Fetch an agent's metadata over TCP.
pub(crate) fn fetch_metadata(addr: SocketAddr, timeout: Duration) -> Result<AgentMetadata> {
    let gone = |_| XferError::RemoteGone(addr.to_string());
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(gone)?;
    s.set_read_timeout(Some(timeout)).map_err(|e| XferError::io("setsockopt", &e))?;
    let mut hb = [0u8; HEADER_LEN];
    Header::new(FrameKind::GetMeta).encode(&mut hb);
    s.write_all(&hb).map_err(gone)?;
    let (h, _, payload) = read_frame(&mut s, MAX_META).map_err(gone)??;
    if h.kind != FrameKind::Meta {
        return Err(XferError::Protocol("expected Meta"));
    }
    AgentMetadata::decode(&payload)
}
