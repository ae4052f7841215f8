//! kvx-xfer: the KV transfer library (agents, registered regions, descriptor lists, backends).
//!
//! # Model
//!
//! An [`Agent`] lives in each process (or shard). It registers *regions* once — host memory
//! ([`Agent::alloc_mem`], a memfd mapped shared, on 2 MiB hugetlb pages when the host has them
//! reserved) and file ranges ([`Agent::register_file`], opened `O_DIRECT`) — and describes
//! bytes in them with [`Desc`] triples `(region, offset, len)`. Its [`AgentMetadata`] (name,
//! instance, host identity, TCP and Unix endpoints, regions, secret key) encodes to a compact
//! versioned blob that an authenticated channel carries to peers, which pass it to
//! [`Agent::add_remote`].
//!
//! # Authentication
//!
//! An agent serves only peers that hold its metadata: every connection, on either channel,
//! opens with a mutual HMAC-SHA256 challenge-response keyed by the target's random key
//! ([`auth`]), and until the initiator's proof checked out the target serves nothing but the
//! handshake and a keyless GetMeta — no region fd, no byte of a region. Metadata fetched with
//! [`Agent::fetch_metadata`] has no key and cannot be used to connect.
//!
//! A transfer is a READ or WRITE of a local descriptor list against a remote one of equal
//! shape. [`Agent::prep`] validates and resolves the pair once into a [`Prepped`] list (bounds,
//! pairing, alignment, backend choice, pointers, wire encoding); [`Agent::post`] then costs a
//! slot, an `Arc` clone and a bounded-queue push — no allocation. The returned [`XferHandle`]
//! reports status, waits with a timeout, and cancels. The remote agent receives the
//! transfer's notification (≤ 256 bytes) through [`Agent::get_notifs`] once the bytes are in
//! place. Errors are typed ([`XferError`]): a dead peer is `RemoteGone`, a bad descriptor
//! `OutOfBounds`, a stuck one `Timeout`; no transfer can wait forever.
//!
//! # Backends, chosen by locality
//!
//! * **shm** (same host): on `add_remote` the initiator connects the peer's abstract Unix
//!   socket, authenticates, receives its region fds by `SCM_RIGHTS` and maps every memory
//!   region once.
//!   A transfer is a copy in the initiator's copy thread — `memcpy` for small blocks,
//!   AVX-512/AVX2 non-temporal stores for blocks ≥ `nt_threshold`, one store fence per
//!   transfer; with `copy_threads` > 1 that many threads take whole transfers from one queue,
//!   splitting a transfer of 1 MiB or more between those waiting idle — and only the
//!   notification frame crosses the socket. The control thread watches the socket for
//!   hang-up, which turns a dead peer into `RemoteGone`.
//! * **tcp** (any host): `tcp_threads` io_uring threads per agent (default 1) drive the
//!   connections, as initiator and target; with more than one, an initiator holds one
//!   connection per thread to each remote and posts transfers to them in turn. Frames ([`wire`]) are pipelined: many transfers in flight per connection,
//!   sends batched into one `sendmsg` per up to 64 frames, payloads received by one
//!   `recvmsg(MSG_WAITALL)` straight into the registered region, no staging copy beyond a
//!   4 KiB header read. Zero-copy send (`SENDMSG_ZC`) is used only where it pays: with
//!   [`ZeroCopy::Auto`] (the default) a connection starts zero-copy and falls back to plain
//!   sends as soon as the kernel reports it copied anyway (loopback, veth — where zero-copy
//!   measured half the speed of a plain send); a zero-copy batch is released only after its
//!   notification, when the kernel no longer references the pages.
//! * **file** (local or same-host file regions): `O_DIRECT` `READ_FIXED`/`WRITE_FIXED` on
//!   registered buffers (memory regions are registered with the ring in 1 GiB chunks) and
//!   fixed files, many ops in flight.
//! * **rdma** (feature `rdma`): ibverbs device discovery and resources; reports
//!   [`XferError::NoDevice`] on hosts without an HCA. Not wired into agents yet; its
//!   queue-pair details are to travel with the metadata, over the same authenticated channel.
//!
//! # Safety
//!
//! This crate uses `unsafe` for four things, each resting on one invariant:
//!
//! 1. **Region lifetime.** Region and peer mappings live in append-only tables owned by the
//!    agent's shared state; nothing is unmapped while the state lives. Every engine thread
//!    holds that state and is joined before it drops. So any pointer resolved at prep time
//!    (after a bounds check against the region it points into) stays valid for every job
//!    that carries it.
//! 2. **Shared memory is raw memory.** Region bytes can be written at any time by a peer
//!    process, so the crate never forms `&[u8]`/`&mut [u8]` over them: copies use raw
//!    pointer loads and stores (`copy_nonoverlapping`, SIMD streaming stores). Concurrent
//!    writers make the *bytes* unspecified, never the program unsound. Ordering between a
//!    copy and the notification that announces it is a `SeqCst` fence (plus `sfence` after
//!    streaming stores).
//! 3. **Kernel-held buffers.** io_uring ops point at connection state (boxed, never moved
//!    while an op is in flight: one receive and one send per connection, tracked by busy
//!    flags), at region memory (rule 1), and at registered buffers (regions, rule 1). A
//!    connection is freed only after both its ops completed; on shutdown the engine cancels
//!    every op and waits for the completions before dropping anything, and leaks rather than
//!    frees if the kernel does not let go.
//! 4. **Descriptor passing.** fds received with `SCM_RIGHTS` are wrapped in `OwnedFd` at
//!    once; `mmap` of a peer region uses the length the peer reported, checked to cover the
//!    region.
//!
//! Self-transfers through shm reject overlapping source and destination ranges, so
//! `copy_nonoverlapping` never sees an overlap.

mod agent;
pub mod auth;
pub mod bench;
pub mod copy;
mod desc;
mod error;
mod meta;
pub mod peer;
#[cfg(feature = "rdma")]
pub mod rdma;
mod region;
mod shm;
mod slots;
mod uring;
pub mod wire;

pub use agent::{
    Agent, AgentConfig, Backend, MAX_REGIONS, MAX_REMOTES, Prepped, RegionMemory, RemoteId,
    XferHandle, XferStats, ZeroCopy,
};
pub use desc::{Desc, MAX_DESCS, MAX_XFER_BYTES, Op, pair_lengths};
pub use error::{Result, XferError};
pub use meta::{AgentMetadata, META_VERSION, RegionInfo};
pub use region::{DIRECT_IO_ALIGN, HugePages, RegionId, RegionKind};
pub use slots::{Notif, XferStatus};

/// The error a build or host without RDMA gives for the rdma backend.
pub(crate) fn rdma_unavailable() -> XferError {
    #[cfg(feature = "rdma")]
    {
        match rdma::probe() {
            Ok(devs) if !devs.is_empty() => {
                XferError::Unsupported("rdma transfers are not wired into agents yet")
            }
            Ok(_) => XferError::NoDevice("no RDMA device found".into()),
            Err(e) => e,
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        XferError::Unsupported("built without the `rdma` feature")
    }
}
