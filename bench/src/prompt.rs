//! Prompts of exact token lengths, cut from a synthetic corpus and checked by re-encoding.

use std::sync::Arc;

use rand::Rng;

use crate::BenchError;
use crate::corpus::{WORDS, corpus_text};
use crate::tokenizer::TokenCodec;

/// Words in the corpus prompts are cut from (about 1.2 tokens each for BPE tokenizers).
const CORPUS_WORDS: usize = 24_000;
/// Decode/encode rounds spent pulling a prompt to its exact length.
const MAX_FIX_ROUNDS: usize = 10;
/// Words opening a [`PromptSynth::tagged`] prompt.
const TAG_WORDS: u32 = 4;
/// Distinct tags of [`PromptSynth::tagged`] (`WORDS.len()^4`, about 6e10); tags are taken
/// modulo this.
pub(crate) const TAG_SPACE: u64 = (WORDS.len() as u64).pow(TAG_WORDS);

/// A prompt and its length under the benchmark's tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The text sent.
    pub text: String,
    /// Its token count (equal to the requested length unless the tokenizer made that
    /// impossible within the adjustment rounds).
    pub tokens: u32,
}

/// Makes prompts of exact token lengths.
#[derive(Debug, Clone)]
pub struct PromptSynth {
    codec: Arc<dyn TokenCodec>,
    corpus: Arc<[u32]>,
}

impl PromptSynth {
    /// Tokenizes the corpus (seeded) with `codec`.
    pub fn new(codec: Arc<dyn TokenCodec>, seed: u64) -> Result<Self, BenchError> {
        let corpus = codec.encode(&corpus_text(CORPUS_WORDS, seed))?;
        if corpus.is_empty() {
            return Err(BenchError::Tokenizer("the tokenizer produced no tokens".into()));
        }
        Ok(Self { codec, corpus: corpus.into() })
    }

    /// The tokenizer.
    pub fn codec(&self) -> &Arc<dyn TokenCodec> {
        &self.codec
    }

    /// `n` consecutive corpus tokens from a random place (wrapping around the end).
    pub fn sample_ids<R: Rng + ?Sized>(&self, n: usize, rng: &mut R) -> Vec<u32> {
        let len = self.corpus.len();
        let start = rng.random_range(0..len);
        self.corpus.iter().cycle().skip(start).take(n).copied().collect()
    }

    /// A prompt of exactly `n` tokens.
    pub fn prompt<R: Rng + ?Sized>(&self, n: u32, rng: &mut R) -> Result<Prompt, BenchError> {
        let ids = self.sample_ids(n as usize, rng);
        self.exact(ids, n, rng)
    }

    /// A prompt of exactly `n` tokens whose first four words spell `tag` (its lowest four
    /// digits in base `WORDS.len()`, the lowest first), followed by corpus text. Prompts whose
    /// tags differ modulo `WORDS.len()^4` (about 6e10) differ within their first four words,
    /// so they share no prefix a cache could serve (unless `n` is shorter than the tag).
    pub fn tagged<R: Rng + ?Sized>(
        &self,
        tag: u64,
        n: u32,
        rng: &mut R,
    ) -> Result<Prompt, BenchError> {
        let base = WORDS.len() as u64;
        let words: Vec<&str> =
            (0..TAG_WORDS).map(|i| WORDS[(tag / base.pow(i) % base) as usize]).collect();
        let mut ids = self.codec.encode(&words.join(" "))?;
        ids.truncate(n as usize);
        let rest = (n as usize).saturating_sub(ids.len());
        ids.extend(self.sample_ids(rest, rng));
        self.exact(ids, n, rng)
    }

    /// Text for `ids` whose re-encoded length is `target`: decodes, re-encodes, and trims or
    /// tops up the tail until the count matches. Only the tail changes, so prompts that share a
    /// token prefix keep sharing it.
    pub fn exact<R: Rng + ?Sized>(
        &self,
        mut ids: Vec<u32>,
        target: u32,
        rng: &mut R,
    ) -> Result<Prompt, BenchError> {
        let target_len = target as usize;
        let mut text = String::new();
        let mut count = 0;
        for _ in 0..MAX_FIX_ROUNDS {
            text = self.codec.decode(&ids)?;
            ids = self.codec.encode(&text)?;
            count = ids.len();
            if count == target_len {
                break;
            }
            if count > target_len {
                ids.truncate(target_len);
            } else {
                ids.extend(self.sample_ids(target_len - count, rng));
            }
        }
        Ok(Prompt { text, tokens: count.try_into().unwrap_or(u32::MAX) })
    }

    /// Token count of `text`.
    pub fn count(&self, text: &str) -> Result<u32, BenchError> {
        Ok(self.codec.encode(text)?.len().try_into().unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::WordCodec;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn word_prompts_have_exact_lengths_and_are_seeded() {
        let s = PromptSynth::new(Arc::new(WordCodec), 1).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for n in [1, 2, 17, 512, 30_000] {
            let p = s.prompt(n, &mut rng).unwrap();
            assert_eq!(p.tokens, n);
            assert_eq!(p.text.split_whitespace().count(), n as usize);
        }
        let a = s.prompt(40, &mut ChaCha8Rng::seed_from_u64(1)).unwrap();
        let b = s.prompt(40, &mut ChaCha8Rng::seed_from_u64(1)).unwrap();
        let c = s.prompt(40, &mut ChaCha8Rng::seed_from_u64(2)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn tagged_prompts_open_with_their_tag_and_have_exact_lengths() {
        let s = PromptSynth::new(Arc::new(WordCodec), 1).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let base = WORDS.len() as u64;
        let tag = 3 + 5 * base + 7 * base * base;
        let p = s.tagged(tag, 30, &mut rng).unwrap();
        assert_eq!(p.tokens, 30);
        let words: Vec<&str> = p.text.split_whitespace().collect();
        assert_eq!(words.len(), 30);
        assert_eq!(words[..4], [WORDS[3], WORDS[5], WORDS[7], WORDS[0]]);
        // Consecutive tags differ in the first word; a prompt shorter than the tag is cut.
        let q = s.tagged(tag + 1, 30, &mut rng).unwrap();
        assert_eq!(q.text.split_whitespace().next(), Some(WORDS[4]));
        assert_eq!(s.tagged(tag, 2, &mut rng).unwrap().text, format!("{} {}", WORDS[3], WORDS[5]));
    }
}
