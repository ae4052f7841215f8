//! Prompt log-probabilities on a real `kvx serve` with the model (`echo` + `logprobs` on
//! `/v1/completions`, as lm-eval's `local-completions` asks for them): the answer lists every
//! prompt token, the first without a score; `max_tokens: 0` scores the prompt alone; the
//! streamed answer carries the same scores as the whole one; scores do not depend on the
//! requests beside them; `kvx eval loglik` sums exactly the scores the server sends; and
//! `/tokenizer_info` describes the tokenizer as vLLM does.

use std::thread;

use kvx_e2e::kvx_ok;
use kvx_e2e::serve::{Endpoint, HttpResponse, Served};
use serde_json::{Value, json};

const MODEL: &[&str] = &["--engine", "model", "--shards", "1", "--threads-per-shard", "2"];

fn ok(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// A prompt long enough to be scored in several engine steps.
const TEXT: &str = "The history of the printing press begins in the fifteenth century, when \
    Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press adapted \
    from those used for wine. Within fifty years presses operated in more than two hundred \
    cities across Europe, and the price of books fell so far that reading spread from monks \
    and scholars to merchants, craftsmen and their families. Pamphlets, newspapers and \
    scientific journals followed, and ideas moved faster than ever before.";

#[test]
fn echo_with_logprobs_scores_the_prompt() {
    let s = Served::start(MODEL);
    let ids = ok(&s.post("/tokenize", &json!({"prompt": TEXT, "add_special_tokens": false})));
    let ids: Vec<u64> = serde_json::from_value(ids["tokens"].clone()).expect("ids");
    assert!(ids.len() > 70, "{} tokens", ids.len());

    // max_tokens 0: the prompt alone, every token listed, the first without a score.
    let body = json!({"prompt": [ids.clone()], "echo": true, "logprobs": 2, "max_tokens": 0,
                      "temperature": 0});
    let v = ok(&s.post("/v1/completions", &body));
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    let lp = &c["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    let scores = lp["token_logprobs"].as_array().expect("token_logprobs");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    assert_eq!((tokens.len(), scores.len(), tops.len()), (ids.len(), ids.len(), ids.len()));
    assert!(scores[0].is_null() && tops[0].is_null(), "{lp}");
    let text: String = tokens.iter().map(|t| t.as_str().expect("token")).collect();
    assert_eq!(text, TEXT);
    assert_eq!(c["text"], TEXT);
    let mut top1 = 0;
    for (i, (s, t)) in scores.iter().zip(tops).enumerate().skip(1) {
        let s = s.as_f64().expect("a score");
        let t = t.as_object().expect("alternatives");
        assert!(s <= 0.0 && s > -40.0, "token {i}: {s}");
        assert_eq!(t.len(), 2, "token {i}: {t:?}");
        let best = t.values().map(|x| x.as_f64().expect("f")).fold(f64::MIN, f64::max);
        assert!(best >= s, "token {i}: {s} above the best alternative {best}");
        // The prompt token among the alternatives has exactly its score.
        if let Some(x) = t.get(tokens[i].as_str().expect("token")) {
            assert_eq!(x.as_f64(), Some(s), "token {i}");
            top1 += usize::from(best == s);
        }
    }
    assert!(top1 > ids.len() / 4, "a natural text is mostly the model's first choice: {top1}");

    // With generated tokens, streamed: the first chunk echoes the prompt with the same
    // scores; the generated tokens follow with theirs.
    let mut sb = body.clone();
    sb["max_tokens"] = json!(3);
    sb["stream"] = json!(true);
    let events = s.post("/v1/completions", &sb).events();
    assert_eq!(events.last(), Some(&json!("[DONE]")));
    let first = &events[0]["choices"][0];
    assert_eq!(first["text"], TEXT);
    assert_eq!(first["logprobs"]["token_logprobs"], lp["token_logprobs"]);
    assert_eq!(first["logprobs"]["top_logprobs"], lp["top_logprobs"]);
    let generated: usize = events[1..events.len() - 1]
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array().map(Vec::len))
        .sum();
    assert_eq!(generated, 3);
    // Whole, with generated tokens: the prompt's scores, then three more.
    let mut wb = body.clone();
    wb["max_tokens"] = json!(3);
    let w = ok(&s.post("/v1/completions", &wb));
    let wl = w["choices"][0]["logprobs"]["token_logprobs"].as_array().expect("scores").clone();
    assert_eq!(wl.len(), ids.len() + 3);
    assert_eq!(&wl[..ids.len()], &scores[..]);

    // Beside other requests the scores are the same, bit for bit (the prompt was also cached
    // by now: a scored prompt is computed whole all the same).
    let others: Vec<_> = (0..3)
        .map(|k| {
            let addr = s.addr.clone();
            thread::spawn(move || {
                let b = json!({"prompt": format!("Story {k}: once upon a time"),
                               "max_tokens": 24, "temperature": 0});
                kvx_e2e::serve::http(
                    &addr,
                    "POST",
                    "/v1/completions",
                    &[],
                    Some(b.to_string().as_bytes()),
                )
            })
        })
        .collect();
    let again = ok(&s.post("/v1/completions", &body));
    for o in others {
        assert_eq!(o.join().expect("thread").status, 200);
    }
    assert_eq!(again["choices"][0]["logprobs"], c["logprobs"]);

    // kvx eval sums the very scores the server sends.
    let dir = std::env::temp_dir().join(format!("kvx-prompt-logprobs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("pairs.jsonl");
    let ctx = 20;
    std::fs::write(&file, format!("{}\n", json!({"tokens": ids, "context_tokens": ctx})))
        .expect("write");
    let out = kvx_ok(&["eval", "loglik", "--file", file.to_str().expect("path")]);
    let e: Value = serde_json::from_str(out.trim()).expect("eval json");
    let want: f64 = scores[ctx..].iter().map(|x| x.as_f64().expect("f")).sum();
    assert!((e["logprob"].as_f64().expect("logprob") - want).abs() < 1e-9, "{e} vs {want}");
    assert_eq!(e["continuation_tokens"], ids.len() - ctx);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokenizer_info_describes_the_tokenizer() {
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "1"]);
    let v = ok(&s.get("/tokenizer_info"));
    let eos = v["eos_token"].as_str().expect("eos_token");
    // The eos token's text tokenizes (specials parsed) to the end-of-text id alone.
    let t = ok(&s.post("/tokenize", &json!({"prompt": eos, "add_special_tokens": false})));
    assert_eq!(t["tokens"].as_array().map(Vec::len), Some(1), "{t}");
    assert!(v["model_max_length"].as_u64().is_some_and(|n| n > 0), "{v}");
    assert!(v["chat_template"].as_str().is_some_and(|t| t.contains("im_start")), "{v}");
    assert!(v["add_bos_token"].is_boolean(), "{v}");
}

#[test]
fn a_prompt_filling_the_context_is_scored_with_max_tokens_0() {
    // A KV cache of 12 MiB: a context of a few hundred tokens.
    let mut args = MODEL.to_vec();
    args.extend(["--kv-cache-bytes", "12582912"]);
    let s = Served::start(&args);
    let ctx = ok(&s.get("/tokenizer_info"))["model_max_length"].as_u64().expect("context");
    assert!((200..2000).contains(&ctx), "context {ctx}");
    let ids = ok(&s.post("/tokenize", &json!({"prompt": TEXT, "add_special_tokens": false})));
    let ids: Vec<u64> = serde_json::from_value(ids["tokens"].clone()).expect("ids");
    let prompt: Vec<u64> = ids.iter().copied().cycle().take(ctx as usize).collect();
    let body = json!({"prompt": [prompt], "echo": true, "logprobs": 1, "max_tokens": 0});
    let v = ok(&s.post("/v1/completions", &body));
    let lp = v["choices"][0]["logprobs"]["token_logprobs"].as_array().expect("scores").clone();
    assert_eq!(lp.len() as u64, ctx);
    assert!(lp[0].is_null() && lp[1..].iter().all(Value::is_f64), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // One token more than the context is refused, and so is generating after a full one.
    let mut long = prompt.clone();
    long.push(prompt[0]);
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [long], "echo": true, "logprobs": 1, "max_tokens": 0}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [prompt], "echo": true, "logprobs": 1, "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn a_scored_prompt_is_computed_where_it_decodes() {
    // Disaggregated, every prompt remote: a scored prompt stays on the decode shard, with
    // the scores an aggregated server gives.
    let agg = Served::start(MODEL);
    let mut args = vec!["--engine", "model", "--threads-per-shard", "1"];
    args.extend(["--prefill-shards", "1", "--decode-shards", "1", "--disagg-min-tokens", "0"]);
    let dis = Served::start(&args);
    let body = json!({"prompt": TEXT, "echo": true, "logprobs": 1, "max_tokens": 2,
                      "temperature": 0});
    let a = ok(&agg.post("/v1/completions", &body));
    let d = ok(&dis.post("/v1/completions", &body));
    assert_eq!(d["choices"][0]["logprobs"], a["choices"][0]["logprobs"]);
    assert_eq!(dis.metric("kvx_router_disagg_remote_prefills_total").unwrap_or(0.0), 0.0);
    // Not sent to the decode shard to await KV (and then computed there for want of room).
    let no_room = dis.metric("kvx_router_disagg_local_prefills_no_room_total");
    assert_eq!(no_room.unwrap_or(0.0), 0.0);
    // A plain request on the same server is disaggregated.
    let plain = json!({"prompt": TEXT, "max_tokens": 2, "temperature": 0});
    ok(&dis.post("/v1/completions", &plain));
    assert_eq!(dis.metric("kvx_router_disagg_remote_prefills_total"), Some(1.0));
}
