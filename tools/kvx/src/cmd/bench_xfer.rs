//! `kvx bench xfer`: KV transfer bandwidth and latency for the shm, tcp and file backends.
//!
//! Starts the remote side itself (a child `kvx bench xfer --serve-peer`) unless `--peer`
//! gives the metadata a running one printed; the file backend needs no peer.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use kvx_xfer::bench::{BenchConfig, BenchReport};
use kvx_xfer::peer::PeerConfig;
use kvx_xfer::{AgentMetadata, Backend, HugePages, Op, ZeroCopy};

/// Arguments of `kvx bench xfer`.
#[derive(Debug, clap::Args)]
pub(crate) struct XferArgs {
    /// Backend: shm (same host), tcp (io_uring sockets) or file (O_DIRECT io_uring).
    #[arg(long, default_value = "shm", value_parser = ["shm", "tcp", "file"], env = "KVX_BENCH_XFER_BACKEND")]
    backend: String,
    /// Direction seen from this side: write (push to the peer / file) or read.
    #[arg(long, default_value = "write", value_parser = ["read", "write"])]
    op: String,
    /// Bytes per block (suffixes K, M, G).
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    block_size: u64,
    /// Blocks in the pool on each side (the pool is walked, so a large one keeps blocks cold).
    #[arg(long, default_value_t = 16384)]
    blocks: u64,
    /// Blocks (descriptors) per transfer.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Transfers kept in flight.
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Unmeasured warm-up seconds per run.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Runs (each printed; take the median).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Use a running peer instead of starting one: the metadata line it printed (hex, key
    /// included: a peer admits only holders of its key), or `@FILE` holding that line.
    #[arg(long)]
    peer: Option<String>,
    /// Backing file for the file backend (default: a temporary file, removed afterwards).
    #[arg(long, env = "KVX_BENCH_XFER_FILE")]
    file: Option<PathBuf>,
    /// Use normal pages even when hugepages are reserved.
    #[arg(long)]
    no_huge: bool,
    /// Blocks at least this large are copied with non-temporal stores (shm).
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    nt_threshold: u64,
    /// Threads copying shm transfers; each takes whole transfers, so with several in flight
    /// that many stream at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    copy_threads: u16,
    /// io_uring threads on each side (tcp): each drives its own connection, transfers take
    /// them in turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    tcp_threads: u16,
    /// Send a notification with every transfer.
    #[arg(long)]
    notify: bool,
    /// Zero-copy TCP sends: auto keeps them only where the kernel does not copy anyway.
    #[arg(long, default_value = "auto", value_parser = ["auto", "always", "never"])]
    zero_copy: String,
    /// Print one JSON object per run instead of a text line.
    #[arg(long)]
    json: bool,
    /// Serve as the remote side (prints metadata, runs until stdin closes).
    #[arg(long, hide = true)]
    serve_peer: bool,
    /// Pool bytes of a served peer (default: block size × blocks).
    #[arg(long, hide = true, value_parser = parse_size)]
    peer_mem: Option<u64>,
    /// TCP listen address of a served peer.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("`{s}` is not a size (e.g. 65536, 64K, 4M)"))
}

/// The child peer; closing its stdin ends it.
struct SpawnedPeer {
    child: Child,
}

impl Drop for SpawnedPeer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn spawn_peer(
    pool: u64,
    no_huge: bool,
    tcp_threads: u16,
) -> anyhow::Result<(SpawnedPeer, AgentMetadata)> {
    let exe = std::env::current_exe().context("locating the kvx binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "xfer", "--serve-peer", "--peer-mem", &pool.to_string()]);
    cmd.args(["--tcp-threads", &tcp_threads.to_string()]);
    if no_huge {
        cmd.arg("--no-huge");
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let out = child.stdout.take().context("peer stdout")?;
    let peer = SpawnedPeer { child };
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).context("reading peer metadata")?;
    let md = AgentMetadata::from_hex(&line).context("peer metadata")?;
    Ok((peer, md))
}

pub(crate) fn run(a: XferArgs) -> anyhow::Result<()> {
    let hugepages = if a.no_huge { HugePages::Never } else { HugePages::Auto };
    let pool = a.block_size.checked_mul(a.blocks).context("pool size overflows")?;
    if a.serve_peer {
        let mut cfg = PeerConfig::new("bench-peer");
        cfg.mem = vec![a.peer_mem.unwrap_or(pool)];
        cfg.tcp_listen = a.listen;
        cfg.hugepages = hugepages;
        cfg.tcp_threads = usize::from(a.tcp_threads);
        kvx_xfer::peer::serve_until_stdin_eof(&cfg)?;
        return Ok(());
    }
    let backend: Backend = a.backend.parse()?;
    let op = if a.op == "read" { Op::Read } else { Op::Write };
    let (tmp_file, file) = match &a.file {
        Some(f) => (false, f.clone()),
        None => {
            (true, std::env::temp_dir().join(format!("kvx-bench-xfer-{}.dat", std::process::id())))
        }
    };
    let cfg = BenchConfig {
        backend,
        op,
        block_size: a.block_size,
        blocks: a.blocks,
        batch: a.batch,
        inflight: a.inflight,
        duration: Duration::from_secs_f64(a.secs.max(0.1)),
        warmup: Duration::from_secs_f64(a.warmup.max(0.0)),
        hugepages,
        nt_threshold: usize::try_from(a.nt_threshold).unwrap_or(usize::MAX),
        copy_threads: usize::from(a.copy_threads),
        tcp_threads: usize::from(a.tcp_threads),
        file: file.clone(),
        notify: a.notify,
        zero_copy: match a.zero_copy.as_str() {
            "always" => ZeroCopy::Always,
            "never" => ZeroCopy::Never,
            _ => ZeroCopy::Auto,
        },
    };
    let mut _peer = None;
    let md = match (backend, a.peer.clone()) {
        (Backend::File, _) => None,
        (_, Some(spec)) => {
            let line = match spec.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path)
                    .with_context(|| format!("reading the peer's metadata from {path}"))?,
                None => spec,
            };
            let line = line.lines().next().unwrap_or("").trim().to_owned();
            Some(AgentMetadata::from_hex(&line).context("--peer: the peer's metadata line")?)
        }
        _ => {
            let (p, md) = spawn_peer(pool, a.no_huge, a.tcp_threads)?;
            _peer = Some(p);
            Some(md)
        }
    };
    let mut reports: Vec<BenchReport> = Vec::with_capacity(a.runs);
    let result = (|| -> anyhow::Result<()> {
        for _ in 0..a.runs.max(1) {
            let r = kvx_xfer::bench::run(&cfg, md.as_ref())?;
            let mut out = std::io::stdout().lock();
            if a.json {
                writeln!(out, "{}", serde_json::to_string(&r)?)?;
            } else {
                writeln!(out, "{}", r.line())?;
            }
            reports.push(r);
        }
        Ok(())
    })();
    if tmp_file {
        let _ = std::fs::remove_file(&file);
    }
    result?;
    if reports.len() > 1 && !a.json {
        let mut g: Vec<f64> = reports.iter().map(|r| r.gbps).collect();
        g.sort_by(f64::total_cmp);
        println!("median {:.3} GB/s over {} runs", g[g.len() / 2], g.len());
    }
    if reports.is_empty() {
        bail!("no run completed");
    }
    if !a.json && !a.no_huge && reports.iter().any(|r| !r.hugepages) {
        eprintln!(
            "note: the pools are on 4 KiB pages (no 2 MiB hugepages reserved); reserving some \
             (/proc/sys/vm/nr_hugepages, 512 per GiB of pool on each side) sped one shm copy \
             thread up by a quarter where measured"
        );
    }
    Ok(())
}
