//! `kvx model`: pull, list and locate models in the store.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};

use kvx_worker::store::{CATALOGUE, DEFAULT, Store};

#[derive(Debug, Args)]
pub(crate) struct ModelArgs {
    #[command(subcommand)]
    cmd: ModelCmd,
}

#[derive(Debug, Subcommand)]
enum ModelCmd {
    /// Fetch a model into the store (the default model when no name is given).
    Pull {
        /// Catalogue name.
        name: Option<String>,
    },
    /// List the catalogue and what the store holds.
    List,
    /// Print the path of a model file, pulling it first if needed.
    Path {
        /// Catalogue name or path to a GGUF file (default: the default model).
        name: Option<String>,
    },
    /// Re-hash every pulled model against its pinned checksum.
    Verify,
}

pub(crate) fn run(args: ModelArgs, store: &Store) -> Result<()> {
    match args.cmd {
        ModelCmd::Pull { name } => {
            let k = match name.as_deref() {
                None => DEFAULT,
                Some(n) => match CATALOGUE.iter().find(|k| k.name == n) {
                    Some(k) => *k,
                    None => bail!("unknown model {n:?}; `kvx model list` shows the catalogue"),
                },
            };
            let path = store.ensure(&k)?;
            println!("{}", path.display());
        }
        ModelCmd::List => {
            let have = store.list();
            for k in CATALOGUE {
                let status = match have.iter().find(|(h, _, _)| h.name == k.name) {
                    Some((_, p, len)) => {
                        format!("pulled  {} ({:.1} MB)", p.display(), *len as f64 / 1e6)
                    }
                    None => "not pulled".to_string(),
                };
                let default = if k.name == DEFAULT.name { " (default)" } else { "" };
                println!("{}{default}\n  {}\n  {status}", k.name, k.about);
            }
        }
        ModelCmd::Path { name } => {
            let path: PathBuf = store.resolve(name.as_deref())?;
            println!("{}", path.display());
        }
        ModelCmd::Verify => {
            for (k, p, _) in store.list() {
                let ok = store.verify(&k)?;
                println!("{} {} {}", if ok { "ok " } else { "BAD" }, k.name, p.display());
                if !ok {
                    bail!(
                        "{} does not match its pinned sha256; delete it and pull again",
                        p.display()
                    );
                }
            }
        }
    }
    Ok(())
}
