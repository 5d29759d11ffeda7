#!/bin/bash
# One layer's gradient buffer under ZeRO-3 with checkpointing (the last
# layer's gradients reduce-scattered while the next recomputes): bits
# against the previous binary (6e346ec), the GPU tests, then the 6.56B
# proxy (ZeRO-3 over one rank), in turns.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
for b in prev one; do gunzip -c .dev/braid-$b.gz > /tmp/braid-$b && chmod +x /tmp/braid-$b; done
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "--zero 3" "--zero 3 --checkpointing" "--zero 3 --accum 2" "--zero 2" "--zero 2 --accum 2 --checkpointing" "--zero 3 --no-reshard-after-forward"; do
    for env in "" "BRAID_ZERO3_GATHER=f32" "BRAID_SAVED_IN_GRADS=off"; do
      case "$extra$env" in *"--zero 2"*BRAID_*) continue;; *accum*SAVED*) continue;; esac
      n=$((n+1))
      for b in prev one; do
        env $env /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 $extra --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
      done
      echo "bits $m [$extra] [$env]: $(cmp -s prev-$n.safetensors one-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('one-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
    done
  done
done
rm -f /tmp/*.safetensors
cd - > /dev/null
mkdir -p /work/main/target/release; ln -sf /tmp/braid-one /work/main/target/release/braid
gunzip -c .dev/gpu-tests-new.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 200 /tmp/gpu-tests --test-threads 1 --nocapture zero3 memory_estimate > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|L12-H10|estimate" $OUT/gpu-tests.txt | head -20
M=L20-H40-C5120-V50304-T1024
run() { /tmp/braid-$1 train --device cuda --data random --seq 1024 --eval-every 0 --log-every 100 --model $M --batch 8 --checkpointing --steps 12 --zero 3 --nproc 1 2>&1 | grep -E "memory estimate|gpu summary|besides|error" | sed "s/^/$1: /"; }
run one; run prev; run one
