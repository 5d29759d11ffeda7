#!/bin/bash
# ZeRO stage 2 block by block: the GPU tests of ZeRO (one GPU: stages 2 and
# 3 over one rank against one GPU), then the model-state memory at 2 ranks
# on the host's CPUs (124M and 1558M, every stage), as in BENCHMARKS.md.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/device.txt
timeout 240 /tmp/gpu-tests --test-threads 1 --nocapture zero > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|ZeRO-2|ZeRO-3 over|max \|diff\|" $OUT/gpu-tests.txt
cd /tmp
for m in 124M 1558M; do for z in 0 1 2 3; do
  a="--zero $z"; [ $z = 0 ] && a=""
  /usr/bin/time -v timeout 200 /tmp/braid train --model $m --seq 64 --batch 1 --steps 2 --eval-every 0 --nproc 2 $a > $OUT/mem-$m-z$z.txt 2>&1
  echo "$m z$z: $(grep -h 'model states\|besides\|Maximum resident\|error' $OUT/mem-$m-z$z.txt | tr '\n' ' ')"
done; done
