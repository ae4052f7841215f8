//! Repository rules that the compiler does not check: a `//!` line opening every Rust file,
//! `unsafe` only in the crates allowed to use it, workspace lints in every crate, crate
//! clippy.toml files that keep the workspace's lists, and the dependency rules of
//! [`crate::deps`].

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// Crate directories whose code may use `unsafe`.
const UNSAFE_ALLOWED: &[&str] = &["kernels/", "dataplane/xfer/"];

/// Directories never scanned.
const SKIP: &[&str] =
    &["target", ".git", ".kvx", "node_modules", "fuzz/target", "fuzz/corpus", "fuzz/artifacts"];

pub(crate) fn check(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    let mut files = Vec::new();
    walk(root, root, &mut files)?;
    for path in &files {
        let rel = path.strip_prefix(root).unwrap_or(path).to_string_lossy().replace('\\', "/");
        if rel.ends_with(".rs") {
            let text = fs::read_to_string(path)?;
            if !text.trim_start().starts_with("//!") {
                problems
                    .push(format!("{rel}: does not start with a `//!` line saying what it is for"));
            }
            if !UNSAFE_ALLOWED.iter().any(|p| rel.starts_with(p)) && uses_unsafe(&text) {
                problems.push(format!("{rel}: `unsafe` outside kernels/ and dataplane/xfer/"));
            }
        } else if rel.ends_with("Cargo.toml") && rel != "Cargo.toml" && !rel.contains("fuzz/") {
            let text = fs::read_to_string(path)?;
            if !text.contains("[lints]\nworkspace = true") {
                problems.push(format!("{rel}: missing `[lints] workspace = true`"));
            }
        } else if rel.ends_with("/clippy.toml") {
            clippy_repeats_the_workspace(root, path, &rel, &mut problems)?;
        }
    }
    crate::deps::check(root, &mut problems)?;
    if problems.is_empty() {
        eprintln!("xtask: tidy: {} files checked", files.len());
        return Ok(());
    }
    for p in &problems {
        eprintln!("tidy: {p}");
    }
    bail!("{} tidy problem(s)", problems.len())
}

/// A crate's clippy.toml that says it extends the workspace's must list every entry of it
/// (clippy reads only the nearest file).
fn clippy_repeats_the_workspace(
    root: &Path,
    path: &Path,
    rel: &str,
    problems: &mut Vec<String>,
) -> Result<()> {
    let text = fs::read_to_string(path)?;
    if !text.contains("It repeats the workspace's clippy.toml") {
        return Ok(());
    }
    let top = fs::read_to_string(root.join("clippy.toml"))?;
    for line in top.lines().map(str::trim).filter(|l| l.starts_with("{ path = ")) {
        let entry = line.split(',').next().unwrap_or(line);
        if !text.contains(entry) {
            problems.push(format!("{rel}: lacks the workspace's `{entry}`"));
        }
    }
    Ok(())
}

/// Whether code (not comments or string literals) uses `unsafe`.
fn uses_unsafe(text: &str) -> bool {
    const FORMS: [&str; 4] = ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern"];
    text.lines().map(str::trim_start).filter(|l| !l.starts_with("//")).any(|l| {
        FORMS.iter().any(|f| {
            l.match_indices(f).any(|(at, _)| {
                let before = &l[..at];
                (before.matches('"').count() - before.matches("\\\"").count()).is_multiple_of(2)
            })
        })
    })
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let rel = path.strip_prefix(root).unwrap_or(&path).to_string_lossy().replace('\\', "/");
        if SKIP.iter().any(|s| {
            rel == *s || rel.ends_with(&format!("/{s}")) || rel.starts_with(&format!("{s}/"))
        }) {
            continue;
        }
        if entry.file_type()?.is_dir() {
            walk(root, &path, out)?;
        } else if rel.ends_with(".rs")
            || rel.ends_with("Cargo.toml")
            || rel.ends_with("clippy.toml")
        {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_detection_ignores_comments() {
        assert!(uses_unsafe("fn f() { unsafe { x() } }"));
        assert!(!uses_unsafe("// unsafe { in a comment }\nfn f() {}"));
        assert!(uses_unsafe("unsafe impl Send for X {}"));
        assert!(!uses_unsafe("let s = \"unsafe { quoted }\";"));
    }

    #[test]
    fn the_repository_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).map(Path::to_path_buf);
        check(&root.expect("workspace root")).expect("tidy");
    }
}
