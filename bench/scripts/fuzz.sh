#!/usr/bin/env bash
# Runs every fuzz target (cargo-fuzz, nightly toolchain) for SECS seconds each, JOBS at a time,
# starting from its saved inputs (fuzz/regressions/<target>/) and keeping its growing corpus in
# fuzz/corpus/<target>/. Prints each target's executions per second, coverage and crashes;
# a crash's input is left in fuzz/artifacts/<target>/ — fix it, then copy the input into
# fuzz/regressions/<target>/ so that `cargo xtask test` runs it from then on.
#
# Usage: bench/scripts/fuzz.sh [SECS=600] [TARGET...]
# Environment: JOBS (1), CARGO_FUZZ (default: .kvx/tools/cargo-fuzz/bin/cargo-fuzz, installed
# there with `cargo install cargo-fuzz --locked --root .kvx/tools/cargo-fuzz` when missing).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SECS=${1:-600}
shift || true
JOBS=${JOBS:-1}
CARGO_FUZZ=${CARGO_FUZZ:-$ROOT/.kvx/tools/cargo-fuzz/bin/cargo-fuzz}
if [ ! -x "$CARGO_FUZZ" ]; then
  cargo install cargo-fuzz --locked --root "$ROOT/.kvx/tools/cargo-fuzz"
fi
ALL=(
  "kernels/gguf parse"
  "dataplane/proto wire"
  "dataplane/xfer agent_metadata"
  "dataplane/tokenizer chat_template"
  "control/ingress openai_request"
  "control/router kv_events"
)
want=("$@")
LOGS=$(mktemp -d)
STAMP=$LOGS/start  # crashes are counted from this run only
touch "$STAMP"
run_one() {
  local crate=$1 target=$2
  local dir=$ROOT/$crate/fuzz
  mkdir -p "$dir/corpus/$target"
  local seeds=()
  [ -d "$dir/regressions/$target" ] && seeds=("$dir/regressions/$target")
  local rc=0
  (cd "$dir" && PATH="$(dirname "$CARGO_FUZZ"):$PATH" cargo +nightly fuzz run --release "$target" \
    "$dir/corpus/$target" "${seeds[@]}" -- \
    -max_total_time="$SECS" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096) \
    > "$LOGS/$target.log" 2>&1 || rc=$?
  local execs runs cov
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$LOGS/$target.log" | grep -oE '[0-9]+$' || echo 0)
  execs=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$LOGS/$target.log" | grep -oE '[0-9]+$' || echo 0)
  cov=$(grep -oE 'cov: *[0-9]+' "$LOGS/$target.log" | tail -1 | grep -oE '[0-9]+$' || echo 0)
  local crashes
  crashes=$( (find "$dir/artifacts/$target" -type f -newer "$STAMP" 2> /dev/null || true) | wc -l)
  printf '%-16s %-22s rc %-3s %12s runs %8s exec/s  cov %6s  crashes %s\n' \
    "$target" "$crate" "$rc" "$runs" "$execs" "$cov" "$crashes"
}
active=0
for spec in "${ALL[@]}"; do
  read -r crate target <<< "$spec"
  if [ ${#want[@]} -gt 0 ] && [[ ! " ${want[*]} " == *" $target "* ]]; then continue; fi
  run_one "$crate" "$target" &
  active=$((active + 1))
  if [ "$active" -ge "$JOBS" ]; then wait -n || true; active=$((active - 1)); fi
done
wait
echo "logs in $LOGS"
