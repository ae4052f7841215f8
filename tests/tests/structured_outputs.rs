//! Structured outputs through `kvx serve`: on the real model, 20 JSON schemas and 10 regexes
//! (each greedy and sampled, through `response_format`, `guided_json` and `guided_regex` on
//! both endpoints) whose every answer Python's `jsonschema` and `re.fullmatch` accept; bad
//! schemas, regexes and `response_format` types are 400s; the mocker honours a constraint.

use std::io::Write;
use std::process::{Command, Stdio};

use kvx_e2e::serve::{Endpoint, Served, http};
use kvx_e2e::{oracle_python, root};
use serde_json::{Value, json};

/// One request of the run: where it goes, its body, and what its answer must satisfy.
struct Case {
    name: String,
    path: &'static str,
    body: Value,
    /// `{"schema": ..}` or `{"regex": ..}`.
    check: Value,
}

fn cases() -> Vec<Case> {
    let path = root().join("tests/data/structured_outputs.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("cases file"))
        .expect("cases JSON");
    let chat = |prompt: &str| json!([{"role": "user", "content": prompt}]);
    let completion = |prompt: &str| format!("Question: {prompt}\nAnswer: ");
    let mut out = Vec::new();
    for (i, c) in data["schemas"].as_array().expect("schemas").iter().enumerate() {
        let (name, prompt, schema) = (
            c["name"].as_str().expect("name"),
            c["prompt"].as_str().expect("prompt"),
            &c["schema"],
        );
        let check = json!({"schema": schema});
        out.push(Case {
            name: format!("{name}/greedy"),
            path: "/v1/chat/completions",
            body: json!({"messages": chat(prompt), "max_tokens": 256, "temperature": 0,
                "response_format": {"type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": true}}}),
            check: check.clone(),
        });
        let sampled = json!({"max_tokens": 256, "temperature": 0.8, "seed": 7 + i});
        let (path, body) = if i % 2 == 0 {
            let mut b = sampled;
            b["messages"] = chat(prompt);
            b["guided_json"] = schema.clone();
            ("/v1/chat/completions", b)
        } else {
            let mut b = sampled;
            b["prompt"] = json!(completion(prompt));
            b["guided_json"] = json!(schema.to_string());
            ("/v1/completions", b)
        };
        out.push(Case { name: format!("{name}/sampled"), path, body, check });
    }
    for (i, c) in data["regexes"].as_array().expect("regexes").iter().enumerate() {
        let (name, prompt, regex) = (
            c["name"].as_str().expect("name"),
            c["prompt"].as_str().expect("prompt"),
            c["regex"].as_str().expect("regex"),
        );
        let check = json!({"regex": regex});
        out.push(Case {
            name: format!("{name}/greedy"),
            path: "/v1/chat/completions",
            body: json!({"messages": chat(prompt), "max_tokens": 256, "temperature": 0,
                "guided_regex": regex}),
            check: check.clone(),
        });
        out.push(Case {
            name: format!("{name}/sampled"),
            path: "/v1/completions",
            body: json!({"prompt": completion(prompt), "max_tokens": 256, "temperature": 0.8,
                "seed": 100 + i, "guided_regex": regex}),
            check,
        });
    }
    out
}

/// Runs the Python validator over `(case, text)` answers; its report.
fn validate(answers: &[(&Case, String)]) -> (bool, String) {
    let input: Vec<Value> = answers
        .iter()
        .map(|(c, text)| {
            let mut v = c.check.clone();
            v["name"] = json!(c.name);
            v["text"] = json!(text);
            v
        })
        .collect();
    let mut child = Command::new(oracle_python())
        .arg(root().join("tests/clients/structured_validate.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(Value::Array(input).to_string().as_bytes())
        .expect("writing answers");
    let out = child.wait_with_output().expect("python");
    let report =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), report)
}

#[test]
fn every_answer_matches_its_schema_or_regex() {
    let s = Served::start(&["--engine", "model", "--shards", "1", "--threads-per-shard", "2"]);
    let cases = cases();
    assert_eq!(cases.len(), 60);
    // Eight clients at a time: the engine batches them.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Value)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8)
            .map(|_| {
                let (next, cases, addr) = (&next, &cases, s.addr.clone());
                scope.spawn(move || {
                    let mut got = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(c) = cases.get(i) else { return got };
                        let r =
                            http(&addr, "POST", c.path, &[], Some(c.body.to_string().as_bytes()));
                        assert_eq!(r.status, 200, "{}: {}", c.name, r.text());
                        got.push((i, r.json()));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("client")).collect()
    });
    let mut answers = Vec::new();
    let mut stopped = 0;
    let mut cut = Vec::new();
    for (i, v) in &results {
        let c = &cases[*i];
        let choice = &v["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or_else(|| panic!("{}: no text in {v}", c.name))
            .to_string();
        match choice["finish_reason"].as_str() {
            Some("stop") => {
                stopped += 1;
                answers.push((c, text));
            }
            _ => cut.push(format!("{}: {text:?}", c.name)),
        }
    }
    let (ok, report) = validate(&answers);
    eprintln!("{report}");
    assert!(ok, "answers that do not validate:\n{report}");
    // The schemas' answers are short: nearly every request ends because its grammar did.
    assert!(stopped >= 57, "{stopped} of 60 ended with stop; cut by max_tokens: {cut:#?}");
}

#[test]
fn bad_constraints_are_client_errors_and_the_mocker_honours_good_ones() {
    let s = Served::start(&["--engine", "mocker", "--speedup-ratio", "1000"]);
    let m = json!([{"role": "user", "content": "hi"}]);
    for (body, needle) in [
        (
            json!({"messages": m, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}),
            "no-such-type",
        ),
        (
            json!({"messages": m, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x",
                    "schema": {"type": "integer", "minimum": 5, "maximum": 2}}}}),
            "",
        ),
        (json!({"messages": m, "guided_regex": "[a-"}), ""),
        (json!({"messages": m, "guided_json": "{not json"}), "JSON"),
        (json!({"messages": m, "guided_grammar": "start: undefined_rule"}), ""),
        (json!({"messages": m, "response_format": {"type": "xml"}}), "response_format.type"),
        (json!({"messages": m, "stream": true, "guided_regex": "(ab"}), ""),
    ] {
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let r = s.post("/v1/completions", &json!({"prompt": "x", "guided_regex": "[a-"}));
    assert_eq!(r.status, 400, "{}", r.text());
    // The mocker's tokens give way to the grammar's.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": m, "max_tokens": 50, "temperature": 0,
            "guided_regex": "[0-9]{3}-[0-9]{2}"}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 50, "temperature": 0.7,
            "seed": 1, "guided_regex": "[0-9]{3}-[0-9]{2}"}),
        ),
    ] {
        let v = s.post(path, &body).json();
        let choice = &v["choices"][0];
        let text = choice["message"]["content"].as_str().or_else(|| choice["text"].as_str());
        let text = text.unwrap_or_else(|| panic!("{v}"));
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        let b = text.as_bytes();
        assert!(
            b.len() == 6
                && b.iter().enumerate().all(|(i, c)| if i == 3 {
                    *c == b'-'
                } else {
                    c.is_ascii_digit()
                }),
            "{text:?}"
        );
    }
}
