//! `kvx bench`: benchmark any OpenAI-compatible endpoint (the default action), compare two
//! reports (`kvx bench compare`), or measure KV transfers (`kvx bench xfer`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use kvx_bench::{LengthDist, Report};

use super::bench_config::parse_dist;

/// Arguments of `kvx bench`: a subcommand, or the options of a run.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    pub(crate) command: Option<BenchCommand>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

/// `kvx bench ...` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Benchmark an OpenAI-compatible endpoint (what `kvx bench` does without a subcommand).
    Run(Box<RunArgs>),
    /// Print two JSON reports side by side with B/A ratios.
    Compare(CompareArgs),
    /// KV transfer bandwidth and latency (shm, tcp, file backends).
    Xfer(super::bench_xfer::XferArgs),
    /// Prompt processing and generation speed of the engine (like llama-bench).
    Engine(super::bench_engine::EngineBenchArgs),
}

/// Workload kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum WorkloadKind {
    /// Independent prompts of --input-tokens / --output-tokens lengths.
    Synthetic,
    /// --prefixes shared prefixes of --prefix-tokens, each prompt a prefix plus a unique suffix
    /// of --input-tokens.
    SharedPrefix,
    /// --sessions chat sessions of --turns turns; each request carries the history.
    MultiTurn,
    /// Replay of the Mooncake-format trace given by --trace.
    Trace,
    /// Prompts from --prompts-file.
    Prompts,
    /// --streams closed-loop decode streams (--input-tokens, --output-tokens) and a long prompt
    /// (--burst-input-tokens, --burst-output-tokens) every --burst-interval seconds; figures
    /// per class (stream, burst). Runs --duration (default 60) seconds.
    Mixed,
}

/// Options of a benchmark run.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    // Endpoint.
    /// Base URL of the server (`/v1/...` paths are added) or a full request URL.
    #[arg(
        long,
        default_value = "http://127.0.0.1:8000",
        env = "KVX_BENCH_URL",
        help_heading = "Endpoint"
    )]
    pub(super) url: String,
    /// API to call.
    #[arg(
        long,
        value_enum,
        default_value = "chat",
        env = "KVX_BENCH_API",
        help_heading = "Endpoint"
    )]
    pub(super) api: ApiArg,
    /// Model name to send (default: the first one `GET /v1/models` lists).
    #[arg(long, env = "KVX_BENCH_MODEL", help_heading = "Endpoint")]
    pub(super) model: Option<String>,
    /// API key, sent as `Authorization: Bearer ...`.
    #[arg(long, env = "KVX_BENCH_API_KEY", hide_env_values = true, help_heading = "Endpoint")]
    pub(super) api_key: Option<String>,
    /// Extra request header `NAME: VALUE` (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE", help_heading = "Endpoint")]
    pub(super) headers: Vec<String>,
    /// Ask for complete responses instead of streams (no TTFT or ITL then).
    #[arg(long, help_heading = "Endpoint")]
    pub(super) no_stream: bool,
    /// Do not ask for the final usage chunk (`stream_options.include_usage`).
    #[arg(long, help_heading = "Endpoint")]
    pub(super) no_usage: bool,
    /// Send `ignore_eos: true` so that servers honouring it generate exactly the output length.
    #[arg(long, help_heading = "Endpoint")]
    pub(super) ignore_eos: bool,
    /// Send the output length as `max_completion_tokens` instead of `max_tokens`.
    #[arg(long, help_heading = "Endpoint")]
    pub(super) max_completion_tokens: bool,
    /// JSON object merged into every request body, e.g. '{"temperature":0}'.
    #[arg(long, value_name = "JSON", env = "KVX_BENCH_EXTRA_BODY", help_heading = "Endpoint")]
    pub(super) extra_body: Option<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0, help_heading = "Endpoint")]
    pub(super) timeout: f64,
    /// Wait up to this many seconds for the server to answer `GET /v1/models` first.
    #[arg(long, default_value_t = 0.0, help_heading = "Endpoint")]
    pub(super) wait_ready: f64,

    // Workload.
    /// Workload (default: trace when --trace is given, prompts with --prompts-file, else
    /// synthetic).
    #[arg(long, value_enum, help_heading = "Workload")]
    pub(super) workload: Option<WorkloadKind>,
    /// Prompt (or suffix, or user message) lengths: N, normal:MEAN,STD, uniform:MIN,MAX,
    /// lognormal:MEAN,STD.
    #[arg(long, default_value = "128", value_parser = parse_dist, help_heading = "Workload")]
    pub(super) input_tokens: LengthDist,
    /// Output lengths (`max_tokens`), same forms as --input-tokens.
    #[arg(long, default_value = "64", value_parser = parse_dist, help_heading = "Workload")]
    pub(super) output_tokens: LengthDist,
    /// Distinct prompts generated (requests cycle through them).
    #[arg(long, default_value_t = 100, help_heading = "Workload")]
    pub(super) prompts: usize,
    /// Shared prefixes (shared-prefix workload).
    #[arg(long, default_value_t = 4, help_heading = "Workload")]
    pub(super) prefixes: usize,
    /// Tokens per shared prefix (shared-prefix workload).
    #[arg(long, default_value_t = 512, help_heading = "Workload")]
    pub(super) prefix_tokens: u32,
    /// Chat sessions (multi-turn workload).
    #[arg(long, default_value_t = 16, help_heading = "Workload")]
    pub(super) sessions: usize,
    /// Turns per session (multi-turn workload), same forms as --input-tokens.
    #[arg(long, default_value = "4", value_parser = parse_dist, help_heading = "Workload")]
    pub(super) turns: LengthDist,
    /// Pause between a response and the next turn, milliseconds (multi-turn workload).
    #[arg(long, default_value_t = 0, help_heading = "Workload")]
    pub(super) think_time_ms: u64,
    /// Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids).
    #[arg(long, value_name = "JSONL", help_heading = "Workload")]
    pub(super) trace: Option<PathBuf>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = kvx_bench::MOONCAKE_BLOCK_TOKENS, help_heading = "Workload")]
    pub(super) trace_block_tokens: u32,
    /// Decode streams, each a closed loop (mixed workload).
    #[arg(long, default_value_t = 8, help_heading = "Workload")]
    pub(super) streams: usize,
    /// Seconds between long prompts, the first one interval in (mixed workload).
    #[arg(long, value_name = "SECONDS", default_value_t = 4.0, help_heading = "Workload")]
    pub(super) burst_interval: f64,
    /// Long prompts' lengths, same forms as --input-tokens (mixed workload).
    #[arg(long, default_value = "1500", value_parser = parse_dist, help_heading = "Workload")]
    pub(super) burst_input_tokens: LengthDist,
    /// Long prompts' output lengths (mixed workload).
    #[arg(long, default_value = "16", value_parser = parse_dist, help_heading = "Workload")]
    pub(super) burst_output_tokens: LengthDist,
    /// Prompts file: JSON lines with "prompt" (and optional "output_length"), or plain lines.
    #[arg(long, value_name = "FILE", help_heading = "Workload")]
    pub(super) prompts_file: Option<PathBuf>,
    /// Tokenizer for exact prompt lengths: the model's tokenizer.json (or .gguf), or `words`
    /// (one token per word, for servers that count words).
    #[arg(long, default_value = "words", env = "KVX_BENCH_TOKENIZER", help_heading = "Workload")]
    pub(super) tokenizer: String,
    /// Count output tokens by tokenizing the text when the server reports no usage (default:
    /// one per streamed chunk).
    #[arg(long, help_heading = "Workload")]
    pub(super) count_output_with_tokenizer: bool,

    // Load.
    /// Closed loop at this concurrency; a comma list is a sweep (default 1).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["request_rate", "trace_speed"], help_heading = "Load")]
    pub(super) concurrency: Vec<usize>,
    /// Open loop, Poisson arrivals at this many requests/s; a comma list is a sweep.
    #[arg(long, value_delimiter = ',', conflicts_with = "trace_speed", help_heading = "Load")]
    pub(super) request_rate: Vec<f64>,
    /// Replay at the trace's timestamps divided by this factor; a comma list is a sweep
    /// (default 1 when --trace is given without another load).
    #[arg(long, value_delimiter = ',', requires = "trace", help_heading = "Load")]
    pub(super) trace_speed: Vec<f64>,
    /// Requests per level (default: the dataset's size, unless --duration bounds the level).
    #[arg(long, help_heading = "Load")]
    pub(super) requests: Option<u64>,
    /// Seconds per level after which no request starts (mixed workload: 60 unless --requests).
    #[arg(long, help_heading = "Load")]
    pub(super) duration: Option<f64>,
    /// Unmeasured warm-up requests before the first level.
    #[arg(long, default_value_t = 0, help_heading = "Load")]
    pub(super) warmup: usize,
    /// Seed for prompts, lengths and arrivals.
    #[arg(long, default_value_t = 0, env = "KVX_BENCH_SEED", help_heading = "Load")]
    pub(super) seed: u64,
    /// Client threads (0 = one per available core).
    #[arg(long, default_value_t = 0, env = "KVX_BENCH_THREADS", help_heading = "Load")]
    pub(super) threads: usize,
    /// Open loop: most requests in flight; later arrivals wait and show as schedule lag.
    #[arg(long, default_value_t = 4096, help_heading = "Load")]
    pub(super) max_in_flight: usize,

    // Objectives and output.
    /// Goodput objective: time to first token at most this many milliseconds.
    #[arg(long, help_heading = "Output")]
    pub(super) slo_ttft: Option<f64>,
    /// Goodput objective: mean inter-token latency of a request at most this many milliseconds.
    #[arg(long, help_heading = "Output")]
    pub(super) slo_itl: Option<f64>,
    /// Write the JSON report here (schema: bench/SCHEMA.md).
    #[arg(long, value_name = "PATH", help_heading = "Output")]
    pub(super) json: Option<PathBuf>,
    /// Write the self-contained HTML report here.
    #[arg(long, value_name = "PATH", help_heading = "Output")]
    pub(super) html: Option<PathBuf>,
    /// Include one record per request in the JSON report.
    #[arg(long, help_heading = "Output")]
    pub(super) export_requests: bool,
    /// No progress bar.
    #[arg(long, short, help_heading = "Output")]
    pub(super) quiet: bool,
}

/// API choice on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ApiArg {
    /// /v1/chat/completions
    Chat,
    /// /v1/completions
    Completions,
}

/// Arguments of `kvx bench compare`.
#[derive(Debug, Args)]
pub(crate) struct CompareArgs {
    /// Baseline report (A).
    a: PathBuf,
    /// Report compared against it (B).
    b: PathBuf,
}

pub(crate) fn run(args: BenchArgs, rt: &super::Runtime) -> anyhow::Result<()> {
    match args.command {
        None => run_bench(&args.run),
        Some(BenchCommand::Run(run)) => run_bench(&run),
        Some(BenchCommand::Compare(c)) => {
            let a = Report::read_json(&c.a)?;
            let b = Report::read_json(&c.b)?;
            print!(
                "{}",
                kvx_bench::compare_table(
                    &a,
                    &c.a.display().to_string(),
                    &b,
                    &c.b.display().to_string()
                )
            );
            Ok(())
        }
        Some(BenchCommand::Xfer(x)) => super::bench_xfer::run(x),
        Some(BenchCommand::Engine(e)) => super::bench_engine::run(e, rt),
    }
}

fn run_bench(args: &RunArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let report = kvx_bench::run(&config).context("benchmark")?;
    print!("{}", kvx_bench::summary_table(&report));
    if let Some(path) = &args.json {
        report.write_json(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.html {
        report.write_html(path)?;
        eprintln!("wrote {}", path.display());
    }
    let failed: u64 = report.runs.iter().map(|r| r.requests.failed).sum();
    let completed: u64 = report.runs.iter().map(|r| r.requests.completed).sum();
    if completed == 0 {
        bail!("no request succeeded ({failed} failed)");
    }
    Ok(())
}
