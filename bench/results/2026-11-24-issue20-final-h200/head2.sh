#!/bin/bash
# Issue 20's rows at HEAD in one call on one H200: braid beside PyTorch
# eager, torch.compile and --act-ckpt.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc CUDA_VISIBLE_DEVICES=0
gunzip -c .dev/braid-head.gz > /tmp/braid && chmod +x /tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee $OUT/device.txt
br() { local m=$1; shift; timeout 120 /tmp/braid train --device cuda --model $m --data random --seq 1024 --steps 25 --eval-every 0 --log-every 100 "$@" > /tmp/run.txt 2>&1; echo "braid $m $*: $(grep -E "gpu summary|error" /tmp/run.txt | cut -c1-220)" | tee -a $OUT/bench.txt; }
pt() { (cd .dev/anchors && timeout 240 python3 torch_gpt2_bench.py "$@" 2>&1 | grep -E "RESULT|Error" | tail -1 | sed "s/^/pytorch $*: /" | tee -a $OUT/bench.txt); }
B=L32-H32-C2560-V50304-T1024
br 1558M --batch 8
pt --model 1558M --B 8 --steps 20
pt --model 1558M --B 8 --steps 20 --compile
br $B --batch 8
pt --model L32-H32-C2560 --B 8 --steps 20
pt --model L32-H32-C2560 --B 8 --steps 20 --compile
br $B --batch 16 --checkpointing
pt --model L32-H32-C2560 --B 16 --steps 20 --act-ckpt
