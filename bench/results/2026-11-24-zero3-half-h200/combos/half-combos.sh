#!/bin/bash
# bf16 gathers against f32 gathers on combinations the GPU tests do not
# cover: --no-reshard-after-forward, --accum 2, evaluation, --checkpointing
# with them. The saved models must be byte-identical.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
R=$PWD; cd /tmp
base="train --device cuda --zero 3 --nproc 1 --seq 32 --batch 8 --steps 12 --seed 11 --grad-clip 1.0"
i=0
for extra in "--no-reshard-after-forward" "--accum 2" "--eval-every 4" "--checkpointing --no-reshard-after-forward --eval-every 6"; do
  i=$((i+1))
  /tmp/braid $base $extra --save h$i.safetensors > h$i.txt 2>&1 || { echo "case $i bf16 failed"; tail -3 h$i.txt; }
  BRAID_ZERO3_GATHER=f32 /tmp/braid $base $extra --save f$i.safetensors > f$i.txt 2>&1 || { echo "case $i f32 failed"; tail -3 f$i.txt; }
  r=$(python3 $R/.dev/cmp.py h$i.safetensors f$i.safetensors)
  echo "case $i ($extra): $r"; grep -h "final loss" h$i.txt f$i.txt
done | tee $OUT/combos.txt
