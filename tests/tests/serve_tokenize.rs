//! `/tokenize` and `/detokenize` on a real `kvx serve` (the model's tokenizer and chat
//! template): the ids are those `kvx tokenize` prints and those a completion counts as its
//! prompt; bad input gets a clear 400/404; keys are asked for as on `/v1/*`.

use kvx_e2e::kvx_ok;
use kvx_e2e::serve::{Served, http};
use serde_json::{Value, json};

const FAST: &[&str] = &["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "1"];

fn post(s: &Served, path: &str, body: &Value) -> (u16, Value) {
    let b = body.to_string();
    let r = http(&s.addr, "POST", path, &[], Some(b.as_bytes()));
    (r.status, r.json())
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().expect("an array").iter().map(|x| x.as_u64().expect("an id")).collect()
}

#[test]
fn tokenize_matches_the_cli_and_the_prompt_a_completion_counts() {
    let s = Served::start(FAST);
    let text = "The quick brown fox jumps over the lazy dog.";
    let cli: Value = serde_json::from_str(&kvx_ok(&["tokenize", "--text", text])).expect("json");
    let (st, v) = post(&s, "/tokenize", &json!({ "prompt": text }));
    assert_eq!(st, 200, "{v}");
    assert_eq!(ids(&v["tokens"]), ids(&cli));
    assert_eq!(v["count"], json!(ids(&cli).len()));
    assert!(v["max_model_len"].as_u64().is_some_and(|n| n > 0), "{v}");

    // Token texts, when asked, put the text back together.
    let (_, v) = post(&s, "/tokenize", &json!({ "prompt": text, "return_token_strs": true }));
    let joined: String =
        v["token_strs"].as_array().expect("strs").iter().map(|x| x.as_str().unwrap()).collect();
    assert!(joined.ends_with(text), "{joined:?}");

    // Messages: the chat template's ids, as many as the completion's prompt_tokens, and the
    // same ids `kvx tokenize --chat` prints.
    let msgs = json!([{ "role": "user", "content": text }]);
    let (st, v) = post(&s, "/tokenize", &json!({ "messages": msgs }));
    assert_eq!(st, 200, "{v}");
    let chat_cli: Value =
        serde_json::from_str(&kvx_ok(&["tokenize", "--chat", "--text", text])).expect("json");
    assert_eq!(ids(&v["tokens"]), ids(&chat_cli));
    let (st, c) = post(&s, "/v1/chat/completions", &json!({ "messages": msgs, "max_tokens": 1 }));
    assert_eq!(st, 200, "{c}");
    assert_eq!(v["count"], c["usage"]["prompt_tokens"], "{c}");

    // Detokenize is the inverse.
    let (st, d) = post(&s, "/detokenize", &json!({ "tokens": cli }));
    assert_eq!(st, 200, "{d}");
    assert!(d["prompt"].as_str().expect("prompt").ends_with(text), "{d}");
}

#[test]
fn bad_tokenize_requests_are_refused_clearly() {
    let s = Served::start(FAST);
    for (body, status) in [
        (json!({}), 400),
        (json!({ "prompt": "a", "messages": [{ "role": "user", "content": "b" }] }), 400),
        (json!({ "messages": [] }), 400),
        (json!({ "model": "no-such-model", "prompt": "a" }), 404),
    ] {
        let (st, v) = post(&s, "/tokenize", &body);
        assert_eq!(st, status, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    let (st, v) = post(&s, "/detokenize", &json!({ "tokens": [4_000_000_000u64] }));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("outside the vocabulary"), "{v}");
    let r = http(&s.addr, "POST", "/tokenize", &[], Some(b"{\"prompt\":"));
    assert_eq!(r.status, 400);

    // With keys, a key is asked for.
    let k = Served::start(&[FAST, &["--api-key", "k-1"]].concat());
    let body = br#"{"prompt":"a"}"#;
    assert_eq!(http(&k.addr, "POST", "/tokenize", &[], Some(body)).status, 401);
    let auth = [("Authorization", "Bearer k-1")];
    assert_eq!(http(&k.addr, "POST", "/tokenize", &auth, Some(body)).status, 200);
}
