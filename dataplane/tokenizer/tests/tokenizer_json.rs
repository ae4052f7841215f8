//! A tokenizer loaded from Hugging Face tokenizer.json + tokenizer_config.json gives the same
//! ids, text, special tokens and template as the GGUF it was written from.
//!
//! Needs `KVX_TEST_MODEL` (see tests/common/mod.rs).

mod common;

use common::{corpus, model_path, scratch_dir};
use kvx_tokenizer::{ChatMessage, TokenAttr, Tokenizer, TokenizerError};
use serde_json::{Value, json};

/// Writes tokenizer.json (+ config) for the GGUF tokenizer into `dir`.
fn export(tok: &Tokenizer, dir: &std::path::Path, with_config: bool) -> std::path::PathBuf {
    let mut j: Value = serde_json::from_str(&tok.backend().to_string(false).unwrap()).unwrap();
    // The pipeline's placeholder for characters missing from the vocabulary is not part of a
    // Hugging Face vocabulary.
    let vocab = j["model"]["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < tok.vocab_size() as u64);
    j["model"]["unk_token"] = Value::Null;
    j["decoder"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let added: Vec<Value> = (0..tok.vocab_size() as u32)
        .filter(|&i| tok.token_attr(i).unwrap().intersects(TokenAttr::CONTROL))
        .map(|i| {
            json!({"id": i, "content": tok.token_text(i).unwrap(), "single_word": false,
                   "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    j["added_tokens"] = Value::Array(added);
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, j.to_string()).unwrap();
    if with_config {
        let t = tok.chat_template().unwrap();
        let config = json!({
            "bos_token": {"content": "<|im_start|>", "special": true},
            "eos_token": "<|im_end|>",
            "add_bos_token": false,
            "chat_template": t.source(),
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    path
}

#[test]
fn tokenizer_json_matches_gguf() {
    let gguf_tok = Tokenizer::from_gguf_path(&model_path()).unwrap();
    let dir = scratch_dir("hfjson");
    let path = export(&gguf_tok, &dir, true);
    let hf = Tokenizer::from_tokenizer_json(&path).unwrap();
    assert_eq!(hf.vocab_size(), gguf_tok.vocab_size());
    assert_eq!(hf.bos_id(), Some(1));
    assert_eq!(hf.eos_id(), Some(2));
    assert!(!hf.add_bos());
    // EOS, and every token whose text marks the end of a turn.
    assert_eq!(hf.eog_ids(), &[0, 2, 4]);
    let mut mismatches = 0;
    for (_, text) in corpus() {
        for parse_special in [true, false] {
            let a = gguf_tok.encode(&text, parse_special).unwrap();
            let b = hf.encode(&text, parse_special).unwrap();
            if a != b {
                mismatches += 1;
                eprintln!("{text:?} parse_special={parse_special}\n gguf {a:?}\n json {b:?}");
            }
            assert_eq!(hf.decode(&b, false).unwrap(), gguf_tok.decode(&a, false).unwrap());
        }
        assert_eq!(hf.encode_prompt(&text).unwrap(), gguf_tok.encode_prompt(&text).unwrap());
    }
    assert_eq!(mismatches, 0);
    let msgs = [ChatMessage::system("S"), ChatMessage::user("U")];
    assert_eq!(
        hf.chat_template().unwrap().render(&msgs, true).unwrap(),
        gguf_tok.chat_template().unwrap().render(&msgs, true).unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokenizer_json_without_config_and_unsupported_files() {
    let gguf_tok = Tokenizer::from_gguf_path(&model_path()).unwrap();
    let dir = scratch_dir("hfjson-bare");
    let path = export(&gguf_tok, &dir, false);
    let hf = Tokenizer::from_tokenizer_json(&path).unwrap();
    assert!(hf.chat_template().is_none());
    assert_eq!(hf.bos_id(), None);
    assert!(hf.encode_prompt("hi").is_ok());
    assert_eq!(
        hf.encode("Hello world", false).unwrap(),
        gguf_tok.encode("Hello world", false).unwrap()
    );

    // A WordPiece model is not supported; a missing file is a file error.
    let wp = dir.join("wordpiece.json");
    std::fs::write(
        &wp,
        json!({"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": null}).to_string(),
    )
    .unwrap();
    assert!(matches!(Tokenizer::from_tokenizer_json(&wp), Err(TokenizerError::Unsupported(_))));
    assert!(matches!(
        Tokenizer::from_tokenizer_json(&dir.join("missing.json")),
        Err(TokenizerError::File { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}
