//! Fuzz harness: hostile conversations through real chat templates. The first byte picks a
//! template (ChatML, Llama 3, Mistral, Gemma, Qwen with tools, typed content, ...); the rest is
//! a JSON object `{"messages": [...], "tools": ..., "documents": ..., "kwargs": {...}}` rendered
//! with it. Rendering may refuse (a template raising on a bad role), never panic or hang.

use kvx_tokenizer::{ChatMessage, ChatTemplate, RenderOptions};

const TEMPLATES: [&str; 8] = [
    include_str!("../../tests/data/templates/chatml_default_system.jinja"),
    include_str!("../../tests/data/templates/llama3_style.jinja"),
    include_str!("../../tests/data/templates/mistral_style.jinja"),
    include_str!("../../tests/data/templates/gemma_style.jinja"),
    include_str!("../../tests/data/templates/qwen_tools.jinja"),
    include_str!("../../tests/data/templates/typed_content.jinja"),
    include_str!("../../tests/data/templates/tojson_variety.jinja"),
    include_str!("../../tests/data/templates/python_methods.jinja"),
];

#[derive(serde::Deserialize)]
struct Input {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    tools: Option<serde_json::Value>,
    #[serde(default)]
    documents: Option<serde_json::Value>,
    #[serde(default)]
    kwargs: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    generation_prompt: bool,
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else { return };
    let Ok(input) = serde_json::from_slice::<Input>(body) else { return };
    let Ok(t) = ChatTemplate::new(TEMPLATES[which as usize % TEMPLATES.len()], "<s>", "</s>")
    else {
        panic!("a test template does not compile");
    };
    let t = t.with_fixed_time(1_700_000_000);
    let opts = RenderOptions {
        add_generation_prompt: input.generation_prompt,
        tools: input.tools,
        documents: input.documents,
        extra: input.kwargs,
    };
    let _ = t.render_with(&input.messages, &opts);
}
