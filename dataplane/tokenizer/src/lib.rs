//! kvx-tokenizer: tokenizers and chat templates built from model metadata, giving exactly
//! llama.cpp's token ids for the same GGUF file.
//!
//! A [`Tokenizer`] is built from a GGUF file's `tokenizer.*` metadata (or from a Hugging Face
//! `tokenizer.json`). Encoding follows llama.cpp step by step: special tokens are cut out of
//! the text first (longest first, control tokens only when special tokens are parsed), then
//! each remaining piece is split by the pre-tokenizer regexes llama.cpp uses for the model's
//! `tokenizer.ggml.pre` and byte-level BPE is applied by the `tokenizers` crate. Decoding,
//! the end-of-generation set and the special-token attributes follow llama.cpp's vocabulary
//! rules. [`ChatTemplate`] renders `tokenizer.chat_template` with minijinja the way
//! transformers renders it with jinja2.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is implemented; SentencePiece
//! (`"llama"`) and the other models give [`TokenizerError::Unsupported`].
//!
//! Where kvx deliberately or unavoidably differs from llama.cpp:
//! - [`Tokenizer::decode`] does not apply llama.cpp's clean-up of spaces before punctuation
//!   (`llama_detokenize` does for some pre-tokenizer types), so decoding is lossless and
//!   equals the concatenation of the token pieces, as llama.cpp's server streams them.
//! - Where a vocabulary has several candidate texts for EOT or a FIM role, llama.cpp picks
//!   one in hash-map order; kvx picks the lowest id. The end-of-generation set is the same
//!   unless a vocabulary has several FIM pad/repo/separator candidates.
//! - Special tokens of equal length that overlap in the text are tried in id order
//!   (llama.cpp's order among them is unspecified).
//! - BPE merges whose parts or result are not vocabulary entries are left out.

#![forbid(unsafe_code)]

mod decode;
mod error;
mod hf;
mod pretok;
mod special;
mod template;
mod vocab;

use std::path::Path;

use kvx_gguf::GgufFile;

pub use decode::DecodeStream;
pub use error::{TemplateError, TokenizerError};
pub use template::{ChatMessage, ChatTemplate, ContentPart, MessageContent, RenderOptions};
pub use vocab::{SpecialTokens, TokenAttr};

use error::backend;
use special::{Fragment, SpecialMatcher};
use vocab::{PieceStyle, SpecialRole, Vocab, VocabInput};

/// A tokenizer: text to token ids and back, the model's special tokens, and its chat
/// template.
pub struct Tokenizer {
    vocab: Vocab,
    matcher: SpecialMatcher,
    backend: tokenizers::Tokenizer,
    description: String,
    chat_template: Option<ChatTemplate>,
    chat_template_error: Option<TemplateError>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.description)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.vocab.special)
            .field("add_bos", &self.vocab.add_bos)
            .field("add_eos", &self.vocab.add_eos)
            .field("eog", &self.vocab.eog)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// GGUF keys of the special ids, in the order llama.cpp reads them (the deprecated FIM keys
/// last, so they win).
const SPECIAL_KEYS: &[(&str, SpecialRole)] = &[
    ("tokenizer.ggml.bos_token_id", SpecialRole::Bos),
    ("tokenizer.ggml.eos_token_id", SpecialRole::Eos),
    ("tokenizer.ggml.eot_token_id", SpecialRole::Eot),
    ("tokenizer.ggml.eom_token_id", SpecialRole::Eom),
    ("tokenizer.ggml.unknown_token_id", SpecialRole::Unk),
    ("tokenizer.ggml.seperator_token_id", SpecialRole::Sep),
    ("tokenizer.ggml.padding_token_id", SpecialRole::Pad),
    ("tokenizer.ggml.mask_token_id", SpecialRole::Mask),
    ("tokenizer.ggml.fim_pre_token_id", SpecialRole::FimPre),
    ("tokenizer.ggml.fim_suf_token_id", SpecialRole::FimSuf),
    ("tokenizer.ggml.fim_mid_token_id", SpecialRole::FimMid),
    ("tokenizer.ggml.fim_pad_token_id", SpecialRole::FimPad),
    ("tokenizer.ggml.fim_rep_token_id", SpecialRole::FimRep),
    ("tokenizer.ggml.fim_sep_token_id", SpecialRole::FimSep),
    ("tokenizer.ggml.prefix_token_id", SpecialRole::FimPre),
    ("tokenizer.ggml.suffix_token_id", SpecialRole::FimSuf),
    ("tokenizer.ggml.middle_token_id", SpecialRole::FimMid),
];

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        match model {
            "gpt2" => {}
            "llama" => {
                return Err(TokenizerError::Unsupported(
                    "SentencePiece tokenizers (tokenizer.ggml.model = \"llama\") are not \
                     implemented yet"
                        .into(),
                ));
            }
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer model {other:?} (tokenizer.ggml.model) is not implemented"
                )));
            }
        }
        let pre_name = gguf.get_str_opt("tokenizer.ggml.pre")?;
        let spec = pretok::spec_for(pre_name)?;

        let texts = gguf.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let n = texts.len();
        let attrs = match gguf.get("tokenizer.ggml.token_type") {
            None => vec![vocab::TokenAttr::NORMAL; n],
            Some(_) => {
                let types = gguf.get_i32_array("tokenizer.ggml.token_type")?;
                if types.len() < n {
                    return Err(TokenizerError::Invalid(format!(
                        "{} token types for {n} tokens",
                        types.len()
                    )));
                }
                types[..n].iter().map(|&t| vocab::TokenAttr::from_token_type(t)).collect()
            }
        };
        let merges = gguf.get_str_array("tokenizer.ggml.merges")?;

        let defaults = SpecialTokens {
            bos: if spec.no_default_bos { None } else { Some(11) },
            eos: Some(11),
            ..Default::default()
        };
        let mut stated = Vec::new();
        for &(key, role) in SPECIAL_KEYS {
            if gguf.get(key).is_some() {
                stated.push((role, gguf.get_i64(key)?));
            }
        }
        let add_bos = gguf.get_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(spec.add_bos);
        let add_eos = gguf.get_bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

        let vocab = Vocab::new(VocabInput {
            texts,
            attrs,
            defaults,
            stated,
            add_bos,
            add_eos,
            model_name: gguf.get_str_opt("general.name")?.unwrap_or("").to_owned(),
            pre_name: pre_name.unwrap_or("").to_owned(),
            arch: gguf.get_str_opt("general.architecture")?.unwrap_or("").to_owned(),
            style: PieceStyle::ByteLevel,
        })?;

        let backend = bpe_backend(&vocab, merges, &spec)?;
        let description = format!(
            "byte-level BPE, pre-tokenizer {} ({})",
            pre_name.unwrap_or("default"),
            spec.family
        );
        let template_source = gguf.get_str_opt("tokenizer.chat_template")?.map(str::to_owned);
        Ok(Self::assemble(vocab, backend, description, template_source))
    }

    /// Opens a GGUF file and builds its tokenizer.
    pub fn from_gguf_path(path: &Path) -> Result<Self, TokenizerError> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// Builds a tokenizer from a Hugging Face `tokenizer.json`, reading the chat template and
    /// the BOS/EOS settings from a `tokenizer_config.json` beside it when there is one.
    ///
    /// Byte-level BPE tokenizers are supported; encoding uses the file's own normalizer,
    /// pre-tokenizer and model, with added tokens cut out of text by the same rules as for
    /// GGUF files (special ones only when special tokens are parsed).
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        hf::load(path)
    }

    fn assemble(
        vocab: Vocab,
        backend: tokenizers::Tokenizer,
        description: String,
        template_source: Option<String>,
    ) -> Self {
        let text_of = |id: Option<u32>| {
            id.and_then(|i| vocab.texts.get(i as usize)).cloned().unwrap_or_default()
        };
        let (chat_template, chat_template_error) = match template_source {
            None => (None, None),
            Some(src) => {
                match ChatTemplate::new(src, text_of(vocab.special.bos), text_of(vocab.special.eos))
                {
                    Ok(t) => (Some(t), None),
                    Err(e) => (None, Some(e)),
                }
            }
        };
        // The matcher is built from the vocabulary's special tokens, which are valid patterns;
        // failing that, encoding falls back to treating all text as plain text.
        let matcher = SpecialMatcher::new(&vocab).unwrap_or_else(|_| SpecialMatcher::empty());
        Tokenizer { vocab, matcher, backend, description, chat_template, chat_template_error }
    }

    /// Token ids of `text`. With `parse_special`, control tokens written in the text
    /// (`<|im_start|>`, ...) become their ids; without, they are tokenized as plain text.
    /// User-defined tokens are matched either way. Never adds BOS or EOS.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, parse_special, &mut out)?;
        Ok(out)
    }

    fn encode_into(
        &self,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        for fragment in self.matcher.partition(&self.vocab, text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(s) => {
                    let enc = self.backend.encode_fast(s, false).map_err(backend)?;
                    let n = self.vocab.texts.len() as u32;
                    out.extend(enc.get_ids().iter().copied().filter(|&id| id < n));
                }
            }
        }
        Ok(())
    }

    /// Token ids of a prompt as llama.cpp tokenizes one: BOS and EOS added as the model's
    /// `add_bos` / `add_eos` flags say, special tokens parsed.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if self.vocab.add_bos {
            out.push(self.vocab.special.bos.ok_or(TokenizerError::MissingSpecial("BOS"))?);
        }
        self.encode_into(text, true, &mut out)?;
        if self.vocab.add_eos {
            out.push(self.vocab.special.eos.ok_or(TokenizerError::MissingSpecial("EOS"))?);
        }
        Ok(out)
    }

    /// The text of `ids`. Control and unknown tokens render as their text unless
    /// `skip_special`; user-defined tokens always do. Invalid UTF-8 (a character cut off at
    /// either end) becomes U+FFFD. Unlike llama.cpp's `llama_detokenize`, no clean-up of
    /// spaces before punctuation is applied, so `decode(encode(x)) == x`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, skip_special)?);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    pub(crate) fn piece(&self, id: u32, skip_special: bool) -> Result<&[u8], TokenizerError> {
        let attr = self.attr(id)?;
        if skip_special && attr.intersects(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
            return Ok(&[]);
        }
        Ok(self.vocab.pieces.get(id as usize).unwrap_or(&[]))
    }

    fn attr(&self, id: u32) -> Result<TokenAttr, TokenizerError> {
        self.vocab
            .attrs
            .get(id as usize)
            .copied()
            .ok_or(TokenizerError::UnknownId { id, vocab_size: self.vocab_size() })
    }

    /// The bytes token `id` decodes to, special tokens rendered (may be part of a UTF-8
    /// character).
    pub fn token_to_piece(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.piece(id, false)
    }

    /// The vocabulary entry of `id` as stored (byte-level characters for BPE tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id of the vocabulary entry `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.ids.get(text).copied()
    }

    /// The attributes of `id` (llama.cpp's `llama_token_get_attr`).
    pub fn token_attr(&self, id: u32) -> Option<TokenAttr> {
        self.vocab.attrs.get(id as usize).copied()
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.texts.len()
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.vocab.special.bos
    }

    /// End-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.vocab.special.eos
    }

    /// All special-role ids.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.vocab.special
    }

    /// Whether prompts start with BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether prompts end with EOS.
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// The ids that end generation, ascending: EOS, EOT, EOM, the FIM pad/repo/separator
    /// tokens, and every token whose text is a known end marker (`<|im_end|>`,
    /// `<|endoftext|>`, `<|eot_id|>`, `<end_of_turn>`, ...), as llama.cpp computes them.
    pub fn eog_ids(&self) -> &[u32] {
        &self.vocab.eog
    }

    /// Whether `id` ends generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// The model's chat template, if it has one that compiles.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Why the model's chat template did not compile, if it did not.
    pub fn chat_template_error(&self) -> Option<&TemplateError> {
        self.chat_template_error.as_ref()
    }

    /// A short description (`byte-level BPE, pre-tokenizer smollm (starcoder)`).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// A new incremental detokenizer.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(skip_special)
    }

    /// The underlying `tokenizers` pipeline that encodes text between special tokens
    /// (byte-level BPE with the pre-tokenizer splits), e.g. to save it as `tokenizer.json`.
    pub fn backend(&self) -> &tokenizers::Tokenizer {
        &self.backend
    }
}

/// Vocabulary text of the placeholder for characters missing from the vocabulary.
const MISSING_CHAR_TEXT: &str = "\u{FFFF}kvx-missing-char";

/// The placeholder's id: the first id past the vocabulary.
fn missing_char_id(vocab: &Vocab) -> u32 {
    vocab.texts.len() as u32
}

/// The `tokenizers` pipeline for a GGUF byte-level BPE vocabulary.
fn bpe_backend(
    vocab: &Vocab,
    merges: &[String],
    spec: &pretok::PreSpec,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    use tokenizers::models::bpe::{BPE, Vocab as BpeVocab};

    let mut bpe_vocab = BpeVocab::default();
    for (i, t) in vocab.texts.iter().enumerate() {
        bpe_vocab.insert(t.clone(), i as u32);
    }
    let mut seen = std::collections::HashSet::with_capacity(merges.len());
    let mut pairs = Vec::with_capacity(merges.len());
    for line in merges {
        // Split at the first space after the first byte, as llama.cpp does.
        let Some(pos) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        let (a, b) = (&line[..pos], &line[pos + 1..]);
        if !seen.insert((a, b)) {
            continue; // llama.cpp keeps the first rank of a repeated merge
        }
        // A merge whose parts or result are not tokens can only produce text that falls back
        // to bytes; the tokenizers crate rejects such merges, so they are left out.
        if bpe_vocab.contains_key(a)
            && bpe_vocab.contains_key(b)
            && vocab.ids.contains_key(&[a, b].concat())
        {
            pairs.push((a.to_owned(), b.to_owned()));
        }
    }
    // Characters the vocabulary lacks must stay in the word while merging, keeping their
    // neighbours apart, and vanish afterwards (llama.cpp finds no token for them and drops
    // them after merging). A placeholder id beyond the vocabulary stands in for them; its
    // text uses a character outside the byte-level alphabet, so no text can reach it.
    bpe_vocab.insert(MISSING_CHAR_TEXT.to_owned(), missing_char_id(vocab));
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab, pairs)
        .unk_token(MISSING_CHAR_TEXT.to_owned())
        .fuse_unk(false)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(backend)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pretok::build(spec)?));
    Ok(tok)
}

#[cfg(test)]
mod tests {
    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<super::Tokenizer>();
        assert_send_sync::<super::ChatTemplate>();
        assert_send_sync::<super::DecodeStream>();
    }
}
