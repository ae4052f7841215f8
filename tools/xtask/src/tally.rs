//! Running checks and `cargo test` to the end and counting what passed: every test binary
//! runs even when one fails (`--no-fail-fast`), and the run ends with one plain line,
//! `N passed, N failed`, counting the tests and the checks (rustfmt, tidy, clippy).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// Counts of a run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Tests (and checks) that passed.
    pub(crate) passed: u64,
    /// Tests (and checks) that failed.
    pub(crate) failed: u64,
    /// Tests ignored.
    pub(crate) ignored: u64,
    /// What failed: check names and cargo's rerun arguments of failing test targets.
    pub(crate) failures: Vec<String>,
}

impl Tally {
    /// Records a check.
    pub(crate) fn check(&mut self, name: &str, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
            self.failures.push(name.to_string());
        }
    }

    /// The closing line CI reads.
    pub(crate) fn line(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed)
    }
}

/// `(passed, failed, ignored)` of a libtest summary line
/// (`test result: ok. 5 passed; 0 failed; 1 ignored; ...`).
pub(crate) fn parse_result(line: &str) -> Option<(u64, u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let (_, counts) = rest.split_once(". ")?;
    let mut out = (None, None, None);
    for part in counts.split(';') {
        let mut w = part.split_whitespace();
        let (Some(n), Some(what)) = (w.next(), w.next()) else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what {
            "passed" => out.0 = Some(n),
            "failed" => out.1 = Some(n),
            "ignored" => out.2 = Some(n),
            _ => {}
        }
    }
    Some((out.0?, out.1?, out.2.unwrap_or(0)))
}

/// cargo's rerun arguments of a failed test target (`error: test failed, to rerun pass
/// `-p kvx-x --lib``).
pub(crate) fn parse_failed_target(line: &str) -> Option<String> {
    let rest = line.trim().strip_prefix("error: test failed, to rerun pass ")?;
    Some(rest.trim_matches('`').to_string())
}

/// Runs `cmd` (a `cargo test`), passing its output through, and adds its counts to `t`. A
/// target that failed without a result line of failures (a crash, a build error) counts as
/// one failure; so does a run that failed with no target named.
pub(crate) fn cargo_test(cmd: &mut Command, t: &mut Tally) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let out = child.stdout.take().context("stdout")?;
    let err = child.stderr.take().context("stderr")?;
    let errs = std::thread::spawn(move || {
        let mut targets = Vec::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("{line}");
            targets.extend(parse_failed_target(&line));
        }
        targets
    });
    let mut binaries_with_failures = 0u64;
    let stdout = std::io::stdout();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        let mut o = stdout.lock();
        let _ = writeln!(o, "{line}");
        if let Some((p, f, i)) = parse_result(&line) {
            t.passed += p;
            t.failed += f;
            t.ignored += i;
            binaries_with_failures += u64::from(f > 0);
        }
    }
    let status = child.wait()?;
    let targets = errs.join().unwrap_or_default();
    let unexplained = (targets.len() as u64).saturating_sub(binaries_with_failures);
    t.failed += unexplained;
    if !status.success() && targets.is_empty() && binaries_with_failures == 0 {
        t.failed += 1;
        t.failures.push(format!("cargo test ({status})"));
    }
    t.failures.extend(targets);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_are_counted() {
        let ok = "test result: ok. 12 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.03s";
        assert_eq!(parse_result(ok), Some((12, 0, 2)));
        let bad = "test result: FAILED. 6 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!(parse_result(bad), Some((6, 2, 0)));
        assert_eq!(parse_result("running 3 tests"), None);
    }

    #[test]
    fn failed_targets_are_named() {
        let l = "error: test failed, to rerun pass `-p kvx-planes --test local`";
        assert_eq!(parse_failed_target(l).as_deref(), Some("-p kvx-planes --test local"));
        assert_eq!(parse_failed_target("error: could not compile `x`"), None);
    }

    #[test]
    fn checks_count_in_the_closing_line() {
        let mut t = Tally { passed: 10, ..Tally::default() };
        t.check("rustfmt", true);
        t.check("clippy", false);
        assert_eq!(t.line(), "11 passed, 1 failed");
        assert_eq!(t.failures, ["clippy"]);
    }
}
