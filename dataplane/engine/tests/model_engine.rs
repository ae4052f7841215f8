//! The engine on the real model: batch invariance (16 requests together produce exactly the
//! tokens each produces alone, with and without chunked prefill, and with preemptions forced
//! by a tiny block pool), prefix caching (a request sharing a long prefix computes only its
//! new tokens). The allocation-free step loop is checked in `alloc_free.rs`.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

mod common;

use std::collections::HashMap;

use common::{engine, model, prompts, request, sched};
use kvx_engine::Engine;
use kvx_proto::{GenerateRequest, RequestId};

/// Runs `reqs` through `e` (all submitted at once) and returns each request's tokens.
fn run_all(e: &mut Engine, reqs: &[GenerateRequest]) -> HashMap<RequestId, Vec<u32>> {
    for r in reqs {
        e.add(r).expect("add");
    }
    let mut out: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut finished = 0;
    while finished < reqs.len() {
        let step = e.step().expect("step");
        for ev in &step.events {
            if let Some(t) = ev.token {
                out.entry(ev.id).or_default().push(t);
            }
            finished += usize::from(ev.finish.is_some());
        }
        e.drain_block_events(|_| {});
    }
    out
}

#[test]
fn batch_invariance_with_chunking_and_preemption() {
    let m = model();
    let reqs: Vec<GenerateRequest> =
        prompts().iter().enumerate().map(|(i, p)| request(i, p, 12)).collect();
    // Each request alone.
    let mut alone = HashMap::new();
    for r in &reqs {
        let mut e = engine(&m, 64, sched(512, true));
        alone.extend(run_all(&mut e, std::slice::from_ref(r)));
    }
    // Together, whole prompts per step.
    let mut e = engine(&m, 256, sched(1024, false));
    assert_eq!(run_all(&mut e, &reqs), alone, "16 together (no chunking)");
    // Together, prompts chunked by a small budget.
    let mut e = engine(&m, 256, sched(24, true));
    assert_eq!(run_all(&mut e, &reqs), alone, "16 together (chunked prefill)");
    // Together in a pool too small for all of them: preemption and recompute.
    let mut e = engine(&m, 20, sched(64, true));
    let together = run_all(&mut e, &reqs);
    assert!(e.stats().preemptions > 0, "the tiny pool forced preemptions");
    assert_eq!(together, alone, "16 together with preemptions");
}

#[test]
fn a_shared_prefix_is_not_recomputed() {
    let m = model();
    let prefix: Vec<u32> = (0..1000u32).map(|j| 200 + (j * 37) % 30_000).collect();
    let mut a = prefix.clone();
    a.extend([11, 12, 13]);
    let mut b = prefix.clone();
    b.extend([21, 22, 23, 24, 25]);
    let mut e = engine(&m, 200, sched(512, true));
    run_all(&mut e, &[request(0, &a, 2)]);
    let before = e.stats();
    assert_eq!(before.prefill_tokens, 1003);
    run_all(&mut e, &[request(1, &b, 2)]);
    let after = e.stats();
    // 1000 = 62 full blocks (992 tokens) cached; the rest of b is computed.
    assert_eq!(after.cached_tokens - before.cached_tokens, 992);
    assert_eq!(after.prefill_tokens - before.prefill_tokens, (b.len() - 992) as u64);
}

/// A request resumed after tokens it produced elsewhere (a migration) generates exactly the
/// rest of what an undisturbed run gives, with the same log-probabilities, and counts the
/// resumed tokens in its usage.
#[test]
fn a_resumed_request_continues_as_an_undisturbed_one() {
    let model = common::model();
    let mut e = common::engine(&model, 256, common::sched(64, true));
    let prompt = &common::prompts()[5];
    let mut whole = common::request(0, prompt, 24);
    whole.logprobs = Some(1);
    e.add(&whole).expect("add");
    let (mut tokens, mut lps) = (Vec::new(), Vec::new());
    while e.has_work() {
        let out = e.step().expect("step");
        for ev in out.events.iter().filter(|ev| ev.id == whole.id) {
            if let Some(t) = ev.token {
                tokens.push(t);
                lps.push(ev.logprob);
            }
        }
    }
    assert_eq!(tokens.len(), 24);
    for cut in [1, 9, 23] {
        let mut e = common::engine(&model, 256, common::sched(64, true));
        let mut resumed = common::request(1, prompt, 24);
        resumed.logprobs = Some(1);
        resumed.resume = tokens[..cut].to_vec();
        e.add(&resumed).expect("add resumed");
        let (mut got, mut got_lp, mut usage) = (Vec::new(), Vec::new(), None);
        while e.has_work() {
            let out = e.step().expect("step");
            for ev in out.events.iter().filter(|ev| ev.id == resumed.id) {
                if let Some(t) = ev.token {
                    got.push(t);
                    got_lp.push(ev.logprob);
                }
                if ev.finish.is_some() {
                    usage = Some(ev.usage);
                }
            }
        }
        assert_eq!(got, tokens[cut..], "resumed after {cut} tokens");
        assert_eq!(got_lp, lps[cut..], "log-probabilities after {cut} tokens");
        assert_eq!(usage.map(|u| u.completion_tokens), Some(24));
    }
    let mut done = common::request(2, prompt, 4);
    done.resume = tokens[..4].to_vec();
    assert!(e.add(&done).is_err(), "nothing left to generate");
}
