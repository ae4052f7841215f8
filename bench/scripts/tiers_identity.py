#!/usr/bin/env python3
"""Greedy multi-turn chat sessions, the same on several OpenAI endpoints: each turn sends the
whole history (user messages drawn from a fixed word list, the assistant's earlier answers),
32 tokens per answer with their top-5 log-probabilities. Prints, for each endpoint after the
first, how many answers have the same tokens (text) as the first endpoint's, and how many
also the same log-probabilities, and the prompt tokens served from cache on each. Exits
non-zero when any text differs.

Usage: tiers_identity.py URL [URL ...] [--sessions N] [--turns N] [--words N]
"""
import argparse
import json
import random
import sys
import urllib.request

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact story river music "
         "garden letter window market engine island winter paper bridge history").split()


def chat(url, messages):
    body = json.dumps({"messages": messages, "max_tokens": 32, "temperature": 0,
                       "logprobs": True, "top_logprobs": 5, "ignore_eos": True}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        v = json.load(r)
    c = v["choices"][0]
    cached = (v.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return c["message"]["content"], c.get("logprobs"), cached, v["usage"]["prompt_tokens"]


def run(url, sessions, turns, words):
    rng = random.Random(7)
    users = [[" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(turns)]
             for _ in range(sessions)]
    history = [[] for _ in range(sessions)]
    answers, cached, prompt = [], 0, 0
    # Turn by turn, session after session: every session's history has to come back each turn.
    for t in range(turns):
        for s in range(sessions):
            history[s].append({"role": "user", "content": users[s][t]})
            text, lps, c, p = chat(url, history[s])
            history[s].append({"role": "assistant", "content": text})
            answers.append((text, lps))
            cached += c
            prompt += p
    return answers, cached, prompt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--words", type=int, default=150)
    a = ap.parse_args()
    base = None
    ok = True
    for i, url in enumerate(a.urls):
        answers, cached, prompt = run(url, a.sessions, a.turns, a.words)
        line = f"endpoint {i}: {cached}/{prompt} prompt tokens cached ({cached / max(prompt, 1):.0%})"
        if base is None:
            base = answers
        else:
            text = sum(x[0] == y[0] for x, y in zip(base, answers))
            both = sum(x == y for x, y in zip(base, answers))
            ok &= text == len(base)
            line += (f"; answers with endpoint 0's tokens: {text}/{len(base)}, "
                     f"and its log-probabilities too: {both}/{len(base)}")
            first = next((k for k, (x, y) in enumerate(zip(base, answers)) if x[0] != y[0]), None)
            if first is not None:
                line += f" (first different text at answer {first}: {base[first][0]!r} vs {answers[first][0]!r})"
        print(line, flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
