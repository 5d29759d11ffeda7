#!/bin/bash
# Issue 17 on a 16-core GPU machine: braid's image loader (copy to GPU) vs
# PyTorch's DataLoader on the same images, scaling with threads; token
# loading from .beton vs the flat path in braid train.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid; B=/tmp/braid
A=$PWD/.dev/lanchors
R=$OUT/results.txt
exec > >(tee -a $R) 2>&1
nproc; nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__)'
# 300 images x 21 copies in distinct class folders = 6,300 images.
F=/tmp/folder; rm -rf $F; mkdir -p $F
for k in $(seq 0 20); do for c in .dev/folder/*; do cp -r $c $F/$(basename $c)_$k; done; done
find $F -type f | wc -l
echo "== braid data write (16 cores)"; $B data write /tmp/inet.beton --images $F --max-resolution 256 --mode jpg --quality 90 2>&1 | tail -1
echo "== ffcv-anchor-free: braid data load, copy to GPU"
for res in 160 192; do for t in 1 2 4 8 16; do
  echo "-- res $res threads $t"; $B data load /tmp/inet.beton --res $res --threads $t --epochs 3 --device cuda 2>&1 | tail -2
done; done
echo "-- res 160 threads 16 process cache"; $B data load /tmp/inet.beton --res 160 --threads 16 --epochs 3 --device cuda --cache process 2>&1 | tail -2
echo "-- res 160 threads 16 bf16 nchw"; $B data load /tmp/inet.beton --res 160 --threads 16 --epochs 3 --device cuda --dtype bf16 --layout nchw 2>&1 | tail -2
echo "== PyTorch DataLoader"
for res in 160 192; do for w in 2 16; do
  echo "-- res $res workers $w"; timeout 150 python3 $A/ffcv_loader_bench.py torch $F --res $res --workers $w --epochs 2 2>&1 | tail -1
done; done
