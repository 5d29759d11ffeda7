#!/bin/bash
# Where the device memory peaks, part by part: the 6.56B proxy under
# ZeRO-3 over one rank (checkpointing), and 1558M in one process.
export NCCL_NVLS_ENABLE=0 BRAID_KERNEL_CACHE=/tmp/kc
gunzip -c .dev/braid-ph.gz > /tmp/braid && chmod +x /tmp/braid
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
show() {
python3 - "$1" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
G=2**30
print("peak", round(d["peak_device_bytes"]/G,3), "GiB in", d["peak_device_part"])
parts=d["device_memory_by_part"]
for p in parts:
    print("   %-36s %8.3f" % (p["part"], p["most_bytes"]/G))
PY
}
M=L20-H40-C5120-V50304-T1024
timeout 300 /tmp/braid train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model $M --batch 8 --checkpointing --steps 4 --zero 3 --nproc 1 --json $OUT/proxy.json > $OUT/proxy.txt 2>&1; echo "exit $?"
grep -E "estimate|gpu summary|device memory|error" $OUT/proxy.txt
show $OUT/proxy.json | head -80
timeout 200 /tmp/braid train --device cuda --data random --seq 1024 --eval-every 0 --log-every 4 --model 1558M --batch 8 --steps 4 --json $OUT/xl.json > $OUT/xl.txt 2>&1; echo "exit $?"
grep -E "estimate|gpu summary|device memory|error" $OUT/xl.txt
show $OUT/xl.json | sort -k2 -n -r | head -12
