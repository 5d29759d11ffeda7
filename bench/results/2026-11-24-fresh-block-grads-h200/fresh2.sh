#!/bin/bash
# Fresh block gradients under ZeRO-3 / stage 2 (no memset of whole block
# buffers): bits against the previous binary (0b02a8f), then the 6.56B
# proxy (ZeRO-3 over one rank), in turns.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
for b in prev blk; do gunzip -c .dev/braid-$b.gz > /tmp/braid-$b && chmod +x /tmp/braid-$b; done
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "--zero 3" "--zero 3 --checkpointing" "--zero 3 --accum 2" "--zero 2" "--zero 2 --accum 2 --checkpointing" "--zero 3 --no-reshard-after-forward"; do
    for env in "" "BRAID_ZERO3_GATHER=f32" "BRAID_SAVED_IN_GRADS=off"; do
      case "$extra$env" in *"--zero 2"*BRAID_*) continue;; *accum*SAVED*) continue;; esac
      n=$((n+1))
      for b in prev blk; do
        env $env /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 8 --seed 5 --eval-every 4 --nproc 1 $extra --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
      done
      echo "bits $m [$extra] [$env]: $(cmp -s prev-$n.safetensors blk-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('prev-$n.json'));b=json.load(open('blk-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
    done
  done
done
rm -f /tmp/*.safetensors
cd - > /dev/null
M=L20-H40-C5120-V50304-T1024
run() { /tmp/braid-$1 train --device cuda --data random --seq 1024 --eval-every 0 --log-every 100 --model $M --batch 8 --checkpointing --steps 12 --zero 3 --nproc 1 2>&1 | grep -E "gpu summary|error" | sed "s/^/$1: /"; }
run blk; run prev; run blk; run prev
