//! The full run's tests, two test binaries at a time: `cargo test --no-run` builds them all
//! and names them, then each runs as `cargo test` would run it (in its package's directory,
//! with cargo's runtime environment), its output kept in a file and printed whole when it
//! ends, the longest of the last run first. Many of the end-to-end binaries wait on servers,
//! leases and planner intervals more than they compute, so a second binary fills the cores
//! they leave. Binaries whose tests size things from measured latencies ([`ALONE`]) run
//! first, by themselves. Doc tests run after, through `cargo test --doc`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::tally::{self, Tally};

/// Test binaries that run at once.
pub(crate) const JOBS: usize = 2;

/// Binaries that run with no other beside them: the planner's scenarios size pools from the
/// latencies they measure, which a second binary would disturb.
pub(crate) const ALONE: [&str; 1] = ["-p kvx-e2e --test planner"];

/// One test binary `cargo test --no-run` built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TestBinary {
    /// The executable.
    pub(crate) exe: PathBuf,
    /// Its package's directory (where `cargo test` runs it).
    pub(crate) dir: PathBuf,
    /// Its package's name.
    pub(crate) package: String,
    /// cargo's target selection that reruns it (`--lib`, `--test NAME`, `--bin NAME`).
    pub(crate) select: String,
}

impl TestBinary {
    /// The name it has in the timing record and in failures: cargo's rerun arguments.
    pub(crate) fn label(&self) -> String {
        format!("-p {} {}", self.package, self.select)
    }
}

#[derive(Deserialize)]
struct Artifact {
    reason: String,
    #[serde(default)]
    package_id: String,
    #[serde(default)]
    manifest_path: Option<PathBuf>,
    #[serde(default)]
    target: Option<Target>,
    #[serde(default)]
    profile: Option<Profile>,
    #[serde(default)]
    executable: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

/// The test binaries among `cargo test --no-run --message-format=json` lines.
pub(crate) fn parse_binaries(json_lines: &str) -> Vec<TestBinary> {
    let mut out = Vec::new();
    for line in json_lines.lines() {
        let Ok(a) = serde_json::from_str::<Artifact>(line) else { continue };
        let (Some(exe), Some(target), Some(profile), Some(manifest)) =
            (a.executable, a.target, a.profile, a.manifest_path)
        else {
            continue;
        };
        if a.reason != "compiler-artifact" || !profile.test {
            continue;
        }
        let kind = target.kind.first().map(String::as_str).unwrap_or_default();
        let select = match kind {
            "lib" | "rlib" | "proc-macro" | "cdylib" | "dylib" | "staticlib" => "--lib".into(),
            "bin" => format!("--bin {}", target.name),
            "test" => format!("--test {}", target.name),
            "bench" => format!("--bench {}", target.name),
            "example" => format!("--example {}", target.name),
            _ => continue,
        };
        let dir = manifest.parent().map(Path::to_path_buf).unwrap_or_default();
        out.push(TestBinary { exe, package: package_name(&a.package_id, &dir), dir, select });
    }
    out
}

/// A package's name from its id: `path+file:///dir#name@1.0`, or `path+file:///dir/name#1.0`
/// where the directory has the package's name.
fn package_name(id: &str, dir: &Path) -> String {
    match id.rsplit_once('#') {
        Some((_, tail)) if tail.contains('@') => tail.split('@').next().unwrap_or(tail).into(),
        _ => dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    }
}

/// Where each binary's last time is kept (seconds by label, one per line).
fn record_path(root: &Path) -> PathBuf {
    root.join("target/xtask-test-times")
}

fn read_record(root: &Path) -> HashMap<String, f64> {
    let text = std::fs::read_to_string(record_path(root)).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once('\t'))
        .filter_map(|(s, label)| Some((label.to_string(), s.parse().ok()?)))
        .collect()
}

/// Orders `bins` for the run: the longest of the last run first; binaries without a time
/// (a fresh checkout) first of all, integration tests before unit tests.
pub(crate) fn order(bins: &mut [TestBinary], times: &HashMap<String, f64>) {
    bins.sort_by(|a, b| {
        let key = |t: &TestBinary| {
            let integration = t.select.starts_with("--test");
            (times.get(&t.label()).copied().unwrap_or(f64::INFINITY), integration)
        };
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0).then(kb.1.cmp(&ka.1))
    });
}

/// Builds every test target with `cargo test --workspace --no-run`, runs the binaries
/// ([`ALONE`] ones first, each by itself, then the others [`JOBS`] at a time) with `env`,
/// then the doc tests; adds everything to `t`. A build that fails or names no binary counts
/// as a failed check, and the doc tests still run.
pub(crate) fn run_all(root: &Path, env: &[(String, String)], t: &mut Tally) -> Result<()> {
    match build_all(root) {
        Ok(bins) if !bins.is_empty() => run_binaries(root, bins, env, t),
        Ok(_) => t.check("cargo test --no-run (no test binary)", false),
        Err(e) => {
            eprintln!("xtask: {e:#}");
            t.check("cargo test --no-run", false);
        }
    }
    let mut doc = Command::new("cargo");
    doc.current_dir(root).args(["test", "--workspace", "--doc", "--no-fail-fast"]);
    for (k, v) in env {
        doc.env(k, v);
    }
    tally::cargo_test(&mut doc, t)
}

/// The test binaries of the workspace, built.
fn build_all(root: &Path) -> Result<Vec<TestBinary>> {
    let mut build = Command::new("cargo");
    build.current_dir(root).args(["test", "--workspace", "--no-run"]);
    build.arg("--message-format=json-render-diagnostics");
    eprintln!("xtask: {build:?}");
    let out = build.stderr(Stdio::inherit()).output().context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --no-run failed: {}", out.status);
    }
    Ok(parse_binaries(&String::from_utf8_lossy(&out.stdout)))
}

/// Runs `bins` as [`run_all`] says and adds their results to `t`; a binary whose result went
/// missing (a runner thread that died) counts as failed.
fn run_binaries(root: &Path, mut bins: Vec<TestBinary>, env: &[(String, String)], t: &mut Tally) {
    order(&mut bins, &read_record(root));
    let (alone, shared): (Vec<_>, Vec<_>) =
        bins.into_iter().partition(|b| ALONE.contains(&b.label().as_str()));
    let out_dir = root.join("target/xtask-test-output");
    let _ = std::fs::create_dir_all(&out_dir);
    let mut results: Vec<(TestBinary, Result<Done>)> = Vec::new();
    let mut expected = Vec::new();
    for (i, bin) in alone.into_iter().enumerate() {
        expected.push(bin.label());
        let done = run_one(&bin, env, &out_dir.join(format!("alone-{i}.log")));
        results.push((bin, done));
    }
    expected.extend(shared.iter().map(TestBinary::label));
    let queue = Arc::new(Mutex::new(shared.into_iter().enumerate()));
    let shared_results = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..JOBS)
        .map(|_| {
            let (queue, results) = (Arc::clone(&queue), Arc::clone(&shared_results));
            let (env, out_dir) = (env.to_vec(), out_dir.clone());
            std::thread::spawn(move || {
                loop {
                    let next = queue.lock().map(|mut q| q.next()).unwrap_or(None);
                    let Some((i, bin)) = next else { break };
                    let done = run_one(&bin, &env, &out_dir.join(format!("{i}.log")));
                    if let Ok(mut r) = results.lock() {
                        r.push((bin, done));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    if let Ok(mut r) = shared_results.lock() {
        results.append(&mut r);
    }
    let mut record = String::new();
    for (bin, done) in &results {
        add_run(t, &bin.label(), done);
        if let Ok(d) = done {
            record.push_str(&format!("{:.1}\t{}\n", d.secs, bin.label()));
        }
    }
    for label in expected {
        if !results.iter().any(|(b, _)| b.label() == label) {
            eprintln!("xtask: {label}: no result (its runner thread died)");
            t.failed += 1;
            t.failures.push(label);
        }
    }
    let _ = std::fs::write(record_path(root), record);
}

/// What one binary's run left: its output, exit status and time.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) output: String,
    pub(crate) success: bool,
    pub(crate) secs: f64,
}

/// Runs `bin` as `cargo test` runs it, its output (both streams) into the file `log`, and
/// prints the output whole when it ends. A file rather than a pipe: servers a test starts
/// inherit the output, and one the test failed to stop (a crash skips its drops) would hold a
/// pipe open past the test's end.
fn run_one(bin: &TestBinary, env: &[(String, String)], log: &Path) -> Result<Done> {
    eprintln!("xtask: started {}", bin.label());
    let started = Instant::now();
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(&bin.exe);
    // cargo's runtime variables for this package, not xtask's own.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_") || ["CARGO_MANIFEST_PATH", "CARGO_CRATE_NAME"].contains(&&*k)
        {
            cmd.env_remove(&*k);
        }
    }
    cmd.current_dir(&bin.dir)
        .env("CARGO_MANIFEST_DIR", &bin.dir)
        .env("CARGO_MANIFEST_PATH", bin.dir.join("Cargo.toml"))
        .env("CARGO_PKG_NAME", &bin.package)
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let status = cmd.status().with_context(|| format!("running {}", bin.exe.display()));
    let secs = started.elapsed().as_secs_f64();
    let output = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    println!("xtask: {} ({}, {secs:.1} s)\n{output}", bin.label(), bin.exe.display());
    Ok(Done { output, success: status?.success(), secs })
}

/// Adds one binary's run to `t`: its result lines; a binary that failed without a result
/// line of failures (a crash, a panic outside a test) counts as one failure.
pub(crate) fn add_run(t: &mut Tally, label: &str, done: &Result<Done>) {
    let done = match done {
        Ok(d) => d,
        Err(e) => {
            eprintln!("xtask: {label}: {e:#}");
            t.failed += 1;
            t.failures.push(label.to_string());
            return;
        }
    };
    let mut failed_tests = 0;
    for line in done.output.lines() {
        if let Some((p, f, i)) = tally::parse_result(line) {
            t.passed += p;
            t.failed += f;
            t.ignored += i;
            failed_tests += f;
        }
    }
    if !done.success {
        if failed_tests == 0 {
            t.failed += 1;
        }
        t.failures.push(label.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests#kvx-e2e@0.1.0","manifest_path":"/w/tests/Cargo.toml","target":{"name":"planner","kind":["test"]},"profile":{"test":true},"executable":"/w/target/debug/deps/planner-1"}
{"reason":"compiler-artifact","package_id":"path+file:///w/kernels#kvx-kernels@0.1.0","manifest_path":"/w/kernels/Cargo.toml","target":{"name":"kvx_kernels","kind":["lib"]},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","package_id":"path+file:///w/kernels#kvx-kernels@0.1.0","manifest_path":"/w/kernels/Cargo.toml","target":{"name":"kvx_kernels","kind":["lib"]},"profile":{"test":true},"executable":"/w/target/debug/deps/kvx_kernels-2"}
{"reason":"compiler-artifact","package_id":"path+file:///w/tools/xtask#0.1.0","manifest_path":"/w/tools/xtask/Cargo.toml","target":{"name":"xtask","kind":["bin"]},"profile":{"test":true},"executable":"/w/target/debug/deps/xtask-3"}
{"reason":"build-finished","success":true}"#;

    #[test]
    fn test_binaries_are_read_from_cargos_messages() {
        let bins = parse_binaries(BUILT);
        let labels: Vec<String> = bins.iter().map(TestBinary::label).collect();
        assert_eq!(
            labels,
            ["-p kvx-e2e --test planner", "-p kvx-kernels --lib", "-p xtask --bin xtask"]
        );
        assert_eq!(bins[0].dir, Path::new("/w/tests"));
        assert_eq!(bins[1].exe, Path::new("/w/target/debug/deps/kvx_kernels-2"));
    }

    #[test]
    fn the_longest_of_the_last_run_goes_first_and_unknown_ones_before_them() {
        let mut bins = parse_binaries(BUILT);
        let times = HashMap::from([
            ("-p kvx-kernels --lib".to_string(), 3.0),
            ("-p xtask --bin xtask".to_string(), 9.0),
        ]);
        order(&mut bins, &times);
        let labels: Vec<String> = bins.iter().map(TestBinary::label).collect();
        assert_eq!(
            labels,
            ["-p kvx-e2e --test planner", "-p xtask --bin xtask", "-p kvx-kernels --lib"]
        );
        // With no record, integration tests first.
        let mut bins = parse_binaries(BUILT);
        bins.reverse();
        order(&mut bins, &HashMap::new());
        assert_eq!(bins[0].label(), "-p kvx-e2e --test planner");
    }

    #[test]
    fn a_crash_counts_once_and_failing_tests_count_each() {
        let mut t = Tally::default();
        let ok = "test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured";
        add_run(&mut t, "a", &Ok(Done { output: ok.into(), success: true, secs: 1.0 }));
        let bad = "test result: FAILED. 2 passed; 3 failed; 0 ignored; 0 measured";
        add_run(&mut t, "b", &Ok(Done { output: bad.into(), success: false, secs: 1.0 }));
        add_run(&mut t, "c", &Ok(Done { output: "SIGSEGV".into(), success: false, secs: 1.0 }));
        add_run(&mut t, "d", &Err(anyhow::anyhow!("no such file")));
        assert_eq!((t.passed, t.failed, t.ignored), (6, 5, 1));
        assert_eq!(t.failures, ["b", "c", "d"]);
    }
}
