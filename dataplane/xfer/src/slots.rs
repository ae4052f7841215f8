//! The bounded table of in-flight transfers and the bounded notification queue.
//!
//! Each transfer occupies one slot from post to the moment both its engine has finished and
//! its handle has been dropped. A slot's whole state is one `AtomicU64`:
//! `generation << 32 | flags << 8 | state`, so that a stale handle or a stale engine job (whose
//! generation no longer matches) can never touch a reused slot, and the "who frees the slot"
//! question is settled by a single atomic read-modify-write.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::XferError;
use crate::wire::MAX_NOTIF;

const FREE: u64 = 0;
const QUEUED: u64 = 1;
const RUNNING: u64 = 2;
const DONE: u64 = 3;
const FAILED: u64 = 4;
const STATE_MASK: u64 = 0xff;
/// The handle was dropped; whoever reaches a terminal state frees the slot.
const ABANDONED: u64 = 1 << 8;
/// Cancellation was requested while running; engines check it between descriptors.
const CANCEL_REQ: u64 = 1 << 9;
/// A handle is parked waiting on this slot: completing it must wake the waiters. Completions
/// nobody waits for cost no system call.
const WAITED: u64 = 1 << 10;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct Slot {
    word: AtomicU64,
    err: Mutex<Option<XferError>>,
    /// When the transfer finished, in nanoseconds since the table was created.
    done_ns: AtomicU64,
}

/// Outcome of a transfer as seen by its handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    /// Queued or moving bytes.
    Pending,
    /// All bytes placed; the notification (if any) was sent.
    Done,
    /// Finished with an error; see [`XferError`].
    Failed(XferError),
}

/// Fixed-capacity slot table plus the condition variable completions are signalled on.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Box<[Slot]>,
    free: Mutex<Vec<u32>>,
    done: Mutex<u64>,
    cv: Condvar,
    epoch: Instant,
}

impl SlotTable {
    pub(crate) fn new(cap: usize) -> Self {
        let cap = cap.clamp(1, 1 << 20);
        SlotTable {
            slots: (0..cap)
                .map(|_| Slot {
                    word: AtomicU64::new(1 << 32),
                    err: Mutex::new(None),
                    done_ns: AtomicU64::new(0),
                })
                .collect(),
            free: Mutex::new((0..cap as u32).rev().collect()),
            done: Mutex::new(0),
            cv: Condvar::new(),
            epoch: Instant::now(),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Take a free slot and mark it queued. Returns (index, generation).
    pub(crate) fn alloc(&self) -> Option<(u32, u32)> {
        let idx = lock(&self.free).pop()?;
        let s = &self.slots[idx as usize];
        *lock(&s.err) = None;
        let seq = (s.word.load(Ordering::Acquire) >> 32) as u32;
        s.word.store(u64::from(seq) << 32 | QUEUED, Ordering::Release);
        Some((idx, seq))
    }

    fn slot(&self, idx: u32) -> Option<&Slot> {
        self.slots.get(idx as usize)
    }

    /// Engine side: move a queued slot of this generation to running. False when the slot
    /// was cancelled, or its generation moved on.
    pub(crate) fn start(&self, idx: u32, seq: u32) -> bool {
        let Some(s) = self.slot(idx) else { return false };
        s.word
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                ((w >> 32) as u32 == seq && w & STATE_MASK == QUEUED)
                    .then_some(w & !STATE_MASK | RUNNING)
            })
            .is_ok()
    }

    /// Engine side: true when cancellation was requested for this running slot.
    pub(crate) fn cancel_requested(&self, idx: u32, seq: u32) -> bool {
        self.slot(idx).is_some_and(|s| {
            let w = s.word.load(Ordering::Acquire);
            (w >> 32) as u32 == seq && w & CANCEL_REQ != 0
        })
    }

    /// Engine side: finish a queued or running slot of this generation. Frees it when the
    /// handle is already gone. Returns false when the slot was not ours (stale).
    pub(crate) fn complete(&self, idx: u32, seq: u32, res: Result<(), XferError>) -> bool {
        self.finish(idx, seq, res, false)
    }

    fn finish(&self, idx: u32, seq: u32, res: Result<(), XferError>, queued_only: bool) -> bool {
        let Some(s) = self.slot(idx) else { return false };
        let ours = |w: u64| {
            (w >> 32) as u32 == seq
                && (w & STATE_MASK == QUEUED || (!queued_only && w & STATE_MASK == RUNNING))
        };
        let mut err = lock(&s.err);
        if !ours(s.word.load(Ordering::Acquire)) {
            return false;
        }
        s.done_ns.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let new_state = match res {
            Ok(()) => DONE,
            Err(e) => {
                *err = Some(e);
                FAILED
            }
        };
        let prev = s.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            ours(w).then_some(w & !STATE_MASK | new_state)
        });
        drop(err);
        match prev {
            Ok(p) => {
                if p & ABANDONED != 0 {
                    self.free_slot(idx);
                }
                if p & WAITED != 0 {
                    self.notify();
                }
                true
            }
            Err(_) => false,
        }
    }

    fn free_slot(&self, idx: u32) {
        let s = &self.slots[idx as usize];
        let seq = (s.word.load(Ordering::Acquire) >> 32) as u32;
        s.word.store(u64::from(seq.wrapping_add(1)) << 32 | FREE, Ordering::Release);
        lock(&self.free).push(idx);
    }

    fn notify(&self) {
        let mut g = lock(&self.done);
        *g = g.wrapping_add(1);
        self.cv.notify_all();
    }

    /// Handle side: when the transfer finished (None while pending or for a stale handle).
    pub(crate) fn completed_at(&self, idx: u32, seq: u32) -> Option<Instant> {
        let s = self.slot(idx)?;
        let w = s.word.load(Ordering::Acquire);
        if (w >> 32) as u32 != seq || !matches!(w & STATE_MASK, DONE | FAILED) {
            return None;
        }
        Some(self.epoch + Duration::from_nanos(s.done_ns.load(Ordering::Relaxed)))
    }

    /// Handle side: the current status.
    pub(crate) fn status(&self, idx: u32, seq: u32) -> XferStatus {
        let Some(s) = self.slot(idx) else { return XferStatus::Failed(XferError::UnknownRemote) };
        let w = s.word.load(Ordering::SeqCst);
        if (w >> 32) as u32 != seq {
            return XferStatus::Failed(XferError::Protocol("stale transfer handle"));
        }
        match w & STATE_MASK {
            DONE => XferStatus::Done,
            FAILED => XferStatus::Failed(
                lock(&s.err).clone().unwrap_or(XferError::Protocol("failure without error")),
            ),
            _ => XferStatus::Pending,
        }
    }

    /// Handle side: block until terminal or `timeout` passes.
    pub(crate) fn wait(&self, idx: u32, seq: u32, timeout: Duration) -> XferStatus {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.status(idx, seq);
            if st != XferStatus::Pending {
                return st;
            }
            let now = Instant::now();
            if now >= deadline {
                return XferStatus::Pending;
            }
            // Mark the slot as waited on (a completion after this RMW sees the bit and wakes
            // us); then re-check under the lock the completer takes to notify.
            let Some(s) = self.slot(idx) else { return XferStatus::Pending };
            let _ = s.word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                ((w >> 32) as u32 == seq).then_some(w | WAITED)
            });
            let g = lock(&self.done);
            if self.status(idx, seq) == XferStatus::Pending {
                let _ = self.cv.wait_timeout(g, deadline - now);
            } else {
                drop(g);
            }
        }
    }

    /// Handle side: cancel. A queued transfer finishes as `Cancelled` at once (true); a running
    /// one is asked to stop at the next descriptor boundary (false; the handle reports how it
    /// really ended).
    pub(crate) fn cancel(&self, idx: u32, seq: u32) -> bool {
        let Some(s) = self.slot(idx) else { return false };
        let w = s.word.load(Ordering::Acquire);
        if (w >> 32) as u32 != seq {
            return false;
        }
        match w & STATE_MASK {
            QUEUED => {
                if self.finish(idx, seq, Err(XferError::Cancelled), true) {
                    true
                } else {
                    // Started (or finished) meanwhile: ask the running transfer to stop.
                    self.cancel(idx, seq)
                }
            }
            RUNNING => {
                let _ = s.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                    ((w >> 32) as u32 == seq && w & STATE_MASK == RUNNING).then_some(w | CANCEL_REQ)
                });
                false
            }
            _ => false,
        }
    }

    /// Handle side: the handle is gone. Frees the slot now if terminal, else leaves it to the
    /// engine.
    pub(crate) fn release(&self, idx: u32, seq: u32) {
        let Some(s) = self.slot(idx) else { return };
        let prev = s.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            ((w >> 32) as u32 == seq).then_some(w | ABANDONED)
        });
        if let Ok(p) = prev
            && matches!(p & STATE_MASK, DONE | FAILED)
        {
            self.free_slot(idx);
        }
    }

    /// Number of slots not in use (for tests and metrics).
    pub(crate) fn free_count(&self) -> usize {
        lock(&self.free).len()
    }
}

/// A notification delivered to this agent by a peer's transfer.
#[derive(Clone)]
pub struct Notif {
    /// Name of the agent that sent it.
    pub from: Arc<str>,
    len: u16,
    buf: [u8; MAX_NOTIF],
}

impl std::fmt::Debug for Notif {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notif").field("from", &self.from).field("msg", &self.msg()).finish()
    }
}

impl Notif {
    pub(crate) fn new(from: Arc<str>, msg: &[u8]) -> Notif {
        let mut n = Notif { from, len: 0, buf: [0; MAX_NOTIF] };
        let l = msg.len().min(MAX_NOTIF);
        n.buf[..l].copy_from_slice(&msg[..l]);
        n.len = l as u16;
        n
    }

    /// The message bytes.
    pub fn msg(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// A notification message carried inline with a transfer (no allocation per post).
#[derive(Clone, Copy)]
pub(crate) struct NotifBuf {
    pub(crate) len: u16,
    pub(crate) buf: [u8; MAX_NOTIF],
}

impl std::fmt::Debug for NotifBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NotifBuf({} bytes)", self.len)
    }
}

impl NotifBuf {
    pub(crate) const EMPTY: NotifBuf = NotifBuf { len: 0, buf: [0; MAX_NOTIF] };

    pub(crate) fn new(msg: &[u8]) -> Result<NotifBuf, XferError> {
        if msg.len() > MAX_NOTIF {
            return Err(XferError::Full("notification message (max 256 bytes)"));
        }
        let mut n = NotifBuf::EMPTY;
        n.buf[..msg.len()].copy_from_slice(msg);
        n.len = msg.len() as u16;
        Ok(n)
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// Bounded FIFO of received notifications. Producers get `false` when it is full and apply
/// back-pressure to their peer instead of dropping.
#[derive(Debug)]
pub(crate) struct NotifQueue {
    q: Mutex<VecDeque<Notif>>,
    cap: usize,
    cv: Condvar,
}

impl NotifQueue {
    pub(crate) fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        NotifQueue { q: Mutex::new(VecDeque::with_capacity(cap)), cap, cv: Condvar::new() }
    }

    pub(crate) fn push(&self, from: &Arc<str>, msg: &[u8]) -> bool {
        let mut q = lock(&self.q);
        if q.len() >= self.cap {
            return false;
        }
        q.push_back(Notif::new(from.clone(), msg));
        self.cv.notify_all();
        true
    }

    pub(crate) fn drain_into(&self, out: &mut Vec<Notif>) -> usize {
        let mut q = lock(&self.q);
        let n = q.len();
        out.extend(q.drain(..));
        n
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Option<Notif> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.q);
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .cv
                .wait_timeout(q, deadline - now)
                .map(|r| r.0)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_and_reuse() {
        let t = SlotTable::new(2);
        let (a, sa) = t.alloc().unwrap();
        let (b, sb) = t.alloc().unwrap();
        assert!(t.alloc().is_none(), "table is bounded");
        assert!(t.start(a, sa));
        assert!(t.complete(a, sa, Ok(())));
        assert_eq!(t.status(a, sa), XferStatus::Done);
        t.release(a, sa);
        // b: handle dropped first, engine completes later and frees.
        t.release(b, sb);
        assert_eq!(t.free_count(), 1);
        assert!(t.complete(b, sb, Err(XferError::Timeout)));
        assert_eq!(t.free_count(), 2);
        // A stale generation cannot touch the reused slot.
        let (a2, sa2) = t.alloc().unwrap();
        let (_b2, _) = t.alloc().unwrap();
        let stale = if a2 == a { sa } else { sb };
        assert_ne!(sa2, stale);
        assert!(!t.start(a2, stale));
        assert!(!t.complete(a2, stale, Ok(())));
    }

    #[test]
    fn cancel_queued_and_running() {
        let t = SlotTable::new(4);
        let (a, sa) = t.alloc().unwrap();
        assert!(t.cancel(a, sa));
        assert_eq!(t.status(a, sa), XferStatus::Failed(XferError::Cancelled));
        assert!(!t.start(a, sa), "a cancelled transfer never starts");
        let (b, sb) = t.alloc().unwrap();
        assert!(t.start(b, sb));
        assert!(!t.cancel(b, sb));
        assert!(t.cancel_requested(b, sb));
        assert_eq!(t.wait(b, sb, Duration::from_millis(1)), XferStatus::Pending);
    }

    #[test]
    fn wait_wakes_on_completion() {
        let t = Arc::new(SlotTable::new(1));
        let (a, sa) = t.alloc().unwrap();
        let t2 = t.clone();
        let th = std::thread::spawn(move || t2.wait(a, sa, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        t.complete(a, sa, Err(XferError::RemoteGone("x".into())));
        assert_eq!(th.join().unwrap(), XferStatus::Failed(XferError::RemoteGone("x".into())));
    }

    #[test]
    fn notif_queue_is_bounded() {
        let q = NotifQueue::new(2);
        let from: Arc<str> = Arc::from("p");
        assert!(q.push(&from, b"a"));
        assert!(q.push(&from, b"b"));
        assert!(!q.push(&from, b"c"));
        let mut v = Vec::new();
        assert_eq!(q.drain_into(&mut v), 2);
        assert_eq!(v[1].msg(), b"b");
    }
}
