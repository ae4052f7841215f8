//! The tiers over a real kvx-xfer agent: a pool region filled with a pattern stands for the
//! engine's KV cache; blocks offered go to host memory and disk, come back byte for byte into
//! other pool blocks, survive a restart, and a corrupted block on disk is caught by its
//! checksum and never loaded.

#![allow(clippy::disallowed_methods)] // the tests poll the mover with short sleeps

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_kvbm::{Action, DiskConfig, PoolLayout, TierConfig, TierEvent, Tiers};
use kvx_proto::{LocalBlockHash, RequestId, SequenceHash, StorageTier};
use kvx_xfer::{Agent, AgentConfig, Desc, HugePages};

/// 5,000 bytes of keys (and of values) per block: not a multiple of 4 KiB, so every slot
/// carries padding.
const BB: u64 = 5000;
const BLOCKS: u64 = 16;

struct Rig {
    agent: Arc<Agent>,
    pool: PoolLayout,
    dir: PathBuf,
}

fn rig(name: &str) -> Rig {
    let mut c = AgentConfig::new(name);
    c.tcp_listen = None;
    c.hugepages = HugePages::Never;
    c.fixed_buffers = false;
    c.prefault = false;
    let agent = Arc::new(Agent::new(c).expect("agent"));
    let region = agent.alloc_mem(2 * BB * BLOCKS).expect("pool region");
    let pool =
        PoolLayout { region, k_offset: 0, v_offset: BB * BLOCKS, block_bytes: BB, blocks: BLOCKS };
    let dir = std::env::temp_dir().join(format!("kvbm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Rig { agent, pool, dir }
}

impl Rig {
    fn cfg(&self, disk_bytes: u64) -> TierConfig {
        TierConfig {
            host_bytes: 4 * 2 * 8192,
            disk: Some(DiskConfig {
                dir: self.dir.clone(),
                file: "shard-0.blocks".into(),
                bytes: disk_bytes,
                min_hits: 0,
            }),
            timeout: Duration::from_secs(10),
        }
    }

    /// Fills pool block `b` with bytes derived from `seed`.
    fn fill(&self, b: u32, seed: u8) {
        let bytes: Vec<u8> =
            (0..BB).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        let p = &self.pool;
        self.agent
            .write_local(Desc::new(p.region, p.k_offset + u64::from(b) * BB, BB), &bytes)
            .unwrap();
        let v: Vec<u8> = bytes.iter().map(|x| x ^ 0x5a).collect();
        self.agent
            .write_local(Desc::new(p.region, p.v_offset + u64::from(b) * BB, BB), &v)
            .unwrap();
    }

    /// The keys and values of pool block `b`.
    fn read(&self, b: u32) -> Vec<u8> {
        let p = &self.pool;
        let mut out = vec![0u8; 2 * BB as usize];
        let (k, v) = out.split_at_mut(BB as usize);
        self.agent.read_local(Desc::new(p.region, p.k_offset + u64::from(b) * BB, BB), k).unwrap();
        self.agent.read_local(Desc::new(p.region, p.v_offset + u64::from(b) * BB, BB), v).unwrap();
        out
    }
}

fn h(i: u64) -> SequenceHash {
    SequenceHash(1000 + i)
}

/// Polls until the tiers are idle; returns the actions and events seen.
fn settle(t: &mut Tiers) -> (Vec<Action>, Vec<TierEvent>) {
    let (mut actions, mut events) = (Vec::new(), Vec::new());
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        t.poll(&mut actions);
        if !t.busy() {
            break;
        }
        assert!(Instant::now() < end, "the mover did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    t.drain_events(|e| events.push(e));
    t.check_invariants().unwrap();
    (actions, events)
}

/// Offers pool blocks 0..4 as a chain of four blocks, and waits until they are on disk.
fn offload_chain(r: &Rig, t: &mut Tiers) {
    let mut out = Vec::new();
    for b in 0..4u32 {
        r.fill(b, b as u8 * 7 + 1);
        let parent = (b > 0).then(|| h(u64::from(b) - 1));
        assert!(t.offer(b, h(u64::from(b)), LocalBlockHash(u64::from(b)), parent), "copied");
    }
    assert!(!t.offer(0, h(0), LocalBlockHash(0), None), "a block is copied down once");
    t.flush(&mut out);
    let (mut actions, mut events) = settle(t);
    // A second round, in case a write finished after the first one's last poll.
    let (a2, e2) = settle(t);
    actions.extend(a2);
    events.extend(e2);
    let unpinned: Vec<u32> = actions
        .iter()
        .filter_map(|a| if let Action::Unpin(b) = a { Some(*b) } else { None })
        .collect();
    assert_eq!(unpinned, vec![0, 1, 2, 3]);
    let stored = |tier| {
        events
            .iter()
            .filter(|e| matches!(e, TierEvent::Stored { tier: t, .. } if *t == tier))
            .count()
    };
    assert_eq!((stored(StorageTier::Host), stored(StorageTier::Disk)), (4, 4));
    let m = t.metrics();
    assert_eq!((m.offloaded_host, m.offloaded_disk, m.host_blocks, m.disk_blocks), (4, 4, 4, 4));
}

#[test]
fn blocks_go_down_and_come_back_byte_for_byte() {
    let r = rig("roundtrip");
    let mut t = Tiers::start(r.agent.clone(), r.pool, &r.cfg(64 * 8192), 7).expect("tiers");
    offload_chain(&r, &mut t);
    let want: Vec<Vec<u8>> = (0..4).map(|b| r.read(b)).collect();
    // A host child whose parent is only on disk comes after it in a snapshot.
    let snap = t.snapshot();
    assert_eq!(snap.len(), 8, "four blocks in each tier");
    // A prompt with blocks 0..4 then one unknown: the first pool block is in the pool.
    let hashes: Vec<SequenceHash> = (0..6).map(h).collect();
    let found = t.probe(hashes[1..].iter().copied());
    t.probe(hashes[1..].iter().copied());
    assert_eq!(t.metrics().lookups, 0, "probes count nothing: a waiting request is probed again");
    t.admitted([hashes[0]], hashes[1..].iter().copied());
    assert_eq!(found, 3, "blocks 1..4 from host memory; the unknown one ends the run");
    let mut out = Vec::new();
    t.load(RequestId(5), hashes[1..4].iter().copied(), &[10, 11, 12], &mut out);
    let (actions, _) = settle(&mut t);
    assert_eq!(actions, vec![Action::Loaded { id: RequestId(5), blocks: 3 }]);
    for (i, b) in [10u32, 11, 12].iter().enumerate() {
        assert_eq!(r.read(*b), want[i + 1], "block {}", i + 1);
    }
    let m = t.metrics();
    assert_eq!((m.lookups, m.hits_host, m.onboarded_host), (4, 3, 3));
    assert!(m.onboard_host_bytes >= 3 * 2 * BB && m.onboard_host_seconds > 0.0);
    assert!(m.offload_host_bytes >= 4 * 2 * BB && m.offload_disk_bytes >= 4 * 2 * BB);

    // A restart: host memory is gone, the disk tier comes back and is announced.
    drop(t);
    let mut t = Tiers::start(r.agent.clone(), r.pool, &r.cfg(64 * 8192), 7).expect("tiers");
    let mut ev = Vec::new();
    t.drain_events(|e| ev.push(e));
    let disk: Vec<u64> = ev
        .iter()
        .filter_map(|e| match e {
            TierEvent::Stored { tier: StorageTier::Disk, block, .. } => Some(block.seq_hash.0),
            _ => None,
        })
        .collect();
    assert_eq!(disk, vec![1000, 1001, 1002, 1003], "parents first");
    assert_eq!(t.snapshot().len(), 4);
    assert_eq!(t.probe(hashes.iter().copied()), 4);
    t.load(RequestId(6), hashes.iter().copied(), &[4, 5, 6, 7], &mut out);
    let (actions, events) = settle(&mut t);
    assert_eq!(actions, vec![Action::Loaded { id: RequestId(6), blocks: 4 }]);
    for b in 0..4u32 {
        assert_eq!(r.read(4 + b), want[b as usize], "block {b} from disk");
    }
    assert!(events.is_empty(), "loads from disk go straight into the pool: {events:?}");
    let m = t.metrics();
    assert_eq!(m.onboarded_disk, 4);
    assert!(m.onboard_disk_bytes >= 4 * 2 * BB && m.onboard_host_bytes == 0);

    // Another fingerprint (another model or layout) finds nothing.
    drop(t);
    let t = Tiers::start(r.agent.clone(), r.pool, &r.cfg(64 * 8192), 8).expect("tiers");
    assert_eq!(t.snapshot().len(), 0);
    drop(t);
    std::fs::remove_dir_all(&r.dir).unwrap();
}

#[test]
fn a_corrupted_block_on_disk_is_dropped_and_ends_the_loaded_prefix() {
    use std::os::unix::fs::FileExt;
    let r = rig("corrupt");
    let mut t = Tiers::start(r.agent.clone(), r.pool, &r.cfg(64 * 8192), 7).expect("tiers");
    offload_chain(&r, &mut t);
    drop(t);
    // Flip one byte of block 2's values on disk (slot order follows write order).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(r.dir.join("shard-0.blocks"))
        .unwrap();
    let stride = 4096 + 2 * 8192;
    let at = 2 * stride + 4096 + 8192 + 100;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 1], at).unwrap();
    let mut t = Tiers::start(r.agent.clone(), r.pool, &r.cfg(64 * 8192), 7).expect("tiers");
    t.drain_events(|_| {});
    let hashes: Vec<SequenceHash> = (0..4).map(h).collect();
    assert_eq!(t.probe(hashes.iter().copied()), 4);
    let mut out = Vec::new();
    t.load(RequestId(1), hashes.iter().copied(), &[8, 9, 10, 11], &mut out);
    let (actions, events) = settle(&mut t);
    assert_eq!(
        actions,
        vec![Action::Loaded { id: RequestId(1), blocks: 2 }],
        "blocks 0 and 1 only"
    );
    assert!(events.contains(&TierEvent::Removed { tier: StorageTier::Disk, seq_hash: h(2) }));
    let m = t.metrics();
    assert_eq!((m.checksum_failures, m.disk_blocks), (1, 3));
    // Asked again, the run stops before the dropped block.
    assert_eq!(t.probe(hashes.iter().copied()), 2);
    t.check_invariants().unwrap();
    drop(t);
    std::fs::remove_dir_all(&r.dir).unwrap();
}

#[test]
fn a_full_host_tier_evicts_its_least_recent_block_and_says_so() {
    let r = rig("evict");
    let cfg = TierConfig { disk: None, ..r.cfg(0) };
    let mut t = Tiers::start(r.agent.clone(), r.pool, &cfg, 7).expect("tiers");
    let mut out = Vec::new();
    for b in 0..5u32 {
        r.fill(b, b as u8);
        assert!(t.offer(b, h(u64::from(b)), LocalBlockHash(0), None));
        t.flush(&mut out);
        settle(&mut t);
    }
    // Four slots: block 0 went when block 4 came.
    let m = t.metrics();
    assert_eq!((m.host_blocks, m.host_capacity), (4, 4));
    assert_eq!(t.probe([h(0)]), 0);
    // A load of a block no tier holds ends at once with nothing.
    t.load(RequestId(9), [h(0)], &[3], &mut out);
    assert_eq!(out, vec![Action::Loaded { id: RequestId(9), blocks: 0 }]);
    let snap: Vec<u64> = t.snapshot().iter().map(|(_, _, b)| b.seq_hash.0).collect();
    assert!(!snap.contains(&1000) && snap.len() == 4);
}

#[test]
fn with_a_reuse_filter_only_blocks_reused_enough_go_to_disk() {
    let r = rig("filter");
    let mut cfg = r.cfg(64 * 8192);
    if let Some(d) = cfg.disk.as_mut() {
        d.min_hits = 2;
    }
    let mut t = Tiers::start(r.agent.clone(), r.pool, &cfg, 7).expect("tiers");
    let mut out = Vec::new();
    for b in 0..2u32 {
        r.fill(b, b as u8);
        assert!(t.offer(b, h(u64::from(b)), LocalBlockHash(0), None));
    }
    t.flush(&mut out);
    settle(&mut t);
    assert_eq!((t.metrics().host_blocks, t.metrics().disk_blocks), (2, 0), "not yet reused");
    // Block 0 is reused twice (in the pool both times), block 1 once.
    t.admitted([h(0), h(1)], []);
    t.admitted([h(0)], []);
    t.flush(&mut out);
    let (_, events) = settle(&mut t);
    let on_disk: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            TierEvent::Stored { tier: StorageTier::Disk, block, .. } => Some(block.seq_hash.0),
            _ => None,
        })
        .collect();
    assert_eq!(on_disk, vec![1000]);
    // It comes back from disk byte for byte.
    let want = r.read(0);
    drop(t);
    let mut t = Tiers::start(r.agent.clone(), r.pool, &cfg, 7).expect("tiers");
    t.drain_events(|_| {});
    assert_eq!(t.probe([h(0), h(1)]), 1);
    t.load(RequestId(2), [h(0)], &[9], &mut out);
    settle(&mut t);
    assert_eq!(r.read(9), want);
    drop(t);
    std::fs::remove_dir_all(&r.dir).unwrap();
}
