#!/bin/bash
# Same-call figures at fbed056 on one H200: the 6.56B ZeRO-3 proxy beside
# FSDP2 over one rank; 2.65B B 8 beside PyTorch eager and torch.compile.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
M=L20-H40-C5120-V50304-T1024
timeout 150 /tmp/braid train --device cuda --data random --seq 1024 --eval-every 0 --log-every 100 --model $M --batch 8 --checkpointing --steps 12 --zero 3 --nproc 1 > $OUT/z3-proxy.txt 2>&1; echo "exit $?" >> $OUT/z3-proxy.txt
grep -h "memory estimate\|gpu summary\|besides\|exit" $OUT/z3-proxy.txt
(cd .dev/anchors && timeout 200 torchrun --nproc_per_node 1 torch_gpt2_bench.py --fsdp --act-ckpt --model L20-H40-C5120 --B 8 --steps 5 --warmup 3 > $OUT/fsdp2-proxy.txt 2>&1; echo "exit $?" >> $OUT/fsdp2-proxy.txt)
grep -h "RESULT\|exit\|Error" $OUT/fsdp2-proxy.txt | tail -2
B=L32-H32-C2560-V50304-T1024
timeout 90 /tmp/braid train --device cuda --model $B --data random --batch 8 --seq 1024 --steps 25 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error" | tee $OUT/braid-2.65b.txt
(cd .dev/anchors && timeout 90 python3 torch_gpt2_bench.py --model L32-H32-C2560 --B 8 --steps 20 2>&1 | grep -E "RESULT|Error" | tail -1 | tee $OUT/eager-2.65b.txt)
(cd .dev/anchors && timeout 200 python3 torch_gpt2_bench.py --model L32-H32-C2560 --B 8 --steps 20 --compile 2>&1 | grep -E "RESULT|Error" | tail -1 | tee $OUT/compile-2.65b.txt)
