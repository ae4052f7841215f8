//! The error type of kvx-bench: configuration, input files, tokenizer and report failures.

use std::path::PathBuf;

/// Everything that can stop a benchmark before or after it runs. Failures of individual
/// requests are not errors: they are counted by class in the report.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A configuration value is out of range or inconsistent with another.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An input file (trace, prompts, report) has a malformed line or document.
    #[error("{path}:{line}: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 when the whole document is at fault).
        line: usize,
        /// What was wrong.
        msg: String,
    },
    /// The tokenizer could not be loaded or failed on a text.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The async runtime could not be started, or one of its tasks failed.
    #[error("runtime: {0}")]
    Runtime(std::io::Error),
    /// A report could not be serialized.
    #[error("report: {0}")]
    Json(#[from] serde_json::Error),
}

impl BenchError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    pub(crate) fn config(msg: impl Into<String>) -> Self {
        Self::Config(msg.into())
    }
}
