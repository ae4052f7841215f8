//! The mocker backend: the real scheduler and block pool with a timing model instead of
//! kernels, for testing and benchmarking everything around the engine (ingress, routers,
//! planners) without computing a model.
//!
//! The timing model is Dynamo's mocker's, so router comparisons are like for like:
//! a step that prefills `t` uncached tokens takes `4.21e-7·t² + 0.01518·t + 16.5` ms, a step
//! that decodes at KV usage `p` (fraction of blocks in use) takes `−25.74·p² + 54.01·p + 5.74`
//! ms; both are divided by `speedup`. Tokens are drawn from a deterministic hash of the
//! position so runs are reproducible; end-of-generation ids can be avoided so requests run
//! to `max_tokens`. The drawn token's logit stands [`HOT_LOGIT`] above all others, so any
//! sampling a request asks for (temperatures up to 2, penalties, truncations) picks it: the
//! token stream does not depend on the sampler's random draws.

use std::time::{Duration, Instant};

use kvx_kernels::model::{AttnMode, Logits, SeqChunk};

use crate::EngineError;
use crate::engine::Backend;

/// The logit of the mocker's token; every other logit is 0. At temperature 2 the other
/// 49k tokens of a real vocabulary together have a probability below 1e-16.
pub const HOT_LOGIT: f32 = 100.0;

/// Mocker settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MockConfig {
    /// Vocabulary size (a small one for tokenizer-free runs, the model's to pair with its
    /// tokenizer).
    pub n_vocab: usize,
    /// KV blocks.
    pub n_blocks: usize,
    /// Time is divided by this (use a large value for a near-zero-latency engine).
    pub speedup: f64,
    /// Token ids the mocker never emits (e.g. end-of-generation ids).
    pub avoid: Vec<u32>,
}

/// The mocker backend.
#[derive(Debug)]
pub struct MockBackend {
    cfg: MockConfig,
    clock: Option<Instant>,
}

impl MockBackend {
    /// A mocker.
    pub fn new(cfg: MockConfig) -> Self {
        MockBackend { cfg, clock: None }
    }

    /// Simulated duration of a step (before the speedup).
    pub fn step_ms(prefill_tokens: usize, kv_usage: f64, decodes: bool) -> f64 {
        let t = prefill_tokens as f64;
        let prefill = if prefill_tokens > 0 { 4.21e-7 * t * t + 0.01518 * t + 16.5 } else { 0.0 };
        let p = kv_usage.clamp(0.0, 1.0);
        let decode = if decodes { -25.74 * p * p + 54.01 * p + 5.74 } else { 0.0 };
        prefill + decode
    }

    fn token(&self, pos: usize, seed: u32) -> u32 {
        let n = self.cfg.n_vocab.max(1) as u64;
        let mut h = (pos as u64 ^ (u64::from(seed) << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        loop {
            h ^= h >> 29;
            let t = (h % n) as u32;
            if !self.cfg.avoid.contains(&t) || self.cfg.avoid.len() as u64 >= n {
                return t;
            }
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9).wrapping_add(1);
        }
    }

    /// One row of logits: [`HOT_LOGIT`] at the drawn token, 0 elsewhere.
    fn fill_logits(&self, out: &mut [f32], pos: usize, seed: u32) {
        out.fill(0.0);
        if let Some(l) = out.get_mut(self.token(pos, seed) as usize) {
            *l = HOT_LOGIT;
        }
    }
}

impl Backend for MockBackend {
    fn forward(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), EngineError> {
        let mut prefill = 0;
        let mut decodes = false;
        let mut blocks = 0;
        for c in chunks {
            match c.mode {
                AttnMode::Prefill => prefill += c.tokens.len(),
                AttnMode::Decode if c.tokens.len() > 1 => prefill += c.tokens.len(),
                AttnMode::Decode => decodes = true,
            }
            if c.logits.wanted() {
                blocks += c.block_table.len();
            }
        }
        let usage = blocks as f64 / self.cfg.n_blocks.max(1) as f64;
        let ms = Self::step_ms(prefill, usage, decodes) / self.cfg.speedup.max(1e-9);
        let v = self.cfg.n_vocab;
        let mut row = 0;
        for c in chunks.iter().filter(|c| c.logits.wanted()) {
            // A scored chunk has a row per token; the others one for their last.
            let first = if c.logits == Logits::All { 1 } else { c.tokens.len() };
            for end in first..=c.tokens.len() {
                let out = logits
                    .get_mut(row * v..(row + 1) * v)
                    .ok_or_else(|| EngineError::Internal("logits buffer too small".into()))?;
                let seed = c.tokens.first().copied().unwrap_or(0);
                self.fill_logits(out, c.start_pos + end, seed);
                row += 1;
            }
        }
        // Wait out the simulated step, measured from the end of the previous one so that
        // engine overhead is part of the budget rather than added to it.
        let now = Instant::now();
        let start =
            self.clock.filter(|&c| c <= now && now - c < Duration::from_millis(2)).unwrap_or(now);
        let until = start + Duration::from_secs_f64(ms / 1e3);
        sleep_until(until);
        // The deadline, not the wake-up time: oversleeping shortens the next step's wait.
        self.clock = Some(until);
        Ok(())
    }

    fn n_vocab(&self) -> usize {
        self.cfg.n_vocab
    }

    fn n_blocks(&self) -> usize {
        self.cfg.n_blocks
    }

    /// Nothing to copy: the mocker holds no KV.
    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), EngineError> {
        Ok(())
    }

    /// Any prompt token id: the mocker computes nothing from them but block hashes, so a
    /// tokenizer-free mocker with a tiny vocabulary serves prompts tokenized by a frontend
    /// with the real model's vocabulary.
    fn prompt_vocab(&self) -> usize {
        u32::MAX as usize + 1
    }
}

/// Sleeps until `t` without spinning: a late wake-up (the OS timer slack, tens of
/// microseconds) does not accumulate, because the next step's budget is measured from this
/// step's deadline; and hundreds of mock engines in one process cost no CPU while they wait.
fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_model_matches_dynamo_formulas() {
        assert!(
            (MockBackend::step_ms(100, 0.0, false) - (4.21e-7 * 1e4 + 1.518 + 16.5)).abs() < 1e-9
        );
        assert!(
            (MockBackend::step_ms(0, 0.5, true) - (-25.74 * 0.25 + 27.005 + 5.74)).abs() < 1e-9
        );
        assert_eq!(MockBackend::step_ms(0, 0.3, false), 0.0);
    }

    /// Whatever sampling a request asks for, the mocker's token is the one drawn, so a
    /// request whose end-of-generation ids are avoided runs to `max_tokens` (with a hot
    /// logit of 1 a temperature-1 draw over a 49k vocabulary picks it 0.005 % of the time).
    #[test]
    fn every_sampling_draws_the_mocker_token() {
        use crate::sampler::{Sampler, SamplerState, SamplingParams};
        let n_vocab = 49_152;
        let m = MockBackend::new(MockConfig {
            n_vocab,
            n_blocks: 8,
            speedup: 1e9,
            avoid: vec![0, 1, 2],
        });
        let mut logits = vec![0.0f32; n_vocab];
        let mut sampler = Sampler::new(n_vocab);
        let prompt: Vec<u32> = (0..64).collect();
        for seed in 0..40u64 {
            let params = SamplingParams {
                temperature: 0.5 + (seed % 4) as f32 * 0.5,
                top_k: [0, 40][seed as usize % 2],
                top_p: [1.0, 0.9][seed as usize / 2 % 2],
                min_p: [0.0, 0.05][seed as usize / 4 % 2],
                presence_penalty: 2.0,
                frequency_penalty: 2.0,
                repetition_penalty: 1.5,
                seed: Some(seed),
            };
            let mut state = SamplerState::new(&params, seed);
            let mut output = Vec::new();
            for pos in 0..50 {
                // A small position range repeats tokens, so the penalties hit the hot one.
                m.fill_logits(&mut logits, pos % 7, seed as u32);
                let want = m.token(pos % 7, seed as u32);
                sampler.apply_penalties(&params, &mut logits, &prompt, &output);
                let got = sampler.sample(&params, &mut state, &logits, true);
                assert_eq!(got.token, want, "seed {seed} pos {pos}: {params:?}");
                output.push(got.token);
            }
        }
    }

    #[test]
    fn avoided_tokens_are_never_emitted() {
        let m = MockBackend::new(MockConfig {
            n_vocab: 4,
            n_blocks: 8,
            speedup: 1e9,
            avoid: vec![0, 2],
        });
        for pos in 0..1000 {
            let t = m.token(pos, 7);
            assert!(t == 1 || t == 3);
        }
    }

    /// The step sums count every step: its prompt tokens, the context its decoded tokens
    /// attended, its time and the prompt queued at its start.
    #[test]
    fn step_sums_count_what_each_step_did() {
        use crate::engine::{Engine, EngineConfig};
        use crate::scheduler::SchedulerConfig;
        use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};
        let backend = MockBackend::new(MockConfig {
            n_vocab: 64,
            n_blocks: 64,
            speedup: 1e3,
            avoid: Vec::new(),
        });
        let sched = SchedulerConfig { max_batched_tokens: 64, ..SchedulerConfig::default() };
        let mut e = Engine::new(EngineConfig { sched, worker_id: 1 }, Box::new(backend), None);
        let stop = StopConditions { max_tokens: 5, ignore_eos: true, ..Default::default() };
        let prompt: Vec<u32> = (0..100).map(|i| i % 60).collect();
        let req = GenerateRequest::new(RequestId(1), prompt, SamplingOptions::default(), stop);
        e.add(&req).expect("added");
        let mut generated = 0;
        while e.has_work() {
            generated +=
                e.step().expect("step").events.iter().filter(|v| v.token.is_some()).count();
        }
        assert_eq!(generated, 5);
        let st = e.stats();
        let s = st.step;
        assert_eq!(s.n, st.steps as f64);
        assert_eq!(s.n, 6.0, "two prompt chunks (64 + 36 tokens), four decode steps");
        assert_eq!(s.x1, 100.0);
        assert_eq!(s.x1x1, 64.0 * 64.0 + 36.0 * 36.0);
        // Decoded at positions 100..=103: contexts 101..=104.
        assert_eq!(s.x2, 410.0);
        assert_eq!(s.x1x2, 0.0, "no step both prefilled and decoded");
        assert!(s.y > 0.0 && s.yy > 0.0 && s.x1y > 0.0 && s.x2y > 0.0);
        // Queued at the first step's start: 99 prompt tokens (the last one is computed with
        // the first decode's token), at the second 35.
        assert!(s.qy > 0.0 && s.qy <= 99.0 * s.y);
    }
}
