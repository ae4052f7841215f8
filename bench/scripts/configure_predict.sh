#!/usr/bin/env bash
# kvx configure's predictions against what kvx bench measures, in one go:
#
#   mocker  `kvx profile --engine mocker` of a mock worker (Dynamo's timing model at speedup 1,
#           1,024 KV blocks of 16 tokens, 8,192 batched tokens); `kvx configure --profile` for
#           ISL 2,000 / OSL 200, TTFT p90 <= 500 ms, ITL p90 <= 50 ms on 16 (virtual) cores;
#           then three layouts, each at the concurrency configure gives it (its knee: the
#           fewest users within 5% of its most throughput within the targets): the best one,
#           run from the settings file configure wrote, and
#           --mock-layouts more (default: agg 4, disagg 2+6).
#   model   `kvx profile --engine model` of the default model with 1 and with 2 threads per
#           shard; `kvx configure` over both for ISL --isl / OSL --osl on this host's cores; the
#           best layout (from its settings file) and --model-layouts more (default: agg 1 of
#           the 2-thread kind, disagg 1+1 of the 1-thread kind).
#
# Each layout runs as one `kvx serve` (its workers as engine shards) under `kvx bench
# --concurrency C` for --secs seconds; the report sets predicted against measured output
# tokens/s, TTFT p50 and ITL p50, with their ratios (the bar: each within 25%). Prompt and
# output lengths are uniform over +-25% of ISL and OSL (their means): with lengths all alike a
# closed loop stays in lockstep — every user of a worker sends its next prompt in the same
# step — which no modelled (or real) load does.
#
# Usage: bench/scripts/configure_predict.sh [--out DIR] [--secs S] [--isl N] [--osl N]
#          [--ttft MS] [--itl MS] [--mock-layouts "agg:4 disagg:2:6"]
#          [--model-layouts "agg:1:m2 disagg:1:1:m1"] [--skip-mocker] [--skip-model]
#          [--reuse-profiles]   (keep the profiles an earlier run left in --out)
# Environment: KVX (binary, default target/release/kvx), KVX_HOME (model store).
set -euo pipefail

OUT=/tmp/kvx-configure SECS=60 ISL=512 OSL=64 TTFT=3000 ITL=250
MOCK_LAYOUTS="agg:4 disagg:2:6" MODEL_LAYOUTS="agg:1:m2 disagg:1:1:m1" DO_MOCK=1 DO_MODEL=1 REUSE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --secs) SECS=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --ttft) TTFT=$2; shift 2 ;;
    --itl) ITL=$2; shift 2 ;;
    --mock-layouts) MOCK_LAYOUTS=$2; shift 2 ;;
    --model-layouts) MODEL_LAYOUTS=$2; shift 2 ;;
    --skip-mocker) DO_MOCK=0; shift ;;
    --skip-model) DO_MODEL=0; shift ;;
    --reuse-profiles) REUSE=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
KVX=${KVX:-$HERE/../../target/release/kvx}
GGUF=$("$KVX" model path smollm2-135m-instruct-q4_1)
mkdir -p "$OUT"
rm -f "$OUT/results.jsonl"
PIDS=()
stop_all() {
  local p
  for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done
  for p in ${PIDS[@]+"${PIDS[@]}"}; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"

# serve NAME ENVFILE ARGS...: `kvx serve` on an ephemeral port (settings from ENVFILE when not
# "-"); sets ADDR.
serve() {
  local name=$1 envfile=$2; shift 2
  local log=$OUT/serve.$name.log
  (
    if [ "$envfile" != - ]; then set -a; . "$envfile"; set +a; fi
    exec "$KVX" serve --port 0 --model "$GGUF" "$@"
  ) >"$log" 2>"$log.err" & PIDS+=($!)
  for _ in $(seq 600); do
    ADDR=$(sed -n 's#^listening on http://##p' "$log"); [ -n "$ADDR" ] && return 0; sleep 0.2
  done
  echo "kvx serve ($name) did not start: $(tail -3 "$log.err")" >&2; return 1
}
# measure NAME LAYOUTS_JSON MODE P D KIND ISL OSL ENVFILE ARGS...: the layout's prediction at
# its best concurrency, a serve of it, kvx bench at that concurrency, one result line.
measure() {
  local name=$1 json=$2 mode=$3 p=$4 d=$5 kind=$6 isl=$7 osl=$8 envfile=$9; shift 9
  local c
  c=$(python3 - "$json" "$mode" "$p" "$d" "$kind" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1])); mode, p, d, kind = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
kn = lambda n: n.rsplit("/", 1)[-1].removesuffix(".json")
for i in s["ranked"]:
    pt = s["points"][i]; l = pt["layout"]
    if l["mode"] != mode or kn(s["kinds"][l["kind"]]) != kind: continue
    if (mode == "agg" and l["workers"] == p) or (mode == "disagg" and (l["prefill"], l["decode"]) == (p, d)):
        print(pt["prediction"]["concurrency"]); sys.exit(0)
sys.exit(f"{mode} {p}+{d} of {kind}: no concurrency meets the targets; not measured")
EOF
) || return 0
  serve "$name" "$envfile" "$@"
  local in out
  in=$(python3 -c "print(f'uniform:{round($isl * 0.75)},{round($isl * 1.25)}')")
  out=$(python3 -c "print(f'uniform:{round($osl * 0.75)},{round($osl * 1.25)}')")
  "$KVX" bench --url "http://$ADDR" --api completions --input-tokens "$in" --output-tokens "$out" \
    --ignore-eos --prompts 5000 --concurrency "$c" --duration "$SECS" \
    --tokenizer "$GGUF" --timeout 600 --quiet --json "$OUT/bench-$name.json" >/dev/null
  stop_all
  python3 - "$json" "$OUT/bench-$name.json" "$name" "$mode" "$p" "$d" "$kind" "$c" >>"$OUT/results.jsonl" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1])); r = json.load(open(sys.argv[2]))["runs"][0]
name, mode, p, d, kind, c = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], int(sys.argv[8])
kn = lambda n: n.rsplit("/", 1)[-1].removesuffix(".json")
for pt in s["points"]:
    l = pt["layout"]
    if pt["prediction"]["concurrency"] != c or l["mode"] != mode or kn(s["kinds"][l["kind"]]) != kind: continue
    if (mode == "agg" and l["workers"] == p) or (mode == "disagg" and (l["prefill"], l["decode"]) == (p, d)):
        q = pt["prediction"]; break
m = {"tok_s": r["throughput"]["output_tokens_per_s"], "ttft_p50_ms": r["latency_ms"]["ttft"]["p50"],
     "itl_p50_ms": r["latency_ms"]["itl"]["p50"]}
print(json.dumps({"name": name, "layout": f"{mode} {p}" + (f"+{d}" if mode == "disagg" else "") + f" x {kind}",
                  "concurrency": c, "requests": r["requests"]["completed"], "errors": r["errors"],
                  "predicted": {k: q[k] for k in m}, "measured": m}))
EOF
  tail -1 "$OUT/results.jsonl"
}
# best ENV: "MODE P D KIND" of the layout a settings file describes.
best() {
  python3 - "$1" <<'EOF'
import re, sys
env = dict(re.findall(r"^(KVX_[A-Z_]+)=(.*)$", open(sys.argv[1]).read(), re.M))
kind = env["KVX_PLANNER_PROFILE"].strip("'\"").rsplit("/", 1)[-1].removesuffix(".json")
if "KVX_PREFILL_SHARDS" in env: print("disagg", env["KVX_PREFILL_SHARDS"], env["KVX_DECODE_SHARDS"], kind)
else: print("agg", env["KVX_SHARDS"], 0, kind)
EOF
}
CONF=(--home-dir "${KVX_HOME:-$HOME/.kvx}" --kv-disk-dir none --no-kv-host --listen-port 0)

if [ "$DO_MOCK" = 1 ]; then
  echo "== mocker: profile"
  ENGINE=(--engine mocker --mocker-blocks 1024 --block-size 16 --max-num-seqs 256 --max-batched-tokens 8192)
  [ "$REUSE" = 1 ] && [ -f "$OUT/mock.json" ] || "$KVX" profile "${ENGINE[@]}" --out "$OUT/mock.json" \
    --max-isl 4096 --max-batch 64 --max-context 4096 --reps 3 2>"$OUT/profile-mock.log"
  echo "== mocker: kvx configure"
  "$KVX" configure "${CONF[@]}" --profile "$OUT/mock.json" --isl 2000 --osl 200 --ttft 500 --itl 50 \
    --cores 16 --json "$OUT/mock-layouts.json" --out "$OUT/mock.env" 2>"$OUT/mock-report.txt"
  sed -n '/^Best/p' "$OUT/mock-report.txt"
  SERVE_MOCK=(--mocker-vocab 49152 --disagg-min-tokens 0)
  # The best layout runs from the settings file configure wrote (the vocabulary aside: the
  # frontend tokenizes with the model's, the mock engines draw from it).
  read -r MODE P D KIND < <(best "$OUT/mock.env")
  measure mock-best "$OUT/mock-layouts.json" "$MODE" "$P" "$D" "$KIND" 2000 200 "$OUT/mock.env" \
    --mocker-vocab 49152
  for l in $MOCK_LAYOUTS; do
    IFS=: read -r MODE A B <<<"$l"
    if [ "$MODE" = agg ]; then
      measure "mock-agg-$A" "$OUT/mock-layouts.json" agg "$A" 0 mock 2000 200 - "${ENGINE[@]}" "${SERVE_MOCK[@]}" --shards "$A"
    else
      measure "mock-disagg-$A-$B" "$OUT/mock-layouts.json" disagg "$A" "$B" mock 2000 200 - "${ENGINE[@]}" "${SERVE_MOCK[@]}" \
        --prefill-shards "$A" --decode-shards "$B"
    fi
  done
fi

if [ "$DO_MODEL" = 1 ]; then
  echo "== model: profiles with 1 and 2 threads per shard"
  for t in 1 2; do
    [ "$REUSE" = 1 ] && [ -f "$OUT/m$t.json" ] && continue
    "$KVX" profile --engine model --threads-per-shard "$t" --out "$OUT/m$t.json" \
      --max-isl 2048 --max-batch 32 --max-context 2048 --reps 3 2>"$OUT/profile-m$t.log"
  done
  echo "== model: kvx configure"
  "$KVX" configure "${CONF[@]}" --profile "$OUT/m1.json" --profile "$OUT/m2.json" --isl "$ISL" --osl "$OSL" \
    --ttft "$TTFT" --itl "$ITL" --json "$OUT/model-layouts.json" --out "$OUT/model.env" 2>"$OUT/model-report.txt"
  sed -n '/^Best/p' "$OUT/model-report.txt"
  read -r MODE P D KIND < <(best "$OUT/model.env")
  measure model-best "$OUT/model-layouts.json" "$MODE" "$P" "$D" "$KIND" "$ISL" "$OSL" "$OUT/model.env"
  for l in $MODEL_LAYOUTS; do
    IFS=: read -r MODE A B C <<<"$l"
    if [ "$MODE" = agg ]; then
      T=${B#m}
      measure "model-agg-$A-$B" "$OUT/model-layouts.json" agg "$A" 0 "$B" "$ISL" "$OSL" - \
        --engine model --shards "$A" --threads-per-shard "$T"
    else
      T=${C#m}
      measure "model-disagg-$A-$B-$C" "$OUT/model-layouts.json" disagg "$A" "$B" "$C" "$ISL" "$OSL" - \
        --engine model --prefill-shards "$A" --decode-shards "$B" --threads-per-shard "$T" --disagg-min-tokens 0
    fi
  done
fi

echo "== predicted against measured (bar: each within 25%)"
python3 - "$OUT/results.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'layout':28s} {'users':>5s} {'reqs':>5s} {'err':>3s}  " + "  ".join(f"{k:>24s}" for k in ("output tok/s", "TTFT p50 ms", "ITL p50 ms")))
within = 0
for r in rows:
    cells = []
    for k in ("tok_s", "ttft_p50_ms", "itl_p50_ms"):
        p, m = r["predicted"][k], r["measured"][k]
        ratio = p / m if m else float("inf")
        within += abs(ratio - 1) <= 0.25
        cells.append(f"{p:8.1f} / {m:8.1f} = {ratio:4.2f}")
    err = sum(r["errors"].values()) if isinstance(r["errors"], dict) else r["errors"]
    print(f"{r['layout']:28s} {r['concurrency']:5d} {r['requests']:5d} {err:3d}  " + "  ".join(cells))
print(f"{within} of {3 * len(rows)} predictions within 25% (predicted / measured)")
EOF
