#!/usr/bin/env bash
# Client throughput check: kvx bench pinned to one core (taskset -c CLIENT_CPU, one runtime
# thread) against the zero-latency OpenAI fixture pinned to another (taskset -c SERVER_CPU).
# Prints requests/s of each run and the median.
#
# Usage: bench/scripts/one_core_rps.sh [RUNS=3] [REQUESTS=60000] [CONCURRENCY=64]
# Environment: KVX (default target/release/kvx), FIXTURE (default
# target/release/examples/openai_fixture; build with
# `cargo build --release -p kvx -p kvx-bench --example openai_fixture`), CLIENT_CPU (0), SERVER_CPU (1).
set -euo pipefail
RUNS=${1:-3} REQUESTS=${2:-60000} CONC=${3:-64}
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
FIXTURE=${FIXTURE:-$HERE/../../target/release/examples/openai_fixture}
CLIENT_CPU=${CLIENT_CPU:-0} SERVER_CPU=${SERVER_CPU:-1}
PORT=$((20000 + RANDOM % 20000))
OUT=$(mktemp -d)
taskset -c "$SERVER_CPU" "$FIXTURE" --port "$PORT" 2> "$OUT/fixture.log" &
FPID=$!
trap 'kill $FPID 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.1; done
rates=()
for i in $(seq 1 "$RUNS"); do
  taskset -c "$CLIENT_CPU" "$KVX" bench --url "http://127.0.0.1:$PORT" --threads 1 \
    --concurrency "$CONC" --requests "$REQUESTS" --warmup 1000 --input-tokens 32 \
    --output-tokens 16 --prompts 1000 --seed "$i" -q --json "$OUT/run_$i.json" > /dev/null 2>&1
  r=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["runs"][0]; print("%.0f %d" % (r["throughput"]["requests_per_s"], r["requests"]["failed"]))' "$OUT/run_$i.json")
  echo "run $i: ${r% *} requests/s (${r#* } failed)"
  rates+=("${r% *}")
done
printf '%s\n' "${rates[@]}" | sort -n | awk '{a[NR]=$1} END {print "median: " a[int((NR+1)/2)] " requests/s on one client core"}'
