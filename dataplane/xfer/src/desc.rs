//! Descriptors: (region, offset, length) triples naming bytes in a local or remote region.

use serde::{Deserialize, Serialize};

use crate::error::{Result, XferError};
use crate::region::RegionId;

/// Most descriptors in one transfer (leaves room under the kernel's 1024-iovec limit per
/// socket call for the frame header, descriptor list and notification).
pub const MAX_DESCS: usize = 1000;

/// Largest total payload of one transfer (keeps every socket call under the kernel's 2 GiB cap).
pub const MAX_XFER_BYTES: u64 = 1 << 30;

/// A contiguous byte range in a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Desc {
    /// The region, as numbered by the agent that registered it.
    pub region: RegionId,
    /// Byte offset within the region.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
}

impl Desc {
    /// Shorthand constructor.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Desc { region, offset, len }
    }

    /// Check that the descriptor lies inside a region of `region_len` bytes.
    pub fn check_bounds(&self, region_len: u64) -> Result<()> {
        match self.offset.checked_add(self.len) {
            Some(end) if end <= region_len && self.len > 0 => Ok(()),
            _ if self.len == 0 => Err(XferError::Mismatch("zero-length descriptor")),
            _ => Err(XferError::OutOfBounds {
                region: self.region.0,
                offset: self.offset,
                len: self.len,
                region_len,
            }),
        }
    }
}

/// Direction of a transfer, seen from the initiating agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// Remote bytes are copied into local descriptors.
    Read,
    /// Local bytes are copied into remote descriptors.
    Write,
}

/// Check that two descriptor lists pair up: same count, same length entry by entry, within the
/// per-transfer limits. Returns the total byte count.
pub fn pair_lengths(local: &[Desc], remote: &[Desc]) -> Result<u64> {
    if local.len() != remote.len() {
        return Err(XferError::Mismatch("local and remote lists differ in length"));
    }
    if local.is_empty() {
        return Err(XferError::Mismatch("empty descriptor list"));
    }
    if local.len() > MAX_DESCS {
        return Err(XferError::Full("descriptor list (max 1000 entries)"));
    }
    let mut total = 0u64;
    for (l, r) in local.iter().zip(remote) {
        if l.len != r.len {
            return Err(XferError::Mismatch("entry lengths differ"));
        }
        total = total.saturating_add(l.len);
    }
    if total > MAX_XFER_BYTES {
        return Err(XferError::Full("transfer (max 1 GiB)"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        let d = Desc::new(RegionId(3), 10, 20);
        assert!(d.check_bounds(30).is_ok());
        assert!(matches!(d.check_bounds(29), Err(XferError::OutOfBounds { region: 3, .. })));
        let wrap = Desc::new(RegionId(0), u64::MAX - 1, 4);
        assert!(matches!(wrap.check_bounds(u64::MAX), Err(XferError::OutOfBounds { .. })));
        assert!(Desc::new(RegionId(0), 0, 0).check_bounds(10).is_err());
    }

    #[test]
    fn pairing() {
        let a = [Desc::new(RegionId(0), 0, 8), Desc::new(RegionId(0), 8, 8)];
        let b = [Desc::new(RegionId(1), 64, 8), Desc::new(RegionId(1), 0, 8)];
        assert_eq!(pair_lengths(&a, &b), Ok(16));
        assert!(pair_lengths(&a, &b[..1]).is_err());
        let c = [Desc::new(RegionId(1), 64, 8), Desc::new(RegionId(1), 0, 9)];
        assert!(pair_lengths(&a, &c).is_err());
        assert!(pair_lengths(&[], &[]).is_err());
    }
}
