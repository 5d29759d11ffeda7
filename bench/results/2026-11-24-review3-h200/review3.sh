#!/bin/bash
# Review (behaviour unchanged): ZeRO-3's sharded start through replicate;
# bits against 5659bd3, and the GPU tests on sharding and offload.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid.gz > /tmp/braid-prev; gunzip -c .dev/braid-rv.gz > /tmp/braid-new; chmod +x /tmp/braid-*
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "--zero 3" "--zero 3 --checkpointing" "--zero 3 --precision f32" "--zero 2" "--offload optimizer"; do
    n=$((n+1))
    for b in prev new; do
      /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 $extra --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
  done
done
cd - > /dev/null
gunzip -c .dev/gpu-rv.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 300 /tmp/gpu-tests --test-threads 1 --nocapture zero3 sharded offloaded > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-160
