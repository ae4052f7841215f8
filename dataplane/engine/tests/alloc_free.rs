//! A steady-state engine step (sequences decoding, sampled with penalties, top-k or top-p,
//! some with log-probabilities) allocates nothing. Alone in its test binary so that no other test allocates while it counts.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

mod common;

use std::alloc::System;

use common::{engine, model, prompts, request, sched};
use kvx_proto::{GenerateRequest, SamplingOptions};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn steady_state_steps_allocate_nothing() {
    let m = model();
    let mut e = engine(&m, 256, sched(512, true));
    let mut reqs: Vec<GenerateRequest> =
        prompts().iter().take(8).enumerate().map(|(i, p)| request(i, p, 200)).collect();
    // Sampled (not greedy) with penalties, to cover the sampler's full path: half with
    // top-k, half over the whole vocabulary at a temperature that flattens it (top-p cut by
    // bands) with five log-probabilities a token.
    for (i, r) in reqs.iter_mut().enumerate() {
        let whole = i % 2 == 1;
        r.sampling = SamplingOptions {
            temperature: if whole { 4.0 } else { 0.9 },
            top_k: if whole { 0 } else { 40 },
            top_p: 0.95,
            presence_penalty: 0.5,
            seed: Some(3),
            ..Default::default()
        };
        r.logprobs = whole.then_some(5);
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
