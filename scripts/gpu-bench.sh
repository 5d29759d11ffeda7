#!/usr/bin/env bash
# braid's GPU collectives against PyTorch over NCCL, in the same call.
# Runs on a GPU machine from binaries built elsewhere:
#
#   scripts/gpu-bench.sh [OUTDIR] [GPU counts, default "2 4"] [rounds, default 2]
#
# For each GPU count and round (braid and PyTorch alternate), runs
#   braid bench all_reduce,all_gather,reduce_scatter,broadcast --device cuda
#   torchrun ../shared/anchors/torch_collectives_bench.py --backend nccl
# over 8 B .. 1 GiB (factor 4), both timed the same way (rank 0's time,
# 20 iterations per size), then prints the per-size busbw and latency
# ratios (best round of each) with scripts/compare_torch.py.
set -u -o pipefail
BRAID=${BRAID:-target/release/braid}
ANCHORS=${ANCHORS:-../shared/anchors}
OUT_DIR=${1:-${OUT:-gpu-bench-out}}
COUNTS=${2:-"2 4"}
ROUNDS=${3:-2}
MAXB=${MAXB:-1G}
mkdir -p "$OUT_DIR"
# Measured like the PyTorch script: rank 0's time, 20 iterations (10 from
# 64 MiB up) after 5 warm-up ones.
BRAID_ITERS=${BRAID_ITERS:-"-n 20 -w 5"}
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$ngpu" -gt 0 ] || { echo "skipped: no GPU"; exit 0; }
nvidia-smi -L | head -1
for n in $COUNTS; do
  [ "$n" -le "$ngpu" ] || { echo "skipped: $n GPUs (only $ngpu)"; continue; }
  for round in $(seq 1 "$ROUNDS"); do
    echo "--- $n GPUs, round $round: braid"
    $BRAID bench all_reduce,all_gather,reduce_scatter,broadcast --device cuda --np "$n" \
      -b 8 -e "$MAXB" -f 4 $BRAID_ITERS --timer rank0 --json "$OUT_DIR/braid-$n-$round.json" > "$OUT_DIR/braid-$n-$round.txt" 2>&1 \
      || { echo "braid bench failed:"; tail -20 "$OUT_DIR/braid-$n-$round.txt"; }
    echo "--- $n GPUs, round $round: torch"
    torchrun --standalone --nproc_per_node="$n" "$ANCHORS/torch_collectives_bench.py" --backend nccl \
      --max-bytes $(( $(echo "$MAXB" | sed 's/G/*1073741824/;s/M/*1048576/;s/K/*1024/') )) \
      > "$OUT_DIR/torch-$n-$round.txt" 2>&1 || { echo "torch failed:"; tail -20 "$OUT_DIR/torch-$n-$round.txt"; }
  done
done
python3 "$(dirname "$0")/compare_torch.py" "$OUT_DIR" | tee "$OUT_DIR/compare.md"
