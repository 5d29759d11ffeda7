#!/bin/bash
# Host memory and start-up of the one-GPU ZeRO-3 proxy after the host fixes
# (init in the padded layout, checksum in pieces, host copy dropped), and
# the GPU tests.
export NCCL_NVLS_ENABLE=0
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid
mkdir -p /work/main/target/release && ln -sf /tmp/braid /work/main/target/release/braid
B=/tmp/braid
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for l in sys.stdin: sys.stdout.write("%7.2f %s" % (time.time() - t0, l))'; }
timeout 420 .dev/gpu-tests --test-threads 1 > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -h "test result\|exit\|FAILED\|panicked" $OUT/gpu-tests.txt | head
M=L20-H40-C5120-V50304-T1024
run() { # name, args...
  local name=$1; shift
  { /usr/bin/time -v timeout 280 $B train --device cuda --data random --seq 1024 --eval-every 0 --log-every 2 "$@" 2>&1; echo "exit $?"; } | stamp > $OUT/$name.txt
  echo "$name: $(grep -h 'initialised\|copied\|memory estimate\|step     1/\|gpu summary\|exit\|error\|Maximum resident\|Elapsed' $OUT/$name.txt | tr '\n' ' ')"
}
run z3 --model $M --batch 8 --steps 8 --checkpointing --zero 3 --nproc 1
run one --model $M --batch 8 --steps 8 --checkpointing
