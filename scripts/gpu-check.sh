#!/usr/bin/env bash
# GPU check: runs on a GPU machine from binaries built elsewhere (no Rust
# toolchain needed there). Build first: cargo build --release --bins --examples
#
#   scripts/gpu-check.sh [OUTDIR]
#
# 1. braid topo: GPUs, link matrix, measured copy bandwidth/latency;
#    braid kernels --check: every training-engine kernel vs the CPU engine.
# 2. braid verify --device cuda on 2 and 4 GPUs (one process per GPU) and
#    on all GPUs from one process (-g): every operation x dtype x reduce op
#    at counts 0, 1, 7, 1031, 4099, 90001; one summary line per group.
# 3. braid bench --graph --check with -g and with 2 processes.
# 4. SIGKILL: a worker killed during an all-reduce loop (queued without
#    waiting: braid bench; waiting for each: examples/hello_gpu); the others
#    must exit with an error naming the operation within 30 s.
# Exit status 0 only if every step passed. Output is also kept in OUTDIR.
set -u -o pipefail
BRAID=${BRAID:-target/release/braid}
OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0   # never create multicast objects
export BRAID_TIMEOUT=${BRAID_TIMEOUT:-120}
failures=0
step() { echo; echo "=== $* ==="; }
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no GPU (nvidia-smi finds none)"; exit 0
fi
ngpu=$(nvidia-smi -L | wc -l)
echo "$(date -u +%FT%TZ) $(nvidia-smi -L | head -1 | cut -d'(' -f1) x $ngpu; braid $($BRAID --version 2>/dev/null)"

step "topology"
if $BRAID topo --json "$OUT_DIR/topo.json" | tee "$OUT_DIR/topo.txt"; then pass "topo"; else fail "topo"; fi

step "training-engine kernels vs the CPU engine"
if $BRAID kernels --ptx "compute_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)" --check \
     2>&1 | tee "$OUT_DIR/kernels.txt"; then pass "kernels"; else fail "kernels"; fi

for n in 2 4; do
  [ "$n" -le "$ngpu" ] || { echo "skipped: $n GPUs (only $ngpu)"; continue; }
  step "verify, $n GPUs, one process per GPU"
  if $BRAID verify --device cuda --np "$n" > "$OUT_DIR/verify-$n.txt" 2>&1; then
    cat "$OUT_DIR/verify-$n.txt"
    pass "verify on $n GPUs"
  else
    cat "$OUT_DIR/verify-$n.txt"; fail "verify on $n GPUs"
  fi
done

step "verify, $ngpu GPUs from one process (-g $ngpu)"
if $BRAID verify --device cuda -g "$ngpu" --np 1 2>&1 | tee "$OUT_DIR/verify-g$ngpu.txt"; then
  pass "verify -g $ngpu"
else
  fail "verify -g $ngpu"
fi

step "bench smoke: -g $ngpu with --graph and --check; 2 processes with --graph"
if $BRAID bench all_reduce,all_gather,reduce_scatter,broadcast,all_to_all --device cuda -g "$ngpu" --np 1 \
     --graph --check -b 8 -e 64M -f 8 -n 5 -d bf16 > "$OUT_DIR/bench-graph-g.txt" 2>&1 \
   && $BRAID bench all_reduce --device cuda --np 2 --graph --check -b 1K -e 16M -f 16 -n 5 > "$OUT_DIR/bench-graph-2.txt" 2>&1; then
  grep -h 'Out of bounds values\|# braid bench' "$OUT_DIR"/bench-graph-*.txt
  pass "bench --graph --check"
else
  tail -20 "$OUT_DIR"/bench-graph-*.txt; fail "bench --graph --check"
fi

# kill_test N VICTIM NAME READY-PATTERN COMMAND...: starts N ranks of
# COMMAND, waits for READY-PATTERN in rank 0's output, kills VICTIM.
kill_test() {
  local n=$1 victim=$2 name=$3 ready=$4 port=$((20000 + RANDOM % 20000))
  shift 4
  local dir="$OUT_DIR/kill-$name-$n"
  mkdir -p "$dir"
  local pids=()
  for r in $(seq 0 $((n - 1))); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n GROUP_RANK=0 \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port BRAID_RUN_ID=kill-$port \
      "$@" >"$dir/rank$r.out" 2>"$dir/rank$r.err" &
    pids+=($!)
  done
  # Wait until the timed loop runs (rank 0 prints its header first).
  for _ in $(seq 1 600); do grep -q "$ready" "$dir/rank0.out" 2>/dev/null && break; sleep 0.1; done
  sleep 3
  kill -9 "${pids[$victim]}"
  local t0; t0=$(date +%s.%N)
  local ok=1
  for r in $(seq 0 $((n - 1))); do
    [ "$r" = "$victim" ] && continue
    local waited=0
    while kill -0 "${pids[$r]}" 2>/dev/null && [ "$waited" -lt 300 ]; do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "${pids[$r]}" 2>/dev/null; then
      echo "rank $r: still running 30 s after rank $victim was killed"; ok=0; kill -9 "${pids[$r]}"
      continue
    fi
    wait "${pids[$r]}"; local rc=$?
    local dt; dt=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }")
    local msg; msg=$(grep -v '^ *$' "$dir/rank$r.err" | grep -v 'NCCL WARN\|NCCL INFO' | tail -1)
    echo "rank $r: exit $rc after ${dt}s: $msg"
    if [ "$rc" = 0 ] || ! echo "$msg" | grep -q 'all_reduce'; then ok=0; fi
  done
  wait 2>/dev/null
  [ "$ok" = 1 ]
}

HELLO=${HELLO_GPU:-$(dirname "$BRAID")/examples/hello_gpu}
for n in 2 4; do
  [ "$n" -le "$ngpu" ] || continue
  # Queueing without waiting: CUDA's launch queue fills behind kernels
  # that wait for the dead rank, so the survivors are stuck inside NCCL
  # (the watchdog ends them).
  step "SIGKILL of rank 1 during a queued all-reduce loop (braid bench) on $n GPUs"
  if kill_test "$n" 1 bench '^# braid bench' $BRAID bench all_reduce --device cuda -b 32M -e 32M -n 100000000 -w 2 \
       | tee "$OUT_DIR/kill-bench-$n.txt"; then pass "kill test (bench) on $n GPUs"; else fail "kill test (bench) on $n GPUs"; fi
  # Waiting for every operation: the survivors are in DeviceWork::wait,
  # which sees the abort, calls ncclCommAbort and returns the error.
  if [ -x "$HELLO" ]; then
    step "SIGKILL of rank 1 during an all-reduce + wait loop (examples/hello_gpu) on $n GPUs"
    if kill_test "$n" 1 hello '^Hello from rank' "$HELLO" --iters 100000000 --mib 32 \
         | tee "$OUT_DIR/kill-hello-$n.txt"; then pass "kill test (hello_gpu) on $n GPUs"; else fail "kill test (hello_gpu) on $n GPUs"; fi
  else
    echo "skipped: $HELLO not built (cargo build --release --examples)"
  fi
done

echo
if [ "$failures" = 0 ]; then echo "gpu-check: all passed"; else echo "gpu-check: $failures step(s) FAILED"; fi
[ "$failures" = 0 ]
