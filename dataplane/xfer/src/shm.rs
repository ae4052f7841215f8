//! Same-host backend: the Unix control channel (fd passing, notifications, liveness) and the
//! copy thread that moves bytes between this process and a peer's mapped memfd regions.
//!
//! Connect once: the initiator says Hello, checks the peer's proof and proves it holds the
//! peer's key ([`crate::auth`]; the peer hands out nothing before that), asks for its peer's
//! region fds (SCM_RIGHTS), maps every memory region shared and registers every file fd with
//! io_uring. From then on a
//! transfer is pointer arithmetic and a copy in the initiator's copy thread; only a small
//! notification frame travels, and only when asked for. The control thread watches each such
//! socket for hang-up, which is how a dead peer turns into `RemoteGone` instead of a hang.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::agent::{Prepped, Shared};
use crate::auth::{Dial, Handshake, PROOF_LEN};
use crate::copy::{copy_block_unfenced, store_fence};
use crate::desc::Op;
use crate::error::{Result, XferError};
use crate::meta::AgentMetadata;
use crate::region::{MemMap, RegionId, RegionKind, to_usize};
use crate::slots::NotifBuf;
use crate::wire::{FrameKind, HEADER_LEN, Header, MAX_NOTIF};

/// Most same-host peers one agent serves at once.
const MAX_CTL_CONNS: usize = 256;
/// Region fds per Fds frame (below the kernel's SCM_MAX_FD of 253).
const FDS_PER_FRAME: usize = 128;
/// Bytes per region entry in an Fds frame: id u32, kind u32, len u64, map_len u64, base u64.
const FD_ENTRY: usize = 32;

/// A mapped or registered region of a same-host peer (a copyable view).
#[derive(Debug, Clone, Copy)]
pub(crate) enum PeerRegion {
    Mem(*mut u8),
    File { fixed: u32, base: u64 },
}

#[derive(Debug)]
enum Owned {
    Mem(MemMap),
    File { _fd: OwnedFd, fixed: u32, base: u64 },
}

/// The initiator's end of a same-host channel and the peer regions it mapped.
#[derive(Debug)]
pub(crate) struct LocalPeer {
    sock: UnixStream,
    send_lock: Mutex<()>,
    regions: Vec<(RegionId, u64, Owned)>,
}

impl LocalPeer {
    /// The mapped view of region `id`, with its length.
    pub(crate) fn region(&self, id: RegionId, md: &AgentMetadata) -> Result<(u64, PeerRegion)> {
        let (_, len, o) =
            self.regions.iter().find(|(r, _, _)| *r == id).ok_or(if md.region(id).is_some() {
                XferError::Unsupported("remote region was not shared with this agent")
            } else {
                XferError::UnknownRegion(id.0)
            })?;
        Ok((
            *len,
            match o {
                Owned::Mem(m) => PeerRegion::Mem(m.ptr()),
                Owned::File { fixed, base, .. } => PeerRegion::File { fixed: *fixed, base: *base },
            },
        ))
    }

    /// A duplicate of the socket for the control thread to watch for hang-up.
    pub(crate) fn watch_fd(&self) -> Result<OwnedFd> {
        self.sock.as_fd().try_clone_to_owned().map_err(|e| XferError::io("dup", &e))
    }

    /// Send a notification frame to the peer.
    pub(crate) fn send_notif(&self, peer: &str, from_instance: u64, msg: &[u8]) -> Result<()> {
        let mut frame = [0u8; HEADER_LEN + MAX_NOTIF];
        let mut h = Header::new(FrameKind::Notif);
        h.notif = msg.len() as u16;
        h.xfer = from_instance;
        let mut hb = [0u8; HEADER_LEN];
        h.encode(&mut hb);
        frame[..HEADER_LEN].copy_from_slice(&hb);
        frame[HEADER_LEN..HEADER_LEN + msg.len()].copy_from_slice(msg);
        let _g = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
        (&self.sock).write_all(&frame[..HEADER_LEN + msg.len()]).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => XferError::Timeout,
            _ => XferError::RemoteGone(peer.to_owned()),
        })
    }
}

fn abstract_addr(name: &str) -> Result<UnixAddr> {
    UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| XferError::io("unix address", &e))
}

/// Bind the agent's abstract Unix listener.
pub(crate) fn listen(name: &str) -> Result<UnixListener> {
    let l = UnixListener::bind_addr(&abstract_addr(name)?)
        .map_err(|e| XferError::io("bind unix", &e))?;
    l.set_nonblocking(true).map_err(|e| XferError::io("set_nonblocking", &e))?;
    Ok(l)
}

fn header_bytes(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    h.encode(&mut b);
    b
}

fn read_header(s: &mut UnixStream) -> std::io::Result<Result<Header>> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b)?;
    Ok(Header::decode(&b))
}

fn io_gone(peer: &str) -> impl Fn(std::io::Error) -> XferError + '_ {
    move |e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => XferError::Timeout,
        _ => XferError::RemoteGone(peer.to_owned()),
    }
}

/// Connect to a same-host peer, authenticate (both ways), fetch and map its regions.
pub(crate) fn connect_peer(
    sh: &Shared,
    unix: &str,
    md: &AgentMetadata,
    reg_file: impl Fn(RawFd) -> Result<u32>,
) -> Result<LocalPeer> {
    let gone = io_gone(&md.name);
    let mut sock = UnixStream::connect_addr(&abstract_addr(unix)?)
        .map_err(|_| XferError::RemoteGone(md.name.clone()))?;
    let t = Some(sh.cfg.connect_timeout);
    sock.set_read_timeout(t).map_err(|e| XferError::io("setsockopt", &e))?;
    sock.set_write_timeout(Some(sh.cfg.xfer_timeout))
        .map_err(|e| XferError::io("setsockopt", &e))?;
    let dial = Dial::new()?;
    let hello = dial.hello(&sh.name);
    let mut h = Header::new(FrameKind::Hello);
    h.xfer = sh.instance;
    h.notif = hello.len() as u16;
    let mut frame = header_bytes(&h).to_vec();
    frame.extend_from_slice(&hello);
    sock.write_all(&frame).map_err(&gone)?;
    let ack = read_header(&mut sock).map_err(&gone)??;
    if ack.ndesc != 0 || ack.payload != 0 {
        return Err(XferError::Protocol("malformed HelloAck"));
    }
    let mut notif = vec![0u8; usize::from(ack.notif)];
    sock.read_exact(&mut notif).map_err(&gone)?;
    if ack.kind != FrameKind::HelloAck || ack.xfer != md.instance {
        return Err(XferError::RemoteGone(md.name.clone()));
    }
    let proof_i = dial.check_ack(&md.key, &notif, &md.name)?;
    let mut a = Header::new(FrameKind::Auth);
    a.notif = PROOF_LEN as u16;
    let mut frame = header_bytes(&a).to_vec();
    frame.extend_from_slice(&proof_i);
    sock.write_all(&frame).map_err(&gone)?;
    let ids: Vec<u32> = md.regions.iter().map(|r| r.id.0).collect();
    let mut regions = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(FDS_PER_FRAME) {
        let mut req = Header::new(FrameKind::GetFds);
        req.payload = (chunk.len() * 4) as u64;
        let mut frame = header_bytes(&req).to_vec();
        for id in chunk {
            frame.extend_from_slice(&id.to_le_bytes());
        }
        sock.write_all(&frame).map_err(&gone)?;
        let (hdr, body, fds) = recv_fds_frame(&mut sock).map_err(&gone)?;
        let hdr = hdr?;
        if hdr.kind != FrameKind::Fds || body.len() % FD_ENTRY != 0 {
            return Err(XferError::Protocol("bad Fds reply"));
        }
        let mut fds = fds.into_iter();
        for e in body.chunks(FD_ENTRY) {
            let u32_at = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]);
            let u64_at = |i: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&e[i..i + 8]);
                u64::from_le_bytes(a)
            };
            let (id, kind, len, map_len, base) =
                (u32_at(0), u32_at(4), u64_at(8), u64_at(16), u64_at(24));
            if kind == u32::MAX {
                continue; // the peer no longer has it
            }
            let fd = fds.next().ok_or(XferError::Protocol("Fds reply lacks descriptors"))?;
            let owned = if kind == RegionKind::Mem as u32 {
                if len > map_len {
                    return Err(XferError::Protocol("region longer than its mapping"));
                }
                Owned::Mem(MemMap::map_shared(fd.as_raw_fd(), to_usize(map_len)?, sh.cfg.prefault)?)
            } else {
                let fixed = reg_file(fd.as_raw_fd())?;
                Owned::File { _fd: fd, fixed, base }
            };
            regions.push((RegionId(id), len, owned));
        }
    }
    sock.set_read_timeout(None).map_err(|e| XferError::io("setsockopt", &e))?;
    Ok(LocalPeer { sock, send_lock: Mutex::new(()), regions })
}

/// Receive one frame that may carry SCM_RIGHTS descriptors.
// The cmsg walk is one unit: the CMSG_* accessors and the reads they bound share one argument.
#[allow(clippy::multiple_unsafe_ops_per_block)]
fn recv_fds_frame(
    sock: &mut UnixStream,
) -> std::io::Result<(Result<Header>, Vec<u8>, Vec<OwnedFd>)> {
    const CMSG_CAP: usize = 64 + FDS_PER_FRAME * 4;
    let mut buf = vec![0u8; HEADER_LEN + FDS_PER_FRAME * FD_ENTRY];
    let mut cbuf = [0u64; CMSG_CAP / 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is a valid "no address, no iov" value we then fill in.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_CAP;
    // SAFETY: `msg` points at live buffers sized as declared; the fd is a valid socket.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the CMSG_* macros walk the control buffer the kernel just filled, bounded by
    // `msg_controllen`; SCM_RIGHTS payloads are arrays of c_int fds now owned by us.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    let mut got = n as usize;
    if got == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if got < HEADER_LEN {
        sock.read_exact(&mut buf[got..HEADER_LEN])?;
        got = HEADER_LEN;
    }
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(&buf[..HEADER_LEN]);
    let hdr = Header::decode(&hb);
    let plen = match &hdr {
        Ok(h) => usize::try_from(h.payload).unwrap_or(usize::MAX).min(buf.len() - HEADER_LEN),
        Err(_) => 0,
    };
    if got < HEADER_LEN + plen {
        sock.read_exact(&mut buf[got..HEADER_LEN + plen])?;
    }
    Ok((hdr, buf[HEADER_LEN..HEADER_LEN + plen].to_vec(), fds))
}

/// Send bytes with SCM_RIGHTS descriptors attached.
// Building the one cmsghdr is one unit, covered by one SAFETY argument.
#[allow(clippy::multiple_unsafe_ops_per_block)]
fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    const CMSG_CAP: usize = 64 + FDS_PER_FRAME * 4;
    let mut cbuf = [0u64; CMSG_CAP / 8];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: zeroed msghdr, then filled with pointers to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * 4) as u32;
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer holds `space <= CMSG_CAP` bytes; we write one cmsghdr
        // and `fds.len()` ints inside it, as CMSG_FIRSTHDR/CMSG_DATA lay out.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&raw const msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
            let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(*fd);
            }
        }
    }
    // SAFETY: `msg` describes live buffers; MSG_NOSIGNAL turns a dead peer into EPIPE.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = n as usize;
    if n < bytes.len() {
        (&*sock).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// One accepted same-host connection on the target side.
#[derive(Debug)]
struct Accepted {
    sock: UnixStream,
    peer: Arc<str>,
    /// The handshake: nothing but Hello and Auth is served before it is open.
    hs: Handshake,
    /// A notification waiting for room in the queue (back-pressure on this peer).
    blocked: Option<NotifBuf>,
    /// The connection failed and is dropped after this poll round.
    dead: bool,
    /// When it was accepted: one that has not authenticated within the connect timeout is
    /// closed (so that idle strangers cannot hold the connection slots).
    since: std::time::Instant,
}

/// Start the control thread: accepts same-host peers, serves Hello/GetFds, receives
/// notifications, and watches initiator-side sockets for hang-up.
pub(crate) fn start_control(sh: Arc<Shared>, listener: UnixListener) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("xfer-ctl-{}", sh.name))
        .spawn(move || control_loop(&sh, &listener))
        .map_err(|e| XferError::io("spawn", &e))
}

fn control_loop(sh: &Shared, listener: &UnixListener) {
    let mut conns: Vec<Accepted> = Vec::new();
    let mut watches: Vec<(OwnedFd, u32)> = Vec::new();
    let mut pfds: Vec<libc::pollfd> = Vec::new();
    while !sh.shutdown.load(Ordering::SeqCst) {
        watches.append(&mut sh.ctl_watch.lock().unwrap_or_else(|p| p.into_inner()));
        pfds.clear();
        let pfd = |fd: RawFd, events: i16| libc::pollfd { fd, events, revents: 0 };
        pfds.push(pfd(sh.ctl_wake.as_raw_fd(), libc::POLLIN));
        pfds.push(pfd(listener.as_raw_fd(), libc::POLLIN));
        let mut any_blocked = false;
        for c in &conns {
            let ev = if c.blocked.is_some() {
                any_blocked = true;
                0
            } else {
                libc::POLLIN
            };
            pfds.push(pfd(c.sock.as_raw_fd(), ev));
        }
        for (fd, _) in &watches {
            pfds.push(pfd(fd.as_raw_fd(), libc::POLLRDHUP));
        }
        let timeout = if any_blocked { 1 } else { 500 };
        // SAFETY: `pfds` is a live, correctly sized array of pollfd.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            continue;
        }
        if pfds[0].revents != 0 {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into a live u64 from our eventfd.
            let _ = unsafe { libc::read(sh.ctl_wake.as_raw_fd(), (&raw mut v).cast(), 8) };
        }
        // Serve readable peers; no allocation here (this loop runs per notification).
        let nconns = conns.len();
        for (i, c) in conns.iter_mut().enumerate() {
            if let Some(b) = c.blocked {
                if sh.notifs.push(&c.peer, b.bytes()) {
                    c.blocked = None;
                }
                continue;
            }
            if pfds[2 + i].revents != 0 && serve_frame(sh, c).is_err() {
                c.dead = true;
            }
            if !c.hs.is_open() && c.since.elapsed() > sh.cfg.connect_timeout {
                c.dead = true;
            }
        }
        conns.retain(|c| !c.dead);
        let hung = |k: usize| {
            pfds[2 + nconns + k].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
        };
        let mut k = 0;
        watches.retain(|(_, remote)| {
            let gone = hung(k);
            k += 1;
            if gone && let Ok(r) = sh.remote(*remote) {
                r.alive.store(false, Ordering::Release);
            }
            !gone
        });
        if pfds[1].revents != 0 {
            while let Ok((s, _)) = listener.accept() {
                if conns.len() >= MAX_CTL_CONNS {
                    continue; // dropped: the peer sees EOF
                }
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                conns.push(Accepted {
                    sock: s,
                    peer: Arc::from("?"),
                    hs: Handshake::Fresh,
                    blocked: None,
                    dead: false,
                    since: std::time::Instant::now(),
                });
            }
        }
    }
}

/// Serve one frame from an accepted peer. `Err` drops the connection: any frame but Hello
/// and Auth before the peer authenticated, a wrong proof, a malformed frame.
fn serve_frame(sh: &Shared, c: &mut Accepted) -> std::io::Result<()> {
    let invalid = || std::io::Error::from(std::io::ErrorKind::InvalidData);
    let h = match read_header(&mut c.sock)? {
        Ok(h) => h,
        Err(_) => return Err(invalid()),
    };
    // Same-host frames carry no descriptors, and only GetFds a payload.
    if h.ndesc != 0 || (h.kind != FrameKind::GetFds && h.payload != 0) {
        return Err(invalid());
    }
    let mut notif = [0u8; MAX_NOTIF];
    let nl = usize::from(h.notif);
    c.sock.read_exact(&mut notif[..nl])?;
    match h.kind {
        FrameKind::Hello => {
            let mut ack = Vec::with_capacity(MAX_NOTIF);
            let name =
                c.hs.hello(&sh.key, &notif[..nl], &sh.name, &mut ack).map_err(|_| invalid())?;
            c.peer = Arc::from(String::from_utf8_lossy(name).as_ref());
            let mut a = Header::new(FrameKind::HelloAck);
            a.xfer = sh.instance;
            a.notif = ack.len() as u16;
            let mut out = header_bytes(&a).to_vec();
            out.extend_from_slice(&ack);
            (&c.sock).write_all(&out)
        }
        FrameKind::Auth => c.hs.auth(&sh.key, &notif[..nl]).map_err(|_| invalid()),
        FrameKind::GetFds if c.hs.is_open() => {
            let n = usize::try_from(h.payload).unwrap_or(usize::MAX);
            if n % 4 != 0 || n / 4 > FDS_PER_FRAME {
                return Err(std::io::ErrorKind::InvalidData.into());
            }
            let mut ids = vec![0u8; n];
            c.sock.read_exact(&mut ids)?;
            let mut body = Vec::with_capacity(n / 4 * FD_ENTRY);
            let mut fds = Vec::new();
            for id in ids.chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])) {
                let (kind, len, map_len, base) = match sh.regions.get(id) {
                    Some(r) => {
                        fds.push(r.fd());
                        let map_len = match r.mem_ptr() {
                            Some(_) => file_len(r.fd()).unwrap_or(r.len),
                            None => r.len,
                        };
                        (r.kind() as u32, r.len, map_len, r.file_base())
                    }
                    None => (u32::MAX, 0, 0, 0),
                };
                for v in [id, kind] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
                for v in [len, map_len, base] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
            }
            let mut r = Header::new(FrameKind::Fds);
            r.payload = body.len() as u64;
            let mut out = header_bytes(&r).to_vec();
            out.extend_from_slice(&body);
            send_with_fds(&c.sock, &out, &fds)
        }
        FrameKind::Notif if c.hs.is_open() => {
            if !sh.notifs.push(&c.peer, &notif[..nl]) {
                c.blocked = NotifBuf::new(&notif[..nl]).ok();
            }
            Ok(())
        }
        _ => Err(std::io::ErrorKind::InvalidData.into()),
    }
}

fn file_len(fd: RawFd) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat buffer on a valid fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &raw mut st) } == 0).then_some(st.st_size as u64)
}

/// A shared-memory copy job.
#[derive(Debug, Clone)]
pub(crate) struct ShmJob {
    pub(crate) idx: u32,
    pub(crate) seq: u32,
    pub(crate) op: Op,
    pub(crate) prep: Prepped,
    pub(crate) notif: NotifBuf,
}

/// Transfers at least this large are split between the copy threads waiting idle when one
/// takes it (with several in flight nobody waits, and each thread streams its own).
pub(crate) const SPLIT_MIN: usize = 1 << 20;
/// Split points are rounded to this many bytes, so streaming stores stay line-aligned.
const SPLIT_ALIGN: usize = 4096;

/// Work for the copy threads.
enum Work {
    /// A whole transfer, posted by the agent.
    Job(ShmJob),
    /// Bytes `[from, to)` of a split transfer.
    Part { job: ShmJob, from: usize, to: usize },
}

struct Queue {
    work: VecDeque<Work>,
    /// Threads waiting for work, and parts queued for them.
    idle: usize,
    parts: usize,
    closed: bool,
}

/// The copy threads' queue: transfers at the back, parts of split transfers at the front (so
/// a split transfer finishes first). Its capacity (slots + threads) is reserved up front:
/// transfers are at most one per slot and parts at most one per idle thread, so pushing
/// never allocates.
pub(crate) struct CopyQueue {
    q: Mutex<Queue>,
    cv: Condvar,
    /// Per slot: parts of its transfer still copying, and whether a cancel stopped one.
    left: Box<[AtomicU32]>,
    stopped: Box<[AtomicBool]>,
    threads: usize,
}

impl std::fmt::Debug for CopyQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyQueue({} threads)", self.threads)
    }
}

impl CopyQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue a transfer for the copy threads.
    pub(crate) fn push(&self, job: ShmJob) -> Result<()> {
        let mut g = self.lock();
        if g.closed {
            return Err(XferError::Shutdown);
        }
        if g.work.len() >= g.work.capacity() {
            return Err(XferError::Full("copy queue"));
        }
        g.work.push_back(Work::Job(job));
        drop(g);
        self.cv.notify_one();
        Ok(())
    }

    /// Let the copy threads exit once the queue is empty.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.cv.notify_all();
    }
}

/// Start the copy threads (`copy_threads`, at least one) on one queue.
pub(crate) fn start_copier(sh: &Arc<Shared>) -> Result<(Arc<CopyQueue>, Vec<JoinHandle<()>>)> {
    let threads = sh.cfg.copy_threads.max(1);
    let slots = sh.slots.capacity();
    let cq = Arc::new(CopyQueue {
        q: Mutex::new(Queue {
            work: VecDeque::with_capacity(slots + threads),
            idle: 0,
            parts: 0,
            closed: false,
        }),
        cv: Condvar::new(),
        left: (0..slots).map(|_| AtomicU32::new(0)).collect(),
        stopped: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        threads,
    });
    let mut handles = Vec::with_capacity(threads);
    for i in 0..threads {
        let (sh, cq2) = (sh.clone(), cq.clone());
        let h = std::thread::Builder::new()
            .name(format!("xfer-copy-{}-{i}", sh.name))
            .spawn(move || copier(&sh, &cq2));
        match h {
            Ok(h) => handles.push(h),
            Err(e) => {
                cq.close();
                return Err(XferError::io("spawn", &e));
            }
        }
    }
    Ok((cq, handles))
}

/// One copy thread: take the next work, copy it; whoever copies the last part of a transfer
/// completes it. Exits when the queue is closed and empty.
fn copier(sh: &Shared, cq: &CopyQueue) {
    loop {
        let work = {
            let mut g = cq.lock();
            loop {
                if let Some(w) = g.work.pop_front() {
                    if matches!(w, Work::Part { .. }) {
                        g.parts -= 1;
                    }
                    break w;
                }
                if g.closed {
                    return;
                }
                g.idle += 1;
                g = cq.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                g.idle -= 1;
            }
        };
        match work {
            Work::Job(job) => run_job(sh, cq, job),
            Work::Part { job, from, to } => {
                let cancelled = || sh.slots.cancel_requested(job.idx, job.seq);
                let ok = copy_range(&job.prep, job.op, from, to, sh.cfg.nt_threshold, cancelled);
                part_done(sh, cq, &job, true, ok);
            }
        }
    }
}

/// Start a transfer: check its peer, split it when threads wait idle, copy this thread's
/// share.
fn run_job(sh: &Shared, cq: &CopyQueue, job: ShmJob) {
    if !sh.slots.start(job.idx, job.seq) {
        return; // cancelled while queued
    }
    let alive = sh
        .remote(job.prep.inner.remote)
        .and_then(|rem| if rem.alive.load(Ordering::Acquire) { Ok(()) } else { Err(rem.gone()) });
    let total = to_usize(job.prep.inner.total);
    let total = match alive.and(total) {
        Ok(t) => t,
        Err(e) => {
            sh.slots.complete(job.idx, job.seq, Err(e));
            return;
        }
    };
    // Helpers: threads waiting right now that no queued part is already meant for.
    let mut extra = 0;
    let mut share = total;
    if total >= SPLIT_MIN && cq.threads > 1 {
        let mut g = cq.lock();
        extra = g.idle.saturating_sub(g.parts).min(cq.threads - 1);
        if extra > 0 {
            share = (total / (extra + 1)).div_ceil(SPLIT_ALIGN) * SPLIT_ALIGN;
            // Rounding can leave the last helper nothing (never for ≥ 1 MiB and a few
            // threads, but the ranges must cover the transfer whatever the numbers).
            extra = (1..=extra).filter(|i| share * i < total).count();
            if extra == 0 {
                share = total;
            }
            let slot = job.idx as usize;
            cq.left[slot].store(u32::try_from(extra + 1).unwrap_or(u32::MAX), Ordering::Relaxed);
            cq.stopped[slot].store(false, Ordering::Relaxed);
            for i in (1..=extra).rev() {
                let (from, to) = (share * i, (share * (i + 1)).min(total));
                g.work.push_front(Work::Part { job: job.clone(), from, to });
            }
            g.parts += extra;
        }
    }
    for _ in 0..extra {
        cq.cv.notify_one();
    }
    let cancelled = || sh.slots.cancel_requested(job.idx, job.seq);
    let ok = copy_range(&job.prep, job.op, 0, share.min(total), sh.cfg.nt_threshold, cancelled);
    part_done(sh, cq, &job, extra > 0, ok);
}

/// One part (or the whole) of a transfer is copied; the last one completes the transfer.
fn part_done(sh: &Shared, cq: &CopyQueue, job: &ShmJob, split: bool, ok: bool) {
    let slot = job.idx as usize;
    if split {
        if !ok {
            cq.stopped[slot].store(true, Ordering::Relaxed);
        }
        if cq.left[slot].fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
    }
    let stopped = !ok || (split && cq.stopped[slot].load(Ordering::Relaxed));
    let res = if stopped { Err(XferError::Cancelled) } else { announce(sh, job) };
    sh.slots.complete(job.idx, job.seq, res);
}

/// Copy the bytes `[from, to)` of a transfer (offsets into its concatenated segments);
/// false when `cancelled` said stop between two segments.
fn copy_range(
    prep: &Prepped,
    op: Op,
    from: usize,
    to: usize,
    nt: usize,
    cancelled: impl Fn() -> bool,
) -> bool {
    let p = &prep.inner;
    let mut at = 0;
    for (l, r) in p.local.iter().zip(p.remote_mem.iter()) {
        let start = at;
        at += l.len;
        let (a, b) = (from.max(start), to.min(at));
        if a >= b {
            if at >= to {
                break;
            }
            continue;
        }
        if cancelled() {
            store_fence();
            return false;
        }
        let (dst, src) = match op {
            Op::Write => (r.ptr, l.ptr.cast_const()),
            Op::Read => (l.ptr, r.ptr.cast_const()),
        };
        let off = a - start;
        let (dst, src) = (dst.wrapping_add(off), src.wrapping_add(off));
        // SAFETY: `off + (b - a) <= l.len` in both segments, which were bounds-checked at
        // prep time against mappings that live as long as the agent (held through `sh` by
        // every copy thread); local and peer mappings are distinct, prep rejects overlapping
        // ranges of a self-transfer, and the parts of a split transfer are disjoint.
        unsafe { copy_block_unfenced(dst, src, b - a, nt) };
    }
    // One fence per range: its streaming stores are ordered before the count-down or the
    // completion and notification that announce them.
    store_fence();
    true
}

/// After the bytes: the notification (same-host peer or this agent), then the peer's
/// liveness decides the result.
fn announce(sh: &Shared, job: &ShmJob) -> Result<()> {
    let rem = sh.remote(job.prep.inner.remote)?;
    std::sync::atomic::fence(Ordering::SeqCst);
    if job.notif.len > 0 {
        if rem.is_self {
            let from = sh.name.clone();
            let deadline = std::time::Instant::now() + sh.cfg.xfer_timeout;
            while !sh.notifs.push(&from, job.notif.bytes()) {
                if std::time::Instant::now() >= deadline {
                    return Err(XferError::Timeout);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        } else if let Some(peer) = &rem.local {
            peer.send_notif(&rem.name, sh.instance, job.notif.bytes()).inspect_err(|e| {
                if e.is_remote_gone() {
                    rem.alive.store(false, Ordering::Release);
                }
            })?;
        }
    }
    if !rem.alive.load(Ordering::Acquire) {
        return Err(rem.gone());
    }
    Ok(())
}
