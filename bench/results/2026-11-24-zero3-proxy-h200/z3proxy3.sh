#!/bin/bash
# One-GPU proxy for issue 14's 12.85B run, braid and FSDP2 in turns:
# L20-H40-C5120 (6.56B, the model state per rank of 12.85B on 2 GPUs),
# B 8 x 1024, activation checkpointing, ZeRO-3 / FSDP2 over one rank.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
B=/tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader > $OUT/device.txt
M=L20-H40-C5120-V50304-T1024
run() { # name, args...
  local name=$1; shift
  timeout 200 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
fsdp() { # name
  (cd .dev/anchors && timeout 200 torchrun --nproc_per_node 1 torch_gpt2_bench.py --fsdp --act-ckpt --model L20-H40-C5120 --B 8 --steps 10 --warmup 3 > $OUT/$1.txt 2>&1; echo "exit $?" >> $OUT/$1.txt)
  echo "$1: $(grep -h 'RESULT\|exit\|Error' $OUT/$1.txt | tr '\n' ' ')"
}
run z3-1 --steps 15 --zero 3 --nproc 1
fsdp fsdp2-1
run z3-2 --steps 15 --zero 3 --nproc 1
fsdp fsdp2-2
BRAID_CKPT_ATTENTION=recomputed run z3-recomputed --steps 15 --zero 3 --nproc 1
BRAID_PROFILE=1 run z3-profile --steps 10 --zero 3 --nproc 1
BRAID_PROFILE=1 BRAID_BF16_WEIGHTS=streamed run one-streamed-profile --steps 10
