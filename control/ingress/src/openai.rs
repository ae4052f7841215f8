//! OpenAI request bodies as clients send them (`/v1/chat/completions`, `/v1/completions`),
//! and their translation into engine requests: validation, chat templating, tokenization and
//! the context-length check. Unknown fields are ignored; a field of the wrong type is a 400.

use kvx_proto::{Constraint, GenerateRequest, RequestId, SamplingOptions, StopConditions, TokenId};
use kvx_tokenizer::{ChatMessage, MessageContent, RenderOptions, Tokenizer};
use serde::Deserialize;

use crate::error::ApiError;

/// Stop strings accepted per request at most.
pub const MAX_STOP_STRINGS: usize = 16;
/// Prompts in one `/v1/completions` request at most.
pub const MAX_PROMPTS: usize = 64;
/// Alternatives per token (`top_logprobs`) at most.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Choices per prompt (`n`) at most.
pub const MAX_N: u32 = 16;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `/v1/completions` `prompt`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<TokenId>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<TokenId>>),
}

/// The sampling and stopping fields both endpoints share.
#[derive(Debug, Clone, Default)]
pub struct Common {
    /// `model`.
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u32>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k` (≤ 0 = off).
    pub top_k: Option<i64>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `seed`.
    pub seed: Option<i64>,
    /// `n`.
    pub n: Option<u32>,
    /// `stop`.
    pub stop: Option<StopSpec>,
    /// `stop_token_ids` (extension).
    pub stop_token_ids: Option<Vec<TokenId>>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
    /// `repetition_penalty` (extension).
    pub repetition_penalty: Option<f32>,
    /// Alternatives per token when logprobs are asked for (`None` = no logprobs).
    pub logprobs: Option<u32>,
    /// `ignore_eos` (extension).
    pub ignore_eos: bool,
    /// `min_tokens` (extension).
    pub min_tokens: Option<u32>,
    /// The grammar of the output (`response_format`, `guided_*`).
    pub constraint: Option<Constraint>,
    /// `timeout` (extension): seconds the whole request may take, queue included.
    pub timeout: Option<f64>,
}

/// A `/tokenize` body (vLLM's shape): a `prompt`, or `messages` rendered by the chat template
/// as `/v1/chat/completions` renders them.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// A text to tokenize.
    #[serde(default)]
    pub prompt: Option<String>,
    /// A conversation to render and tokenize.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// Add the model's BOS/EOS as a prompt gets them (default true for `prompt`; for
    /// `messages`, the template places them and this defaults to false).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text.
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// A `/detokenize` body.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids.
    pub tokens: Vec<TokenId>,
}

/// A `/v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    stop: Option<StopSpec>,
    #[serde(default)]
    stop_token_ids: Option<Vec<TokenId>>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    min_tokens: Option<u32>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
    #[serde(default)]
    timeout: Option<f64>,
    /// Tool definitions, handed to the chat template.
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// `tool_choice`: `none`, `auto`, `required` or a named function ([`crate::tools`]).
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// `parallel_tool_calls`: accepted; a forced choice makes one call.
    #[serde(default)]
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    /// Extra chat template variables (extension).
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// `response_format` (`text`, `json_object`, `json_schema`).
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// `guided_json` (vLLM extension): a JSON schema, as an object or a string.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    /// `guided_regex` (vLLM extension).
    #[serde(default)]
    pub guided_regex: Option<String>,
    /// `guided_grammar` (vLLM extension): a Lark grammar.
    #[serde(default)]
    pub guided_grammar: Option<String>,
}

/// A `/v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: PromptSpec,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    best_of: Option<u32>,
    /// Each choice's text starts with its prompt's text.
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    stop: Option<StopSpec>,
    #[serde(default)]
    stop_token_ids: Option<Vec<TokenId>>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    logprobs: Option<u32>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    min_tokens: Option<u32>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
    #[serde(default)]
    timeout: Option<f64>,
    /// `response_format` (`text`, `json_object`, `json_schema`).
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// `guided_json` (vLLM extension): a JSON schema, as an object or a string.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    /// `guided_regex` (vLLM extension).
    #[serde(default)]
    pub guided_regex: Option<String>,
    /// `guided_grammar` (vLLM extension): a Lark grammar.
    #[serde(default)]
    pub guided_grammar: Option<String>,
}

macro_rules! common_fields {
    ($r:expr, $logprobs:expr) => {
        Common {
            model: $r.model.clone(),
            stream: $r.stream.unwrap_or(false),
            include_usage: $r
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            max_tokens: $r.max_completion_tokens.or($r.max_tokens),
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            n: $r.n,
            stop: $r.stop.clone(),
            stop_token_ids: $r.stop_token_ids.clone(),
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            repetition_penalty: $r.repetition_penalty,
            logprobs: $logprobs,
            ignore_eos: $r.ignore_eos.unwrap_or(false),
            min_tokens: $r.min_tokens,
            constraint: constraint_of(
                $r.response_format.as_ref(),
                $r.guided_json.as_ref(),
                $r.guided_regex.as_deref(),
                $r.guided_grammar.as_deref(),
            )?,
            timeout: $r.timeout,
        }
    };
}

impl ChatRequest {
    /// The shared fields.
    pub fn common(&self) -> Result<Common, ApiError> {
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, n) => Some(n.unwrap_or(0)),
            (false, Some(n)) if n > 0 => {
                return Err(ApiError::bad_request(
                    "top_logprobs requires logprobs to be true",
                    Some("top_logprobs"),
                ));
            }
            (false, _) => None,
        };
        Ok(common_fields!(self, logprobs))
    }

    /// The prompt text: the conversation through the model's chat template.
    pub fn render(&self, tok: &Tokenizer) -> Result<String, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty", Some("messages")));
        }
        for m in &self.messages {
            if let Some(MessageContent::Parts(parts)) = &m.content
                && let Some(p) = parts.iter().find(|p| p.kind != "text")
            {
                return Err(ApiError::bad_request(
                    format!("content parts of type {:?} are not supported (text only)", p.kind),
                    Some("messages"),
                ));
            }
        }
        let Some(t) = tok.chat_template() else {
            return Err(ApiError::bad_request(
                "this model has no chat template; use /v1/completions",
                None,
            ));
        };
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: self.tools.clone().filter(|v| !v.is_null()),
            documents: None,
            extra: self.chat_template_kwargs.clone().unwrap_or_default(),
        };
        t.render_with(&self.messages, &opts)
            .map_err(|e| ApiError::bad_request(format!("chat template: {e}"), Some("messages")))
    }
}

impl CompletionRequest {
    /// The shared fields.
    pub fn common(&self) -> Result<Common, ApiError> {
        if self.best_of.is_some_and(|b| b != 1 && Some(b) != self.n) {
            return Err(ApiError::bad_request("best_of must be 1 or equal to n", Some("best_of")));
        }
        Ok(common_fields!(self, self.logprobs))
    }

    /// The prompts as token ids (BOS added as the model asks for text prompts).
    pub fn prompts(&self, tok: &Tokenizer) -> Result<Vec<Vec<TokenId>>, ApiError> {
        let encode = |s: &str| {
            tok.encode_prompt(s)
                .map_err(|e| ApiError::bad_request(format!("prompt: {e}"), Some("prompt")))
        };
        let out: Vec<Vec<TokenId>> = match &self.prompt {
            PromptSpec::Text(s) => vec![encode(s)?],
            PromptSpec::Texts(v) => {
                check_count(v.len())?;
                v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?
            }
            PromptSpec::Tokens(t) => vec![t.clone()],
            PromptSpec::TokenLists(v) => {
                check_count(v.len())?;
                v.clone()
            }
        };
        let vocab = tok.vocab_size();
        for p in &out {
            if p.is_empty() {
                return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
            }
            if let Some(&t) = p.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_request(
                    format!("prompt token {t} is outside the vocabulary of {vocab}"),
                    Some("prompt"),
                ));
            }
        }
        Ok(out)
    }
}

fn check_count(n: usize) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::bad_request("prompt must not be an empty list", Some("prompt")));
    }
    if n > MAX_PROMPTS {
        return Err(ApiError::bad_request(
            format!("at most {MAX_PROMPTS} prompts per request ({n} given)"),
            Some("prompt"),
        ));
    }
    Ok(())
}

/// The output's grammar from `response_format` and vLLM's `guided_json`, `guided_regex` and
/// `guided_grammar` (at most one of them; `response_format` of type `text` is none).
fn constraint_of(
    response_format: Option<&serde_json::Value>,
    guided_json: Option<&serde_json::Value>,
    guided_regex: Option<&str>,
    guided_grammar: Option<&str>,
) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: String, field: &'static str| ApiError::bad_request(m, Some(field));
    let schema_text = |v: &serde_json::Value, field: &'static str| match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Object(_) | serde_json::Value::Bool(_) => Ok(v.to_string()),
        _ => Err(bad(format!("{field} must be a JSON schema (an object)"), field)),
    };
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    match response_format.filter(|v| !v.is_null()) {
        None => {}
        Some(serde_json::Value::Object(rf)) => match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", Constraint::JsonObject)),
            Some("json_schema") => {
                let Some(schema) =
                    rf.get("json_schema").and_then(|j| j.get("schema")).filter(|s| !s.is_null())
                else {
                    return Err(bad(
                        "response_format.json_schema.schema is required for type json_schema"
                            .into(),
                        "response_format.json_schema",
                    ));
                };
                let text = schema_text(schema, "response_format.json_schema.schema")?;
                found.push(("response_format", Constraint::JsonSchema(text)));
            }
            Some(t) => {
                return Err(bad(
                    format!(
                        "response_format.type {t:?} is not supported (text, json_object or \
                         json_schema)"
                    ),
                    "response_format.type",
                ));
            }
            None => {
                return Err(bad(
                    "response_format.type is required (text, json_object or json_schema)".into(),
                    "response_format.type",
                ));
            }
        },
        Some(_) => {
            return Err(bad("response_format must be an object".into(), "response_format"));
        }
    }
    if let Some(v) = guided_json.filter(|v| !v.is_null()) {
        found.push(("guided_json", Constraint::JsonSchema(schema_text(v, "guided_json")?)));
    }
    if let Some(r) = guided_regex {
        found.push(("guided_regex", Constraint::Regex(r.to_owned())));
    }
    if let Some(g) = guided_grammar {
        found.push(("guided_grammar", Constraint::Lark(g.to_owned())));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(bad(
            format!("only one output constraint per request ({} given)", names.join(", ")),
            found[1].0,
        ));
    }
    let c = found.pop();
    if let Some((field, c)) = &c {
        let len = match c {
            Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Lark(t) => t.len(),
            Constraint::JsonObject => 0,
        };
        check_constraint_len(len, field)?;
    }
    Ok(c.map(|(_, c)| c))
}

/// Longest grammar text (schema, regex or Lark) a request may carry: each choice's engine
/// request holds a copy, and compiling it costs the engine's step thread.
pub const MAX_CONSTRAINT_BYTES: usize = 64 << 10;

/// A constraint's text within [`MAX_CONSTRAINT_BYTES`].
pub fn check_constraint_len(len: usize, field: &'static str) -> Result<(), ApiError> {
    if len > MAX_CONSTRAINT_BYTES {
        return Err(ApiError::bad_request(
            format!("{field}: the grammar is {len} bytes, more than {MAX_CONSTRAINT_BYTES}"),
            Some(field),
        ));
    }
    Ok(())
}

/// Longest `timeout` accepted, seconds (a day).
pub const MAX_TIMEOUT_SECS: f64 = 86_400.0;

/// A request's deadline from now: the shorter of its `timeout` field and its
/// `X-Request-Timeout` header (seconds, each in (0, a day]); `None` without either.
pub fn timeout_of(
    field: Option<f64>,
    header: Option<&[u8]>,
) -> Result<Option<std::time::Duration>, ApiError> {
    let check = |v: f64, name: &'static str| {
        if v.is_finite() && v > 0.0 && v <= MAX_TIMEOUT_SECS {
            Ok(v)
        } else {
            Err(ApiError::bad_request(
                format!("{name} must be a number of seconds in (0, {MAX_TIMEOUT_SECS}]"),
                Some(name),
            ))
        }
    };
    let from_header = match header {
        None => None,
        Some(h) => {
            let v = std::str::from_utf8(h).ok().and_then(|t| t.trim().parse::<f64>().ok());
            Some(check(v.unwrap_or(f64::NAN), "x-request-timeout")?)
        }
    };
    let from_field = field.map(|v| check(v, "timeout")).transpose()?;
    let secs = match (from_field, from_header) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Ok(secs.map(std::time::Duration::from_secs_f64))
}

/// Parses a JSON body into `T`, mapping syntax and type errors to a 400.
pub fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "malformed JSON"
            }
            _ => "invalid request",
        };
        ApiError::bad_request(format!("{what}: {e}"), None)
    })
}

fn range(name: &'static str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::bad_request(
            format!("{name} must be between {lo} and {hi} (got {x})"),
            Some(name),
        )),
        _ => Ok(()),
    }
}

/// Sampling and stopping, validated; `max_tokens` still to be resolved against the prompt.
#[derive(Debug, Clone)]
pub struct Params {
    /// Sampling.
    pub sampling: SamplingOptions,
    /// Stop conditions (`max_tokens` = requested, 0 when absent).
    pub stop: StopConditions,
    /// Alternatives per token wanted by the client (`None` = no logprobs).
    pub logprobs: Option<u32>,
    /// The grammar of the output.
    pub constraint: Option<Constraint>,
    /// Alternatives per scored prompt token (`echo` with `logprobs`; `None` = not scored).
    pub prompt_logprobs: Option<u32>,
}

impl Common {
    /// Validates the fields and builds the engine's parameters.
    pub fn params(&self) -> Result<Params, ApiError> {
        if let Some(n) = self.n
            && !(1..=MAX_N).contains(&n)
        {
            return Err(ApiError::bad_request(
                format!("n must be between 1 and {MAX_N} (got {n})"),
                Some("n"),
            ));
        }
        range("temperature", self.temperature, 0.0, 100.0)?;
        range("top_p", self.top_p, f32::MIN_POSITIVE, 1.0)?;
        range("min_p", self.min_p, 0.0, 1.0)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        range("repetition_penalty", self.repetition_penalty, f32::MIN_POSITIVE, 100.0)?;
        if self.max_tokens == Some(0) {
            return Err(ApiError::bad_request("max_tokens must be at least 1", Some("max_tokens")));
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(ApiError::bad_request(
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS} (got {n})"),
                Some("top_logprobs"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopSpec::One(s)) => vec![s.clone()],
            Some(StopSpec::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_request(
                format!("at most {MAX_STOP_STRINGS} stop strings ({} given)", stop.len()),
                Some("stop"),
            ));
        }
        if stop.iter().any(|s| s.is_empty() || s.len() > 1024) {
            return Err(ApiError::bad_request(
                "stop strings must be 1 to 1024 bytes long",
                Some("stop"),
            ));
        }
        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if stop_token_ids.len() > 256 {
            return Err(ApiError::bad_request(
                "at most 256 stop_token_ids",
                Some("stop_token_ids"),
            ));
        }
        let sampling = SamplingOptions {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.map_or(0, |k| k.clamp(0, i64::from(u32::MAX)) as u32),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
        };
        Ok(Params {
            sampling,
            stop: StopConditions {
                max_tokens: self.max_tokens.unwrap_or(0),
                min_tokens: self.min_tokens.unwrap_or(0),
                stop_token_ids,
                stop,
                ignore_eos: self.ignore_eos,
            },
            logprobs: self.logprobs,
            constraint: self.constraint.clone(),
            prompt_logprobs: None,
        })
    }
}

impl Params {
    /// The engine request that scores a prompt and generates nothing (`echo` with `logprobs`
    /// and `max_tokens: 0`): the prompt may fill the context.
    pub fn score_request(
        &self,
        id: RequestId,
        prompt: Vec<TokenId>,
        context: usize,
    ) -> Result<GenerateRequest, ApiError> {
        let p = prompt.len();
        if p > context {
            return Err(ApiError::bad_request(
                format!(
                    "This model's maximum context length is {context} tokens. However, your \
                     prompt has {p} tokens. Please reduce the length of the prompt."
                ),
                Some("prompt"),
            ));
        }
        let mut r = self.request(id, prompt, usize::MAX)?;
        r.stop.max_tokens = 0;
        Ok(r)
    }

    /// The engine request for one prompt, with `max_tokens` checked against the context
    /// (absent = the rest of the context).
    pub fn request(
        &self,
        id: RequestId,
        prompt: Vec<TokenId>,
        context: usize,
    ) -> Result<GenerateRequest, ApiError> {
        let p = prompt.len();
        let max_tokens = if self.stop.max_tokens == 0 {
            if p >= context {
                return Err(ApiError::bad_request(
                    format!(
                        "This model's maximum context length is {context} tokens. However, your \
                         prompt has {p} tokens, leaving no room for the completion. Please \
                         reduce the length of the prompt."
                    ),
                    Some("messages"),
                ));
            }
            context - p
        } else {
            let m = self.stop.max_tokens as usize;
            if p + m > context {
                return Err(ApiError::bad_request(
                    format!(
                        "This model's maximum context length is {context} tokens. However, you \
                         requested {} tokens ({p} in the prompt, {m} in the completion). Please \
                         reduce the length of the prompt or max_tokens.",
                        p + m
                    ),
                    Some("max_tokens"),
                ));
            }
            m
        };
        let mut stop = self.stop.clone();
        stop.max_tokens = max_tokens.min(u32::MAX as usize) as u32;
        Ok(GenerateRequest {
            id,
            prompt,
            sampling: self.sampling.clone(),
            stop,
            // The engine sends the token's own logprob only with at least one alternative.
            logprobs: self.logprobs.map(|n| n.max(1)),
            salt: None,
            kv: Default::default(),
            resume: Vec::new(),
            constraint: self.constraint.clone(),
            prompt_logprobs: self.prompt_logprobs,
            fork: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_of_the_wrong_type_are_rejected_and_unknown_ones_ignored() {
        let ok: ChatRequest = parse(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"frobnicate":{"x":1},
                "temperature":0,"stop":"x","max_tokens":5}"#,
        )
        .unwrap();
        let c = ok.common().unwrap();
        assert_eq!(c.max_tokens, Some(5));
        assert!(matches!(c.stop, Some(StopSpec::One(_))));
        for bad in [
            &br#"{"messages":"hi"}"#[..],
            br#"{"messages":[],"temperature":"hot"}"#,
            br#"{"messages":[],"max_tokens":-1}"#,
            br#"{"messages":[],"stream":"yes"}"#,
            br#"{"messages":[{"role":"user","content":5}]}"#,
            br#"{"messages":[] "#,
        ] {
            let e = parse::<ChatRequest>(bad).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn prompts_of_every_shape_parse() {
        for (body, n) in [
            (&br#"{"prompt":"a"}"#[..], 1),
            (br#"{"prompt":["a","b"]}"#, 2),
            (br#"{"prompt":[1,2,3]}"#, 1),
            (br#"{"prompt":[[1,2],[3]]}"#, 2),
        ] {
            let r: CompletionRequest = parse(body).unwrap();
            let got = match r.prompt {
                PromptSpec::Text(_) | PromptSpec::Tokens(_) => 1,
                PromptSpec::Texts(v) => v.len(),
                PromptSpec::TokenLists(v) => v.len(),
            };
            assert_eq!(got, n);
        }
    }

    #[test]
    fn parameters_are_range_checked() {
        let base = Common::default();
        assert!(base.params().is_ok());
        assert!(Common { n: Some(MAX_N), ..Default::default() }.params().is_ok());
        for c in [
            Common { n: Some(0), ..Default::default() },
            Common { n: Some(MAX_N + 1), ..Default::default() },
            Common { temperature: Some(-1.0), ..Default::default() },
            Common { top_p: Some(0.0), ..Default::default() },
            Common { top_p: Some(f32::NAN), ..Default::default() },
            Common { max_tokens: Some(0), ..Default::default() },
            Common { logprobs: Some(21), ..Default::default() },
            Common { stop: Some(StopSpec::Many(vec!["x".into(); 17])), ..Default::default() },
            Common { stop: Some(StopSpec::One(String::new())), ..Default::default() },
        ] {
            assert_eq!(c.params().unwrap_err().status.as_u16(), 400, "{c:?}");
        }
    }

    #[test]
    fn context_overflow_states_both_numbers() {
        let p = Common { max_tokens: Some(100), ..Default::default() }.params().unwrap();
        let s = std::time::Duration::from_secs_f64;
        assert_eq!(timeout_of(None, None).unwrap(), None);
        assert_eq!(timeout_of(Some(2.5), None).unwrap(), Some(s(2.5)));
        assert_eq!(timeout_of(Some(2.5), Some(b" 1.5")).unwrap(), Some(s(1.5)));
        assert_eq!(timeout_of(None, Some(b"3")).unwrap(), Some(s(3.0)));
        for (f, h) in [
            (Some(0.0), None),
            (Some(-1.0), None),
            (Some(f64::INFINITY), None),
            (Some(1e9), None),
            (None, Some(&b"soon"[..])),
            (None, Some(&b"0"[..])),
        ] {
            assert_eq!(timeout_of(f, h).unwrap_err().status.as_u16(), 400, "{f:?} {h:?}");
        }
        let e = p.request(RequestId(1), vec![1; 50], 120).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("120") && e.message.contains("50") && e.message.contains("100"));
        let r = p.request(RequestId(1), vec![1; 20], 120).unwrap();
        assert_eq!(r.stop.max_tokens, 100);
        // Absent max_tokens fills the context.
        let p = Common::default().params().unwrap();
        assert_eq!(p.request(RequestId(1), vec![1; 20], 120).unwrap().stop.max_tokens, 100);
        assert!(p.request(RequestId(1), vec![1; 120], 120).is_err());
    }

    #[test]
    fn chat_logprobs_need_the_flag() {
        let r: ChatRequest = parse(br#"{"messages":[],"top_logprobs":3}"#).unwrap();
        assert!(r.common().is_err());
        let r: ChatRequest = parse(br#"{"messages":[],"logprobs":true,"top_logprobs":3}"#).unwrap();
        assert_eq!(r.common().unwrap().logprobs, Some(3));
        let p = r.common().unwrap().params().unwrap();
        let r: ChatRequest = parse(br#"{"messages":[],"logprobs":true}"#).unwrap();
        assert_eq!(r.common().unwrap().logprobs, Some(0));
        // The engine is asked for at least one alternative so the token's own logprob comes.
        let req = r.common().unwrap().params().unwrap().request(RequestId(1), vec![1], 10).unwrap();
        assert_eq!(req.logprobs, Some(1));
        assert_eq!(p.logprobs, Some(3));
    }

    #[test]
    fn echo_with_logprobs_is_taken_and_best_of_may_equal_n() {
        let r: CompletionRequest = parse(br#"{"prompt":"a","echo":true,"logprobs":1}"#).unwrap();
        assert_eq!(r.common().unwrap().logprobs, Some(1));
        let r: CompletionRequest = parse(br#"{"prompt":"a","echo":true,"max_tokens":0}"#).unwrap();
        assert_eq!(r.common().unwrap().max_tokens, Some(0));
        let r: CompletionRequest = parse(br#"{"prompt":"a","n":3,"best_of":3}"#).unwrap();
        assert!(r.common().is_ok());
        let r: CompletionRequest = parse(br#"{"prompt":"a","n":3,"best_of":4}"#).unwrap();
        assert!(r.common().is_err());
    }

    #[test]
    fn output_constraints_map_from_response_format_and_guided_fields() {
        let c = |body: &str| -> Result<Option<Constraint>, u16> {
            let r: ChatRequest = parse(body.as_bytes()).map_err(|e| e.status.as_u16())?;
            r.common().map(|c| c.constraint).map_err(|e| e.status.as_u16())
        };
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(c(&format!("{{{m}}}")), Ok(None));
        // A grammar past the size bound is refused before any engine sees it.
        let long = "a".repeat(MAX_CONSTRAINT_BYTES + 1);
        assert_eq!(c(&format!(r#"{{{m},"guided_regex":"{long}"}}"#)), Err(400));
        let fits = "a".repeat(MAX_CONSTRAINT_BYTES);
        assert!(c(&format!(r#"{{{m},"guided_regex":"{fits}"}}"#)).is_ok());
        assert_eq!(c(&format!(r#"{{{m},"response_format":{{"type":"text"}}}}"#)), Ok(None));
        assert_eq!(
            c(&format!(r#"{{{m},"response_format":{{"type":"json_object"}}}}"#)),
            Ok(Some(Constraint::JsonObject))
        );
        let got = c(&format!(
            r#"{{{m},"response_format":{{"type":"json_schema","json_schema":{{"name":"x",
                "schema":{{"type":"integer"}},"strict":true}}}}}}"#
        ));
        assert_eq!(got, Ok(Some(Constraint::JsonSchema(r#"{"type":"integer"}"#.into()))));
        assert_eq!(
            c(&format!(r#"{{{m},"guided_json":"{{\"type\":\"string\"}}"}}"#)),
            Ok(Some(Constraint::JsonSchema(r#"{"type":"string"}"#.into())))
        );
        assert_eq!(
            c(&format!(r#"{{{m},"guided_regex":"\\d+"}}"#)),
            Ok(Some(Constraint::Regex(r"\d+".into())))
        );
        assert_eq!(
            c(&format!(r#"{{{m},"guided_grammar":"start: \"a\""}}"#)),
            Ok(Some(Constraint::Lark(r#"start: "a""#.into())))
        );
        for bad in [
            r#""response_format":{"type":"xml"}"#,
            r#""response_format":{"type":"json_schema"}"#,
            r#""response_format":"json""#,
            r#""response_format":{}"#,
            r#""guided_json":5"#,
            r#""guided_regex":"a","guided_grammar":"start: \"a\"""#,
        ] {
            assert_eq!(c(&format!("{{{m},{bad}}}")), Err(400), "{bad}");
        }
        let r: ChatRequest =
            parse(format!(r#"{{{m},"response_format":{{"type":"xml"}}}}"#).as_bytes()).unwrap();
        let e = r.common().unwrap_err();
        assert!(e.message.contains("response_format.type"), "{}", e.message);
        // Completions take the same fields, and the request carries the grammar.
        let r: CompletionRequest = parse(br#"{"prompt":"x","guided_regex":"[ab]"}"#).unwrap();
        let req = r.common().unwrap().params().unwrap().request(RequestId(1), vec![1], 10).unwrap();
        assert_eq!(req.constraint, Some(Constraint::Regex("[ab]".into())));
    }
}
