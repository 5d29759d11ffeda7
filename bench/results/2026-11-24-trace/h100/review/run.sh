#!/bin/bash
# Review check: GPU tests, 124M with and without --trace, reports of a
# traced 124M run and a traced ZeRO-3 run (anchor on its own stream,
# bounded flush).
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
ln -sf $PWD/.dev/braid /work/main/target/release/braid
B=$PWD/.dev/braid
cd /tmp
A="train --device cuda --model 124M --batch 16 --seq 1024 --data random --steps 40 --eval-every 0 --log-every 10"
{ for i in 1 2; do
  $B $A 2>&1 | grep "gpu summary" | sed "s/^/plain  $i: /"
  $B $A --trace t$i 2>&1 | grep -E "gpu summary|warning" | sed "s/^/traced $i: /"
done; } > $OUT/overhead.txt
$B report t2 > $OUT/report-124M.txt 2>&1
$B train --device cuda --model 124M --batch 8 --seq 1024 --data random --steps 12 --eval-every 0 --zero 3 --nproc 1 --trace z3 > z3.txt 2>&1
$B report z3 > $OUT/report-zero3.txt 2>&1
tar czf $OUT/traces.tgz t2 z3
cd - >/dev/null
timeout 300 ./.dev/gpu-tests --test-threads 1 > $OUT/gpu-tests.txt 2>&1
tail -n 3 $OUT/gpu-tests.txt; cat $OUT/overhead.txt
