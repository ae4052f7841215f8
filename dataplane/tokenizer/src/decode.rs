//! Incremental detokenization: feed token ids one at a time, get text as soon as it forms
//! whole UTF-8 characters.

use crate::Tokenizer;
use crate::error::TokenizerError;

/// Turns a stream of token ids into text without ever emitting a broken character.
///
/// Bytes of a character split across tokens are held back until the character is complete.
/// Invalid bytes become U+FFFD exactly as `String::from_utf8_lossy` replaces them, so the
/// concatenation of everything [`DecodeStream::step`] and [`DecodeStream::finish`] return
/// equals [`Tokenizer::decode`] of all the ids.
///
/// The stream keeps only its state, not the tokenizer, so it can live next to an
/// `Arc<Tokenizer>` in a sequence's state. After the first few tokens it allocates nothing
/// but the text it returns (nothing at all with [`DecodeStream::step_into`]).
#[derive(Debug, Clone, Default)]
pub struct DecodeStream {
    skip_special: bool,
    /// An incomplete UTF-8 sequence from the previous tokens (at most 3 bytes).
    pending: Vec<u8>,
    /// Reused buffer for `pending` + the new piece.
    scratch: Vec<u8>,
}

impl DecodeStream {
    /// A new stream; `skip_special` drops control tokens as [`Tokenizer::decode`] does.
    pub fn new(skip_special: bool) -> Self {
        DecodeStream { skip_special, pending: Vec::with_capacity(4), scratch: Vec::new() }
    }

    /// Feeds one id and returns the text it completes (possibly empty).
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let mut out = String::new();
        self.step_into(tokenizer, id, &mut out)?;
        Ok(out)
    }

    /// Feeds one id and appends the text it completes to `out`.
    pub fn step_into(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        out: &mut String,
    ) -> Result<(), TokenizerError> {
        let piece = tokenizer.piece(id, self.skip_special)?;
        if self.pending.is_empty() {
            self.pending.clear();
            let rest = push_lossy(piece, out);
            self.pending.extend_from_slice(rest);
        } else {
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.pending);
            self.scratch.extend_from_slice(piece);
            let rest = push_lossy(&self.scratch, out);
            self.pending.clear();
            self.pending.extend_from_slice(rest);
        }
        Ok(())
    }

    /// Ends the stream: held-back bytes of an unfinished character become U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            out.push(char::REPLACEMENT_CHARACTER);
            self.pending.clear();
        }
    }

    /// Whether bytes of an unfinished character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// Appends `bytes` to `out` as `from_utf8_lossy` would, except that an incomplete sequence at
/// the very end is returned instead of replaced.
fn push_lossy<'a>(mut bytes: &'a [u8], out: &mut String) -> &'a [u8] {
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                return &[];
            }
            Err(e) => {
                let (valid, rest) = bytes.split_at(e.valid_up_to());
                // `valid` is valid UTF-8 by the definition of `valid_up_to`.
                out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes = &rest[n..];
                    }
                    None => return rest,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::push_lossy;

    #[test]
    fn lossy_chunks_match_from_utf8_lossy() {
        let cases: &[&[u8]] = &[
            b"plain",
            "é€😀".as_bytes(),
            b"\xF0\x9F\x98",
            b"a\xFFb\xC3",
            b"\xE2\x82\xE2\x82\xAC",
            b"\xED\xA0\x80x",
            b"\xF4\x90\x80\x80",
        ];
        for bytes in cases {
            for split in 0..=bytes.len() {
                let mut out = String::new();
                let pending = push_lossy(&bytes[..split], &mut out).to_vec();
                let mut joined = pending.clone();
                joined.extend_from_slice(&bytes[split..]);
                let rest = push_lossy(&joined, &mut out);
                if !rest.is_empty() {
                    out.push(char::REPLACEMENT_CHARACTER);
                }
                assert_eq!(out, String::from_utf8_lossy(bytes), "{bytes:?} split at {split}");
            }
        }
    }
}
