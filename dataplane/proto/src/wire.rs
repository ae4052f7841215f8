//! Versioned wire frames for the request and event planes.
//!
//! A frame is `len: u32 LE` (bytes after this field) ‖ `version: u8` ‖ `kind: u8` ‖ payload
//! (JSON). Readers reject frames of another version or over their size limit, so a peer
//! speaking a newer protocol is told so instead of being misread.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The protocol version of this build.
pub const VERSION: u8 = 1;

/// Largest frame accepted by default.
pub const MAX_FRAME: usize = 64 << 20;

/// Errors decoding a frame.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the frame needs (wait for more).
    #[error("incomplete frame")]
    Incomplete,
    /// Frame larger than allowed.
    #[error("frame of {0} bytes exceeds the limit of {1}")]
    TooLarge(usize, usize),
    /// A peer with another protocol version.
    #[error("peer speaks protocol version {0}, this build speaks {VERSION}")]
    Version(u8),
    /// Payload that does not parse.
    #[error("malformed frame payload: {0}")]
    Payload(#[from] serde_json::Error),
}

/// Appends one frame carrying `msg` to `out`.
pub fn encode<T: Serialize>(kind: u8, msg: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, VERSION, kind]);
    serde_json::to_writer(&mut *out, msg)?;
    let len = out.len() - start - 4;
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Splits one frame off the front of `buf`: `(kind, payload, bytes consumed)`.
pub fn split(buf: &[u8], max: usize) -> Result<(u8, &[u8], usize), WireError> {
    if buf.len() < 4 {
        return Err(WireError::Incomplete);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > max {
        return Err(WireError::TooLarge(len, max));
    }
    if len < 2 {
        return Err(WireError::Payload(serde::de::Error::custom("frame shorter than its header")));
    }
    if buf.len() < 4 + len {
        return Err(WireError::Incomplete);
    }
    if buf[4] != VERSION {
        return Err(WireError::Version(buf[4]));
    }
    Ok((buf[5], &buf[6..4 + len], 4 + len))
}

/// Decodes a payload.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    Ok(serde_json::from_slice(payload)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{FinishReason, Output, Usage};

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let mut buf = Vec::new();
        let msg = Output::Finished {
            reason: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_tokens: 0,
                ..Default::default()
            },
        };
        encode(7, &msg, &mut buf).unwrap();
        encode(8, &msg, &mut buf).unwrap();
        let (kind, payload, used) = split(&buf, MAX_FRAME).unwrap();
        assert_eq!(kind, 7);
        assert_eq!(decode::<Output>(payload).unwrap(), msg);
        let (kind, _, used2) = split(&buf[used..], MAX_FRAME).unwrap();
        assert_eq!((kind, used + used2), (8, buf.len()));
        assert!(matches!(split(&buf[..used - 1], MAX_FRAME), Err(WireError::Incomplete)));
        assert!(matches!(split(&buf, 4), Err(WireError::TooLarge(..))));
        let mut bad = buf.clone();
        bad[4] = 99;
        assert!(matches!(split(&bad, MAX_FRAME), Err(WireError::Version(99))));
        let mut junk = vec![5, 0, 0, 0, VERSION, 1];
        junk.extend_from_slice(b"{{{");
        let (_, p, _) = split(&junk, MAX_FRAME).unwrap();
        assert!(decode::<Output>(p).is_err());
    }
}
