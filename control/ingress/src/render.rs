//! Response bodies in OpenAI's shapes: whole responses, SSE chunks (written straight into a
//! byte buffer from a per-request prefix, so a streamed token costs one small copy), usage and
//! log-probabilities.

use bytes::{BufMut, BytesMut};
use kvx_proto::{FinishReason, Logprob, Usage};
use kvx_tokenizer::Tokenizer;
use serde_json::{Value, json};

/// Which API a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Api {
    /// Label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
        }
    }
}

/// The OpenAI `finish_reason`.
pub fn finish_reason(r: FinishReason) -> &'static str {
    r.as_str()
}

/// `usage` of a response.
pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    // kvx's extension: the prompt's KV transfer in disaggregated serving.
    if u.kv_transfer_us > 0 {
        v["kv_transfer_ms"] = json!(f64::from(u.kv_transfer_us) / 1e3);
    }
    v
}

fn piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_to_piece(id).unwrap_or(&[]).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// Log-probabilities accumulated for one choice.
#[derive(Debug, Default)]
pub struct LogprobAcc {
    entries: Vec<Value>,
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    tops: Vec<Value>,
    offsets: Vec<Value>,
    offset: usize,
}

impl LogprobAcc {
    /// Adds a token with its log-probability, keeping `n` alternatives.
    pub fn push(&mut self, api: Api, tok: &Tokenizer, id: u32, lp: &Logprob, n: usize) {
        let (text, bytes) = piece(tok, id);
        let top = lp.top.iter().take(n);
        match api {
            Api::Chat => {
                let tops: Vec<Value> = top
                    .map(|t| {
                        let (s, b) = piece(tok, t.token);
                        json!({"token": s, "logprob": t.logprob, "bytes": b})
                    })
                    .collect();
                self.entries.push(json!({
                    "token": text, "logprob": lp.logprob, "bytes": bytes, "top_logprobs": tops,
                }));
            }
            Api::Completions => {
                let mut m = serde_json::Map::new();
                for t in top {
                    m.insert(piece(tok, t.token).0, json!(t.logprob));
                }
                self.offsets.push(json!(self.offset));
                self.offset += text.chars().count();
                self.tokens.push(json!(text));
                self.token_logprobs.push(json!(lp.logprob));
                self.tops.push(Value::Object(m));
            }
        }
    }

    /// Adds a token without a log-probability (a prompt's first): `null` in its place.
    pub fn push_unscored(&mut self, api: Api, tok: &Tokenizer, id: u32) {
        let (text, bytes) = piece(tok, id);
        match api {
            Api::Chat => self.entries.push(json!({
                "token": text, "logprob": null, "bytes": bytes, "top_logprobs": [],
            })),
            Api::Completions => {
                self.offsets.push(json!(self.offset));
                self.offset += text.chars().count();
                self.tokens.push(json!(text));
                self.token_logprobs.push(Value::Null);
                self.tops.push(Value::Null);
            }
        }
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.tokens.is_empty()
    }

    /// The `logprobs` object, emptying the accumulator.
    pub fn take(&mut self, api: Api) -> Value {
        let offset = self.offset;
        let v = match api {
            Api::Chat => json!({"content": std::mem::take(&mut self.entries)}),
            Api::Completions => json!({
                "tokens": std::mem::take(&mut self.tokens),
                "token_logprobs": std::mem::take(&mut self.token_logprobs),
                "top_logprobs": std::mem::take(&mut self.tops),
                "text_offset": std::mem::take(&mut self.offsets),
            }),
        };
        *self = LogprobAcc { offset, ..Default::default() };
        v
    }
}

/// One finished choice of a whole response.
#[derive(Debug)]
pub struct Choice {
    /// Generated text.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<Value>,
    /// The `tool_calls` array, when the answer called tools (chat); `text` is then the
    /// content left beside them (none when empty).
    pub tool_calls: Option<Value>,
}

/// A whole (non-streamed) response.
pub fn response(
    api: Api,
    id: &str,
    created: u64,
    model: &str,
    choices: Vec<Choice>,
    usage: &Usage,
) -> Vec<u8> {
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| match api {
            Api::Chat => match c.tool_calls {
                None => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": c.logprobs,
                    "finish_reason": finish_reason(c.finish),
                }),
                Some(calls) => json!({
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": if c.text.is_empty() { Value::Null } else { Value::from(c.text) },
                        "tool_calls": calls,
                    },
                    "logprobs": c.logprobs,
                    "finish_reason": "tool_calls",
                }),
            },
            Api::Completions => json!({
                "index": i,
                "text": c.text,
                "logprobs": c.logprobs,
                "finish_reason": finish_reason(c.finish),
            }),
        })
        .collect();
    let object = match api {
        Api::Chat => "chat.completion",
        Api::Completions => "text_completion",
    };
    let v = json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(usage),
    });
    serde_json::to_vec(&v).unwrap_or_default()
}

/// Writes SSE chunks of one streamed response.
#[derive(Debug)]
pub struct ChunkWriter {
    api: Api,
    /// `data: {"id":...,"choices":[{"index":`
    prefix: Vec<u8>,
    /// `data: {"id":...,"model":"..."` (for the usage chunk)
    head: Vec<u8>,
}

fn json_str(buf: &mut BytesMut, s: &str) {
    // Serializing a &str cannot fail.
    let _ = serde_json::to_writer(buf.writer(), s);
}

impl ChunkWriter {
    /// A writer for response `id`.
    pub fn new(api: Api, id: &str, created: u64, model: &str) -> Self {
        let object = match api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        let mut head = BytesMut::new();
        head.put_slice(b"data: {\"id\":");
        json_str(&mut head, id);
        head.put_slice(
            format!(",\"object\":\"{object}\",\"created\":{created},\"model\":").as_bytes(),
        );
        json_str(&mut head, model);
        let head = head.to_vec();
        let mut prefix = head.clone();
        prefix.extend_from_slice(b",\"choices\":[{\"index\":");
        ChunkWriter { api, prefix, head }
    }

    /// The first chunk of a chat choice: the assistant role.
    pub fn role(&self, buf: &mut BytesMut, index: usize) {
        if self.api == Api::Chat {
            buf.put_slice(&self.prefix);
            buf.put_slice(index.to_string().as_bytes());
            buf.put_slice(
                b",\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            );
        }
    }

    /// A chunk with new text (and log-probabilities).
    pub fn delta(&self, buf: &mut BytesMut, index: usize, text: &str, logprobs: Option<&Value>) {
        buf.put_slice(&self.prefix);
        buf.put_slice(index.to_string().as_bytes());
        match self.api {
            Api::Chat => buf.put_slice(b",\"delta\":{\"content\":"),
            Api::Completions => buf.put_slice(b",\"text\":"),
        }
        json_str(buf, text);
        if self.api == Api::Chat {
            buf.put_slice(b"}");
        }
        buf.put_slice(b",\"logprobs\":");
        match logprobs {
            Some(v) => {
                let _ = serde_json::to_writer(buf.writer(), v);
            }
            None => buf.put_slice(b"null"),
        }
        buf.put_slice(b",\"finish_reason\":null}]}\n\n");
    }

    /// The last chunk of a choice.
    pub fn finish(&self, buf: &mut BytesMut, index: usize, reason: FinishReason) {
        buf.put_slice(&self.prefix);
        buf.put_slice(index.to_string().as_bytes());
        match self.api {
            Api::Chat => buf.put_slice(b",\"delta\":{}"),
            Api::Completions => buf.put_slice(b",\"text\":\"\""),
        }
        buf.put_slice(b",\"logprobs\":null,\"finish_reason\":\"");
        buf.put_slice(finish_reason(reason).as_bytes());
        buf.put_slice(b"\"}]}\n\n");
    }

    /// A chat chunk with a choice's tool calls, each whole (`calls`: the `tool_calls` array;
    /// every entry gets its place as `index`).
    pub fn tool_calls(&self, buf: &mut BytesMut, index: usize, calls: &Value) {
        let calls: Vec<Value> = calls
            .as_array()
            .map(|a| {
                a.iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let mut c = c.clone();
                        c["index"] = Value::from(i);
                        c
                    })
                    .collect()
            })
            .unwrap_or_default();
        buf.put_slice(&self.prefix);
        buf.put_slice(index.to_string().as_bytes());
        buf.put_slice(b",\"delta\":{\"tool_calls\":");
        let _ = serde_json::to_writer(buf.writer(), &calls);
        buf.put_slice(b"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }

    /// The last chunk of a choice that called tools (`finish_reason: tool_calls`).
    pub fn finish_tool_calls(&self, buf: &mut BytesMut, index: usize) {
        buf.put_slice(&self.prefix);
        buf.put_slice(index.to_string().as_bytes());
        buf.put_slice(b",\"delta\":{},\"logprobs\":null,\"finish_reason\":\"tool_calls\"}]}\n\n");
    }

    /// The usage chunk (`stream_options.include_usage`).
    pub fn usage(&self, buf: &mut BytesMut, usage: &Usage) {
        buf.put_slice(&self.head);
        buf.put_slice(b",\"choices\":[],\"usage\":");
        let _ = serde_json::to_writer(buf.writer(), &usage_json(usage));
        buf.put_slice(b"}\n\n");
    }

    /// An error in the middle of a stream.
    pub fn error(&self, buf: &mut BytesMut, error_json: &str) {
        buf.put_slice(b"data: ");
        buf.put_slice(error_json.as_bytes());
        buf.put_slice(b"\n\n");
    }

    /// The end of the stream.
    pub fn done(&self, buf: &mut BytesMut) {
        buf.put_slice(b"data: [DONE]\n\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(buf: &BytesMut) -> Vec<Value> {
        std::str::from_utf8(buf)
            .unwrap()
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let d = e.strip_prefix("data: ").unwrap();
                if d == "[DONE]" { json!("DONE") } else { serde_json::from_str(d).unwrap() }
            })
            .collect()
    }

    #[test]
    fn chat_chunks_are_valid_json_in_openai_shape() {
        let w = ChunkWriter::new(Api::Chat, "chatcmpl-1", 7, "m\"odel");
        let mut b = BytesMut::new();
        w.role(&mut b, 0);
        w.delta(&mut b, 0, "he said \"hi\"\n", None);
        w.finish(&mut b, 0, FinishReason::Length);
        w.usage(
            &mut b,
            &Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_tokens: 1,
                ..Default::default()
            },
        );
        w.done(&mut b);
        let ev = events(&b);
        assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(ev[0]["object"], "chat.completion.chunk");
        assert_eq!(ev[0]["model"], "m\"odel");
        assert_eq!(ev[1]["choices"][0]["delta"]["content"], "he said \"hi\"\n");
        assert_eq!(ev[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(ev[3]["choices"], json!([]));
        assert_eq!(ev[3]["usage"]["total_tokens"], 5);
        assert_eq!(ev[3]["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        assert_eq!(ev[4], "DONE");
    }

    #[test]
    fn completion_chunks_carry_text() {
        let w = ChunkWriter::new(Api::Completions, "cmpl-1", 7, "m");
        let mut b = BytesMut::new();
        w.role(&mut b, 0);
        w.delta(&mut b, 1, "x", Some(&json!({"tokens": ["x"]})));
        w.finish(&mut b, 1, FinishReason::Stop);
        let ev = events(&b);
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0]["object"], "text_completion");
        assert_eq!(ev[0]["choices"][0]["index"], 1);
        assert_eq!(ev[0]["choices"][0]["text"], "x");
        assert_eq!(ev[0]["choices"][0]["logprobs"]["tokens"][0], "x");
        assert_eq!(ev[1]["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn whole_response_shape() {
        let body = response(
            Api::Chat,
            "chatcmpl-1",
            5,
            "m",
            vec![Choice {
                text: "hi".into(),
                finish: FinishReason::Stop,
                logprobs: None,
                tool_calls: None,
            }],
            &Usage {
                prompt_tokens: 4,
                completion_tokens: 1,
                cached_tokens: 0,
                ..Default::default()
            },
        );
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "hi");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 5);
        assert_eq!(v["object"], "chat.completion");
    }
}
