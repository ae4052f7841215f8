//! The agent: one per process (or per shard), owning registered regions, known remotes, the
//! in-flight transfer table and the backend engines.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::{self, Key};
use crate::desc::{Desc, Op, pair_lengths};
use crate::error::{Result, XferError};
use crate::meta::{AgentMetadata, RegionInfo, host_id};
use crate::region::{self, AppendTable, DIRECT_IO_ALIGN, HugePages, Region, RegionId, RegionKind};
use crate::shm::{self, CopyQueue, LocalPeer, PeerRegion, ShmJob};
use crate::slots::{Notif, NotifBuf, NotifQueue, SlotTable, XferStatus};
use crate::uring::{self, UJob};

/// Most regions one agent can register.
pub const MAX_REGIONS: usize = 1024;
/// Most remote agents one agent can know.
pub const MAX_REMOTES: usize = 256;
/// Size of one io_uring registered-buffer chunk (the kernel caps a fixed buffer at 1 GiB).
pub(crate) const BUF_CHUNK: u64 = 1 << 30;

/// Which mechanism moves the bytes of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backend {
    /// Same host: the initiator maps the remote's memfd regions once and copies directly.
    Shm,
    /// Any host: frames over a TCP connection driven by io_uring.
    Tcp,
    /// Local or same-host file regions: O_DIRECT io_uring reads and writes.
    File,
    /// RDMA through ibverbs (feature `rdma`; needs an HCA).
    Rdma,
}

impl std::str::FromStr for Backend {
    type Err = XferError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "shm" => Ok(Backend::Shm),
            "tcp" => Ok(Backend::Tcp),
            "file" => Ok(Backend::File),
            "rdma" => Ok(Backend::Rdma),
            _ => Err(XferError::Unsupported("backend must be shm, tcp, file or rdma")),
        }
    }
}

/// When the TCP backend uses zero-copy sends (`SENDMSG_ZC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ZeroCopy {
    /// Always plain sends (one copy into the socket buffer).
    Never,
    /// Always zero-copy sends.
    Always,
    /// Start each connection with zero-copy sends and fall back to plain sends as soon as the
    /// kernel reports it copied anyway (loopback, veth), where zero-copy measures about half
    /// the speed of a plain send; keep them where the NIC really avoids the copy.
    #[default]
    Auto,
}

/// Plain configuration of an agent (the binary maps its flags onto this).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent name, carried in metadata and notifications.
    pub name: String,
    /// Listen for TCP transfers on this address (port 0 = ephemeral); `None` = no listener.
    pub tcp_listen: Option<SocketAddr>,
    /// Accept same-host peers (shared memory and file backends) on an abstract Unix socket.
    pub same_host: bool,
    /// Bound on transfers in flight (posted and not yet released) at once.
    pub max_inflight: usize,
    /// Bound on received notifications not yet taken by the application.
    pub notif_capacity: usize,
    /// Hugepage policy for memory regions.
    pub hugepages: HugePages,
    /// Blocks at least this large are copied with non-temporal stores on the shm path.
    pub nt_threshold: usize,
    /// Threads that copy shm transfers (at least 1). They take whole transfers from one queue,
    /// so with several in flight that many stream at once; a transfer of at least
    /// 1 MiB taken while others wait idle is split between them.
    pub copy_threads: usize,
    /// io_uring engine threads (at least 1). Each has its own ring and its own connection to
    /// every TCP remote, and transfers to a remote take those connections in turn, so that
    /// with 2 both ends of a stream keep two cores busy (a connection's bytes are copied by
    /// the kernel in the thread that drives it). Connections accepted from initiators are
    /// spread over the engines the same way. File transfers use the first engine.
    pub tcp_threads: usize,
    /// A transfer not finished after this long fails with [`XferError::Timeout`].
    pub xfer_timeout: Duration,
    /// Timeout for connecting and handshaking with a remote.
    pub connect_timeout: Duration,
    /// io_uring submission queue entries.
    pub ring_entries: u32,
    /// Zero-copy send policy of the TCP backend.
    pub tcp_zero_copy: ZeroCopy,
    /// Register memory regions with io_uring as fixed buffers, for `READ_FIXED` /
    /// `WRITE_FIXED` file transfers. Registration pins a region's pages: all of it becomes
    /// resident at once. Without it, file transfers use plain reads and writes.
    pub fixed_buffers: bool,
    /// Pre-fault memory regions (this agent's, and its mappings of peers') when they are
    /// mapped, so that no transfer takes a page fault. Off for memory that should become
    /// resident as it is used (a KV cache that fills gradually).
    pub prefault: bool,
}

impl AgentConfig {
    /// Defaults: TCP on an ephemeral loopback port, same-host channel on, 1024 in flight.
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            tcp_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            same_host: true,
            max_inflight: 1024,
            notif_capacity: 4096,
            hugepages: HugePages::Auto,
            nt_threshold: 64 << 10,
            copy_threads: 1,
            tcp_threads: 1,
            xfer_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            ring_entries: 256,
            tcp_zero_copy: ZeroCopy::Auto,
            fixed_buffers: true,
            prefault: true,
        }
    }
}

/// Identifies a remote agent known to this agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteId(pub(crate) u32);

/// A reference to a live TCP connection inside the io_uring engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnRef {
    pub(crate) idx: u32,
    pub(crate) seq: u32,
}

/// A known remote agent.
#[derive(Debug)]
pub(crate) struct Remote {
    pub(crate) md: AgentMetadata,
    pub(crate) name: Arc<str>,
    pub(crate) is_self: bool,
    pub(crate) alive: AtomicBool,
    pub(crate) local: Option<LocalPeer>,
    /// The connection of each io_uring engine to this remote (indexed by engine; empty until
    /// the first TCP transfer connects).
    pub(crate) tcp: Mutex<Vec<ConnRef>>,
}

impl Remote {
    pub(crate) fn gone(&self) -> XferError {
        XferError::RemoteGone(self.name.to_string())
    }
}

/// Counters of the TCP send path (monotonic, relaxed).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) tcp_sends: std::sync::atomic::AtomicU64,
    pub(crate) tcp_zc_sends: std::sync::atomic::AtomicU64,
    pub(crate) tcp_zc_copied: std::sync::atomic::AtomicU64,
}

/// A snapshot of an agent's send-path counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct XferStats {
    /// `sendmsg` batches submitted on TCP connections (plain and zero-copy).
    pub tcp_sends: u64,
    /// Of those, zero-copy (`SENDMSG_ZC`).
    pub tcp_zc_sends: u64,
    /// Zero-copy notifications that reported the kernel copied anyway.
    pub tcp_zc_copied: u64,
}

/// State shared by the agent handle, its engines and its transfer handles.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: AgentConfig,
    pub(crate) name: Arc<str>,
    pub(crate) instance: u64,
    pub(crate) host: u64,
    /// The secret peers prove they hold (published in the metadata).
    pub(crate) key: Key,
    pub(crate) regions: AppendTable<Region>,
    pub(crate) remotes: AppendTable<Remote>,
    pub(crate) slots: SlotTable,
    pub(crate) notifs: NotifQueue,
    pub(crate) shutdown: AtomicBool,
    pub(crate) unix_name: Option<String>,
    pub(crate) tcp_addr: Mutex<Option<SocketAddr>>,
    /// Per io_uring engine: its wake-up eventfd, whether it sleeps, and connections accepted
    /// by engine 0 that it is to serve.
    pub(crate) uring_wake: Box<[OwnedFd]>,
    pub(crate) uring_sleeping: Box<[AtomicBool]>,
    pub(crate) handoff: Box<[Mutex<Vec<OwnedFd>>]>,
    pub(crate) ctl_wake: OwnedFd,
    pub(crate) ctl_watch: Mutex<Vec<(OwnedFd, u32)>>,
    pub(crate) counters: Counters,
}

pub(crate) fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
    let _ = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}

pub(crate) fn eventfd() -> Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(XferError::last_os("eventfd"));
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Shared {
    pub(crate) fn remote(&self, id: u32) -> Result<&Remote> {
        self.remotes.get(id).ok_or(XferError::UnknownRemote)
    }

    pub(crate) fn region(&self, id: RegionId) -> Result<&Region> {
        self.regions.get(id.0).ok_or(XferError::UnknownRegion(id.0))
    }

    pub(crate) fn metadata(&self) -> AgentMetadata {
        AgentMetadata {
            name: self.name.to_string(),
            instance: self.instance,
            host: self.host,
            pid: std::process::id(),
            tcp: *self.tcp_addr.lock().unwrap_or_else(|p| p.into_inner()),
            unix: self.unix_name.clone(),
            regions: self
                .regions
                .iter()
                .map(|r| RegionInfo { id: r.id, kind: r.kind(), len: r.len })
                .collect(),
            key: self.key.0,
        }
    }
}

/// One resolved memory segment (local or mapped remote).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemSeg {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// io_uring fixed-buffer index covering this segment (`u16::MAX` when none).
    pub(crate) buf_index: u16,
}

/// One resolved file segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileSeg {
    pub(crate) fixed: u32,
    pub(crate) off: u64,
}

/// The resolved, validated form of a descriptor-list pair.
#[derive(Debug)]
pub(crate) struct PrepInner {
    pub(crate) instance: u64,
    pub(crate) remote: u32,
    pub(crate) backend: Backend,
    pub(crate) total: u64,
    pub(crate) local: Box<[MemSeg]>,
    pub(crate) remote_mem: Box<[MemSeg]>,
    pub(crate) remote_file: Box<[FileSeg]>,
    pub(crate) wire: Box<[u8]>,
    pub(crate) ndesc: u32,
}

// SAFETY: the raw pointers point into mappings owned by the agent's append-only tables, which
// outlive every engine job (engines hold the agent's `Arc<Shared>`); see the crate docs.
unsafe impl Send for PrepInner {}
// SAFETY: as above; the struct is immutable after construction.
unsafe impl Sync for PrepInner {}

/// A pre-validated descriptor-list pair, ready to post any number of times.
///
/// Prepping checks regions, bounds, pairing, alignment and backend once, and resolves every
/// descriptor to a pointer, fixed-buffer index or wire encoding; posting a prepped transfer
/// allocates nothing.
#[derive(Debug, Clone)]
pub struct Prepped {
    pub(crate) inner: Arc<PrepInner>,
}

impl Prepped {
    /// The backend this transfer will use.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }
    /// Total bytes moved per post.
    pub fn bytes(&self) -> u64 {
        self.inner.total
    }
}

/// A posted transfer. Dropping it releases its slot (an unfinished transfer still finishes).
#[derive(Debug)]
pub struct XferHandle {
    shared: Arc<Shared>,
    idx: u32,
    seq: u32,
}

impl XferHandle {
    /// Current status, without blocking.
    pub fn status(&self) -> XferStatus {
        self.shared.slots.status(self.idx, self.seq)
    }

    /// Block until the transfer finishes or `timeout` passes. `Err(Timeout)` means it is still
    /// running (the per-transfer deadline of the agent bounds how long that can last).
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        match self.shared.slots.wait(self.idx, self.seq, timeout) {
            XferStatus::Done => Ok(()),
            XferStatus::Failed(e) => Err(e),
            XferStatus::Pending => Err(XferError::Timeout),
        }
    }

    /// When the transfer finished (recorded by the engine, so it is exact even when nobody
    /// was waiting); `None` while it is pending.
    pub fn completed_at(&self) -> Option<std::time::Instant> {
        self.shared.slots.completed_at(self.idx, self.seq)
    }

    /// Cancel. Returns true when the transfer had not started and is now `Cancelled`; false
    /// when it already runs (the shm backend stops at the next descriptor; a TCP transfer
    /// still waiting in its connection's send queue, or a file transfer waiting for room in
    /// the ring, ends `Cancelled` unsent; TCP transfers on the wire and file transfers whose
    /// I/O was submitted run to their end) or has finished. Either way the handle reports the
    /// outcome.
    pub fn cancel(&self) -> bool {
        self.shared.slots.cancel(self.idx, self.seq)
    }
}

impl Drop for XferHandle {
    fn drop(&mut self) {
        self.shared.slots.release(self.idx, self.seq);
    }
}

/// A memory region lent to a KV cache (kvx-kernels' `KvMemory`), so that peers write KV
/// blocks straight into the memory the engine attends over. It keeps the agent's shared
/// state, and with it the mapping, alive.
#[derive(Debug)]
pub struct RegionMemory {
    _shared: Arc<Shared>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is into a mapping owned by `Shared`, which this value keeps alive and
// which is never unmapped while it lives (rule 1 of the crate docs); moving or sharing the
// handle between threads moves no bytes.
unsafe impl Send for RegionMemory {}
// SAFETY: as for `Send`: the handle only hands out the pointer.
unsafe impl Sync for RegionMemory {}

// SAFETY: `ptr` is the start of an mmap'ed region of `len` bytes (page-aligned, so 64-byte
// aligned), readable and writable, mapped until `Shared` drops, which `_shared` prevents
// while the cache holds this value. Peers can write any byte of a registered region; lending
// it to a cache is the promise that they write only the blocks the cache's scheduler lent
// them, and that the cache reads those only after the transfer's completion was announced —
// the contract of kvx's disaggregated serving (a prefill worker writes exactly the blocks a
// decode worker reserved and sent it, then says so through the plane).
unsafe impl kvx_kernels::model::KvMemory for RegionMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A transfer agent. See the crate docs for the model.
#[derive(Debug)]
pub struct Agent {
    shared: Arc<Shared>,
    /// The shm copy threads' queue.
    copy_q: Option<Arc<CopyQueue>>,
    /// Job queues of the io_uring engines (index = engine).
    uring_tx: Vec<SyncSender<UJob>>,
    /// Engine for the next TCP transfer (round robin).
    next_engine: AtomicUsize,
    threads: Vec<JoinHandle<()>>,
}

impl Agent {
    /// Start an agent: its same-host listener, io_uring engine and copy thread.
    pub fn new(mut cfg: AgentConfig) -> Result<Agent> {
        cfg.tcp_threads = cfg.tcp_threads.clamp(1, 64);
        let engines = cfg.tcp_threads;
        let instance = random_u64();
        let unix_name =
            cfg.same_host.then(|| format!("kvx-xfer.{}.{instance:016x}", std::process::id()));
        let shared = Arc::new(Shared {
            name: Arc::from(cfg.name.as_str()),
            instance,
            host: host_id(),
            key: Key(auth::random()?),
            regions: AppendTable::new(MAX_REGIONS),
            remotes: AppendTable::new(MAX_REMOTES),
            slots: SlotTable::new(cfg.max_inflight),
            notifs: NotifQueue::new(cfg.notif_capacity),
            shutdown: AtomicBool::new(false),
            unix_name,
            tcp_addr: Mutex::new(None),
            uring_wake: (0..engines).map(|_| eventfd()).collect::<Result<_>>()?,
            uring_sleeping: (0..engines).map(|_| AtomicBool::new(false)).collect(),
            handoff: (0..engines).map(|_| Mutex::new(Vec::with_capacity(16))).collect(),
            ctl_wake: eventfd()?,
            ctl_watch: Mutex::new(Vec::new()),
            counters: Counters::default(),
            cfg,
        });
        let mut agent = Agent {
            shared: shared.clone(),
            copy_q: None,
            uring_tx: Vec::with_capacity(engines),
            next_engine: AtomicUsize::new(0),
            threads: vec![],
        };
        for id in 0..engines {
            let (utx, uth) = uring::start(shared.clone(), id)?;
            agent.uring_tx.push(utx);
            agent.threads.push(uth);
        }
        let (cq, sth) = shm::start_copier(&shared)?;
        agent.copy_q = Some(cq);
        agent.threads.extend(sth);
        if let Some(name) = &shared.unix_name {
            let listener = shm::listen(name)?;
            let th = shm::start_control(shared.clone(), listener)?;
            agent.threads.push(th);
        }
        Ok(agent)
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Metadata to publish (regions registered so far, endpoints and this agent's key).
    ///
    /// It carries the key: whoever holds it can read and write every registered region, so
    /// hand it only to peers over an authenticated channel.
    pub fn metadata(&self) -> AgentMetadata {
        self.shared.metadata()
    }

    /// Allocate and register `len` bytes of host memory (memfd, hugepages per config).
    pub fn alloc_mem(&self, len: u64) -> Result<RegionId> {
        let idx = self.shared.regions.push_with(XferError::Full("region table"), |i| {
            let cfg = &self.shared.cfg;
            let mut r = region::alloc_mem(RegionId(i), len, cfg.hugepages, cfg.prefault)?;
            let ptr = r.mem_ptr().ok_or(XferError::Protocol("memory region without mapping"))?;
            if self.shared.cfg.fixed_buffers {
                r.uring_idx =
                    self.uring_call(0, |reply| UJob::RegMem { ptr, len: r.len, reply })?;
            }
            Ok(r)
        })?;
        Ok(RegionId(idx))
    }

    /// Register `len` bytes of the file at `path` from file offset `base` (O_DIRECT; both
    /// multiples of 4096). The file is created or grown as needed.
    pub fn register_file(&self, path: &Path, base: u64, len: u64) -> Result<RegionId> {
        let idx = self.shared.regions.push_with(XferError::Full("region table"), |i| {
            let mut r = region::open_file(RegionId(i), path, base, len)?;
            let fd = r.fd();
            r.uring_idx = self.uring_call(0, |reply| UJob::RegFile { fd, reply })?;
            Ok(r)
        })?;
        Ok(RegionId(idx))
    }

    /// Whether a memory region landed on hugetlb pages.
    pub fn is_huge(&self, id: RegionId) -> Result<bool> {
        Ok(self.shared.region(id)?.is_huge())
    }

    /// Base pointer and length of a local memory region.
    ///
    /// The mapping is shared with peers that may read or write it at any time; access it only
    /// through raw pointer reads and writes, synchronised by your own protocol (for example
    /// "a WRITE's bytes are complete once its notification arrives").
    pub fn mem_ptr(&self, id: RegionId) -> Result<(*mut u8, u64)> {
        let r = self.shared.region(id)?;
        let p = r.mem_ptr().ok_or(XferError::Unsupported("not a memory region"))?;
        Ok((p, r.len))
    }

    /// A local memory region, lent to a KV cache (see [`RegionMemory`]).
    pub fn region_memory(&self, id: RegionId) -> Result<RegionMemory> {
        let (ptr, len) = self.mem_ptr(id)?;
        let len = usize::try_from(len).map_err(|_| XferError::Unsupported("region too large"))?;
        Ok(RegionMemory { _shared: self.shared.clone(), ptr, len })
    }

    /// Copy `src` into local memory at `d` (bounds-checked).
    pub fn write_local(&self, d: Desc, src: &[u8]) -> Result<()> {
        let (p, len) = self.mem_ptr(d.region)?;
        if src.len() as u64 != d.len {
            return Err(XferError::Mismatch("buffer length differs from descriptor"));
        }
        d.check_bounds(len)?;
        let off = region::to_usize(d.offset)?;
        // SAFETY: `d` lies within the mapping (checked above).
        let dst = unsafe { p.add(off) };
        // SAFETY: `dst..+len` is inside the mapping and `src` is a distinct Rust slice; raw
        // copies into shared memory are the documented access mode.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copy local memory at `d` into `dst` (bounds-checked).
    pub fn read_local(&self, d: Desc, dst: &mut [u8]) -> Result<()> {
        let (p, len) = self.mem_ptr(d.region)?;
        if dst.len() as u64 != d.len {
            return Err(XferError::Mismatch("buffer length differs from descriptor"));
        }
        d.check_bounds(len)?;
        let off = region::to_usize(d.offset)?;
        // SAFETY: `d` lies within the mapping (checked above).
        let src = unsafe { p.add(off) };
        // SAFETY: as in `write_local`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Learn a remote agent from its metadata. On the same host this connects the same-host
    /// channel (authenticating with the key in `md`) and maps the remote's memory regions
    /// once. Passing this agent's own metadata gives a loopback remote (local file tier, local
    /// copies).
    ///
    /// Fails with [`XferError::Auth`] when `md` carries no key, or when the same-host peer
    /// does not prove it holds that key; a TCP remote is authenticated when the first
    /// transfer to it connects ([`prep`](Self::prep) returns the error).
    pub fn add_remote(&self, md: &AgentMetadata) -> Result<RemoteId> {
        let is_self = md.instance == self.shared.instance;
        if !is_self && !md.has_key() {
            return Err(XferError::Auth {
                peer: md.name.clone(),
                reason: "its metadata carries no key (metadata fetched over TCP cannot be \
                         used to connect)",
            });
        }
        let local = if is_self || md.host != self.shared.host || !self.shared.cfg.same_host {
            None
        } else if let Some(unix) = &md.unix {
            match shm::connect_peer(&self.shared, unix, md, |fd| {
                self.uring_call(0, |reply| UJob::RegFile { fd, reply })
            }) {
                Ok(p) => Some(p),
                Err(e) if e.is_remote_gone() || matches!(e, XferError::Auth { .. }) => {
                    return Err(e);
                }
                Err(_) => None,
            }
        } else {
            None
        };
        let watch = local.as_ref().map(|p| p.watch_fd()).transpose()?;
        let idx = self.shared.remotes.push_with(XferError::Full("remote table"), |_| {
            Ok(Remote {
                md: md.clone(),
                name: Arc::from(md.name.as_str()),
                is_self,
                alive: AtomicBool::new(true),
                local,
                tcp: Mutex::new(Vec::new()),
            })
        })?;
        if let Some(w) = watch {
            self.shared.ctl_watch.lock().unwrap_or_else(|p| p.into_inner()).push((w, idx));
            wake(&self.shared.ctl_wake);
        }
        Ok(RemoteId(idx))
    }

    /// Whether the remote is believed alive (false once its process or connection is gone).
    pub fn remote_alive(&self, r: RemoteId) -> bool {
        self.shared.remote(r.0).is_ok_and(|r| r.alive.load(Ordering::Acquire))
    }

    /// Ask the agent listening on `addr` for its metadata over TCP.
    ///
    /// GetMeta is answered to anyone, without a handshake, so the answer comes with its key
    /// zeroed: it tells who listens there and what they expose (diagnostics, tools), but
    /// [`add_remote`](Self::add_remote) refuses it. Requiring the handshake instead would be
    /// circular — the key is what the handshake proves — so peers that are to transfer get
    /// the metadata, key included, over an authenticated channel (the worker planes) instead.
    pub fn fetch_metadata(addr: SocketAddr, timeout: Duration) -> Result<AgentMetadata> {
        uring::fetch_metadata(addr, timeout)
    }

    /// Validate and resolve a descriptor-list pair for repeated posting. `backend` overrides
    /// the choice by locality (file regions → File; same host → Shm; else Tcp).
    pub fn prep(
        &self,
        remote: RemoteId,
        local: &[Desc],
        remote_descs: &[Desc],
        backend: Option<Backend>,
    ) -> Result<Prepped> {
        let sh = &*self.shared;
        let rem = sh.remote(remote.0)?;
        let total = pair_lengths(local, remote_descs)?;
        let file_side =
            remote_descs.first().map(|d| self.remote_kind(rem, d.region)).transpose()?;
        let backend = match backend {
            Some(b) => b,
            None if file_side == Some(RegionKind::File) => Backend::File,
            None if rem.is_self || rem.local.is_some() => Backend::Shm,
            None => Backend::Tcp,
        };
        // Local side: always registered memory.
        let mut lsegs = Vec::with_capacity(local.len());
        for d in local {
            let r = sh.region(d.region)?;
            d.check_bounds(r.len)?;
            let base = r
                .mem_ptr()
                .ok_or(XferError::Unsupported("local descriptors must name memory regions"))?;
            lsegs.push((r, *d, base));
        }
        let mk_mem = |base: *mut u8, d: &Desc, buf_index: u16| -> Result<MemSeg> {
            let off = region::to_usize(d.offset)?;
            // SAFETY: `d` was bounds-checked against the mapping `base` belongs to.
            let ptr = unsafe { base.add(off) };
            Ok(MemSeg { ptr, len: region::to_usize(d.len)?, buf_index })
        };
        let mut inner = PrepInner {
            instance: sh.instance,
            remote: remote.0,
            backend,
            total,
            local: Box::new([]),
            remote_mem: Box::new([]),
            remote_file: Box::new([]),
            wire: Box::new([]),
            ndesc: local.len() as u32,
        };
        match backend {
            Backend::Shm => {
                let mut l = Vec::with_capacity(local.len());
                let mut r = Vec::with_capacity(local.len());
                for ((_, ld, lbase), rd) in lsegs.iter().zip(remote_descs) {
                    l.push(mk_mem(*lbase, ld, u16::MAX)?);
                    let (rbase, rlen) = self.remote_mem(rem, rd.region)?;
                    rd.check_bounds(rlen)?;
                    if rem.is_self
                        && ld.region == rd.region
                        && ld.offset < rd.offset + rd.len
                        && rd.offset < ld.offset + ld.len
                    {
                        return Err(XferError::Mismatch("source and destination overlap"));
                    }
                    r.push(mk_mem(rbase, rd, u16::MAX)?);
                }
                inner.local = l.into();
                inner.remote_mem = r.into();
            }
            Backend::File => {
                let mut l = Vec::with_capacity(local.len());
                let mut f = Vec::with_capacity(local.len());
                for ((lr, ld, lbase), rd) in lsegs.iter().zip(remote_descs) {
                    let (fixed, fbase, flen) = self.remote_file(rem, rd.region)?;
                    rd.check_bounds(flen)?;
                    for v in [ld.offset, ld.len, rd.offset] {
                        if !v.is_multiple_of(DIRECT_IO_ALIGN) {
                            return Err(XferError::Misaligned {
                                align: DIRECT_IO_ALIGN,
                                offset: rd.offset,
                                len: rd.len,
                            });
                        }
                    }
                    // Split at registered-buffer chunk boundaries.
                    let mut done = 0u64;
                    while done < ld.len {
                        let off = ld.offset + done;
                        let chunk = off / BUF_CHUNK;
                        let n = (ld.len - done).min((chunk + 1) * BUF_CHUNK - off);
                        let idx = if lr.uring_idx == u32::MAX {
                            u16::MAX // not registered: a plain read or write
                        } else {
                            u16::try_from(u64::from(lr.uring_idx) + chunk)
                                .map_err(|_| XferError::Full("registered buffer table"))?
                        };
                        l.push(mk_mem(*lbase, &Desc::new(ld.region, off, n), idx)?);
                        f.push(FileSeg { fixed, off: fbase + rd.offset + done });
                        done += n;
                    }
                }
                inner.local = l.into();
                inner.remote_file = f.into();
            }
            Backend::Tcp => {
                if rem.is_self {
                    return Err(XferError::Unsupported("tcp to self"));
                }
                let mut l = Vec::with_capacity(local.len());
                let mut wire = vec![0u8; remote_descs.len() * crate::wire::DESC_LEN];
                for (i, ((_, ld, lbase), rd)) in lsegs.iter().zip(remote_descs).enumerate() {
                    l.push(mk_mem(*lbase, ld, u16::MAX)?);
                    let info =
                        rem.md.region(rd.region).ok_or(XferError::UnknownRegion(rd.region.0))?;
                    if info.kind != RegionKind::Mem {
                        return Err(XferError::Unsupported("tcp moves memory regions only"));
                    }
                    rd.check_bounds(info.len)?;
                    crate::wire::encode_desc(rd, &mut wire[i * crate::wire::DESC_LEN..]);
                }
                inner.local = l.into();
                inner.wire = wire.into();
                self.ensure_tcp(remote.0, rem)?;
            }
            Backend::Rdma => return Err(crate::rdma_unavailable()),
        }
        Ok(Prepped { inner: Arc::new(inner) })
    }

    fn remote_kind(&self, rem: &Remote, id: RegionId) -> Result<RegionKind> {
        if rem.is_self {
            return Ok(self.shared.region(id)?.kind());
        }
        Ok(rem.md.region(id).ok_or(XferError::UnknownRegion(id.0))?.kind)
    }

    fn remote_mem(&self, rem: &Remote, id: RegionId) -> Result<(*mut u8, u64)> {
        if rem.is_self {
            return self.mem_ptr(id);
        }
        let peer =
            rem.local.as_ref().ok_or(XferError::Unsupported("remote is not on this host"))?;
        match peer.region(id, &rem.md)? {
            (len, PeerRegion::Mem(p)) => Ok((p, len)),
            _ => Err(XferError::Unsupported("remote region is not memory")),
        }
    }

    fn remote_file(&self, rem: &Remote, id: RegionId) -> Result<(u32, u64, u64)> {
        if rem.is_self {
            let r = self.shared.region(id)?;
            if r.kind() != RegionKind::File {
                return Err(XferError::Unsupported(
                    "file backend needs a file region on the remote side",
                ));
            }
            return Ok((r.uring_idx, r.file_base(), r.len));
        }
        let peer =
            rem.local.as_ref().ok_or(XferError::Unsupported("remote is not on this host"))?;
        match peer.region(id, &rem.md)? {
            (len, PeerRegion::File { fixed, base }) => Ok((fixed, base, len)),
            _ => Err(XferError::Unsupported("file backend needs a file region on the remote side")),
        }
    }

    fn ensure_tcp(&self, idx: u32, rem: &Remote) -> Result<()> {
        let mut g = rem.tcp.lock().unwrap_or_else(|p| p.into_inner());
        if !g.is_empty() {
            return if rem.alive.load(Ordering::Acquire) { Ok(()) } else { Err(rem.gone()) };
        }
        let addr = rem.md.tcp.ok_or(XferError::Unsupported("remote has no tcp endpoint"))?;
        let mut conns = Vec::with_capacity(self.uring_tx.len());
        for engine in 0..self.uring_tx.len() {
            let to = self.shared.cfg.connect_timeout;
            let fd = uring::connect(&self.shared, addr, &rem.md, to)?;
            let peer = rem.name.clone();
            conns.push(self.uring_call(engine, |reply| UJob::AddConn {
                fd,
                remote: idx,
                peer,
                reply,
            })?);
        }
        *g = conns;
        Ok(())
    }

    fn uring_call<T>(
        &self,
        engine: usize,
        make: impl FnOnce(SyncSender<Result<T>>) -> UJob,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.send_uring(engine, make(tx))?;
        rx.recv_timeout(Duration::from_secs(10)).map_err(|_| XferError::Shutdown)?
    }

    fn send_uring(&self, engine: usize, job: UJob) -> Result<()> {
        let tx = self.uring_tx.get(engine).ok_or(XferError::Shutdown)?;
        match tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(XferError::Full("io_uring job queue")),
            Err(TrySendError::Disconnected(_)) => return Err(XferError::Shutdown),
        }
        if self.shared.uring_sleeping[engine].load(Ordering::SeqCst) {
            wake(&self.shared.uring_wake[engine]);
        }
        Ok(())
    }

    /// Post a prepped transfer with an optional notification (≤ 256 bytes) for the remote.
    pub fn post(&self, op: Op, prepped: &Prepped, notif: &[u8]) -> Result<XferHandle> {
        let sh = &self.shared;
        if prepped.inner.instance != sh.instance {
            return Err(XferError::Mismatch("prepped list belongs to another agent"));
        }
        let rem = sh.remote(prepped.inner.remote)?;
        let notif = NotifBuf::new(notif)?;
        let (idx, seq) = sh.slots.alloc().ok_or(XferError::Full("in-flight transfer table"))?;
        let h = XferHandle { shared: self.shared.clone(), idx, seq };
        if !rem.alive.load(Ordering::Acquire) {
            sh.slots.complete(idx, seq, Err(rem.gone()));
            return Ok(h);
        }
        let prep = prepped.clone();
        let sent = match prepped.inner.backend {
            Backend::Shm => {
                let cq = self.copy_q.as_ref().ok_or(XferError::Shutdown)?;
                cq.push(ShmJob { idx, seq, op, prep, notif })
            }
            Backend::Tcp => {
                let n = self.uring_tx.len().max(1);
                let engine = self.next_engine.fetch_add(1, Ordering::Relaxed) % n;
                self.send_uring(engine, UJob::Xfer { idx, seq, op, prep, notif })
            }
            Backend::File => self.send_uring(0, UJob::Xfer { idx, seq, op, prep, notif }),
            Backend::Rdma => Err(crate::rdma_unavailable()),
        };
        if let Err(e) = sent {
            sh.slots.complete(idx, seq, Err(e));
        }
        Ok(h)
    }

    /// Prep and post in one call (allocates; use [`prep`](Self::prep) + [`post`](Self::post)
    /// on hot paths).
    pub fn xfer(
        &self,
        op: Op,
        remote: RemoteId,
        local: &[Desc],
        remote_descs: &[Desc],
        notif: &[u8],
    ) -> Result<XferHandle> {
        let p = self.prep(remote, local, remote_descs, None)?;
        self.post(op, &p, notif)
    }

    /// Move received notifications into `out`; returns how many.
    pub fn get_notifs(&self, out: &mut Vec<Notif>) -> usize {
        self.shared.notifs.drain_into(out)
    }

    /// Wait up to `timeout` for the next notification.
    pub fn wait_notif(&self, timeout: Duration) -> Option<Notif> {
        self.shared.notifs.wait(timeout)
    }

    /// Slots not in use (capacity minus transfers whose handles or engines still hold them).
    pub fn free_slots(&self) -> usize {
        self.shared.slots.free_count()
    }

    /// Send-path counters.
    pub fn stats(&self) -> XferStats {
        let c = &self.shared.counters;
        XferStats {
            tcp_sends: c.tcp_sends.load(Ordering::Relaxed),
            tcp_zc_sends: c.tcp_zc_sends.load(Ordering::Relaxed),
            tcp_zc_copied: c.tcp_zc_copied.load(Ordering::Relaxed),
        }
    }

    /// Capacity of the in-flight table.
    pub fn max_inflight(&self) -> usize {
        self.shared.slots.capacity()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        if let Some(cq) = self.copy_q.take() {
            cq.close();
        }
        self.uring_tx.clear();
        for w in &self.shared.uring_wake {
            wake(w);
        }
        wake(&self.shared.ctl_wake);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

pub(crate) fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into a live u64.
    let n = unsafe { libc::getrandom((&raw mut v).cast(), 8, 0) };
    if n != 8 {
        let t =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        v = t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32);
    }
    v
}
