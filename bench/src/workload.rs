//! Workloads: what is asked. Each is turned, before the run, into a [`Dataset`] of
//! conversations whose first request bodies are already serialized.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::dist::LengthDist;
use crate::prompt::{Prompt, PromptSynth, TAG_SPACE};
use crate::request::{BodyBuilder, Role};

/// Block size of the Mooncake trace format: each hash id stands for this many prompt tokens.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// What to send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadConfig {
    /// Independent prompts with lengths drawn from distributions.
    Synthetic {
        /// Prompt lengths in tokens.
        input: LengthDist,
        /// Output lengths (`max_tokens`).
        output: LengthDist,
        /// Distinct prompts generated; requests cycle through them.
        prompts: usize,
    },
    /// `prefixes` shared prefixes of `prefix_tokens` each, every prompt one of them (each
    /// prefix equally often, in random order) plus a unique suffix.
    SharedPrefix {
        /// Number of distinct prefixes.
        prefixes: usize,
        /// Length of each prefix in tokens.
        prefix_tokens: u32,
        /// Length of the unique suffix.
        suffix: LengthDist,
        /// Output lengths.
        output: LengthDist,
        /// Distinct prompts generated.
        prompts: usize,
    },
    /// Chat sessions: each turn's request carries the whole history so far (earlier user
    /// messages and the server's actual answers).
    MultiTurn {
        /// Number of sessions.
        sessions: usize,
        /// Turns per session.
        turns: LengthDist,
        /// Length of each new user message.
        user: LengthDist,
        /// Output lengths.
        output: LengthDist,
        /// Pause between a response and the session's next request.
        think_time_ms: u64,
    },
    /// Replay of a Mooncake-format trace (JSON lines with `timestamp` in ms, `input_length`,
    /// `output_length` and `hash_ids`, each id standing for one block of `block_tokens`).
    Trace {
        /// The trace file.
        path: PathBuf,
        /// Tokens per hash id (512 in the published traces).
        block_tokens: u32,
    },
    /// Prompts from a file: JSON lines with `prompt` or `text` (and optional `output_length`),
    /// or plain text, one prompt per line.
    PromptsFile {
        /// The file.
        path: PathBuf,
        /// Output lengths for lines that do not give one.
        output: LengthDist,
    },
    /// Interference of long prompts with ongoing decodes: `streams` decode streams, each a
    /// closed loop of `input`-token prompts generating `output` tokens (a new request as soon
    /// as the last one ends), and one `burst_input`-token prompt generating `burst_output`
    /// every `burst_interval_s` seconds, the first one interval after the start. Every prompt
    /// is distinct from its first words on, so none is served from a prefix cache. Requests
    /// are made as the run goes ([`MixedSource`]); it runs under
    /// [`LoadConfig::Mixed`](crate::LoadConfig::Mixed), bounded by a duration or a request
    /// count.
    Mixed {
        /// Concurrent decode streams.
        streams: usize,
        /// Prompt lengths of the streams' requests.
        input: LengthDist,
        /// Output lengths of the streams' requests.
        output: LengthDist,
        /// Prompt lengths of the bursts.
        burst_input: LengthDist,
        /// Output lengths of the bursts.
        burst_output: LengthDist,
        /// Seconds between bursts (a fixed interval).
        burst_interval_s: f64,
    },
}

impl WorkloadConfig {
    /// Short name: `synthetic`, `shared_prefix`, `multi_turn`, `trace`, `prompts_file` or
    /// `mixed`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Synthetic { .. } => "synthetic",
            Self::SharedPrefix { .. } => "shared_prefix",
            Self::MultiTurn { .. } => "multi_turn",
            Self::Trace { .. } => "trace",
            Self::PromptsFile { .. } => "prompts_file",
            Self::Mixed { .. } => "mixed",
        }
    }

    /// One line for humans.
    pub fn describe(&self) -> String {
        match self {
            Self::Synthetic { input, output, prompts } => {
                format!("synthetic: input {input}, output {output}, {prompts} prompts")
            }
            Self::SharedPrefix { prefixes, prefix_tokens, suffix, output, prompts } => format!(
                "shared prefix: {prefixes} x {prefix_tokens}-token prefixes, suffix {suffix}, \
                 output {output}, {prompts} prompts"
            ),
            Self::MultiTurn { sessions, turns, user, output, think_time_ms } => format!(
                "multi-turn: {sessions} sessions, turns {turns}, user {user}, output {output}, \
                 think {think_time_ms} ms"
            ),
            Self::Trace { path, block_tokens } => {
                format!("trace {} ({block_tokens}-token blocks)", path.display())
            }
            Self::PromptsFile { path, output } => {
                format!("prompts from {}, output {output}", path.display())
            }
            Self::Mixed { streams, input, output, burst_input, burst_output, burst_interval_s } => {
                format!(
                    "mixed: {streams} streams (input {input}, output {output}), a burst every \
                     {burst_interval_s} s (input {burst_input}, output {burst_output})"
                )
            }
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        let nonzero = |n: usize, what: &str| {
            if n == 0 {
                Err(BenchError::config(format!("{what} must be at least 1")))
            } else {
                Ok(())
            }
        };
        match self {
            Self::Synthetic { input, output, prompts } => {
                input.validate()?;
                output.validate()?;
                nonzero(*prompts, "prompts")
            }
            Self::SharedPrefix { prefixes, prefix_tokens, suffix, output, prompts } => {
                suffix.validate()?;
                output.validate()?;
                nonzero(*prefixes, "prefixes")?;
                nonzero(*prefix_tokens as usize, "prefix tokens")?;
                nonzero(*prompts, "prompts")
            }
            Self::MultiTurn { sessions, turns, user, output, .. } => {
                turns.validate()?;
                user.validate()?;
                output.validate()?;
                nonzero(*sessions, "sessions")
            }
            Self::Trace { block_tokens, .. } => nonzero(*block_tokens as usize, "block tokens"),
            Self::PromptsFile { output, .. } => output.validate(),
            Self::Mixed { streams, input, output, burst_input, burst_output, burst_interval_s } => {
                for d in [input, output, burst_input, burst_output] {
                    d.validate()?;
                }
                if !(burst_interval_s.is_finite() && *burst_interval_s >= 1e-3) {
                    return Err(BenchError::config("the burst interval must be at least 1 ms"));
                }
                nonzero(*streams, "streams")
            }
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The new user message.
    pub user: String,
    /// Its length in tokens.
    pub input_tokens: u32,
    /// `max_tokens` asked for.
    pub max_tokens: u32,
    /// The serialized request for a first turn (later turns depend on earlier answers and are
    /// built when sent).
    pub body: Option<Bytes>,
}

/// A sequence of turns sent one after another (one turn for single-request workloads).
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The turns.
    pub turns: Vec<Turn>,
    /// Arrival time in milliseconds from the trace, when there is one.
    pub at_ms: Option<f64>,
}

/// The requests of a run, built before it starts.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Conversations, in order.
    pub conversations: Vec<Conversation>,
    /// Whether later turns carry history (and so need the answers' text).
    pub multi_turn: bool,
    /// Pause between turns of a conversation.
    pub think_time: Duration,
    /// Conversations used to warm up, disjoint from the measured ones.
    pub warmup: Vec<Conversation>,
    /// The mixed workload's requests, made as the run goes (its `conversations` are empty).
    pub mixed: Option<MixedSource>,
}

impl Dataset {
    /// Builds the dataset of `workload`, with `warmup` extra single-turn requests of the
    /// workload's mean lengths whose prompts share nothing with the measured ones.
    pub fn build(
        workload: &WorkloadConfig,
        synth: &PromptSynth,
        bodies: &BodyBuilder,
        seed: u64,
        warmup: usize,
    ) -> Result<Self, BenchError> {
        workload.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let single = |p: Prompt, max_tokens: u32, at_ms: Option<f64>| {
            let body = bodies.body(&[(Role::User, &p.text)], max_tokens);
            Conversation {
                turns: vec![Turn {
                    user: p.text,
                    input_tokens: p.tokens,
                    max_tokens,
                    body: Some(body),
                }],
                at_ms,
            }
        };
        let mut multi_turn = false;
        let mut think_time = Duration::ZERO;
        let mut mixed = None;
        let (conversations, mean_in, mean_out) = match workload {
            WorkloadConfig::Synthetic { input, output, prompts } => {
                let mut convs = Vec::with_capacity(*prompts);
                for _ in 0..*prompts {
                    let n = input.sample(&mut rng);
                    let p = synth.prompt(n, &mut rng)?;
                    convs.push(single(p, output.sample(&mut rng), None));
                }
                (convs, input.mean(), output.mean())
            }
            WorkloadConfig::SharedPrefix { prefixes, prefix_tokens, suffix, output, prompts } => {
                let heads: Vec<Vec<u32>> = (0..*prefixes)
                    .map(|_| {
                        synth.exact(
                            synth.sample_ids(*prefix_tokens as usize, &mut rng),
                            *prefix_tokens,
                            &mut rng,
                        )
                    })
                    .map(|p| p.and_then(|p| synth.codec().encode(&p.text)))
                    .collect::<Result<_, _>>()?;
                // Every prefix equally often, in random order.
                let mut order: Vec<usize> = (0..*prompts).map(|i| i % heads.len()).collect();
                order.shuffle(&mut rng);
                let mut convs = Vec::with_capacity(*prompts);
                for &h in &order {
                    let head = &heads[h];
                    let n = suffix.sample(&mut rng);
                    let mut ids = head.clone();
                    ids.extend(synth.sample_ids(n as usize, &mut rng));
                    let target = (head.len() as u32).saturating_add(n);
                    let p = synth.exact(ids, target, &mut rng)?;
                    convs.push(single(p, output.sample(&mut rng), None));
                }
                (convs, f64::from(*prefix_tokens) + suffix.mean(), output.mean())
            }
            WorkloadConfig::MultiTurn { sessions, turns, user, output, think_time_ms } => {
                multi_turn = true;
                think_time = Duration::from_millis(*think_time_ms);
                let mut convs = Vec::with_capacity(*sessions);
                for _ in 0..*sessions {
                    let t = turns.sample(&mut rng);
                    let mut conv =
                        Conversation { turns: Vec::with_capacity(t as usize), at_ms: None };
                    for k in 0..t {
                        let p = synth.prompt(user.sample(&mut rng), &mut rng)?;
                        let max_tokens = output.sample(&mut rng);
                        let body =
                            (k == 0).then(|| bodies.body(&[(Role::User, &p.text)], max_tokens));
                        conv.turns.push(Turn {
                            user: p.text,
                            input_tokens: p.tokens,
                            max_tokens,
                            body,
                        });
                    }
                    convs.push(conv);
                }
                (convs, user.mean(), output.mean())
            }
            WorkloadConfig::Trace { path, block_tokens } => {
                let entries = read_trace(path)?;
                let mut blocks = BlockCache::new(*block_tokens, seed);
                let mut convs = Vec::with_capacity(entries.len());
                let (mut sum_in, mut sum_out) = (0.0, 0.0);
                for (i, e) in entries.iter().enumerate() {
                    let p = match &e.text_input {
                        Some(text) => Prompt { text: text.clone(), tokens: synth.count(text)? },
                        None => {
                            let mut tail_rng = ChaCha8Rng::seed_from_u64(
                                seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                            );
                            let ids = blocks
                                .ids(synth, &e.hash_ids, e.input_length, &mut tail_rng)
                                .map_err(|msg| BenchError::Parse {
                                    path: path.clone(),
                                    line: e.line,
                                    msg,
                                })?;
                            synth.exact(ids, e.input_length, &mut tail_rng)?
                        }
                    };
                    sum_in += f64::from(p.tokens);
                    sum_out += f64::from(e.output_length);
                    convs.push(single(p, e.output_length.max(1), e.timestamp));
                }
                let n = entries.len().max(1) as f64;
                (convs, sum_in / n, sum_out / n)
            }
            WorkloadConfig::PromptsFile { path, output } => {
                let lines = read_prompts(path)?;
                let mut convs = Vec::with_capacity(lines.len());
                let (mut sum_in, mut sum_out) = (0.0, 0.0);
                for (text, out) in lines {
                    let tokens = synth.count(&text)?;
                    let max_tokens = out.unwrap_or_else(|| output.sample(&mut rng)).max(1);
                    sum_in += f64::from(tokens);
                    sum_out += f64::from(max_tokens);
                    convs.push(single(Prompt { text, tokens }, max_tokens, None));
                }
                let n = convs.len().max(1) as f64;
                (convs, sum_in / n, sum_out / n)
            }
            WorkloadConfig::Mixed {
                streams,
                input,
                output,
                burst_input,
                burst_output,
                burst_interval_s,
            } => {
                mixed = Some(MixedSource {
                    synth: synth.clone(),
                    seed,
                    streams: *streams,
                    stream: (*input, *output),
                    burst: (*burst_input, *burst_output),
                    interval: Duration::from_secs_f64(burst_interval_s.min(1e9)),
                });
                (Vec::new(), input.mean(), output.mean())
            }
        };
        if conversations.is_empty() && mixed.is_none() {
            return Err(BenchError::config("the workload has no requests"));
        }
        let mut wrng = ChaCha8Rng::seed_from_u64(seed ^ 0x7761_726d_7570);
        let warm_in = (mean_in.round() as u32).max(1);
        let warm_out = (mean_out.round() as u32).max(1);
        let warmup = (0..warmup)
            .map(|_| Ok(single(synth.prompt(warm_in, &mut wrng)?, warm_out, None)))
            .collect::<Result<_, BenchError>>()?;
        Ok(Self { conversations, multi_turn, think_time, warmup, mixed })
    }

    /// Total requests in the dataset (turns of all conversations; 0 for the mixed workload).
    pub fn requests(&self) -> u64 {
        self.conversations.iter().map(|c| c.turns.len() as u64).sum()
    }
}

/// The class of a request of the mixed workload, by which its figures are also reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestClass {
    /// A request of one of the closed-loop decode streams.
    Stream,
    /// One of the periodic long prompts.
    Burst,
}

impl RequestClass {
    /// `stream` or `burst`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stream => "stream",
            Self::Burst => "burst",
        }
    }
}

impl std::fmt::Display for RequestClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The requests of the mixed workload, made one at a time while the run goes (a run is
/// bounded by time, so there is no fixed dataset). Request `index` of a class is the same for
/// a seed, and every prompt opens with words spelling its class and index
/// ([`PromptSynth::tagged`]), so no two requests of a run share a prefix. A second run with
/// the same seed sends the same prompts: against a server that kept them in its prefix
/// cache, give it another seed (whose prompts differ from the first word on).
#[derive(Debug, Clone)]
pub struct MixedSource {
    synth: PromptSynth,
    seed: u64,
    streams: usize,
    stream: (LengthDist, LengthDist),
    burst: (LengthDist, LengthDist),
    interval: Duration,
}

impl MixedSource {
    /// Concurrent decode streams.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// When burst `k` (from 0) is due, from the start of the level: `(k + 1)` intervals.
    pub fn burst_due(&self, k: u64) -> Duration {
        self.interval.saturating_mul(u32::try_from(k.saturating_add(1)).unwrap_or(u32::MAX))
    }

    /// Request `index` of `class`, its body serialized.
    pub fn request(
        &self,
        bodies: &BodyBuilder,
        class: RequestClass,
        index: u64,
    ) -> Result<Turn, BenchError> {
        let (input, output) = match class {
            RequestClass::Stream => self.stream,
            RequestClass::Burst => self.burst,
        };
        // Streams take the even numbers and bursts the odd ones; the seed shifts the tags, so
        // that runs with other seeds differ from the first word on.
        let number = index.wrapping_mul(2).wrapping_add(u64::from(class == RequestClass::Burst));
        let salt = self.seed ^ 0x6d69_7865_6400;
        let mut rng = ChaCha8Rng::seed_from_u64(salt ^ number.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let n = input.sample(&mut rng);
        let max_tokens = output.sample(&mut rng);
        let shift = salt.wrapping_mul(0xA24B_AED4_963E_E407) % TAG_SPACE;
        let tag = (number % TAG_SPACE + shift) % TAG_SPACE;
        let p = self.synth.tagged(tag, n, &mut rng)?;
        let body = bodies.body(&[(Role::User, &p.text)], max_tokens);
        Ok(Turn { user: p.text, input_tokens: p.tokens, max_tokens, body: Some(body) })
    }
}

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    /// Arrival time in milliseconds.
    pub timestamp: Option<f64>,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// One id per block of the prompt; equal ids mean equal blocks.
    pub hash_ids: Vec<u64>,
    /// Literal prompt text, used instead of synthesized blocks when given.
    pub text_input: Option<String>,
    /// 1-based line in the file.
    pub line: usize,
}

#[derive(Deserialize)]
struct WireTrace {
    #[serde(default)]
    timestamp: Option<f64>,
    #[serde(default)]
    input_length: Option<u32>,
    #[serde(default)]
    output_length: Option<u32>,
    #[serde(default)]
    hash_ids: Vec<u64>,
    #[serde(default)]
    text_input: Option<String>,
}

/// Reads a Mooncake-format trace, sorted by timestamp (stable, so ties keep file order).
pub fn read_trace(path: &Path) -> Result<Vec<TraceEntry>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |msg: String| BenchError::Parse { path: path.to_path_buf(), line: line_no, msg };
        let w: WireTrace = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let input_length = match (w.input_length, &w.text_input) {
            (Some(n), _) if n > 0 => n,
            (_, Some(_)) => 0,
            _ => return Err(bad("input_length (> 0) or text_input is required".into())),
        };
        if w.timestamp.is_some_and(|t| !t.is_finite() || t < 0.0) {
            return Err(bad("timestamp must be a non-negative number of milliseconds".into()));
        }
        out.push(TraceEntry {
            timestamp: w.timestamp,
            input_length,
            output_length: w.output_length.unwrap_or(1),
            hash_ids: w.hash_ids,
            text_input: w.text_input,
            line: line_no,
        });
    }
    if out.is_empty() {
        return Err(BenchError::Parse {
            path: path.to_path_buf(),
            line: 0,
            msg: "empty trace".into(),
        });
    }
    if out.iter().any(|e| e.timestamp.is_some()) {
        out.sort_by(|a, b| a.timestamp.unwrap_or(0.0).total_cmp(&b.timestamp.unwrap_or(0.0)));
    }
    Ok(out)
}

/// Token blocks per hash id, made once and reused so equal ids give equal blocks.
#[derive(Debug)]
struct BlockCache {
    block: u32,
    seed: u64,
    blocks: HashMap<u64, Vec<u32>>,
}

impl BlockCache {
    fn new(block: u32, seed: u64) -> Self {
        Self { block, seed, blocks: HashMap::new() }
    }

    /// Token ids for a prompt of `len` tokens described by `hash_ids`: every id a full block,
    /// except that the last may be partial (when the ids cover more than `len`) and that a
    /// tail beyond the ids is filled with fresh tokens.
    fn ids<R: Rng + ?Sized>(
        &mut self,
        synth: &PromptSynth,
        hash_ids: &[u64],
        len: u32,
        tail_rng: &mut R,
    ) -> Result<Vec<u32>, String> {
        let block = self.block as u64;
        let len64 = u64::from(len);
        let covered = hash_ids.len() as u64 * block;
        if covered >= len64 + block {
            return Err(format!(
                "{} hash ids of {block} tokens are too many for input_length {len}",
                hash_ids.len()
            ));
        }
        let mut ids = Vec::with_capacity(len as usize);
        for &h in hash_ids {
            let blk = self.blocks.entry(h).or_insert_with(|| {
                let mut r =
                    ChaCha8Rng::seed_from_u64(self.seed ^ h.wrapping_mul(0xA24B_AED4_963E_E407));
                synth.sample_ids(block as usize, &mut r)
            });
            let take = (len as usize - ids.len()).min(blk.len());
            ids.extend_from_slice(&blk[..take]);
        }
        if ids.len() < len as usize {
            ids.extend(synth.sample_ids(len as usize - ids.len(), tail_rng));
        }
        Ok(ids)
    }
}

/// Reads a prompts file: `(text, output_length)` per non-empty line.
pub fn read_prompts(path: &Path) -> Result<Vec<(String, Option<u32>)>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    #[derive(Deserialize)]
    struct Line {
        #[serde(default)]
        prompt: Option<String>,
        #[serde(default)]
        text: Option<String>,
        #[serde(default)]
        output_length: Option<u32>,
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if t.starts_with('{') {
            let l: Line = serde_json::from_str(t).map_err(|e| BenchError::Parse {
                path: path.to_path_buf(),
                line: i + 1,
                msg: e.to_string(),
            })?;
            let Some(p) = l.prompt.or(l.text) else {
                return Err(BenchError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    msg: "a JSON line needs \"prompt\" or \"text\"".into(),
                });
            };
            out.push((p, l.output_length));
        } else {
            out.push((line.to_string(), None));
        }
    }
    if out.is_empty() {
        return Err(BenchError::Parse {
            path: path.to_path_buf(),
            line: 0,
            msg: "no prompts".into(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::EndpointConfig;
    use crate::tokenizer::{TokenCodec, WordCodec};
    use std::sync::Arc;

    fn synth() -> PromptSynth {
        PromptSynth::new(Arc::new(WordCodec), 3).unwrap()
    }

    fn bodies() -> BodyBuilder {
        BodyBuilder::new(&EndpointConfig::default(), "m")
    }

    fn tmp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvx-bench-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn synthetic_is_deterministic_and_exact() {
        let w = WorkloadConfig::Synthetic {
            input: "uniform:10,50".parse().unwrap(),
            output: LengthDist::fixed(7),
            prompts: 20,
        };
        let a = Dataset::build(&w, &synth(), &bodies(), 5, 3).unwrap();
        let b = Dataset::build(&w, &synth(), &bodies(), 5, 3).unwrap();
        assert_eq!(a.conversations.len(), 20);
        assert_eq!(a.warmup.len(), 3);
        for (x, y) in a.conversations.iter().zip(&b.conversations) {
            assert_eq!(x.turns[0].user, y.turns[0].user);
            let t = &x.turns[0];
            assert_eq!(t.user.split_whitespace().count() as u32, t.input_tokens);
            assert!((10..=50).contains(&t.input_tokens));
            let v: serde_json::Value = serde_json::from_slice(t.body.as_ref().unwrap()).unwrap();
            assert_eq!(v["messages"][0]["content"], t.user.as_str());
            assert_eq!(v["max_tokens"], 7);
        }
        // Warm-up prompts share nothing with the measured ones.
        let w0 = &a.warmup[0].turns[0].user;
        assert!(a.conversations.iter().all(|c| &c.turns[0].user != w0));
    }

    #[test]
    fn shared_prefix_prompts_start_with_one_of_the_prefixes() {
        let w = WorkloadConfig::SharedPrefix {
            prefixes: 3,
            prefix_tokens: 32,
            suffix: LengthDist::fixed(8),
            output: LengthDist::fixed(4),
            prompts: 12,
        };
        let d = Dataset::build(&w, &synth(), &bodies(), 1, 0).unwrap();
        let heads: std::collections::HashSet<String> = d
            .conversations
            .iter()
            .map(|c| c.turns[0].user.split_whitespace().take(32).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(heads.len(), 3);
        let tails: std::collections::HashSet<&str> =
            d.conversations.iter().map(|c| c.turns[0].user.as_str()).collect();
        assert_eq!(tails.len(), 12);
        assert!(d.conversations.iter().all(|c| c.turns[0].input_tokens == 40));
    }

    #[test]
    fn multi_turn_sessions_only_prebuild_the_first_turn() {
        let w = WorkloadConfig::MultiTurn {
            sessions: 4,
            turns: LengthDist::fixed(3),
            user: LengthDist::fixed(5),
            output: LengthDist::fixed(2),
            think_time_ms: 0,
        };
        let d = Dataset::build(&w, &synth(), &bodies(), 1, 0).unwrap();
        assert!(d.multi_turn);
        assert_eq!(d.requests(), 12);
        for c in &d.conversations {
            assert!(c.turns[0].body.is_some() && c.turns[1..].iter().all(|t| t.body.is_none()));
        }
    }

    #[test]
    fn trace_blocks_are_shared_exactly_where_hash_ids_are() {
        let trace = tmp(
            "t.jsonl",
            "{\"timestamp\": 20, \"input_length\": 40, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n\
             {\"timestamp\": 0, \"input_length\": 35, \"output_length\": 3, \"hash_ids\": [1, 2, 4]}\n\
             \n\
             {\"timestamp\": 10, \"input_length\": 50, \"output_length\": 3, \"hash_ids\": [1, 5]}\n",
        );
        let w = WorkloadConfig::Trace { path: trace, block_tokens: 16 };
        let d = Dataset::build(&w, &synth(), &bodies(), 1, 0).unwrap();
        let words: Vec<Vec<String>> = d
            .conversations
            .iter()
            .map(|c| c.turns[0].user.split_whitespace().map(String::from).collect())
            .collect();
        // Sorted by timestamp: [1,2,4]/35, [1,5]/50 (tail of fresh tokens), [1,2,3]/40.
        assert_eq!(
            d.conversations.iter().map(|c| c.at_ms.unwrap()).collect::<Vec<_>>(),
            vec![0.0, 10.0, 20.0]
        );
        assert_eq!(words.iter().map(Vec::len).collect::<Vec<_>>(), vec![35, 50, 40]);
        assert_eq!(words[0][..32], words[2][..32]);
        assert_ne!(words[0][32..35], words[2][32..35]);
        assert_eq!(words[0][..16], words[1][..16]);
        assert_ne!(words[0][16..32], words[1][16..32]);
        let codec = WordCodec;
        assert_eq!(codec.encode(&d.conversations[1].turns[0].user).unwrap().len(), 50);
    }

    #[test]
    fn bad_traces_and_prompt_files_name_the_line() {
        let t = tmp("bad.jsonl", "{\"input_length\": 10}\n{\"output_length\": 3}\n");
        match read_trace(&t) {
            Err(BenchError::Parse { line, .. }) => assert_eq!(line, 2),
            other => panic!("{other:?}"),
        }
        let t = tmp("toomany.jsonl", "{\"input_length\": 10, \"hash_ids\": [1,2,3]}\n");
        let w = WorkloadConfig::Trace { path: t, block_tokens: 8 };
        assert!(matches!(
            Dataset::build(&w, &synth(), &bodies(), 1, 0),
            Err(BenchError::Parse { line: 1, .. })
        ));
        let p = tmp(
            "p.txt",
            "hello world\n{\"prompt\": \"a b c\", \"output_length\": 9}\n\n{\"x\": 1}\n",
        );
        assert!(matches!(read_prompts(&p), Err(BenchError::Parse { line: 4, .. })));
        let p = tmp("p2.txt", "hello world\n{\"text\": \"a b c\", \"output_length\": 9}\n");
        assert_eq!(
            read_prompts(&p).unwrap(),
            vec![("hello world".into(), None), ("a b c".into(), Some(9))]
        );
    }

    fn mixed(streams: usize, burst_interval_s: f64) -> WorkloadConfig {
        WorkloadConfig::Mixed {
            streams,
            input: LengthDist::fixed(64),
            output: LengthDist::fixed(384),
            burst_input: LengthDist::fixed(1500),
            burst_output: LengthDist::fixed(16),
            burst_interval_s,
        }
    }

    #[test]
    fn mixed_requests_have_their_class_lengths_and_share_no_prefix() {
        let d = Dataset::build(&mixed(8, 4.0), &synth(), &bodies(), 7, 2).unwrap();
        assert!(d.conversations.is_empty() && d.requests() == 0, "made as the run goes");
        // Warm-up requests have the streams' lengths.
        assert_eq!(d.warmup.len(), 2);
        for c in &d.warmup {
            assert_eq!((c.turns[0].input_tokens, c.turns[0].max_tokens), (64, 384));
        }
        let m = d.mixed.as_ref().unwrap();
        assert_eq!(m.streams(), 8);
        let b = bodies();
        let mut first_blocks = std::collections::HashSet::new();
        for (class, n, out, count) in
            [(RequestClass::Stream, 64, 384, 400), (RequestClass::Burst, 1500, 16, 40)]
        {
            for k in 0..count {
                let t = m.request(&b, class, k).unwrap();
                assert_eq!(t.input_tokens, n, "{class} {k}");
                assert_eq!(t.user.split_whitespace().count() as u32, n);
                let v: serde_json::Value =
                    serde_json::from_slice(t.body.as_ref().unwrap()).unwrap();
                assert_eq!(v["messages"][0]["content"], t.user.as_str());
                assert_eq!(v["max_tokens"], out);
                // No two requests share even their first four words.
                let head: Vec<&str> = t.user.split_whitespace().take(4).collect();
                assert!(first_blocks.insert(head.join(" ")), "{class} {k} repeats a prefix");
            }
        }
        // A request is the same for a seed; another seed changes it from the first word on.
        let again = m.request(&b, RequestClass::Burst, 3).unwrap();
        assert_eq!(again.user, m.request(&b, RequestClass::Burst, 3).unwrap().user);
        let other = Dataset::build(&mixed(8, 4.0), &synth(), &bodies(), 8, 0).unwrap();
        let first = |t: &Turn| t.user.split_whitespace().next().map(str::to_string);
        let theirs = other.mixed.unwrap().request(&b, RequestClass::Burst, 3).unwrap();
        assert_ne!(first(&theirs), first(&again));
    }

    #[test]
    fn bursts_come_one_interval_apart_from_one_interval_in() {
        let d = Dataset::build(&mixed(2, 0.3), &synth(), &bodies(), 1, 0).unwrap();
        let m = d.mixed.unwrap();
        let due: Vec<f64> = (0..10).map(|k| m.burst_due(k).as_secs_f64()).collect();
        for (k, t) in due.iter().enumerate() {
            assert!((t - 0.3 * (k + 1) as f64).abs() < 1e-6, "burst {k} at {t}");
        }
        // Within a 2 s run: the bursts due at 0.3, 0.6, ... 1.8 s.
        let within = (0..).take_while(|&k| m.burst_due(k) < Duration::from_secs(2)).count();
        assert_eq!(within, 6);
        assert_eq!(m.burst_due(u64::MAX), m.burst_due(u64::from(u32::MAX)), "saturates");
    }

    #[test]
    fn mixed_parameters_are_checked() {
        let with = |streams, burst_interval_s, burst: u32| WorkloadConfig::Mixed {
            streams,
            input: LengthDist::fixed(8),
            output: LengthDist::fixed(4),
            burst_input: LengthDist::fixed(burst),
            burst_output: LengthDist::fixed(2),
            burst_interval_s,
        };
        let build = |w: &WorkloadConfig| Dataset::build(w, &synth(), &bodies(), 1, 0);
        let bad = [with(0, 1.0, 64), with(2, 0.0, 64), with(2, -1.0, 64), with(2, f64::NAN, 64)];
        for w in bad.iter().chain(&[with(2, 1e-4, 64), with(2, 1.0, 0)]) {
            assert!(matches!(build(w), Err(BenchError::Config(_))), "{w:?}");
        }
        assert!(build(&with(2, 1.0, 64)).is_ok());
    }
}
