//! The `kvx` command line: tokenize against llama.cpp, generate's JSON shape and errors,
//! the model store commands, `kvx bench engine`'s report, `kvx bench xfer` on every backend.

use std::io::Write;
use std::process::{Command, Stdio};

use kvx_e2e::{kvx, kvx_ok, oracle_python, root, test_model};

fn oracle_tokenize(text: &str) -> Vec<u32> {
    let mut child = Command::new(oracle_python())
        .arg(root().join("tests/oracle/oracle.py"))
        .args(["tokenize", "--model"])
        .arg(test_model())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("oracle");
    let req = serde_json::json!({"text": text, "add_special": true, "parse_special": true});
    child.stdin.take().expect("stdin").write_all(format!("{req}\n").as_bytes()).expect("write");
    let out = child.wait_with_output().expect("oracle output");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("oracle json");
    serde_json::from_value(v["ids"].clone()).expect("ids")
}

#[test]
fn tokenize_matches_llama_cpp() {
    let model = test_model();
    let model = model.to_str().expect("utf-8 path");
    for text in [
        "Hello world! How are you?",
        "  leading spaces and\ttabs\n\nnewlines  ",
        "fn main() { println!(\"{}\", 1 + 2); }",
        "Emoji 🧑‍🚀 and CJK 漢字, accents: café, naïve.",
        "<|im_start|>user\nhi<|im_end|>\n",
        "Numbers 1234567890 and 3.14159",
    ] {
        let ours: Vec<u32> =
            serde_json::from_str(&kvx_ok(&["tokenize", "--model", model, "--text", text]))
                .expect("json array");
        assert_eq!(ours, oracle_tokenize(text), "text {text:?}");
    }
}

#[test]
fn generate_prints_the_documented_json() {
    let model = test_model();
    let out = kvx_ok(&[
        "generate",
        "--model",
        model.to_str().expect("path"),
        "--chat",
        "--prompt",
        "Say hi.",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let prompt = v["prompt_token_ids"].as_array().expect("prompt_token_ids");
    let tokens = v["token_ids"].as_array().expect("token_ids");
    assert!(prompt.len() > 10, "chat prompt too short: {v}");
    assert!(!tokens.is_empty() && tokens.len() <= 5, "{v}");
    assert!(v["text"].is_string());
    // Seeded sampling is reproducible.
    let args = |seed: &str| {
        kvx_ok(&[
            "generate",
            "--model",
            model.to_str().expect("path"),
            "--prompt",
            "Once upon a time",
            "--temperature",
            "1.0",
            "--seed",
            seed,
            "--max-tokens",
            "8",
            "--json",
        ])
    };
    let (a, b) = (args("7"), args("7"));
    let ids = |s: &str| {
        serde_json::from_str::<serde_json::Value>(s.trim()).expect("json")["token_ids"].clone()
    };
    assert_eq!(ids(&a), ids(&b));
}

#[test]
fn bad_input_gets_a_clear_error() {
    let out = kvx(&["generate", "--model", "no-such-model", "--prompt", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model"), "{out:?}");

    let model = test_model();
    let out = kvx(&[
        "generate",
        "--model",
        model.to_str().expect("path"),
        "--prompt",
        "x",
        "--max-tokens",
        "100000",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exceeds the context"), "{err}");

    let out = kvx(&[
        "generate",
        "--model",
        model.to_str().expect("path"),
        "--prompt",
        "x",
        "--top-p",
        "0",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("top_p"), "{out:?}");

    // A file that is not GGUF.
    let bogus = std::env::temp_dir().join(format!("kvx-not-gguf-{}", std::process::id()));
    std::fs::write(&bogus, b"definitely not a model").expect("write");
    let out = kvx(&["generate", "--model", bogus.to_str().expect("path"), "--prompt", "x"]);
    let _ = std::fs::remove_file(&bogus);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).to_lowercase().contains("gguf"), "{out:?}");
}

#[test]
fn model_store_commands() {
    let list = kvx_ok(&["model", "list"]);
    assert!(list.contains("smollm2-135m-instruct-q4_1"), "{list}");
    let path = kvx_ok(&["model", "path"]);
    assert!(std::path::Path::new(path.trim()).is_file(), "{path}");
    let verify = kvx_ok(&["model", "verify"]);
    assert!(verify.contains("ok"), "{verify}");
}

#[test]
fn bench_engine_reports_the_timed_runs_only() {
    let model = test_model();
    let run = |extra: &[&str]| {
        let mut args = vec!["bench", "engine", "--model", model.to_str().expect("path")];
        args.extend_from_slice(&["--threads", "1", "--pp", "32", "--tg", "8", "--reps", "2"]);
        args.extend_from_slice(extra);
        args.push("--json");
        let line = kvx_ok(&args);
        serde_json::from_str::<serde_json::Value>(line.trim()).expect("one JSON object")
    };
    for extra in [&[][..], &["--no-amx"][..]] {
        let v = run(extra);
        // Two timed runs of each test: the untimed warm-up is not among them.
        for (runs, median) in [("pp_runs", "pp_tok_s"), ("tg_runs", "tg_tok_s")] {
            let r = v[runs].as_array().expect(runs);
            assert_eq!(r.len(), 2, "{extra:?}: {v}");
            assert!(r.iter().all(|x| x.as_f64().is_some_and(|x| x > 0.0)), "{v}");
            assert!(v[median].as_f64().is_some_and(|x| x > 0.0), "{v}");
        }
        let kernels = v["kernels"].as_str().expect("kernels");
        // `--no-amx` never names tiles; without it they are named where the machine has them.
        if !extra.is_empty() {
            assert!(!kernels.contains("amx"), "{v}");
        }
        assert!(!v["arithmetic"].as_str().expect("arithmetic").is_empty(), "{v}");
    }
}

#[test]
fn bench_xfer_runs_every_backend_and_reports_json() {
    // In the target directory: O_DIRECT needs a real file system (tmpfs refuses it).
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let file = dir.join(format!("kvx-bench-xfer-e2e-{}", std::process::id()));
    let file_arg = file.to_str().expect("path").to_owned();
    let cases: [&[&str]; 4] = [
        &["--backend", "shm", "--copy-threads", "2"],
        &["--backend", "tcp", "--tcp-threads", "2"],
        &["--backend", "tcp", "--op", "read"],
        &["--backend", "file", "--file", &file_arg],
    ];
    for extra in cases {
        let mut args = vec![
            "bench",
            "xfer",
            "--json",
            "--secs",
            "0.3",
            "--warmup",
            "0",
            "--block-size",
            "64K",
            "--blocks",
            "64",
            "--batch",
            "4",
            "--inflight",
            "4",
        ];
        args.extend_from_slice(extra);
        let line = kvx_ok(&args);
        let v: serde_json::Value = serde_json::from_str(line.trim()).expect("one JSON object");
        assert!(v["transfers"].as_u64().expect("transfers") > 0, "{extra:?}: {v}");
        assert!(v["gbps"].as_f64().expect("gbps") > 0.0, "{extra:?}: {v}");
        assert_eq!(v["bytes"].as_u64(), Some(v["transfers"].as_u64().unwrap() * 4 * 65536));
        assert_eq!(v["backend"], extra[1], "{v}");
        if extra.contains(&"--copy-threads") {
            assert_eq!(v["copy_threads"], 2, "{v}");
        }
        if extra.contains(&"--tcp-threads") {
            assert_eq!(v["tcp_threads"], 2, "{v}");
        }
    }
    let _ = std::fs::remove_file(&file);
    // Shapes that cannot work are refused with a reason, not run.
    let out = kvx(&["bench", "xfer", "--batch", "8", "--blocks", "4", "--secs", "0.1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("blocks >= batch"), "{out:?}");
}
