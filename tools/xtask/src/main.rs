//! Project automation: `cargo xtask test` sets up what the tests need and runs them all.
//!
//! * `cargo xtask setup` — installs the system packages the tests need ([`needs`]: apt-get
//!   as root; otherwise it stops and names them), pulls the default model, builds the
//!   llama.cpp oracle (llama-cpp-python from PyPI, in a venv under `.kvx/`), builds the
//!   release binary.
//! * `cargo xtask test [-- ARGS]` — setup, then rustfmt, the tidy rules, clippy and
//!   `cargo test --workspace --no-fail-fast ARGS` with the environment the tests expect; every
//!   step runs even when one fails, and the run ends with `N passed, N failed`.
//! * `cargo xtask test --fast [-- ARGS]` — the inner loop: rustfmt, tidy and the unit tests
//!   (`--lib --bins`) of every crate; no set-up, no model, no end-to-end suite.
//! * `cargo xtask tidy` — the repository rules alone.
//!
//! Environment given to the tests: `KVX_BIN` (release binary), `KVX_TEST_MODEL` (the default
//! GGUF), `KVX_ORACLE_PYTHON` (a python with `llama_cpp`), `KVX_HOME` (the model store),
//! `KVX_HELM` and `KVX_KUBE_VALIDATE` (the deploy/ checkers, [`deploy_tools`]),
//! `KVX_KV_CACHE_BYTES` (the KV cache of the servers tests start, unless already set).

mod deploy_tools;
mod deps;
mod needs;
mod tally;
mod tidy;

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use tally::Tally;

/// The oracle: llama-cpp-python from PyPI, built from source for this CPU by pip.
const ORACLE_REQ: &str = "llama-cpp-python==0.3.36";

fn main() -> ExitCode {
    match run_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_main() -> Result<ExitCode> {
    let args: Vec<String> = env::args().skip(1).collect();
    let root = workspace_root()?;
    match args.first().map(String::as_str) {
        Some("setup") => {
            setup(&root)?;
        }
        Some("test") => {
            let rest = &args[1..];
            let fast = rest.first().is_some_and(|a| a == "--fast");
            let extra = rest.iter().skip(usize::from(fast)).skip_while(|a| *a == "--");
            let extra: Vec<String> = extra.cloned().collect();
            let tally = if fast {
                run_fast(&root, &extra)?
            } else {
                let env = setup(&root)?;
                run_checks(&root, &env, &extra)?
            };
            if !tally.failures.is_empty() {
                eprintln!("xtask: failed: {}", tally.failures.join(", "));
            }
            if tally.ignored > 0 {
                eprintln!("xtask: {} test(s) ignored", tally.ignored);
            }
            println!("{}", tally.line());
            return Ok(if tally.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE });
        }
        Some("tidy") => tidy::check(&root)?,
        _ => {
            eprintln!("usage: cargo xtask <setup|test [--fast]|tidy> [-- extra cargo test args]");
            return Ok(ExitCode::from(2));
        }
    }
    Ok(ExitCode::SUCCESS)
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

/// The KV cache of each engine of every `kvx` process a test starts without
/// `--kv-cache-bytes` (512 MiB, room for ~23 k tokens of the test model; mock engines size
/// their simulated cache by it too): `kvx serve` and `kvx worker` make their whole cache
/// resident before they serve, and the default (a quarter of RAM, at most 4 GiB, shared by
/// the engines) takes ~11 s of page zeroing on a small VM, for each of the suite's servers.
/// The status-page test starts its server with the default, which keeps that path tested.
const TEST_KV_CACHE_BYTES: &str = "536870912";

/// What the tests need, as environment variables.
struct TestEnv {
    vars: Vec<(String, String)>,
}

fn setup(root: &Path) -> Result<TestEnv> {
    let host_python = env::var("KVX_PYTHON").unwrap_or_else(|_| "python3".into());
    needs::ensure(&host_python)?;
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
    let deploy = deploy_tools::ensure(root, &host_python)?;
    let kv_bytes = env::var("KVX_KV_CACHE_BYTES").unwrap_or_else(|_| TEST_KV_CACHE_BYTES.into());
    Ok(TestEnv {
        vars: vec![
            ("KVX_KV_CACHE_BYTES".into(), kv_bytes),
            ("KVX_BIN".into(), bin.display().to_string()),
            ("KVX_HOME".into(), home.display().to_string()),
            ("KVX_TEST_MODEL".into(), model),
            ("KVX_ORACLE_PYTHON".into(), python.display().to_string()),
            ("KVX_HELM".into(), deploy.helm.display().to_string()),
            ("KVX_KUBE_VALIDATE".into(), deploy.kube_validate.display().to_string()),
        ],
    })
}

/// The kernel level kvx picks on this CPU: `SimdLevel::detect` of kvx-kernels, mirrored
/// here so that xtask builds in seconds (a test checks that the two agree).
fn kernel_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        let avx512 = avx2
            && has!("avx512f")
            && has!("avx512bw")
            && has!("avx512dq")
            && has!("avx512vl")
            && has!("avx512vnni");
        if avx512 {
            return "avx512";
        }
        if avx2 {
            return "avx2";
        }
    }
    "scalar"
}

/// ggml build flags giving exactly the instruction set of kvx's kernel level on this CPU
/// (explicit, so that extensions kvx does not mirror, such as AMX tiles, stay off), and
/// without the multimodal library (`LLAVA_BUILD`, loaded only by image chat handlers, which
/// the oracle does not use).
fn oracle_cmake_args() -> (&'static str, String) {
    let (level, isa) = match kernel_level() {
        "avx512" => (
            "avx512",
            "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
             -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON",
        ),
        "avx2" => (
            "avx2",
            "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
             -DGGML_AVX512=OFF",
        ),
        _ => (
            "scalar",
            "-DGGML_NATIVE=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF",
        ),
    };
    (level, format!("{isa} -DLLAVA_BUILD=OFF"))
}

/// A venv with the oracle, reused when it already imports at the pinned version and was
/// built for this CPU's kernel level with these flags.
fn ensure_oracle(root: &Path) -> Result<PathBuf> {
    if let Some(p) = env::var_os("KVX_ORACLE_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let venv = root.join(".kvx/oracle");
    let python = venv.join("bin/python");
    let (level, cmake_args) = oracle_cmake_args();
    let marker = venv.join("kvx-oracle-build");
    let want = ORACLE_REQ.split("==").nth(1).unwrap_or_default();
    let stamp = format!("{ORACLE_REQ} {level} {cmake_args}");
    let check = format!(
        "import llama_cpp, numpy, jinja2, openai, jsonschema; assert llama_cpp.__version__ == {want:?}"
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
        .args(["numpy", "jinja2", "openai", "jsonschema"])
        .env("CMAKE_ARGS", flags))?;
    std::fs::write(&marker, stamp)?;
    Ok(python)
}

/// The full run: rustfmt, tidy, clippy and every test, each to its end.
fn run_checks(root: &Path, env: &TestEnv, extra: &[String]) -> Result<Tally> {
    let mut t = Tally::default();
    t.check("rustfmt", step(Command::new("cargo").current_dir(root).args(FMT)));
    t.check("tidy", report(tidy::check(root)));
    t.check("clippy", step(Command::new("cargo").current_dir(root).args(CLIPPY)));
    let mut test = Command::new("cargo");
    test.current_dir(root).args(["test", "--workspace", "--no-fail-fast"]).args(extra);
    for (k, v) in &env.vars {
        test.env(k, v);
    }
    tally::cargo_test(&mut test, &mut t)?;
    Ok(t)
}

/// The inner loop: rustfmt, tidy and the unit tests of every crate, with nothing set up.
fn run_fast(root: &Path, extra: &[String]) -> Result<Tally> {
    let mut t = Tally::default();
    t.check("rustfmt", step(Command::new("cargo").current_dir(root).args(FMT)));
    t.check("tidy", report(tidy::check(root)));
    let mut test = Command::new("cargo");
    test.current_dir(root)
        .args(["test", "--workspace", "--exclude", "kvx-e2e", "--lib", "--bins"])
        .arg("--no-fail-fast")
        .args(extra);
    tally::cargo_test(&mut test, &mut t)?;
    Ok(t)
}

const FMT: [&str; 4] = ["fmt", "--all", "--", "--check"];
const CLIPPY: [&str; 6] = ["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"];

/// Runs a step; whether it succeeded (its failure is printed).
fn step(cmd: &mut Command) -> bool {
    report(run(cmd))
}

fn report(r: Result<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mirrored_kernel_level_is_the_kernels_own() {
        assert_eq!(super::kernel_level(), kvx_kernels::cpu::SimdLevel::detect().name());
    }
}
