#!/usr/bin/env bash
# KV tiers below the engine's pool (host memory G2, disk G3), every comparison in one go:
#
#   multiturn  `kvx bench --workload multi-turn --sessions 8 --turns 10 --input-tokens 200
#              --output-tokens 32 --concurrency 8 --think-time-ms 8000` against `kvx serve
#              --kv-cache-bytes 67108864` (G1 holds ~15% of the final working set) with no tier,
#              with `--kv-host-bytes 1073741824`, with a 16 MiB host tier and `--kv-disk`, and
#              with a 2 GiB G1 instead (the ceiling a tier can approach), alternating, RUNS
#              times: TTFT p50/p90 and the share of prompt tokens cached; ratios no-tier / tier
#              (medians of the runs).
#   identity   4 greedy chat sessions of 8 turns, sequentially, on one shard with a 48 MiB G1:
#              a 512 MiB host tier, a 2 GiB G1 (no tier), a 16 MiB host tier with a disk tier,
#              and no tier; answers (tokens, and top-5 log-probabilities) compared with the
#              first one's.
#   restart    `kvx serve --kv-disk DIR`, a 2,000-token prompt, stop, start, the same prompt:
#              cached_tokens and TTFT cold / after the restart (median of RUNS restarts).
#   rates      loads into the pool measured by the server (bytes / seconds of its onboard
#              counters) from disk (after a restart) and from host memory, against `kvx bench
#              xfer --backend file --op read` with the block's size on disk (one transfer per
#              block) and a single-thread memcpy of cold blocks of the same size; and the rate
#              of the write-through copies to host memory.
#
# Usage: bench/scripts/tiers.sh [--only SECTION[,SECTION]] [--runs N] [--out DIR]
# Environment: KVX (binary, default target/release/kvx), KVX_HOME (model store), DISK_DIR
# (where disk tiers live; default under --out), MODES (multiturn configurations to run,
# default "none host disk ceiling").
set -euo pipefail

ONLY=multiturn,identity,restart,rates RUNS=3 OUT=/tmp/kvx-tiers
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
GGUF=$("$KVX" model path smollm2-135m-instruct-q4_1)
mkdir -p "$OUT"
DISK_DIR=${DISK_DIR:-$OUT/disk}
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT
want() { [[ ",$ONLY," == *",$1,"* ]]; }
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"

# Starts `kvx serve ARGS` on an ephemeral port; sets ADDR.
serve() {
  local log=$OUT/serve.$RANDOM.log
  "$KVX" serve --port 0 --model "$GGUF" "$@" >"$log" 2>"$log.err" &
  PIDS+=($!)
  for _ in $(seq 600); do
    ADDR=$(sed -n 's#^listening on http://##p' "$log"); [ -n "$ADDR" ] && return 0; sleep 0.2
  done
  echo "kvx serve did not start: $(tail -3 "$log.err")" >&2; return 1
}

# A counter of the server at ADDR, summed over its workers (0 when absent).
metric() {
  curl -s "http://$ADDR/metrics" | awk -v m="$1" -v f="${2:-}" \
    'index($0, m) == 1 && index($0, f) { s += $NF } END { printf "%.6f\n", s + 0 }'
}

if want multiturn; then
  echo "== multiturn: 8 sessions x 10 turns, 200 + 32 tokens, think 8 s, G1 64 MiB per shard, $RUNS runs"
  MT=(--api chat --workload multi-turn --sessions 8 --turns 10 --input-tokens 200 --output-tokens 32
      --concurrency 8 --think-time-ms 8000 --tokenizer "$GGUF" --quiet)
  for r in $(seq "$RUNS"); do
    for mode in ${MODES:-none host disk ceiling}; do
      rm -rf "$DISK_DIR"
      case $mode in
        none) serve --kv-cache-bytes 67108864 ;;
        host) serve --kv-cache-bytes 67108864 --kv-host-bytes 1073741824 ;;
        disk) serve --kv-cache-bytes 67108864 --kv-host-bytes 16777216 --kv-disk "$DISK_DIR" ;;
        ceiling) serve --kv-cache-bytes 2147483648 ;;
      esac
      "$KVX" bench --url "http://$ADDR" "${MT[@]}" --seed "$r" --json "$OUT/mt-$mode-$r.json" >/dev/null
      curl -s "http://$ADDR/metrics" | grep -E '^kvx_worker_kv_(onboard|offload)_blocks_total' \
        > "$OUT/mt-$mode-$r.metrics" || true
      stop_all
    done
  done
  python3 - "$OUT" "$RUNS" ${MODES:-none host disk ceiling} <<'EOF'
import json, statistics, sys
out, runs, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def get(mode, r):
    run = json.load(open(f"{out}/mt-{mode}-{r}.json"))["runs"][0]
    t = run["tokens"]
    return {"p50": run["latency_ms"]["ttft"]["p50"], "p90": run["latency_ms"]["ttft"]["p90"],
            "cached": t.get("cache_hit_ratio") or 0.0, "errors": run["requests"].get("failed", 0)}
rows = {m: [get(m, r) for r in range(1, runs + 1)] for m in modes}
med = lambda m, k: statistics.median(x[k] for x in rows[m])
print(f"{'':10s}{'TTFT p50 ms':>13s}{'TTFT p90 ms':>13s}{'cached':>8s}{'errors':>8s}")
for m in modes:
    print(f"{m:10s}{med(m, 'p50'):13.0f}{med(m, 'p90'):13.0f}{med(m, 'cached'):8.0%}{med(m, 'errors'):8.0f}")
for m, bars in [("host", {"p50": 2.0, "p90": 3.0}), ("disk", {"p50": 1.5})]:
    if m not in modes or "none" not in modes:
        continue
    for k, bar in bars.items():
        rs = [n[k] / t[k] for n, t in zip(rows["none"], rows[m])]
        print(f"TTFT {k} no tier / {m}: {statistics.median(rs):.2f}x (runs: {', '.join(f'{x:.2f}' for x in rs)}; bar >= {bar}x)")
EOF
fi

if want identity; then
  echo "== identity: 4 greedy sessions x 8 turns on one shard, G1 48 MiB"
  rm -rf "$DISK_DIR"
  serve --shards 1 --kv-cache-bytes 50331648; A=$ADDR
  serve --shards 1 --kv-cache-bytes 50331648 --kv-host-bytes 536870912; B=$ADDR
  serve --shards 1 --kv-cache-bytes 2147483648; C=$ADDR
  serve --shards 1 --kv-cache-bytes 50331648 --kv-host-bytes 16777216 --kv-disk "$DISK_DIR"; D=$ADDR
  echo "endpoints: 0 = host 512 MiB, 1 = G1 2 GiB, 2 = host 16 MiB + disk, 3 = no tier"
  python3 "$HERE/tiers_identity.py" "http://$B" "http://$C" "http://$D" "http://$A" | tee "$OUT/identity.txt" || true
  stop_all
fi

if want restart; then
  echo "== restart: a 2,000-token prompt, cold, then after a restart with --kv-disk, $RUNS restarts"
  P=$(python3 -c 'import json; print(json.dumps([200 + (j * 104729) % 40000 for j in range(2000)]))')
  ask() {
    curl -s -w ' %{time_total}' "http://$ADDR/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"prompt\": $P, \"max_tokens\": 1, \"temperature\": 0}" |
      python3 -c 'import json,sys; b,t=sys.stdin.read().rsplit(" ",1); v=json.loads(b); print(v["usage"]["prompt_tokens_details"]["cached_tokens"], float(t)*1000, v["choices"][0]["text"])'
  }
  for r in $(seq "$RUNS"); do
    rm -rf "$DISK_DIR"
    serve --shards 1 --kv-disk "$DISK_DIR"; read -r c0 t0 x0 <<<"$(ask)"
    sleep 1; stop_all
    serve --shards 1 --kv-disk "$DISK_DIR"; read -r c1 t1 x1 <<<"$(ask)"
    stop_all
    echo "run $r: cold TTFT $t0 ms (cached $c0); after restart TTFT $t1 ms (cached $c1); cold / restarted $(python3 -c "print(f'{$t0/$t1:.1f}')")x; same token: $([ "$x0" = "$x1" ] && echo yes || echo NO)"
  done | tee "$OUT/restart.txt"
fi

if want rates; then
  echo "== rates: loads into the pool against kvx bench xfer and memcpy"
  rm -rf "$DISK_DIR"
  P=$(python3 -c 'import json; print(json.dumps([300 + (j * 7919) % 40000 for j in range(2500)]))')
  Q=$(python3 -c 'import json; print(json.dumps([300 + (j * 6151) % 40000 for j in range(2500)]))')
  ask() { curl -s -o /dev/null "http://$ADDR/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": $1, \"max_tokens\": 1, \"temperature\": 0}"; }
  # Disk: write the prompt's blocks, restart, load them (a 64 MiB pool: each 2,500-token
  # prompt pushes the other out of it, and a 64 MiB host tier cannot hold both either).
  serve --shards 1 --kv-cache-bytes 67108864 --kv-disk "$DISK_DIR"; ask "$P"; ask "$Q"; sleep 1; stop_all
  serve --shards 1 --kv-cache-bytes 67108864 --kv-disk "$DISK_DIR"
  for _ in $(seq 5); do ask "$P"; ask "$Q"; done
  DB=$(metric kvx_worker_kv_onboard_bytes_total 'tier="disk"'); DS=$(metric kvx_worker_kv_onboard_seconds_total 'tier="disk"')
  stop_all
  # Host memory: a 1 GiB host tier holds both prompts.
  serve --shards 1 --kv-cache-bytes 67108864 --kv-host-bytes 1073741824
  for _ in $(seq 6); do ask "$P"; ask "$Q"; done
  HB=$(metric kvx_worker_kv_onboard_bytes_total 'tier="host"'); HS=$(metric kvx_worker_kv_onboard_seconds_total 'tier="host"')
  OB=$(metric kvx_worker_kv_offload_bytes_total 'tier="host"'); OS=$(metric kvx_worker_kv_offload_seconds_total 'tier="host"')
  echo "write-through to host memory: $(python3 -c "print(f'{$OB/1e6:.0f} MB in {$OS*1e3:.0f} ms, {$OB/$OS/1e9:.2f} GB/s')")"
  stop_all
  BLOCK=$(python3 - "$GGUF" <<'EOF'
# Bytes of one block's keys and values on disk and in host memory (each padded to 4 KiB):
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 16 tokens x f16.
print(2 * (((30 * 3 * 64 * 16 * 2) + 4095) // 4096 * 4096))
EOF
)
  XF=$("$KVX" bench xfer --backend file --op read --block-size "$BLOCK" --blocks 4096 --inflight 1 --secs 5 --runs 3 --json |
       python3 -c 'import json,statistics,sys; print(statistics.median(json.loads(l)["gbps"] for l in sys.stdin if l.strip()))')
  cc -O2 -o "$OUT/memcpy_cold" "$HERE/../xfer/memcpy_cold.c"
  MC=$("$OUT/memcpy_cold" "$BLOCK" $((1 << 30)) 5 | sed 's/.*gbps=//')
  python3 - "$DB" "$DS" "$HB" "$HS" "$XF" "$MC" "$BLOCK" <<'EOF' | tee "$OUT/rates.txt"
import sys
db, ds, hb, hs, xf, mc, block = map(float, sys.argv[1:])
disk = db / ds / 1e9 if ds else 0.0
host = hb / hs / 1e9 if hs else 0.0
print(f"G3 -> G1 loads: {disk:.2f} GB/s ({db / 1e6:.0f} MB); kvx bench xfer --backend file --op read, {block:.0f}-byte blocks: {xf:.2f} GB/s; ratio {disk / xf:.2f} (bar >= 0.5)")
print(f"G2 -> G1 loads: {host:.2f} GB/s ({hb / 1e6:.0f} MB); single-thread memcpy of cold {block:.0f}-byte blocks: {mc:.2f} GB/s; ratio {host / mc:.2f} (bar >= 0.5)")
EOF
fi
