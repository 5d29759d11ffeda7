#!/bin/bash
# End of the twelfth session: HEAD (the gpt_gpu split) against ca343da, bits
# on 26 configurations (offload too), then every GPU test on one H200.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid-z3split.gz > /tmp/braid-prev; gunzip -c .dev/braid.gz > /tmp/braid-new; chmod +x /tmp/braid-*
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
cd /tmp
n=0; same=0
for spec in "L4-H4-C128-V50304-T64 64 8" "L2-H2-C256-V50304-T1024 1024 2"; do
  set -- $spec; m=$1; t=$2; bs=$3
  for extra in "|" "|--checkpointing" "BRAID_CKPT_ATTENTION=recomputed|--checkpointing" "|--defer-layers 2 --checkpointing" "|--zero 3 --checkpointing" "BRAID_SAVED_IN_GRADS=off|--zero 3 --checkpointing" "|--zero 2" "BRAID_SCORE_GRADS=recomputed|--checkpointing" "|--offload optimizer" "|--precision f32 --zero 3" "|--precision f32" "|--accum 2" "|--zero 3 --accum 2"; do
    n=$((n+1)); envs=${extra%%|*}; args=${extra#*|}
    for b in prev new; do
      env $envs /tmp/braid-$b train --device cuda --model $m --seq $t --batch $bs --steps 6 --seed 5 --eval-every 3 --nproc 1 $args --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    r="$(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
    [ "$r" = "identical losses/norms equal" ] && same=$((same+1)) || echo "bits $m [$extra]: $r"
  done
done
echo "bits: $same of $n identical (saved model, losses, eval losses, norms)"
rm -f /tmp/*.safetensors
cd - > /dev/null
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 380 /tmp/gpu-tests --test-threads 1 > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-140
