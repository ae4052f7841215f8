//! Overload control: the admission queue in front of the router. Engine requests past the
//! server's running bound, or past its bound on the prompt tokens of requests admitted that
//! have not produced their first output (waiting in the engines or being prefilled), wait
//! here in arrival order; a newcomer is refused at once (429 with `Retry-After`) when the
//! queue is full or when its estimated wait here (the queue ahead over the rate slots have
//! been given back) is longer than the bound; one whose deadline passes while it waits leaves
//! then. Admitted requests thus keep their latency under any offered load instead of every
//! request waiting behind an ever longer queue. The starting bound (off unless set; the
//! engines' step token budget is a natural value) keeps the engines' own queues short: a
//! request admitted starts within a step or two, so the wait is here, where it is estimated
//! and bounded. Unless set, the wait bound is the recent mean time admitted requests took to
//! start, between [`AUTO_WAIT_FLOOR`] and [`AUTO_WAIT_MAX`]: a request waits here at most
//! about as long as its start then takes. The running bound may follow the engines' batch
//! knees ([`Admission::set_running_bound`]): the fewest sequences that give nearly the
//! decode throughput of all their slots, so that under overload the engines run where their
//! throughput is already had and what is past it waits here, estimated and bounded, instead
//! of lengthening every running request's steps.
//!
//! Measured and not kept: adding the engines' recent dispatch-to-first-token time to the
//! estimate (the two-second feedback lags, admissions come in waves, and both latency and
//! throughput came out worse); a two-second wait bound while arrivals still found room,
//! tightened only once nobody had for a second (under overload some arrival finds room now
//! and then, and the long waits admitted then set the tail of the time to first token); a
//! running bound that adapted to the time between tokens, lowered while it was over twice
//! its light-load value (on two CPU shards it settled at its least, four per engine, and the
//! server completed a third of the requests a second it had); the starting bound on by
//! default (with the adaptive wait bound it refused a quarter of sixteen closed-loop streams).

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
    /// When above 0, the running bound follows [`Admission::set_running_bound`] (the
    /// engines' batch knees) between this and `max_running`; a request's choices count as
    /// this many slots at most.
    pub running_floor: usize,
    /// Prompt tokens of engine requests admitted that have not produced their first output,
    /// at most (0 = no bound; a larger request runs alone); more wait here.
    pub max_starting_tokens: usize,
    /// Engine requests waiting to start at most (here, with a running or starting bound;
    /// dispatched with no output yet, without either); more are refused.
    pub max_queue: usize,
    /// Longest estimated wait for a slot a newcomer is admitted with; longer ones are refused
    /// (with a running or starting bound: without one the wait is not estimated). `None`: the
    /// recent mean time to start, between [`AUTO_WAIT_FLOOR`] and [`AUTO_WAIT_MAX`] (the
    /// latter before one is known).
    pub max_wait: Option<Duration>,
}

/// The least wait bound when it follows the time requests take to start.
pub const AUTO_WAIT_FLOOR: Duration = Duration::from_millis(250);
/// The most wait bound when it follows the time requests take to start (and the bound
/// before one is known).
pub const AUTO_WAIT_MAX: Duration = Duration::from_secs(2);

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_running: 0,
            running_floor: 0,
            max_starting_tokens: 0,
            max_queue: 1024,
            max_wait: None,
        }
    }
}

/// `--max-running`: how many engine requests may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunningBound {
    /// `0`: the serving side's sequence slots in one process, no bound in front of workers.
    #[default]
    Default,
    /// At most this many.
    Fixed(usize),
    /// `knee`: the decoding workers' batch knees (their slots until known; each at least 4
    /// or its slots), no fewer than a floor: under overload the engines run where their
    /// throughput is had and the rest wait or are refused here. Closed-loop clients above
    /// the knees wait, or are refused when their wait would be longer than the wait bound.
    Knee,
}

/// The most requests a bound that follows the knees admits in front of workers whose slots
/// are not known (a frontend before any worker reported).
pub const KNEE_CAP: usize = 1 << 16;

impl std::str::FromStr for RunningBound {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "knee" => Ok(RunningBound::Knee),
            "0" => Ok(RunningBound::Default),
            n => n
                .parse()
                .map(RunningBound::Fixed)
                .map_err(|_| format!("expected a number of requests or `knee`, not `{n}`")),
        }
    }
}

impl RunningBound {
    /// Sets `cfg`'s running bound for a serving side of `slots` sequence slots (`None`: not
    /// known, in front of workers) whose knees may be followed down to `floor`.
    pub fn apply(self, cfg: &mut AdmissionConfig, slots: Option<usize>, floor: usize) {
        let (max, fl) = match self {
            RunningBound::Default => (slots.unwrap_or(0), 0),
            RunningBound::Fixed(n) => (n, 0),
            RunningBound::Knee => (slots.unwrap_or(KNEE_CAP).max(1), floor.max(1)),
        };
        cfg.max_running = max;
        cfg.running_floor = fl.min(max);
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
    /// Prompt tokens of requests admitted and not started.
    starts: Option<Arc<Semaphore>>,
    /// Engine requests waiting for a slot here.
    queued: AtomicUsize,
    /// Their prompt tokens (as counted against the starting bound).
    queued_tokens: AtomicUsize,
    /// Engine requests dispatched that have not produced their first output.
    unstarted: AtomicUsize,
    /// How long running slots were held.
    holds: Holds,
    /// How long requests took from their starting slot to their first output.
    start_holds: Holds,
    /// The running bound now (`max_running` unless it follows the knees).
    bound: AtomicUsize,
    /// Running slots to forget as they come back: the bound was lowered below those in use.
    debt: AtomicUsize,
    /// Serializes changes of the bound.
    resize: Mutex<()>,
}

impl Admission {
    /// An admission queue with these bounds.
    pub fn new(cfg: AdmissionConfig) -> Arc<Admission> {
        let slots = (cfg.max_running > 0).then(|| Arc::new(Semaphore::new(cfg.max_running)));
        // As many permits as a semaphore holds and one acquisition takes.
        let cfg = AdmissionConfig {
            running_floor: cfg.running_floor.min(cfg.max_running),
            max_starting_tokens: cfg
                .max_starting_tokens
                .min(Semaphore::MAX_PERMITS)
                .min(u32::MAX as usize),
            ..cfg
        };
        let starts = (cfg.max_starting_tokens > 0)
            .then(|| Arc::new(Semaphore::new(cfg.max_starting_tokens)));
        Arc::new(Admission {
            cfg,
            slots,
            starts,
            queued: AtomicUsize::new(0),
            queued_tokens: AtomicUsize::new(0),
            unstarted: AtomicUsize::new(0),
            holds: Holds::default(),
            start_holds: Holds::default(),
            bound: AtomicUsize::new(cfg.max_running),
            debt: AtomicUsize::new(0),
            resize: Mutex::new(()),
        })
    }

    /// The running bound now.
    pub fn running_bound(&self) -> usize {
        self.bound.load(Ordering::Relaxed)
    }

    /// Sets the running bound to `n`, within [`AdmissionConfig::running_floor`] and
    /// [`AdmissionConfig::max_running`] (nothing without a floor): raised, the slots are free
    /// at once; lowered, free slots go at once and those in use as they come back.
    pub fn set_running_bound(&self, n: usize) {
        let Some(slots) = &self.slots else { return };
        if self.cfg.running_floor == 0 {
            return;
        }
        let n = n.clamp(self.cfg.running_floor, self.cfg.max_running);
        let _one = self.resize.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.bound.swap(n, Ordering::Relaxed);
        if n > old {
            let more = n - old;
            slots.add_permits(more - take_debt(&self.debt, more));
        } else if n < old {
            let less = old - n;
            let gone = slots.forget_permits(less);
            self.debt.fetch_add(less - gone, Ordering::Relaxed);
            // A ticket that came back between the two saw no debt and freed its slots: take
            // them now. The debt is held out while its slots are forgotten, so that no ticket
            // pays a slot that is also forgotten; what is not free yet goes back as debt.
            let owed = take_debt(&self.debt, usize::MAX);
            let gone = slots.forget_permits(owed);
            self.debt.fetch_add(owed - gone, Ordering::Relaxed);
        }
    }

    /// The bounds in force.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// Engine requests waiting here for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Engine requests waiting to start: here for a slot with a running or starting bound;
    /// dispatched with no output yet (in the engines' queues, or being prefilled) without.
    pub fn waiting(&self) -> usize {
        if self.slots.is_some() || self.starts.is_some() {
            self.queued.load(Ordering::Relaxed)
        } else {
            self.unstarted.load(Ordering::Relaxed)
        }
    }

    /// The longest estimated wait admitted now: the configured one, or the recent mean time
    /// to start, between [`AUTO_WAIT_FLOOR`] and [`AUTO_WAIT_MAX`] (the latter before one is
    /// known).
    pub fn wait_bound(&self, now: Instant) -> Duration {
        match self.cfg.max_wait {
            Some(w) => w,
            None => self.start_holds.mean(now).map_or(AUTO_WAIT_MAX, |s| {
                Duration::from_secs_f64(s.min(3600.0)).clamp(AUTO_WAIT_FLOOR, AUTO_WAIT_MAX)
            }),
        }
    }

    /// Whether `w` running slots and `t` starting tokens are free with nobody waiting.
    fn has_room(&self, w: usize, t: usize) -> bool {
        let free = |s: &Option<Arc<Semaphore>>, n: usize| {
            s.as_ref().is_none_or(|s| s.available_permits() >= n)
        };
        self.queued.load(Ordering::Relaxed) == 0 && free(&self.slots, w) && free(&self.starts, t)
    }

    /// The wait for slots `weight` engine requests with `tokens` prompt tokens arriving now
    /// would face: none while slots are free and nobody waits, else what is ahead and these
    /// over the rate full slots free at — the bound over the mean time a slot was held in the
    /// last ten seconds (Little's law: at light load the rate slots happened to free at is
    /// the arrival rate, not what the server can do), for the slower of the running slots and
    /// the starting tokens. Zero before a hold is known, and without either bound (requests
    /// then wait in the engines' queues, bounded by `max_queue` alone).
    pub fn estimated_wait(&self, now: Instant, weight: usize, tokens: usize) -> Duration {
        let (w, t) = self.weights(weight, tokens);
        if self.has_room(w, t) {
            return Duration::ZERO;
        }
        let queued = self.queued.load(Ordering::Relaxed);
        let wait = |ahead: usize, bound: usize, holds: &Holds| match bound {
            0 => 0.0,
            b => holds.mean(now).map_or(0.0, |h| ahead as f64 * h / b as f64),
        };
        let run = wait(queued + w, self.running_bound(), &self.holds);
        let queued_tokens = self.queued_tokens.load(Ordering::Relaxed);
        let start = wait(queued_tokens + t, self.cfg.max_starting_tokens, &self.start_holds);
        Duration::from_secs_f64(run.max(start).min(1e6))
    }

    /// Running slots and starting tokens `weight` engine requests of `tokens` prompt tokens
    /// take (each at least one, at most the bound).
    fn weights(&self, weight: usize, tokens: usize) -> (usize, usize) {
        let w = match (self.cfg.max_running, self.cfg.running_floor) {
            (0, _) => weight.max(1),
            (m, 0) => weight.clamp(1, m),
            // The bound may fall to the floor while this waits.
            (_, f) => weight.clamp(1, f),
        };
        let t = match self.cfg.max_starting_tokens {
            0 => tokens.max(1),
            b => tokens.clamp(1, b),
        };
        (w, t)
    }

    /// Admits `weight` engine requests (a request's choices; more than `max_running` count
    /// as `max_running`) that prefill `tokens` prompt tokens together: refused at once when the queue is full or the estimated wait is
    /// longer than the bound or than what is left until `deadline`; otherwise waits for its
    /// slots in arrival order, or until `deadline`. Dropping the future leaves the queue.
    pub async fn enter(
        self: &Arc<Self>,
        weight: usize,
        tokens: usize,
        deadline: Option<Instant>,
    ) -> Result<Ticket, Refused> {
        let now = Instant::now();
        let (w, t) = self.weights(weight, tokens);
        let wait = self.estimated_wait(now, w, t);
        if deadline.is_some_and(|d| now >= d) {
            return Err(Refused::Deadline);
        }
        if self.waiting() + w > self.cfg.max_queue.max(w) {
            return Err(Refused::QueueFull { retry_after: wait });
        }
        if wait > self.wait_bound(now) || deadline.is_some_and(|d| now + wait > d) {
            return Err(Refused::TooLong { wait });
        }
        let _queued = Queued::new(&self.queued, w);
        let _queued_tokens = Queued::new(&self.queued_tokens, t);
        // Running slots first, then starting tokens, each in arrival order (a request holding
        // starting tokens holds its running slots: no cycle).
        let permit = acquire(&self.slots, w, deadline).await?;
        let slotted = Instant::now();
        let starting = acquire(&self.starts, t, deadline).await?;
        // Every engine request starts on its own (a wide request counted as the bound too).
        let n = weight.max(1);
        self.unstarted.fetch_add(n, Ordering::Relaxed);
        Ok(Ticket {
            admission: self.clone(),
            permit,
            starting,
            unstarted: n,
            weight: n,
            slotted,
            since: Instant::now(),
        })
    }
}

/// Takes up to `most` off `debt`; returns how many.
fn take_debt(debt: &AtomicUsize, most: usize) -> usize {
    let mut taken = 0;
    let _ = debt.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
        taken = d.min(most);
        Some(d - taken)
    });
    taken
}

/// `n` permits of `slots` (none without a bound), waited for until `deadline` at most.
async fn acquire(
    slots: &Option<Arc<Semaphore>>,
    n: usize,
    deadline: Option<Instant>,
) -> Result<Option<OwnedSemaphorePermit>, Refused> {
    let Some(slots) = slots else { return Ok(None) };
    let acquire = slots.clone().acquire_many_owned(n as u32);
    let got = match deadline {
        None => acquire.await,
        Some(d) => match tokio::time::timeout_at(d.into(), acquire).await {
            Ok(got) => got,
            Err(_) => return Err(Refused::Deadline),
        },
    };
    // The semaphores are never closed.
    Ok(got.ok())
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
    /// Its starting tokens not given back (its share goes back as each engine request
    /// starts).
    starting: Option<OwnedSemaphorePermit>,
    /// Of its engine requests, those that have not started.
    unstarted: usize,
    /// Its engine requests.
    weight: usize,
    /// When it got its running slots.
    slotted: Instant,
    /// When it got its starting tokens too (all it waited for).
    since: Instant,
}

impl Ticket {
    /// One of its engine requests produced its first output.
    pub fn started(&mut self) {
        if self.unstarted > 0 {
            self.unstarted -= 1;
            self.admission.unstarted.fetch_sub(1, Ordering::Relaxed);
            // The time to start is its first engine request's (the other choices of a prompt
            // start after it by design).
            if self.unstarted + 1 == self.weight {
                let now = Instant::now();
                let secs = now.saturating_duration_since(self.since).as_secs_f64();
                self.admission.start_holds.add(now, secs);
            }
            if let Some(p) = &mut self.starting {
                // It keeps its tokens' share for the engine requests not started.
                let keep = p.num_permits() * self.unstarted / (self.unstarted + 1);
                let give = p.num_permits() - keep;
                if self.unstarted == 0 {
                    self.starting = None;
                } else if give > 0 {
                    drop(p.split(give));
                }
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let a = &self.admission;
        a.unstarted.fetch_sub(self.unstarted, Ordering::Relaxed);
        // Only a request that started says how long a slot is held (one refused by the
        // engine at once would pull the estimate towards zero).
        let Some(mut p) = self.permit.take() else { return };
        if self.unstarted < self.weight {
            let now = Instant::now();
            let held = now.saturating_duration_since(self.slotted).as_secs_f64();
            for _ in 0..p.num_permits() {
                a.holds.add(now, held);
            }
        }
        // Slots past a lowered bound do not come back.
        let owed = take_debt(&a.debt, p.num_permits());
        if owed == p.num_permits() {
            p.forget();
        } else if owed > 0
            && let Some(gone) = p.split(owed)
        {
            gone.forget();
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
            max_wait: Some(Duration::from_millis(max_wait_ms)),
            ..AdmissionConfig::default()
        })
    }

    #[tokio::test]
    async fn past_the_starting_tokens_requests_wait_until_enough_start() {
        let a = Admission::new(AdmissionConfig {
            max_running: 10,
            max_starting_tokens: 4,
            max_queue: 10,
            ..AdmissionConfig::default()
        });
        // No start known yet: the most.
        assert_eq!(a.wait_bound(Instant::now()), AUTO_WAIT_MAX);
        // Three choices of a two-token prompt hold the whole bound (six counted as four).
        let mut wide = a.enter(3, 6, None).await.unwrap();
        let a2 = a.clone();
        let next = tokio::spawn(async move { a2.enter(1, 2, None).await });
        tokio::task::yield_now().await;
        assert_eq!((a.queued(), a.queued_tokens.load(Ordering::Relaxed)), (1, 2));
        // Its first choice starts: two of its four tokens go back, and the next is in.
        wide.started();
        let mut t = next.await.unwrap().unwrap();
        assert_eq!((a.queued(), a.queued_tokens.load(Ordering::Relaxed)), (0, 0));
        // Starts that took no time make the bound the floor; starts that took 0.5 s and 1.5 s,
        // their mean; starts that took ten seconds, the most.
        assert_eq!(a.wait_bound(Instant::now()), AUTO_WAIT_FLOOR);
        let now = Instant::now();
        *a.start_holds.0.lock().unwrap() = [(now, 0.5), (now, 1.5)].into();
        assert_eq!(a.wait_bound(now), Duration::from_secs(1));
        *a.start_holds.0.lock().unwrap() = [(now, 10.0)].into();
        assert_eq!(a.wait_bound(now), AUTO_WAIT_MAX);
        // Starts of a second and three: with the four tokens taken a newcomer of two would
        // wait an estimated 2 x 2 s / 4.
        *a.start_holds.0.lock().unwrap() = [(now, 1.0), (now, 3.0)].into();
        let w = a.estimated_wait(now, 1, 2);
        assert!((w.as_secs_f64() - 1.0).abs() < 1e-9, "{w:?}");
        // One wider than the bound counts as the bound: 4 x 2 s / 4.
        let w = a.estimated_wait(now, 1, 100);
        assert!((w.as_secs_f64() - 2.0).abs() < 1e-9, "{w:?}");
        // All started: tokens free, no wait.
        t.started();
        wide.started();
        wide.started();
        assert_eq!(a.estimated_wait(Instant::now(), 1, 4), Duration::ZERO);
        assert!(a.enter(2, 4, None).await.is_ok());
    }

    #[tokio::test]
    async fn the_wait_bound_follows_starts_with_a_running_bound_alone() {
        let a = Admission::new(AdmissionConfig { max_running: 2, ..AdmissionConfig::default() });
        assert_eq!(a.wait_bound(Instant::now()), AUTO_WAIT_MAX);
        // Two choices: only the first one's start is a time to start.
        let mut t = a.enter(2, 10, None).await.unwrap();
        t.started();
        assert_eq!(a.start_holds.0.lock().unwrap().len(), 1);
        t.started();
        assert_eq!(a.start_holds.0.lock().unwrap().len(), 1);
        assert_eq!(a.wait_bound(Instant::now()), AUTO_WAIT_FLOOR);
        // A request wider than the running bound still counts each choice's start.
        drop(t);
        let mut wide = a.enter(3, 10, None).await.unwrap();
        for _ in 0..3 {
            wide.started();
        }
        assert_eq!(a.unstarted.load(Ordering::Relaxed), 0);
        drop(wide);
        assert_eq!(a.unstarted.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_running_bound_that_follows_the_knees_moves_within_its_floor_and_slots() {
        let a = Admission::new(AdmissionConfig {
            max_running: 8,
            running_floor: 2,
            max_queue: 16,
            max_wait: Some(Duration::from_secs(3600)),
            ..AdmissionConfig::default()
        });
        let free = || a.slots.as_ref().unwrap().available_permits();
        assert_eq!(a.running_bound(), 8);
        let mut held: Vec<Ticket> = Vec::new();
        for _ in 0..6 {
            held.push(a.enter(1, 1, None).await.unwrap());
        }
        // Lowered to 4 with 6 in use: the 2 free slots go at once, 2 more as they come back.
        a.set_running_bound(4);
        assert_eq!((a.running_bound(), free(), a.debt.load(Ordering::Relaxed)), (4, 0, 2));
        held.truncate(3);
        assert_eq!((free(), a.debt.load(Ordering::Relaxed)), (1, 0));
        // A newcomer takes the free one; the next waits for a slot.
        held.push(a.enter(1, 1, None).await.unwrap());
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.enter(1, 1, None).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1);
        // Raised past the slots: the slots; the waiting one gets in.
        a.set_running_bound(100);
        assert_eq!(a.running_bound(), 8);
        held.push(waiting.await.unwrap().unwrap());
        assert_eq!(free(), 3);
        // Never under the floor; a request's choices count as the floor at most.
        a.set_running_bound(0);
        assert_eq!((a.running_bound(), free(), a.debt.load(Ordering::Relaxed)), (2, 0, 3));
        held.clear();
        assert_eq!((free(), a.debt.load(Ordering::Relaxed)), (2, 0));
        let wide = a.enter(5, 1, None).await.unwrap();
        assert_eq!(free(), 0);
        drop(wide);
        // Raised while slots are owed: the debt is forgiven first.
        a.set_running_bound(4);
        held.push(a.enter(2, 1, None).await.unwrap());
        held.push(a.enter(2, 1, None).await.unwrap());
        a.set_running_bound(2);
        assert_eq!((free(), a.debt.load(Ordering::Relaxed)), (0, 2));
        a.set_running_bound(3);
        assert_eq!((free(), a.debt.load(Ordering::Relaxed)), (0, 1));
        held.clear();
        assert_eq!((free(), a.debt.load(Ordering::Relaxed)), (3, 0));
    }

    #[test]
    fn the_running_bound_flag_reads_numbers_and_knee() {
        let parse = |s: &str| s.parse::<RunningBound>();
        assert_eq!(parse("0"), Ok(RunningBound::Default));
        assert_eq!(parse("16"), Ok(RunningBound::Fixed(16)));
        assert_eq!(parse("knee"), Ok(RunningBound::Knee));
        assert!(parse("-1").unwrap_err().contains("`knee`"));
        let with = |b: RunningBound, slots, floor| {
            let mut c = AdmissionConfig::default();
            b.apply(&mut c, slots, floor);
            (c.max_running, c.running_floor)
        };
        assert_eq!(with(RunningBound::Default, Some(128), 8), (128, 0));
        assert_eq!(with(RunningBound::Default, None, 8), (0, 0));
        assert_eq!(with(RunningBound::Fixed(16), Some(128), 8), (16, 0));
        assert_eq!(with(RunningBound::Knee, Some(128), 8), (128, 8));
        assert_eq!(with(RunningBound::Knee, None, 4), (KNEE_CAP, 4));
        assert_eq!(with(RunningBound::Knee, Some(2), 8), (2, 2));
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
        assert_eq!(a.estimated_wait(Instant::now(), 1, 1), Duration::ZERO);
        let mut t = a.enter(1, 1, None).await.unwrap();
        let _u = a.enter(1, 1, None).await.unwrap();
        // Two dispatched, not started: the queue is full.
        assert_eq!(a.waiting(), 2);
        assert!(matches!(a.enter(1, 1, None).await, Err(Refused::QueueFull { .. })));
        // One starts: room again.
        t.started();
        assert_eq!(a.waiting(), 1);
        assert!(a.enter(1, 1, None).await.is_ok());
    }

    #[tokio::test]
    async fn with_a_running_bound_the_wait_is_the_queue_over_the_rate_full_slots_free_at() {
        let a = adm(2, 100, 1000);
        let t0 = Instant::now();
        // Free slots and nobody waiting: no wait, whatever the rate.
        assert_eq!(a.estimated_wait(t0, 1, 1), Duration::ZERO);
        let _t1 = a.enter(1, 1, None).await.unwrap();
        let _t2 = a.enter(1, 1, None).await.unwrap();
        // Full, no rate yet: admitted to wait.
        assert_eq!(a.estimated_wait(t0, 1, 1), Duration::ZERO);
        // Slots held 0.5 s each, two of them: they free at 4 a second; the first in line
        // waits 0.25 s, the fifth 1.25 s.
        a.holds.add(t0, 0.4);
        a.holds.add(t0, 0.6);
        let w1 = a.estimated_wait(Instant::now(), 1, 1);
        assert!((w1.as_secs_f64() - 0.25).abs() < 1e-9, "{w1:?}");
        a.queued.fetch_add(4, Ordering::Relaxed);
        let w5 = a.estimated_wait(Instant::now(), 1, 1);
        assert!((w5.as_secs_f64() - 1.25).abs() < 1e-9, "{w5:?}");
        assert!(matches!(a.enter(1, 1, None).await, Err(Refused::TooLong { .. })));
        a.queued.fetch_sub(4, Ordering::Relaxed);
    }

    #[tokio::test]
    async fn a_deadline_already_past_is_a_deadline_and_only_started_requests_count_as_holds() {
        let a = adm(1, 10, 60_000);
        let past = Instant::now() - Duration::from_millis(1);
        assert_eq!(a.enter(1, 1, Some(past)).await.err(), Some(Refused::Deadline));
        // A request refused by the engine before it started holds its slot for no time: it
        // is not counted.
        drop(a.enter(1, 1, None).await.unwrap());
        assert_eq!(a.holds.mean(Instant::now()), None);
        let mut t = a.enter(1, 1, None).await.unwrap();
        t.started();
        drop(t);
        assert!(a.holds.mean(Instant::now()).is_some());
    }

    #[tokio::test]
    async fn the_queue_is_bounded() {
        let a = adm(0, 3, 60_000);
        let t1 = a.enter(2, 1, None).await.unwrap();
        let _t2 = a.enter(1, 1, None).await.unwrap();
        assert!(matches!(a.enter(1, 1, None).await, Err(Refused::QueueFull { .. })));
        drop(t1);
        assert!(a.enter(2, 1, None).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn requests_past_the_running_bound_wait_in_order_until_their_deadline() {
        let a = adm(2, 10, 60_000);
        let mut first = a.enter(2, 1, None).await.unwrap();
        first.started();
        // Past the bound: the next waits (and counts as queued) until a slot frees.
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.enter(1, 1, None).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1);
        // One with a deadline leaves at it, and leaves the queue.
        let d = Instant::now() + Duration::from_millis(200);
        let r = a.enter(1, 1, Some(d)).await;
        assert_eq!(r.err(), Some(Refused::Deadline));
        assert_eq!(a.queued(), 1);
        drop(first);
        waiting.await.unwrap().unwrap();
        assert_eq!(a.queued(), 0);
        // Given-back slots are counted for the estimate.
        assert!(a.holds.mean(Instant::now()).is_some());
        // A waiting request whose client went away leaves the queue too.
        let held = a.enter(2, 1, None).await.unwrap();
        let a3 = a.clone();
        let gone = tokio::spawn(async move { a3.enter(1, 1, None).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(a.queued(), 0);
        drop(held);
        // A request wider than the bound runs alone.
        assert!(a.enter(5, 1, None).await.is_ok());
    }
}
