//! End-to-end tests of the load generator against the OpenAI fixture server over real sockets.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use kvx_bench::{
    Api, BenchConfig, EndpointConfig, LengthDist, LoadConfig, Report, RequestClass, TokenizerSpec,
    WorkloadConfig, compare_table, read_trace, render_html, summary_table,
};
use support::openai_fixture::{Fixture, FixtureConfig};

fn config(url: &str) -> BenchConfig {
    BenchConfig {
        endpoint: EndpointConfig { url: url.to_string(), ..Default::default() },
        tokenizer: TokenizerSpec::Words,
        keep_request_records: true,
        ..Default::default()
    }
}

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// Expected prefix-cache hits per trace request, from the trace alone: position p of a prompt
/// is (hash id, offset) when p falls in a hashed block and unique otherwise; a request hits the
/// longest prefix it shares with any earlier request, in whole server blocks.
fn expected_cached(trace: &[kvx_bench::TraceEntry], block: u32, server_block: usize) -> Vec<usize> {
    let seqs: Vec<Vec<(i64, u32)>> = trace
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (0..e.input_length)
                .map(|p| match e.hash_ids.get((p / block) as usize) {
                    Some(&h) => (h as i64, p % block),
                    None => (-(i as i64) - 1, p),
                })
                .collect()
        })
        .collect();
    (0..seqs.len())
        .map(|i| {
            let lcp = (0..i)
                .map(|j| seqs[i].iter().zip(&seqs[j]).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0);
            lcp / server_block * server_block
        })
        .collect()
}

#[test]
fn trace_replay_reproduces_the_block_sharing_the_trace_encodes() {
    let fixture = Fixture::start(FixtureConfig { block_size: 16, ..Default::default() });
    let path = data("mooncake_small.jsonl");
    let trace = read_trace(&path).unwrap();
    let mut cfg = config(&fixture.url());
    cfg.workload = WorkloadConfig::Trace { path, block_tokens: 512 };
    cfg.load = LoadConfig::Trace { speeds: vec![1.0] };
    cfg.seed = 3;
    let report = kvx_bench::run(&cfg).unwrap();
    let run = &report.runs[0];
    assert_eq!(run.requests.completed, trace.len() as u64, "{:?}", run.errors);

    // The fixture saw the requests in trace order with the trace's exact prompt lengths.
    let seen = fixture.log();
    let lengths: Vec<usize> = seen.iter().map(|s| s.prompt_tokens).collect();
    let want_lengths: Vec<usize> = trace.iter().map(|e| e.input_length as usize).collect();
    assert_eq!(lengths, want_lengths, "arrival order or prompt lengths differ from the trace");

    // And its prefix cache reported exactly the sharing the hash ids encode.
    let want = expected_cached(&trace, 512, 16);
    assert!(want.iter().filter(|&&c| c > 0).count() >= 8, "the trace exercises sharing");
    let mut records = run.request_records.clone();
    records.sort_by_key(|r| r.conversation);
    let got: Vec<usize> = records.iter().map(|r| r.cached_tokens.unwrap() as usize).collect();
    assert_eq!(got, want);
    let total: usize = want.iter().sum();
    assert_eq!(run.tokens.cached_total, Some(total as u64));
    assert!(run.tokens.cache_hit_ratio.unwrap() > 0.3);
}

#[test]
fn closed_loop_measures_every_request_and_token() {
    let fixture = Fixture::start(FixtureConfig {
        ttft: Duration::from_millis(5),
        itl: Duration::from_millis(2),
        ..Default::default()
    });
    let mut cfg = config(&fixture.url());
    cfg.workload = WorkloadConfig::Synthetic {
        input: LengthDist::fixed(32),
        output: LengthDist::fixed(6),
        prompts: 10,
    };
    cfg.load = LoadConfig::Closed { concurrency: vec![3] };
    cfg.max_requests = Some(24);
    cfg.warmup_requests = 2;
    let report = kvx_bench::run(&cfg).unwrap();
    assert_eq!(fixture.requests(), 26, "24 measured + 2 warm-up");
    assert_eq!(report.target.model, "fixture-model", "model discovered from /v1/models");
    let r = &report.runs[0];
    assert_eq!((r.requests.completed, r.requests.failed), (24, 0));
    assert_eq!(r.tokens.output_total, 24 * 6);
    assert_eq!(r.tokens.input_total, 24 * 32);
    assert_eq!(r.tokens.server_prompt_total, Some(24 * 32));
    let lat = r.latency_ms;
    assert_eq!(lat.ttft.unwrap().count, 24);
    assert_eq!(lat.itl.unwrap().count, 24 * 5, "every gap between tokens");
    assert_eq!(lat.tpot.unwrap().count, 24);
    // Lower bounds only: the fixture sleeps at least this long.
    assert!(lat.ttft.unwrap().min >= 4.9, "{:?}", lat.ttft);
    assert!(lat.itl.unwrap().p50 >= 1.9, "{:?}", lat.itl);
    assert!(lat.e2e.unwrap().min >= 4.9 + 5.0 * 1.9);
    assert!(r.client.peak_in_flight <= 3);
    assert!(r.throughput.output_tokens_per_s > 0.0);
    assert_eq!(r.cdf_ms.ttft.last().unwrap()[1], 1.0);
    let table = summary_table(&report);
    assert!(table.contains("TTFT (ms)") && table.contains("c=3"), "{table}");
}

#[test]
fn multi_turn_history_grows_turn_by_turn() {
    let fixture = Fixture::start(FixtureConfig { block_size: 4, ..Default::default() });
    let mut cfg = config(&fixture.url());
    cfg.workload = WorkloadConfig::MultiTurn {
        sessions: 3,
        turns: LengthDist::fixed(3),
        user: LengthDist::fixed(10),
        output: LengthDist::fixed(4),
        think_time_ms: 1,
    };
    cfg.load = LoadConfig::Closed { concurrency: vec![2] };
    let report = kvx_bench::run(&cfg).unwrap();
    let r = &report.runs[0];
    assert_eq!(r.requests.completed, 9);
    for rec in &r.request_records {
        let k = u64::from(rec.turn);
        // History: every earlier user message (10 words) and answer (4 words) plus the new one.
        assert_eq!(rec.server_prompt_tokens, Some(10 * (k + 1) + 4 * k), "{rec:?}");
        assert_eq!(u64::from(rec.input_tokens), 10 * (k + 1) + 4 * k);
        // Each turn's prompt extends the previous one, so the server finds it cached.
        if k > 0 {
            assert!(rec.cached_tokens.unwrap() >= 10 * k + 4 * (k - 1) - 3, "{rec:?}");
        }
    }
}

#[test]
fn poisson_arrivals_are_deterministic_for_a_seed() {
    let fixture = Fixture::start(FixtureConfig::default());
    let run = |seed| {
        let mut cfg = config(&fixture.url());
        cfg.workload = WorkloadConfig::Synthetic {
            input: "uniform:8,24".parse().unwrap(),
            output: "normal:4,1".parse().unwrap(),
            prompts: 50,
        };
        cfg.load = LoadConfig::Poisson { rates: vec![400.0] };
        cfg.duration = Some(Duration::from_millis(250));
        cfg.seed = seed;
        kvx_bench::run(&cfg).unwrap()
    };
    let (a, b) = (run(11), run(11));
    let (ra, rb) = (&a.runs[0], &b.runs[0]);
    assert_eq!(ra.requests.sent, rb.requests.sent);
    assert_eq!(ra.tokens.input_total, rb.tokens.input_total);
    assert_eq!(ra.tokens.output_total, rb.tokens.output_total);
    assert!(ra.requests.sent > 40 && ra.requests.sent < 200, "{}", ra.requests.sent);
    assert_eq!(ra.requests.failed, 0);
    assert!(ra.client.schedule_lag_ms.is_some());
}

#[test]
fn closed_loop_streams_keep_their_connections() {
    // Each of the 4 streams sends its requests on one kept-alive connection: the server sees at
    // most 4 connections for 40 requests (and one for the model list), and nothing is resent.
    let fixture = Fixture::start(FixtureConfig::default());
    let mut cfg = config(&fixture.url());
    cfg.max_requests = Some(40);
    cfg.load = LoadConfig::Closed { concurrency: vec![4] };
    cfg.workload = WorkloadConfig::Synthetic {
        input: LengthDist::fixed(8),
        output: LengthDist::fixed(4),
        prompts: 5,
    };
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!((r.requests.completed, r.requests.failed), (40, 0), "{:?}", r.errors);
    assert_eq!(r.client.resent, 0);
    let n = fixture.connections();
    assert!((2..=4 + 1).contains(&n), "{n} connections: at most one per stream");
}

#[test]
fn a_request_cut_off_mid_stream_gives_up_its_connection() {
    // Every response streams for 2 s and the timeout is 1 s: each request times out with its
    // stream half read, is not sent again, and the next one goes out on a new connection (the
    // old one cannot carry another request before the rest of that stream).
    let fixture =
        Fixture::start(FixtureConfig { itl: Duration::from_millis(500), ..Default::default() });
    let mut cfg = config(&fixture.url());
    cfg.max_requests = Some(4);
    cfg.endpoint.model = Some("m".into());
    cfg.request_timeout = Duration::from_secs(1);
    cfg.workload = WorkloadConfig::Synthetic {
        input: LengthDist::fixed(8),
        output: LengthDist::fixed(5),
        prompts: 5,
    };
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!(r.errors.get("timeout"), Some(&4), "{:?}", r.errors);
    assert_eq!((fixture.requests(), r.client.resent), (4, 0));
    assert_eq!(fixture.connections(), 1 + 4, "the model list's, then one a request");
}

#[test]
fn a_request_on_a_connection_the_server_closes_is_sent_again() {
    // Each connection's third request is dropped with the connection, unanswered (a server
    // capping kept-alive requests), shut down or reset (a socket closed with a request unread
    // is reset): each is sent once more on a fresh connection and completes.
    for reset in [false, true] {
        let fixture =
            Fixture::start(FixtureConfig { close_at: Some(3), reset, ..Default::default() });
        let mut cfg = config(&fixture.url());
        cfg.max_requests = Some(20);
        cfg.load = LoadConfig::Closed { concurrency: vec![4] };
        cfg.workload = WorkloadConfig::Synthetic {
            input: LengthDist::fixed(8),
            output: LengthDist::fixed(2),
            prompts: 5,
        };
        let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
        let done = (r.requests.completed, r.requests.failed);
        assert_eq!(done, (20, 0), "reset {reset}: {:?}", r.errors);
        assert!(r.client.resent > 0, "reset {reset}: the dropped requests were sent again");
        assert_eq!(fixture.requests(), 20 + r.client.resent, "reset {reset}");
        // A stream's connection is replaced only when the server drops it: besides the model
        // list's, one connection for each resend and the one each stream (1 to 4) still holds.
        let (n, resent) = (fixture.connections(), r.client.resent);
        let want = 1 + resent + 1..=1 + resent + 4;
        assert!(want.contains(&n), "reset {reset}: {n} connections, {resent} resent");
    }

    // Once only: a server that drops every request still fails each one, as `body`.
    let fixture = Fixture::start(FixtureConfig { close_at: Some(1), ..Default::default() });
    let mut cfg = config(&fixture.url());
    cfg.max_requests = Some(3);
    cfg.endpoint.model = Some("m".into());
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!(r.errors.get("body"), Some(&3));
    assert_eq!((fixture.requests(), r.client.resent), (6, 3));
}

#[test]
fn failures_are_counted_by_class() {
    let fixture = Fixture::start(FixtureConfig { fail_every: Some(4), ..Default::default() });
    let mut cfg = config(&fixture.url());
    cfg.max_requests = Some(20);
    cfg.workload = WorkloadConfig::Synthetic {
        input: LengthDist::fixed(8),
        output: LengthDist::fixed(2),
        prompts: 5,
    };
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!(r.requests.completed + r.requests.failed, 20);
    assert_eq!(r.errors.get("http_503"), Some(&r.requests.failed));
    assert!(r.requests.failed >= 4);

    // Nothing listens here: every request fails to connect.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cfg = config(&format!("http://127.0.0.1:{port}"));
    cfg.endpoint.model = Some("m".into());
    cfg.max_requests = Some(3);
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!(r.errors.get("connect"), Some(&3));
}

#[test]
fn a_closed_loop_stream_waits_as_long_as_a_shedding_server_asks() {
    // Every request is shed with `Retry-After: 5`: each of 2 streams sends once and then waits,
    // and the level's end at 2.5 s cuts the wait short. A stream that resent at once would send
    // thousands; one whose wait outlived the level would end the run after 5 s.
    let fixture = Fixture::start(FixtureConfig { shed_retry_after: Some(5), ..Default::default() });
    let mut cfg = config(&fixture.url());
    cfg.endpoint.model = Some("m".into());
    cfg.load = LoadConfig::Closed { concurrency: vec![2] };
    cfg.duration = Some(Duration::from_millis(2500));
    let t0 = std::time::Instant::now();
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    let took = t0.elapsed();
    assert_eq!(r.requests.completed, 0);
    assert_eq!(r.errors.get("shed_429"), Some(&r.requests.failed));
    assert_eq!(fixture.requests(), 2);
    assert!(took < Duration::from_millis(4500), "{took:?}");
}

#[test]
fn completions_api_without_streaming_counts_with_the_tokenizer() {
    let fixture = Fixture::start(FixtureConfig::default());
    let mut cfg = config(&fixture.url());
    cfg.endpoint.api = Api::Completions;
    cfg.endpoint.stream = false;
    cfg.workload = WorkloadConfig::Synthetic {
        input: LengthDist::fixed(12),
        output: LengthDist::fixed(5),
        prompts: 4,
    };
    cfg.max_requests = Some(8);
    let r = kvx_bench::run(&cfg).unwrap().runs.remove(0);
    assert_eq!(r.requests.completed, 8, "{:?}", r.errors);
    assert_eq!(r.tokens.output_total, 40);
    assert!(r.latency_ms.ttft.is_none() && r.latency_ms.e2e.is_some());
}

#[test]
fn prompts_file_and_sweep_write_a_report_that_compares() {
    let fixture =
        Fixture::start(FixtureConfig { itl: Duration::from_micros(200), ..Default::default() });
    let dir = std::env::temp_dir().join(format!("kvx-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"one two three\", \"output_length\": 3}\nfour five\n")
        .unwrap();
    let mut cfg = config(&fixture.url());
    cfg.workload = WorkloadConfig::PromptsFile { path: prompts, output: LengthDist::fixed(2) };
    cfg.load = LoadConfig::Closed { concurrency: vec![1, 2] };
    cfg.max_requests = Some(6);
    cfg.keep_request_records = false;
    let report = kvx_bench::run(&cfg).unwrap();
    assert_eq!(report.runs.len(), 2);
    assert_eq!(report.runs[1].tokens.input_total, 3 * (3 + 2));
    assert_eq!(report.runs[1].tokens.output_total, 3 * (3 + 2));
    let a = dir.join("a.json");
    report.write_json(&a).unwrap();
    let back = Report::read_json(&a).unwrap();
    assert!(back == report, "the report survives a JSON round trip");
    let table = compare_table(&report, "a", &back, "b");
    assert!(table.contains("TTFT p50 (ms)") && table.contains("1.000"), "{table}");
    std::fs::write(dir.join("bad.json"), "{\"schema\": \"other/9\"}").unwrap();
    assert!(Report::read_json(&dir.join("bad.json")).is_err());
}

#[test]
fn mixed_workload_reports_streams_and_bursts_apart() {
    let fixture = Fixture::start(FixtureConfig {
        ttft: Duration::from_millis(2),
        per_uncached_token: Duration::from_micros(20),
        itl: Duration::from_millis(2),
        ..Default::default()
    });
    let mut cfg = config(&fixture.url());
    cfg.workload = WorkloadConfig::Mixed {
        streams: 2,
        input: LengthDist::fixed(16),
        output: LengthDist::fixed(20),
        burst_input: LengthDist::fixed(300),
        burst_output: LengthDist::fixed(4),
        burst_interval_s: 0.3,
    };
    cfg.load = LoadConfig::Mixed;
    cfg.duration = Some(Duration::from_secs(2));
    cfg.warmup_requests = 2;
    let report = kvx_bench::run(&cfg).unwrap();
    assert_eq!((report.workload.kind.as_str(), report.load.mode.as_str()), ("mixed", "mixed"));
    let r = &report.runs[0];
    assert_eq!(r.level.label, "2 streams + bursts");
    assert_eq!(r.requests.failed, 0, "{:?}", r.errors);
    assert_eq!(fixture.requests(), r.requests.sent + 2, "measured + 2 warm-up");

    // Both classes, with plausible counts: every burst due before the end (0.3 .. 1.8 s), and
    // each stream at least once; together they make the overall figures.
    let (s, b) = (&r.classes["stream"], &r.classes["burst"]);
    assert_eq!(r.classes.len(), 2);
    assert_eq!(b.requests.completed, 6);
    assert!(s.requests.completed >= 2, "{:?}", s.requests);
    assert_eq!(s.requests.completed + b.requests.completed, r.requests.completed);
    assert_eq!(s.tokens.output_total, s.requests.completed * 20);
    assert_eq!(b.tokens.output_total, 6 * 4);
    assert_eq!(s.tokens.output_total + b.tokens.output_total, r.tokens.output_total);
    assert_eq!(s.latency_ms.itl.unwrap().count, s.requests.completed * 19, "every gap");
    assert_eq!(b.latency_ms.itl.unwrap().count, 6 * 3);
    assert_eq!(b.latency_ms.ttft.unwrap().count, 6);
    assert!(s.throughput.output_tokens_per_s > 0.0 && b.throughput.output_tokens_per_s > 0.0);
    let sum = s.throughput.output_tokens_per_s + b.throughput.output_tokens_per_s;
    assert!((sum - r.throughput.output_tokens_per_s).abs() < 1e-6 * sum);

    // Each request has its class's lengths, and none found its prompt in the prefix cache.
    assert_eq!(r.request_records.len() as u64, r.requests.sent);
    for rec in &r.request_records {
        let (input, output) = match rec.class {
            Some(RequestClass::Stream) => (16, 20),
            Some(RequestClass::Burst) => (300, 4),
            None => panic!("a record without a class: {rec:?}"),
        };
        assert_eq!((rec.input_tokens, rec.output_tokens), (input, output), "{rec:?}");
        assert_eq!(rec.server_prompt_tokens, Some(u64::from(input)));
        assert_eq!(rec.cached_tokens, Some(0), "{rec:?}");
    }
    let mut bursts: Vec<u32> = r
        .request_records
        .iter()
        .filter(|x| x.class == Some(RequestClass::Burst))
        .map(|x| x.conversation)
        .collect();
    bursts.sort_unstable();
    assert_eq!(bursts, [0, 1, 2, 3, 4, 5]);
    let long = fixture.log().iter().filter(|x| x.prompt_tokens == 300).count();
    assert_eq!(long, 6, "the fixture saw the six bursts");

    // The renderings show the classes, and the JSON keeps them.
    let table = summary_table(&report);
    println!("{table}");
    for want in ["stream ", "burst ", "  TTFT (ms)", "  ITL (ms)", "2 streams + bursts"] {
        assert!(table.contains(want), "{want:?} missing from\n{table}");
    }
    let html = render_html(&report);
    assert!(html.contains("<table class=\"classes\">") && html.contains("<th>burst</th>"));
    let dir = std::env::temp_dir().join(format!("kvx-bench-mixed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mixed.json");
    report.write_json(&path).unwrap();
    let back = Report::read_json(&path).unwrap();
    assert!(back == report, "the classes survive a JSON round trip");
    let cmp = compare_table(&report, "a", &back, "b");
    assert!(cmp.contains("burst ITL p99 (ms)") && cmp.contains("stream TTFT p50 (ms)"), "{cmp}");
}
