//! Router metrics as plain counters and a fixed-bucket histogram; the caller exports them
//! (Prometheus or anything else).

use std::time::Duration;

use crate::index::TIERS;

/// Upper bounds, in microseconds, of the decision-latency buckets (a last, unbounded bucket
/// follows).
pub const LATENCY_BOUNDS_US: [u64; 14] =
    [1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 100_000];

/// A cumulative-friendly latency histogram with the fixed bounds of [`LATENCY_BOUNDS_US`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: [u64; LATENCY_BOUNDS_US.len() + 1],
    sum_ns: u64,
}

impl LatencyHistogram {
    /// Counts one observation.
    pub fn record(&mut self, d: Duration) {
        let us = d.as_micros();
        let i = LATENCY_BOUNDS_US
            .iter()
            .position(|&b| us <= b as u128)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.counts[i] += 1;
        self.sum_ns = self.sum_ns.saturating_add(d.as_nanos().min(u64::MAX as u128) as u64);
    }

    /// Observations per bucket (not cumulative), the last one unbounded.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Sum of all observations.
    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_ns)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1), in microseconds; `None`
    /// when empty or when it falls in the unbounded bucket.
    pub fn quantile_upper_us(&self, q: f64) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return LATENCY_BOUNDS_US.get(i).copied();
            }
        }
        None
    }
}

/// Counters of the router's decisions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterMetrics {
    /// Selections made.
    pub decisions: u64,
    /// Full prompt blocks of the selected requests.
    pub requested_blocks: u64,
    /// Of those, blocks cached on the chosen worker (any tier).
    pub cached_blocks: u64,
    /// Cached blocks on the chosen worker by best tier (see [`crate::TIER_ORDER`]).
    pub cached_blocks_by_tier: [u64; TIERS],
    /// Events ignored because their worker was not registered.
    pub events_unknown_worker: u64,
    /// Load reports applied.
    pub load_reports: u64,
    /// Requests freed by expiry.
    pub expired_requests: u64,
    /// Decision latency, as recorded by the caller.
    pub decision_latency: LatencyHistogram,
}

impl RouterMetrics {
    /// Cached blocks / requested blocks over all decisions (0 before any).
    pub fn hit_rate(&self) -> f64 {
        if self.requested_blocks == 0 {
            0.0
        } else {
            self.cached_blocks as f64 / self.requested_blocks as f64
        }
    }

    /// Mean cached blocks per decision.
    pub fn overlap_per_decision(&self) -> f64 {
        if self.decisions == 0 { 0.0 } else { self.cached_blocks as f64 / self.decisions as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile_upper_us(0.5), None);
        for us in [0, 1, 3, 7, 7, 40, 900, 200_000] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 8);
        assert_eq!(h.counts()[0], 2);
        assert_eq!(h.counts()[2], 1);
        assert_eq!(h.counts()[3], 2);
        assert_eq!(h.counts()[LATENCY_BOUNDS_US.len()], 1);
        assert_eq!(h.quantile_upper_us(0.5), Some(10));
        assert_eq!(h.quantile_upper_us(0.0), Some(1));
        assert_eq!(h.quantile_upper_us(1.0), None);
        assert_eq!(h.sum(), Duration::from_micros(200_958));
    }

    #[test]
    fn rates() {
        let mut m = RouterMetrics::default();
        assert_eq!(m.hit_rate(), 0.0);
        assert_eq!(m.overlap_per_decision(), 0.0);
        m.decisions = 2;
        m.requested_blocks = 10;
        m.cached_blocks = 4;
        assert_eq!(m.hit_rate(), 0.4);
        assert_eq!(m.overlap_per_decision(), 2.0);
    }
}
