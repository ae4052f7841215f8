#!/usr/bin/env bash
# NVIDIA's aiperf (PyPI `aiperf`) against `kvx serve`: starts the server, runs one
# `aiperf profile` per endpoint (chat and completions, streaming), and fails unless every
# request succeeded. Prints request counts, errors, TTFT / ITL / throughput.
#
# Usage: bench/scripts/aiperf_kvx.sh [options]
#   --engine model|mocker   what computes tokens (default model)
#   --requests N            requests per profile (default 40)
#   --concurrency C         (default 4)
#   --isl N --osl N         prompt / output tokens (default 128 / 32)
#   --out DIR               artifacts (default /tmp/kvx-aiperf)
# Environment: KVX (binary, default target/release/kvx), MODEL (GGUF, default `kvx model path`),
#   AIPERF_VENV (default /tmp/aiperf-venv; made with `pip install aiperf gguf` when it lacks
#   aiperf), SERVER_CPUS / CLIENT_CPUS (taskset lists; default: no pinning), PORT (18110).
set -euo pipefail

ENGINE=model REQ=40 CONC=4 ISL=128 OSL=32 OUT=/tmp/kvx-aiperf
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KVX=${KVX:-$ROOT/target/release/kvx}
MODEL=${MODEL:-$("$KVX" model path)}
VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
PORT=${PORT:-18110}
URL=http://127.0.0.1:$PORT
SPIN=() CPIN=()
[ -n "${SERVER_CPUS:-}" ] && SPIN=(taskset -c "$SERVER_CPUS")
[ -n "${CLIENT_CPUS:-}" ] && CPIN=(taskset -c "$CLIENT_CPUS")

if ! "$VENV/bin/python" -c 'import aiperf, gguf, tokenizers' 2>/dev/null; then
  echo "== installing aiperf into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q aiperf gguf
fi
rm -rf "$OUT"; mkdir -p "$OUT"
"$VENV/bin/python" "$HERE/gguf_hf_dir.py" "$MODEL" "$OUT/hf" >/dev/null

"${SPIN[@]}" "$KVX" serve --model "$MODEL" --engine "$ENGINE" --speedup-ratio 1 \
  --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "$URL/v1/models" >/dev/null 2>&1 && break
  sleep 0.2
done
NAME=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "kvx serve ($ENGINE) $NAME at $URL; aiperf $("$VENV/bin/pip" show aiperf | awk '/^Version/{print $2}'); isl $ISL osl $OSL, $REQ requests at concurrency $CONC" | tee "$OUT/setup.txt"

status=0
for ep in chat completions; do
  echo "== aiperf profile --endpoint-type $ep --streaming"
  "${CPIN[@]}" "$VENV/bin/aiperf" profile --model "$NAME" --url "$URL" --endpoint-type "$ep" \
    --streaming --tokenizer "$OUT/hf" --isl "$ISL" --isl-stddev 0 --osl "$OSL" --osl-stddev 0 \
    --request-count "$REQ" --warmup-request-count 2 --concurrency "$CONC" --random-seed 1 \
    --ui none --workers-max "$CONC" --record-processors 1 \
    --output-artifact-dir "$OUT/$ep" > "$OUT/$ep.txt" 2>&1 || status=1
  python3 - "$OUT/$ep/profile_export_aiperf.json" "$REQ" <<'PY' || status=1
import json, sys
d = json.load(open(sys.argv[1]))
want = int(sys.argv[2])
n = d["request_count"]["avg"]
errs = d.get("error_summary") or []
rate = d.get("request_error_rate", {}).get("avg", 0.0)
m = lambda k, s="avg": d.get(k, {}).get(s, float("nan"))
print(f"requests {n:.0f}/{want}, errors {len(errs)} (error rate {rate}%), "
      f"TTFT p50 {m('time_to_first_token', 'p50'):.1f} ms, ITL p50 {m('inter_token_latency', 'p50'):.2f} ms, "
      f"{m('request_throughput'):.2f} req/s, {m('output_token_throughput'):.1f} output tok/s")
if errs or rate or n != want:
    print("FAILED:", json.dumps(errs)[:2000])
    sys.exit(1)
PY
done
exit $status
