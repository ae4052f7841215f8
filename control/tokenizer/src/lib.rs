//! kvx-tokenizer: tokenizers and chat templates built from model metadata.

#![forbid(unsafe_code)]
