//! kvx-e2e: shared helpers for end-to-end tests that run the real binary on real sockets with
//! the real model. The test set-up (`cargo xtask test`) exports the variables read here; a
//! test run without them fails and says how to get them.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub mod certs;
pub mod etcd;
pub mod kube;
pub mod netns;
pub mod planes;
pub mod serve;

fn required(var: &str, what: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(v) => PathBuf::from(v),
        None => panic!(
            "{var} is not set ({what}). Run the tests through `cargo xtask test`, which builds \
             and exports everything, or set {var} yourself."
        ),
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

/// The `kvx` binary under test (`KVX_BIN`).
pub fn kvx_bin() -> PathBuf {
    required("KVX_BIN", "path to the release kvx binary")
}

/// The default model file (`KVX_TEST_MODEL`).
pub fn test_model() -> PathBuf {
    required("KVX_TEST_MODEL", "path to SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A python interpreter with llama-cpp-python (`KVX_ORACLE_PYTHON`).
pub fn oracle_python() -> PathBuf {
    required("KVX_ORACLE_PYTHON", "python with llama_cpp installed")
}

/// Runs a Python client of tests/clients/ (`script`) with the oracle's python and `args`;
/// its stdout, panicking with both streams when it fails.
pub fn python_client(script: &str, args: &[&str]) -> String {
    let out = Command::new(oracle_python())
        .arg(root().join("tests/clients").join(script))
        .args(args)
        .output()
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `kvx` with `args` against the test model's store.
pub fn kvx(args: &[&str]) -> Output {
    let mut cmd = Command::new(kvx_bin());
    cmd.args(args);
    if let Some(home) = std::env::var_os("KVX_HOME") {
        cmd.env("KVX_HOME", home);
    }
    cmd.output().expect("spawning kvx")
}

/// Runs `kvx` and returns stdout, panicking with stderr on failure.
pub fn kvx_ok(args: &[&str]) -> String {
    let out = kvx(args);
    assert!(out.status.success(), "kvx {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}
