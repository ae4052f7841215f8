//! The mover: one thread per tier set that moves block bytes through the process's kvx-xfer
//! agent (a transfer to itself: shared-memory copies between the engine's pool and the host
//! tier, `O_DIRECT` io_uring reads and writes between the host tier and the disk file) and
//! checks and writes checksums. It takes jobs from a bounded queue and answers each with one
//! [`Done`]; the shard never waits for it.
//!
//! Jobs name slots and blocks only; the mover turns them into descriptor lists (two per
//! block between the pool and host memory, keys and values; one for a block's data plus one
//! for its header between host memory and disk) and posts each job as few transfers as the
//! descriptor limit allows.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::{Duration, Instant};

use kvx_xfer::{Agent, Desc, MAX_DESCS, Op, RegionId, RemoteId};
use xxhash_rust::xxh3::Xxh3;

use crate::disk::{DiskLayout, HEADER_BYTES, Header, align_up};

/// Headers staged for one persist job at most.
pub const MAX_PERSIST: usize = 256;

/// Where the engine's pool keeps a block's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLayout {
    /// The agent region the pool lives in.
    pub region: RegionId,
    /// Where the keys of block 0 start.
    pub k_offset: u64,
    /// Where the values of block 0 start.
    pub v_offset: u64,
    /// Bytes of one block's keys (and of its values).
    pub block_bytes: u64,
}

/// Where every tier's bytes are.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub(crate) pool: PoolLayout,
    /// Host tier: slot `s` holds keys at `s · 2p`, values at `s · 2p + p` (`p` the block's
    /// bytes rounded up to 4 KiB).
    pub(crate) host: RegionId,
    /// Disk tier file and its slots.
    pub(crate) disk: Option<(RegionId, DiskLayout)>,
    /// Staging memory for headers ([`MAX_PERSIST`] × 4 KiB).
    pub(crate) headers: RegionId,
}

impl Geometry {
    fn pad(&self) -> u64 {
        align_up(self.pool.block_bytes)
    }

    pub(crate) fn host_slot_bytes(&self) -> u64 {
        2 * self.pad()
    }

    fn host_k(&self, s: u32) -> u64 {
        u64::from(s) * self.host_slot_bytes()
    }

    /// Key and value descriptor pairs between pool block `b` and host slot `s`.
    fn pool_host(&self, b: u32, s: u32, local: &mut Vec<Desc>, remote: &mut Vec<Desc>) {
        let (p, bb) = (&self.pool, self.pool.block_bytes);
        let k = self.host_k(s);
        local.push(Desc::new(p.region, p.k_offset + u64::from(b) * bb, bb));
        remote.push(Desc::new(self.host, k, bb));
        local.push(Desc::new(p.region, p.v_offset + u64::from(b) * bb, bb));
        remote.push(Desc::new(self.host, k + self.pad(), bb));
    }
}

/// Work for the mover.
#[derive(Debug)]
pub(crate) enum Job {
    /// Copy pool blocks to host slots: `(block, slot)`.
    Offload { id: u64, pairs: Vec<(u32, u32)> },
    /// Write host slots to disk slots with their headers (checksums filled in here):
    /// `(host slot, disk slot, header)`.
    Persist { id: u64, items: Vec<(u32, u32, Header)> },
    /// Load a prompt's blocks: first `reads` (disk slot → host slot, expected checksum),
    /// then `copies` (host slot → pool block) in prefix order, stopping at the first copy
    /// whose host slot a failed read should have filled.
    Load { id: u64, reads: Vec<(u32, u32, u64)>, copies: Vec<(u32, u32)> },
}

/// A job's outcome.
#[derive(Debug)]
pub(crate) enum Done {
    /// Whether the copies happened (all or none).
    Offload { id: u64, ok: bool, bytes: u64, secs: f64 },
    /// Per item, the checksum written, or why the write failed.
    Persist { id: u64, results: Vec<Result<u64, String>>, bytes: u64, secs: f64 },
    /// Per read whether its bytes matched their checksum (`None`: not read); the leading
    /// copies done.
    Load { id: u64, reads: Vec<Option<bool>>, copied: usize, bytes: u64, secs: f64 },
}

/// The mover's side: the agent, a loopback remote to itself, the geometry.
pub(crate) struct Mover {
    agent: Arc<Agent>,
    me: RemoteId,
    geo: Geometry,
    timeout: Duration,
    buf: Vec<u8>,
}

impl Mover {
    pub(crate) fn new(
        agent: Arc<Agent>,
        geo: Geometry,
        timeout: Duration,
    ) -> kvx_xfer::Result<Self> {
        let me = agent.add_remote(&agent.metadata())?;
        Ok(Mover { agent, me, geo, timeout, buf: vec![0; 64 << 10] })
    }

    /// Serves jobs until either channel closes.
    pub(crate) fn run(mut self, jobs: Receiver<Job>, done: SyncSender<Done>) {
        while let Ok(job) = jobs.recv() {
            let d = match job {
                Job::Offload { id, pairs } => self.offload(id, &pairs),
                Job::Persist { id, items } => self.persist(id, items),
                Job::Load { id, reads, copies } => self.load(id, &reads, &copies),
            };
            if done.send(d).is_err() {
                return;
            }
        }
    }

    /// Posts `op` over descriptor pairs, in chunks under the descriptor limit, and waits.
    fn transfer(&self, op: Op, local: &[Desc], remote: &[Desc]) -> Result<u64, String> {
        let mut bytes = 0;
        for (l, r) in local.chunks(MAX_DESCS - 8).zip(remote.chunks(MAX_DESCS - 8)) {
            let p = self.agent.prep(self.me, l, r, None).map_err(|e| e.to_string())?;
            let h = self.agent.post(op, &p, b"").map_err(|e| e.to_string())?;
            if let Err(e) = h.wait(self.timeout) {
                h.cancel();
                return Err(e.to_string());
            }
            bytes += p.bytes();
        }
        Ok(bytes)
    }

    fn offload(&mut self, id: u64, pairs: &[(u32, u32)]) -> Done {
        let t0 = Instant::now();
        let (mut l, mut r) =
            (Vec::with_capacity(2 * pairs.len()), Vec::with_capacity(2 * pairs.len()));
        for &(b, s) in pairs {
            self.geo.pool_host(b, s, &mut l, &mut r);
        }
        let res = self.transfer(Op::Write, &l, &r);
        if let Err(e) = &res {
            tracing::warn!(error = %e, blocks = pairs.len(), "KV offload to host memory failed");
        }
        Done::Offload {
            id,
            ok: res.is_ok(),
            bytes: res.unwrap_or(0),
            secs: t0.elapsed().as_secs_f64(),
        }
    }

    /// xxh3 of a host slot's keys then values (through bounded copies out of the region:
    /// the crate reads shared memory only through the agent).
    fn checksum(&mut self, s: u32) -> Result<u64, String> {
        let bb = self.geo.pool.block_bytes;
        let k = self.geo.host_k(s);
        let mut h = Xxh3::new();
        for base in [k, k + self.geo.pad()] {
            let mut off = 0;
            while off < bb {
                let n = (bb - off).min(self.buf.len() as u64);
                let chunk = &mut self.buf[..n as usize];
                self.agent
                    .read_local(Desc::new(self.geo.host, base + off, n), chunk)
                    .map_err(|e| e.to_string())?;
                h.update(chunk);
                off += n;
            }
        }
        Ok(h.digest())
    }

    fn persist(&mut self, id: u64, items: Vec<(u32, u32, Header)>) -> Done {
        let t0 = Instant::now();
        let fail = |items: &[(u32, u32, Header)], why: String| Done::Persist {
            id,
            results: items.iter().map(|_| Err(why.clone())).collect(),
            bytes: 0,
            secs: t0.elapsed().as_secs_f64(),
        };
        let Some((file, layout)) = self.geo.disk else {
            return fail(&items, "no disk tier".into());
        };
        let mut results = Vec::with_capacity(items.len());
        let (mut l, mut r) = (Vec::new(), Vec::new());
        let slot_bytes = self.geo.host_slot_bytes();
        for (i, &(hs, ds, mut header)) in items.iter().take(MAX_PERSIST).enumerate() {
            let staged = (|| {
                header.checksum = self.checksum(hs)?;
                let at = Desc::new(self.geo.headers, i as u64 * HEADER_BYTES, HEADER_BYTES);
                let mut page = vec![0u8; HEADER_BYTES as usize];
                page[..crate::disk::HEADER_LEN].copy_from_slice(&header.encode());
                self.agent.write_local(at, &page).map_err(|e| e.to_string())?;
                Ok::<_, String>((header.checksum, at))
            })();
            match staged {
                Ok((sum, at)) => {
                    l.push(at);
                    r.push(Desc::new(file, layout.header_at(ds), HEADER_BYTES));
                    l.push(Desc::new(self.geo.host, self.geo.host_k(hs), slot_bytes));
                    r.push(Desc::new(file, layout.data_at(ds), slot_bytes));
                    results.push(Ok(sum));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        results.extend(items.iter().skip(MAX_PERSIST).map(|_| Err("too many at once".into())));
        let res = if l.is_empty() { Ok(0) } else { self.transfer(Op::Write, &l, &r) };
        match res {
            Ok(bytes) => Done::Persist { id, results, bytes, secs: t0.elapsed().as_secs_f64() },
            Err(e) => fail(&items, e),
        }
    }

    fn load(&mut self, id: u64, reads: &[(u32, u32, u64)], copies: &[(u32, u32)]) -> Done {
        let t0 = Instant::now();
        let mut bytes = 0;
        let mut checked = vec![None; reads.len()];
        if let Some((file, layout)) = self.geo.disk.filter(|_| !reads.is_empty()) {
            let slot_bytes = self.geo.host_slot_bytes();
            let (l, r): (Vec<Desc>, Vec<Desc>) = reads
                .iter()
                .map(|&(ds, hs, _)| {
                    (
                        Desc::new(self.geo.host, self.geo.host_k(hs), slot_bytes),
                        Desc::new(file, layout.data_at(ds), slot_bytes),
                    )
                })
                .unzip();
            match self.transfer(Op::Read, &l, &r) {
                Ok(n) => {
                    bytes += n;
                    for (ok, &(_, hs, want)) in checked.iter_mut().zip(reads) {
                        *ok = self.checksum(hs).ok().map(|got| got == want);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reading KV blocks from disk failed"),
            }
        }
        // Copy the prefix whose host slots hold good bytes.
        let bad: Vec<u32> = reads
            .iter()
            .zip(&checked)
            .filter(|(_, ok)| **ok != Some(true))
            .map(|(&(_, hs, _), _)| hs)
            .collect();
        let n = copies.iter().position(|(hs, _)| bad.contains(hs)).unwrap_or(copies.len());
        let (mut l, mut r) = (Vec::with_capacity(2 * n), Vec::with_capacity(2 * n));
        for &(hs, b) in &copies[..n] {
            self.geo.pool_host(b, hs, &mut l, &mut r);
        }
        let copied = if l.is_empty() {
            0
        } else {
            match self.transfer(Op::Read, &l, &r) {
                Ok(x) => {
                    bytes += x;
                    n
                }
                Err(e) => {
                    tracing::warn!(error = %e, "loading KV blocks into the pool failed");
                    0
                }
            }
        };
        Done::Load { id, reads: checked, copied, bytes, secs: t0.elapsed().as_secs_f64() }
    }
}
