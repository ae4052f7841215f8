//! Greedy generation in `--exact` arithmetic matches llama.cpp token for token
//! (tests/oracle/parity.py): at least 9 of 10 prompts identical, any divergence only where
//! llama.cpp's top two logits are within 1e-3, and kvx's chat prompt ids equal llama.cpp's
//! tokenization of the transformers-style rendering. `KVX_PARITY_PROMPTS` points the test at another prompt file.

use std::process::Command;

use kvx_e2e::{kvx_bin, oracle_python, root, test_model};

#[test]
fn greedy_generation_matches_llama_cpp() {
    let prompts = std::env::var_os("KVX_PARITY_PROMPTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root().join("tests/data/parity_prompts.txt"));
    let out = Command::new(oracle_python())
        .arg(root().join("tests/oracle/parity.py"))
        .arg("--kvx")
        .arg(kvx_bin())
        .arg("--model")
        .arg(test_model())
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-tokens", "32", "--tie", "1e-3", "--min-match", "0.9"])
        .output()
        .expect("running parity.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or("{}")).expect("summary line");
    assert_eq!(summary["pass"], true, "parity failed: {summary}");
    assert!(summary["prompts"].as_u64().unwrap_or(0) >= 10, "too few prompts: {summary}");
}
