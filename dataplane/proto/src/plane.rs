//! The worker planes between a frontend and the workers it routes to: the message kinds and
//! payloads carried in [`crate::wire`] frames over one TCP connection per worker process.
//!
//! A worker process hosting several engines (shards) registers each as its own worker id on
//! that connection. The connection carries both planes:
//!
//! * request plane: [`Submit`] and [`Cancel`] down; [`OutputMsg`] (token deltas, then one
//!   `Finished` or `Error`) up;
//! * event plane: [`KvEvents`], [`Note`] (first token, finished), [`Snapshot`] (answering
//!   [`SnapshotRequest`] after lost events) and [`Load`] up;
//! * liveness: [`Heartbeat`] both ways at a fixed interval; a peer silent for longer than
//!   the timeout, or a closed connection, is dead;
//! * disaggregated serving: a worker registers its [`WorkerRole`] and, where it moves KV,
//!   its [`KvPeer`] (transfer agent metadata and KV layout, sent once); the frontend sends
//!   each prefill worker the decode workers' peers ([`Peers`], once per peer) and tells a
//!   decode worker whether a request's KV arrived ([`KvReady`]).
//!
//! Readers skip frames of kinds they do not know, so new kinds can be added without a
//! version bump; a changed payload of an existing kind needs a new [`crate::wire::VERSION`].

use serde::{Deserialize, Serialize};

use crate::WorkerId;
use crate::events::{KvEvent, StorageTier, StoredBlock};
use crate::hashing::SequenceHash;
use crate::load::WorkerMetrics;
use crate::request::{GenerateRequest, Output, RequestId};

/// Frame kinds (the `kind` byte of a [`crate::wire`] frame).
pub mod kind {
    /// Worker → frontend: [`super::Register`].
    pub const REGISTER: u8 = 1;
    /// Frontend → worker: [`super::Registered`].
    pub const REGISTERED: u8 = 2;
    /// Frontend → worker: [`super::Submit`].
    pub const SUBMIT: u8 = 3;
    /// Frontend → worker: [`super::Cancel`].
    pub const CANCEL: u8 = 4;
    /// Worker → frontend: [`super::OutputMsg`].
    pub const OUTPUT: u8 = 5;
    /// Worker → frontend: [`super::KvEvents`].
    pub const KV_EVENTS: u8 = 6;
    /// Worker → frontend: [`super::Note`].
    pub const NOTE: u8 = 7;
    /// Frontend → worker: [`super::SnapshotRequest`].
    pub const SNAPSHOT_REQUEST: u8 = 8;
    /// Worker → frontend: [`super::Snapshot`].
    pub const SNAPSHOT: u8 = 9;
    /// Worker → frontend: [`super::Load`].
    pub const LOAD: u8 = 10;
    /// Both ways: [`super::Heartbeat`].
    pub const HEARTBEAT: u8 = 11;
    /// Frontend → worker: [`super::Peers`].
    pub const PEERS: u8 = 12;
    /// Frontend → worker: [`super::KvReady`].
    pub const KV_READY: u8 = 13;
}

/// What a worker does in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum WorkerRole {
    /// Prefill and decode (aggregated).
    #[default]
    Agg,
    /// Prompts only: their KV goes to decode workers.
    Prefill,
    /// Decode, with prompts' KV from prefill workers (or computed here when it is cheaper).
    Decode,
}

impl WorkerRole {
    /// The lower-case name (flags, metrics).
    pub fn name(self) -> &'static str {
        match self {
            WorkerRole::Agg => "agg",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// Where a worker's KV blocks can be written by a peer. Its `Debug` leaves out the agent
/// metadata, which holds the agent's key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPeer {
    /// The transfer agent's metadata (kvx-xfer `AgentMetadata`, encoded; empty for mock
    /// engines, whose transfers are modelled).
    pub agent: Vec<u8>,
    /// The agent's region holding this worker's KV cache.
    pub region: u32,
    /// Where the keys start in the region.
    pub k_offset: u64,
    /// Where the values start.
    pub v_offset: u64,
    /// Bytes of one block's keys (and of its values).
    pub block_bytes: u64,
}

impl std::fmt::Debug for KvPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPeer")
            .field("agent", &format_args!("<{} bytes>", self.agent.len()))
            .field("region", &self.region)
            .field("k_offset", &self.k_offset)
            .field("v_offset", &self.v_offset)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

/// The KV peers of decode workers, for a prefill worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peers {
    /// `(decode worker, its peer)`.
    pub peers: Vec<(WorkerId, KvPeer)>,
}

/// Whether a reserved request's KV arrived at its decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvReady {
    /// The decode worker.
    pub worker_id: WorkerId,
    /// The request.
    pub id: RequestId,
    /// True: the KV is in its blocks; false: it will not come (compute the prompt here).
    pub arrived: bool,
}

/// A worker (one engine) joins: the first frames of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    /// Its id, unique in the cluster.
    pub worker_id: WorkerId,
    /// The served model's name (must match the frontend's).
    pub model: String,
    /// Tokens per KV block (must match the router's).
    pub block_size: usize,
    /// KV blocks of its pool.
    pub kv_blocks: usize,
    /// Requests it runs at once at most.
    pub max_num_seqs: usize,
    /// Its part in disaggregated serving.
    #[serde(default)]
    pub role: WorkerRole,
    /// Where peers write its KV (decode workers), or how it writes others' (prefill).
    #[serde(default)]
    pub kv_peer: Option<KvPeer>,
    /// The arithmetic its model engines compute in and the kernel level computing it
    /// (`split-kv-half/avx512/free-attention`, `exact/avx2`, ...; empty for mock engines): one
    /// fleet computes in one, or its KV blocks and tokens would differ by worker.
    #[serde(default)]
    pub arith: String,
}

/// The frontend's answer to a [`Register`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    /// The worker.
    pub worker_id: WorkerId,
    /// Whether it was accepted.
    pub accepted: bool,
    /// Why not, when refused.
    pub reason: String,
}

/// Start a request on a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submit {
    /// The worker (engine) that runs it.
    pub worker_id: WorkerId,
    /// The request.
    pub request: GenerateRequest,
}

/// Cancel a request (idempotent; unknown ids are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    /// The worker running it.
    pub worker_id: WorkerId,
    /// The request.
    pub id: RequestId,
}

/// One output of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputMsg {
    /// The request.
    pub id: RequestId,
    /// The output.
    pub output: Output,
}

/// KV events of the connection's workers, in order per worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvents {
    /// The events.
    pub events: Vec<KvEvent>,
}

/// A request lifecycle note, for the router's load accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoteKind {
    /// The request produced its first token (its prefill is done).
    FirstToken,
    /// The request ended (finished, failed or cancelled).
    Finished,
}

/// A lifecycle note of one request on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    /// The worker.
    pub worker_id: WorkerId,
    /// The request.
    pub id: RequestId,
    /// What happened.
    pub note: NoteKind,
}

/// Ask a worker for every block it holds (after lost events, or when it joins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// The worker.
    pub worker_id: WorkerId,
}

/// Every cached block of a worker, parents before children.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The worker.
    pub worker_id: WorkerId,
    /// Events up to this id are reflected in the snapshot.
    pub last_event_id: u64,
    /// `(parent, block)` pairs of the engine's pool.
    pub blocks: Vec<(Option<SequenceHash>, StoredBlock)>,
    /// Blocks of the tiers below it, `(tier, parent, block)`, parents first in each tier.
    #[serde(default)]
    pub lower: Vec<(StorageTier, Option<SequenceHash>, StoredBlock)>,
}

/// A worker's load and counters (its id is `metrics.load.worker_id`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Load and counters.
    pub metrics: WorkerMetrics,
    /// The worker is draining: it runs what it has and takes nothing new, so its frontend
    /// takes it out of routing (absent, from older workers: not draining).
    #[serde(default)]
    pub draining: bool,
}

/// Liveness, both ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Sender's counter.
    pub seq: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEventData;
    use crate::hashing::LocalBlockHash;
    use crate::request::{ErrorClass, KvDest, KvRole, SamplingOptions, StopConditions};
    use crate::wire::{MAX_FRAME, decode, encode, split};

    fn round_trip<T>(kind: u8, msg: &T) -> T
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        let mut buf = Vec::new();
        encode(kind, msg, &mut buf).unwrap();
        let (k, payload, used) = split(&buf, MAX_FRAME).unwrap();
        assert_eq!((k, used), (kind, buf.len()));
        decode(payload).unwrap()
    }

    #[test]
    fn every_message_round_trips_through_a_frame() {
        let reg = Register {
            worker_id: 7,
            model: "m".into(),
            block_size: 16,
            kv_blocks: 256,
            max_num_seqs: 64,
            role: WorkerRole::Decode,
            kv_peer: Some(KvPeer {
                agent: vec![1, 2, 3],
                region: 2,
                k_offset: 0,
                v_offset: 4096,
                block_bytes: 512,
            }),
            arith: "split/avx512".into(),
        };
        assert_eq!(round_trip(kind::REGISTER, &reg), reg);
        let ready = KvReady { worker_id: 7, id: RequestId(9), arrived: false };
        assert_eq!(round_trip(kind::KV_READY, &ready), ready);
        let peers = Peers { peers: vec![(7, reg.kv_peer.clone().expect("peer"))] };
        assert_eq!(round_trip(kind::PEERS, &peers), peers);
        let ack = Registered { worker_id: 7, accepted: false, reason: "model".into() };
        assert_eq!(round_trip(kind::REGISTERED, &ack), ack);
        let sub = Submit {
            worker_id: 7,
            request: GenerateRequest {
                id: RequestId(u64::MAX),
                prompt: vec![1, 2, 3],
                sampling: SamplingOptions::default(),
                stop: StopConditions::default(),
                logprobs: None,
                salt: Some("t".into()),
                kv: KvRole::PrefillTo(KvDest { worker: 3, first_block: 2, blocks: vec![9, 4] }),
                resume: Vec::new(),
                constraint: None,
                prompt_logprobs: None,
                fork: None,
            },
        };
        assert_eq!(round_trip(kind::SUBMIT, &sub), sub);
        let c = Cancel { worker_id: 7, id: RequestId(3) };
        assert_eq!(round_trip(kind::CANCEL, &c), c);
        let o = OutputMsg {
            id: RequestId(3),
            output: Output::Error { class: ErrorClass::Unavailable, message: "gone".into() },
        };
        assert_eq!(round_trip(kind::OUTPUT, &o), o);
        let block = StoredBlock { seq_hash: SequenceHash(u64::MAX), local_hash: LocalBlockHash(1) };
        let ev = KvEvents {
            events: vec![KvEvent {
                worker_id: 7,
                event_id: 1,
                tier: StorageTier::Device,
                data: KvEventData::Stored { parent: None, blocks: vec![block] },
            }],
        };
        assert_eq!(round_trip(kind::KV_EVENTS, &ev), ev);
        let n = Note { worker_id: 7, id: RequestId(3), note: NoteKind::FirstToken };
        assert_eq!(round_trip(kind::NOTE, &n), n);
        let s = Snapshot {
            worker_id: 7,
            last_event_id: 9,
            blocks: vec![(None, block)],
            lower: vec![(StorageTier::Disk, None, block)],
        };
        assert_eq!(round_trip(kind::SNAPSHOT, &s), s);
        let l = Load {
            metrics: WorkerMetrics { prompt_tokens: 5, ..Default::default() },
            draining: true,
        };
        assert_eq!(round_trip(kind::LOAD, &l), l);
        let h = Heartbeat { seq: 2 };
        assert_eq!(round_trip(kind::HEARTBEAT, &h), h);
        let r = SnapshotRequest { worker_id: 7 };
        assert_eq!(round_trip(kind::SNAPSHOT_REQUEST, &r), r);
    }
}
