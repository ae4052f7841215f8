#!/usr/bin/env bash
# kvx's CPU engine against llama.cpp on this machine, in one run, alternating the two, medians:
#  1. prefill pp512 and single-stream decode tg128 at 1 and 2 threads
#     (`kvx bench engine` vs `llama-bench`);
#  2. serving: 16 concurrent streams, 130-token prompts, 128 output tokens (ignore_eos),
#     `kvx serve` vs `llama-server --parallel 16 --cont-batching`, both driven by `kvx bench`
#     with the same workload; output tokens/s, TTFT p50 and the servers' peak RSS (VmHWM);
#     and kvx serve's 16 streams against one stream on the same server (its decode rate,
#     1 / mean time per output token), the scaling ratio; and, for reading it (no target),
#     one stream on a server started with `--no-lend-cores` (its shard on one core, where
#     the default lends it the idle ones).
# Prints the ratio table (kvx / llama.cpp) against the targets.
#
# The peer is llama.cpp as vendored in the llama-cpp-python sdist from PyPI, built once
# (cmake Release, GGML_NATIVE=ON) and cached in $PEER_DIR.
#
# Usage: bench/scripts/cpu_vs_llamacpp.sh [runs]
#   env: KVX (default target/release/kvx), MODEL (GGUF; default the catalogue's default
#   model), PEER_DIR (default .kvx/peer), THREADS (default "1 2"), SKIP_ENGINE=1,
#   SKIP_SERVE=1, SERVE_REQUESTS (default 64), ONE_REQUESTS (one stream's; default 6),
#   SKIP_NO_LEND=1 (no `--no-lend-cores` one-stream run), SHARDS (kvx serve engine shards,
#   default one per core), KV_BYTES (KV budget per shard, default 134217728), LLAMA_CTX
#   (llama-server context, default 8192), PORT_BASE (default 18470), OUT_DIR (raw results; default
#   .kvx/cpu_vs_llamacpp/<time>).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-3}
KVX=${KVX:-target/release/kvx}
PEER_DIR=${PEER_DIR:-.kvx/peer}
THREADS=${THREADS:-"1 2"}
SERVE_REQUESTS=${SERVE_REQUESTS:-64}
ONE_REQUESTS=${ONE_REQUESTS:-6}
SHARDS=${SHARDS:-$(nproc)}
KV_BYTES=${KV_BYTES:-134217728}
LLAMA_CTX=${LLAMA_CTX:-8192}
PORT_BASE=${PORT_BASE:-18470}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
here=$(dirname "$0")

[ -x "$KVX" ] || { echo "no kvx binary at $KVX (cargo build --release -p kvx)" >&2; exit 1; }
MODEL=${MODEL:-$("$KVX" model path)}

# A native build that faults on this CPU (a VM that advertises AMX but faults on `ldtilecfg`,
# as some KVM guests do) is rebuilt in $PEER_DIR/build-noamx with the AMX extensions off.
peer_runs() { # bin dir; fails with >= 128 when the probe died of a signal
  [ -x "$1/llama-bench" ] && [ -x "$1/llama-server" ] || return 1
  "$1/llama-bench" -m "$MODEL" -t 1 -p 8 -n 0 -r 1 > /dev/null 2>&1
}
peer_build() { # build dir, extra cmake args...
  local dir=$1
  shift
  cmake -S "$PEER_DIR/src/vendor/llama.cpp" -B "$dir" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "$@" >&2
  nice cmake --build "$dir" --target llama-bench llama-server -j"$(nproc)" >&2
}
build_peer() {
  PEER_BIN="$PEER_DIR/build-noamx/bin"
  if peer_runs "$PEER_BIN"; then return; fi
  PEER_BIN="$PEER_DIR/build/bin"
  if peer_runs "$PEER_BIN"; then return; fi
  mkdir -p "$PEER_DIR"
  if [ ! -d "$PEER_DIR/src/vendor/llama.cpp" ]; then
    echo "fetching llama-cpp-python==$LLAMA_CPP_PYTHON (sdist) ..." >&2
    python3 -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" \
      -d "$PEER_DIR" >&2
    rm -rf "$PEER_DIR/src" "$PEER_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON"
    tar xzf "$PEER_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$PEER_DIR"
    mv "$PEER_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON" "$PEER_DIR/src"
  fi
  local rc=0
  if [ ! -x "$PEER_BIN/llama-bench" ] || [ ! -x "$PEER_BIN/llama-server" ]; then
    echo "building llama-bench and llama-server (Release, GGML_NATIVE=ON) ..." >&2
    peer_build "$PEER_DIR/build"
    peer_runs "$PEER_BIN" && return
  fi
  peer_runs "$PEER_BIN" || rc=$?
  if [ "$rc" -lt 128 ]; then
    echo "llama-bench fails on $MODEL (exit $rc), not by a fault of the build" >&2
    exit 1
  fi
  local off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  echo "the native build faults on this CPU; rebuilding with AMX off ($off) ..." >&2
  peer_build "$PEER_DIR/build-noamx" -DCMAKE_C_FLAGS="$off" -DCMAKE_CXX_FLAGS="$off"
  PEER_BIN="$PEER_DIR/build-noamx/bin"
  peer_runs "$PEER_BIN" || { echo "llama.cpp does not run on this CPU" >&2; exit 1; }
}
build_peer
echo "peer: $PEER_BIN" >&2
LLAMA_BENCH="$PEER_BIN/llama-bench"
LLAMA_SERVER="$PEER_BIN/llama-server"

out=${OUT_DIR:-.kvx/cpu_vs_llamacpp/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

# The arithmetic kvx computes in (`auto` chooses per CPU; KVX_ARITH=exact gives llama.cpp's).
ARITH_USED=$("$KVX" generate --model "$MODEL" --prompt Hello --max-tokens 1 2>&1 >/dev/null \
  | grep -o '[a-z]* arithmetic$' || echo "unknown arithmetic")
echo "$ARITH_USED" > "$out/kvx_arithmetic.txt"
echo "model: $MODEL; runs: $RUNS; cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); kvx: $ARITH_USED" >&2

# ---- 1. engine: pp512 and tg128, alternating kvx and llama-bench -----------------------------
if [ -z "${SKIP_ENGINE:-}" ]; then
  for r in $(seq "$RUNS"); do
    for t in $THREADS; do
      echo "engine run $r, $t thread(s) ..." >&2
      "$KVX" bench engine --model "$MODEL" --threads "$t" --pp 512 --tg 128 --reps 1 --json \
        2>/dev/null > "$out/kvx_engine.$t.$r.json"
      "$LLAMA_BENCH" -m "$MODEL" -t "$t" -p 512 -n 128 -r 1 -o json \
        2>/dev/null > "$out/llama_engine.$t.$r.json"
    done
  done
fi

# ---- 2. serving: 16 streams, alternating kvx serve and llama-server --------------------------
# One stream first (kvx only: its decode rate is the base of the 16-stream scaling ratio; other
# prompts than the 16 streams', so that they find nothing in the prefix cache), then 16
# streams; records the server's peak RSS and stops it.
drive_one() { # name port json
  "$KVX" bench --url "http://127.0.0.1:$2" --api completions --tokenizer "$MODEL" \
    --workload synthetic --input-tokens 130 --output-tokens 128 --ignore-eos \
    --concurrency 1 --requests "$ONE_REQUESTS" --warmup 1 --wait-ready 120 --seed 1 \
    --extra-body '{"temperature":0}' -q --json "$3" > "$out/$1.one.bench.log" 2>&1
}
drive() { # name port json
  "$KVX" bench --url "http://127.0.0.1:$2" --api completions --tokenizer "$MODEL" \
    --workload synthetic --input-tokens 130 --output-tokens 128 --ignore-eos \
    --concurrency 16 --requests "$SERVE_REQUESTS" --warmup 2 --wait-ready 120 \
    --extra-body '{"temperature":0}' -q --json "$3" > "$out/$1.bench.log" 2>&1
  grep VmHWM "/proc/$server_pid/status" | awk '{print $2}' > "$3.hwm_kb"
  kill "$server_pid"
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
if [ -z "${SKIP_SERVE:-}" ]; then
  for r in $(seq "$RUNS"); do
    echo "serving run $r: kvx serve ..." >&2
    port=$((PORT_BASE + 2 * r))
    "$KVX" serve --model "$MODEL" --port "$port" --shards "$SHARDS" --kv-cache-bytes "$KV_BYTES" \
      > "$out/kvx_serve.$r.log" 2>&1 &
    server_pid=$!
    drive_one kvx_serve "$port" "$out/kvx_serve_one.$r.json"
    drive kvx_serve "$port" "$out/kvx_serve.$r.json"
    if [ -z "${SKIP_NO_LEND:-}" ]; then
      echo "serving run $r: kvx serve --no-lend-cores, one stream ..." >&2
      port=$((PORT_BASE + 100 + r))
      "$KVX" serve --model "$MODEL" --port "$port" --shards "$SHARDS" \
        --kv-cache-bytes "$KV_BYTES" --no-lend-cores > "$out/kvx_serve_nolend.$r.log" 2>&1 &
      server_pid=$!
      drive_one kvx_serve_nolend "$port" "$out/kvx_serve_one_nolend.$r.json"
      kill "$server_pid"
      wait "$server_pid" 2>/dev/null || true
      server_pid=""
    fi
    echo "serving run $r: llama-server ..." >&2
    port=$((PORT_BASE + 2 * r + 1))
    "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" --parallel 16 --cont-batching \
      -t "$(nproc)" -tb "$(nproc)" -c "$LLAMA_CTX" > "$out/llama_serve.$r.log" 2>&1 &
    server_pid=$!
    drive llama_serve "$port" "$out/llama_serve.$r.json"
  done
fi

python3 "$here/cpu_vs_llamacpp.py" "$out" "$RUNS" "$THREADS" "$((KV_BYTES * SHARDS))"
