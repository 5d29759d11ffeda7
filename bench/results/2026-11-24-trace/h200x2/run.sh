#!/bin/bash
# Two GPUs: the GPU tests (their 2-GPU legs), 124M data parallel with and
# without --trace (overhead), the 2-GPU trace and its report.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
ln -sf $PWD/.dev/braid /work/main/target/release/braid
B=$PWD/.dev/braid
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
cd /tmp
A="train --device cuda --nproc 2 --model 124M --batch 16 --seq 1024 --data random --steps 50 --eval-every 0 --log-every 10"
{ for i in 1 2 3; do
  $B $A > p$i.txt 2>&1; grep -h "gpu summary\|summary: overlap\|exposed" p$i.txt | sed "s/^/plain  $i: /"
  $B $A --trace t$i > q$i.txt 2>&1; grep -h "gpu summary\|summary: overlap\|exposed\|warning\|trace:" q$i.txt | sed "s/^/traced $i: /"
done; } > $OUT/overhead.txt 2>&1
$B report t3 > $OUT/report-ddp2.txt 2>&1
$B report t3 --json > $OUT/report-ddp2.json 2>&1
tar czf $OUT/trace-ddp2.tgz t3 q3.txt
cd - >/dev/null
timeout 420 ./.dev/gpu-tests --test-threads 1 > $OUT/gpu-tests.txt 2>&1
tail -n 3 $OUT/gpu-tests.txt; cat $OUT/overhead.txt
