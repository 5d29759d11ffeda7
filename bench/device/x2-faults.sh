#!/bin/bash
# 2 GPUs (nvidia-h200-x2): the 2-GPU points of issues 15 and 16, in two
# device calls (the device tool stops a command at 600 s):
#   bash bench/device/x2-faults.sh faults
#     - issue 15: the GPU fault tests (a SIGSTOP'd rank named within the
#       timeout; a SIGKILL'd rank restarted from its checkpoint ending
#       with the uninterrupted run's parameters, data parallel and
#       ZeRO-3; a 4-CPU-rank ZeRO-3 checkpoint resumed on 2 GPUs, then on
#       one);
#     - issue 16: a traced 124M data-parallel run on 2 GPUs, its report,
#       the report's exposed communication beside the run's own summary;
#     - `braid verify --device cuda --np 2` (every collective and dtype).
#   bash bench/device/x2-faults.sh tests
#     - every GPU test (gpu.rs, gpu_zero.rs), the 2-GPU legs included;
#       `braid verify` again where the call has time left.
# Carry: .dev/braid.gz .dev/gpu-tests.gz .dev/gpu-zero-tests.gz
# .dev/gpu-faults-tests.gz .dev/commit .dev/built-at (bench/device/pack.sh makes them).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
[ "$(nvidia-smi -L | grep -c GPU)" = 2 ] || echo "warning: not 2 GPUs"
case ${1:-} in
faults)
  timeout 280 /tmp/gpu-faults-tests --test-threads 1 --nocapture > "$L/gpu-faults.txt" 2>&1
  echo "exit $?" >> "$L/gpu-faults.txt"
  echo "== gpu-faults"
  grep -E "^test |test result|panicked|skipped|rank|exit" "$L/gpu-faults.txt" | head -60
  cd /tmp
  A="train --device cuda --nproc 2 --model 124M --batch 16 --seq 1024 --data random --steps 50 --eval-every 0 --log-every 10"
  timeout 100 $B $A --trace /tmp/tr2 > "$L/traced.txt" 2>&1
  echo "== traced 124M on 2 GPUs: the run's own summary"
  grep -E "summary|exposed|error" "$L/traced.txt"
  timeout 40 $B report /tmp/tr2 > "$L/report.txt" 2>&1
  timeout 40 $B report /tmp/tr2 --json > "$L/report.json" 2>&1
  timeout 40 $B report /tmp/tr2 --html "$L/report.html" > /dev/null 2>&1
  echo "== braid report"
  grep -iE "overlap|exposed|straggler|bottleneck" "$L/report.txt" | head -20
  tar czf "$L/trace.tgz" -C /tmp tr2
  # The device tool stops a command at 600 s: verify only with time left.
  if [ $SECONDS -lt 440 ]; then
    timeout 120 $B verify --device cuda --np 2 > "$L/verify.txt" 2>&1
    echo "exit $?" >> "$L/verify.txt"
    echo "== verify"
    tail -n 6 "$L/verify.txt"
  else
    echo "== verify skipped: $SECONDS s gone (run it in the tests call)"
  fi
  cd - > /dev/null
  ;;
tests)
  for t in gpu-tests gpu-zero-tests; do
    timeout 250 /tmp/$t --test-threads 1 > "$L/$t.txt" 2>&1
    echo "exit $?" >> "$L/$t.txt"
    echo "== $t"
    grep -E "test result|FAILED|panicked|exit" "$L/$t.txt" | head -20
  done
  if [ $SECONDS -lt 440 ]; then
    timeout 120 $B verify --device cuda --np 2 > "$L/verify-2.txt" 2>&1
    echo "exit $?" >> "$L/verify-2.txt"
    echo "== verify (again)"
    tail -n 6 "$L/verify-2.txt"
  fi
  ;;
*)
  echo "usage: x2-faults.sh faults|tests" >&2
  exit 2
  ;;
esac
finish
