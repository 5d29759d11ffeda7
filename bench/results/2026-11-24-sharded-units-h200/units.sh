#!/bin/bash
# gpt_gpu.rs's ZeRO-3 units moved to gpt_gpu/sharded.rs (a move): bits
# against the binary before it (f88c280) over the configurations that run
# those units, then every GPU test (their 2-GPU legs skip on one GPU).
# Carry: .dev/braid.gz .dev/braid-prev.gz .dev/gpu-tests.gz .dev/commit.
cd "$(dirname "$0")/../../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid-prev.gz > /tmp/braid-prev && chmod +x /tmp/braid-prev
cd /tmp
n=0
for spec in "L4-H4-C128-V50304-T64 64 8" "L2-H2-C256-V50304-T1024 1024 2" "L2-H4-C512-V50257-T1024 1024 2"; do
  set -- $spec; m=$1; t=$2; bs=$3
  for extra in "|--zero 3 --checkpointing" "BRAID_SAVED_IN_GRADS=off|--zero 3 --checkpointing" "|--zero 3" "|--zero 3 --accum 2" "|--zero 2" "|--zero 3 --precision f32"; do
    n=$((n+1)); envs=${extra%%|*}; args=${extra#*|}
    for b in prev new; do
      bin=/tmp/braid-prev; [ $b = new ] && bin=$B
      env $envs $bin train --device cuda --model $m --seq $t --batch $bs --steps 6 --seed 5 \
        --eval-every 3 --nproc 1 $args --save $b-$n.safetensors --json $b-$n.json \
        > $L/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $L/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
  done
done
rm -f /tmp/*.safetensors
cd - > /dev/null
timeout 330 /tmp/gpu-tests --test-threads 1 > $L/gpu-tests.txt 2>&1
echo "exit $?" >> $L/gpu-tests.txt
grep -E "test result|FAILED|panicked|exit" $L/gpu-tests.txt | cut -c1-160
finish
