#!/bin/bash
# One-GPU proxy for issue 14's 12.85B run (L20-H40-C5120, 6.56B: the model
# state per rank of 12.85B on 2 GPUs): braid ZeRO-3 over one rank (layers
# gathered in bf16) beside PyTorch FSDP2 over one rank, same call.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
B=/tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
M=L20-H40-C5120-V50304-T1024
run() { # name, args...
  local name=$1; shift
  timeout 200 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|ZeRO-3 besides\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
run z3-bf16 --steps 12 --zero 3 --nproc 1
cd .dev/anchors
timeout 250 torchrun --nproc_per_node 1 torch_gpt2_bench.py --fsdp --act-ckpt --model L20-H40-C5120 --B 8 --steps 5 --warmup 3 > $OUT/fsdp2.txt 2>&1; echo "exit $?" >> $OUT/fsdp2.txt
grep -h "RESULT\|exit\|Error" $OUT/fsdp2.txt
cd ../..
run z3-bf16-2 --steps 12 --zero 3 --nproc 1
