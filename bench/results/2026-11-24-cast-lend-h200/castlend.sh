#!/bin/bash
# The token embeddings' bf16 cast lent to the gradient shard (ZeRO-3):
# bits against 99ab39a, the GPU tests that lend or estimate, the proxy.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
for b in prev new; do :; done
gunzip -c .dev/braid.gz > /tmp/braid-prev; gunzip -c .dev/braid-ph.gz > /tmp/braid-new; chmod +x /tmp/braid-*
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "X=1|--zero 3" "X=1|--zero 3 --checkpointing" "BRAID_ATTENTION=batched|--zero 3 --checkpointing" "X=1|--zero 3 --accum 2" "X=1|--zero 2" "BRAID_BF16_WEIGHTS=streamed|" "BRAID_BF16_WEIGHTS=streamed|--checkpointing"; do
    n=$((n+1))
    for b in prev new; do
      env ${extra%%|*} /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 ${extra#*|} --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')") $(grep -h 'saved activations' new-$n.txt $OUT/bits-new-$n.txt 2>/dev/null | head -1 | cut -c1-120)"
  done
done
rm -f /tmp/*.safetensors
cd - > /dev/null
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
gunzip -c .dev/gpu-ph.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 300 /tmp/gpu-tests --test-threads 1 --nocapture zero3 estimate saved streamed > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|estimate" $OUT/gpu-tests.txt | head -30
M=L20-H40-C5120-V50304-T1024
for b in new prev; do
timeout 200 /tmp/braid-$b train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing --steps 8 --zero 3 --nproc 1 > $OUT/proxy-$b.txt 2>&1; echo "$b exit $?"
grep -E "estimate|gpu summary|device memory|besides|error" $OUT/proxy-$b.txt
done
