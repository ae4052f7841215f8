#!/usr/bin/env bash
# Disaggregated prefill and decode, every comparison in one go:
#
#   identity     20 greedy prompts of 50 to 3,000 tokens (token ids, top-5 log-probabilities)
#                through `kvx serve --prefill-shards 1 --decode-shards 1 --disagg-min-tokens 0`
#                and aggregated `kvx serve --shards 2`: identical or not, prompt by prompt.
#   interference 8 streams decoding 384 tokens (64-token prompts) while 1,500-token prompts
#                arrive at three quarters of one core's prefill rate (every 4 s on the 2-vCPU
#                Xeon the bar was set on; `--burst-interval auto` measures this machine's rate
#                with `kvx bench engine --threads 1 --pp 1500`, or give seconds)
#                (`kvx bench --workload mixed`), 1 prefill + 1 decode shard (with kvx's
#                default `--disagg-min-tokens 256` the decode shard computes the streams' own
#                64-token prompts; `--disagg-min-tokens 0` sends every prompt to the prefill shard)
#                against 2 aggregated shards, alternating, RUNS times: the streams' ITL p99
#                (ratio aggregated / disaggregated), output tok/s (disaggregated / aggregated),
#                TTFT p50/p90 of both classes. Medians of the runs.
#   hosts        frontend, prefill worker and decode worker in three network namespaces on a
#                bridge (needs root): the KV over TCP; the identity prompts (first 8) against
#                aggregated serve; the per-request KV transfer rate against
#                `kvx bench xfer --backend tcp` between the same two namespaces, same block size
#                (one KV block's keys or values), one transfer in flight.
#   fleet        8 prefill + 24 decode mock workers against 32 aggregated mock workers
#                (`kvx worker --engine mocker`, Dynamo's timing model at speedup 1, modelled
#                KV transfers; block size 16, 16,384 blocks, 256 sequences and 8,192 tokens
#                per step), ISL 3,000 / OSL 150, Poisson at 1, 2 and 4 req/s, 1,000 distinct
#                prompts, seed = rate index: TTFT and ITL percentiles. With DYNAMO=1 the same
#                workload on Dynamo 1.6.1's mocker (bench/scripts/dynamo_disagg_fleet.sh).
#
# Usage: bench/scripts/disagg.sh [--only SECTION[,SECTION]] [--runs N] [--secs S] [--out DIR]
#                                [--burst-interval S|auto] [--disagg-min-tokens N]
# Environment: KVX (binary, default target/release/kvx), KVX_HOME (model store).
set -euo pipefail

ONLY=identity,interference,hosts,fleet RUNS=3 SECS=120 OUT=/tmp/kvx-disagg BURST=auto MIN_TOKENS=256
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --secs) SECS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --burst-interval) BURST=$2; shift 2 ;;
    --disagg-min-tokens) MIN_TOKENS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
GGUF=$("$KVX" model path smollm2-135m-instruct-q4_1)
mkdir -p "$OUT"
PIDS=()
NETNS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
cleanup() {
  stop_all
  for n in "${NETNS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del kxdm 2>/dev/null || true
}
trap cleanup EXIT
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

if want identity; then
  echo "== identity: 20 prompts of 50 to 3,000 tokens"
  serve --engine model --shards 2; AGG=$ADDR
  serve --engine model --prefill-shards 1 --decode-shards 1 --disagg-min-tokens 0; DIS=$ADDR
  python3 "$HERE/disagg_identity.py" "http://$AGG" "http://$DIS" --prompts 20 | tee "$OUT/identity.txt"
  curl -s "http://$DIS/metrics" | grep -E '^kvx_router_(disagg_remote|disagg_fallbacks|kv_transfer)' || true
  stop_all
fi

if want interference; then
  if [ "$BURST" = auto ]; then
    PP=$("$KVX" bench engine --model "$GGUF" --threads 1 --pp 1500 --tg 0 --reps 3 --json 2>/dev/null \
         | python3 -c 'import json, sys; print(json.load(sys.stdin)["pp_tok_s"])')
    BURST=$(python3 -c "print(round(1500 / (0.75 * $PP), 2))")
    echo "one core prefills 1,500 tokens at $(printf %.0f "$PP") tok/s: a prompt every $BURST s is three quarters of it"
  fi
  echo "== interference: 8 streams 64->384 tokens, a 1,500-token prompt every $BURST s, $SECS s, $RUNS runs"
  MIXED=(--api completions --workload mixed --streams 8 --input-tokens 64 --output-tokens 384
         --ignore-eos --burst-input-tokens 1500 --burst-output-tokens 16 --burst-interval "$BURST"
         --duration "$SECS" --tokenizer "$GGUF" --quiet)
  for r in $(seq "$RUNS"); do
    for mode in agg disagg; do
      if [ $mode = agg ]; then serve --engine model --shards 2
      else serve --engine model --prefill-shards 1 --decode-shards 1 --disagg-min-tokens "$MIN_TOKENS"; fi
      "$KVX" bench --url "http://$ADDR" "${MIXED[@]}" --seed "$r" --json "$OUT/mixed-$mode-$r.json" >/dev/null
      stop_all
    done
  done
  python3 - "$OUT" "$RUNS" <<'EOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def get(mode, r):
    run = json.load(open(f"{out}/mixed-{mode}-{r}.json"))["runs"][0]
    s, b = run["classes"]["stream"], run["classes"]["burst"]
    return {"itl_p99": s["latency_ms"]["itl"]["p99"], "itl_p50": s["latency_ms"]["itl"]["p50"],
            "tok_s": run["throughput"]["output_tokens_per_s"],
            "stream_ttft_p50": s["latency_ms"]["ttft"]["p50"], "stream_ttft_p90": s["latency_ms"]["ttft"]["p90"],
            "burst_ttft_p50": b["latency_ms"]["ttft"]["p50"], "burst_ttft_p90": b["latency_ms"]["ttft"]["p90"],
            "bursts": b["requests"]["completed"]}
rows = {m: [get(m, r) for r in range(1, runs + 1)] for m in ("agg", "disagg")}
med = lambda m, k: statistics.median(x[k] for x in rows[m])
print(f"{'':22s}{'aggregated':>12s}{'disaggregated':>15s}")
for k in ["itl_p50", "itl_p99", "tok_s", "stream_ttft_p50", "stream_ttft_p90", "burst_ttft_p50", "burst_ttft_p90", "bursts"]:
    print(f"{k:22s}{med('agg', k):12.1f}{med('disagg', k):15.1f}")
ratios = [a["itl_p99"] / d["itl_p99"] for a, d in zip(rows["agg"], rows["disagg"])]
tput = [d["tok_s"] / a["tok_s"] for a, d in zip(rows["agg"], rows["disagg"])]
print(f"stream ITL p99 aggregated / disaggregated: {statistics.median(ratios):.2f}x (runs: {', '.join(f'{x:.2f}' for x in ratios)}; bar >= 3x)")
print(f"output tok/s disaggregated / aggregated: {statistics.median(tput):.2f}x (runs: {', '.join(f'{x:.2f}' for x in tput)}; bar >= 0.7x)")
EOF
fi

if want hosts; then
  echo "== hosts: three network namespaces, KV over TCP"
  NET=10.79.1
  ip netns add kxdhub; NETNS+=(kxdhub)
  ip -n kxdhub link add br0 type bridge; ip -n kxdhub link set br0 up
  ip link add kxdm type veth peer name kxdmb; ip link set kxdmb netns kxdhub
  ip -n kxdhub link set kxdmb master br0 up; ip addr add $NET.254/24 dev kxdm; ip link set kxdm up
  for i in 1 2 3; do
    ip netns add kxd$i; NETNS+=(kxd$i)
    ip link add kxdv$i type veth peer name kxdb$i
    ip link set kxdv$i netns kxd$i; ip link set kxdb$i netns kxdhub
    ip -n kxdhub link set kxdb$i master br0 up
    ip -n kxd$i addr add $NET.$i/24 dev kxdv$i; ip -n kxd$i link set kxdv$i up; ip -n kxd$i link set lo up
  done
  serve --engine model --shards 1; AGG=$ADDR
  FLOG=$OUT/hosts-frontend.log
  ip netns exec kxd1 "$KVX" frontend --host $NET.1 --port 0 --worker-listen $NET.1:7100 --model "$GGUF" \
    --disagg-min-tokens 0 >"$FLOG" 2>"$FLOG.err" & PIDS+=($!)
  for _ in $(seq 100); do grep -q "^listening on" "$FLOG" && break; sleep 0.2; done
  FE=$(sed -n 's#^listening on http://##p' "$FLOG")
  # A small decode pool, so that its blocks are reused (resident) after the warm-up.
  ip netns exec kxd3 "$KVX" worker --role decode --frontend $NET.1:7100 --model "$GGUF" --worker-id 300 \
    --kv-listen $NET.3:0 --kv-cache-bytes 400000000 >"$OUT/hosts-decode.log" 2>&1 & PIDS+=($!)
  ip netns exec kxd2 "$KVX" worker --role prefill --frontend $NET.1:7100 --model "$GGUF" --worker-id 200 \
    --kv-listen $NET.2:0 >"$OUT/hosts-prefill.log" 2>&1 & PIDS+=($!)
  for _ in $(seq 300); do
    [ "$(curl -s "http://$FE/metrics" | sed -n 's/^kvx_router_plane_workers //p')" = 2 ] && break; sleep 0.2
  done
  python3 "$HERE/disagg_identity.py" "http://$AGG" "http://$FE" --prompts 8 | tail -1
  metric() { curl -s "http://$FE/metrics" | sed -n "s/^kvx_router_$1 //p"; }
  python3 - "$FE" <<'EOF'
import json, sys, urllib.request
fe = sys.argv[1]
def metric(n):
    t = urllib.request.urlopen(f"http://{fe}/metrics").read().decode()
    return next(float(l.split()[-1]) for l in t.splitlines() if l.startswith("kvx_router_" + n + " "))
def comp(p):
    body = json.dumps({"prompt": p, "max_tokens": 1, "temperature": 0}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{fe}/v1/completions", body, {"Content-Type": "application/json"})).read()
# Warm the decode pool (fills its 400 MB once), then measure 12 prompts of 1,500 tokens.
for i in range(24):
    comp([400 + (i * 7919 + j * 104729) % 40000 for j in range(1500)])
b0, s0, n0 = metric("kv_transfer_bytes_total"), metric("kv_transfer_seconds_sum"), metric("kv_transfers_total")
for i in range(12):
    comp([500 + (i * 6101 + j * 104729) % 40000 for j in range(1500)])
b, s, n = metric("kv_transfer_bytes_total") - b0, metric("kv_transfer_seconds_sum") - s0, metric("kv_transfers_total") - n0
print(f"kvx: {n:.0f} requests, {b/n/1e6:.1f} MB each, mean transfer {s/n*1e3:.1f} ms: {b/s/1e9:.2f} GB/s per request")
open("/tmp/kvx-disagg-rate", "w").write(str(b / s / 1e9))
EOF
  stop_all
  # The link alone: kvx bench xfer between the same namespaces, 184,320-byte blocks
  # (one KV block's keys or values: 30 layers x 3 KV heads x 64 dims x 16 tokens x f16),
  # 188 blocks per transfer (a 1,500-token prompt's keys and values), one in flight.
  ip netns exec kxd3 "$KVX" bench xfer --backend tcp --serve-peer --listen $NET.3:7300 --block-size 184320 \
    --blocks 4096 < <(sleep 60) >"$OUT/xfer-peer.log" 2>&1 & PIDS+=($!)
  sleep 1
  ip netns exec kxd2 "$KVX" bench xfer --backend tcp --peer "@$OUT/xfer-peer.log" --block-size 184320 --blocks 4096 \
    --batch 188 --inflight 1 --secs 5 --runs 3 --json | tee "$OUT/xfer.json"
  python3 - "$OUT/xfer.json" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
key = next(k for k in ("gb_per_s", "gbps", "bandwidth_gb_s", "GB/s") if k in runs[0])
bw = statistics.median(r[key] for r in runs)
kvx = float(open("/tmp/kvx-disagg-rate").read())
print(f"kvx bench xfer tcp: {bw:.2f} GB/s; kvx per-request KV transfer: {kvx:.2f} GB/s = {kvx / bw:.2f}x (bar >= 0.5x)")
EOF
  stop_all
fi

if want fleet; then
  echo "== fleet: 8 prefill + 24 decode mock workers vs 32 aggregated, ISL 3,000 / OSL 150"
  MOCK=(--engine mocker --mocker-vocab 49152 --mocker-blocks 16384 --block-size 16
        --max-num-seqs 256 --max-batched-tokens 8192)
  for mode in agg disagg; do
    seed=0
    for rate in 1 2 4; do
      seed=$((seed + 1))
      FLOG=$OUT/fleet-frontend.log
      "$KVX" frontend --port 0 --worker-listen 127.0.0.1:0 --model "$GGUF" >"$FLOG" 2>"$FLOG.err" & PIDS+=($!)
      for _ in $(seq 100); do grep -q "^listening on" "$FLOG" && break; sleep 0.1; done
      W=$(sed -n 's/^workers join at //p' "$FLOG"); FE=$(sed -n 's#^listening on http://##p' "$FLOG")
      if [ $mode = disagg ]; then
        "$KVX" worker --role prefill --frontend "$W" --shards 8 --worker-id 1000 "${MOCK[@]}" >/dev/null 2>&1 & PIDS+=($!)
        "$KVX" worker --role decode --frontend "$W" --shards 24 --worker-id 2000 "${MOCK[@]}" >/dev/null 2>&1 & PIDS+=($!)
      else
        "$KVX" worker --frontend "$W" --shards 32 --worker-id 3000 "${MOCK[@]}" >/dev/null 2>&1 & PIDS+=($!)
      fi
      for _ in $(seq 300); do
        [ "$(curl -s "http://$FE/metrics" | sed -n 's/^kvx_router_plane_workers //p')" = 32 ] && break; sleep 0.2
      done
      "$KVX" bench --url "http://$FE" --api completions --input-tokens 3000 --output-tokens 150 --ignore-eos \
        --prompts 1000 --seed $seed --request-rate $rate --duration 30 \
        --json "$OUT/fleet-$mode-$rate.json" --quiet >/dev/null
      stop_all
    done
  done
  python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'':10s}{'rate':>5s}{'TTFT p50':>10s}{'p90':>8s}{'p99':>8s}{'ITL p50':>9s}{'p90':>7s}{'p99':>7s}{'tok/s':>8s}")
for mode in ("agg", "disagg"):
    for rate in (1, 2, 4):
        r = json.load(open(f"{out}/fleet-{mode}-{rate}.json"))["runs"][0]
        t, i = r["latency_ms"]["ttft"], r["latency_ms"]["itl"]
        print(f"{mode:10s}{rate:5d}{t['p50']:10.1f}{t['p90']:8.1f}{t['p99']:8.1f}{i['p50']:9.2f}{i['p90']:7.2f}{i['p99']:7.2f}{r['throughput']['output_tokens_per_s']:8.1f}")
EOF
  if [ "${DYNAMO:-0}" = 1 ]; then
    OUT=$OUT/dynamo KVX=$KVX "$HERE/dynamo_disagg_fleet.sh"
  fi
fi
