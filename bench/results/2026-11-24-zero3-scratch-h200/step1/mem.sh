#!/bin/bash
# ZeRO-3 memory: the head reads the cast embeddings (f32 ones freed after
# the forward pass) and the head's buffers live in the gradient shard
# (placement across slices). GPU tests, then the 6.56B proxy, old and new
# binaries in this call.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
for b in old new; do gunzip -c .dev/braid-$b.gz > /tmp/braid-$b && chmod +x /tmp/braid-$b; done
ln -sf /tmp/braid-new /work/main/target/release/braid
gunzip -c .dev/gpu-tests-new.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
timeout 300 /tmp/gpu-tests --test-threads 1 --nocapture zero3 memory_estimate > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|L12-H10|estimate" $OUT/gpu-tests.txt | head -30
M=L20-H40-C5120-V50304-T1024
run() { # name, binary, args...
  local name=$1 b=$2; shift 2
  timeout 150 /tmp/braid-$b train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|ZeRO-3 besides\|peak\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
run z3-new new --steps 12 --zero 3 --nproc 1
run z3-old old --steps 12 --zero 3 --nproc 1
