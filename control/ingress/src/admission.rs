//! Overload control: the admission queue in front of the router. Engine requests past the
//! server's running bound wait here in arrival order; a newcomer is refused at once (429 with
//! `Retry-After`) when the queue is full or when its estimated wait here (the queue ahead over
//! the rate running slots have been given back) is longer than the bound; one whose deadline
//! passes while it waits leaves then. Admitted requests thus keep their latency under any
//! offered load instead of every request waiting behind an ever longer queue. (Adding the
//! engines' recent dispatch-to-first-token time to the estimate was measured and not kept:
//! the two-second feedback lags, admissions come in waves, and both latency and throughput
//! came out worse.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How requests are admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    /// Engine requests dispatched and not ended at most; more wait here (0 = no bound here:
    /// requests wait in the engines' queues, and the wait check still applies).
    pub max_running: usize,
    /// Engine requests waiting to start at most (here, with a running bound; dispatched with
    /// no output yet, without one); more are refused.
    pub max_queue: usize,
    /// Longest estimated wait for a running slot a newcomer is admitted with; longer ones are
    /// refused (with a running bound: without one the wait is not estimated).
    pub max_wait: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { max_running: 0, max_queue: 1024, max_wait: Duration::from_secs(2) }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refused {
    /// The queue holds `max_queue` requests; one may start in about `retry_after`.
    QueueFull {
        /// The estimated wait now.
        retry_after: Duration,
    },
    /// The estimated wait is longer than the bound (or than the request's deadline).
    TooLong {
        /// The estimated wait.
        wait: Duration,
    },
    /// The request's deadline passed while it waited.
    Deadline,
}

impl Refused {
    /// The label counted in `kvx_admission_refused_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::QueueFull { .. } => "queue_full",
            Refused::TooLong { .. } => "wait",
            Refused::Deadline => "deadline",
        }
    }
}

/// Slot holds remembered, and over how long.
const HOLD_SAMPLES: usize = 256;
const HOLD_WINDOW: Duration = Duration::from_secs(10);

/// How long running slots were held, over the last seconds.
#[derive(Debug, Default)]
struct Holds(Mutex<VecDeque<(Instant, f64)>>);

impl Holds {
    fn add(&self, at: Instant, secs: f64) {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == HOLD_SAMPLES {
            q.pop_front();
        }
        q.push_back((at, secs));
    }

    /// The mean hold, seconds (`None` without one in the window).
    fn mean(&self, now: Instant) -> Option<f64> {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        while q.front().is_some_and(|&(t, _)| now.saturating_duration_since(t) > HOLD_WINDOW) {
            q.pop_front();
        }
        (!q.is_empty()).then(|| q.iter().map(|&(_, v)| v).sum::<f64>() / q.len() as f64)
    }
}

/// The admission queue (shared by every request of a server).
#[derive(Debug)]
pub struct Admission {
    cfg: AdmissionConfig,
    slots: Option<Arc<Semaphore>>,
    /// Engine requests waiting for a slot here.
    queued: AtomicUsize,
    /// Engine requests dispatched that have not produced their first output.
    unstarted: AtomicUsize,
    /// How long running slots were held.
    holds: Holds,
}

impl Admission {
    /// An admission queue with these bounds.
    pub fn new(cfg: AdmissionConfig) -> Arc<Admission> {
        let slots = (cfg.max_running > 0).then(|| Arc::new(Semaphore::new(cfg.max_running)));
        Arc::new(Admission {
            cfg,
            slots,
            queued: AtomicUsize::new(0),
            unstarted: AtomicUsize::new(0),
            holds: Holds::default(),
        })
    }

    /// The bounds in force.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// Engine requests waiting here for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Engine requests waiting to start: here for a slot with a running bound; dispatched
    /// with no output yet (in the engines' queues, or being prefilled) without one.
    pub fn waiting(&self) -> usize {
        match self.slots {
            Some(_) => self.queued.load(Ordering::Relaxed),
            None => self.unstarted.load(Ordering::Relaxed),
        }
    }

    /// The wait for running slots `weight` engine requests arriving now would face: none
    /// while slots are free and nobody waits, else the requests ahead and these over the rate
    /// full slots free at — `max_running` over the mean time a slot was held in the last ten
    /// seconds (Little's law: at light load the rate slots happened to free at is the arrival
    /// rate, not what the server can do). Zero before a hold is known, and without a running
    /// bound (requests then wait in the engines' queues, bounded by `max_queue` alone).
    pub fn estimated_wait(&self, now: Instant, weight: usize) -> Duration {
        let Some(slots) = &self.slots else { return Duration::ZERO };
        let queued = self.queued.load(Ordering::Relaxed);
        if queued == 0 && slots.available_permits() >= weight {
            return Duration::ZERO;
        }
        match self.holds.mean(now) {
            Some(hold) => Duration::from_secs_f64(
                ((queued + weight) as f64 * hold / self.cfg.max_running.max(1) as f64).min(1e6),
            ),
            None => Duration::ZERO,
        }
    }

    /// Admits `weight` engine requests (a request's choices; more than `max_running` count
    /// as `max_running`): refused at once when the queue is full or the estimated wait is
    /// longer than the bound or than what is left until `deadline`; otherwise waits for its
    /// slots in arrival order, or until `deadline`. Dropping the future leaves the queue.
    pub async fn enter(
        self: &Arc<Self>,
        weight: usize,
        deadline: Option<Instant>,
    ) -> Result<Ticket, Refused> {
        let now = Instant::now();
        let w = match self.cfg.max_running {
            0 => weight.max(1),
            m => weight.clamp(1, m),
        };
        let wait = self.estimated_wait(now, w);
        if deadline.is_some_and(|d| now >= d) {
            return Err(Refused::Deadline);
        }
        if self.waiting() + w > self.cfg.max_queue.max(w) {
            return Err(Refused::QueueFull { retry_after: wait });
        }
        if wait > self.cfg.max_wait || deadline.is_some_and(|d| now + wait > d) {
            return Err(Refused::TooLong { wait });
        }
        let permit = match &self.slots {
            None => None,
            Some(slots) => {
                let _queued = Queued::new(&self.queued, w);
                let acquire = slots.clone().acquire_many_owned(w as u32);
                let got = match deadline {
                    None => acquire.await,
                    Some(d) => match tokio::time::timeout_at(d.into(), acquire).await {
                        Ok(got) => got,
                        Err(_) => return Err(Refused::Deadline),
                    },
                };
                // The semaphore is never closed.
                got.ok()
            }
        };
        self.unstarted.fetch_add(w, Ordering::Relaxed);
        Ok(Ticket {
            admission: self.clone(),
            permit,
            unstarted: w,
            weight: w,
            since: Instant::now(),
        })
    }
}

/// Counts weight in the queue for as long as it lives.
struct Queued<'a> {
    n: &'a AtomicUsize,
    w: usize,
}

impl<'a> Queued<'a> {
    fn new(n: &'a AtomicUsize, w: usize) -> Self {
        n.fetch_add(w, Ordering::Relaxed);
        Queued { n, w }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.n.fetch_sub(self.w, Ordering::Relaxed);
    }
}

/// An admitted request's place: its running slots until dropped.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    permit: Option<OwnedSemaphorePermit>,
    /// Of its engine requests, those that have not started.
    unstarted: usize,
    /// Its engine requests.
    weight: usize,
    /// When it got its slots.
    since: Instant,
}

impl Ticket {
    /// One of its engine requests produced its first output.
    pub fn started(&mut self) {
        if self.unstarted > 0 {
            self.unstarted -= 1;
            self.admission.unstarted.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let a = &self.admission;
        a.unstarted.fetch_sub(self.unstarted, Ordering::Relaxed);
        // Only a request that started says how long a slot is held (one refused by the
        // engine at once would pull the estimate towards zero).
        if let Some(p) = self.permit.take().filter(|_| self.unstarted < self.weight) {
            let now = Instant::now();
            let held = now.saturating_duration_since(self.since).as_secs_f64();
            for _ in 0..p.num_permits() {
                a.holds.add(now, held);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adm(max_running: usize, max_queue: usize, max_wait_ms: u64) -> Arc<Admission> {
        Admission::new(AdmissionConfig {
            max_running,
            max_queue,
            max_wait: Duration::from_millis(max_wait_ms),
        })
    }

    #[test]
    fn holds_are_averaged_over_the_last_seconds() {
        let h = Holds::default();
        let t0 = Instant::now();
        assert_eq!(h.mean(t0), None);
        h.add(t0, 1.0);
        h.add(t0 + Duration::from_secs(1), 2.0);
        assert_eq!(h.mean(t0 + Duration::from_secs(2)), Some(1.5));
        // Ten seconds on, the first is forgotten, then both.
        assert_eq!(h.mean(t0 + Duration::from_millis(10_500)), Some(2.0));
        assert_eq!(h.mean(t0 + Duration::from_secs(12)), None);
    }

    #[tokio::test]
    async fn without_a_running_bound_requests_are_bounded_by_the_queue_alone() {
        let a = adm(0, 2, 300);
        assert_eq!(a.estimated_wait(Instant::now(), 1), Duration::ZERO);
        let mut t = a.enter(1, None).await.unwrap();
        let _u = a.enter(1, None).await.unwrap();
        // Two dispatched, not started: the queue is full.
        assert_eq!(a.waiting(), 2);
        assert!(matches!(a.enter(1, None).await, Err(Refused::QueueFull { .. })));
        // One starts: room again.
        t.started();
        assert_eq!(a.waiting(), 1);
        assert!(a.enter(1, None).await.is_ok());
    }

    #[tokio::test]
    async fn with_a_running_bound_the_wait_is_the_queue_over_the_rate_full_slots_free_at() {
        let a = adm(2, 100, 1000);
        let t0 = Instant::now();
        // Free slots and nobody waiting: no wait, whatever the rate.
        assert_eq!(a.estimated_wait(t0, 1), Duration::ZERO);
        let _t1 = a.enter(1, None).await.unwrap();
        let _t2 = a.enter(1, None).await.unwrap();
        // Full, no rate yet: admitted to wait.
        assert_eq!(a.estimated_wait(t0, 1), Duration::ZERO);
        // Slots held 0.5 s each, two of them: they free at 4 a second; the first in line
        // waits 0.25 s, the fifth 1.25 s.
        a.holds.add(t0, 0.4);
        a.holds.add(t0, 0.6);
        let w1 = a.estimated_wait(Instant::now(), 1);
        assert!((w1.as_secs_f64() - 0.25).abs() < 1e-9, "{w1:?}");
        a.queued.fetch_add(4, Ordering::Relaxed);
        let w5 = a.estimated_wait(Instant::now(), 1);
        assert!((w5.as_secs_f64() - 1.25).abs() < 1e-9, "{w5:?}");
        assert!(matches!(a.enter(1, None).await, Err(Refused::TooLong { .. })));
        a.queued.fetch_sub(4, Ordering::Relaxed);
    }

    #[tokio::test]
    async fn a_deadline_already_past_is_a_deadline_and_only_started_requests_count_as_holds() {
        let a = adm(1, 10, 60_000);
        let past = Instant::now() - Duration::from_millis(1);
        assert_eq!(a.enter(1, Some(past)).await.err(), Some(Refused::Deadline));
        // A request refused by the engine before it started holds its slot for no time: it
        // is not counted.
        drop(a.enter(1, None).await.unwrap());
        assert_eq!(a.holds.mean(Instant::now()), None);
        let mut t = a.enter(1, None).await.unwrap();
        t.started();
        drop(t);
        assert!(a.holds.mean(Instant::now()).is_some());
    }

    #[tokio::test]
    async fn the_queue_is_bounded() {
        let a = adm(0, 3, 60_000);
        let t1 = a.enter(2, None).await.unwrap();
        let _t2 = a.enter(1, None).await.unwrap();
        assert!(matches!(a.enter(1, None).await, Err(Refused::QueueFull { .. })));
        drop(t1);
        assert!(a.enter(2, None).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn requests_past_the_running_bound_wait_in_order_until_their_deadline() {
        let a = adm(2, 10, 60_000);
        let mut first = a.enter(2, None).await.unwrap();
        first.started();
        // Past the bound: the next waits (and counts as queued) until a slot frees.
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.enter(1, None).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1);
        // One with a deadline leaves at it, and leaves the queue.
        let d = Instant::now() + Duration::from_millis(200);
        let r = a.enter(1, Some(d)).await;
        assert_eq!(r.err(), Some(Refused::Deadline));
        assert_eq!(a.queued(), 1);
        drop(first);
        waiting.await.unwrap().unwrap();
        assert_eq!(a.queued(), 0);
        // Given-back slots are counted for the estimate.
        assert!(a.holds.mean(Instant::now()).is_some());
        // A waiting request whose client went away leaves the queue too.
        let held = a.enter(2, None).await.unwrap();
        let a3 = a.clone();
        let gone = tokio::spawn(async move { a3.enter(1, None).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(a.queued(), 0);
        drop(held);
        // A request wider than the bound runs alone.
        assert!(a.enter(5, None).await.is_ok());
    }
}
