#!/bin/bash
# One GPU: checkpoints of an offloaded optimizer. The GPU resume test
# (its offload legs: resumed at step 10 of 20, bit for bit), then 124M
# with --offload optimizer saving every 15 steps, the checkpoint verified,
# and a run resumed from step 15 beside the uninterrupted one.
# Carry: .dev/braid.gz .dev/gpu-zero-tests.gz .dev/commit
cd "$(dirname "$0")/../../.." && source bench/device/setup.sh
timeout 300 /tmp/gpu-zero-tests --test-threads 1 --nocapture gpu_resume > "$L/resume-test.txt" 2>&1
echo "exit $?" >> "$L/resume-test.txt"
grep -E "resumed|test result|panicked|^exit" "$L/resume-test.txt"
cd /tmp || exit 1
A="train --device cuda --model 124M --data random --batch 8 --seq 1024 --offload optimizer --steps 30 --eval-every 0 --log-every 5"
timeout 150 $B $A --save-every 15 --ckpt-dir /tmp/ock --save /tmp/off-whole.safetensors > "$L/off-whole.txt" 2>&1
echo "exit $?" >> "$L/off-whole.txt"
grep -E "checkpoint|stall|step +30/|gpu summary|error|^exit" "$L/off-whole.txt" | head -12
timeout 60 $B ckpt inspect /tmp/ock --verify > "$L/off-inspect.txt" 2>&1
echo "exit $?" >> "$L/off-inspect.txt"
tail -n 5 "$L/off-inspect.txt"
timeout 150 $B $A --resume /tmp/ock/step-00000015 --save /tmp/off-resumed.safetensors > "$L/off-resumed.txt" 2>&1
echo "exit $?" >> "$L/off-resumed.txt"
grep -E "resum|step +30/|error|^exit" "$L/off-resumed.txt" | head -6
cmp /tmp/off-whole.safetensors /tmp/off-resumed.safetensors && echo "final --save files: byte-identical"
finish
