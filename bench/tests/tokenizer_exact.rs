//! Prompts built with a real byte-level BPE tokenizer (a small `tokenizer.json` made here) come
//! out at exactly the requested token lengths, and trace prompts keep their shared blocks.

use std::sync::Arc;

use kvx_bench::{
    BodyBuilder, Dataset, EndpointConfig, ModelTokenizer, PromptSynth, TokenCodec, WORDS,
    WorkloadConfig,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A GPT-2 style tokenizer.json: byte-level alphabet plus merges that build every word of the
/// built-in list (with and without its leading space) from pairs, so words are mostly one or
/// two tokens and boundaries can merge across the seams of cut prompts.
fn tiny_bpe(dir: &std::path::Path) -> std::path::PathBuf {
    // The GPT-2 byte-to-unicode table.
    let mut bs: Vec<u32> =
        (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let byte_char =
        |b: u8| char::from_u32(cs[bs.iter().position(|&x| x == b as u32).unwrap()]).unwrap();
    let mut vocab: Vec<String> = Vec::new();
    let mut index = std::collections::HashMap::new();
    let mut add = |t: String, vocab: &mut Vec<String>| {
        if !index.contains_key(&t) {
            index.insert(t.clone(), vocab.len());
            vocab.push(t);
        }
    };
    for b in 0..=255u8 {
        add(byte_char(b).to_string(), &mut vocab);
    }
    let mut merges: Vec<(String, String)> = Vec::new();
    for w in WORDS.iter().take(200) {
        for spaced in [false, true] {
            let mut parts: Vec<String> = Vec::new();
            if spaced {
                parts.push(byte_char(b' ').to_string());
            }
            parts.extend(w.bytes().map(|b| byte_char(b).to_string()));
            // Merge left to right: ((a b) c) d ...
            while parts.len() > 1 {
                let (a, b) = (parts.remove(0), parts.remove(0));
                let ab = format!("{a}{b}");
                if !merges.contains(&(a.clone(), b.clone())) {
                    merges.push((a, b));
                }
                add(ab.clone(), &mut vocab);
                parts.insert(0, ab);
            }
        }
    }
    let vocab_json: serde_json::Map<String, serde_json::Value> =
        vocab.iter().enumerate().map(|(i, t)| (t.clone(), serde_json::json!(i))).collect();
    let merges_json: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab_json, "merges": merges_json},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string(&tok).unwrap()).unwrap();
    path
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvx-bench-tok-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bpe_prompts_have_exact_token_lengths() {
    let dir = tmpdir("exact");
    let codec: Arc<dyn TokenCodec> = Arc::new(ModelTokenizer::from_path(&tiny_bpe(&dir)).unwrap());
    // Words of the list are one token each with the tiny BPE; unknown words split into bytes.
    assert_eq!(codec.encode("the time").unwrap().len(), 2);
    assert!(codec.encode(" zzzq").unwrap().len() > 2);
    let synth = PromptSynth::new(codec.clone(), 4).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [1u32, 2, 3, 7, 64, 100, 512, 1000, 2049] {
        for _ in 0..5 {
            let p = synth.prompt(n, &mut rng).unwrap();
            assert_eq!(p.tokens, n, "{:?}", p.text);
            assert_eq!(codec.encode(&p.text).unwrap().len(), n as usize);
        }
    }
}

#[test]
fn bpe_trace_prompts_share_the_blocks_of_equal_hash_ids() {
    let dir = tmpdir("trace");
    let codec: Arc<dyn TokenCodec> = Arc::new(ModelTokenizer::from_path(&tiny_bpe(&dir)).unwrap());
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 300, \"output_length\": 2, \"hash_ids\": [7, 8, 9]}\n\
         {\"timestamp\": 1, \"input_length\": 250, \"output_length\": 2, \"hash_ids\": [7, 8, 10]}\n",
    )
    .unwrap();
    let synth = PromptSynth::new(codec.clone(), 4).unwrap();
    let bodies = BodyBuilder::new(&EndpointConfig::default(), "m");
    let w = WorkloadConfig::Trace { path: trace, block_tokens: 100 };
    let d = Dataset::build(&w, &synth, &bodies, 9, 0).unwrap();
    let a = codec.encode(&d.conversations[0].turns[0].user).unwrap();
    let b = codec.encode(&d.conversations[1].turns[0].user).unwrap();
    assert_eq!((a.len(), b.len()), (300, 250));
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    // Two equal 100-token blocks; a merge across the seam may cost a token or two.
    assert!((198..=205).contains(&shared), "shared {shared}");
}
