#!/usr/bin/env bash
# The price of cluster membership on the request plane: `kvx frontend` + one `kvx worker
# --engine mocker --speedup-ratio 1e9` (engine time ~0, so the planes are all there is),
# plaintext vs mutual TLS vs a shared token, alternating, RUNS runs each, same machine, same
# load generator (`kvx bench`, SSE chat): requests/s in a closed loop at --concurrency C and
# latency at concurrency 1 (TTFT p50, ITL p50, end-to-end p50). Reports medians and the
# ratios to plaintext. Certificates: a throw-away CA and one member certificate for
# 127.0.0.1 made with openssl.
#
# With --tests it also runs the remote-plane and disaggregation end-to-end suites with every
# kvx process in mutual TLS (KVX_CLUSTER_CA/CERT/KEY in the environment, tests unchanged).
#
# Usage: bench/scripts/cluster_tls.sh [--runs N] [--concurrency C] [--requests N]
#        [--lat-requests N] [--tests] [--out DIR]
# Environment: KVX (binary, default target/release/kvx), SERVER_CPUS (default 0), CLIENT_CPUS
# (default 1): the frontend and worker share SERVER_CPUS, the load generator runs apart.
set -euo pipefail

RUNS=3 CONC=32 REQ=2000 LAT_REQ=300 ISL=128 OSL=16 TESTS=0 OUT=/tmp/kvx-cluster-tls
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --lat-requests) LAT_REQ=$2; shift 2 ;;
    --tests) TESTS=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KVX=${KVX:-$ROOT/target/release/kvx}
MODEL=${MODEL:-$("$KVX" model path)}
SERVER_CPUS=${SERVER_CPUS:-0}
CLIENT_CPUS=${CLIENT_CPUS:-1}
NAME=smollm2

rm -rf "$OUT"; mkdir -p "$OUT/pki"
PKI=$OUT/pki
# SANs: loopback, and every address the across-hosts tests give their namespaces
# (10.77.NET.1-4 and .254, NET = 10 + pid % 240).
SAN="DNS:localhost,IP:127.0.0.1"
for n in $(seq 10 249); do for h in 1 2 3 4 254; do SAN="$SAN,IP:10.77.$n.$h"; done; done
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj "/CN=kvx test cluster CA" -keyout "$PKI/ca-key.pem" -out "$PKI/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvx member" \
  -keyout "$PKI/member-key.pem" -out "$PKI/member.csr" 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$SAN" > "$PKI/ext.cnf"
openssl x509 -req -in "$PKI/member.csr" -CA "$PKI/ca.pem" -CAkey "$PKI/ca-key.pem" \
  -CAcreateserial -days 2 -extfile "$PKI/ext.cnf" -out "$PKI/member.pem" 2>/dev/null
head -c 32 /dev/urandom | base64 > "$PKI/token"

if [ "$TESTS" = 1 ]; then
  echo "== remote-plane and disaggregation suites under mutual TLS"
  ( cd "$ROOT" && KVX_CLUSTER_CA=$PKI/ca.pem KVX_CLUSTER_CERT=$PKI/member.pem \
      KVX_CLUSTER_KEY=$PKI/member-key.pem cargo test --no-fail-fast -p kvx-e2e \
      --test planes_remote --test planes_disagg -- --test-threads 1 ) > "$OUT/tests.txt" 2>&1 || true
  grep -E "^test .*(ok|FAILED)$|test result" "$OUT/tests.txt" | sed 's/^/  /' 
fi

TOK_DIR=$OUT/tok
mkdir -p "$TOK_DIR"
{
  echo "kvx $("$KVX" --version); frontend + 1 mocker worker at --speedup-ratio 1e9"
  echo "isl $ISL osl $OSL; throughput: c=$CONC x $REQ requests; latency: c=1 x $LAT_REQ; $RUNS runs each"
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) CPUs; servers on $SERVER_CPUS, client on $CLIENT_CPUS; load $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/setup.txt"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT

flags() { # MODE
  case "$1" in
    plain) ;;
    mtls) echo "--cluster-ca $PKI/ca.pem --cluster-cert $PKI/member.pem --cluster-key $PKI/member-key.pem" ;;
    token) echo "--cluster-token-file $PKI/token" ;;
  esac
}

run_mode() { # MODE I
  local mode=$1 i=$2 log="$OUT/${1}_$2"
  # shellcheck disable=SC2046
  taskset -c "$SERVER_CPUS" "$KVX" frontend --model "$MODEL" --served-model-name "$NAME" \
    --host 127.0.0.1 --port 0 --worker-listen 127.0.0.1:0 $(flags "$mode") > "$log.frontend" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do grep -q "listening on http://" "$log.frontend" && break; sleep 0.1; done
  local url wjoin
  url=http://$(sed -n 's/^listening on http:\/\///p' "$log.frontend")
  wjoin=$(sed -n 's/^workers join at //p' "$log.frontend")
  # shellcheck disable=SC2046
  taskset -c "$SERVER_CPUS" "$KVX" worker --frontend "$wjoin" --engine mocker \
    --speedup-ratio 1e9 --mocker-vocab 1024 --served-model-name "$NAME" $(flags "$mode") \
    > "$log.worker" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    curl -s "$url/metrics" | grep -q '^kvx_router_plane_workers 1' && break; sleep 0.1
  done
  for phase in tput lat; do
    local c=$CONC n=$REQ w=50
    [ $phase = lat ] && { c=1; n=$LAT_REQ; w=10; }
    taskset -c "$CLIENT_CPUS" "$KVX" bench --url "$url" --model "$NAME" --api chat \
      --tokenizer "$MODEL" --input-tokens "$ISL" --output-tokens "$OSL" --ignore-eos \
      --prompts 200 --requests "$n" --warmup "$w" --concurrency "$c" -q \
      --json "$log.$phase.json" > "$log.$phase.txt"
  done
  cleanup
}

for i in $(seq 1 "$RUNS"); do
  for mode in plain mtls token; do
    echo "== run $i: $mode (load $(cut -d' ' -f1 /proc/loadavg))"
    run_mode "$mode" "$i"
  done
done

python3 - "$OUT" "$RUNS" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
med = statistics.median
rows = {}
for mode in ("plain", "mtls", "token"):
    rps, ttft, itl, e2e, fails = [], [], [], [], 0
    for i in range(1, runs + 1):
        t = json.load(open(f"{out}/{mode}_{i}.tput.json"))["runs"][0]
        l = json.load(open(f"{out}/{mode}_{i}.lat.json"))["runs"][0]
        rps.append(t["throughput"]["requests_per_s"])
        ttft.append(l["latency_ms"]["ttft"]["p50"]); itl.append(l["latency_ms"]["itl"]["p50"])
        e2e.append(l["latency_ms"]["e2e"]["p50"])
        fails += t["requests"]["failed"] + l["requests"]["failed"]
    rows[mode] = dict(rps=rps, ttft=med(ttft), itl=med(itl), e2e=med(e2e), fails=fails)
print("| plane | req/s (median) | runs | TTFT p50 c=1 (ms) | ITL p50 c=1 (ms) | e2e p50 c=1 (ms) | failed |")
print("|---|---|---|---|---|---|---|")
for m, name in (("plain", "plaintext"), ("mtls", "mutual TLS"), ("token", "token")):
    r = rows[m]
    print(f"| {name} | {med(r['rps']):.0f} | {', '.join(f'{x:.0f}' for x in r['rps'])} | {r['ttft']:.3f} | {r['itl']:.3f} | {r['e2e']:.3f} | {r['fails']} |")
p = rows["plain"]
for m in ("mtls", "token"):
    r = rows[m]
    print(f"\n{m} / plaintext: requests/s **{med(r['rps']) / med(p['rps']):.3f}x**, "
          f"e2e p50 at c=1 **{r['e2e'] / p['e2e']:.3f}x** (per run req/s: "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(r['rps'], p['rps'])) + ")")
PY
