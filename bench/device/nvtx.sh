#!/bin/bash
# braid's NVTX ranges under Nsight on the GPUs (issue 48). One phase per
# device call:
#
#   bash bench/device/nvtx.sh check
#     Nsight Compute with its NVTX support (`ncu --nvtx`), on one GPU and
#     then two (data parallel, the gradients over NCCL rather than the
#     copy engines, so that NCCL's kernels run): the kernels of
#     step 3 only (`--nvtx-include "step 3/"`), each printed with the
#     stack of braid's ranges around it (step > forward > unit, step >
#     nccl all_reduce ...). The clocks are left alone (--clock-control
#     none). Then whether Nsight Systems (where its nsys is found) can
#     record braid's ranges and export them.
#   bash bench/device/nvtx.sh nccl
#     only check's two-GPU leg (NCU_LIMIT seconds, default 240).
#   bash bench/device/nvtx.sh overhead
#     the 124M model on one GPU, batch 16 x 1024, braid at this commit and
#     the previous binary (PREV=REV bash bench/device/pack.sh) in turns,
#     5 runs each (NVTX_ROUNDS), and this binary with BRAID_NVTX=1 but no tool: the
#     median step of each run (NVTX off must cost nothing).
#
# Logs under $L (in $OUT/logs.tgz). Carry: .dev/braid.gz .dev/commit, and
# for `overhead` .dev/braid-prev.gz.
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
small=(--model L4-H8-C512-V50304-T1024 --data random --batch 4 --seq 1024 --steps 4
  --eval-every 0 --log-every 1 --device cuda)

# ncu over step 3 of a one-GPU run: the kernels with their NVTX stacks,
# shortened to what shows braid's ranges.
ncu_step() {
  local name=$1
  timeout -k 10 "${NCU_LIMIT:-240}" ncu --nvtx --nvtx-include "step 3/" --clock-control none \
    --target-processes all --metrics gpu__time_duration.sum --print-nvtx-rename none \
    "$B" train "${small[@]}" "${@:2}" > "$L/ncu-$name.txt" 2>&1
  echo "ncu $name: exit $? | kernels profiled: $(grep -c 'gpu__time_duration.sum' "$L/ncu-$name.txt")"
  grep -E "NVTX|Push/Pop|<default domain>|step 3|==PROF==|error" "$L/ncu-$name.txt" | head -40 | cut -c1-200
}

phase_check() {
  export BRAID_NVTX=1
  ncu_step one-gpu
  phase_nccl
  local nsys
  nsys=$(command -v nsys || ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
  if [ -n "$nsys" ]; then
    timeout -k 10 120 "$nsys" profile -t cuda,nvtx -o /tmp/nsys-braid -f true \
      "$B" train "${small[@]}" > "$L/nsys.txt" 2>&1
    echo "nsys profile: exit $? | $(ls /tmp/nsys-braid* 2>/dev/null | tr '\n' ' ')"
    timeout -k 10 60 "$nsys" export --type sqlite -o /tmp/nsys-braid.sqlite /tmp/nsys-braid.nsys-rep \
      >> "$L/nsys.txt" 2>&1 && echo "nsys export: ok" || echo "nsys export: failed (see nsys.txt)"
    tail -5 "$L/nsys.txt" | cut -c1-200
  else
    echo "nsys: not found"
  fi
}

# Two ranks with NCCL for the gradients (the copy engines launch no NCCL
# kernel): the NCCL kernels of step 3 with braid's ranges around them.
# Rank 0 runs under ncu and rank 1 beside it, each started by hand
# (RANK, WORLD_SIZE, MASTER_*): ncu runs the kernels it profiles one at a
# time across its processes, so with both ranks under it an NCCL kernel
# waits forever for its peer's, queued behind it (it hung so under
# `braid train --nproc-per-node 2`, 2026-11-27; this ncu, 2025.3, has no
# lockstep launch across processes).
phase_nccl() {
  export BRAID_NVTX=1 BRAID_GPU_ALLREDUCE=nccl WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561
  RANK=1 LOCAL_RANK=1 timeout -k 10 "${NCU_LIMIT:-240}" "$B" train "${small[@]}" \
    > "$L/ncu-two-gpus-rank1.txt" 2>&1 &
  RANK=0 LOCAL_RANK=0 ncu_step two-gpus
  wait
  grep -B2 -A8 "ncclDevKernel" "$L/ncu-two-gpus.txt" | grep -E "nccl|<[0-9]+," | head -30 | cut -c1-200
}

phase_overhead() {
  [ -x /tmp/braid-prev ] || { echo "overhead: .dev/braid-prev.gz not carried"; return; }
  local i b
  local m=(--model 124M --data random --batch 16 --seq 1024 --steps 30 --eval-every 0
    --log-every 10 --device cuda)
  for i in $(seq "${NVTX_ROUNDS:-5}"); do
    for b in prev this nvtx-no-tool; do
      case $b in
        prev) timeout 120 /tmp/braid-prev train "${m[@]}" > "$L/overhead-$b-$i.txt" 2>&1 ;;
        this) timeout 120 "$B" train "${m[@]}" > "$L/overhead-$b-$i.txt" 2>&1 ;;
        nvtx-no-tool) BRAID_NVTX=1 timeout 120 "$B" train "${m[@]}" > "$L/overhead-$b-$i.txt" 2>&1 ;;
      esac
      echo "$b $i: $(grep -h 'gpu summary' "$L/overhead-$b-$i.txt" | grep -o 'median step [0-9.]* ms')"
    done
  done
}

case "${1:-}" in
  check) phase_check ;;
  nccl) phase_nccl ;;
  overhead) phase_overhead ;;
  *) echo "usage: bash bench/device/nvtx.sh check|nccl|overhead" >&2; exit 2 ;;
esac
finish
