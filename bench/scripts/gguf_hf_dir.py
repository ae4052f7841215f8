#!/usr/bin/env python3
"""Makes a Hugging Face style model directory (config.json, tokenizer.json,
tokenizer_config.json with the chat template) from a GGUF file's metadata, for servers that
load a tokenizer and chat template from such a directory (Dynamo's frontend and mocker).
No weights are written.

Needs the PyPI packages `gguf` and `tokenizers`.
Usage: gguf_hf_dir.py MODEL.gguf OUT_DIR
"""
import json
import os
import subprocess
import sys

from gguf import GGUFReader


def field(reader, name):
    f = reader.fields.get(name)
    if f is None:
        return None
    v = f.parts[f.data[0]]
    try:
        return bytes(v).decode("utf-8") if v.dtype.kind == "u" and v.itemsize == 1 else v[0].item()
    except Exception:
        return None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model, out = sys.argv[1], sys.argv[2]
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "gguf_tokenizer_json.py"), model, out], check=True)
    r = GGUFReader(model)
    arch = field(r, "general.architecture") or "llama"
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    get = lambda k, d=None: field(r, f"{arch}.{k}") or d
    bos = field(r, "tokenizer.ggml.bos_token_id")
    eos = field(r, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": n_vocab,
        "hidden_size": get("embedding_length", 576),
        "intermediate_size": get("feed_forward_length", 1536),
        "num_hidden_layers": get("block_count", 30),
        "num_attention_heads": get("attention.head_count", 9),
        "num_key_value_heads": get("attention.head_count_kv", 3),
        "max_position_embeddings": get("context_length", 8192),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tmpl = field(r, "tokenizer.chat_template")
    if tmpl:
        tc["chat_template"] = tmpl
    with open(tc_path, "w") as f:
        json.dump(tc, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f)


if __name__ == "__main__":
    main()
