//! Length distributions for synthetic prompts and outputs: fixed, normal, uniform, lognormal.

use std::fmt;
use std::str::FromStr;

use rand::Rng;
use rand_distr::{Distribution, LogNormal, Normal};
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// A distribution of token counts. Samples are rounded to the nearest integer and clamped to
/// at least 1.
///
/// Text form (used on the command line): `128` (fixed), `normal:MEAN,STDDEV`,
/// `uniform:MIN,MAX` (inclusive), `lognormal:MEAN,STDDEV` (the mean and standard deviation of
/// the lengths themselves, not of their logarithm).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LengthDist {
    /// Always the same length.
    Fixed {
        /// The length.
        value: u32,
    },
    /// Normal with the given mean and standard deviation.
    Normal {
        /// Mean length.
        mean: f64,
        /// Standard deviation.
        stddev: f64,
    },
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest length.
        min: u32,
        /// Largest length.
        max: u32,
    },
    /// Lognormal whose lengths have the given mean and standard deviation.
    LogNormal {
        /// Mean length.
        mean: f64,
        /// Standard deviation of the lengths.
        stddev: f64,
    },
}

impl LengthDist {
    /// A fixed length.
    pub fn fixed(value: u32) -> Self {
        Self::Fixed { value }
    }

    /// Checks the parameters; every constructor path ends here before sampling.
    pub fn validate(&self) -> Result<(), BenchError> {
        let ok = match *self {
            Self::Fixed { value } => value >= 1,
            Self::Normal { mean, stddev } | Self::LogNormal { mean, stddev } => {
                mean.is_finite() && mean >= 1.0 && stddev.is_finite() && stddev >= 0.0
            }
            Self::Uniform { min, max } => min >= 1 && min <= max,
        };
        if ok { Ok(()) } else { Err(BenchError::config(format!("bad length distribution {self}"))) }
    }

    /// The mean of the distribution (before clamping).
    pub fn mean(&self) -> f64 {
        match *self {
            Self::Fixed { value } => f64::from(value),
            Self::Normal { mean, .. } | Self::LogNormal { mean, .. } => mean,
            Self::Uniform { min, max } => (f64::from(min) + f64::from(max)) / 2.0,
        }
    }

    /// The largest value a sample can take, where bounded (used to size buffers).
    pub fn upper_bound(&self) -> Option<u32> {
        match *self {
            Self::Fixed { value } => Some(value),
            Self::Uniform { max, .. } => Some(max),
            _ => None,
        }
    }

    /// Draws one length (at least 1).
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        let x = match *self {
            Self::Fixed { value } => return value.max(1),
            Self::Uniform { min, max } => return rng.random_range(min..=max).max(1),
            Self::Normal { mean, stddev } => match Normal::new(mean, stddev) {
                Ok(d) => d.sample(rng),
                Err(_) => mean,
            },
            Self::LogNormal { mean, stddev } => {
                // For lengths L with mean m and deviation s: sigma^2 = ln(1 + s^2/m^2),
                // mu = ln(m) - sigma^2 / 2.
                let sigma2 = (1.0 + (stddev * stddev) / (mean * mean)).ln();
                let mu = mean.ln() - sigma2 / 2.0;
                match LogNormal::new(mu, sigma2.sqrt()) {
                    Ok(d) => d.sample(rng),
                    Err(_) => mean,
                }
            }
        };
        // Clamp in f64 first: `as` saturates, and NaN maps to 0 which the max() lifts to 1.
        (x.round().clamp(1.0, f64::from(u32::MAX)) as u32).max(1)
    }
}

impl fmt::Display for LengthDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Fixed { value } => write!(f, "{value}"),
            Self::Normal { mean, stddev } => write!(f, "normal:{mean},{stddev}"),
            Self::Uniform { min, max } => write!(f, "uniform:{min},{max}"),
            Self::LogNormal { mean, stddev } => write!(f, "lognormal:{mean},{stddev}"),
        }
    }
}

impl FromStr for LengthDist {
    type Err = BenchError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            BenchError::config(format!(
                "bad length distribution {s:?}: expected N, normal:MEAN,STD, uniform:MIN,MAX or lognormal:MEAN,STD"
            ))
        };
        let s = s.trim();
        let dist = match s.split_once(':') {
            None => Self::Fixed { value: s.parse().map_err(|_| bad())? },
            Some((kind, args)) => {
                let (a, b) = args.split_once(',').ok_or_else(bad)?;
                let (a, b) = (a.trim(), b.trim());
                match kind.trim() {
                    "fixed" => return Err(bad()),
                    "normal" => Self::Normal {
                        mean: a.parse().map_err(|_| bad())?,
                        stddev: b.parse().map_err(|_| bad())?,
                    },
                    "uniform" => Self::Uniform {
                        min: a.parse().map_err(|_| bad())?,
                        max: b.parse().map_err(|_| bad())?,
                    },
                    "lognormal" => Self::LogNormal {
                        mean: a.parse().map_err(|_| bad())?,
                        stddev: b.parse().map_err(|_| bad())?,
                    },
                    _ => return Err(bad()),
                }
            }
        };
        dist.validate()?;
        Ok(dist)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn stats(d: LengthDist, n: usize) -> (f64, f64, u32, u32) {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<f64> = (0..n).map(|_| f64::from(d.sample(&mut rng))).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let min = xs.iter().copied().fold(f64::MAX, f64::min) as u32;
        let max = xs.iter().copied().fold(0.0, f64::max) as u32;
        (mean, var.sqrt(), min, max)
    }

    #[test]
    fn parses_every_form_and_round_trips() {
        for s in ["128", "normal:100,10", "uniform:5,9", "lognormal:200,80"] {
            let d: LengthDist = s.parse().unwrap();
            assert_eq!(d.to_string().parse::<LengthDist>().unwrap(), d);
        }
        for bad in ["", "0", "x", "normal:1", "uniform:9,5", "gamma:1,2", "normal:-5,1"] {
            assert!(bad.parse::<LengthDist>().is_err(), "{bad}");
        }
    }

    #[test]
    fn samples_have_the_requested_moments() {
        let (m, s, ..) = stats("normal:300,30".parse().unwrap(), 20_000);
        assert!((m - 300.0).abs() < 2.0 && (s - 30.0).abs() < 2.0, "{m} {s}");
        let (m, s, ..) = stats("lognormal:300,150".parse().unwrap(), 50_000);
        assert!((m - 300.0).abs() < 6.0 && (s - 150.0).abs() < 10.0, "{m} {s}");
        let (_, _, lo, hi) = stats("uniform:10,20".parse().unwrap(), 5_000);
        assert_eq!((lo, hi), (10, 20));
        let (m, s, lo, _) = stats("normal:2,50".parse().unwrap(), 1000);
        assert!(lo >= 1 && m > 0.0 && s > 0.0);
    }

    #[test]
    fn sampling_is_deterministic_for_a_seed() {
        let d: LengthDist = "lognormal:100,40".parse().unwrap();
        let a: Vec<u32> =
            (0..50).scan(ChaCha8Rng::seed_from_u64(3), |r, _| Some(d.sample(r))).collect();
        let b: Vec<u32> =
            (0..50).scan(ChaCha8Rng::seed_from_u64(3), |r, _| Some(d.sample(r))).collect();
        assert_eq!(a, b);
    }
}
