#!/usr/bin/env python3
"""Writes a Hugging Face tokenizer.json (and tokenizer_config.json) for a GGUF model whose
tokenizer is byte-level BPE (tokenizer.ggml.model == "gpt2"), so that kvx bench and aiperf can
size prompts with the model's own vocabulary offline.

Needs the PyPI packages `gguf` and `tokenizers`.
Usage: gguf_tokenizer_json.py MODEL.gguf OUT_DIR
"""
import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def strings(reader, name):
    f = reader.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def scalar_str(reader, name):
    f = reader.fields.get(name)
    return bytes(f.parts[f.data[0]]).decode("utf-8") if f else None


def scalar_int(reader, name):
    f = reader.fields.get(name)
    return int(f.parts[f.data[0]][0]) if f else None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model, out = sys.argv[1], sys.argv[2]
    r = GGUFReader(model)
    kind = scalar_str(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        sys.exit(f"{model}: tokenizer model {kind!r} is not byte-level BPE (gpt2)")
    tokens = strings(r, "tokenizer.ggml.tokens")
    merges = strings(r, "tokenizer.ggml.merges")
    tt = r.fields["tokenizer.ggml.token_type"]
    types = [int(tt.parts[i][0]) for i in tt.data]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
    )
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm"/"gpt2"-family pre-tokenizers: single digits, then GPT-2 byte level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    )
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    name = lambda key: tokens[scalar_int(r, key)] if scalar_int(r, key) is not None else None
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    print(f"wrote {out}/tokenizer.json: {len(tokens)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
