//! The vocabulary as llama.cpp sees it: token texts and attributes, special ids (from the
//! model's keys and from well-known token texts), the end-of-generation set, the order in
//! which special tokens are cut out of text, and the text each token decodes to.

use std::collections::{BTreeSet, HashMap};

use crate::error::TokenizerError;

/// Token attributes, with the bit values of llama.cpp's `llama_token_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TokenAttr(u32);

impl TokenAttr {
    /// No type known.
    pub const UNDEFINED: TokenAttr = TokenAttr(0);
    /// The unknown token.
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    /// A placeholder that is never produced.
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    /// An ordinary vocabulary entry.
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    /// A control token (`<|im_start|>`, `<|endoftext|>`, ...).
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    /// A token added by the model's authors and matched literally in text.
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    /// A raw byte token (`<0x0A>`).
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);
    /// Normalized.
    pub const NORMALIZED: TokenAttr = TokenAttr(1 << 6);
    /// White space to the left is swallowed when the token is cut out of text.
    pub const LSTRIP: TokenAttr = TokenAttr(1 << 7);
    /// White space to the right is swallowed when the token is cut out of text.
    pub const RSTRIP: TokenAttr = TokenAttr(1 << 8);
    /// Single word.
    pub const SINGLE_WORD: TokenAttr = TokenAttr(1 << 9);

    /// The attribute of a GGUF `tokenizer.ggml.token_type` value.
    pub fn from_token_type(t: i32) -> TokenAttr {
        match t {
            1 => Self::NORMAL,
            2 => Self::UNKNOWN,
            3 => Self::CONTROL,
            4 => Self::USER_DEFINED,
            5 => Self::UNUSED,
            6 => Self::BYTE,
            _ => Self::UNDEFINED,
        }
    }

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether any bit of `other` is set.
    pub fn intersects(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }

    fn with(self, other: TokenAttr, on: bool) -> TokenAttr {
        if on { TokenAttr(self.0 | other.0) } else { TokenAttr(self.0 & !other.0) }
    }
}

impl std::ops::BitOr for TokenAttr {
    type Output = TokenAttr;
    fn bitor(self, rhs: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | rhs.0)
    }
}

/// Ids of the tokens with a special role (`None`: the model has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
    /// End of turn.
    pub eot: Option<u32>,
    /// End of message.
    pub eom: Option<u32>,
    /// Unknown.
    pub unk: Option<u32>,
    /// Separator.
    pub sep: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
    /// Mask.
    pub mask: Option<u32>,
    /// Fill-in-the-middle prefix.
    pub fim_pre: Option<u32>,
    /// Fill-in-the-middle suffix.
    pub fim_suf: Option<u32>,
    /// Fill-in-the-middle middle.
    pub fim_mid: Option<u32>,
    /// Fill-in-the-middle padding.
    pub fim_pad: Option<u32>,
    /// Fill-in-the-middle repository name.
    pub fim_rep: Option<u32>,
    /// Fill-in-the-middle file separator.
    pub fim_sep: Option<u32>,
}

/// How token texts turn back into bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte-level BPE: every character stands for one byte.
    ByteLevel,
}

/// Everything the vocabulary is built from, whatever the source file.
#[derive(Debug)]
pub(crate) struct VocabInput {
    pub texts: Vec<String>,
    pub attrs: Vec<TokenAttr>,
    /// Special ids the tokenizer type sets before the model's keys are read.
    pub defaults: SpecialTokens,
    /// Special ids the model file states, possibly out of range (then ignored).
    pub stated: Vec<(SpecialRole, i64)>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// `general.name`, `tokenizer.ggml.pre`, `general.architecture` (per-model attribute rules).
    pub model_name: String,
    pub pre_name: String,
    pub arch: String,
    pub style: PieceStyle,
}

/// A special role a model file can assign to a token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpecialRole {
    Bos,
    Eos,
    Eot,
    Eom,
    Unk,
    Sep,
    Pad,
    Mask,
    FimPre,
    FimSuf,
    FimMid,
    FimPad,
    FimRep,
    FimSep,
}

impl SpecialTokens {
    fn slot(&mut self, role: SpecialRole) -> &mut Option<u32> {
        match role {
            SpecialRole::Bos => &mut self.bos,
            SpecialRole::Eos => &mut self.eos,
            SpecialRole::Eot => &mut self.eot,
            SpecialRole::Eom => &mut self.eom,
            SpecialRole::Unk => &mut self.unk,
            SpecialRole::Sep => &mut self.sep,
            SpecialRole::Pad => &mut self.pad,
            SpecialRole::Mask => &mut self.mask,
            SpecialRole::FimPre => &mut self.fim_pre,
            SpecialRole::FimSuf => &mut self.fim_suf,
            SpecialRole::FimMid => &mut self.fim_mid,
            SpecialRole::FimPad => &mut self.fim_pad,
            SpecialRole::FimRep => &mut self.fim_rep,
            SpecialRole::FimSep => &mut self.fim_sep,
        }
    }
}

/// Token texts that mark a role when the model file does not name the token.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] =
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Token texts that end generation wherever they are in the vocabulary.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Tokens that always render, whatever their type says (harmony format).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// The vocabulary, ready for encoding and decoding.
#[derive(Debug)]
pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub attrs: Vec<TokenAttr>,
    pub ids: HashMap<String, u32>,
    pub special: SpecialTokens,
    pub add_bos: bool,
    pub add_eos: bool,
    /// End-of-generation ids, ascending.
    pub eog: Vec<u32>,
    /// Control, user-defined and unknown tokens, longest text first: the order in which they
    /// are cut out of text.
    pub special_cache: Vec<u32>,
    /// The bytes each token renders to when special tokens are shown.
    pub pieces: Pieces,
}

/// All token pieces in one buffer.
#[derive(Debug, Default)]
pub(crate) struct Pieces {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Pieces {
    pub fn get(&self, id: usize) -> Option<&[u8]> {
        let end = *self.ends.get(id)?;
        let start = if id == 0 { 0 } else { self.ends[id - 1] };
        self.bytes.get(start..end)
    }
}

impl Vocab {
    pub fn new(input: VocabInput) -> Result<Vocab, TokenizerError> {
        let VocabInput {
            mut texts,
            mut attrs,
            defaults,
            stated,
            add_bos,
            add_eos,
            model_name,
            pre_name,
            arch,
            style,
        } = input;
        let n = texts.len();
        if n == 0 {
            return Err(TokenizerError::Invalid("the vocabulary is empty".into()));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::Invalid(format!("{n} tokens do not fit u32 ids")));
        }
        attrs.resize(n, TokenAttr::NORMAL);

        let mut ids = HashMap::with_capacity(n);
        for (i, t) in texts.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
            if ids.insert(t.clone(), i as u32).is_some() {
                return Err(TokenizerError::Invalid(format!("token {t:?} appears twice")));
            }
        }

        // Special ids: defaults out of range are dropped; stated ids out of range are ignored.
        let mut special = defaults;
        let in_range = |id: i64| u32::try_from(id).ok().filter(|&v| (v as usize) < n);
        for role in [
            SpecialRole::Bos,
            SpecialRole::Eos,
            SpecialRole::Eot,
            SpecialRole::Eom,
            SpecialRole::Unk,
            SpecialRole::Sep,
            SpecialRole::Pad,
            SpecialRole::Mask,
            SpecialRole::FimPre,
            SpecialRole::FimSuf,
            SpecialRole::FimMid,
            SpecialRole::FimPad,
            SpecialRole::FimRep,
            SpecialRole::FimSep,
        ] {
            let slot = special.slot(role);
            *slot = slot.filter(|&v| (v as usize) < n);
        }
        for &(role, id) in &stated {
            if let Some(v) = in_range(id) {
                *special.slot(role) = Some(v);
            }
        }

        // Roles found by token text (first match in id order), forced to be control tokens.
        let detect: [(SpecialRole, &[&str]); 8] = [
            (SpecialRole::Eot, EOT_TEXTS),
            (SpecialRole::Eom, EOM_TEXTS),
            (SpecialRole::FimPre, FIM_PRE_TEXTS),
            (SpecialRole::FimSuf, FIM_SUF_TEXTS),
            (SpecialRole::FimMid, FIM_MID_TEXTS),
            (SpecialRole::FimPad, FIM_PAD_TEXTS),
            (SpecialRole::FimRep, FIM_REP_TEXTS),
            (SpecialRole::FimSep, FIM_SEP_TEXTS),
        ];
        for (role, names) in detect {
            if special.slot(role).is_some() {
                continue;
            }
            if let Some(id) = (0..n).find(|&i| names.contains(&texts[i].as_str())) {
                *special.slot(role) = Some(id as u32);
                attrs[id] = attrs[id] | TokenAttr::CONTROL;
            }
        }

        // Control tokens whose text says "unused" are unused.
        for (t, a) in texts.iter().zip(attrs.iter_mut()) {
            if a.intersects(TokenAttr::CONTROL) && t.contains("unused") {
                *a = *a | TokenAttr::UNUSED;
            }
        }

        // End of generation.
        let mut eog = BTreeSet::new();
        eog.extend(special.fim_pad);
        eog.extend(special.fim_rep);
        eog.extend(special.fim_sep);
        for (i, t) in texts.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) {
                eog.insert(i as u32);
                attrs[i] = attrs[i] | TokenAttr::CONTROL;
            }
        }
        for (i, t) in texts.iter().enumerate() {
            if ALWAYS_RENDERED.contains(&t.as_str()) {
                attrs[i] = TokenAttr::USER_DEFINED;
            }
        }
        eog.extend(special.eos);
        eog.extend(special.eot);
        eog.extend(special.eom);
        let with_text =
            |eog: &BTreeSet<u32>, s: &str| eog.iter().copied().find(|&i| texts[i as usize] == s);
        // Formats where "<|end|>" ends a message but not the generation.
        if let Some(end) = with_text(&eog, "<|end|>") {
            let has = |s: &str| with_text(&eog, s).is_some();
            let has_call = has("<|call|>") || has("<|calls|>");
            if has_call && (has("<|return|>") || has("<|flush|>")) {
                eog.remove(&end);
                attrs[end as usize] = TokenAttr::USER_DEFINED;
            }
        }
        // Formats where "</s>" is an ordinary token.
        if let Some(s) = with_text(&eog, "</s>")
            && (with_text(&eog, "<|tool_response>").is_some()
                || with_text(&eog, "<|plamo:eos|>").is_some())
        {
            eog.remove(&s);
            attrs[s as usize] = TokenAttr::NORMAL;
        }

        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize]
                    .intersects(TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN)
            })
            .collect();
        special_cache.sort_by(|&a, &b| texts[b as usize].len().cmp(&texts[a as usize].len()));

        let pieces = build_pieces(&texts, &attrs, style);

        // Per-model strip rules.
        let name = model_name.to_lowercase();
        let set = |text: &str, attr: TokenAttr, on: bool, attrs: &mut Vec<TokenAttr>| {
            if let Some(&id) = ids.get(text) {
                attrs[id as usize] = attrs[id as usize].with(attr, on);
            }
        };
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code"].iter().any(|s| pre_name.contains(s))
            || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|s| arch.contains(s))
        {
            set("<mask>", TokenAttr::LSTRIP, true, &mut attrs);
        } else if name.contains("phi-3") || name.contains("phi3") {
            for &id in &special_cache {
                attrs[id as usize] = attrs[id as usize].with(TokenAttr::RSTRIP, true);
            }
            set("</s>", TokenAttr::RSTRIP, true, &mut attrs);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(t, TokenAttr::RSTRIP, false, &mut attrs);
            }
        } else if name.contains("modern-bert") {
            set("[MASK]", TokenAttr::LSTRIP, true, &mut attrs);
        }

        Ok(Vocab {
            texts,
            attrs,
            ids,
            special,
            add_bos,
            add_eos,
            eog: eog.into_iter().collect(),
            special_cache,
            pieces,
        })
    }
}

/// The GPT-2 byte ↔ character table: printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100.. in byte order.
pub(crate) fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

fn build_pieces(texts: &[String], attrs: &[TokenAttr], style: PieceStyle) -> Pieces {
    let PieceStyle::ByteLevel = style;
    let chars = byte_level_chars();
    let mut to_byte: HashMap<char, u8> = HashMap::with_capacity(256);
    for (b, &c) in chars.iter().enumerate() {
        to_byte.insert(c, b as u8);
    }
    let mut pieces = Pieces { bytes: Vec::new(), ends: Vec::with_capacity(texts.len()) };
    for (text, &attr) in texts.iter().zip(attrs) {
        if attr.intersects(TokenAttr::UNKNOWN | TokenAttr::CONTROL | TokenAttr::USER_DEFINED) {
            pieces.bytes.extend_from_slice(text.as_bytes());
        } else if attr.intersects(TokenAttr::NORMAL) {
            for c in text.chars() {
                match to_byte.get(&c) {
                    Some(&b) => pieces.bytes.push(b),
                    None => {
                        // llama.cpp marks characters outside the byte table this way.
                        let mut buf = [0u8; 4];
                        pieces.bytes.extend_from_slice(b"[UNK_BYTE_0x");
                        for byte in c.encode_utf8(&mut buf).bytes() {
                            pieces.bytes.extend_from_slice(format!("{byte:02x}").as_bytes());
                        }
                        pieces.bytes.extend_from_slice(text.as_bytes());
                        pieces.bytes.push(b']');
                    }
                }
            }
        } else if attr.intersects(TokenAttr::BYTE) {
            pieces.bytes.push(byte_token_value(text));
        }
        pieces.ends.push(pieces.bytes.len());
    }
    pieces
}

/// The byte of a `<0xAB>` token, read as llama.cpp does (two hex digits at offset 3, as many
/// as parse).
fn byte_token_value(text: &str) -> u8 {
    let digits = text.get(3..5).or_else(|| text.get(3..)).unwrap_or("");
    let mut v: u32 = 0;
    for c in digits.chars() {
        match c.to_digit(16) {
            Some(d) => v = v * 16 + d,
            None => break,
        }
    }
    v as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_level_chars();
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xAD], 'Ń');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn byte_tokens() {
        assert_eq!(byte_token_value("<0x0A>"), 10);
        assert_eq!(byte_token_value("<0xff>"), 255);
        assert_eq!(byte_token_value("<0x"), 0);
    }
}
