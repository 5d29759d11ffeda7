#!/bin/bash
# GPU ZeRO-3 on one GPU (issue 14): the GPU tests, then ZeRO-3 over one rank against one GPU.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release && ln -sf $PWD/.dev/braid /work/main/target/release/braid
B=$PWD/.dev/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv > $OUT/machine.txt 2>&1
timeout 330 .dev/gpu-tests --test-threads 1 --nocapture gpu_zero3 > $OUT/test-zero3.txt 2>&1; echo "exit $?" >> $OUT/test-zero3.txt
tail -5 $OUT/test-zero3.txt
grep -h "max |diff|" $OUT/test-zero3.txt
run() { # name, args...
  local name=$1; shift
  timeout 150 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 5 "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'median step\|peak\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
run 124m-one --model 124M --batch 16 --steps 25
BRAID_BF16_WEIGHTS=streamed run 124m-one-streamed --model 124M --batch 16 --steps 25
run 124m-z3 --model 124M --batch 16 --steps 25 --zero 3 --nproc 1
