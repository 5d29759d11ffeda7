#!/bin/bash
# After the review: the ZeRO-3 GPU test and the offload/ZeRO/DDP GPU tests that share the engine.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release && ln -sf $PWD/.dev/braid /work/main/target/release/braid
timeout 400 .dev/gpu-tests --test-threads 1 --nocapture > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -h "test result\|exit\|max |diff|\|FAILED" $OUT/gpu-tests.txt
