#!/usr/bin/env bash
# On a GPU machine with nvcc and PyTorch: times braid's fused attention
# kernels (bench.cu) and PyTorch's scaled_dot_product_attention backends
# (sdpa.py) at the same shapes. Usage: bench/flash/run.sh
set -eu
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name --format=csv,noheader
nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/braid-flash-bench bench.cu
/tmp/braid-flash-bench
python3 sdpa.py 2>&1 | grep -v Warning
