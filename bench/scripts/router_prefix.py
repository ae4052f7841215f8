#!/usr/bin/env python3
"""Helpers of router_prefix.sh.

  router_prefix.py hf MODEL.gguf OUT_DIR gguf_tokenizer_json.py
      Writes a Hugging Face model directory without weights (tokenizer.json,
      tokenizer_config.json with the chat template, config.json) for Dynamo's frontend and
      mocker, from the GGUF's metadata. Needs the PyPI packages `gguf` and `tokenizers`.

  router_prefix.py summary OUT_DIR
      Reads the kvx bench JSON reports (TAG-RUN.json) and /metrics dumps and prints, per
      configuration, the median over runs of: prefix hit rate (cached / prompt tokens from the
      usage the server returned), the server's own hit-rate figure, TTFT p50 / p90, E2E p50,
      completed and failed requests, and the load average before the runs.
"""
import glob
import json
import os
import re
import statistics
import subprocess
import sys


def hf(gguf_path, out, tok_script):
    from gguf import GGUFReader

    subprocess.run([sys.executable, tok_script, gguf_path, out], check=True)
    r = GGUFReader(gguf_path)

    def field(name):
        f = r.fields.get(name)
        if f is None:
            return None
        v = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(v).decode("utf-8")
        return v[0].item()

    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        tc = json.load(f)
    tc["chat_template"] = field("tokenizer.chat_template")
    tc["model_max_length"] = field("llama.context_length")
    with open(cfg_path, "w") as f:
        json.dump(tc, f)
    heads = field("llama.attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(r.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": field("llama.embedding_length"),
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field("llama.attention.head_count_kv") or heads,
        "max_position_embeddings": field("llama.context_length"),
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field("llama.rope.freq_base"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    print(f"wrote {out}: tokenizer, chat template, config.json")


def metric_sum(text, name):
    """Sum of the samples of series `name` (any labels) in a Prometheus text dump."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name:
            total += float(m.group(3))
            seen = True
    return total if seen else None


def server_hit_rate(tag, out):
    """The server's own hit-rate figure: kvx engines' counters, or Dynamo's histograms."""
    path = os.path.join(out, tag + ".metrics")
    if not os.path.exists(path):
        return None
    text = open(path).read()
    v = metric_sum(text, "kvx_prefix_cache_hit_rate")
    if v is not None:
        return v
    cached = metric_sum(text, "dynamo_frontend_cached_tokens_sum")
    prompt = metric_sum(text, "dynamo_frontend_input_sequence_tokens_sum")
    if cached is not None and prompt:
        return cached / prompt
    return None


def summary(out):
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        tag = os.path.basename(path)[:-5]
        m = re.match(r"^(.*)-(\d+)$", tag)
        if not m:
            continue
        with open(path) as f:
            rep = json.load(f)
        run = rep["runs"][0]
        tok = run["tokens"]
        prompt = tok.get("server_prompt_total") or 0
        cached = tok.get("cached_total")
        lat = run["latency_ms"]
        load = open(path + ".load").read().split()[1] if os.path.exists(path + ".load") else "?"
        rows.setdefault(m.group(1), []).append(
            {
                "hit": (cached / prompt) if (cached is not None and prompt) else None,
                "server_hit": server_hit_rate(tag, out),
                "ttft50": lat["ttft"]["p50"],
                "ttft90": lat["ttft"]["p90"],
                "e2e50": lat["e2e"]["p50"],
                "ok": run["requests"]["completed"],
                "failed": run["requests"]["failed"],
                "load": load,
            }
        )

    def med(vals, fmt):
        vals = [v for v in vals if v is not None]
        return fmt.format(statistics.median(vals)) if vals else "n/a"

    order = ["kvx-mock-kv", "kvx-mock-round-robin", "kvx-mock-random", "dynamo-mock-kv",
             "kvx-real-kv", "kvx-real-round-robin"]
    names = sorted(rows, key=lambda k: order.index(k) if k in order else len(order))
    print("| configuration | runs | hit rate (usage) | hit rate (server) | TTFT p50 ms | "
          "TTFT p90 ms | E2E p50 ms | completed / failed | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in names:
        rs = rows[k]
        print(
            f"| {k} | {len(rs)} | {med([r['hit'] for r in rs], '{:.3f}')} | "
            f"{med([r['server_hit'] for r in rs], '{:.3f}')} | "
            f"{med([r['ttft50'] for r in rs], '{:.1f}')} | "
            f"{med([r['ttft90'] for r in rs], '{:.1f}')} | "
            f"{med([r['e2e50'] for r in rs], '{:.1f}')} | "
            f"{sum(r['ok'] for r in rs)} / {sum(r['failed'] for r in rs)} | "
            f"{', '.join(r['load'] for r in rs)} |"
        )
    print()
    print("Per run (hit rate, TTFT p50 ms):")
    for k in names:
        print(f"  {k}: " + "; ".join(
            f"{r['hit']:.3f}, {r['ttft50']:.1f}" if r['hit'] is not None else f"n/a, {r['ttft50']:.1f}"
            for r in rows[k]))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "hf":
        hf(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
