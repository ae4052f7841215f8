//! Conformance suite: every backend (shm, tcp, file) runs the same behavioural tests —
//! random descriptor lists verified byte for byte, bounds rejected locally and remotely,
//! many transfers in flight completing in any order, notifications, cancellation, and a
//! peer process killed mid-transfer turning into an error rather than a hang.

#![allow(clippy::disallowed_methods)] // the model and tools come from `cargo xtask test`'s environment

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvx_xfer::{
    Agent, AgentConfig, AgentMetadata, Backend, DIRECT_IO_ALIGN, Desc, Op, RegionId, RemoteId,
    XferError, XferStatus, ZeroCopy,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const REGION: u64 = 8 << 20;
const WAIT: Duration = Duration::from_secs(20);

fn tmp_path(tag: &str) -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("kvx-xfer-{tag}-{}-{}", std::process::id(), rand::random::<u32>()))
}

/// An initiator agent `a`, a target (a second agent `b`, or `a` itself for files), the
/// local region in `a`, and the target region.
struct Fx {
    backend: Backend,
    a: Agent,
    b: Option<Agent>,
    remote: RemoteId,
    local: RegionId,
    target: RegionId,
    file: Option<PathBuf>,
}

impl Drop for Fx {
    fn drop(&mut self) {
        if let Some(f) = &self.file {
            let _ = std::fs::remove_file(f);
        }
    }
}

thread_local! {
    /// Zero-copy policy for agents built by this test thread (each test runs on its own).
    static ZC: std::cell::Cell<ZeroCopy> = const { std::cell::Cell::new(ZeroCopy::Auto) };
    /// Copy threads of the shm backend for agents built by this test thread.
    static COPY_THREADS: std::cell::Cell<usize> = const { std::cell::Cell::new(1) };
    /// io_uring engines (TCP connections per remote) for agents built by this test thread.
    static TCP_THREADS: std::cell::Cell<usize> = const { std::cell::Cell::new(1) };
    /// Whether agents built by this test thread keep regions resident (pre-faulted and
    /// registered as fixed buffers).
    static RESIDENT: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

fn base_cfg(name: &str) -> AgentConfig {
    let mut c = AgentConfig::new(name);
    c.tcp_zero_copy = ZC.with(|z| z.get());
    c.copy_threads = COPY_THREADS.with(|t| t.get());
    c.tcp_threads = TCP_THREADS.with(|t| t.get());
    c.fixed_buffers = RESIDENT.with(|f| f.get());
    c.prefault = RESIDENT.with(|f| f.get());
    c
}

fn agent(name: &str) -> Agent {
    let mut c = base_cfg(name);
    c.max_inflight = 512;
    Agent::new(c).expect("agent starts")
}

fn fixture(backend: Backend) -> Fx {
    let a = agent("init");
    let local = a.alloc_mem(REGION).unwrap();
    match backend {
        Backend::File => {
            let path = tmp_path("file");
            let target = a.register_file(&path, 0, REGION).unwrap();
            let remote = a.add_remote(&a.metadata()).unwrap();
            Fx { backend, a, b: None, remote, local, target, file: Some(path) }
        }
        _ => {
            let b = agent("target");
            let target = b.alloc_mem(REGION).unwrap();
            let remote = a.add_remote(&b.metadata()).unwrap();
            Fx { backend, a, b: Some(b), remote, local, target, file: None }
        }
    }
}

impl Fx {
    fn unit(&self) -> u64 {
        if self.backend == Backend::File { DIRECT_IO_ALIGN } else { 1 }
    }

    /// Read the target's bytes out of band (directly from the target agent or the file).
    fn target_bytes(&self, off: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        match (&self.b, &self.file) {
            (Some(b), _) => b.read_local(Desc::new(self.target, off, len), &mut v).unwrap(),
            (None, Some(f)) => {
                std::fs::File::open(f).unwrap().read_exact_at(&mut v, off).unwrap();
            }
            _ => unreachable!(),
        }
        v
    }

    /// The receiving side's notification queue.
    fn notif_side(&self) -> &Agent {
        self.b.as_ref().unwrap_or(&self.a)
    }

    fn run(&self, op: Op, l: &[Desc], r: &[Desc], notif: &[u8]) -> Result<(), XferError> {
        let p = self.a.prep(self.remote, l, r, Some(self.backend))?;
        assert_eq!(p.backend(), self.backend);
        self.a.post(op, &p, notif)?.wait(WAIT)
    }
}

/// `n` non-overlapping random ranges inside `[0, span)`, in random order, lengths multiples
/// of `unit` up to `max_units` units.
fn random_ranges(
    rng: &mut StdRng,
    n: usize,
    span: u64,
    unit: u64,
    max_units: u64,
) -> Vec<(u64, u64)> {
    let lens: Vec<u64> = (0..n).map(|_| rng.random_range(1..=max_units) * unit).collect();
    place(rng, &lens, span, unit, max_units)
}

/// Non-overlapping random places inside `[0, span)` for ranges of the given lengths (each at
/// most `max_units` units).
fn place(rng: &mut StdRng, lens: &[u64], span: u64, unit: u64, max_units: u64) -> Vec<(u64, u64)> {
    let slot = unit * max_units;
    let mut slots: Vec<u64> = (0..span / slot).collect();
    assert!(slots.len() >= lens.len());
    slots.shuffle(rng);
    slots
        .into_iter()
        .zip(lens)
        .map(|(s, &len)| {
            let shift = rng.random_range(0..=max_units - len / unit) * unit;
            (s * slot + shift, len)
        })
        .collect()
}

fn random_lists_verified_byte_for_byte(backend: Backend) {
    let unit = if backend == Backend::File { DIRECT_IO_ALIGN } else { 1 };
    random_lists_with(backend, 24, if unit == 1 { 70_000 } else { 17 }, 12);
}

/// Rounds of up to `max_n` random ranges of up to `max_units` units each, written to the
/// target and read back to fresh places, every byte checked.
fn random_lists_with(backend: Backend, max_n: usize, max_units: u64, rounds: usize) {
    let fx = fixture(backend);
    let mut rng = StdRng::seed_from_u64(0x5eed ^ backend as u64 ^ max_units);
    let unit = fx.unit();
    let half = REGION / 2;
    for round in 0..rounds {
        let n = rng.random_range(1..=max_n);
        let rr = random_ranges(&mut rng, n, REGION, unit, max_units);
        // Local source ranges in the first half, with the same lengths.
        let lens: Vec<u64> = rr.iter().map(|r| r.1).collect();
        let src = place(&mut rng, &lens, half, unit, max_units);
        let l: Vec<Desc> =
            src.iter().zip(&rr).map(|(s, r)| Desc::new(fx.local, s.0, r.1)).collect();
        let r: Vec<Desc> = rr.iter().map(|&(o, n)| Desc::new(fx.target, o, n)).collect();
        let mut payloads = Vec::new();
        for d in &l {
            let mut b = vec![0u8; d.len as usize];
            rng.fill(&mut b[..]);
            fx.a.write_local(*d, &b).unwrap();
            payloads.push(b);
        }
        fx.run(Op::Write, &l, &r, b"")
            .unwrap_or_else(|e| panic!("{backend:?} write round {round}: {e}"));
        for (d, want) in r.iter().zip(&payloads) {
            assert!(
                fx.target_bytes(d.offset, d.len) == *want,
                "{backend:?} round {round}: remote bytes differ"
            );
        }
        // Read back into the second half at fresh random places.
        let dst = place(&mut rng, &lens, half, unit, max_units);
        let l2: Vec<Desc> =
            dst.iter().zip(&rr).map(|(s, r)| Desc::new(fx.local, half + s.0, r.1)).collect();
        fx.run(Op::Read, &l2, &r, b"")
            .unwrap_or_else(|e| panic!("{backend:?} read round {round}: {e}"));
        for (d, want) in l2.iter().zip(&payloads) {
            let mut got = vec![0u8; d.len as usize];
            fx.a.read_local(*d, &mut got).unwrap();
            assert!(got == *want, "{backend:?} round {round}: read-back bytes differ");
        }
    }
}

fn out_of_bounds_rejected(backend: Backend) {
    let fx = fixture(backend);
    let u = fx.unit();
    let ok = Desc::new(fx.local, 0, 4 * u);
    let past_end = Desc::new(fx.target, REGION - 2 * u, 4 * u);
    let e = fx.a.prep(fx.remote, &[ok], &[past_end], Some(backend)).unwrap_err();
    assert!(matches!(e, XferError::OutOfBounds { .. }), "{backend:?}: {e}");
    let local_past = Desc::new(fx.local, REGION, u);
    let e =
        fx.a.prep(fx.remote, &[local_past], &[Desc::new(fx.target, 0, u)], Some(backend))
            .unwrap_err();
    assert!(matches!(e, XferError::OutOfBounds { .. }), "{backend:?}: {e}");
    let wrap = Desc::new(fx.target, u64::MAX - u + 1, 4 * u);
    assert!(fx.a.prep(fx.remote, &[ok], &[wrap], Some(backend)).is_err());
    let unknown = Desc::new(RegionId(77), 0, 4 * u);
    let e = fx.a.prep(fx.remote, &[ok], &[unknown], Some(backend)).unwrap_err();
    assert!(matches!(e, XferError::UnknownRegion(77)), "{backend:?}: {e}");
    let e =
        fx.a.prep(fx.remote, &[ok, ok], &[Desc::new(fx.target, 0, 4 * u)], Some(backend))
            .unwrap_err();
    assert!(matches!(e, XferError::Mismatch(_)), "{backend:?}: {e}");
    // A peer whose published metadata overstates its region: the side that owns the bytes
    // must still refuse (the mapping length or the target's own check wins).
    if let Some(b) = &fx.b {
        let mut md: AgentMetadata = b.metadata();
        md.regions[0].len = REGION * 4;
        let liar = fx.a.add_remote(&md).unwrap();
        let far = Desc::new(fx.target, REGION * 2, 4 * u);
        let res =
            fx.a.prep(liar, &[ok], &[far], Some(backend))
                .and_then(|p| fx.a.post(Op::Write, &p, b"")?.wait(WAIT));
        assert!(matches!(res, Err(XferError::OutOfBounds { .. })), "{backend:?}: {res:?}");
        // The connection survives a refused request.
        let near = Desc::new(fx.target, 0, 4 * u);
        let res =
            fx.a.prep(liar, &[ok], &[near], Some(backend))
                .and_then(|p| fx.a.post(Op::Read, &p, b"")?.wait(WAIT));
        assert_eq!(res, Ok(()), "{backend:?}");
    }
}

fn many_in_flight_complete_in_any_order(backend: Backend) {
    let fx = fixture(backend);
    let mut rng = StdRng::seed_from_u64(99);
    let block = if backend == Backend::File { 8 * 1024 } else { 12_345 };
    let count = 300usize;
    assert!(count as u64 * block <= REGION / 2);
    let mut src = vec![0u8; (count as u64 * block) as usize];
    rng.fill(&mut src[..]);
    fx.a.write_local(Desc::new(fx.local, 0, src.len() as u64), &src).unwrap();
    let mut handles = Vec::new();
    for i in 0..count as u64 {
        // Reverse placement on the target so order mistakes show up as wrong bytes.
        let r = Desc::new(fx.target, (count as u64 - 1 - i) * block, block);
        let p =
            fx.a.prep(fx.remote, &[Desc::new(fx.local, i * block, block)], &[r], Some(backend))
                .unwrap();
        let msg = format!("blk-{i}");
        handles.push((i, fx.a.post(Op::Write, &p, msg.as_bytes()).unwrap()));
    }
    handles.shuffle(&mut rng);
    for (i, h) in &handles {
        h.wait(WAIT).unwrap_or_else(|e| panic!("{backend:?} transfer {i}: {e}"));
    }
    let mut seen = HashSet::new();
    let deadline = Instant::now() + WAIT;
    while seen.len() < count && Instant::now() < deadline {
        if let Some(n) = fx.notif_side().wait_notif(Duration::from_millis(200)) {
            assert_eq!(&*n.from, "init");
            seen.insert(String::from_utf8(n.msg().to_vec()).unwrap());
        }
    }
    assert_eq!(seen.len(), count, "{backend:?}: every transfer notified once");
    for i in 0..count as u64 {
        let got = fx.target_bytes((count as u64 - 1 - i) * block, block);
        assert!(
            got == src[(i * block) as usize..((i + 1) * block) as usize],
            "{backend:?} block {i}"
        );
    }
    drop(handles);
    let deadline = Instant::now() + WAIT;
    while fx.a.free_slots() < fx.a.max_inflight() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(fx.a.free_slots(), fx.a.max_inflight(), "{backend:?}: every slot released");
}

fn cancel_before_start(backend: Backend) {
    let fx = fixture(backend);
    let block = 512 << 10;
    let p =
        fx.a.prep(
            fx.remote,
            &[Desc::new(fx.local, 0, block)],
            &[Desc::new(fx.target, 0, block)],
            Some(backend),
        )
        .unwrap();
    // 240 MiB queued: more than the copy threads can move while this thread posts and then
    // cancels, even when they (three on two cores) crowd it out for a few milliseconds. 480
    // transfers, nearly every slot of the agent and nearly twice the ring's entries: file transfers beyond those wait in the
    // engine's queue, where a cancel still finds them (the engine takes a job off its channel
    // at once, so the channel alone is no queue to cancel in).
    let hs: Vec<_> = (0..480).map(|_| fx.a.post(Op::Write, &p, b"").unwrap()).collect();
    let cancelled: Vec<bool> = hs.iter().rev().map(|h| h.cancel()).collect();
    let mut ended_cancelled = 0;
    for (h, c) in hs.iter().rev().zip(&cancelled) {
        let r = h.wait(WAIT);
        if *c {
            assert_eq!(r, Err(XferError::Cancelled), "{backend:?}");
        } else {
            assert!(matches!(r, Ok(()) | Err(XferError::Cancelled)), "{backend:?}: {r:?}");
        }
        ended_cancelled += usize::from(r == Err(XferError::Cancelled));
    }
    // Cancelled at once while queued for the engine, or while waiting behind 200 MiB in the
    // connection's send queue (TCP) or the file queue: either way most of them never move.
    assert!(ended_cancelled > 0, "{backend:?}: queued transfers can be cancelled");
    // The agent still works afterwards.
    fx.run(Op::Write, &[Desc::new(fx.local, 0, block)], &[Desc::new(fx.target, 0, block)], b"")
        .unwrap();
}

/// A peer process with a `64 MiB` memory region (and a file region for the file backend).
struct ChildPeer {
    child: Child,
    md: AgentMetadata,
    file: Option<PathBuf>,
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(f) = &self.file {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn spawn_peer(with_file: bool, seed: u64) -> ChildPeer {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvx-xfer-peer"));
    cmd.args(["--name", "child", "--mem", &(64u64 << 20).to_string(), "--seed", &seed.to_string()]);
    let file = with_file.then(|| tmp_path("peerfile"));
    if let Some(f) = &file {
        cmd.args(["--file", &format!("{}:{}", f.display(), 64u64 << 20)]);
    }
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let md = AgentMetadata::from_hex(&line).expect("peer metadata");
    ChildPeer { child, md, file }
}

fn cross_process_round_trip(backend: Backend) {
    let peer = spawn_peer(backend == Backend::File, 4242);
    let a = agent("init");
    let local = a.alloc_mem(16 << 20).unwrap();
    let r = a.add_remote(&peer.md).unwrap();
    let target = if backend == Backend::File { RegionId(1) } else { RegionId(0) };
    let n = 3 << 20;
    if backend != Backend::File {
        // Read the peer's pattern and check it.
        let p = a
            .prep(r, &[Desc::new(local, 0, n)], &[Desc::new(target, 4096, n)], Some(backend))
            .unwrap();
        a.post(Op::Read, &p, b"").unwrap().wait(WAIT).unwrap();
        let mut want = vec![0u8; n as usize];
        kvx_xfer::peer::pattern(4242, 0, 4096, &mut want);
        let mut got = vec![0u8; n as usize];
        a.read_local(Desc::new(local, 0, n), &mut got).unwrap();
        assert!(got == want, "{backend:?}: peer pattern read back");
    }
    let mut data = vec![0u8; n as usize];
    StdRng::seed_from_u64(5).fill(&mut data[..]);
    a.write_local(Desc::new(local, 0, n), &data).unwrap();
    let w = a
        .prep(r, &[Desc::new(local, 0, n)], &[Desc::new(target, 1 << 20, n)], Some(backend))
        .unwrap();
    a.post(Op::Write, &w, b"").unwrap().wait(WAIT).unwrap();
    let rd = a
        .prep(r, &[Desc::new(local, 8 << 20, n)], &[Desc::new(target, 1 << 20, n)], Some(backend))
        .unwrap();
    a.post(Op::Read, &rd, b"").unwrap().wait(WAIT).unwrap();
    let mut got = vec![0u8; n as usize];
    a.read_local(Desc::new(local, 8 << 20, n), &mut got).unwrap();
    assert!(got == data, "{backend:?}: cross-process write + read back");
}

fn peer_killed_mid_transfer(backend: Backend) {
    let mut peer = spawn_peer(backend == Backend::File, 1);
    let mut cfg = base_cfg("init");
    cfg.xfer_timeout = Duration::from_secs(10);
    let a = Agent::new(cfg).unwrap();
    let local = a.alloc_mem(32 << 20).unwrap();
    let r = a.add_remote(&peer.md).unwrap();
    let target = if backend == Backend::File { RegionId(1) } else { RegionId(0) };
    let block = 4u64 << 20;
    let preps: Vec<_> = (0..8u64)
        .map(|i| {
            a.prep(
                r,
                &[Desc::new(local, (i % 8) * block, block)],
                &[Desc::new(target, i * block, block)],
                Some(backend),
            )
            .unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut inflight = std::collections::VecDeque::new();
    let mut done_ok = 0u64;
    let mut killed_at = None;
    let mut first_err = None;
    let mut posted = 0u64;
    while first_err.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{backend:?}: no error after the peer died"
        );
        while inflight.len() < 8 {
            let op = if posted.is_multiple_of(2) { Op::Write } else { Op::Read };
            inflight.push_back(a.post(op, &preps[(posted % 8) as usize], b"n").unwrap());
            posted += 1;
        }
        if done_ok == 16 && killed_at.is_none() {
            peer.child.kill().unwrap();
            killed_at = Some(Instant::now());
        }
        let h = inflight.pop_front().unwrap();
        // Every transfer resolves well inside the wait: a hang fails here.
        match h.wait(Duration::from_secs(15)) {
            Ok(()) => done_ok += 1,
            Err(XferError::Timeout) => panic!("{backend:?}: transfer hung after peer death"),
            Err(e) => first_err = Some(e),
        }
    }
    let e = first_err.unwrap();
    assert!(killed_at.is_some(), "{backend:?}: failed before the kill: {e}");
    assert!(matches!(e, XferError::RemoteGone(_)), "{backend:?}: {e}");
    // The rest of the in-flight transfers resolve too, and new posts fail fast.
    for h in inflight {
        let r = h.wait(Duration::from_secs(15));
        assert!(!matches!(r, Err(XferError::Timeout)), "{backend:?}: in-flight transfer hung");
    }
    assert!(!a.remote_alive(r));
    let t = Instant::now();
    let r2 = a.post(Op::Write, &preps[0], b"").unwrap().wait(Duration::from_secs(15));
    assert!(matches!(r2, Err(XferError::RemoteGone(_))), "{backend:?}: {r2:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    let _ = peer.child.wait();
}

/// A receiver with a tiny notification queue that drains late: nothing is dropped or
/// duplicated, transfers complete once it drains (back-pressure, not loss).
fn notifications_back_pressure_not_loss(backend: Backend) {
    let small = |name: &str| {
        let mut cfg = base_cfg(name);
        cfg.notif_capacity = 4;
        Agent::new(cfg).unwrap()
    };
    // The file backend notifies the initiating agent itself (its own file tier).
    let a = if backend == Backend::File { small("init") } else { agent("init") };
    let b = small("target");
    let la = a.alloc_mem(1 << 20).unwrap();
    let (target, remote, notified) = if backend == Backend::File {
        let path = tmp_path("bp");
        let t = a.register_file(&path, 0, 1 << 20).unwrap();
        (t, a.add_remote(&a.metadata()).unwrap(), Some(path))
    } else {
        let t = b.alloc_mem(1 << 20).unwrap();
        (t, a.add_remote(&b.metadata()).unwrap(), None)
    };
    let side = if backend == Backend::File { &a } else { &b };
    let n = 40u64;
    let mut hs = Vec::new();
    for i in 0..n {
        let d = [Desc::new(la, i * 4096, 4096)];
        let r = [Desc::new(target, i * 4096, 4096)];
        let p = a.prep(remote, &d, &r, Some(backend)).unwrap();
        let op = if i % 2 == 0 { Op::Write } else { Op::Read };
        hs.push(a.post(op, &p, format!("n{i}").as_bytes()).unwrap());
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut seen = HashSet::new();
    let deadline = Instant::now() + WAIT;
    while (seen.len() as u64) < n && Instant::now() < deadline {
        if let Some(m) = side.wait_notif(Duration::from_millis(100)) {
            assert!(seen.insert(m.msg().to_vec()), "{backend:?}: duplicate notification");
        }
    }
    assert_eq!(seen.len() as u64, n, "{backend:?}: every notification delivered");
    for h in hs {
        h.wait(WAIT).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
    }
    if let Some(p) = notified {
        let _ = std::fs::remove_file(p);
    }
}

macro_rules! suite {
    ($($m:ident => $b:expr),* $(,)?) => {$(
        mod $m {
            use super::*;
            #[test] fn random_lists() { random_lists_verified_byte_for_byte($b) }
            #[test] fn out_of_bounds() { out_of_bounds_rejected($b) }
            #[test] fn many_in_flight_any_order() { many_in_flight_complete_in_any_order($b) }
            #[test] fn cancel() { cancel_before_start($b) }
            #[test] fn cross_process() { cross_process_round_trip($b) }
            #[test] fn peer_killed() { peer_killed_mid_transfer($b) }
            #[test] fn notif_back_pressure() { notifications_back_pressure_not_loss($b) }
        }
    )*};
}

suite!(shm => Backend::Shm, tcp => Backend::Tcp, file => Backend::File);

/// The TCP suite again with zero-copy sends forced on (on loopback the kernel copies, but the
/// two-completion protocol and buffer lifetimes are exercised all the same).
mod tcp_zero_copy {
    use super::*;
    fn zc() {
        ZC.with(|z| z.set(ZeroCopy::Always));
    }
    #[test]
    fn random_lists() {
        zc();
        random_lists_verified_byte_for_byte(Backend::Tcp)
    }
    #[test]
    fn out_of_bounds() {
        zc();
        out_of_bounds_rejected(Backend::Tcp)
    }
    #[test]
    fn many_in_flight_any_order() {
        zc();
        many_in_flight_complete_in_any_order(Backend::Tcp)
    }
    #[test]
    fn peer_killed() {
        zc();
        peer_killed_mid_transfer(Backend::Tcp)
    }
    #[test]
    fn notif_back_pressure() {
        zc();
        notifications_back_pressure_not_loss(Backend::Tcp)
    }
}

/// The shm suite again with three copy threads taking transfers from one queue: many in
/// flight run at once and complete in any order.
mod shm_copy_threads {
    use super::*;
    fn three() {
        COPY_THREADS.with(|t| t.set(3));
    }
    #[test]
    fn random_lists() {
        three();
        random_lists_verified_byte_for_byte(Backend::Shm)
    }
    #[test]
    fn large_random_lists() {
        three();
        // Up to 18 ranges of up to 200,000 bytes at odd offsets and lengths.
        random_lists_with(Backend::Shm, 18, 200_000, 16)
    }
    #[test]
    fn many_in_flight_any_order() {
        three();
        many_in_flight_complete_in_any_order(Backend::Shm)
    }
    #[test]
    fn cancel() {
        three();
        cancel_before_start(Backend::Shm)
    }
    #[test]
    fn peer_killed() {
        three();
        peer_killed_mid_transfer(Backend::Shm)
    }
}

/// The TCP suite again with two io_uring engines on each side: two connections per remote,
/// transfers alternating between them, accepted connections handed from engine 0 to 1. The
/// file suite runs on the first engine of such an agent.
mod tcp_two_engines {
    use super::*;
    fn two() {
        TCP_THREADS.with(|t| t.set(2));
    }
    #[test]
    fn random_lists() {
        two();
        random_lists_verified_byte_for_byte(Backend::Tcp)
    }
    #[test]
    fn out_of_bounds() {
        two();
        out_of_bounds_rejected(Backend::Tcp)
    }
    #[test]
    fn many_in_flight_any_order() {
        two();
        many_in_flight_complete_in_any_order(Backend::Tcp)
    }
    #[test]
    fn cancel() {
        two();
        cancel_before_start(Backend::Tcp)
    }
    #[test]
    fn cross_process() {
        two();
        cross_process_round_trip(Backend::Tcp)
    }
    #[test]
    fn peer_killed() {
        two();
        peer_killed_mid_transfer(Backend::Tcp)
    }
    #[test]
    fn notif_back_pressure() {
        two();
        notifications_back_pressure_not_loss(Backend::Tcp)
    }
    #[test]
    fn files_on_the_first_engine() {
        two();
        random_lists_verified_byte_for_byte(Backend::File);
        many_in_flight_complete_in_any_order(Backend::File)
    }
}

/// Regions that become resident as they are used: not pre-faulted, not registered with the
/// ring (file transfers then use plain reads and writes).
#[test]
fn regions_not_kept_resident() {
    RESIDENT.with(|f| f.set(false));
    random_lists_verified_byte_for_byte(Backend::File);
    many_in_flight_complete_in_any_order(Backend::File);
    random_lists_verified_byte_for_byte(Backend::Shm);
    random_lists_verified_byte_for_byte(Backend::Tcp)
}

#[test]
fn backend_chosen_by_locality() {
    let fx = fixture(Backend::Shm);
    let d = [Desc::new(fx.local, 0, 64)];
    let t = [Desc::new(fx.target, 0, 64)];
    assert_eq!(fx.a.prep(fx.remote, &d, &t, None).unwrap().backend(), Backend::Shm);
    let f = fixture(Backend::File);
    let fd = [Desc::new(f.target, 0, 4096)];
    assert_eq!(
        f.a.prep(f.remote, &[Desc::new(f.local, 0, 4096)], &fd, None).unwrap().backend(),
        Backend::File
    );
    let e = fx.a.prep(fx.remote, &d, &t, Some(Backend::Rdma)).unwrap_err();
    assert!(matches!(e, XferError::Unsupported(_) | XferError::NoDevice(_)), "{e}");
}

#[test]
fn file_backend_rejects_misaligned() {
    let f = fixture(Backend::File);
    let e =
        f.a.prep(f.remote, &[Desc::new(f.local, 0, 4097)], &[Desc::new(f.target, 0, 4097)], None)
            .unwrap_err();
    assert!(matches!(e, XferError::Misaligned { .. }), "{e}");
    let e =
        f.a.prep(f.remote, &[Desc::new(f.local, 0, 4096)], &[Desc::new(f.target, 512, 4096)], None)
            .unwrap_err();
    assert!(matches!(e, XferError::Misaligned { .. }), "{e}");
}

#[test]
fn metadata_fetched_over_tcp() {
    let b = agent("target");
    b.alloc_mem(1 << 20).unwrap();
    let md = b.metadata();
    let got = Agent::fetch_metadata(md.tcp.unwrap(), Duration::from_secs(5)).unwrap();
    // Served to anyone, so without the key; everything else as published.
    assert!(md.has_key() && !got.has_key());
    assert_eq!(got, md.without_key());
    // Such metadata names the agent but cannot be used to connect to it.
    let a = agent("init");
    assert!(matches!(a.add_remote(&got), Err(XferError::Auth { .. })));
}

#[test]
fn tcp_peer_that_stops_answering_times_out() {
    use kvx_xfer::auth::{NONCE_LEN, Side, proof};
    use std::io::{Read, Write};
    // A fake target holding the key it publishes: answers the handshake, then reads
    // requests and never acknowledges.
    let key = [9u8; 32];
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let th = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hb = [0u8; kvx_xfer::wire::HEADER_LEN];
        s.read_exact(&mut hb).unwrap();
        let h = kvx_xfer::wire::Header::decode(&hb).unwrap();
        let mut hello = vec![0u8; h.notif as usize];
        s.read_exact(&mut hello).unwrap();
        let cn: [u8; NONCE_LEN] = hello[..NONCE_LEN].try_into().unwrap();
        let sn = [3u8; NONCE_LEN];
        let mut ack = kvx_xfer::wire::Header::new(kvx_xfer::wire::FrameKind::HelloAck);
        ack.xfer = 1;
        ack.notif = 64;
        ack.encode(&mut hb);
        s.write_all(&hb).unwrap();
        s.write_all(&sn).unwrap();
        s.write_all(&proof(&key, Side::Target, &cn, &sn)).unwrap();
        let mut sink = vec![0u8; 1 << 16];
        while s.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
    });
    let mut cfg = base_cfg("init");
    cfg.xfer_timeout = Duration::from_millis(500);
    let a = Agent::new(cfg).unwrap();
    let local = a.alloc_mem(1 << 20).unwrap();
    let md = AgentMetadata {
        name: "silent".into(),
        instance: 1,
        host: 0,
        pid: 0,
        tcp: Some(addr),
        unix: None,
        regions: vec![kvx_xfer::RegionInfo {
            id: RegionId(0),
            kind: kvx_xfer::RegionKind::Mem,
            len: 1 << 20,
        }],
        key,
    };
    let r = a.add_remote(&md).unwrap();
    let h = a
        .xfer(Op::Write, r, &[Desc::new(local, 0, 4096)], &[Desc::new(RegionId(0), 0, 4096)], b"")
        .unwrap();
    let t = Instant::now();
    assert_eq!(h.wait(Duration::from_secs(20)), Err(XferError::Timeout));
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(h.status(), XferStatus::Failed(XferError::Timeout));
    drop(a);
    th.join().unwrap();
}

#[test]
fn self_overlap_rejected() {
    let a = agent("solo");
    let m = a.alloc_mem(1 << 20).unwrap();
    let me = a.add_remote(&a.metadata()).unwrap();
    let e = a.prep(me, &[Desc::new(m, 0, 100)], &[Desc::new(m, 50, 100)], None).unwrap_err();
    assert!(matches!(e, XferError::Mismatch(_)), "{e}");
    let mut data = vec![7u8; 100];
    data[0] = 1;
    a.write_local(Desc::new(m, 0, 100), &data).unwrap();
    a.xfer(Op::Write, me, &[Desc::new(m, 0, 100)], &[Desc::new(m, 200, 100)], b"hi")
        .unwrap()
        .wait(WAIT)
        .unwrap();
    let mut got = vec![0u8; 100];
    a.read_local(Desc::new(m, 200, 100), &mut got).unwrap();
    assert_eq!(got, data);
    assert_eq!(a.wait_notif(WAIT).unwrap().msg(), b"hi");
}

#[test]
fn hugepage_regions_when_reserved_typed_error_otherwise() {
    let mut c = base_cfg("huge");
    c.hugepages = kvx_xfer::HugePages::Require;
    let a = Agent::new(c).unwrap();
    match a.alloc_mem(4 << 20) {
        Ok(r) => {
            assert!(a.is_huge(r).unwrap());
            let b = agent("target");
            let t = b.alloc_mem(4 << 20).unwrap();
            let rid = a.add_remote(&b.metadata()).unwrap();
            let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7) as u8).collect();
            a.write_local(Desc::new(r, 4096, 1 << 20), &data).unwrap();
            a.xfer(
                Op::Write,
                rid,
                &[Desc::new(r, 4096, 1 << 20)],
                &[Desc::new(t, 0, 1 << 20)],
                b"",
            )
            .unwrap()
            .wait(WAIT)
            .unwrap();
            let mut got = vec![0u8; 1 << 20];
            b.read_local(Desc::new(t, 0, 1 << 20), &mut got).unwrap();
            assert!(got == data);
        }
        Err(e) => assert!(matches!(e, XferError::Io { .. }), "{e}"),
    }
    // Auto never fails for lack of hugepages.
    let b = agent("auto");
    assert!(b.alloc_mem(4 << 20).is_ok());
}

#[test]
fn zero_copy_auto_falls_back_where_the_kernel_copies() {
    let run = |mode: ZeroCopy| {
        let mut c = AgentConfig::new("zc");
        c.tcp_zero_copy = mode;
        let a = Agent::new(c).unwrap();
        let b = agent("target");
        let la = a.alloc_mem(1 << 20).unwrap();
        let rb = b.alloc_mem(1 << 20).unwrap();
        let r = a.add_remote(&b.metadata()).unwrap();
        let p = a
            .prep(r, &[Desc::new(la, 0, 1 << 16)], &[Desc::new(rb, 0, 1 << 16)], Some(Backend::Tcp))
            .unwrap();
        for _ in 0..50 {
            a.post(Op::Write, &p, b"").unwrap().wait(WAIT).unwrap();
        }
        a.stats()
    };
    let never = run(ZeroCopy::Never);
    assert_eq!(never.tcp_zc_sends, 0);
    assert!(never.tcp_sends > 0);
    let always = run(ZeroCopy::Always);
    assert_eq!(always.tcp_zc_sends, always.tcp_sends, "{always:?}");
    let auto = run(ZeroCopy::Auto);
    eprintln!("zero-copy auto on this host: {auto:?}");
    if auto.tcp_zc_copied > 0 {
        // Loopback: the kernel copies, so auto stops using zero-copy after the first report.
        assert!(auto.tcp_zc_sends < auto.tcp_sends / 2, "{auto:?}");
    } else {
        assert_eq!(auto.tcp_zc_sends, auto.tcp_sends, "{auto:?}");
    }
}
