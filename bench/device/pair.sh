#!/bin/bash
# Two device scripts in one call: one that needs the machine's CPU cores
# and no GPU (the parameter server's runs, ps.sh) beside one that needs the
# GPU and little CPU (one.sh's phases), so a short device budget serves
# both. The CPU job gets cores 2 and up, the GPU job cores 0-1 (taskset);
# each is stopped at PAIR_LIMIT seconds (default 420) from the start.
#
#   PAIR_CPU="ps.sh converge transient" PAIR_GPU="one.sh fp8" bash bench/device/pair.sh
#
# Each job's settings pass through the environment as usual (PS_*, FP8_*;
# the GPU job's ONE_LIMIT is cut to the time the pair has left).
# PAIR_H200_FIRST="one.sh calibrate": on an H200, that phase runs first,
# alone (the host's AdamW is timed with no job beside it), under
# ONE_LIMIT=PAIR_FIRST_LIMIT (default 150), and the pair gets the time
# left.
# Each job's output is in $L/pair-cpu.txt and $L/pair-gpu.txt (the last
# lines printed); both jobs' logs come back in $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
. bench/device/setup.sh
limit=${PAIR_LIMIT:-420}
cores=$(nproc)
# Pinned apart where there are cores to spare (not on a small machine).
cpu_pin=() gpu_pin=()
if [ "$cores" -ge 4 ]; then
  cpu_pin=(taskset -c "2-$((cores - 1))") gpu_pin=(taskset -c 0-1)
fi
if [ -n "${PAIR_H200_FIRST:-}" ] && grep -q H200 "$L/device.txt"; then
  first=${PAIR_FIRST_LIMIT:-150}
  # shellcheck disable=SC2086 # a script and its phase, split
  ONE_LIMIT=$first timeout -k 10 $((first + 30)) bash bench/device/$PAIR_H200_FIRST 2>&1 |
    tail -n 30
fi
left=$((limit - SECONDS))
if [ -n "${PAIR_CPU:-}" ]; then
  # shellcheck disable=SC2086
  timeout -k 10 "$left" "${cpu_pin[@]}" bash bench/device/$PAIR_CPU \
    > "$L/pair-cpu.txt" 2>&1 &
  # The CPU job unpacks .dev/ first (setup.sh); the GPU job's unpacking
  # then finds the binaries busy and leaves them as they are.
  sleep 5
fi
if [ -n "${PAIR_GPU:-}" ]; then
  gpu_limit=$((left - 20))
  [ "${ONE_LIMIT:-540}" -lt "$gpu_limit" ] && gpu_limit=${ONE_LIMIT:-540}
  # shellcheck disable=SC2086
  ONE_LIMIT=$gpu_limit timeout -k 10 $((left - 5)) "${gpu_pin[@]}" bash bench/device/$PAIR_GPU \
    > "$L/pair-gpu.txt" 2>&1
  echo "== GPU job ($PAIR_GPU): exit $?"
  tail -n 60 "$L/pair-gpu.txt"
fi
wait
echo "== CPU job (${PAIR_CPU:-none})"
tail -n 45 "$L/pair-cpu.txt" 2> /dev/null
echo "pair.sh: ${SECONDS} s"
finish
