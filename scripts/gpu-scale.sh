#!/usr/bin/env bash
# The one-GPU engine at billion-parameter scale (issue 20), on the device
# machine, in one call. Parts, each logged under OUTDIR:
#   check    the GPU tests past 2^31 elements: AdamW and the norm on a flat
#            buffer of 2^31 + 3·2^20 + 4093 elements against a chunked run
#            (LARGE: the gpu_large test binary), and a 2.4B-parameter model
#            trained, saved (bf16, > 4 GiB), read back and resumed (TESTS:
#            the gpu test binary); then `braid kernels --check`;
#   profile  where the time goes (BRAID_PROFILE=1) at 1558M and 2.65B, B 8;
#   speed    braid at 1558M B 8, 2.65B B 8 and 2.65B B 16 --checkpointing,
#            then the PyTorch anchor at the same shapes (eager, --compile;
#            --act-ckpt for the checkpointed one) — tokens/s, MFU, peak memory;
#   largest  the largest model that trains at B 1, T 1024 with checkpointing
#            (LAYERS: the depths of L-H32-C4096 to try), braid and PyTorch.
# Usage: scripts/gpu-scale.sh OUTDIR PARTS   (PARTS: e.g. "check profile speed")
# Environment: BRAID, TESTS, LARGE, ANCHORS, PYTHON, STEPS, SHAPES, TORCH, LAYERS.
set -u
out=${1:?usage: gpu-scale.sh OUTDIR PARTS}
parts=${2:-"check profile speed"}
braid=${BRAID:-target/release/braid}
tests=${TESTS:-}
large=${LARGE:-}
anchors=${ANCHORS:-../shared/anchors}
py=${PYTHON:-python3}
steps=${STEPS:-25}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=${BRAID_KERNEL_CACHE:-/tmp/braid-kernel-cache}
exec > >(tee -a "$out/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
B2650=L32-H32-C2560-V50304-T1024
has() { [[ " $parts " == *" $1 "* ]]; }
summary() { grep -E "summary|GiB|error" | grep -vE "^\s*$" | tail -6; }

if has check; then
  echo "== check: flat buffers past 2^31 elements"
  [ -n "$large" ] && "$large" --nocapture 2>&1 | grep -E "^test |norm of|AdamW over|skipped|panicked|test result"
  [ -n "$tests" ] && "$tests" --test-threads 1 ${TEST_FILTER:-a_model_past} --nocapture 2>&1 \
    | grep -E "^test |losses|estimate|skipped|panicked|assert|test result"
  "$braid" kernels --check 2>&1 | tail -3
fi

if has profile; then
  for m in 1558M $B2650; do
    echo "== profile: $m, B 8 x 1024"
    BRAID_PROFILE=1 "$braid" train --device cuda --model $m --data random --batch 8 --seq 1024 \
      --steps 12 --eval-every 0 --log-every 100 2>&1 | grep -A45 "GPU time per step"
  done
fi

if has speed; then
  # SHAPES: "model batch [flags]" per run, ';'-separated; TORCH: the
  # anchor's modes (eager, compile; act-ckpt runs the B 16 shape).
  IFS=';' read -ra shapes <<< "${SHAPES:-1558M 8;$B2650 8;$B2650 16 --checkpointing}"
  for shape in "${shapes[@]}"; do
    set -- $shape
    echo "== braid: $*"
    "$braid" train --device cuda --model $1 --data random --batch $2 --seq 1024 ${3:-} \
      --steps "$steps" --eval-every 0 --log-every 100 2>&1 | summary
  done
  for mode in ${TORCH:-eager compile act-ckpt}; do
    case $mode in
      eager) runs=("1558M 8" "L32-H32-C2560 8") ;;
      compile) runs=("1558M 8 --compile" "L32-H32-C2560 8 --compile") ;;
      act-ckpt) runs=("L32-H32-C2560 16 --act-ckpt") ;;
    esac
    for r in "${runs[@]}"; do
      set -- $r
      echo "== PyTorch: $*"
      $py "$anchors/torch_gpt2_bench.py" --model $1 --B $2 ${3:-} --steps 20 2>&1 | grep -E "RESULT|Error|error" | tail -2
    done
  done
fi

if has largest; then
  # LAYERS: depths of the C4096 / 32-head model to try (0.4B apart).
  for l in ${LAYERS:-36 40 44 46}; do
    m="L$l-H32-C4096"
    echo "== largest: braid $m B 1 --checkpointing"
    "$braid" train --device cuda --model $m-V50304-T1024 --data random --batch 1 --seq 1024 \
      --checkpointing --steps 6 --eval-every 0 --log-every 100 2>&1 | summary
    echo "== largest: PyTorch $m B 1 --act-ckpt"
    $py "$anchors/torch_gpt2_bench.py" --model $m --B 1 --act-ckpt --steps 3 --warmup 2 2>&1 \
      | grep -E "RESULT|OutOfMemory|Error" | tail -2
  done
fi
echo "== done"
