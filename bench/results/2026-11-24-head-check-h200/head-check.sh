#!/bin/bash
# HEAD on one H200: every GPU test (2-GPU legs skip) and the gpu_faults
# tests' skip paths; 124M one GPU, HEAD against 99ab39a in turns; a
# ZeRO-3 run over one rank (a communicator of one) and its exit.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/braid-99ab39a.gz > /tmp/braid-prev && chmod +x /tmp/braid-prev
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
gunzip -c .dev/gpu-faults.gz > /tmp/gpu-faults && chmod +x /tmp/gpu-faults
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
timeout 400 /tmp/gpu-tests --test-threads 1 --nocapture > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit" $OUT/gpu-tests.txt | cut -c1-160
timeout 60 /tmp/gpu-faults --test-threads 1 > $OUT/gpu-faults.txt 2>&1; echo "exit $?" >> $OUT/gpu-faults.txt
grep -E "test result|exit" $OUT/gpu-faults.txt
cd /tmp
for i in 1 2 3; do for b in braid braid-prev; do
  /tmp/$b train --device cuda --model 124M --batch 16 --seq 1024 --data random --steps 30 --eval-every 0 --log-every 100 2>&1 | grep "gpu summary" | sed "s/^/$b: /" | cut -c1-140
done; done | tee $OUT/124m.txt
s=$(date +%s.%N); /tmp/braid train --device cuda --model L4-H4-C128-V50304-T64 --seq 64 --batch 8 --steps 20 --zero 3 --nproc 1 > $OUT/z3.txt 2>&1; echo "zero3 nproc 1: exit $? in $(echo "$(date +%s.%N) - $s" | bc) s"
grep -E "device memory|error" $OUT/z3.txt
