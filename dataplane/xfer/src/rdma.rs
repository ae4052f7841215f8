//! RDMA backend (feature `rdma`): ibverbs devices, a reliable-connected queue pair per peer,
//! memory registration and one-sided RDMA READ/WRITE with completion polling.
//!
//! The verbs calls go through `csrc/kvx_rdma.c` (ibv_post_send and ibv_poll_cq are inline
//! functions in the C header). On a host without an HCA, [`probe`] and [`Endpoint::open`]
//! return [`XferError::NoDevice`]. Agents do not route transfers here yet: the queue-pair
//! exchange needs the endpoint info in agent metadata, which comes with the first host that
//! has a device to test it on. That info ([`QpInfo`], with the rkeys of registered memory)
//! grants one-sided access to the regions, so it is to travel only inside the metadata, over
//! the same authenticated channel as the agent's key, never over an open endpoint.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::NonNull;

use crate::error::{Result, XferError};

#[repr(C)]
struct RawRdma {
    _p: [u8; 0],
}

/// What a peer needs to connect its queue pair to ours.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpInfo {
    /// Port LID (InfiniBand) or 0 (RoCE).
    pub lid: u16,
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE / routed InfiniBand).
    pub gid: [u8; 16],
}

unsafe extern "C" {
    fn kvx_rdma_device_count() -> c_int;
    fn kvx_rdma_device_name(i: c_int, buf: *mut c_char, len: usize) -> c_int;
    fn kvx_rdma_open(
        name: *const c_char,
        port: u8,
        depth: c_int,
        err: *mut c_char,
        errlen: usize,
    ) -> *mut RawRdma;
    fn kvx_rdma_close(r: *mut RawRdma);
    fn kvx_rdma_local_info(r: *mut RawRdma, out: *mut QpInfo) -> c_int;
    fn kvx_rdma_connect(r: *mut RawRdma, remote: *const QpInfo) -> c_int;
    fn kvx_rdma_reg(
        r: *mut RawRdma,
        addr: *mut c_void,
        len: usize,
        lkey: *mut u32,
        rkey: *mut u32,
    ) -> *mut c_void;
    fn kvx_rdma_dereg(mr: *mut c_void) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn kvx_rdma_post(
        r: *mut RawRdma,
        write: c_int,
        wr_id: u64,
        laddr: *mut c_void,
        len: u32,
        lkey: u32,
        raddr: u64,
        rkey: u32,
    ) -> c_int;
    fn kvx_rdma_poll(r: *mut RawRdma, ids: *mut u64, status: *mut c_int, max: c_int) -> c_int;
}

/// Names of the RDMA devices on this host; `NoDevice` when there are none.
pub fn probe() -> Result<Vec<String>> {
    // SAFETY: no arguments; the C side frees the list it allocates.
    let n = unsafe { kvx_rdma_device_count() };
    if n <= 0 {
        return Err(XferError::NoDevice("no RDMA device found".into()));
    }
    let mut names = Vec::new();
    for i in 0..n {
        let mut buf = [0 as c_char; 64];
        // SAFETY: `buf` is writable for its full length, which we pass.
        if unsafe { kvx_rdma_device_name(i, buf.as_mut_ptr(), buf.len()) } == 0 {
            // SAFETY: the C side wrote a NUL-terminated string into `buf` (snprintf).
            names.push(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned());
        }
    }
    Ok(names)
}

/// A registered memory range: keys for local and remote access.
#[derive(Debug)]
pub struct Mr {
    raw: NonNull<c_void>,
    /// Local key.
    pub lkey: u32,
    /// Remote key (give it to the peer).
    pub rkey: u32,
}

/// One device context with a protection domain, completion queue and RC queue pair.
#[derive(Debug)]
pub struct Endpoint {
    raw: NonNull<RawRdma>,
    mrs: Vec<Mr>,
}

// SAFETY: the verbs objects may be used from any thread; `&mut self` methods serialise use.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Open `device` (empty = first) on `port` with `depth` outstanding work requests.
    pub fn open(device: &str, port: u8, depth: u32) -> Result<Endpoint> {
        let name =
            CString::new(device).map_err(|_| XferError::Unsupported("device name with NUL"))?;
        let mut err = [0 as c_char; 128];
        let depth = c_int::try_from(depth.max(1)).unwrap_or(c_int::MAX);
        // SAFETY: valid C string and error buffer with its length.
        let raw = unsafe { kvx_rdma_open(name.as_ptr(), port, depth, err.as_mut_ptr(), err.len()) };
        match NonNull::new(raw) {
            Some(raw) => Ok(Endpoint { raw, mrs: Vec::new() }),
            None => {
                // SAFETY: the C side always NUL-terminates `err` on failure.
                let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
                Err(XferError::NoDevice(msg))
            }
        }
    }

    /// Our queue-pair coordinates, to send to the peer.
    pub fn local_info(&mut self) -> Result<QpInfo> {
        let mut q = QpInfo::default();
        // SAFETY: `raw` is a live endpoint; `q` is a writable QpInfo with the C layout.
        if unsafe { kvx_rdma_local_info(self.raw.as_ptr(), &raw mut q) } != 0 {
            return Err(XferError::last_os("ibv_query_port"));
        }
        Ok(q)
    }

    /// Move the queue pair to ready-to-send against the peer's coordinates.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<()> {
        // SAFETY: live endpoint and a readable QpInfo.
        if unsafe { kvx_rdma_connect(self.raw.as_ptr(), remote) } != 0 {
            return Err(XferError::last_os("ibv_modify_qp"));
        }
        Ok(())
    }

    /// Register `len` bytes at `addr`.
    ///
    /// # Safety
    /// The range must stay mapped until the endpoint is dropped.
    pub unsafe fn register(&mut self, addr: *mut u8, len: usize) -> Result<(u32, u32)> {
        let (mut lkey, mut rkey) = (0u32, 0u32);
        // SAFETY: live endpoint; the caller keeps the range mapped (contract above).
        let mr = unsafe {
            kvx_rdma_reg(self.raw.as_ptr(), addr.cast(), len, &raw mut lkey, &raw mut rkey)
        };
        let raw = NonNull::new(mr).ok_or_else(|| XferError::last_os("ibv_reg_mr"))?;
        self.mrs.push(Mr { raw, lkey, rkey });
        Ok((lkey, rkey))
    }

    /// Post one RDMA WRITE (`write`) or READ of `len` bytes between a registered local address
    /// and a remote address/rkey.
    ///
    /// # Safety
    /// `laddr..+len` must lie in a range registered here and stay valid until the completion
    /// with `wr_id` has been polled.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post(
        &mut self,
        write: bool,
        wr_id: u64,
        laddr: *mut u8,
        len: u32,
        lkey: u32,
        raddr: u64,
        rkey: u32,
    ) -> Result<()> {
        // SAFETY: live endpoint; buffer validity is the caller's contract.
        let rc = unsafe {
            kvx_rdma_post(
                self.raw.as_ptr(),
                c_int::from(write),
                wr_id,
                laddr.cast(),
                len,
                lkey,
                raddr,
                rkey,
            )
        };
        if rc != 0 {
            return Err(XferError::errno("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Poll up to 32 completions into `out` as (wr_id, ok); returns how many.
    pub fn poll(&mut self, out: &mut Vec<(u64, bool)>) -> Result<usize> {
        let mut ids = [0u64; 32];
        let mut st = [0 as c_int; 32];
        // SAFETY: live endpoint; arrays of 32 entries match `max`.
        let n = unsafe { kvx_rdma_poll(self.raw.as_ptr(), ids.as_mut_ptr(), st.as_mut_ptr(), 32) };
        if n < 0 {
            return Err(XferError::Protocol("ibv_poll_cq failed"));
        }
        let n = n as usize;
        out.extend(ids[..n].iter().zip(&st[..n]).map(|(i, s)| (*i, *s == 0)));
        Ok(n)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        for mr in self.mrs.drain(..) {
            // SAFETY: each MR was registered on this endpoint and is deregistered once.
            unsafe { kvx_rdma_dereg(mr.raw.as_ptr()) };
        }
        // SAFETY: `raw` came from kvx_rdma_open and is closed exactly once.
        unsafe { kvx_rdma_close(self.raw.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_is_a_typed_error_not_a_crash() {
        match probe() {
            Ok(devs) => assert!(!devs.is_empty()),
            Err(e) => assert!(matches!(e, XferError::NoDevice(_)), "{e}"),
        }
        if probe().is_err() {
            let e = Endpoint::open("", 1, 16).unwrap_err();
            assert!(matches!(e, XferError::NoDevice(_)), "{e}");
        }
    }
}
