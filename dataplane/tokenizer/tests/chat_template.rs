//! Chat templates rendered by kvx (minijinja) against the same templates rendered by jinja2
//! the way transformers does (tests/oracle/oracle.py `render`), and chat-templated
//! conversations tokenized against llama.cpp.
//!
//! Needs `KVX_TEST_MODEL` and `KVX_ORACLE_PYTHON` (see tests/common/mod.rs).

mod common;

use std::path::Path;

use common::{model_path, oracle_tokenize, run_oracle};
use kvx_tokenizer::{
    ChatMessage, ChatTemplate, MessageContent, RenderOptions, TemplateError, Tokenizer,
};
use serde_json::{Value, json};

/// 2024-02-29 13:05:09 UTC, so `strftime_now` gives the same answer on both sides.
const NOW: i64 = 1_709_211_909;

struct Chat {
    name: String,
    messages: Vec<ChatMessage>,
    tools: Option<Value>,
    extra: serde_json::Map<String, Value>,
}

fn chats() -> Vec<Chat> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chats.json");
    let all: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    all.into_iter()
        .map(|c| Chat {
            name: c["name"].as_str().unwrap().to_owned(),
            messages: serde_json::from_value(c["messages"].clone()).unwrap(),
            tools: c.get("tools").cloned(),
            extra: c.get("extra").and_then(Value::as_object).cloned().unwrap_or_default(),
        })
        .collect()
}

fn templates() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/templates");
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .map(|p| {
            (
                p.file_stem().unwrap().to_str().unwrap().to_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    let gguf = kvx_gguf::GgufFile::open(model_path()).unwrap();
    out.push(("smollm2".into(), gguf.get_str("tokenizer.chat_template").unwrap().to_owned()));
    out
}

/// The messages as the template receives them: text parts joined when the template does not
/// read typed content itself.
fn template_view(t: &ChatTemplate, messages: &[ChatMessage]) -> Value {
    Value::Array(
        messages
            .iter()
            .map(|m| {
                let mut v = serde_json::to_value(m).unwrap();
                if let (Some(MessageContent::Parts(parts)), false) =
                    (&m.content, t.supports_typed_content())
                {
                    let joined: Vec<&str> =
                        parts.iter().filter_map(|p| p.text.as_deref()).collect();
                    v["content"] = Value::String(joined.join("\n"));
                }
                v
            })
            .collect(),
    )
}

#[test]
fn renders_match_transformers() {
    let (bos, eos) = ("<s>", "</s>");
    let mut requests = Vec::new();
    let mut ours = Vec::new();
    for (tname, source) in templates() {
        let t = ChatTemplate::new(source.clone(), bos, eos).unwrap().with_fixed_time(NOW);
        for chat in chats() {
            for add_generation_prompt in [false, true] {
                let options = RenderOptions {
                    add_generation_prompt,
                    tools: chat.tools.clone(),
                    documents: None,
                    extra: chat.extra.clone(),
                };
                ours.push((
                    format!(
                        "{tname} × {} (add_generation_prompt={add_generation_prompt})",
                        chat.name
                    ),
                    t.render_with(&chat.messages, &options),
                ));
                requests.push(json!({
                    "template": source,
                    "messages": template_view(&t, &chat.messages),
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": bos,
                    "eos_token": eos,
                    "tools": chat.tools,
                    "extra": chat.extra,
                    "now": NOW,
                }));
            }
        }
    }
    let answers = run_oracle(&["render"], &requests);
    assert_eq!(answers.len(), ours.len());
    let (mut rendered, mut raised, mut lenient, mut failures) = (0, 0, 0, Vec::new());
    for ((label, got), want) in ours.iter().zip(&answers) {
        match (got, want.get("text").and_then(Value::as_str), want.get("error")) {
            (Ok(g), Some(w), _) if g == w => rendered += 1,
            (Ok(g), Some(w), _) => {
                failures.push(format!("{label}:\n--- kvx\n{g}\n--- transformers\n{w}"))
            }
            (Err(TemplateError::Raised(m)), None, Some(e)) => {
                let e = e.as_str().unwrap();
                if e == format!("TemplateError: {m}") {
                    raised += 1;
                } else {
                    failures.push(format!("{label}: raised {m:?}, transformers {e:?}"));
                }
            }
            (Err(_), None, Some(_)) => raised += 1,
            // minijinja iterates `none` as an empty sequence where jinja2 raises; a template
            // that loops over a null content renders instead of failing.
            (Ok(_), None, Some(e))
                if e.as_str().is_some_and(|e| e.contains("'NoneType' object is not iterable")) =>
            {
                lenient += 1
            }
            (g, _, _) => failures.push(format!("{label}: kvx {g:?}, transformers {want}")),
        }
    }
    if !failures.is_empty() {
        panic!("{} render mismatches:\n{}", failures.len(), failures.join("\n\n"));
    }
    eprintln!("{rendered} renders equal, {raised} errors on both sides, {lenient} lenient");
    assert!(rendered > 150, "only {rendered} renders compared");
    assert!(raised >= 4, "only {raised} template errors compared");
    assert!(lenient <= 2, "{lenient} renders where transformers fails");
}

#[test]
fn chat_prompts_tokenize_like_llama_cpp() {
    let model = model_path();
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let t = tok.chat_template().expect("SmolLM2 has a chat template");
    let mut texts = Vec::new();
    for chat in chats() {
        for agp in [false, true] {
            if let Ok(text) = t.render(&chat.messages, agp) {
                texts.push(text);
            }
        }
    }
    assert!(texts.len() >= 20);
    let oracle = oracle_tokenize(&model, &texts, true, true);
    for (text, want) in texts.iter().zip(&oracle) {
        assert_eq!(tok.encode_prompt(text).unwrap(), want.ids, "{text:?}");
        // Control tokens of the template come out as single ids.
        let im_start = tok.token_id("<|im_start|>").unwrap();
        assert_eq!(
            want.ids.iter().filter(|&&i| i == im_start).count(),
            text.matches("<|im_start|>").count()
        );
    }
}

#[test]
fn smollm2_template_facts() {
    let tok = Tokenizer::from_gguf_path(&model_path()).unwrap();
    let t = tok.chat_template().unwrap();
    assert!(tok.chat_template_error().is_none());
    assert_eq!(t.bos_token(), "<|im_start|>");
    assert_eq!(t.eos_token(), "<|im_end|>");
    assert!(!t.supports_typed_content());
    let text = t.render(&[ChatMessage::user("Hi")], true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Typed parts are joined for a template that reads strings.
    let parts: ChatMessage = serde_json::from_value(json!({
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]
    }))
    .unwrap();
    assert!(t.render(&[parts], false).unwrap().contains("<|im_start|>user\na\nb<|im_end|>"));
}

#[test]
fn template_errors_are_typed() {
    let e = ChatTemplate::new("{% for x in %}", "", "").unwrap_err();
    assert!(matches!(e, TemplateError::Syntax(_)), "{e:?}");
    let e = ChatTemplate::new("{{ x", "", "").unwrap_err();
    assert!(matches!(e, TemplateError::Syntax(_)), "{e:?}");

    let t = ChatTemplate::new("{{ raise_exception('no ' ~ messages[0].role) }}", "", "").unwrap();
    assert_eq!(
        t.render(&[ChatMessage::user("x")], false),
        Err(TemplateError::Raised("no user".into()))
    );
    let t = ChatTemplate::new("{{ messages[0].missing.deeper }}", "", "").unwrap();
    assert!(matches!(t.render(&[ChatMessage::user("x")], false), Err(TemplateError::Render(_))));
    let t = ChatTemplate::new("{{ undefined_thing | tojson }}", "", "").unwrap();
    assert!(matches!(t.render(&[], false), Err(TemplateError::Render(_))));
    let t = ChatTemplate::new("{{ 1 | tojson(bogus=1) }}", "", "").unwrap();
    assert!(matches!(t.render(&[], false), Err(TemplateError::Render(_))));
    // A template that loops forever through recursion stops with an error.
    let t = ChatTemplate::new("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "", "")
        .unwrap();
    assert!(t.render(&[], false).is_err());
}

#[test]
fn typed_content_detection_and_messages() {
    let typed = ChatTemplate::new(
        "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    assert!(typed.supports_typed_content());
    let plain =
        ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", "", "").unwrap();
    assert!(!plain.supports_typed_content());

    // OpenAI-shaped messages deserialize, with null content and extra fields kept.
    let m: ChatMessage = serde_json::from_value(json!({
        "role": "assistant", "content": null,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    }))
    .unwrap();
    assert_eq!(m.content, None);
    assert!(m.extra.contains_key("tool_calls"));
    let t = ChatTemplate::new(
        "{{ messages[0].content is none }} {{ messages[0].tool_calls[0].function.name }}",
        "",
        "",
    )
    .unwrap();
    // Booleans print as Python prints them, as in jinja2.
    assert_eq!(t.render(&[m], false).unwrap(), "True f");

    // Extra variables reach the template; the standard ones cannot be overridden.
    let t = ChatTemplate::new("{{ enable_thinking }} {{ add_generation_prompt }}", "", "").unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert("enable_thinking".into(), json!(false));
    extra.insert("add_generation_prompt".into(), json!("overridden"));
    let out = t
        .render_with(
            &[],
            &RenderOptions { add_generation_prompt: true, extra, ..Default::default() },
        )
        .unwrap();
    assert_eq!(out, "False True");
}
