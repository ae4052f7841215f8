//! Standalone peer process for tests and benchmarks (see `kvx_xfer::peer`).
//!
//! Usage: `kvx-xfer-peer [--name N] [--mem BYTES]... [--file PATH:BYTES]... [--seed S]
//! [--listen ADDR] [--no-huge]`. Prints its metadata as one hex line, then serves until stdin
//! closes.

use std::process::ExitCode;

use kvx_xfer::HugePages;
use kvx_xfer::peer::{PeerConfig, serve_until_stdin_eof};

fn parse(args: &[String]) -> Result<PeerConfig, String> {
    let mut cfg = PeerConfig::new("peer");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--name" => cfg.name = val()?,
            "--mem" => cfg.mem.push(val()?.parse().map_err(|_| "bad --mem")?),
            "--file" => {
                let v = val()?;
                let (p, n) = v.rsplit_once(':').ok_or("--file wants PATH:BYTES")?;
                cfg.files.push((p.into(), n.parse().map_err(|_| "bad --file length")?));
            }
            "--seed" => cfg.fill_seed = Some(val()?.parse().map_err(|_| "bad --seed")?),
            "--listen" => cfg.tcp_listen = val()?.parse().map_err(|_| "bad --listen")?,
            "--no-huge" => cfg.hugepages = HugePages::Never,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(cfg)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvx-xfer-peer: {e}");
            return ExitCode::from(2);
        }
    };
    match serve_until_stdin_eof(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvx-xfer-peer: {e}");
            ExitCode::FAILURE
        }
    }
}
