//! The errors of building tokenizers, encoding, decoding and rendering chat templates.

use std::path::PathBuf;

/// Errors of building a tokenizer, encoding and decoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF file could not be read, or lacks a key the tokenizer needs.
    #[error(transparent)]
    Gguf(#[from] kvx_gguf::GgufError),
    /// A tokenizer model or pre-tokenizer kvx does not implement.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// Tokenizer data that is inconsistent (duplicate tokens, ids out of range, ...).
    #[error("invalid tokenizer data: {0}")]
    Invalid(String),
    /// An error from the `tokenizers` crate.
    #[error("tokenizer backend: {0}")]
    Backend(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary ({vocab_size} tokens)")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The model says to add BOS/EOS but does not name the token.
    #[error("the model asks for a {0} token but does not define one")]
    MissingSpecial(&'static str),
    /// A file next to a tokenizer.json could not be read.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A chat template error.
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// Errors of compiling and rendering chat templates.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// The template does not compile.
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    /// Rendering failed otherwise (undefined attribute, type error, ...).
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// A message or context value that cannot be passed to a template.
    #[error("invalid chat input: {0}")]
    Input(String),
}

pub(crate) fn backend(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Backend(e.to_string())
}
