//! A streamed response's relays: one task per choice moves the engine's outputs to the
//! response body as they come, whether or not the client reads, counting the bytes that wait
//! for the body. A client that stops reading lets them pile up to a bound; past it — or past
//! the request's deadline — the request is cut: its engine requests are cancelled (their KV
//! blocks freed) without waiting for the client to read again. The request's running slot
//! (its admission [`Ticket`]) is given back as soon as its engine requests have all ended or
//! it is cut, not when a slow client has read the last byte.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvx_proto::{Output, RequestId};
use tokio::sync::Notify;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::admission::Ticket;
use crate::dispatch::Dispatcher;

/// Why a stream was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// The client left more than the bound unread.
    Unread,
    /// The request's deadline passed.
    Deadline,
}

/// Told once when a request is cut (counts it).
pub type OnCut = Box<dyn Fn(Cut) + Send + Sync>;

/// One streamed request's relays' shared state.
pub struct StreamState {
    /// Bytes relayed and not yet taken by the body.
    pending: AtomicUsize,
    bound: usize,
    /// 0, or 1 + the [`Cut`] index.
    cut: AtomicU8,
    stop: Notify,
    on_cut: OnCut,
    /// The request's running slot, until its engine requests have all ended or it is cut.
    ticket: Mutex<Option<Ticket>>,
    /// Its engine requests, and those that have ended.
    choices: usize,
    ended: AtomicUsize,
}

impl std::fmt::Debug for StreamState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamState")
            .field("pending", &self.pending)
            .field("bound", &self.bound)
            .field("cut", &self.cut())
            .finish()
    }
}

impl StreamState {
    /// A request of `choices` engine requests holding `ticket`; its relays cut it when more
    /// than `bound` bytes wait for the body (and tell `on_cut`, once).
    pub fn new(
        bound: usize,
        choices: usize,
        ticket: Option<Ticket>,
        on_cut: OnCut,
    ) -> Arc<StreamState> {
        Arc::new(StreamState {
            pending: AtomicUsize::new(0),
            bound: bound.max(1),
            cut: AtomicU8::new(0),
            stop: Notify::new(),
            on_cut,
            ticket: Mutex::new(ticket),
            choices,
            ended: AtomicUsize::new(0),
        })
    }

    fn release(&self) {
        drop(self.ticket.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// One of its engine requests ended (after the last, the running slot is released).
    pub fn choice_ended(&self) {
        if self.ended.fetch_add(1, Ordering::AcqRel) + 1 >= self.choices {
            self.release();
        }
    }

    /// Why the request was cut, if it was.
    pub fn cut(&self) -> Option<Cut> {
        match self.cut.load(Ordering::Acquire) {
            1 => Some(Cut::Unread),
            2 => Some(Cut::Deadline),
            _ => None,
        }
    }

    fn cut_for(&self, why: Cut) {
        let v = match why {
            Cut::Unread => 1,
            Cut::Deadline => 2,
        };
        if self.cut.compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.stop.notify_waiters();
            self.release();
            (self.on_cut)(why);
        }
    }

    /// The body took `o` (its bytes no longer wait).
    pub fn taken(&self, o: &Output) {
        self.pending.fetch_sub(weight(o), Ordering::Relaxed);
    }

    /// Bytes waiting for the body.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

/// About what an output weighs once written as an SSE event (its text, its tokens'
/// log-probabilities, and the event's frame).
pub fn weight(o: &Output) -> usize {
    const FRAME: usize = 160;
    match o {
        Output::Delta(d) => FRAME + d.text.len() + 96 * d.logprobs.len(),
        Output::PromptLogprobs { logprobs, .. } => FRAME + 96 * logprobs.len(),
        Output::Error { message, .. } => FRAME + message.len(),
        Output::Finished { .. } | Output::Kv(_) => FRAME,
    }
}

/// Relays engine request `id`'s outputs from `rx` to the returned receiver until the request
/// ends, the body is dropped, or the request is cut (then `id` is cancelled and the returned
/// receiver ends; [`StreamState::cut`] says why).
pub fn spawn(
    id: RequestId,
    mut rx: UnboundedReceiver<Output>,
    state: Arc<StreamState>,
    deadline: Option<Instant>,
    dispatcher: Arc<dyn Dispatcher>,
) -> UnboundedReceiver<Output> {
    // Bounded by construction: what it holds is counted, and past `bound` bytes the relay
    // stops sending.
    #[allow(clippy::disallowed_methods)]
    let (tx, out) = unbounded_channel();
    tokio::spawn(async move {
        let deadline = deadline.map(tokio::time::Instant::from_std);
        let expired = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        loop {
            // Created before the check: a cut after it still wakes this one.
            let stop = state.stop.notified();
            if state.cut().is_some() {
                break;
            }
            tokio::select! {
                biased;
                () = stop => break,
                () = &mut expired => {
                    state.cut_for(Cut::Deadline);
                    break;
                }
                () = tx.closed() => return,
                m = rx.recv() => {
                    let Some(o) = m else { return };
                    let w = weight(&o);
                    let end = matches!(o, Output::Finished { .. } | Output::Error { .. });
                    if state.pending.fetch_add(w, Ordering::Relaxed) + w > state.bound && !end {
                        state.pending.fetch_sub(w, Ordering::Relaxed);
                        state.cut_for(Cut::Unread);
                        break;
                    }
                    if end {
                        state.choice_ended();
                    }
                    if tx.send(o).is_err() || end {
                        return;
                    }
                }
            }
        }
        dispatcher.cancel(id);
    });
    out
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the engine's side of a stream, as the planes make it
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use kvx_proto::{GenerateRequest, OutputDelta};
    use tokio::sync::mpsc::UnboundedSender;

    use super::*;
    use crate::dispatch::{DispatchError, WorkerState};

    #[derive(Default)]
    struct Cancels(Mutex<Vec<RequestId>>);

    impl Dispatcher for Cancels {
        fn submit(&self, _: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError> {
            Err(DispatchError::Unavailable("none".into()))
        }
        fn cancel(&self, id: RequestId) {
            self.0.lock().unwrap().push(id);
        }
        fn ready(&self) -> bool {
            true
        }
        fn workers(&self) -> Vec<WorkerState> {
            Vec::new()
        }
    }

    fn delta(text: &str) -> Output {
        Output::Delta(OutputDelta { tokens: vec![1], text: text.into(), logprobs: Vec::new() })
    }

    type Setup = (
        UnboundedSender<Output>,
        UnboundedReceiver<Output>,
        Arc<StreamState>,
        Arc<Cancels>,
        Arc<Mutex<Vec<Cut>>>,
    );

    fn setup(bound: usize, deadline: Option<Instant>) -> Setup {
        let (tx, rx) = unbounded_channel();
        let cuts = Arc::new(Mutex::new(Vec::new()));
        let c = cuts.clone();
        let state =
            StreamState::new(bound, 1, None, Box::new(move |why| c.lock().unwrap().push(why)));
        let d = Arc::new(Cancels::default());
        let out = spawn(RequestId(7), rx, state.clone(), deadline, d.clone());
        (tx, out, state, d, cuts)
    }

    #[tokio::test]
    async fn outputs_pass_through_and_their_bytes_are_counted_until_taken() {
        let (tx, mut out, state, d, cuts) = setup(1 << 20, None);
        tx.send(delta("hello")).unwrap();
        let o = out.recv().await.unwrap();
        assert_eq!(state.pending(), weight(&o));
        state.taken(&o);
        assert_eq!(state.pending(), 0);
        tx.send(Output::Finished {
            reason: kvx_proto::FinishReason::Stop,
            usage: Default::default(),
        })
        .unwrap();
        assert!(matches!(out.recv().await, Some(Output::Finished { .. })));
        // After the end the relay is gone, with nothing cancelled or cut.
        assert!(out.recv().await.is_none());
        assert!(d.0.lock().unwrap().is_empty() && cuts.lock().unwrap().is_empty());
        assert_eq!(state.cut(), None);
    }

    #[tokio::test]
    async fn a_client_that_leaves_too_much_unread_is_cut_and_its_request_cancelled() {
        let (tx, mut out, state, d, cuts) = setup(1000, None);
        // Nothing is taken: the fourth 300-byte delta is past the bound.
        let text = "x".repeat(300 - 160);
        for _ in 0..10 {
            let _ = tx.send(delta(&text));
        }
        let mut got = 0;
        while out.recv().await.is_some() {
            got += 1;
        }
        assert_eq!(got, 3);
        assert_eq!(state.cut(), Some(Cut::Unread));
        assert_eq!(*d.0.lock().unwrap(), vec![RequestId(7)]);
        assert_eq!(*cuts.lock().unwrap(), vec![Cut::Unread]);
        // The engine's channel was dropped too.
        assert!(tx.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_cuts_a_stream_whether_or_not_the_client_reads() {
        let deadline = Instant::now() + Duration::from_secs(3);
        let (tx, mut out, state, d, cuts) = setup(1 << 20, Some(deadline));
        tx.send(delta("a")).unwrap();
        assert!(out.recv().await.is_some());
        // Nothing more comes; at the deadline the stream ends and the request is cancelled.
        assert!(out.recv().await.is_none());
        assert_eq!(state.cut(), Some(Cut::Deadline));
        assert_eq!(*d.0.lock().unwrap(), vec![RequestId(7)]);
        assert_eq!(*cuts.lock().unwrap(), vec![Cut::Deadline]);
    }

    #[tokio::test]
    async fn one_cut_stops_every_relay_of_the_request() {
        let cuts = Arc::new(Mutex::new(Vec::new()));
        let c = cuts.clone();
        let state =
            StreamState::new(1000, 2, None, Box::new(move |why| c.lock().unwrap().push(why)));
        let d = Arc::new(Cancels::default());
        let (tx1, rx1) = unbounded_channel();
        let (_tx2, rx2) = unbounded_channel();
        let mut out1 = spawn(RequestId(1), rx1, state.clone(), None, d.clone());
        let mut out2 = spawn(RequestId(2), rx2, state.clone(), None, d.clone());
        let text = "y".repeat(600);
        tx1.send(delta(&text)).unwrap();
        tx1.send(delta(&text)).unwrap();
        while out1.recv().await.is_some() {}
        // The quiet choice's relay ends too, and both engine requests are cancelled.
        assert!(out2.recv().await.is_none());
        let mut ids = d.0.lock().unwrap().clone();
        ids.sort();
        assert_eq!(ids, vec![RequestId(1), RequestId(2)]);
        assert_eq!(cuts.lock().unwrap().len(), 1);
    }
}
