//! Tokenizer behaviour on a tiny hand-built byte-level vocabulary (no model or oracle needed):
//! special-token cutting rules, user-defined tokens, end-of-generation ids, byte and unused
//! tokens, characters missing from the vocabulary, streaming decode, strip attributes, and
//! the errors of malformed metadata.

use kvx_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use kvx_tokenizer::{DecodeStream, TokenAttr, Tokenizer, TokenizerError};
use proptest::prelude::*;

/// GPT-2's byte → character table.
fn byte_char(b: u8) -> char {
    let mut n = 0u32;
    for x in 0..=255u8 {
        let printable = matches!(x, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        if x == b {
            return if printable { char::from(x) } else { char::from_u32(256 + n).unwrap() };
        }
        if !printable {
            n += 1;
        }
    }
    unreachable!()
}

fn bl(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

struct Spec {
    tokens: Vec<(String, i32)>,
    merges: Vec<String>,
    extra: Vec<(&'static str, MetaValue)>,
    drop_bytes: Vec<u8>,
}

const MERGES: &[(&str, &str)] = &[
    ("h", "e"),
    ("l", "l"),
    ("ll", "o"),
    ("he", "llo"),
    (" ", "w"),
    ("o", "r"),
    (" w", "or"),
    ("l", "d"),
    (" wor", "ld"),
    (" ", "t"),
    (" t", "he"),
];

fn spec() -> Spec {
    let mut tokens: Vec<(String, i32)> =
        (0..=255u8).map(|b| (byte_char(b).to_string(), 1)).collect();
    for (a, b) in MERGES {
        tokens.push((bl(&format!("{a}{b}")), 1));
    }
    for (t, ty) in [
        ("<|endoftext|>", 3),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool>", 4),
        ("<|im", 3),
        ("<0x41>", 6),
        ("<unused_3>", 3),
        ("<|unk|>", 2),
        ("<gap>", 5),
    ] {
        tokens.push((t.to_owned(), ty));
    }
    let merges = MERGES.iter().map(|(a, b)| format!("{} {}", bl(a), bl(b))).collect();
    Spec { tokens, merges, extra: vec![], drop_bytes: vec![] }
}

fn build(s: &Spec) -> Vec<u8> {
    let tokens: Vec<(String, i32)> = s
        .tokens
        .iter()
        .filter(|(t, _)| !s.drop_bytes.iter().any(|&b| *t == byte_char(b).to_string()))
        .cloned()
        .collect();
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama")
        .metadata("tokenizer.ggml.model", "gpt2")
        .metadata("tokenizer.ggml.pre", "gpt-2")
        .metadata(
            "tokenizer.ggml.tokens",
            MetaArray::String(tokens.iter().map(|t| t.0.clone()).collect()),
        )
        .metadata("tokenizer.ggml.token_type", MetaArray::I32(tokens.iter().map(|t| t.1).collect()))
        .metadata("tokenizer.ggml.merges", MetaArray::String(s.merges.clone()))
        .metadata("tokenizer.ggml.bos_token_id", 1u32)
        .metadata("tokenizer.ggml.eos_token_id", 2u32);
    for (k, v) in &s.extra {
        w.set_metadata(k, v.clone());
    }
    w.to_bytes().unwrap()
}

fn tokenizer(s: &Spec) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::from_bytes(build(s)).unwrap()).unwrap()
}

fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.token_id(text).or_else(|| tok.token_id(&bl(text))).unwrap_or_else(|| panic!("{text:?}"))
}

#[test]
fn merges_and_round_trip() {
    let tok = tokenizer(&spec());
    let ids = tok.encode("hello world the", false).unwrap();
    assert_eq!(ids, [id(&tok, "hello"), id(&tok, " world"), id(&tok, " the")]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello world the");
    // Unmerged text falls back to byte-level characters, which all exist here.
    let ids = tok.encode("héllo 😀", false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "héllo 😀");
    assert!(tok.encode("", true).unwrap().is_empty());
    assert!(tok.description().contains("gpt-2"));
}

#[test]
fn special_tokens_are_cut_longest_first() {
    let tok = tokenizer(&spec());
    let (start, end, im, tool) =
        (id(&tok, "<|im_start|>"), id(&tok, "<|im_end|>"), id(&tok, "<|im"), id(&tok, "<tool>"));
    let ids = tok.encode("<|im_start|>hello<|im_end|>", true).unwrap();
    assert_eq!(ids, [start, id(&tok, "hello"), end]);
    // "<|im" is also a token, but the longer tokens are cut first.
    assert_eq!(tok.encode("<|im<|im_start|>", true).unwrap(), [im, start]);
    assert_eq!(tok.encode("<|im_st", true).unwrap()[0], im);
    // Without special parsing control tokens are text; user-defined tokens are still cut.
    let plain = tok.encode("<|im_start|> <tool>", false).unwrap();
    assert!(!plain.contains(&start) && !plain.contains(&im));
    assert_eq!(plain.last(), Some(&tool));
    assert_eq!(tok.decode(&plain, false).unwrap(), "<|im_start|> <tool>");
    // Unknown-type tokens are special too.
    let unk = id(&tok, "<|unk|>");
    assert_eq!(tok.encode("<|unk|>", true).unwrap(), [unk]);
    assert_ne!(tok.encode("<|unk|>", false).unwrap(), [unk]);
}

#[test]
fn attributes_eog_and_pieces() {
    let tok = tokenizer(&spec());
    let eot = id(&tok, "<|endoftext|>");
    let im_end = id(&tok, "<|im_end|>");
    // EOS (id 2, a byte-level character here) and the texts that mark an end.
    assert_eq!(tok.eog_ids(), &[2, eot, im_end]);
    assert!(tok.is_eog(im_end) && !tok.is_eog(id(&tok, "<|im_start|>")));
    assert_eq!(tok.special_tokens().eot, Some(eot));
    let unused = id(&tok, "<unused_3>");
    assert_eq!(tok.token_attr(unused), Some(TokenAttr::CONTROL | TokenAttr::UNUSED));
    // A byte token decodes to its byte; an unused-type token to nothing.
    assert_eq!(tok.token_to_piece(id(&tok, "<0x41>")).unwrap(), b"A");
    assert_eq!(tok.token_to_piece(id(&tok, "<gap>")).unwrap(), b"");
    // Control tokens render unless skipped; user-defined ones always.
    let ids = [id(&tok, "<|im_start|>"), id(&tok, "hello"), id(&tok, "<tool>"), eot];
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>hello<tool><|endoftext|>");
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello<tool>");
    let n = tok.vocab_size() as u32;
    assert!(matches!(tok.decode(&[n], false), Err(TokenizerError::UnknownId { .. })));
    assert!(tok.token_to_piece(n).is_err());
    assert!(matches!(
        DecodeStream::new(false).step(&tok, n),
        Err(TokenizerError::UnknownId { .. })
    ));
}

#[test]
fn characters_missing_from_the_vocabulary_keep_neighbours_apart() {
    // Without the byte 'x', "axb" must not merge a and b across the missing character.
    let mut s = spec();
    s.tokens.push(("ab".into(), 1));
    s.merges.push("a b".into());
    let full = tokenizer(&s);
    assert_eq!(full.encode("ab", false).unwrap(), [id(&full, "ab")]);
    s.drop_bytes = vec![b'x'];
    let tok = tokenizer(&s);
    assert_eq!(tok.encode("axb", false).unwrap(), [id(&tok, "a"), id(&tok, "b")]);
    assert_eq!(tok.decode(&tok.encode("axb", false).unwrap(), false).unwrap(), "ab");
}

#[test]
fn prompt_flags() {
    let mut s = spec();
    s.extra = vec![
        ("tokenizer.ggml.add_bos_token", true.into()),
        ("tokenizer.ggml.add_eos_token", true.into()),
    ];
    let tok = tokenizer(&s);
    assert_eq!(tok.encode_prompt("hello").unwrap(), [1, id(&tok, "hello"), 2]);
    assert_eq!(tok.encode("hello", true).unwrap(), [id(&tok, "hello")]);

    // A pre-tokenizer type without a default BOS, and no BOS key: asking for BOS fails.
    let mut s = spec();
    s.extra = vec![
        ("tokenizer.ggml.pre", "chatglm-bpe".into()),
        ("tokenizer.ggml.add_bos_token", true.into()),
    ];
    let bytes = {
        let mut w = GgufWriter::new();
        for (k, v) in GgufFile::from_bytes(build(&s)).unwrap().metadata() {
            if k != "tokenizer.ggml.bos_token_id" {
                w.metadata(k.clone(), v.clone());
            }
        }
        w.to_bytes().unwrap()
    };
    let tok = Tokenizer::from_gguf(&GgufFile::from_bytes(bytes).unwrap()).unwrap();
    assert_eq!(tok.bos_id(), None);
    assert!(matches!(tok.encode_prompt("x"), Err(TokenizerError::MissingSpecial("BOS"))));
}

#[test]
fn malformed_metadata_is_an_error() {
    let with = |changes: Vec<(&'static str, MetaValue)>| {
        let mut s = spec();
        s.extra = changes;
        Tokenizer::from_gguf(&GgufFile::from_bytes(build(&s)).unwrap())
    };
    assert!(matches!(
        with(vec![("tokenizer.ggml.model", "llama".into())]),
        Err(TokenizerError::Unsupported(m)) if m.contains("SentencePiece")
    ));
    assert!(matches!(
        with(vec![("tokenizer.ggml.model", "bert".into())]),
        Err(TokenizerError::Unsupported(_))
    ));
    assert!(matches!(
        with(vec![("tokenizer.ggml.pre", "no-such-pre".into())]),
        Err(TokenizerError::Unsupported(m)) if m.contains("no-such-pre")
    ));
    assert!(matches!(
        with(vec![("tokenizer.ggml.token_type", MetaArray::I32(vec![1; 3]).into())]),
        Err(TokenizerError::Invalid(_))
    ));
    assert!(matches!(
        with(vec![(
            "tokenizer.ggml.tokens",
            MetaArray::String(vec!["a".into(), "a".into()]).into()
        )]),
        Err(TokenizerError::Invalid(_))
    ));
    assert!(matches!(
        with(vec![("tokenizer.ggml.merges", 3u32.into())]),
        Err(TokenizerError::Gguf(_))
    ));
    let no_tokens = GgufWriter::new().metadata("tokenizer.ggml.model", "gpt2").to_bytes().unwrap();
    assert!(matches!(
        Tokenizer::from_gguf(&GgufFile::from_bytes(no_tokens).unwrap()),
        Err(TokenizerError::Gguf(kvx_gguf::GgufError::MissingKey(_)))
    ));
    // Out-of-range special ids are ignored (as llama.cpp does), not trusted.
    let tok = with(vec![("tokenizer.ggml.eos_token_id", 1_000_000u32.into())]).unwrap();
    assert_eq!(tok.eos_id(), Some(11));
    // A template that does not compile leaves the tokenizer usable.
    let tok = with(vec![("tokenizer.chat_template", "{% if %}".into())]).unwrap();
    assert!(tok.chat_template().is_none());
    assert!(tok.chat_template_error().is_some());
}

#[test]
fn strip_attributes_swallow_white_space() {
    // A tokenizer.json whose added token strips white space on both sides.
    let base = tokenizer(&spec());
    let mut j: serde_json::Value =
        serde_json::from_str(&base.backend().to_string(false).unwrap()).unwrap();
    let n = base.vocab_size() as u64;
    j["model"]["vocab"].as_object_mut().unwrap().retain(|_, v| v.as_u64().unwrap() < n);
    j["model"]["unk_token"] = serde_json::Value::Null;
    j["decoder"] = serde_json::json!({"type": "ByteLevel"});
    j["added_tokens"] = serde_json::json!([
        {"id": id(&base, "<tool>"), "content": "<tool>", "special": false, "lstrip": true, "rstrip": true},
        {"id": id(&base, "<|im_end|>"), "content": "<|im_end|>", "special": true, "rstrip": true},
    ]);
    let dir = std::env::temp_dir().join(format!("kvx-tok-strip-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, j.to_string()).unwrap();
    let tok = Tokenizer::from_tokenizer_json(&path).unwrap();
    let tool = id(&tok, "<tool>");
    // Both white-space runs around <tool> are swallowed, so "world" loses its space.
    assert_eq!(
        tok.encode("hello \n <tool>\t world", false).unwrap(),
        [id(&tok, "hello"), tool, id(&tok, "w"), id(&tok, "or"), id(&tok, "ld")]
    );
    assert_eq!(
        tok.encode("<|im_end|>  the", true).unwrap(),
        [id(&tok, "<|im_end|>"), id(&tok, "t"), id(&tok, "he")]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn decode_stream_never_breaks_characters() {
    let tok = tokenizer(&spec());
    // "é😀" split into single bytes: nothing comes out until each character is complete.
    let ids = tok.encode("é😀!", false).unwrap();
    assert!(ids.len() >= 6);
    let mut stream = DecodeStream::new(false);
    let outs: Vec<String> = ids.iter().map(|&i| stream.step(&tok, i).unwrap()).collect();
    assert_eq!(outs.concat(), "é😀!");
    assert!(outs.iter().all(|s| s.is_empty() || s.chars().count() >= 1));
    assert_eq!(outs.iter().filter(|s| !s.is_empty()).count(), 3);
    assert!(!stream.has_pending());
    // An unfinished character at the end becomes one replacement character.
    let mut s = DecodeStream::new(false);
    let mut out = String::new();
    for &i in &ids[..2] {
        s.step_into(&tok, i, &mut out).unwrap();
    }
    s.step_into(&tok, ids[2], &mut out).unwrap();
    assert!(s.has_pending());
    s.finish(&mut out);
    assert_eq!(out, format!("é{}", char::REPLACEMENT_CHARACTER));
    assert_eq!(out, tok.decode(&ids[..3], false).unwrap());
}

proptest! {
    #[test]
    fn decode_stream_equals_decode(ids in prop::collection::vec(0u32..285, 0..40), skip in any::<bool>()) {
        let tok = tokenizer(&spec());
        let ids: Vec<u32> = ids.into_iter().filter(|&i| (i as usize) < tok.vocab_size()).collect();
        let mut stream = DecodeStream::new(skip);
        let mut out = String::new();
        for &i in &ids {
            stream.step_into(&tok, i, &mut out).unwrap();
        }
        stream.finish(&mut out);
        prop_assert_eq!(out, tok.decode(&ids, skip).unwrap());
    }

    #[test]
    fn encode_decode_round_trips(text in "\\PC{0,40}", parse in any::<bool>()) {
        let tok = tokenizer(&spec());
        let ids = tok.encode(&text, parse).unwrap();
        prop_assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}
