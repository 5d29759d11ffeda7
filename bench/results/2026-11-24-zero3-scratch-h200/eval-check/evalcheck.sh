#!/bin/bash
# ZeRO-3 with evaluation passes between steps: lent vs apart buffers give
# the same saved bytes and losses (fused and batched attention, with and
# without checkpointing, a vocabulary padded to 64).
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid-new.gz > /tmp/braid-new && chmod +x /tmp/braid-new
cd /tmp
for m in L4-H4-C128-V50304-T64 L3-H2-C96-V50257-T64; do
for ck in "--checkpointing" ""; do
E="train --device cuda --model $m --seq 64 --batch 8 --steps 8 --eval-every 2 --zero 3 --nproc 1 $ck --seed 3"
/tmp/braid-new $E --save lent.safetensors --json lent.json > $OUT/eval-lent-$m$ck.txt 2>&1 || echo "lent run failed"
BRAID_SAVED_IN_GRADS=off /tmp/braid-new $E --save apart.safetensors --json apart.json > $OUT/eval-apart-$m$ck.txt 2>&1 || echo "apart run failed"
echo "$m $ck: $(cmp lent.safetensors apart.safetensors && echo saved models identical) $(grep -h 'saved activations in the gradient shard' $OUT/eval-lent-$m$ck.txt | tail -1)"
python3 -c "
import json;a=json.load(open('lent.json'));b=json.load(open('apart.json'))
def L(d): return [(s.get('loss'), s.get('eval_loss')) for s in d.get('steps', [])]
print('  losses equal:', L(a)==L(b), 'evals:', [x for x in L(a) if x[1] is not None][:3])"
done; done
