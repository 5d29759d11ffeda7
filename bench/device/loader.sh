#!/bin/bash
# One GPU machine's CPUs (nvidia-h100-x1: 16 cores), issue 17, one device
# call (about 4 minutes):
#   - an image folder of COPIES (default 21) copies of .dev/folder's class
#     folders, each copy its own classes (300 images x 21 = 6,300), written
#     to a .beton by `braid data write --images` (max resolution 256, JPEG
#     q90) on every core;
#   - `braid data load` of it with the copy to the GPU (--device cuda), at
#     160 and 192 px and 1, 2, 4, 8, 16 threads (THREADS), 3 epochs; at 16
#     threads also through the process cache and as bf16 NCHW;
#   - PyTorch's DataLoader on the folder (ffcv_loader_bench.py torch, no
#     copy to the GPU) with 2 and 16 workers;
#   - GPT-2 124M (bf16, batch 16 x 1024, 60 steps) from random tokens in
#     memory against the same tokens written to a .beton, twice each
#     (TOKENS=0 leaves this out).
# .dev/folder: a small ImageNet-like folder, e.g. 3 images per class:
#   python3 scripts/imagenet-like/make_folder.py /tmp/inet --images 300
#   cp -r /tmp/inet/train .dev/folder
# Carry: .dev/braid.gz .dev/commit .dev/anchors .dev/folder
# (bench/device/pack.sh makes the first three).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
[ -d .dev/folder ] || { echo "loader.sh: no .dev/folder (see its header)" >&2; exit 2; }
exec > >(tee -a "$L/loader.txt") 2>&1
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
F=/tmp/folder
rm -rf "$F" && mkdir -p "$F"
for k in $(seq 0 $((${COPIES:-21} - 1))); do
  for c in .dev/folder/*/; do cp -r "$c" "$F/$(basename "$c")_$k"; done
done
echo "$(find "$F" -type f | wc -l) images"
echo "== braid data write ($(nproc) cores)"
$B data write /tmp/inet.beton --images "$F" --max-resolution 256 --mode jpg --quality 90 2>&1 | tail -n 1
echo "== braid data load, copied to the GPU"
for res in 160 192; do
  for t in ${THREADS:-1 2 4 8 16}; do
    echo "-- res $res threads $t"
    $B data load /tmp/inet.beton --res "$res" --threads "$t" --epochs 3 --device cuda 2>&1 | tail -n 2
  done
done
echo "-- res 160 threads 16, process cache"
$B data load /tmp/inet.beton --res 160 --threads 16 --epochs 3 --device cuda --cache process 2>&1 | tail -n 2
echo "-- res 160 threads 16, bf16 NCHW"
$B data load /tmp/inet.beton --res 160 --threads 16 --epochs 3 --device cuda --dtype bf16 --layout nchw 2>&1 | tail -n 2
echo "== PyTorch DataLoader"
for res in 160 192; do
  for w in 2 16; do
    echo "-- res $res workers $w"
    timeout 150 python3 "$ANCHORS/ffcv_loader_bench.py" torch "$F" --res "$res" --workers "$w" --epochs 2 2>&1 | tail -n 1
  done
done
if [ "${TOKENS:-1}" != 0 ]; then
  echo "== tokens: braid train from memory and from a .beton, 124M B 16 x 1024"
  $B data write /tmp/tok.beton --tokens random --seq 1024 --tokenizer gpt2 --seed 1337 2>&1 | tail -n 1
  for k in 1 2; do
    for d in random /tmp/tok.beton; do
      echo "-- round $k, data $d"
      $B train --model 124M --device cuda --batch 16 --seq 1024 --steps 60 --log-every 60 --eval-every 0 \
        --data "$d" 2>&1 | grep -E "summary|final|error"
    done
  done
fi
echo "loader.sh: ${SECONDS} s"
finish
