//! Cutting special tokens out of text before BPE, with llama.cpp's rules: tokens are tried
//! longest first; each takes every non-overlapping occurrence, left to right, in the text no
//! longer-tried token has taken. Control and unknown tokens are only cut when special tokens
//! are parsed; user-defined tokens always are.

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::error::{TokenizerError, backend};
use crate::vocab::{TokenAttr, Vocab};

/// A piece of the input: text still to be tokenized, or a token already decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Finds special tokens in text.
#[derive(Debug)]
pub(crate) struct SpecialMatcher {
    /// All occurrences of every special token, found in one pass.
    automaton: Option<AhoCorasick>,
    /// Pattern index → (rank in the cut order, token id).
    patterns: Vec<(usize, u32)>,
}

impl SpecialMatcher {
    pub fn new(vocab: &Vocab) -> Result<Self, TokenizerError> {
        if vocab.special_cache.is_empty() {
            return Ok(SpecialMatcher { automaton: None, patterns: Vec::new() });
        }
        let texts: Vec<&str> =
            vocab.special_cache.iter().map(|&id| vocab.texts[id as usize].as_str()).collect();
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(&texts)
            .map_err(backend)?;
        let patterns =
            vocab.special_cache.iter().enumerate().map(|(rank, &id)| (rank, id)).collect();
        Ok(SpecialMatcher { automaton: Some(automaton), patterns })
    }

    /// A matcher that finds nothing.
    pub fn empty() -> Self {
        SpecialMatcher { automaton: None, patterns: Vec::new() }
    }

    /// Splits `text` into fragments as llama.cpp's special-token partition does.
    pub fn partition<'a>(
        &self,
        vocab: &Vocab,
        text: &'a str,
        parse_special: bool,
    ) -> Vec<Fragment<'a>> {
        let Some(ac) = &self.automaton else {
            return whole(text);
        };
        // Every occurrence of every allowed token, grouped by the token's rank.
        let mut by_rank: Vec<(usize, usize, usize)> = Vec::new(); // (rank, start, end)
        for m in ac.find_overlapping_iter(text) {
            let (rank, id) = self.patterns[m.pattern().as_usize()];
            let attr = vocab.attrs[id as usize];
            if !parse_special && attr.intersects(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
                continue;
            }
            by_rank.push((rank, m.start(), m.end()));
        }
        if by_rank.is_empty() {
            return whole(text);
        }
        by_rank.sort_unstable();

        // Taken spans by start, disjoint: start -> (end, Some(token), or None for white space
        // swallowed by a strip attribute).
        let mut taken: BTreeMap<usize, (usize, Option<u32>)> = BTreeMap::new();
        let bytes = text.as_bytes();
        for &(rank, start, end) in &by_rank {
            let id = self.patterns[rank].1;
            let free_from = taken.range(..=start).next_back().map_or(0, |(_, &(e, _))| e);
            let free_to = taken.range(start + 1..).next().map_or(text.len(), |(&s, _)| s);
            if start < free_from || end > free_to {
                continue;
            }
            let attr = vocab.attrs[id as usize];
            if attr.intersects(TokenAttr::LSTRIP) {
                let mut s = start;
                while s > free_from && is_c_space(bytes[s - 1]) {
                    s -= 1;
                }
                if s < start {
                    taken.insert(s, (start, None));
                }
            }
            taken.insert(start, (end, Some(id)));
            if attr.intersects(TokenAttr::RSTRIP) {
                let mut e = end;
                while e < free_to && is_c_space(bytes[e]) {
                    e += 1;
                }
                if e > end {
                    taken.insert(end, (e, None));
                }
            }
        }

        // Every span boundary is a character boundary: a match of a UTF-8 string inside UTF-8
        // text starts and ends on one, and stripping only removes ASCII bytes.
        let mut out = Vec::with_capacity(taken.len() * 2 + 1);
        let mut at = 0;
        for (s, (e, tok)) in taken {
            if s > at {
                out.push(Fragment::Text(&text[at..s]));
            }
            if let Some(id) = tok {
                out.push(Fragment::Token(id));
            }
            at = e;
        }
        if at < text.len() {
            out.push(Fragment::Text(&text[at..]));
        }
        out
    }
}

fn whole(text: &str) -> Vec<Fragment<'_>> {
    if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}
