//! Structured outputs on the real model: constrained requests (a regex, a JSON schema) give
//! exactly the tokens they give alone when 16 of them share a pool too small for all, so that
//! preemption recomputes them mid-grammar (the matcher follows each token once), and every
//! answer matches its grammar.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

#![allow(clippy::disallowed_methods)] // the model comes from `cargo xtask test`'s environment

#[allow(dead_code)] // the tokenizer-free `engine` of the other tests is not used here
mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{model, prompts, request, sched};
use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, ModelBackend};
use kvx_kernels::cpu;
use kvx_kernels::model::LlamaModel;
use kvx_kernels::par::ThreadPool;
use kvx_proto::{Constraint, FinishReason, GenerateRequest, RequestId};
use kvx_tokenizer::Tokenizer;

fn engine(m: &Arc<LlamaModel>, tok: &Arc<Tokenizer>, blocks: usize, s: SchedulerConfig) -> Engine {
    let pool = ThreadPool::new(2).expect("pool");
    let backend = ModelBackend::new(
        m.clone(),
        cpu::kernels(),
        pool,
        blocks,
        s.block_size,
        s.max_batched_tokens,
        1024,
    )
    .expect("backend");
    Engine::new(EngineConfig { sched: s, worker_id: 1 }, Box::new(backend), Some(tok.clone()))
}

type Runs = HashMap<RequestId, (Vec<u32>, String, Option<FinishReason>)>;

fn run_all(e: &mut Engine, reqs: &[GenerateRequest]) -> Runs {
    for r in reqs {
        e.add(r).expect("add");
    }
    let mut out = Runs::new();
    let mut finished = 0;
    while finished < reqs.len() {
        let step = e.step().expect("step");
        for ev in &step.events {
            let o = out.entry(ev.id).or_default();
            o.0.extend(ev.token);
            o.1.push_str(step.text_of(ev));
            if ev.finish.is_some() {
                o.2 = ev.finish;
                finished += 1;
            }
        }
        e.drain_block_events(|_| {});
    }
    out
}

#[test]
fn constrained_requests_survive_preemption_and_match_their_grammar() {
    let m = model();
    let path = std::env::var_os("KVX_TEST_MODEL").expect("KVX_TEST_MODEL");
    let tok = Arc::new(Tokenizer::from_gguf_path(path.as_ref()).expect("tokenizer"));
    let schema = r#"{"type":"object","properties":{"w":{"type":"array","items":{"type":"string",
        "pattern":"^[a-z]{2,5}$"},"minItems":4,"maxItems":4}},"required":["w"],
        "additionalProperties":false}"#;
    let reqs: Vec<GenerateRequest> = prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = request(i, p, 40);
            r.constraint = Some(if i % 2 == 0 {
                Constraint::Regex("[a-z]{2,6}( [a-z]{2,6}){3}".into())
            } else {
                Constraint::JsonSchema(schema.into())
            });
            r
        })
        .collect();
    let mut alone = Runs::new();
    for r in &reqs {
        let mut e = engine(&m, &tok, 64, sched(512, true));
        alone.extend(run_all(&mut e, std::slice::from_ref(r)));
    }
    let mut e = engine(&m, &tok, 20, sched(64, true));
    let together = run_all(&mut e, &reqs);
    assert!(e.stats().preemptions > 0, "the tiny pool forced preemptions");
    assert_eq!(together, alone, "16 constrained requests together with preemptions");
    for (i, r) in reqs.iter().enumerate() {
        let (_, text, finish) = &alone[&r.id];
        assert_eq!(*finish, Some(FinishReason::Stop), "{i}: {text:?}");
        if i % 2 == 0 {
            let words: Vec<&str> = text.split(' ').collect();
            assert!(
                words.len() == 4
                    && words
                        .iter()
                        .all(|w| (2..=6).contains(&w.len())
                            && w.bytes().all(|b| b.is_ascii_lowercase())),
                "{i}: {text:?}"
            );
        } else {
            let v: serde_json::Value = serde_json::from_str(text).expect("JSON");
            let w = v["w"].as_array().expect("w");
            assert_eq!(w.len(), 4, "{text}");
            assert!(w.iter().all(|s| s.as_str().is_some_and(|s| (2..=5).contains(&s.len()))));
        }
    }
}
