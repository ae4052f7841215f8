//! Fuzz harness: arbitrary bytes as an OpenAI request body — a chat completion when the first
//! byte is even, a completion otherwise — through everything ingress does before tokenizing:
//! parsing, the shared fields and their checks (sampling, stops, `response_format` and the
//! `guided_*` grammars, `timeout`), the engine request they build, and for chats the tools and
//! `tool_choice`, and the tool-call parsers run over the request's own texts.

use kvx_ingress::openai::{ChatRequest, CompletionRequest, parse, timeout_of};
use kvx_ingress::tools::{self, StreamSplit, ToolMode};
use kvx_proto::RequestId;
use kvx_tokenizer::MessageContent;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else { return };
    if which % 2 == 0 {
        chat(body);
    } else {
        completion(body);
    }
}

fn common(c: Result<kvx_ingress::openai::Common, kvx_ingress::ApiError>) {
    let Ok(c) = c else { return };
    let _ = timeout_of(c.timeout, None);
    if let Ok(p) = c.params() {
        let _ = p.request(RequestId(1), vec![1, 2, 3], 8192);
        let _ = p.score_request(RequestId(2), vec![1, 2, 3], 8192);
    }
}

fn chat(body: &[u8]) {
    let Ok(r) = parse::<ChatRequest>(body) else { return };
    common(r.common());
    let Ok((defs, choice)) = tools::parse(r.tools.as_ref(), r.tool_choice.as_ref()) else {
        return;
    };
    let _ = tools::forced_schema(&defs, &choice);
    // The request's own texts stand in for what a model might answer.
    let texts: Vec<&str> = r
        .messages
        .iter()
        .filter_map(|m| match &m.content {
            Some(MessageContent::Text(t)) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    for t in &texts {
        let _ = tools::parse_auto(t, &defs);
        let _ = tools::parse_forced(t, &defs);
    }
    let Some(mode) = ToolMode::new(defs, &choice) else { return };
    for t in &texts {
        let _ = mode.split(t);
        // Streamed in pieces of every length up to 7 bytes, cut on character boundaries.
        let mut split = StreamSplit::default();
        let mut rest = *t;
        let mut k = 1;
        while !rest.is_empty() {
            let mut cut = (k % 7 + 1).min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let _ = split.push(&mode, &rest[..cut]);
            rest = &rest[cut..];
            k += 1;
        }
        let _ = split.finish(&mode);
    }
}

fn completion(body: &[u8]) {
    let Ok(r) = parse::<CompletionRequest>(body) else { return };
    common(r.common());
}
