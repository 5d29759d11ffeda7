#!/bin/bash
# Pipeline parallelism on 2 or 4 GPUs (issue 47). One phase per device
# call (the device tool stops a command at 600 s; a phase stops starting
# runs when its PP_LIMIT seconds, default 540, would be passed):
#
#   bash bench/device/pp.sh tests
#     the pipeline GPU tests (gpu_pp.rs: every schedule at --pp 2 and 4
#     against one GPU, 1F1B tracking one GPU over 60 steps).
#   bash bench/device/pp.sh bench
#     bf16 on 4 GPUs, global batch 16 x 1024 in 8 micro-batches, the 2.65B
#     model (L32-H32-C2560-V50304-T1024): braid --pp 4 beside PyTorch's
#     pipelining (anchors/torch_pp_bench.py), 1F1B then interleaved (2
#     stages per rank), each pair in this call.
#   bash bench/device/pp.sh more
#     the same for GPipe and the zero-bubble schedules (braid's ZB-H1,
#     PyTorch's interleaved zero bubble), and PyTorch's interleaved alone
#     (PP_PEER=interleaved).
#   bash bench/device/pp.sh h2
#     braid alone at 2.65B, 8 micro-batches: the zero-bubble schedules
#     PP_H2_SCHEDULES (default: ZB-H1 and ZB-H2, "zb zb-h2") in turns
#     PP_H2_ROUNDS times (default 2), each run's measured idle and
#     activations held; then PyTorch's schedules PP_H2_PEERS (default its
#     best and its zero bubble, "gpipe zb"; empty skips them).
#   bash bench/device/pp.sh bubble
#     braid alone, the 2.65B model on 4 GPUs, 8 steps of each schedule:
#     the timeline chart of the last step and the measured idle fraction
#     beside the theory's. PP_BUBBLE_MODEL (e.g. L30-H32-C2560: 30 layers
#     and the head split over 4 or 8 stages within 1.5 % of equal, where
#     32 layers leave one stage 7 % over), PP_BUBBLE_MB micro-batches and
#     PP_BUBBLE_BATCH the global batch change the run; PP_SCHEDULES the
#     schedules.
#   bash bench/device/pp.sh big
#     the 12.85B model (L40-H40-C5120) on 4 GPUs, batch 16 x 1024 in 8
#     micro-batches with activation checkpointing: braid --pp 4 1F1B beside
#     PyTorch 1F1B (PP_BIG_PEER= skips the peer); PP_STREAMED=1 adds braid
#     with its bf16 weights cast layer by layer.
#   bash bench/device/pp.sh two
#     the 2.65B pairs of `bench` on 2 of the GPUs (--pp 2): 1F1B and
#     interleaved, beside PyTorch's (ANCHORS.md has its 2-H200 figures);
#     with TWO_BIG=1 (H200s) the 12.85B 1F1B pair with checkpointing.
#   bash bench/device/pp.sh layouts
#     the 12.85B model on 4 GPUs, global batch 16 x 1024 with activation
#     checkpointing, braid alone in each 3-D layout that fits (PP_LAYOUTS,
#     by default --pp 4 with 1F1B and with interleaved zero bubble; --tp 2
#     --pp 2; --pp 2 x data 2 with ZeRO-1; --tp 4 with sequence
#     parallelism, its default, lighter and faster than --no-sp at this
#     size; --zero 3): the best beside ZeRO-3.
#
# Logs under $L (in $OUT/logs.tgz). Carry: .dev/braid.gz .dev/commit .dev/built-at
# .dev/gpu-pp-tests.gz, and for bench and big .dev/anchors (made by
# bench/device/pack.sh).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
LIMIT=${PP_LIMIT:-540}
NPROC=${PP_GPUS:-4}

left() { echo $((LIMIT - SECONDS)); }

# Each GPU's SM clock, temperature, power and throttle reasons every 2 s
# into $L/NAME-smi.txt while a run goes (`watch_gpus NAME`, then
# `unwatch_gpus`), and a line per GPU of the lowest clock and the hottest
# reading: a rank whose GPU slows down shows here, not only in the chart.
watch_gpus() {
  SMI_FILE="$L/$1-smi.txt"
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 2000 > "$SMI_FILE" 2>&1 &
  SMI_PID=$!
}
unwatch_gpus() {
  kill "$SMI_PID" 2>/dev/null
  wait "$SMI_PID" 2>/dev/null
  awk -F', ' 'NF >= 6 { i = $2; if (!(i in lo) || $3 < lo[i]) lo[i] = $3; if ($4 > hot[i]) hot[i] = $4;
      if ($6 != "0x0000000000000000" && $6 != "0x0000000000000001") th[i] = $6 }
    END { for (i in lo) printf "  GPU %s: lowest SM clock %s MHz, hottest %s C%s\n", i, lo[i], hot[i],
      (i in th) ? ", throttled (" th[i] ")" : "" }' "$SMI_FILE" | sort
}

phase_tests() {
  local t
  t=$(left)
  [ -x /tmp/gpu-pp-tests ] || { echo "gpu-pp: not carried"; return; }
  timeout -k 10 "$t" /tmp/gpu-pp-tests --test-threads 1 --nocapture > "$L/gpu-pp.txt" 2>&1
  echo "exit $?" >> "$L/gpu-pp.txt"
  grep -E "^test |test result|panicked|max \|diff\||bf16|^exit|error" "$L/gpu-pp.txt" | cut -c1-300
}

# braid and the PyTorch peer on the same model and schedule: NAME, MODEL,
# braid's extra arguments, the peer's arguments, the time limit of each.
pair() {
  local name=$1 model=$2 ours=$3 theirs=$4 cap=${5:-200} t
  [ "$ours" = "-" ] && { peer "$name" "$model" "$theirs" "$cap"; return; }
  t=$(left)
  [ "$t" -ge 60 ] || { echo "$name: skipped ($t s left)"; return; }
  [ "$t" -gt "$cap" ] && t=$cap
  watch_gpus "$name-braid"
  # shellcheck disable=SC2086 # word lists
  timeout -k 10 "$t" "$B" train --device cuda --model "$model-V50304-T1024" --data random \
    --global-batch 16 --seq 1024 --steps 12 --eval-every 0 --log-every 4 --nproc-per-node "$NPROC" \
    --pp "$NPROC" --micro-batches 8 $ours > "$L/$name-braid.txt" 2>&1
  echo "$name braid ($ours): exit $? | $(grep -h 'gpu summary' "$L/$name-braid.txt" | sed 's/.*gpu summary: //')"
  unwatch_gpus
  grep -h 'error' "$L/$name-braid.txt" | head -3 | cut -c1-400
  [ -n "$theirs" ] || return
  peer "$name" "$model" "$theirs" "$cap"
}

# The PyTorch peer alone: NAME, MODEL, its arguments, the time limit.
peer() {
  local name=$1 model=$2 theirs=$3 cap=$4 t
  t=$(left)
  [ "$t" -ge 60 ] || { echo "$name peer: skipped ($t s left)"; return; }
  [ "$t" -gt "$cap" ] && t=$cap
  # shellcheck disable=SC2086
  timeout -k 10 "$t" torchrun --standalone --nproc_per_node="$NPROC" "$ANCHORS/torch_pp_bench.py" \
    --model "$model" --T 1024 --B 16 --micro-batches 8 --steps 10 $theirs > "$L/$name-torch.txt" 2>&1
  echo "$name torch ($theirs): exit $? | $(grep -h RESULT "$L/$name-torch.txt")"
}

phase_bench() {
  pair 1f1b L32-H32-C2560 "--schedule 1f1b" "--schedule 1f1b"
  # (torchrun takes --virtual as its own flag: the peer's default is 2.)
  pair interleaved L32-H32-C2560 "--schedule interleaved:2" "--schedule interleaved"
}

phase_more() {
  [ "${PP_PEER:-}" = interleaved ] && pair interleaved L32-H32-C2560 - "--schedule interleaved"
  pair zb L32-H32-C2560 "--schedule zb" "--schedule zb"
  pair gpipe L32-H32-C2560 "--schedule gpipe" "--schedule gpipe"
}

phase_h2() {
  local i s
  for i in $(seq "${PP_H2_ROUNDS:-2}"); do
    for s in ${PP_H2_SCHEDULES:-zb zb-h2}; do
      pair "h2-$s-$i" L32-H32-C2560 "--schedule $s" "" 120
      grep -h 'pipeline bubble\|held at once' "$L/h2-$s-$i-braid.txt" | sed 's/^\[rank 0\] //' | cut -c1-240
    done
  done
  for s in ${PP_H2_PEERS-gpipe zb}; do
    peer "$s" L32-H32-C2560 "--schedule $s" 150
  done
}

phase_bubble() {
  local s t f
  for s in ${PP_SCHEDULES:-gpipe 1f1b interleaved:2 zb}; do
    f="$L/bubble-${s/:/-}.txt"
    t=$(left)
    [ "$t" -ge 40 ] || { echo "$s: skipped ($t s left)"; continue; }
    [ "$t" -gt 90 ] && t=90
    timeout -k 10 "$t" "$B" train --device cuda --model "${PP_BUBBLE_MODEL:-L32-H32-C2560}-V50304-T1024" \
      --data random --global-batch "${PP_BUBBLE_BATCH:-16}" --seq 1024 --steps 8 --eval-every 0 \
      --log-every 4 --nproc-per-node "$NPROC" --pp "$NPROC" --micro-batches "${PP_BUBBLE_MB:-8}" \
      --schedule "$s" > "$f" 2>&1
    echo "$s: exit $? | $(grep -h 'gpu summary' "$f" | sed 's/.*median/median/')"
    grep -h -A6 'pipeline timeline' "$f" | sed 's/^\[rank 0\] //'
    grep -h 'error' "$f" | head -2 | cut -c1-300
  done
}

phase_two() {
  export CUDA_VISIBLE_DEVICES=0,1
  NPROC=2
  phase_bench
  if [ -n "${TWO_BIG:-}" ]; then phase_big; fi
}

phase_layouts() {
  local how t f i=0
  local IFS=';'
  for how in ${PP_LAYOUTS:---pp 4 --micro-batches 8;--pp 4 --micro-batches 8 --schedule interleaved-zb;--tp 2 --no-sp --pp 2 --micro-batches 8;--pp 2 --micro-batches 8 --zero 1;--tp 4;--zero 3}; do
    i=$((i + 1))
    f="$L/layout-$i.txt"
    t=$(left)
    [ "$t" -ge 60 ] || { echo "$how: skipped ($t s left)"; continue; }
    [ "$t" -gt 150 ] && t=150
    # shellcheck disable=SC2086 # word list
    (IFS=' '; timeout -k 10 "$t" "$B" train --device cuda --model L40-H40-C5120-V50304-T1024 \
      --data random --global-batch 16 --seq 1024 --steps 8 --eval-every 0 --log-every 4 \
      --checkpointing --nproc-per-node "$NPROC" $how > "$f" 2>&1)
    echo "$how: exit $? | $(grep -h 'gpu summary' "$f" | sed 's/.*median/median/')"
    grep -h 'error' "$f" | head -2 | cut -c1-300
  done
}

phase_big() {
  pair big L40-H40-C5120 "--schedule 1f1b --checkpointing" "${PP_BIG_PEER---schedule 1f1b --act-ckpt}" 260
  # The bf16 weights cast layer by layer (no full bf16 copy: 2 bytes a
  # parameter less) with PP_STREAMED=1.
  if [ -n "${PP_STREAMED:-}" ]; then
    BRAID_BF16_WEIGHTS=streamed pair big-streamed L40-H40-C5120 "--schedule 1f1b --checkpointing" "" 260
  fi
}

case "${1:-}" in
  tests) phase_tests ;;
  bench) phase_bench ;;
  more) phase_more ;;
  bubble) phase_bubble ;;
  h2) phase_h2 ;;
  layouts) phase_layouts ;;
  two) phase_two ;;
  big) phase_big ;;
  *) echo "usage: pp.sh tests|bench|more|h2|bubble|layouts|two|big" >&2; exit 2 ;;
esac
finish
