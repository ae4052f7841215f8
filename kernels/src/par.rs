//! A fork-join thread pool for the intra-op threads of one shard.
//!
//! `run(job)` executes `job(thread_index, n_threads)` on every thread of the pool (the caller
//! is thread 0) and returns when all are done. It allocates nothing per call: the job is
//! passed by reference, workers wake on an epoch counter (spinning briefly, then parking), and
//! completion is a countdown. One dispatcher at a time (a mutex serializes `run`).
//!
//! # Safety
//! The job reference is lifetime-erased while workers run it. This is sound because `run`
//! does not return (even when a job panics) until every worker has finished with it: the
//! `remaining` countdown reaches zero only after each worker's last use of the reference.

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
    remaining: AtomicUsize,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the dispatcher while no worker reads it (before the epoch
// is bumped, with all workers idle) and read by workers only between the epoch bump (Acquire)
// and their `remaining` decrement; see the module docs.
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
    /// A pool with `n_threads` threads in all (at least 1).
    pub fn new(n_threads: usize) -> std::io::Result<Self> {
        Self::with_start_hook(n_threads, |_| {})
    }

    /// Like [`ThreadPool::new`]; `hook(i)` runs first on each worker thread `i` (1-based;
    /// the caller is thread 0), e.g. to pin it to a core.
    pub fn with_start_hook(
        n_threads: usize,
        hook: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
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

    /// Runs `job(i, n)` on every thread `i` in `0..n` and waits for all. A panic in any
    /// thread is re-raised here after every thread has finished.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let s = &*self.shared;
        if s.n_threads == 1 {
            job(0, 1);
            return;
        }
        let _guard = self.dispatch.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: erasing the lifetime is sound because this function waits below until no
        // worker uses the reference any more (module docs).
        let erased: Job<'static> = unsafe { std::mem::transmute::<Job<'_>, Job<'static>>(job) };
        // SAFETY: all workers are idle (the previous run ended with remaining == 0), so no one
        // reads `job` while it is written.
        unsafe { *s.job.get() = Some(erased) };
        s.remaining.store(s.n_threads - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| job(0, s.n_threads)));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job (remaining == 0).
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a kernel thread panicked");
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
        // SAFETY: the epoch moved, so the dispatcher has published a job and waits for us.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job
            && catch_unwind(AssertUnwindSafe(|| job(index, s.n_threads))).is_err()
        {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.remaining.fetch_sub(1, Ordering::Release);
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
