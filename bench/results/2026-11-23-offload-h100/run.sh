#!/bin/bash
# Offload measurements on one GPU (issue 14), with DeepSpeed ZeRO-Offload as the peer.
export NCCL_NVLS_ENABLE=0
B=$PWD/.dev/braid
{ nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv; free -g; nproc; } > $OUT/machine.txt 2>&1
watch_run() { # name, timeout, args... ; peak host memory of the process tree's largest member
  local name=$1 t=$2; shift 2
  timeout $t "$@" > $OUT/$name.txt 2>&1 &
  local pid=$!
  local peak=0
  while kill -0 $pid 2>/dev/null; do
    for p in $(pgrep -g $(ps -o pgid= $pid | tr -d ' ') 2>/dev/null); do
      h=$(awk '/VmHWM/{print $2}' /proc/$p/status 2>/dev/null); h=${h:-0}
      [ "$h" -gt "$peak" ] && peak=$h
    done
    sleep 1
  done
  wait $pid; echo "exit $?" >> $OUT/$name.txt
  echo "peak host resident set (VmHWM, largest process): $((peak/1024)) MiB" >> $OUT/$name.txt
}
M6=L40-H28-C3584-V50304-T1024
M3=L32-H20-C2560-V50304-T1024
COMMON="--device cuda --data random --batch 8 --seq 1024 --checkpointing --eval-every 0 --log-every 1"
timeout 120 $B train $COMMON --model $M6 --steps 1 > $OUT/refused.txt 2>&1; echo "exit $?" >> $OUT/refused.txt
watch_run big 300 $B train $COMMON --model $M6 --steps 8 --warmup 2 --offload optimizer
watch_run mid-offload 200 $B train $COMMON --model $M3 --steps 10 --warmup 2 --offload optimizer
watch_run mid-gpu 200 $B train $COMMON --model $M3 --steps 10 --warmup 2
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/anchors/wheels/*.whl > $OUT/ds.txt 2>&1
export PYTHONPATH=/tmp/site
watch_run ds 330 torchrun --standalone --nproc_per_node=1 .dev/anchors/ds_gpt2_bench.py --zero 2 --offload optimizer --act-ckpt --model L32-H20-C2560 --B 8 --T 1024 --steps 8 --warmup 3
grep -h "RESULT\|summary\|offloaded\|error\|Error\|exit\|peak host" $OUT/*.txt | tail -40
