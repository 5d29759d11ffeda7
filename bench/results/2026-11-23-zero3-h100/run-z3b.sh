#!/bin/bash
# All GPU tests after the ZeRO-3 seams; 1558M ZeRO-3 over one rank against one GPU.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release && ln -sf $PWD/.dev/braid /work/main/target/release/braid
B=$PWD/.dev/braid
timeout 330 .dev/gpu-tests --test-threads 1 > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -h "test result\|exit\|FAILED\|panicked" $OUT/gpu-tests.txt
run() { # name, args...
  local name=$1; shift
  timeout 120 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 5 "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|median step\|peak\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
BRAID_BF16_WEIGHTS=streamed run 1558m-one-streamed --model 1558M --batch 8 --steps 12 --checkpointing
run 1558m-z3 --model 1558M --batch 8 --steps 12 --checkpointing --zero 3 --nproc 1
