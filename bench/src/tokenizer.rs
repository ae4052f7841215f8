//! Token codecs used to build prompts of exact token lengths: a model's tokenizer (kvx-tokenizer,
//! from a GGUF or a `tokenizer.json`) or a word codec for tokenizer-free servers.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::BenchError;
use crate::corpus::WORDS;

/// What kvx-bench needs from a tokenizer. Kept small so any tokenizer can stand behind it.
pub trait TokenCodec: Send + Sync + fmt::Debug {
    /// Token ids of `text`, without special tokens added.
    fn encode(&self, text: &str) -> Result<Vec<u32>, BenchError>;
    /// Text of `ids`, special tokens skipped.
    fn decode(&self, ids: &[u32]) -> Result<String, BenchError>;
    /// Number of ids in the vocabulary.
    fn vocab_size(&self) -> usize;
    /// A short description for reports (`words`, or the file the tokenizer came from).
    fn describe(&self) -> String;
}

/// Which tokenizer to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// One token per whitespace-separated word ([`WordCodec`]); for servers that count words.
    Words,
    /// A `.gguf` model (its metadata holds the tokenizer) or a Hugging Face `tokenizer.json`
    /// (or a directory holding one).
    File(std::path::PathBuf),
}

impl TokenizerSpec {
    /// Loads the codec.
    pub fn load(&self) -> Result<Arc<dyn TokenCodec>, BenchError> {
        match self {
            Self::Words => Ok(Arc::new(WordCodec)),
            Self::File(path) => Ok(Arc::new(ModelTokenizer::from_path(path)?)),
        }
    }
}

/// A model's tokenizer (kvx-tokenizer), read from a GGUF or a `tokenizer.json`.
#[derive(Debug)]
pub struct ModelTokenizer {
    inner: kvx_tokenizer::Tokenizer,
    source: String,
}

impl ModelTokenizer {
    /// Reads the tokenizer of a `.gguf` model, or a `tokenizer.json` (or a directory holding
    /// one).
    pub fn from_path(path: &Path) -> Result<Self, BenchError> {
        let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        let inner = if is_gguf {
            kvx_tokenizer::Tokenizer::from_gguf_path(&file)
        } else {
            kvx_tokenizer::Tokenizer::from_tokenizer_json(&file)
        }
        .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", file.display())))?;
        Ok(Self { inner, source: file.display().to_string() })
    }
}

impl TokenCodec for ModelTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, BenchError> {
        self.inner.encode(text, false).map_err(|e| BenchError::Tokenizer(e.to_string()))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BenchError> {
        self.inner.decode(ids, true).map_err(|e| BenchError::Tokenizer(e.to_string()))
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn describe(&self) -> String {
        self.source.clone()
    }
}

/// One token per whitespace-separated word, over the built-in word list. Words outside the
/// list encode to one extra id (decoded as `<unk>`), so counting any text works.
#[derive(Debug, Clone, Copy, Default)]
pub struct WordCodec;

impl WordCodec {
    fn id_of(word: &str) -> u32 {
        // The list is short; a linear scan only runs while building prompts, never per token
        // of a response.
        WORDS.iter().position(|w| *w == word).map_or(WORDS.len() as u32, |i| i as u32)
    }
}

impl TokenCodec for WordCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, BenchError> {
        Ok(text.split_whitespace().map(Self::id_of).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BenchError> {
        let mut out = String::with_capacity(ids.len() * 6);
        for (i, &id) in ids.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(WORDS.get(id as usize).copied().unwrap_or("<unk>"));
        }
        Ok(out)
    }

    fn vocab_size(&self) -> usize {
        WORDS.len() + 1
    }

    fn describe(&self) -> String {
        "words".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_codec_round_trips_and_counts_words() {
        let c = WordCodec;
        let ids = c.encode("the  time\nwater zzzz").unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids[3] as usize, WORDS.len());
        assert_eq!(c.decode(&ids[..3]).unwrap(), "the time water");
        let text = c.decode(&[5, 9, 0]).unwrap();
        assert_eq!(c.encode(&text).unwrap(), vec![5, 9, 0]);
    }

    #[test]
    fn missing_tokenizer_file_is_an_error() {
        for p in ["/nonexistent/tokenizer.json", "/nonexistent/model.gguf"] {
            let spec = TokenizerSpec::File(p.into());
            assert!(matches!(spec.load(), Err(BenchError::Tokenizer(_))), "{p}");
        }
    }
}
