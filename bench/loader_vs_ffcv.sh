#!/bin/bash
# Issue 17's loader benchmark on a CPU machine: braid data load against the
# ffcv 1.0.2 Loader (QUASI_RANDOM, os_cache 1 and 0) on the same
# ffcv-written .beton, and PyTorch's DataLoader on the folder it was
# written from; 160 and 192 px, random-resized-crop + flip, uint8, batch
# 128, 2 workers each, 3 epochs (2 for the DataLoader), best epoch after
# the first. Rounds alternate the peers; run it on a quiet machine, from
# the repository root after `cargo build --release`:
#
#   bench/loader_vs_ffcv.sh [FOLDER] [FFCV_BETON] [ROUNDS]
#
# FOLDER: an image folder (scripts/imagenet-like/make_folder.py writes one;
# default /work/imagenet-like/train); FFCV_BETON: the .beton ffcv's
# DatasetWriter wrote from it (ffcv_loader_bench.py write; default
# /tmp/inet-ffcv.beton); ROUNDS: default 3. Environment: PY (a Python with
# ffcv, torch and torchvision; default python3), ANCHORS (the directory of
# ffcv_loader_bench.py; default ../shared/anchors), B (braid; default
# target/release/braid).
F=${1:-/work/imagenet-like/train}
D=${2:-/tmp/inet-ffcv.beton}
N=${3:-3}
A=${ANCHORS:-../shared/anchors}
PY=${PY:-python3}
B=${B:-./target/release/braid}
[ -f "$A/ffcv_loader_bench.py" ] || { echo "no $A/ffcv_loader_bench.py (set ANCHORS)" >&2; exit 2; }
uptime
nproc
for round in $(seq 1 "$N"); do
  for res in 160 192; do
    echo "== round $round res $res"
    $B data load "$D" --res $res --threads 2 --epochs 3 2> /dev/null
    $B data load "$D" --res $res --threads 2 --epochs 3 --cache process 2> /dev/null
    timeout 300 $PY "$A/ffcv_loader_bench.py" ffcv "$D" --res $res --workers 2 --os-cache 1 2> /dev/null | tail -1
    timeout 300 $PY "$A/ffcv_loader_bench.py" ffcv "$D" --res $res --workers 2 --os-cache 0 2> /dev/null | tail -1
    [ "$round" = 1 ] && timeout 300 $PY "$A/ffcv_loader_bench.py" torch "$F" --res $res --workers 2 --epochs 2 2> /dev/null | tail -1
  done
done
uptime
