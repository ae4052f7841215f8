//! The transfer benchmark behind `kvx bench xfer`: GB/s and latency percentiles per backend.
//!
//! The initiator owns a pool of `blocks` blocks of `block_size` bytes and moves it to or from
//! the remote pool in transfers of `batch` blocks (block `i` ↔ remote block `i`), keeping
//! `inflight` transfers posted. Walking the whole pool keeps blocks cold when the pool is
//! larger than the caches. Transfers are prepped once; the timed loop only posts and waits.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::agent::{Agent, AgentConfig, Backend, ZeroCopy};
use crate::desc::{Desc, Op};
use crate::error::{Result, XferError};
use crate::meta::AgentMetadata;
use crate::region::{HugePages, RegionId};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Backend to force.
    pub backend: Backend,
    /// Direction.
    pub op: Op,
    /// Bytes per block.
    pub block_size: u64,
    /// Blocks in the pool on each side.
    pub blocks: u64,
    /// Blocks (descriptors) per transfer.
    pub batch: u64,
    /// Transfers kept in flight.
    pub inflight: usize,
    /// Measured time.
    pub duration: Duration,
    /// Unmeasured time before it.
    pub warmup: Duration,
    /// Hugepage policy for the local pool.
    pub hugepages: HugePages,
    /// Non-temporal copy threshold for the shm backend.
    pub nt_threshold: usize,
    /// Copy threads of the shm backend.
    pub copy_threads: usize,
    /// io_uring engine threads (connections per remote) of the tcp backend.
    pub tcp_threads: usize,
    /// Backing file for the file backend.
    pub file: PathBuf,
    /// Send a notification with every transfer.
    pub notify: bool,
    /// Zero-copy send policy (tcp).
    pub zero_copy: ZeroCopy,
}

/// Measured result.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Backend name.
    pub backend: String,
    /// "read" or "write".
    pub op: String,
    /// Bytes per block.
    pub block_size: u64,
    /// Blocks per transfer.
    pub batch: u64,
    /// Blocks in the pool.
    pub blocks: u64,
    /// Transfers in flight.
    pub inflight: usize,
    /// Transfers completed in the measured window.
    pub transfers: u64,
    /// Bytes moved in the measured window.
    pub bytes: u64,
    /// Length of the measured window.
    pub secs: f64,
    /// 10^9 bytes per second.
    pub gbps: f64,
    /// Transfer latency percentiles in microseconds (post → observed completion).
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Maximum.
    pub max_us: f64,
    /// Whether the local pool sits on hugetlb pages.
    pub hugepages: bool,
    /// Copy threads of the shm backend.
    pub copy_threads: usize,
    /// io_uring engine threads of the tcp backend (this side and the spawned peer).
    pub tcp_threads: usize,
    /// 1-minute load average when the run ended.
    pub load1: f64,
}

impl BenchReport {
    /// One human-readable line.
    pub fn line(&self) -> String {
        format!(
            "{:<5} {:<5} block {:>8} x{:<4} inflight {:<3} {:>7.3} GB/s  {:>7} xfers  lat p50 {:.1} p90 {:.1} p99 {:.1} max {:.1} us  (huge {}, copy threads {}, tcp threads {}, load {:.2})",
            self.backend,
            self.op,
            self.block_size,
            self.batch,
            self.inflight,
            self.gbps,
            self.transfers,
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.max_us,
            self.hugepages,
            self.copy_threads,
            self.tcp_threads,
            self.load1
        )
    }
}

/// The 1-minute load average (0 when unavailable).
pub fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)]) / 10.0
}

/// Run the initiator side. `remote` is the peer's metadata (shm, tcp); the file backend
/// needs none (it transfers between the local pool and a local file).
pub fn run(cfg: &BenchConfig, remote: Option<&AgentMetadata>) -> Result<BenchReport> {
    if cfg.batch == 0 || cfg.blocks < cfg.batch || cfg.inflight == 0 || cfg.block_size == 0 {
        return Err(XferError::Mismatch(
            "need blocks >= batch >= 1, inflight >= 1, block size >= 1",
        ));
    }
    let pool =
        cfg.block_size.checked_mul(cfg.blocks).ok_or(XferError::Unsupported("pool too large"))?;
    let mut ac = AgentConfig::new("bench-initiator");
    ac.tcp_listen = None;
    ac.hugepages = cfg.hugepages;
    ac.nt_threshold = cfg.nt_threshold;
    ac.copy_threads = cfg.copy_threads;
    ac.tcp_threads = cfg.tcp_threads;
    ac.max_inflight = cfg.inflight.max(16) * 2;
    ac.ring_entries = 256;
    ac.tcp_zero_copy = cfg.zero_copy;
    let agent = Agent::new(ac)?;
    let local = agent.alloc_mem(pool)?;
    let huge = agent.is_huge(local)?;
    // Touch the source so every page is real and distinct.
    let chunk = vec![0x5au8; (1 << 20).min(pool) as usize];
    let mut off = 0;
    while off < pool {
        let n = (pool - off).min(chunk.len() as u64);
        agent.write_local(Desc::new(local, off, n), &chunk[..n as usize])?;
        off += n;
    }
    let (rid, target) = match cfg.backend {
        Backend::File => {
            let t = agent.register_file(&cfg.file, 0, pool)?;
            (agent.add_remote(&agent.metadata())?, t)
        }
        _ => {
            let md = remote.ok_or(XferError::Unsupported("this backend needs a peer"))?;
            let r = md.regions.first().ok_or(XferError::UnknownRegion(0))?;
            if r.len < pool {
                return Err(XferError::OutOfBounds {
                    region: r.id.0,
                    offset: 0,
                    len: pool,
                    region_len: r.len,
                });
            }
            (agent.add_remote(md)?, r.id)
        }
    };
    let nx = cfg.blocks / cfg.batch;
    let mut preps = Vec::with_capacity(nx as usize);
    for i in 0..nx {
        let l: Vec<Desc> = (0..cfg.batch)
            .map(|j| Desc::new(local, (i * cfg.batch + j) * cfg.block_size, cfg.block_size))
            .collect();
        let r: Vec<Desc> =
            l.iter().map(|d| Desc::new(RegionId(target.0), d.offset, d.len)).collect();
        preps.push(agent.prep(rid, &l, &r, Some(cfg.backend))?);
    }
    let per_xfer = cfg.batch * cfg.block_size;
    let notif: &[u8] = if cfg.notify { b"bench" } else { b"" };
    if cfg.backend == Backend::File && cfg.op == Op::Read {
        // Lay the file out once so reads hit written blocks.
        drive(&agent, &preps, Op::Write, cfg.inflight, notif, None, Some(nx))?;
    }
    drive(&agent, &preps, cfg.op, cfg.inflight, notif, Some(cfg.warmup), None)?;
    let cap = (cfg.duration.as_secs_f64() * 2e6) as usize + 1024;
    let mut lat = Vec::with_capacity(cap.min(1 << 24));
    let t0 = Instant::now();
    let n = drive(&agent, &preps, cfg.op, cfg.inflight, notif, Some(cfg.duration), None).map(
        |(n, l)| {
            lat = l;
            n
        },
    )?;
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    let bytes = n * per_xfer;
    Ok(BenchReport {
        backend: format!("{:?}", cfg.backend).to_lowercase(),
        op: format!("{:?}", cfg.op).to_lowercase(),
        block_size: cfg.block_size,
        batch: cfg.batch,
        blocks: cfg.blocks,
        inflight: cfg.inflight,
        transfers: n,
        bytes,
        secs,
        gbps: bytes as f64 / secs / 1e9,
        p50_us: pct(&lat, 0.50),
        p90_us: pct(&lat, 0.90),
        p99_us: pct(&lat, 0.99),
        max_us: pct(&lat, 1.0),
        hugepages: huge,
        copy_threads: cfg.copy_threads,
        tcp_threads: cfg.tcp_threads,
        load1: load1(),
    })
}

/// Keep `inflight` transfers posted, cycling through `preps`, for `dur` or `count` transfers.
/// Returns completed transfers and their latencies in tenths of a microsecond.
///
/// When the window is full the driver sleeps until the older half of it is done,
/// then reaps everything finished from the front: one wake-up per half window instead of one
/// per transfer. Latency uses the completion time the engine recorded, so it does not include
/// the driver's own sleep.
fn drive(
    agent: &Agent,
    preps: &[crate::agent::Prepped],
    op: Op,
    inflight: usize,
    notif: &[u8],
    dur: Option<Duration>,
    count: Option<u64>,
) -> Result<(u64, Vec<u32>)> {
    let start = Instant::now();
    let mut q: VecDeque<(Instant, crate::agent::XferHandle)> = VecDeque::with_capacity(inflight);
    let mut lat = Vec::with_capacity(if count.is_some() { 0 } else { 1 << 20 });
    let mut next = 0usize;
    let mut posted = 0u64;
    let mut done = 0u64;
    let wait = Duration::from_secs(60);
    loop {
        let more = match (dur, count) {
            (_, Some(c)) => posted < c,
            (Some(d), None) => start.elapsed() < d,
            (None, None) => false,
        };
        while more && q.len() < inflight && count.is_none_or(|c| posted < c) {
            let h = agent.post(op, &preps[next], notif)?;
            q.push_back((Instant::now(), h));
            next = (next + 1) % preps.len();
            posted += 1;
        }
        if q.is_empty() {
            break;
        }
        // Wake when the older half is done (at least one transfer stays in flight).
        let target = if more { (q.len() - 1) / 2 } else { 0 };
        q[target].1.wait(wait)?;
        while let Some((t, h)) = q.front() {
            let Some(at) = h.completed_at() else { break };
            h.wait(Duration::ZERO)?;
            done += 1;
            if lat.len() < lat.capacity() {
                let d = at.saturating_duration_since(*t);
                lat.push(u32::try_from(d.as_nanos() / 100).unwrap_or(u32::MAX));
            }
            q.pop_front();
        }
    }
    Ok((done, lat))
}
