#!/bin/bash
# The bounded step-end sync: 124M on one GPU, before (old) and after (new),
# alternating; then the one-GPU tests of training.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/braid-old.gz > /tmp/braid-old && chmod +x /tmp/braid-old
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader > $OUT/device.txt
A="train --device cuda --model 124M --batch 16 --seq 1024 --data random --steps 40 --eval-every 0 --log-every 100"
for i in 1 2 3; do
  for b in old new; do
    bin=/tmp/braid; [ $b = old ] && bin=/tmp/braid-old
    echo "$b $i: $($bin $A 2>&1 | grep 'gpu summary' | sed 's/.*median step/median step/')"
  done
done | tee $OUT/sync-ab.txt
BRAID_TIMEOUT=0.001 /tmp/braid $A --steps 3 > $OUT/tiny-timeout.txt 2>&1; echo "exit $?" >> $OUT/tiny-timeout.txt; tail -2 $OUT/tiny-timeout.txt
timeout 300 /tmp/gpu-tests --test-threads 1 resume checkpointing offload bench > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|exit" $OUT/gpu-tests.txt
