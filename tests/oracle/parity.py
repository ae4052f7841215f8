#!/usr/bin/env python3
"""Greedy-generation parity between kvx and llama.cpp (through llama-cpp-python).

For each prompt (one per line of --prompts), runs
    kvx generate --exact --chat --temperature 0 --max-tokens N --json --prompt P
then feeds kvx's prompt token ids to llama.cpp (oracle.py generate) and compares the
generated ids token by token. A prompt "matches" when the ids are identical. A divergence
is "allowed" when, at the first differing step, llama.cpp's top two logits are within
--tie (default 1e-3): then either token is a correct greedy choice.

It also checks that kvx's prompt ids equal llama.cpp's tokenization of the chat template
rendered by jinja2 the way transformers renders it (oracle.py render + tokenize).

Prints one line per prompt and a JSON summary as the last line; exits 1 when fewer than
--min-match of the prompts match or when any divergence is not at a near-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ORACLE = os.path.join(HERE, "oracle.py")


def run_oracle(python: str, sub: str, model: str | None, requests: list[dict], extra: list[str] = ()) -> list[dict]:
    cmd = [python, ORACLE, sub] + (["--model", model] if model else []) + list(extra)
    out = subprocess.run(cmd, input="".join(json.dumps(r) + "\n" for r in requests),
                         capture_output=True, text=True, check=True)
    return [json.loads(l) for l in out.stdout.splitlines() if l.strip()]


def gguf_template(python: str, model: str) -> tuple[str, str, str]:
    """The model's chat template and BOS/EOS texts, read through llama.cpp's loader."""
    script = (
        "import json, sys, llama_cpp\n"
        "m = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)\n"
        "tok = lambda t: m.detokenize([t], special=True).decode('utf-8', 'replace') if t >= 0 else ''\n"
        "print(json.dumps([m.metadata.get('tokenizer.chat_template', ''), tok(m.token_bos()), tok(m.token_eos())]))\n"
    )
    out = subprocess.run([python, "-c", script, model], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvx", required=True, help="path to the kvx binary")
    ap.add_argument("--model", required=True, help="GGUF file (given to both)")
    ap.add_argument("--prompts", required=True, help="file with one prompt per line")
    ap.add_argument("--python", default=sys.executable, help="python with llama_cpp")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tie", type=float, default=1e-3)
    ap.add_argument("--min-match", type=float, default=0.9, help="fraction of prompts that must match")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kvx-args", default="", help="extra arguments for kvx generate")
    a = ap.parse_args()

    prompts = [l.rstrip("\n") for l in open(a.prompts, encoding="utf-8") if l.strip()]
    template, bos, eos = gguf_template(a.python, a.model)
    renders = run_oracle(a.python, "render", None, [
        {"template": template, "messages": [{"role": "user", "content": p}],
         "add_generation_prompt": True, "bos_token": bos, "eos_token": eos} for p in prompts])
    oracle_prompt_ids = run_oracle(a.python, "tokenize", a.model, [
        {"text": r["text"], "add_special": True, "parse_special": True} for r in renders])

    ours = []
    for p in prompts:
        cmd = [a.kvx, "generate", "--exact", "--model", a.model, "--chat", "--temperature", "0",
               "--max-tokens", str(a.max_tokens), "--json", "--prompt", p] + a.kvx_args.split()
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"kvx failed on {p!r}: {out.stderr.strip()}", file=sys.stderr)
            return 2
        ours.append(json.loads(out.stdout.strip().splitlines()[-1]))

    theirs = run_oracle(a.python, "generate", a.model,
                        [{"prompt_ids": o["prompt_token_ids"], "max_tokens": a.max_tokens} for o in ours],
                        ["--threads", str(a.threads)])

    matched, allowed, failed, prompt_mismatch = 0, 0, 0, 0
    for p, o, t, op in zip(prompts, ours, theirs, oracle_prompt_ids):
        if o["prompt_token_ids"] != op["ids"]:
            prompt_mismatch += 1
            print(f"PROMPT-IDS  {p!r}: kvx {o['prompt_token_ids']} vs llama.cpp {op['ids']}")
        a_ids, b_ids = o["token_ids"], t["token_ids"]
        if a_ids == b_ids:
            matched += 1
            print(f"match       {p!r}")
            continue
        i = next((k for k in range(min(len(a_ids), len(b_ids))) if a_ids[k] != b_ids[k]), min(len(a_ids), len(b_ids)))
        if i < len(t["top2"]):
            _, l1, _, l2 = t["top2"][i]
            gap = l1 - l2
        else:
            gap = float("inf")
        if gap < a.tie:
            allowed += 1
            print(f"near-tie    {p!r}: first difference at token {i}, llama.cpp top-2 gap {gap:.2e}")
        else:
            failed += 1
            print(f"DIVERGE     {p!r}: first difference at token {i}, llama.cpp top-2 gap {gap:.4f}; "
                  f"kvx {a_ids[i:i+4]} vs llama.cpp {b_ids[i:i+4]}")
    n = len(prompts)
    ok = matched >= a.min_match * n and failed == 0 and prompt_mismatch == 0
    print(json.dumps({"prompts": n, "matched": matched, "near_tie": allowed, "diverged": failed,
                      "prompt_id_mismatch": prompt_mismatch, "pass": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
