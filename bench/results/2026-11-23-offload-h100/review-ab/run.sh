#!/bin/bash
# A/B of the offloaded update, before (55690e5) and after the review, same machine, alternating.
export NCCL_NVLS_ENABLE=0
for round in 3; do for v in old new; do
  b=.dev/braid; [ $v = old ] && b=.dev/braid-old
  timeout 120 $b train --device cuda --data random --batch 8 --seq 1024 --checkpointing --eval-every 0 --model L32-H20-C2560-V50304-T1024 --steps 10 --warmup 2 --offload optimizer > $OUT/ab-$v-$round.txt 2>&1
  echo "$v $round: $(grep -h 'last update\|median step' $OUT/ab-$v-$round.txt | tr '\n' ' ')"
done; done
