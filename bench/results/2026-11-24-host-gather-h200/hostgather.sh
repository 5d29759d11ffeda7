#!/bin/bash
# ZeRO-3 gathers the model back block by block into host memory (rank 0)
# at its end: bits against 7d5359f (saved files), the GPU tests on
# sharding, the proxy with --save.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid-shs.gz > /tmp/braid-prev; gunzip -c .dev/braid-hg.gz > /tmp/braid-new; chmod +x /tmp/braid-*
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "X=1|--zero 3" "X=1|--zero 3 --checkpointing" "X=1|--zero 3 --precision f32" "X=1|--zero 3 --accum 2" "BRAID_ZERO3_GATHER=f32|--zero 3" "X=1|--zero 2" "X=1|--zero 3 --no-reshard-after-forward"; do
    n=$((n+1))
    for b in prev new; do
      env ${extra%%|*} /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 ${extra#*|} --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
  done
done
# Without --save: the same losses, no final gather.
/tmp/braid-new train --device cuda --model L4-H4-C128-V50304-T64 --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 --zero 3 --json nosave.json > $OUT/nosave.txt 2>&1; echo "no --save: exit $? $(python3 -c "
import json;a=json.load(open('prev-1.json'));b=json.load(open('nosave.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal to the saving run' if L(a)==L(b) else 'losses DIFFER')")"
rm -f /tmp/*.safetensors
cd - > /dev/null
gunzip -c .dev/gpu-hg.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 300 /tmp/gpu-tests --test-threads 1 --nocapture zero3 sharded resume estimate past_2_31 > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|estimate" $OUT/gpu-tests.txt | cut -c1-200 | head -30
M=L20-H40-C5120-V50304-T1024
for b in new prev; do
s=$(date +%s)
timeout 200 /tmp/braid-$b train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing --steps 4 --zero 3 --nproc 1 --save /tmp/p-$b.safetensors --save-dtype bf16 > $OUT/proxy-$b.txt 2>&1; echo "$b --save: exit $? in $(( $(date +%s) - s )) s"
grep -E "estimate|gpu summary|device memory|error|saved" $OUT/proxy-$b.txt | cut -c1-250
done
echo "proxy saved models: $(cmp -s /tmp/p-new.safetensors /tmp/p-prev.safetensors && echo identical || echo DIFFER) ($(stat -c %s /tmp/p-new.safetensors) bytes)"
rm -f /tmp/p-*.safetensors
