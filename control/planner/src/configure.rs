//! `kvx configure`: a deployment's settings from the shape of the host it runs on, written as
//! the `KVX_*` environment file the systemd units read or as the `config:` map of the Helm
//! chart's values. Every setting carries the one-line reason it has its value.
//!
//! What it decides: the process layout (one-host `serve`, a `frontend`, or a `worker` of a
//! role), one engine shard per core, the host KV tier from the memory left over, the disk
//! tier's place, discovery and the listening address. With profiles, the layout search of
//! [`crate::layouts`] replaces the shards with the best layout's pools.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why the host could not be read.
#[derive(Debug, Error)]
pub enum ConfigureError {
    /// `/proc/meminfo` could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line of `/proc/meminfo` we need is missing or malformed.
    #[error("/proc/meminfo has no usable {0} line")]
    Meminfo(&'static str),
    /// A request that cannot be met.
    #[error("{0}")]
    Invalid(String),
}

/// What the host offers, read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostShape {
    /// Cores this process may run on.
    pub cores: usize,
    /// Physical memory, bytes.
    pub mem_total: u64,
    /// Memory available without swapping, bytes.
    pub mem_available: u64,
    /// Huge pages configured, and their size in bytes.
    pub hugepages: u64,
    /// Size of one huge page, bytes.
    pub hugepage_bytes: u64,
}

impl HostShape {
    /// Reads this host: the cores from the scheduler's affinity, memory from `/proc/meminfo`.
    pub fn read() -> Result<Self, ConfigureError> {
        let path = Path::new("/proc/meminfo");
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigureError::Read { path: path.into(), source })?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::from_meminfo(&text, cores)
    }

    /// The shape from the text of `/proc/meminfo` and a core count.
    pub fn from_meminfo(text: &str, cores: usize) -> Result<Self, ConfigureError> {
        let field = |name: &'static str| -> Option<u64> {
            let line = text.lines().find(|l| l.split(':').next() == Some(name))?;
            let mut it = line.split(':').nth(1)?.split_whitespace();
            let n: u64 = it.next()?.parse().ok()?;
            Some(match it.next() {
                Some("kB") => n.saturating_mul(1024),
                _ => n,
            })
        };
        let mem_total = field("MemTotal").ok_or(ConfigureError::Meminfo("MemTotal"))?;
        let mem_available = field("MemAvailable").unwrap_or(mem_total / 2);
        Ok(Self {
            cores: cores.max(1),
            mem_total,
            mem_available,
            hugepages: field("HugePages_Total").unwrap_or(0),
            hugepage_bytes: field("Hugepagesize").unwrap_or(2 << 20),
        })
    }
}

/// Which process the settings are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `kvx serve`: the HTTP API and the engine shards in one process.
    Serve,
    /// `kvx frontend`: the HTTP API and router over remote workers.
    Frontend,
    /// `kvx worker` of this role (`agg`, `prefill` or `decode`).
    Worker(&'static str),
    /// A frontend and this many worker processes on one host, sharing one settings file
    /// (the systemd units of deploy/systemd: each worker's own file adds its role and disk
    /// tier).
    Host(usize),
}

impl Layout {
    /// The layout of a name: `serve`, `frontend`, `worker`, `prefill`, `decode`, `agg`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "serve" => Self::Serve,
            "frontend" => Self::Frontend,
            "worker" | "agg" => Self::Worker("agg"),
            "prefill" => Self::Worker("prefill"),
            "decode" => Self::Worker("decode"),
            "host" => Self::Host(1),
            _ => return None,
        })
    }

    fn runs_engines(self) -> bool {
        !matches!(self, Self::Frontend)
    }

    /// Engine processes that share the host's cores.
    fn engine_processes(self) -> usize {
        match self {
            Self::Host(n) => n.max(1),
            _ => 1,
        }
    }

    fn serves_http(self) -> bool {
        !matches!(self, Self::Worker(_))
    }

    /// The layout with `n` workers, for [`Layout::Host`]; others are unchanged.
    pub fn with_workers(self, n: usize) -> Self {
        match self {
            Self::Host(_) => Self::Host(n.max(1)),
            other => other,
        }
    }
}

/// What the operator asks for.
#[derive(Debug, Clone)]
pub struct Request {
    /// The process layout.
    pub layout: Layout,
    /// Address the HTTP API listens on.
    pub host: String,
    /// HTTP port.
    pub port: u16,
    /// kvx's home (model store), e.g. systemd's `StateDirectory`.
    pub home: PathBuf,
    /// The model (catalogue name or GGUF path); `None` leaves the default.
    pub model: Option<String>,
    /// Directory of the disk KV tier; `None` for none.
    pub kv_disk: Option<PathBuf>,
    /// Whether to keep a host-memory KV tier.
    pub kv_host: bool,
    /// etcd endpoints for discovery (comma-separated); `None` for a single host.
    pub etcd: Option<String>,
    /// The frontend's worker-plane address a worker connects to without discovery.
    pub frontend: Option<String>,
}

/// One setting and why it has its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The `KVX_*` variable.
    pub key: &'static str,
    /// Its value.
    pub value: String,
    /// One line on why.
    pub why: String,
}

/// The settings for one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The host they were made for.
    pub shape: HostShape,
    /// The settings, in the order written.
    pub settings: Vec<Setting>,
}

/// Settings the Helm chart gives its pods itself.
const CHART_SETS: &[&str] = &[
    "KVX_HOME",
    "KVX_HOST",
    "KVX_PORT",
    "KVX_KV_DISK",
    "KVX_WORKER_LISTEN",
    "KVX_FRONTEND",
    "KVX_ROLE",
    "KVX_DISCOVERY",
    "KVX_ETCD_ENDPOINTS",
];

/// The worker plane of a one-host layout.
const HOST_PLANE: &str = "127.0.0.1:7100";

/// Host KV tier: a quarter of the available memory, at most this much.
const HOST_TIER_MAX: u64 = 64 << 30;
/// Below this much available memory no host tier is proposed.
const HOST_TIER_MIN_AVAILABLE: u64 = 2 << 30;

/// The settings for `req` on a host of `shape`.
pub fn plan(shape: HostShape, req: &Request) -> Result<Settings, ConfigureError> {
    if req.host.is_empty() {
        return Err(ConfigureError::Invalid("the listening address is empty".into()));
    }
    let mut out = Vec::new();
    let mut set = |key: &'static str, value: String, why: String| {
        out.push(Setting { key, value, why });
    };
    set("KVX_HOME", req.home.display().to_string(), "the model store and caches".into());
    if let Some(m) = &req.model {
        set("KVX_MODEL", m.clone(), "the model served".into());
    }
    if req.layout.serves_http() {
        let why = if req.host == "127.0.0.1" || req.host == "::1" {
            "loopback only; put a TLS proxy in front or set 0.0.0.0 with --tls-cert".to_string()
        } else {
            "reachable from the network: pair with TLS and API keys (SECURITY.md)".to_string()
        };
        set("KVX_HOST", req.host.clone(), why);
        set("KVX_PORT", req.port.to_string(), "the OpenAI-compatible API and /metrics".into());
    }
    if let Layout::Worker(role) = req.layout {
        set("KVX_ROLE", role.to_string(), "the pool this worker serves".into());
    }
    if req.layout.runs_engines() {
        let procs = req.layout.engine_processes();
        let shards = (shape.cores / procs).max(1);
        let why = if procs > 1 {
            format!("one engine shard per core: {} cores over {procs} workers", shape.cores)
        } else {
            format!("one engine shard per core ({} cores here)", shape.cores)
        };
        set("KVX_SHARDS", shards.to_string(), why);
        set(
            "KVX_THREADS_PER_SHARD",
            "1".into(),
            "a shard computes on its own core; more shards beat wider shards".into(),
        );
        if req.kv_host && shape.mem_available >= HOST_TIER_MIN_AVAILABLE {
            let all = (shape.mem_available / 4).min(HOST_TIER_MAX);
            let bytes = (all / shape.cores as u64) & !((1 << 20) - 1);
            set(
                "KVX_KV_HOST_BYTES",
                bytes.to_string(),
                format!(
                    "host KV tier per shard: a quarter of the {:.1} GiB available (at most {} GiB) over {} shards",
                    gib(shape.mem_available),
                    HOST_TIER_MAX >> 30,
                    shape.cores
                ),
            );
        }
        if let (Some(dir), false) = (&req.kv_disk, matches!(req.layout, Layout::Host(_))) {
            set(
                "KVX_KV_DISK",
                dir.display().to_string(),
                "disk KV tier: blocks survive restarts (16 GiB per shard unless KVX_KV_DISK_BYTES)"
                    .into(),
            );
        }
    }
    if let Layout::Host(_) = req.layout {
        set(
            "KVX_WORKER_LISTEN",
            HOST_PLANE.into(),
            "the frontend's worker plane, on loopback: this host's workers join it".into(),
        );
    }
    match (&req.etcd, req.layout) {
        (Some(endpoints), Layout::Frontend | Layout::Worker(_) | Layout::Host(_)) => {
            set("KVX_DISCOVERY", "etcd".into(), "workers and frontends find each other".into());
            set("KVX_ETCD_ENDPOINTS", endpoints.clone(), "the etcd cluster".into());
        }
        (None, Layout::Host(_)) => set(
            "KVX_FRONTEND",
            HOST_PLANE.into(),
            "workers join the frontend on this host (each disk tier: worker-ROLE.env)".into(),
        ),
        (None, Layout::Worker(_)) => match &req.frontend {
            Some(f) => set("KVX_FRONTEND", f.clone(), "the frontend's worker plane".into()),
            None => {
                return Err(ConfigureError::Invalid(
                    "a worker needs --etcd or --frontend to find its frontend".into(),
                ));
            }
        },
        _ => {}
    }
    Ok(Settings { shape, settings: out })
}

fn gib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 30)
}

impl Settings {
    /// Sets `setting`, in place of one with its key (a layout's shards replace the
    /// one-shard-per-core default; the shards of a role and `KVX_SHARDS` exclude each other).
    pub fn set(&mut self, setting: Setting) {
        if matches!(setting.key, "KVX_PREFILL_SHARDS" | "KVX_DECODE_SHARDS") {
            self.settings.retain(|s| s.key != "KVX_SHARDS");
        }
        match self.settings.iter_mut().find(|s| s.key == setting.key) {
            Some(s) => *s = setting,
            None => self.settings.push(setting),
        }
    }

    /// Applies a layout's settings ([`crate::layouts::Search::settings`]): each replaces its
    /// key, and the host KV tier, sized per shard for one shard per core, is sized again for
    /// the layout's shards (the same memory over them).
    pub fn apply_layout(&mut self, layout: Vec<Setting>) {
        let shards = |set: &Self| -> u64 {
            let get = |k: &str| {
                set.settings.iter().find(|s| s.key == k).and_then(|s| s.value.parse::<u64>().ok())
            };
            get("KVX_SHARDS")
                .unwrap_or_else(|| {
                    get("KVX_PREFILL_SHARDS").unwrap_or(0) + get("KVX_DECODE_SHARDS").unwrap_or(0)
                })
                .max(1)
        };
        let before = shards(self);
        for s in layout {
            self.set(s);
        }
        let after = shards(self);
        let tier = self.settings.iter_mut().find(|s| s.key == "KVX_KV_HOST_BYTES");
        if let Some((t, per)) = tier.and_then(|t| t.value.parse::<u64>().ok().map(|v| (t, v))) {
            let all = per.saturating_mul(before);
            t.value = ((all / after) & !((1 << 20) - 1)).to_string();
            t.why = format!(
                "host KV tier per shard: {} MiB over the layout's {after} shards",
                all >> 20
            );
        }
    }

    fn header(&self) -> String {
        let s = &self.shape;
        let mut h = format!(
            "# Written by `kvx configure` for a host with {} cores, {:.1} GiB memory ({:.1} GiB available)",
            s.cores,
            gib(s.mem_total),
            gib(s.mem_available)
        );
        if s.hugepages > 0 {
            let _ = write!(h, ", {} huge pages of {} KiB", s.hugepages, s.hugepage_bytes >> 10);
        }
        h.push_str(".\n");
        h
    }

    /// As an environment file (systemd `EnvironmentFile=`): `# why` above each `KEY=value`.
    pub fn to_env(&self) -> String {
        let mut out = self.header();
        for s in &self.settings {
            let _ = write!(out, "\n# {}\n{}={}\n", s.why, s.key, env_quote(&s.value));
        }
        out
    }

    /// As the Helm chart's `config:` values (a map of `KVX_*` to strings), without the
    /// settings the chart itself sets (paths, addresses and ports of its pods): what is left
    /// is sized for pods shaped like the host this ran on.
    pub fn to_helm(&self) -> String {
        let mut out = self.header();
        out.push_str("# Sized for worker pods with this host's cores and memory.\nconfig:\n");
        for s in self.settings.iter().filter(|s| !CHART_SETS.contains(&s.key)) {
            let _ = write!(out, "  # {}\n  {}: {}\n", s.why, s.key, yaml_quote(&s.value));
        }
        out
    }
}

/// Writes `text` to `path` as a settings file: readable by owner and group only (it may name
/// key files), its directory created, replaced whole (written aside, then renamed).
pub fn write_settings(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o640)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// systemd's `EnvironmentFile=` quoting: plain when safe, else double quotes with `\` escapes.
fn env_quote(v: &str) -> String {
    if !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || "/._-:,@+=".contains(c)) {
        return v.to_string();
    }
    let mut q = String::with_capacity(v.len() + 2);
    q.push('"');
    for c in v.chars() {
        if matches!(c, '"' | '\\' | '$' | '`') {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

/// A YAML double-quoted string (values are always strings for the ConfigMap).
fn yaml_quote(v: &str) -> String {
    let mut q = String::with_capacity(v.len() + 2);
    q.push('"');
    for c in v.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24576000 kB\nMemFree:         1000 kB\n\
        MemAvailable:   20000000 kB\nHugePages_Total:      64\nHugepagesize:       2048 kB\n";

    fn req(layout: Layout) -> Request {
        Request {
            layout,
            host: "127.0.0.1".into(),
            port: 8000,
            home: "/var/lib/kvx".into(),
            model: None,
            kv_disk: Some("/var/lib/kvx/kv".into()),
            kv_host: true,
            etcd: None,
            frontend: None,
        }
    }

    fn get<'a>(s: &'a Settings, key: &str) -> Option<&'a str> {
        s.settings.iter().find(|x| x.key == key).map(|x| x.value.as_str())
    }

    /// A layout's shards replace one shard per core; the host tier's memory is spread over
    /// them; shards of roles and `KVX_SHARDS` never stand together.
    #[test]
    fn a_layout_replaces_the_shards_and_resizes_the_host_tier() {
        let shape = HostShape::from_meminfo(MEMINFO, 8).unwrap();
        let mut s = plan(shape, &req(Layout::Serve)).unwrap();
        let per8: u64 = get(&s, "KVX_KV_HOST_BYTES").unwrap().parse().unwrap();
        let set = |key: &'static str, v: &str| Setting { key, value: v.into(), why: String::new() };
        s.apply_layout(vec![set("KVX_PREFILL_SHARDS", "1"), set("KVX_DECODE_SHARDS", "3")]);
        assert_eq!(get(&s, "KVX_SHARDS"), None);
        assert_eq!(get(&s, "KVX_DECODE_SHARDS"), Some("3"));
        let per4: u64 = get(&s, "KVX_KV_HOST_BYTES").unwrap().parse().unwrap();
        assert_eq!(per4, (per8 * 8 / 4) & !((1 << 20) - 1));
        assert_eq!(s.settings.iter().filter(|x| x.key == "KVX_DECODE_SHARDS").count(), 1);
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let s = HostShape::from_meminfo(MEMINFO, 8).unwrap();
        assert_eq!(s.mem_total, 24_576_000 * 1024);
        assert_eq!(s.mem_available, 20_000_000 * 1024);
        assert_eq!((s.hugepages, s.hugepage_bytes), (64, 2 << 20));
        assert!(matches!(
            HostShape::from_meminfo("MemFree: 1 kB\n", 2),
            Err(ConfigureError::Meminfo("MemTotal"))
        ));
    }

    #[test]
    fn serve_gets_a_shard_per_core_and_a_host_tier() {
        let shape = HostShape::from_meminfo(MEMINFO, 8).unwrap();
        let s = plan(shape, &req(Layout::Serve)).unwrap();
        assert_eq!(get(&s, "KVX_SHARDS"), Some("8"));
        let host: u64 = get(&s, "KVX_KV_HOST_BYTES").unwrap().parse().unwrap();
        assert_eq!(host, (20_000_000u64 * 1024 / 4 / 8) & !((1 << 20) - 1));
        assert_eq!(get(&s, "KVX_KV_DISK"), Some("/var/lib/kvx/kv"));
        assert_eq!(get(&s, "KVX_PORT"), Some("8000"));
        assert_eq!(get(&s, "KVX_ROLE"), None);
    }

    #[test]
    fn small_hosts_get_no_host_tier_and_frontends_no_engines() {
        let small = HostShape::from_meminfo("MemTotal: 1048576 kB\nMemAvailable: 900000 kB\n", 2);
        let s = plan(small.unwrap(), &req(Layout::Serve)).unwrap();
        assert_eq!(get(&s, "KVX_KV_HOST_BYTES"), None);
        let shape = HostShape::from_meminfo(MEMINFO, 8).unwrap();
        let mut r = req(Layout::Frontend);
        r.etcd = Some("http://10.0.0.1:2379".into());
        let f = plan(shape, &r).unwrap();
        assert_eq!(get(&f, "KVX_SHARDS"), None);
        assert_eq!(get(&f, "KVX_DISCOVERY"), Some("etcd"));
    }

    #[test]
    fn a_worker_needs_a_way_to_its_frontend() {
        let shape = HostShape::from_meminfo(MEMINFO, 4).unwrap();
        let r = req(Layout::parse("decode").unwrap());
        assert!(matches!(plan(shape, &r), Err(ConfigureError::Invalid(_))));
        let mut r = r;
        r.frontend = Some("10.0.0.2:9000".into());
        let s = plan(shape, &r).unwrap();
        assert_eq!(get(&s, "KVX_ROLE"), Some("decode"));
        assert_eq!(get(&s, "KVX_HOST"), None, "workers serve no HTTP");
    }

    #[test]
    fn a_host_layout_splits_cores_over_its_workers_and_joins_them_on_loopback() {
        let shape = HostShape::from_meminfo(MEMINFO, 8).unwrap();
        let s = plan(shape, &req(Layout::parse("host").unwrap().with_workers(2))).unwrap();
        assert_eq!(get(&s, "KVX_SHARDS"), Some("4"));
        assert_eq!(get(&s, "KVX_FRONTEND"), Some("127.0.0.1:7100"));
        assert_eq!(get(&s, "KVX_WORKER_LISTEN"), Some("127.0.0.1:7100"));
        assert_eq!(get(&s, "KVX_KV_DISK"), None, "each worker has its own disk tier");
        assert_eq!(get(&s, "KVX_ROLE"), None, "the unit's instance gives the role");
        let mut r = req(Layout::Host(2));
        r.etcd = Some("http://127.0.0.1:2379".into());
        let s = plan(shape, &r).unwrap();
        assert_eq!(get(&s, "KVX_FRONTEND"), None);
        assert_eq!(get(&s, "KVX_DISCOVERY"), Some("etcd"));
    }

    #[test]
    fn settings_files_are_private_and_replaced_whole() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("kvx-configure-{}", std::process::id()));
        let path = dir.join("etc/kvx.env");
        write_settings(&path, "KVX_PORT=1\n").unwrap();
        write_settings(&path, "KVX_PORT=2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "KVX_PORT=2\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        assert!(!path.with_extension("tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn env_and_helm_quote_what_needs_it() {
        assert_eq!(env_quote("/var/lib/kvx"), "/var/lib/kvx");
        assert_eq!(env_quote("a b\"$"), "\"a b\\\"\\$\"");
        assert_eq!(yaml_quote("x\"y"), "\"x\\\"y\"");
        let shape = HostShape::from_meminfo(MEMINFO, 2).unwrap();
        let mut r = req(Layout::Serve);
        r.model = Some("/models/my model.gguf".into());
        let s = plan(shape, &r).unwrap();
        let env = s.to_env();
        assert!(env.contains("\nKVX_MODEL=\"/models/my model.gguf\"\n"), "{env}");
        assert!(env.starts_with("# Written by `kvx configure` for a host with 2 cores"));
        let helm = s.to_helm();
        assert!(helm.contains("config:\n"));
        assert!(helm.contains("  KVX_SHARDS: \"2\"\n"), "{helm}");
        assert!(!helm.contains("KVX_HOME") && !helm.contains("KVX_KV_DISK"), "{helm}");
    }
}
