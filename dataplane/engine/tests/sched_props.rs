//! Property tests of the block pool and the scheduler: under random arrivals, cancellations,
//! finishes and preemptions no block is leaked or double-freed, the bookkeeping always
//! agrees, and every request eventually finishes.

use kvx_engine::block_pool::BlockPool;
use kvx_engine::scheduler::{Scheduler, SchedulerConfig, SchedulerOutput};
use kvx_proto::{LocalBlockHash, RequestId, SequenceHash};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum PoolOp {
    Alloc,
    Release(usize),
    Register(usize, u64),
    Acquire(u64),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        3 => Just(PoolOp::Alloc),
        3 => (0usize..64).prop_map(PoolOp::Release),
        2 => (0usize..64, 0u64..12).prop_map(|(i, h)| PoolOp::Register(i, h)),
        2 => (0u64..12).prop_map(PoolOp::Acquire),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn block_pool_never_leaks_or_double_frees(ops in prop::collection::vec(pool_op(), 1..200)) {
        let mut pool = BlockPool::new(8);
        let mut held: Vec<u32> = Vec::new(); // one entry per reference we own
        for op in ops {
            match op {
                PoolOp::Alloc => {
                    if let Some(b) = pool.allocate() { held.push(b) } else { prop_assert_eq!(pool.available(), 0) }
                }
                PoolOp::Release(i) if !held.is_empty() => {
                    let b = held.swap_remove(i % held.len());
                    pool.release(b);
                }
                PoolOp::Register(i, h) if !held.is_empty() => {
                    let b = held[i % held.len()];
                    pool.register(b, SequenceHash(h), LocalBlockHash(h), None);
                }
                PoolOp::Acquire(h) => {
                    if let Some(b) = pool.acquire_cached(SequenceHash(h)) { held.push(b) }
                }
                _ => {}
            }
            pool.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(pool.active(), { let mut u = held.clone(); u.sort(); u.dedup(); u.len() });
        }
        for b in held.drain(..) {
            pool.release(b);
        }
        pool.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(pool.available(), 8);
    }
}

#[derive(Debug, Clone)]
enum SchedOp {
    Arrive { prompt: Vec<u32>, max_tokens: usize },
    Cancel(usize),
    Step,
}

fn sched_op() -> impl Strategy<Value = SchedOp> {
    // Small alphabets and shared starts make prefix-cache hits frequent.
    let prompt = (prop::collection::vec(0u32..3, 1..6), prop::collection::vec(0u32..50, 0..30))
        .prop_map(|(a, b)| a.into_iter().chain(b).collect::<Vec<_>>());
    prop_oneof![
        2 => (prompt, 1usize..12).prop_map(|(prompt, max_tokens)| SchedOp::Arrive { prompt, max_tokens }),
        1 => (0usize..16).prop_map(SchedOp::Cancel),
        6 => Just(SchedOp::Step),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn scheduler_keeps_blocks_consistent(
        ops in prop::collection::vec(sched_op(), 1..150),
        budget in 4usize..40,
        n_blocks in 12usize..40,
        chunked in any::<bool>(),
    ) {
        let cfg = SchedulerConfig {
            block_size: 4,
            max_num_seqs: 4,
            max_batched_tokens: budget,
            max_waiting: 8,
            chunked_prefill: chunked,
            max_model_len: 64,
            prefix_caching: true,
        };
        let mut s = Scheduler::new(cfg, n_blocks);
        let mut out = SchedulerOutput::default();
        let mut live: Vec<(usize, usize)> = Vec::new(); // (seq id, max_len)
        let mut next_id = 0u64;
        let mut sampled = 0u32;
        let mut step = |s: &mut Scheduler, out: &mut SchedulerOutput, live: &mut Vec<(usize, usize)>| -> Result<(), TestCaseError> {
            s.schedule(out);
            prop_assert!(out.num_tokens <= budget);
            s.commit(out);
            let chunks = out.chunks.clone();
            for c in chunks.iter().filter(|c| c.logits) {
                sampled = sampled.wrapping_add(1);
                s.append_token(c.seq, sampled % 7);
            }
            live.retain(|&(sid, max_len)| {
                let done = s.seq(sid).is_some_and(|q| q.tokens.len() >= max_len);
                if done { s.remove(sid); }
                !done
            });
            s.check_invariants().map_err(TestCaseError::fail)
        };
        for op in ops {
            match op {
                SchedOp::Arrive { prompt, max_tokens } => {
                    next_id += 1;
                    if let Ok(sid) = s.add(RequestId(next_id), &prompt, max_tokens, 0) {
                        live.push((sid, prompt.len() + max_tokens));
                    }
                }
                SchedOp::Cancel(i) if !live.is_empty() => {
                    let (sid, _) = live.swap_remove(i % live.len());
                    prop_assert!(s.remove(sid).is_some());
                }
                SchedOp::Step => step(&mut s, &mut out, &mut live)?,
                _ => {}
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        // Drain: everything left finishes (no deadlock, no starvation).
        for _ in 0..2000 {
            if !s.has_work() { break; }
            step(&mut s, &mut out, &mut live)?;
        }
        prop_assert!(!s.has_work(), "requests left unfinished: {:?}", live);
        prop_assert_eq!(s.pool().active(), 0, "blocks leaked");
        prop_assert_eq!(s.pool().available(), n_blocks);
    }
}
