#!/usr/bin/env bash
# Data-parallel training on the GPU machines, from binaries built here (no
# Rust toolchain there). Parts, each logged under OUTDIR:
#   check   braid kernels --check (engine and hook kernels), and the GPU
#           tests of crates/braid/tests/gpu.rs (TESTS: the test binary;
#           f32 equivalence on 2 GPUs, bf16 tracks f32, hooks, a killed rank);
#   seam    one GPU, 50 steps from seed 5: the loop before and after the
#           seam commit (OLD, SEAM binaries) must give the same losses;
#   speed   GPT-2 124M, batch 16 x 1024 per GPU, bf16: braid on 1 and 2 GPUs
#           (with and without overlap, with and without deferred weight
#           gradients), PyTorch one process, DDP eager and DDP --compile on
#           2 GPUs (ANCHORS: the directory of torch_gpt2_bench.py);
#   hooks   124M on 2 GPUs with bf16 / fp16 / PowerSGD gradients: bytes
#           per step and step time; loss curves (synthetic corpus, GPT-2
#           BPE, B 8 x 256 per GPU, 200 steps) plain vs PowerSGD vs bf16.
#   scale   PyTorch one process / DDP eager / DDP --compile on 2 GPUs, then
#           `braid scale --workers 1,2` (ROUNDS times) with PyTorch's
#           points drawn beside braid's (scale/scaling.svg, .json);
#   tune    what slows computation while gradients are reduced: NCCL's
#           CTA count (NCCL_MAX_CTAS), the compute stream's priority, and the
#           per-phase GPU time on 1 and 2 GPUs (BRAID_PROFILE=1).
# Usage: scripts/gpu-ddp.sh OUTDIR PARTS   (PARTS: e.g. "check seam speed hooks")
# Environment: BRAID, TESTS, OLD, SEAM, ANCHORS, PYTHON, ROUNDS.
set -u
out=${1:?usage: gpu-ddp.sh OUTDIR PARTS}
parts=${2:-"check seam speed hooks"}
braid=${BRAID:-.dev/braid}
tests=${TESTS:-.dev/gpu-tests}
anchors=${ANCHORS:-.dev}
py=${PYTHON:-python3}
rounds=${ROUNDS:-2}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=${BRAID_KERNEL_CACHE:-/tmp/braid-kernel-cache}
export BRAID_TIMEOUT=${BRAID_TIMEOUT:-120}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
big="--model 124M --data random --batch 16 --seq 1024 --eval-every 0 --log-every 1000"

if want check; then
  echo "== kernels --check"
  "$braid" kernels --check 2>&1 | tee "$out/kernels.txt" | tail -8
  echo "== GPU tests"
  # The test binary runs the braid binary by the path it was built with.
  exe=${TEST_BRAID_PATH:-/work/main/target/release/braid}
  if [ ! -e "$exe" ]; then mkdir -p "$(dirname "$exe")"; ln -sf "$PWD/$braid" "$exe"; fi
  "$tests" --test-threads 1 2>&1 | tee "$out/gpu-tests.txt" | grep -E "^test |test result|max \|diff\||panicked" 
fi

if want seam; then
  echo "== seam: the same losses before and after (one GPU, 50 steps, seed 5)"
  for p in f32 bf16; do
    for b in "${OLD:-.dev/braid-old}" "${SEAM:-.dev/braid-seam}"; do
      "$b" train --steps 50 --seed 5 --device cuda --precision $p --json "$out/seam-$p-$(basename "$b").json" | grep -E "^done"
    done
  done
fi

if want speed; then
  for r in $(seq "$rounds"); do
    echo "== speed round $r: braid, 124M, B=16 x 1024 per GPU, bf16"
    "$braid" train --device cuda $big --steps 30 --json "$out/speed-1gpu-$r.json" | grep -E "summary"
    "$braid" train --device cuda $big --steps 30 --nproc 2 --json "$out/speed-2gpu-$r.json" | grep -E "summary|strategy"
  done
  echo "== braid, 2 GPUs: no overlap (the same reductions after the backward pass)"
  "$braid" train --device cuda $big --steps 30 --nproc 2 --no-overlap --json "$out/speed-2gpu-nooverlap.json" | grep -E "summary"
  echo "== braid, 2 GPUs: overlap, weight gradients not deferred"
  "$braid" train --device cuda $big --steps 30 --nproc 2 --defer-layers 0 --json "$out/speed-2gpu-nodefer.json" | grep -E "summary"
  echo "== PyTorch"
  $py "$anchors/torch_gpt2_bench.py" --steps 20 2>&1 | grep RESULT
  torchrun --standalone --nproc_per_node 2 "$anchors/torch_gpt2_bench.py" --steps 20 2>&1 | grep RESULT
  torchrun --standalone --nproc_per_node 2 "$anchors/torch_gpt2_bench.py" --steps 20 --compile 2>&1 | grep RESULT
fi

if want tune; then
  echo "== tuning the overlap, 124M on 2 GPUs: NCCL's CTAs, the compute stream's priority"
  two() { "$braid" train --device cuda $big --steps 30 --nproc 2 "$@" | grep -E "median step|average step|overlap:"; }
  # TUNE: settings to try, separated by ';' (each: VAR=VALUE ...).
  IFS=';' read -ra cases <<< "${TUNE:-NCCL_MAX_CTAS=8;NCCL_MAX_CTAS=16;BRAID_MAIN_STREAM_PRIORITY=-5}"
  for v in "${cases[@]}"; do
    echo "-- $v"; (export $v; two)
  done
  if [ -n "${PROFILE:-}" ]; then
    echo "-- phases, 1 GPU then 2 GPUs (BRAID_PROFILE=1)"
    BRAID_PROFILE=1 "$braid" train --device cuda $big --steps 15 | grep -A14 "GPU time per step"
    BRAID_PROFILE=1 "$braid" train --device cuda $big --steps 15 --nproc 2 | grep -A14 "GPU time per step"
  fi
fi

if want scale; then
  echo "== scaling: PyTorch (one process, DDP eager, DDP --compile on 2 GPUs), then braid scale 1,2 with PyTorch drawn beside"
  res() { grep RESULT | sed 's/.*tok_s=\([0-9]*\).*/\1/'; }
  t1=$($py "$anchors/torch_gpt2_bench.py" --steps 20 2>&1 | tee -a "$out/torch.txt" | res)
  t2=$(torchrun --standalone --nproc_per_node 2 "$anchors/torch_gpt2_bench.py" --steps 20 2>&1 | tee -a "$out/torch.txt" | res)
  c2=$(torchrun --standalone --nproc_per_node 2 "$anchors/torch_gpt2_bench.py" --steps 20 --compile 2>&1 | tee -a "$out/torch.txt" | res)
  grep RESULT "$out/torch.txt"
  for r in $(seq "$rounds"); do
    "$braid" scale --workers 1,2 --out "$out/scale" --peer "PyTorch DDP eager=1:$t1,2:$t2" --peer "PyTorch DDP + compile=2:$c2" \
      -- $big --device cuda --steps 30 2>&1 | grep -E "^ +[0-9]|workers|summary: (overlap|an average)"
  done
fi

if want hooks; then
  echo "== hooks, 124M on 2 GPUs: bytes and step time"
  for h in bf16 fp16 powersgd:1:5 powersgd:4:5; do
    echo "-- $h"
    "$braid" train --device cuda $big --steps 30 --nproc 2 --grad-comm $h --json "$out/hook-${h//:/_}.json" | grep -E "summary"
  done
  echo "== loss curves: 124M, synthetic corpus (GPT-2 BPE), B 8 x 256 per GPU, 2 GPUs, 200 steps"
  for h in plain powersgd:1:10 powersgd:4:10 bf16; do
    "$braid" train --device cuda --nproc 2 --model 124M --tokenizer gpt2 --batch 8 --seq 256 \
      --steps 200 --lr 6e-4 --warmup 20 --log-every 50 --grad-comm $h \
      --json "$out/curve-${h//:/_}.json" | grep -E "^step|done|communication per step"
  done
fi
echo "== done"
