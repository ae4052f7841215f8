//! A fork-join thread pool for the intra-op threads of one shard, which may borrow the
//! cores of idle shards.
//!
//! `run(job)` executes `job(share, n)` once for every share `0..n` (`n` = the pool's width,
//! [`ThreadPool::n_threads`]) and returns when all are done. Shares are claimed from a counter:
//! the caller and every worker taking part claim the next unclaimed share until none is left,
//! so a worker that the OS has descheduled (a busy machine) delays nothing it has not claimed.
//! It allocates nothing per call: the job is passed by reference, workers wake on an epoch
//! counter (spinning briefly, then parking). One dispatcher at a time (a mutex serializes
//! `run`).
//!
//! # Guests
//! A pool may also hold *guest* workers, each pinned (by the caller's start hook) to a core
//! another shard owns and holding that core's [`CoreLease`]. The core's owner lends it while
//! it has nothing to do and reclaims it when work arrives. [`ThreadPool::borrow_idle`] (the
//! pool's owner calls it before a step) takes the leases of the cores lent at that moment and
//! sets the width to the pool's own threads plus the guests it holds;
//! [`ThreadPool::return_borrowed`] (after the step) gives them back; [`ThreadPool::borrowing`]
//! wraps a step in both (the backends' `forward`). The width changes only
//! there, so every run of a step splits its work the same way, and a share's bits do not
//! depend on which thread computes it. A guest takes shares only while its pool holds its
//! lease: on a reclaimed core it does not spin, it is not woken for later runs, and it claims
//! at most one more share (one whose claim was under way), so the shares it leaves are the
//! caller's.
//!
//! # Safety
//! The job reference is lifetime-erased while workers may use it. A worker reads the job cell
//! and calls the job only between incrementing `active` and decrementing it again, and only
//! when it saw `open` set after that increment. `run` writes the cell while `open` is clear
//! (a worker may be active then, having woken for an earlier run, but it finds `open` clear
//! and leaves without reading the cell), sets `open` after the write, clears it once every
//! share is done and then waits for `active` to reach zero before returning (also when a job
//! panics), so no worker uses the reference after `run` returns.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

type Job<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(100);

/// Threads a pool holds at most (its own and guests): one bit each in the run's masks.
pub const MAX_THREADS: usize = 64;

/// A core's owner works on it.
const BUSY: u64 = 0;
/// The owner is idle: a pool may borrow the core.
const FREE: u64 = 1;
/// Lent to the pool with id `state - LENT`.
const LENT: u64 = 2;

/// Pool ids, for the leases they hold.
static NEXT_POOL: AtomicU64 = AtomicU64::new(0);

/// Whether a core its owner (a shard) is not using may run another pool's work, and which
/// pool's. Clones share the state. Starts busy.
#[derive(Clone, Debug, Default)]
pub struct CoreLease(Arc<AtomicU64>);

impl CoreLease {
    /// A lease of a core its owner is using.
    pub fn new() -> CoreLease {
        CoreLease(Arc::new(AtomicU64::new(BUSY)))
    }

    /// The owner has nothing to do: another pool may borrow the core (a lease already lent
    /// stays with its borrower).
    pub fn lend(&self) {
        let _ = self.0.compare_exchange(BUSY, FREE, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The owner needs its core: the borrower's guest finishes the share it is computing,
    /// claims at most one more (one whose claim was under way) and is not woken for the
    /// borrower's later runs.
    pub fn reclaim(&self) {
        self.0.store(BUSY, Ordering::SeqCst);
    }

    /// Whether the owner lends the core and no pool holds it.
    pub fn is_free(&self) -> bool {
        self.0.load(Ordering::SeqCst) == FREE
    }

    fn try_hold(&self, pool: u64) -> bool {
        let mine = LENT + pool;
        let cur = self.0.load(Ordering::SeqCst);
        cur == mine
            || (cur == FREE
                && self.0.compare_exchange(FREE, mine, Ordering::SeqCst, Ordering::SeqCst).is_ok())
    }

    fn held_by(&self, pool: u64) -> bool {
        self.0.load(Ordering::SeqCst) == LENT + pool
    }

    fn give_back(&self, pool: u64) {
        let _ = self.0.compare_exchange(LENT + pool, FREE, Ordering::SeqCst, Ordering::SeqCst);
    }
}

struct Shared {
    id: u64,
    /// The pool's own threads (the caller included); workers `own..` are guests.
    own: usize,
    /// Guest `g`'s lease is `leases[g]` (worker `own + g`).
    leases: Vec<CoreLease>,
    epoch: AtomicU64,
    job: UnsafeCell<Option<Job<'static>>>,
    /// Shares of the current run.
    n: AtomicUsize,
    /// Bit `i`: worker `i` takes part in the current run.
    invited: AtomicU64,
    /// Set while the current job may be called.
    open: AtomicBool,
    /// Workers between checking `open` and leaving the job.
    active: AtomicUsize,
    /// The next share of the current run to claim.
    next: AtomicUsize,
    /// Shares of the current run that finished.
    done: AtomicUsize,
    /// Per worker: parked (or about to park) until unparked.
    sleeping: Vec<AtomicBool>,
    shutdown: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the dispatcher while `open` is clear, and read by workers
// only while active with `open` seen set after their increment; see the module docs.
unsafe impl Sync for Shared {}

impl Shared {
    /// Whether worker `index` may take shares now: its own, or a guest whose lease this pool
    /// holds.
    fn may_work(&self, index: usize) -> bool {
        index < self.own || self.leases.get(index - self.own).is_some_and(|l| l.held_by(self.id))
    }

    /// Claims and runs shares of the current run until none is left, as worker `index` (0:
    /// the caller); a guest stops claiming once its core is reclaimed.
    fn claim_shares(
        &self,
        job: Job<'_>,
        n: usize,
        index: usize,
    ) -> Option<Box<dyn std::any::Any + Send>> {
        let mut panic = None;
        loop {
            if !self.may_work(index) {
                return panic;
            }
            let k = self.next.fetch_add(1, Ordering::SeqCst);
            if k >= n {
                return panic;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(k, n))) {
                panic.get_or_insert(p);
            }
            self.done.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A pool of `n_threads - 1` workers plus the calling thread, and its guests.
pub struct ThreadPool {
    shared: Arc<Shared>,
    dispatch: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
    /// Worker `i`'s thread is `threads[i - 1]`.
    threads: Vec<Thread>,
    /// Bit `i`: guest worker `i` is held (the width is the own threads plus these).
    held: AtomicU64,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("own", &self.shared.own)
            .field("guests", &self.shared.leases.len())
            .field("width", &self.n_threads())
            .finish()
    }
}

impl ThreadPool {
    /// A pool with `n_threads` threads in all (at least 1, at most [`MAX_THREADS`]).
    pub fn new(n_threads: usize) -> std::io::Result<Self> {
        Self::with_guests(n_threads, Vec::new(), |_| {})
    }

    /// Like [`ThreadPool::new`]; `hook(i)` runs first on each worker thread `i` (1-based;
    /// the caller is thread 0), e.g. to pin it to a core.
    pub fn with_start_hook(
        n_threads: usize,
        hook: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        Self::with_guests(n_threads, Vec::new(), hook)
    }

    /// A pool of `n_threads` own threads and one guest per lease (module docs): guest `g` is
    /// worker `n_threads + g`, and `hook` runs first on every worker, guests included (it
    /// pins guest `g` to the core `leases[g]` lends). Own threads and guests together are at
    /// most [`MAX_THREADS`]: leases past that are not used.
    pub fn with_guests(
        n_threads: usize,
        mut leases: Vec<CoreLease>,
        hook: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let own = n_threads.clamp(1, MAX_THREADS);
        leases.truncate(MAX_THREADS - own);
        let total = own + leases.len();
        let shared = Arc::new(Shared {
            id: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            own,
            leases,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n: AtomicUsize::new(0),
            invited: AtomicU64::new(0),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            sleeping: (0..total).map(|_| AtomicBool::new(false)).collect(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let hook = Arc::new(hook);
        let mut pool = ThreadPool {
            shared: shared.clone(),
            dispatch: Mutex::new(()),
            workers: Vec::with_capacity(total - 1),
            threads: Vec::with_capacity(total - 1),
            held: AtomicU64::new(0),
        };
        for i in 1..total {
            let worker_shared = shared.clone();
            let hook = hook.clone();
            let name = if i < own { format!("kvx-op-{i}") } else { format!("kvx-guest-{i}") };
            // On an error the pool built so far is dropped, which stops its workers.
            let h = std::thread::Builder::new().name(name).spawn(move || {
                hook(i);
                worker_loop(&worker_shared, i)
            })?;
            pool.threads.push(h.thread().clone());
            pool.workers.push(h);
        }
        Ok(pool)
    }

    /// The width of a run: the pool's own threads (the caller included) plus the guests held
    /// since the last [`borrow_idle`](Self::borrow_idle).
    pub fn n_threads(&self) -> usize {
        self.shared.own + self.held.load(Ordering::Relaxed).count_ones() as usize
    }

    /// The widest a run can be: own threads and every guest.
    pub fn max_threads(&self) -> usize {
        self.shared.own + self.shared.leases.len()
    }

    /// Takes the leases of the guests' cores that are lent now (keeping those already held)
    /// and returns the new width. Call it between runs, from the thread that runs them.
    pub fn borrow_idle(&self) -> usize {
        let s = &*self.shared;
        let mut held = 0u64;
        for (g, lease) in s.leases.iter().enumerate() {
            if lease.try_hold(s.id) {
                held |= 1 << (s.own + g);
            }
        }
        self.held.store(held, Ordering::Relaxed);
        self.n_threads()
    }

    /// Gives back every lease held (between runs): the width is the pool's own threads again.
    pub fn return_borrowed(&self) {
        let s = &*self.shared;
        if self.held.swap(0, Ordering::Relaxed) != 0 {
            for lease in &s.leases {
                lease.give_back(s.id);
            }
        }
    }

    /// `f()` with the cores lent now borrowed ([`borrow_idle`](Self::borrow_idle)), given
    /// back when it returns or unwinds: one step's runs.
    pub fn borrowing<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Back<'a>(&'a ThreadPool);
        impl Drop for Back<'_> {
            fn drop(&mut self) {
                self.0.return_borrowed();
            }
        }
        self.borrow_idle();
        let _back = Back(self);
        f()
    }

    /// Runs `job(i, n)` for every share `i` in `0..n` (`n` = [`n_threads`](Self::n_threads))
    /// and waits for all. A panic in any share is re-raised here after every share has
    /// finished.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let s = &*self.shared;
        let n = self.n_threads();
        if n == 1 {
            job(0, 1);
            return;
        }
        let _guard = self.dispatch.lock().unwrap_or_else(|p| p.into_inner());
        // Own workers, and the guests whose lease is still held (an owner may have reclaimed
        // its core in the middle of the step: its guest is not woken).
        let own_mask = if s.own >= 64 { u64::MAX } else { (1u64 << s.own) - 1 };
        let mut invited = own_mask & !1;
        let held = self.held.load(Ordering::Relaxed);
        if held != 0 {
            for (g, lease) in s.leases.iter().enumerate() {
                let bit = 1u64 << (s.own + g);
                if held & bit != 0 && lease.held_by(s.id) {
                    invited |= bit;
                }
            }
        }
        // SAFETY: erasing the lifetime is sound because this function does not return while
        // a worker may still use the reference (module docs).
        let erased: Job<'static> = unsafe { std::mem::transmute::<Job<'_>, Job<'static>>(job) };
        // SAFETY: `open` is clear (the previous run cleared it and waited for its workers to
        // leave), so no worker reads the cell while it is written (module docs).
        unsafe { *s.job.get() = Some(erased) };
        s.n.store(n, Ordering::SeqCst);
        s.invited.store(invited, Ordering::SeqCst);
        s.next.store(0, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        s.open.store(true, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        for (i, t) in self.threads.iter().enumerate() {
            let w = i + 1;
            if invited & (1 << w) != 0 && s.sleeping[w].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
        let panic = s.claim_shares(job, n, 0);
        wait_for(|| s.done.load(Ordering::SeqCst) == n);
        s.open.store(false, Ordering::SeqCst);
        wait_for(|| s.active.load(Ordering::SeqCst) == 0);
        // SAFETY: `open` is clear and every worker that saw it set has left (a worker active
        // from now on finds it clear and does not read the cell).
        unsafe { *s.job.get() = None };
        let worker_panicked = s.panicked.swap(false, Ordering::Relaxed);
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        if worker_panicked {
            panic!("a kernel thread panicked");
        }
    }
}

/// Spins briefly, then yields, until `done()`.
fn wait_for(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 1 << 12 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker_loop(s: &Shared, index: usize) {
    let mut seen = 0u64;
    let bit = 1u64 << index;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins += 1;
            // A guest spins only on a core its pool holds.
            if !spins.is_multiple_of(64) || (start.elapsed() < SPIN && s.may_work(index)) {
                std::hint::spin_loop();
                continue;
            }
            s.sleeping[index].store(true, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                std::thread::park();
            }
            s.sleeping[index].store(false, Ordering::SeqCst);
        }
        s.active.fetch_add(1, Ordering::SeqCst);
        if s.open.load(Ordering::SeqCst)
            && s.invited.load(Ordering::SeqCst) & bit != 0
            && s.may_work(index)
        {
            // SAFETY: this worker is active and saw `open` set afterwards, so the dispatcher
            // keeps the job alive until it leaves (module docs).
            let job = unsafe { *s.job.get() };
            if let Some(job) = job
                && s.claim_shares(job, s.n.load(Ordering::SeqCst), index).is_some()
            {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for t in &self.threads {
            t.unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        self.return_borrowed();
    }
}

/// The `i`-th of `n` near-equal parts of `0..len`, with part boundaries on multiples of `align`.
pub fn split_range(len: usize, i: usize, n: usize, align: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = len.div_ceil(align);
    let per = units / n;
    let extra = units % n;
    let start = i * per + i.min(extra);
    let end = start + per + usize::from(i < extra);
    (start * align).min(len)..(end * align).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_thread_runs_each_job_once() {
        for n in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n).unwrap();
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for _ in 0..1000 {
                pool.run(&|i, nt| {
                    assert_eq!(nt, n);
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            for h in &hits {
                assert_eq!(h.load(Ordering::Relaxed), 1000);
            }
        }
    }

    #[test]
    fn shares_of_absent_workers_are_run_by_the_caller() {
        // Workers that never get a core (simulated by a pool whose workers are blocked in
        // their start hook) must not stall `run`: the caller runs their shares.
        let gate = Arc::new(Mutex::new(()));
        let held = gate.lock().unwrap();
        let g = gate.clone();
        let pool = ThreadPool::with_start_hook(4, move |_| drop(g.lock())).unwrap();
        let hits: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
        for _ in 0..100 {
            pool.run(&|i, _| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        drop(held);
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 100, "every share ran exactly once per run");
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::new(3).unwrap();
        let count = AtomicU32::new(0);
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(5));
            pool.run(&|_, _| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(count.load(Ordering::Relaxed), 9);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i, _| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    /// Runs one two-share job on `pool` whose shares each wait (up to `wait`) for the other
    /// to start, and returns the names of the threads that ran them.
    fn share_threads(pool: &ThreadPool, wait: Duration) -> [String; 2] {
        let started = [AtomicBool::new(false), AtomicBool::new(false)];
        let who = [Mutex::new(String::new()), Mutex::new(String::new())];
        pool.run(&|i, n| {
            assert_eq!(n, 2);
            *who[i].lock().unwrap() = std::thread::current().name().unwrap_or("").to_string();
            started[i].store(true, Ordering::SeqCst);
            let t0 = Instant::now();
            while !started[1 - i].load(Ordering::SeqCst) && t0.elapsed() < wait {
                std::thread::yield_now();
            }
        });
        who.map(|w| w.into_inner().unwrap())
    }

    fn guest_took_part(names: &[String; 2]) -> bool {
        names.iter().any(|n| n.starts_with("kvx-guest"))
    }

    #[test]
    fn a_guest_works_only_while_its_core_is_lent() {
        let lease = CoreLease::new();
        let pool = ThreadPool::with_guests(1, vec![lease.clone()], |_| {}).unwrap();
        assert_eq!(pool.max_threads(), 2);
        // The owner works on its core: one share, on the caller.
        assert_eq!(pool.borrow_idle(), 1);
        let count = AtomicU32::new(0);
        pool.run(&|i, n| {
            assert_eq!((i, n), (0, 1));
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 1);
        // Lent: two shares, the second on the guest (the first waits for it).
        lease.lend();
        assert_eq!(pool.borrow_idle(), 2);
        assert!(!lease.is_free(), "the pool holds the lease");
        assert!(guest_took_part(&share_threads(&pool, Duration::from_secs(10))));
        // Reclaimed in the middle of a step: the width stays for the step's runs, but the
        // guest takes no share; the caller computes both.
        lease.reclaim();
        let main = std::thread::current().name().unwrap_or("").to_string();
        assert_eq!(share_threads(&pool, Duration::from_millis(200)), [main.clone(), main]);
        pool.return_borrowed();
        assert_eq!(pool.n_threads(), 1);
        assert_eq!(pool.borrow_idle(), 1, "a reclaimed core is not borrowed again");
    }

    #[test]
    fn a_lent_core_is_held_by_one_pool_at_a_time() {
        let lease = CoreLease::new();
        let a = ThreadPool::with_guests(1, vec![lease.clone()], |_| {}).unwrap();
        let b = ThreadPool::with_guests(1, vec![lease.clone()], |_| {}).unwrap();
        lease.lend();
        assert_eq!(a.borrow_idle(), 2);
        assert_eq!(b.borrow_idle(), 1, "held by the other pool");
        assert_eq!(a.borrow_idle(), 2, "a pool keeps what it holds");
        a.return_borrowed();
        assert!(lease.is_free());
        assert_eq!(b.borrow_idle(), 2);
        assert!(guest_took_part(&share_threads(&b, Duration::from_secs(10))));
        // Lending again does not take the core from its borrower.
        lease.lend();
        assert_eq!(a.borrow_idle(), 1);
        drop(b);
        assert!(lease.is_free(), "a dropped pool gives its leases back");
    }

    #[test]
    fn a_run_after_panics_in_the_caller_and_a_worker_succeeds() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            // Each share waits for the other to start, so the caller and the worker each
            // panic in one.
            let started = [AtomicBool::new(false), AtomicBool::new(false)];
            pool.run(&|i, _| {
                started[i].store(true, Ordering::SeqCst);
                let t0 = Instant::now();
                while !started[1 - i].load(Ordering::SeqCst)
                    && t0.elapsed() < Duration::from_secs(10)
                {
                    std::thread::yield_now();
                }
                panic!("share {i}");
            })
        }));
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2, "the next run is not taken for a panic");
    }

    #[test]
    fn split_range_covers_exactly() {
        for len in [0, 1, 7, 64, 100, 1000] {
            for n in 1..6 {
                for align in [1, 4, 16] {
                    let mut next = 0;
                    for i in 0..n {
                        let r = split_range(len, i, n, align);
                        assert_eq!(r.start, next);
                        assert!(r.start.is_multiple_of(align) || r.start == len);
                        next = r.end;
                    }
                    assert_eq!(next, len);
                }
            }
        }
    }
}
