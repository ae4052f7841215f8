#!/usr/bin/env bash
# Every arithmetic measured against the reference (the model's own math on its quantized
# weights: f32 activations and cache, f64 sums): KL divergence of each scored token's
# next-token distribution (mean, p99), top-1 agreement and perplexity over a text the tests do
# not use, then each arithmetic's speed: prompt (pp512) and single-stream decode (tg128) tok/s
# from `kvx bench engine`, and 16 concurrent greedy streams of 128 tokens from `kvx generate`
# (alternating runs, medians); then each arithmetic's divergence against the first's, token by
# token (`kvx eval perplexity --kld-values`).
# Usage: bench/scripts/arith_table.sh [runs]
#   KVX=path/to/kvx  TEXT=file (default: the GPL-3, GFDL-1.3 and Apache-2.0 texts of
#   Debian's base-files, one after the other: 7,395 scored tokens at CTX 512)
#   CTX=512 CHUNKS=100 (windows scored at most)  THREADS=2  ARITHS="exact fast split"
#   BASE=file: a reference base saved earlier (`kvx eval perplexity --arith reference
#   --save-logits file` over the same text, window and chunks) instead of a new pass
set -euo pipefail
cd "$(dirname "$0")/../.."
KVX=${KVX:-target/release/kvx}
RUNS=${1:-3}
CTX=${CTX:-512}
CHUNKS=${CHUNKS:-100}
THREADS=${THREADS:-2}
ARITHS=${ARITHS:-exact fast split}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "${TEXT:-}" ]; then
  TEXT=$tmp/text.txt
  cat /usr/share/common-licenses/{GPL-3,GFDL-1.3,Apache-2.0} > "$TEXT"
fi
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs), model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs)), $(nproc) cores; text: $TEXT; ctx $CTX, $CHUNKS windows" >&2

ppl=(eval perplexity --file "$TEXT" --ctx "$CTX" --chunks "$CHUNKS" --threads "$THREADS" --json)
if [ -n "${BASE:-}" ]; then
  ref=$BASE
  "$KVX" "${ppl[@]}" --arith exact --kl-divergence "$ref" \
    | python3 -c 'import json,sys; q=json.load(sys.stdin); print(json.dumps({"ppl": q["ppl_base"], "tokens": q["tokens"], "chunks": q["chunks"], "ctx": q["ctx"]}))' \
    > "$tmp/q.reference.json"
else
  ref=$tmp/ref.logp
  echo "reference pass (slow)..." >&2
  start=$(date +%s)
  "$KVX" "${ppl[@]}" --arith reference --save-logits "$ref" > "$tmp/q.reference.json"
  echo "reference: $(( $(date +%s) - start )) s" >&2
fi
for a in $ARITHS; do
  "$KVX" "${ppl[@]}" --arith "$a" --kl-divergence "$ref" --kld-values "$tmp/k.$a.f64" \
    > "$tmp/q.$a.json"
done

python3 - "$tmp" <<'PY'
import random, sys
d = sys.argv[1]
topics = ["rain", "the moon", "bread", "rivers", "chess", "bees", "glass", "volcanoes",
          "trains", "coffee", "maps", "owls", "tides", "paper", "salt", "wind"]
with open(f"{d}/sixteen.txt", "w") as f:
    for t in topics:
        f.write(f"Write a long, detailed essay about {t}, covering its history, science and culture.\n")
PY
for r in $(seq "$RUNS"); do
  for a in $ARITHS; do
    "$KVX" bench engine --arith "$a" --threads "$THREADS" --pp 512 --tg 128 --reps 3 --json \
        2>/dev/null > "$tmp/s.$a.$r.json"
    "$KVX" generate --arith "$a" --threads "$THREADS" --prompts-file "$tmp/sixteen.txt" --chat \
        --concurrency 16 --temperature 0 --max-tokens 128 --ignore-eos --json \
        2>/dev/null > "$tmp/g.$a.$r.jsonl"
  done
done

python3 - "$tmp" "$RUNS" $ARITHS <<'PY'
import json, statistics, sys
d, runs, ariths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
med = statistics.median
ref = json.load(open(f"{d}/q.reference.json"))
print(f"reference perplexity {ref['ppl']:.4f} over {ref['tokens']} tokens ({ref['chunks']} windows of {ref['ctx']})\n")
print(f"| arithmetic | KLD mean | KLD p99 | top-1 | perplexity (Δ vs {ariths[0]}) | pp512 tok/s | tg128 tok/s | 16 streams tok/s |")
print("|---|---|---|---|---|---|---|---|")
base_ppl = None
for a in ariths:
    q = json.load(open(f"{d}/q.{a}.json"))
    if base_ppl is None:
        base_ppl = q["ppl"]
    pp = [json.load(open(f"{d}/s.{a}.{r}.json"))["pp_tok_s"] for r in range(1, runs + 1)]
    tg = [json.load(open(f"{d}/s.{a}.{r}.json"))["tg_tok_s"] for r in range(1, runs + 1)]
    g = []
    for r in range(1, runs + 1):
        rows = [json.loads(l) for l in open(f"{d}/g.{a}.{r}.jsonl")]
        g.append(sum(len(j["token_ids"]) for j in rows) / (max(j["e2e_ms"] for j in rows) / 1e3))
    dppl = 100 * (q["ppl"] / base_ppl - 1)
    print(f"| {q['arith']} | {q['kld_mean']:.6f} ± {q['kld_se']:.6f} | {q['kld_p99']:.5f} | {100 * q['top1']:.2f} % | "
          f"{q['ppl']:.4f} ({dppl:+.2f} %) | {med(pp):.0f} | {med(tg):.0f} | {med(g):.0f} |")
print(f"| reference | 0 | 0 | 100 % | {ref['ppl']:.4f} | – | – | – |")

# Paired: each arithmetic's divergence minus the first's, token by token (the same tokens, so
# what the text's hard and easy tokens share cancels: a smaller standard error than the
# difference of two independent means). The default rule asks for the difference plus its
# standard error to be <= 0.
import array, math
def kld(a):
    v = array.array("d")
    with open(f"{d}/k.{a}.f64", "rb") as f:
        v.frombytes(f.read())
    if sys.byteorder == "big":
        v.byteswap()  # the file is little-endian
    return v
k0 = kld(ariths[0])
print(f"\n| arithmetic | KLD − {ariths[0]}'s, paired (mean ± s.e.) | relative | tokens nearer / farther |")
print("|---|---|---|---|")
for a in ariths[1:]:
    k = kld(a)
    assert len(k) == len(k0) > 1, f"{a}: {len(k)} divergences against {len(k0)}"
    diff = [x - y for x, y in zip(k, k0)]
    n = len(diff)
    mean = sum(diff) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in diff) / (n - 1) / n)
    rel = f"{100 * mean / (sum(k0) / n):+.1f} %" if sum(k0) > 0 else "–"
    print(f"| {a} | {mean:+.6f} ± {se:.6f} | {rel} | "
          f"{sum(x < 0 for x in diff)} / {sum(x > 0 for x in diff)} |")
PY
