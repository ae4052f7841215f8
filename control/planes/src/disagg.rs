//! Disaggregated prefill and decode, frontend side: the decision per request and the relay
//! that runs its two legs (the contract is in DESIGN.md §3).
//!
//! 1. The decode router picks the decode worker D (load, and the prefix D holds). If the
//!    prompt D lacks is shorter than `min_tokens`, or the prefill pool already queues
//!    `max_prefill_queue` tokens, D computes it itself (a local request); both are counted.
//! 2. Otherwise D gets the request with [`KvRole::AwaitKv`]: it reserves blocks for the
//!    whole prompt (reusing the prefix it caches) and answers [`KvNote::Reserved`] with the
//!    blocks that the prompt but its last token needs, or [`KvNote::Local`] when it has no
//!    room (then it computes the prompt itself).
//! 3. The prefill router picks P (prefix overlap and prefill load); P gets the prefill leg
//!    (its own id, [`RequestId::prefill_leg`]) with [`KvRole::PrefillTo`] D's blocks,
//!    computes the prompt but its last token, writes the KV straight into D's blocks
//!    through kvx-xfer and ends the leg with [`KvNote::Sent`].
//! 4. D is told the KV arrived and computes the last prompt token — its logits give the
//!    first token, so tokens and log-probabilities are those of an aggregated run — and
//!    streams the rest to the client.
//!
//! Faults: a prefill leg that fails, or a prefill worker that disappears, is placed on
//! another prefill worker (at most `max_prefill_attempts` in all); past those, past
//! `transfer_timeout` from the start of the transfer ([`KvNote::Sending`]) or past
//! `prefill_timeout` from the first placement, D is told the KV will not come and computes
//! the prompt itself (its reserved blocks stay out of use until a late write cannot land).
//! A client that goes away cancels both legs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvx_ingress::DispatchError;
use kvx_proto::{ErrorClass, GenerateRequest, KvDest, KvNote, KvRole, Output, RequestId, WorkerId};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// Frontend settings of disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggConfig {
    /// Prefill remotely only when the prompt the decode worker lacks has this many tokens.
    pub min_tokens: usize,
    /// ... and the prefill pool queues fewer prompt tokens than this.
    pub max_prefill_queue: usize,
    /// A prefill whose KV has not arrived this long after its transfer started is computed
    /// by the decode worker instead.
    pub transfer_timeout: Duration,
    /// ... and one whose prompt is not computed this long after its first placement (a
    /// prefill worker that is alive but stuck; a dead one is noticed at once).
    pub prefill_timeout: Duration,
    /// Placements of a prefill leg at most.
    pub max_prefill_attempts: u32,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            min_tokens: 256,
            max_prefill_queue: 16_384,
            transfer_timeout: Duration::from_secs(10),
            prefill_timeout: Duration::from_secs(300),
            max_prefill_attempts: 2,
        }
    }
}

/// Why a request was not prefilled remotely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// The uncached prompt is shorter than `min_tokens`.
    Short,
    /// The prefill pool is busy (or empty).
    Busy,
}

/// Counters of disaggregated serving, for `/metrics`.
#[derive(Debug, Default)]
pub struct DisaggCounters {
    /// Requests prefilled by a prefill worker.
    pub remote: AtomicU64,
    /// Requests prefilled by their decode worker: the uncached prompt was short.
    pub local_short: AtomicU64,
    /// ... the prefill pool was busy or empty.
    pub local_busy: AtomicU64,
    /// ... the decode worker had no room to reserve blocks.
    pub local_no_room: AtomicU64,
    /// ... every block was cached on the decode worker.
    pub local_cached: AtomicU64,
    /// Remote prefills that failed and were computed by the decode worker.
    pub fallbacks: AtomicU64,
    /// Prefill legs placed again after a failure.
    pub prefill_retries: AtomicU64,
    /// KV bytes moved.
    pub kv_bytes: AtomicU64,
    /// Transfers, and their total time in microseconds.
    pub transfers: AtomicU64,
    /// Sum of transfer times, microseconds.
    pub transfer_us: AtomicU64,
    /// Largest transfer time seen, microseconds.
    pub transfer_max_us: AtomicU64,
}

impl DisaggCounters {
    /// Counts a local decision.
    pub fn local(&self, why: Local) {
        match why {
            Local::Short => &self.local_short,
            Local::Busy => &self.local_busy,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// The counters as `/metrics` shows them.
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let n = g(&self.transfers);
        vec![
            ("disagg_remote_prefills_total", g(&self.remote)),
            ("disagg_local_prefills_short_total", g(&self.local_short)),
            ("disagg_local_prefills_busy_total", g(&self.local_busy)),
            ("disagg_local_prefills_no_room_total", g(&self.local_no_room)),
            ("disagg_local_prefills_cached_total", g(&self.local_cached)),
            ("disagg_fallbacks_total", g(&self.fallbacks)),
            ("disagg_prefill_retries_total", g(&self.prefill_retries)),
            ("kv_transfer_bytes_total", g(&self.kv_bytes)),
            ("kv_transfers_total", n),
            ("kv_transfer_seconds_sum", g(&self.transfer_us) / 1e6),
            ("kv_transfer_seconds_max", g(&self.transfer_max_us) / 1e6),
        ]
    }
}

/// What a plane gives the relay: its workers, seen as legs of requests.
pub trait Legs: Send + Sync + 'static {
    /// Sends `req` to worker `w`; its outputs arrive on the returned channel.
    fn submit_to(
        &self,
        w: WorkerId,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<Output>, DispatchError>;
    /// Tells decode worker `w` whether request `id`'s KV arrived; false when its queue is
    /// full (try again).
    fn kv_ready(&self, w: WorkerId, id: RequestId, arrived: bool) -> bool;
    /// Cancels request `id` on worker `w`.
    fn cancel_on(&self, w: WorkerId, id: RequestId);
    /// Picks a prefill worker for the prefill leg `leg` of `req`, not one of `exclude`, and
    /// accounts it in the prefill router.
    fn pick_prefill(
        &self,
        leg: RequestId,
        req: &GenerateRequest,
        exclude: &[WorkerId],
    ) -> Option<WorkerId>;
    /// The prefill leg `leg` ended (frees it in the prefill router).
    fn prefill_ended(&self, leg: RequestId);
    /// The request ended on its decode worker (frees it in the decode router).
    fn decode_ended(&self, id: RequestId);
    /// The counters.
    fn counters(&self) -> &DisaggCounters;
}

/// How the prefill leg of a request ended.
enum Prefill {
    /// The KV is in the decode worker's blocks.
    Sent(kvx_proto::KvTransfer),
    /// It will not come.
    Failed,
    /// The client went away.
    ClientGone,
    /// The decode leg ended first (with this output, to forward).
    DecodeEnded(Output),
}

/// Runs a disaggregated request whose decode leg (`d_rx`, on worker `decode`) was sent with
/// [`KvRole::AwaitKv`]: places its prefill leg, tells the decode worker when the KV is in,
/// and forwards the decode leg's outputs to `client`.
pub async fn relay<L: Legs>(
    legs: Arc<L>,
    cfg: DisaggConfig,
    req: GenerateRequest,
    decode: WorkerId,
    mut d_rx: UnboundedReceiver<Output>,
    client: UnboundedSender<Output>,
) {
    let id = req.id;
    let c = legs.counters();
    // 1. The decode worker's reservation.
    let first = tokio::select! {
        o = d_rx.recv() => o,
        _ = client.closed() => {
            legs.cancel_on(decode, id);
            legs.decode_ended(id);
            return;
        }
    };
    let prefill = match first {
        Some(Output::Kv(KvNote::Reserved { first_block, blocks })) if blocks.is_empty() => {
            let _ = first_block;
            c.local_cached.fetch_add(1, Ordering::Relaxed);
            tell(&*legs, decode, id, true).await;
            None
        }
        Some(Output::Kv(KvNote::Reserved { first_block, blocks })) => {
            Some(KvDest { worker: decode, first_block, blocks })
        }
        Some(Output::Kv(KvNote::Local)) => {
            c.local_no_room.fetch_add(1, Ordering::Relaxed);
            None
        }
        Some(Output::Kv(KvNote::Sent(_))) => None,
        Some(other) => {
            // The decode worker refused or ended the request at once.
            let end = !matches!(other, Output::Delta(_) | Output::PromptLogprobs { .. });
            let _ = client.send(other);
            if end {
                legs.decode_ended(id);
                return;
            }
            None
        }
        None => {
            let _ = client.send(gone(decode));
            legs.decode_ended(id);
            return;
        }
    };
    // 2. The prefill leg, while watching the decode leg and the client.
    let mut transfer_us = 0u32;
    if let Some(dest) = prefill {
        match prefill_leg(&*legs, &cfg, &req, dest, &mut d_rx, &client).await {
            Prefill::Sent(t) => {
                c.remote.fetch_add(1, Ordering::Relaxed);
                transfer_us = (t.transfer_ms * 1e3).max(1.0) as u32;
                tell(&*legs, decode, id, true).await;
            }
            Prefill::Failed => {
                c.fallbacks.fetch_add(1, Ordering::Relaxed);
                tell(&*legs, decode, id, false).await;
            }
            Prefill::ClientGone => {
                legs.cancel_on(decode, id);
                legs.decode_ended(id);
                return;
            }
            Prefill::DecodeEnded(out) => {
                let _ = client.send(out);
                legs.decode_ended(id);
                return;
            }
        }
    }
    // 3. The decode leg's stream, to the client.
    loop {
        let o = tokio::select! {
            o = d_rx.recv() => o,
            _ = client.closed() => {
                legs.cancel_on(decode, id);
                break;
            }
        };
        match o {
            Some(Output::Kv(_)) => {}
            Some(Output::Finished { reason, mut usage }) => {
                usage.kv_transfer_us = transfer_us;
                let _ = client.send(Output::Finished { reason, usage });
                break;
            }
            Some(o) => {
                let end = !matches!(o, Output::Delta(_) | Output::PromptLogprobs { .. });
                if client.send(o).is_err() {
                    legs.cancel_on(decode, id);
                    break;
                }
                if end {
                    break;
                }
            }
            None => {
                let _ = client.send(gone(decode));
                break;
            }
        }
    }
    legs.decode_ended(id);
}

/// Tells the decode worker about the KV, waiting out a full queue (a second at most; a
/// worker that stays full that long is lost to the plane anyway).
async fn tell<L: Legs>(legs: &L, w: WorkerId, id: RequestId, arrived: bool) {
    for _ in 0..1000 {
        if legs.kv_ready(w, id, arrived) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tracing::warn!(request = %id, worker = w, "the decode worker's queue stayed full");
}

fn gone(w: WorkerId) -> Output {
    Output::Error { class: ErrorClass::Unavailable, message: format!("worker {w} disappeared") }
}

/// Places the prefill leg (again after a failure, within the attempts and the timeout) and
/// waits for its KV to be sent.
async fn prefill_leg<L: Legs>(
    legs: &L,
    cfg: &DisaggConfig,
    req: &GenerateRequest,
    dest: KvDest,
    d_rx: &mut UnboundedReceiver<Output>,
    client: &UnboundedSender<Output>,
) -> Prefill {
    let leg = req.id.prefill_leg();
    let mut deadline = tokio::time::Instant::from_std(Instant::now() + cfg.prefill_timeout);
    let mut tried: Vec<WorkerId> = Vec::new();
    while tried.len() < cfg.max_prefill_attempts.max(1) as usize {
        let Some(p) = legs.pick_prefill(leg, req, &tried) else { break };
        if !tried.is_empty() {
            legs.counters().prefill_retries.fetch_add(1, Ordering::Relaxed);
        }
        tried.push(p);
        let mut p_req = req.clone();
        p_req.id = leg;
        p_req.kv = KvRole::PrefillTo(dest.clone());
        let mut p_rx = match legs.submit_to(p, p_req) {
            Ok(rx) => rx,
            Err(e) => {
                tracing::debug!(request = %req.id, prefill = p, error = %e, "prefill refused");
                legs.prefill_ended(leg);
                continue;
            }
        };
        loop {
            let o = tokio::select! {
                o = p_rx.recv() => o,
                d = d_rx.recv() => {
                    // The decode leg speaks before its KV arrived: it failed or went away.
                    legs.cancel_on(p, leg);
                    legs.prefill_ended(leg);
                    return Prefill::DecodeEnded(d.unwrap_or_else(|| gone(dest.worker)));
                }
                _ = client.closed() => {
                    legs.cancel_on(p, leg);
                    legs.prefill_ended(leg);
                    return Prefill::ClientGone;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        request = %req.id,
                        prefill = p,
                        "prefill or KV transfer timed out; computing it on the decode worker"
                    );
                    legs.cancel_on(p, leg);
                    legs.prefill_ended(leg);
                    return Prefill::Failed;
                }
            };
            match o {
                Some(Output::Kv(KvNote::Sent(t))) => {
                    let c = legs.counters();
                    c.kv_bytes.fetch_add(t.bytes, Ordering::Relaxed);
                    c.transfers.fetch_add(1, Ordering::Relaxed);
                    let us = (t.transfer_ms * 1e3) as u64;
                    c.transfer_us.fetch_add(us, Ordering::Relaxed);
                    c.transfer_max_us.fetch_max(us, Ordering::Relaxed);
                    legs.prefill_ended(leg);
                    return Prefill::Sent(t);
                }
                Some(Output::Error { message, .. }) => {
                    tracing::warn!(request = %req.id, prefill = p, %message, "prefill failed");
                    legs.prefill_ended(leg);
                    break;
                }
                None => {
                    legs.prefill_ended(leg);
                    break;
                }
                Some(Output::Kv(KvNote::Sending)) => {
                    deadline = tokio::time::Instant::now() + cfg.transfer_timeout;
                }
                Some(_) => {}
            }
        }
    }
    Prefill::Failed
}
