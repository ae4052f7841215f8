//! Load generation: closed loop at a concurrency, open loop at a Poisson rate or at a trace's
//! timestamps, or the mixed workload's streams and bursts; sweeps over levels, warm-up, bounds
//! by request count or duration.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use crate::BenchError;
use crate::client::{Client, Outcome, Scratch};
use crate::metrics::{Collector, Finished};
use crate::prompt::PromptSynth;
use crate::report::{Level, LoadInfo, Report, RunReport, SCHEMA, Slo, Target, WorkloadInfo};
use crate::request::{BodyBuilder, EndpointConfig, Role};
use crate::tokenizer::{TokenCodec, TokenizerSpec};
use crate::workload::{Conversation, Dataset, RequestClass, Turn, WorkloadConfig};

/// How load is offered. Each value in the list is one level of a sweep, run in order.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadConfig {
    /// Closed loop: this many requests (or sessions) in flight, each sent when one finishes.
    Closed {
        /// Concurrency per level.
        concurrency: Vec<usize>,
    },
    /// Open loop: arrivals of a Poisson process at this many requests (sessions) per second.
    Poisson {
        /// Rate per level.
        rates: Vec<f64>,
    },
    /// Open loop at the trace's timestamps divided by a speed factor.
    Trace {
        /// Speed factor per level (2.0 replays twice as fast).
        speeds: Vec<f64>,
    },
    /// The load the mixed workload describes itself (its closed-loop streams and periodic
    /// bursts), as one level; for that workload only.
    Mixed,
}

impl LoadConfig {
    /// The levels, in order (the mixed load takes its one level from the workload).
    fn levels(&self, workload: &WorkloadConfig) -> Vec<LevelSpec> {
        match self {
            Self::Closed { concurrency } => {
                concurrency.iter().map(|&c| LevelSpec::Concurrency(c)).collect()
            }
            Self::Poisson { rates } => rates.iter().map(|&r| LevelSpec::Rate(r)).collect(),
            Self::Trace { speeds } => speeds.iter().map(|&s| LevelSpec::TraceSpeed(s)).collect(),
            Self::Mixed => match workload {
                WorkloadConfig::Mixed { streams, .. } => vec![LevelSpec::Mixed(*streams)],
                _ => Vec::new(),
            },
        }
    }

    fn mode(&self) -> &'static str {
        match self {
            Self::Closed { .. } => "closed",
            Self::Poisson { .. } => "poisson",
            Self::Trace { .. } => "trace",
            Self::Mixed => "mixed",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum LevelSpec {
    Concurrency(usize),
    Rate(f64),
    TraceSpeed(f64),
    /// The mixed workload with this many streams.
    Mixed(usize),
}

impl LevelSpec {
    fn level(self) -> Level {
        match self {
            Self::Concurrency(c) => {
                Level { mode: "concurrency".into(), value: c as f64, label: format!("c={c}") }
            }
            Self::Rate(r) => {
                Level { mode: "request_rate".into(), value: r, label: format!("{r} req/s") }
            }
            Self::TraceSpeed(s) => {
                Level { mode: "trace_speed".into(), value: s, label: format!("trace x{s}") }
            }
            Self::Mixed(n) => Level {
                mode: "mixed".into(),
                value: n as f64,
                label: format!("{n} streams + bursts"),
            },
        }
    }
}

/// How generated tokens are counted when the server reports no usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputCount {
    /// One token per chunk carrying text (what OpenAI-compatible servers stream).
    #[default]
    Chunks,
    /// Tokenize the generated text with the benchmark's tokenizer.
    Tokenizer,
}

/// Everything a benchmark needs; built by the `kvx bench` command line or by tests.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The endpoint.
    pub endpoint: EndpointConfig,
    /// What to send.
    pub workload: WorkloadConfig,
    /// Tokenizer for exact prompt lengths.
    pub tokenizer: TokenizerSpec,
    /// How to send it.
    pub load: LoadConfig,
    /// Requests per level; `None` means the dataset's size unless `duration` bounds the level
    /// (the mixed workload, which has no dataset, needs one of the two).
    pub max_requests: Option<u64>,
    /// Time per level after which no new request starts.
    pub duration: Option<Duration>,
    /// Unmeasured requests sent before the first level.
    pub warmup_requests: usize,
    /// Seed for prompts, lengths and arrivals.
    pub seed: u64,
    /// Objectives for goodput.
    pub slo: Slo,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Wait this long for the server to answer `GET /v1/models` before starting.
    pub wait_ready: Duration,
    /// Client runtime threads; 0 = one per available core (a single-threaded runtime on one).
    pub client_threads: usize,
    /// Open loop: most requests in flight; further arrivals wait (and show as schedule lag).
    pub max_in_flight: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Keep per-request records in the report.
    pub keep_request_records: bool,
    /// Counting of generated tokens without server usage.
    pub output_count: OutputCount,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            endpoint: EndpointConfig::default(),
            workload: WorkloadConfig::Synthetic {
                input: crate::LengthDist::fixed(128),
                output: crate::LengthDist::fixed(64),
                prompts: 100,
            },
            tokenizer: TokenizerSpec::Words,
            load: LoadConfig::Closed { concurrency: vec![1] },
            max_requests: None,
            duration: None,
            warmup_requests: 0,
            seed: 0,
            slo: Slo::default(),
            request_timeout: Duration::from_secs(600),
            wait_ready: Duration::ZERO,
            client_threads: 0,
            max_in_flight: 4096,
            progress: false,
            keep_request_records: false,
            output_count: OutputCount::Chunks,
        }
    }
}

impl BenchConfig {
    fn validate(&self) -> Result<(), BenchError> {
        let mixed_workload = matches!(self.workload, WorkloadConfig::Mixed { .. });
        if mixed_workload != (self.load == LoadConfig::Mixed) {
            return Err(BenchError::config(
                "the mixed workload runs under the mixed load, and only it does",
            ));
        }
        if mixed_workload && self.max_requests.is_none() && self.duration.is_none() {
            return Err(BenchError::config("the mixed workload needs a duration or request bound"));
        }
        let levels = self.load.levels(&self.workload);
        if levels.is_empty() {
            return Err(BenchError::config("no load level given"));
        }
        for l in levels {
            let ok = match l {
                LevelSpec::Concurrency(c) | LevelSpec::Mixed(c) => c >= 1,
                LevelSpec::Rate(r) | LevelSpec::TraceSpeed(r) => r.is_finite() && r > 0.0,
            };
            if !ok {
                return Err(BenchError::config("concurrency, rate and speed must be positive"));
            }
        }
        if matches!(self.load, LoadConfig::Trace { .. })
            && !matches!(self.workload, WorkloadConfig::Trace { .. })
        {
            return Err(BenchError::config("trace-timed load needs a trace workload"));
        }
        if self.max_requests == Some(0) || self.duration.is_some_and(|d| d.is_zero()) {
            return Err(BenchError::config("request count and duration bounds must be positive"));
        }
        if self.max_in_flight == 0 || self.request_timeout.is_zero() {
            return Err(BenchError::config("max in flight and request timeout must be positive"));
        }
        Ok(())
    }
}

/// Runs the benchmark on its own runtime and returns the report.
pub fn run(config: &BenchConfig) -> Result<Report, BenchError> {
    let threads = match config.client_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    let rt = builder.enable_all().build().map_err(BenchError::Runtime)?;
    rt.block_on(run_async(config, threads))
}

/// Runs the benchmark on the current runtime. `threads` is only reported.
pub async fn run_async(config: &BenchConfig, threads: usize) -> Result<Report, BenchError> {
    config.validate()?;
    let started_unix_ms =
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let codec = config.tokenizer.load()?;
    let client = Client::new(&config.endpoint, config.request_timeout)?;
    let model = resolve_model(&client, config).await?;
    let synth = PromptSynth::new(codec.clone(), config.seed)?;
    let bodies = BodyBuilder::new(&config.endpoint, &model);
    let dataset =
        Dataset::build(&config.workload, &synth, &bodies, config.seed, config.warmup_requests)?;
    let ctx = Arc::new(Ctx {
        client,
        bodies,
        codec: codec.clone(),
        count_with_tokenizer: config.output_count == OutputCount::Tokenizer
            || !config.endpoint.stream,
        slo: config.slo,
        keep_records: config.keep_request_records,
        max_in_flight: config.max_in_flight,
        progress: config.progress,
        seed: config.seed,
        scratch: Mutex::new(Vec::new()),
        dataset,
    });
    let levels = config.load.levels(&config.workload);
    if !ctx.dataset.warmup.is_empty() {
        let c = match levels.first() {
            Some(LevelSpec::Concurrency(c) | LevelSpec::Mixed(c)) => *c,
            _ => 8,
        }
        .min(ctx.dataset.warmup.len());
        let n = ctx.dataset.warmup.len() as u64;
        let st = LevelState::new(&ctx, Instant::now(), "warm-up", Some(n), None);
        closed_loop(&ctx, &st, c, Which::Warmup).await;
        st.bar.finish_and_clear();
    }
    let mut runs = Vec::with_capacity(levels.len());
    let dataset_requests = ctx.dataset.requests();
    for (i, spec) in levels.iter().enumerate() {
        let limit = match (config.max_requests, config.duration, spec) {
            (_, _, LevelSpec::TraceSpeed(_)) => {
                Some(config.max_requests.map_or(dataset_requests, |m| m.min(dataset_requests)))
            }
            (Some(m), _, _) => Some(m),
            (None, Some(_), _) => None,
            (None, None, _) => Some(dataset_requests),
        };
        runs.push(run_level(&ctx, *spec, i as u64, limit, config.duration).await?);
    }
    Ok(Report {
        schema: SCHEMA.to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix_ms,
        target: Target {
            url: ctx.client.uri().to_string(),
            api: config.endpoint.api,
            model,
            stream: config.endpoint.stream,
        },
        workload: WorkloadInfo {
            kind: config.workload.kind().to_string(),
            description: config.workload.describe(),
            tokenizer: codec.describe(),
            conversations: ctx.dataset.conversations.len(),
            dataset_requests,
            config: config.workload.clone(),
        },
        load: LoadInfo {
            mode: config.load.mode().to_string(),
            max_requests: config.max_requests,
            duration_s: config.duration.map(|d| d.as_secs_f64()),
            warmup_requests: config.warmup_requests,
            request_timeout_s: config.request_timeout.as_secs_f64(),
            client_threads: threads,
        },
        slo: config.slo,
        seed: config.seed,
        runs,
    })
}

async fn resolve_model(client: &Client, config: &BenchConfig) -> Result<String, BenchError> {
    let deadline = Instant::now() + config.wait_ready;
    loop {
        match client.first_model().await {
            Ok(m) => return Ok(config.endpoint.model.clone().unwrap_or(m)),
            Err(e) => {
                if Instant::now() >= deadline {
                    return match &config.endpoint.model {
                        // The server may not list models; go on with the name given.
                        Some(m) if config.wait_ready.is_zero() => Ok(m.clone()),
                        _ => Err(e),
                    };
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Shared by every task of a benchmark.
#[derive(Debug)]
struct Ctx {
    client: Client,
    bodies: BodyBuilder,
    codec: Arc<dyn TokenCodec>,
    count_with_tokenizer: bool,
    slo: Slo,
    keep_records: bool,
    max_in_flight: usize,
    progress: bool,
    seed: u64,
    /// Reusable request buffers and their kept-alive connections (bounded by the number of
    /// concurrent requests): a request takes one, and puts it back when it is done.
    scratch: Mutex<Vec<Scratch>>,
    dataset: Dataset,
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Warmup,
    Measured,
}

impl Ctx {
    fn conversations(&self, which: Which) -> &[Conversation] {
        match which {
            Which::Warmup => &self.dataset.warmup,
            Which::Measured => &self.dataset.conversations,
        }
    }

    fn take_scratch(&self) -> Scratch {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }

    fn put_scratch(&self, s: Scratch) {
        let mut pool = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < self.max_in_flight {
            pool.push(s);
        }
    }
}

/// State of the level being run.
#[derive(Debug)]
struct LevelState {
    t0: Instant,
    collector: Mutex<Collector>,
    issued: AtomicU64,
    limit: u64,
    deadline: Option<Instant>,
    in_flight: AtomicU64,
    peak: AtomicU64,
    bar: ProgressBar,
}

impl LevelState {
    fn new(
        ctx: &Ctx,
        t0: Instant,
        label: &str,
        limit: Option<u64>,
        duration: Option<Duration>,
    ) -> Arc<Self> {
        let bar = if ctx.progress {
            let (bar, template) = match limit {
                Some(n) => (
                    ProgressBar::new(n),
                    "{prefix:>12} {elapsed_precise} [{wide_bar}] {pos}/{len} {per_sec} {msg}",
                ),
                None => (
                    ProgressBar::new_spinner(),
                    "{prefix:>12} {elapsed_precise} {spinner} {pos} requests {per_sec} {msg}",
                ),
            };
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(label.to_string());
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        } else {
            ProgressBar::hidden()
        };
        Arc::new(Self {
            t0,
            collector: Mutex::new(Collector::new(t0, ctx.slo, ctx.keep_records)),
            issued: AtomicU64::new(0),
            limit: limit.unwrap_or(u64::MAX),
            deadline: duration.map(|d| t0 + d),
            in_flight: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            bar,
        })
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Takes the right to send one more request. An open-loop arrival was already checked
    /// against the deadline by its schedule, so lateness of the client cannot drop it.
    fn claim(&self, check_deadline: bool) -> bool {
        !(check_deadline && self.past_deadline())
            && self.issued.fetch_add(1, Ordering::Relaxed) < self.limit
    }

    fn exhausted(&self) -> bool {
        self.past_deadline() || self.issued.load(Ordering::Relaxed) >= self.limit
    }

    fn record(&self, f: &Finished<'_>) {
        let failed = f.outcome.error.is_some();
        let mut c = self.collector.lock().unwrap_or_else(|e| e.into_inner());
        c.add(f);
        drop(c);
        self.bar.inc(1);
        if failed {
            self.bar.set_message("(errors)");
        }
    }
}

async fn run_level(
    ctx: &Arc<Ctx>,
    spec: LevelSpec,
    index: u64,
    limit: Option<u64>,
    duration: Option<Duration>,
) -> Result<RunReport, BenchError> {
    let level = spec.level();
    let t0 = Instant::now();
    let st = LevelState::new(ctx, t0, &level.label, limit, duration);
    let done = match spec {
        LevelSpec::Concurrency(c) => {
            closed_loop(ctx, &st, c, Which::Measured).await;
            Ok(())
        }
        LevelSpec::Rate(_) | LevelSpec::TraceSpeed(_) => {
            open_loop(ctx, &st, spec, index).await;
            Ok(())
        }
        LevelSpec::Mixed(_) => mixed_loop(ctx, &st).await,
    };
    st.bar.finish_and_clear();
    done?;
    let peak = st.peak.load(Ordering::Relaxed);
    let collector = {
        let mut guard = st.collector.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *guard, Collector::new(t0, ctx.slo, false))
    };
    Ok(collector.finish(level, peak))
}

async fn closed_loop(ctx: &Arc<Ctx>, st: &Arc<LevelState>, concurrency: usize, which: Which) {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..concurrency {
        let (ctx, st, next) = (ctx.clone(), st.clone(), next.clone());
        tasks.spawn(async move {
            let mut scratch = ctx.take_scratch();
            let convs = ctx.conversations(which);
            while !st.exhausted() && !convs.is_empty() {
                let i = next.fetch_add(1, Ordering::Relaxed) % convs.len();
                if !run_conversation(&ctx, &st, which, i, &mut scratch, None).await {
                    break;
                }
            }
            ctx.put_scratch(scratch);
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            tracing::error!("load task failed: {e}");
        }
    }
}

/// Seconds as a duration, clamped to [0, 10^9] s so that no input can make it panic.
fn secs(x: f64) -> Duration {
    Duration::from_secs_f64(if x.is_finite() { x.clamp(0.0, 1e9) } else { 0.0 })
}

async fn open_loop(ctx: &Arc<Ctx>, st: &Arc<LevelState>, spec: LevelSpec, index: u64) {
    let convs = ctx.conversations(Which::Measured);
    if convs.is_empty() {
        return;
    }
    let sem = Arc::new(Semaphore::new(ctx.max_in_flight));
    let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed ^ 0x6172_7269_7661_6c00 ^ index);
    let exp = match spec {
        LevelSpec::Rate(r) => Exp::new(r).ok(),
        _ => None,
    };
    let base_ms = convs[0].at_ms.unwrap_or(0.0);
    let t0 = st.t0;
    let mut offset = 0.0f64;
    let mut tasks = JoinSet::new();
    for i in 0usize.. {
        // Arrivals are cut by their scheduled time and the request bound, not by how late the
        // client is. Single-request conversations are counted here, before their tasks run.
        let single = !ctx.dataset.multi_turn;
        if (single && i as u64 >= st.limit) || st.issued.load(Ordering::Relaxed) >= st.limit {
            break;
        }
        let due = match (spec, &exp) {
            (LevelSpec::TraceSpeed(speed), _) => {
                let Some(conv) = convs.get(i) else { break };
                t0 + secs((conv.at_ms.unwrap_or(base_ms) - base_ms) / speed / 1e3)
            }
            (_, Some(exp)) => {
                let due = t0 + secs(offset);
                offset += exp.sample(&mut rng);
                due
            }
            _ => break,
        };
        if st.deadline.is_some_and(|d| due >= d) {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        let lag = Instant::now().saturating_duration_since(due);
        let (ctx, st) = (ctx.clone(), st.clone());
        let conv = i % convs.len();
        tasks.spawn(async move {
            let mut scratch = ctx.take_scratch();
            run_conversation(&ctx, &st, Which::Measured, conv, &mut scratch, Some(lag)).await;
            ctx.put_scratch(scratch);
            drop(permit);
        });
        while let Some(r) = tasks.try_join_next() {
            if let Err(e) = r {
                tracing::error!("load task failed: {e}");
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            tracing::error!("load task failed: {e}");
        }
    }
}

/// Sends the turns of one conversation in order. Returns `false` once the level's bound stops
/// it (so closed-loop workers stop too).
async fn run_conversation(
    ctx: &Ctx,
    st: &LevelState,
    which: Which,
    index: usize,
    scratch: &mut Scratch,
    lag: Option<Duration>,
) -> bool {
    let Some(conv) = ctx.conversations(which).get(index) else { return false };
    let multi = ctx.dataset.multi_turn;
    let want_text = multi || ctx.count_with_tokenizer;
    let mut history: Vec<(Role, String)> = Vec::new();
    let mut history_tokens = 0u32;
    for (k, turn) in conv.turns.iter().enumerate() {
        let scheduled = k == 0 && lag.is_some();
        if !st.claim(!scheduled) {
            return false;
        }
        let body = match &turn.body {
            Some(b) => b.clone(),
            None => {
                let mut msgs: Vec<(Role, &str)> =
                    history.iter().map(|(r, t)| (*r, t.as_str())).collect();
                msgs.push((Role::User, &turn.user));
                ctx.bodies.body(&msgs, turn.max_tokens)
            }
        };
        let (outcome, output_tokens) = exchange(ctx, st, body, scratch, want_text).await;
        let input_tokens = history_tokens.saturating_add(turn.input_tokens);
        st.record(&Finished {
            outcome: &outcome,
            gaps: &scratch.gaps,
            input_tokens,
            output_tokens,
            lag: if k == 0 { lag } else { None },
            conversation: index,
            turn: k,
            class: None,
        });
        if outcome.error.is_some() {
            // A failed turn ends its session: later turns would lack the answer. A request the
            // server shed with `Retry-After` holds its closed-loop stream that long before the
            // next (as client SDKs do; a stream that resent at once would only add refusals);
            // open-loop arrivals keep their schedule, and the warm-up (no deadline) does not
            // wait. The level's end cuts the wait short; a used-up level does not wait.
            if lag.is_none()
                && matches!(which, Which::Measured)
                && !st.exhausted()
                && let Some(wait) = outcome.retry_after
            {
                let until = Instant::now() + wait;
                let until = st.deadline.map_or(until, |d| d.min(until));
                tokio::time::sleep_until(until.into()).await;
            }
            return true;
        }
        if multi && k + 1 < conv.turns.len() {
            history.push((Role::User, turn.user.clone()));
            history.push((Role::Assistant, scratch.text.clone()));
            history_tokens = input_tokens.saturating_add(output_tokens);
            if !ctx.dataset.think_time.is_zero() {
                tokio::time::sleep(ctx.dataset.think_time).await;
            }
        }
    }
    true
}

/// Sends one request, counting it in flight; returns what the client saw and the number of
/// generated tokens (server usage, else counted).
async fn exchange(
    ctx: &Ctx,
    st: &LevelState,
    body: Bytes,
    scratch: &mut Scratch,
    want_text: bool,
) -> (Outcome, u32) {
    let now = st.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
    st.peak.fetch_max(now, Ordering::Relaxed);
    let outcome = ctx.client.send(body, scratch, want_text).await;
    st.in_flight.fetch_sub(1, Ordering::Relaxed);
    let output_tokens = match outcome.usage.and_then(|u| u.completion_tokens) {
        Some(n) => n.try_into().unwrap_or(u32::MAX),
        None if ctx.count_with_tokenizer && !scratch.text.is_empty() => ctx
            .codec
            .encode(&scratch.text)
            .map_or(outcome.content_chunks, |ids| ids.len().try_into().unwrap_or(u32::MAX)),
        None => outcome.content_chunks,
    };
    (outcome, output_tokens)
}

/// The first failure of a mixed run's request builders; it ends the level.
type Failure = Arc<Mutex<Option<BenchError>>>;

fn failed(failure: &Failure) -> bool {
    failure.lock().unwrap_or_else(|e| e.into_inner()).is_some()
}

fn fail(failure: &Failure, e: BenchError) {
    failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
}

/// Builds request `index` of `class` of the mixed workload on the blocking pool, so that
/// tokenizing a long prompt never holds up the reading of other responses.
fn prepare(
    ctx: &Arc<Ctx>,
    class: RequestClass,
    index: u64,
) -> JoinHandle<Result<Turn, BenchError>> {
    let ctx = ctx.clone();
    tokio::task::spawn_blocking(move || match &ctx.dataset.mixed {
        Some(m) => m.request(&ctx.bodies, class, index),
        None => Err(BenchError::config("not a mixed workload")),
    })
}

async fn ready(h: JoinHandle<Result<Turn, BenchError>>) -> Result<Turn, BenchError> {
    h.await.map_err(|e| BenchError::Runtime(std::io::Error::other(e)))?
}

/// Sends one request of the mixed workload and records it under its class.
async fn send_mixed(
    ctx: &Ctx,
    st: &LevelState,
    (turn, class, index): (&Turn, RequestClass, u64),
    scratch: &mut Scratch,
    lag: Option<Duration>,
) {
    let Some(body) = turn.body.clone() else { return };
    let (outcome, output_tokens) = exchange(ctx, st, body, scratch, ctx.count_with_tokenizer).await;
    st.record(&Finished {
        outcome: &outcome,
        gaps: &scratch.gaps,
        input_tokens: turn.input_tokens,
        output_tokens,
        lag,
        conversation: usize::try_from(index).unwrap_or(usize::MAX),
        turn: 0,
        class: Some(class),
    });
}

/// The mixed workload: its streams, each sending its next request as soon as the last one
/// ends (built while the last one runs), and a burst at every interval. Bursts are cut by their
/// scheduled time and the request bound, not by how late the client is.
async fn mixed_loop(ctx: &Arc<Ctx>, st: &Arc<LevelState>) -> Result<(), BenchError> {
    let Some(src) = ctx.dataset.mixed.as_ref() else { return Ok(()) };
    let failure = Failure::default();
    let next_index = Arc::new(AtomicU64::new(0));
    let mut streams = JoinSet::new();
    for _ in 0..src.streams() {
        let (ctx, st) = (ctx.clone(), st.clone());
        let (failure, next_index) = (failure.clone(), next_index.clone());
        streams.spawn(async move {
            let mut scratch = ctx.take_scratch();
            let mut index = next_index.fetch_add(1, Ordering::Relaxed);
            let mut next = prepare(&ctx, RequestClass::Stream, index);
            while !failed(&failure) && st.claim(true) {
                let turn = match ready(next).await {
                    Ok(t) => t,
                    Err(e) => {
                        fail(&failure, e);
                        break;
                    }
                };
                let this = index;
                index = next_index.fetch_add(1, Ordering::Relaxed);
                next = prepare(&ctx, RequestClass::Stream, index);
                let req = (&turn, RequestClass::Stream, this);
                send_mixed(&ctx, &st, req, &mut scratch, None).await;
            }
            ctx.put_scratch(scratch);
        });
    }
    let sem = Arc::new(Semaphore::new(ctx.max_in_flight));
    let mut bursts = JoinSet::new();
    let mut streams_left = src.streams();
    let mut next = prepare(ctx, RequestClass::Burst, 0);
    for k in 0u64.. {
        let due = st.t0 + src.burst_due(k);
        let bounded =
            st.deadline.is_some_and(|d| due >= d) || st.issued.load(Ordering::Relaxed) >= st.limit;
        if bounded || failed(&failure) {
            break;
        }
        loop {
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(due.into()) => break,
                r = streams.join_next(), if streams_left > 0 => {
                    // Streams end at the bound (or on a failure): stop early if it was that.
                    streams_left -= 1;
                    if let Some(Err(e)) = r {
                        tracing::error!("load task failed: {e}");
                    }
                    if st.issued.load(Ordering::Relaxed) >= st.limit || failed(&failure) {
                        break;
                    }
                }
            }
        }
        if failed(&failure) || !st.claim(false) {
            break;
        }
        let turn = match ready(next).await {
            Ok(t) => t,
            Err(e) => {
                fail(&failure, e);
                break;
            }
        };
        next = prepare(ctx, RequestClass::Burst, k + 1);
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        let lag = Instant::now().saturating_duration_since(due);
        let (ctx, st) = (ctx.clone(), st.clone());
        bursts.spawn(async move {
            let mut scratch = ctx.take_scratch();
            let req = (&turn, RequestClass::Burst, k);
            send_mixed(&ctx, &st, req, &mut scratch, Some(lag)).await;
            ctx.put_scratch(scratch);
            drop(permit);
        });
        while let Some(r) = bursts.try_join_next() {
            if let Err(e) = r {
                tracing::error!("load task failed: {e}");
            }
        }
    }
    for set in [&mut streams, &mut bursts] {
        while let Some(r) = set.join_next().await {
            if let Err(e) = r {
                tracing::error!("load task failed: {e}");
            }
        }
    }
    let failure = failure.lock().unwrap_or_else(|e| e.into_inner()).take();
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LengthDist;

    fn mixed() -> WorkloadConfig {
        WorkloadConfig::Mixed {
            streams: 2,
            input: LengthDist::fixed(8),
            output: LengthDist::fixed(4),
            burst_input: LengthDist::fixed(64),
            burst_output: LengthDist::fixed(2),
            burst_interval_s: 0.5,
        }
    }

    #[test]
    fn the_mixed_workload_and_the_mixed_load_go_together_with_a_bound() {
        let ok = BenchConfig {
            workload: mixed(),
            load: LoadConfig::Mixed,
            duration: Some(Duration::from_secs(1)),
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
        let levels = ok.load.levels(&ok.workload);
        assert!(matches!(levels[..], [LevelSpec::Mixed(2)]));
        assert_eq!(levels[0].level().label, "2 streams + bursts");
        let by_count = BenchConfig { duration: None, max_requests: Some(10), ..ok.clone() };
        assert!(by_count.validate().is_ok());
        let unbounded = BenchConfig { duration: None, ..ok.clone() };
        let closed =
            BenchConfig { load: LoadConfig::Closed { concurrency: vec![2] }, ..ok.clone() };
        let not_mixed = BenchConfig { load: LoadConfig::Mixed, ..Default::default() };
        for bad in [unbounded, closed, not_mixed] {
            assert!(matches!(bad.validate(), Err(BenchError::Config(_))), "{bad:?}");
        }
    }
}
