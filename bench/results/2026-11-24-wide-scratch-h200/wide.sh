#!/bin/bash
# The wide scratch (gelu, dgelu, qkv, datty in one buffer; the GELU over
# fch): bits against 6be00a3, braid kernels --check, GPU tests, and the
# proxy's memory and speed beside the previous binary.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid.gz > /tmp/braid-prev; gunzip -c .dev/braid-wide.gz > /tmp/braid-new; chmod +x /tmp/braid-*
mkdir -p /work/main/target/release; ln -sf /tmp/braid-new /work/main/target/release/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
phase=${1:-a}
if [ $phase = a ]; then
timeout 120 /tmp/braid-new kernels --check > $OUT/kernels.txt 2>&1; echo "exit $?" >> $OUT/kernels.txt
grep -iE "fail|bit-exact|over the pre|exit" $OUT/kernels.txt | cut -c1-150
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "|" "|--checkpointing" "BRAID_CKPT_ATTENTION=recomputed|--checkpointing" "BRAID_ATTENTION=batched|--checkpointing" "BRAID_ATTENTION=batched|" "BRAID_FUSED_EPILOGUES=0|--checkpointing" "BRAID_FUSED_EPILOGUES=0|" "|--defer-layers 2" "|--defer-layers 3 --checkpointing" "|--zero 3 --checkpointing" "|--zero 3" "|--zero 2" "|--accum 2 --checkpointing" "BRAID_SCORE_GRADS=recomputed|--checkpointing"; do
    n=$((n+1)); envs=${extra%%|*}; args=${extra#*|}
    for b in prev new; do
      env $envs /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 $args --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s prev-$n.safetensors new-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('new-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
  done
done
rm -f /tmp/*.safetensors
cd - > /dev/null
exit 0
fi
cd /tmp
P="train --device cuda --model L20-H40-C5120-V50304-T1024 --batch 8 --seq 1024 --checkpointing --data random --eval-every 0 --steps 8 --log-every 4 --zero 3 --nproc 1"
for b in prev new prev new; do
  timeout 150 /tmp/braid-$b $P > $OUT/proxy-$b.txt 2>&1
  echo "proxy $b: $(grep -h 'memory estimate\|gpu summary' $OUT/proxy-$b.txt | sed 's/.*GPU memory estimate/estimate/;s/.*gpu summary: bf16 | 1 GPU(s) |//' | tr '\n' ' ')"
done
O="train --device cuda --model 1558M --batch 8 --seq 1024 --data random --eval-every 0 --steps 10 --log-every 5 --nproc 1"
for b in prev new; do
  timeout 100 /tmp/braid-$b $O > $OUT/one-$b.txt 2>&1
  echo "1558M $b: $(grep -h 'memory estimate\|gpu summary' $OUT/one-$b.txt | sed 's/.*GPU memory estimate/estimate/;s/.*gpu summary: bf16 | 1 GPU(s) |//' | tr '\n' ' ')"
done
cd - > /dev/null
gunzip -c .dev/gpu-wide.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 200 /tmp/gpu-tests --test-threads 1 --nocapture checkpointing_and_streamed memory_estimate saved_activations zero3_matches bf16_gathers padded_layout > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-160
