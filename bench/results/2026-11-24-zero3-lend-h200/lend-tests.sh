#!/bin/bash
# GPU tests of the saved-activations-in-the-gradient-shard change.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
timeout 560 /tmp/gpu-tests --test-threads 1 --nocapture > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|ZeRO-3 L12|max \|diff\|" $OUT/gpu-tests.txt
