//! Scored prompts on the real model: the engine's prompt scores (computed in chunks of at
//! most `SCORE_ROWS` tokens, beside other requests, through preemptions, after the prompt's
//! blocks were cached) are bit for bit the log-softmax of one forward pass over the whole
//! prompt; `eval::loglikelihoods` sums them; lm-eval's pair split.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

mod common;

use std::collections::HashMap;

use common::{engine, model, request, sched};
use kvx_engine::sampler::Sampler;
use kvx_engine::scheduler::SCORE_ROWS;
use kvx_engine::{Engine, eval};
use kvx_kernels::cpu;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;
use kvx_proto::{GenerateRequest, RequestId};

/// A prompt of `len` tokens (token ids, no tokenizer needed).
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|j| 200 + (salt * 7919 + j * 131) % 30_000).collect()
}

/// The log-softmax of `row` at `t`, as the sampler scores a prompt token (the same function
/// of the row: the scores below differ only if their logits do).
fn log_softmax_at(row: &[f32], t: u32) -> f32 {
    Sampler::new(row.len()).score(row, t, 0, &mut Vec::new())
}

/// Each prompt token's score (tokens 1..) from one forward pass over the whole prompt.
fn reference(m: &LlamaModel, p: &[u32]) -> Vec<f32> {
    let k = cpu::kernels();
    let pool = ThreadPool::new(2).expect("pool");
    let bs = 16;
    let blocks = p.len().div_ceil(bs);
    let mut kv = KvCache::new(&m.cfg, blocks, bs).expect("kv");
    let mut s = Scratch::new(m, p.len(), 1024, pool.n_threads());
    let table: Vec<u32> = (0..blocks as u32).collect();
    let chunk = SeqChunk {
        tokens: p,
        start_pos: 0,
        block_table: &table,
        logits: Logits::All,
        mode: AttnMode::Prefill,
    };
    let v = m.cfg.n_vocab;
    let mut logits = vec![0.0; p.len() * v];
    let rows = m.forward(k, &pool, &[chunk], &mut kv, &mut s, &mut logits).expect("forward");
    assert_eq!(rows, p.len());
    (1..p.len()).map(|i| log_softmax_at(&logits[(i - 1) * v..i * v], p[i])).collect()
}

fn scored(i: usize, p: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest { prompt_logprobs: Some(2), ..request(i, p, max_tokens) }
}

/// Runs `reqs` together; per request its prompt scores (as received: a prompt computed again
/// sends them again from where it starts) and its generated tokens.
fn run(e: &mut Engine, reqs: &[GenerateRequest]) -> HashMap<RequestId, (Vec<f32>, Vec<u32>)> {
    for r in reqs {
        e.add(r).expect("add");
    }
    let mut out: HashMap<RequestId, (Vec<f32>, Vec<u32>)> = HashMap::new();
    let mut finished = 0;
    while finished < reqs.len() {
        let step = e.step().expect("step");
        for ev in &step.events {
            let entry = out.entry(ev.id).or_default();
            if !ev.prompt.is_empty() {
                assert!(ev.token.is_none() && ev.prompt_start >= 1, "{ev:?}");
                entry.0.truncate(ev.prompt_start as usize - 1);
                assert_eq!(entry.0.len() + 1, ev.prompt_start as usize, "scores arrive in order");
                for p in &step.prompt[ev.prompt.clone()] {
                    let top = &step.top[p.top.clone()];
                    assert_eq!(top.len(), 2);
                    assert!(top[0].logprob >= top[1].logprob && top[0].logprob >= p.logprob);
                    entry.0.push(p.logprob);
                }
            }
            if let Some(t) = ev.token {
                entry.1.push(t);
            }
            finished += usize::from(ev.finish.is_some());
        }
        e.drain_block_events(|_| {});
        e.scheduler().check_invariants().expect("invariants");
    }
    out
}

#[test]
fn prompt_scores_are_one_forward_pass_bit_for_bit() {
    let m = model();
    let long = prompt(2 * SCORE_ROWS + 37, 1);
    let want = reference(&m, &long);
    assert_eq!(want.len(), long.len() - 1);

    // Alone: chunks of SCORE_ROWS tokens.
    let mut e = engine(&m, 64, sched(512, true));
    let alone = run(&mut e, &[scored(0, &long, 3)]);
    let (scores, tokens) = &alone[&RequestId(1)];
    assert_eq!(scores, &want, "alone");
    assert_eq!(tokens.len(), 3);
    assert_eq!(e.stats().prefill_tokens as usize, long.len());

    // The same prompt after its blocks were cached by a plain request: still computed whole
    // (no cache hit), with the same scores and the same generated tokens as alone.
    let plain = run(&mut e, &[request(1, &long, 1)]);
    assert!(plain[&RequestId(2)].0.is_empty(), "an unscored request gets no scores");
    let before = e.stats();
    let again = run(&mut e, &[scored(2, &long, 3)]);
    assert_eq!(again[&RequestId(3)], alone[&RequestId(1)], "after a cache fill");
    assert_eq!((e.stats().prefill_tokens - before.prefill_tokens) as usize, long.len());
    assert_eq!(e.stats().cached_tokens, before.cached_tokens);

    // Beside other requests, two scored prompts at once, under a small step budget.
    let other = prompt(70, 2);
    let want_other = reference(&m, &other);
    let reqs = vec![
        request(10, &common::prompts()[5], 6),
        scored(11, &long, 3),
        request(12, &prompt(90, 4), 6),
        scored(13, &other, 2),
    ];
    let mut e = engine(&m, 128, sched(48, true));
    let together = run(&mut e, &reqs);
    assert_eq!(together[&RequestId(12)].0, want, "batched, chunked by the budget");
    assert_eq!(together[&RequestId(12)].1, alone[&RequestId(1)].1);
    assert_eq!(together[&RequestId(14)].0, want_other);

    // In a pool too small for all of them: preemptions recompute, scores are not repeated.
    let mut e = engine(&m, 18, sched(64, true));
    let tight = run(&mut e, &reqs);
    assert!(e.stats().preemptions > 0, "the tiny pool forced preemptions");
    assert_eq!(tight[&RequestId(12)].0, want, "through preemptions");
    assert_eq!(tight[&RequestId(14)].0, want_other);
}

#[test]
fn loglikelihoods_sum_the_continuation_scores() {
    let m = model();
    let a = prompt(30, 5);
    let b = prompt(90, 6);
    let (wa, wb) = (reference(&m, &a), reference(&m, &b));
    let mut e = engine(&m, 64, sched(256, true));
    let got = eval::loglikelihoods(&mut e, &[(a.clone(), 20), (b.clone(), 1)], 2).expect("eval");
    let sum = |w: &[f32], ctx: usize| w[ctx - 1..].iter().map(|&l| f64::from(l)).sum::<f64>();
    assert_eq!(got[0].logprob, sum(&wa, 20));
    assert_eq!((got[0].context_tokens, got[0].continuation_tokens), (20, 10));
    assert_eq!(got[1].logprob, sum(&wb, 1));
    // Made-up token sequences are not what the model would write.
    assert!(!got[1].greedy);
    for bad in [(a.clone(), 0), (a.clone(), a.len())] {
        assert!(eval::loglikelihoods(&mut e, &[bad], 1).is_err());
    }
}

#[test]
fn pairs_split_as_lm_eval_splits_them() {
    let tok = common::tokenizer();
    // Trailing whitespace moves to the continuation; the whole text's tokens split after the
    // context's own count.
    let (c, k) = eval::encode_pair(&tok, "Question: what is 2+2?\nAnswer: ", "4").expect("pair");
    let whole = tok.encode("Question: what is 2+2?\nAnswer: 4", true).expect("encode");
    assert_eq!([c.clone(), k.clone()].concat(), whole);
    assert_eq!(c, tok.encode("Question: what is 2+2?\nAnswer:", true).expect("encode"));
    assert!(!k.is_empty());
    assert!(eval::encode_pair(&tok, "", "x").is_err());
    let lines = "{\"context\":\"The sky is\",\"continuation\":\" blue\"}\n\n{\"tokens\":[1,2,3],\"context_tokens\":2}\n";
    let inputs = eval::read_inputs(&tok, lines).expect("inputs");
    assert_eq!(inputs.len(), 2);
    assert_eq!(inputs[1], (vec![1, 2, 3], 2));
    assert!(eval::read_inputs(&tok, "{\"context\":1}").is_err());
}
