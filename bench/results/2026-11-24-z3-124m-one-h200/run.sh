#!/bin/bash
# 124M on one H200: ZeRO-3 over one rank (the sharding machinery, its
# gathers and reduce-scatters local copies on the communication stream)
# against one process, batch 16 x 1024, bf16, alternating, twice each: a
# one-GPU view of ZeRO-3's cost at the size where issue 14 asks for
# >= 0.9x data parallelism.
# Carry: .dev/braid.gz .dev/commit.
cd "$(dirname "$0")/../../.." && source bench/device/setup.sh
cd /tmp
A="train --device cuda --model 124M --batch 16 --seq 1024 --data random --steps 40 --eval-every 0 --log-every 20"
for i in 1 2; do
  for mode in plain z3; do
    extra=""; [ $mode = z3 ] && extra="--zero 3 --nproc 1"
    timeout 120 $B $A $extra > $L/$mode-$i.txt 2>&1
    echo "$mode $i: $(grep -h 'gpu summary' $L/$mode-$i.txt | sed 's/.*GPU(s) |//')"
    grep -h "summary: an average step" $L/$mode-$i.txt | sed "s/^/   /"
  done
done
cd - > /dev/null
finish
