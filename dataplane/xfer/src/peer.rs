//! A standalone peer agent for tests and benchmarks: registers regions, prints its metadata
//! as one hex line on stdout, and serves until stdin closes (or it is killed).
//!
//! Regions can be filled with a deterministic pattern ([`pattern`]) so that a process reading
//! from the peer can check every byte without another channel.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::agent::{Agent, AgentConfig};
use crate::desc::Desc;
use crate::error::Result;
use crate::region::{HugePages, RegionId};

/// What the peer registers.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// Agent name.
    pub name: String,
    /// Sizes of memory regions to allocate (ids 0, 1, … in order).
    pub mem: Vec<u64>,
    /// File regions (path, length) registered after the memory regions.
    pub files: Vec<(PathBuf, u64)>,
    /// TCP listen address.
    pub tcp_listen: SocketAddr,
    /// Hugepage policy.
    pub hugepages: HugePages,
    /// Fill memory regions with [`pattern`] for this seed.
    pub fill_seed: Option<u64>,
    /// io_uring engine threads ([`AgentConfig::tcp_threads`]).
    pub tcp_threads: usize,
}

impl PeerConfig {
    /// A peer named `name` with no regions, listening on an ephemeral loopback port.
    pub fn new(name: impl Into<String>) -> Self {
        PeerConfig {
            name: name.into(),
            mem: vec![],
            files: vec![],
            tcp_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            hugepages: HugePages::Auto,
            fill_seed: None,
            tcp_threads: 1,
        }
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The deterministic content of bytes `off..off+out.len()` of region `region` for `seed`.
pub fn pattern(seed: u64, region: u32, off: u64, out: &mut [u8]) {
    let base = seed ^ u64::from(region).rotate_left(48);
    let mut i = 0usize;
    while i < out.len() {
        let pos = off + i as u64;
        let word = splitmix(base ^ (pos / 8)).to_le_bytes();
        let k = (pos % 8) as usize;
        let n = (8 - k).min(out.len() - i);
        out[i..i + n].copy_from_slice(&word[k..k + n]);
        i += n;
    }
}

/// Fill a whole local memory region with [`pattern`].
pub fn fill(agent: &Agent, region: RegionId, seed: u64) -> Result<()> {
    let (_, len) = agent.mem_ptr(region)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        pattern(seed, region.0, off, &mut buf[..n]);
        agent.write_local(Desc::new(region, off, n as u64), &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Start the agent and its regions, print the metadata line to `out`.
pub fn start(cfg: &PeerConfig, out: &mut impl Write) -> Result<Agent> {
    let mut ac = AgentConfig::new(cfg.name.clone());
    ac.tcp_listen = Some(cfg.tcp_listen);
    ac.hugepages = cfg.hugepages;
    ac.tcp_threads = cfg.tcp_threads;
    let agent = Agent::new(ac)?;
    for &len in &cfg.mem {
        let r = agent.alloc_mem(len)?;
        if let Some(seed) = cfg.fill_seed {
            fill(&agent, r, seed)?;
        }
    }
    for (path, len) in &cfg.files {
        agent.register_file(path, 0, *len)?;
    }
    let _ = writeln!(out, "{}", agent.metadata().to_hex());
    let _ = out.flush();
    Ok(agent)
}

/// Run a peer until stdin reaches EOF (the parent closed it or died).
pub fn serve_until_stdin_eof(cfg: &PeerConfig) -> Result<()> {
    let agent = start(cfg, &mut std::io::stdout())?;
    let mut line = String::new();
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    while lock.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
        line.clear();
    }
    drop(agent);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_position_addressed() {
        let mut whole = vec![0u8; 100];
        pattern(9, 2, 1000, &mut whole);
        for start in 0..100 {
            let mut part = vec![0u8; 100 - start];
            pattern(9, 2, 1000 + start as u64, &mut part);
            assert_eq!(part, whole[start..]);
        }
        let mut other = vec![0u8; 100];
        pattern(9, 3, 1000, &mut other);
        assert_ne!(other, whole);
    }
}
