//! Project automation: `cargo xtask test` sets up what the tests need and runs them all.
//!
//! * `cargo xtask setup` — pulls the default model, builds the llama.cpp oracle
//!   (llama-cpp-python from PyPI, in a venv under `.kvx/`), builds the release binary.
//! * `cargo xtask test` — setup, then formatting, lints, the tidy rules and `cargo test`
//!   for the whole workspace with the environment the tests expect.
//! * `cargo xtask tidy` — the repository rules alone.
//!
//! Environment given to the tests: `KVX_BIN` (release binary), `KVX_TEST_MODEL` (the default
//! GGUF), `KVX_ORACLE_PYTHON` (a python with `llama_cpp`), `KVX_HOME` (the model store).

mod tidy;

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use kvx_kernels::cpu::SimdLevel;

/// The oracle: llama-cpp-python from PyPI, built from source for this CPU by pip.
const ORACLE_REQ: &str = "llama-cpp-python==0.3.36";

fn main() -> Result<()> {
    let args: Vec<String> = env::args().skip(1).collect();
    let root = workspace_root()?;
    match args.first().map(String::as_str) {
        Some("setup") => {
            setup(&root)?;
        }
        Some("test") => {
            let env = setup(&root)?;
            run_checks(&root, &env, &args[1..])?;
        }
        Some("tidy") => tidy::check(&root)?,
        _ => {
            eprintln!("usage: cargo xtask <setup|test|tidy> [-- extra cargo test args]");
            std::process::exit(2);
        }
    }
    Ok(())
}

fn workspace_root() -> Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Ok(dir.ancestors().nth(2).context("xtask lives at tools/xtask")?.to_path_buf())
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// What the tests need, as environment variables.
struct TestEnv {
    vars: Vec<(String, String)>,
}

fn setup(root: &Path) -> Result<TestEnv> {
    let home = env::var_os("KVX_HOME").map(PathBuf::from).unwrap_or_else(|| root.join(".kvx/home"));
    run(Command::new("cargo").current_dir(root).args(["build", "--release", "-p", "kvx"]))?;
    let bin = root.join("target/release/kvx");
    let out = Command::new(&bin)
        .args(["model", "path"])
        .env("KVX_HOME", &home)
        .output()
        .context("running kvx model path")?;
    if !out.status.success() {
        bail!("kvx model path failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let model = String::from_utf8(out.stdout)?.trim().to_string();
    let python = ensure_oracle(root)?;
    Ok(TestEnv {
        vars: vec![
            ("KVX_BIN".into(), bin.display().to_string()),
            ("KVX_HOME".into(), home.display().to_string()),
            ("KVX_TEST_MODEL".into(), model),
            ("KVX_ORACLE_PYTHON".into(), python.display().to_string()),
        ],
    })
}

/// ggml build flags giving exactly the instruction set of kvx's kernel level on this CPU
/// (explicit, so that extensions kvx does not mirror, such as AMX tiles, stay off).
fn oracle_cmake_args() -> (&'static str, &'static str) {
    match SimdLevel::detect() {
        SimdLevel::Avx512 => (
            "avx512",
            "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
             -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON",
        ),
        SimdLevel::Avx2 => (
            "avx2",
            "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
             -DGGML_AVX512=OFF",
        ),
        SimdLevel::Scalar => (
            "scalar",
            "-DGGML_NATIVE=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF",
        ),
    }
}

/// A venv with the oracle, reused when it already imports at the pinned version and was
/// built for this CPU's kernel level.
fn ensure_oracle(root: &Path) -> Result<PathBuf> {
    if let Some(p) = env::var_os("KVX_ORACLE_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let venv = root.join(".kvx/oracle");
    let python = venv.join("bin/python");
    let (level, cmake_args) = oracle_cmake_args();
    let marker = venv.join("kvx-oracle-build");
    let want = ORACLE_REQ.split("==").nth(1).unwrap_or_default();
    let stamp = format!("{ORACLE_REQ} {level}");
    let check = format!(
        "import llama_cpp, numpy, jinja2, openai; assert llama_cpp.__version__ == {want:?}"
    );
    let ok = std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == stamp)
        && Command::new(&python).args(["-c", &check]).output().is_ok_and(|o| o.status.success());
    if ok {
        return Ok(python);
    }
    eprintln!(
        "xtask: building the llama.cpp oracle ({ORACLE_REQ} for {level}; minutes on 2 cores)"
    );
    let host_python = env::var("KVX_PYTHON").unwrap_or_else(|_| "python3".into());
    let _ = std::fs::remove_dir_all(&venv);
    run(Command::new(&host_python).args(["-m", "venv"]).arg(&venv))?;
    let flags = cmake_args.split_whitespace().collect::<Vec<_>>().join(" ");
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-cache-dir", ORACLE_REQ])
        .args(["numpy", "jinja2", "openai"])
        .env("CMAKE_ARGS", flags))?;
    std::fs::write(&marker, stamp)?;
    Ok(python)
}

fn run_checks(root: &Path, env: &TestEnv, extra: &[String]) -> Result<()> {
    run(Command::new("cargo").current_dir(root).args(["fmt", "--all", "--", "--check"]))?;
    tidy::check(root)?;
    run(Command::new("cargo").current_dir(root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    let mut test = Command::new("cargo");
    test.current_dir(root).args(["test", "--workspace"]).args(extra);
    for (k, v) in &env.vars {
        test.env(k, v);
    }
    run(&mut test)
}
