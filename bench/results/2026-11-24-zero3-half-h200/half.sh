#!/bin/bash
# bf16 gathers under ZeRO-3 on one GPU: the GPU tests (zero3, resume),
# then the 6.56B proxy (ZeRO-3 over one rank) with bf16 and f32 gathers.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
timeout 330 /tmp/gpu-tests --test-threads 1 --nocapture zero3 resume > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|L12-H10|max \|diff\||bf16, ZeRO" $OUT/gpu-tests.txt
B=/tmp/braid
M=L20-H40-C5120-V50304-T1024
run() { # name, args...
  local name=$1; shift
  timeout 200 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|ZeRO-3 besides\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
run z3-bf16 --steps 12 --zero 3 --nproc 1
BRAID_ZERO3_GATHER=f32 run z3-f32 --steps 12 --zero 3 --nproc 1
