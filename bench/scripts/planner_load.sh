#!/usr/bin/env bash
# The SLA planner against load that moves, and the smallest static fleet that meets the
# targets at peak, in one go:
#
#   profile  `kvx profile --engine mocker` of a mock worker (Dynamo's timing model at speedup
#            1, 1,024 KV blocks of 16 tokens, 256 sequences and 8,192 tokens per step).
#   trace    Poisson arrivals whose rate ramps 1 -> 16 req/s, falls to 2, then follows a sine
#            (9 +- 7 req/s), ISL 2,000 / OSL 200, no shared prefixes; 600 s at --scale 1.
#   planner  `kvx frontend` + `kvx planner --connector local` (1..32 workers per pool, targets
#            TTFT p90 <= 500 ms and ITL p90 <= 50 ms, --interval seconds per decision) while
#            `kvx bench` replays the trace.
#   peak     the smallest static fleet (prefill + decode mock workers) that meets both targets
#            at the peak rate (16 req/s for --peak-secs): from the planner's largest pools, the
#            fewest decode workers that hold the targets (doubling, then bisection), then the
#            fewest prefill workers. --static P+D takes a fleet found so by an earlier run
#            instead of searching again.
#   static   that fleet under the same trace, the planner only observing (its pools fixed).
#
# Per interval the targets are judged on the frontend's own TTFT and ITL histograms (the p90
# of that interval, as the planner observes them); the first two intervals are not judged.
# Worker-seconds: each interval's running workers x its length (planner), the fleet's size x
# the trace's length (static). The bound: the worker-seconds of a planner that knew each
# interval's highest rate beforehand and sized both pools for it by the planner's own model
# (the profile's prefill rate at rho <= 1 - TTFT/target; decode slots with at most 10% of
# requests waiting, Erlang C). Writes $OUT/report.html (replicas and load over time, SVG).
#
# Usage: bench/scripts/planner_load.sh [--out DIR] [--interval S] [--cooldown S]
#          [--lookahead N] [--predictor P] [--scale F] [--peak-secs S] [--static P+D]
#          [--skip-static-run] [--load-based]
# --load-based runs the planner without the profile: pools sized from the workers' step
# times alone (the peak search and the bound still use the profile).
# --skip-static-run (with --static) leaves out the static fleet's replay: its worker-seconds
# are its size x the trace's length either way; only the planner's intervals are judged.
# Environment: KVX (binary, default target/release/kvx), KVX_HOME (model store).
set -euo pipefail

OUT=/tmp/kvx-planner INTERVAL=20 SCALE=1 PEAK_SECS=60 COOLDOWN="" LOOKAHEAD=1.5 STATIC=""
PREDICTOR=holt STATIC_RUN=1 SIZING=(--profile)
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --interval) INTERVAL=$2; shift 2 ;;
    --cooldown) COOLDOWN=$2; shift 2 ;;
    --lookahead) LOOKAHEAD=$2; shift 2 ;;
    --static) STATIC=$2; shift 2 ;;
    --predictor) PREDICTOR=$2; shift 2 ;;
    --skip-static-run) STATIC_RUN=0; shift ;;
    --load-based) SIZING=(); shift ;;
    --scale) SCALE=$2; shift 2 ;;
    --peak-secs) PEAK_SECS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
COOLDOWN=${COOLDOWN:-$INTERVAL}
if [ "$STATIC_RUN" = 0 ] && [ -z "$STATIC" ]; then
  echo "--skip-static-run needs --static P+D" >&2; exit 2
fi
[ "$STATIC_RUN" = 1 ] || rm -f "$OUT/bench-static.json" "$OUT/decisions-static.jsonl"
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
GGUF=$("$KVX" model path smollm2-135m-instruct-q4_1)
mkdir -p "$OUT"
PIDS=()
stop_all() {
  local p
  for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done
  for p in ${PIDS[@]+"${PIDS[@]}"}; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
ENGINE=(--engine mocker --mocker-blocks 1024 --block-size 16 --max-num-seqs 256 --max-batched-tokens 8192)
MOCK=("${ENGINE[@]}" --mocker-vocab 49152 --heartbeat-ms 500 --heartbeat-timeout-ms 3000 --shutdown-grace 60)
TARGETS=(--ttft 500 --itl 50)

echo "== profile"
"$KVX" profile "${ENGINE[@]}" --out "$OUT/profile.json" --max-isl 4096 --max-batch 64 \
  --max-context 4096 --reps 3 2>"$OUT/profile.log"

echo "== trace"
python3 - "$OUT/trace.jsonl" "$SCALE" <<'EOF'
import json, math, random, sys
out, scale = sys.argv[1], float(sys.argv[2])
up, down, sine, period = 240 * scale, 120 * scale, 240 * scale, 240 * scale
def rate(t):
    if t < up: return 1 + 15 * t / up
    t -= up
    if t < down: return 16 - 14 * t / down
    t -= down
    return 9 - 7 * math.cos(2 * math.pi * t / period)  # from 2 up to 16 and back
total, peak, rng, t, n = up + down + sine, 16.0, random.Random(7), 0.0, 0
with open(out, "w") as f:
    while True:
        t += rng.expovariate(peak)
        if t >= total: break
        if rng.random() * peak > rate(t): continue
        f.write(json.dumps({"timestamp": round(t * 1000, 3), "input_length": 2000,
                            "output_length": 200, "hash_ids": list(range(4 * n, 4 * n + 4))}) + "\n")
        n += 1
print(f"{n} requests over {total:.0f} s")
# The rate itself, every 0.1 s, for the bound below.
json.dump([rate(k / 10) for k in range(int(total * 10) + 1)], open(out.replace(".jsonl", ".rate.json"), "w"))
EOF
TRACE_SECS=$(python3 -c "print(600 * $SCALE)")

# Starts a frontend; sets FE (HTTP) and W (workers' address).
frontend() {
  local log=$OUT/frontend.$1.log
  "$KVX" frontend --port 0 --worker-listen 127.0.0.1:0 --model "$GGUF" \
    --heartbeat-ms 500 --heartbeat-timeout-ms 3000 >"$log" 2>"$log.err" & PIDS+=($!)
  for _ in $(seq 300); do grep -q "^listening on" "$log" && break; sleep 0.1; done
  W=$(sed -n 's/^workers join at //p' "$log"); FE=$(sed -n 's#^listening on http://##p' "$log")
}
wait_workers() {
  for _ in $(seq 600); do
    [ "$(curl -s "http://$FE/metrics" | sed -n 's/^kvx_router_plane_workers //p')" = "$1" ] && return 0
    sleep 0.2
  done
  echo "the frontend did not reach $1 workers" >&2; return 1
}
# planner NAME ARGS...: a planner on the frontend, decisions to $OUT/decisions-NAME.jsonl.
planner() {
  local name=$1; shift
  rm -f "$OUT/decisions-$name.jsonl"
  "$KVX" planner --frontend "http://$FE" "${TARGETS[@]}" --max-batched-tokens 8192 \
    --planner-interval "$INTERVAL" --cooldown "$COOLDOWN" --lookahead "$LOOKAHEAD" \
    --decisions "$OUT/decisions-$name.jsonl" "$@" >"$OUT/planner-$name.log" 2>&1 & PIDS+=($!)
}
# static_fleet P D: P prefill and D decode mock workers (one process each).
static_fleet() {
  local i
  for i in $(seq "$1"); do "$KVX" worker --role prefill --frontend "$W" "${MOCK[@]}" >/dev/null 2>&1 & PIDS+=($!); done
  for i in $(seq "$2"); do "$KVX" worker --role decode --frontend "$W" "${MOCK[@]}" >/dev/null 2>&1 & PIDS+=($!); done
  wait_workers $(($1 + $2))
}
observe() {
  planner "$1" --profile "$OUT/profile.json" --connector virtual --decision-file "$OUT/virtual-$1.json" --ack-file "$OUT/ack-$1.json" \
    --min-prefill "$2" --max-prefill "$2" --min-decode "$3" --max-decode "$3"
}
replay() {
  "$KVX" bench --url "http://$FE" --api completions --trace "$OUT/trace.jsonl" --ignore-eos \
    --tokenizer "$GGUF" --timeout 120 --quiet --json "$OUT/bench-$1.json" >/dev/null
}

echo "== planner: the trace through kvx planner (local connector, 1..32 workers per pool, ${INTERVAL} s intervals)"
frontend planner
planner planner ${SIZING[@]+"${SIZING[@]}" "$OUT/profile.json"} --connector local \
  --worker-logs "$OUT/workers" --min-prefill 1 --max-prefill 32 \
  --min-decode 1 --max-decode 32 --predictor "$PREDICTOR" \
  --worker-args "--frontend $W ${MOCK[*]}"
wait_workers 2
replay planner
stop_all

echo "== peak: the smallest static fleet meeting both targets at 16 req/s"
if [ -n "$STATIC" ]; then
  P=${STATIC%+*} D=${STATIC#*+}
  echo "  taken from --static: $P prefill + $D decode (not searched in this run)"
else
read -r P D < <(python3 -c "
import json
ds = [json.loads(l) for l in open('$OUT/decisions-planner.jsonl')]
print(max(d['target']['prefill'] for d in ds), max(d['target']['decode'] for d in ds))")
meets() {  # meets P D: one peak run (exit 0: meets, 1: misses; anything else stops the script)
  rm -f "$OUT/peak-$1-$2.json"
  frontend "peak-$1-$2"
  static_fleet "$1" "$2" || { echo "the fleet $1+$2 did not start" >&2; exit 3; }
  "$KVX" bench --url "http://$FE" --api completions --input-tokens 2000 --output-tokens 200 --ignore-eos \
    --prompts 100000 --request-rate 16 --duration "$PEAK_SECS" --tokenizer "$GGUF" --quiet \
    --json "$OUT/peak-$1-$2.json" >/dev/null || { echo "kvx bench failed against $1+$2" >&2; exit 3; }
  stop_all
  python3 - "$OUT/peak-$1-$2.json" "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
t, i = r["latency_ms"]["ttft"]["p90"], r["latency_ms"]["itl"]["p90"]
ok = t <= 500 and i <= 50 and not r["errors"]
print(f"  {sys.argv[2]} prefill + {sys.argv[3]} decode: TTFT p90 {t:.0f} ms, ITL p90 {i:.1f} ms, errors {r['errors']}: {'meets' if ok else 'misses'}", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
}
# Decode workers: double until the targets hold, then bisect (a miss below, a hit above);
# then prefill workers one at a time.
while ! meets "$P" "$D"; do D=$((D * 2)); [ "$D" -gt 64 ] && { echo "no static fleet met the targets" >&2; exit 1; }; done
LO=0
while [ $((D - LO)) -gt 1 ]; do
  MID=$(((LO + D) / 2))
  if meets "$P" "$MID"; then D=$MID; else LO=$MID; fi
done
while [ "$P" -gt 1 ] && meets $((P - 1)) "$D"; do P=$((P - 1)); done
fi
echo "smallest static fleet: $P prefill + $D decode"

if [ "$STATIC_RUN" = 1 ]; then
echo "== static: the trace through $P prefill + $D decode workers"
frontend static
static_fleet "$P" "$D"
observe static "$P" "$D"
replay static
stop_all
fi

python3 - "$OUT" "$INTERVAL" "$P" "$D" "$TRACE_SECS" <<'EOF'
import json, math, sys
out, interval, p, d, secs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def load(name):
    return [json.loads(l) for l in open(f"{out}/decisions-{name}.jsonl")]
def judge(ds):
    judged = ds[2:]
    # An interval meets the targets when its p90s (where it measured any) are within them.
    ok = [x for x in judged if (x["observed"]["ttft_p90_ms"] or 0) <= 500 and (x["observed"]["itl_p90_ms"] or 0) <= 50]
    return len(ok), len(judged)
rows = {}
import os
for name in ("planner", "static"):
    if name == "static" and not os.path.exists(f"{out}/bench-static.json"):
        continue
    ds = load(name)
    ok, n = judge(ds)
    busy = [x for x in ds if x["observed"]["requests"] > 0]
    ws = sum((x["actual"]["prefill"] + x["actual"]["decode"]) * interval for x in busy)
    rows[name] = (ok, n, ws, ds)
    bench = json.load(open(f"{out}/bench-{name}.json"))["runs"][0]
    print(f"{name:8s} intervals meeting both targets {ok}/{n} ({100 * ok / max(n, 1):.0f}%), "
          f"worker-seconds {ws:.0f}, requests {bench['requests']['completed']} completed, errors {bench['errors']}, "
          f"TTFT p90 {bench['latency_ms']['ttft']['p90']:.0f} ms, ITL p90 {bench['latency_ms']['itl']['p90']:.1f} ms")
static_ws = (p + d) * secs
print(f"static fleet {p}+{d} over the {secs:.0f} s trace: {static_ws:.0f} worker-seconds; "
      f"planner / static = {rows['planner'][2] / static_ws:.3f} (bar <= 0.65); "
      f"planner intervals meeting both: {100 * rows['planner'][0] / max(rows['planner'][1], 1):.0f}% (bar >= 90%)")
# The bound: each interval sized beforehand for its highest rate by the planner's model.
prof = json.load(open(f"{out}/profile.json"))
ISL, OSL, TTFT = 2000.0, 200.0, 500.0
def lerp(xs, ys, x):
    if x <= xs[0]: return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]: return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]
ttft0 = lerp([q["isl"] for q in prof["prefill"]], [q["ttft_ms"] for q in prof["prefill"]], ISL)
ctx = ISL + OSL / 2
rows_ctx = sorted({q["context"] for q in prof["decode"]}, key=lambda c: abs(c - ctx))[0]
dec = sorted((q["batch"], q["itl_ms"]) for q in prof["decode"] if q["context"] == rows_ctx)
sh = prof["shape"]
slots = max(1, min(sh["kv_blocks"] * sh["block_size"] // int(ISL + OSL), dec[-1][0]))
hold = OSL * lerp([b for b, _ in dec], [v for _, v in dec], slots) / 1e3
def erlang_c(n, a):
    if a <= 0: return 0.0
    if a >= n: return 1.0
    b = 1.0
    for k in range(1, n + 1): b = a * b / (k + a * b)
    return n * b / (n - a * (1 - b))
def need(r):
    n = 1
    while erlang_c(n * slots, r * hold) > 0.1: n += 1
    rho = min(0.95, max(0.05, 1 - ttft0 / TTFT))  # as the planner bounds it
    return n + max(1, math.ceil(r * ttft0 / 1e3 / rho))
rates = json.load(open(f"{out}/trace.rate.json"))  # every 0.1 s
bound, t = 0.0, 0.0
while t < secs:
    end = min(secs, t + interval)
    bound += need(max(rates[round(t * 10):round(end * 10) + 1])) * (end - t)
    t = end
print(f"bound: a planner knowing each {interval:.0f} s interval's highest rate beforehand needs "
      f"{bound:.0f} worker-seconds = {bound / static_ws:.2f} of the static fleet "
      f"({slots} sequences of {hold:.1f} s per decode worker, idle TTFT {ttft0:.0f} ms)")
# The report: replicas and load over time.
ds = rows["planner"][3]
W, H, L, T, B = 900, 320, 60, 30, 40
tmax = max(1, len(ds)) * interval
def poly(vals, ymax, color, dash=""):
    pts = " ".join(f"{L + (i + 1) * interval / tmax * (W - L - 20):.1f},{T + (H - T - B) * (1 - v / ymax):.1f}" for i, v in enumerate(vals))
    return f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2" {dash}/>'
def chart(title, series, ymax, ylabel):
    ticks = "".join(f'<text x="{L - 6}" y="{T + (H - T - B) * (1 - k / 4) + 4:.1f}" text-anchor="end" font-size="11">{ymax * k / 4:.0f}</text>' for k in range(5))
    xt = "".join(f'<text x="{L + k / 6 * (W - L - 20):.1f}" y="{H - B + 16}" text-anchor="middle" font-size="11">{tmax * k / 6:.0f}</text>' for k in range(7))
    legend = "".join(f'<text x="{L + 10 + 170 * i}" y="18" fill="{c}" font-size="12">{n}</text>' for i, (n, _, c, _) in enumerate(series))
    lines = "".join(poly(v, ymax, c, dash) for _, v, c, dash in series)
    return (f'<h2>{title}</h2><svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
            f'<rect x="{L}" y="{T}" width="{W - L - 20}" height="{H - T - B}" fill="none" stroke="#999"/>{ticks}{xt}{legend}{lines}'
            f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle" font-size="12">seconds</text>'
            f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle" font-size="12">{ylabel}</text></svg>')
rate = [x["observed"]["requests"] / interval for x in ds]
pred = [x["predicted"]["requests_per_s"] for x in ds]
rep = [("decode desired", [x["target"]["decode"] for x in ds], "#1f77b4", ""),
       ("decode running", [x["actual"]["decode"] for x in ds], "#1f77b4", 'stroke-dasharray="5 4"'),
       ("prefill desired", [x["target"]["prefill"] for x in ds], "#d62728", ""),
       ("prefill running", [x["actual"]["prefill"] for x in ds], "#d62728", 'stroke-dasharray="5 4"')]
ymax_r = max(2, max(max(v) for _, v, _, _ in rep)) * 1.1
ttft = [x["observed"]["ttft_p90_ms"] or 0 for x in ds]
itl = [x["observed"]["itl_p90_ms"] or 0 for x in ds]
reasons = "".join(f"<tr><td>{x['id']}</td><td>{x['target']['prefill']}</td><td>{x['target']['decode']}</td><td>{x['reason']}</td></tr>" for x in ds)
html = ("<!doctype html><meta charset=utf-8><title>kvx planner: load that moves</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{border-top:1px solid #ddd;padding:2px 6px;font-size:12px}</style>"
        f"<h1>kvx planner: load that moves</h1><p>{interval:.0f} s intervals; static fleet {p}+{d}.</p>"
        + chart("Replicas", rep, ymax_r, "workers")
        + chart("Load", [("requests/s measured", rate, "#2ca02c", ""), ("requests/s predicted", pred, "#ff7f0e", 'stroke-dasharray="5 4"')], max(max(rate), max(pred), 1) * 1.1, "requests/s")
        + chart("Latency (p90 per interval)", [("TTFT ms", ttft, "#9467bd", ""), ("ITL ms x 10", [v * 10 for v in itl], "#8c564b", "")], max(max(ttft), max(itl) * 10, 600) * 1.1, "ms")
        + f"<h2>Decisions</h2><table><tr><td>#</td><td>prefill</td><td>decode</td><td>why</td></tr>{reasons}</table>")
open(f"{out}/report.html", "w").write(html)
print(f"report: {out}/report.html")
EOF
