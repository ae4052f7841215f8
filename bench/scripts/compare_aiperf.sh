#!/usr/bin/env bash
# Agreement check: kvx bench and aiperf (PyPI `aiperf`) against the same OpenAI-compatible
# server and workload, alternating, RUNS runs each; prints medians and ratios of TTFT p50/p90,
# ITL p50 and output tokens/s (aiperf_summary.py) and fails if one differs by more than 5%.
#
# Both tools size prompts with the same tokenizer directory (tokenizer.json, e.g. made by
# gguf_tokenizer_json.py), send the same fixed input/output lengths as `max_tokens`, the same
# extra body, and count output tokens by tokenizing the generated text (aiperf's default;
# kvx bench --count-output-with-tokenizer) unless the server reports usage.
#
# Usage: bench/scripts/compare_aiperf.sh [options]
#   --url URL            server (default http://127.0.0.1:8000)
#   --model NAME         model name (default: ask the server)
#   --tokenizer DIR      directory holding tokenizer.json (required)
#   --isl N --osl N      input / output tokens per request (default 128 / 32)
#   --requests N         measured requests per run (default 40)
#   --warmup N           warm-up requests per run (default 2)
#   --concurrency C      closed-loop concurrency (default 1)
#   --runs N             runs per tool (default 3)
#   --extra-body JSON    merged into every request (default '{}')
#   --out DIR            where results go (default /tmp/kvx-aiperf-compare)
# Environment: KVX (kvx binary, default target/release/kvx), AIPERF (default: aiperf on PATH),
#   CLIENT_CPUS (e.g. 0: run both clients under `taskset -c CLIENT_CPUS`). On a small machine pin
#   the server to other cores (e.g. `taskset -c 1 python -m llama_cpp.server ... --n_threads 1`)
#   so that neither client's own CPU use slows the server it measures.
set -euo pipefail

URL=http://127.0.0.1:8000 MODEL= TOK= ISL=128 OSL=32 REQ=40 WARM=2 CONC=1 RUNS=3 EXTRA='{}'
OUT=/tmp/kvx-aiperf-compare
while [ $# -gt 0 ]; do
  case "$1" in
    --url) URL=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --tokenizer) TOK=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --warmup) WARM=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --extra-body) EXTRA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$TOK" ] && [ -f "$TOK/tokenizer.json" ] || { echo "--tokenizer DIR with tokenizer.json is required" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
AIPERF=${AIPERF:-aiperf}
if [ -z "$MODEL" ]; then
  MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
fi
PIN=()
[ -n "${CLIENT_CPUS:-}" ] && PIN=(taskset -c "$CLIENT_CPUS")
rm -rf "$OUT"; mkdir -p "$OUT"
echo "server $URL model $MODEL: isl $ISL osl $OSL, $REQ requests at concurrency $CONC, $RUNS runs each" | tee "$OUT/setup.txt"

for i in $(seq 1 "$RUNS"); do
  echo "== run $i: kvx bench"
  "${PIN[@]}" "$KVX" bench --url "$URL" --model "$MODEL" --tokenizer "$TOK/tokenizer.json" \
    --input-tokens "$ISL" --output-tokens "$OSL" --prompts "$REQ" --requests "$REQ" \
    --warmup "$WARM" --concurrency "$CONC" --extra-body "$EXTRA" --seed "$i" \
    --count-output-with-tokenizer -q --json "$OUT/kvx_$i.json" > "$OUT/kvx_$i.txt"
  echo "== run $i: aiperf"
  "${PIN[@]}" "$AIPERF" profile --model "$MODEL" --url "$URL" --endpoint-type chat --streaming \
    --tokenizer "$TOK" --isl "$ISL" --isl-stddev 0 --osl "$OSL" --osl-stddev 0 \
    --request-count "$REQ" --warmup-request-count "$WARM" --concurrency "$CONC" \
    --use-legacy-max-tokens --extra-inputs "$EXTRA" --random-seed "$i" --ui none \
    --workers-max "$CONC" --record-processors 1 \
    --output-artifact-dir "$OUT/aiperf_$i" > "$OUT/aiperf_$i.txt" 2>&1
done
python3 "$HERE/aiperf_summary.py" "$OUT" | tee "$OUT/summary.md"
