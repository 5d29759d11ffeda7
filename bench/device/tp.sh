#!/bin/bash
# Tensor parallelism on 2 or 4 GPUs (issue 46). One phase per device call
# (the device tool stops a command at 600 s; a phase stops starting runs
# when its TP_LIMIT seconds, default 540, would be passed):
#
#   bash bench/device/tp.sh tests
#     the tensor-parallel GPU tests (gpu_tp.rs: --tp 2 against one GPU on 2
#     GPUs, --tp 2 x data 2 against data parallelism on 4), then the GPU
#     tests that read and write checkpoints (the piece format changed for
#     tensor parallelism: every earlier layout must still resume
#     bit-identical) and the padded-layout test.
#   bash bench/device/tp.sh bench
#     bf16 on 4 GPUs, global batch 16 x 1024, the 2.65B model
#     (L32-H32-C2560-V50304-T1024): braid --tp 4 beside PyTorch TP 4 + SP
#     (anchors/torch_tp_bench.py), then braid --tp 2 x data 2 beside
#     PyTorch TP 2 x FSDP2 2, each pair in this call.
#   bash bench/device/tp.sh big
#     the 12.85B model (L40-H40-C5120) on 4 GPUs, batch 8 x 1024 with
#     activation checkpointing: braid --tp 4 beside PyTorch TP 4 + SP.
#   bash bench/device/tp.sh two
#     the 2.65B pair on 2 of the GPUs: braid --tp 2 beside PyTorch TP 2 + SP;
#     with TWO_BIG=1 (H200s) the 12.85B pair of `big` on the same 2 GPUs.
#   bash bench/device/tp.sh cross
#     where tensor parallelism beats ZeRO-3: the 2.65B model on 4 GPUs,
#     braid --tp 4 beside braid --zero 3 at global batches 4 to 32
#     (CROSS_BATCHES) of 1024 tokens.
#   bash bench/device/tp.sh estimate
#     the memory pre-flight under --tp: its estimate beside the measured
#     peak, and its refusal of what cannot fit.
#   bash bench/device/tp.sh run
#     one --tp 2 f32 run on the 124M model beside one GPU's, 20 steps: the
#     loss curves side by side and the tensor groups' traffic per step.
#   bash bench/device/tp.sh overlap
#     braid alone, 2.65B --tp 4 --no-sp: the tensor group's sums after
#     each row-split product against in 2, 4, 8 row blocks beside the
#     next block's product (BRAID_TP_OVERLAP; TP_BLOCKS lists them), twice
#     each in turns.
#   bash bench/device/tp.sh sums
#     braid alone, 2.65B --tp 4 --no-sp: the row-split products summed over
#     the tensor group in f32 and in bf16 (the default; BRAID_TP_SUMS),
#     twice each in turns; TP_SUMS_BIG=1 adds the 12.85B pair of `big`.
#   bash bench/device/tp.sh grads
#     braid alone, 2.65B --tp 4 --no-sp: the backward pass's input-gradient
#     sums first, then beside the weight gradients (BRAID_TP_GRAD_OVERLAP,
#     the default),
#     in turns TP_GRADS_ROUNDS times (default 3); TP_GRADS_BIG=1 adds the
#     12.85B pair of `big`, once each.
#   bash bench/device/tp.sh sp
#     sequence parallelism in the bf16 engine: its GPU tests (gpu_tp.rs,
#     `sequence_parallel`), then braid alone at 2.65B --tp 4 with --sp and
#     --no-sp in turns, TP_SP_ROUNDS times (default 2); TP_SP_PEERS=1
#     adds the pairs of `bench` with
#     --sp; TP_SP_BIG=1 the 12.85B pair of `big` with --sp and --no-sp,
#     once each; TP_SP_TESTS=0 skips the tests.
#
# Logs under $L (in $OUT/logs.tgz). Carry: .dev/braid.gz .dev/commit .dev/built-at
# .dev/gpu-tp-tests.gz .dev/gpu-tests.gz .dev/gpu-zero-tests.gz, and for
# bench .dev/anchors (made by bench/device/pack.sh).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
LIMIT=${TP_LIMIT:-540}

left() { echo $((LIMIT - SECONDS)); }

# A test binary, optionally filtered: NAME BIN FILTER...
tests() {
  local name=$1 bin=$2
  shift 2
  [ -x "$bin" ] || { echo "$name: not carried"; return; }
  local t
  t=$(left)
  [ "$t" -ge 30 ] || { echo "$name: skipped ($t s left)"; return; }
  timeout -k 10 "$t" "$bin" --test-threads 1 --nocapture "$@" > "$L/$name.txt" 2>&1
  echo "exit $?" >> "$L/$name.txt"
  echo "== $name $*"
  grep -E "^test |test result|panicked|max \|diff\||^exit" "$L/$name.txt" | cut -c1-240
}

phase_tests() {
  tests gpu-tp /tmp/gpu-tp-tests
  tests gpu-zero-resume /tmp/gpu-zero-tests resume
  tests gpu-padded /tmp/gpu-tests padded
}

phase_run() {
  local common=(train --device cuda --precision f32 --model 124M --data random --batch 8
    --seq 256 --steps 20 --eval-every 0 --log-every 5)
  timeout 200 "$B" "${common[@]}" --json "$L/one.json" > "$L/one.txt" 2>&1
  echo "one GPU: exit $? | $(grep -h 'summary: median' "$L/one.txt")"
  timeout 200 "$B" "${common[@]}" --tp 2 --no-sp --nproc-per-node 2 --json "$L/tp2.json" \
    > "$L/tp2.txt" 2>&1
  echo "--tp 2: exit $? | $(grep -h 'summary: median' "$L/tp2.txt")"
  grep -h 'tensor groups' "$L/tp2.txt"
  python3 - "$L/one.json" "$L/tp2.json" << 'PY'
import json, sys
a, b = (json.load(open(p))["steps"] for p in sys.argv[1:])
for x, y in zip(a, b):
    print(f'step {x["step"]:>3}: one GPU {x["loss"]:.5f}  --tp 2 {y["loss"]:.5f}  diff {abs(x["loss"] - y["loss"]):.2e}')
PY
}

# braid and the PyTorch peer on the same layout: NAME, braid's extra
# arguments, the peer's arguments.
pair() {
  local name=$1 ours=$2 theirs=$3 t
  t=$(left)
  [ "$t" -ge 60 ] || { echo "$name: skipped ($t s left)"; return; }
  [ "$t" -gt 200 ] && t=200
  # shellcheck disable=SC2086 # word lists
  timeout -k 10 "$t" "$B" train --device cuda --model L32-H32-C2560-V50304-T1024 --data random \
    --global-batch 16 --seq 1024 --steps 12 --eval-every 0 --log-every 4 --nproc-per-node "$NPROC" \
    $ours > "$L/$name-braid.txt" 2>&1
  echo "$name braid ($ours): exit $? | $(grep -h 'gpu summary' "$L/$name-braid.txt" | sed 's/.*gpu summary: //')"
  t=$(left)
  [ "$t" -ge 60 ] || { echo "$name peer: skipped ($t s left)"; return; }
  [ "$t" -gt 200 ] && t=200
  # shellcheck disable=SC2086
  timeout -k 10 "$t" torchrun --standalone --nproc_per_node="$NPROC" "$ANCHORS/torch_tp_bench.py" \
    --model L32-H32-C2560 --T 1024 --steps 10 $theirs > "$L/$name-torch.txt" 2>&1
  echo "$name torch ($theirs): exit $? | $(grep -h RESULT "$L/$name-torch.txt")"
}

NPROC=4

# The same 2.65B pair on 2 GPUs (the first two of the machine): braid --tp 2
# beside PyTorch TP 2 + SP.
phase_two() {
  export CUDA_VISIBLE_DEVICES=0,1
  NPROC=2
  pair tp2 "--tp 2 --no-sp" "--tp 2 --B 16"
  # 12.85B on two GPUs needs H200s' memory (about 16 bytes a parameter
  # over 2: 103 GB per GPU before activations).
  if [ -n "${TWO_BIG:-}" ]; then phase_big; fi
}

phase_bench() {
  pair tp4 "--tp 4 --no-sp" "--tp 4 --B 16"
  pair tp2dp2 "--tp 2 --no-sp" "--tp 2 --dp 2 --B 8"
}

# The 12.85B model (L40-H40-C5120) on 4 GPUs, batch 8 x 1024, activation
# checkpointing: braid --tp 4 beside PyTorch TP 4 + SP. The bf16 weights
# as the pre-flight chooses (a whole copy where it fits);
# TP_BIG_WEIGHTS=streamed casts them layer by layer (the form of the
# rows before 2026-11-27, later). TP_BIG_PEER=0 skips PyTorch.
phase_big() {
  local t
  t=$(left)
  [ "$t" -gt 260 ] && t=260
  BRAID_BF16_WEIGHTS=${TP_BIG_WEIGHTS:-auto} timeout -k 10 "$t" "$B" train --device cuda \
    --model L40-H40-C5120-V50304-T1024 --data random --global-batch 8 --seq 1024 --steps 8 \
    --eval-every 0 --log-every 2 --checkpointing --nproc-per-node "$NPROC" --tp "$NPROC" --no-sp \
    > "$L/big-braid.txt" 2>&1
  echo "12.85B braid --tp $NPROC: exit $? | $(grep -h 'gpu summary' "$L/big-braid.txt" | sed 's/.*gpu summary: //')"
  grep -h 'error' "$L/big-braid.txt" | head -3
  grep -h 'memory estimate' "$L/big-braid.txt" | head -1
  [ "${TP_BIG_PEER:-1}" = 0 ] && return
  t=$(left)
  [ "$t" -ge 60 ] || { echo "12.85B peer: skipped ($t s left)"; return; }
  [ "$t" -gt 260 ] && t=260
  timeout -k 10 "$t" torchrun --standalone --nproc_per_node="$NPROC" "$ANCHORS/torch_tp_bench.py" \
    --model L40-H40-C5120 --T 1024 --steps 6 --warmup 2 --tp "$NPROC" --B 8 --act-ckpt \
    > "$L/big-torch.txt" 2>&1
  echo "12.85B torch TP $NPROC + SP: exit $? | $(grep -h RESULT "$L/big-torch.txt")"
}

# Where tensor parallelism wins: the 2.65B model on 4 GPUs, sequence 1024,
# braid --tp 4 beside braid's own ZeRO-3 at global batches 4, 8, 16 and
# 32 (ZeRO-3's gathers hide under less computation as the batch shrinks).
phase_cross() {
  local b how t f
  for b in ${CROSS_BATCHES:-4 8 16 32}; do
    for how in "--tp 4 --no-sp" "--zero 3"; do
      f="$L/cross-b$b-$(echo "$how" | tr -d ' -').txt"
      t=$(left)
      [ "$t" -ge 45 ] || { echo "batch $b $how: skipped ($t s left)"; continue; }
      [ "$t" -gt 120 ] && t=120
      # shellcheck disable=SC2086 # word list
      timeout -k 10 "$t" "$B" train --device cuda --model L32-H32-C2560-V50304-T1024 \
        --data random --global-batch "$b" --seq 1024 --steps 12 --eval-every 0 --log-every 4 \
        --nproc-per-node 4 $how > "$f" 2>&1
      echo "batch $b x 1024, $how: exit $? | $(grep -h 'gpu summary' "$f" | sed 's/.*gpu summary: //')"
    done
  done
}

# The memory pre-flight under --tp: the estimate it prints beside the
# measured peak (2.65B, --tp 2 on 2 GPUs and --tp 2 x data 2 on 4, batch
# 16 x 1024), and the refusal of the 12.85B model at --tp 2 on 80 GB cards.
phase_estimate() {
  local f n how
  for how in "2 --tp 2 --no-sp" "4 --tp 2 --no-sp"; do
    n=${how%% *}
    f="$L/estimate-$n.txt"
    # shellcheck disable=SC2086 # word list
    timeout -k 10 120 "$B" train --device cuda --model L32-H32-C2560-V50304-T1024 --data random \
      --global-batch 16 --seq 1024 --steps 8 --eval-every 0 --log-every 4 \
      --nproc-per-node ${how} > "$f" 2>&1
    echo "$n GPUs, --tp 2: exit $? | $(grep -h 'GPU memory estimate' "$f" | head -1 | sed 's/.*\] //') | $(grep -h 'gpu summary' "$f" | sed 's/.*peak/peak/')"
  done
  f="$L/estimate-refused.txt"
  timeout -k 10 120 "$B" train --device cuda --model L40-H40-C5120-V50304-T1024 --data random \
    --global-batch 8 --seq 1024 --steps 2 --checkpointing --nproc-per-node 2 --tp 2 --no-sp \
    > "$f" 2>&1
  echo "12.85B --tp 2 on 2 GPUs: exit $? | $(grep -h 'error' "$f" | head -1 | cut -c1-400)"
}

# One braid run at 2.65B --tp 4 ($SP_FLAG, by default --no-sp), batch
# 16 x 1024, 12 steps, into $L/NAME.txt, with the environment assignments
# given (VAR=VALUE ...); prints its exit status and GPU summary, or that
# it was skipped.
tp4_run() {
  local name=$1 t
  shift
  t=$(left)
  [ "$t" -ge 40 ] || { echo "$name: skipped ($t s left)"; return 1; }
  [ "$t" -gt 100 ] && t=100
  env "$@" timeout -k 10 "$t" "$B" train --device cuda \
    --model L32-H32-C2560-V50304-T1024 --data random --global-batch 16 --seq 1024 --steps 12 \
    --eval-every 0 --log-every 4 --nproc-per-node 4 --tp 4 "${SP_FLAG:---no-sp}" > "$L/$name.txt" 2>&1
  echo "$name: exit $? | $(grep -h 'gpu summary' "$L/$name.txt" | sed 's/.*median/median/')"
}

# braid alone at 2.65B --tp 4 --no-sp, batch 16 x 1024: the row-split
# products' sums over the tensor group after each product (1 block) or
# in 2, 4 and 8 row blocks beside the next block's product
# (BRAID_TP_OVERLAP), twice each in turns.
phase_overlap() {
  local k i
  for i in 1 2; do
    for k in ${TP_BLOCKS:-1 2 4 8}; do
      tp4_run "overlap-$k-$i" BRAID_TP_OVERLAP="$k"
    done
  done
}

# braid alone at 2.65B --tp 4 --no-sp, batch 16 x 1024: the row-split
# products summed over the tensor group in f32 and in bf16 (the default;
# BRAID_TP_SUMS), twice each in turns; with TP_SUMS_BIG=1 the
# 12.85B pair of `big` (checkpointing, batch 8) too, once each.
phase_sums() {
  local d i f t
  for i in 1 2; do
    for d in f32 bf16; do
      tp4_run "sums-$d-$i" BRAID_TP_SUMS="$d" &&
        grep -h '^\[rank 0\] step    12' "$L/sums-$d-$i.txt" | grep -o 'loss [0-9.]*'
    done
  done
  [ -n "${TP_SUMS_BIG:-}" ] || return
  for d in f32 bf16; do
    f="$L/sums-big-$d.txt"
    t=$(left)
    [ "$t" -ge 90 ] || { echo "sums big $d: skipped ($t s left)"; continue; }
    [ "$t" -gt 200 ] && t=200
    BRAID_TP_SUMS=$d BRAID_BF16_WEIGHTS=streamed timeout -k 10 "$t" "$B" train --device cuda \
      --model L40-H40-C5120-V50304-T1024 --data random --global-batch 8 --seq 1024 --steps 8 \
      --checkpointing --eval-every 0 --log-every 4 --nproc-per-node 4 --tp 4 --no-sp > "$f" 2>&1
    echo "12.85B sums in $d: exit $? | $(grep -h 'gpu summary' "$f" | sed 's/.*median/median/')"
  done
}

# braid alone at 2.65B --tp 4 --no-sp, batch 16 x 1024: the input
# gradients' sums first (off) and beside the weight gradients (on), in
# turns; with TP_GRADS_BIG=1 the 12.85B pair of `big` too, once each.
phase_grads() {
  local i o t f
  for i in $(seq "${TP_GRADS_ROUNDS:-3}"); do
    for o in off on; do
      tp4_run "grads-$o-$i" BRAID_TP_GRAD_OVERLAP="$o" &&
        grep -h '^\[rank 0\] step    12' "$L/grads-$o-$i.txt" | grep -o 'loss [0-9.]*'
    done
  done
  [ -n "${TP_GRADS_BIG:-}" ] || return
  for o in off on; do
    f="$L/grads-big-$o.txt"
    t=$(left)
    [ "$t" -ge 90 ] || { echo "grads big $o: skipped ($t s left)"; continue; }
    [ "$t" -gt 150 ] && t=150
    BRAID_TP_GRAD_OVERLAP=$o timeout -k 10 "$t" "$B" train --device cuda \
      --model L40-H40-C5120-V50304-T1024 --data random --global-batch 8 --seq 1024 --steps 8 \
      --checkpointing --eval-every 0 --log-every 4 --nproc-per-node 4 --tp 4 --no-sp > "$f" 2>&1
    echo "12.85B input-gradient sums beside $o: exit $? | $(grep -h 'gpu summary' "$f" | sed 's/.*median/median/')"
  done
}

# Sequence parallelism in the bf16 engine: its tests, then braid alone at
# 2.65B --tp 4 with and without it, in turns; TP_SP_BIG=1 adds 12.85B.
phase_sp() {
  local i s t f
  [ "${TP_SP_TESTS:-1}" = 0 ] || tests gpu-tp-sp /tmp/gpu-tp-tests sequence_parallel
  for i in $(seq "${TP_SP_ROUNDS:-2}"); do
    for s in --sp --no-sp; do
      f="sp${s#--}-$i"
      SP_FLAG=$s tp4_run "$f" &&
        grep -h '^\[rank 0\] step    12' "$L/$f.txt" | grep -o 'loss [0-9.]*'
    done
  done
  if [ -n "${TP_SP_PEERS:-}" ]; then
    pair tp4-sp "--tp 4 --sp" "--tp 4 --B 16"
    pair tp2dp2-sp "--tp 2 --sp" "--tp 2 --dp 2 --B 8"
  fi
  [ -n "${TP_SP_BIG:-}" ] || return
  for s in --sp --no-sp; do
    f="$L/sp-big${s#--}.txt"
    t=$(left)
    [ "$t" -ge 90 ] || { echo "12.85B $s: skipped ($t s left)"; continue; }
    [ "$t" -gt 160 ] && t=160
    timeout -k 10 "$t" "$B" train --device cuda \
      --model L40-H40-C5120-V50304-T1024 --data random --global-batch 8 --seq 1024 --steps 8 \
      --checkpointing --eval-every 0 --log-every 4 --nproc-per-node 4 --tp 4 "$s" > "$f" 2>&1
    echo "12.85B $s: exit $? | $(grep -h 'GPU memory estimate' "$f" | head -1 | sed 's/.*\] //') | $(grep -h 'gpu summary' "$f" | sed 's/.*median/median/')"
  done
}

case "${1:-}" in
  tests) phase_tests ;;
  sp) phase_sp ;;
  grads) phase_grads ;;
  overlap) phase_overlap ;;
  sums) phase_sums ;;
  bench) phase_bench ;;
  big) phase_big ;;
  two) phase_two ;;
  cross) phase_cross ;;
  estimate) phase_estimate ;;
  run) phase_run ;;
  *) echo "usage: tp.sh tests|bench|big|two|cross|estimate|run|overlap|sums|grads|sp" >&2; exit 2 ;;
esac
finish
