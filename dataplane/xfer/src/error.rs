//! The closed set of transfer errors, typed so callers can tell a dead peer from a bad descriptor.

use std::io;

/// Everything that can go wrong when registering memory, preparing or running a transfer.
///
/// Errors are `Clone` because a transfer's outcome is stored once and may be read by several
/// observers (the handle, a cancelling thread). Every variant is a terminal outcome: an API
/// that returns it never leaves work behind that could hang.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum XferError {
    /// The remote agent's process or connection went away (EOF, reset, refused, hang-up).
    #[error("remote agent `{0}` is gone")]
    RemoteGone(String),
    /// A descriptor reaches past the end of its region.
    #[error(
        "descriptor out of bounds: region {region} offset {offset} len {len} (region is {region_len} bytes)"
    )]
    OutOfBounds {
        /// Region id the descriptor names.
        region: u32,
        /// Offset into the region.
        offset: u64,
        /// Length of the descriptor.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// A descriptor names a region that is not registered.
    #[error("unknown region {0}")]
    UnknownRegion(u32),
    /// A handle or id names a remote agent this agent does not know.
    #[error("unknown remote agent")]
    UnknownRemote,
    /// The transfer did not finish within its deadline.
    #[error("transfer timed out")]
    Timeout,
    /// The transfer was cancelled before it started moving bytes.
    #[error("transfer cancelled")]
    Cancelled,
    /// Local and remote descriptor lists do not pair up (count or per-entry length).
    #[error("descriptor lists do not match: {0}")]
    Mismatch(&'static str),
    /// O_DIRECT file I/O needs aligned offsets, lengths and buffers.
    #[error("descriptor not aligned to {align} bytes for direct I/O (offset {offset}, len {len})")]
    Misaligned {
        /// Required alignment in bytes.
        align: u64,
        /// Offending offset.
        offset: u64,
        /// Offending length.
        len: u64,
    },
    /// The requested backend cannot serve this pair of regions (e.g. TCP to a file region).
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// A bounded queue or table is full; retry after completing some transfers.
    #[error("{0} is full")]
    Full(&'static str),
    /// A malformed or unexpected frame arrived from a peer.
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    /// The remote agent failed the handshake: it does not hold the key its metadata names
    /// (altered or stale metadata, someone else at its address), or the metadata carries no
    /// key at all (fetched with [`Agent::fetch_metadata`](crate::Agent::fetch_metadata)).
    #[error("cannot authenticate agent `{peer}`: {reason}")]
    Auth {
        /// The remote agent's name, as its metadata gives it.
        peer: String,
        /// What failed.
        reason: &'static str,
    },
    /// The peer speaks a wire version this build does not.
    #[error("wire version {got} not supported (this build speaks {want})")]
    Version {
        /// Version received.
        got: u8,
        /// Version expected.
        want: u8,
    },
    /// A system call failed.
    #[error("{op}: {msg}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The OS error text.
        msg: String,
        /// The raw errno, 0 when none.
        errno: i32,
    },
    /// A feature needs hardware this host lacks (e.g. RDMA without an HCA).
    #[error("no device: {0}")]
    NoDevice(String),
    /// The agent is shutting down.
    #[error("agent is shut down")]
    Shutdown,
}

impl XferError {
    /// Wrap an `io::Error` from the named operation.
    pub fn io(op: &'static str, e: &io::Error) -> Self {
        XferError::Io { op, msg: e.to_string(), errno: e.raw_os_error().unwrap_or(0) }
    }

    /// Wrap a negative errno returned by io_uring or a raw syscall.
    pub fn errno(op: &'static str, errno: i32) -> Self {
        Self::io(op, &io::Error::from_raw_os_error(errno))
    }

    /// The last OS error, for raw libc calls.
    pub fn last_os(op: &'static str) -> Self {
        Self::io(op, &io::Error::last_os_error())
    }

    /// True when the error means the peer is unreachable for good (not a per-transfer fault).
    pub fn is_remote_gone(&self) -> bool {
        matches!(self, XferError::RemoteGone(_))
    }
}

/// Result alias for this crate.
pub type Result<T, E = XferError> = std::result::Result<T, E>;

/// Map errnos that mean "the peer is gone" to [`XferError::RemoteGone`].
pub(crate) fn peer_errno(name: &str, op: &'static str, errno: i32) -> XferError {
    match errno {
        libc::EPIPE
        | libc::ECONNRESET
        | libc::ECONNREFUSED
        | libc::ENOTCONN
        | libc::ECONNABORTED
        | libc::EHOSTUNREACH
        | libc::ENETUNREACH => XferError::RemoteGone(name.to_owned()),
        libc::ETIMEDOUT => XferError::Timeout,
        _ => XferError::errno(op, errno),
    }
}
