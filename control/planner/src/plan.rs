//! The SLA planner's decision: from an interval's observation, the predicted next interval
//! (request rate, prompt and output lengths) and a worker profile, how many prefill and
//! decode workers meet the TTFT and ITL targets — then the guardrails (bounds per pool, no
//! change while one is under way, scale-down only after a cooldown) and a one-line reason.
//!
//! Prefill: a worker prefills `isl / ttft(isl)` prompt tokens per second (the profile); at
//! utilisation ρ a prompt's TTFT is modelled as `ttft(isl) / (1 − ρ)` (queueing in front of
//! one server), times the correction measured/expected of the last interval. The largest ρ
//! that keeps that within the TTFT target sets the tokens per second each worker may take.
//! Decode: the ITL target over the correction measured/expected ITL (expected: the profile's
//! ITL at the batch each worker held, by Little's law) bounds the batch; the profile's best
//! output tokens per second within it, at a context of `isl + osl/2`, sets each worker's
//! share of the predicted output tokens per second.
//!
//! With load-based sizing on ([`crate::load`]), each pool may also move by one from what runs
//! on the workers' own step times; the profile's sizing, when there is a profile, is the
//! floor.

use std::fmt::Write as _;
use std::time::Duration;

use kvx_proto::profile::Profile;
use serde::Serialize;

use crate::load::{LoadConfig, LoadSizer, LoadView, PoolLoad};
use crate::observe::Observation;
use crate::predict::{Predictor, PredictorKind};

/// The largest share of requests that may find every decode slot taken (the targets are
/// 90th percentiles).
const WAIT_SHARE: f64 = 0.1;

/// Erlang C: the chance that an arrival waits when `servers` serve an offered load of `load`
/// (arrival rate × holding time), as in M/M/c: 1 at or past saturation, 0 without load.
fn erlang_c(servers: f64, load: f64) -> f64 {
    if load.is_nan() || load <= 0.0 {
        return 0.0;
    }
    let n = servers.floor();
    if load >= n {
        return 1.0;
    }
    // Erlang B by its recurrence, then C from B.
    let mut b = 1.0;
    let mut k = 1.0;
    while k <= n {
        b = load * b / (k + load * b);
        k += 1.0;
    }
    (n * b / (n - load * (1.0 - b))).clamp(0.0, 1.0)
}

/// Latency targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Targets {
    /// Time to first token, 90th percentile, milliseconds.
    pub ttft_ms: f64,
    /// Inter-token latency, 90th percentile, milliseconds.
    pub itl_ms: f64,
}

/// Bounds on a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Fewest workers.
    pub min: u32,
    /// Most workers.
    pub max: u32,
}

/// Worker counts of the two pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Replicas {
    /// Prefill workers.
    pub prefill: u32,
    /// Decode workers.
    pub decode: u32,
}

/// The planner's settings.
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    /// Seconds between decisions.
    pub interval: Duration,
    /// Latency targets.
    pub targets: Targets,
    /// Prefill pool bounds.
    pub prefill: Bounds,
    /// Decode pool bounds.
    pub decode: Bounds,
    /// Predictor of request count, prompt and output length.
    pub predictor: PredictorKind,
    /// A pool is not scaled down within this long of its last change (less a tenth of an
    /// interval: the decisions' jitter).
    pub cooldown: Duration,
    /// The most a correction factor may be (and one over the least).
    pub max_correction: f64,
    /// How many intervals past the last observation the pools are sized for on a rise. An
    /// observation is the mean of the interval just ended, half an interval before the
    /// decision; 1.5 sizes for the end of the next interval, so a rising trend is met where
    /// it will be rather than where it was. On a fall the pools are sized for the next
    /// interval's start (half an interval on).
    pub lookahead: f64,
    /// Load-based sizing from the workers' step times (`None`: off; then a profile is
    /// needed).
    pub load: Option<LoadConfig>,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            interval: Duration::from_secs(60),
            targets: Targets { ttft_ms: 500.0, itl_ms: 50.0 },
            prefill: Bounds { min: 1, max: 8 },
            decode: Bounds { min: 1, max: 8 },
            predictor: PredictorKind::Holt { alpha: 0.5, beta: 0.3, phi: 1.0 },
            cooldown: Duration::from_secs(120),
            max_correction: 4.0,
            lookahead: 1.5,
            load: None,
        }
    }
}

/// Settings that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Bounds, targets or intervals out of range.
    #[error("planner: {0}")]
    Invalid(String),
    /// The profile is unusable.
    #[error(transparent)]
    Profile(#[from] kvx_proto::profile::ProfileError),
}

impl PlannerConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Invalid(m));
        for (name, b) in [("prefill", self.prefill), ("decode", self.decode)] {
            if b.min > b.max || b.max == 0 {
                return bad(format!("{name} pool bounds {}..{} are empty", b.min, b.max));
            }
        }
        let t = self.targets;
        if !(t.ttft_ms > 0.0 && t.itl_ms > 0.0 && t.ttft_ms.is_finite() && t.itl_ms.is_finite()) {
            return bad("the TTFT and ITL targets must be positive".into());
        }
        if self.interval.is_zero() {
            return bad("the interval must be positive".into());
        }
        if self.max_correction.is_nan() || self.max_correction < 1.0 {
            return bad("the correction bound must be at least 1".into());
        }
        if !(0.0..=16.0).contains(&self.lookahead) {
            return bad("the lookahead must be between 0 and 16 intervals".into());
        }
        if let Some(l) = self.load {
            if !(l.sensitivity > 0.0 && l.sensitivity <= 1.0) {
                return bad("the load sensitivity must be in (0, 1]".into());
            }
            if l.window == 0 || l.chunk_tokens.is_nan() || l.chunk_tokens < 1.0 {
                return bad("load-based sizing needs a window and a batched-token budget".into());
            }
        }
        Ok(())
    }
}

/// The predicted next interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Load {
    /// Requests per second.
    pub requests_per_s: f64,
    /// Mean prompt tokens.
    pub isl: f64,
    /// Mean output tokens.
    pub osl: f64,
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Its number, from 1.
    pub id: u64,
    /// What was measured.
    pub observed: Observation,
    /// What the predictors expect next.
    pub predicted: Load,
    /// Measured / expected TTFT and ITL of the last interval (1 when unknown).
    pub corrections: (f64, f64),
    /// The TTFT and ITL (p90, ms) the target replicas are expected to give.
    pub expected_ttft_ms: f64,
    /// Expected ITL at the target replicas.
    pub expected_itl_ms: f64,
    /// What the load asks for, within the pools' bounds.
    pub desired: Replicas,
    /// What is applied after the guardrails.
    pub target: Replicas,
    /// What ran when it was made.
    pub actual: Replicas,
    /// Load-based sizing's view of both pools (when it runs).
    pub load: Option<LoadView>,
    /// One line on why.
    pub reason: String,
}

/// The planner's state between intervals.
#[derive(Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    profile: Option<Profile>,
    load: Option<LoadSizer>,
    requests: Predictor,
    isl: Predictor,
    osl: Predictor,
    /// The last targets applied, and when each pool last changed (seconds on the caller's
    /// clock).
    last: Option<Replicas>,
    changed_at: [Option<f64>; 2],
    decisions: u64,
}

/// What the profile asks for, and what it needs to say what a target gives.
struct ProfileSizing {
    want: (f64, f64),
    corrections: (f64, f64),
    prompt_tok_s: f64,
    idle_ms: f64,
    ctx: f64,
    rate: f64,
    reason: String,
}

impl Planner {
    /// A planner over workers described by `profile` (throughput-based sizing), with
    /// load-based sizing too when the configuration asks for it; without a profile,
    /// load-based sizing alone.
    pub fn new(cfg: PlannerConfig, profile: Option<Profile>) -> Result<Self, PlanError> {
        cfg.validate()?;
        if let Some(p) = &profile {
            p.validate()?;
        } else if cfg.load.is_none() {
            return Err(PlanError::Invalid(
                "without a profile the planner needs load-based sizing".into(),
            ));
        }
        let p = cfg.predictor;
        Ok(Planner {
            load: cfg.load.map(LoadSizer::new),
            cfg,
            profile,
            requests: p.build(),
            isl: p.build(),
            osl: p.build(),
            last: None,
            changed_at: [None, None],
            decisions: 0,
        })
    }

    /// Its settings.
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// Decides the pools for the next interval. `now_s` is the caller's clock in seconds,
    /// `obs` what was measured over the last `elapsed_s` seconds, `actual` the workers
    /// running now (a pool whose count differs from the last target is still changing: it is
    /// held).
    pub fn decide(
        &mut self,
        now_s: f64,
        elapsed_s: f64,
        obs: &Observation,
        actual: Replicas,
    ) -> Decision {
        self.decisions += 1;
        let secs = if elapsed_s.is_finite() && elapsed_s > 1e-3 {
            elapsed_s
        } else {
            self.cfg.interval.as_secs_f64()
        };
        self.requests.observe(obs.requests / secs);
        if obs.finished > 0.0 {
            self.isl.observe(obs.isl);
            self.osl.observe(obs.osl);
        }
        let predicted = Load {
            requests_per_s: self.requests.predict(),
            isl: self.isl.predict(),
            osl: self.osl.predict(),
        };
        let t = self.cfg.targets;
        let rate_now = obs.requests / secs;
        // The pools are sized for the highest rate the trend predicts over the next interval:
        // its end on a rise (`lookahead` intervals past the observation, the mean of the
        // interval just ended), its start on a fall (half an interval past it).
        let ahead = self.requests.predict_ahead(self.cfg.lookahead);
        let rate = ahead.max(self.requests.predict_ahead(self.cfg.lookahead.min(0.5)));
        let sizing = self.profile.as_ref().map(|profile| {
            size_by_profile(&self.cfg, profile, obs, actual, &predicted, rate, rate_now)
        });
        let load = self.load.as_mut().map(|l| {
            let isl = if predicted.isl > 0.0 { predicted.isl } else { obs.isl };
            l.observe(obs, secs, isl, (t.ttft_ms, t.itl_ms), (actual.prefill, actual.decode))
        });
        // Throughput-based sizing sets the floor; load-based sizing moves a pool by one from
        // what runs.
        let want = |i: usize| {
            let tp = sizing.as_ref().map(|s| if i == 0 { s.want.0 } else { s.want.1 });
            let ld = load.as_ref().map(|v| {
                let (pool, now) =
                    if i == 0 { (&v.prefill, actual.prefill) } else { (&v.decode, actual.decode) };
                f64::from(now) + f64::from(pool.step)
            });
            match (tp, ld) {
                (Some(a), Some(b)) => a.max(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => 0.0,
            }
        };
        let bound = |want: f64, b: Bounds| {
            (want.max(0.0).min(f64::from(u32::MAX)) as u32).clamp(b.min, b.max)
        };
        let desired = Replicas {
            prefill: bound(want(0), self.cfg.prefill),
            decode: bound(want(1), self.cfg.decode),
        };

        // Guardrails.
        let mut reason = String::new();
        let last = self.last.unwrap_or(actual);
        let mut target = last;
        let pools = [
            ("prefill", desired.prefill, last.prefill, actual.prefill),
            ("decode", desired.decode, last.decode, actual.decode),
        ];
        for (i, (name, want, was, now)) in pools.into_iter().enumerate() {
            let slot = if i == 0 { &mut target.prefill } else { &mut target.decode };
            if want == was {
                continue;
            }
            if now != was && self.last.is_some() {
                let _ =
                    write!(reason, "{name} held at {was} ({now} running: a change is under way); ");
                continue;
            }
            // Decisions come an interval apart give or take the scheduler's jitter: a cooldown
            // of one interval lets the next decision shrink the pool.
            let slack = 0.1 * self.cfg.interval.as_secs_f64();
            let cooling = self.changed_at[i]
                .is_some_and(|at| now_s - at < self.cfg.cooldown.as_secs_f64() - slack);
            if want < was && cooling {
                let _ = write!(reason, "{name} stays {was} (cooldown after its last change); ");
                continue;
            }
            let _ = write!(reason, "{name} {was}→{want}; ");
            *slot = want;
            self.changed_at[i] = Some(now_s);
        }
        self.last = Some(target);
        if reason.is_empty() {
            reason.push_str("no change; ");
        }

        let (expected_ttft_ms, expected_itl_ms, corrections) = match (&sizing, &self.profile) {
            (Some(s), Some(profile)) => {
                let (ttft, itl) = expected(profile, s, &predicted, target);
                reason.push_str(&s.reason);
                (ttft, itl, s.corrections)
            }
            // Load-based alone: the highest estimate at the workers running.
            _ => {
                let _ = write!(
                    reason,
                    "next {:.2} req/s ({:.2} measured, {:.0} in flight) × {:.0} prompt / {:.0} output tokens",
                    predicted.requests_per_s, rate_now, obs.inflight, predicted.isl, predicted.osl
                );
                let v = load.as_ref();
                let hi = |f: fn(&LoadView) -> &PoolLoad| v.map_or(0.0, |v| f(v).estimate_ms.1);
                (hi(|v| &v.prefill), hi(|v| &v.decode), (1.0, 1.0))
            }
        };
        if let Some(v) = &load {
            let _ = write!(reason, "; {}", v.describe());
        }
        Decision {
            id: self.decisions,
            observed: obs.clone(),
            predicted,
            corrections,
            expected_ttft_ms,
            expected_itl_ms,
            desired,
            target,
            actual,
            load,
            reason,
        }
    }
}

/// Throughput-based sizing from the profile.
///
/// Prefill: the correction compares the measured TTFT with the model at the measured
/// utilisation. Decode: the correction compares the measured mean ITL with the profile at
/// the batch each worker held (Little's law: requests × output tokens × mean ITL).
#[allow(clippy::too_many_arguments)]
fn size_by_profile(
    cfg: &PlannerConfig,
    profile: &Profile,
    obs: &Observation,
    actual: Replicas,
    predicted: &Load,
    rate: f64,
    rate_now: f64,
) -> ProfileSizing {
    let t = cfg.targets;
    let clamp_corr = |c: f64| c.clamp(1.0 / cfg.max_correction, cfg.max_correction);
    let t0 = |isl: f64| profile.ttft_ms(isl);
    let cap = |isl: f64| profile.prefill_tok_s(isl);
    let p_corr = match (obs.ttft_p90_ms, actual.prefill) {
        (Some(m), n) if n > 0 && obs.finished > 0.0 && obs.isl > 0.0 => {
            let rho = (rate_now * obs.isl / (f64::from(n) * cap(obs.isl))).min(0.95);
            clamp_corr(m / (t0(obs.isl) / (1.0 - rho)))
        }
        _ => 1.0,
    };
    let idle = t0(predicted.isl) * p_corr;
    let rho_max = (1.0 - idle / t.ttft_ms).clamp(0.05, 0.95);
    let prompt_tok_s = rate * predicted.isl;
    let want_p = (prompt_tok_s / (cap(predicted.isl) * rho_max)).ceil();

    let ctx = predicted.isl + predicted.osl / 2.0;
    let d_corr = match (obs.itl_mean_ms, actual.decode) {
        (Some(m), n) if n > 0 && obs.finished > 0.0 => {
            let batch = (rate_now * obs.osl * m / 1e3 / f64::from(n)).max(1.0);
            clamp_corr(m / profile.itl_ms(batch, obs.isl + obs.osl / 2.0))
        }
        _ => 1.0,
    };
    let itl_budget = t.itl_ms / d_corr;
    let out_tok_s = rate * predicted.osl;
    let (mut want_d, per_decode, slots) = match profile.decode_capacity(ctx, itl_budget) {
        Some((tok_s, b)) => ((out_tok_s / tok_s).ceil(), Some(tok_s), b),
        // Even one sequence is slower than the budget: no batch meets it, so each worker
        // runs one sequence at a time (the target is missed by what one step takes).
        None => {
            let one = 1e3 / profile.itl_ms(1.0, ctx).max(1e-3);
            ((out_tok_s / one).ceil(), None, 1.0)
        }
    };
    // A request that finds every sequence slot of the pool taken — what the workers' KV
    // caches hold — waits for a sequence to end (seconds, past any TTFT target), so at
    // most `WAIT_SHARE` of them may: Erlang C over the pool's slots, each held for the
    // output's length at the batch's ITL. (Past the batch that meets the ITL target a
    // request is batched, slower, not kept waiting: the throughput sizing covers that.)
    let kv_slots = profile.max_batch(ctx).max(1.0);
    let hold_s = predicted.osl * profile.itl_ms(slots, ctx) * d_corr / 1e3;
    let offered = rate * hold_s;
    let wait_share = |n: f64| erlang_c(n * kv_slots, offered);
    // Every request in flight at the frontend needs a place in a batch that meets the ITL
    // target (a backlog drains only so).
    want_d = want_d.max(1.0).max((obs.inflight / slots).ceil());
    while want_d < f64::from(cfg.decode.max) && wait_share(want_d) > WAIT_SHARE {
        want_d += 1.0;
    }
    let reason = format!(
        "next {:.2} req/s (sized for {:.2}: the trend's highest over the next interval, {} intervals on at most) × {:.0} prompt / {:.0} output tokens ({}; {:.2} measured, {:.0} in flight): prefill {:.0} tok/s over {:.0} per worker at ρ ≤ {:.2} (TTFT {:.0} ms idle, ×{:.2} measured), decode {:.0} tok/s over {} per worker within ITL {:.1} ms (×{:.2} measured; {:.0} sequences held, {:.0}% wait for a slot)",
        predicted.requests_per_s,
        rate,
        cfg.lookahead,
        predicted.isl,
        predicted.osl,
        cfg.predictor,
        rate_now,
        obs.inflight,
        prompt_tok_s,
        cap(predicted.isl),
        rho_max,
        t0(predicted.isl),
        p_corr,
        out_tok_s,
        per_decode
            .map_or("one sequence each (no batch meets it)".to_string(), |v| format!("{v:.0}")),
        itl_budget,
        d_corr,
        offered,
        100.0 * wait_share(want_d.max(f64::from(actual.decode)).max(1.0)),
    );
    ProfileSizing {
        want: (want_p, want_d),
        corrections: (p_corr, d_corr),
        prompt_tok_s,
        idle_ms: idle,
        ctx,
        rate,
        reason,
    }
}

/// The TTFT and ITL (ms) the profile expects at `target`.
fn expected(
    profile: &Profile,
    s: &ProfileSizing,
    predicted: &Load,
    target: Replicas,
) -> (f64, f64) {
    let cap = profile.prefill_tok_s(predicted.isl);
    let rho = if target.prefill > 0 {
        (s.prompt_tok_s / (f64::from(target.prefill) * cap)).min(0.99)
    } else {
        0.99
    };
    let ttft = s.idle_ms / (1.0 - rho);
    // The batch each decode worker holds at the target, by Little's law (sequences = rate
    // × output tokens × ITL at that batch), found by iterating to its fixed point.
    let d_corr = s.corrections.1;
    let max_batch = profile.max_batch(s.ctx).max(1.0);
    let mut batch = 1.0;
    if target.decode > 0 {
        let per = s.rate * predicted.osl / 1e3 / f64::from(target.decode);
        for _ in 0..64 {
            let next = (per * profile.itl_ms(batch, s.ctx) * d_corr).clamp(1.0, 4.0 * max_batch);
            if (next - batch).abs() < 1e-3 {
                break;
            }
            batch = next;
        }
    }
    (ttft, profile.itl_ms(batch, s.ctx) * d_corr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_proto::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, WorkerShape};

    /// Prefill: 10 ms + 0.05 ms per token; decode: 10 ms + 1 ms per sequence.
    fn profile() -> Profile {
        let shape = WorkerShape {
            engine: "mocker".into(),
            role: "agg".into(),
            shards: 1,
            threads_per_shard: 1,
            simd: "none".into(),
            arith: String::new(),
            model: "test".into(),
            block_size: 16,
            kv_blocks: 8192,
            max_batched_tokens: 4096,
            kv_bytes_per_token: 0,
            cpu: "test".into(),
        };
        let prefill = [500, 1000, 2000, 4000]
            .map(|isl| {
                let ttft_ms = 10.0 + 0.05 * f64::from(isl);
                PrefillPoint { isl, ttft_ms, tok_s: f64::from(isl) / ttft_ms * 1e3 }
            })
            .to_vec();
        let mut decode = Vec::new();
        for context in [512, 4096] {
            for batch in [1, 16, 64] {
                let itl_ms = 10.0 + f64::from(batch);
                decode.push(DecodePoint {
                    batch,
                    context,
                    itl_ms,
                    tok_s: f64::from(batch) / itl_ms * 1e3,
                });
            }
        }
        Profile { version: PROFILE_VERSION, shape, reps: 1, temperature: 0.0, prefill, decode }
    }

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            interval: Duration::from_secs(10),
            targets: Targets { ttft_ms: 500.0, itl_ms: 50.0 },
            prefill: Bounds { min: 1, max: 32 },
            decode: Bounds { min: 1, max: 32 },
            predictor: PredictorKind::Constant,
            cooldown: Duration::from_secs(30),
            max_correction: 4.0,
            lookahead: 1.5,
            load: None,
        }
    }

    fn obs(rate: f64, ttft: f64, itl: f64) -> Observation {
        Observation {
            requests: rate * 10.0,
            finished: rate * 10.0,
            inflight: 0.0,
            isl: 2000.0,
            osl: 200.0,
            ttft_mean_ms: Some(ttft),
            ttft_p90_ms: Some(ttft),
            itl_mean_ms: Some(itl),
            itl_p90_ms: Some(itl),
            workers: Default::default(),
            steps: Default::default(),
        }
    }

    #[test]
    fn pools_follow_the_load_as_the_profile_says() {
        let mut p = Planner::new(cfg(), Some(profile())).unwrap();
        // 10 req/s × 2000 tokens = 20,000 prompt tok/s; a worker prefills 2000 tokens in
        // 110 ms (18,182 tok/s) and may run at ρ ≤ 1 − 110/500 = 0.78 → 14,182 → 2 workers.
        // Decode: 2,000 output tok/s; within 50 ms a worker runs batch 40 → 800 tok/s → 3.
        // The measured latencies are what the model expects at 2 + 4 workers (ρ = 0.55;
        // batch 20 per decode worker), so there is no correction.
        let ttft = 110.0 / (1.0 - 20_000.0 / 36_363.636_36);
        let d = p.decide(0.0, 10.0, &obs(10.0, ttft, 20.0), Replicas { prefill: 2, decode: 4 });
        assert!(
            (d.corrections.0 - 1.0).abs() < 1e-6 && (d.corrections.1 - 1.0).abs() < 1e-6,
            "{d:?}"
        );
        assert_eq!(d.desired, Replicas { prefill: 2, decode: 3 }, "{}", d.reason);
        assert_eq!(d.target, d.desired);
        assert!(d.reason.starts_with("decode 4→3; next 10.00 req/s"), "{}", d.reason);
        // 3 decode workers: batch b = 2000 × (10 + b) / 1000 / 3 → 20, ITL 30 ms.
        assert!((d.expected_itl_ms - 30.0).abs() < 0.01, "{d:?}");
        assert!((d.expected_ttft_ms - ttft).abs() < 0.01, "{d:?}");
        // No load: back to the minimum; the decode pool only after its cooldown.
        let d = p.decide(10.0, 10.0, &obs(0.0, 0.0, 0.0), Replicas { prefill: 2, decode: 3 });
        assert_eq!(d.desired, Replicas { prefill: 1, decode: 1 });
        assert_eq!(d.target, Replicas { prefill: 1, decode: 3 }, "{}", d.reason);
        assert!(d.reason.contains("decode stays 3 (cooldown"), "{}", d.reason);
        let d = p.decide(40.0, 10.0, &obs(0.0, 0.0, 0.0), Replicas { prefill: 1, decode: 3 });
        assert_eq!(d.target, Replicas { prefill: 1, decode: 1 }, "{}", d.reason);
    }

    #[test]
    fn a_change_under_way_is_held_and_slow_measurements_add_workers() {
        let ttft = 110.0 / (1.0 - 20_000.0 / 36_363.636_36);
        let now = Replicas { prefill: 2, decode: 4 };
        let mut p = Planner::new(cfg(), Some(profile())).unwrap();
        let d = p.decide(0.0, 10.0, &obs(10.0, ttft, 20.0), now);
        assert_eq!(d.target.decode, 3);
        // Twice the load while four decode workers still run: the pool is held at 3.
        let d = p.decide(10.0, 10.0, &obs(20.0, ttft, 20.0), now);
        assert!(d.desired.decode > 4, "{d:?}");
        assert_eq!(d.target.decode, 3, "{}", d.reason);
        assert!(d.reason.contains("decode held at 3 (4 running"), "{}", d.reason);
        // ITL measured at 150 ms where the profile says 85 (batch 75 per worker): the budget
        // shrinks by that factor and more decode workers are asked for than at 20 ms.
        let mut q = Planner::new(cfg(), Some(profile())).unwrap();
        let slow = q.decide(0.0, 10.0, &obs(10.0, ttft, 150.0), now);
        assert!((slow.corrections.1 - 150.0 / 85.0).abs() < 1e-6, "{slow:?}");
        assert!(slow.desired.decode > 3, "{}", slow.reason);
    }

    /// On a rising ramp a trend predictor sizes the pools for where the rate will be: the
    /// further ahead, the more decode workers; a constant predictor has no trend to extend.
    #[test]
    fn a_rising_trend_is_met_where_it_will_be() {
        let run = |predictor: &str, lookahead: f64| {
            let cfg = PlannerConfig { predictor: predictor.parse().unwrap(), lookahead, ..cfg() };
            let mut p = Planner::new(cfg, Some(profile())).unwrap();
            let mut d = None;
            for i in 0..6 {
                let rate = 2.0 + 2.0 * f64::from(i);
                let actual = p.last.unwrap_or(Replicas { prefill: 1, decode: 1 });
                d = Some(p.decide(10.0 * f64::from(i), 10.0, &obs(rate, 300.0, 30.0), actual));
            }
            d.unwrap().desired.decode
        };
        let (now, next, far) = (run("holt", 0.0), run("holt", 1.5), run("holt", 3.0));
        assert!(now < next && next < far, "{now} {next} {far}");
        assert_eq!(run("constant", 0.0), run("constant", 3.0));
        let bad = PlannerConfig { lookahead: -1.0, ..cfg() };
        assert!(bad.validate().is_err());
    }

    /// An ITL target below one sequence's step: the pool is sized at one sequence per worker,
    /// and a lone stream gets one worker (its requests are batched, not kept waiting).
    #[test]
    fn a_target_no_batch_meets_sizes_one_sequence_per_worker() {
        let tight = PlannerConfig { targets: Targets { ttft_ms: 500.0, itl_ms: 8.0 }, ..cfg() };
        let one = Replicas { prefill: 1, decode: 1 };
        let mut p = Planner::new(tight.clone(), Some(profile())).unwrap();
        assert_eq!(p.decide(0.0, 10.0, &obs(0.3, 100.0, 11.0), one).desired.decode, 1);
        // 2 req/s × 200 tokens over 1000 / 11 tokens/s per worker.
        let mut p = Planner::new(tight, Some(profile())).unwrap();
        assert_eq!(p.decide(0.0, 10.0, &obs(2.0, 100.0, 11.0), one).desired.decode, 5);
    }

    /// A cooldown of one interval: the next decision may shrink the pool again even when it
    /// comes a little early (the decisions' timer jitters).
    #[test]
    fn a_cooldown_of_one_interval_allows_the_next_decision() {
        let c = PlannerConfig { cooldown: Duration::from_secs(10), ..cfg() };
        let mut p = Planner::new(c, Some(profile())).unwrap();
        let ttft = 110.0 / (1.0 - 20_000.0 / 36_363.636_36);
        let d = p.decide(0.0, 10.0, &obs(10.0, ttft, 20.0), Replicas { prefill: 2, decode: 4 });
        assert_eq!(d.target.decode, 3, "{}", d.reason);
        let idle = obs(0.0, 0.0, 0.0);
        let d = p.decide(9.98, 9.98, &idle, Replicas { prefill: 2, decode: 3 });
        assert_eq!(d.target.decode, 1, "{}", d.reason);
        // Well within it, no.
        let d = p.decide(10.5, 0.52, &obs(30.0, ttft, 20.0), Replicas { prefill: 2, decode: 1 });
        let up = d.target.decode;
        let d = p.decide(12.0, 1.5, &idle, Replicas { prefill: 2, decode: up });
        assert!(up > 1 && d.target.decode == up, "{}", d.reason);
    }

    #[test]
    fn erlang_c_matches_known_values() {
        assert!((erlang_c(2.0, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(erlang_c(4.0, 0.0), 0.0);
        assert_eq!(erlang_c(4.0, 4.0), 1.0);
        // One server: the chance to wait is the utilisation.
        assert!((erlang_c(1.0, 0.7) - 0.7).abs() < 1e-12);
        // More servers at the same utilisation wait less.
        assert!(erlang_c(100.0, 80.0) < erlang_c(10.0, 8.0));
    }

    #[test]
    fn decode_slots_get_headroom_when_a_worker_holds_few_sequences() {
        // A KV cache of 7 sequences of ~2,100 tokens per worker (1,024 blocks of 16), each
        // holding its slot for 200 tokens × 17 ms = 3.4 s. At 1.5 req/s one worker has the
        // throughput (300 of 412 tok/s) but a third of the requests would wait for a slot
        // (Erlang C of 7 slots at 5.1 held): two workers. Measured as the model expects
        // (2 prefill workers at ρ 0.08; 2 decode workers at batch ~1.8 and 11.76 ms).
        let mut small = profile();
        small.shape.kv_blocks = 1024;
        let mut p = Planner::new(cfg(), Some(small)).unwrap();
        let ttft = 110.0 / (1.0 - 1.5 * 2000.0 / 36_363.636_36);
        let d =
            p.decide(0.0, 10.0, &obs(1.5, ttft, 11.764_705_88), Replicas { prefill: 2, decode: 2 });
        assert!((d.corrections.1 - 1.0).abs() < 1e-6, "{d:?}");
        assert_eq!(d.desired.decode, 2, "{}", d.reason);
        assert!(erlang_c(7.0, 5.1) > WAIT_SHARE && erlang_c(14.0, 5.1) <= WAIT_SHARE);
        assert!(d.reason.contains("5 sequences held, 0% wait for a slot"), "{}", d.reason);
    }

    #[test]
    fn a_falling_trend_is_followed_to_the_next_intervals_start_and_a_backlog_gets_slots() {
        let mut c = cfg();
        c.predictor = PredictorKind::Holt { alpha: 0.5, beta: 0.5, phi: 1.0 };
        let mut p = Planner::new(c, Some(profile())).unwrap();
        let now = Replicas { prefill: 2, decode: 4 };
        for (i, rate) in [12.0, 8.0, 4.0].into_iter().enumerate() {
            p.decide(10.0 * i as f64, 10.0, &obs(rate, 200.0, 20.0), now);
        }
        // Level 2 and slope −3 after 12, 8, 4, 4: the next interval starts at 0.5 req/s (half an
        // interval on), where the 4 just measured would ask for 2 workers: one.
        let d = p.decide(30.0, 10.0, &obs(4.0, 200.0, 20.0), now);
        assert!(d.reason.contains("4.00 measured"), "{}", d.reason);
        assert!(d.reason.contains("decode 100 tok/s"), "{}", d.reason);
        assert_eq!(d.desired.decode, 1, "{}", d.reason);
        // 100 requests in flight at 25 slots a worker: 4 workers, whatever the rate.
        let mut backlog = obs(4.0, 200.0, 20.0);
        backlog.inflight = 100.0;
        let d = p.decide(40.0, 10.0, &backlog, now);
        assert_eq!(d.desired.decode, 4, "{}", d.reason);
    }

    #[test]
    fn bounds_and_settings() {
        let mut c = cfg();
        c.prefill = Bounds { min: 2, max: 3 };
        let mut p = Planner::new(c.clone(), Some(profile())).unwrap();
        let d = p.decide(0.0, 10.0, &obs(100.0, 200.0, 30.0), Replicas { prefill: 2, decode: 1 });
        assert_eq!(d.desired.prefill, 3);
        let mut fresh = Planner::new(c.clone(), Some(profile())).unwrap();
        let d2 = fresh.decide(0.0, 10.0, &obs(0.0, 0.0, 0.0), Replicas { prefill: 2, decode: 1 });
        assert_eq!(d2.desired.prefill, 2);
        c.decode = Bounds { min: 3, max: 2 };
        assert!(Planner::new(c, Some(profile())).is_err());
        let mut c = cfg();
        c.targets.itl_ms = 0.0;
        assert!(Planner::new(c, Some(profile())).is_err());
        let mut bad = profile();
        bad.decode.swap(0, 1);
        assert!(matches!(Planner::new(cfg(), Some(bad)), Err(PlanError::Profile(_))));
    }

    /// Decode steps of `context` tokens (± half) at 2 ms + 0.001 ms a token on `n` workers.
    fn with_steps(mut o: Observation, n: usize, context: f64) -> Observation {
        for w in 0..n {
            let mut s = kvx_proto::StepSums::default();
            for i in 0..99 {
                let x2 = context * (0.5 + f64::from(i % 3) * 0.5);
                s.add(0.0, x2, 2e-3 + 1e-6 * x2, 0.0);
            }
            let steps = crate::observe::WorkerSteps { role: "decode".into(), sums: s, queued: 0.0 };
            o.steps.insert(format!("d{w}"), steps);
        }
        o
    }

    #[test]
    fn load_based_sizing_moves_a_pool_by_one_and_the_profile_is_its_floor() {
        let load = PlannerConfig { load: Some(LoadConfig::default()), ..cfg() };
        assert!(Planner::new(cfg(), None).is_err(), "neither a profile nor load-based sizing");
        let mut p = Planner::new(load.clone(), None).unwrap();
        let now = Replicas { prefill: 1, decode: 2 };
        // Every decode worker steps in 62 ms (> 50): one more.
        let d = p.decide(0.0, 10.0, &with_steps(obs(1.0, 100.0, 62.0), 2, 60_000.0), now);
        assert_eq!(d.desired.decode, 3, "{}", d.reason);
        assert!((d.expected_itl_ms - 62.0).abs() < 0.01, "{d:?}");
        assert!(d.reason.contains("load: decode step 2.0 ms"), "{}", d.reason);
        assert_eq!(d.load.as_ref().map(|v| v.decode.step), Some(1));
        // With the profile too: at 10 req/s it asks for 3 decode workers, load-based sizing
        // for 3 − 1 (12 ms now, 17 with one fewer): the profile's 3 stands.
        let mut p = Planner::new(load, Some(profile())).unwrap();
        let ttft = 110.0 / (1.0 - 20_000.0 / 36_363.636_36);
        let three = Replicas { prefill: 2, decode: 3 };
        let d = p.decide(0.0, 10.0, &with_steps(obs(10.0, ttft, 20.0), 3, 10_000.0), three);
        assert_eq!(d.load.as_ref().map(|v| v.decode.step), Some(-1));
        assert_eq!(d.desired.decode, 3, "{}", d.reason);
        let bad = PlannerConfig {
            load: Some(LoadConfig { sensitivity: 0.0, ..LoadConfig::default() }),
            ..cfg()
        };
        assert!(bad.validate().is_err());
    }
}
