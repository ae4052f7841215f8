//! The batch knee: the fewest sequences an engine decodes at once that give most of the decode
//! throughput its sequence slots would. A decode step's time is fitted against its batch as
//! the engine runs, `t = a + b·B` (the fixed cost of a step — reading the weights — and each
//! sequence's own), over its decode-only steps with exponential forgetting; throughput
//! `B / (a + b·B)` then saturates at `1/b`, and past the knee more sequences only lengthen
//! every step. The admission queue bounds the requests running at once by the engines'
//! knees, so under overload the engines run where throughput is already had and the rest
//! wait (or are refused) in front of them instead of slowing every running request.

/// Steps over which a step's weight in the fit halves.
const HALF_LIFE_STEPS: f64 = 2048.0;
/// Least effective number of steps before a fit is trusted.
const MIN_STEPS: f64 = 64.0;
/// Least spread of the batch (standard deviation, sequences) before a fit is trusted: the
/// slope needs batches of different sizes.
const MIN_BATCH_SD: f64 = 1.0;
/// Least mean step time before a fit is trusted: steps faster than this are overhead (a
/// mocker at a high speed-up), not a cost that grows with the batch.
const MIN_STEP_SECS: f64 = 1e-3;
/// Least share of the step times' variance the fit must explain.
const MIN_R2: f64 = 0.5;

/// Share of the throughput at the engine's sequence slots the knee keeps.
pub const KNEE_SHARE: f64 = 0.9;

/// The least knee an engine reports (at most its slots).
pub const FLOOR_PER_ENGINE: usize = 4;

/// Decaying least-squares sums of decode steps' batch `B` and time `t` (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KneeFit {
    w: f64,
    b: f64,
    bb: f64,
    t: f64,
    bt: f64,
    tt: f64,
}

impl KneeFit {
    /// Counts a decode-only step of `batch` sequences that took `secs`.
    pub fn add(&mut self, batch: usize, secs: f64) {
        if batch == 0 || !secs.is_finite() || secs < 0.0 {
            return;
        }
        let d = 0.5f64.powf(1.0 / HALF_LIFE_STEPS);
        let (b, t) = (batch as f64, secs);
        self.w = self.w * d + 1.0;
        self.b = self.b * d + b;
        self.bb = self.bb * d + b * b;
        self.t = self.t * d + t;
        self.bt = self.bt * d + b * t;
        self.tt = self.tt * d + t * t;
    }

    /// The fit `(a, b)` in seconds (a step's fixed cost, each sequence's), when the steps
    /// seen support one: enough of them, batches of different sizes, steps that take time,
    /// both terms positive and most of the variance explained.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.w < MIN_STEPS {
            return None;
        }
        let n = self.w;
        let (mb, mt) = (self.b / n, self.t / n);
        let vb = self.bb / n - mb * mb;
        let vt = self.tt / n - mt * mt;
        let cbt = self.bt / n - mb * mt;
        if vb < MIN_BATCH_SD * MIN_BATCH_SD || mt < MIN_STEP_SECS || vt <= 0.0 {
            return None;
        }
        let slope = cbt / vb;
        let intercept = mt - slope * mb;
        let r2 = cbt * cbt / (vb * vt);
        (slope > 0.0 && intercept > 0.0 && r2 >= MIN_R2).then_some((intercept, slope))
    }

    /// The knee for an engine of `slots` sequence slots: the fewest sequences whose decode
    /// throughput is [`KNEE_SHARE`] of what `slots` give, by the fit, and no fewer than
    /// [`FLOOR_PER_ENGINE`] (at most `slots`); `None` without a fit.
    pub fn knee(&self, slots: usize) -> Option<usize> {
        let (a, b) = self.fit()?;
        Some(knee_of(a, b, slots, KNEE_SHARE).max(FLOOR_PER_ENGINE.min(slots.max(1))))
    }
}

/// The fewest sequences `k` with `k / (a + b·k) ≥ share · s / (a + b·s)`, `s = slots`.
fn knee_of(a: f64, b: f64, slots: usize, share: f64) -> usize {
    let s = slots.max(1) as f64;
    let k = share * s * a / (a + (1.0 - share) * s * b);
    (k.ceil() as usize).clamp(1, slots.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fitted(a: f64, b: f64, batches: impl Iterator<Item = usize>) -> KneeFit {
        let mut f = KneeFit::default();
        for (i, n) in batches.enumerate() {
            // ±2 % noise that does not follow the batch.
            let noise = 1.0 + 0.02 * ((i * 7919 % 13) as f64 / 6.0 - 1.0);
            f.add(n, (a + b * n as f64) * noise);
        }
        f
    }

    #[test]
    fn the_fit_recovers_the_step_costs_and_the_knee_keeps_the_throughput_share() {
        // 4 ms a step, 1.25 ms a sequence, batches 1..=32 again and again.
        let f = fitted(4e-3, 1.25e-3, (0..2000).map(|i| 1 + i % 32));
        let (a, b) = f.fit().expect("a fit");
        assert!((a - 4e-3).abs() < 2e-4 && (b - 1.25e-3).abs() < 2e-5, "{a} {b}");
        let k = f.knee(64).unwrap();
        let thr = |n: usize| n as f64 / (a + b * n as f64);
        assert!(thr(k) >= KNEE_SHARE * thr(64), "{k}");
        assert!(thr(k - 1) < KNEE_SHARE * thr(64), "{k} is the fewest");
        assert!((15..=22).contains(&k), "{k}");
        // Where a step is all fixed cost, throughput grows with the batch to the slots: the
        // knee is 90% of them; where it is all per sequence, one.
        assert_eq!(knee_of(1.0, 1e-9, 64, KNEE_SHARE), 58);
        assert_eq!(knee_of(1e-9, 1.0, 64, KNEE_SHARE), 1);
    }

    #[test]
    fn no_fit_without_spread_time_or_a_cost_that_grows_with_the_batch() {
        // One batch size only.
        assert_eq!(fitted(4e-3, 1e-3, std::iter::repeat_n(8, 500)).fit(), None);
        // Too few steps.
        assert_eq!(fitted(4e-3, 1e-3, (0..40).map(|i| 1 + i % 8)).fit(), None);
        // Steps of microseconds (a fast mocker).
        assert_eq!(fitted(4e-6, 1e-6, (0..500).map(|i| 1 + i % 8)).fit(), None);
        // Time that does not follow the batch.
        let mut f = KneeFit::default();
        for i in 0..500 {
            f.add(1 + i % 8, 5e-3 + 4e-3 * ((i * 37 % 11) as f64 / 10.0));
        }
        assert_eq!(f.fit(), None);
        assert_eq!(f.knee(64), None);
    }

    #[test]
    fn old_steps_are_forgotten() {
        // Slow steps long ago, then a faster machine: the fit follows the recent ones.
        let mut f = fitted(20e-3, 5e-3, (0..4000).map(|i| 1 + i % 16));
        for n in (0..20_000).map(|i| 1 + i % 16) {
            f.add(n, 4e-3 + 1e-3 * n as f64);
        }
        let (a, b) = f.fit().unwrap();
        assert!((a - 4e-3).abs() < 5e-4 && (b - 1e-3).abs() < 1e-4, "{a} {b}");
    }
}
