//! Agent metadata: who an agent is, where to reach it and which regions it exposes.
//!
//! Metadata is what discovery carries between processes. It encodes to a compact versioned
//! blob ([`AgentMetadata::encode`]) and, for text channels, to hex. It carries the agent's
//! secret key (see [`crate::auth`]): whoever holds an agent's metadata can connect to it, so
//! it travels only over authenticated channels (the worker planes) or stays in-process.
//! Queue-pair details of the RDMA backend, once it is wired into agents, are to travel the
//! same way, with the metadata.

use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::auth::KEY_LEN;
use crate::error::{Result, XferError};
use crate::region::{RegionId, RegionKind};
use crate::wire::{Dec, Enc};

/// Version of the metadata blob layout (2: carries the agent's key; version 1 blobs, which
/// do not, are refused).
pub const META_VERSION: u8 = 2;
const META_MAGIC: u32 = 0x444D_584B; // "KXMD"

/// One exposed region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Region id within its agent.
    pub id: RegionId,
    /// Memory or file.
    pub kind: RegionKind,
    /// Length in bytes.
    pub len: u64,
}

/// Everything a peer needs to transfer to or from an agent.
///
/// Its `Debug` output leaves the key out.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// Agent name (unique within a deployment by convention).
    pub name: String,
    /// Random id of this agent instance; a restarted agent gets a new one.
    pub instance: u64,
    /// Identity of the host and network namespace; equal values mean shared memory works.
    pub host: u64,
    /// Process id (informational).
    pub pid: u32,
    /// TCP endpoint, when the agent listens.
    pub tcp: Option<SocketAddr>,
    /// Abstract Unix socket name of the same-host channel, when enabled.
    pub unix: Option<String>,
    /// Exposed regions.
    pub regions: Vec<RegionInfo>,
    /// The agent's secret: peers prove they hold it before the agent serves them. All zero
    /// in metadata that was served without it ([`Agent::fetch_metadata`](crate::Agent::fetch_metadata)),
    /// which cannot be used to connect.
    pub key: [u8; KEY_LEN],
}

impl fmt::Debug for AgentMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentMetadata")
            .field("name", &self.name)
            .field("instance", &self.instance)
            .field("host", &self.host)
            .field("pid", &self.pid)
            .field("tcp", &self.tcp)
            .field("unix", &self.unix)
            .field("regions", &self.regions)
            .field("key", &if self.has_key() { "(set)" } else { "(none)" })
            .finish()
    }
}

impl AgentMetadata {
    /// Encode to the versioned binary blob.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::new();
        e.u32(META_MAGIC).u8(META_VERSION);
        e.bytes(self.name.as_bytes()).u64(self.instance).u64(self.host).u32(self.pid);
        e.bytes(self.tcp.map(|a| a.to_string()).unwrap_or_default().as_bytes());
        e.bytes(self.unix.as_deref().unwrap_or("").as_bytes());
        e.bytes(&self.key);
        e.u32(u32::try_from(self.regions.len()).unwrap_or(u32::MAX));
        for r in &self.regions {
            e.u32(r.id.0).u8(match r.kind {
                RegionKind::Mem => 0,
                RegionKind::File => 1,
            });
            e.u64(r.len);
        }
        e.finish()
    }

    /// Decode a blob produced by [`encode`](Self::encode).
    pub fn decode(b: &[u8]) -> Result<AgentMetadata> {
        let mut d = Dec::new(b);
        if d.u32()? != META_MAGIC {
            return Err(XferError::Protocol("not an agent metadata blob"));
        }
        let v = d.u8()?;
        if v == 1 {
            return Err(XferError::Protocol(
                "metadata version 1 carries no key (the agent runs an older kvx-xfer)",
            ));
        }
        if v != META_VERSION {
            return Err(XferError::Version { got: v, want: META_VERSION });
        }
        let text = |b: &[u8]| {
            String::from_utf8(b.to_vec())
                .map_err(|_| XferError::Protocol("metadata text not UTF-8"))
        };
        let name = text(d.bytes()?)?;
        let instance = d.u64()?;
        let host = d.u64()?;
        let pid = d.u32()?;
        let tcp = text(d.bytes()?)?;
        let tcp = if tcp.is_empty() {
            None
        } else {
            Some(tcp.parse().map_err(|_| XferError::Protocol("bad tcp address in metadata"))?)
        };
        let unix = text(d.bytes()?)?;
        let unix = if unix.is_empty() { None } else { Some(unix) };
        let key = <[u8; KEY_LEN]>::try_from(d.bytes()?)
            .map_err(|_| XferError::Protocol("bad key length in metadata"))?;
        let n = d.u32()? as usize;
        if n > d.remaining() / 13 {
            return Err(XferError::Protocol("region count exceeds blob"));
        }
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            let id = RegionId(d.u32()?);
            let kind = match d.u8()? {
                0 => RegionKind::Mem,
                1 => RegionKind::File,
                _ => return Err(XferError::Protocol("bad region kind")),
            };
            regions.push(RegionInfo { id, kind, len: d.u64()? });
        }
        Ok(AgentMetadata { name, instance, host, pid, tcp, unix, regions, key })
    }

    /// Encode as lowercase hex (for stdout, env vars, text discovery stores).
    pub fn to_hex(&self) -> String {
        let b = self.encode();
        let mut s = String::with_capacity(b.len() * 2);
        for x in b {
            s.push(char::from(b"0123456789abcdef"[usize::from(x >> 4)]));
            s.push(char::from(b"0123456789abcdef"[usize::from(x & 15)]));
        }
        s
    }

    /// Decode from [`to_hex`](Self::to_hex) output.
    pub fn from_hex(s: &str) -> Result<AgentMetadata> {
        let s = s.trim().as_bytes();
        if !s.len().is_multiple_of(2) {
            return Err(XferError::Protocol("odd-length hex"));
        }
        let nib = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(XferError::Protocol("bad hex digit")),
        };
        let b =
            s.chunks(2).map(|p| Ok(nib(p[0])? << 4 | nib(p[1])?)).collect::<Result<Vec<u8>>>()?;
        Self::decode(&b)
    }

    /// Whether the metadata carries a key (metadata served by GetMeta does not).
    pub fn has_key(&self) -> bool {
        self.key != [0u8; KEY_LEN]
    }

    /// The same metadata with the key zeroed, safe to hand to anyone.
    pub fn without_key(&self) -> AgentMetadata {
        AgentMetadata { key: [0u8; KEY_LEN], ..self.clone() }
    }

    /// The exposed region with this id.
    pub fn region(&self, id: RegionId) -> Option<&RegionInfo> {
        self.regions.iter().find(|r| r.id == id)
    }
}

/// Identity of this host and network namespace (boot id hashed with the netns inode).
pub(crate) fn host_id() -> u64 {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in boot.trim().bytes().chain(ns.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".into(),
            instance: 42,
            host: 7,
            pid: 1234,
            tcp: Some("127.0.0.1:5555".parse().unwrap()),
            unix: Some("kvx-xfer-abc".into()),
            regions: vec![
                RegionInfo { id: RegionId(0), kind: RegionKind::Mem, len: 1 << 30 },
                RegionInfo { id: RegionId(1), kind: RegionKind::File, len: 4096 },
            ],
            key: [0x5a; KEY_LEN],
        }
    }

    #[test]
    fn roundtrip() {
        let m = sample();
        assert_eq!(AgentMetadata::decode(&m.encode()), Ok(m.clone()));
        assert_eq!(AgentMetadata::from_hex(&m.to_hex()), Ok(m.clone()));
        let none = AgentMetadata { tcp: None, unix: None, regions: vec![], ..m.clone() };
        assert_eq!(AgentMetadata::decode(&none.encode()), Ok(none));
        let keyless = m.without_key();
        assert!(m.has_key() && !keyless.has_key());
        assert_eq!(AgentMetadata::decode(&keyless.encode()), Ok(keyless));
    }

    #[test]
    fn debug_leaves_the_key_out() {
        let m = sample();
        let s = format!("{m:?}");
        assert!(s.contains("prefill-0") && s.contains("(set)"), "{s}");
        assert!(!s.contains("90, 90"), "key bytes (0x5a = 90) printed: {s}");
    }

    #[test]
    fn rejects_garbage_and_versions() {
        let mut b = sample().encode();
        b[4] = 3;
        assert_eq!(AgentMetadata::decode(&b), Err(XferError::Version { got: 3, want: 2 }));
        b[4] = 1;
        assert!(
            matches!(AgentMetadata::decode(&b), Err(XferError::Protocol(m)) if m.contains("no key"))
        );
        let b = sample().encode();
        for cut in 0..b.len() {
            assert!(AgentMetadata::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        assert!(AgentMetadata::from_hex("zz").is_err());
    }
}
