#!/usr/bin/env bash
# 1558M on one H200: save stall, async (page-locked staging made at start) vs synchronous, then load.
set -u
export NCCL_NVLS_ENABLE=0
B=$PWD/.dev/braid
CK=$PWD/.ck
COMMON="train --model 1558M --device cuda --batch 8 --seq 1024 --data random --steps 390 --save-every 130 --keep 1 --eval-every 0 --log-every 10"
rm -rf $CK; /usr/bin/time -v $B $COMMON --ckpt-dir $CK/async --json $OUT/async.json > $OUT/async.log 2>&1
echo "exit $?" >> $OUT/async.log
( time $B ckpt inspect $CK/async --verify ) > $OUT/load.log 2>&1
rm -rf $CK; $B $COMMON --ckpt-sync --ckpt-dir $CK/sync --json $OUT/sync.json > $OUT/sync.log 2>&1
echo "exit $?" >> $OUT/sync.log
rm -rf $CK
grep -h "checkpoint step\|summary: median\|Maximum resident\|Elapsed\|exit" $OUT/async.log $OUT/sync.log
tail -4 $OUT/load.log
