//! Tokenizers from Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) files.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{TokenizerError, backend};
use crate::vocab::{PieceStyle, SpecialRole, TokenAttr, Vocab, VocabInput};
use crate::{SpecialTokens, Tokenizer};

fn read_json(path: &Path) -> Result<Value, TokenizerError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TokenizerError::File { path: path.to_owned(), message: e.to_string() })?;
    serde_json::from_str(&text)
        .map_err(|e| TokenizerError::File { path: path.to_owned(), message: e.to_string() })
}

/// A token named in tokenizer_config.json: a string or `{"content": ...}`.
fn token_content(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

fn has_byte_level_decoder(decoder: Option<&Value>) -> bool {
    let Some(d) = decoder else { return false };
    match d.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => d
            .get("decoders")
            .and_then(Value::as_array)
            .is_some_and(|ds| ds.iter().any(|x| has_byte_level_decoder(Some(x)))),
        _ => false,
    }
}

pub(crate) fn load(path: &Path) -> Result<Tokenizer, TokenizerError> {
    let mut json = read_json(path)?;
    let invalid = |m: &str| TokenizerError::Invalid(format!("{}: {m}", path.display()));
    let model_type = json.pointer("/model/type").and_then(Value::as_str).unwrap_or("");
    if model_type != "BPE" || !has_byte_level_decoder(json.get("decoder")) {
        return Err(TokenizerError::Unsupported(format!(
            "{}: only byte-level BPE tokenizer.json files are implemented (model {model_type:?})",
            path.display()
        )));
    }

    // id -> (text, attribute) from the model vocabulary and the added tokens.
    let model_vocab = json
        .pointer("/model/vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("model.vocab is missing"))?;
    let mut entries: HashMap<u32, (String, TokenAttr)> = HashMap::with_capacity(model_vocab.len());
    for (text, id) in model_vocab {
        let id =
            id.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| invalid("bad id"))?;
        entries.insert(id, (text.clone(), TokenAttr::NORMAL));
    }
    let added = json.get("added_tokens").and_then(Value::as_array).cloned().unwrap_or_default();
    for t in &added {
        let id = t
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| invalid("added token without id"))?;
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("added token without content"))?;
        let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
        let mut attr = if flag("special") { TokenAttr::CONTROL } else { TokenAttr::USER_DEFINED };
        if flag("lstrip") {
            attr = attr | TokenAttr::LSTRIP;
        }
        if flag("rstrip") {
            attr = attr | TokenAttr::RSTRIP;
        }
        entries.insert(id, (content.to_owned(), attr));
    }
    let n = entries.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
    if n > 16 * 1024 * 1024 {
        return Err(invalid("vocabulary ids beyond 16M"));
    }
    let mut texts = vec![String::new(); n];
    let mut attrs = vec![TokenAttr::UNDEFINED; n];
    for (id, (text, attr)) in entries {
        texts[id as usize] = text;
        attrs[id as usize] = attr;
    }

    let config_path = path.with_file_name("tokenizer_config.json");
    let config = if config_path.exists() { Some(read_json(&config_path)?) } else { None };
    let cfg = |k: &str| config.as_ref().and_then(|c| c.get(k));
    let id_of = |name: &str| -> Option<i64> {
        let content = token_content(cfg(name))?;
        texts.iter().position(|t| t == content).map(|i| i as i64)
    };
    let mut stated = Vec::new();
    for (key, role) in [
        ("bos_token", SpecialRole::Bos),
        ("eos_token", SpecialRole::Eos),
        ("unk_token", SpecialRole::Unk),
        ("pad_token", SpecialRole::Pad),
        ("sep_token", SpecialRole::Sep),
        ("mask_token", SpecialRole::Mask),
    ] {
        if let Some(id) = id_of(key) {
            stated.push((role, id));
        }
    }

    // The encoding pipeline without added tokens (they are cut out beforehand) and without
    // the post-processor (BOS/EOS are added by `encode_prompt`).
    let post_processor = json.get("post_processor").cloned();
    if let Some(obj) = json.as_object_mut() {
        obj.insert("added_tokens".into(), Value::Array(Vec::new()));
        obj.insert("post_processor".into(), Value::Null);
        obj.insert("truncation".into(), Value::Null);
        obj.insert("padding".into(), Value::Null);
        // Pieces are decoded from the vocabulary; the decoder section is not needed.
        obj.insert("decoder".into(), Value::Null);
    }
    let backend_tok: tokenizers::Tokenizer = json.to_string().parse().map_err(backend)?;

    // BOS/EOS: the config's flags, else whatever the post-processor adds to an empty text.
    let bos = id_of("bos_token");
    let eos = id_of("eos_token");
    let (mut add_bos, mut add_eos) = (false, false);
    if let Some(pp) = post_processor.filter(|p| !p.is_null()) {
        let mut with_pp = json.clone();
        if let Some(obj) = with_pp.as_object_mut() {
            obj.insert("post_processor".into(), pp);
        }
        let full: tokenizers::Tokenizer = with_pp.to_string().parse().map_err(backend)?;
        let ids = full.encode_fast("", true).map_err(backend)?.get_ids().to_vec();
        add_bos = bos.is_some() && ids.first().map(|&i| i64::from(i)) == bos;
        add_eos = eos.is_some() && ids.last().map(|&i| i64::from(i)) == eos;
    }
    if let Some(b) = cfg("add_bos_token").and_then(Value::as_bool) {
        add_bos = b;
    }
    if let Some(b) = cfg("add_eos_token").and_then(Value::as_bool) {
        add_eos = b;
    }

    let template = match cfg("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_owned),
        _ => {
            let jinja = path.with_file_name("chat_template.jinja");
            std::fs::read_to_string(jinja).ok()
        }
    };

    let vocab = Vocab::new(VocabInput {
        texts,
        attrs,
        defaults: SpecialTokens::default(),
        stated,
        add_bos,
        add_eos,
        model_name: String::new(),
        pre_name: String::new(),
        arch: String::new(),
        style: PieceStyle::ByteLevel,
    })?;
    Ok(Tokenizer::assemble(
        vocab,
        backend_tok,
        format!("byte-level BPE from {}", path.display()),
        template,
    ))
}
