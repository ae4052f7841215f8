//! `kvx bench` flags turned into the benchmark's [`BenchConfig`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use kvx_bench::{
    Api, BenchConfig, EndpointConfig, LengthDist, LoadConfig, OutputCount, Slo, TokenizerSpec,
    WorkloadConfig,
};

use super::bench::{ApiArg, RunArgs, WorkloadKind};

pub(super) fn parse_dist(s: &str) -> Result<LengthDist, String> {
    s.parse().map_err(|e: kvx_bench::BenchError| e.to_string())
}

fn secs(what: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .with_context(|| format!("{what}: {s} is not a number of seconds"))
}

impl RunArgs {
    pub(super) fn config(&self) -> anyhow::Result<BenchConfig> {
        let mut extra_body = serde_json::Map::new();
        if let Some(text) = &self.extra_body {
            match serde_json::from_str(text).context("--extra-body")? {
                serde_json::Value::Object(m) => extra_body = m,
                _ => bail!("--extra-body must be a JSON object"),
            }
        }
        let mut headers = Vec::with_capacity(self.headers.len());
        for h in &self.headers {
            let Some((k, v)) = h.split_once(':') else {
                bail!("--header {h:?}: expected NAME: VALUE")
            };
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        let endpoint = EndpointConfig {
            url: self.url.clone(),
            api: match self.api {
                ApiArg::Chat => Api::Chat,
                ApiArg::Completions => Api::Completions,
            },
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            headers,
            stream: !self.no_stream,
            include_usage: !self.no_usage,
            ignore_eos: self.ignore_eos,
            max_completion_tokens_field: self.max_completion_tokens,
            extra_body,
        };
        let kind = self.workload.unwrap_or(if self.trace.is_some() {
            WorkloadKind::Trace
        } else if self.prompts_file.is_some() {
            WorkloadKind::Prompts
        } else {
            WorkloadKind::Synthetic
        });
        let workload = match kind {
            WorkloadKind::Synthetic => WorkloadConfig::Synthetic {
                input: self.input_tokens,
                output: self.output_tokens,
                prompts: self.prompts,
            },
            WorkloadKind::SharedPrefix => WorkloadConfig::SharedPrefix {
                prefixes: self.prefixes,
                prefix_tokens: self.prefix_tokens,
                suffix: self.input_tokens,
                output: self.output_tokens,
                prompts: self.prompts,
            },
            WorkloadKind::MultiTurn => WorkloadConfig::MultiTurn {
                sessions: self.sessions,
                turns: self.turns,
                user: self.input_tokens,
                output: self.output_tokens,
                think_time_ms: self.think_time_ms,
            },
            WorkloadKind::Trace => WorkloadConfig::Trace {
                path: self.trace.clone().context("the trace workload needs --trace FILE")?,
                block_tokens: self.trace_block_tokens,
            },
            WorkloadKind::Prompts => WorkloadConfig::PromptsFile {
                path: self
                    .prompts_file
                    .clone()
                    .context("the prompts workload needs --prompts-file FILE")?,
                output: self.output_tokens,
            },
            WorkloadKind::Mixed => WorkloadConfig::Mixed {
                streams: self.streams,
                input: self.input_tokens,
                output: self.output_tokens,
                burst_input: self.burst_input_tokens,
                burst_output: self.burst_output_tokens,
                burst_interval_s: self.burst_interval,
            },
        };
        let mixed = kind == WorkloadKind::Mixed;
        let other_load = [self.concurrency.len(), self.request_rate.len(), self.trace_speed.len()];
        if mixed && other_load.iter().any(|&n| n > 0) {
            bail!("the mixed workload sets its own load (--streams, --burst-interval)");
        }
        let mut duration = self.duration.map(|d| secs("--duration", d)).transpose()?;
        if mixed && duration.is_none() && self.requests.is_none() {
            duration = Some(Duration::from_secs(60));
        }
        let load = if mixed {
            LoadConfig::Mixed
        } else if !self.request_rate.is_empty() {
            LoadConfig::Poisson { rates: self.request_rate.clone() }
        } else if !self.trace_speed.is_empty() {
            LoadConfig::Trace { speeds: self.trace_speed.clone() }
        } else if !self.concurrency.is_empty() {
            LoadConfig::Closed { concurrency: self.concurrency.clone() }
        } else if kind == WorkloadKind::Trace {
            LoadConfig::Trace { speeds: vec![1.0] }
        } else {
            LoadConfig::Closed { concurrency: vec![1] }
        };
        let tokenizer = match self.tokenizer.as_str() {
            "words" => TokenizerSpec::Words,
            path => TokenizerSpec::File(PathBuf::from(path)),
        };
        Ok(BenchConfig {
            endpoint,
            workload,
            tokenizer,
            load,
            max_requests: self.requests,
            duration,
            warmup_requests: self.warmup,
            seed: self.seed,
            slo: Slo { ttft_ms: self.slo_ttft, itl_ms: self.slo_itl },
            request_timeout: secs("--timeout", self.timeout)?,
            wait_ready: secs("--wait-ready", self.wait_ready)?,
            client_threads: self.threads,
            max_in_flight: self.max_in_flight,
            progress: !self.quiet,
            keep_request_records: self.export_requests,
            output_count: if self.count_output_with_tokenizer {
                OutputCount::Tokenizer
            } else {
                OutputCount::Chunks
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::bench::{BenchArgs, BenchCommand};
    use crate::cmd::{Cli, Command};
    use clap::Parser;

    fn bench(args: &[&str]) -> BenchArgs {
        let mut argv = vec!["kvx", "bench"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Bench(b) => *b,
            #[allow(unreachable_patterns)]
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn default_run_subcommands_and_sweeps_parse() {
        let b = bench(&[
            "--url",
            "http://h:1",
            "--concurrency",
            "1,2,8",
            "--input-tokens",
            "normal:64,8",
        ]);
        assert!(b.command.is_none());
        let cfg = b.run.config().unwrap();
        assert_eq!(cfg.load, LoadConfig::Closed { concurrency: vec![1, 2, 8] });
        assert_eq!(cfg.endpoint.url, "http://h:1");
        assert!(matches!(
            cfg.workload,
            WorkloadConfig::Synthetic { input: LengthDist::Normal { .. }, .. }
        ));

        let b = bench(&["run", "--request-rate", "5,10", "--duration", "2"]);
        let Some(BenchCommand::Run(r)) = b.command else { panic!() };
        let cfg = r.config().unwrap();
        assert_eq!(cfg.load, LoadConfig::Poisson { rates: vec![5.0, 10.0] });
        assert_eq!(cfg.duration, Some(Duration::from_secs(2)));

        let b = bench(&["compare", "a.json", "b.json"]);
        assert!(matches!(b.command, Some(BenchCommand::Compare(_))));

        let b = bench(&["--trace", "t.jsonl"]);
        let cfg = b.run.config().unwrap();
        assert_eq!(cfg.load, LoadConfig::Trace { speeds: vec![1.0] });
        assert!(matches!(cfg.workload, WorkloadConfig::Trace { block_tokens: 512, .. }));
    }

    #[test]
    fn conflicting_or_bad_options_are_refused() {
        let parse = |a: &[&str]| {
            let mut argv = vec!["kvx", "bench"];
            argv.extend_from_slice(a);
            Cli::try_parse_from(argv)
        };
        assert!(parse(&["--concurrency", "2", "--request-rate", "3"]).is_err());
        assert!(parse(&["--trace-speed", "2"]).is_err(), "needs --trace");
        assert!(parse(&["--input-tokens", "normal:5"]).is_err());
        assert!(parse(&["compare", "a.json"]).is_err());
        assert!(bench(&["--extra-body", "[1]"]).run.config().is_err());
        assert!(bench(&["--header", "nocolon"]).run.config().is_err());
        assert!(bench(&["--workload", "prompts"]).run.config().is_err());
        for other in [["--concurrency", "4"], ["--request-rate", "2"]] {
            let b = bench(&[&["--workload", "mixed"][..], &other[..]].concat());
            assert!(b.run.config().is_err(), "{other:?} with the mixed workload");
        }
        assert!(parse(&["--workload", "mixed", "--burst-input-tokens", "x"]).is_err());
    }

    #[test]
    fn mixed_workload_parses_with_its_defaults_and_flags() {
        let cfg = bench(&["--workload", "mixed"]).run.config().unwrap();
        let want = WorkloadConfig::Mixed {
            streams: 8,
            input: LengthDist::fixed(128),
            output: LengthDist::fixed(64),
            burst_input: LengthDist::fixed(1500),
            burst_output: LengthDist::fixed(16),
            burst_interval_s: 4.0,
        };
        assert_eq!((&cfg.workload, &cfg.load), (&want, &LoadConfig::Mixed));
        assert_eq!((cfg.duration, cfg.max_requests), (Some(Duration::from_secs(60)), None));

        let b = bench(&[
            "--workload",
            "mixed",
            "--streams",
            "4",
            "--input-tokens",
            "64",
            "--output-tokens",
            "384",
            "--burst-interval",
            "0.5",
            "--burst-input-tokens",
            "uniform:1000,2000",
            "--burst-output-tokens",
            "8",
            "--duration",
            "120",
            "--warmup",
            "3",
        ]);
        let cfg = b.run.config().unwrap();
        let want = WorkloadConfig::Mixed {
            streams: 4,
            input: LengthDist::fixed(64),
            output: LengthDist::fixed(384),
            burst_input: LengthDist::Uniform { min: 1000, max: 2000 },
            burst_output: LengthDist::fixed(8),
            burst_interval_s: 0.5,
        };
        assert_eq!(cfg.workload, want);
        assert_eq!((cfg.duration, cfg.warmup_requests), (Some(Duration::from_secs(120)), 3));
        // A request bound alone leaves the duration open.
        let cfg = bench(&["--workload", "mixed", "--requests", "50"]).run.config().unwrap();
        assert_eq!((cfg.duration, cfg.max_requests), (None, Some(50)));
    }
}
