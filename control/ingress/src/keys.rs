//! API keys: the fixed keys of the configuration (`--api-key`, and `--admin-key` for the admin
//! endpoints only) and those of a keys file (one key a line, optionally followed by the models
//! it may use and by its limits), checked in constant time and re-read on demand
//! ([`ApiKeys::reload`]) without disturbing requests already admitted.
//!
//! The file's format:
//!
//! ```text
//! # a comment; blank lines are ignored
//! sk-team-a                                     every model
//! sk-team-b   model-x,model-y                   only these
//! sk-team-c   *  concurrency=4 rpm=600 tpm=100000
//! sk-team-d   model-x  rpm=60                   only model-x, 60 requests a minute
//! sk-ops      *  admin                          every model, and `/metrics`
//! ```
//!
//! After the key come, separated by whitespace, an optional model list (comma-separated; `*`
//! or no list at all: every model) and optional fields. A token holding `=`, or the word
//! `admin`, is a field (so no model can be called `admin` or hold a `=`); fields follow the
//! model list. The fields:
//!
//! * `concurrency=N`: the key's requests running at once (admitted and not ended, streams
//!   included) at most;
//! * `rpm=N`: requests per minute, `tpm=N`: tokens per minute, each a token bucket holding N
//!   and refilled continuously (N a minute). A request takes one from `rpm` and its prompt
//!   tokens from `tpm` when it is admitted (a prompt larger than N needs a full bucket); its
//!   completion tokens are taken from `tpm` as they are produced, which may leave the
//!   bucket in debt (down to -N) so that the key's next request waits;
//! * `admin`: the key may read the admin endpoints (`/metrics`); it is also a normal key
//!   for its models.
//!
//! A key listed twice gets both lines' models; it is an admin key if either line says so;
//! a limit may be given on either line, or on both with one value. A request above a limit
//! is refused ([`Access::admit`] says which limit and for how long). A key's counts live as
//! long as the key: a reload that keeps the key keeps its running requests and buckets (a
//! bucket resized to a new limit keeps its level, at most the new size), one that drops the
//! key drops them. Keys given on the command line have no limits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::error::IngressError;

/// What a key may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// Every model.
    All,
    /// Only these models.
    Models(Arc<[String]>),
}

impl Grant {
    /// Whether the key may use `model`.
    pub fn allows(&self, model: &str) -> bool {
        match self {
            Grant::All => true,
            Grant::Models(m) => m.iter().any(|x| x == model),
        }
    }

    /// No model (a key for the admin endpoints only).
    fn none() -> Grant {
        Grant::Models(Arc::from(Vec::new()))
    }

    /// What a key listed twice may use: everything either line grants.
    fn merge(self, other: Grant) -> Grant {
        match (self, other) {
            (Grant::Models(a), Grant::Models(b)) => {
                let mut v = a.to_vec();
                v.extend(b.iter().filter(|m| !a.contains(m)).cloned());
                Grant::Models(v.into())
            }
            _ => Grant::All,
        }
    }
}

/// A key's limits (none: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Requests running at once at most.
    pub concurrency: Option<u32>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens (prompt and completion) per minute.
    pub tpm: Option<u32>,
}

impl Limits {
    /// Whether no limit is set.
    pub fn is_none(&self) -> bool {
        *self == Limits::default()
    }
}

/// One key of a keys file, with all its lines merged. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyLine {
    /// The key.
    pub key: String,
    /// The models it may use.
    pub grant: Grant,
    /// Its limits.
    pub limits: Limits,
    /// Whether it may read the admin endpoints.
    pub admin: bool,
}

impl std::fmt::Debug for KeyLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyLine")
            .field("grant", &self.grant)
            .field("limits", &self.limits)
            .field("admin", &self.admin)
            .finish_non_exhaustive()
    }
}

const FIELDS: &str = "concurrency=N, rpm=N, tpm=N, admin";

/// Whether a token after the key is a field rather than (part of) the model list.
fn is_field(t: &str) -> bool {
    t.contains('=') || t == "admin"
}

/// The keys of a keys file's text, in file order; a key listed twice appears once, with both
/// lines merged (see the module docs). The error names the line at fault, never a key.
pub fn parse(text: &str) -> Result<Vec<KeyLine>, String> {
    let mut out: Vec<KeyLine> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = strip_comment(line.trim_start_matches('\u{feff}')).trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| format!("line {}: {why}", i + 1);
        let mut tokens = line.split_whitespace();
        let Some(key) = tokens.next() else { continue };
        let rest: Vec<&str> = tokens.collect();
        let split = rest.iter().position(|t| is_field(t)).unwrap_or(rest.len());
        let (models, fields) = rest.split_at(split);
        let grant = parse_models(&models.join(" ")).map_err(at)?;
        let (limits, admin) = parse_fields(fields).map_err(at)?;
        match seen.get(key) {
            Some(&j) => {
                let old = &mut out[j];
                old.grant = std::mem::replace(&mut old.grant, Grant::All).merge(grant);
                old.admin |= admin;
                old.limits = merge_limits(old.limits, limits).map_err(at)?;
            }
            None => {
                seen.insert(key.to_string(), out.len());
                out.push(KeyLine { key: key.to_string(), grant, limits, admin });
            }
        }
    }
    Ok(out)
}

/// A line's model list (`""`: every model).
fn parse_models(list: &str) -> Result<Grant, String> {
    if list.is_empty() {
        return Ok(Grant::All);
    }
    let mut models = Vec::new();
    for m in list.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        if m.contains(char::is_whitespace) {
            return Err(format!(
                "`{m}`: expected KEY, then optionally MODEL[,MODEL...] (model names are \
                 separated by commas), then optionally fields ({FIELDS})"
            ));
        }
        if m == "*" {
            return Ok(Grant::All);
        }
        if !models.iter().any(|x| x == m) {
            models.push(m.to_string());
        }
    }
    if models.is_empty() {
        return Err("an empty model list (leave it out, or write `*`, to allow every model)".into());
    }
    Ok(Grant::Models(models.into()))
}

/// A line's fields.
fn parse_fields(fields: &[&str]) -> Result<(Limits, bool), String> {
    let mut limits = Limits::default();
    let mut admin = false;
    for &f in fields {
        if !is_field(f) {
            return Err(format!("`{f}`: the model list comes before the fields ({FIELDS})"));
        }
        if f == "admin" {
            admin = true;
            continue;
        }
        let (name, value) = f.split_once('=').unwrap_or((f, ""));
        let slot = match name {
            "concurrency" => &mut limits.concurrency,
            "rpm" => &mut limits.rpm,
            "tpm" => &mut limits.tpm,
            "admin" => return Err(format!("`{f}`: `admin` takes no value")),
            _ => return Err(format!("`{f}`: unknown field (the fields: {FIELDS})")),
        };
        let n: u32 =
            value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                format!("`{f}`: {name} takes a whole number from 1 to {}", u32::MAX)
            })?;
        if slot.replace(n).is_some() {
            return Err(format!("`{name}` given twice"));
        }
    }
    Ok((limits, admin))
}

/// The limits of a key listed twice: each from whichever line gives it; both lines may give
/// one only with the same value.
fn merge_limits(a: Limits, b: Limits) -> Result<Limits, String> {
    let one = |name: &str, x: Option<u32>, y: Option<u32>| match (x, y) {
        (Some(x), Some(y)) if x != y => {
            Err(format!("`{name}={y}` for a key an earlier line gives `{name}={x}` (give it once)"))
        }
        _ => Ok(x.or(y)),
    };
    Ok(Limits {
        concurrency: one("concurrency", a.concurrency, b.concurrency)?,
        rpm: one("rpm", a.rpm, b.rpm)?,
        tpm: one("tpm", a.tpm, b.tpm)?,
    })
}

/// `line` up to a `#` that starts it or follows whitespace.
fn strip_comment(line: &str) -> &str {
    let mut after_space = true;
    for (i, c) in line.char_indices() {
        if c == '#' && after_space {
            return &line[..i];
        }
        after_space = c.is_whitespace();
    }
    line
}

/// A token bucket of `size` tokens refilled continuously at `size` a minute. Every method
/// takes the time as `now` (never earlier than the last call's; an earlier one counts as
/// the same instant).
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    size: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket of `per_minute` tokens.
    pub fn full(per_minute: u32, now: Instant) -> Bucket {
        let size = f64::from(per_minute.max(1));
        Bucket { size, level: size, at: now }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.size / 60.0).min(self.size);
        self.at = self.at.max(now);
    }

    /// The tokens it holds at `now` (below zero while in debt).
    pub fn level(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.level
    }

    /// How long from `now` until it holds `n` tokens (at most its size): zero if it does.
    pub fn wait(&mut self, n: u64, now: Instant) -> Duration {
        self.refill(now);
        let need = (n as f64).min(self.size);
        if self.level >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.level) * 60.0 / self.size)
        }
    }

    /// Takes `n` tokens, going into debt if it holds fewer (never below minus its size).
    pub fn take(&mut self, n: u64, now: Instant) {
        self.refill(now);
        self.level = (self.level - n as f64).max(-self.size);
    }

    /// Gives it a new size (`per_minute`), keeping its level (at most the new size).
    pub fn resize(&mut self, per_minute: u32, now: Instant) {
        self.refill(now);
        self.size = f64::from(per_minute.max(1));
        self.level = self.level.min(self.size);
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// `concurrency`.
    Concurrency,
    /// `rpm`.
    Rpm,
    /// `tpm`.
    Tpm,
}

impl Limit {
    /// Its name in the keys file (and the `reason` label of the refusals' metric).
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Concurrency => "concurrency",
            Limit::Rpm => "rpm",
            Limit::Tpm => "tpm",
        }
    }
}

/// A request refused by its key's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The first limit in the way (`concurrency`, then `rpm`, then `tpm`).
    pub limit: Limit,
    /// That limit's value.
    pub value: u32,
    /// When every limit in the way would let the request in, as far as known now (for
    /// `concurrency`, which waits on other requests, one second).
    pub retry_after: Duration,
}

impl Refusal {
    /// `retry_after` in whole seconds, rounded up (past a microsecond's rounding slack), at
    /// least 1 (`Retry-After`).
    pub fn retry_after_secs(&self) -> u32 {
        let s = (self.retry_after.as_secs_f64() - 1e-6).ceil();
        if s >= f64::from(u32::MAX) { u32::MAX } else { (s as u32).max(1) }
    }

    /// What the client is told.
    pub fn message(&self) -> String {
        let what = match self.limit {
            Limit::Concurrency => "requests at once",
            Limit::Rpm => "requests per minute",
            Limit::Tpm => "tokens per minute",
        };
        format!(
            "rate limit reached for this API key: {} {what} ({}={}); retry after {} s",
            self.value,
            self.limit.as_str(),
            self.value,
            self.retry_after_secs()
        )
    }
}

/// A key's counts: its limits, its running requests and its buckets.
#[derive(Debug)]
struct Counters {
    limits: Limits,
    running: u32,
    rpm: Option<Bucket>,
    tpm: Option<Bucket>,
}

type State = Arc<Mutex<Counters>>;

fn lock(s: &State) -> std::sync::MutexGuard<'_, Counters> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl Counters {
    fn new(limits: Limits, now: Instant) -> Counters {
        Counters {
            limits,
            running: 0,
            rpm: limits.rpm.map(|n| Bucket::full(n, now)),
            tpm: limits.tpm.map(|n| Bucket::full(n, now)),
        }
    }

    /// New limits (a reload): buckets kept and resized, new ones full, running kept.
    fn set_limits(&mut self, limits: Limits, now: Instant) {
        let fit = |b: &mut Option<Bucket>, n: Option<u32>| match (b.as_mut(), n) {
            (Some(old), Some(n)) => old.resize(n, now),
            (_, n) => *b = n.map(|n| Bucket::full(n, now)),
        };
        fit(&mut self.rpm, limits.rpm);
        fit(&mut self.tpm, limits.tpm);
        self.limits = limits;
    }

    fn admit(&mut self, prompt_tokens: u64, requests: u32, now: Instant) -> Result<(), Refusal> {
        let mut refusal: Option<Refusal> = None;
        let mut refuse = |limit, value, wait: Duration| match &mut refusal {
            Some(r) => r.retry_after = r.retry_after.max(wait),
            None => refusal = Some(Refusal { limit, value, retry_after: wait }),
        };
        // A request of several engine requests (`n` choices) counts each; one larger than the
        // limit runs only alone.
        if let Some(n) = self.limits.concurrency
            && (self.running >= n || (self.running > 0 && self.running + requests > n))
        {
            refuse(Limit::Concurrency, n, Duration::from_secs(1));
        }
        if let (Some(b), Some(n)) = (&mut self.rpm, self.limits.rpm) {
            let w = b.wait(1, now);
            if !w.is_zero() {
                refuse(Limit::Rpm, n, w);
            }
        }
        if let (Some(b), Some(n)) = (&mut self.tpm, self.limits.tpm) {
            let w = b.wait(prompt_tokens, now);
            if !w.is_zero() {
                refuse(Limit::Tpm, n, w);
            }
        }
        if let Some(r) = refusal {
            return Err(r);
        }
        self.running = self.running.saturating_add(requests);
        if let Some(b) = &mut self.rpm {
            b.take(1, now);
        }
        if let Some(b) = &mut self.tpm {
            b.take(prompt_tokens, now);
        }
        Ok(())
    }
}

/// What an accepted key may do: its models, whether it is an admin key, and its limits.
#[derive(Clone)]
pub struct Access {
    /// The models it may use.
    pub grant: Grant,
    /// Whether it may read the admin endpoints.
    pub admin: bool,
    state: Option<State>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("grant", &self.grant)
            .field("admin", &self.admin)
            .field("limits", &self.limits())
            .finish()
    }
}

impl Access {
    /// Every model, no limit (no authentication asked for).
    pub fn open() -> Access {
        Access { grant: Grant::All, admin: false, state: None }
    }

    /// The key's limits now.
    pub fn limits(&self) -> Limits {
        self.state.as_ref().map_or_else(Limits::default, |s| lock(s).limits)
    }

    /// The key's requests running now (those holding a [`KeyPermit`]); 0 for keys without
    /// counts (command-line keys, no authentication).
    pub fn running(&self) -> u32 {
        self.state.as_ref().map_or(0, |s| lock(s).running)
    }

    /// Admits a request of `prompt_tokens` at `now`, or says which limit refuses it and for
    /// how long. Nothing is counted for a refused request. The permit counts the request as
    /// running until it is dropped.
    pub fn admit(&self, prompt_tokens: u64, now: Instant) -> Result<KeyPermit, Refusal> {
        self.admit_n(prompt_tokens, 1, now)
    }

    /// Like [`Access::admit`] for a request that runs as `requests` engine requests (`n`
    /// choices of one prompt): it counts as that many running requests against
    /// `concurrency` (one larger than the limit is admitted only when none of the key's
    /// requests runs), one request against `rpm`, and its prompt once against `tpm`.
    pub fn admit_n(
        &self,
        prompt_tokens: u64,
        requests: u32,
        now: Instant,
    ) -> Result<KeyPermit, Refusal> {
        let requests = requests.max(1);
        let Some(s) = &self.state else { return Ok(KeyPermit { state: None, requests }) };
        lock(s).admit(prompt_tokens, requests, now)?;
        Ok(KeyPermit { state: Some(s.clone()), requests })
    }
}

/// An admitted request's place in its key's counts: running until dropped (whichever way
/// the request ends), and the tokens it produces taken from the key's `tpm` bucket.
#[derive(Debug, Default)]
pub struct KeyPermit {
    state: Option<State>,
    /// Running requests it counts for.
    requests: u32,
}

impl KeyPermit {
    /// `tokens` more completion tokens produced at `now`.
    pub fn produced(&self, tokens: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        if let Some(s) = &self.state
            && let Some(b) = &mut lock(s).tpm
        {
            b.take(tokens, now);
        }
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if let Some(s) = &self.state {
            let mut c = lock(s);
            c.running = c.running.saturating_sub(self.requests);
        }
    }
}

/// A key as it is kept: its SHA-256 digest (so that every comparison is over 32 bytes, in
/// constant time, whatever the presented key's length), its grant, whether it is an admin
/// key, and (keys of the file) its counts.
#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    grant: Grant,
    admin: bool,
    state: Option<State>,
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// The keys in force.
struct Table {
    entries: Box<[Entry]>,
    any_admin: bool,
}

/// `fixed`, then the keys of the file: a key in both gets both grants and the file's limits.
/// The counts of a file key `old` holds carry over, with the new limits.
fn table(fixed: &[Entry], file: Vec<KeyLine>, old: Option<&Table>, now: Instant) -> Table {
    let mut t = fixed.to_vec();
    let mut index: HashMap<[u8; 32], usize> =
        t.iter().enumerate().map(|(i, e)| (e.digest, i)).collect();
    let old: HashMap<[u8; 32], &State> = old
        .map(|o| o.entries.iter().filter_map(|e| Some((e.digest, e.state.as_ref()?))).collect())
        .unwrap_or_default();
    for line in file {
        let d = digest(line.key.as_bytes());
        let state = match old.get(&d) {
            Some(s) => {
                lock(s).set_limits(line.limits, now);
                Arc::clone(s)
            }
            None => Arc::new(Mutex::new(Counters::new(line.limits, now))),
        };
        match index.get(&d) {
            Some(&i) => {
                let e = &mut t[i];
                e.grant = std::mem::replace(&mut e.grant, Grant::All).merge(line.grant);
                e.admin |= line.admin;
                e.state = Some(state);
            }
            None => {
                index.insert(d, t.len());
                t.push(Entry {
                    digest: d,
                    grant: line.grant,
                    admin: line.admin,
                    state: Some(state),
                });
            }
        }
    }
    let any_admin = t.iter().any(|e| e.admin);
    Table { entries: t.into(), any_admin }
}

fn read_file(path: &Path) -> Result<Vec<KeyLine>, IngressError> {
    let why = |why: String| IngressError::KeysFile { path: path.to_path_buf(), why };
    let text = std::fs::read_to_string(path).map_err(|e| why(e.to_string()))?;
    parse(&text).map_err(why)
}

struct Inner {
    fixed: Vec<Entry>,
    file: Option<PathBuf>,
    /// Whether inference asks for a key (API keys or a keys file are configured).
    inference: bool,
    table: RwLock<Arc<Table>>,
}

impl Inner {
    fn table(&self) -> Arc<Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The accepted API keys: none (no authentication asked for), or fixed keys and/or a keys
/// file, and the admin keys. Clones share the table, so a reload through one is seen by all.
#[derive(Clone, Default)]
pub struct ApiKeys {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        match &self.inner {
            None => f.write_str("ApiKeys(none)"),
            Some(i) => f
                .debug_struct("ApiKeys")
                .field("keys", &self.len())
                .field("admin", &self.admin_required())
                .field("file", &i.file)
                .finish(),
        }
    }
}

impl ApiKeys {
    /// No keys: every request is let in.
    pub fn none() -> ApiKeys {
        ApiKeys::default()
    }

    /// `fixed` keys (every model, no limit), `admin` keys (the admin endpoints only) and the
    /// keys of `file`, read now; empty keys are skipped. Without fixed keys and file,
    /// inference asks for no key; with a file, it asks for one even while the file lists
    /// none. The admin endpoints ask for an admin key while one is in force.
    pub fn new(
        fixed: &[String],
        admin: &[String],
        file: Option<&Path>,
    ) -> Result<ApiKeys, IngressError> {
        let fixed: Vec<&String> = fixed.iter().filter(|k| !k.is_empty()).collect();
        let admin: Vec<&String> = admin.iter().filter(|k| !k.is_empty()).collect();
        if fixed.is_empty() && admin.is_empty() && file.is_none() {
            return Ok(ApiKeys::none());
        }
        let inference = !fixed.is_empty() || file.is_some();
        let mut entries: Vec<Entry> = Vec::new();
        let keys = fixed.iter().map(|k| (k, Grant::All, false));
        for (k, grant, admin) in keys.chain(admin.iter().map(|k| (k, Grant::none(), true))) {
            let d = digest(k.as_bytes());
            match entries.iter_mut().find(|e| e.digest == d) {
                Some(e) => {
                    e.grant = std::mem::replace(&mut e.grant, Grant::All).merge(grant);
                    e.admin |= admin;
                }
                None => entries.push(Entry { digest: d, grant, admin, state: None }),
            }
        }
        let from_file = match file {
            Some(p) => read_file(p)?,
            None => Vec::new(),
        };
        let t = table(&entries, from_file, None, Instant::now());
        let inner = Inner {
            fixed: entries,
            file: file.map(Path::to_path_buf),
            inference,
            table: RwLock::new(Arc::new(t)),
        };
        Ok(ApiKeys { inner: Some(Arc::new(inner)) })
    }

    /// Whether inference requests must present a key.
    pub fn required(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.inference)
    }

    /// Whether an admin key is in force (then the admin endpoints ask for one).
    pub fn admin_required(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.table().any_admin)
    }

    /// The keys file, if there is one.
    pub fn file(&self) -> Option<&Path> {
        self.inner.as_ref().and_then(|i| i.file.as_deref())
    }

    /// How many distinct keys (admin keys included) are accepted now.
    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| i.table().entries.len())
    }

    /// Whether no key is accepted now (no authentication, or an empty keys file).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What `key` may do: `None` when it is not accepted. Without keys, everything. Every
    /// accepted key is compared, each over its whole digest.
    pub fn check(&self, key: &[u8]) -> Option<Access> {
        let Some(inner) = &self.inner else { return Some(Access::open()) };
        let t = inner.table();
        let d = digest(key);
        let mut hit = None;
        for e in t.entries.iter() {
            let diff = e.digest.iter().zip(&d).fold(0u8, |acc, (x, y)| acc | (x ^ y));
            if diff == 0 {
                hit = Some(e);
            }
        }
        hit.map(|e| Access { grant: e.grant.clone(), admin: e.admin, state: e.state.clone() })
    }

    /// Re-reads the keys file: from now on exactly its keys (and the fixed ones) are
    /// accepted, with its limits; requests already admitted run on, still counted for
    /// their key while it stays. Returns the number of keys the file lists, `None` without
    /// a file. On an error (unreadable file, bad line) the keys in force stay. Reads the
    /// file: call it where blocking is fine.
    pub fn reload(&self) -> Result<Option<usize>, IngressError> {
        let Some(inner) = &self.inner else { return Ok(None) };
        let Some(path) = &inner.file else { return Ok(None) };
        let from_file = read_file(path)?;
        let n = from_file.len();
        // One reload at a time: the write lock is held while counts carry over.
        let mut slot = inner.table.write().unwrap_or_else(|p| p.into_inner());
        let t = table(&inner.fixed, from_file, Some(&slot), Instant::now());
        *slot = Arc::new(t);
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models(g: &Grant) -> Vec<&str> {
        match g {
            Grant::All => vec!["*"],
            Grant::Models(m) => m.iter().map(String::as_str).collect(),
        }
    }

    fn limits(concurrency: Option<u32>, rpm: Option<u32>, tpm: Option<u32>) -> Limits {
        Limits { concurrency, rpm, tpm }
    }

    /// A temporary directory, removed when dropped.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let d = std::env::temp_dir().join(format!("kvx-keys-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_file_format() {
        let text = "\u{feff}# keys\n\nsk-a\n  sk-b   m1,m2  # team b\nsk-c m3 , m4,\nsk-#d\n";
        let keys = parse(text).unwrap();
        let got: Vec<(&str, Vec<&str>)> =
            keys.iter().map(|l| (l.key.as_str(), models(&l.grant))).collect();
        assert_eq!(
            got,
            [
                ("sk-a", vec!["*"]),
                ("sk-b", vec!["m1", "m2"]),
                ("sk-c", vec!["m3", "m4"]),
                ("sk-#d", vec!["*"]),
            ]
        );
        assert!(keys.iter().all(|l| l.limits.is_none() && !l.admin));
        // A key twice: both lines' models; with a line that allows everything, everything.
        let keys = parse("k m1\nk m2,m1\nj m1\nj\n").unwrap();
        assert_eq!(models(&keys[0].grant), ["m1", "m2"]);
        assert_eq!(keys[1].grant, Grant::All);
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn fields_follow_the_model_list() {
        let text = "a  m1,m2  concurrency=4  rpm=600  tpm=100000\n\
                    b  *  rpm=60\n\
                    c  tpm=5  # no model list: every model\n\
                    d  m1 , m2,  concurrency=1\n\
                    ops  *  admin\n\
                    ops2 admin concurrency=2\n\
                    e  m1,*\n";
        let k = parse(text).unwrap();
        let got: Vec<(&str, Vec<&str>, Limits, bool)> =
            k.iter().map(|l| (l.key.as_str(), models(&l.grant), l.limits, l.admin)).collect();
        assert_eq!(
            got,
            [
                ("a", vec!["m1", "m2"], limits(Some(4), Some(600), Some(100_000)), false),
                ("b", vec!["*"], limits(None, Some(60), None), false),
                ("c", vec!["*"], limits(None, None, Some(5)), false),
                ("d", vec!["m1", "m2"], limits(Some(1), None, None), false),
                ("ops", vec!["*"], Limits::default(), true),
                ("ops2", vec!["*"], limits(Some(2), None, None), true),
                ("e", vec!["*"], Limits::default(), false),
            ]
        );
        // A key twice: limits from either line (the same value twice is fine), admin if
        // either line says so.
        let k = parse("k m1 rpm=5\nk m2 concurrency=3 admin\nk rpm=5\n").unwrap();
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].grant, Grant::All);
        assert_eq!(k[0].limits, limits(Some(3), Some(5), None));
        assert!(k[0].admin);
        // Debug output never shows the key.
        assert!(!format!("{k:?}").contains("\"k\""), "{k:?}");
    }

    #[test]
    fn bad_lines_are_named() {
        let e = parse("ok\nk m1 m2\n").unwrap_err();
        assert!(e.starts_with("line 2: "), "{e}");
        let e = parse("k ,,\n").unwrap_err();
        assert!(e.starts_with("line 1: ") && e.contains("empty model list"), "{e}");
        for (text, line, says) in [
            ("k m1 burst=3\n", 1, "unknown field"),
            ("ok\n\nk * rpm=0\n", 3, "whole number"),
            ("k * rpm=-1\n", 1, "whole number"),
            ("k * tpm=lots\n", 1, "whole number"),
            ("k * concurrency=\n", 1, "whole number"),
            ("k * rpm=99999999999\n", 1, "whole number"),
            ("k rpm=3 m1\n", 1, "model list comes before the fields"),
            ("k * admin=yes\n", 1, "takes no value"),
            ("k * rpm=3 rpm=4\n", 1, "given twice"),
            ("k * rpm=3\nk * rpm=4\n", 2, "earlier line gives `rpm=3`"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.starts_with(&format!("line {line}: ")) && e.contains(says), "{text:?}: {e}");
            assert!(!e.contains("`k`") && !e.contains(" k "), "the key in {e:?}");
        }
    }

    #[test]
    fn buckets_refill_continuously() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = Bucket::full(60, t0);
        assert_eq!(b.wait(60, t0), Duration::ZERO);
        b.take(60, t0);
        // One token a second.
        assert_eq!(b.wait(1, t0), s(1));
        assert_eq!(b.wait(1, t0 + Duration::from_millis(500)), Duration::from_millis(500));
        assert_eq!(b.wait(1, t0 + s(1)), Duration::ZERO);
        assert_eq!(b.wait(30, t0 + s(1)), s(29));
        // An earlier `now` is the same instant; the level never passes the size.
        assert_eq!(b.wait(1, t0), Duration::ZERO);
        assert_eq!(b.level(t0 + s(3600)), 60.0);
        // More than the size needs a full bucket, and leaves it in debt (at most its size).
        let t1 = t0 + s(3600);
        assert_eq!(b.wait(1000, t1), Duration::ZERO);
        b.take(1000, t1);
        assert_eq!(b.level(t1), -60.0);
        assert_eq!(b.wait(1, t1), s(61));
        assert_eq!(b.wait(0, t1), s(60));
        // Resized: the level stays, at most the new size; it refills at the new rate.
        let t2 = t1 + s(120);
        assert_eq!(b.level(t2), 60.0);
        b.resize(6, t2);
        assert_eq!(b.level(t2), 6.0);
        b.take(6, t2);
        assert_eq!(b.wait(1, t2), s(10));
        b.resize(600, t2);
        assert_eq!(b.wait(1, t2), Duration::from_millis(100));
    }

    fn keys_with(dir: &Dir, text: &str) -> (ApiKeys, PathBuf) {
        let file = dir.0.join("keys");
        std::fs::write(&file, text).unwrap();
        (ApiKeys::new(&["fixed".into()], &[], Some(&file)).unwrap(), file)
    }

    #[test]
    fn limits_admit_and_permits_release() {
        let dir = Dir::new("limits");
        let (keys, _) = keys_with(
            &dir,
            "c * concurrency=2\nr * rpm=2\nt * tpm=600\nall * concurrency=1 rpm=1\n",
        );
        let t0 = Instant::now();
        let s = Duration::from_secs;

        // concurrency=2: two permits, the third refused (retry after 1 s) until one goes.
        let c = keys.check(b"c").unwrap();
        let p1 = c.admit(10, t0).unwrap();
        let p2 = c.admit(10, t0).unwrap();
        assert_eq!(c.running(), 2);
        let r = c.admit(10, t0).unwrap_err();
        assert_eq!((r.limit, r.value, r.retry_after_secs()), (Limit::Concurrency, 2, 1));
        assert!(r.message().contains("concurrency=2"), "{}", r.message());
        drop(p1);
        assert_eq!(c.running(), 1);
        let p3 = c.admit(10, t0).unwrap();
        drop((p2, p3));
        assert_eq!(c.running(), 0);
        // n choices count n: two fill the limit, one of three runs only alone.
        let pn = c.admit_n(10, 2, t0).unwrap();
        assert_eq!(c.running(), 2);
        assert_eq!(c.admit(10, t0).unwrap_err().limit, Limit::Concurrency);
        drop(pn);
        let p1 = c.admit(10, t0).unwrap();
        assert_eq!(c.admit_n(10, 3, t0).unwrap_err().limit, Limit::Concurrency);
        drop(p1);
        let big = c.admit_n(10, 3, t0).unwrap();
        assert_eq!(c.running(), 3);
        drop(big);
        assert_eq!(c.running(), 0);

        // rpm=2: a request every 30 s once the bucket is empty.
        let r2 = keys.check(b"r").unwrap();
        let _a = r2.admit(1, t0).unwrap();
        let _b = r2.admit(1, t0).unwrap();
        let e = r2.admit(1, t0).unwrap_err();
        assert_eq!((e.limit, e.retry_after, e.retry_after_secs()), (Limit::Rpm, s(30), 30));
        let e = r2.admit(1, t0 + s(20)).unwrap_err();
        assert_eq!(e.retry_after_secs(), 10);
        let _c = r2.admit(1, t0 + s(30)).unwrap();

        // tpm=600 (10 a second): prompts at admission, completions as produced.
        let t = keys.check(b"t").unwrap();
        let p = t.admit(500, t0).unwrap();
        let e = t.admit(101, t0).unwrap_err();
        assert_eq!((e.limit, e.retry_after_secs()), (Limit::Tpm, 1));
        p.produced(300, t0);
        // 100 - 300 = -200: 30 s until it holds 100 again.
        let e = t.admit(100, t0).unwrap_err();
        assert_eq!(e.retry_after, s(30));
        // A refused request counted nothing.
        assert_eq!(t.running(), 1);
        drop(p);
        assert_eq!(t.running(), 0);
        let _p = t.admit(100, t0 + s(30)).unwrap();

        // Several limits in the way: the first one named, the longest wait given.
        let all = keys.check(b"all").unwrap();
        let _p = all.admit(1, t0).unwrap();
        let e = all.admit(1, t0).unwrap_err();
        assert_eq!((e.limit, e.retry_after), (Limit::Concurrency, s(60)));

        // Command-line keys have no limits and no counts.
        let f = keys.check(b"fixed").unwrap();
        let ps: Vec<KeyPermit> = (0..100).map(|_| f.admit(1 << 20, t0).unwrap()).collect();
        assert_eq!((f.limits(), f.running(), ps.len()), (Limits::default(), 0, 100));
    }

    #[test]
    fn a_reload_keeps_the_counts_of_the_keys_that_stay() {
        let dir = Dir::new("reload-limits");
        let (keys, file) = keys_with(&dir, "a * concurrency=1 rpm=2\nb * concurrency=1\n");
        let t0 = Instant::now();
        let a = keys.check(b"a").unwrap();
        let running = a.admit(1, t0).unwrap();
        let _second = a.admit(1, t0).unwrap_err();
        let b = keys.check(b"b").unwrap();
        let b_running = b.admit(1, t0).unwrap();

        // a stays with a higher concurrency: its running request still counts, its rpm
        // bucket (one left of two) stays; b goes.
        std::fs::write(&file, "a * concurrency=3 rpm=2\n").unwrap();
        assert_eq!(keys.reload().unwrap(), Some(1));
        let a2 = keys.check(b"a").unwrap();
        assert_eq!(a2.limits(), limits(Some(3), Some(2), None));
        assert_eq!(a2.running(), 1);
        let p = a2.admit(1, t0).unwrap();
        assert_eq!(a2.running(), 2);
        assert_eq!(a2.admit(1, t0).unwrap_err().limit, Limit::Rpm);
        assert!(keys.check(b"b").is_none());
        // Permits of a dropped key or taken before the reload end cleanly.
        drop((b_running, running, p));
        assert_eq!(a2.running(), 0);

        // Limits removed: counting goes on, nothing is refused.
        std::fs::write(&file, "a\n").unwrap();
        keys.reload().unwrap();
        let a3 = keys.check(b"a").unwrap();
        let ps: Vec<KeyPermit> = (0..5).map(|_| a3.admit(1, t0).unwrap()).collect();
        assert_eq!(a3.running(), 5);
        // Limits added to a key that runs requests: they count at once.
        std::fs::write(&file, "a * concurrency=5\n").unwrap();
        keys.reload().unwrap();
        assert_eq!(keys.check(b"a").unwrap().admit(1, t0).unwrap_err().limit, Limit::Concurrency);
        drop(ps);
        assert!(keys.check(b"a").unwrap().admit(1, t0).is_ok());
    }

    #[test]
    fn admin_keys() {
        // Flag admin keys: the admin endpoints only; inference stays open without API keys.
        let keys = ApiKeys::new(&[], &["adm".into(), String::new()], None).unwrap();
        assert!(!keys.required() && keys.admin_required());
        let a = keys.check(b"adm").unwrap();
        assert!(a.admin && !a.grant.allows("any-model"));
        assert!(keys.check(b"other").is_none());
        // Also an API key: both.
        let keys = ApiKeys::new(&["k".into()], &["k".into()], None).unwrap();
        assert_eq!(keys.len(), 1);
        let a = keys.check(b"k").unwrap();
        assert!(a.admin && a.grant == Grant::All);

        // An `admin` line is also a normal key for its models; the admin endpoints ask for
        // an admin key only while one is in force.
        let dir = Dir::new("admin");
        let (keys, file) = keys_with(&dir, "ops m1 admin\nuser\n");
        assert!(keys.required() && keys.admin_required());
        let ops = keys.check(b"ops").unwrap();
        assert!(ops.admin && ops.grant.allows("m1") && !ops.grant.allows("m2"));
        assert!(!keys.check(b"user").unwrap().admin);
        assert!(!keys.check(b"fixed").unwrap().admin);
        std::fs::write(&file, "ops m1\n").unwrap();
        keys.reload().unwrap();
        assert!(!keys.admin_required() && !keys.check(b"ops").unwrap().admin);
        assert!(!ApiKeys::none().admin_required());
    }

    #[test]
    fn keys_are_checked_and_reloaded() {
        let dir = Dir::new("reload");
        let file = dir.0.join("keys");
        std::fs::write(&file, "a\nb other-model\n").unwrap();
        let keys = ApiKeys::new(&["fixed".into(), String::new()], &[], Some(&file)).unwrap();
        assert!(keys.required() && !keys.admin_required());
        assert_eq!(keys.len(), 3);
        let grant = |k: &[u8]| keys.check(k).map(|a| a.grant);
        assert_eq!(grant(b"a"), Some(Grant::All));
        assert_eq!(grant(b"fixed"), Some(Grant::All));
        let b = grant(b"b").unwrap();
        assert!(b.allows("other-model") && !b.allows("served"));
        assert_eq!(grant(b"c"), None);
        assert_eq!(grant(b""), None);

        // A clone sees the reload; the revoked key is refused, the fixed one stays.
        let seen = keys.clone();
        let grant = |k: &[u8]| seen.check(k).map(|a| a.grant);
        std::fs::write(&file, "b\n").unwrap();
        assert_eq!(keys.reload().unwrap(), Some(1));
        assert_eq!(grant(b"a"), None);
        assert_eq!(grant(b"b"), Some(Grant::All));
        assert_eq!(grant(b"fixed"), Some(Grant::All));

        // A failed reload keeps the keys in force and names the file.
        std::fs::write(&file, "b m1 m2\n").unwrap();
        let e = keys.reload().unwrap_err().to_string();
        assert!(e.contains(&file.display().to_string()) && e.contains("line 1"), "{e}");
        std::fs::write(&file, "b * rpm=0\n").unwrap();
        assert!(keys.reload().is_err());
        std::fs::remove_file(&file).unwrap();
        assert!(keys.reload().is_err());
        assert_eq!(grant(b"b"), Some(Grant::All));
        assert_eq!(seen.check(b"b").unwrap().limits(), Limits::default());

        // An empty file still asks for a key; a missing one is a startup error.
        std::fs::write(&file, "# nobody\n").unwrap();
        let keys = ApiKeys::new(&[], &[], Some(&file)).unwrap();
        assert!(keys.required() && keys.is_empty());
        assert!(keys.check(b"anything").is_none());
        let e = ApiKeys::new(&[], &[], Some(&dir.0.join("missing"))).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");

        let open = ApiKeys::new(&[String::new()], &[String::new()], None).unwrap();
        assert!(!open.required() && !open.admin_required());
        assert_eq!(open.check(b"x").map(|a| a.grant), Some(Grant::All));
        // Debug output (a logged configuration) never shows a key.
        let shown =
            format!("{:?}", ApiKeys::new(&["sk-secret".into()], &["sk-adm".into()], None).unwrap());
        assert!(!shown.contains("sk-secret") && !shown.contains("sk-adm"), "{shown}");
    }
}
