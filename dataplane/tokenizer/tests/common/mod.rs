//! Shared helpers for the oracle tests: locating the model and the llama.cpp oracle, running
//! the oracle over JSON lines, and reading the test corpus.

#![allow(clippy::disallowed_methods)] // the model and tools come from `cargo xtask test`'s environment
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// The GGUF model under test (`KVX_TEST_MODEL`); fails with instructions when unset.
pub fn model_path() -> PathBuf {
    match std::env::var_os("KVX_TEST_MODEL") {
        Some(p) => p.into(),
        None => panic!(
            "KVX_TEST_MODEL is not set: export KVX_TEST_MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
             (the project's test set-up, `cargo xtask`, exports it)"
        ),
    }
}

/// The Python interpreter with llama-cpp-python (`KVX_ORACLE_PYTHON`); fails with
/// instructions when unset.
pub fn oracle_python() -> PathBuf {
    match std::env::var_os("KVX_ORACLE_PYTHON") {
        Some(p) => p.into(),
        None => panic!(
            "KVX_ORACLE_PYTHON is not set: export KVX_ORACLE_PYTHON=/path/to/python with \
             llama-cpp-python 0.3.36 installed (the project's test set-up, `cargo xtask`, exports it)"
        ),
    }
}

/// tests/oracle/oracle.py at the workspace root.
pub fn oracle_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/oracle/oracle.py")
}

/// Runs `oracle.py <args>` with one JSON line per request on stdin; returns one JSON value
/// per line of output.
pub fn run_oracle(args: &[&str], requests: &[Value]) -> Vec<Value> {
    let mut child = Command::new(oracle_python())
        .arg(oracle_script())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the oracle ({}): {e}", oracle_python().display()));
    let mut stdin = child.stdin.take().unwrap();
    let input: String = requests.iter().map(|r| format!("{r}\n")).collect();
    let writer = std::thread::spawn(move || {
        stdin.write_all(input.as_bytes()).unwrap();
    });
    let stdout = child.stdout.take().unwrap();
    let out: Vec<Value> = BufReader::new(stdout)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    writer.join().unwrap();
    let status = child.wait_with_output().unwrap();
    assert!(
        status.status.success(),
        "oracle {args:?} failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    out
}

/// Token ids from llama.cpp for each text.
pub struct OracleTokens {
    pub ids: Vec<u32>,
    /// Concatenated pieces, special tokens rendered.
    pub pieces: Vec<u8>,
    /// Concatenated pieces, control tokens dropped.
    pub pieces_plain: Vec<u8>,
    /// llama_detokenize output (with llama.cpp's space clean-up).
    pub detok: Vec<u8>,
}

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Tokenizes every text with llama.cpp.
pub fn oracle_tokenize(
    model: &Path,
    texts: &[String],
    add_special: bool,
    parse_special: bool,
) -> Vec<OracleTokens> {
    let reqs: Vec<Value> = texts
        .iter()
        .map(|t| {
            serde_json::json!({"text": t, "add_special": add_special, "parse_special": parse_special})
        })
        .collect();
    let out = run_oracle(&["tokenize", "--model", model.to_str().unwrap()], &reqs);
    assert_eq!(out.len(), texts.len());
    out.into_iter()
        .map(|v| OracleTokens {
            ids: v["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            pieces: hex(v["pieces"].as_str().unwrap()),
            pieces_plain: hex(v["pieces_plain"].as_str().unwrap()),
            detok: hex(v["detok"].as_str().unwrap()),
        })
        .collect()
}

/// The corpus in tests/data/corpus.jsonl: (tag, text).
pub fn corpus() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/corpus.jsonl");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["tag"].as_str().unwrap().to_owned(), v["text"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// A directory for files a test writes, removed and recreated.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-tokenizer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Shows a text with its escapes, shortened, for failure messages.
pub fn show(text: &str) -> String {
    let s = format!("{text:?}");
    if s.len() > 160 {
        let cut = (0..=150).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!("{}…({} bytes)", &s[..cut], text.len())
    } else {
        s
    }
}
