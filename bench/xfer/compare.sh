#!/usr/bin/env bash
# kvx-xfer bandwidth against this machine's own limits and against peer transfer libraries.
#
#   bench/xfer/compare.sh [RUNS] [SECS]          (defaults: 3 runs of 3 s each)
#
# Each pair (kvx case, reference) runs alternately RUNS times; the summary prints medians
# (min-max), the ratio of medians and the bar each ratio must clear:
#   shm vs single-thread memcpy of 64 KiB cold blocks      >= 0.8
#   tcp vs iperf3 single stream over loopback              >= 0.8
#   file vs fio (io_uring, O_DIRECT, QD32, 1 MiB) read/write >= 0.8
#   kvx vs NIXL (UCX, DRAM->DRAM, two processes)           >= 2.5  (64 KiB and 4 MiB blocks)
#   kvx vs Mooncake Transfer Engine (TCP)                  >= 3    (64 KiB and 4 MiB blocks)
#     (rows for kvx's TCP backend, like for like, and for shm, what kvx picks on one host)
#
# Environment:
#   KVX       kvx binary (default: target/release/kvx, built with cargo if missing)
#   NIXL_PY   python with `nixl` installed (default /tmp/venv-nixl/bin/python; see README)
#   MC_BENCH  Mooncake's transfer_engine_bench (default: inside /tmp/venv-mc)
#   WORKDIR   scratch directory on the disk under test (default: mktemp under /var/tmp)
#   ONLY      space-separated subset of: memcpy iperf fio nixl mooncake
#   HUGEPAGES auto (default): when run as root with too few 2 MiB hugepages reserved, reserve
#             enough for kvx's pools for the run and restore the count at exit (NIXL's numpy
#             buffers get transparent hugepages on their own); off: leave the system as it is
#   COPY_THREADS  kvx shm copy threads in the peer rows (default 2; NIXL gets as many UCX
#             threads, Mooncake runs 2); the memcpy row always compares one thread with one
#   TCP_THREADS   kvx io_uring threads (= connections) per side in the Mooncake rows (default
#             2, as Mooncake's --threads=2); the iperf3 row compares one stream with one
# The machine is shared: the load average is printed with every result; compare medians.
set -euo pipefail

RUNS=${1:-3}
SECS=${2:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KVX=${KVX:-$ROOT/target/release/kvx}
NIXL_PY=${NIXL_PY:-/tmp/venv-nixl/bin/python}
MC_BENCH=${MC_BENCH:-$(ls /tmp/venv-mc/lib/python3*/site-packages/mooncake/transfer_engine_bench 2>/dev/null | head -1 || true)}
ONLY=${ONLY:-memcpy iperf fio nixl mooncake}
HUGEPAGES=${HUGEPAGES:-auto}
COPY_THREADS=${COPY_THREADS:-2}
TCP_THREADS=${TCP_THREADS:-2}
WORK=${WORKDIR:-$(mktemp -d /var/tmp/kvx-xfer-compare.XXXXXX)}
mkdir -p "$WORK"
RES="$WORK/results.tsv"
: > "$RES"
PIDS=()

HP_SYSCTL=/proc/sys/vm/nr_hugepages
HP_RESTORE=""
cleanup() {
    for p in "${PIDS[@]:-}"; do
        [ -n "$p" ] && kill "$p" 2>/dev/null || true
    done
    rm -f "$WORK"/*.dat "$WORK"/fio.file
    if [ -n "$HP_RESTORE" ]; then
        echo "$HP_RESTORE" > "$HP_SYSCTL" || true
    fi
}
trap cleanup EXIT

# kvx's largest case holds two 1 GiB pools (initiator and peer): 1024 pages of 2 MiB.
HP_NEED=1040
if [ "$HUGEPAGES" = auto ] && [ -w "$HP_SYSCTL" ]; then
    hp_now=$(cat "$HP_SYSCTL")
    if [ "$hp_now" -lt "$HP_NEED" ]; then
        HP_RESTORE=$hp_now
        echo "$HP_NEED" > "$HP_SYSCTL" || true
        echo "reserved $(cat "$HP_SYSCTL") hugepages for the run (was $hp_now; restored at exit)"
    fi
fi

want() { [[ " $ONLY " == *" $1 "* ]]; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$(cut -d' ' -f1 /proc/loadavg)" >> "$RES"; echo "  $1: $2 GB/s (load $(cut -d' ' -f1 /proc/loadavg))"; }
json_gbps() { python3 -c 'import json,sys; print("%.3f" % json.loads(sys.stdin.readline())["gbps"])'; }

if [ ! -x "$KVX" ]; then
    (cd "$ROOT" && cargo build --release -p kvx)
fi
cc -O2 -o "$WORK/memcpy_cold" "$HERE/memcpy_cold.c"

kvx() { # name, kvx bench xfer args...
    local name=$1; shift
    record "$name" "$("$KVX" bench xfer --json --secs "$SECS" --warmup 1 "$@" | json_gbps)"
}

memcpy_ref() { record "$1" "$("$WORK/memcpy_cold" "$2" $((1 << 30)) "$SECS" | sed 's/.*gbps=//')"; }

iperf_ref() {
    local port=$((20000 + RANDOM % 20000))
    iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
    local sp=$!
    PIDS+=("$sp")
    sleep 0.3
    record iperf3 "$(iperf3 -c 127.0.0.1 -p "$port" -t "$SECS" -J | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.3f" % (d["end"]["sum_received"]["bits_per_second"] / 8e9))')"
    wait "$sp" 2>/dev/null || true
}

fio_ref() { # rw
    record "fio-$1" "$(fio --name=ref --filename="$WORK/fio.file" --size=1G --ioengine=io_uring --direct=1 \
        --bs=1M --iodepth=32 --rw="$1" --time_based --runtime="$SECS" --ramp_time=1 --output-format=json |
        python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print("%.3f" % ((j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e9))')"
}

nixl_ref() { # name block blocks batch inflight
    local d="$WORK/nixl.$RANDOM"
    mkdir -p "$d"
    "$NIXL_PY" "$HERE/nixl_bench.py" target --dir "$d" --block "$2" --blocks "$3" \
        --threads "$COPY_THREADS" >"$d/target.log" 2>&1 &
    local tp=$!
    PIDS+=("$tp")
    local out
    out=$(timeout 120 "$NIXL_PY" "$HERE/nixl_bench.py" initiator --dir "$d" --block "$2" --blocks "$3" \
        --batch "$4" --inflight "$5" --secs "$SECS" --threads "$COPY_THREADS" 2>/dev/null |
        grep '^nixl ' || true)
    record "$1" "$(sed 's/.*gbps=//' <<<"${out:-gbps=0}")"
    sleep 0.3
    kill "$tp" 2>/dev/null || true
    wait "$tp" 2>/dev/null || true
}

MC_PORT=""
mc_start() {
    "$MC_BENCH" --mode=target --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1:17777 \
        --protocol=tcp --buffer_size=1073741824 >"$WORK/mc_target.log" 2>&1 &
    PIDS+=("$!")
    for _ in $(seq 100); do
        MC_PORT=$(grep -o 'listening on 127.0.0.1:[0-9]*' "$WORK/mc_target.log" | head -1 | sed 's/.*://' || true)
        [ -n "$MC_PORT" ] && break
        sleep 0.1
    done
}
mc_ref() { # name block batch
    local log
    log=$(timeout 120 "$MC_BENCH" --mode=initiator --metadata_server=P2PHANDSHAKE \
        --local_server_name=127.0.0.1:$((17800 + RANDOM % 100)) --segment_id=127.0.0.1:"$MC_PORT" \
        --protocol=tcp --operation=write --block_size="$2" --batch_size="$3" --threads=2 \
        --duration="$SECS" --buffer_size=1073741824 2>&1 | grep 'Test completed' || true)
    # Rate from the counts (10^9 bytes/s), independent of the tool's unit formatting.
    record "$1" "$(python3 -c 'import re,sys; m=re.search(r"duration ([0-9.]+), batch count ([0-9]+)", sys.argv[1]); print("%.3f" % (int(m.group(2))*int(sys.argv[2])*int(sys.argv[3])/float(m.group(1))/1e9) if m else "0")' "$log" "$2" "$3")"
}

echo "work dir $WORK; $RUNS runs x $SECS s; $(nproc) CPUs; load $(cat /proc/loadavg)"
echo "hugepages reserved: $(cat "$HP_SYSCTL" 2>/dev/null || echo ?); kvx shm copy threads / tcp threads (peer rows): $COPY_THREADS / $TCP_THREADS"
if want mooncake && [ -x "${MC_BENCH:-/nonexistent}" ]; then
    export LD_LIBRARY_PATH="$(dirname "$MC_BENCH"):${LD_LIBRARY_PATH:-}"
    mc_start
fi

for r in $(seq "$RUNS"); do
    echo "== run $r"
    if want memcpy; then
        memcpy_ref memcpy-64K 65536
        kvx kvx-shm-64K-cold --backend shm --block-size 64K --blocks 16384 --batch 1 --inflight 32
    fi
    if want iperf && command -v iperf3 >/dev/null; then
        iperf_ref
        kvx kvx-tcp-4M --backend tcp --block-size 64K --blocks 16384 --batch 64 --inflight 4
    fi
    if want fio && command -v fio >/dev/null; then
        fio_ref read
        kvx kvx-file-read --backend file --op read --block-size 1M --blocks 1024 --inflight 32 --file "$WORK/kvx.dat"
        fio_ref write
        kvx kvx-file-write --backend file --op write --block-size 1M --blocks 1024 --inflight 32 --file "$WORK/kvx.dat"
    fi
    if want nixl && [ -x "$NIXL_PY" ]; then
        nixl_ref nixl-64K 65536 4096 64 4
        kvx kvx-shm-64Kx64 --backend shm --block-size 64K --blocks 4096 --batch 64 --inflight 4 \
            --copy-threads "$COPY_THREADS"
        nixl_ref nixl-4M 4194304 64 4 4
        kvx kvx-shm-4Mx4 --backend shm --block-size 4M --blocks 64 --batch 4 --inflight 4 \
            --copy-threads "$COPY_THREADS"
    fi
    if want mooncake && [ -n "$MC_PORT" ]; then
        mc_ref mooncake-64K 65536 128
        kvx kvx-tcp-64Kx128 --backend tcp --block-size 64K --blocks 16384 --batch 128 --inflight 2 \
            --tcp-threads "$TCP_THREADS"
        kvx kvx-shm-64Kx128 --backend shm --block-size 64K --blocks 16384 --batch 128 --inflight 2 \
            --copy-threads "$COPY_THREADS"
        mc_ref mooncake-4M 4194304 8
        kvx kvx-tcp-4Mx8 --backend tcp --block-size 4M --blocks 256 --batch 8 --inflight 2 \
            --tcp-threads "$TCP_THREADS"
        kvx kvx-shm-4Mx8 --backend shm --block-size 4M --blocks 256 --batch 8 --inflight 2 \
            --copy-threads "$COPY_THREADS"
    fi
done

python3 - "$RES" <<'EOF'
import statistics, sys
rows = {}
loads = []
for line in open(sys.argv[1]):
    name, v, load = line.rstrip("\n").split("\t")
    rows.setdefault(name, []).append(float(v))
    loads.append(float(load))
med = {k: statistics.median(v) for k, v in rows.items()}
def cell(k):
    v = rows[k]
    return f"{med[k]:7.3f} ({min(v):.2f}-{max(v):.2f})"
pairs = [
    ("shm 64 KiB cold vs memcpy", "kvx-shm-64K-cold", "memcpy-64K", 0.8),
    ("tcp loopback vs iperf3 1 stream", "kvx-tcp-4M", "iperf3", 0.8),
    ("file O_DIRECT read vs fio", "kvx-file-read", "fio-read", 0.8),
    ("file O_DIRECT write vs fio", "kvx-file-write", "fio-write", 0.8),
    ("shm 64 KiB x64 vs NIXL (UCX)", "kvx-shm-64Kx64", "nixl-64K", 2.5),
    ("shm 4 MiB x4 vs NIXL (UCX)", "kvx-shm-4Mx4", "nixl-4M", 2.5),
    ("tcp 64 KiB x128 vs Mooncake TCP", "kvx-tcp-64Kx128", "mooncake-64K", 3.0),
    ("tcp 4 MiB x8 vs Mooncake TCP", "kvx-tcp-4Mx8", "mooncake-4M", 3.0),
    ("shm 64 KiB x128 vs Mooncake TCP", "kvx-shm-64Kx128", "mooncake-64K", 3.0),
    ("shm 4 MiB x8 vs Mooncake TCP", "kvx-shm-4Mx8", "mooncake-4M", 3.0),
]
print()
print(f"{'comparison':34} {'kvx GB/s median (min-max)':27} {'reference GB/s':24} {'ratio':>6} {'bar':>5}  ok")
for title, k, ref, bar in pairs:
    if k not in med or ref not in med:
        continue
    ratio = med[k] / med[ref] if med[ref] > 0 else float("inf")
    print(f"{title:34} {cell(k):27} {cell(ref):24} {ratio:6.2f} {bar:5.1f}  {'yes' if ratio >= bar else 'NO'}")
if loads:
    print(f"\nload average during runs: median {statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}; n={len(next(iter(rows.values())))} runs per case")
EOF
