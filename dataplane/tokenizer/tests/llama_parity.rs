//! Token-for-token parity with llama.cpp (through tests/oracle/oracle.py): the corpus with and
//! without special-token parsing, prompts with BOS/EOS flags, every code point, the
//! vocabulary's special ids, attributes, end-of-generation set and pieces, and the other
//! pre-tokenizer types on vocab-only copies of the model.
//!
//! Needs `KVX_TEST_MODEL` and `KVX_ORACLE_PYTHON` (see tests/common/mod.rs).

mod common;

use std::path::{Path, PathBuf};

use common::{OracleTokens, corpus, model_path, oracle_tokenize, run_oracle, scratch_dir, show};
use kvx_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use kvx_tokenizer::{DecodeStream, Tokenizer};

const MAX_REPORTED: usize = 12;

/// Compares our ids with llama.cpp's for every text; returns the failure descriptions.
fn compare(
    tok: &Tokenizer,
    texts: &[String],
    oracle: &[OracleTokens],
    parse_special: bool,
    label: &str,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(oracle) {
        let got = tok.encode(text, parse_special).unwrap();
        if got != want.ids {
            failures.push(format!(
                "[{label}, parse_special={parse_special}] {}\n{}",
                show(text),
                diff_ids(&got, &want.ids)
            ));
        }
    }
    failures
}

/// The ids around the first difference.
fn diff_ids(got: &[u32], want: &[u32]) -> String {
    let at = got.iter().zip(want).take_while(|(a, b)| a == b).count();
    let from = at.saturating_sub(4);
    let window = |v: &[u32]| v[from.min(v.len())..(at + 8).min(v.len())].to_vec();
    format!(
        "   first difference at {at} (lengths {} / {}):\n   kvx:   …{:?}\n   llama: …{:?}",
        got.len(),
        want.len(),
        window(got),
        window(want)
    )
}

fn check(failures: Vec<String>, what: &str) {
    if !failures.is_empty() {
        let shown: Vec<&String> = failures.iter().take(MAX_REPORTED).collect();
        panic!(
            "{} {what} mismatches with llama.cpp; first {}:\n{}",
            failures.len(),
            shown.len(),
            shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
        );
    }
}

fn texts_of_corpus() -> Vec<String> {
    corpus().into_iter().map(|(_, t)| t).collect()
}

#[test]
fn corpus_ids_and_text_match_llama_cpp() {
    let model = model_path();
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let texts = texts_of_corpus();
    assert!(texts.len() >= 200, "corpus has {} cases", texts.len());
    let mut failures = Vec::new();
    let mut round_trips = 0;
    for parse_special in [true, false] {
        let oracle = oracle_tokenize(&model, &texts, false, parse_special);
        failures.extend(compare(&tok, &texts, &oracle, parse_special, "smollm"));
        for (text, want) in texts.iter().zip(&oracle) {
            let shown = tok.decode(&want.ids, false).unwrap();
            let plain = tok.decode(&want.ids, true).unwrap();
            if shown != String::from_utf8_lossy(&want.pieces) {
                failures.push(format!("decode(special shown) of {}: {shown:?}", show(text)));
            }
            if plain != String::from_utf8_lossy(&want.pieces_plain) {
                failures.push(format!("decode(special skipped) of {}: {plain:?}", show(text)));
            }
            // Where llama.cpp's own detokenizer gives the text back, so must we.
            if want.detok == text.as_bytes() {
                round_trips += 1;
                if shown != *text {
                    failures.push(format!("round trip of {}: {shown:?}", show(text)));
                }
            }
            // Streaming gives the same text, one token at a time.
            for skip in [false, true] {
                let mut stream = DecodeStream::new(skip);
                let mut streamed = String::new();
                for &id in &want.ids {
                    stream.step_into(&tok, id, &mut streamed).unwrap();
                }
                stream.finish(&mut streamed);
                let whole = if skip { &plain } else { &shown };
                if streamed != *whole {
                    failures.push(format!("stream (skip={skip}) of {}: {streamed:?}", show(text)));
                }
            }
        }
    }
    // Decoding never changes text, even where llama.cpp's clean-up of spaces would.
    for text in &texts {
        let ids = tok.encode(text, true).unwrap();
        if tok.decode(&ids, false).unwrap() != *text {
            failures.push(format!("decode(encode(x)) != x for {}", show(text)));
        }
    }
    check(failures, "corpus");
    eprintln!("{} texts × 2 modes equal; {round_trips} llama.cpp round trips", texts.len());
    assert!(round_trips > texts.len(), "only {round_trips} llama.cpp round trips");
}

#[test]
fn prompts_match_llama_cpp_with_add_special() {
    let model = model_path();
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let texts = texts_of_corpus();
    let oracle = oracle_tokenize(&model, &texts, true, true);
    let failures: Vec<String> = texts
        .iter()
        .zip(&oracle)
        .filter_map(|(t, want)| {
            let got = tok.encode_prompt(t).unwrap();
            (got != want.ids).then(|| format!("{}:\n{}", show(t), diff_ids(&got, &want.ids)))
        })
        .collect();
    check(failures, "prompt");
}

#[test]
fn every_code_point_matches_llama_cpp() {
    let model = model_path();
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    // Every scalar value up to the end of plane 3 and the tag / variation-selector block;
    // one in 61 elsewhere (the rest of the space is unassigned or private use).
    let code_points: Vec<char> = (0u32..=0x10FFFF)
        .filter(|&c| c < 0x32400 || (0xE0000..0xE0200).contains(&c) || c % 61 == 0)
        .filter_map(char::from_u32)
        .collect();
    // Each code point next to letters, digits, spaces, punctuation and itself.
    let texts: Vec<String> = code_points
        .chunks(1024)
        .map(|chunk| chunk.iter().map(|c| format!("a{c}b {c}1{c}!{c}{c} {c}\n")).collect())
        .collect();
    let oracle = oracle_tokenize(&model, &texts, false, false);
    let mut failures = compare(&tok, &texts, &oracle, false, "code points");
    // Narrow each failing chunk down to the code points that differ.
    let mut detail = Vec::new();
    for (i, (text, want)) in texts.iter().zip(&oracle).enumerate() {
        if tok.encode(text, false).unwrap() == want.ids {
            continue;
        }
        let singles: Vec<String> = code_points
            .chunks(1024)
            .nth(i)
            .unwrap()
            .iter()
            .map(|c| format!("a{c}b {c}1{c}!{c}{c} {c}\n"))
            .collect();
        let o = oracle_tokenize(&model, &singles, false, false);
        for (s, w) in singles.iter().zip(&o) {
            let got = tok.encode(s, false).unwrap();
            if got != w.ids {
                let c = s.chars().nth(1).unwrap();
                detail.push(format!("U+{:04X}: kvx {got:?} llama {:?}", c as u32, w.ids));
            }
        }
    }
    failures.extend(detail);
    check(failures, "code point");
    eprintln!("{} code points in {} texts equal", code_points.len(), texts.len());
}

#[test]
fn vocabulary_matches_llama_cpp() {
    let model = model_path();
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let v = &run_oracle(&["vocab", "--model", model.to_str().unwrap()], &[])[0];
    assert_eq!(tok.vocab_size() as u64, v["n_vocab"].as_u64().unwrap());
    let id = |k: &str| v[k].as_i64().and_then(|x| u32::try_from(x).ok());
    assert_eq!(tok.bos_id(), id("bos"));
    assert_eq!(tok.eos_id(), id("eos"));
    assert_eq!(tok.special_tokens().pad, id("pad"));
    assert_eq!(tok.special_tokens().sep, id("sep"));
    assert_eq!(tok.special_tokens().fim_rep, id("fim_rep"));
    assert_eq!(tok.special_tokens().fim_pad, id("fim_pad"));
    assert_eq!(tok.add_bos(), v["add_bos"].as_bool().unwrap());
    assert_eq!(tok.add_eos(), v["add_eos"].as_bool().unwrap());
    let eog: Vec<u32> =
        v["eog"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(tok.eog_ids(), &eog[..]);
    assert!(eog.iter().all(|&i| tok.is_eog(i)));
    // EOT is one of the EOG tokens (llama.cpp picks among several candidates by hash order).
    assert!(tok.special_tokens().eot.is_some_and(|e| tok.is_eog(e)));
    let attrs = v["attrs"].as_array().unwrap();
    let pieces = v["pieces"].as_array().unwrap();
    let plain = v["pieces_plain"].as_array().unwrap();
    let mut failures = Vec::new();
    for i in 0..tok.vocab_size() as u32 {
        let want_attr = attrs[i as usize].as_u64().unwrap() as u32;
        if tok.token_attr(i).unwrap().bits() != want_attr {
            failures.push(format!("attr of {i}: {:?} vs {want_attr}", tok.token_attr(i)));
        }
        let want = common::hex(pieces[i as usize].as_str().unwrap());
        if tok.token_to_piece(i).unwrap() != want {
            failures.push(format!("piece of {i}"));
        }
        let want_plain = common::hex(plain[i as usize].as_str().unwrap());
        let got_plain = tok.decode(&[i], true).unwrap();
        if got_plain != String::from_utf8_lossy(&want_plain) {
            failures.push(format!("plain piece of {i}"));
        }
    }
    check(failures, "vocabulary");
}

/// A vocab-only copy of the model with some metadata replaced.
fn variant(dir: &Path, name: &str, changes: &[(&str, MetaValue)]) -> PathBuf {
    let src = GgufFile::open(model_path()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.metadata(k.clone(), v.clone());
    }
    for (k, v) in changes {
        w.set_metadata(k, v.clone());
    }
    let path = dir.join(format!("{name}.gguf"));
    w.write_file(&path).unwrap();
    path
}

#[test]
fn other_pre_tokenizers_match_llama_cpp() {
    let dir = scratch_dir("pre");
    let texts = texts_of_corpus();
    let mut failures = Vec::new();
    for pre in [
        "default",
        "gpt-2",
        "starcoder",
        "llama-bpe",
        "dbrx",
        "qwen2",
        "qwen35",
        "deepseek-coder",
        "deepseek-v3",
        "falcon",
        "bloom",
        "viking",
        "gpt-4o",
        "tekken",
        "seed-coder",
        "bailingmoe",
        "ufakzeka",
        "minicpm5",
        "chatglm-bpe",
        "granite-embed-multi-97m",
    ] {
        let path = variant(&dir, pre, &[("tokenizer.ggml.pre", pre.into())]);
        let tok = Tokenizer::from_gguf_path(&path).unwrap();
        let oracle = oracle_tokenize(&path, &texts, false, true);
        failures.extend(compare(&tok, &texts, &oracle, true, pre));
        let oracle = oracle_tokenize(&path, &texts, true, true);
        for (t, want) in texts.iter().zip(&oracle) {
            let got = tok.encode_prompt(t).unwrap();
            if got != want.ids {
                failures.push(format!(
                    "[{pre} prompt] {}:\n{}",
                    show(t),
                    diff_ids(&got, &want.ids)
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    check(failures, "pre-tokenizer");
}

#[test]
fn token_types_and_flags_match_llama_cpp() {
    let dir = scratch_dir("types");
    let src = GgufFile::open(model_path()).unwrap();
    let tokens = src.get_str_array("tokenizer.ggml.tokens").unwrap();
    let mut types: Vec<i32> = src.get_i32_array("tokenizer.ggml.token_type").unwrap().into_owned();
    let find = |t: &str| tokens.iter().position(|x| x == t).unwrap();
    // User-defined tokens are cut out of text even without special parsing: a word piece, a
    // control token turned user-defined, and a token that is a prefix of another.
    for t in ["ing", "<|im_start|>", "Ġthe", "<filename>"] {
        types[find(t)] = 4;
    }
    // An unknown token and an unused one.
    types[find("<gh_stars>")] = 2;
    types[find("<issue_start>")] = 5;
    let cases: Vec<(&str, Vec<(&str, MetaValue)>)> = vec![
        ("types", vec![("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types)))]),
        (
            "bos_eos",
            vec![
                ("tokenizer.ggml.add_bos_token", true.into()),
                ("tokenizer.ggml.add_eos_token", true.into()),
            ],
        ),
    ];
    let texts = texts_of_corpus();
    let mut failures = Vec::new();
    for (name, changes) in cases {
        let path = variant(&dir, name, &changes);
        let tok = Tokenizer::from_gguf_path(&path).unwrap();
        for parse_special in [true, false] {
            let oracle = oracle_tokenize(&path, &texts, false, parse_special);
            failures.extend(compare(&tok, &texts, &oracle, parse_special, name));
            for (t, want) in texts.iter().zip(&oracle) {
                if tok.decode(&want.ids, false).unwrap() != String::from_utf8_lossy(&want.pieces) {
                    failures.push(format!("[{name}] decode of {}", show(t)));
                }
            }
        }
        let oracle = oracle_tokenize(&path, &texts, true, true);
        for (t, want) in texts.iter().zip(&oracle) {
            let got = tok.encode_prompt(t).unwrap();
            if got != want.ids {
                failures.push(format!(
                    "[{name} prompt] {}:\n{}",
                    show(t),
                    diff_ids(&got, &want.ids)
                ));
            }
        }
        let v = &run_oracle(&["vocab", "--model", path.to_str().unwrap()], &[])[0];
        let attrs = v["attrs"].as_array().unwrap();
        for i in 0..tok.vocab_size() as u32 {
            if u64::from(tok.token_attr(i).unwrap().bits()) != attrs[i as usize].as_u64().unwrap() {
                failures.push(format!("[{name}] attr of token {i} {:?}", tok.token_text(i)));
            }
        }
        let eog: Vec<u32> =
            v["eog"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        if tok.eog_ids() != &eog[..] {
            failures.push(format!("[{name}] eog {:?} vs {eog:?}", tok.eog_ids()));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    check(failures, "token type / flag");
}
