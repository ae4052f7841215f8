#!/usr/bin/env bash
# Engine measurements against its own single-request baseline (same binary, same run):
#  1. prefix cache: TTFT of a request whose 1,000-token prefix is cached vs the first one;
#  2. throughput: 16 concurrent greedy requests x 128 tokens vs one request's decode tok/s.
# Usage: bench/scripts/engine_bars.sh [runs]   (KVX=path/to/kvx, THREADS=n)
set -euo pipefail
cd "$(dirname "$0")/../.."
KVX=${KVX:-target/release/kvx}
RUNS=${1:-3}
THREADS=${THREADS:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp" <<'PY'
import random, sys
d = sys.argv[1]
random.seed(7)
words = "the of and to in is it you that he was for on are with as his they be at one have this from".split()
prefix = " ".join(random.choice(words) for _ in range(900))
with open(f"{d}/prefix.txt", "w") as f:
    f.write(prefix + " Question one: what is the first word?\n")
    f.write(prefix + " Question two: what is the last word here?\n")
topics = ["rain", "the moon", "bread", "rivers", "chess", "bees", "glass", "volcanoes",
          "trains", "coffee", "maps", "owls", "tides", "paper", "salt", "wind"]
with open(f"{d}/sixteen.txt", "w") as f:
    for t in topics:
        f.write(f"Write a long, detailed essay about {t}, covering its history, science and culture.\n")
with open(f"{d}/one.txt", "w") as f:
    f.write(f"Write a long, detailed essay about {topics[0]}, covering its history, science and culture.\n")
PY

for r in $(seq "$RUNS"); do
  "$KVX" generate --prompts-file "$tmp/prefix.txt" --concurrency 1 --temperature 0 --max-tokens 4 \
      --json --threads "$THREADS" 2>/dev/null > "$tmp/prefix.$r.jsonl"
  "$KVX" generate --prompts-file "$tmp/one.txt" --chat --concurrency 1 --temperature 0 --max-tokens 128 \
      --ignore-eos --json --threads "$THREADS" 2>/dev/null > "$tmp/one.$r.jsonl"
  "$KVX" generate --prompts-file "$tmp/sixteen.txt" --chat --concurrency 16 --temperature 0 --max-tokens 128 \
      --ignore-eos --json --threads "$THREADS" 2>/dev/null > "$tmp/sixteen.$r.jsonl"
done

python3 - "$tmp" "$RUNS" <<'PY'
import json, statistics, sys
d, runs = sys.argv[1], int(sys.argv[2])
def load(p): return [json.loads(l) for l in open(p)]
ttft_ratio, cached, tput_ratio, single_tps, multi_tps = [], [], [], [], []
for r in range(1, runs + 1):
    a, b = load(f"{d}/prefix.{r}.jsonl")
    ttft_ratio.append(a["ttft_ms"] / b["ttft_ms"]); cached.append(b["cached_tokens"])
    one = load(f"{d}/one.{r}.jsonl")[0]
    n = len(one["token_ids"])
    s = (n - 1) / ((one["e2e_ms"] - one["ttft_ms"]) / 1e3)
    six = load(f"{d}/sixteen.{r}.jsonl")
    toks = sum(len(j["token_ids"]) for j in six)
    wall = max(j["e2e_ms"] for j in six) / 1e3
    m = toks / wall
    single_tps.append(s); multi_tps.append(m); tput_ratio.append(m / s)
    print(f"run {r}: prefix TTFT {a['ttft_ms']:.1f} -> {b['ttft_ms']:.1f} ms ({ttft_ratio[-1]:.1f}x, {b['cached_tokens']} cached), "
          f"single decode {s:.1f} tok/s, 16 concurrent {m:.1f} tok/s ({tput_ratio[-1]:.2f}x)")
med = statistics.median
print(f"median: prefix TTFT ratio {med(ttft_ratio):.1f}x (cached tokens {med(cached):.0f}); "
      f"throughput 16 concurrent / single decode {med(tput_ratio):.2f}x "
      f"({med(multi_tps):.1f} vs {med(single_tps):.1f} tok/s)")
PY
