#!/bin/bash
# Review (fresh.rs's zeroing through one helper): bits against 92d53cf, then the GPU tests that zero gradients.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc CUDA_VISIBLE_DEVICES=0
gunzip -c .dev/braid.gz > /tmp/braid-prev && chmod +x /tmp/braid-prev
gunzip -c .dev/braid-review.gz > /tmp/braid-new && chmod +x /tmp/braid-new
gunzip -c .dev/gpu-review.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
mkdir -p /work/main/target/release && ln -sf /tmp/braid-new /work/main/target/release/braid
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "" "--checkpointing" "--accum 2" "--checkpointing --accum 3" "--zero 3 --nproc 1" "--zero 3 --nproc 1 --checkpointing" "--zero 2 --nproc 1" "--zero 1 --nproc 1" "--offload optimizer"; do
    n=$((n+1))
    for b in prev new; do
      /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 10 --seed 5 --eval-every 3 --grad-clip 1.0 $extra --save $b-$n.safetensors --json $b-$n.json > /tmp/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 /tmp/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER', b.get('saved_in_grads_bytes'))")" | tee -a $OUT/bits.txt
  done
done
cd - > /dev/null
timeout 300 /tmp/gpu-tests --test-threads 1 --nocapture gpu_one_process gpu_zero3 gpu_checkpointing a_sharded the_gpu_memory > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-200
