//! Request bodies for the OpenAI chat and completions APIs, built once per prompt.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// Which OpenAI API to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions` with `messages`.
    Chat,
    /// `POST /v1/completions` with `prompt`.
    Completions,
}

impl Api {
    /// The default path of the API.
    pub fn default_path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }
}

/// Where and how requests are sent.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointConfig {
    /// Base URL, e.g. `http://127.0.0.1:8000` (a path, if given, replaces the API's default).
    pub url: String,
    /// Which API.
    pub api: Api,
    /// Model name sent in each request; `None` asks the server (`GET /v1/models`).
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer ...` when set.
    pub api_key: Option<String>,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Stream the response (SSE). Without streaming there is no TTFT or ITL.
    pub stream: bool,
    /// Ask for a final usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Send `ignore_eos: true` so servers that honour it generate exactly `max_tokens`.
    pub ignore_eos: bool,
    /// Send the limit as `max_completion_tokens` instead of `max_tokens`.
    pub max_completion_tokens_field: bool,
    /// Extra top-level fields merged into every body (they win over the defaults).
    pub extra_body: Map<String, Value>,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8000".into(),
            api: Api::Chat,
            model: None,
            api_key: None,
            headers: Vec::new(),
            stream: true,
            include_usage: true,
            ignore_eos: false,
            max_completion_tokens_field: false,
            extra_body: Map::new(),
        }
    }
}

/// A chat message role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The user.
    User,
    /// The model.
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

/// Builds request bodies for one endpoint and model.
#[derive(Debug, Clone)]
pub struct BodyBuilder {
    endpoint: EndpointConfig,
    model: String,
}

impl BodyBuilder {
    /// A builder for `endpoint`, naming `model` in every body.
    pub fn new(endpoint: &EndpointConfig, model: &str) -> Self {
        Self { endpoint: endpoint.clone(), model: model.to_string() }
    }

    /// The body for a conversation whose last message is the user's, asking for at most
    /// `max_tokens` tokens.
    pub fn body(&self, messages: &[(Role, &str)], max_tokens: u32) -> Bytes {
        let mut obj = Map::new();
        obj.insert("model".into(), Value::String(self.model.clone()));
        match self.endpoint.api {
            Api::Chat => {
                let msgs: Vec<Value> = messages
                    .iter()
                    .map(|(role, text)| json!({"role": role.as_str(), "content": text}))
                    .collect();
                obj.insert("messages".into(), Value::Array(msgs));
            }
            Api::Completions => {
                let mut prompt = String::new();
                for (i, (_, text)) in messages.iter().enumerate() {
                    if i > 0 {
                        prompt.push('\n');
                    }
                    prompt.push_str(text);
                }
                obj.insert("prompt".into(), Value::String(prompt));
            }
        }
        let field = if self.endpoint.max_completion_tokens_field {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        obj.insert(field.into(), json!(max_tokens));
        obj.insert("stream".into(), Value::Bool(self.endpoint.stream));
        if self.endpoint.stream && self.endpoint.include_usage {
            obj.insert("stream_options".into(), json!({"include_usage": true}));
        }
        if self.endpoint.ignore_eos {
            obj.insert("ignore_eos".into(), Value::Bool(true));
        }
        for (k, v) in &self.endpoint.extra_body {
            obj.insert(k.clone(), v.clone());
        }
        // Serializing a Map of plain values cannot fail.
        Bytes::from(serde_json::to_vec(&Value::Object(obj)).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_body_has_messages_limits_and_extras() {
        let mut ep = EndpointConfig { ignore_eos: true, ..Default::default() };
        ep.extra_body.insert("temperature".into(), json!(0.0));
        ep.extra_body.insert("max_tokens".into(), json!(7));
        let b = BodyBuilder::new(&ep, "m").body(&[(Role::User, "hi"), (Role::Assistant, "yo")], 5);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["model"], "m");
        assert_eq!(v["messages"][1]["role"], "assistant");
        assert_eq!(v["max_tokens"], 7, "extra body wins");
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["ignore_eos"], true);
        assert_eq!(v["temperature"], 0.0);
    }

    #[test]
    fn completions_body_joins_the_turns() {
        let ep = EndpointConfig {
            api: Api::Completions,
            stream: false,
            max_completion_tokens_field: true,
            ..Default::default()
        };
        let b = BodyBuilder::new(&ep, "m").body(&[(Role::User, "a"), (Role::User, "b")], 3);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], "a\nb");
        assert_eq!(v["max_completion_tokens"], 3);
        assert!(v.get("stream_options").is_none());
    }
}
