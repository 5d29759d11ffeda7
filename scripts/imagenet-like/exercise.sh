#!/usr/bin/env bash
# The course's data-loading exercise ("Create an FFCV .beton dataset for
# ImageNet") on the offline ImageNet-like folder: write the .beton, look
# into it (text, JSON, a contact sheet), then load it at 160 and 192 px
# with random-resized-crop and flips through both caches, in the order
# FFCV trains in.
#
#   scripts/imagenet-like/exercise.sh [FOLDER] [OUT_DIR]
#
# FOLDER defaults to /work/imagenet-like/train (make it with
# make_folder.py, see README.md); OUT_DIR to a temporary directory. Uses
# ./target/release/braid (cargo build --release --bins).
set -euo pipefail
FOLDER=${1:-/work/imagenet-like/train}
OUT=${2:-$(mktemp -d)}
BRAID=${BRAID:-./target/release/braid}
if [ ! -d "$FOLDER" ]; then
  echo "no image folder at $FOLDER: build one with scripts/imagenet-like/make_folder.py (README.md beside this script)" >&2
  exit 1
fi
mkdir -p "$OUT"
echo "== 1. write: ImageNet layout -> image + label fields, JPEG at max resolution 256 (FFCV's ImageNet recipe)"
"$BRAID" data write "$OUT/train.beton" --images "$FOLDER" --max-resolution 256 --mode jpg --quality 90
echo "== 2. inspect: header, fields, pages, bytes per field, first samples"
"$BRAID" data inspect "$OUT/train.beton" --samples 2
"$BRAID" data inspect "$OUT/train.beton" --json --samples 1
"$BRAID" data inspect "$OUT/train.beton" --sheet "$OUT/first-images.png" --sheet-count 32
echo "== 3. load: quasi-random order, random-resized-crop + flip, uint8 NHWC batches of 128"
for res in 160 192; do
  "$BRAID" data load "$OUT/train.beton" --res "$res" --epochs 3
done
echo "== 4. the process cache (pages read once per epoch into a bounded pool) and bf16 NCHW batches"
"$BRAID" data load "$OUT/train.beton" --res 160 --epochs 2 --cache process --dtype bf16 --layout nchw
echo "outputs in $OUT (train.beton, first-images.png)"
