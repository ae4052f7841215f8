//! Choices of one prompt on the real model (`n` > 1): followers forked from their leader
//! compute none of the prompt (engine counters) and produce exactly the tokens each would
//! produce on its own, seeded sampling and greedy alike; a follower whose leader is gone is
//! computed as any request, with the same tokens. Block bookkeeping stays exact throughout.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

#[allow(dead_code)] // not every helper is used here
mod common;

use std::collections::HashMap;

use common::{engine, model, request, sched};
use kvx_engine::Engine;
use kvx_proto::{Fork, GenerateRequest, RequestId, SamplingOptions};

/// A 1,000-token prompt: 62 full blocks of 16 and 8 more.
fn prompt() -> Vec<u32> {
    (0..1000u32).map(|j| 300 + (j * 613) % 25_000).collect()
}

fn choice(i: usize, p: &[u32], seed: u64, fork: Option<Fork>) -> GenerateRequest {
    let mut r = request(i, p, 12);
    r.sampling = SamplingOptions { temperature: 0.9, seed: Some(seed), ..Default::default() };
    r.stop.ignore_eos = true;
    r.fork = fork;
    r
}

/// Steps until every request in `ids` finished, collecting tokens; `after_first` is added
/// once the first request produced its first token.
fn run(
    e: &mut Engine,
    first: &GenerateRequest,
    after_first: &[GenerateRequest],
) -> HashMap<RequestId, Vec<u32>> {
    e.add(first).expect("add");
    let mut out: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut pending = Some(after_first);
    let mut finished = 0;
    while finished < 1 + after_first.len() {
        let step = e.step().expect("step");
        for ev in &step.events {
            if let Some(t) = ev.token {
                out.entry(ev.id).or_default().push(t);
            }
            finished += usize::from(ev.finish.is_some());
        }
        e.drain_block_events(|_| {});
        e.scheduler().check_invariants().expect("invariants");
        if out.contains_key(&first.id)
            && let Some(rest) = pending.take()
        {
            for r in rest {
                e.add(r).expect("add follower");
            }
        }
    }
    out
}

#[test]
fn followers_start_from_the_leaders_prompt_with_their_own_tokens() {
    let m = model();
    let p = prompt();
    let seeds = [11u64, 12, 13, 14];
    // Each choice alone, in a fresh engine.
    let mut alone = Vec::new();
    for (k, &seed) in seeds.iter().enumerate() {
        let mut e = engine(&m, 160, sched(512, true));
        let r = choice(k, &p, seed, None);
        alone.push(run(&mut e, &r, &[]).remove(&r.id).expect("tokens"));
    }
    assert!(alone.windows(2).any(|w| w[0] != w[1]), "seeded choices differ");

    // Forked: one prompt computation, each choice's own tokens.
    let mut e = engine(&m, 160, sched(512, true));
    let leader = choice(0, &p, seeds[0], Some(Fork::Leader { followers: 3 }));
    let followers: Vec<GenerateRequest> = (1..4)
        .map(|k| choice(k, &p, seeds[k], Some(Fork::Follower { leader: leader.id })))
        .collect();
    let got = run(&mut e, &leader, &followers);
    for (k, want) in alone.iter().enumerate() {
        assert_eq!(&got[&RequestId(k as u64 + 1)], want, "choice {k}");
    }
    let st = e.stats();
    assert_eq!(st.prefill_tokens, p.len() as u64, "the prompt was computed once");
    assert_eq!(st.cached_tokens, 3 * p.len() as u64, "followers took all of it");

    // Greedy choices fork too (the same tokens as the leader's).
    let mut e = engine(&m, 160, sched(512, true));
    let mut g = request(7, &p, 8);
    g.fork = Some(Fork::Leader { followers: 1 });
    let mut f = request(8, &p, 8);
    f.fork = Some(Fork::Follower { leader: g.id });
    let got = run(&mut e, &g, std::slice::from_ref(&f));
    assert_eq!(got[&g.id], got[&f.id]);
    assert_eq!(e.stats().prefill_tokens, p.len() as u64);
}

#[test]
fn a_follower_without_its_leader_is_computed() {
    let m = model();
    let p = prompt();
    let mut e = engine(&m, 160, sched(512, true));
    let solo = choice(1, &p, 5, None);
    let want = run(&mut e, &solo, &[]).remove(&solo.id).expect("tokens");

    // The leader ended (one token) before its follower came: the follower computes the
    // prompt's last partial block itself (the full ones are cached), with the same tokens.
    let mut e = engine(&m, 160, sched(512, true));
    let mut leader = choice(0, &p, 4, Some(Fork::Leader { followers: 1 }));
    leader.stop.max_tokens = 1;
    let _ = run(&mut e, &leader, &[]);
    let before = e.stats();
    let f = choice(1, &p, 5, Some(Fork::Follower { leader: leader.id }));
    let got = run(&mut e, &f, &[]);
    assert_eq!(got[&f.id], want);
    assert_eq!(e.stats().prefill_tokens - before.prefill_tokens, 8);

    // A follower naming an unknown leader is an ordinary request.
    let mut e = engine(&m, 160, sched(512, true));
    let f = choice(1, &p, 5, Some(Fork::Follower { leader: RequestId(999) }));
    assert_eq!(run(&mut e, &f, &[])[&f.id], want);
    e.scheduler().check_invariants().expect("invariants");
}
