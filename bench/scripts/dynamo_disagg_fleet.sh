#!/usr/bin/env bash
# Fleet benchmark of NVIDIA Dynamo 1.6.1's mocker engine, aggregated vs disaggregated, driven
# by kvx's load generator, on one machine without GPU, etcd or NATS:
#
#   agg     Dynamo frontend (router kv) + one `python -m dynamo.mocker --num-workers 32`
#           (32 aggregated mock workers)
#   disagg  Dynamo frontend (router kv; the frontend activates its prefill router when it
#           discovers the prefill worker set) + `dynamo.mocker --disaggregation-mode prefill
#           --num-workers 8` + `dynamo.mocker --disaggregation-mode decode --num-workers 24`
#
# Planes: file discovery (DYN_FILE_KV, a fresh directory per configuration), TCP request
# plane, ZMQ event plane -- no etcd, no NATS. Every mock worker: block size 16, 16384 KV
# blocks, max-num-seqs 256, max-num-batched-tokens 8192, speedup 1, prefix caching and chunked
# prefill on (Dynamo defaults), polynomial timing model (default), engine type vllm (default).
# Disaggregated (`disagg`): no --bootstrap-ports, so the frontend runs the prefill on a
# prefill worker and then hands the request to a decode worker (synchronous prefill path).
# Optional third configuration `disagg-bs` (CONFIGS="agg disagg disagg-bs"): the same fleet
# with --bootstrap-ports on the prefill workers (one free loopback port each), the
# bootstrap-rendezvous path (the router picks the decode worker while the prefill is still
# running -- a few ms after the prefill pick in the frontend's log -- and the two workers
# meet over the prefill worker's bootstrap port). In both, the mocker simulates the KV transfer with its default bandwidth and kv_bytes_per_token computed from
# the model's config.json (SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 x bf16 = 23,040 B).
#
# Workload: `kvx bench` synthetic, completions API, streaming, ISL 3000 / OSL 150 with
# ignore_eos, open loop Poisson at each rate in RATES for DURATION s, word tokenizer (kvx's
# default; Dynamo's SmolLM2 tokenizer counts ~3006 prompt tokens per 3000-word prompt, see
# the table's "prompt tok/req" column), PROMPTS distinct prompts per level so that
# no prompt repeats (no prefix-cache hits), seed = level index (the same prompts and arrival
# times for both configurations). Servers are started fresh per configuration and kept across
# its rates.
#
# Output: $OUT/<config>-<rate>.json (kvx-bench/1 reports, bench/SCHEMA.md), .txt (bench's
# table), .meta.json (server CPU, load, router admissions), logs/, summary.md (the table).
#
# Usage: dynamo_fleet.sh            (environment overrides below)
#   OUT (/tmp/dyn-disagg/fleet)  RATES ("1 2 4")  DURATION (30)  CONFIGS ("agg disagg")
#   AGG_WORKERS (32)  PREFILL_WORKERS (8)  DECODE_WORKERS (24)  PROMPTS (1000)
#   BLOCK (16)  BLOCKS (16384)  MAX_SEQS (256)  MAX_BATCHED (8192)  SPEEDUP (1)   per mock worker;
#   kvx worker's own defaults are max-num-seqs 64 / max-batched-tokens 512
#   DYNPY (python with ai-dynamo 1.6.1; default /tmp/dyn-planes-venv/bin/python if present,
#          else /tmp/dyn-disagg/venv/bin/python, created with the commands below if missing)
#   KVX (target/release/kvx)  KVX_HOME (.kvx/home)  HF (/tmp/dyn-disagg/hf)
#   DYN_LOG (Dynamo's log filter, default warn: per-request info logging off)
# Dynamo is installed with: python3 -m venv V && V/bin/pip install ai-dynamo-runtime==1.6.1 &&
#   V/bin/pip install --no-deps ai-dynamo==1.6.1 && V/bin/pip install pyyaml transformers
#   msgspec pyzmq aiohttp prometheus-client kubernetes redis zstandard tqdm gguf
set -euo pipefail

OUT=${OUT:-/tmp/dyn-disagg/fleet}
RATES=${RATES:-"1 2 4"}
DURATION=${DURATION:-30}
CONFIGS=${CONFIGS:-"agg disagg"}
AGG_WORKERS=${AGG_WORKERS:-32}
PREFILL_WORKERS=${PREFILL_WORKERS:-8}
DECODE_WORKERS=${DECODE_WORKERS:-24}
PROMPTS=${PROMPTS:-1000}
ISL=3000 OSL=150
BLOCK=${BLOCK:-16} BLOCKS=${BLOCKS:-16384} MAX_SEQS=${MAX_SEQS:-256} MAX_BATCHED=${MAX_BATCHED:-8192} SPEEDUP=${SPEEDUP:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
export KVX_HOME=${KVX_HOME:-$HERE/../../.kvx/home}
HF=${HF:-/tmp/dyn-disagg/hf}
NAME=smollm2-135m-instruct-q4_1
export DYN_LOG=${DYN_LOG:-warn}
HFSCRIPT=$HERE/gguf_hf_dir.py

if [ -z "${DYNPY:-}" ]; then
  if [ -x /tmp/dyn-planes-venv/bin/python ]; then DYNPY=/tmp/dyn-planes-venv/bin/python
  else DYNPY=/tmp/dyn-disagg/venv/bin/python; fi
fi
if ! "$DYNPY" -c 'import dynamo.mocker, dynamo.frontend' 2>/dev/null; then
  V=$(dirname "$(dirname "$DYNPY")")
  echo "installing ai-dynamo 1.6.1 into $V"
  python3 -m venv "$V"
  "$V/bin/pip" install -q ai-dynamo-runtime==1.6.1
  "$V/bin/pip" install -q --no-deps ai-dynamo==1.6.1
  "$V/bin/pip" install -q pyyaml transformers msgspec pyzmq aiohttp prometheus-client \
    kubernetes redis zstandard tqdm gguf
fi

rm -rf "$OUT"; mkdir -p "$OUT/logs"
PIDS=()

stop_all() {
  local p alive
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 60); do   # graceful shutdown takes ~1-3 s; SIGKILL after 15 s
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.25
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits until GET $1 answers and its body contains $2; fails early if a server died.
wait_http() {
  for _ in $(seq 1 600); do
    if curl -sf "$1" 2>/dev/null | grep -q "$2"; then return 0; fi
    for p in "${PIDS[@]}"; do
      kill -0 "$p" 2>/dev/null || { echo "server pid $p exited; see $OUT/logs" >&2; return 1; }
    done
    sleep 0.2
  done
  echo "timed out waiting for $1 to show '$2'" >&2; return 1
}

# Waits until the frontend's router has registered $2 workers (all types together).
wait_workers() {
  local n=0
  for _ in $(seq 1 600); do
    n=$(curl -sf "$1/metrics" 2>/dev/null | grep -c '^dynamo_component_router_worker_registered{' || true)
    [ "$n" -ge "$2" ] && return 0
    sleep 0.2
  done
  echo "timed out: router sees $n of $2 workers" >&2; return 1
}

cpu_ticks() { # summed utime+stime of the servers, clock ticks
  local t=0 p f
  for p in "${PIDS[@]}"; do
    f=$(cut -d' ' -f14,15 "/proc/$p/stat" 2>/dev/null) || continue
    t=$((t + ${f% *} + ${f#* }))
  done
  echo $t
}

admissions() { # "prefill decode" requests the frontend's router admitted so far
  curl -sf "$1/metrics" 2>/dev/null | awk '
    /^dynamo_frontend_router_admission_received_total\{/ {
      if ($0 ~ /worker_type="prefill"/) p += $NF; else d += $NF }
    END { printf "%d %d\n", p, d }'
}

MOCK=(--model-path "$HF" --model-name "$NAME" --num-gpu-blocks-override "$BLOCKS"
  --block-size "$BLOCK" --max-num-seqs "$MAX_SEQS" --max-num-batched-tokens "$MAX_BATCHED"
  --speedup-ratio "$SPEEDUP")
PLANES=(--discovery-backend file --request-plane tcp --event-plane zmq)

start_fleet() { # config -> sets URL (not in a subshell: PIDS must stay in this shell)
  local cfg=$1 port
  port=$(free_port)
  export DYN_FILE_KV="$OUT/store-$cfg"
  rm -rf "$DYN_FILE_KV"; mkdir -p "$DYN_FILE_KV"
  "$DYNPY" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$port" --router-mode kv \
    --kv-cache-block-size "$BLOCK" "${PLANES[@]}" > "$OUT/logs/$cfg.frontend.log" 2>&1 &
  PIDS+=($!)
  if [ "$cfg" = agg ]; then
    "$DYNPY" -m dynamo.mocker "${MOCK[@]}" "${PLANES[@]}" --num-workers "$AGG_WORKERS" \
      > "$OUT/logs/$cfg.mocker.log" 2>&1 &
    PIDS+=($!)
  else
    local bs=()
    if [ "$cfg" = disagg-bs ]; then
      local ports=() _i
      for _i in $(seq 1 "$PREFILL_WORKERS"); do ports+=("$(free_port)"); done
      bs=(--bootstrap-ports "$(IFS=,; echo "${ports[*]}")")
    fi
    "$DYNPY" -m dynamo.mocker "${MOCK[@]}" "${PLANES[@]}" --disaggregation-mode prefill \
      --num-workers "$PREFILL_WORKERS" "${bs[@]}" > "$OUT/logs/$cfg.prefill.log" 2>&1 &
    PIDS+=($!)
    "$DYNPY" -m dynamo.mocker "${MOCK[@]}" "${PLANES[@]}" --disaggregation-mode decode \
      --num-workers "$DECODE_WORKERS" > "$OUT/logs/$cfg.decode.log" 2>&1 &
    PIDS+=($!)
  fi
  URL="http://127.0.0.1:$port"
}

{
  echo "kvx $("$KVX" --version)"
  "$DYNPY" -c 'import importlib.metadata as m; print("ai-dynamo", m.version("ai-dynamo"), "ai-dynamo-runtime", m.version("ai-dynamo-runtime"))'
  echo "machine: $(nproc) cores, $(grep MemTotal /proc/meminfo | tr -s ' ')"
  echo "workload: synthetic ISL $ISL / OSL $OSL ignore_eos, completions, Poisson rates: $RATES, ${DURATION}s each"
  echo "agg: $AGG_WORKERS workers; disagg: $PREFILL_WORKERS prefill + $DECODE_WORKERS decode;" \
    "each: block $BLOCK, $BLOCKS blocks, max-num-seqs $MAX_SEQS, max-num-batched-tokens $MAX_BATCHED, speedup $SPEEDUP"
} | tee "$OUT/setup.txt"

if [ ! -f "$HF/config.json" ] || [ ! -f "$HF/tokenizer.json" ]; then
  "$DYNPY" "$HFSCRIPT" "$("$KVX" model path "$NAME")" "$HF"
fi

CLK=$(getconf CLK_TCK)
for cfg in $CONFIGS; do
  case $cfg in
    agg) want=$AGG_WORKERS ;;
    disagg|disagg-bs) want=$((PREFILL_WORKERS + DECODE_WORKERS)) ;;
    *) echo "unknown config $cfg" >&2; exit 2 ;;
  esac
  echo "== $cfg: starting"
  t0=$(date +%s.%N)
  start_fleet "$cfg"
  wait_http "$URL/v1/models" "$NAME"
  wait_workers "$URL" "$want"
  sleep 2   # let discovery settle (decode/prefill pairing, event subscriptions)
  awk -v a="$t0" -v b="$(date +%s.%N)" -v n="$want" 'BEGIN { printf "   ready in %.1f s, %d workers registered\n", b - a, n }'
  i=0
  for rate in $RATES; do
    i=$((i + 1))
    tag="$cfg-$rate"
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    read -r p0 d0 < <(admissions "$URL")
    c0=$(cpu_ticks); w0=$(date +%s.%N)
    echo "== $cfg at $rate req/s (load $load)"
    "$KVX" bench --url "$URL" --api completions --input-tokens "$ISL" --output-tokens "$OSL" \
      --ignore-eos --request-rate "$rate" --duration "$DURATION" --prompts "$PROMPTS" \
      --seed "$i" --json "$OUT/$tag.json" --quiet > "$OUT/$tag.txt" 2>&1 \
      || { echo "kvx bench failed, see $OUT/$tag.txt" >&2; tail -n 5 "$OUT/$tag.txt" >&2; }
    c1=$(cpu_ticks); w1=$(date +%s.%N)
    read -r p1 d1 < <(admissions "$URL")
    curl -sf "$URL/metrics" > "$OUT/$tag.metrics" || true
    python3 - "$OUT/$tag.meta.json" <<EOF
import json, sys
json.dump({"config": "$cfg", "rate": $rate, "load_before": "$load",
           "server_cpu_s": ($c1 - $c0) / $CLK, "wall_s": $w1 - $w0,
           "admitted_prefill": $p1 - $p0, "admitted_decode": $d1 - $d0}, open(sys.argv[1], "w"))
EOF
    grep -E "ok,|TTFT|ITL|throughput" "$OUT/$tag.txt" | sed 's/^/   /' || true
    sleep 3
  done
  stop_all
  rm -rf "$OUT/store-$cfg"
done

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, sys
out = sys.argv[1]
rows = []
for meta_path in glob.glob(os.path.join(out, "*.meta.json")):
    meta = json.load(open(meta_path))
    rep_path = meta_path[: -len(".meta.json")] + ".json"
    if not os.path.exists(rep_path):
        rows.append((meta["config"], meta["rate"], None, meta)); continue
    rows.append((meta["config"], meta["rate"], json.load(open(rep_path))["runs"][0], meta))
order = {"agg": 0, "disagg": 1, "disagg-bs": 2}
rows.sort(key=lambda r: (order.get(r[0], 9), r[1]))
print("| config | req/s | ok/sent | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 "
      "| out tok/s | prompt tok/req (server) | cached | routed prefill/decode | server CPU | load before |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for cfg, rate, run, meta in rows:
    cpu = 100 * meta["server_cpu_s"] / meta["wall_s"]
    routed = f'{meta["admitted_prefill"]}/{meta["admitted_decode"]}'
    if run is None:
        print(f"| {cfg} | {rate:g} | failed | | | | | | | | | | {routed} | {cpu:.0f}% | {meta['load_before']} |"); continue
    t, l, rq, tok = run["latency_ms"]["ttft"], run["latency_ms"]["itl"], run["requests"], run["tokens"]
    spt = tok.get("server_prompt_total")
    ppr = f"{spt / rq['completed']:.0f}" if spt and rq["completed"] else "-"
    cached = f'{100 * (tok.get("cache_hit_ratio") or 0):.1f}%'
    f = lambda s, k: f"{s[k]:.1f}" if s.get(k) is not None else "-"
    print(f"| {cfg} | {rate:g} | {rq['completed']}/{rq['sent']} | {f(t,'p50')} | {f(t,'p90')} | {f(t,'p99')} "
          f"| {f(l,'p50')} | {f(l,'p90')} | {f(l,'p99')} | {run['throughput']['output_tokens_per_s']:.1f} "
          f"| {ppr} | {cached} | {routed} | {cpu:.0f}% | {meta['load_before']} |")
print()
print("Latencies in ms (kvx bench: TTFT to the first text chunk, ITL every gap between text chunks).")
print("routed prefill/decode: requests the frontend's router admitted to prefill / decode (or aggregated)")
print("workers during the level (dynamo_frontend_router_admission_received_total). server CPU: CPU time of")
print("the frontend and mocker processes over the level's wall time (100% = one core of 2).")
EOF
