//! `kvx profile`: the pre-deployment sweep of one engine, in this process — time to first
//! token of a prompt alone on an idle engine over prompt lengths, and the step time of a
//! batch decoding together over batch sizes × context lengths — each point the median of
//! repeated runs, as a [`Profile`] the SLA planner and `kvx configure` read.
//!
//! The sequences of a decode batch have prompts of their own, as served requests do: a
//! batch over one shared prompt would read the same KV blocks for every sequence (from
//! cache), and step faster than a batch of distinct requests. Each context's prompts are
//! prefilled once, untimed, before its first batch; the batches and their repetitions find
//! them in the prefix cache but for a last token of their own, start decoding together, and
//! the sweep spends its time decoding. They sample at the sweep's temperature (the API's
//! default, 1, unless told otherwise): a served step draws each sequence's token from the
//! whole vocabulary, which greedy decoding would leave out of the profile. (The prefill
//! points stay greedy: one draw per prompt is lost in its TTFT.)
//!
//! [`bench_engine`] is `kvx bench engine`'s measurement, llama-bench's two tests on one
//! engine.

use std::time::Instant;

use kvx_engine::{Engine, EngineError};
use kvx_proto::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, Profile, WorkerShape};

use crate::setup::{EngineKind, Prepared};
use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};

/// What to sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// Prompt lengths of the prefill curve, ascending.
    pub prefill_isl: Vec<u32>,
    /// Largest batch of the decode grid; each context gets up to 6 sizes from 1 to this or
    /// to the most that fit the KV cache.
    pub max_batch: u32,
    /// Context lengths of the decode grid, ascending.
    pub contexts: Vec<u32>,
    /// Runs per point (the median is kept).
    pub reps: u32,
    /// Decode steps timed per run.
    pub steps: u32,
    /// Sampling temperature of the decode batches' requests (0: greedy): a served step
    /// draws every sequence's token, which a greedy profile would leave out.
    pub temperature: f32,
}

impl Sweep {
    /// ~16 prompt lengths up to `max_isl` (a geometric series) and a 6 × 6 decode grid up to
    /// `max_batch` sequences of `max_context` tokens.
    pub fn standard(max_isl: u32, max_batch: u32, max_context: u32, reps: u32) -> Self {
        let geo = |max: u32, n: u32, min: u32| -> Vec<u32> {
            let (lo, hi) = (f64::from(min.max(1)), f64::from(max.max(min.max(1))));
            let mut v: Vec<u32> = (0..n)
                .map(|i| {
                    (lo * (hi / lo).powf(f64::from(i) / f64::from((n - 1).max(1)))).round() as u32
                })
                .collect();
            v.dedup();
            v
        };
        Sweep {
            prefill_isl: geo(max_isl, 16, 32),
            max_batch: max_batch.max(1),
            contexts: geo(max_context, 6, 64),
            reps: reps.max(1),
            steps: 8,
            temperature: 1.0,
        }
    }

    /// The batch sizes measured at `context` tokens on an engine holding `capacity` KV
    /// tokens (a geometric series from 1; empty when not even one sequence fits).
    pub fn batches_at(&self, context: u32, capacity: u64) -> Vec<u32> {
        let per = u64::from(context) + u64::from(self.steps) + 2 + 16;
        let fit = (capacity / per.max(1)).min(u64::from(self.max_batch)) as u32;
        if fit == 0 {
            return Vec::new();
        }
        let mut v: Vec<u32> = (0..6)
            .map(|i| (f64::from(fit).powf(f64::from(i) / 5.0)).round().max(1.0) as u32)
            .collect();
        v.dedup();
        v
    }
}

/// The shape of the worker `prepared` makes engines for, in role `role`, as a profile
/// records it (the CPU from `/proc/cpuinfo`).
pub fn shape_of(prepared: &Prepared, role: &str) -> WorkerShape {
    let setup = prepared.setup();
    let mocker = setup.kind == EngineKind::Mocker;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("model name"))?;
            Some(line.split(':').nth(1)?.trim().to_string())
        })
        .unwrap_or_default();
    WorkerShape {
        engine: if mocker { "mocker" } else { "model" }.into(),
        role: role.to_string(),
        shards: 1,
        threads_per_shard: setup.threads_per_engine as u32,
        simd: if mocker { "none".into() } else { setup.kernels.label() },
        arith: if mocker { String::new() } else { setup.effective_arith().name().into() },
        model: if mocker {
            format!("mocker (speedup {})", setup.mocker.speedup)
        } else {
            prepared.model_label()
        },
        block_size: prepared.block_size() as u32,
        kv_blocks: prepared.kv_blocks() as u32,
        max_batched_tokens: setup.limits.max_batched_tokens as u32,
        kv_bytes_per_token: prepared.kv_bytes_per_token(),
        cpu,
    }
}

/// Why the sweep stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProfileRunError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// An engine could not be made.
    #[error("making an engine: {0}")]
    Setup(String),
    /// A point that cannot be measured on this engine.
    #[error("{0}")]
    Invalid(String),
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// A prompt token: spread over the vocabulary, clear of its first and last ids.
fn token(i: u64, vocab: u32) -> u32 {
    let span = u64::from(vocab.saturating_sub(4).max(1));
    2 + ((i.wrapping_mul(2_654_435_761)) % span) as u32
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, temperature: f32) -> GenerateRequest {
    GenerateRequest::new(
        RequestId(id),
        prompt,
        SamplingOptions { temperature, seed: Some(id), ..Default::default() },
        StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
    )
}

/// Measures `sweep` on engines from `make` (a fresh one per prefill run and per decode
/// context: nothing cached between them), which hold `capacity` KV tokens. `vocab` bounds
/// the prompt tokens; `progress` is told each point as it is measured.
pub fn measure(
    make: &mut dyn FnMut() -> Result<Engine, String>,
    vocab: u32,
    capacity: u64,
    shape: WorkerShape,
    sweep: &Sweep,
    progress: &mut dyn FnMut(&str),
) -> Result<Profile, ProfileRunError> {
    if let Some(&c) = sweep.contexts.iter().find(|&&c| sweep.batches_at(c, capacity).is_empty()) {
        return Err(ProfileRunError::Invalid(format!(
            "one sequence of {c} tokens does not fit the engine's {capacity} KV tokens: a shorter context"
        )));
    }
    if sweep.prefill_isl.is_empty() || sweep.contexts.is_empty() {
        return Err(ProfileRunError::Invalid("nothing to measure".into()));
    }
    let mut next_id = 0u64;
    let mut id = || {
        next_id += 1;
        next_id
    };
    let mut prefill = Vec::new();
    for &isl in &sweep.prefill_isl {
        let mut runs = Vec::new();
        for rep in 0..sweep.reps {
            let mut engine = make().map_err(ProfileRunError::Setup)?;
            let salt = u64::from(isl) * 1_000 + u64::from(rep);
            let prompt = (0..u64::from(isl)).map(|i| token(salt * 7_919 + i, vocab)).collect();
            engine.add(&request(id(), prompt, 1, 0.0))?;
            let t = Instant::now();
            loop {
                if !engine.has_work() {
                    return Err(ProfileRunError::Invalid(format!(
                        "a prompt of {isl} tokens ended without a token"
                    )));
                }
                let out = engine.step()?;
                if out.events.iter().any(|e| e.token.is_some()) {
                    break;
                }
            }
            runs.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let ttft_ms = median(&mut runs);
        progress(&format!("prefill {isl} tokens: TTFT {ttft_ms:.1} ms"));
        prefill.push(PrefillPoint { isl, ttft_ms, tok_s: f64::from(isl) / ttft_ms * 1e3 });
    }
    let mut decode = Vec::new();
    for &context in &sweep.contexts {
        let mut engine = make().map_err(ProfileRunError::Setup)?;
        let batches = sweep.batches_at(context, capacity);
        let most = batches.iter().copied().max().unwrap_or(1) as usize;
        // A prompt (but its last token) per sequence of the largest batch.
        let prompts: Vec<Vec<u32>> = (0..most as u64)
            .map(|k| {
                (0..u64::from(context.saturating_sub(1)))
                    .map(|i| token(u64::from(context) * 31 + k * 1_000_003 + i, vocab))
                    .collect()
            })
            .collect();
        // Prefill every prompt once, untimed: the batches below find them in the prefix
        // cache and start decoding together.
        for (k, prompt) in prompts.iter().enumerate() {
            let mut p = prompt.clone();
            p.push(token(k as u64 + 7, vocab));
            engine.add(&request(id(), p, 1, 0.0))?;
        }
        while engine.has_work() {
            engine.step()?;
        }
        for batch in batches {
            let mut runs = Vec::new();
            for rep in 0..sweep.reps {
                let ids: Vec<u64> = (0..batch).map(|_| id()).collect();
                for (k, &rid) in ids.iter().enumerate() {
                    let mut prompt = prompts[k % prompts.len()].clone();
                    prompt.push(token(u64::from(rep) * 100_003 + k as u64 + 1, vocab));
                    engine.add(&request(rid, prompt, sweep.steps + 2, sweep.temperature))?;
                }
                // Until every sequence has its first token, then time the steps.
                let mut started = 0usize;
                while started < ids.len() {
                    if !engine.has_work() {
                        return Err(ProfileRunError::Invalid(format!(
                            "batch {batch} at {context} tokens ended before every sequence started"
                        )));
                    }
                    let out = engine.step()?;
                    started += out
                        .events
                        .iter()
                        .filter(|e| e.token.is_some() && e.usage.completion_tokens == 1)
                        .count();
                }
                let mut steps = Vec::new();
                for _ in 0..sweep.steps {
                    let t = Instant::now();
                    let out = engine.step()?;
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if out.events.iter().filter(|e| e.token.is_some()).count() == ids.len() {
                        steps.push(ms);
                    }
                }
                for rid in ids {
                    engine.cancel(RequestId(rid));
                }
                while engine.has_work() {
                    engine.step()?;
                }
                if steps.is_empty() {
                    return Err(ProfileRunError::Invalid(format!(
                        "batch {batch} at {context} tokens never decoded together (the engine runs at most {} sequences)",
                        engine.config().sched.max_num_seqs
                    )));
                }
                runs.push(median(&mut steps));
            }
            let itl_ms = median(&mut runs);
            progress(&format!("decode batch {batch} at {context} tokens: ITL {itl_ms:.2} ms"));
            decode.push(DecodePoint {
                batch,
                context,
                itl_ms,
                tok_s: f64::from(batch) / itl_ms * 1e3,
            });
        }
    }
    Ok(Profile {
        version: PROFILE_VERSION,
        shape,
        reps: sweep.reps,
        temperature: sweep.temperature,
        prefill,
        decode,
    })
}

/// The timed runs of [`bench_engine`], tokens/s each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineBench {
    /// Prompt processing: `pp` prompt tokens over the time to the first token.
    pub pp_runs: Vec<f64>,
    /// Generation: `tg` tokens over the time from the first token to the last.
    pub tg_runs: Vec<f64>,
}

impl EngineBench {
    /// The median of the prompt runs (0 without any).
    pub fn pp_median(&self) -> f64 {
        median(&mut self.pp_runs.clone())
    }
    /// The median of the generation runs (0 without any).
    pub fn tg_median(&self) -> f64 {
        median(&mut self.tg_runs.clone())
    }
}

/// llama-bench's tests on `engine`, `reps` times each: pp, one batch of `pp` prompt tokens;
/// tg, `tg` tokens generated one at a time after a one-token prompt (the first sampled token
/// comes from the prompt step, as llama-bench's tg starts decoding at once); greedy. As
/// llama-bench keeps one context and warms it up, one engine serves every run (give it no
/// prefix cache, so that nothing is found between runs) and an untimed run of each test
/// goes first: no timed run pays the first writes of a fresh KV cache (on huge pages, ~0.3
/// GB/s on some VMs). `0` skips a test.
pub fn bench_engine(
    engine: &mut Engine,
    vocab: u32,
    pp: u32,
    tg: u32,
    reps: u32,
) -> Result<EngineBench, ProfileRunError> {
    let mut id = 0u64;
    // Seconds to the first token and to the end of one greedy request.
    let mut run_one = |prompt: Vec<u32>, max_tokens: u32| -> Result<(f64, f64), ProfileRunError> {
        id += 1;
        engine.add(&request(id, prompt, max_tokens, 0.0))?;
        let start = Instant::now();
        let mut first = None;
        loop {
            if !engine.has_work() {
                return Err(ProfileRunError::Invalid("a request ended without finishing".into()));
            }
            let out = engine.step()?;
            if first.is_none() && out.events.iter().any(|e| e.token.is_some()) {
                first = Some(start.elapsed().as_secs_f64());
            }
            if out.events.iter().any(|e| e.finish.is_some()) {
                return Ok((first.unwrap_or(0.0), start.elapsed().as_secs_f64()));
            }
        }
    };
    let mut b = EngineBench::default();
    // Run 0 is the untimed warm-up.
    for r in 0..=reps.max(1) {
        if pp > 0 {
            let (ttft, _) = run_one((0..u64::from(pp)).map(|i| token(i, vocab)).collect(), 1)?;
            if r > 0 {
                b.pp_runs.push(f64::from(pp) / ttft);
            }
        }
        if tg > 0 {
            let (first, total) = run_one(vec![token(0, vocab)], tg + 1)?;
            if r > 0 {
                b.tg_runs.push(f64::from(tg) / (total - first));
            }
        }
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::EngineSetup;

    #[test]
    fn bench_engine_reports_the_timed_runs_of_each_test() {
        let prepared =
            EngineSetup::tokenizer_free_mocker(1, 64, 32, 512, 1000.0).prepare().expect("mocker");
        let mut engine = prepared.engine(0).expect("engine");
        let b = bench_engine(&mut engine, 512, 40, 6, 3).expect("bench");
        assert_eq!((b.pp_runs.len(), b.tg_runs.len()), (3, 3), "{b:?}");
        assert!(b.pp_runs.iter().chain(&b.tg_runs).all(|&x| x > 0.0 && x.is_finite()), "{b:?}");
        assert!(b.pp_median() > 0.0 && b.tg_median() > 0.0);
        // A skipped test has no runs.
        let b = bench_engine(&mut engine, 512, 0, 4, 2).expect("bench");
        assert!(b.pp_runs.is_empty() && b.tg_runs.len() == 2 && b.pp_median() == 0.0);
        // Every request finished: nothing is left on the engine.
        assert!(!engine.has_work());
    }
}
