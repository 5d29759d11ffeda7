#!/bin/bash
# ZeRO-3's finish no longer gathers beside the optimizer state: 1558M peak against the estimate; 124M again.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release && ln -sf $PWD/.dev/braid /work/main/target/release/braid
B=$PWD/.dev/braid
timeout 200 .dev/gpu-tests --test-threads 1 --nocapture gpu_zero3 > $OUT/test-zero3.txt 2>&1; echo "exit $?" >> $OUT/test-zero3.txt
grep -h "max |diff|\|test result\|exit" $OUT/test-zero3.txt
run() { # name, args...
  local name=$1; shift
  timeout 120 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 5 "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|median step\|peak\|exit\|error\|model states' $OUT/$name.txt | tr '\n' ' ')"
}
run 1558m-z3 --model 1558M --batch 8 --steps 12 --checkpointing --zero 3 --nproc 1
run 124m-z3 --model 124M --batch 16 --steps 25 --zero 3 --nproc 1
run 124m-one --model 124M --batch 16 --steps 25
