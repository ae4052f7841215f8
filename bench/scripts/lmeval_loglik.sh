#!/usr/bin/env bash
# lm-eval against kvx serve, checked against kvx eval: runs lm-eval's `local-completions`
# model (PyPI lm-eval, which scores choices with `echo` + `logprobs` and tokenizes through the
# server's /tokenize with `tokenizer_backend=remote`) on the multiple-choice task in
# bench/lmeval/, then scores the very contexts and continuations lm-eval logged with
# `kvx eval loglik` in one process (no server) and compares the log-likelihoods one by one.
# Fails when one differs by more than TOL (default 1e-4) or a greedy flag differs.
#
# Usage: bench/scripts/lmeval_loglik.sh [--port P] [--out DIR] [--concurrency C]
# Environment: KVX (kvx binary, default target/release/kvx), LM_EVAL (lm_eval executable,
#   default .kvx/lmeval/bin/lm_eval: `python3 -m venv .kvx/lmeval && .kvx/lmeval/bin/pip
#   install "lm-eval[api]==0.4.13"`), KVX_MODEL / KVX_HOME as for kvx, TOL.
set -euo pipefail

PORT=18731 OUT=/tmp/kvx-lmeval CONC=2
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KVX=${KVX:-$ROOT/target/release/kvx}
LM_EVAL=${LM_EVAL:-$ROOT/.kvx/lmeval/bin/lm_eval}
PY=$(dirname "$LM_EVAL")/python
TOL=${TOL:-1e-4}
rm -rf "$OUT"; mkdir -p "$OUT/task"
sed "s#@DATA@#$ROOT/bench/lmeval/mc.jsonl#" "$ROOT/bench/lmeval/kvx_mc.yaml.in" > "$OUT/task/kvx_mc.yaml"

"$KVX" serve --host 127.0.0.1 --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break
  sleep 0.5
done
MODEL=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "kvx serve on :$PORT, model $MODEL; lm-eval $("$PY" -c 'import importlib.metadata as m; print(m.version("lm_eval"))')"

HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$LM_EVAL" --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=remote,num_concurrent=$CONC,max_retries=1" \
  --tasks kvx_mc --include_path "$OUT/task" --log_samples --output_path "$OUT/results" \
  > "$OUT/lm_eval.log" 2>&1 || { tail -40 "$OUT/lm_eval.log"; exit 1; }
grep -E "^\|" "$OUT/lm_eval.log" || true

SAMPLES=$(find "$OUT/results" -name 'samples_kvx_mc_*.jsonl' | head -1)
python3 - "$SAMPLES" "$OUT/pairs.jsonl" "$OUT/lm_eval_scores.json" <<'PY'
import json, sys
pairs, scores = [], []
for line in open(sys.argv[1]):
    doc = json.loads(line)
    for args, resp in zip(doc["arguments"].values(), doc["resps"]):
        ll, greedy = resp[0]
        pairs.append({"context": args["arg_0"], "continuation": args["arg_1"]})
        scores.append([float(ll), str(greedy) == "True"])
with open(sys.argv[2], "w") as f:
    f.writelines(json.dumps(p) + "\n" for p in pairs)
json.dump(scores, open(sys.argv[3], "w"))
print(f"lm-eval logged {len(pairs)} log-likelihood requests")
PY
"$KVX" eval loglik --file "$OUT/pairs.jsonl" > "$OUT/kvx_eval.jsonl"
python3 - "$OUT/lm_eval_scores.json" "$OUT/kvx_eval.jsonl" "$TOL" <<'PY'
import json, sys
lm = json.load(open(sys.argv[1]))
kv = [json.loads(l) for l in open(sys.argv[2])]
tol = float(sys.argv[3])
assert len(lm) == len(kv), (len(lm), len(kv))
diffs = [abs(a[0] - b["logprob"]) for a, b in zip(lm, kv)]
greedy = sum(a[1] != b["greedy"] for a, b in zip(lm, kv))
worst = max(range(len(diffs)), key=diffs.__getitem__)
print(f"{len(kv)} log-likelihoods: max |lm-eval - kvx eval| = {diffs[worst]:.3g} "
      f"(request {worst}: {lm[worst][0]:.6f} vs {kv[worst]['logprob']:.6f}), "
      f"greedy flags differing: {greedy}, tolerance {tol:g}")
sys.exit(0 if diffs[worst] <= tol and greedy == 0 else 1)
PY
