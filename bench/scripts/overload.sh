#!/usr/bin/env bash
# Overload control, measured: open-loop Poisson arrivals at 0.8x and 3x the measured capacity
# against `kvx serve` (real model), then back to 0.8x.
#
#  1. capacity: a server with the default flags, closed loop at CAP_CONC streams for CAP_DUR s:
#     completed requests/s = C (the default flags run as many sequences as the engines hold:
#     this is the most the server completes).
#  2. a server with the flags given to this script (e.g. --max-running knee, or 16),
#     warmed up, then
#     base:     0.8 C for DUR s;
#     overload: 3 C for DUR s (two clients: 2.2 C, and 0.8 C that runs RECOVER s longer);
#     recovery: the 0.8 C client's requests sent from 5 s after the overload stopped.
#  The server's RSS is sampled every 0.5 s throughout.
#
# Prints: C; for each phase the requests sent, completed, shed (429/503 with Retry-After) and
# any other failure by class; TTFT p50/p99 of completed requests; RSS; and the bar's ratios
# (overload TTFT p99 / base, overload RSS max / base, recovery TTFT p99 / base).
#
# Usage: bench/scripts/overload.sh [kvx serve flags...]
# Environment: KVX (default target/release/kvx), DUR (120), RECOVER (30), CAP_DUR (60),
# CAP_CONC (64), ISL (128), OSL (64), PROMPTS (5000 distinct prompts: few prefix-cache hits),
# OUT (a new temporary directory), C (skip step 1).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
DUR=${DUR:-120} RECOVER=${RECOVER:-30} CAP_DUR=${CAP_DUR:-60} CAP_CONC=${CAP_CONC:-64}
ISL=${ISL:-128} OSL=${OSL:-64} PROMPTS=${PROMPTS:-5000}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PORT=$((20000 + RANDOM % 20000))
URL=http://127.0.0.1:$PORT
SPID=
RPID=
stop() {
  [ -n "$RPID" ] && kill "$RPID" 2>/dev/null || true
  if [ -n "$SPID" ]; then kill "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; fi
  SPID= RPID=
}
trap stop EXIT
serve() {
  "$KVX" serve --port "$PORT" "$@" > "$OUT/serve.log" 2>&1 &
  SPID=$!
  for _ in $(seq 600); do
    curl -sf "$URL/ready" > /dev/null && return 0
    kill -0 "$SPID" 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
    sleep 0.1
  done
  echo "the server did not get ready" >&2
  exit 1
}
bench() {
  "$KVX" bench --url "$URL" --api completions --ignore-eos --input-tokens "$ISL" --prompts "$PROMPTS" \
    --output-tokens "$OSL" --max-in-flight 100000 --timeout 120 -q "$@" > /dev/null
}
rss_sampler() {
  while kill -0 "$SPID" 2>/dev/null; do
    echo "$(date +%s.%N) $(awk '/VmRSS/ {print $2}' "/proc/$SPID/status" 2>/dev/null)"
    sleep 0.5
  done > "$OUT/rss.txt" &
  RPID=$!
}

if [ -z "${C:-}" ]; then
  serve
  bench --concurrency 8 --duration 10 --json "$OUT/warm0.json"
  bench --concurrency "$CAP_CONC" --duration "$CAP_DUR" --json "$OUT/capacity.json"
  C=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["runs"][0]; print("%.3f" % r["throughput"]["requests_per_s"])' "$OUT/capacity.json")
  stop
fi
rate() { python3 -c "print('%.3f' % ($C * $1))"; }
echo "capacity: $C requests/s (closed loop, $CAP_CONC streams, default flags)"

serve "$@"
rss_sampler
bench --concurrency 8 --duration 10 --json "$OUT/warm.json"
t_base=$(date +%s.%N)
bench --request-rate "$(rate 0.8)" --duration "$DUR" --export-requests --json "$OUT/base.json"
t_over=$(date +%s.%N)
bench --request-rate "$(rate 2.2)" --duration "$DUR" --export-requests --seed 1 \
  --json "$OUT/over_a.json" &
APID=$!
bench --request-rate "$(rate 0.8)" --duration "$((DUR + RECOVER))" --export-requests --seed 2 \
  --json "$OUT/over_b.json"
wait "$APID"
t_end=$(date +%s.%N)
stop

python3 - "$OUT" "$DUR" "$t_base" "$t_over" "$t_end" "$C" <<'EOF'
import json, math, sys
out, dur, t_base, t_over, t_end, cap = sys.argv[1], float(sys.argv[2]), *map(float, sys.argv[3:7])
def run(name):
    return json.load(open(f"{out}/{name}.json"))["runs"][0]
def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else float("nan")
rss = [tuple(map(float, l.split())) for l in open(f"{out}/rss.txt") if len(l.split()) == 2]
def rss_in(a, b):
    return [kb / 1024 for t, kb in rss if a <= t < b]
base, oa, ob = run("base"), run("over_a"), run("over_b")
def ttfts(rs, lo, hi):
    return [r["ttft_ms"] for r in rs if r.get("ttft_ms") is not None and lo <= r["start_ms"] < hi]
def in_window(rs, lo, hi):
    return [r for r in rs if lo <= r["start_ms"] < hi]
def errors(records):
    e = {}
    for r in records:
        if r.get("error"):
            e[r["error"]] = e.get(r["error"], 0) + 1
    return e
bt = ttfts(base["request_records"], 0, 1e12)
ot = ttfts(oa["request_records"], 0, dur * 1e3) + ttfts(ob["request_records"], 0, dur * 1e3)
rt = ttfts(ob["request_records"], (dur + 5) * 1e3, 1e12)
b_rss, o_rss = rss_in(t_base, t_over), rss_in(t_over, t_over + dur)
# Every record by the phase it was sent in (the 0.8x client runs on into the recovery).
b_rec = base["request_records"]
o_rec = in_window(oa["request_records"], 0, dur * 1e3) + in_window(ob["request_records"], 0, dur * 1e3)
r_rec = in_window(ob["request_records"], (dur + 5) * 1e3, 1e12)
err_b, err_o, err_r = errors(b_rec), errors(o_rec), errors(r_rec)
bad = {k: v for k, v in {**err_b, **err_o, **err_r}.items() if not k.startswith("shed_")}
def done(rs):
    return sum(1 for r in rs if not r.get("error"))
rows = [
    ("base 0.8x", len(b_rec), done(b_rec), err_b, bt, b_rss),
    ("overload 3x", len(o_rec), done(o_rec), err_o, ot, o_rss),
    ("recovery 0.8x (+5 s on)", len(r_rec), done(r_rec), err_r, rt, rss_in(t_over + dur, t_end)),
]
print(f"capacity C = {cap:.2f} requests/s; phases of {dur:.0f} s")
print(f"{'phase':26} {'sent':>6} {'done':>6} {'refused/failed':24} {'TTFT p50':>9} {'TTFT p99':>9} {'RSS MiB (max)':>14}")
for name, sent, done, err, t, r in rows:
    e = ", ".join(f"{k} {v}" for k, v in sorted(err.items())) or "-"
    print(f"{name:26} {sent:6d} {done:6d} {e:24} {pct(t, 50):9.1f} {pct(t, 99):9.1f} {max(r or [0]):14.1f}")
summary = {
    "capacity_rps": cap,
    "base_ttft_p99_ms": pct(bt, 99),
    "overload_ttft_p99_ms": pct(ot, 99),
    "recovery_ttft_p99_ms": pct(rt, 99),
    "overload_ttft_ratio": pct(ot, 99) / pct(bt, 99),
    "recovery_ttft_ratio": pct(rt, 99) / pct(bt, 99),
    "rss_ratio": max(o_rss or [0]) / max(b_rss or [1]),
    "unexpected_errors": bad,
}
print(f"bar: overload TTFT p99 / base {summary['overload_ttft_ratio']:.2f} (<= 2), "
      f"RSS max overload / base {summary['rss_ratio']:.3f} (<= 1.10), "
      f"recovery TTFT p99 / base {summary['recovery_ttft_ratio']:.2f} (back to 1), "
      f"failures other than shed: {bad or 'none'}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"reports in {out}")
EOF
