#!/usr/bin/env python3
"""Greedy completions of 20 prompts of 50 to 3,000 tokens (token ids) with their top-5
log-probabilities, from two OpenAI endpoints; prints whether each pair is identical and
exits non-zero on any difference.

Usage: disagg_identity.py URL_A URL_B [--prompts N] [--max-tokens N]
"""
import argparse
import json
import sys
import urllib.request


def prompts(n):
    out = []
    for i in range(n):
        length = 50 + (i * 2950) // max(n - 1, 1)
        out.append([200 + (i * 7919 + j * 104729) % 40000 for j in range(length)])
    return out


def complete(url, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "logprobs": 5}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        c = json.load(r)["choices"][0]
    return {"text": c["text"], "logprobs": c["logprobs"], "finish": c["finish_reason"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    same = 0
    ps = prompts(a.prompts)
    for i, p in enumerate(ps):
        x, y = complete(a.a, p, a.max_tokens), complete(a.b, p, a.max_tokens)
        ok = x == y
        same += ok
        print(f"prompt {i:2d} ({len(p):4d} tokens): {'identical' if ok else 'DIFFERENT'}"
              + ("" if ok else f"\n  A: {x['text']!r}\n  B: {y['text']!r}"))
    print(f"{same}/{len(ps)} prompts identical (tokens and top-5 log-probabilities)")
    sys.exit(0 if same == len(ps) else 1)


if __name__ == "__main__":
    main()
