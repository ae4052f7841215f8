//! Registered regions: memfd-backed host memory (hugepages when available) and O_DIRECT file ranges.
//!
//! A region is registered once and lives as long as its agent: the table is append-only, so a
//! pointer resolved from a region stays valid for every in-flight transfer (see the crate's
//! safety notes).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{Result, XferError};

/// Alignment required of file offsets, lengths and memory addresses for O_DIRECT I/O.
pub const DIRECT_IO_ALIGN: u64 = 4096;

/// Size of a huge page used for hugetlb-backed memory regions.
pub const HUGE_PAGE: u64 = 2 << 20;

/// Identifies a region within one agent. Ids are dense, starting at 0, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u32);

/// What backs a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionKind {
    /// Host memory (a memfd mapped shared).
    Mem,
    /// A byte range of a file opened with O_DIRECT.
    File,
}

/// Whether host memory regions use hugetlb pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum HugePages {
    /// Try 2 MiB hugetlb pages, fall back to normal pages if none are reserved.
    #[default]
    Auto,
    /// Always use normal pages.
    Never,
    /// Fail the registration if hugetlb pages cannot be had.
    Require,
}

/// A shared, writable mapping, unmapped on drop.
#[derive(Debug)]
pub(crate) struct MemMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory with no thread affinity; all access goes through raw
// pointers whose synchronisation is the transfer protocol's job (see the crate docs).
unsafe impl Send for MemMap {}
// SAFETY: as above; `&MemMap` only hands out the base pointer and length.
unsafe impl Sync for MemMap {}

impl MemMap {
    /// Map `len` bytes of `fd` shared and read-write, pre-faulting the pages if `populate`.
    pub(crate) fn map_shared(fd: RawFd, len: usize, populate: bool) -> Result<MemMap> {
        if len == 0 {
            return Err(XferError::Unsupported("zero-length region"));
        }
        // SAFETY: a fresh mapping at a kernel-chosen address cannot alias any Rust object;
        // the fd is valid for the call and `len` is non-zero.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 },
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(XferError::last_os("mmap"));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(XferError::Protocol("mmap returned null"))?;
        Ok(MemMap { ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for MemMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from a successful mmap and are unmapped exactly once; the
        // owner (an append-only table inside the agent) drops only when no transfer can run.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// What backs a registered region, with the handles needed to reach its bytes.
#[derive(Debug)]
pub(crate) enum Backing {
    Mem { map: MemMap, fd: OwnedFd, huge: bool },
    File { fd: OwnedFd, base: u64 },
}

/// A registered region.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) id: RegionId,
    pub(crate) len: u64,
    pub(crate) backing: Backing,
    /// io_uring index: first fixed-buffer slot (memory) or fixed-file slot (file).
    pub(crate) uring_idx: u32,
}

impl Region {
    pub(crate) fn kind(&self) -> RegionKind {
        match self.backing {
            Backing::Mem { .. } => RegionKind::Mem,
            Backing::File { .. } => RegionKind::File,
        }
    }

    /// Base pointer of a memory region, `None` for a file region.
    pub(crate) fn mem_ptr(&self) -> Option<*mut u8> {
        match &self.backing {
            Backing::Mem { map, .. } => Some(map.ptr()),
            Backing::File { .. } => None,
        }
    }

    /// The fd to hand to a same-host peer (memfd or O_DIRECT file).
    pub(crate) fn fd(&self) -> RawFd {
        match &self.backing {
            Backing::Mem { fd, .. } | Backing::File { fd, .. } => fd.as_raw_fd(),
        }
    }

    /// File offset of byte 0 of the region (0 for memory).
    pub(crate) fn file_base(&self) -> u64 {
        match &self.backing {
            Backing::Mem { .. } => 0,
            Backing::File { base, .. } => *base,
        }
    }

    pub(crate) fn is_huge(&self) -> bool {
        matches!(self.backing, Backing::Mem { huge: true, .. })
    }
}

fn memfd(name: &str, flags: libc::c_uint) -> Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| XferError::Unsupported("region name with NUL"))?;
    // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(XferError::last_os("memfd_create"));
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ftruncate(fd: &OwnedFd, len: u64) -> Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| XferError::Unsupported("region too large"))?;
    // SAFETY: plain syscall on a valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(XferError::last_os("ftruncate"));
    }
    Ok(())
}

/// Create a host memory region of `len` bytes: a memfd (hugetlb if asked and available),
/// sized, mapped shared and pre-faulted if `populate`.
pub(crate) fn alloc_mem(id: RegionId, len: u64, huge: HugePages, populate: bool) -> Result<Region> {
    if len == 0 {
        return Err(XferError::Unsupported("zero-length region"));
    }
    let name = format!("kvx-xfer-{}", id.0);
    if huge != HugePages::Never {
        let hlen = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let attempt = memfd(&name, libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB)
            .and_then(|fd| {
                ftruncate(&fd, hlen)?;
                let map = MemMap::map_shared(fd.as_raw_fd(), to_usize(hlen)?, populate)?;
                Ok((fd, map))
            });
        match attempt {
            Ok((fd, map)) => {
                return Ok(Region {
                    id,
                    len,
                    backing: Backing::Mem { map, fd, huge: true },
                    uring_idx: u32::MAX,
                });
            }
            Err(e) if huge == HugePages::Require => return Err(e),
            Err(_) => {}
        }
    }
    let fd = memfd(&name, libc::MFD_CLOEXEC)?;
    ftruncate(&fd, len)?;
    let map = MemMap::map_shared(fd.as_raw_fd(), to_usize(len)?, populate)?;
    Ok(Region { id, len, backing: Backing::Mem { map, fd, huge: false }, uring_idx: u32::MAX })
}

/// Register `len` bytes of the file at `path` starting at file offset `base`, opened with
/// O_DIRECT. The file is created if missing and grown to cover the range.
pub(crate) fn open_file(
    id: RegionId,
    path: &std::path::Path,
    base: u64,
    len: u64,
) -> Result<Region> {
    use std::os::unix::fs::OpenOptionsExt;
    if len == 0 {
        return Err(XferError::Unsupported("zero-length region"));
    }
    if !base.is_multiple_of(DIRECT_IO_ALIGN) || !len.is_multiple_of(DIRECT_IO_ALIGN) {
        return Err(XferError::Misaligned { align: DIRECT_IO_ALIGN, offset: base, len });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| XferError::io("open (O_DIRECT)", &e))?;
    let end = base.checked_add(len).ok_or(XferError::Unsupported("file range overflows"))?;
    let cur = file.metadata().map_err(|e| XferError::io("fstat", &e))?.len();
    if cur < end {
        file.set_len(end).map_err(|e| XferError::io("ftruncate", &e))?;
    }
    Ok(Region {
        id,
        len,
        backing: Backing::File { fd: OwnedFd::from(file), base },
        uring_idx: u32::MAX,
    })
}

pub(crate) fn to_usize(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| XferError::Unsupported("length does not fit in usize"))
}

/// Append-only table of a fixed capacity. Entries are never removed while the table lives, so
/// `&T` obtained from it stays valid for the table's lifetime and lookups need no lock.
#[derive(Debug)]
pub(crate) struct AppendTable<T> {
    slots: Box<[OnceLock<T>]>,
    len: AtomicU32,
    push: std::sync::Mutex<()>,
}

impl<T> AppendTable<T> {
    pub(crate) fn new(cap: usize) -> Self {
        AppendTable {
            slots: (0..cap).map(|_| OnceLock::new()).collect(),
            len: AtomicU32::new(0),
            push: std::sync::Mutex::new(()),
        }
    }

    /// Append the value built from its index; fails when the table is full.
    pub(crate) fn push_with<E>(
        &self,
        full: E,
        make: impl FnOnce(u32) -> std::result::Result<T, E>,
    ) -> std::result::Result<u32, E> {
        let _g = self.push.lock().unwrap_or_else(|p| p.into_inner());
        let idx = self.len.load(Ordering::Acquire);
        let slot = self.slots.get(idx as usize).ok_or(full)?;
        let v = make(idx)?;
        // The push lock makes us the only writer of this slot.
        let _ = slot.set(v);
        self.len.store(idx + 1, Ordering::Release);
        Ok(idx)
    }

    pub(crate) fn get(&self, idx: u32) -> Option<&T> {
        self.slots.get(idx as usize).and_then(OnceLock::get)
    }

    pub(crate) fn len(&self) -> u32 {
        self.len.load(Ordering::Acquire)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}
