//! Dependency rules: the crate edges of the manifests against the code map in
//! ARCHITECTURE.md, the floors they may cross (tools → bench → control → dataplane →
//! kernels, never back up), and declared dependencies that no code uses.
//!
//! The code map is the fenced block tagged `crate-map` in ARCHITECTURE.md: one line per
//! workspace crate, `NAME FOLDER → DEPENDENCY...` (workspace crates only). It must list every
//! workspace crate with its folder, and each crate's edges must be exactly the workspace
//! crates its manifest declares (normal, dev and build dependencies together).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A dependency as a manifest declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Dep {
    /// The key (what code names it, with `-` as `_`).
    pub(crate) key: String,
    /// The package (differs from the key when renamed).
    pub(crate) package: String,
    /// `normal`, `dev` or `build`.
    pub(crate) kind: &'static str,
}

/// A workspace crate.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub(crate) name: String,
    /// Folder relative to the root, `/`-separated.
    pub(crate) dir: String,
    pub(crate) deps: Vec<Dep>,
}

/// The floor of a folder: crates may use crates on their floor or below.
pub(crate) fn floor(dir: &str) -> Option<u8> {
    let top = dir.split('/').next()?;
    Some(match top {
        "kernels" => 0,
        "dataplane" => 1,
        "control" => 2,
        "bench" => 3,
        "tools" | "tests" => 4,
        _ => return None,
    })
}

fn table_deps(t: Option<&toml::Value>, kind: &'static str, out: &mut Vec<Dep>) {
    let Some(t) = t.and_then(toml::Value::as_table) else { return };
    for (key, v) in t {
        let package = v.get("package").and_then(toml::Value::as_str).unwrap_or(key).to_string();
        out.push(Dep { key: key.clone(), package, kind });
    }
}

/// The dependencies a manifest declares, target-specific ones included.
pub(crate) fn manifest_deps(manifest: &toml::Value) -> Vec<Dep> {
    let mut deps = Vec::new();
    for (section, kind) in
        [("dependencies", "normal"), ("dev-dependencies", "dev"), ("build-dependencies", "build")]
    {
        table_deps(manifest.get(section), kind, &mut deps);
        if let Some(targets) = manifest.get("target").and_then(toml::Value::as_table) {
            for t in targets.values() {
                table_deps(t.get(section), kind, &mut deps);
            }
        }
    }
    deps
}

fn read_toml(path: &Path) -> Result<toml::Value> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The workspace's members and its `[workspace.dependencies]` keys.
pub(crate) fn workspace(root: &Path) -> Result<(Vec<Member>, Vec<String>)> {
    let top = read_toml(&root.join("Cargo.toml"))?;
    let ws = top.get("workspace").context("the root manifest has no [workspace]")?;
    let mut members = Vec::new();
    for m in ws.get("members").and_then(toml::Value::as_array).context("workspace.members")? {
        let dir = m.as_str().context("a member is not a string")?.to_string();
        let manifest = read_toml(&root.join(&dir).join("Cargo.toml"))?;
        let name = manifest
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(toml::Value::as_str)
            .with_context(|| format!("{dir}/Cargo.toml has no package name"))?
            .to_string();
        members.push(Member { name, dir, deps: manifest_deps(&manifest) });
    }
    let declared = ws
        .get("dependencies")
        .and_then(toml::Value::as_table)
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default();
    Ok((members, declared))
}

/// The code map: crate → (folder, allowed workspace dependencies).
pub(crate) type CodeMap = BTreeMap<String, (String, BTreeSet<String>)>;

/// Parses the `crate-map` block of ARCHITECTURE.md.
pub(crate) fn parse_map(architecture: &str) -> Result<CodeMap> {
    let start = architecture.find("```crate-map\n").context("no ```crate-map block")?;
    let body = &architecture[start + "```crate-map\n".len()..];
    let end = body.find("```").context("the crate-map block is not closed")?;
    let mut map = CodeMap::new();
    for line in body[..end].lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (left, right) =
            line.split_once('→').with_context(|| format!("crate-map line without →: {line}"))?;
        let mut parts = left.split_whitespace();
        let (Some(name), Some(dir), None) = (parts.next(), parts.next(), parts.next()) else {
            bail!("crate-map line is not `NAME FOLDER → DEPS`: {line}");
        };
        let deps = right.split_whitespace().map(str::to_string).collect();
        if map.insert(name.to_string(), (dir.to_string(), deps)).is_some() {
            bail!("crate-map lists {name} twice");
        }
    }
    Ok(map)
}

/// Checks the manifests' crate edges against the map and the floors.
pub(crate) fn check_edges(members: &[Member], map: &CodeMap, problems: &mut Vec<String>) {
    let dirs: BTreeMap<&str, &str> =
        members.iter().map(|m| (m.name.as_str(), m.dir.as_str())).collect();
    for m in members {
        let Some((dir, allowed)) = map.get(&m.name) else {
            problems.push(format!("{}: not in ARCHITECTURE.md's crate-map", m.name));
            continue;
        };
        if *dir != m.dir {
            problems.push(format!("{}: the crate-map says {dir}, the workspace {}", m.name, m.dir));
        }
        let edges: BTreeSet<String> = m
            .deps
            .iter()
            .filter(|d| dirs.contains_key(d.package.as_str()))
            .map(|d| d.package.clone())
            .collect();
        for e in edges.difference(allowed) {
            problems.push(format!(
                "{} → {e}: an edge the crate-map in ARCHITECTURE.md does not allow",
                m.name
            ));
        }
        for e in allowed.difference(&edges) {
            problems.push(format!("{} → {e}: in the crate-map but not in the manifest", m.name));
        }
    }
    for (name, (dir, allowed)) in map {
        if !dirs.contains_key(name.as_str()) {
            problems.push(format!("crate-map lists {name}, which is not a workspace crate"));
            continue;
        }
        let Some(f) = floor(dir) else {
            problems.push(format!("{name}: {dir} is on no floor"));
            continue;
        };
        for to in allowed {
            match dirs.get(to.as_str()).and_then(|d| floor(d)) {
                Some(g) if g <= f => {}
                Some(_) => problems.push(format!(
                    "{name} → {to}: runs up the floors (tools → bench → control → dataplane → kernels)"
                )),
                None => problems.push(format!("{name} → {to}: not a workspace crate")),
            }
        }
    }
}

/// Rust files under `dir`, skipping build output and nested fuzz crates.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if path.is_dir() {
            if !matches!(name, "target" | "fuzz") {
                rust_files(&path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether `code` names `ident` as a whole word outside comment lines.
pub(crate) fn names(code: &str, ident: &str) -> bool {
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    code.lines().filter(|l| !l.trim_start().starts_with("//")).any(|l| {
        l.match_indices(ident).any(|(at, _)| {
            !word(l[..at].chars().next_back()) && !word(l[at + ident.len()..].chars().next())
        })
    })
}

/// Declared dependencies no code uses: normal and build dependencies must be named by the
/// library/binary code (src/, build.rs), dev dependencies anywhere in the crate.
pub(crate) fn check_unused(
    root: &Path,
    members: &[Member],
    declared: &[String],
    problems: &mut Vec<String>,
) -> Result<()> {
    let mut used_anywhere = BTreeSet::new();
    for m in members {
        let dir = root.join(&m.dir);
        let mut src = Vec::new();
        rust_files(&dir.join("src"), &mut src)?;
        if dir.join("build.rs").is_file() {
            src.push(dir.join("build.rs"));
        }
        let mut all = Vec::new();
        rust_files(&dir, &mut all)?;
        let read = |files: &[PathBuf]| -> Result<String> {
            let mut s = String::new();
            for f in files {
                s.push_str(&fs::read_to_string(f)?);
                s.push('\n');
            }
            Ok(s)
        };
        let (src, all) = (read(&src)?, read(&all)?);
        for d in &m.deps {
            used_anywhere.insert(d.key.clone());
            let ident = d.key.replace('-', "_");
            let code = if d.kind == "dev" { &all } else { &src };
            if !names(code, &ident) {
                let where_ = if d.kind == "dev" { "" } else { " (outside tests)" };
                problems.push(format!(
                    "{}: {} dependency `{}` is never used{where_}",
                    m.name, d.kind, d.key
                ));
            }
        }
    }
    for d in declared {
        if !used_anywhere.contains(d) {
            problems.push(format!("[workspace.dependencies] `{d}`: no crate uses it"));
        }
    }
    Ok(())
}

/// Every dependency rule, with problems appended to `problems`.
pub(crate) fn check(root: &Path, problems: &mut Vec<String>) -> Result<()> {
    let (members, declared) = workspace(root)?;
    let arch = fs::read_to_string(root.join("ARCHITECTURE.md")).context("ARCHITECTURE.md")?;
    let map = parse_map(&arch)?;
    check_edges(&members, &map, problems);
    check_unused(root, &members, &declared, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, dir: &str, deps: &[&str]) -> Member {
        let deps = deps
            .iter()
            .map(|d| Dep { key: d.to_string(), package: d.to_string(), kind: "normal" })
            .collect();
        Member { name: name.into(), dir: dir.into(), deps }
    }

    const MAP: &str = "x\n```crate-map\nkvx-a kernels → \nkvx-b dataplane/b → kvx-a\nkvx-c control/c → kvx-b\n```\n";

    fn problems(members: &[Member], map: &str) -> Vec<String> {
        let mut p = Vec::new();
        check_edges(members, &parse_map(map).expect("map"), &mut p);
        p
    }

    fn ok_members() -> Vec<Member> {
        vec![
            member("kvx-a", "kernels", &["libc"]),
            member("kvx-b", "dataplane/b", &["kvx-a", "serde"]),
            member("kvx-c", "control/c", &["kvx-b"]),
        ]
    }

    #[test]
    fn manifests_that_match_the_map_pass() {
        assert_eq!(problems(&ok_members(), MAP), Vec::<String>::new());
    }

    #[test]
    fn an_edge_the_map_does_not_allow_fails() {
        let mut m = ok_members();
        m[2].deps.push(Dep { key: "kvx-a".into(), package: "kvx-a".into(), kind: "dev" });
        let p = problems(&m, MAP);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("kvx-c → kvx-a"), "{p:?}");
    }

    #[test]
    fn a_map_edge_up_the_floors_fails_and_a_stale_one_too() {
        let map = MAP.replace("kvx-b dataplane/b → kvx-a", "kvx-b dataplane/b → kvx-a kvx-c");
        let mut m = ok_members();
        m[1].deps.push(Dep { key: "kvx-c".into(), package: "kvx-c".into(), kind: "normal" });
        let p = problems(&m, &map);
        assert!(p.iter().any(|x| x.contains("runs up the floors")), "{p:?}");
        let p = problems(&ok_members(), &map);
        assert!(p.iter().any(|x| x.contains("not in the manifest")), "{p:?}");
    }

    #[test]
    fn a_crate_missing_from_the_map_or_in_the_wrong_folder_fails() {
        let mut m = ok_members();
        m.push(member("kvx-d", "control/d", &[]));
        m[0].dir = "dataplane/a".into();
        let p = problems(&m, MAP);
        assert!(p.iter().any(|x| x.contains("kvx-d: not in")), "{p:?}");
        assert!(p.iter().any(|x| x.contains("the crate-map says kernels")), "{p:?}");
    }

    #[test]
    fn a_name_counts_only_as_a_whole_word_outside_comments() {
        assert!(names("use serde::Serialize;", "serde"));
        assert!(names("#[derive(thiserror::Error)]", "thiserror"));
        assert!(!names("use serde_json::Value;", "serde"));
        assert!(!names("// serde::Serialize is used here", "serde"));
        assert!(!names("let my_serde = 1;", "serde"));
    }

    #[test]
    fn the_workspace_follows_the_rules() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("root");
        let mut p = Vec::new();
        check(root, &mut p).expect("check");
        assert!(p.is_empty(), "{p:#?}");
    }
}
