//! Tool calls on the real model through the official `openai` Python client
//! (tests/clients/tool_calls.py): with `tool_choice` "required" and naming each tool, streamed
//! and not, every answer carries a call whose arguments validate against the tool's schema;
//! and the request errors of tools and tool_choice over raw HTTP.

use kvx_e2e::python_client;
use kvx_e2e::serve::{Served, http};
use serde_json::{Value, json};

#[test]
fn forced_tool_calls_validate_through_the_openai_client() {
    let s = Served::start(&["--shards", "1", "--threads-per-shard", "2"]);
    let stdout = python_client("tool_calls.py", &[&format!("http://{}/v1", s.addr)]);
    assert!(stdout.contains("ok: 16 calls"), "{stdout}");
}

#[test]
fn bad_tools_and_choices_are_refused_by_name() {
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "1000", "--shards", "1"]);
    let tool =
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (body, param) in [
        (json!({"messages": msgs, "tools": {"a": 1}}), "tools"),
        (json!({"messages": msgs, "tools": [{"type": "function"}]}), "tools"),
        (json!({"messages": msgs, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": msgs, "tools": [tool], "tool_choice": "often"}), "tool_choice"),
        (
            json!({"messages": msgs, "tools": [tool],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": msgs, "tools": [tool], "tool_choice": "required",
                   "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ] {
        let r =
            http(&s.addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()));
        assert_eq!(r.status, 400, "{body} -> {}", r.text());
        let v: Value = r.json();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // The mocker honours the forced call's grammar: with a closed schema the only answer is a
    // call of `f` with no arguments.
    let closed = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {}, "additionalProperties": false}}});
    let body = json!({"messages": msgs, "tools": [closed], "tool_choice": "required",
                      "max_tokens": 64, "temperature": 0});
    let r = http(&s.addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json();
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
    assert_eq!(ch["message"]["tool_calls"][0]["function"]["name"], "f", "{v}");
    assert_eq!(ch["message"]["tool_calls"][0]["function"]["arguments"], "{}", "{v}");
    assert!(ch["message"]["content"].is_null(), "{v}");

    // A schema with definitions and references (as Pydantic writes it) compiles and is
    // followed: the only answer is x = "yes".
    let with_refs = json!({"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Answer"}}, "required": ["x"],
        "additionalProperties": false, "$defs": {"Answer": {"type": "string", "enum": ["yes"]}}}}});
    let body = json!({"messages": msgs, "tools": [with_refs],
                      "tool_choice": {"type": "function", "function": {"name": "g"}},
                      "max_tokens": 64, "temperature": 0});
    let r = http(&s.addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json();
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "g", "{v}");
    assert_eq!(call["arguments"], r#"{"x":"yes"}"#, "{v}");
}
