//! Shared set-up of the engine tests on the real model: the model from `KVX_TEST_MODEL`, an
//! engine over it, 16 distinct prompts and greedy requests.

#![allow(clippy::disallowed_methods)] // the model and tools come from `cargo xtask test`'s environment

use std::sync::Arc;

use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, ModelBackend};
use kvx_kernels::cpu;
use kvx_kernels::cpu::lanes::LaneMath;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{Arith, LlamaModel};
use kvx_kernels::par::ThreadPool;
use kvx_proto::{GenerateRequest, RequestId, SamplingOptions, StopConditions};

/// The model, repacked for the row-lane kernels as `kvx --exact` loads it.
pub fn model() -> Arc<LlamaModel> {
    model_in(Arith::Exact)
}

/// The model as `kvx --arith ARITH` loads it (not the reference arithmetic's backend).
pub fn model_in(arith: Arith) -> Arc<LlamaModel> {
    let path = std::env::var_os("KVX_TEST_MODEL").expect(
        "KVX_TEST_MODEL is not set (path to the default GGUF); run through `cargo xtask test`",
    );
    let mut model =
        LlamaModel::load(Arc::new(GgufFile::open(path).expect("open model"))).expect("load model");
    let math = arith.lane_math().unwrap_or(LaneMath::Exact);
    model.repack(cpu::kernels(), math).expect("repack");
    model.split_kv = arith.split_kv();
    model.free_attention = arith.free_attention()
        && kvx_kernels::ops::attention_free_covers(cpu::kernels(), model.cfg.head_dim);
    Arc::new(model)
}

/// The model's tokenizer.
#[allow(dead_code)] // not every test file tokenizes
pub fn tokenizer() -> kvx_tokenizer::Tokenizer {
    let path = std::env::var_os("KVX_TEST_MODEL").expect("KVX_TEST_MODEL is not set");
    kvx_tokenizer::Tokenizer::from_gguf_path(std::path::Path::new(&path)).expect("tokenizer")
}

pub fn engine(model: &Arc<LlamaModel>, blocks: usize, sched: SchedulerConfig) -> Engine {
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
#[allow(dead_code)] // not every test file uses them
pub fn prompts() -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|i| {
            let len = 5 + (i as usize * 7) % 40;
            (0..len as u32).map(|j| 100 + (i * 977 + j * 31) % 20_000).collect()
        })
        .collect()
}

#[allow(dead_code)] // not every test file builds requests
pub fn request(i: usize, prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(i as u64 + 1),
        prompt: prompt.to_vec(),
        sampling: SamplingOptions { temperature: 0.0, ..Default::default() },
        stop: StopConditions { max_tokens, ..Default::default() },
        logprobs: None,
        salt: None,
        kv: Default::default(),
        resume: Vec::new(),
        constraint: None,
        prompt_logprobs: None,
        fork: None,
    }
}

/// A scheduler of 16-token blocks, 16 sequences and a `budget`-token step.
pub fn sched(budget: usize, chunked: bool) -> SchedulerConfig {
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
