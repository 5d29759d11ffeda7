#!/bin/bash
# The block-activation lookups in backward.rs written as forward.rs writes them: bits against 0e02454.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid.gz > /tmp/braid-prev; gunzip -c .dev/braid-tidy.gz > /tmp/braid-new; chmod +x /tmp/braid-*
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
if [ "${1:-a}" = a ]; then
true
true
cd /tmp
cmpbits() { # n, label
  echo "bits $2: $(cmp -s prev-$1.safetensors new-$1.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$1.json'));b=json.load(open('new-$1.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
}
n=0
for spec in "L4-H4-C128-V50304-T64 64 8" "L2-H2-C256-V50304-T1024 1024 2" "L2-H4-C512-V50257-T1024 1024 2"; do
  set -- $spec; m=$1; t=$2; bs=$3
  for extra in "|" "|--checkpointing" "BRAID_CKPT_ATTENTION=recomputed|--checkpointing" "|--defer-layers 2 --checkpointing" "|--zero 3 --checkpointing" "BRAID_SAVED_IN_GRADS=off|--zero 3 --checkpointing" "|--zero 2" "BRAID_SCORE_GRADS=recomputed|--checkpointing"; do
    n=$((n+1)); envs=${extra%%|*}; args=${extra#*|}
    for b in prev new; do
      env $envs /tmp/braid-$b train --device cuda --model $m --seq $t --batch $bs --steps 6 --seed 5 --eval-every 3 --nproc 1 $args --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    cmpbits $n "$m [$extra]"
  done
done
rm -f /tmp/*.safetensors
exit 0
fi
cd /tmp
P="train --device cuda --model L20-H40-C5120-V50304-T1024 --batch 8 --seq 1024 --checkpointing --data random --eval-every 0 --steps 8 --log-every 4 --zero 3 --nproc 1"
for b in prev new prev new; do
  timeout 150 /tmp/braid-$b $P --json p-$b.json > $OUT/proxy-$b.txt 2>&1
  echo "proxy $b: $(grep -h 'memory estimate\|gpu summary' $OUT/proxy-$b.txt | sed 's/.*GPU memory estimate/estimate/;s/(.*)//;s/.*gpu summary: bf16 | 1 GPU(s) |//' | tr '\n' ' ')"
done
python3 -c "
import json;a=json.load(open('p-prev.json'));b=json.load(open('p-new.json'))
L=lambda d:[(s['loss'],s['grad_norm']) for s in d['steps']]
print('proxy losses/norms', 'equal' if L(a)==L(b) else 'DIFFER', L(b)[-1])"
for b in prev new; do
  BRAID_SAVED_IN_GRADS=off timeout 150 /tmp/braid-$b $P > $OUT/proxy-apart-$b.txt 2>&1
  echo "proxy, saved apart, $b: $(grep -h 'memory estimate\|gpu summary' $OUT/proxy-apart-$b.txt | sed 's/.*GPU memory estimate/estimate/;s/(.*)//;s/.*gpu summary: bf16 | 1 GPU(s) |//' | tr '\n' ' ')"
done
cd - > /dev/null
gunzip -c .dev/gpu-sg.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 200 /tmp/gpu-tests --test-threads 1 --nocapture checkpointing_and_streamed memory_estimate saved_activations zero3_matches > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-160
