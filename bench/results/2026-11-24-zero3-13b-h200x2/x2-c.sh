#!/bin/bash
# 2 H200s: the saved-activations test's 2-GPU leg (fixed argument list).
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 200 /tmp/gpu-tests --test-threads 1 --nocapture saved_activations > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|ZeRO-3|assert" $OUT/gpu-tests.txt
