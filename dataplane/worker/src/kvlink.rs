//! Moving prompts' KV from prefill shards to decode shards: a process's transfer agent (one
//! kvx-xfer [`Agent`], with one registered region per model engine, in which that engine's
//! KV cache lives), the layouts of its own shards' caches, and the decode peers the plane
//! told it about (their agent metadata and layout, received once at registration).
//!
//! A prefill shard whose request is prefilled starts a [`Pending`] write of the request's
//! blocks into the blocks the decode worker reserved — shared memory on one host, TCP across
//! hosts, chosen by the agent; consecutive blocks on both sides merge into one descriptor
//! pair for the keys and one for the values — and polls it between steps: a transfer never
//! blocks a step. Mock engines have no KV bytes: their transfers are modelled (bytes over a
//! bandwidth plus a latency) so that fleets of them behave like the real thing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_kernels::model::{KvLayout, KvMemory};
use kvx_proto::plane::KvPeer;
use kvx_proto::{KvDest, KvTransfer, WorkerId};
use kvx_xfer::{Agent, AgentConfig, AgentMetadata, Desc, Op, RegionId, RemoteId, XferStatus};

/// Why a transfer did not happen.
#[derive(Debug, thiserror::Error)]
pub enum KvLinkError {
    /// The transfer library failed.
    #[error("KV transfer: {0}")]
    Xfer(#[from] kvx_xfer::XferError),
    /// No peer is known for the decode worker.
    #[error("no KV peer for worker {0}")]
    UnknownPeer(WorkerId),
    /// Not a shard of this process.
    #[error("worker {0} has no KV region here")]
    NotLocal(WorkerId),
    /// Layouts that cannot be paired.
    #[error("{0}")]
    Mismatch(String),
}

/// How transfers of mock engines are modelled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferModel {
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Fixed cost per transfer.
    pub latency: Duration,
}

impl Default for TransferModel {
    fn default() -> Self {
        // About loopback TCP as `kvx bench xfer` measures it on this class of machine.
        TransferModel { bytes_per_s: 4e9, latency: Duration::from_micros(200) }
    }
}

/// Settings of a process's KV link.
#[derive(Debug, Clone)]
pub struct KvLinkConfig {
    /// The agent's TCP address (for peers on other hosts); `None`: same host only.
    pub tcp_listen: Option<SocketAddr>,
    /// A transfer not done after this long fails (and the request is prefilled elsewhere).
    pub timeout: Duration,
    /// The model of mock engines' transfers.
    pub model: TransferModel,
}

impl Default for KvLinkConfig {
    fn default() -> Self {
        KvLinkConfig {
            tcp_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            timeout: Duration::from_secs(10),
            model: TransferModel::default(),
        }
    }
}

/// A decode worker's cache as a prefill shard writes into it.
#[derive(Debug, Clone)]
struct Peer {
    /// The agent that holds it (`None`: a modelled, mock peer).
    remote: Option<RemoteId>,
    region: RegionId,
    layout: KvLayout,
}

/// A process's KV transfer link.
#[derive(Debug)]
pub struct KvLink {
    cfg: KvLinkConfig,
    /// `None` for mock engines (modelled transfers).
    agent: Option<Arc<Agent>>,
    /// This process's shards: their regions and layouts.
    local: Mutex<HashMap<WorkerId, (RegionId, KvLayout)>>,
    peers: Mutex<HashMap<WorkerId, Peer>>,
    /// Remote agents added, by instance.
    agents: Mutex<HashMap<u64, RemoteId>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn layout_of(p: &KvPeer) -> Result<KvLayout, KvLinkError> {
    let n =
        |v: u64| usize::try_from(v).map_err(|_| KvLinkError::Mismatch("layout overflows".into()));
    Ok(KvLayout {
        bytes: 0,
        k_offset: n(p.k_offset)?,
        v_offset: n(p.v_offset)?,
        block_bytes: n(p.block_bytes)?,
    })
}

impl KvLink {
    /// A link with a transfer agent, for model engines.
    pub fn with_agent(name: &str, cfg: KvLinkConfig) -> Result<Self, KvLinkError> {
        let mut ac = AgentConfig::new(name);
        ac.tcp_listen = cfg.tcp_listen;
        ac.xfer_timeout = cfg.timeout;
        // KV pages are touched as blocks fill: no 2 MiB pages (they would zero inside a
        // step), no pinning of whole regions (they would be resident at once).
        ac.hugepages = kvx_xfer::HugePages::Never;
        ac.fixed_buffers = false;
        ac.prefault = false;
        let agent = Agent::new(ac)?;
        Ok(Self::build(cfg, Some(Arc::new(agent))))
    }

    /// A link that models transfers, for mock engines.
    pub fn modelled(cfg: KvLinkConfig) -> Self {
        Self::build(cfg, None)
    }

    fn build(cfg: KvLinkConfig, agent: Option<Arc<Agent>>) -> Self {
        KvLink {
            cfg,
            agent,
            local: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            agents: Mutex::new(HashMap::new()),
        }
    }

    /// Registers the KV region of a model engine of this process (worker `w`), to be lent
    /// to its cache.
    pub fn region_for(
        &self,
        w: WorkerId,
        layout: KvLayout,
    ) -> Result<Option<Box<dyn KvMemory>>, KvLinkError> {
        let Some(agent) = &self.agent else {
            lock(&self.local).insert(w, (RegionId(0), layout));
            return Ok(None);
        };
        let region = agent.alloc_mem(layout.bytes as u64)?;
        lock(&self.local).insert(w, (region, layout));
        Ok(Some(Box::new(agent.region_memory(region)?)))
    }

    /// The process's transfer agent (`None` for mock engines).
    pub fn agent(&self) -> Option<&Arc<Agent>> {
        self.agent.as_ref()
    }

    /// The region and layout of local worker `w`'s KV cache.
    pub fn region_of(&self, w: WorkerId) -> Option<(RegionId, KvLayout)> {
        lock(&self.local).get(&w).copied()
    }

    /// The peer record a worker of this process registers with, once its region exists.
    pub fn peer(&self, w: WorkerId) -> Option<KvPeer> {
        let (region, layout) = *lock(&self.local).get(&w)?;
        Some(KvPeer {
            agent: self.agent.as_ref().map(|a| a.metadata().encode()).unwrap_or_default(),
            region: region.0,
            k_offset: layout.k_offset as u64,
            v_offset: layout.v_offset as u64,
            block_bytes: layout.block_bytes as u64,
        })
    }

    /// Learns where decode workers' caches are (each agent is added once).
    pub fn add_peers(&self, peers: &[(WorkerId, KvPeer)]) -> Result<(), KvLinkError> {
        for (w, p) in peers {
            let layout = layout_of(p)?;
            let remote = match (&self.agent, p.agent.is_empty()) {
                (Some(agent), false) => {
                    let md = AgentMetadata::decode(&p.agent)?;
                    let mut agents = lock(&self.agents);
                    let id = match agents.get(&md.instance) {
                        Some(&id) => id,
                        None => {
                            let id = agent.add_remote(&md)?;
                            agents.insert(md.instance, id);
                            id
                        }
                    };
                    Some(id)
                }
                (None, true) => None,
                (Some(_), true) => {
                    return Err(KvLinkError::Mismatch(format!(
                        "worker {w} is a mock engine; model engines cannot send it KV"
                    )));
                }
                (None, false) => {
                    return Err(KvLinkError::Mismatch(format!(
                        "worker {w} holds real KV; mock engines cannot send it any"
                    )));
                }
            };
            lock(&self.peers).insert(*w, Peer { remote, region: RegionId(p.region), layout });
        }
        Ok(())
    }

    /// Forgets a decode worker (it left the plane).
    pub fn remove_peer(&self, w: WorkerId) {
        lock(&self.peers).remove(&w);
    }

    /// Starts writing the KV of `src` (blocks of local worker `from`) into the blocks of
    /// `dest`.
    pub fn start(
        &self,
        from: WorkerId,
        src: &[u32],
        dest: &KvDest,
        prefill_ms: f32,
    ) -> Result<Pending, KvLinkError> {
        let (region, layout) = *lock(&self.local).get(&from).ok_or(KvLinkError::NotLocal(from))?;
        let peer = lock(&self.peers)
            .get(&dest.worker)
            .cloned()
            .ok_or(KvLinkError::UnknownPeer(dest.worker))?;
        if peer.layout.block_bytes != layout.block_bytes || src.len() != dest.blocks.len() {
            return Err(KvLinkError::Mismatch(format!(
                "blocks of {} bytes × {} cannot go into blocks of {} bytes × {}",
                layout.block_bytes,
                src.len(),
                peer.layout.block_bytes,
                dest.blocks.len()
            )));
        }
        let blocks = src.len() as u32;
        let bytes = 2 * src.len() as u64 * layout.block_bytes as u64;
        let t0 = Instant::now();
        let kind = match (&self.agent, peer.remote) {
            (Some(agent), Some(remote)) => {
                let (local, remote_descs) =
                    descriptors(region, &layout, src, peer.region, &peer.layout, &dest.blocks);
                if local.is_empty() {
                    PendingKind::Done
                } else {
                    PendingKind::Xfer(agent.xfer(Op::Write, remote, &local, &remote_descs, b"")?)
                }
            }
            _ => {
                let m = &self.cfg.model;
                let secs = bytes as f64 / m.bytes_per_s.max(1.0);
                PendingKind::Modelled(t0 + m.latency + Duration::from_secs_f64(secs))
            }
        };
        Ok(Pending {
            kind,
            t0,
            deadline: t0 + self.cfg.timeout,
            report: KvTransfer { blocks, bytes, prefill_ms, transfer_ms: 0.0 },
        })
    }
}

/// Pairs the key and value spans of `src` blocks with those of `dst` blocks, merging runs
/// that are consecutive on both sides.
pub fn descriptors(
    src_region: RegionId,
    src_layout: &KvLayout,
    src: &[u32],
    dst_region: RegionId,
    dst_layout: &KvLayout,
    dst: &[u32],
) -> (Vec<Desc>, Vec<Desc>) {
    let (mut local, mut remote) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < src.len().min(dst.len()) {
        let mut n = 1;
        while i + n < src.len().min(dst.len())
            && src[i + n] == src[i] + n as u32
            && dst[i + n] == dst[i] + n as u32
        {
            n += 1;
        }
        let s = src_layout.spans(src[i] as usize, n);
        let d = dst_layout.spans(dst[i] as usize, n);
        for ((so, len), (dof, _)) in s.into_iter().zip(d) {
            local.push(Desc::new(src_region, so as u64, len as u64));
            remote.push(Desc::new(dst_region, dof as u64, len as u64));
        }
        i += n;
    }
    (local, remote)
}

enum PendingKind {
    Xfer(kvx_xfer::XferHandle),
    Modelled(Instant),
    Done,
}

/// A transfer in flight.
pub struct Pending {
    kind: PendingKind,
    t0: Instant,
    deadline: Instant,
    report: KvTransfer,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("report", &self.report).finish()
    }
}

impl Pending {
    /// `None` while the transfer runs; then what it moved, or why it failed.
    pub fn poll(&self) -> Option<Result<KvTransfer, String>> {
        let done = |at: Instant| {
            let mut r = self.report;
            r.transfer_ms = at.duration_since(self.t0).as_secs_f32() * 1e3;
            Some(Ok(r))
        };
        let now = Instant::now();
        match &self.kind {
            PendingKind::Done => done(now),
            PendingKind::Modelled(at) => (now >= *at).then(|| done(*at)).flatten(),
            PendingKind::Xfer(h) => match h.status() {
                XferStatus::Done => done(h.completed_at().unwrap_or(now)),
                XferStatus::Failed(e) => Some(Err(e.to_string())),
                XferStatus::Pending if now >= self.deadline => {
                    h.cancel();
                    Some(Err("the KV transfer timed out".into()))
                }
                XferStatus::Pending => None,
            },
        }
    }

    /// When [`poll`](Self::poll) should next be called at the latest.
    pub fn next_check(&self) -> Instant {
        match &self.kind {
            PendingKind::Modelled(at) => *at,
            _ => Instant::now() + Duration::from_micros(500),
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests wait on the wall clock
mod tests {
    use super::*;

    fn layout(block_bytes: usize, v_offset: usize) -> KvLayout {
        KvLayout { bytes: 0, k_offset: 0, v_offset, block_bytes }
    }

    #[test]
    fn consecutive_blocks_on_both_sides_merge_into_one_pair_of_descriptors() {
        let (s, d) = (layout(100, 10_000), layout(100, 50_000));
        let (l, r) = descriptors(RegionId(1), &s, &[4, 5, 6, 9], RegionId(2), &d, &[7, 8, 9, 10]);
        // Runs: [4,5,6]→[7,8,9] and [9]→[10]; keys and values each.
        assert_eq!(l.len(), 4);
        assert_eq!((l[0].offset, l[0].len), (400, 300));
        assert_eq!((r[0].offset, r[0].len), (700, 300));
        assert_eq!((l[1].offset, r[1].offset), (10_400, 50_700));
        assert_eq!((l[2].offset, r[2].offset, l[2].len), (900, 1000, 100));
        assert!(
            l.iter().all(|x| x.region == RegionId(1)) && r.iter().all(|x| x.region == RegionId(2))
        );
        // A break on one side only splits the run.
        let (l, _) = descriptors(RegionId(1), &s, &[1, 2], RegionId(2), &d, &[5, 7]);
        assert_eq!(l.len(), 4);
    }

    #[test]
    fn a_modelled_transfer_takes_its_modelled_time() {
        let cfg = KvLinkConfig {
            model: TransferModel { bytes_per_s: 64e6, latency: Duration::from_millis(1) },
            ..KvLinkConfig::default()
        };
        let link = KvLink::modelled(cfg);
        assert!(link.region_for(1, layout(16_000, 1 << 20)).unwrap().is_none());
        let peer = link.peer(1).unwrap();
        assert!(peer.agent.is_empty());
        link.add_peers(&[(2, peer)]).unwrap();
        let dest = KvDest { worker: 2, first_block: 0, blocks: vec![3, 4] };
        let p = link.start(1, &[0, 1], &dest, 1.0).unwrap();
        assert!(p.poll().is_none(), "64 000 bytes at 64 MB/s + 1 ms is 2 ms");
        std::thread::sleep(Duration::from_millis(5));
        let r = p.poll().unwrap().unwrap();
        assert_eq!((r.blocks, r.bytes), (2, 64_000));
        assert!(r.transfer_ms >= 1.9, "{}", r.transfer_ms);
        assert!(matches!(
            link.start(1, &[0], &KvDest { worker: 9, first_block: 0, blocks: vec![1] }, 0.0),
            Err(KvLinkError::UnknownPeer(9))
        ));
    }
}
