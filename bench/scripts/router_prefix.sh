#!/usr/bin/env bash
# Shared-prefix routing benchmark: prefix hit rate and TTFT of
#   (a) kvx frontend + one `kvx worker` process with 4 mock engines, router kv / round-robin /
#       random,
#   (b) Dynamo 1.6 frontend (kv router) + `dynamo.mocker` with 4 workers, same block counts,
#   (c) kvx frontend + one `kvx worker` with 4 real-model shards (1 thread each), kv vs
#       round-robin,
# all driven by `kvx bench` with the same workload: 20 system prompts of 1,000 tokens, each
# request one of them (each equally often, random order) plus a unique 100-token suffix,
# 16 in flight, 32 output tokens (ignore_eos), completions API. Mock engines on both sides:
# 256 KV blocks of 16 tokens, Dynamo's polynomial timing model at speedup 1, at most 256
# sequences and 8,192 tokens per step, chunked prefill, prefix caching.
#
# Hit rate = cached prompt tokens / prompt tokens, both summed from the `usage` the servers
# return (`prompt_tokens_details.cached_tokens`); router_prefix.py also prints each side's own
# server-side figure (kvx: the engines' counters in /metrics; Dynamo: the frontend's
# cached-token histogram) as a cross-check. Every configuration starts fresh servers (cold
# caches); each run uses its own prompt seed, the same for every configuration of that run.
# Medians of RUNS runs; the load average before each measurement is recorded.
#
# Usage: bench/scripts/router_prefix.sh [options]
#   --runs N             runs per configuration (default 3)
#   --requests N         requests per mock run (default 400)
#   --real-requests N    requests per real-engine run (default 64; 0 skips (c))
#   --dynamo-python PY   python with ai-dynamo 1.6.1 (default: /tmp/dyn-planes-venv/bin/python;
#                        `none` skips (b))
#   --out DIR            results (default /tmp/kvx-router-prefix)
# Environment: KVX (kvx binary, default target/release/kvx), KVX_HOME (model store), BLOCKS
# (KV blocks per engine, default 256), MODES (kvx mock router modes, default
# "kv round-robin random"; " " skips them).
# Dynamo is installed with: python3 -m venv V && V/bin/pip install ai-dynamo-runtime==1.6.1 &&
#   V/bin/pip install --no-deps ai-dynamo==1.6.1 && V/bin/pip install pyyaml transformers
#   msgspec pyzmq aiohttp prometheus-client kubernetes redis zstandard tqdm gguf
set -euo pipefail

RUNS=3 REQ=400 REAL_REQ=64 DYNPY=/tmp/dyn-planes-venv/bin/python OUT=/tmp/kvx-router-prefix
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --real-requests) REAL_REQ=$2; shift 2 ;;
    --dynamo-python) DYNPY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
GGUF=$("$KVX" model path smollm2-135m-instruct-q4_1)
NAME=smollm2-135m-instruct-q4_1
BLOCK=16 BLOCKS=${BLOCKS:-256}
# 256 blocks of the real model: 30 layers x (K, V) x 3 KV heads x 64 dims x 16 tokens x f16.
REAL_KV_BYTES=$((BLOCKS * 30 * 2 * 3 * 64 * BLOCK * 2))
MOCK_ENGINE=(--max-num-seqs 256 --max-batched-tokens 8192 --block-size "$BLOCK")
rm -rf "$OUT"; mkdir -p "$OUT/logs"
PIDS=()

stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits until the file $1 has a line starting with $2 and prints the rest of it.
wait_line() {
  for _ in $(seq 1 600); do
    if l=$(grep -m1 "^$2" "$1" 2>/dev/null); then echo "${l#"$2"}"; return 0; fi
    sleep 0.2
  done
  echo "timed out waiting for '$2' in $1" >&2; return 1
}

# Waits until GET $1 answers and its body contains $2.
wait_http() {
  for _ in $(seq 1 900); do
    if curl -sf "$1" 2>/dev/null | grep -q "$2"; then return 0; fi
    sleep 0.2
  done
  echo "timed out waiting for $1 to show '$2'" >&2; return 1
}

bench() { # url requests seed json
  local seed=$3
  echo "load $(cut -d' ' -f1-3 /proc/loadavg)" > "$4.load"
  "$KVX" bench --url "$1" --api completions --model "$NAME" --workload shared-prefix \
    --prefixes 20 --prefix-tokens 1000 --input-tokens 100 --output-tokens 32 \
    --concurrency 16 --requests "$2" --prompts "$2" --tokenizer "$GGUF" --ignore-eos \
    --seed "$seed" -q --json "$4" > "${4%.json}.txt"
}

kvx_run() { # tag mode engine requests seed
  local tag=$1 mode=$2 engine=$3 n=$4 seed=$5
  "$KVX" frontend --port 0 --worker-listen 127.0.0.1:0 --model "$GGUF" \
    --router-mode "$mode" --block-size "$BLOCK" > "$OUT/logs/$tag.frontend.out" 2> "$OUT/logs/$tag.frontend.err" &
  PIDS+=($!)
  local waddr url
  waddr=$(wait_line "$OUT/logs/$tag.frontend.out" "workers join at ")
  url=$(wait_line "$OUT/logs/$tag.frontend.out" "listening on ")
  if [ "$engine" = mocker ]; then
    "$KVX" worker --frontend "$waddr" --engine mocker --shards 4 --mocker-blocks "$BLOCKS" \
      --speedup-ratio 1 "${MOCK_ENGINE[@]}" > "$OUT/logs/$tag.worker.out" 2> "$OUT/logs/$tag.worker.err" &
  else
    "$KVX" worker --frontend "$waddr" --engine model --model "$GGUF" --shards 4 \
      --threads-per-shard 1 --kv-cache-bytes "$REAL_KV_BYTES" --block-size "$BLOCK" \
      > "$OUT/logs/$tag.worker.out" 2> "$OUT/logs/$tag.worker.err" &
  fi
  PIDS+=($!)
  wait_http "$url/metrics" "kvx_router_plane_workers 4"
  bench "$url" "$n" "$seed" "$OUT/$tag.json"
  curl -sf "$url/metrics" > "$OUT/$tag.metrics" || true
  stop_all
}

dynamo_run() { # tag requests seed
  local tag=$1 n=$2 seed=$3 port
  port=$(free_port)
  export DYN_FILE_KV="$OUT/dynamo-store-$tag"
  mkdir -p "$DYN_FILE_KV"
  local planes=(--discovery-backend file --request-plane tcp --event-plane zmq)
  "$DYNPY" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$port" --router-mode kv \
    --kv-cache-block-size "$BLOCK" "${planes[@]}" > "$OUT/logs/$tag.frontend.log" 2>&1 &
  PIDS+=($!)
  "$DYNPY" -m dynamo.mocker --model-path "$OUT/hf" --model-name "$NAME" --num-workers 4 \
    --num-gpu-blocks-override "$BLOCKS" --block-size "$BLOCK" --max-num-seqs 256 \
    --max-num-batched-tokens 8192 --speedup-ratio 1 "${planes[@]}" \
    > "$OUT/logs/$tag.mocker.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/v1/models" "$NAME"
  # The router learns the workers from discovery; give it a moment after the model appears.
  sleep 3
  bench "http://127.0.0.1:$port" "$n" "$seed" "$OUT/$tag.json"
  curl -sf "http://127.0.0.1:$port/metrics" > "$OUT/$tag.metrics" || true
  stop_all
}

{
  echo "kvx $("$KVX" --version)  model $GGUF"
  echo "machine: $(nproc) cores, $(grep MemTotal /proc/meminfo | tr -s ' ')"
  echo "workload: 20 x 1000-token prefixes + 100-token suffix, 16 in flight, 32 output tokens"
  echo "mock: $REQ requests/run, real: $REAL_REQ requests/run, $RUNS runs"
} | tee "$OUT/setup.txt"

if [ "$DYNPY" != none ]; then
  "$DYNPY" -c 'import importlib.metadata as m; print("ai-dynamo", m.version("ai-dynamo"))' | tee -a "$OUT/setup.txt"
  "$DYNPY" "$HERE/router_prefix.py" hf "$GGUF" "$OUT/hf" "$HERE/gguf_tokenizer_json.py"
fi

for r in $(seq 1 "$RUNS"); do
  for mode in ${MODES:-kv round-robin random}; do
    echo "== run $r: kvx mocker, router $mode"
    kvx_run "kvx-mock-$mode-$r" "$mode" mocker "$REQ" "$r"
  done
  if [ "$DYNPY" != none ]; then
    echo "== run $r: Dynamo mocker, router kv"
    dynamo_run "dynamo-mock-kv-$r" "$REQ" "$r"
  fi
  if [ "$REAL_REQ" -gt 0 ]; then
    for mode in kv round-robin; do
      echo "== run $r: kvx real shards, router $mode"
      kvx_run "kvx-real-$mode-$r" "$mode" model "$REAL_REQ" "$r"
    done
  fi
done
python3 "$HERE/router_prefix.py" summary "$OUT" | tee "$OUT/summary.md"
