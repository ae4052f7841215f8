//! Per-request output processing: detokenization, stop conditions (end-of-generation tokens,
//! stop token ids, stop strings with streaming holdback, `max_tokens`, `min_tokens`).
//!
//! Text that could be the beginning of a stop string is held back until it can no longer
//! match, so a streamed response never shows text that the final response cuts off. Text is
//! appended to a caller-owned buffer; nothing here allocates per token once the request's
//! buffers have grown to their working size.

use kvx_proto::{FinishReason, StopConditions};
use kvx_tokenizer::{DecodeStream, Tokenizer};

/// The text and stop state of one request.
#[derive(Debug)]
pub struct OutputState {
    stop: StopConditions,
    stream: DecodeStream,
    /// Decoded text not yet released (a possible stop-string prefix).
    held: String,
    max_stop: usize,
    generated: usize,
}

impl OutputState {
    /// State for a request with these stop conditions.
    pub fn new(stop: StopConditions) -> Self {
        let max_stop = stop.stop.iter().map(String::len).max().unwrap_or(0);
        OutputState {
            held: String::with_capacity(max_stop * 2 + 64),
            stream: DecodeStream::new(true),
            max_stop,
            stop,
            generated: 0,
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Processes one sampled token: appends the text it releases to `out` and returns why the
    /// request ends, if it does. `tok` is `None` for tokenizer-free engines (no text, no stop
    /// strings).
    pub fn on_token(
        &mut self,
        token: u32,
        tok: Option<&Tokenizer>,
        out: &mut String,
    ) -> Option<FinishReason> {
        self.generated += 1;
        let n = self.generated;
        let may_stop = n >= self.stop.min_tokens as usize;
        let is_eog = tok.is_some_and(|t| t.is_eog(token)) && !self.stop.ignore_eos;
        if may_stop && (is_eog || self.stop.stop_token_ids.contains(&token)) {
            self.flush(tok, out);
            return Some(FinishReason::Stop);
        }
        if let Some(t) = tok {
            // Decoding errors (an id outside the vocabulary) cannot happen for sampled ids.
            let _ = self.stream.step_into(t, token, &mut self.held);
            if may_stop
                && self.max_stop > 0
                && let Some(cut) = self.find_stop()
            {
                out.push_str(&self.held[..cut]);
                self.held.clear();
                return Some(FinishReason::Stop);
            }
        }
        if n >= self.stop.max_tokens as usize {
            self.flush(tok, out);
            return Some(FinishReason::Length);
        }
        self.release(out);
        None
    }

    /// Replays tokens a client already received from an earlier placement of the request:
    /// the detokenizer, the held text and the counts end where they were, and the text those
    /// tokens released (which the client has) is dropped. `Some` if they already end it.
    pub fn replay(&mut self, tokens: &[u32], tok: Option<&Tokenizer>) -> Option<FinishReason> {
        let mut seen = String::new();
        for &t in tokens {
            if let Some(r) = self.on_token(t, tok, &mut seen) {
                return Some(r);
            }
            seen.clear();
        }
        None
    }

    /// Releases everything held (the request ends for another reason, e.g. cancellation).
    pub fn flush(&mut self, tok: Option<&Tokenizer>, out: &mut String) {
        if tok.is_some() {
            self.stream.finish(&mut self.held);
        }
        out.push_str(&self.held);
        self.held.clear();
    }

    /// Byte offset of the earliest stop-string match in `held`.
    fn find_stop(&self) -> Option<usize> {
        self.stop
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
    }

    /// Moves to `out` all held text except the longest suffix that starts a stop string.
    fn release(&mut self, out: &mut String) {
        let keep = if self.max_stop == 0 { 0 } else { self.holdback() };
        let cut = self.held.len() - keep;
        out.push_str(&self.held[..cut]);
        self.held.drain(..cut);
    }

    fn holdback(&self) -> usize {
        let h = self.held.as_bytes();
        let mut best = 0;
        for s in self.stop.stop.iter().map(String::as_bytes) {
            // Longest k < len(s) with held ending in s[..k].
            for k in (best + 1..s.len().min(h.len() + 1)).rev() {
                if h.ends_with(&s[..k]) {
                    best = best.max(k);
                    break;
                }
            }
        }
        // Never split a UTF-8 character.
        let mut keep = best;
        while keep < h.len() && !self.held.is_char_boundary(h.len() - keep) {
            keep += 1;
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds pre-decoded text through the holdback logic (tokenizer-free path + manual text).
    fn run(
        stop: &[&str],
        pieces: &[&str],
        max_tokens: u32,
    ) -> (String, Vec<String>, Option<FinishReason>) {
        let mut st = OutputState::new(StopConditions {
            max_tokens,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        });
        let mut total = String::new();
        let mut deltas = Vec::new();
        let mut fin = None;
        for p in pieces {
            st.generated += 1;
            st.held.push_str(p);
            let mut out = String::new();
            if let Some(cut) = st.find_stop() {
                out.push_str(&st.held[..cut]);
                st.held.clear();
                fin = Some(FinishReason::Stop);
            } else if st.generated >= max_tokens as usize {
                out.push_str(&st.held);
                st.held.clear();
                fin = Some(FinishReason::Length);
            } else {
                st.release(&mut out);
            }
            total.push_str(&out);
            deltas.push(out);
            if fin.is_some() {
                break;
            }
        }
        (total, deltas, fin)
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let (total, deltas, fin) = run(&["END"], &["Hello ", "wor", "ld E", "N", "D more"], 100);
        assert_eq!(total, "Hello world ");
        assert_eq!(fin, Some(FinishReason::Stop));
        // "E" and "EN" were held back while they could still become "END".
        assert_eq!(deltas, vec!["Hello ", "wor", "ld ", "", ""]);
    }

    #[test]
    fn a_false_start_is_released() {
        let (total, deltas, fin) = run(&["END"], &["a E", "x b"], 2);
        assert_eq!(total, "a Ex b");
        assert_eq!(deltas, vec!["a ", "Ex b"]);
        assert_eq!(fin, Some(FinishReason::Length));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (total, _, fin) = run(&["bb", "a"], &["xxbba"], 10);
        assert_eq!(total, "xx");
        assert_eq!(fin, Some(FinishReason::Stop));
    }

    #[test]
    fn holdback_never_splits_characters() {
        let (total, deltas, _) = run(&["é!"], &["café", " ok"], 10);
        assert_eq!(total, "café ok");
        assert_eq!(deltas[0], "caf");
    }

    #[test]
    fn stop_token_ids_and_min_tokens() {
        let mut st = OutputState::new(StopConditions {
            max_tokens: 10,
            min_tokens: 2,
            stop_token_ids: vec![5],
            ..Default::default()
        });
        let mut out = String::new();
        assert_eq!(st.on_token(5, None, &mut out), None, "min_tokens not reached");
        assert_eq!(st.on_token(5, None, &mut out), Some(FinishReason::Stop));
        let mut st = OutputState::new(StopConditions { max_tokens: 2, ..Default::default() });
        assert_eq!(st.on_token(1, None, &mut out), None);
        assert_eq!(st.on_token(1, None, &mut out), Some(FinishReason::Length));
    }
}
