#!/usr/bin/env bash
# Frontend overhead: `kvx serve --engine mocker` against Dynamo 1.6.1's frontend with its
# mocker, both at `--speedup-ratio 1e9` (no simulated delay to speak of; Dynamo 1.6.1's
# documented `0 = infinite` still waits out real-time decode steps), on the same
# machine, driven by the same load generator (`kvx bench`) in the same script, alternating,
# RUNS runs each. Reports medians of:
#   * requests/s in a closed loop at --concurrency C (throughput), and their ratio;
#   * latency at concurrency 1 with a zero-latency engine, i.e. the time the serving stack adds
#     (HTTP, chat template, tokenization, routing, scheduling, detokenization, SSE, plus the
#     client's share): TTFT p50 (added before the first token), ITL p50 (added per further
#     token) and end-to-end p50/p99 of the whole --osl-token request.
#
# Dynamo runs without etcd or NATS (`--discovery-backend file --request-plane tcp
# --event-plane zmq`). Its venv is made under /tmp on first use: `ai-dynamo-runtime==1.6.1` with
# its requirements, then `ai-dynamo==1.6.1 --no-deps` plus the requirements its frontend and
# mocker import. Both servers read the model's tokenizer and chat template (no weights): kvx from
# the GGUF, Dynamo from a Hugging Face style directory made from the GGUF (gguf_hf_dir.py).
#
# Usage: bench/scripts/frontend_overhead.sh [options]
#   --runs N          runs per server (default 3)
#   --concurrency C   closed-loop concurrency of the throughput phase (default 32)
#   --requests N      requests per throughput run (default 2000)
#   --lat-requests N  requests per latency run at concurrency 1 (default 300)
#   --isl N --osl N   prompt / output tokens (default 128 / 16)
#   --api chat|completions   (default chat)
#   --no-stream       whole responses instead of SSE streams
#   --out DIR         results (default /tmp/kvx-frontend-overhead)
# Environment: KVX (binary, default target/release/kvx), MODEL (GGUF, default `kvx model path`),
#   DYN_VENV (default /tmp/dyn-venv), SERVER_CPUS (default 0), CLIENT_CPUS (default 1): servers
#   and the load generator are pinned apart with taskset.
set -euo pipefail

RUNS=3 CONC=32 REQ=2000 LAT_REQ=300 ISL=128 OSL=16 API=chat STREAM=1
OUT=/tmp/kvx-frontend-overhead
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --lat-requests) LAT_REQ=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --api) API=$2; shift 2 ;;
    --no-stream) STREAM=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KVX=${KVX:-$ROOT/target/release/kvx}
MODEL=${MODEL:-$("$KVX" model path)}
DYN_VENV=${DYN_VENV:-/tmp/dyn-venv}
SERVER_CPUS=${SERVER_CPUS:-0}
CLIENT_CPUS=${CLIENT_CPUS:-1}
KVX_PORT=${KVX_PORT:-18100}
DYN_PORT=${DYN_PORT:-18101}
NAME=smollm2
# kvx's mocker goes through the engine's real sampler (Dynamo's picks token ids directly); over
# a small vocabulary that costs microseconds per token instead of a full-vocabulary softmax.
# Requests send ignore_eos, so both servers generate exactly --osl tokens.
MOCKER_VOCAB=${MOCKER_VOCAB:-1024}

if ! "$DYN_VENV/bin/python" -c 'import dynamo.frontend, dynamo.mocker, gguf' 2>/dev/null; then
  echo "== installing Dynamo 1.6.1 into $DYN_VENV"
  python3 -m venv "$DYN_VENV"
  "$DYN_VENV/bin/pip" install -q ai-dynamo-runtime==1.6.1
  "$DYN_VENV/bin/pip" install -q ai-dynamo==1.6.1 --no-deps
  # ai-dynamo's own requirements that the frontend and mocker import (aisimulate, a
  # performance-model package fetched from another index, is not needed by either).
  "$DYN_VENV/bin/pip" install -q "aiohttp<4.0,>=3.14.3" "kubernetes<33.0.0,>=32.0.1" \
    "msgspec>=0.19.0" "prometheus-client<1.0,>=0.23.1" "pyzmq>=26.0.0" "redis<9.0.0,>=6.2.0" \
    tqdm "transformers>=4.56.0" "typing-extensions>=4.10.0" "zstandard<1.0,>=0.23.0" \
    packaging uvloop gguf
fi

rm -rf "$OUT"; mkdir -p "$OUT"
"$DYN_VENV/bin/python" "$HERE/gguf_hf_dir.py" "$MODEL" "$OUT/hf" >/dev/null
TOK="$OUT/hf/tokenizer.json"
{
  echo "kvx $("$KVX" --version) vs ai-dynamo $("$DYN_VENV/bin/pip" show ai-dynamo 2>/dev/null | awk '/^Version/{print $2}')"
  echo "model $MODEL; api $API stream $STREAM; isl $ISL osl $OSL; throughput: c=$CONC x $REQ requests; latency: c=1 x $LAT_REQ requests; $RUNS runs each"
  echo "servers on CPU $SERVER_CPUS, load generator on CPU $CLIENT_CPUS; $(nproc) CPUs; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/setup.txt"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT

wait_model() { # URL: waits until /v1/models lists a model
  for _ in $(seq 1 600); do
    if curl -sf "$1/v1/models" 2>/dev/null | grep -q '"id"'; then return 0; fi
    sleep 0.2
  done
  echo "server at $1 did not come up" >&2; return 1
}

bench() { # URL TAG
  local extra=()
  [ "$STREAM" = 1 ] || extra+=(--no-stream)
  taskset -c "$CLIENT_CPUS" "$KVX" bench --url "$1" --model "$NAME" --api "$API" \
    --tokenizer "$TOK" --input-tokens "$ISL" --output-tokens "$OSL" --ignore-eos \
    --prompts 200 --requests "$REQ" --warmup 50 --concurrency "$CONC" -q "${extra[@]}" \
    --json "$OUT/$2_tput.json" > "$OUT/$2_tput.txt"
  taskset -c "$CLIENT_CPUS" "$KVX" bench --url "$1" --model "$NAME" --api "$API" \
    --tokenizer "$TOK" --input-tokens "$ISL" --output-tokens "$OSL" --ignore-eos \
    --prompts 200 --requests "$LAT_REQ" --warmup 10 --concurrency 1 -q "${extra[@]}" \
    --json "$OUT/$2_lat.json" > "$OUT/$2_lat.txt"
}

for i in $(seq 1 "$RUNS"); do
  echo "== run $i: kvx serve (load $(cut -d' ' -f1 /proc/loadavg))"
  taskset -c "$SERVER_CPUS" "$KVX" serve --model "$MODEL" --served-model-name "$NAME" \
    --engine mocker --speedup-ratio 1e9 --mocker-vocab "$MOCKER_VOCAB" \
    --host 127.0.0.1 --port "$KVX_PORT" \
    > "$OUT/kvx_server_$i.log" 2>&1 &
  PIDS+=($!)
  wait_model "http://127.0.0.1:$KVX_PORT"
  bench "http://127.0.0.1:$KVX_PORT" "kvx_$i"
  cleanup

  echo "== run $i: dynamo frontend + mocker (load $(cut -d' ' -f1 /proc/loadavg))"
  kvdir="$OUT/dyn_kv_$i"; mkdir -p "$kvdir"
  DYN_FILE_KV="$kvdir" taskset -c "$SERVER_CPUS" "$DYN_VENV/bin/python" -m dynamo.frontend \
    --http-host 127.0.0.1 --http-port "$DYN_PORT" --discovery-backend file --request-plane tcp \
    --event-plane zmq > "$OUT/dyn_frontend_$i.log" 2>&1 &
  PIDS+=($!)
  DYN_FILE_KV="$kvdir" taskset -c "$SERVER_CPUS" "$DYN_VENV/bin/python" -m dynamo.mocker \
    --model-path "$OUT/hf" --model-name "$NAME" --speedup-ratio 1e9 --discovery-backend file \
    --request-plane tcp --event-plane zmq > "$OUT/dyn_mocker_$i.log" 2>&1 &
  PIDS+=($!)
  wait_model "http://127.0.0.1:$DYN_PORT"
  bench "http://127.0.0.1:$DYN_PORT" "dyn_$i"
  cleanup
done

python3 - "$OUT" "$RUNS" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def load(tag, i, phase):
    r = json.load(open(f"{out}/{tag}_{i}_{phase}.json"))["runs"][0]
    return r
rows = {}
for tag in ("kvx", "dyn"):
    rps, p50, p99, fails, outtok, ttft, itl = [], [], [], 0, [], [], []
    for i in range(1, runs + 1):
        t, l = load(tag, i, "tput"), load(tag, i, "lat")
        rps.append(t["throughput"]["requests_per_s"])
        outtok.append(t["throughput"]["output_tokens_per_s"])
        p50.append(l["latency_ms"]["e2e"]["p50"])
        p99.append(l["latency_ms"]["e2e"]["p99"])
        ttft.append(l["latency_ms"]["ttft"]["p50"])
        itl.append(l["latency_ms"]["itl"]["p50"])
        fails += t["requests"]["failed"] + l["requests"]["failed"]
    rows[tag] = dict(rps=statistics.median(rps), all_rps=rps, tok=statistics.median(outtok),
                     p50=statistics.median(p50), p99=statistics.median(p99), fails=fails,
                     ttft=statistics.median(ttft), itl=statistics.median(itl))
print("| server | req/s (median) | runs | output tok/s | TTFT p50 at c=1 (ms) | ITL p50 at c=1 (ms) | p50 e2e at c=1 (ms) | p99 e2e at c=1 (ms) | failed |")
print("|---|---|---|---|---|---|---|---|---|")
for tag, name in (("kvx", "kvx serve (mocker)"), ("dyn", "Dynamo 1.6.1 frontend + mocker")):
    r = rows[tag]
    print(f"| {name} | {r['rps']:.0f} | {', '.join(f'{x:.0f}' for x in r['all_rps'])} | {r['tok']:.0f} | {r['ttft']:.3f} | {r['itl']:.3f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['fails']} |")
print()
print(f"kvx / Dynamo requests/s: **{rows['kvx']['rps'] / rows['dyn']['rps']:.2f}x**; "
      f"kvx p50 added latency at c=1 (engine time ~0): **{rows['kvx']['ttft']:.3f} ms** before the "
      f"first token, {rows['kvx']['itl']:.3f} ms per further token, {rows['kvx']['p50']:.3f} ms for the "
      f"whole request (Dynamo: {rows['dyn']['ttft']:.3f} / {rows['dyn']['itl']:.3f} / {rows['dyn']['p50']:.3f} ms)")
PY
