//! `kvx configure --profile`: the layouts a host's cores allow — aggregated workers, or a
//! prefill and a decode pool — each predicted from worker profiles over a range of
//! concurrencies; their Pareto front of output tokens per second per core against tokens per
//! second per user; and the best layout whose predicted TTFT and ITL p90 meet the targets,
//! each layout reported at its knee (the fewest users within [`KNEE`] of its most).
//!
//! The load is a closed loop, as `kvx bench --concurrency C` drives it: C users, each sending
//! its next request when its last one ends. A worker's time is its profile's:
//!
//! * a step that decodes `b` sequences of context `c` takes the profile's ITL at (b, c); a
//!   prompt's prefill (or a chunk of it: the shape's batched tokens less the `b` decoded
//!   beside it) adds its idle TTFT to the step it runs in; the last prompt token, which a
//!   disaggregated decode worker computes itself, adds the idle TTFT of the shortest
//!   profiled prompt (a step of its own on the mocker; an overestimate on the real engine,
//!   where a token more in a decode step costs little);
//! * sequences decoding on a worker follow Little's law (arrivals × output tokens × mean
//!   ITL); while a user decodes, its worker takes every other user's prompt once per cycle
//!   ((C − 1) / workers of them), each in a step (or a chunk's steps) of the user's window:
//!   the mean ITL is the decode step plus that work over the window's steps (what exceeds
//!   one per step falls in the user's wait for its own prompt); the median and 90th
//!   percentile are a pure decode step unless more than half (a tenth) of the steps carry
//!   a prompt;
//! * a prompt queues for its prefill worker among the C / P users it serves, each away for
//!   the rest of its cycle between prompts: the mean wait by mean value analysis of that
//!   closed loop; a prompt waits with probability ρ, for an exponential time (the
//!   quantiles). An aggregated worker's users decode in the steps that compute the others'
//!   prompts, so the prompts take turns: its median prompt waits only for the excess above
//!   and, once the worker saturates, for what the cycle then holds (Little's law); the
//!   queue's wait stays in its 90th percentile. TTFT adds
//!   the steps in progress at each hand-off (aggregated: one; disaggregated: the decode
//!   worker's, when it reserves the request's blocks and when their KV has arrived) and the
//!   step
//!   that gives the first token, each carrying the decode of the other users' sequences on
//!   that worker (none when no other user is decoding there);
//! * throughput is C over the time a request takes (TTFT + (OSL − 1) × mean ITL), at most
//!   what the prefill workers compute; that rate falls as the rate assumed rises, so the
//!   fixed point is found by bisection;
//! * in a closed loop every user holds a sequence slot all the time (an aggregated worker's
//!   from admission, a decode worker's from the blocks it reserves before the prompt is
//!   computed elsewhere): concurrencies go up to the slots the layout's KV caches hold.
//!
//! A disaggregated TTFT adds the prompt's KV transfer: its bytes (the profile's KV bytes per
//! token) over the link's bandwidth, plus 0.2 ms.
//!
//! Not modelled: prompts batched together on a prefill worker (they are cheaper than one
//! by one, so TTFT is overestimated under load), and CPU time the frontend and clients take
//! from the workers.

use std::fmt::Write as _;

use kvx_proto::profile::Profile;
use serde::Serialize;

use crate::configure::{ConfigureError, Setting};

/// What the layouts are sized for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    /// Prompt tokens per request.
    pub isl: f64,
    /// Output tokens per request.
    pub osl: f64,
    /// TTFT target, 90th percentile, milliseconds.
    pub ttft_ms: f64,
    /// ITL target, 90th percentile, milliseconds.
    pub itl_ms: f64,
    /// Bytes per second a prompt's KV moves at from a prefill to a decode worker (with the
    /// profile's KV bytes per token, the transfer time a disaggregated TTFT adds).
    pub link_bytes_per_s: f64,
}

/// How far below its most throughput a layout's operating point may sit: the search reports
/// the fewest users within this share of the most (a closed loop's throughput flattens long
/// before its latency stops growing).
pub const KNEE: f64 = 0.05;

/// The most workers of one kind a search puts in a layout.
pub const MAX_WORKERS: u32 = 128;

/// The fixed cost of one KV transfer, milliseconds (the mock engines' transfer model).
const TRANSFER_LATENCY_MS: f64 = 0.2;

/// A worker shape: its profile, and the cores one worker of it computes on.
#[derive(Debug, Clone)]
pub struct WorkerKind {
    /// Where the profile came from (for the report and the settings written).
    pub name: String,
    /// The profile.
    pub profile: Profile,
    /// Cores of one worker (shards × threads per shard of the profiled shape).
    pub cores: u32,
}

impl WorkerKind {
    /// A kind from its profile (refused when the profile is not usable).
    pub fn new(name: String, profile: Profile) -> Result<Self, ConfigureError> {
        profile.validate().map_err(|e| ConfigureError::Invalid(format!("{name}: {e}")))?;
        let s = &profile.shape;
        let cores = s.shards.max(1).saturating_mul(s.threads_per_shard.max(1));
        Ok(WorkerKind { name, profile, cores })
    }
}

/// A layout: its worker counts and the kind of its workers (an index into the kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Layout {
    /// Workers that prefill and decode their own requests.
    Agg {
        /// Workers.
        workers: u32,
        /// Their kind.
        kind: usize,
    },
    /// A prefill pool and a decode pool of one kind.
    Disagg {
        /// Prefill workers.
        prefill: u32,
        /// Decode workers.
        decode: u32,
        /// Their kind.
        kind: usize,
    },
}

impl Layout {
    /// Its kind.
    pub fn kind(self) -> usize {
        match self {
            Layout::Agg { kind, .. } | Layout::Disagg { kind, .. } => kind,
        }
    }

    /// Its workers.
    pub fn workers(self) -> u32 {
        match self {
            Layout::Agg { workers, .. } => workers,
            Layout::Disagg { prefill, decode, .. } => prefill + decode,
        }
    }

    /// One line: `agg 4 × K` or `disagg 1 prefill + 3 decode × K` (K: the profile's file
    /// name without its directory and `.json`).
    pub fn describe(self, kinds: &[WorkerKind]) -> String {
        let k = kinds.get(self.kind()).map_or("?", |k| {
            let base = k.name.rsplit('/').next().unwrap_or(&k.name);
            base.strip_suffix(".json").unwrap_or(base)
        });
        match self {
            Layout::Agg { workers, .. } => format!("agg {workers} × {k}"),
            Layout::Disagg { prefill, decode, .. } => {
                format!("disagg {prefill} prefill + {decode} decode × {k}")
            }
        }
    }
}

/// What a layout is predicted to give at one concurrency (all zero for a layout whose kind
/// is not among the kinds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Prediction {
    /// Users in the closed loop.
    pub concurrency: u32,
    /// Requests completed per second.
    pub requests_per_s: f64,
    /// Output tokens per second, all workers.
    pub tok_s: f64,
    /// Output tokens per second per core.
    pub tok_s_per_core: f64,
    /// Output tokens per second each user sees (1 / median ITL).
    pub tok_s_per_user: f64,
    /// TTFT median, milliseconds.
    pub ttft_p50_ms: f64,
    /// TTFT 90th percentile.
    pub ttft_p90_ms: f64,
    /// ITL median.
    pub itl_p50_ms: f64,
    /// ITL 90th percentile.
    pub itl_p90_ms: f64,
    /// Sequences each decoding worker holds.
    pub batch: f64,
    /// Whether both p90s meet the targets.
    pub meets: bool,
}

/// The mean time a prompt waits for its prefill worker when `users` users of a closed loop
/// share it, each away `away_ms` between its prompts (decoding, and the rest of its cycle),
/// a prompt taking `s` ms: mean value analysis of one queue and one delay, exact for
/// exponential times (deterministic prefills wait somewhat less). A closed loop's users are
/// paced by their own requests, so they queue far less than Poisson arrivals at the same
/// utilisation would.
fn closed_wait_ms(users: f64, s: f64, away_ms: f64) -> f64 {
    let n = users.round().clamp(1.0, 1e5) as u32;
    let (mut q, mut r) = (0.0, s);
    for k in 1..=n {
        r = s * (1.0 + q);
        q = f64::from(k) / (r + away_ms) * r;
    }
    (r - s).max(0.0)
}

/// The wait a share `q` of prompts stays within, for a mean wait `mean` at utilisation
/// `rho`: a prompt waits with probability ρ, for an exponential time of mean `mean` / ρ.
fn wait_quantile_ms(mean: f64, rho: f64, q: f64) -> f64 {
    let rho = rho.clamp(0.0, 1.0);
    let tail = 1.0 - q;
    if rho <= tail || mean <= 0.0 {
        return 0.0;
    }
    mean / rho * (rho / tail).ln()
}

/// The most users a layout's KV caches hold at once (every one a sequence of ISL + OSL). In
/// a closed loop every user holds a sequence on a decoding worker all the time: an
/// aggregated worker's from admission to the end, a decode worker's from the blocks it
/// reserves before the prompt is prefilled elsewhere; past this, requests wait for a slot.
pub fn max_concurrency(layout: Layout, kinds: &[WorkerKind], w: &Workload) -> u32 {
    let Some(k) = kinds.get(layout.kind()) else { return 0 };
    let slots = k.profile.max_batch(w.isl + w.osl).max(0.0) as u32;
    match layout {
        Layout::Agg { workers, .. } => workers.saturating_mul(slots),
        Layout::Disagg { decode, .. } => decode.saturating_mul(slots),
    }
}

/// What `layout` gives `concurrency` users of workload `w`.
pub fn predict(layout: Layout, kinds: &[WorkerKind], w: &Workload, concurrency: u32) -> Prediction {
    let Some(k) = kinds.get(layout.kind()) else { return Prediction::default() };
    let p = &k.profile;
    let c = f64::from(concurrency.max(1));
    let ctx = w.isl + w.osl / 2.0;
    let steps = (w.osl - 1.0).max(0.0);
    let cores = f64::from(layout.workers().saturating_mul(k.cores).max(1));
    let (decoders, prefillers) = match layout {
        Layout::Agg { workers, .. } => (f64::from(workers.max(1)), f64::from(workers.max(1))),
        Layout::Disagg { prefill, decode, .. } => {
            (f64::from(decode.max(1)), f64::from(prefill.max(1)))
        }
    };
    // A prompt's prefill: on an aggregated worker in chunks of the shape's batched tokens,
    // each in a step that also decodes; on a prefill worker the prompt but its last token,
    // whose step the decode worker runs.
    let mbt = f64::from(p.shape.max_batched_tokens.max(1));
    // An aggregated worker's step takes a chunk of the prompt beside a token of each
    // sequence it decodes: the prompt's chunks (count, and time of each) at a batch.
    let chunking = |batch: f64| match layout {
        Layout::Agg { .. } => {
            let n = (w.isl / (mbt - batch).max(1.0)).ceil().max(1.0);
            (n, p.ttft_ms(w.isl / n))
        }
        Layout::Disagg { .. } => (1.0, p.ttft_ms((w.isl - 1.0).max(1.0))),
    };
    let last_ms = match layout {
        Layout::Agg { .. } => 0.0,
        Layout::Disagg { .. } => p.ttft_ms(1.0),
    };
    let transfer_ms = match layout {
        Layout::Agg { .. } => 0.0,
        Layout::Disagg { .. } => {
            (w.isl - 1.0).max(1.0) * p.shape.kv_bytes_per_token as f64 / w.link_bytes_per_s.max(1.0)
                * 1e3
                + TRANSFER_LATENCY_MS
        }
    };
    let max_batch = p.max_batch(w.isl + w.osl).max(1.0);
    // What `x` requests per second would give, and the rate that gives back (C over the
    // cycle a request then takes, at most what the prefill workers compute). The rate given
    // back falls as `x` grows, so the fixed point is found by bisection.
    let eval = |x: f64| -> (Prediction, f64) {
        let per_decoder = x / decoders;
        // While a user decodes its `steps` tokens, its worker takes every other user's
        // prompt of the closed loop once ((C − 1) / workers of them: an aggregated worker's
        // in chunks that share steps with the decoding, a decode worker's as the step of each
        // prompt's last token); those are the longer steps of the user's window. (Counting
        // them per cycle, not as a share of all the worker's time, matters: the others'
        // prompts fall in the user's decoding, not in its own prefill. Measured on two real
        // aggregated layouts: throughput over-predicted by 1.26–1.37× by the share, 1.15–1.18×
        // so.) The sequences decoding on the worker follow by Little's law at that ITL.
        let prompt_work = |batch: f64| {
            let (chunks, chunk_ms) = chunking(batch);
            let (extra_ms, per_prompt) = match layout {
                Layout::Agg { .. } => (chunk_ms, chunks),
                Layout::Disagg { .. } => (last_ms, 1.0),
            };
            (chunks, chunk_ms, extra_ms, (c - 1.0) / decoders * per_prompt)
        };
        // At most one prompt step per step of the user's window; the rest fall in its wait.
        let mean_of =
            |td: f64, work: &(f64, f64, f64, f64)| td + work.3.min(steps) * work.2 / steps.max(1.0);
        let mut batch = 1.0;
        let mut work = prompt_work(batch);
        let mut td = p.itl_ms(1.0, ctx).max(1e-3);
        let mut mean = mean_of(td, &work);
        for _ in 0..64 {
            batch = (per_decoder * steps * mean / 1e3).clamp(1.0, max_batch);
            work = prompt_work(batch);
            td = p.itl_ms(batch, ctx).max(1e-3);
            let next = mean_of(td, &work);
            if (next - mean).abs() < 1e-6 * mean {
                break;
            }
            mean = next;
        }
        let (chunks, chunk_ms, extra_ms, per_cycle) = work;
        // The share of the user's steps that carry another prompt's work, and the prompt
        // steps past one per step of its window (taken while its own prompt waits).
        let with_prompt = (per_cycle / steps.max(1.0)).min(1.0);
        let over = (per_cycle - steps).max(0.0);
        let itl_q = |q: f64| if with_prompt > 1.0 - q { td + extra_ms } else { td };
        // The other users' sequences decoding on the worker a new prompt's step runs on:
        // with none, that step carries no decode (one user alone never waits for itself).
        let decoding = (x * steps * mean / 1e3 / c).clamp(0.0, 1.0);
        let others = ((c - 1.0) / decoders * decoding).clamp(0.0, max_batch);
        let busy = others.min(1.0);
        let t_others = p.itl_ms(others.max(1.0), ctx);
        // The prefill queue.
        let service = match layout {
            Layout::Agg { .. } => chunks * (chunk_ms + busy * t_others),
            Layout::Disagg { .. } => chunk_ms,
        }
        .max(1e-3);
        let rho = x / prefillers * service / 1e3;
        let first = match layout {
            // The step in progress, then the prompt's steps.
            Layout::Agg { .. } => busy * t_others / 2.0 + service,
            // The prompt on the prefill worker, its KV's transfer, and three steps of the
            // decode worker: the one in progress when the request's blocks are reserved (half
            // a step on average), the one in progress when the KV has arrived (another half),
            // and the one that computes the last prompt token.
            Layout::Disagg { .. } => service + transfer_ms + last_ms + busy * 2.0 * t_others,
        };
        let wait = closed_wait_ms(c / prefillers, service, first - service + steps * mean);
        // An aggregated worker's users decode in the steps that compute the others' prompts:
        // a user's next prompt comes a set number of steps after its last, so the prompts
        // fall into a round robin and the typical one waits for none (measured: TTFT p50 at
        // 8 users of one worker within 15% of a prompt alone, where the queue of exponential
        // times gave 1.8×). A disaggregated prefill worker's arrivals come from another
        // worker's clock and queue. Lengths that vary break the round now and then: the
        // queue's wait stays in the 90th percentile.
        let typical = match layout {
            Layout::Agg { .. } => over * (extra_ms + td),
            Layout::Disagg { .. } => wait,
        };
        let cycle_ms = first + typical + steps * mean;
        // No more prompts than the prefill workers compute.
        let most = prefillers * 1e3 / service;
        let back = (c / (cycle_ms.max(1e-3) / 1e3)).min(most);
        // Past what the prefill workers compute, the users' cycle is C / rate (Little's law):
        // what it holds beyond the prompt and the decoding is waiting.
        let saturated = (c / x.max(1e-9) * 1e3 - first - steps * mean).max(0.0);
        let (typical, wait) = (typical.max(saturated), wait.max(saturated));
        let ttft_p50_ms = first
            + match layout {
                Layout::Agg { .. } => typical,
                Layout::Disagg { .. } => wait_quantile_ms(wait, rho, 0.5),
            };
        let pred = Prediction {
            concurrency: concurrency.max(1),
            requests_per_s: x,
            tok_s: x * w.osl,
            tok_s_per_core: x * w.osl / cores,
            tok_s_per_user: 1e3 / itl_q(0.5),
            ttft_p50_ms,
            ttft_p90_ms: (first + wait_quantile_ms(wait, rho, 0.9)).max(ttft_p50_ms),
            itl_p50_ms: itl_q(0.5),
            itl_p90_ms: itl_q(0.9),
            batch,
            meets: false,
        };
        (pred, back)
    };
    // Above any rate: C over a cycle of the idle TTFT and steps of one sequence, doubled (a
    // profile's batch of two may step faster than its one, by noise).
    let idle_cycle = (p.ttft_ms(w.isl) + steps * p.itl_ms(1.0, ctx)).max(1e-3);
    let (mut lo, mut hi) = (0.0, 2.0 * c / (idle_cycle / 1e3));
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if eval(mid).1 > mid {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut out = eval(lo).0;
    out.meets = out.ttft_p90_ms <= w.ttft_ms && out.itl_p90_ms <= w.itl_ms;
    out
}

/// Concurrencies tried per layout: 1, 2, 3, 4, 6, 8, 12, 16, … up to `max`, and `max`.
fn concurrencies(max: u32) -> Vec<u32> {
    let mut v = Vec::new();
    let mut a = 1u32;
    while a <= max {
        v.push(a);
        let b = a + a / 2;
        if b > a && b <= max && b != a * 2 {
            v.push(b);
        }
        a = a.saturating_mul(2);
        if a == 0 {
            break;
        }
    }
    if max > 0 && v.last() != Some(&max) {
        v.push(max);
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// One layout at one concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// The layout.
    pub layout: Layout,
    /// What it is predicted to give.
    pub prediction: Prediction,
}

/// Every layout the cores allow, predicted.
#[derive(Debug, Clone)]
pub struct Search {
    /// The kinds of worker.
    pub kinds: Vec<WorkerKind>,
    /// The workload.
    pub workload: Workload,
    /// Cores per host and hosts.
    pub cores: u32,
    /// Hosts.
    pub hosts: u32,
    /// Every (layout, concurrency) predicted.
    pub points: Vec<Point>,
    /// Indices into `points` of the Pareto front (tokens/s per core against per user), by
    /// per-user speed, fastest first.
    pub front: Vec<usize>,
    /// For each layout, its knee (the fewest users within [`KNEE`] of the most throughput
    /// it gives within the targets), best layout first (the most output tokens per second
    /// it gives within the targets, then per core, then fewer workers).
    pub ranked: Vec<usize>,
}

impl Search {
    /// The best point that meets the targets.
    pub fn best(&self) -> Option<&Point> {
        self.ranked.first().map(|&i| &self.points[i])
    }
}

/// Enumerates the layouts of `kinds` on `hosts` hosts of `cores` cores (a worker runs on one
/// host; the pools' workers fill the hosts' cores), predicts each at its concurrencies and
/// ranks them.
pub fn search(
    kinds: Vec<WorkerKind>,
    workload: Workload,
    cores: u32,
    hosts: u32,
) -> Result<Search, ConfigureError> {
    let bad = |m: String| Err(ConfigureError::Invalid(m));
    if kinds.is_empty() {
        return bad("no profile given".into());
    }
    let w = workload;
    if !(w.isl >= 1.0 && w.osl >= 1.0 && w.isl.is_finite() && w.osl.is_finite()) {
        return bad("--isl and --osl must be at least 1".into());
    }
    if !(w.ttft_ms > 0.0 && w.itl_ms > 0.0 && w.ttft_ms.is_finite() && w.itl_ms.is_finite()) {
        return bad("the TTFT and ITL targets must be positive".into());
    }
    if !(w.link_bytes_per_s > 0.0 && w.link_bytes_per_s.is_finite()) {
        return bad("the KV link's bandwidth must be positive".into());
    }
    if cores == 0 || hosts == 0 {
        return bad("--cores and --hosts must be at least 1".into());
    }
    let model = &kinds[0].profile.shape.model;
    if let Some(k) = kinds.iter().find(|k| &k.profile.shape.model != model) {
        return bad(format!(
            "{} profiles {}, not {model}: one search is over one model in one arithmetic",
            k.name, k.profile.shape.model
        ));
    }
    let mut layouts = Vec::new();
    for (i, k) in kinds.iter().enumerate() {
        if k.cores > cores || k.profile.max_batch(w.isl + w.osl) < 1.0 {
            continue;
        }
        // Workers of this kind a host holds, and so the whole fleet (at most
        // `MAX_WORKERS`: the disaggregated layouts grow as its square).
        let total = (cores / k.cores).saturating_mul(hosts).min(MAX_WORKERS);
        for n in 1..=total {
            layouts.push(Layout::Agg { workers: n, kind: i });
        }
        for p in 1..total {
            for d in 1..=total - p {
                layouts.push(Layout::Disagg { prefill: p, decode: d, kind: i });
            }
        }
    }
    if layouts.is_empty() {
        return bad(format!(
            "no profiled worker fits: each needs more than the {cores} cores of a host, or a \
             sequence of {:.0} tokens (ISL + OSL) does not fit in its KV cache",
            w.isl + w.osl
        ));
    }
    let mut points: Vec<Point> = Vec::new();
    let mut tops: Vec<(usize, f64)> = Vec::new();
    for layout in layouts {
        let max = max_concurrency(layout, &kinds, &w);
        let first = points.len();
        let mut most = 0.0f64;
        for c in concurrencies(max) {
            let prediction = predict(layout, &kinds, &w, c);
            if prediction.meets {
                most = most.max(prediction.tok_s);
            }
            points.push(Point { layout, prediction });
        }
        // The layout's knee: the fewest users within `KNEE` of the most throughput it gives
        // within the targets (past it, users add latency, not throughput).
        let knee = (first..points.len()).find(|&i| {
            let p = &points[i].prediction;
            p.meets && p.tok_s >= most * (1.0 - KNEE)
        });
        tops.extend(knee.map(|i| (i, most)));
    }
    // Layouts ranked by their most (where their knee lands on the grid of users is not the
    // layout's worth), then by the most per core, then fewer workers.
    tops.sort_by(|&(a, ma), &(b, mb)| {
        let (wa, wb) =
            (f64::from(points[a].layout.workers()), f64::from(points[b].layout.workers()));
        let cores = |i: usize| f64::from(kinds[points[i].layout.kind()].cores);
        (mb.total_cmp(&ma))
            .then((mb / (wb * cores(b))).total_cmp(&(ma / (wa * cores(a)))))
            .then(points[a].layout.workers().cmp(&points[b].layout.workers()))
    });
    let ranked: Vec<usize> = tops.into_iter().map(|(i, _)| i).collect();
    // The front: by per-user speed, fastest first, each point with more throughput per core
    // than every faster one (by more than 1%: layouts that differ only in how many workers
    // share the load sit on the same spot).
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| {
        let (pa, pb) = (&points[a].prediction, &points[b].prediction);
        pb.tok_s_per_user
            .total_cmp(&pa.tok_s_per_user)
            .then(pb.tok_s_per_core.total_cmp(&pa.tok_s_per_core))
    });
    let mut front = Vec::new();
    let mut most = f64::NEG_INFINITY;
    for i in order {
        let v = points[i].prediction.tok_s_per_core;
        if v > most * 1.01 {
            front.push(i);
            most = v;
        }
    }
    Ok(Search { kinds, workload, cores, hosts, points, front, ranked })
}

impl Search {
    /// The report: the workload, the Pareto front, the layouts that meet the targets (at
    /// most `top`), the best, and how to measure it.
    pub fn report(&self, top: usize) -> String {
        let w = &self.workload;
        let mut s = format!(
            "{} layouts × concurrencies predicted for ISL {:.0} / OSL {:.0} on {} host(s) of {} cores; targets TTFT p90 ≤ {:.0} ms, ITL p90 ≤ {:.1} ms\n",
            self.points.len(),
            w.isl,
            w.osl,
            self.hosts,
            self.cores,
            w.ttft_ms,
            w.itl_ms
        );
        for k in &self.kinds {
            let sh = &k.profile.shape;
            let _ = writeln!(
                s,
                "  {}: {} engine, {} shard(s) × {} thread(s), {} KV blocks of {}, {} batched tokens ({}; {})",
                k.name,
                sh.engine,
                sh.shards,
                sh.threads_per_shard,
                sh.kv_blocks,
                sh.block_size,
                sh.max_batched_tokens,
                sh.simd,
                sh.cpu
            );
        }
        let header = format!(
            "  {:<34} {:>5} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8}\n",
            "layout",
            "users",
            "tok/s",
            "tok/s/core",
            "tok/s/user",
            "TTFT p50",
            "TTFT p90",
            "ITL p50",
            "ITL p90"
        );
        let row = |s: &mut String, p: &Point| {
            let q = &p.prediction;
            let _ = writeln!(
                s,
                "  {:<34} {:>5} {:>9.0} {:>10.1} {:>10.1} {:>9.0} {:>9.0} {:>8.1} {:>8.1}{}",
                p.layout.describe(&self.kinds),
                q.concurrency,
                q.tok_s,
                q.tok_s_per_core,
                q.tok_s_per_user,
                q.ttft_p50_ms,
                q.ttft_p90_ms,
                q.itl_p50_ms,
                q.itl_p90_ms,
                if q.meets { "" } else { "  (misses)" }
            );
        };
        let _ = writeln!(s, "\nPareto front (tokens/s per core against tokens/s per user):");
        s.push_str(&header);
        for &i in &self.front {
            row(&mut s, &self.points[i]);
        }
        let _ = writeln!(
            s,
            "\nLayouts meeting the targets ({} of them; each at its knee: the fewest users within \
             {:.0}% of its most throughput; best first):",
            self.ranked.len(),
            KNEE * 100.0
        );
        s.push_str(&header);
        for &i in self.ranked.iter().take(top) {
            row(&mut s, &self.points[i]);
        }
        match self.best() {
            Some(b) => {
                let _ = writeln!(
                    s,
                    "\nBest: {} at {} users; measure it with: kvx bench --concurrency {} --input-tokens {:.0} --output-tokens {:.0} --ignore-eos",
                    b.layout.describe(&self.kinds),
                    b.prediction.concurrency,
                    b.prediction.concurrency,
                    w.isl,
                    w.osl
                );
            }
            None => {
                let _ = writeln!(s, "\nNo layout meets the targets on these cores.");
            }
        }
        s
    }
}

impl Search {
    /// Everything predicted, as JSON: the kinds (their profiles' names), the workload, every
    /// point, the front and the ranked layouts (indices into the points).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "kinds": self.kinds.iter().map(|k| k.name.clone()).collect::<Vec<_>>(),
            "workload": {
                "isl": self.workload.isl,
                "osl": self.workload.osl,
                "ttft_ms": self.workload.ttft_ms,
                "itl_ms": self.workload.itl_ms,
            },
            "cores": self.cores,
            "hosts": self.hosts,
            "points": self.points,
            "front": self.front,
            "ranked": self.ranked,
        })
    }

    /// The settings that run `point`'s layout as one `kvx serve` on one host (its workers as
    /// engine shards) as it was predicted: the shards of each role, threads, batched tokens,
    /// sequences, each engine's KV cache as profiled, every prompt of a disaggregated layout
    /// prefilled on the prefill pool, the mocker's blocks and speed for a mock fleet; and the
    /// targets and profile the planner reads. Refused for layouts over several hosts.
    pub fn settings(&self, point: &Point) -> Result<Vec<Setting>, ConfigureError> {
        if self.hosts > 1 {
            return Err(ConfigureError::Invalid(format!(
                "the layouts span {} hosts: settings are for one `kvx serve` (use --hosts 1, or \
                 deploy the report's pools as workers)",
                self.hosts
            )));
        }
        let Some(k) = self.kinds.get(point.layout.kind()) else {
            return Err(ConfigureError::Invalid("the point's worker kind is unknown".into()));
        };
        let sh = &k.profile.shape;
        let q = &point.prediction;
        let mut out = Vec::new();
        let mut set = |key: &'static str, value: String, why: String| {
            out.push(Setting { key, value, why });
        };
        let profiled = format!("as profiled in {}", k.name);
        let predicted = format!(
            "predicted at {} users: {:.0} output tok/s ({:.1} per core), TTFT p50 {:.0} ms, ITL p50 {:.1} ms",
            q.concurrency, q.tok_s, q.tok_s_per_core, q.ttft_p50_ms, q.itl_p50_ms
        );
        let shards = sh.shards.max(1);
        match point.layout {
            Layout::Agg { workers, .. } => set(
                "KVX_SHARDS",
                (workers * shards).to_string(),
                format!("{}; {predicted}", point.layout.describe(&self.kinds)),
            ),
            Layout::Disagg { prefill, decode, .. } => {
                set(
                    "KVX_PREFILL_SHARDS",
                    (prefill * shards).to_string(),
                    format!("{}; {predicted}", point.layout.describe(&self.kinds)),
                );
                set(
                    "KVX_DECODE_SHARDS",
                    (decode * shards).to_string(),
                    "the decode pool of the same layout".into(),
                );
                set(
                    "KVX_DISAGG_MIN_TOKENS",
                    "0".into(),
                    "every prompt is prefilled on the prefill pool, as predicted".into(),
                );
            }
        }
        set("KVX_THREADS_PER_SHARD", sh.threads_per_shard.max(1).to_string(), profiled.clone());
        set("KVX_BLOCK_SIZE", sh.block_size.to_string(), profiled.clone());
        set("KVX_MAX_BATCHED_TOKENS", sh.max_batched_tokens.to_string(), profiled.clone());
        let most = k.profile.decode.iter().map(|d| d.batch).max().unwrap_or(1);
        set(
            "KVX_MAX_NUM_SEQS",
            most.max(1).to_string(),
            format!("the largest batch profiled in {}", k.name),
        );
        if sh.engine == "mocker" {
            set("KVX_ENGINE", "mocker".into(), "the profile is of mock workers".into());
            set("KVX_MOCKER_BLOCKS", sh.kv_blocks.to_string(), profiled.clone());
            if let Some(speedup) = sh
                .model
                .split("speedup ")
                .nth(1)
                .and_then(|t| t.trim_end_matches(')').trim().parse::<f64>().ok())
                .filter(|v| (v - 1.0).abs() > 1e-9)
            {
                set("KVX_SPEEDUP_RATIO", speedup.to_string(), profiled.clone());
            }
        } else if !sh.arith.is_empty() {
            // The workers compute in the arithmetic profiled, whatever `auto` would choose
            // on their CPUs.
            set("KVX_ARITH", sh.arith.clone(), format!("the arithmetic {profiled}"));
        }
        if sh.engine != "mocker" && sh.kv_bytes_per_token > 0 {
            let bytes = u64::from(sh.kv_blocks)
                .saturating_mul(u64::from(sh.block_size))
                .saturating_mul(sh.kv_bytes_per_token);
            set(
                "KVX_KV_CACHE_BYTES",
                bytes.to_string(),
                format!("each engine's KV cache {profiled} ({} blocks)", sh.kv_blocks),
            );
        }
        set(
            "KVX_PLANNER_PROFILE",
            k.name.clone(),
            "for `kvx planner` over workers of this shape".into(),
        );
        set(
            "KVX_PLANNER_TTFT_MS",
            format!("{}", self.workload.ttft_ms),
            "the TTFT p90 target".into(),
        );
        set("KVX_PLANNER_ITL_MS", format!("{}", self.workload.itl_ms), "the ITL p90 target".into());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_proto::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, WorkerShape};

    /// A mock worker's profile: Dynamo's mocker formulas at 1,024 blocks of 16 tokens.
    fn mocker(threads: u32) -> Profile {
        let shape = WorkerShape {
            engine: "mocker".into(),
            role: "agg".into(),
            shards: 1,
            threads_per_shard: threads,
            simd: "none".into(),
            arith: String::new(),
            model: "m".into(),
            block_size: 16,
            kv_blocks: 1024,
            max_batched_tokens: 8192,
            kv_bytes_per_token: 0,
            cpu: "test".into(),
        };
        let pf = |t: f64| 4.21e-7 * t * t + 0.01518 * t + 16.5;
        let prefill = [32u32, 128, 512, 1024, 2048, 4096]
            .iter()
            .map(|&isl| PrefillPoint {
                isl,
                ttft_ms: pf(f64::from(isl)),
                tok_s: f64::from(isl) / pf(f64::from(isl)) * 1e3,
            })
            .collect();
        let mut decode = Vec::new();
        for context in [64u32, 1024, 2048, 4096] {
            for batch in [1u32, 2, 4, 8, 16] {
                let u = (f64::from(batch * context) / 16384.0).min(1.0);
                let itl = -25.74 * u * u + 54.01 * u + 5.74;
                decode.push(DecodePoint {
                    batch,
                    context,
                    itl_ms: itl,
                    tok_s: f64::from(batch) / itl * 1e3,
                });
            }
        }
        Profile { version: PROFILE_VERSION, shape, reps: 1, temperature: 0.0, prefill, decode }
    }

    fn work() -> Workload {
        Workload { isl: 2000.0, osl: 200.0, ttft_ms: 500.0, itl_ms: 50.0, link_bytes_per_s: 4e9 }
    }

    fn kinds() -> Vec<WorkerKind> {
        vec![WorkerKind::new("mock".into(), mocker(1)).unwrap()]
    }

    #[test]
    fn one_user_sees_an_idle_worker() {
        let k = kinds();
        let w = work();
        let p = predict(Layout::Agg { workers: 1, kind: 0 }, &k, &w, 1);
        // TTFT: the prompt's step alone (no other user decodes); ITL: one sequence.
        let itl = k[0].profile.itl_ms(1.0, 2100.0);
        assert!((p.itl_p50_ms - itl).abs() < 1e-9, "{p:?}");
        let ttft = k[0].profile.ttft_ms(2000.0);
        assert!((p.ttft_p50_ms - ttft).abs() < 1e-6, "{p:?}");
        let cycle = ttft + 199.0 * itl;
        assert!((p.requests_per_s - 1e3 / cycle).abs() < 1e-3, "{p:?}");
        assert!(p.meets);
    }

    #[test]
    fn more_users_more_throughput_slower_tokens() {
        let k = kinds();
        let w = work();
        let l = Layout::Disagg { prefill: 1, decode: 2, kind: 0 };
        let a = predict(l, &k, &w, 2);
        let b = predict(l, &k, &w, 12);
        assert!(
            b.tok_s > a.tok_s && b.itl_p50_ms > a.itl_p50_ms && b.batch > a.batch,
            "{a:?} {b:?}"
        );
        // Little's law holds at the fixed point.
        let per = b.requests_per_s / 2.0 * 199.0 * b.itl_p50_ms / 1e3;
        assert!((per - b.batch).abs() / b.batch < 0.1, "{per} {b:?}");
        assert_eq!(max_concurrency(l, &k, &w), 2 * 7);
    }

    /// More users never give less throughput, and a prefill pool too small for the load
    /// caps it: TTFT then takes up what the loop's cycle leaves.
    #[test]
    fn throughput_grows_with_users_up_to_the_prefill_pool() {
        let k = kinds();
        let w = work();
        for l in [
            Layout::Agg { workers: 2, kind: 0 },
            Layout::Disagg { prefill: 1, decode: 3, kind: 0 },
            Layout::Disagg { prefill: 1, decode: 12, kind: 0 },
        ] {
            let mut last = 0.0;
            for c in 1..=max_concurrency(l, &k, &w) {
                let p = predict(l, &k, &w, c);
                assert!(p.tok_s >= last * (1.0 - 1e-6), "{l:?} at {c}: {p:?} after {last}");
                assert!(p.ttft_p90_ms >= p.ttft_p50_ms && p.ttft_p50_ms > 0.0, "{p:?}");
                last = p.tok_s;
            }
        }
        // One prefill worker computes at most 1 / 48.6 ms prompts a second.
        let l = Layout::Disagg { prefill: 1, decode: 24, kind: 0 };
        let p = predict(l, &k, &w, 168);
        let most = 1e3 / k[0].profile.ttft_ms(1999.0);
        assert!((p.requests_per_s - most).abs() < 0.01 * most, "{p:?}");
        // Prompts queue: the mean TTFT (what the cycle leaves over the decode) lies between
        // the median and the 90th percentile.
        let ttft_mean = 168.0 / p.requests_per_s * 1e3 - 199.0 * p.itl_p50_ms;
        assert!(ttft_mean > 1000.0, "{p:?}");
        assert!(p.ttft_p50_ms < ttft_mean * 1.05 && ttft_mean < p.ttft_p90_ms, "{ttft_mean} {p:?}");
    }

    /// An aggregated worker's users take turns: while it keeps up, a prompt waits for none
    /// (its median TTFT is its own steps), and each user's cycle holds every other user's
    /// prompt once, in the steps of its decoding.
    #[test]
    fn an_aggregated_worker_s_prompts_take_turns() {
        let k = kinds();
        let w = work();
        let l = Layout::Agg { workers: 1, kind: 0 };
        let one = predict(l, &k, &w, 1);
        for c in [2u32, 3, 4] {
            let p = predict(l, &k, &w, c);
            let cycle = f64::from(c) / p.requests_per_s * 1e3;
            let others = (cycle - p.ttft_p50_ms - 199.0 * p.itl_p50_ms) / f64::from(c - 1);
            // The other prompts' steps: about a prompt alone each (8,192 batched tokens
            // take a 2,000-token prompt in one step).
            let alone = k[0].profile.ttft_ms(2000.0);
            assert!((others - alone).abs() < 0.1 * alone, "{c}: {others} vs {alone}: {p:?}");
            // No wait for another prompt (48.6 ms here): the prompt's own step, which also
            // decodes the others, and half the step in progress when it came.
            assert!(p.ttft_p50_ms < one.ttft_p50_ms + 2.0 * p.itl_p50_ms, "{c}: {p:?} {one:?}");
            assert!(p.ttft_p90_ms >= p.ttft_p50_ms);
        }
    }

    #[test]
    fn a_busy_prefill_worker_queues_prompts() {
        let k = kinds();
        let w = work();
        let one = predict(Layout::Disagg { prefill: 1, decode: 8, kind: 0 }, &k, &w, 56);
        let two = predict(Layout::Disagg { prefill: 2, decode: 8, kind: 0 }, &k, &w, 56);
        assert!(
            one.ttft_p90_ms > two.ttft_p90_ms && one.ttft_p90_ms >= one.ttft_p50_ms,
            "{one:?} {two:?}"
        );
        assert_eq!(wait_quantile_ms(10.0, 0.05, 0.9), 0.0);
        assert!(wait_quantile_ms(10.0, 0.8, 0.9) > wait_quantile_ms(10.0, 0.8, 0.5));
        // One user never waits; two users away 300 ms between 100-ms prompts (exact MVA:
        // R(2) = 100 (1 + 100/400) = 125) wait 25 ms; many users saturate: N·S − away.
        assert_eq!(closed_wait_ms(1.0, 100.0, 300.0), 0.0);
        assert!((closed_wait_ms(2.0, 100.0, 300.0) - 25.0).abs() < 1e-9);
        assert!((closed_wait_ms(50.0, 100.0, 300.0) - (50.0 * 100.0 - 300.0 - 100.0)).abs() < 1.0);
    }

    #[test]
    fn the_search_finds_a_front_and_a_best_within_the_cores() {
        let s = search(kinds(), work(), 8, 1).unwrap();
        let best = s.best().unwrap();
        assert!(best.prediction.meets && best.layout.workers() <= 8);
        // The best layout is the one that gives the most output tokens per second within
        // the targets, at some number of users.
        let meeting = s.points.iter().filter(|p| p.prediction.meets);
        let top = meeting.clone().map(|p| p.prediction.tok_s).fold(0.0, f64::max);
        let best_most = meeting
            .filter(|p| p.layout == best.layout)
            .map(|p| p.prediction.tok_s)
            .fold(0.0, f64::max);
        assert_eq!(best_most, top);
        // Each layout is reported at its knee: within 5% of its most, with fewer users
        // falling short of that.
        for &i in &s.ranked {
            let r = &s.points[i];
            let same: Vec<&Point> =
                s.points.iter().filter(|p| p.layout == r.layout && p.prediction.meets).collect();
            let most = same.iter().map(|p| p.prediction.tok_s).fold(0.0, f64::max);
            assert!(r.prediction.tok_s >= most * (1.0 - KNEE), "{r:?}");
            assert!(
                same.iter()
                    .filter(|p| p.prediction.concurrency < r.prediction.concurrency)
                    .all(|p| p.prediction.tok_s < most * (1.0 - KNEE)),
                "{r:?}"
            );
        }
        // The front is ordered and no point dominates one on it.
        for w in s.front.windows(2) {
            let (a, b) = (&s.points[w[0]].prediction, &s.points[w[1]].prediction);
            assert!(a.tok_s_per_user >= b.tok_s_per_user && a.tok_s_per_core < b.tok_s_per_core);
        }
        for &i in &s.front {
            let f = &s.points[i].prediction;
            assert!(!s.points.iter().any(|p| {
                let q = &p.prediction;
                q.tok_s_per_user > f.tok_s_per_user && q.tok_s_per_core > f.tok_s_per_core
            }));
        }
        assert!(s.report(5).contains("Best: "));
        let j = s.to_json();
        assert_eq!(j["points"].as_array().unwrap().len(), s.points.len());
        assert!(j["points"][0]["layout"]["mode"].is_string());
        let set = s.settings(best).unwrap();
        let key = |k: &str| set.iter().find(|s| s.key == k).map(|s| s.value.clone());
        assert_eq!(key("KVX_ENGINE").as_deref(), Some("mocker"));
        match best.layout {
            Layout::Agg { workers, .. } => assert_eq!(key("KVX_SHARDS"), Some(workers.to_string())),
            Layout::Disagg { prefill, decode, .. } => {
                assert_eq!(key("KVX_PREFILL_SHARDS"), Some(prefill.to_string()));
                assert_eq!(key("KVX_DECODE_SHARDS"), Some(decode.to_string()));
            }
        }
        // A model engine's profile names its arithmetic; the settings pin it (an older
        // profile without one pins nothing).
        for (arith, want) in [("split", Some("split")), ("", None)] {
            let mut real = mocker(1);
            real.shape.engine = "model".into();
            real.shape.arith = arith.into();
            real.shape.kv_bytes_per_token = 23_040;
            let s = search(vec![WorkerKind::new("real".into(), real).unwrap()], work(), 2, 1);
            let s = s.unwrap();
            let set = s.settings(s.best().unwrap()).unwrap();
            let arith = set.iter().find(|s| s.key == "KVX_ARITH").map(|s| s.value.as_str());
            assert_eq!(arith, want, "{want:?}");
        }
        // Workers of two cores: four of them on 8 cores.
        let wide = vec![WorkerKind::new("wide".into(), mocker(2)).unwrap()];
        let s = search(wide, work(), 8, 1).unwrap();
        assert!(s.points.iter().all(|p| p.layout.workers() <= 4));
        let s = search(kinds(), work(), 4, 2).unwrap();
        assert!(s.points.iter().any(|p| p.layout.workers() == 8));
        assert!(s.settings(s.best().unwrap()).is_err(), "settings are for one host");
        // A sequence longer than a worker's KV cache: nothing fits.
        let long = Workload { isl: 20_000.0, ..work() };
        assert!(search(kinds(), long, 4, 1).is_err());
        assert_eq!(predict(Layout::Agg { workers: 1, kind: 3 }, &kinds(), &work(), 1).tok_s, 0.0);
    }

    #[test]
    fn impossible_targets_and_bad_requests() {
        let tight = Workload { itl_ms: 1.0, ..work() };
        let s = search(kinds(), tight, 4, 1).unwrap();
        assert!(s.best().is_none() && s.report(5).contains("No layout"));
        for (w, cores, hosts) in [
            (Workload { isl: 0.0, ..work() }, 4, 1),
            (Workload { ttft_ms: f64::NAN, ..work() }, 4, 1),
            (Workload { link_bytes_per_s: 0.0, ..work() }, 4, 1),
            (work(), 0, 1),
            (work(), 4, 0),
        ] {
            assert!(search(kinds(), w, cores, hosts).is_err());
        }
        assert!(search(Vec::new(), work(), 4, 1).is_err());
        let mut other = mocker(1);
        other.shape.model = "n".into();
        let two = vec![kinds().remove(0), WorkerKind::new("other".into(), other).unwrap()];
        assert!(search(two, work(), 4, 1).is_err());
        assert_eq!(concurrencies(1), vec![1]);
        assert_eq!(concurrencies(13), vec![1, 2, 3, 4, 6, 8, 12, 13]);
    }
}
