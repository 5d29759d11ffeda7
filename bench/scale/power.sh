#!/usr/bin/env bash
# Power draw, SM clock and throttle reasons (nvidia-smi every 200 ms) while
# braid (GEMM tuning on and off) and PyTorch eager train the 2.65B model at
# B 8; variables as in ratio.sh.
set -u; export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
BRAID=${BRAID:-.dev/braid} TORCH_BENCH=${TORCH_BENCH:-.dev/torch_gpt2_bench.py}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,clocks.max.mem --format=csv
B=L32-H32-C2560-V50304-T1024
sample() { nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active,utilization.gpu --format=csv,noheader,nounits -lms 200 > $OUT/$1.csv & echo $!; }
summ() { python3 - "$OUT/$1.csv" <<'PY'
import sys,collections
rows=[l.strip().split(', ') for l in open(sys.argv[1]) if l.strip()]
rows=[r for r in rows if len(r)>=7 and r[6].strip().isdigit() and int(r[6])>90]
if not rows: print("no busy samples"); sys.exit()
p=[float(r[1]) for r in rows]; c=[float(r[2]) for r in rows]; t=[float(r[4]) for r in rows]
reasons=collections.Counter(r[5] for r in rows)
print(f"busy samples {len(rows)}: power mean {sum(p)/len(p):.0f} W max {max(p):.0f}; sm clock mean {sum(c)/len(c):.0f} MHz min {min(c):.0f}; temp max {max(t):.0f}; reasons {dict(reasons)}")
PY
}
for t in on off; do
  echo "== braid $B 8 tune $t"
  pid=$(sample braid-$t)
  BRAID_GEMM_TUNE=$t $BRAID train --device cuda --model $B --data random --batch 8 --seq 1024 --steps 40 --eval-every 0 --log-every 100 2>&1 | grep -E "gpu summary|error"
  kill $pid; sleep 0.5; summ braid-$t
done
echo "== PyTorch eager $B 8"
pid=$(sample torch)
python3 $TORCH_BENCH --model L32-H32-C2560 --B 8 --steps 30 2>&1 | grep -E "RESULT|Error" | tail -2
kill $pid; sleep 0.5; summ torch
