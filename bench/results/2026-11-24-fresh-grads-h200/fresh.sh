#!/bin/bash
# Fresh gradients (no whole-buffer memset per step): bits against the
# previous binary (6845f96), then 2.65B / 1558M B 8 speed beside PyTorch
# eager, in turns.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc CUDA_VISIBLE_DEVICES=0
for b in new fresh; do gunzip -c .dev/braid-$b.gz > /tmp/braid-$b && chmod +x /tmp/braid-$b; done
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
cd /tmp
n=0
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
  for extra in "" "--accum 2" "--checkpointing --accum 3" "--zero 1 --nproc 1" "--offload optimizer"; do
    n=$((n+1))
    for b in new fresh; do
      /tmp/braid-$b train --device cuda --model $m --seq 64 --batch 8 --steps 10 --seed 5 --eval-every 5 $extra --save $b-$n.safetensors --json $b-$n.json > $OUT/bits-$b-$n.txt 2>&1 || echo "run $b $n failed: $(tail -2 $OUT/bits-$b-$n.txt)"
    done
    echo "bits $m [$extra]: $(cmp -s new-$n.safetensors fresh-$n.safetensors && echo identical || echo DIFFER) $(python3 -c "
import json;a=json.load(open('new-$n.json'));b=json.load(open('fresh-$n.json'))
L=lambda d:[(s['loss'],s['eval_loss'],s['grad_norm']) for s in d['steps']]
print('losses/norms equal' if L(a)==L(b) else 'losses DIFFER')")"
  done
done
cd - > /dev/null
T=.dev/anchors/torch_gpt2_bench.py
B=L32-H32-C2560-V50304-T1024
br() { /tmp/braid-$1 train --device cuda --model $2 --data random --batch 8 --seq 1024 --steps 25 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error" | sed "s/^/$1 $2: /"; }
pt() { python3 $T --model $1 --B 8 --steps 20 2>&1 | grep -E "RESULT|Error" | tail -1; }
for r in 1 2; do br fresh $B; br new $B; pt L32-H32-C2560; done
br fresh $B
br fresh 1558M; br new 1558M; pt 1558M
