#!/usr/bin/env bash
# braid against PyTorch eager on one GPU, in turns (2.65B B 8 three times,
# 1558M B 8, 2.65B B 16 with checkpointing). On a GPU machine, from the
# repository root: BRAID=path/to/braid TORCH_BENCH=path/to/torch_gpt2_bench.py
# bench/scale/ratio.sh
set -u; export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc CUDA_VISIBLE_DEVICES=0
BRAID=${BRAID:-.dev/braid} TORCH_BENCH=${TORCH_BENCH:-.dev/torch_gpt2_bench.py}
nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader
B=L32-H32-C2560-V50304-T1024
for r in 1 2 3; do
  echo "== round $r: braid $B 8"
  $BRAID train --device cuda --model $B --data random --batch 8 --seq 1024 --steps 25 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error"
  echo "== round $r: PyTorch eager L32-H32-C2560 8"
  python3 $TORCH_BENCH --model L32-H32-C2560 --B 8 --steps 20 2>&1 | grep -E "RESULT|Error" | tail -1
done
echo "== braid 1558M 8"
$BRAID train --device cuda --model 1558M --data random --batch 8 --seq 1024 --steps 25 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error"
echo "== PyTorch eager 1558M 8"
python3 $TORCH_BENCH --model 1558M --B 8 --steps 20 2>&1 | grep -E "RESULT|Error" | tail -1
echo "== braid $B 16 --checkpointing"
$BRAID train --device cuda --model $B --data random --batch 16 --seq 1024 --checkpointing --steps 25 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error"
echo "== PyTorch eager L32-H32-C2560 16 --act-ckpt"
python3 $TORCH_BENCH --model L32-H32-C2560 --B 16 --act-ckpt --steps 20 2>&1 | grep -E "RESULT|Error" | tail -1
