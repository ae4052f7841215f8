//! Load predictors: the next interval's request count, prompt length or output length from
//! the intervals seen so far — the last value (`constant`), a moving average, Holt's linear
//! trend (double exponential smoothing; optionally damped, Gardner's φ) or a Kalman filter
//! over a local linear trend.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

/// Which predictor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PredictorKind {
    /// The next value is the last one.
    Constant,
    /// The mean of the last `window` values.
    MovingAverage {
        /// Values averaged.
        window: usize,
    },
    /// Holt's linear trend: a smoothed level and a smoothed slope, one step ahead; with
    /// `phi` < 1 the trend is damped (each step ahead adds φ times the last step's slope),
    /// so a rise that stops is not extended as far.
    Holt {
        /// Level smoothing, in (0, 1].
        alpha: f64,
        /// Trend smoothing, in (0, 1].
        beta: f64,
        /// Trend damping, in (0, 1] (1: undamped).
        phi: f64,
    },
    /// A Kalman filter on a local linear trend (level and slope as a random walk).
    Kalman {
        /// Variance of the level's and the slope's steps, relative to the observation noise.
        q: f64,
    },
}

impl PredictorKind {
    /// A predictor of this kind with no history.
    pub fn build(self) -> Predictor {
        Predictor { kind: self, state: State::default() }
    }
}

impl fmt::Display for PredictorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Constant => write!(f, "constant"),
            Self::MovingAverage { window } => write!(f, "moving-average:{window}"),
            Self::Holt { alpha, beta, phi } if *phi == 1.0 => write!(f, "holt:{alpha}:{beta}"),
            Self::Holt { alpha, beta, phi } => write!(f, "holt:{alpha}:{beta}:{phi}"),
            Self::Kalman { q } => write!(f, "kalman:{q}"),
        }
    }
}

/// A predictor name that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown predictor {0:?}: constant, moving-average[:WINDOW], holt[:ALPHA:BETA[:PHI]] or kalman[:Q]"
)]
pub struct BadPredictor(String);

impl FromStr for PredictorKind {
    type Err = BadPredictor;

    /// `constant`, `moving-average[:WINDOW]` (default 5), `holt[:ALPHA:BETA[:PHI]]` (default
    /// 0.5:0.3:1), `kalman[:Q]` (default 0.1).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadPredictor(s.to_string());
        let mut it = s.split(':');
        let name = it.next().unwrap_or_default();
        let mut num = |default: f64| -> Result<f64, BadPredictor> {
            match it.next() {
                None => Ok(default),
                Some(v) => v.parse::<f64>().ok().filter(|v| v.is_finite()).ok_or_else(bad),
            }
        };
        let kind = match name {
            "constant" => Self::Constant,
            "moving-average" => {
                let w = num(5.0)?;
                if !(1.0..=10_000.0).contains(&w) || w.fract() != 0.0 {
                    return Err(bad());
                }
                Self::MovingAverage { window: w as usize }
            }
            "holt" => {
                let (alpha, beta, phi) = (num(0.5)?, num(0.3)?, num(1.0)?);
                let unit = |v: f64| v > 0.0 && v <= 1.0;
                if !(unit(alpha) && unit(beta) && unit(phi)) {
                    return Err(bad());
                }
                Self::Holt { alpha, beta, phi }
            }
            "kalman" => {
                let q = num(0.1)?;
                if q <= 0.0 {
                    return Err(bad());
                }
                Self::Kalman { q }
            }
            _ => return Err(bad()),
        };
        if it.next().is_some() {
            return Err(bad());
        }
        Ok(kind)
    }
}

#[derive(Debug, Clone, Default)]
struct State {
    /// Values seen (the moving average's window; the constant's last value).
    recent: VecDeque<f64>,
    /// Level and slope (Holt, Kalman).
    level: f64,
    slope: f64,
    /// The Kalman filter's state covariance.
    p: [[f64; 2]; 2],
    seen: u64,
}

/// A predictor and its history.
#[derive(Debug, Clone)]
pub struct Predictor {
    kind: PredictorKind,
    state: State,
}

impl Predictor {
    /// Its kind.
    pub fn kind(&self) -> PredictorKind {
        self.kind
    }

    /// Values observed so far.
    pub fn seen(&self) -> u64 {
        self.state.seen
    }

    /// Takes one interval's value (non-finite values are ignored).
    pub fn observe(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        let s = &mut self.state;
        s.seen += 1;
        match self.kind {
            PredictorKind::Constant => {
                s.recent.clear();
                s.recent.push_back(x);
            }
            PredictorKind::MovingAverage { window } => {
                s.recent.push_back(x);
                while s.recent.len() > window.max(1) {
                    s.recent.pop_front();
                }
            }
            PredictorKind::Holt { alpha, beta, phi } => match s.seen {
                1 => (s.level, s.slope) = (x, 0.0),
                2 => (s.level, s.slope) = (x, x - s.level),
                _ => {
                    let prev = s.level;
                    s.level = alpha * x + (1.0 - alpha) * (s.level + phi * s.slope);
                    s.slope = beta * (s.level - prev) + (1.0 - beta) * phi * s.slope;
                }
            },
            PredictorKind::Kalman { q } => {
                if s.seen == 1 {
                    s.level = x;
                    s.slope = 0.0;
                    // Unsure of the slope at first, sure of the level.
                    s.p = [[1.0, 0.0], [0.0, 1.0]];
                    return;
                }
                // Predict: level += slope; P = F P F' + Q (observation noise R = 1, so q is
                // the steps' variance relative to it; values are scaled by the level).
                let scale = s.level.abs().max(1.0);
                let (q, r) = (q * scale * scale, scale * scale);
                let [[p00, p01], [p10, p11]] = s.p;
                let (l, v) = (s.level + s.slope, s.slope);
                let a00 = p00 + p01 + p10 + p11 + q;
                let a01 = p01 + p11;
                let a10 = p10 + p11;
                let a11 = p11 + q;
                // Update with the observed level.
                let k0 = a00 / (a00 + r);
                let k1 = a10 / (a00 + r);
                let e = x - l;
                s.level = l + k0 * e;
                s.slope = v + k1 * e;
                s.p = [[(1.0 - k0) * a00, (1.0 - k0) * a01], [a10 - k1 * a00, a11 - k1 * a01]];
            }
        }
    }

    /// The next interval's value (0 before anything is seen; never negative).
    pub fn predict(&self) -> f64 {
        self.predict_ahead(1.0)
    }

    /// The value `steps` intervals after the last one observed: the trend predictors extend
    /// their slope that far, the others have no trend and give their level.
    pub fn predict_ahead(&self, steps: f64) -> f64 {
        let s = &self.state;
        if s.seen == 0 {
            return 0.0;
        }
        let v = match self.kind {
            PredictorKind::Constant => s.recent.back().copied().unwrap_or(0.0),
            PredictorKind::MovingAverage { .. } => {
                s.recent.iter().sum::<f64>() / s.recent.len().max(1) as f64
            }
            PredictorKind::Holt { phi, .. } if phi < 1.0 => {
                // φ + φ² + … over `steps` steps (continued for a fraction of one).
                let h = steps.max(0.0);
                s.level + s.slope * phi * (1.0 - phi.powf(h)) / (1.0 - phi)
            }
            PredictorKind::Holt { .. } | PredictorKind::Kalman { .. } => {
                s.level + steps.max(0.0) * s.slope
            }
        };
        v.max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: &str, xs: &[f64]) -> f64 {
        let mut p = kind.parse::<PredictorKind>().unwrap().build();
        for &x in xs {
            p.observe(x);
        }
        p.predict()
    }

    #[test]
    fn names_parse_with_their_parameters_and_bad_ones_are_refused() {
        assert_eq!("constant".parse(), Ok(PredictorKind::Constant));
        assert_eq!("moving-average:3".parse(), Ok(PredictorKind::MovingAverage { window: 3 }));
        assert_eq!("holt".parse(), Ok(PredictorKind::Holt { alpha: 0.5, beta: 0.3, phi: 1.0 }));
        let damped: PredictorKind = "holt:0.5:0.3:0.8".parse().unwrap();
        assert_eq!(damped, PredictorKind::Holt { alpha: 0.5, beta: 0.3, phi: 0.8 });
        assert_eq!(damped.to_string(), "holt:0.5:0.3:0.8");
        assert!("holt:0.5:0.3:0".parse::<PredictorKind>().is_err());
        assert_eq!("kalman:0.5".parse(), Ok(PredictorKind::Kalman { q: 0.5 }));
        for bad in [
            "",
            "arima",
            "holt:0",
            "holt:1.5:0.1",
            "moving-average:0",
            "moving-average:2.5",
            "kalman:-1",
            "constant:1",
            "kalman:nan",
        ] {
            assert!(bad.parse::<PredictorKind>().is_err(), "{bad}");
        }
        let k: PredictorKind = "holt:0.4:0.2".parse().unwrap();
        assert_eq!(k.to_string().parse::<PredictorKind>().unwrap(), k);
    }

    #[test]
    fn constant_and_moving_average() {
        assert_eq!(run("constant", &[]), 0.0);
        assert_eq!(run("constant", &[3.0, 9.0]), 9.0);
        assert_eq!(run("moving-average:2", &[1.0, 3.0, 5.0]), 4.0);
        assert_eq!(run("moving-average:5", &[2.0, f64::NAN, 4.0]), 3.0, "NaN is skipped");
    }

    #[test]
    fn trend_predictors_follow_a_ramp_and_settle_on_a_level() {
        let ramp: Vec<f64> = (0..20).map(|i| 10.0 + 2.0 * f64::from(i)).collect();
        // The next value of the ramp is 50; the constant predictor lags by a step.
        assert_eq!(run("constant", &ramp), 48.0);
        for k in ["holt", "kalman:0.1"] {
            let v = run(k, &ramp);
            assert!((v - 50.0).abs() < 0.5, "{k}: {v}");
        }
        let flat = [7.0; 30];
        for k in ["holt", "kalman:0.1", "moving-average"] {
            assert!((run(k, &flat) - 7.0).abs() < 1e-6, "{k}");
        }
        // A fall below zero is predicted as zero.
        let fall: Vec<f64> = (0..10).map(|i| 20.0 - 5.0 * f64::from(i)).collect();
        assert_eq!(run("holt", &fall), 0.0);
        // Further ahead, the slope is extended; without a trend the level stays.
        let mut h = "holt".parse::<PredictorKind>().unwrap().build();
        let mut c = PredictorKind::Constant.build();
        for &x in &ramp {
            h.observe(x);
            c.observe(x);
        }
        assert!((h.predict_ahead(1.5) - 51.0).abs() < 0.5, "{}", h.predict_ahead(1.5));
        assert!((h.predict_ahead(0.0) - 48.0).abs() < 0.5);
        assert_eq!(c.predict_ahead(3.0), 48.0);
    }

    #[test]
    fn kalman_smooths_noise_better_than_the_last_value() {
        // A level of 100 with alternating noise of ±20: the last value is off by 20.
        let xs: Vec<f64> = (0..40).map(|i| if i % 2 == 0 { 120.0 } else { 80.0 }).collect();
        let k = run("kalman:0.01", &xs);
        assert!((k - 100.0).abs() < 15.0, "{k}");
        assert!((run("constant", &xs) - 100.0).abs() >= 20.0);
    }

    /// A damped trend extends a slope less far: after a steady rise that stops, the damped
    /// prediction ahead is between the level and the undamped one, and each further step
    /// adds φ times the last.
    #[test]
    fn a_damped_trend_stops_short_of_the_straight_line() {
        let rise = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let feed = |k: &str| {
            let mut p = k.parse::<PredictorKind>().unwrap().build();
            for &x in &rise {
                p.observe(x);
            }
            p
        };
        let (straight, damped) = (feed("holt:0.5:0.3"), feed("holt:0.5:0.3:0.5"));
        assert!(
            (straight.predict_ahead(2.0) - 8.0).abs() < 1e-9,
            "{}",
            straight.predict_ahead(2.0)
        );
        let (d0, d1, d2) =
            (damped.predict_ahead(0.0), damped.predict_ahead(1.0), damped.predict_ahead(2.0));
        assert!(d0 < d1 && d1 < d2 && d2 < straight.predict_ahead(2.0), "{d0} {d1} {d2}");
        // Each step adds φ = 0.5 times the last one's.
        assert!(((d2 - d1) - 0.5 * (d1 - d0)).abs() < 1e-9, "{d0} {d1} {d2}");
    }
}
