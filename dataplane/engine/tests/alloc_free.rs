//! A steady-state engine step (sequences decoding, sampled with penalties) allocates
//! nothing. Alone in its test binary so that no other test allocates while it counts.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

use std::alloc::System;
use std::sync::Arc;

use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, ModelBackend};
use kvx_kernels::cpu;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::LlamaModel;
use kvx_kernels::par::ThreadPool;
use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn model() -> Arc<LlamaModel> {
    let path = std::env::var_os("KVX_TEST_MODEL").expect(
        "KVX_TEST_MODEL is not set (path to the default GGUF); run through `cargo xtask test`",
    );
    Arc::new(
        LlamaModel::load(Arc::new(GgufFile::open(path).expect("open model"))).expect("load model"),
    )
}

fn engine(model: &Arc<LlamaModel>, blocks: usize, sched: SchedulerConfig) -> Engine {
    let pool = ThreadPool::new(2).expect("pool");
    let backend = ModelBackend::new(
        model.clone(),
        cpu::kernels(),
        pool,
        blocks,
        sched.block_size,
        sched.max_batched_tokens,
        1024,
    )
    .expect("backend");
    Engine::new(EngineConfig { sched, worker_id: 1 }, Box::new(backend), None)
}

/// 16 distinct prompts of different lengths (token ids; no tokenizer needed).
fn prompts() -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|i| {
            let len = 5 + (i as usize * 7) % 40;
            (0..len as u32).map(|j| 100 + (i * 977 + j * 31) % 20_000).collect()
        })
        .collect()
}

fn request(i: usize, prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(i as u64 + 1),
        prompt: prompt.to_vec(),
        sampling: SamplingOptions { temperature: 0.0, ..Default::default() },
        stop: StopConditions { max_tokens, ..Default::default() },
        logprobs: None,
        salt: None,
    }
}

fn sched(budget: usize, chunked: bool) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 16,
        max_num_seqs: 16,
        max_batched_tokens: budget,
        max_waiting: 64,
        chunked_prefill: chunked,
        max_model_len: 1024,
        prefix_caching: true,
    }
}

#[test]
fn steady_state_steps_allocate_nothing() {
    let m = model();
    let mut e = engine(&m, 256, sched(512, true));
    let mut reqs: Vec<GenerateRequest> =
        prompts().iter().take(8).enumerate().map(|(i, p)| request(i, p, 200)).collect();
    // Sampled (not greedy) with penalties, to cover the sampler's full path.
    for r in &mut reqs {
        r.sampling = SamplingOptions {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            presence_penalty: 0.5,
            seed: Some(3),
            ..Default::default()
        };
        e.add(r).expect("add");
    }
    // Warm up: prefill and some decode steps.
    for _ in 0..20 {
        e.step().expect("step");
        e.drain_block_events(|_| {});
    }
    let region = Region::new(GLOBAL);
    for _ in 0..40 {
        let out = e.step().expect("step");
        assert_eq!(out.events.len(), 8);
        e.drain_block_events(|_| {});
    }
    let stats = region.change();
    assert_eq!(
        (stats.allocations, stats.reallocations),
        (0, 0),
        "the step loop allocated: {stats:?}"
    );
}
