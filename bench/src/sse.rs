//! Server-sent-events framing and OpenAI stream-chunk parsing without per-token allocation.
//!
//! [`SseParser`] splits the byte stream into events with one reusable buffer; [`parse_chunk`]
//! reads the few fields a benchmark needs from a chunk by borrowing from the event's bytes.
//! Neither allocates once the buffers have grown to the size of the largest event.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Largest SSE line or event accepted; a longer one is a protocol error (bounds memory).
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// The stream carried more than [`MAX_EVENT_BYTES`] without an event boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventTooLarge;

/// Incremental SSE parser (the `text/event-stream` format): feed it bytes as they arrive and it
/// calls back once per complete event with the event's `data` (multi-line data joined by `\n`).
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of an incomplete line carried over from the previous feed.
    line: Vec<u8>,
    /// Data of the event being assembled.
    data: Vec<u8>,
    /// Whether `data` holds at least one data line (an event may carry empty data).
    has_data: bool,
    /// The previous feed ended on `\r`, so a leading `\n` in the next feed belongs to it.
    after_cr: bool,
}

impl SseParser {
    /// A parser with no pending bytes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets any partial event, keeping the buffers' capacity.
    pub fn reset(&mut self) {
        self.line.clear();
        self.data.clear();
        self.has_data = false;
        self.after_cr = false;
    }

    /// Consumes `bytes`, calling `on_event` with the data of each event completed by them.
    pub fn feed(
        &mut self,
        mut bytes: &[u8],
        mut on_event: impl FnMut(&[u8]),
    ) -> Result<(), EventTooLarge> {
        if self.after_cr {
            self.after_cr = false;
            if let [b'\n', rest @ ..] = bytes {
                bytes = rest;
            }
        }
        while let Some(pos) = memchr::memchr2(b'\n', b'\r', bytes) {
            let (head, tail) = bytes.split_at(pos);
            let is_cr = tail[0] == b'\r';
            bytes = &tail[1..];
            if is_cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            if self.line.is_empty() {
                self.line_done(head, &mut on_event)?;
            } else {
                self.push_line(head)?;
                let line = std::mem::take(&mut self.line);
                let r = self.line_done(&line, &mut on_event);
                self.line = line;
                self.line.clear();
                r?;
            }
        }
        self.push_line(bytes)
    }

    /// Flushes an event left open when the stream ends without a blank line.
    pub fn finish(&mut self, mut on_event: impl FnMut(&[u8])) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            // A too-large line was already refused when it was pushed.
            let _ = self.line_done(&line, &mut on_event);
            self.line = line;
            self.line.clear();
        }
        if self.has_data {
            on_event(&self.data);
        }
        self.data.clear();
        self.has_data = false;
    }

    fn push_line(&mut self, bytes: &[u8]) -> Result<(), EventTooLarge> {
        if self.line.len() + bytes.len() > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn line_done(
        &mut self,
        line: &[u8],
        on_event: &mut impl FnMut(&[u8]),
    ) -> Result<(), EventTooLarge> {
        if line.is_empty() {
            if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
            return Ok(());
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(0) => return Ok(()), // comment
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            if self.data.len() + value.len() > MAX_EVENT_BYTES {
                return Err(EventTooLarge);
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        Ok(())
    }
}

/// Token usage as OpenAI-compatible servers report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct Usage {
    /// Prompt tokens the server counted.
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    /// Details of the prompt tokens (prefix-cache hits).
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// kvx's extension: milliseconds the prompt's KV took to move from a prefill worker.
    #[serde(default)]
    pub kv_transfer_ms: Option<f64>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the server's prefix cache.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl Usage {
    /// `prompt_tokens_details.cached_tokens`, when reported.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

/// What one stream chunk says, borrowed from the event bytes.
#[derive(Debug, Default)]
pub struct ChunkInfo<'a> {
    /// The generated text of the first choice as a raw JSON string (quotes and escapes
    /// included): `delta.content` (chat), `text` (completions), or a reasoning field.
    pub content: Option<&'a RawValue>,
    /// The first choice carries a finish reason.
    pub finished: bool,
    /// Usage, when the chunk carries it.
    pub usage: Option<Usage>,
    /// The chunk is an error object.
    pub error: bool,
}

impl ChunkInfo<'_> {
    /// Whether the chunk carries generated text (a non-empty string).
    pub fn has_content(&self) -> bool {
        self.content.is_some_and(|raw| {
            let s = raw.get();
            s.len() > 2 && s.starts_with('"')
        })
    }
}

/// Parses one stream chunk (`data` of one event other than `[DONE]`).
pub fn parse_chunk(data: &[u8]) -> Result<ChunkInfo<'_>, serde_json::Error> {
    let wire: WireChunk<'_> = serde_json::from_slice(data)?;
    let (content, finished) = match wire.choices.0 {
        Some(c) => {
            let delta = c.delta.unwrap_or_default();
            let content = [c.text, delta.content, delta.reasoning_content, delta.reasoning]
                .into_iter()
                .flatten()
                .find(|raw| raw.get().len() > 2 && raw.get().starts_with('"'));
            (content, c.finish_reason.is_some_and(|r| r.get() != "null"))
        }
        None => (None, false),
    };
    Ok(ChunkInfo {
        content,
        finished,
        usage: wire.usage,
        error: wire.error.is_some_and(|e| e.get() != "null"),
    })
}

#[derive(Deserialize)]
struct WireChunk<'a> {
    #[serde(default, borrow)]
    choices: FirstChoice<'a>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
}

#[derive(Deserialize, Default)]
struct WireChoice<'a> {
    #[serde(default, borrow)]
    delta: Option<WireDelta<'a>>,
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize, Default)]
struct WireDelta<'a> {
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    reasoning: Option<&'a RawValue>,
}

/// The first element of `choices`, skipping the rest without collecting them.
#[derive(Default)]
struct FirstChoice<'a>(Option<WireChoice<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstChoice(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<WireChoice<'a>>()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Appends the text of a raw JSON string (with its quotes) to `out`, resolving escapes.
/// Returns `false` (leaving `out` as it was) if `raw` is not a well-formed JSON string.
pub fn unescape_json_str(raw: &str, out: &mut String) -> bool {
    let start_len = out.len();
    let ok = unescape_inner(raw, out);
    if !ok {
        out.truncate(start_len);
    }
    ok
}

fn unescape_inner(raw: &str, out: &mut String) -> bool {
    let Some(body) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) else {
        return false;
    };
    let bytes = body.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let Some(off) = memchr::memchr(b'\\', &bytes[i..]) else {
            out.push_str(&body[i..]);
            return true;
        };
        out.push_str(&body[i..i + off]);
        i += off + 1;
        let Some(&esc) = bytes.get(i) else { return false };
        i += 1;
        let c = match esc {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let Some(hi) = hex4(bytes, i) else { return false };
                i += 4;
                if (0xD800..0xDC00).contains(&hi) {
                    // A high surrogate must be followed by `\u` and a low surrogate.
                    if bytes.get(i) != Some(&b'\\') || bytes.get(i + 1) != Some(&b'u') {
                        return false;
                    }
                    let Some(lo) = hex4(bytes, i + 2) else { return false };
                    if !(0xDC00..0xE000).contains(&lo) {
                        return false;
                    }
                    i += 6;
                    match char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)) {
                        Some(c) => c,
                        None => return false,
                    }
                } else {
                    match char::from_u32(hi) {
                        Some(c) => c,
                        None => return false,
                    }
                }
            }
            _ => return false,
        };
        out.push(c);
    }
    true
}

fn hex4(bytes: &[u8], at: usize) -> Option<u32> {
    let s = bytes.get(at..at + 4)?;
    let mut v = 0u32;
    for &b in s {
        v = v * 16 + (b as char).to_digit(16)?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn events_of(chunks: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, |d| out.push(String::from_utf8(d.to_vec()).unwrap())).unwrap();
        }
        p.finish(|d| out.push(String::from_utf8(d.to_vec()).unwrap()));
        out
    }

    /// Reference twin: split the whole stream at once, the simplest way the spec allows.
    fn events_reference(stream: &[u8]) -> Vec<String> {
        let text = String::from_utf8(stream.to_vec()).unwrap();
        let text = text.replace("\r\n", "\n").replace('\r', "\n");
        let mut out = Vec::new();
        let mut data: Option<String> = None;
        for line in text.split('\n') {
            if line.is_empty() {
                if let Some(d) = data.take() {
                    out.push(d);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            if field == "data" {
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                }
            }
        }
        if let Some(d) = data {
            out.push(d);
        }
        out
    }

    #[test]
    fn splits_events_across_any_chunking_like_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let pieces = [
            "data: {\"a\":1}\n\n",
            "data: {\"b\":2}\r\n\r\n",
            ": keep-alive\n\n",
            "event: message\ndata: x\ndata: y\n\n",
            "data:nospace\r\r",
            "id: 7\ndata: [DONE]\n\n",
            "data\n\n",
        ];
        for _ in 0..300 {
            let mut stream = String::new();
            for _ in 0..rng.random_range(1..12) {
                stream.push_str(pieces[rng.random_range(0..pieces.len())]);
            }
            let bytes = stream.as_bytes();
            let mut cuts: Vec<usize> =
                (0..rng.random_range(0..6)).map(|_| rng.random_range(0..=bytes.len())).collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut prev = 0;
            for c in cuts {
                chunks.push(&bytes[prev..c]);
                prev = c;
            }
            chunks.push(&bytes[prev..]);
            assert_eq!(events_of(&chunks), events_reference(bytes), "{stream:?}");
        }
    }

    #[test]
    fn unterminated_last_event_is_flushed_and_huge_lines_are_refused() {
        assert_eq!(events_of(&[b"data: a\n\ndata: b"]), vec!["a", "b"]);
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(p.feed(&big, |_| {}), Err(EventTooLarge));
    }

    #[test]
    fn reads_chat_and_completion_chunks() {
        let c = parse_chunk(br#"{"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#).unwrap();
        assert!(!c.has_content() && !c.finished && c.usage.is_none());
        let c = parse_chunk(br#"{"choices":[{"delta":{"content":"Hi \"you\""},"finish_reason":null},{"delta":{}}]}"#).unwrap();
        assert!(c.has_content());
        let mut s = String::new();
        assert!(unescape_json_str(c.content.unwrap().get(), &mut s));
        assert_eq!(s, "Hi \"you\"");
        let c = parse_chunk(br#"{"choices":[{"text":" the","finish_reason":"length"}]}"#).unwrap();
        assert!(c.has_content() && c.finished);
        let c = parse_chunk(br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#).unwrap();
        let u = c.usage.unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens()),
            (Some(9), Some(3), Some(4))
        );
        let c = parse_chunk(br#"{"choices":null,"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":null}}"#).unwrap();
        assert_eq!(c.usage.unwrap().cached_tokens(), None);
        let c = parse_chunk(br#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#).unwrap();
        assert!(c.has_content());
        assert!(parse_chunk(br#"{"error":{"message":"boom"}}"#).unwrap().error);
        assert!(parse_chunk(b"{not json").is_err());
    }

    #[test]
    fn unescape_matches_serde_json_on_random_strings() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let alphabet = ['a', ' ', '"', '\\', '\n', '\t', '/', 'é', '€', '😀', '\u{1}', '\u{7f}'];
        for _ in 0..2000 {
            let s: String =
                (0..rng.random_range(0..20)).map(|_| alphabet[rng.random_range(0..12)]).collect();
            let mut raw = serde_json::to_string(&s).unwrap();
            if rng.random_bool(0.3) {
                // Also exercise \u escapes for every char, the other legal spelling.
                raw = String::from("\"");
                for u in s.encode_utf16() {
                    raw.push_str(&format!("\\u{u:04x}"));
                }
                raw.push('"');
            }
            let want: String = serde_json::from_str(&raw).unwrap();
            let mut got = String::from("prefix");
            assert!(unescape_json_str(&raw, &mut got));
            assert_eq!(&got["prefix".len()..], want);
        }
        for bad in [r#""\"#, r#""\x""#, r#""\ud800""#, r#""\ud800\u0041""#, "noquotes", r#""\u12""#]
        {
            let mut out = String::from("keep");
            assert!(!unescape_json_str(bad, &mut out), "{bad}");
            assert_eq!(out, "keep");
        }
    }
}
