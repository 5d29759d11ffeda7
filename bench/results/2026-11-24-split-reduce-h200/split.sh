#!/bin/bash
# ZeRO-3's tied embeddings reduce-scattered in two parts (the head's part
# at once, the embedding unit's at the end), on one H200, in two calls:
#   bits:  at one rank the two orders add the same numbers, so
#          BRAID_SPLIT_REDUCE=on must give the same bits as off (six
#          configurations), and the GPU tests of ZeRO-3 and the estimate;
#   proxy: the 12.85B proxy (L20, one rank) with the split (its default
#          under --checkpointing) and without, lent and apart: peak
#          memory, speed, losses.
# Carry: .dev/braid.gz .dev/gpu-tests.gz .dev/commit.
cd "$(dirname "$0")/../../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
cd /tmp
case ${1:-} in
bits)
  n=0
  for spec in "L4-H4-C128-V50304-T64 64 8" "L2-H4-C512-V50257-T1024 1024 2"; do
    set -- $spec; m=$1; t=$2; bs=$3
    for extra in "|--zero 3 --checkpointing" "|--zero 3" "BRAID_SAVED_IN_GRADS=off|--zero 3 --checkpointing"; do
      n=$((n+1)); envs=${extra%%|*}; args=${extra#*|}
      for s in off on; do
        env $envs BRAID_SPLIT_REDUCE=$s $B train --device cuda --model $m --seq $t --batch $bs \
          --steps 6 --seed 5 --eval-every 3 --nproc 1 $args --save $s-$n.safetensors \
          --json $s-$n.json > $L/bits-$s-$n.txt 2>&1 || echo "run $s $n failed: $(tail -2 $L/bits-$s-$n.txt)"
      done
      echo "bits $m [$extra]: $(cmp -s off-$n.safetensors on-$n.safetensors && echo identical || echo DIFFER)," \
        "split: off $(grep -c 'two parts' $L/bits-off-$n.txt) on $(grep -c 'two parts' $L/bits-on-$n.txt)," \
        "units $(grep -ho 'at most, [0-9.]* MB' $L/bits-off-$n.txt) -> $(grep -ho 'at most, [0-9.]* MB' $L/bits-on-$n.txt)"
    done
  done
  rm -f /tmp/*.safetensors
  timeout 330 /tmp/gpu-tests --test-threads 1 zero3 memory_estimate saved_activations \
    sharded_gpu_optimizer resume_from_a_sharded > $L/gpu-tests.txt 2>&1
  echo "exit $?" >> $L/gpu-tests.txt
  grep -E "^test |test result|panicked|exit" $L/gpu-tests.txt | cut -c1-160
  ;;
proxy)
  P="train --device cuda --model L20-H40-C5120-V50304-T1024 --batch 8 --seq 1024 --checkpointing --data random --eval-every 0 --steps 8 --log-every 4 --zero 3 --nproc 1"
  for s in off on off on; do
    BRAID_SPLIT_REDUCE=$s timeout 140 $B $P --json p-$s.json > $L/proxy-$s.txt 2>&1
    echo "proxy split $s: $(grep -h 'memory estimate\|gpu summary\|blocks held' $L/proxy-$s.txt | sed 's/.*GPU memory estimate/estimate/;s/(.*)//;s/.*gpu summary: bf16 | 1 GPU(s) |//;s/.*whole blocks held at once, at most,/units/;s/(gathered.*memory/lent/' | tr '\n' ' ')"
  done
  python3 -c "
import json;a=json.load(open('p-off.json'));b=json.load(open('p-on.json'))
L=lambda d:[(s['loss'],s['grad_norm']) for s in d['steps']]
print('proxy losses/norms', 'equal' if L(a)==L(b) else 'DIFFER', L(b)[-1])"
  for s in off on; do
    BRAID_SAVED_IN_GRADS=off BRAID_SPLIT_REDUCE=$s timeout 140 $B $P > $L/proxy-apart-$s.txt 2>&1
    echo "proxy apart split $s: $(grep -h 'memory estimate\|gpu summary\|blocks held' $L/proxy-apart-$s.txt | sed 's/.*GPU memory estimate/estimate/;s/(.*)//;s/.*gpu summary: bf16 | 1 GPU(s) |//;s/.*whole blocks held at once, at most,/units/;s/(gathered.*memory/lent/' | tr '\n' ' ')"
  done
  ;;
*) echo "usage: split.sh bits|proxy" >&2; exit 2 ;;
esac
cd - > /dev/null
finish
