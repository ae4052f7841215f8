#!/usr/bin/env bash
# Inter-token latency of structured outputs: `kvx bench` against one `kvx serve` (the real
# model), the same workload without and with a JSON schema (`response_format`), alternating,
# RUNS times each. Prints each run's ITL p50, the medians and their ratio (with / without).
# The schema asks for an object with an array of 12 short strings, about as long as the
# unconstrained answers (--output-tokens); TEMPERATURE 0 measures greedy requests, where the
# unconstrained ones may use the cheaper argmax head.
#
# Usage: bench/scripts/structured_itl.sh [RUNS=3] [REQUESTS=16] [CONCURRENCY=4]
# Environment: KVX (default target/release/kvx), MODEL (default `kvx model path`),
# TEMPERATURE (default 0.8), OUTPUT_TOKENS (default 64), SERVE_ARGS (extra `kvx serve` flags),
# SCHEMA (the JSON schema; the default's strings have minLength/maxLength, for which
# llguidance walks the whole token trie each step: its costliest kind of mask).
set -euo pipefail
RUNS=${1:-3} REQUESTS=${2:-16} CONC=${3:-4}
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
MODEL=${MODEL:-$("$KVX" model path)}
TEMP=${TEMPERATURE:-0.8} OUT_TOKENS=${OUTPUT_TOKENS:-64}
OUT=$(mktemp -d)
# shellcheck disable=SC2086
"$KVX" serve --port 0 --model "$MODEL" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null || true' EXIT
ADDR=
for _ in $(seq 600); do
  ADDR=$(sed -n 's#^listening on http://\([^ ]*\).*#\1#p' "$OUT/serve.log" | head -1)
  [ -n "$ADDR" ] && break
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$OUT/serve.log"; echo "kvx serve did not start" >&2; exit 1; }
SCHEMA=${SCHEMA:-'{"type":"object","properties":{"words":{"type":"array","minItems":12,"maxItems":12,"items":{"type":"string","minLength":3,"maxLength":8}}},"required":["words"],"additionalProperties":false}'}
PLAIN="{\"temperature\":$TEMP,\"seed\":1}"
WITH="{\"temperature\":$TEMP,\"seed\":1,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"words\",\"schema\":$SCHEMA}}}"
run() { # NAME BODY
  "$KVX" bench --url "http://$ADDR" --api chat --concurrency "$CONC" --requests "$REQUESTS" \
    --warmup 2 --input-tokens 64 --output-tokens "$OUT_TOKENS" --prompts 64 --seed 1 \
    --extra-body "$2" -q --json "$OUT/$1.json" > /dev/null 2>&1
  python3 - "$OUT/$1.json" "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
itl = r["latency_ms"]["itl"]
print(f"{sys.argv[2]}: ITL p50 {itl['p50']:.2f} ms (p99 {itl['p99']:.2f}, {itl['count']} gaps, "
      f"{r['requests']['failed']} failed)")
PY
}
for i in $(seq 1 "$RUNS"); do
  run "plain_$i" "$PLAIN"
  run "schema_$i" "$WITH"
done
python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
p50 = lambda n: statistics.median(
    json.load(open(f"{out}/{n}_{i}.json"))["runs"][0]["latency_ms"]["itl"]["p50"]
    for i in range(1, runs + 1))
a, b = p50("plain"), p50("schema")
print(f"median ITL p50: without {a:.2f} ms, with schema {b:.2f} ms, ratio {b / a:.3f}")
PY
