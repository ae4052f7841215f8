//! Choosing among scored workers: argmin with a uniform random tie-break, or a softmax over
//! min-max-normalized costs at a temperature.

use rand::Rng;

/// The index of the smallest cost; ties are broken uniformly at random (reservoir sampling,
/// one draw per tie). `None` for an empty slice.
pub fn pick_min<R: Rng + ?Sized>(costs: &[f64], rng: &mut R) -> Option<usize> {
    let mut best: Option<usize> = None;
    let mut ties = 0u32;
    for (i, &c) in costs.iter().enumerate() {
        match best {
            Some(b) if c > costs[b] => {}
            Some(b) if c == costs[b] => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some(i);
                }
            }
            _ => {
                best = Some(i);
                ties = 1;
            }
        }
    }
    best
}

/// Samples an index with probability ∝ `exp(−(c − c_min) / ((c_max − c_min) · temperature))`;
/// uniform when all costs are equal; [`pick_min`] when `temperature` is not positive.
pub fn pick_softmax<R: Rng + ?Sized>(
    costs: &[f64],
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    if temperature <= 0.0 || costs.len() < 2 {
        return pick_min(costs, rng);
    }
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    if range <= 0.0 || !range.is_finite() {
        return Some(rng.random_range(0..costs.len()));
    }
    let scale = 1.0 / (range * temperature);
    let weight = |c: f64| (-(c - min) * scale).exp();
    // The minimum has weight 1, so the sum is at least 1.
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut u = rng.random::<f64>() * total;
    let mut last = 0;
    for (i, &c) in costs.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            last = i;
            if u < w {
                return Some(i);
            }
            u -= w;
        }
    }
    Some(last)
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn argmin_and_empty() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert_eq!(pick_min(&[], &mut rng), None);
        assert_eq!(pick_min(&[3.0, 1.0, 2.0], &mut rng), Some(1));
        assert_eq!(pick_softmax(&[3.0, 1.0, 2.0], 0.0, &mut rng), Some(1));
        assert_eq!(pick_softmax(&[3.0], 1.0, &mut rng), Some(0));
    }

    #[test]
    fn ties_are_uniform() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let costs = [2.0, 1.0, 5.0, 1.0, 1.0, 9.0];
        let mut hits = [0u32; 6];
        let n = 30_000;
        for _ in 0..n {
            hits[pick_min(&costs, &mut rng).unwrap()] += 1;
        }
        assert_eq!(hits[0] + hits[2] + hits[5], 0);
        for &i in &[1, 3, 4] {
            // Expected 10000 each; 5 standard deviations is about 400.
            assert!((hits[i] as i64 - 10_000).abs() < 400, "{hits:?}");
        }
    }

    #[test]
    fn softmax_follows_the_formula() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let costs = [10.0, 11.0, 12.0];
        let t = 0.5;
        let w: Vec<f64> = costs.iter().map(|c: &f64| (-(c - 10.0) / (2.0 * t)).exp()).collect();
        let total: f64 = w.iter().sum();
        let n = 60_000;
        let mut hits = [0u32; 3];
        for _ in 0..n {
            hits[pick_softmax(&costs, t, &mut rng).unwrap()] += 1;
        }
        for i in 0..3 {
            let p = w[i] / total;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!((hits[i] as f64 - n as f64 * p).abs() < 5.0 * sd, "{hits:?} vs {p}");
        }
    }

    #[test]
    fn softmax_equal_costs_are_uniform_and_low_temperature_is_greedy() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut hits = [0u32; 4];
        for _ in 0..20_000 {
            hits[pick_softmax(&[4.0; 4], 1.0, &mut rng).unwrap()] += 1;
        }
        assert!(hits.iter().all(|&h| (h as i64 - 5000).abs() < 350), "{hits:?}");
        for _ in 0..1000 {
            assert_eq!(pick_softmax(&[5.0, 1.0, 9.0], 1e-6, &mut rng), Some(1));
        }
    }

    #[test]
    fn higher_temperature_spreads_choices() {
        let costs = [0.0, 1.0, 2.0, 3.0];
        let spread = |t: f64| {
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            (0..10_000).filter(|_| pick_softmax(&costs, t, &mut rng) != Some(0)).count()
        };
        let (a, b, c) = (spread(0.1), spread(1.0), spread(10.0));
        assert!(a < b && b < c, "{a} {b} {c}");
    }
}
