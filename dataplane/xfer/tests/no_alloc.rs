//! The steady-state transfer path does not allocate: after a warm-up, posting and completing
//! 3000 prepped transfers (12000 blocks) on every backend, 3000 through two copy threads
//! and 3000 alternating between two io_uring engines, every agent's engines included,
//! performs no per-transfer or per-block heap allocation. Counted with a global allocator; this binary holds a single test so no other
//! test's allocations are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvx_xfer::{Agent, AgentConfig, Backend, Desc, Op};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn run(a: &Agent, p: &kvx_xfer::Prepped, n: usize) {
    let mut q = std::collections::VecDeque::with_capacity(8);
    for i in 0..n {
        if q.len() == 8 {
            let h: kvx_xfer::XferHandle = q.pop_front().unwrap();
            h.wait(Duration::from_secs(20)).unwrap();
        }
        let op = if i % 2 == 0 { Op::Write } else { Op::Read };
        q.push_back(a.post(op, p, b"note").unwrap());
    }
    for h in q {
        h.wait(Duration::from_secs(20)).unwrap();
    }
}

#[test]
fn steady_state_transfers_do_not_allocate() {
    let a = Agent::new(AgentConfig::new("a")).unwrap();
    let b = Agent::new(AgentConfig::new("b")).unwrap();
    let la = a.alloc_mem(4 << 20).unwrap();
    let rb = b.alloc_mem(4 << 20).unwrap();
    let path = std::env::temp_dir().join(format!("kvx-xfer-noalloc-{}", std::process::id()));
    let fa = a.register_file(&path, 0, 4 << 20).unwrap();
    let rid = a.add_remote(&b.metadata()).unwrap();
    let me = a.add_remote(&a.metadata()).unwrap();
    let descs = |r| (0..4).map(|i| Desc::new(r, i * 65536, 65536)).collect::<Vec<_>>();
    // An initiator with its own configuration, a region and `b` as its remote.
    let initiator = |name: &str, set: fn(&mut AgentConfig)| {
        let mut cfg = AgentConfig::new(name);
        set(&mut cfg);
        let agent = Agent::new(cfg).unwrap();
        let region = agent.alloc_mem(4 << 20).unwrap();
        let remote = agent.add_remote(&b.metadata()).unwrap();
        (agent, region, remote)
    };
    // Two copy threads taking (and splitting) 1 MiB transfers.
    let (c, lc, rid_c) = initiator("c", |cfg| cfg.copy_threads = 2);
    let big = |r| (0..16).map(|i| Desc::new(r, i * 65536, 65536)).collect::<Vec<_>>();
    // Two io_uring engines: TCP transfers alternate between two connections.
    let (d, ld, rid_d) = initiator("d", |cfg| cfg.tcp_threads = 2);
    let cases = [
        (&a, Backend::Shm, a.prep(rid, &descs(la), &descs(rb), Some(Backend::Shm)).unwrap()),
        (&a, Backend::Tcp, a.prep(rid, &descs(la), &descs(rb), Some(Backend::Tcp)).unwrap()),
        (&a, Backend::File, a.prep(me, &descs(la), &descs(fa), Some(Backend::File)).unwrap()),
        (&c, Backend::Shm, c.prep(rid_c, &big(lc), &big(rb), Some(Backend::Shm)).unwrap()),
        (&d, Backend::Tcp, d.prep(rid_d, &descs(ld), &descs(rb), Some(Backend::Tcp)).unwrap()),
    ];
    let mut sink = Vec::with_capacity(10_000);
    for (agent, backend, p) in &cases {
        run(agent, p, 200); // warm-up: lazily built per-connection state, thread-locals
        let _ = b.get_notifs(&mut sink);
        let _ = a.get_notifs(&mut sink);
        sink.clear();
        let before = ALLOCS.load(Ordering::SeqCst);
        run(agent, p, 3000);
        let after = ALLOCS.load(Ordering::SeqCst);
        // A per-transfer or per-block allocation would show up thousands of times; allow a
        // handful of one-off lazy initialisations (thread parking, channel wait contexts).
        assert!(
            after - before <= 4,
            "{backend:?}: {} allocations during 3000 steady-state transfers",
            after - before
        );
        let _ = b.get_notifs(&mut sink);
        let _ = a.get_notifs(&mut sink);
        sink.clear();
    }
    let _ = std::fs::remove_file(path);
}
