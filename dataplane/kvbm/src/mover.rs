//! The mover: one thread per tier set that moves block bytes through the process's kvx-xfer
//! agent (a transfer to itself: shared-memory copies between the engine's pool, the host
//! tier and a staging area; `O_DIRECT` io_uring reads and writes between the staging area or
//! the host tier and the disk file) and computes and checks checksums. It takes jobs from a
//! bounded queue and answers each with one [`Done`]; the shard never waits for it.
//!
//! Jobs name slots and blocks only; the mover turns them into descriptor lists (two per
//! block between the pool and a slot, keys and values; one for a block's data plus one for
//! its header between a slot and the disk) and posts each job as few transfers as the
//! descriptor limit allows. A transfer that outlives its timeout is cancelled and waited for
//! once more before its memory is touched again; one that still runs then stops the mover
//! (the tiers then fail every job and take none).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::{Duration, Instant};

use kvx_xfer::{Agent, Desc, MAX_DESCS, Op, RegionId, RemoteId, XferError};
use xxhash_rust::xxh3::Xxh3;

use crate::disk::{DiskLayout, HEADER_BYTES, Header, align_up};

/// Blocks read from or written to disk at once, through the mover's staging memory (and
/// headers staged at once).
pub const STAGING_BLOCKS: usize = 32;

/// Blocks of one persist job at most (one staging chunk: the pool blocks it reads are
/// unpinned when it ends).
pub const MAX_PERSIST: usize = STAGING_BLOCKS;

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
    /// Blocks in the pool.
    pub blocks: u64,
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
    /// Staging memory for headers ([`STAGING_BLOCKS`] × 4 KiB).
    pub(crate) headers: RegionId,
    /// Staging memory for blocks read from or written to disk ([`STAGING_BLOCKS`]
    /// host-slot-sized slots, laid out as the host tier's).
    pub(crate) staging: RegionId,
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

    /// Key and value descriptor pairs between pool block `b` and slot `s` of `slots` (the
    /// host tier, or the staging memory laid out the same way).
    fn pool_slot(
        &self,
        b: u32,
        slots: RegionId,
        s: u32,
        local: &mut Vec<Desc>,
        remote: &mut Vec<Desc>,
    ) {
        let (p, bb) = (&self.pool, self.pool.block_bytes);
        let k = self.host_k(s);
        local.push(Desc::new(p.region, p.k_offset + u64::from(b) * bb, bb));
        remote.push(Desc::new(slots, k, bb));
        local.push(Desc::new(p.region, p.v_offset + u64::from(b) * bb, bb));
        remote.push(Desc::new(slots, k + self.pad(), bb));
    }
}

/// Work for the mover.
#[derive(Debug)]
pub(crate) enum Job {
    /// Copy pool blocks to host slots: `(block, slot)`.
    Offload { id: u64, pairs: Vec<(u32, u32)> },
    /// Write blocks to disk slots with their headers (checksums filled in here):
    /// `(source, disk slot, header)`.
    Persist { id: u64, items: Vec<(PersistSrc, u32, Header)> },
    /// Load a prompt's blocks into the pool, in prefix order; the prefix ends at the first
    /// block whose disk bytes fail their checksum (or cannot be read).
    Load { id: u64, items: Vec<LoadItem> },
}

/// Where a block written to disk comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PersistSrc {
    /// A pool block (pinned by the shard until the job is done).
    Pool(u32),
    /// A host slot (pinned until the job is done).
    Host(u32),
}

/// One block of a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoadItem {
    /// From host slot `slot` into pool block `into`.
    Host { slot: u32, into: u32 },
    /// From disk slot `slot`, whose bytes must have checksum `sum`, into pool block `into`.
    Disk { slot: u32, sum: u64, into: u32 },
}

/// A job's outcome.
#[derive(Debug)]
pub(crate) enum Done {
    /// Whether the copies happened (all or none).
    Offload { id: u64, ok: bool, bytes: u64, secs: f64 },
    /// Per item, the checksum written, or why the write failed.
    Persist { id: u64, results: Vec<Result<u64, String>>, bytes: u64, secs: f64 },
    /// Per disk item, in order, whether its bytes matched their checksum (`None`: not
    /// read); the leading items loaded; bytes and seconds of the disk part (reads, checks
    /// and copies into the pool) and of the host part.
    Load { id: u64, checked: Vec<Option<bool>>, loaded: usize, disk: (u64, f64), host: (u64, f64) },
}

/// The mover's side: the agent, a loopback remote to itself, the geometry.
pub(crate) struct Mover {
    agent: Arc<Agent>,
    me: RemoteId,
    geo: Geometry,
    timeout: Duration,
    buf: Vec<u8>,
    /// One header page, staged into the header memory.
    page: Vec<u8>,
    /// A transfer outlived its timeout twice: the mover stops.
    stuck: bool,
}

impl Mover {
    pub(crate) fn new(
        agent: Arc<Agent>,
        geo: Geometry,
        timeout: Duration,
    ) -> kvx_xfer::Result<Self> {
        let me = agent.add_remote(&agent.metadata())?;
        Ok(Mover {
            agent,
            me,
            geo,
            timeout,
            buf: vec![0; 64 << 10],
            page: vec![0; HEADER_BYTES as usize],
            stuck: false,
        })
    }

    /// Serves jobs until either channel closes.
    pub(crate) fn run(mut self, jobs: Receiver<Job>, done: SyncSender<Done>) {
        while let Ok(job) = jobs.recv() {
            let d = match job {
                Job::Offload { id, pairs } => self.offload(id, &pairs),
                Job::Persist { id, items } => self.persist(id, items),
                Job::Load { id, items } => self.load(id, &items),
            };
            if done.send(d).is_err() {
                return;
            }
            if self.stuck {
                tracing::error!("a KV tier transfer did not end: the KV tiers stop");
                return;
            }
        }
    }

    /// Posts `op` over descriptor pairs, in chunks under the descriptor limit, and waits.
    fn transfer(&mut self, op: Op, local: &[Desc], remote: &[Desc]) -> Result<u64, String> {
        let mut bytes = 0;
        for (l, r) in local.chunks(MAX_DESCS - 8).zip(remote.chunks(MAX_DESCS - 8)) {
            let p = self.agent.prep(self.me, l, r, None).map_err(|e| e.to_string())?;
            let h = self.agent.post(op, &p, b"").map_err(|e| e.to_string())?;
            if let Err(e) = h.wait(self.timeout) {
                if matches!(e, XferError::Timeout) {
                    // It may still move bytes: its memory is not touched again before it ends.
                    h.cancel();
                    if matches!(h.wait(self.timeout), Err(XferError::Timeout)) {
                        self.stuck = true;
                    }
                }
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
            self.geo.pool_slot(b, self.geo.host, s, &mut l, &mut r);
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

    /// xxh3 of the keys then values of slot `s` of `slots` (through bounded copies out of
    /// the region: the crate reads shared memory only through the agent).
    fn checksum(&mut self, slots: RegionId, s: u32) -> Result<u64, String> {
        let bb = self.geo.pool.block_bytes;
        let k = self.geo.host_k(s);
        let mut h = Xxh3::new();
        for base in [k, k + self.geo.pad()] {
            let mut off = 0;
            while off < bb {
                let n = (bb - off).min(self.buf.len() as u64);
                let chunk = &mut self.buf[..n as usize];
                self.agent
                    .read_local(Desc::new(slots, base + off, n), chunk)
                    .map_err(|e| e.to_string())?;
                h.update(chunk);
                off += n;
            }
        }
        Ok(h.digest())
    }

    /// Writes blocks to disk, a chunk of [`STAGING_BLOCKS`] at a time: pool blocks are
    /// first copied into the staging memory (their pins end sooner, and the disk sees only
    /// aligned memory), host slots are written from where they are; each block's checksum
    /// goes into its header, written with it in one transfer.
    fn persist(&mut self, id: u64, items: Vec<(PersistSrc, u32, Header)>) -> Done {
        let t0 = Instant::now();
        let Some((file, layout)) = self.geo.disk else {
            let results = items.iter().map(|_| Err("no disk tier".into())).collect();
            return Done::Persist { id, results, bytes: 0, secs: 0.0 };
        };
        let slot_bytes = self.geo.host_slot_bytes();
        let mut results: Vec<Result<u64, String>> = Vec::with_capacity(items.len());
        let mut bytes = 0;
        for chunk in items.chunks(STAGING_BLOCKS) {
            let (mut l, mut r) = (Vec::new(), Vec::new());
            for (j, (src, _, _)) in chunk.iter().enumerate() {
                if let PersistSrc::Pool(b) = *src {
                    self.geo.pool_slot(b, self.geo.staging, j as u32, &mut l, &mut r);
                }
            }
            let from_pool = if l.is_empty() { Ok(0) } else { self.transfer(Op::Write, &l, &r) };
            if let Err(e) = from_pool {
                results.extend(chunk.iter().map(|_| Err(e.clone())));
                continue;
            }
            let (mut l, mut r, mut sums) = (Vec::new(), Vec::new(), Vec::new());
            for (j, &(src, ds, mut header)) in chunk.iter().enumerate() {
                let (slots, s) = match src {
                    PersistSrc::Pool(_) => (self.geo.staging, j as u32),
                    PersistSrc::Host(s) => (self.geo.host, s),
                };
                let staged = (|| {
                    header.checksum = self.checksum(slots, s)?;
                    let at = Desc::new(self.geo.headers, j as u64 * HEADER_BYTES, HEADER_BYTES);
                    self.page[..crate::disk::HEADER_LEN].copy_from_slice(&header.encode());
                    self.agent.write_local(at, &self.page).map_err(|e| e.to_string())?;
                    Ok::<_, String>((header.checksum, at))
                })();
                match staged {
                    Ok((sum, at)) => {
                        l.push(at);
                        r.push(Desc::new(file, layout.header_at(ds), HEADER_BYTES));
                        l.push(Desc::new(slots, self.geo.host_k(s), slot_bytes));
                        r.push(Desc::new(file, layout.data_at(ds), slot_bytes));
                        sums.push(Ok(sum));
                    }
                    Err(e) => sums.push(Err(e)),
                }
            }
            match if l.is_empty() { Ok(0) } else { self.transfer(Op::Write, &l, &r) } {
                Ok(n) => {
                    bytes += n;
                    results.extend(sums);
                }
                Err(e) => results.extend(chunk.iter().map(|_| Err(e.clone()))),
            }
        }
        Done::Persist { id, results, bytes, secs: t0.elapsed().as_secs_f64() }
    }

    /// Loads `items` in prefix order: disk blocks a chunk at a time through the staging
    /// memory (read, checksum, copy into the pool), stopping at the first that fails; then
    /// the host blocks before that point, in one transfer.
    fn load(&mut self, id: u64, items: &[LoadItem]) -> Done {
        let t0 = Instant::now();
        let mut bytes = 0;
        let disk: Vec<(usize, u32, u64, u32)> = items
            .iter()
            .enumerate()
            .filter_map(|(i, it)| match *it {
                LoadItem::Disk { slot, sum, into } => Some((i, slot, sum, into)),
                LoadItem::Host { .. } => None,
            })
            .collect();
        let mut checked = vec![None; disk.len()];
        // Items from the first that did not load on are not loaded.
        let mut end = items.len();
        if let Some((file, layout)) = self.geo.disk {
            let slot_bytes = self.geo.host_slot_bytes();
            let mut done = 0;
            'chunks: for chunk in disk.chunks(STAGING_BLOCKS) {
                let (l, r): (Vec<Desc>, Vec<Desc>) = chunk
                    .iter()
                    .enumerate()
                    .map(|(j, &(_, ds, _, _))| {
                        (
                            Desc::new(self.geo.staging, self.geo.host_k(j as u32), slot_bytes),
                            Desc::new(file, layout.data_at(ds), slot_bytes),
                        )
                    })
                    .unzip();
                match self.transfer(Op::Read, &l, &r) {
                    Ok(n) => bytes += n,
                    Err(e) => {
                        tracing::warn!(error = %e, "reading KV blocks from disk failed");
                        end = end.min(chunk[0].0);
                        break;
                    }
                }
                let (mut l, mut r) = (Vec::new(), Vec::new());
                for (j, &(i, _, sum, into)) in chunk.iter().enumerate() {
                    let ok = self.checksum(self.geo.staging, j as u32).ok().map(|got| got == sum);
                    checked[done + j] = ok;
                    if ok != Some(true) {
                        end = end.min(i);
                        break;
                    }
                    self.geo.pool_slot(into, self.geo.staging, j as u32, &mut l, &mut r);
                }
                if !l.is_empty() {
                    match self.transfer(Op::Read, &l, &r) {
                        Ok(n) => bytes += n,
                        Err(e) => {
                            tracing::warn!(error = %e, "loading KV blocks into the pool failed");
                            end = end.min(chunk[0].0);
                        }
                    }
                }
                done += chunk.len();
                if end < items.len() {
                    break 'chunks;
                }
            }
        } else if let Some(&(i, ..)) = disk.first() {
            end = i;
        }
        let disk_part = (std::mem::take(&mut bytes), t0.elapsed().as_secs_f64());
        let t1 = Instant::now();
        let (mut l, mut r) = (Vec::new(), Vec::new());
        for it in &items[..end] {
            if let LoadItem::Host { slot, into } = *it {
                self.geo.pool_slot(into, self.geo.host, slot, &mut l, &mut r);
            }
        }
        if !l.is_empty() {
            match self.transfer(Op::Read, &l, &r) {
                Ok(n) => bytes += n,
                Err(e) => {
                    tracing::warn!(error = %e, "loading KV blocks into the pool failed");
                    // Only the disk blocks before the first host block made it.
                    let first_host =
                        items.iter().position(|it| matches!(it, LoadItem::Host { .. }));
                    end = end.min(first_host.unwrap_or(end));
                }
            }
        }
        Done::Load {
            id,
            checked,
            loaded: end,
            disk: if disk.is_empty() { (0, 0.0) } else { disk_part },
            host: (bytes, t1.elapsed().as_secs_f64()),
        }
    }
}
