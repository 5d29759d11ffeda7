#!/usr/bin/env bash
# The GPU training engine on the device machine, in one call:
#   1. braid kernels --check (f32 and bf16 kernels vs the CPU engine);
#   2. f32: 50 steps of the tiny model from seed 5 on CPU and GPU (same
#      loss curve expected);
#   3. bf16 vs f32 loss curves: 124M on the synthetic corpus (GPT-2 BPE);
#   4. throughput: GPT-2 124M, B=16, T=1024, bf16, braid and the PyTorch
#      anchor (eager and --compile) in the same call.
# Usage: scripts/gpu-train.sh OUTDIR [BRAID] [ANCHORS]   (results under OUTDIR)
set -u
out=${1:?usage: gpu-train.sh OUTDIR [BRAID] [ANCHORS]}
braid=${2:-target/release/braid}
anchors=${3:-../shared/anchors}
py=${PYTHON:-python3}
steps=${LOSS_STEPS:-200}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=${BRAID_KERNEL_CACHE:-/tmp/braid-kernel-cache}
exec > >(tee "$out/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "== kernels --check"
"$braid" kernels --check

echo "== f32: tiny, 50 steps, seed 5, CPU vs GPU"
"$braid" train --steps 50 --seed 5 --json "$out/tiny-f32-cpu.json" | tail -1
"$braid" train --steps 50 --seed 5 --device cuda --precision f32 --json "$out/tiny-f32-gpu.json" | tail -3
"$braid" train --steps 50 --seed 5 --device cuda --precision bf16 --json "$out/tiny-bf16-gpu.json" | tail -3

echo "== throughput: 124M, B=16, T=1024, bf16"
"$braid" train --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 25 --log-every 5
echo "== the same without the fused epilogues, then also without the fused attention"
BRAID_FUSED_EPILOGUES=0 "$braid" train --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 25 --log-every 100 | grep summary
BRAID_FUSED_EPILOGUES=0 BRAID_ATTENTION=batched "$braid" train --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 25 --log-every 100 | grep summary
echo "== where the time goes (BRAID_PROFILE=1)"
BRAID_PROFILE=1 "$braid" train --device cuda --model 124M --data random --batch 16 --seq 1024 --steps 12 --log-every 100 | grep -A40 "GPU time per step"
$py "$anchors/torch_gpt2_bench.py" --steps 20 2>&1 | tail -2
$py "$anchors/torch_gpt2_bench.py" --steps 20 --compile 2>&1 | tail -2

echo "== loss curves: 124M, synthetic (gpt2 BPE), B=8, T=256, $steps steps, bf16 vs f32"
for p in bf16 f32; do
  "$braid" train --device cuda --precision $p --model 124M --tokenizer gpt2 --batch 8 --seq 256 \
    --steps "$steps" --lr 6e-4 --warmup 20 --log-every 50 --json "$out/124M-$p-loss.json" | tail -4
done
echo "== done"
