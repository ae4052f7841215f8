//! Fuzz harness: arbitrary bytes as an agent's metadata blob (what a peer publishes and another
//! connects with), as a frame header and as transfer descriptors. What decodes must encode back
//! to a blob that decodes to the same metadata.

use kvx_xfer::AgentMetadata;
use kvx_xfer::wire::{HEADER_LEN, Header, decode_desc};

/// Runs one input.
pub fn run(data: &[u8]) {
    if let Ok(m) = AgentMetadata::decode(data) {
        let again = AgentMetadata::decode(&m.encode()).expect("an encoded blob decodes");
        assert!(again == m, "metadata changed through encode and decode");
    }
    if let Some(h) = data.first_chunk::<HEADER_LEN>()
        && let Ok(h) = Header::decode(h)
    {
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b).expect("an encoded header decodes"), h);
        let _ = h.meta_len();
    }
    for c in data.chunks_exact(24).take(64) {
        let _ = decode_desc(c);
    }
}
