//! One planner process's loop body: each tick takes a read of the frontend's metrics, turns
//! it into the interval's observation, decides, hands the decision to the connector and
//! exports what it did as metrics (`kvx_planner_*`). The caller owns the clock and the I/O
//! (fetching `/metrics`, serving the planner's own).

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::connector::{Connector, ConnectorError};
use crate::observe::Sample;
use crate::plan::{Decision, Planner, Replicas};

type GaugeF = Gauge<f64, AtomicU64>;
type RoleLabel = [(&'static str, &'static str); 1];

/// Why a tick failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The frontend's metrics did not parse.
    #[error("the frontend's metrics: {0}")]
    Metrics(String),
    /// The connector failed.
    #[error("connector: {0}")]
    Connector(#[from] ConnectorError),
}

/// The planner's own metrics.
#[derive(Debug, Default)]
struct Metrics {
    desired: Family<RoleLabel, Gauge>,
    actual: Family<RoleLabel, Gauge>,
    predicted_rps: GaugeF,
    predicted_isl: GaugeF,
    predicted_osl: GaugeF,
    expected_ttft: GaugeF,
    expected_itl: GaugeF,
    correction: Family<RoleLabel, GaugeF>,
    decisions: Counter,
    errors: Counter,
}

/// The loop's state.
pub struct Driver {
    planner: Planner,
    connector: Box<dyn Connector>,
    last: Option<(Sample, Instant)>,
    started: Instant,
    metrics: Metrics,
    registry: Registry,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").field("connector", &self.connector.name()).finish_non_exhaustive()
    }
}

impl Driver {
    /// A loop over `planner` applying through `connector`.
    pub fn new(planner: Planner, connector: Box<dyn Connector>) -> Self {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        let m = &metrics;
        registry.register(
            "kvx_planner_desired_replicas",
            "Workers the planner asks for, by role",
            m.desired.clone(),
        );
        registry.register(
            "kvx_planner_actual_replicas",
            "Workers running by the connector's count, by role",
            m.actual.clone(),
        );
        registry.register(
            "kvx_planner_predicted_requests_per_second",
            "Request rate predicted for the next interval",
            m.predicted_rps.clone(),
        );
        registry.register(
            "kvx_planner_predicted_input_tokens",
            "Mean prompt tokens predicted for the next interval",
            m.predicted_isl.clone(),
        );
        registry.register(
            "kvx_planner_predicted_output_tokens",
            "Mean output tokens predicted for the next interval",
            m.predicted_osl.clone(),
        );
        registry.register(
            "kvx_planner_expected_ttft_seconds",
            "TTFT p90 expected at the replicas applied",
            m.expected_ttft.clone(),
        );
        registry.register(
            "kvx_planner_expected_itl_seconds",
            "ITL p90 expected at the replicas applied",
            m.expected_itl.clone(),
        );
        registry.register(
            "kvx_planner_correction",
            "Measured over expected latency of the last interval, by role",
            m.correction.clone(),
        );
        registry.register("kvx_planner_decisions", "Decisions made", m.decisions.clone());
        registry.register(
            "kvx_planner_errors",
            "Ticks that failed (metrics unreadable, connector errors)",
            m.errors.clone(),
        );
        Driver { planner, connector, last: None, started: Instant::now(), metrics, registry }
    }

    /// The first tick keeps what runs within the pools' bounds (nothing running: their
    /// minimum); every later one decides on what was
    /// measured since the last tick that read the metrics. `text` is the frontend's
    /// `/metrics`.
    pub fn tick(&mut self, text: &str) -> Result<Option<Decision>, DriverError> {
        let r = self.try_tick(text);
        if r.is_err() {
            self.metrics.errors.inc();
        }
        r
    }

    fn try_tick(&mut self, text: &str) -> Result<Option<Decision>, DriverError> {
        let sample = Sample::parse(text).map_err(DriverError::Metrics)?;
        let now = Instant::now();
        let Some((last, then)) = self.last.replace((sample.clone(), now)) else {
            // What runs already (a restarted planner, a Deployment's replicas) stays, within
            // the bounds; nothing running starts at the minimum.
            let c = self.planner.config();
            let running = self.connector.actual()?;
            let start = Replicas {
                prefill: running.prefill.clamp(c.prefill.min, c.prefill.max),
                decode: running.decode.clamp(c.decode.min, c.decode.max),
            };
            self.connector.apply(start, 0)?;
            let actual = self.connector.actual()?;
            self.record_replicas(start, actual);
            return Ok(None);
        };
        let obs = sample.since(&last);
        // Running: what the connector started and the frontend has seen join (a worker is
        // not running before it serves, nor once it drains); the connector's count alone
        // where the frontend reports no workers.
        let started = self.connector.actual()?;
        let up = |role: &str| obs.workers.get(role).copied().unwrap_or(0);
        let actual = if obs.workers.is_empty() {
            started
        } else {
            Replicas {
                prefill: started.prefill.min(up("prefill")),
                decode: started.decode.min(up("decode")),
            }
        };
        let elapsed = now.duration_since(then).as_secs_f64();
        let d = self.planner.decide(self.started.elapsed().as_secs_f64(), elapsed, &obs, actual);
        self.connector.apply(d.target, d.id)?;
        let m = &self.metrics;
        m.decisions.inc();
        m.predicted_rps.set(d.predicted.requests_per_s);
        m.predicted_isl.set(d.predicted.isl);
        m.predicted_osl.set(d.predicted.osl);
        m.expected_ttft.set(d.expected_ttft_ms / 1e3);
        m.expected_itl.set(d.expected_itl_ms / 1e3);
        m.correction.get_or_create(&[("role", "prefill")]).set(d.corrections.0);
        m.correction.get_or_create(&[("role", "decode")]).set(d.corrections.1);
        self.record_replicas(d.target, actual);
        Ok(Some(d))
    }

    fn record_replicas(&self, desired: Replicas, actual: Replicas) {
        let m = &self.metrics;
        for (role, d, a) in [
            ("prefill", desired.prefill, actual.prefill),
            ("decode", desired.decode, actual.decode),
        ] {
            m.desired.get_or_create(&[("role", role)]).set(i64::from(d));
            m.actual.get_or_create(&[("role", role)]).set(i64::from(a));
        }
    }

    /// What the connector runs now.
    pub fn actual(&mut self) -> Result<Replicas, DriverError> {
        Ok(self.connector.actual()?)
    }

    /// The planner's metrics in the Prometheus text format.
    pub fn encode_metrics(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannerConfig;
    use std::time::Duration;

    struct Fake(Replicas, Vec<(Replicas, u64)>);

    impl Connector for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn apply(&mut self, t: Replicas, id: u64) -> Result<(), ConnectorError> {
            self.0 = t;
            self.1.push((t, id));
            Ok(())
        }
        fn actual(&mut self) -> Result<Replicas, ConnectorError> {
            Ok(self.0)
        }
    }

    fn text(finished: u32) -> String {
        format!(
            "kvx_requests_finished_total{{reason=\"stop\"}} {finished}\nkvx_input_tokens_total {}\nkvx_output_tokens_total {}\n",
            finished * 2000,
            finished * 200
        )
    }

    #[test]
    fn the_first_tick_starts_the_minimum_and_later_ones_decide_and_export() {
        let cfg = PlannerConfig {
            interval: Duration::from_secs(10),
            predictor: crate::predict::PredictorKind::Constant,
            ..Default::default()
        };
        let profile: kvx_proto::profile::Profile =
            serde_json::from_str(include_str!("../tests/data/profile.json")).unwrap();
        let planner = Planner::new(cfg, Some(profile)).unwrap();
        let mut d = Driver::new(planner, Box::new(Fake(Replicas::default(), Vec::new())));
        assert!(d.tick(&text(0)).unwrap().is_none());
        assert_eq!(d.actual().unwrap(), Replicas { prefill: 1, decode: 1 });
        let dec = d.tick(&text(400)).unwrap().unwrap();
        assert_eq!(dec.id, 1);
        assert!(dec.target.prefill >= 1 && dec.target.decode >= 1);
        let m = d.encode_metrics();
        assert!(m.contains("kvx_planner_desired_replicas{role=\"decode\"}"), "{m}");
        assert!(m.contains("kvx_planner_predicted_requests_per_second 40.0"), "{m}");
        assert!(m.contains("kvx_planner_decisions_total 1"), "{m}");
        assert!(d.tick("kvx_input_tokens_total nope\n").is_err());
        assert!(d.encode_metrics().contains("kvx_planner_errors_total 1"));
    }
}
