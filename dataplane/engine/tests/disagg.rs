//! Disaggregated prefill at the engine level, on the real model: a prefill-only engine
//! computes prompts (but their last token), kvx-xfer writes their KV blocks straight into the
//! blocks a decode engine reserved (two regions of one agent, the shared-memory path), and
//! the decode engine then generates exactly the tokens and log-probabilities of an engine
//! that computed everything itself.
//!
//! Needs `KVX_TEST_MODEL` (the default model; `cargo xtask test` exports it).

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvx_engine::{Admission, Engine, EngineConfig, ModelBackend};
use kvx_kernels::cpu;
use kvx_kernels::model::{KvCache, KvLayout, LlamaModel};
use kvx_kernels::par::ThreadPool;
use kvx_proto::{GenerateRequest, KvDest, KvRole, RequestId};
use kvx_xfer::{Agent, AgentConfig, Desc, Op, RegionId, RemoteId};

const BLOCKS: usize = 96;

/// One agent with a region per engine, and itself as the remote of its writes.
struct Fabric {
    agent: Agent,
    me: RemoteId,
    layout: KvLayout,
}

impl Fabric {
    fn new(model: &LlamaModel, regions: usize) -> (Fabric, Vec<RegionId>) {
        let mut cfg = AgentConfig::new("disagg-test");
        cfg.tcp_listen = None;
        let agent = Agent::new(cfg).expect("agent");
        let layout = KvCache::layout(&model.cfg, BLOCKS, 16).expect("layout");
        let ids: Vec<RegionId> =
            (0..regions).map(|_| agent.alloc_mem(layout.bytes as u64).expect("region")).collect();
        let me = agent.add_remote(&agent.metadata()).expect("self");
        (Fabric { agent, me, layout }, ids)
    }

    fn engine(&self, model: &Arc<LlamaModel>, region: RegionId) -> Engine {
        let sched = common::sched(512, true);
        let mem = self.agent.region_memory(region).expect("region memory");
        let backend = ModelBackend::with_kv_memory(
            model.clone(),
            cpu::kernels(),
            ThreadPool::new(2).expect("pool"),
            BLOCKS,
            sched.block_size,
            sched.max_batched_tokens,
            1024,
            Box::new(mem),
        )
        .expect("backend");
        Engine::new(EngineConfig { sched, worker_id: 1 }, Box::new(backend), None)
    }

    /// Writes blocks `src[i]` of region `from` onto blocks `dst[i]` of region `to`.
    fn write(&self, from: RegionId, src: &[u32], to: RegionId, dst: &[u32]) {
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (&s, &d) in src.iter().zip(dst) {
            let (s, d) = (self.layout.spans(s as usize, 1), self.layout.spans(d as usize, 1));
            for ((so, len), (dof, _)) in s.into_iter().zip(d) {
                local.push(Desc::new(from, so as u64, len as u64));
                remote.push(Desc::new(to, dof as u64, len as u64));
            }
        }
        let h = self.agent.xfer(Op::Write, self.me, &local, &remote, b"kv").expect("post");
        h.wait(Duration::from_secs(10)).expect("transfer");
    }
}

/// Runs `e` until request `id` ends (or is prefilled); returns tokens and logprobs.
fn drive(e: &mut Engine, id: RequestId) -> (Vec<u32>, Vec<f32>, bool) {
    let (mut tokens, mut lps) = (Vec::new(), Vec::new());
    for _ in 0..10_000 {
        let out = e.step().expect("step");
        for ev in out.events.iter().filter(|ev| ev.id == id) {
            if ev.prefilled {
                return (tokens, lps, true);
            }
            if let Some(t) = ev.token {
                tokens.push(t);
                lps.push(ev.logprob);
            }
            if ev.finish.is_some() {
                return (tokens, lps, false);
            }
        }
    }
    panic!("request {id} did not end");
}

fn with_logprobs(mut r: GenerateRequest) -> GenerateRequest {
    r.logprobs = Some(1);
    r
}

#[test]
fn decode_after_a_remote_prefill_gives_the_tokens_of_a_local_one() {
    let model = common::model();
    let (fabric, regions) = Fabric::new(&model, 2);
    let (p_region, d_region) = (regions[0], regions[1]);
    let mut prefill = fabric.engine(&model, p_region);
    let mut decode = fabric.engine(&model, d_region);
    let mut local = common::engine(&model, BLOCKS, common::sched(512, true));
    // Prompts across block boundaries, one over the 512-token prompt batch, and a second
    // one sharing a prefix the decode engine then holds.
    let mut prompts: Vec<Vec<u32>> = common::prompts().into_iter().step_by(3).collect();
    prompts.push((0..600u32).map(|j| 300 + (j * 37) % 9000).collect());
    prompts.push((0..33u32).map(|j| 100 + (j * 31) % 20_000).collect());
    let shared: Vec<u32> = prompts[prompts.len() - 2].iter().copied().chain(200..230).collect();
    prompts.push(shared);
    for (i, p) in prompts.iter().enumerate() {
        let base = with_logprobs(common::request(i, p, 12));
        let id = base.id;
        local.add(&base).expect("local add");
        let want = drive(&mut local, id);

        let mut d_req = base.clone();
        d_req.kv = KvRole::AwaitKv;
        let Admission::Reserved { first_block, blocks } = decode.add(&d_req).expect("reserve")
        else {
            panic!("the decode engine had room")
        };
        let mut p_req = base.clone();
        p_req.kv = KvRole::PrefillTo(KvDest { worker: 1, first_block, blocks: blocks.clone() });
        prefill.add(&p_req).expect("prefill add");
        let (none, _, prefilled) = drive(&mut prefill, id);
        assert!(prefilled && none.is_empty(), "prompt {i}: a prefill-only request samples nothing");
        let src = prefill.blocks_of(id).expect("prefilled blocks");
        let n = blocks.len();
        fabric.write(p_region, &src[first_block..first_block + n], d_region, &blocks);
        assert!(prefill.release(id));
        assert!(decode.kv_arrived(id));
        let got = drive(&mut decode, id);
        assert_eq!(got.0, want.0, "prompt {i} ({} tokens): tokens", p.len());
        assert_eq!(got.1, want.1, "prompt {i}: log-probabilities, bit for bit");
    }
    assert!(
        decode.stats().cached_tokens > 0,
        "the decode engine reused the prefix it had received"
    );
    assert_eq!(decode.scheduler().pool().active(), 0);
    assert_eq!(prefill.scheduler().pool().active(), 0);
    decode.scheduler().check_invariants().expect("decode invariants");
    prefill.scheduler().check_invariants().expect("prefill invariants");
}

#[test]
fn a_transfer_that_fails_is_computed_locally_with_the_same_tokens() {
    let model = common::model();
    let (fabric, regions) = Fabric::new(&model, 1);
    let mut decode = fabric.engine(&model, regions[0]).with_kv_quarantine(Duration::ZERO);
    let mut local = common::engine(&model, BLOCKS, common::sched(512, true));
    let prompt: Vec<u32> = (0..70u32).map(|j| 500 + j * 13).collect();
    let base = common::request(0, &prompt, 8);
    local.add(&base).expect("local add");
    let want = drive(&mut local, base.id);
    let mut d_req = base.clone();
    d_req.kv = KvRole::AwaitKv;
    assert!(matches!(decode.add(&d_req).expect("reserve"), Admission::Reserved { .. }));
    assert!(decode.kv_failed(base.id));
    assert!(!decode.kv_arrived(base.id), "no longer awaiting");
    assert_eq!(drive(&mut decode, base.id).0, want.0);
    decode.scheduler().check_invariants().expect("invariants");
    assert_eq!(decode.scheduler().pool().active(), 0, "quarantined blocks came back");
}
