#!/bin/bash
# Issue 14 on 2 H200s: the 12.85B model under ZeRO-3 (checkpointing, B 8 x
# 1024 per GPU) beside FSDP2, and 124M ZeRO-3 beside braid DDP and FSDP2.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
B=/tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
M=L40-H40-C5120-V50304-T1024
br() { # name, seconds, args...
  local name=$1 t=$2; shift 2
  /usr/bin/time -v timeout $t $B train --device cuda --nproc 2 --data random --seq 1024 --eval-every 0 --log-every 2 "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|ZeRO-3 besides\|model states\|exit\|error\|Maximum resident' $OUT/$name.txt | tr '\n' ' ')"
}
pt() { # name, seconds, args...
  local name=$1 t=$2; shift 2
  (cd .dev/anchors && timeout $t torchrun --nproc_per_node 2 torch_gpt2_bench.py "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt)
  echo "$name: $(grep -h 'RESULT\|exit\|Error' $OUT/$name.txt | tr '\n' ' ')"
}
br z3-13b 240 --zero 3 --model $M --batch 8 --checkpointing --steps 12 --json $OUT/z3-13b.json
pt fsdp2-13b 180 --fsdp --act-ckpt --model L40-H40-C5120 --B 8 --steps 8 --warmup 3
br z3-124m 90 --zero 3 --model 124M --batch 16 --steps 30
br ddp-124m 90 --model 124M --batch 16 --steps 30
pt fsdp2-124m 90 --fsdp --model 124M --B 16 --steps 20
