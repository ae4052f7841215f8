//! Times one sampled draw over a 49,152-token vocabulary (the default model's) for logits
//! of a few spreads (Gaussian, σ = 1 to 5: flat to peaked) and a few settings of
//! temperature and top-p. Usage: `cargo run --release -p kvx-engine --example sampler_time`.

use std::time::Instant;

use kvx_engine::sampler::{Sampler, SamplerState, SamplingParams};
use rand::{Rng, SeedableRng};

fn main() {
    let v = 49_152;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for sigma in [1.0f32, 2.0, 3.0, 5.0] {
        // Box-Muller: standard normal logits, scaled.
        let logits: Vec<f32> = (0..v)
            .map(|_| {
                let (a, b): (f64, f64) = (rng.random(), rng.random());
                let z = (-2.0 * a.max(1e-12).ln()).sqrt() * (std::f64::consts::TAU * b).cos();
                z as f32 * sigma
            })
            .collect();
        for (temperature, top_p, top_k) in
            [(0.8f32, 0.95f32, 0usize), (0.8, 1.0, 0), (1.0, 0.9, 0), (0.8, 0.95, 40)]
        {
            let params =
                SamplingParams { temperature, top_p, top_k, seed: Some(1), ..Default::default() };
            let mut s = Sampler::new(v);
            let mut st = SamplerState::new(&params, 1);
            let mut check = 0u64;
            for _ in 0..20 {
                check += u64::from(s.sample(&params, &mut st, &logits, false).token);
            }
            let n = 200;
            let t0 = Instant::now();
            for _ in 0..n {
                check += u64::from(s.sample(&params, &mut st, &logits, false).token);
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
            let t0 = Instant::now();
            for _ in 0..n {
                check += u64::from(s.sample(&params, &mut st, &logits, true).token);
            }
            let lp = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
            println!(
                "sigma {sigma} temperature {temperature} top_p {top_p} top_k {top_k}: {us:.1} us \
                 a draw, {lp:.1} with its log-probability (token sum {check})"
            );
        }
        // A prompt token's score with its 5 most likely tokens (`echo` with `logprobs: 5`).
        let mut s = Sampler::new(v);
        let mut out = Vec::new();
        let mut sum = 0.0f32;
        let n = 200;
        let t0 = Instant::now();
        for t in 0..n {
            sum += s.score(&logits, t, 5, &mut out);
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
        println!("sigma {sigma}: {us:.1} us a prompt token's score and top 5 (sum {sum:.3})");
    }
}
