//! A fork-join thread pool for the intra-op threads of one shard.
//!
//! `run(job)` executes `job(share, n_threads)` once for every share `0..n_threads` and returns
//! when all are done. Worker `i` runs share `i` when it wakes in time; the caller runs share 0
//! and then every share whose worker has not claimed it yet. So a worker that the OS has
//! descheduled (a busy machine) delays nothing: its share is done by the caller instead of
//! waited for. It allocates nothing per call: the job is passed by reference, workers wake on
//! an epoch counter (spinning briefly, then parking). One dispatcher at a time (a mutex
//! serializes `run`).
//!
//! # Safety
//! The job reference is lifetime-erased while workers may use it. A worker reads and calls it
//! only between incrementing `active` and decrementing it again, and only when it saw `open`
//! set after that increment. `run` clears `open` once every share is done and then waits for
//! `active` to reach zero before returning (also when a job panics), so no worker uses the
//! reference after `run` returns. The job cell is written only while `open` is clear and no
//! worker is active.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(100);

struct Shared {
    n_threads: usize,
    epoch: AtomicU64,
    job: UnsafeCell<Option<Job<'static>>>,
    /// Set while the current job may be called.
    open: AtomicBool,
    /// Workers between checking `open` and leaving the job.
    active: AtomicUsize,
    /// Bit `i`: share `i` of the current run was claimed.
    claimed: AtomicU64,
    /// Shares of the current run that finished.
    done: AtomicUsize,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the dispatcher while `open` is clear and no worker is
// active, and read by workers only while active with `open` seen set; see the module docs.
unsafe impl Sync for Shared {}

/// A pool of `n_threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    dispatch: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("n_threads", &self.shared.n_threads).finish()
    }
}

impl ThreadPool {
    /// A pool with `n_threads` threads in all (at least 1, at most 64).
    pub fn new(n_threads: usize) -> std::io::Result<Self> {
        Self::with_start_hook(n_threads, |_| {})
    }

    /// Like [`ThreadPool::new`]; `hook(i)` runs first on each worker thread `i` (1-based;
    /// the caller is thread 0), e.g. to pin it to a core.
    pub fn with_start_hook(
        n_threads: usize,
        hook: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let n_threads = n_threads.clamp(1, 64);
        let shared = Arc::new(Shared {
            n_threads,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            claimed: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let hook = Arc::new(hook);
        let mut workers = Vec::with_capacity(n_threads - 1);
        for i in 1..n_threads {
            let worker_shared = shared.clone();
            let hook = hook.clone();
            let spawned =
                std::thread::Builder::new().name(format!("kvx-op-{i}")).spawn(move || {
                    hook(i);
                    worker_loop(&worker_shared, i)
                });
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    let pool = ThreadPool { shared, dispatch: Mutex::new(()), workers };
                    drop(pool);
                    return Err(e);
                }
            }
        }
        Ok(ThreadPool { shared, dispatch: Mutex::new(()), workers })
    }

    /// Threads in the pool, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `job(i, n)` for every share `i` in `0..n` (`n` = the pool's threads) and waits
    /// for all. A panic in any share is re-raised here after every share has finished.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let s = &*self.shared;
        let n = s.n_threads;
        if n == 1 {
            job(0, 1);
            return;
        }
        let _guard = self.dispatch.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: erasing the lifetime is sound because this function does not return while
        // a worker may still use the reference (module docs).
        let erased: Job<'static> = unsafe { std::mem::transmute::<Job<'_>, Job<'static>>(job) };
        // SAFETY: `open` is clear and no worker is active (the previous run waited for that),
        // so nobody reads the cell while it is written.
        unsafe { *s.job.get() = Some(erased) };
        s.claimed.store(0, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        s.open.store(true, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        // Share 0, then every share no worker has claimed yet.
        let mut panic = None;
        for i in 0..n {
            if s.claimed.fetch_or(1 << i, Ordering::SeqCst) & (1 << i) == 0 {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(i, n))) {
                    panic.get_or_insert(p);
                }
                s.done.fetch_add(1, Ordering::SeqCst);
            }
        }
        wait_for(|| s.done.load(Ordering::SeqCst) == n);
        s.open.store(false, Ordering::SeqCst);
        wait_for(|| s.active.load(Ordering::SeqCst) == 0);
        // SAFETY: `open` is clear and no worker is active.
        unsafe { *s.job.get() = None };
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
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
            if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let mut g = s.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            drop(g);
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        s.active.fetch_add(1, Ordering::SeqCst);
        let bit = 1u64 << index;
        if s.open.load(Ordering::SeqCst) && s.claimed.fetch_or(bit, Ordering::SeqCst) & bit == 0 {
            // SAFETY: this worker is active and saw `open` set afterwards, so the dispatcher
            // keeps the job alive until it leaves (module docs).
            let job = unsafe { *s.job.get() };
            if let Some(job) = job
                && catch_unwind(AssertUnwindSafe(|| job(index, s.n_threads))).is_err()
            {
                s.panicked.store(true, Ordering::Relaxed);
            }
            s.done.fetch_add(1, Ordering::SeqCst);
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
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
