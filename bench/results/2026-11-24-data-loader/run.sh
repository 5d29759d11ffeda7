#!/bin/bash
# Issue 17's loader benchmark on the 2-core machine: braid data load vs the
# real ffcv 1.0.2 Loader (QUASI_RANDOM, os_cache 1 and 0) on the same
# ffcv-written .beton, and PyTorch's DataLoader on the folder it was
# written from; 160 and 192 px, random-resized-crop + flip, uint8, batch
# 128, 2 workers each, 3 epochs (2 for the DataLoader), best epoch after
# the first. Rounds alternate the peers; run it on a quiet machine.
#   bench/results/2026-11-24-data-loader/run.sh FOLDER FFCV_BETON ROUNDS
F=${1:-/work/imagenet-like/train}; D=${2:-/tmp/inet-ffcv.beton}; N=${3:-3}
A=$(dirname "$0")/../../../../shared/anchors; [ -f $A/ffcv_loader_bench.py ] || A=/work/shared/anchors
PY=/work/ffcv-venv/bin/python; B=./target/release/braid
uptime; nproc
for round in $(seq 1 $N); do for res in 160 192; do
  echo "== round $round res $res"
  $B data load $D --res $res --threads 2 --epochs 3 2>/dev/null
  $B data load $D --res $res --threads 2 --epochs 3 --cache process 2>/dev/null
  timeout 300 $PY $A/ffcv_loader_bench.py ffcv $D --res $res --workers 2 --os-cache 1 2>/dev/null | tail -1
  timeout 300 $PY $A/ffcv_loader_bench.py ffcv $D --res $res --workers 2 --os-cache 0 2>/dev/null | tail -1
  [ $round = 1 ] && timeout 300 $PY $A/ffcv_loader_bench.py torch $F --res $res --workers 2 --epochs 2 2>/dev/null | tail -1
done; done
uptime
