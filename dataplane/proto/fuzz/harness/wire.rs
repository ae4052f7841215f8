//! Fuzz harness: arbitrary bytes as plane frames — split one after another, each payload
//! decoded as every message kind; what decodes must encode, and (without floats, which JSON
//! may not carry back exactly) decode again to the same message.

use std::fmt::Debug;

use kvx_proto::plane::{
    Cancel, Heartbeat, KvEvents, KvReady, Load, Note, OutputMsg, Peers, Register, Registered,
    Snapshot, SnapshotRequest, Submit,
};
use kvx_proto::wire;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut off = 0;
    for _ in 0..64 {
        if off >= data.len() {
            return;
        }
        match wire::split(&data[off..], 1 << 20) {
            Ok((_, payload, used)) => {
                assert!(used >= 6 && used <= data.len() - off, "a frame's length is its own");
                every_kind(payload);
                off += used;
            }
            Err(_) => {
                every_kind(&data[off..]);
                return;
            }
        }
    }
}

fn every_kind(p: &[u8]) {
    exact::<Cancel>(p);
    exact::<Heartbeat>(p);
    exact::<KvEvents>(p);
    exact::<Note>(p);
    exact::<Snapshot>(p);
    exact::<SnapshotRequest>(p);
    exact::<Peers>(p);
    exact::<KvReady>(p);
    exact::<Registered>(p);
    encodes::<Register>(p);
    encodes::<Submit>(p);
    encodes::<OutputMsg>(p);
    encodes::<Load>(p);
}

fn reencode<T: Serialize + DeserializeOwned>(v: &T) -> Vec<u8> {
    let mut buf = Vec::new();
    wire::encode(1, v, &mut buf).expect("a decoded message encodes");
    let (kind, payload, used) = wire::split(&buf, usize::MAX).expect("its own frame splits");
    assert_eq!((kind, used), (1, buf.len()));
    payload.to_vec()
}

fn exact<T: Serialize + DeserializeOwned + PartialEq + Debug>(p: &[u8]) {
    if let Ok(v) = wire::decode::<T>(p) {
        let again: T = wire::decode(&reencode(&v)).expect("an encoded message decodes");
        assert_eq!(again, v);
    }
}

fn encodes<T: Serialize + DeserializeOwned>(p: &[u8]) {
    if let Ok(v) = wire::decode::<T>(p) {
        let _ = wire::decode::<T>(&reencode(&v));
    }
}
