//! The request plane: what the router sends a worker, and what comes back.
//!
//! Router → worker: [`GenerateRequest`] (tokens, sampling, stop conditions). Worker → router:
//! a stream of [`Output`]s — token deltas, then one `Finished` (or `Error`). Cancellation
//! always flows down (by request id).

use serde::{Deserialize, Serialize};

use crate::TokenId;

/// A request's id, unique within the cluster for its lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The id of the prefill leg of a disaggregated request (the top bit set: ingress hands
    /// out ids below 2^63).
    pub fn prefill_leg(self) -> RequestId {
        RequestId(self.0 | 1 << 63)
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Sampling parameters as requested (validated by the engine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingOptions {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// Reproducible sampling.
    pub seed: Option<u64>,
    /// OpenAI presence penalty.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty.
    pub frequency_penalty: f32,
    /// CTRL-style repetition penalty (1 = off).
    pub repetition_penalty: f32,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

/// When to stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopConditions {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Fewest tokens before end-of-generation or stop strings may end the request.
    pub min_tokens: u32,
    /// Extra token ids that end generation (beyond the model's end-of-generation set).
    pub stop_token_ids: Vec<TokenId>,
    /// Strings that end generation; the text is cut before the match.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

impl Default for StopConditions {
    fn default() -> Self {
        StopConditions {
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A generation request, already tokenized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Id.
    pub id: RequestId,
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Sampling.
    pub sampling: SamplingOptions,
    /// Stop conditions.
    pub stop: StopConditions,
    /// Return this many alternatives per token with log-probabilities (`None` = no logprobs).
    pub logprobs: Option<u32>,
    /// Cache isolation salt (tenant); requests with different salts share no KV blocks.
    pub salt: Option<String>,
    /// Its part in disaggregated serving (local by default).
    #[serde(default)]
    pub kv: KvRole,
    /// Tokens the client already received from an earlier placement of this request (its
    /// worker died mid-stream): the request continues after them, computing them as the
    /// generated tokens they are (each in the single-token attention mode), so greedy
    /// output is what an undisturbed run gives. `stop.max_tokens` still counts them.
    #[serde(default)]
    pub resume: Vec<TokenId>,
    /// A grammar the output must match (structured outputs); `None` = free text.
    #[serde(default)]
    pub constraint: Option<Constraint>,
    /// Score the prompt: the log-probability of every prompt token but the first (given the
    /// tokens before it), with this many alternatives each (`echo` with `logprobs`). Such a
    /// prompt is computed whole, never served from the prefix cache, and never disaggregated.
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
    /// Its part among the choices of one prompt (`n` > 1), so that the prompt is computed
    /// once; `None` = on its own.
    #[serde(default)]
    pub fork: Option<Fork>,
}

impl GenerateRequest {
    /// A request of `prompt` with these sampling options and stop conditions, and nothing
    /// else asked for (no log-probabilities, salt, KV role, resumed tokens, constraint or
    /// fork).
    pub fn new(
        id: RequestId,
        prompt: Vec<TokenId>,
        sampling: SamplingOptions,
        stop: StopConditions,
    ) -> Self {
        GenerateRequest {
            id,
            prompt,
            sampling,
            stop,
            logprobs: None,
            salt: None,
            kv: KvRole::default(),
            resume: Vec::new(),
            constraint: None,
            prompt_logprobs: None,
            fork: None,
        }
    }
}

/// A request's part among the choices of one prompt. The leader computes the prompt; a
/// follower sent to the engine that holds the leader starts from the leader's computed
/// prompt (its blocks shared, its last partial block copied, its first token drawn from the
/// leader's logits) and computes nothing of the prompt. A follower that finds no leader
/// (another engine, or the leader ended) is computed as any request, from the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fork {
    /// The prompt's first choice; this many followers come after its first token.
    Leader {
        /// Followers to expect.
        followers: u32,
    },
    /// Another choice of the leader's prompt.
    Follower {
        /// The leader's id.
        leader: RequestId,
    },
}

/// A grammar that constrains a request's output, as the client gave it (compiled by the
/// engine at admission; the text crosses the wire to remote workers unchanged).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Constraint {
    /// A JSON schema (its JSON text): the output is one JSON value it accepts.
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// A request's part in disaggregated serving.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum KvRole {
    /// Compute the prompt here, then generate.
    #[default]
    Local,
    /// Decode side: reserve blocks for the whole prompt now (the stream's first message is
    /// [`KvNote::Reserved`]) and wait for the KV of the prompt but its last token, written
    /// by a prefill worker; the plane then says it arrived (or that it will not, and the
    /// prompt is computed here). Generation then starts from the last prompt token.
    AwaitKv,
    /// Prefill side: compute the prompt but its last token, write its KV into the decode
    /// worker's blocks, generate nothing; the stream ends with [`KvNote::Sent`].
    PrefillTo(KvDest),
}

/// Where a prefill worker writes a prompt's KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDest {
    /// The decode worker.
    pub worker: crate::WorkerId,
    /// Index, in the prompt's block sequence, of the first block to send (the decode worker
    /// has the ones before it cached).
    pub first_block: usize,
    /// The decode worker's blocks for block `first_block` on, in order.
    pub blocks: Vec<u32>,
}

/// The part of a request's stream that concerns its KV in disaggregated serving (the plane
/// consumes these; clients never see them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum KvNote {
    /// Decode side: the prompt's KV goes into these blocks ([`KvDest`]'s fields; none when
    /// every block is cached here already — the request still waits to be told).
    Reserved {
        /// Index of the first block to receive.
        first_block: usize,
        /// The blocks.
        blocks: Vec<u32>,
    },
    /// Decode side: no room to reserve blocks now; the prompt is computed here.
    Local,
    /// Prefill side: the prompt is computed; its KV is being written.
    Sending,
    /// Prefill side: the KV is in the decode worker's blocks. Nothing follows.
    Sent(KvTransfer),
}

/// What moving one request's KV took.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct KvTransfer {
    /// Blocks written.
    pub blocks: u32,
    /// Bytes written.
    pub bytes: u64,
    /// Milliseconds from arrival to the prompt's KV being computed.
    pub prefill_ms: f32,
    /// Milliseconds the write took.
    pub transfer_ms: f32,
}

/// A token's log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// Token.
    pub token: TokenId,
    /// Log-probability.
    pub logprob: f32,
}

/// The log-probability of a generated token and the most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprob {
    /// The generated token's log-probability.
    pub logprob: f32,
    /// Most likely tokens at that step.
    pub top: Vec<TopLogprob>,
}

/// New output of a request since the previous delta.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct OutputDelta {
    /// Generated tokens.
    pub tokens: Vec<TokenId>,
    /// Text they complete (stop strings held back until they cannot match).
    pub text: String,
    /// Per token, when requested.
    pub logprobs: Vec<Logprob>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// End-of-generation token, stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Microseconds the prompt's KV took to move from a prefill worker (disaggregated
    /// serving; 0 when the prompt was computed where it decoded).
    #[serde(default)]
    pub kv_transfer_us: u32,
}

/// The closed set of error classes, assigned near the cause; ingress renders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorClass {
    /// The request is invalid as sent.
    BadRequest,
    /// A named thing (model, request) does not exist.
    NotFound,
    /// Queues are full; retry later.
    Overloaded,
    /// Not ready, or the serving worker went away.
    Unavailable,
    /// A bug or resource failure.
    Internal,
    /// A deadline passed.
    Timeout,
}

/// One message of a request's output stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Output {
    /// New tokens.
    Delta(OutputDelta),
    /// The end: reason and usage. Nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed. Nothing follows.
    Error {
        /// Class.
        class: ErrorClass,
        /// Client-safe message.
        message: String,
    },
    /// Disaggregated serving's news of the request's KV (for the plane, not the client).
    Kv(KvNote),
    /// Scores of prompt tokens `start..start + logprobs.len()` (see
    /// [`GenerateRequest::prompt_logprobs`]; token 0 has none, so `start` ≥ 1), before any
    /// delta. A placement that starts over sends them again from its first: the receiver
    /// keeps the scores before `start` and replaces the rest.
    PromptLogprobs {
        /// Index of the first prompt token scored here.
        start: u32,
        /// One per token, in order.
        logprobs: Vec<Logprob>,
    },
}
