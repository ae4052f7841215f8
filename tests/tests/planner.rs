//! The SLA planner end to end: `kvx profile` measures an engine (the mocker; the real model),
//! `kvx planner` reads a real `kvx frontend`'s /metrics and, through its local connector,
//! starts `kvx worker` processes of that engine; under load the decode pool grows, after it
//! the pool drains back to its minimum while a stream still runs, and no request fails.

use std::time::{Duration, Instant};

use kvx_e2e::kube::{FakeKube, Spawn};
use kvx_e2e::planes::{FAST_HEARTBEAT, Frontend, PlannerProc};
use kvx_e2e::serve::{Endpoint, http, metric_in};
use kvx_e2e::{kvx, kvx_ok, test_model};

fn decode_up(f: &Frontend) -> usize {
    let text = f.get("/metrics").text();
    let ups: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("kvx_worker_up{") && l.ends_with(" 1"))
        .filter_map(|l| l.split('"').nth(1).map(str::to_string))
        .collect();
    ups.iter()
        .filter(|w| {
            metric_in(&text, &format!("kvx_worker_role{{worker=\"{w}\",role=\"decode\"}}"))
                == Some(1.0)
        })
        .count()
}

/// Runs `kvx bench` closed-loop against `addr`; its JSON report.
fn bench(
    addr: &str,
    streams: &str,
    secs: &str,
    (isl, osl): (&str, &str),
    out: &std::path::Path,
) -> serde_json::Value {
    let model = test_model().to_string_lossy().into_owned();
    let url = format!("http://{addr}");
    let o = kvx(&[
        "bench",
        "--url",
        &url,
        "--api",
        "completions",
        "--concurrency",
        streams,
        "--duration",
        secs,
        "--input-tokens",
        isl,
        "--output-tokens",
        osl,
        "--ignore-eos",
        "--tokenizer",
        &model,
        "--quiet",
        "--json",
        &out.to_string_lossy(),
    ]);
    assert!(o.status.success(), "kvx bench failed: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    v["runs"][0].clone()
}

/// One scenario: what the engine is and how hard to push it.
struct Scenario<'a> {
    name: &'a str,
    /// `kvx profile` and `kvx worker` engine flags.
    engine: &'a [&'a str],
    /// The profile's sweep.
    sweep: [&'a str; 3],
    /// ITL target over the profile's ITL of one sequence at the shortest context.
    itl_over_one: f64,
    /// Heavy streams and seconds, the light stream's seconds; prompt and output tokens.
    heavy: (&'a str, &'a str),
    light_secs: &'a str,
    lengths: (&'a str, &'a str),
    /// Whether the planner sizes from the workers' step times alone (no profile).
    load_based: bool,
    /// Whether the workers are two Deployments behind a (stand-in) Kubernetes API server,
    /// rather than the planner's own processes.
    kube: bool,
}

/// The stand-in API server with `kvx-prefill` and `kvx-decode` Deployments of one replica in
/// namespace `kvx`, whose pods are `kvx worker --role R WORKER_ARGS` (logs in `logs`); the
/// planner's flags to scale them (a kubeconfig with the server's token).
fn kube_fleet(worker_args: &str, logs: &std::path::Path) -> (FakeKube, Vec<String>) {
    std::fs::create_dir_all(logs).unwrap();
    let (args, logs2) = (worker_args.to_string(), logs.to_path_buf());
    let spawn: Spawn = Box::new(move |name, i| {
        let role = name.trim_start_matches("kvx-");
        let log = std::fs::File::create(logs2.join(format!("{name}-{i}.log"))).unwrap();
        std::process::Command::new(kvx_e2e::kvx_bin())
            .args(["worker", "--role", role])
            .args(args.split_whitespace())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    });
    let kube = FakeKube::start("planner-token-7", spawn);
    kube.add("deployments", "kvx", "kvx-prefill", 1, false);
    kube.add("deployments", "kvx", "kvx-decode", 1, false);
    let kubeconfig = logs.join("kubeconfig");
    std::fs::write(&kubeconfig, kube.kubeconfig("kvx")).unwrap();
    let flags = [
        "--connector",
        "kubernetes",
        "--kubeconfig",
        &kubeconfig.to_string_lossy(),
        "--k8s-prefill",
        "kvx-prefill",
        "--k8s-decode",
        "kvx-decode",
    ]
    .map(str::to_string)
    .to_vec();
    (kube, flags)
}

/// Profiles the engine, starts a frontend and a planner (local connector, 1 to 2 prefill and
/// 1 to 3 decode workers), pushes the heavy load until the decode pool has grown, then one
/// stream while it drains back to one worker; no request of either fails.
fn scales_up_and_back(sc: &Scenario<'_>) {
    // One scenario at a time: each sizes pools from latencies the other would disturb.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("kvx-planner-{}-{}", sc.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("profile.json");
    let p = profile.to_string_lossy().into_owned();
    let mut args = vec!["profile", "--out", &p, "--reps", "1"];
    args.extend_from_slice(sc.engine);
    for (flag, v) in ["--max-isl", "--max-batch", "--max-context"].iter().zip(sc.sweep) {
        args.extend_from_slice(&[flag, v]);
    }
    kvx_ok(&args);
    let prof: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    let one = prof["decode"][0]["itl_ms"].as_f64().unwrap();
    let itl = format!("{:.2}", one * sc.itl_over_one);
    let f = Frontend::start(&FAST_HEARTBEAT);
    let frontend = format!("http://{}", f.addr);
    let worker_args = format!(
        "--frontend {} {} --heartbeat-ms 200 --heartbeat-timeout-ms 1000 --shutdown-grace 20",
        f.workers,
        sc.engine.join(" ")
    );
    let logs = dir.join("logs").to_string_lossy().into_owned();
    let sizing: &[&str] = if sc.load_based { &[] } else { &["--profile", &p] };
    let local = ["--connector", "local", "--worker-args", &worker_args, "--worker-logs", &logs];
    let (kube, kube_flags) = if sc.kube {
        let (k, f) = kube_fleet(&worker_args, &dir.join("logs"));
        // Two writes refused as if another writer had changed the Deployment first.
        k.inject_conflicts(2);
        (Some(k), f)
    } else {
        (None, Vec::new())
    };
    let kube_flags: Vec<&str> = kube_flags.iter().map(String::as_str).collect();
    let connector: &[&str] = if sc.kube { &kube_flags } else { &local };
    let mut planner = PlannerProc::start(
        &[
            &["--frontend", &frontend],
            sizing,
            connector,
            &[
                "--planner-interval",
                "2",
                "--cooldown",
                "6",
                "--predictor",
                "constant",
                "--ttft",
                "5000",
                "--itl",
                &itl,
                "--max-decode",
                "3",
                "--max-prefill",
                "2",
            ],
        ]
        .concat(),
    );
    f.wait_workers(2);
    assert_eq!(decode_up(&f), 1);

    let heavy = bench(&f.addr, sc.heavy.0, sc.heavy.1, sc.lengths, &dir.join("heavy.json"));
    let decisions = planner.poll().to_vec();
    let most = decisions.iter().filter_map(|d| d["target"]["decode"].as_u64()).max();
    assert!(most >= Some(2), "the decode pool never grew (ITL target {itl} ms): {decisions:#?}");
    let grew = decisions.iter().find(|d| d["target"]["decode"].as_u64() >= Some(2)).unwrap();
    assert!(grew["reason"].as_str().unwrap().contains("decode 1→"), "{grew}");
    if sc.load_based {
        // Sized by the step-time fit: one more decode worker, no profile in sight.
        assert_eq!(grew["load"]["decode"]["step"], 1, "{grew}");
        assert!(grew["reason"].as_str().unwrap().contains("load: decode step"), "{grew}");
    }
    assert_eq!(heavy["errors"], serde_json::json!({}), "{heavy}");
    let end = Instant::now() + Duration::from_secs(60);
    while decode_up(&f) < 2 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(decode_up(&f) >= 2, "a second decode worker never came up: {:#?}", planner.poll());

    // One stream while the pool shrinks back (after the cooldown): the drained workers finish
    // what they run, so its requests complete.
    let light = bench(&f.addr, "1", sc.light_secs, sc.lengths, &dir.join("light.json"));
    assert_eq!(light["errors"], serde_json::json!({}), "{light}");
    assert!(light["requests"]["completed"].as_u64() > Some(3), "{light}");
    // Settled: one decode worker up and the planner's latest decision targeting one (on a
    // loaded machine a decision taken as the heavy phase ended can still move the pool back up
    // for a while; it has to come down again within the minute).
    let end = Instant::now() + Duration::from_secs(60);
    let settled = |planner: &mut PlannerProc| {
        decode_up(&f) == 1 && planner.poll().last().is_some_and(|d| d["target"]["decode"] == 1)
    };
    while !settled(&mut planner) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(decode_up(&f), 1, "decisions: {:#?}", planner.poll());
    let last = planner.poll().last().cloned().unwrap();
    assert_eq!(last["target"]["decode"], 1, "{last}");
    let m = http(&planner.metrics, "GET", "/metrics", &[], None).text();
    assert_eq!(metric_in(&m, "kvx_planner_desired_replicas{role=\"decode\"}"), Some(1.0), "{m}");
    assert!(metric_in(&m, "kvx_planner_decisions_total").unwrap() >= 10.0, "{m}");

    if let Some(k) = &kube {
        // Every change went through the scale subresource: up, then down to one.
        let decode: Vec<i32> =
            k.writes().into_iter().filter(|w| w.0 == "kvx-decode").map(|w| w.1).collect();
        assert!(decode.iter().any(|&n| n >= 2) && decode.last() == Some(&1), "{decode:?}");
        let (conflicts, unauthorized) = k.refusals();
        assert!(conflicts >= 2, "the injected conflicts were met and written again");
        assert_eq!(unauthorized, 0, "every request carried the kubeconfig's token");
        assert_eq!(k.replicas("deployments", "kvx", "kvx-decode"), Some((1, 1)));
    }

    // Stopping the planner stops its workers (local); the Deployments' pods stay until the
    // cluster goes.
    assert!(planner.terminate(Duration::from_secs(30)).is_some_and(|s| s.success()));
    drop(kube);
    f.wait_workers(0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mock workers: an ITL target just above one mock sequence's step, so one decode worker
/// cannot hold 16 streams within it.
#[test]
fn the_planner_grows_the_decode_pool_under_load_and_drains_it_after() {
    scales_up_and_back(&Scenario {
        name: "mocker",
        engine: &["--engine", "mocker"],
        sweep: ["1024", "16", "1024"],
        itl_over_one: 1.03,
        heavy: ("16", "14"),
        light_secs: "16",
        lengths: ("256", "64"),
        load_based: false,
        kube: false,
    });
}

/// Without a profile (load-based sizing): mock workers with a small KV pool, whose decode
/// step slows as it fills; an ITL target 2.5 × one sequence's step, which 16 streams on one
/// worker miss and one stream meets with room to spare.
#[test]
fn without_a_profile_the_decode_pool_follows_the_workers_step_times() {
    scales_up_and_back(&load_based("load", false));
}

/// Load-based sizing over mock workers with a 512-block KV cache (see above).
fn load_based(name: &str, kube: bool) -> Scenario<'_> {
    Scenario {
        name,
        engine: &["--engine", "mocker", "--mocker-blocks", "512"],
        sweep: ["512", "4", "512"],
        itl_over_one: 2.5,
        heavy: ("16", "14"),
        light_secs: "16",
        lengths: ("256", "64"),
        load_based: true,
        kube,
    }
}

/// The Kubernetes connector: the pools are Deployments behind a loopback stand-in for the API
/// server (scale subresource, resourceVersions, a bearer token; its controller runs a `kvx
/// worker` per replica and SIGTERMs the ones removed). Sized from step times, as above.
#[test]
fn the_kubernetes_connector_scales_deployments_through_the_api_server() {
    scales_up_and_back(&load_based("kube", true));
}

/// A Deployment that is not there, or that the credentials may not scale, stops the planner
/// at its start with the reason.
#[test]
fn the_kubernetes_connector_names_what_it_cannot_reach() {
    let dir = std::env::temp_dir().join(format!("kvx-planner-kube-err-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spawn: Spawn = Box::new(|_, _| panic!("no pods in this test"));
    let kube = FakeKube::start("t0ken", spawn);
    kube.add("deployments", "kvx", "kvx-prefill", 0, false);
    kube.add("deployments", "kvx", "kvx-locked", 0, true);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("kubeconfig");
    std::fs::write(&cfg, kube.kubeconfig("kvx")).unwrap();
    let cfg = cfg.to_string_lossy().into_owned();
    let run = |decode: &str| {
        let o = kvx(&[
            "planner",
            "--frontend",
            "http://127.0.0.1:9",
            "--connector",
            "kubernetes",
            "--kubeconfig",
            &cfg,
            "--k8s-prefill",
            "kvx-prefill",
            "--k8s-decode",
            decode,
        ]);
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let missing = run("kvx-decode");
    assert!(missing.contains("deployment kvx/kvx-decode not found"), "{missing}");
    let locked = run("kvx-locked");
    assert!(locked.contains("deployment kvx/kvx-locked: forbidden"), "{locked}");
    // A wrong token: 401, named.
    std::fs::write(&cfg, kube.kubeconfig("kvx").replace("t0ken", "wrong")).unwrap();
    let denied = run("kvx-prefill");
    assert!(denied.contains("Unauthorized"), "{denied}");
    assert!(kube.refusals().1 >= 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A frontend whose /metrics needs its admin key: the planner reads it with `--admin-key`
/// and decides; without the key every read is refused and nothing is decided.
#[test]
fn the_planner_reads_metrics_behind_an_admin_key() {
    let f = Frontend::start(&["--admin-key", "adm-1"]);
    let dir = std::env::temp_dir().join(format!("kvx-planner-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let (decision, ack) = (file("decision.json"), file("ack.json"));
    let frontend = format!("http://{}", f.addr);
    let planner = |key: &[&str]| {
        let mut a = vec![
            "--frontend",
            &frontend,
            "--connector",
            "virtual",
            "--decision-file",
            &decision,
            "--ack-file",
            &ack,
            "--planner-interval",
            "0.3",
        ];
        a.extend_from_slice(key);
        PlannerProc::start(&a)
    };
    let mut without = planner(&[]);
    let mut with = planner(&["--admin-key", "adm-1"]);
    let end = Instant::now() + Duration::from_secs(20);
    while with.poll().is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!with.poll().is_empty(), "no decision with the admin key");
    assert!(without.poll().is_empty(), "a decision without the key: {:?}", without.poll());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real engine on the default model: decode workers go from one to two under four
/// streams whose batch one worker cannot hold within an ITL target 20% above one sequence's
/// step, and back to one under a single stream; no request fails across either change.
#[test]
fn the_planner_scales_real_decode_workers_from_one_to_two_and_back() {
    let model = test_model().to_string_lossy().into_owned();
    scales_up_and_back(&Scenario {
        name: "model",
        engine: &["--engine", "model", "--model", &model],
        sweep: ["256", "8", "256"],
        itl_over_one: 1.2,
        heavy: ("4", "20"),
        light_secs: "20",
        lengths: ("96", "32"),
        load_based: false,
        kube: false,
    });
}

/// `kvx configure --profile` over a mock worker's profile writes settings that `kvx serve`
/// runs as they stand (the shards of the chosen layout, the mocker's blocks and speed), and
/// the served layout answers.
#[test]
fn configure_writes_a_layout_that_serve_runs() {
    let dir = std::env::temp_dir().join(format!("kvx-configure-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("mock.json").to_string_lossy().into_owned();
    kvx_ok(&[
        "profile",
        "--engine",
        "mocker",
        "--out",
        &p,
        "--max-isl",
        "512",
        "--max-batch",
        "8",
        "--max-context",
        "512",
        "--reps",
        "1",
        "--speedup-ratio",
        "10",
        "--mocker-blocks",
        "256",
    ]);
    let env = dir.join("kvx.env").to_string_lossy().into_owned();
    let json = dir.join("layouts.json").to_string_lossy().into_owned();
    let home = std::env::var("KVX_HOME").unwrap_or_else(|_| dir.to_string_lossy().into_owned());
    let out = kvx(&[
        "configure",
        "--profile",
        &p,
        "--isl",
        "256",
        "--osl",
        "32",
        "--ttft",
        "500",
        "--itl",
        "50",
        "--cores",
        "4",
        "--home-dir",
        &home,
        "--kv-disk-dir",
        "none",
        "--no-kv-host",
        "--listen-port",
        "0",
        "--out",
        &env,
        "--json",
        &json,
    ]);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    assert!(report.contains("Pareto front") && report.contains("Best: "), "{report}");
    let layouts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(layouts["points"].as_array().unwrap().len() > 10, "{layouts}");
    let text = std::fs::read_to_string(&env).unwrap();
    let vars: Vec<(String, String)> = text
        .lines()
        .filter(|l| l.starts_with("KVX_"))
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.into(), v.trim_matches('\'').into())))
        .collect();
    let get = |k: &str| vars.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    assert_eq!(get("KVX_ENGINE"), Some("mocker"), "{text}");
    assert_eq!(get("KVX_SPEEDUP_RATIO"), Some("10"), "{text}");
    assert_eq!(get("KVX_MOCKER_BLOCKS"), Some("256"), "{text}");
    let roles = get("KVX_PREFILL_SHARDS").is_some() && get("KVX_DECODE_SHARDS").is_some();
    assert!(roles != get("KVX_SHARDS").is_some(), "one layout's shards: {text}");
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let served = kvx_e2e::serve::Served::start_env(&["--mocker-vocab", "49152"], &env);
    let body = r#"{"prompt": "Hello there", "max_tokens": 8, "ignore_eos": true}"#;
    let r = http(&served.addr, "POST", "/v1/completions", &[], Some(body.as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 8, "{}", r.text());
    let _ = std::fs::remove_dir_all(&dir);
}
