//! Disaggregated serving with the real model: `kvx serve --prefill-shards 1 --decode-shards 1
//! --disagg-min-tokens 0` (every prompt prefilled by the prefill shard, its KV written into
//! the decode shard's blocks through kvx-xfer's shared memory) gives exactly the tokens and
//! the top log-probabilities of aggregated `kvx serve`, for prompts of 50 to 3,000 tokens
//! (`bench/scripts/disagg.sh` runs the 20-prompt set; this test runs 8 of them).

use kvx_e2e::serve::{Endpoint, Served};
use serde_json::{Value, json};

/// 8 prompts of token ids, 50 to 3,000 tokens long.
fn prompts() -> Vec<Vec<u32>> {
    (0..8u32)
        .map(|i| {
            let len = 50 + (i as usize * 2950) / 7;
            (0..len as u32).map(|j| 200 + (i * 7919 + j * 104_729) % 40_000).collect()
        })
        .collect()
}

/// `(text, tokens, [(token, logprob, top)...])` of a greedy completion of `prompt`.
fn complete(s: &Served, prompt: &[u32]) -> Value {
    let body = json!({
        "model": "smollm2-135m-instruct-q4_1",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 5,
    });
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    json!({ "text": c["text"], "logprobs": c["logprobs"], "finish": c["finish_reason"] })
}

#[test]
fn a_disaggregated_server_gives_the_tokens_and_logprobs_of_an_aggregated_one() {
    let prompts = prompts();
    let agg = Served::start(&["--engine", "model", "--shards", "2"]);
    let want: Vec<Value> = prompts.iter().map(|p| complete(&agg, p)).collect();
    drop(agg);
    let disagg = Served::start(&[
        "--engine",
        "model",
        "--prefill-shards",
        "1",
        "--decode-shards",
        "1",
        "--disagg-min-tokens",
        "0",
    ]);
    for (i, (p, want)) in prompts.iter().zip(&want).enumerate() {
        let got = complete(&disagg, p);
        assert_eq!(&got, want, "prompt {i} ({} tokens)", p.len());
    }
    let remote = disagg.metric("kvx_router_disagg_remote_prefills_total").unwrap_or(0.0);
    assert_eq!(remote, prompts.len() as f64, "every prompt was prefilled by the prefill shard");
    assert!(disagg.metric("kvx_router_kv_transfer_bytes_total").unwrap_or(0.0) > 1e6);
    assert_eq!(disagg.metric("kvx_router_disagg_fallbacks_total"), Some(0.0));
}
