#!/usr/bin/env bash
# What bounds data-parallel scaling on this machine, with no communication
# in the picture: GPT-2 124M (B 16 x 1024, bf16) on GPU 0 alone, then on
# both GPUs at once as two independent runs, then data-parallel with and
# without overlap; SM clock and power sampled throughout (nvidia-smi).
# Usage: scripts/gpu-ddp-bound.sh OUTDIR [BRAID]
set -u
out=${1:?usage: gpu-ddp-bound.sh OUTDIR [BRAID]}
braid=${2:-.dev/braid}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=${BRAID_KERNEL_CACHE:-/tmp/braid-kernel-cache}
big="--device cuda --model 124M --data random --batch 16 --seq 1024 --eval-every 0 --log-every 1000 --steps 40"
nvidia-smi --query-gpu=index,timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 > "$out/smi.csv" &
smi=$!
mark() { echo "$1 $(date +%s.%N)" >> "$out/marks.txt"; }
med() { grep -o "median step [0-9.]* ms" | head -1; }
mark alone-start
echo "GPU 0 alone:        $("$braid" train $big | med)"
mark both-start
CUDA_VISIBLE_DEVICES=0 "$braid" train $big > "$out/both0.txt" &
first=$!
CUDA_VISIBLE_DEVICES=1 "$braid" train $big > "$out/both1.txt"
wait $first; sleep 1
echo "GPU 0 beside GPU 1: $(med < "$out/both0.txt"); GPU 1 beside GPU 0: $(med < "$out/both1.txt")"
mark ddp-start
echo "DDP, overlap:       $("$braid" train $big --nproc 2 | med)"
mark ddp-plain-start
echo "DDP, no overlap, nothing deferred: $("$braid" train $big --nproc 2 --no-overlap --defer-layers 0 | med)"
mark end
kill $smi
python3 - "$out" <<'PY'
import sys, csv, datetime
out = sys.argv[1]
marks = [l.split() for l in open(f"{out}/marks.txt")]
rows = []
for r in csv.reader(open(f"{out}/smi.csv")):
    r = [x.strip() for x in r]
    t = datetime.datetime.strptime(r[1], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    rows.append((int(r[0]), t, float(r[2].split()[0]), float(r[4].split()[0])))
for (name, a), (_, b) in zip(marks, marks[1:]):
    a, b = float(a), float(b)
    for g in (0, 1):
        sel = [x for x in rows if x[0] == g and a + 8 < x[1] < b - 1 and x[3] > 150]
        if sel:
            print(f"{name:16} GPU {g}: busy samples {len(sel):3}, SM clock {sum(x[2] for x in sel)/len(sel):6.0f} MHz, power {sum(x[3] for x in sel)/len(sel):5.0f} W")
PY
