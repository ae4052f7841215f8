//! The report: one JSON schema (documented in bench/SCHEMA.md) and its renderings — terminal
//! table, HTML page with SVG charts, and side-by-side comparison of two reports.

mod compare;
mod html;
mod table;

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::client::ErrorClass;
use crate::request::Api;
use crate::workload::{RequestClass, WorkloadConfig};

pub use compare::compare_table;
pub use html::render_html;
pub use table::summary_table;

/// Value of [`Report::schema`] for this layout. Bumped on any incompatible change.
pub const SCHEMA: &str = "kvx-bench/1";

/// A benchmark's results: one [`RunReport`] per load level of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Version of kvx-bench that produced the report.
    pub version: String,
    /// Wall-clock start, milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    /// What was measured.
    pub target: Target,
    /// What was sent.
    pub workload: WorkloadInfo,
    /// How it was sent.
    pub load: LoadInfo,
    /// Service-level objectives used for goodput.
    pub slo: Slo,
    /// Seed of every random choice (prompts, lengths, arrivals).
    pub seed: u64,
    /// One entry per load level, in sweep order.
    pub runs: Vec<RunReport>,
}

/// The endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// Full request URL.
    pub url: String,
    /// API used.
    pub api: Api,
    /// Model name sent.
    pub model: String,
    /// Whether responses were streamed.
    pub stream: bool,
}

/// The workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadInfo {
    /// `synthetic`, `shared_prefix`, `multi_turn`, `trace`, `prompts_file` or `mixed`.
    pub kind: String,
    /// One line for humans.
    pub description: String,
    /// Tokenizer used to size prompts (`words` or a file).
    pub tokenizer: String,
    /// Conversations in the dataset (0 for `mixed`, whose requests are made as it runs).
    pub conversations: usize,
    /// Requests in the dataset (turns of all conversations; 0 for `mixed`).
    pub dataset_requests: u64,
    /// The full workload configuration.
    pub config: WorkloadConfig,
}

/// The load model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadInfo {
    /// `closed` (fixed concurrency), `poisson` (open loop at a rate), `trace` (open loop at
    /// the trace's timestamps) or `mixed` (the mixed workload's streams and bursts).
    pub mode: String,
    /// Request bound per level, if any.
    pub max_requests: Option<u64>,
    /// Duration bound per level in seconds, if any.
    pub duration_s: Option<f64>,
    /// Requests sent before the first level and not measured.
    pub warmup_requests: usize,
    /// Per-request timeout in seconds.
    pub request_timeout_s: f64,
    /// Client runtime threads.
    pub client_threads: usize,
}

/// Service-level objectives: a request is *good* when it succeeded and meets each one given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Largest acceptable time to first token, milliseconds.
    pub ttft_ms: Option<f64>,
    /// Largest acceptable mean inter-token latency of a request (its TPOT), milliseconds.
    pub itl_ms: Option<f64>,
}

/// A load level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Level {
    /// `concurrency`, `request_rate`, `trace_speed` or `mixed`.
    pub mode: String,
    /// Concurrency, requests per second, speed factor, or streams (`mixed`).
    pub value: f64,
    /// Short label, e.g. `c=8`, `8 req/s`, `trace x1`, `8 streams + bursts`.
    pub label: String,
}

/// Results of one load level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// The level.
    pub level: Level,
    /// From the first request sent to the last response finished, seconds.
    pub duration_s: f64,
    /// Request counts.
    pub requests: Counts,
    /// Failed requests by class (see [`ErrorClass`]).
    pub errors: BTreeMap<String, u64>,
    /// Rates over `duration_s`.
    pub throughput: Throughput,
    /// Latency distributions, milliseconds, over successful requests.
    pub latency_ms: Latencies,
    /// Token counts.
    pub tokens: Tokens,
    /// Health of the load generator itself.
    pub client: ClientStats,
    /// Cumulative distributions as `[value_ms, fraction]` points, for plotting.
    pub cdf_ms: Cdfs,
    /// The same figures per request class (`stream`, `burst`) of the mixed workload; empty
    /// (and absent from the JSON) for the other workloads.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<String, ClassReport>,
    /// Per-request records (only when asked for).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_records: Vec<RequestRecord>,
}

/// The figures of one request class of a level (see [`RunReport::classes`]). Rates are over
/// the level's `duration_s`, so the classes' rates add up to the level's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassReport {
    /// Request counts.
    pub requests: Counts,
    /// Rates over the level's duration.
    pub throughput: Throughput,
    /// Latency distributions, milliseconds, over successful requests of the class.
    pub latency_ms: Latencies,
    /// Token counts.
    pub tokens: Tokens,
}

/// Request counts of a level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Requests sent.
    pub sent: u64,
    /// Requests that finished successfully.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
}

/// Throughput of a level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Generated tokens per second (successful requests).
    pub output_tokens_per_s: f64,
    /// Prompt tokens per second (successful requests).
    pub input_tokens_per_s: f64,
    /// Good requests per second (present when an SLO is set).
    pub goodput_requests_per_s: Option<f64>,
    /// Fraction of sent requests that were good (present when an SLO is set).
    pub good_fraction: Option<f64>,
}

/// Summary statistics of one distribution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Standard deviation.
    pub stddev: f64,
    /// Smallest sample.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest sample.
    pub max: f64,
}

/// Latency distributions of a level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    /// Time to first token: request sent to first chunk carrying text.
    pub ttft: Option<Stats>,
    /// Inter-token latency: every gap between consecutive chunks carrying text.
    pub itl: Option<Stats>,
    /// Time per output token of each request: (e2e - ttft) / (output tokens - 1).
    pub tpot: Option<Stats>,
    /// End to end: request sent to response finished.
    pub e2e: Option<Stats>,
    /// The prompt's KV transfer in disaggregated serving, as the server reports it
    /// (`usage.kv_transfer_ms`, a kvx extension); absent when no request reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<Stats>,
}

/// Token counts of a level (successful requests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Tokens {
    /// Prompt tokens by the benchmark's tokenizer (history included for multi-turn).
    pub input_total: u64,
    /// Generated tokens (server usage when reported, else counted).
    pub output_total: u64,
    /// Prompt tokens per request.
    pub input_per_request: Option<Stats>,
    /// Generated tokens per request.
    pub output_per_request: Option<Stats>,
    /// Sum of `usage.prompt_tokens`, when the server reports usage.
    pub server_prompt_total: Option<u64>,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_total: Option<u64>,
    /// `cached_total / server_prompt_total` over requests reporting both.
    pub cache_hit_ratio: Option<f64>,
}

/// Load-generator health: if schedule lag grows, the client (not the server) is the limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientStats {
    /// Open loop: how late each request left against its schedule, milliseconds.
    pub schedule_lag_ms: Option<Stats>,
    /// Most requests in flight at once.
    pub peak_in_flight: u64,
    /// Requests not kept in `request_records` because the record limit was reached.
    pub records_dropped: u64,
    /// Requests sent a second time because the server closed or reset their kept-alive
    /// connection before answering (they count once, by their final outcome).
    #[serde(default)]
    pub resent: u64,
}

/// Cumulative distribution points `[value_ms, fraction]`, fraction rising from 0 to 1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cdfs {
    /// Of TTFT.
    pub ttft: Vec<[f64; 2]>,
    /// Of ITL.
    pub itl: Vec<[f64; 2]>,
    /// Of TPOT.
    pub tpot: Vec<[f64; 2]>,
    /// Of end-to-end latency.
    pub e2e: Vec<[f64; 2]>,
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index of the conversation in the dataset.
    pub conversation: u32,
    /// Turn within the conversation.
    pub turn: u32,
    /// Sent at, milliseconds from the level's start.
    pub start_ms: f64,
    /// Time to first token, milliseconds.
    pub ttft_ms: Option<f64>,
    /// End to end, milliseconds.
    pub e2e_ms: f64,
    /// Prompt tokens by the benchmark's tokenizer.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
    /// `usage.prompt_tokens`, when reported.
    pub server_prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// `usage.kv_transfer_ms`, when reported (kvx's disaggregated serving).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_ms: Option<f64>,
    /// Failure class, if it failed.
    pub error: Option<ErrorClass>,
    /// Class of a mixed-workload request (absent for other workloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<RequestClass>,
}

impl RunReport {
    /// The classes in display order: `stream`, `burst`, then any others by name.
    pub(crate) fn classes_in_order(&self) -> Vec<(&str, &ClassReport)> {
        let rank = |k: &str| match k {
            "stream" => 0,
            "burst" => 1,
            _ => 2,
        };
        let mut v: Vec<(&str, &ClassReport)> =
            self.classes.iter().map(|(k, c)| (k.as_str(), c)).collect();
        v.sort_by_key(|(k, _)| rank(k));
        v
    }
}

impl Report {
    /// Writes the report as pretty JSON.
    pub fn write_json(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text + "\n").map_err(|e| BenchError::io(path, e))
    }

    /// Reads a report written by [`Report::write_json`], checking the schema tag.
    pub fn read_json(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        let bad = |msg: String| BenchError::Parse { path: path.to_path_buf(), line: 0, msg };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        match v.get("schema").and_then(|s| s.as_str()) {
            Some(SCHEMA) => {}
            Some(other) => return Err(bad(format!("schema {other:?}, expected {SCHEMA:?}"))),
            None => return Err(bad("not a kvx bench report (no \"schema\")".into())),
        }
        serde_json::from_value(v).map_err(|e| bad(e.to_string()))
    }

    /// Writes the self-contained HTML report.
    pub fn write_html(&self, path: &Path) -> Result<(), BenchError> {
        std::fs::write(path, render_html(self)).map_err(|e| BenchError::io(path, e))
    }
}
