#!/bin/bash
# One-GPU proxy for issue 14's 12.85B run (L20-H40-C5120, 6.56B, B 8 x 1024,
# checkpointing, ZeRO-3 over one rank): saved activations in the gradient
# shard (default) against apart (BRAID_SAVED_IN_GRADS=off), and FSDP2.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
B=/tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader > $OUT/device.txt
M=L20-H40-C5120-V50304-T1024
run() { # name, args...
  local name=$1; shift
  timeout 200 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|model state\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
fsdp() { # name
  (cd .dev/anchors && timeout 200 torchrun --nproc_per_node 1 torch_gpt2_bench.py --fsdp --act-ckpt --model L20-H40-C5120 --B 8 --steps 10 --warmup 3 > $OUT/$1.txt 2>&1; echo "exit $?" >> $OUT/$1.txt)
  echo "$1: $(grep -h 'RESULT\|exit\|Error' $OUT/$1.txt | tr '\n' ' ')"
}
run z3-lent --steps 15 --zero 3 --nproc 1
BRAID_SAVED_IN_GRADS=off run z3-apart --steps 15 --zero 3 --nproc 1
fsdp fsdp2
run z3-lent-2 --steps 15 --zero 3 --nproc 1
