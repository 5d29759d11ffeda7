#!/bin/bash
# The one-process lending test again (fixed argument list), then 2.65B /
# 1558M beside PyTorch eager and torch.compile, lending on and off.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc CUDA_VISIBLE_DEVICES=0
gunzip -c .dev/braid-lend.gz > /tmp/braid && chmod +x /tmp/braid
gunzip -c .dev/gpu-lend.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
mkdir -p /work/main/target/release && ln -sf /tmp/braid /work/main/target/release/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
timeout 200 /tmp/gpu-tests gpu_one_process --test-threads 1 --nocapture > $OUT/gpu-test.txt 2>&1; echo "exit $?" >> $OUT/gpu-test.txt
grep -E "^test |test result|panicked|exit|gradient buffer" $OUT/gpu-test.txt | cut -c1-250
T=.dev/anchors/torch_gpt2_bench.py
br() { local tag=$1 m=$2; shift 2; timeout 120 /tmp/braid train --device cuda --model $m --data random --seq 1024 --steps 25 --eval-every 0 --log-every 100 "$@" > $OUT/run.txt 2>&1; echo "$tag $m $*: $(grep -E "memory estimate" $OUT/run.txt | cut -c1-60) | $(grep -E "gpu summary|error" $OUT/run.txt | cut -c1-220) | $(grep -E "gradient buffer's memory" $OUT/run.txt)" | tee -a $OUT/bench.txt; }
pt() { (cd .dev/anchors && timeout 240 python3 torch_gpt2_bench.py "$@" 2>&1 | grep -E "RESULT|Error" | tail -1 | sed "s/^/pytorch $*: /" | tee -a $OUT/bench.txt); }
B=L32-H32-C2560-V50304-T1024
br lend $B --batch 8
BRAID_SAVED_IN_GRADS=off br off $B --batch 8
pt --model L32-H32-C2560 --B 8 --steps 20
br lend $B --batch 8
pt --model L32-H32-C2560 --B 8 --steps 20 --compile
br lend 1558M --batch 8
BRAID_SAVED_IN_GRADS=off br off 1558M --batch 8
pt --model 1558M --B 8 --steps 20
br lend $B --batch 16 --checkpointing
BRAID_SAVED_IN_GRADS=off br off $B --batch 16 --checkpointing
