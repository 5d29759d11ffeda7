#!/bin/bash
# One GPU (nvidia-h100-x1 or nvidia-h200): the checks that most one-GPU
# results in bench/results were made with. One phase per device call (the
# device tool stops a command at 600 s; a phase stops starting runs when
# its ONE_LIMIT seconds, default 540, would be passed):
#
#   bash bench/device/one.sh tests [FILTER...]
#     every GPU test (gpu.rs, gpu_zero.rs, gpu_faults.rs), or those whose
#     names contain a FILTER; their 2-GPU legs skip on one GPU.
#   bash bench/device/one.sh bits
#     the previous binary (.dev/braid-prev.gz, built by
#     `PREV=REV bash bench/device/pack.sh`) against this one on 32 small
#     configurations: 2 models (L4-H4-C128 at T 64, L2-H2-C256 at T 1024:
#     head size 128) × 16 settings (plain; checkpointing with the
#     attention kept, recomputed, batched; deferred weight gradients;
#     recomputed score gradients; --accum 2; f32; ZeRO-2; ZeRO-3 plain,
#     with checkpointing, in f32, with f32 gathers, with the saved
#     activations apart, without resharding after forward; the optimizer
#     offloaded), 6 steps from seed 5, an evaluation every 3. It passes
#     when every saved model is byte-identical and every loss, evaluation
#     loss and gradient norm is equal. BITS_ONLY=REGEX: only the settings
#     it matches (e.g. "f32").
#   bash bench/device/one.sh speed
#     the previous binary (.dev/braid-prev.gz) against this one in turns,
#     SPEED_ROUNDS times (default 2): GPT-2 124M at batch 16 x 1024 (25
#     steps) and 1558M at batch 8 x 1024 (15 steps), random tokens, each
#     run's median step and tokens/s, then each binary's best per model
#     and new / prev.
#   bash bench/device/one.sh flash
#     the head-size-128 attention kernels' blocks per SM
#     (BRAID_FLASH128_BLOCKS) in turns on a one-GPU model of the 12.85B
#     width, profiled: see phase_flash.
#   bash bench/device/one.sh hopper
#     the attention's kernels on Hopper's warpgroup products (an H100 or
#     H200): `braid kernels --check` under each BRAID_FLASH_FORWARD of
#     HOPPER_FORWARDS (default "wgmma wgmma2": one or two warpgroups a
#     block), then BRAID_FLASH_BACKWARD=wgmma,
#     the other pass on mma.sync tiles; then GPT-2 124M (batch 16 x 1024,
#     25 steps) with mma.sync tiles in both passes, with the default
#     (auto) and with each choice that passed its check (each forward
#     alone, then the backward beside the first forward that passed), in
#     turns,
#     HOPPER_ROUNDS times (default 1); then the `flash` phase with the
#     default and the same choices.
#   bash bench/device/one.sh groups
#     the attention's blocks sent out G heads at a time
#     (BRAID_FLASH_GROUP_HEADS): `braid kernels --check` under G = 2 and
#     each of HEAD_GROUPS (default "8 16 32"), then 124M and the `flash` phase
#     with the default grid and each G that passed, in turns.
#   bash bench/device/one.sh ncu
#     Nsight Compute over the attention's kernels (flash_*) of step 3 of
#     the `flash` phase's model (L4-H40-C5120, head size 128, batch
#     8 x 1024, checkpointing) under each choice of NCU_CHOICES
#     (FORWARD:BACKWARD, default "mma:mma auto:auto"): speed of light,
#     warp states, scheduler, occupancy, compute and memory workload
#     sections, the clocks left alone; the figures that say what bounds
#     each kernel are printed, the whole report is in $L/ncu-*.txt.
#   bash bench/device/one.sh proxy
#     the one-GPU proxy of the 12.85B model on 2 GPUs: PROXY (default
#     L20-H40-C5120: 6.56B parameters, the model state per rank of 12.85B at
#     N = 2) under ZeRO-3 over one rank, batch 8 x 1024, activation
#     checkpointing, 8 steps; this binary and the previous one (when
#     carried) in turns, twice, then each with the saved activations apart
#     (BRAID_SAVED_IN_GRADS=off); then PyTorch FSDP2 over one rank
#     (torch_gpt2_bench.py --fsdp --act-ckpt). Peak memory about 101 GiB:
#     an H200. PROXY=L4-H8-C1024 is a dry run that fits an H100.
#   bash bench/device/one.sh plan
#     `braid plan`'s prediction beside the run: GPT-2 124M (batch 16 x
#     1024, 30 steps, random tokens) as given and under `--layout auto
#     --global-batch 16`; the layout auto chose and each run's "plan:"
#     line (predicted against measured step) printed.
#   bash bench/device/one.sh calibrate
#     `braid plan calibrate` (this GPU's products, attention, memory and
#     the host's AdamW timed, $L/calibrated.json written), then GPT-2 124M
#     B16, 1558M B8 and L32-H32-C2560 B8 (CALIBRATE_RUNS, MODEL:BATCH)
#     trained 25 steps on random tokens, each run's median step set beside
#     braid plan's prediction for its layout from the calibrated file and
#     from the built-in description of the GPU. CALIBRATE_PROFILE=1: each
#     model also trained 8 steps under BRAID_PROFILE=1, its GPU time by
#     phase printed (where the prediction misses).
#   bash bench/device/one.sh fp8
#     issue 69's FP8 parts checked and timed: see phase_fp8.
#   bash bench/device/one.sh memory
#     `braid plan`'s memory verdicts on this GPU (issue 68: "a layout it
#     calls too large does not fit, one it says fits does not run out of
#     memory"): for each question of MEMORY_QUESTIONS (MODEL:GLOBAL_BATCH,
#     default 2.65B at 32 and 64, 6.35B at 8; the description is the GPU's
#     built-in one), the layout the plan keeps with the most memory and the
#     one it refuses with the least, each run by `braid train` for 3 steps:
#     the first must run (its peak beside the plan's figure), the second,
#     started anyway in its leanest form with the pre-flight told the GPU
#     has room (BRAID_TEST_GPU_FREE), must run out of memory. MEMORY_DRY=1
#     prints the runs without them (checks the script on a machine without
#     a GPU).
#
# Each run's output is under $L (in $OUT/logs.tgz), its command first.
# Carry: .dev/braid.gz .dev/commit, and for `tests` .dev/built-at .dev/gpu-tests.gz
# .dev/gpu-zero-tests.gz .dev/gpu-faults-tests.gz, for `bits`
# .dev/braid-prev.gz, for `proxy` .dev/anchors (and .dev/braid-prev.gz to
# compare). bench/device/pack.sh makes them.
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc
LIMIT=${ONE_LIMIT:-540}
PREV=/tmp/braid-prev
[ -x "$PREV" ] || PREV=

# Seconds a run may take: at most WANT, and what the phase has left; fails
# (the run is skipped) under 20.
budget() {
  local t=$1 left=$((LIMIT - SECONDS))
  [ "$t" -gt "$left" ] && t=$left
  [ "$t" -ge 20 ] || return 1
  echo "$t"
}

# A braid run: log name, seconds, binary, arguments. Its output goes to
# $L/NAME.txt, the command first.
run() {
  local name=$1 t=$2 bin=$3
  shift 3
  if ! t=$(budget "$t"); then
    echo "$name: skipped ($((LIMIT - SECONDS)) s left)"
    return 1
  fi
  local envs="${BRAID_SAVED_IN_GRADS:+BRAID_SAVED_IN_GRADS=$BRAID_SAVED_IN_GRADS }"
  envs+="${BRAID_FLASH128_BLOCKS:+BRAID_FLASH128_BLOCKS=$BRAID_FLASH128_BLOCKS }"
  envs+="${BRAID_FLASH_FORWARD:+BRAID_FLASH_FORWARD=$BRAID_FLASH_FORWARD }"
  envs+="${BRAID_FLASH_BACKWARD:+BRAID_FLASH_BACKWARD=$BRAID_FLASH_BACKWARD }"
  envs+="${BRAID_FLASH_GROUP_HEADS:+BRAID_FLASH_GROUP_HEADS=$BRAID_FLASH_GROUP_HEADS }"
  envs+="${BRAID_FP8:+BRAID_FP8=$BRAID_FP8 }"
  envs+="${BRAID_FP8_SCALING:+BRAID_FP8_SCALING=$BRAID_FP8_SCALING }"
  echo "cmd: $envs$bin $*" > "$L/$name.txt"
  timeout -k 10 "$t" "$bin" "$@" >> "$L/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc" >> "$L/$name.txt"
  return $rc
}

phase_tests() {
  local t filter=("$@")
  for t in gpu-tests gpu-zero-tests gpu-faults-tests; do
    if [ ! -x "/tmp/$t" ]; then
      echo "$t: not carried (.dev/$t.gz)"
      continue
    fi
    local s
    s=$(budget 400) || { echo "$t: skipped (no time left)"; continue; }
    timeout -k 10 "$s" "/tmp/$t" --test-threads 1 --nocapture "${filter[@]}" > "$L/$t.txt" 2>&1
    echo "exit $?" >> "$L/$t.txt"
    echo "== $t ${filter[*]}"
    grep -E "^test |test result|panicked|^exit" "$L/$t.txt" | cut -c1-200
  done
}

phase_bits() {
  [ -n "$PREV" ] || { echo "bits: no previous binary (carry .dev/braid-prev.gz)"; return 2; }
  local n=0 ran=0 same=0 spec m t bs extra envs args b
  cd /tmp || return 2
  for spec in "L4-H4-C128-V50304-T64 64 8" "L2-H2-C256-V50304-T1024 1024 2"; do
    read -r m t bs <<< "$spec"
    for extra in "|" "|--checkpointing" "BRAID_CKPT_ATTENTION=recomputed|--checkpointing" \
      "BRAID_ATTENTION=batched|--checkpointing" "|--defer-layers 2 --checkpointing" \
      "BRAID_SCORE_GRADS=recomputed|--checkpointing" "|--accum 2" "|--precision f32" \
      "|--zero 2" "|--zero 3" "|--zero 3 --checkpointing" "|--precision f32 --zero 3" \
      "BRAID_ZERO3_GATHER=f32|--zero 3" "BRAID_SAVED_IN_GRADS=off|--zero 3 --checkpointing" \
      "|--zero 3 --no-reshard-after-forward" "|--offload optimizer"; do
      n=$((n + 1))
      # BITS_ONLY=REGEX: only the settings it matches (e.g. "f32").
      [ -z "${BITS_ONLY:-}" ] || [[ "$extra" =~ $BITS_ONLY ]] || continue
      ran=$((ran + 1))
      envs=${extra%%|*} args=${extra#*|}
      for b in prev new; do
        local bin=$B
        [ $b = prev ] && bin=$PREV
        # shellcheck disable=SC2086 # envs and args are word lists
        env $envs timeout 90 "$bin" train --device cuda --model "$m" --seq "$t" --batch "$bs" \
          --steps 6 --seed 5 --eval-every 3 --nproc 1 $args --save "$b-$n.safetensors" \
          --json "$b-$n.json" > "$L/bits-$b-$n.txt" 2>&1 ||
          echo "bits $n ($b) failed: $(tail -n 2 "$L/bits-$b-$n.txt" | tr '\n' ' ')"
      done
      local r
      r="$(cmp -s "prev-$n.safetensors" "new-$n.safetensors" && echo identical || echo DIFFER) $(
        python3 - "prev-$n.json" "new-$n.json" 2>&1 << 'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
L = lambda d: [(s["loss"], s["eval_loss"], s["grad_norm"]) for s in d["steps"]]
print("losses/norms equal" if L(a) == L(b) else "losses DIFFER")
EOF
      )"
      if [ "$r" = "identical losses/norms equal" ]; then
        same=$((same + 1))
      else
        echo "bits $n $m [$extra]: $r"
      fi
      echo "bits $n $m [$extra]: $r" >> "$L/bits.txt"
      rm -f "prev-$n.safetensors" "new-$n.safetensors"
      [ $((LIMIT - SECONDS)) -ge 30 ] || { echo "bits: stopped after $n (no time left)"; break 2; }
    done
  done
  cd - > /dev/null || return 2
  echo "bits: $same of $ran configurations identical (saved model, losses, evaluation losses, norms)"
  [ "$same" = "$ran" ]
}

# The previous binary and this one in turns on 124M B16 and 1558M B8:
# tokens/s of each run, then each binary's best and new / prev.
phase_speed() {
  [ -n "$PREV" ] || { echo "speed: no previous binary (carry .dev/braid-prev.gz)"; return 2; }
  local r spec m bs steps b bin n
  for r in $(seq "${SPEED_ROUNDS:-2}"); do
    for spec in "124M 16 25" "1558M 8 15"; do
      read -r m bs steps <<< "$spec"
      for b in prev new; do
        bin=$B
        [ $b = prev ] && bin=$PREV
        n="speed-$m-$b-$r"
        run "$n" 120 "$bin" train --device cuda --model "$m" --batch "$bs" --seq 1024 \
          --data random --steps "$steps" --eval-every 0 --log-every 5 || continue
        echo "$m $b round $r: $(grep -ho 'median step [0-9.]* ms[^|]*| [0-9]* tokens/s' "$L/$n.txt" | tail -1)"
      done
    done
  done
  for m in 124M 1558M; do
    python3 - "$m" "$L" << 'EOF'
import glob, re, sys
m, L = sys.argv[1:]
best = {}
for b in ("prev", "new"):
    for p in glob.glob(f"{L}/speed-{m}-{b}-*.txt"):
        got = re.findall(r"\| (\d+) tokens/s", open(p).read())
        if got:
            best[b] = max(best.get(b, 0), int(got[-1]))
if len(best) == 2:
    print(f"speed {m}: prev {best['prev']} tokens/s, new {best['new']} tokens/s, new/prev {best['new'] / best['prev']:.4f}")
else:
    print(f"speed {m}: incomplete ({best})")
EOF
  done
}

phase_proxy() {
  local P=${PROXY:-L20-H40-C5120} b turn name
  local A=(train --device cuda --model "$P-V50304-T1024" --batch 8 --seq 1024 --checkpointing
    --data random --eval-every 0 --steps 8 --log-every 4 --zero 3 --nproc 1)
  local bins=(new)
  [ -n "$PREV" ] && bins=(new prev)
  show() {
    echo "$1: $(grep -hE 'memory estimate|gpu summary|besides model states|error|^exit [^0]' "$L/$1.txt" |
      sed 's/^\[rank 0\] //' | cut -c1-200 | tr '\n' ' ')"
  }
  for turn in 1 2; do
    for b in "${bins[@]}"; do
      local bin=$B
      [ "$b" = prev ] && bin=$PREV
      name=proxy-$b-$turn
      run "$name" 150 "$bin" "${A[@]}"
      show "$name"
    done
  done
  for b in "${bins[@]}"; do
    local bin=$B
    [ "$b" = prev ] && bin=$PREV
    name=proxy-apart-$b
    BRAID_SAVED_IN_GRADS=off run "$name" 150 "$bin" "${A[@]}"
    show "$name"
  done
  local t
  if t=$(budget 200); then
    echo "cmd: (cd \$ANCHORS && torchrun --standalone --nproc_per_node 1 torch_gpt2_bench.py --fsdp --act-ckpt --model $P --B 8 --steps 10 --warmup 3)" > "$L/fsdp2.txt"
    (cd "$ANCHORS" && timeout -k 10 "$t" torchrun --standalone --nproc_per_node 1 torch_gpt2_bench.py \
      --fsdp --act-ckpt --model "$P" --B 8 --steps 10 --warmup 3 >> "$L/fsdp2.txt" 2>&1
     echo "exit $?" >> "$L/fsdp2.txt")
    echo "fsdp2: $(grep -hE 'RESULT|Error|^exit [^0]' "$L/fsdp2.txt" | tail -n 3 | tr '\n' ' ')"
  else
    echo "fsdp2: skipped (no time left)"
  fi
}

# The head-size-128 attention kernels' blocks per SM
# (BRAID_FLASH128_BLOCKS=F,K,Q; a variant F,K,Q/FWD[:BWD] also sets
# BRAID_FLASH_FORWARD=FWD and BRAID_FLASH_BACKWARD=BWD, e.g.
# 2,2,2/wgmma:mma, and a suffix @G BRAID_FLASH_GROUP_HEADS=G, e.g.
# 2,2,2@16) in turns, FLASH_ROUNDS times, on GPU 0:
# the 12.85B model's width (FLASH_MODEL, default L4-H40-C5120: 4 layers,
# head size 128) at batch 8 x 1024 with checkpointing, 8 steps, profiled
# (BRAID_PROFILE=1); per run the attention's GPU time per step (forward,
# recompute and backward rows) and the median step. The variant with the
# least attention time, over its rounds, goes to $L/flash-best.txt.
phase_flash() {
  local M=${FLASH_MODEL:-L4-H40-C5120-V50304-T1024} v r n ms fwd bwd best= best_ms=
  local variants=${FLASH_VARIANTS:-2,2,2 3,2,2 3,3,3}
  for r in $(seq "${FLASH_ROUNDS:-1}"); do
    for v in $variants; do
      n="flash-${v//[,\/:@]/-}-$r"
      fwd= bwd= grp=
      [[ $v == *@* ]] && grp=${v##*@}
      local base=${v%@*}
      [[ $base == */* ]] && fwd=${base#*/}
      # KIND is FORWARD[:BACKWARD].
      [[ $fwd == *:* ]] && bwd=${fwd#*:}
      BRAID_FLASH128_BLOCKS=${base%%/*} BRAID_FLASH_FORWARD=${fwd%%:*} BRAID_FLASH_BACKWARD=$bwd \
        BRAID_FLASH_GROUP_HEADS=$grp BRAID_PROFILE=1 run "$n" 90 "$B" train --device cuda \
        --model "$M" --batch 8 --seq 1024 --data random --checkpointing --steps 8 \
        --eval-every 0 --log-every 4 || continue
      ms=$(grep -h ' attention  ' "$L/$n.txt" | awk '{ s += $(NF-5) } END { printf "%.3f", s }')
      echo "flash $v round $r: attention $ms ms a step; $(grep -ho 'median step [0-9.]* ms' "$L/$n.txt" | tail -1)"
      echo "$v $ms" >> "$L/flash-times.txt"
    done
  done
  best=$(awk '{ s[$1] += $2 } END { for (v in s) print s[v], v }' "$L/flash-times.txt" 2>/dev/null |
    sort -n | head -1 | cut -d' ' -f2)
  best_ms=$(grep -h "^$best " "$L/flash-times.txt" 2>/dev/null | awk '{ s += $2; n++ } END { if (n) printf "%.3f", s / n }')
  echo "${best:-2,2,2}" > "$L/flash-best.txt"
  echo "flash: fastest ${best:-none} (attention ${best_ms:-?} ms a step)"
}

# The Hopper kernels: each pass's checked, then those that pass timed
# against mma.sync tiles and the default (auto). A choice is
# FORWARD:BACKWARD.
phase_hopper() {
  local r c n check fwd= choices="mma:mma auto:auto"
  local forwards=${HOPPER_FORWARDS:-wgmma wgmma2}
  for check in $forwards; do
    BRAID_FLASH_FORWARD=$check BRAID_FLASH_BACKWARD=mma run "hopper-check-$check" 180 "$B" kernels --check
  done
  BRAID_FLASH_FORWARD=mma BRAID_FLASH_BACKWARD=wgmma run hopper-check-backward 180 "$B" kernels --check
  for check in $forwards backward; do
    echo "== kernels --check: $check"
    grep -E "attention_(forward|backward) \(bf16, fused|kernels within" "$L/hopper-check-$check.txt"
  done
  for check in $forwards; do
    if grep -q "^exit 0" "$L/hopper-check-$check.txt"; then
      choices+=" $check:mma"
      fwd=${fwd:-$check}
    fi
  done
  grep -q "^exit 0" "$L/hopper-check-backward.txt" && choices+=" ${fwd:-mma}:wgmma"
  if [ "$choices" = "mma:mma auto:auto" ]; then
    echo "hopper: no Hopper kernel passed its check; nothing timed"
    return 1
  fi
  for r in $(seq "${HOPPER_ROUNDS:-1}"); do
    for c in $choices; do
      n="hopper-124m-${c/:/-}-$r"
      BRAID_FLASH_FORWARD=${c%:*} BRAID_FLASH_BACKWARD=${c#*:} run "$n" 90 "$B" train --device cuda \
        --model 124M --batch 16 --seq 1024 --data random --steps 25 --eval-every 0 --log-every 5 ||
        continue
      echo "124M $c round $r: $(grep -ho 'median step [0-9.]* ms[^|]*| [0-9]* tokens/s' "$L/$n.txt" | tail -1)"
    done
  done
  local variants=
  for c in $choices; do variants+=" 2,2,2/$c"; done
  FLASH_VARIANTS=${FLASH_VARIANTS:-$variants} phase_flash
}

# The attention's blocks sent out by groups of heads: `braid kernels
# --check` under BRAID_FLASH_GROUP_HEADS=2 (full groups and a partial one
# in the check's shapes) and each of HEAD_GROUPS (default "8 16 32"); then
# 124M with the default grid and each G that passed, in turns, and the
# `flash` phase with the same.
phase_groups() {
  local g pass= n
  for g in 2 ${HEAD_GROUPS:-8 16 32}; do
    BRAID_FLASH_GROUP_HEADS=$g run "groups-check-$g" 180 "$B" kernels --check
    echo "== kernels --check, $g heads a group: $(grep -E 'kernels within' "$L/groups-check-$g.txt")"
    grep -q "^exit 0" "$L/groups-check-$g.txt" && [ "$g" != 2 ] && pass+=" $g"
  done
  [ -n "$pass" ] || { echo "groups: no grouping passed its check; nothing timed"; return 1; }
  for g in "" $pass; do
    n="groups-124m-${g:-none}"
    BRAID_FLASH_GROUP_HEADS=$g run "$n" 90 "$B" train --device cuda --model 124M --batch 16 \
      --seq 1024 --data random --steps 25 --eval-every 0 --log-every 5 || continue
    echo "124M, ${g:+$g heads a group}${g:-the default grid}: $(grep -ho 'median step [0-9.]* ms[^|]*| [0-9]* tokens/s' "$L/$n.txt" | tail -1)"
  done
  local variants="2,2,2"
  for g in $pass; do variants+=" 2,2,2@$g"; done
  FLASH_VARIANTS=${FLASH_VARIANTS:-$variants} phase_flash
}

phase_ncu() {
  local c n t
  export BRAID_NVTX=1
  for c in ${NCU_CHOICES:-mma:mma auto:auto}; do
    n="ncu-${c/:/-}"
    t=$(budget 240) || { echo "$n: skipped (no time left)"; continue; }
    {
      echo "cmd: BRAID_FLASH_FORWARD=${c%:*} BRAID_FLASH_BACKWARD=${c#*:} ncu (flash_*, step 3) $B train ..."
      BRAID_FLASH_FORWARD=${c%:*} BRAID_FLASH_BACKWARD=${c#*:} timeout -k 10 "$t" ncu --nvtx \
        --nvtx-include "step 3/" --kernel-name regex:flash_ --launch-count 24 --clock-control none \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        "$B" train --device cuda --model L4-H40-C5120-V50304-T1024 --batch 8 --seq 1024 \
        --data random --checkpointing --steps 4 --eval-every 0 --log-every 1
      echo "exit $?"
    } > "$L/$n.txt" 2>&1
    echo "== $c: $(tail -1 "$L/$n.txt")"
    grep -E "^  flash_|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Executed Ipc A" \
      "$L/$n.txt" | awk '/^  flash_/ { if (seen[$1]++) skip = 1; else skip = 0 } !skip' | cut -c1-150
  done
}

phase_plan() {
  local common=(--device cuda --model 124M --seq 1024 --steps 30 --data random --eval-every 0)
  run plan-given 150 "$B" train "${common[@]}" --batch 16
  run plan-auto 150 "$B" train "${common[@]}" --layout auto --global-batch 16
  local n
  for n in plan-given plan-auto; do
    echo "== $n: $(head -n 1 "$L/$n.txt" | cut -c1-200)"
    grep -hE "layout auto|^plan:|tokens/s|^exit" "$L/$n.txt" | tail -n 6 | cut -c1-250
  done
}

phase_memory() {
  local hw spec model batch
  hw=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  case $hw in *H200*) hw=h200 ;; *) hw=h100 ;; esac
  for spec in ${MEMORY_QUESTIONS:-L32-H32-C2560:32 L32-H32-C2560:64 L40-H28-C3584:8}; do
    model=${spec%%:*} batch=${spec##*:}
    "$B" plan --model "$model" --gpus 1 --global-batch "$batch" --seq 1024 --hardware "$hw" \
      --json "$L/memory-$model-b$batch-plan.json" > /dev/null || return 1
    # The two layouts at the budget's edge, as braid train's flags.
    local picks
    picks=$(python3 - "$L/memory-$model-b$batch-plan.json" "$batch" << 'PY'
import json, sys
d, batch = json.load(open(sys.argv[1])), sys.argv[2]
ls = d["layouts"]
gib = lambda x: (x["states_bytes"] + x["activation_bytes"]) / 2**30
fits = [x for x in ls if x["prediction"]]
over = [x for x in ls if "GiB per GPU" in (x["refused"] or "")]
for verdict, x in (("fits", max(fits, key=gib, default=None)), ("refused", min(over, key=gib, default=None))):
    if x is None:
        continue
    l = x["layout"]
    # braid train's --batch is a micro-batch's sequences.
    flags = f"--batch {l['micro_batch']} --accum {l['micro_batches']}"
    flags += " --checkpointing" * l["checkpointing"] + " --offload optimizer" * l["offload"]
    print(f"{verdict} {gib(x):.2f} {flags}")
PY
    )
    local verdict gib flags tag
    while read -r verdict gib flags; do
      tag=memory-$model-b$batch-$verdict
      if [ "${MEMORY_DRY:-0}" = 1 ]; then
        echo "$tag (plan: $gib GiB): $B train --device cuda --model $model --seq 1024 $flags --steps 3"
        continue
      fi
      # A refused layout is started anyway (the pre-flight told the GPU
      # has room, BRAID_TEST_GPU_FREE) in its leanest form, to see it run
      # out of memory.
      local lean=()
      if [ "$verdict" = refused ]; then
        lean=(BRAID_TEST_GPU_FREE=4096G BRAID_SCORE_GRADS=recomputed)
        [[ $flags == *--offload* ]] || lean+=(BRAID_BF16_WEIGHTS=streamed)
        [[ $flags == *--checkpointing* ]] &&
          lean+=(BRAID_CKPT_ATTENTION=0 BRAID_CKPT_ATTENTION_OUTPUT=recomputed)
      fi
      (
        for kv in "${lean[@]}"; do export "${kv?}"; done
        # shellcheck disable=SC2086
        run "$tag" 180 "$B" train --device cuda --model "$model" --seq 1024 $flags --steps 3 \
          --data random --eval-every 0 --json "$L/$tag.json"
      )
      local rc=$?
      echo "== $tag: the plan counts $gib GiB; exit $rc"
      if [ -f "$L/$tag.json" ]; then
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('  peak %.2f GiB (%s)' % (d['peak_device_bytes'] / 2**30, d.get('peak_device_part')))" "$L/$tag.json"
      fi
      grep -hE "GPU memory estimate|needs about|out of memory|^exit" "$L/$tag.txt" | tail -n 3 | cut -c1-250
    done <<< "$picks"
  done
}

phase_calibrate() {
  run calibrate 240 "$B" plan calibrate --out "$L/calibrated.json" || return 1
  echo "== braid plan calibrate"
  grep -vE "^(cmd:|exit )" "$L/calibrate.txt" | tail -n 12 | cut -c1-200
  local builtin spec model batch tag hw
  builtin=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['name'].split('-')[0])" "$L/calibrated.json")
  for spec in ${CALIBRATE_RUNS:-124M:16 1558M:8 L32-H32-C2560:8}; do
    model=${spec%%:*} batch=${spec##*:} tag=cal-${spec/:/-b}
    run "$tag" 200 "$B" train --device cuda --model "$model" --seq 1024 --batch "$batch" \
      --steps 25 --data random --eval-every 0 --json "$L/$tag.json" || continue
    if [[ ${CALIBRATE_PROFILE:-0} == 1 ]]; then
      # Where the measured step goes, phase by phase, to set beside the
      # plan's forward, backward and optimizer terms.
      BRAID_PROFILE=1 run "$tag-profile" 120 "$B" train --device cuda --model "$model" \
        --seq 1024 --batch "$batch" --steps 8 --data random --eval-every 0 --log-every 4 &&
        echo "== $tag profiled" &&
        awk '/GPU time per step by phase/ { buf = ""; on = 1 } on { buf = buf $0 "\n" }
          END { printf "%s", buf }' "$L/$tag-profile.txt" | head -n 40
    fi
    for hw in "$L/calibrated.json" "$builtin"; do
      "$B" plan --model "$model" --gpus 1 --global-batch "$batch" --micro-batch "$batch" \
        --hardware "$hw" --json "$L/$tag-plan-$(basename "$hw" .json).json" > /dev/null
    done
  done
  echo "== predicted (plain layout, no checkpointing) against measured median steps"
  python3 - "$L" "$builtin" << 'PY'
import glob, json, os, sys
L, builtin = sys.argv[1], sys.argv[2]
for run in sorted(glob.glob(f"{L}/cal-*-b*.json")):
    if "-plan-" in run:
        continue
    tag = os.path.basename(run)[:-5]
    step = json.load(open(run))["summary"]["median_step_s"]
    cells = []
    for hw in ("calibrated", builtin):
        p = json.load(open(f"{L}/{tag}-plan-{hw}.json"))
        plain = [x for x in p["layouts"] if x["prediction"] and x["layout"]["dp"] == 1
                 and x["layout"]["tp"] == 1 and x["layout"]["pp"] == 1 and x["layout"]["zero"] == 0
                 and not x["layout"]["checkpointing"] and not x["layout"]["offload"]]
        if not plain:
            cells.append(f"{hw}: no such layout")
            continue
        s = plain[0]["prediction"]["step_s"]
        cells.append(f"{hw} {1e3 * s:.1f} ms ({100 * (s / step - 1):+.1f} %)")
    print(f"{tag}: measured {1e3 * step:.1f} ms | " + " | ".join(cells))
PY
}

# FP8 (issue 69): braid-model's fp8 tests on this GPU (the casts bit for
# bit against the host, the scaled products, and the ignored timing of a
# layer's products in bf16 against FP8 with their casts), `braid kernels
# --check` (its FP8 forward model check among the rest), then each model
# of FP8_RUNS (MODEL:BATCH, default 124M:16 1558M:8 L32-H32-C2560:8)
# trained in bf16, with the forward products in FP8 (BRAID_FP8=forward)
# and with every product in FP8 (BRAID_FP8=all), in turns, FP8_ROUNDS
# times (default 1): each run's median step, tokens/s and final loss.
# FP8_MODES picks the modes (default "off forward all"; a mode ending in
# -delayed, e.g. all-delayed, runs under BRAID_FP8_SCALING=delayed).
# FP8_PEER=1 adds torchao's float8 + torch.compile and bf16 +
# torch.compile at FP8_PEER_MODEL (default L32-H32-C2560), B 8.
# FP8_ARGS adds arguments to every braid run (e.g. `--gpu-memory 46` to
# hold braid to torchao float8's 46.17 GiB: issue 69's "at no more
# memory").
phase_fp8() {
  local mt=/tmp/model-tests r spec m bs n
  if [ -f .dev/model-tests.gz ]; then
    gunzip -c .dev/model-tests.gz > "$mt" && chmod +x "$mt"
    timeout 120 "$mt" fp8 --include-ignored --nocapture --test-threads 1 > "$L/fp8-tests.txt" 2>&1
    echo "fp8 tests: exit $?"
    grep -E "^test |fp8 |a layer's products|->" "$L/fp8-tests.txt" | cut -c1-220
  fi
  run fp8-kernels-check 120 "$B" kernels --check &&
    grep -iE "fp8|passed|failed|within" "$L/fp8-kernels-check.txt" | tail -n 5
  if [[ ${FP8_MODES:-} == *delayed* ]]; then
    BRAID_FP8_SCALING=delayed run fp8-kernels-check-delayed 120 "$B" kernels --check &&
      grep -iE "fp8|within" "$L/fp8-kernels-check-delayed.txt" | tail -n 4
  fi
  for r in $(seq "${FP8_ROUNDS:-1}"); do
    for spec in ${FP8_RUNS:-124M:16 1558M:8 L32-H32-C2560:8}; do
      m=${spec%%:*} bs=${spec##*:}
      for mode in ${FP8_MODES:-off forward all}; do
        n="fp8-$m-$mode-$r"
        local sc=dynamic
        [[ $mode == *-delayed ]] && sc=delayed
        # shellcheck disable=SC2086 # FP8_ARGS: extra train arguments, split
        BRAID_FP8=${mode%-delayed} BRAID_FP8_SCALING=$sc run "$n" 150 "$B" train \
          --device cuda --model "$m" --batch "$bs" --seq 1024 --data random --steps 20 \
          --eval-every 0 --log-every 10 ${FP8_ARGS:-} || continue
        echo "$m $mode round $r: $(grep -ho 'median step [0-9.]* ms[^|]*| [0-9]* tokens/s' "$L/$n.txt" | tail -1) | $(grep -ho 'final loss [0-9.]*' "$L/$n.txt" | tail -1)"
      done
    done
  done
  # The peer (FP8_PEER=1): torchao's float8 training with torch.compile,
  # and bf16 with torch.compile, at FP8_PEER_MODEL (2.65B, B 8), in the
  # same call (torchao from the wheels beside the anchors).
  [ -n "${FP8_PEER:-}" ] || return 0
  ds_install
  local pm=${FP8_PEER_MODEL:-L32-H32-C2560} t f
  for f in "--float8" ""; do
    n="fp8-peer-compile${f:+-float8}"
    t=$(budget 200) || { echo "$n: skipped (no time left)"; continue; }
    echo "cmd: (cd \$ANCHORS && torchrun --standalone --nproc_per_node 1 torch_gpt2_bench.py --compile $f --model $pm --B 8 --steps 20 --warmup 5)" > "$L/$n.txt"
    (cd "$ANCHORS" && timeout -k 10 "$t" torchrun --standalone --nproc_per_node 1 torch_gpt2_bench.py \
      --compile $f --model "$pm" --B 8 --steps 20 --warmup 5 >> "$L/$n.txt" 2>&1
     echo "exit $?" >> "$L/$n.txt")
    echo "$n: $(grep -hE 'RESULT|Error|^exit [^0]' "$L/$n.txt" | tail -n 2 | tr '\n' ' ')"
  done
}

phase=${1:-}
shift
case $phase in
tests) phase_tests "$@" ;;
bits) phase_bits ;;
speed) phase_speed ;;
proxy) phase_proxy ;;
fp8) phase_fp8 ;;
flash) phase_flash ;;
hopper) phase_hopper ;;
ncu) phase_ncu ;;
groups) phase_groups ;;
plan) phase_plan ;;
memory) phase_memory ;;
calibrate) phase_calibrate ;;
*)
  echo "usage: one.sh tests [FILTER...] | bits | speed | proxy | flash | hopper | ncu | groups | plan | memory | calibrate" >&2
  exit 2
  ;;
esac
rc=$?
echo "one.sh $phase: ${SECONDS} s"
finish
exit $rc
