#!/bin/bash
# 2 GPUs (nvidia-h200-x2), issue 14: the 12.85B model under ZeRO-3
# (activation checkpointing, batch 8 x 1024 per GPU) beside PyTorch FSDP2
# and DeepSpeed ZeRO-3 in the same call, then 124M ZeRO-3 beside braid's
# data parallelism and FSDP2. `big` (12.85B, the three systems) takes
# about 5 minutes, `small` (124M) about 2; with no phase named both run,
# `small` only if the call has time left for it (the device tool stops a
# command at 600 s).
# Carry: .dev/braid.gz .dev/commit .dev/anchors (bench/device/pack.sh).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
M=L40-H40-C5120-V50304-T1024
br() { # name, seconds, braid train args...
  local name=$1 t=$2; shift 2
  /usr/bin/time -v timeout "$t" $B train --device cuda --nproc 2 --data random --seq 1024 \
    --eval-every 0 --log-every 2 "$@" > "$L/$name.txt" 2>&1
  echo "exit $?" >> "$L/$name.txt"
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|model states\|exit\|error\|Maximum resident' "$L/$name.txt" | tr '\n' ' ')"
}
peer() { # name, seconds, script, args...
  local name=$1 t=$2 script=$3; shift 3
  (cd "$ANCHORS" && timeout "$t" torchrun --nproc_per_node 2 "$script" "$@" > "$L/$name.txt" 2>&1
   echo "exit $?" >> "$L/$name.txt")
  echo "$name: $(grep -h 'RESULT\|exit\|Error' "$L/$name.txt" | tail -4 | tr '\n' ' ')"
}
phase=${1:-all}
if [ "$phase" = all ] || [ "$phase" = big ]; then
  br z3-13b 170 --zero 3 --model $M --batch 8 --checkpointing --steps 12 --json "$L/z3-13b.json"
  peer fsdp2-13b 150 torch_gpt2_bench.py --fsdp --act-ckpt --model L40-H40-C5120 --B 8 --steps 8 --warmup 3
  ds_install
  peer ds-13b 200 ds_gpt2_bench.py --zero 3 --act-ckpt --model L40-H40-C5120 --B 8 --steps 8 --warmup 3
fi
if [ "$phase" = small ] || { [ "$phase" = all ] && [ $SECONDS -lt 400 ]; }; then
  br z3-124m 45 --zero 3 --model 124M --batch 16 --steps 30
  br ddp-124m 45 --model 124M --batch 16 --steps 30
  peer fsdp2-124m 90 torch_gpt2_bench.py --fsdp --model 124M --B 16 --steps 20
fi
finish
