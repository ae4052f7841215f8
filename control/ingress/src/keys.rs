//! API keys: the fixed keys of the configuration and those of a keys file (one key a line,
//! optionally followed by the models it may use), checked in constant time and re-read on
//! demand ([`ApiKeys::reload`]) without disturbing requests already admitted.
//!
//! The file's format:
//!
//! ```text
//! # a comment; blank lines are ignored
//! sk-team-a                          every model
//! sk-team-b   model-x,model-y        only these
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

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

/// The keys of a keys file's text, in file order, each with its grant; a key listed twice
/// appears once with both lines' models. The error names the line at fault.
pub fn parse(text: &str) -> Result<Vec<(String, Grant)>, String> {
    let mut out: Vec<(String, Grant)> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = strip_comment(line.trim_start_matches('\u{feff}')).trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| format!("line {}: {why}", i + 1);
        let (key, rest) = match line.split_once(char::is_whitespace) {
            Some((k, r)) => (k, r.trim()),
            None => (line, ""),
        };
        let grant = if rest.is_empty() {
            Grant::All
        } else {
            let mut models = Vec::new();
            for m in rest.split(',').map(str::trim).filter(|m| !m.is_empty()) {
                if m.contains(char::is_whitespace) {
                    return Err(at(format!(
                        "`{m}`: expected KEY, then optionally MODEL[,MODEL...] (model names \
                         are separated by commas)"
                    )));
                }
                if !models.iter().any(|x| x == m) {
                    models.push(m.to_string());
                }
            }
            if models.is_empty() {
                return Err(at("an empty model list (leave it out to allow every model)".into()));
            }
            Grant::Models(models.into())
        };
        match seen.get(key) {
            Some(&j) => {
                let old = std::mem::replace(&mut out[j].1, Grant::All);
                out[j].1 = old.merge(grant);
            }
            None => {
                seen.insert(key.to_string(), out.len());
                out.push((key.to_string(), grant));
            }
        }
    }
    Ok(out)
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

/// A key as it is kept: its SHA-256 digest (so that every comparison is over 32 bytes, in
/// constant time, whatever the presented key's length) and its grant.
#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    grant: Grant,
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// `fixed` then `file`, a key in both getting both grants.
fn table(fixed: &[Entry], file: Vec<(String, Grant)>) -> Arc<[Entry]> {
    let mut t = fixed.to_vec();
    for (k, g) in file {
        let d = digest(k.as_bytes());
        match t.iter_mut().find(|e| e.digest == d) {
            Some(e) => e.grant = std::mem::replace(&mut e.grant, Grant::All).merge(g),
            None => t.push(Entry { digest: d, grant: g }),
        }
    }
    t.into()
}

fn read_file(path: &Path) -> Result<Vec<(String, Grant)>, IngressError> {
    let why = |why: String| IngressError::KeysFile { path: path.to_path_buf(), why };
    let text = std::fs::read_to_string(path).map_err(|e| why(e.to_string()))?;
    parse(&text).map_err(why)
}

struct Inner {
    fixed: Vec<Entry>,
    file: Option<PathBuf>,
    table: RwLock<Arc<[Entry]>>,
}

/// The accepted API keys: none (no authentication asked for), or fixed keys and/or a keys
/// file. Clones share the table, so a reload through one is seen by all.
#[derive(Clone, Default)]
pub struct ApiKeys {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        match &self.inner {
            None => f.write_str("ApiKeys(none)"),
            Some(i) => {
                f.debug_struct("ApiKeys").field("keys", &self.len()).field("file", &i.file).finish()
            }
        }
    }
}

impl ApiKeys {
    /// No keys: every request is let in.
    pub fn none() -> ApiKeys {
        ApiKeys::default()
    }

    /// `fixed` keys (every model; empty ones are skipped) and the keys of `file`, read now.
    /// With neither, no authentication is asked for; with a file, authentication is asked
    /// for even while the file lists no key.
    pub fn new(fixed: &[String], file: Option<&Path>) -> Result<ApiKeys, IngressError> {
        let fixed: Vec<Entry> = table(
            &[],
            fixed.iter().filter(|k| !k.is_empty()).map(|k| (k.clone(), Grant::All)).collect(),
        )
        .to_vec();
        if fixed.is_empty() && file.is_none() {
            return Ok(ApiKeys::none());
        }
        let from_file = match file {
            Some(p) => read_file(p)?,
            None => Vec::new(),
        };
        let t = table(&fixed, from_file);
        let inner = Inner { fixed, file: file.map(Path::to_path_buf), table: RwLock::new(t) };
        Ok(ApiKeys { inner: Some(Arc::new(inner)) })
    }

    /// Whether requests must present a key.
    pub fn required(&self) -> bool {
        self.inner.is_some()
    }

    /// The keys file, if there is one.
    pub fn file(&self) -> Option<&Path> {
        self.inner.as_ref().and_then(|i| i.file.as_deref())
    }

    /// How many distinct keys are accepted now.
    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| i.table.read().unwrap_or_else(|p| p.into_inner()).len())
    }

    /// Whether no key is accepted now (no authentication, or an empty keys file).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What `key` may use: `None` when it is not accepted. Without keys, everything. Every
    /// accepted key is compared, each over its whole digest.
    pub fn check(&self, key: &[u8]) -> Option<Grant> {
        let Some(inner) = &self.inner else { return Some(Grant::All) };
        let t = inner.table.read().unwrap_or_else(|p| p.into_inner()).clone();
        let d = digest(key);
        let mut hit = None;
        for e in t.iter() {
            let diff = e.digest.iter().zip(&d).fold(0u8, |acc, (x, y)| acc | (x ^ y));
            if diff == 0 {
                hit = Some(&e.grant);
            }
        }
        hit.cloned()
    }

    /// Re-reads the keys file: from now on exactly its keys (and the fixed ones) are
    /// accepted; requests already admitted run on. Returns the number of keys the file
    /// lists, `None` without a file. On an error (unreadable file, bad line) the keys in
    /// force stay. Reads the file: call it where blocking is fine.
    pub fn reload(&self) -> Result<Option<usize>, IngressError> {
        let Some(inner) = &self.inner else { return Ok(None) };
        let Some(path) = &inner.file else { return Ok(None) };
        let from_file = read_file(path)?;
        let n = from_file.len();
        let t = table(&inner.fixed, from_file);
        *inner.table.write().unwrap_or_else(|p| p.into_inner()) = t;
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

    #[test]
    fn the_file_format() {
        let text = "\u{feff}# keys\n\nsk-a\n  sk-b   m1,m2  # team b\nsk-c m3 , m4,\nsk-#d\n";
        let keys = parse(text).unwrap();
        let got: Vec<(&str, Vec<&str>)> =
            keys.iter().map(|(k, g)| (k.as_str(), models(g))).collect();
        assert_eq!(
            got,
            [
                ("sk-a", vec!["*"]),
                ("sk-b", vec!["m1", "m2"]),
                ("sk-c", vec!["m3", "m4"]),
                ("sk-#d", vec!["*"]),
            ]
        );
        // A key twice: both lines' models; with a line that allows everything, everything.
        let keys = parse("k m1\nk m2,m1\nj m1\nj\n").unwrap();
        assert_eq!(models(&keys[0].1), ["m1", "m2"]);
        assert_eq!(keys[1].1, Grant::All);
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn bad_lines_are_named() {
        let e = parse("ok\nk m1 m2\n").unwrap_err();
        assert!(e.starts_with("line 2: "), "{e}");
        let e = parse("k ,,\n").unwrap_err();
        assert!(e.starts_with("line 1: ") && e.contains("empty model list"), "{e}");
    }

    #[test]
    fn keys_are_checked_and_reloaded() {
        let dir = std::env::temp_dir().join(format!("kvx-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "a\nb other-model\n").unwrap();
        let keys = ApiKeys::new(&["fixed".into(), String::new()], Some(&file)).unwrap();
        assert!(keys.required());
        assert_eq!(keys.len(), 3);
        assert_eq!(keys.check(b"a"), Some(Grant::All));
        assert_eq!(keys.check(b"fixed"), Some(Grant::All));
        let b = keys.check(b"b").unwrap();
        assert!(b.allows("other-model") && !b.allows("served"));
        assert_eq!(keys.check(b"c"), None);
        assert_eq!(keys.check(b""), None);

        // A clone sees the reload; the revoked key is refused, the fixed one stays.
        let seen = keys.clone();
        std::fs::write(&file, "b\n").unwrap();
        assert_eq!(keys.reload().unwrap(), Some(1));
        assert_eq!(seen.check(b"a"), None);
        assert_eq!(seen.check(b"b"), Some(Grant::All));
        assert_eq!(seen.check(b"fixed"), Some(Grant::All));

        // A failed reload keeps the keys in force and names the file.
        std::fs::write(&file, "b m1 m2\n").unwrap();
        let e = keys.reload().unwrap_err().to_string();
        assert!(e.contains(&file.display().to_string()) && e.contains("line 1"), "{e}");
        std::fs::remove_file(&file).unwrap();
        assert!(keys.reload().is_err());
        assert_eq!(seen.check(b"b"), Some(Grant::All));

        // An empty file still asks for a key; a missing one is a startup error.
        std::fs::write(&file, "# nobody\n").unwrap();
        let keys = ApiKeys::new(&[], Some(&file)).unwrap();
        assert!(keys.required() && keys.is_empty());
        assert_eq!(keys.check(b"anything"), None);
        let e = ApiKeys::new(&[], Some(&dir.join("missing"))).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();

        let open = ApiKeys::new(&[String::new()], None).unwrap();
        assert!(!open.required());
        assert_eq!(open.check(b"x"), Some(Grant::All));
        // Debug output (a logged configuration) never shows a key.
        let shown = format!("{:?}", ApiKeys::new(&["sk-secret".into()], None).unwrap());
        assert!(!shown.contains("sk-secret"), "{shown}");
    }
}
