#!/bin/bash
# ZeRO-3 memory, step 2: the layers' scratch, checkpointing's block and
# the attention scratch in the gradient shard too. GPU tests; a check with
# evaluation passes between steps (lent vs apart: same saved bytes); the
# 6.56B proxy, old (df0085e) and new binaries in this call.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
for b in old new; do gunzip -c .dev/braid-$b.gz > /tmp/braid-$b && chmod +x /tmp/braid-$b; done
ln -sf /tmp/braid-new /work/main/target/release/braid
gunzip -c .dev/gpu-tests-new.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > $OUT/device.txt
cd /tmp
E="train --device cuda --model L4-H4-C128-V500-T64 --seq 64 --batch 8 --steps 8 --eval-every 2 --zero 3 --checkpointing --seed 3"
/tmp/braid-new $E --save lent.safetensors --json lent.json > $OUT/eval-lent.txt 2>&1; echo "exit $?" >> $OUT/eval-lent.txt
BRAID_SAVED_IN_GRADS=off /tmp/braid-new $E --save apart.safetensors --json apart.json > $OUT/eval-apart.txt 2>&1; echo "exit $?" >> $OUT/eval-apart.txt
cmp lent.safetensors apart.safetensors && echo "eval check: saved models identical"
python3 -c "
import json;a=json.load(open('lent.json'));b=json.load(open('apart.json'))
print('eval check: json equal apart from timings:', [k for k in a if a[k]!=b.get(k)][:12])"
grep -h "eval\|exit" $OUT/eval-lent.txt | tail -3
cd - > /dev/null
timeout 330 /tmp/gpu-tests --test-threads 1 --nocapture zero3 memory_estimate resume checkpointing > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|L12-H10|estimate" $OUT/gpu-tests.txt | head -30
M=L20-H40-C5120-V50304-T1024
run() { # name, binary, args...
  local name=$1 b=$2; shift 2
  timeout 150 /tmp/braid-$b train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing "$@" > $OUT/$name.txt 2>&1; echo "exit $?" >> $OUT/$name.txt
  echo "$name: $(grep -h 'memory estimate\|gpu summary\|ZeRO-3 besides\|exit\|error' $OUT/$name.txt | tr '\n' ' ')"
}
run z3-new new --steps 12 --zero 3 --nproc 1
run z3-old old --steps 12 --zero 3 --nproc 1
run z3-new-2 new --steps 12 --zero 3 --nproc 1
