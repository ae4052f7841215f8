//! Versioned wire frames shared by the TCP and same-host control channels.
//!
//! Every frame starts with a fixed 32-byte little-endian header:
//!
//! ```text
//!  0  magic  u16  0x584B ("KX")
//!  2  version u8  WIRE_VERSION
//!  3  kind    u8  FrameKind
//!  4  status  u16 0 = ok, else an error code (acks and read replies)
//!  6  notif   u16 notification length that follows the descriptors
//!  8  ndesc   u32 number of 24-byte descriptors that follow the header
//! 12  aux     u32 kind-specific (unused = 0)
//! 16  xfer    u64 initiator's transfer id, echoed in the reply
//! 24  payload u64 bytes of payload after descriptors and notification
//! ```
//!
//! A descriptor on the wire is `region u32, reserved u32, offset u64, len u64`. A frame is
//! header, descriptors, notification bytes, payload. Metadata blobs use [`Enc`]/[`Dec`], a
//! length-prefixed little-endian encoding that starts with its own version byte.
//!
//! Every connection, TCP or same-host, opens with the handshake of [`crate::auth`], carried
//! in the notification area (read before anything else): Hello `cn ‖ name`, HelloAck
//! `sn ‖ proof_t ‖ name`, Auth `proof_i`. Until Auth checked out, the target answers only
//! Hello, Auth and GetMeta; any other frame closes the connection.

use crate::desc::Desc;
use crate::error::{Result, XferError};
use crate::region::RegionId;

/// Frame magic.
pub const MAGIC: u16 = 0x584B;
/// Version of the frame layout spoken by this build.
pub const WIRE_VERSION: u8 = 2;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 32;
/// Size of one descriptor on the wire.
pub const DESC_LEN: usize = 24;
/// Largest notification message carried with a transfer.
pub const MAX_NOTIF: usize = 256;

/// Kinds of frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Initiator → target, first frame on a connection: `xfer` = initiator's instance id;
    /// notification area = client nonce (32 bytes) + initiator name.
    Hello = 1,
    /// Target → initiator: `xfer` = target's instance id; notification area = server nonce
    /// (32 bytes) + the target's proof (32 bytes) + target name.
    HelloAck = 2,
    /// Initiator → target: descriptors of target memory + notification + payload to place there.
    WriteReq = 3,
    /// Target → initiator: the write was placed (status 0) or refused.
    WriteAck = 4,
    /// Initiator → target: descriptors of target memory + notification; no payload.
    ReadReq = 5,
    /// Target → initiator: the bytes asked for (status 0) or an error with no payload.
    ReadData = 6,
    /// Anyone → agent: send me your metadata (served without authentication, so without
    /// the key).
    GetMeta = 7,
    /// Agent → asker: payload = encoded metadata, key zeroed.
    Meta = 8,
    /// Same-host: a notification with no data movement on this channel.
    Notif = 9,
    /// Same-host: the fds of the listed regions follow (SCM_RIGHTS); payload = region ids.
    Fds = 10,
    /// Same-host: ask for the fds of the regions listed in the payload (u32 each).
    GetFds = 11,
    /// Initiator → target, after HelloAck: notification area = the initiator's proof
    /// (32 bytes). No reply; a wrong proof closes the connection.
    Auth = 12,
}

impl FrameKind {
    fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            1 => FrameKind::Hello,
            2 => FrameKind::HelloAck,
            3 => FrameKind::WriteReq,
            4 => FrameKind::WriteAck,
            5 => FrameKind::ReadReq,
            6 => FrameKind::ReadData,
            7 => FrameKind::GetMeta,
            8 => FrameKind::Meta,
            9 => FrameKind::Notif,
            10 => FrameKind::Fds,
            11 => FrameKind::GetFds,
            12 => FrameKind::Auth,
            _ => return Err(XferError::Protocol("unknown frame kind")),
        })
    }
}

/// Status codes carried in acks and read replies.
pub mod status {
    /// Success.
    pub const OK: u16 = 0;
    /// A descriptor named an unknown region.
    pub const UNKNOWN_REGION: u16 = 1;
    /// A descriptor was out of bounds.
    pub const OUT_OF_BOUNDS: u16 = 2;
    /// The target cannot serve this region kind over this channel.
    pub const UNSUPPORTED: u16 = 3;
    /// Malformed request.
    pub const PROTOCOL: u16 = 4;
}

/// Translate a status code from a peer into an error.
pub fn status_error(code: u16) -> XferError {
    match code {
        status::UNKNOWN_REGION => XferError::UnknownRegion(u32::MAX),
        status::OUT_OF_BOUNDS => {
            XferError::OutOfBounds { region: u32::MAX, offset: 0, len: 0, region_len: 0 }
        }
        status::UNSUPPORTED => XferError::Unsupported("remote refused the region kind"),
        _ => XferError::Protocol("remote reported a malformed request"),
    }
}

/// The decoded fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: FrameKind,
    /// Status code (0 = ok).
    pub status: u16,
    /// Notification bytes after the descriptors.
    pub notif: u16,
    /// Descriptor count.
    pub ndesc: u32,
    /// Kind-specific word.
    pub aux: u32,
    /// Transfer id.
    pub xfer: u64,
    /// Payload bytes.
    pub payload: u64,
}

impl Header {
    /// A header of `kind` with everything else zero.
    pub fn new(kind: FrameKind) -> Self {
        Header { kind, status: 0, notif: 0, ndesc: 0, aux: 0, xfer: 0, payload: 0 }
    }

    /// Encode into the first 32 bytes of `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = WIRE_VERSION;
        out[3] = self.kind as u8;
        out[4..6].copy_from_slice(&self.status.to_le_bytes());
        out[6..8].copy_from_slice(&self.notif.to_le_bytes());
        out[8..12].copy_from_slice(&self.ndesc.to_le_bytes());
        out[12..16].copy_from_slice(&self.aux.to_le_bytes());
        out[16..24].copy_from_slice(&self.xfer.to_le_bytes());
        out[24..32].copy_from_slice(&self.payload.to_le_bytes());
    }

    /// Decode and check magic and version.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header> {
        if u16::from_le_bytes([b[0], b[1]]) != MAGIC {
            return Err(XferError::Protocol("bad frame magic"));
        }
        if b[2] != WIRE_VERSION {
            return Err(XferError::Version { got: b[2], want: WIRE_VERSION });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let h = Header {
            kind: FrameKind::from_u8(b[3])?,
            status: u16::from_le_bytes([b[4], b[5]]),
            notif: u16::from_le_bytes([b[6], b[7]]),
            ndesc: u32_at(8),
            aux: u32_at(12),
            xfer: u64_at(16),
            payload: u64_at(24),
        };
        if h.ndesc as usize > crate::desc::MAX_DESCS || h.notif as usize > MAX_NOTIF {
            return Err(XferError::Protocol("frame exceeds descriptor or notification limits"));
        }
        Ok(h)
    }

    /// Bytes of descriptors and notification between header and payload.
    pub fn meta_len(&self) -> usize {
        self.ndesc as usize * DESC_LEN + self.notif as usize
    }
}

/// Encode one descriptor.
pub fn encode_desc(d: &Desc, out: &mut [u8]) {
    out[0..4].copy_from_slice(&d.region.0.to_le_bytes());
    out[4..8].copy_from_slice(&0u32.to_le_bytes());
    out[8..16].copy_from_slice(&d.offset.to_le_bytes());
    out[16..24].copy_from_slice(&d.len.to_le_bytes());
}

/// Decode one descriptor from 24 bytes.
pub fn decode_desc(b: &[u8]) -> Desc {
    let mut r = [0u8; 4];
    r.copy_from_slice(&b[0..4]);
    let mut o = [0u8; 8];
    o.copy_from_slice(&b[8..16]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&b[16..24]);
    Desc {
        region: RegionId(u32::from_le_bytes(r)),
        offset: u64::from_le_bytes(o),
        len: u64::from_le_bytes(l),
    }
}

/// Little-endian, length-prefixed encoder for metadata blobs.
#[derive(Debug, Default)]
pub struct Enc {
    buf: Vec<u8>,
}

impl Enc {
    /// Start an empty blob.
    pub fn new() -> Self {
        Enc::default()
    }
    /// Append a byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// Append a u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Append a u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Append a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(&v[..v.len().min(u32::MAX as usize)]);
        self
    }
    /// The encoded bytes.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Decoder matching [`Enc`]; every read is bounds-checked.
#[derive(Debug)]
pub struct Dec<'a> {
    buf: &'a [u8],
}

impl<'a> Dec<'a> {
    /// Decode from `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Dec { buf }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(XferError::Protocol("truncated blob"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    /// Read a byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// Read a u32.
    pub fn u32(&mut self) -> Result<u32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    /// Read a u64.
    pub fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// Read a length-prefixed byte string.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_checks() {
        let h = Header {
            kind: FrameKind::WriteReq,
            status: 2,
            notif: 17,
            ndesc: 3,
            aux: 9,
            xfer: 0xdead_beef_0000_0001,
            payload: 1 << 33,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Ok(h));
        let mut bad = b;
        bad[2] = 99;
        assert_eq!(Header::decode(&bad), Err(XferError::Version { got: 99, want: WIRE_VERSION }));
        let mut bad = b;
        bad[0] = 0;
        assert!(Header::decode(&bad).is_err());
        let mut bad = b;
        bad[8..12].copy_from_slice(&5000u32.to_le_bytes());
        assert!(Header::decode(&bad).is_err());
    }

    #[test]
    fn desc_roundtrip() {
        let d = Desc::new(RegionId(7), 123_456_789_000, 65536);
        let mut b = [0u8; DESC_LEN];
        encode_desc(&d, &mut b);
        assert_eq!(decode_desc(&b), d);
    }

    #[test]
    fn blob_truncation_is_an_error() {
        let mut e = Enc::new();
        e.u8(1).u32(2).u64(3).bytes(b"abc");
        let v = e.finish();
        let mut d = Dec::new(&v);
        assert_eq!((d.u8(), d.u32(), d.u64()), (Ok(1), Ok(2), Ok(3)));
        assert_eq!(d.bytes(), Ok(&b"abc"[..]));
        let mut d = Dec::new(&v[..v.len() - 1]);
        let _ = (d.u8(), d.u32(), d.u64());
        assert!(d.bytes().is_err());
    }
}
