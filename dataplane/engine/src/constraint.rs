//! Structured outputs: a request's grammar (JSON schema, any JSON object, regex, Lark)
//! compiled by llguidance into a per-sequence matcher that masks each step's logits to the
//! tokens the grammar allows and follows the tokens sampled.
//!
//! [`ConstraintEnv`] is the vocabulary's side: a token trie built from the tokenizer's pieces
//! (control, user-defined and unused tokens carry toktrie's special-token marker byte, so
//! grammars never match them as text; the end-of-generation ids are the trie's EOS set) and
//! llguidance's parser factory over it. It takes a while for a large vocabulary, so it is
//! built once per tokenizer and vocabulary size, at the first constrained request, and
//! shared by every engine of the process ([`ConstraintEnv::shared`]).
//!
//! [`SeqConstraint`] is one sequence's matcher. The engine calls [`SeqConstraint::mask`]
//! before penalties and sampling and [`SeqConstraint::advance`] with the token sampled; the
//! matcher advances only on tokens appended to the sequence, so a preempted sequence that
//! recomputes its KV does not feed it twice. The unconstrained path never touches this
//! module.

use std::sync::{Arc, Mutex, Weak};

use kvx_proto::Constraint;
use kvx_tokenizer::{TokenAttr, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// JSON layout when a schema does not choose its own (`x-guidance`): no free whitespace
/// (a small model could otherwise pad forever), a space after `:` and `,` as in
/// `json.dumps`' default output.
const JSON_LAYOUT: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

/// The vocabulary side of structured outputs: the token trie and llguidance's factory.
pub struct ConstraintEnv {
    factory: ParserFactory,
    eog: Vec<u32>,
    n_vocab: usize,
}

impl std::fmt::Debug for ConstraintEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintEnv")
            .field("n_vocab", &self.n_vocab)
            .field("eog", &self.eog)
            .finish()
    }
}

type Cache = Mutex<Vec<(Weak<Tokenizer>, usize, Arc<ConstraintEnv>)>>;
static SHARED: Cache = Mutex::new(Vec::new());

impl ConstraintEnv {
    /// The environment of `tok` over logits rows of `n_vocab` entries, built at the first
    /// call for that tokenizer and size and shared afterwards.
    pub fn shared(tok: &Arc<Tokenizer>, n_vocab: usize) -> Result<Arc<ConstraintEnv>, String> {
        let mut cache = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        cache.retain(|(t, _, _)| t.strong_count() > 0);
        if let Some((_, _, env)) =
            cache.iter().find(|(t, n, _)| *n == n_vocab && t.as_ptr() == Arc::as_ptr(tok))
        {
            return Ok(env.clone());
        }
        let env = Arc::new(ConstraintEnv::new(tok, n_vocab)?);
        cache.push((Arc::downgrade(tok), n_vocab, env.clone()));
        Ok(env)
    }

    /// The environment of `tok` over logits rows of `n_vocab` entries (ids the tokenizer
    /// does not know are never allowed).
    pub fn new(tok: &Tokenizer, n_vocab: usize) -> Result<ConstraintEnv, String> {
        let special =
            TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN | TokenAttr::UNUSED;
        let words = (0..n_vocab as u32)
            .map(|id| {
                let piece = tok.token_to_piece(id).unwrap_or(&[]);
                let is_special =
                    tok.is_eog(id) || tok.token_attr(id).is_some_and(|a| a.intersects(special));
                if is_special && !piece.is_empty() {
                    let mut w = Vec::with_capacity(piece.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(piece);
                    w
                } else {
                    piece.to_vec()
                }
            })
            .collect::<Vec<_>>();
        let eog: Vec<u32> =
            tok.eog_ids().iter().copied().filter(|&t| (t as usize) < n_vocab).collect();
        Self::from_words(&words, &eog)
    }

    /// The environment of a vocabulary given as each token's bytes (special tokens starting
    /// with [`TokTrie::SPECIAL_TOKEN_MARKER`]) and its end-of-generation ids.
    pub fn from_words(words: &[Vec<u8>], eog: &[u32]) -> Result<ConstraintEnv, String> {
        let Some(&eos) = eog.first() else {
            return Err("structured outputs need an end-of-generation token".into());
        };
        if let Some(&t) = eog.iter().find(|&&t| t as usize >= words.len()) {
            return Err(format!("end-of-generation token {t} is outside the vocabulary"));
        }
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, words).with_eos_tokens(eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        // Bounds on what one grammar may cost the step thread, below llguidance's defaults
        // (which allow ~20 ms to build a lexer and ~14 ms per mask): a grammar past them is
        // refused at admission or ends its request, and never stalls the other sequences.
        let limits = factory.limits_mut();
        limits.initial_lexer_fuel = 250_000;
        limits.step_lexer_fuel = 70_000;
        limits.step_max_items = 20_000;
        limits.max_lexer_states = 50_000;
        limits.max_grammar_size = 100_000;
        Ok(ConstraintEnv { factory, eog: eog.to_vec(), n_vocab: words.len() })
    }

    /// Compiles a request's constraint; the error is the client's (a bad schema, regex or
    /// grammar), with llguidance's message.
    pub fn compile(&self, c: &Constraint) -> Result<SeqConstraint, String> {
        let grammar = match c {
            Constraint::JsonSchema(s) => {
                let mut schema: serde_json::Value = serde_json::from_str(s)
                    .map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
                with_layout(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::JsonObject => {
                let mut schema = serde_json::json!({"type": "object"});
                with_layout(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(SeqConstraint { matcher, eog: self.eog.clone(), ready: None })
    }
}

/// Adds the default JSON layout to an object schema that does not set its own.
fn with_layout(schema: &mut serde_json::Value) {
    if let Some(obj) = schema.as_object_mut()
        && !obj.contains_key("x-guidance")
        && let Ok(layout) = serde_json::from_str(JSON_LAYOUT)
    {
        obj.insert("x-guidance".into(), layout);
    }
}

/// One sequence's grammar state.
pub struct SeqConstraint {
    matcher: Matcher,
    eog: Vec<u32>,
    /// The next step's mask, computed ahead ([`SeqConstraint::prepare`]).
    ready: Option<toktrie::SimpleVob>,
}

impl std::fmt::Debug for SeqConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.matcher.get_error())
            .finish()
    }
}

impl SeqConstraint {
    /// Sets the logits of every token the grammar does not allow next to −∞ (the
    /// end-of-generation ids are allowed where the grammar may end). False when no token is
    /// allowed (the matcher failed or is stopped): the sequence must end.
    pub fn mask(&mut self, logits: &mut [f32]) -> bool {
        if self.matcher.is_stopped() {
            return false;
        }
        let mask = match self.ready.take() {
            Some(m) => m,
            None => match self.matcher.compute_mask() {
                Ok(m) => m,
                Err(_) => return false,
            },
        };
        let words = mask.as_slice();
        let mut any = false;
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                any = true;
                continue;
            }
            if bits == 0 {
                // Most words of a mask: nothing allowed.
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits >> i & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                } else {
                    any = true;
                }
            }
        }
        any
    }

    /// Computes the next step's mask now (so that the masks of a batch are computed in
    /// parallel before they are applied); [`SeqConstraint::mask`] uses it.
    pub fn prepare(&mut self) {
        if self.ready.is_none() && !self.matcher.is_stopped() {
            self.ready = self.matcher.compute_mask().ok();
        }
    }

    /// Follows a sampled token; true when the grammar is complete (the token was an
    /// end-of-generation id, or nothing but one can follow) or the matcher failed: the
    /// sequence ends.
    pub fn advance(&mut self, token: u32) -> bool {
        self.ready = None;
        if self.eog.contains(&token) {
            let _ = self.matcher.consume_token(token);
            return true;
        }
        self.matcher.consume_token(token).is_err() || self.matcher.is_stopped()
    }

    /// Follows tokens already generated (a resumed request). Errors if the grammar does not
    /// accept them or they complete it.
    pub fn replay(&mut self, tokens: &[u32]) -> Result<(), String> {
        for &t in tokens {
            if self.advance(t) {
                return Err(self.matcher.get_error().unwrap_or_else(|| {
                    "the resumed tokens already complete the constraint".into()
                }));
            }
        }
        Ok(())
    }

    /// Whether the grammar can end here (end-of-generation is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: every printable ASCII byte, some multi-byte pieces, a special token
    /// and an end-of-generation token (the last id).
    fn toy() -> (ConstraintEnv, Vec<Vec<u8>>) {
        let mut words: Vec<Vec<u8>> = (0x20u8..0x7f).map(|b| vec![b]).collect();
        for w in ["{\"", "\": ", "\"}", ", \"", "true", "false", "null", "12", "ab", "abc"] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(b"\xff<|special|>".to_vec());
        words.push(b"\xff<|end|>".to_vec());
        let eog = words.len() as u32 - 1;
        (ConstraintEnv::from_words(&words, &[eog]).unwrap(), words)
    }

    /// Greedy decoding with logits that prefer `pref` (higher = better), under `c`.
    fn run(c: &mut SeqConstraint, words: &[Vec<u8>], pref: impl Fn(u32) -> f32) -> Vec<u8> {
        let eog = words.len() as u32 - 1;
        let mut out = Vec::new();
        for _ in 0..200 {
            let mut logits: Vec<f32> = (0..words.len() as u32).map(&pref).collect();
            assert!(c.mask(&mut logits), "some token is allowed");
            let (best, _) = logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |b, (i, &l)| if l > b.1 { (i, l) } else { b });
            let best = best as u32;
            assert_ne!(words[best as usize][0], 0xff, "special tokens are never text");
            let done = c.advance(best);
            if best == eog {
                return out;
            }
            out.extend_from_slice(&words[best as usize]);
            if done {
                return out;
            }
        }
        panic!("no end in 200 tokens: {}", String::from_utf8_lossy(&out));
    }

    #[test]
    fn a_schema_forces_valid_json() {
        let (env, words) = toy();
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer","minimum":0,
            "maximum":99},"b":{"type":"boolean"}},"required":["a","b"],
            "additionalProperties":false}"#;
        // Prefers the special token, then digits, then anything else (the grammar decides).
        let pref = |t: u32| {
            let w = &words[t as usize];
            if w[0] == 0xff {
                10.0
            } else if w[0].is_ascii_digit() {
                5.0
            } else {
                t as f32 * 1e-3
            }
        };
        let mut c = env.compile(&Constraint::JsonSchema(schema.into())).unwrap();
        let out = String::from_utf8(run(&mut c, &words, pref)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
        let a = v["a"].as_u64().unwrap();
        assert!(a <= 99, "{out}");
        assert!(v["b"].is_boolean(), "{out}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{out}");
        // The default layout: a space after ':' and ','.
        assert!(out.starts_with("{\"a\": "), "{out}");
    }

    #[test]
    fn json_object_is_an_object() {
        let (env, words) = toy();
        let mut c = env.compile(&Constraint::JsonObject).unwrap();
        // Prefers closing as soon as possible.
        let pref = |t: u32| if words[t as usize] == b"}" { 5.0 } else { 0.0 };
        let out = String::from_utf8(run(&mut c, &words, pref)).unwrap();
        assert_eq!(out, "{}");
    }

    #[test]
    fn bad_schemas_and_regexes_are_errors() {
        let (env, _) = toy();
        for c in [
            Constraint::JsonSchema("{not json".into()),
            Constraint::JsonSchema(r#"{"type":"no-such-type"}"#.into()),
            Constraint::JsonSchema(r#"{"type":"integer","minimum":5,"maximum":2}"#.into()),
            Constraint::Regex("[a-".into()),
            Constraint::Regex("(ab".into()),
            Constraint::Lark("start: undefined_rule".into()),
        ] {
            let e = env.compile(&c).unwrap_err();
            assert!(!e.is_empty(), "{c:?}");
        }
    }

    #[test]
    fn a_regex_constrains_digits() {
        let (env, words) = toy();
        let mut c = env.compile(&Constraint::Regex(r"\d{3}-\d{2}".into())).unwrap();
        // Prefers letters: the grammar allows only digits and the dash.
        let pref = |t: u32| if words[t as usize][0].is_ascii_alphabetic() { 9.0 } else { 0.0 };
        let out = String::from_utf8(run(&mut c, &words, pref)).unwrap();
        assert_eq!(out.len(), 6, "{out}");
        assert!(out.bytes().enumerate().all(|(i, b)| if i == 3 {
            b == b'-'
        } else {
            b.is_ascii_digit()
        }));
    }

    #[test]
    fn end_of_generation_is_allowed_where_the_grammar_may_end() {
        let (env, words) = toy();
        let eog = words.len() as u32 - 1;
        let mut c = env.compile(&Constraint::Regex(r"a+".into())).unwrap();
        let mut logits = vec![0.0; words.len()];
        assert!(c.mask(&mut logits));
        assert_eq!(logits[eog as usize], f32::NEG_INFINITY, "nothing matched yet");
        assert!(!c.advance(u32::from(b'a' - 0x20)));
        assert!(c.is_accepting());
        let mut logits = vec![0.0; words.len()];
        assert!(c.mask(&mut logits));
        assert_eq!(logits[eog as usize], 0.0, "may end after one 'a'");
        assert!(c.advance(eog));
    }

    #[test]
    fn a_resumed_sequence_replays_its_tokens() {
        let (env, words) = toy();
        let id = |s: &[u8]| words.iter().position(|w| w == s).unwrap() as u32;
        let mut c = env.compile(&Constraint::Regex(r"ab+c".into())).unwrap();
        assert!(c.replay(&[id(b"ab"), id(b"b")]).is_ok());
        let mut c = env.compile(&Constraint::Regex(r"ab+c".into())).unwrap();
        assert!(c.replay(&[id(b"c")]).is_err(), "not in the grammar");
        let mut c = env.compile(&Constraint::Regex(r"ab+c".into())).unwrap();
        assert!(c.replay(&[id(b"abc")]).is_err(), "already complete");
    }
}
