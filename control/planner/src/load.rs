//! Sizing without a profile (load-based): each worker's step sums give, per pool, a
//! least-squares fit of a step's time on its prompt tokens and the context its decoded
//! tokens attend, over the last few intervals; from it every worker's latency is estimated
//! at its own load — ITL as one step at the interval's mean batch, TTFT as the worker's mean
//! prefill queue plus a prompt, computed in chunks of the batched-token budget. A pool grows
//! by one when every worker's estimate is over its target and shrinks by one when every
//! worker's estimate at the load the pool would have with one worker fewer is under the
//! target × the sensitivity (a fit without a slope cannot say that, unless the pool is idle;
//! an idle pool with too few steps to fit shrinks too).

use std::collections::VecDeque;
use std::fmt::Write as _;

use kvx_proto::StepSums;
use serde::Serialize;

use crate::observe::Observation;

/// A step-time model: seconds = `a + b·prompt tokens + c·decode context`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepFit {
    /// Seconds of a step that computes nothing.
    pub a: f64,
    /// Seconds per prompt token.
    pub b: f64,
    /// Seconds per token of decode context.
    pub c: f64,
    /// Steps fitted.
    pub steps: f64,
}

impl StepFit {
    /// Fewest steps a fit is made from.
    pub const MIN_STEPS: f64 = 8.0;

    /// The least-squares fit to the steps summed in `s`; `None` with fewer than
    /// [`StepFit::MIN_STEPS`]. A term that does not vary over the steps (a decode worker
    /// prefills nothing) or whose slope comes out negative (time does not fall with work) is
    /// left out and the rest refitted.
    pub fn fit(s: &StepSums) -> Option<StepFit> {
        let n = s.n;
        if n.is_nan() || n < Self::MIN_STEPS {
            return None;
        }
        let (m1, m2, my) = (s.x1 / n, s.x2 / n, s.y / n);
        let s11 = (s.x1x1 - n * m1 * m1).max(0.0);
        let s22 = (s.x2x2 - n * m2 * m2).max(0.0);
        let s12 = s.x1x2 - n * m1 * m2;
        let s1y = s.x1y - n * m1 * my;
        let s2y = s.x2y - n * m2 * my;
        let varies = |sii: f64, m: f64| sii > 1e-9 * n * (m * m + 1.0);
        let (v1, v2) = (varies(s11, m1), varies(s22, m2));
        // One term alone: its slope and the squares it explains.
        let single = |v: bool, sii: f64, siy: f64| {
            if v && siy > 0.0 { Some((siy / sii, siy * siy / sii)) } else { None }
        };
        let mut both = None;
        if v1 && v2 {
            let det = s11 * s22 - s12 * s12;
            if det > 1e-9 * s11 * s22 {
                let b = (s1y * s22 - s2y * s12) / det;
                let c = (s2y * s11 - s1y * s12) / det;
                if b >= 0.0 && c >= 0.0 {
                    both = Some((b, c));
                }
            }
        }
        let (b, c) = match both {
            Some(bc) => bc,
            None => match (single(v1, s11, s1y), single(v2, s22, s2y)) {
                (Some((b, e1)), Some((c, e2))) => {
                    if e1 >= e2 {
                        (b, 0.0)
                    } else {
                        (0.0, c)
                    }
                }
                (Some((b, _)), None) => (b, 0.0),
                (None, Some((c, _))) => (0.0, c),
                (None, None) => (0.0, 0.0),
            },
        };
        let a = my - b * m1 - c * m2;
        [a, b, c].iter().all(|v| v.is_finite()).then_some(StepFit { a, b, c, steps: n })
    }

    /// A step's seconds (never below 0).
    pub fn step_s(&self, prompt: f64, decode_context: f64) -> f64 {
        (self.a + self.b * prompt + self.c * decode_context).max(0.0)
    }

    /// Seconds to compute `tokens` prompt tokens in chunks of `chunk`, each step also
    /// decoding `decode_context`.
    pub fn prefill_s(&self, tokens: f64, chunk: f64, decode_context: f64) -> f64 {
        if tokens.is_nan() || tokens <= 0.0 {
            return 0.0;
        }
        let chunk = chunk.max(1.0);
        let full = (tokens / chunk).floor();
        let rest = tokens - full * chunk;
        let last = if rest > 0.0 { self.step_s(rest, decode_context) } else { 0.0 };
        full * self.step_s(chunk, decode_context) + last
    }
}

/// Settings of load-based sizing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadConfig {
    /// A pool shrinks only when every estimate with one worker fewer is under the target ×
    /// this.
    pub sensitivity: f64,
    /// Intervals of steps each fit is made from.
    pub window: usize,
    /// The workers' batched-token budget (the chunk a prompt is computed in).
    pub chunk_tokens: f64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig { sensitivity: 0.8, window: 8, chunk_tokens: 512.0 }
    }
}

/// What load-based sizing found for one pool.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolLoad {
    /// The fit over the window (`None`: too few steps).
    pub fit: Option<StepFit>,
    /// Workers estimated.
    pub workers: u32,
    /// The lowest and highest estimate (TTFT for prefill, ITL for decode), milliseconds.
    pub estimate_ms: (f64, f64),
    /// The highest estimate with one worker fewer, milliseconds (`None`: not possible).
    pub fewer_ms: Option<f64>,
    /// −1, 0 or +1.
    pub step: i32,
}

/// Both pools.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadView {
    /// The prefill pool.
    pub prefill: PoolLoad,
    /// The decode pool.
    pub decode: PoolLoad,
}

/// Load-based sizing's state: each pool's step sums of the last intervals.
#[derive(Debug)]
pub struct LoadSizer {
    cfg: LoadConfig,
    windows: [VecDeque<StepSums>; 2],
}

/// A worker's load in an interval.
struct Worker {
    /// Its steps.
    steps: f64,
    /// Mean prompt tokens and decode context of its steps.
    x1: f64,
    x2: f64,
    /// Share of the interval it stepped.
    busy: f64,
    /// Its time-averaged prefill queue, tokens.
    queued: f64,
}

impl LoadSizer {
    /// A sizer with no steps seen.
    pub fn new(cfg: LoadConfig) -> Self {
        LoadSizer { cfg, windows: [VecDeque::new(), VecDeque::new()] }
    }

    /// Takes the interval's steps into the fits and sizes both pools: `elapsed_s` is the
    /// interval, `isl` the prompt length a new request is expected to bring, `ttft_ms` and
    /// `itl_ms` the targets, `running` the workers of each pool now.
    pub fn observe(
        &mut self,
        obs: &Observation,
        elapsed_s: f64,
        isl: f64,
        targets: (f64, f64),
        running: (u32, u32),
    ) -> LoadView {
        let secs = elapsed_s.max(1e-3);
        let mut pools: [Vec<Worker>; 2] = [Vec::new(), Vec::new()];
        let mut sums = [StepSums::default(), StepSums::default()];
        for w in obs.steps.values() {
            let i = match w.role.as_str() {
                "prefill" => 0,
                "decode" => 1,
                _ => continue,
            };
            sums[i] = sums[i].plus(&w.sums);
            let s = &w.sums;
            let per = |v: f64| if s.n > 0.0 { v / s.n } else { 0.0 };
            pools[i].push(Worker {
                steps: s.n,
                x1: per(s.x1),
                x2: per(s.x2),
                busy: (s.y / secs).clamp(0.0, 1.0),
                queued: (s.qy / secs).max(0.0),
            });
        }
        let window = self.cfg.window.max(1);
        for (i, s) in sums.iter().enumerate() {
            let w = &mut self.windows[i];
            w.push_back(*s);
            while w.len() > window {
                w.pop_front();
            }
        }
        let fit = |i: usize| {
            let total = self.windows[i].iter().fold(StepSums::default(), |a, s| a.plus(s));
            StepFit::fit(&total)
        };
        let chunk = self.cfg.chunk_tokens;
        let sens = self.cfg.sensitivity;
        let prefill = size_pool(&pools[0], fit(0), running.0, targets.0, sens, |f, w, k| {
            // A new prompt waits for the queue, which grows with utilisation as ρ / (1 − ρ).
            let busy = w.busy * k;
            if busy >= 0.95 {
                return None;
            }
            let grow = |r: f64| r / (1.0 - r);
            let queued = if w.busy > 0.0 { w.queued * grow(busy) / grow(w.busy) } else { 0.0 };
            Some(1e3 * f.prefill_s(queued + isl, chunk, w.x2 * k))
        });
        let decode = size_pool(&pools[1], fit(1), running.1, targets.1, sens, |f, w, k| {
            Some(1e3 * f.step_s(w.x1 * k, w.x2 * k))
        });
        LoadView { prefill, decode }
    }
}

/// One pool's estimates and step; `estimate(fit, worker, k)` is a worker's latency with its
/// load × k (`None`: it could not take that load).
fn size_pool(
    workers: &[Worker],
    fit: Option<StepFit>,
    running: u32,
    target_ms: f64,
    sensitivity: f64,
    estimate: impl Fn(&StepFit, &Worker, f64) -> Option<f64>,
) -> PoolLoad {
    let mut out = PoolLoad {
        fit,
        workers: workers.len() as u32,
        estimate_ms: (0.0, 0.0),
        fewer_ms: None,
        step: 0,
    };
    if workers.is_empty() {
        return out;
    }
    let n = running.max(workers.len() as u32);
    // A pool none of whose workers stepped in the interval is idle: one fewer does as well.
    let idle = workers.iter().all(|w| w.steps == 0.0);
    let Some(f) = fit else {
        if idle && n >= 2 {
            out.fewer_ms = Some(0.0);
            out.step = -1;
        }
        return out;
    };
    let now: Vec<f64> =
        workers.iter().map(|w| estimate(&f, w, 1.0).unwrap_or(f64::INFINITY)).collect();
    let lo = now.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = now.iter().copied().fold(0.0, f64::max);
    out.estimate_ms = (lo, hi);
    if lo > target_ms {
        out.step = 1;
        return out;
    }
    // Shrinking leans on the fit's slope (more load per worker, slower steps); a fit that
    // found none (noise) says nothing about one worker fewer, unless the pool is idle.
    if n >= 2 && (f.b > 0.0 || f.c > 0.0 || idle) {
        let k = f64::from(n) / f64::from(n - 1);
        let fewer: Option<Vec<f64>> = workers.iter().map(|w| estimate(&f, w, k)).collect();
        out.fewer_ms = fewer.map(|v| v.into_iter().fold(0.0, f64::max));
        if out.fewer_ms.is_some_and(|m| m < target_ms * sensitivity) {
            out.step = -1;
        }
    }
    out
}

impl LoadView {
    /// One clause per pool for the decision's reason.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for (name, what, p) in [("prefill", "TTFT", &self.prefill), ("decode", "ITL", &self.decode)]
        {
            if !s.is_empty() {
                s.push_str("; ");
            }
            match p.fit {
                None => {
                    let _ = write!(s, "load: {name} too few steps to fit");
                }
                Some(f) => {
                    let _ = write!(
                        s,
                        "load: {name} step {:.1} ms + {:.3} ms/prompt tok + {:.5} ms/context tok ({:.0} steps), {what} {:.0}–{:.0} ms over {} workers",
                        f.a * 1e3,
                        f.b * 1e3,
                        f.c * 1e3,
                        f.steps,
                        p.estimate_ms.0,
                        p.estimate_ms.1,
                        p.workers
                    );
                    if let Some(m) = p.fewer_ms {
                        let _ = write!(s, ", {m:.0} ms with one fewer");
                    }
                    let _ = write!(s, " → {:+}", p.step);
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::WorkerSteps;

    /// Steps of `y = 2 ms + 0.01 ms·x1 + 0.001 ms·x2` over a grid of loads.
    fn sums(points: &[(f64, f64)], noise: f64) -> StepSums {
        let mut s = StepSums::default();
        for (i, &(x1, x2)) in points.iter().enumerate() {
            let wiggle = if i % 2 == 0 { noise } else { -noise };
            s.add(x1, x2, 2e-3 + 1e-5 * x1 + 1e-6 * x2 + wiggle, 0.0);
        }
        s
    }

    #[test]
    fn the_fit_recovers_a_linear_step_time() {
        let pts: Vec<(f64, f64)> =
            (0..40).map(|i| (f64::from(i % 5) * 100.0, f64::from(i / 5) * 1000.0)).collect();
        let f = StepFit::fit(&sums(&pts, 0.0)).unwrap();
        assert!((f.a - 2e-3).abs() < 1e-9, "{f:?}");
        assert!((f.b - 1e-5).abs() < 1e-11, "{f:?}");
        assert!((f.c - 1e-6).abs() < 1e-12, "{f:?}");
        // Decode only: the prompt term does not vary and is left out.
        let pts: Vec<(f64, f64)> = (0..20).map(|i| (0.0, f64::from(i) * 500.0)).collect();
        let f = StepFit::fit(&sums(&pts, 1e-4)).unwrap();
        assert_eq!(f.b, 0.0);
        assert!((f.c - 1e-6).abs() < 1e-8, "{f:?}");
        // Too few steps, and a slope that would be negative.
        assert!(StepFit::fit(&sums(&pts[..5], 0.0)).is_none());
        let mut s = StepSums::default();
        for i in 0..10 {
            s.add(f64::from(i), 0.0, 0.01 - 1e-4 * f64::from(i), 0.0);
        }
        let f = StepFit::fit(&s).unwrap();
        assert_eq!((f.b, f.c), (0.0, 0.0));
        assert!((f.step_s(0.0, 0.0) - s.y / s.n).abs() < 1e-12, "the mean");
        // Chunks: 1,100 tokens in 512s = two full chunks and 76.
        let f = StepFit { a: 1e-3, b: 1e-5, c: 0.0, steps: 10.0 };
        let want = 2.0 * (1e-3 + 512.0 * 1e-5) + (1e-3 + 76.0 * 1e-5);
        assert!((f.prefill_s(1100.0, 512.0, 0.0) - want).abs() < 1e-12);
        assert_eq!(f.prefill_s(0.0, 512.0, 0.0), 0.0);
    }

    /// An interval in which each decode worker ran `steps` steps of `context` decode
    /// context (± spread, so the fit has a slope) at `2 ms + 0.001 ms/token`.
    fn decode_obs(workers: usize, steps: u32, context: f64) -> Observation {
        let mut obs = Observation::default();
        for w in 0..workers {
            let mut s = StepSums::default();
            for i in 0..steps {
                let x2 = context * (0.5 + f64::from(i % 3) * 0.5);
                s.add(0.0, x2, 2e-3 + 1e-6 * x2, 0.0);
            }
            obs.steps
                .insert(w.to_string(), WorkerSteps { role: "decode".into(), sums: s, queued: 0.0 });
        }
        obs
    }

    #[test]
    fn decode_grows_when_every_worker_is_slow_and_shrinks_when_fewer_would_do() {
        let mut l = LoadSizer::new(LoadConfig::default());
        // 2 workers at a mean context of 60,000 tokens: ITL 62 ms > 50.
        let v = l.observe(&decode_obs(2, 99, 60_000.0), 10.0, 1000.0, (500.0, 50.0), (1, 2));
        let d = &v.decode;
        assert!((d.estimate_ms.1 - 62.0).abs() < 0.01, "{d:?}");
        assert_eq!(d.step, 1);
        assert_eq!(v.prefill.step, 0, "no prefill workers, no change");
        // At 30,000: 32 ms each; with one fewer 62 ms: no change.
        let mut l = LoadSizer::new(LoadConfig::default());
        let v = l.observe(&decode_obs(2, 99, 30_000.0), 10.0, 1000.0, (500.0, 50.0), (1, 2));
        assert_eq!((v.decode.step, v.decode.fewer_ms.map(|m| m.round())), (0, Some(62.0)));
        // 3 workers at 10,000: 12 ms; with two, 17 ms < 40: shrink.
        let mut l = LoadSizer::new(LoadConfig::default());
        let v = l.observe(&decode_obs(3, 99, 10_000.0), 10.0, 1000.0, (500.0, 50.0), (1, 3));
        assert_eq!(v.decode.step, -1, "{:?}", v.decode);
        assert!(v.describe().contains("decode step 2.0 ms"), "{}", v.describe());
        // One slow worker beside a fast one: no growth (routing evens them out).
        let mut obs = decode_obs(1, 99, 60_000.0);
        obs.steps.extend(decode_obs(2, 99, 1_000.0).steps.into_iter().filter(|(w, _)| w == "1"));
        let mut l = LoadSizer::new(LoadConfig::default());
        assert_eq!(l.observe(&obs, 10.0, 1000.0, (500.0, 50.0), (1, 2)).decode.step, 0);
    }

    #[test]
    fn an_idle_pool_shrinks_and_a_flat_fit_does_not() {
        // No steps at all: too few to fit, and idle.
        let mut obs = decode_obs(3, 0, 1000.0);
        let mut l = LoadSizer::new(LoadConfig { window: 2, ..LoadConfig::default() });
        let v = l.observe(&obs, 10.0, 1000.0, (500.0, 50.0), (1, 3));
        assert_eq!((v.decode.fit, v.decode.step), (None, -1));
        // Busy workers whose steps all take 5 ms whatever their load: no slope, no shrink.
        let mut s = StepSums::default();
        for i in 0..30 {
            s.add(0.0, 1000.0 * f64::from(i % 3 + 1), 5e-3, 0.0);
        }
        for w in obs.steps.values_mut() {
            w.sums = s;
        }
        let v = l.observe(&obs, 10.0, 1000.0, (500.0, 50.0), (1, 3));
        assert_eq!(v.decode.fit.map(|f| (f.b, f.c)), Some((0.0, 0.0)));
        assert_eq!(v.decode.step, 0, "{:?}", v.decode);
    }

    #[test]
    fn prefill_estimates_the_queue_a_prompt_waits_for() {
        // A prefill worker stepping 512-token chunks at 1 ms + 0.01 ms/token (6.12 ms each),
        // busy about half of 10 s, with 3,000 tokens queued on average.
        let mut s = StepSums::default();
        let steps = (6.0 / 6.12e-3) as u32;
        for i in 0..steps {
            let x1 = if i % 4 == 0 { 256.0 } else { 512.0 };
            s.add(x1, 0.0, 1e-3 + 1e-5 * x1, 0.0);
        }
        s.qy = 3000.0 * 10.0;
        let mut obs = Observation::default();
        obs.steps.insert("7".into(), WorkerSteps { role: "prefill".into(), sums: s, queued: 0.0 });
        let mut l = LoadSizer::new(LoadConfig::default());
        let v = l.observe(&obs, 10.0, 2000.0, (500.0, 50.0), (1, 1));
        let f = v.prefill.fit.unwrap();
        // 5,000 tokens: 9 chunks of 512 and 392.
        let want = 1e3 * f.prefill_s(5000.0, 512.0, 0.0);
        assert!((v.prefill.estimate_ms.1 - want).abs() < 1e-9);
        assert!((want - (9.0 * 6.12 + 4.92)).abs() < 0.05, "{want}");
        assert_eq!(v.prefill.step, 0, "under 500 ms; one worker cannot shrink");
        // Under a 40 ms target it grows.
        let mut l = LoadSizer::new(LoadConfig::default());
        assert_eq!(l.observe(&obs, 10.0, 2000.0, (40.0, 50.0), (1, 1)).prefill.step, 1);
        // Two workers each over half busy cannot become one.
        let mut two = obs.clone();
        two.steps.insert("8".into(), two.steps["7"].clone());
        let mut l = LoadSizer::new(LoadConfig::default());
        let v = l.observe(&two, 10.0, 2000.0, (500.0, 50.0), (1, 2));
        assert_eq!((v.prefill.step, v.prefill.fewer_ms), (0, None));
    }
}
