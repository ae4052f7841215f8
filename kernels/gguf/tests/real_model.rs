//! Opens the real default model (SmolLM2-135M-Instruct Q4_1) and checks known facts about it.
//! The path comes from `KVX_TEST_MODEL`; without it the test fails and says how to set it.

#![allow(clippy::disallowed_methods)] // the model and tools come from `cargo xtask test`'s environment

use kvx_gguf::{GgmlType, GgufFile};

fn model_path() -> std::path::PathBuf {
    match std::env::var_os("KVX_TEST_MODEL") {
        Some(p) => p.into(),
        None => panic!(
            "KVX_TEST_MODEL is not set: export KVX_TEST_MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
             (the project's test set-up, `cargo xtask`, exports it)"
        ),
    }
}

#[test]
fn smollm2_facts() {
    let f = GgufFile::open(model_path()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(&tokens[..3], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert!(f.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));

    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!(emb.offset, 0);
    assert_eq!(f.tensor_data(emb).len(), 49152 * 18 * 34);
    let norm = f.tensor("output_norm.weight").unwrap();
    assert_eq!((norm.ggml_type, norm.dims.as_slice()), (GgmlType::F32, &[576u64][..]));
    let gate = f.tensor("blk.0.ffn_gate.weight").unwrap();
    assert_eq!((gate.ggml_type, gate.dims.as_slice()), (GgmlType::Q4_1, &[576u64, 1536][..]));
    // The norm weights are ordinary finite floats.
    let w = f.tensor_data(norm);
    assert!(w.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()).is_finite()));
    // All tensor data together ends at the end of the file.
    let end = f.tensors().iter().map(|t| f.data_offset() as u64 + t.offset + t.size_bytes()).max();
    assert_eq!(end, Some(f.bytes().len() as u64));
}
