#!/bin/bash
# Issue 67: the parameter server on the device machine's CPU cores (no GPU
# needed; its 16 cores are what this machine lacks).
#
#   bash bench/device/ps.sh converge [SCENARIO...]
#     bench/ps/converge.sh with 4 workers (PS_WORKERS), 400 steps: sync,
#     async and ssp:2 in each scenario (equal, beton, transient, slow),
#     loss by step and by wall-clock drawn by braid plot; into $L/converge.
#     converge.sh's PS_* settings pass through (PS_STALE_STEPS, PS_EVAL:
#     the stale modes run on until they reach sync's loss).
#   bash bench/device/ps.sh throughput
#     tokens/s of L4-H4-C256 (seq 128, batch 8 per worker, 30 steps, the
#     median step after 5): data parallelism over W workers (shared
#     memory all-reduce) beside --ps S with the servers updating and with
#     servers that only sum (BytePS's split), W in PS_W (default 2 4 8),
#     S in PS_S (default 1 2); then PyTorch's RPC parameter server
#     (bench/ps/torch_rpc_ps.py, the tutorial's pattern) with the same
#     model, W and S, synchronous. Into $L/throughput.md.
#
# Carry: .dev/braid.gz .dev/commit (after `ONLY=braid bash bench/device/pack.sh`).
set -uo pipefail
cd "$(dirname "$0")/../.."
. bench/device/setup.sh
phase=${1:-throughput}
shift || true
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""

converge() {
  PS_WORKERS=${PS_WORKERS:-4} BRAID=$B bash bench/ps/converge.sh "$L/converge" "$@"
}

# tokens/s of one braid run (its --json summary).
tps() {
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d['summary']['tokens_per_s']))" "$1" 2>/dev/null || echo "-"
}

throughput() {
  local model=(--model L4-H4-C256 --seq 128 --batch 8 --steps 30 --log-every 30 --eval-every 0)
  local out=$L/throughput.md
  echo "| workers | data parallel | --ps S, servers update | --ps S, servers sum | PyTorch RPC PS (sync) |" > "$out"
  echo "|---|---|---|---|---|" >> "$out"
  for w in ${PS_W:-2 4 8}; do
    $B train "${model[@]}" --nproc-per-node "$w" --json "$L/tp-dp-$w.json" > "$L/tp-dp-$w.txt" 2>&1
    local dp
    dp=$(tps "$L/tp-dp-$w.json")
    for s in ${PS_S:-1 2}; do
      $B train "${model[@]}" --nproc-per-node $((w + s)) --ps "$s" \
        --json "$L/tp-ps-$w-$s.json" > "$L/tp-ps-$w-$s.txt" 2>&1
      $B train "${model[@]}" --nproc-per-node $((w + s)) --ps "$s" --ps-update worker \
        --json "$L/tp-psw-$w-$s.json" > "$L/tp-psw-$w-$s.txt" 2>&1
      timeout 300 python3 bench/ps/torch_rpc_ps.py --layers 4 --heads 4 --width 256 --vocab 256 \
        --seq 128 --batch 8 --steps 30 --warmup 5 --workers "$w" --servers "$s" --mode sync \
        --json "$L/tp-torch-$w-$s.json" > "$L/tp-torch-$w-$s.txt" 2>&1
      local torch
      torch=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['tokens_per_s']))" "$L/tp-torch-$w-$s.json" 2>/dev/null || echo "-")
      echo "| $w (S = $s) | $dp | $(tps "$L/tp-ps-$w-$s.json") | $(tps "$L/tp-psw-$w-$s.json") | $torch |" >> "$out"
    done
  done
  cat "$out"
}

case $phase in
  converge) converge "$@" ;;
  throughput) throughput ;;
  *) echo "unknown phase $phase (converge, throughput)"; exit 2 ;;
esac
mkdir -p "$OUT/converge"; cp "$L"/converge/*.md "$L"/converge/*.svg "$OUT"/converge/ 2>/dev/null
cp "$L"/throughput.md "$OUT"/ 2>/dev/null
finish
